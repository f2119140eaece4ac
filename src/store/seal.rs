//! Records at rest: a [`Store`] wrapper that seals each recorded answer (headers and body)
//! with AES-256-GCM before any backend sees it, and compresses large bodies (zstd), so every
//! backend stores only what it is given and none of them needs to know.
//!
//! A sealed answer is stored as a [`StoredResponse`] whose only header is [`MARKER`] (a name
//! no HTTP header can have) and whose body is an envelope:
//!
//! ```text
//! version (1) | flags (1) | [key id length (1) | key id | nonce (12)] | payload
//! payload (after opening) = u32-BE headers length | headers | body (if flagged: u32-BE length, zstd frame)
//! ```
//!
//! The additional data of the AEAD is the record id followed by the envelope's head
//! (version, flags, key id): a sealed answer copied to another record, or with a flag
//! flipped, does not open. The status stays in clear: the admin API shows it, and it says
//! nothing of the payment.
//!
//! Opening needs the key named in the envelope. A record sealed under a key that is no
//! longer configured cannot be replayed, and must not be executed again either: the claim
//! answers [`StoreError::Unreadable`], which the proxy turns into a 500 `record-unreadable`.

use std::fmt;
use std::sync::Arc;

use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use bytes::{BufMut, Bytes, BytesMut};

use super::{
    Claim, ClaimRequest, Completed, OwnerToken, RecordView, Store, StoreError, StoreFuture,
    StoredResponse,
};
use crate::config::{AtRest, SealingKey};
use crate::key::RecordId;

/// The header name that marks a stored answer as an envelope. A colon cannot start an
/// HTTP/1 header name, so no upstream header is ever mistaken for it.
pub const MARKER: &str = ":e";

const VERSION: u8 = 1;
const FLAG_SEALED: u8 = 1;
const FLAG_ZSTD: u8 = 2;
/// zstd's default level: on a 1 KiB JSON answer about half the size, in microseconds.
const ZSTD_LEVEL: i32 = 3;
/// A decompressed body larger than this is refused as corrupt (the prefix is sealed along
/// with it when keys are set, but a record in clear could be altered in the store).
const MAX_BODY: usize = 1 << 30;
const NONCE_LEN: usize = 12;

/// The encryption keys: the first seals, every one opens (so a new first key can be rolled
/// out while records sealed under the old one are still replayed).
#[derive(Clone)]
pub struct Keyring {
    keys: Arc<[(String, Aes256Gcm)]>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|(id, _)| id.as_str()).collect();
        write!(f, "Keyring{ids:?}")
    }
}

impl Keyring {
    /// The keyring of the configured keys, the first the one that seals.
    pub fn new(keys: &[SealingKey]) -> Keyring {
        let keys: Vec<(String, Aes256Gcm)> = keys
            .iter()
            .map(|k| (k.id.clone(), Aes256Gcm::new(&k.key.into())))
            .collect();
        Keyring { keys: keys.into() }
    }

    /// Parses `<id>:<base64 of 32 bytes>` entries (see [`SealingKey::parse_all`]).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Keyring, String> {
        SealingKey::parse_all(entries).map(|keys| Keyring::new(&keys))
    }

    /// The id of the key that seals.
    pub fn sealing_id(&self) -> &str {
        &self.keys[0].0
    }

    fn find(&self, id: &[u8]) -> Option<&Aes256Gcm> {
        self.keys
            .iter()
            .find(|(k, _)| k.as_bytes() == id)
            .map(|(_, c)| c)
    }
}

/// How answers are kept at rest.
#[derive(Clone, Debug, Default)]
pub struct Envelope {
    /// Seal with these keys; `None`: stored in clear.
    pub keys: Option<Keyring>,
    /// Compress bodies of at least this many bytes (when that makes them smaller).
    pub compress_min_bytes: Option<usize>,
    /// The largest body a record can hold (the largest `max_response_bytes`, or what an
    /// operator may complete with); a compressed body that declares more is unreadable,
    /// never inflated. `None`: [`MAX_BODY`].
    pub max_body: Option<usize>,
}

impl Envelope {
    /// The envelope that the settings describe.
    pub fn new(at_rest: &AtRest) -> Envelope {
        Envelope {
            keys: at_rest.keys.as_deref().map(Keyring::new),
            compress_min_bytes: at_rest.compress_min_bytes,
            max_body: at_rest.max_body,
        }
    }

    /// Whether this changes anything (else the store is used as is).
    pub fn is_active(&self) -> bool {
        self.keys.is_some() || self.compress_min_bytes.is_some()
    }

    /// The stored form of `response` for record `id`.
    pub fn close(&self, id: &RecordId, response: &StoredResponse) -> StoredResponse {
        let headers = response.encode_headers();
        let mut flags = 0u8;
        let compressed = match self.compress_min_bytes {
            Some(min) if response.body.len() >= min => {
                let mut c = (response.body.len() as u32).to_be_bytes().to_vec();
                // Compression of a buffer in memory fails only when out of memory.
                let z = zstd::bulk::compress(&response.body, ZSTD_LEVEL).unwrap_or_default();
                c.extend_from_slice(&z);
                (!z.is_empty() && c.len() < response.body.len()).then_some(c)
            }
            _ => None,
        };
        if compressed.is_some() {
            flags |= FLAG_ZSTD;
        }
        let body: &[u8] = compressed.as_deref().unwrap_or(&response.body);
        let mut payload = Vec::with_capacity(4 + headers.len() + body.len());
        payload.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        payload.extend_from_slice(&headers);
        payload.extend_from_slice(body);
        let mut out = BytesMut::with_capacity(payload.len() + 64);
        out.put_u8(VERSION);
        match &self.keys {
            None => {
                out.put_u8(flags);
                out.extend_from_slice(&payload);
            }
            Some(keys) => {
                flags |= FLAG_SEALED;
                let key_id = keys.sealing_id().as_bytes();
                out.put_u8(flags);
                out.put_u8(key_id.len() as u8);
                out.extend_from_slice(key_id);
                let head_len = out.len();
                let nonce: [u8; NONCE_LEN] = rand::random();
                let aad = aad(id, &out[..head_len]);
                let sealed = keys.keys[0].1.encrypt(
                    Nonce::from_slice(&nonce),
                    Payload {
                        msg: &payload,
                        aad: &aad,
                    },
                );
                out.extend_from_slice(&nonce);
                // Encryption fails only for messages beyond 64 GiB, far above any body
                // idemgate buffers.
                out.extend_from_slice(&sealed.unwrap_or_default());
            }
        }
        StoredResponse {
            status: response.status,
            headers: vec![(MARKER.to_string(), Bytes::from_static(b"1"))],
            body: out.freeze(),
        }
    }

    /// The answer as recorded, from its stored form. An answer stored in clear before any
    /// of this was configured comes back as it is.
    pub fn open(
        &self,
        id: &RecordId,
        stored: StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        let is_envelope = stored.headers.len() == 1 && stored.headers[0].0 == MARKER;
        if !is_envelope {
            return Ok(stored);
        }
        let unreadable = |why: &str| StoreError::Unreadable(format!("record {id}: {why}"));
        let b = &stored.body;
        let (&version, rest) = b
            .split_first()
            .ok_or_else(|| unreadable("empty envelope"))?;
        if version != VERSION {
            return Err(unreadable("unknown envelope version"));
        }
        let (&flags, rest) = rest.split_first().ok_or_else(|| unreadable("truncated"))?;
        // The payload as one buffer the body is a slice of: opening a sealed answer makes
        // the only copy of it, and an answer in clear is not copied at all (a copy doubled
        // what each large replay held while it was opened).
        let payload: Bytes = if flags & FLAG_SEALED != 0 {
            let (&id_len, rest) = rest.split_first().ok_or_else(|| unreadable("truncated"))?;
            let id_len = usize::from(id_len);
            let key_id = rest.get(..id_len).ok_or_else(|| unreadable("truncated"))?;
            let nonce = rest
                .get(id_len..id_len + NONCE_LEN)
                .ok_or_else(|| unreadable("truncated"))?;
            let sealed = &rest[id_len + NONCE_LEN..];
            let head_len = 3 + id_len;
            let Some(keys) = &self.keys else {
                return Err(unreadable("sealed, and no encryption_keys are configured"));
            };
            let Some(cipher) = keys.find(key_id) else {
                return Err(unreadable(&format!(
                    "sealed under key `{}`, which is not in encryption_keys",
                    String::from_utf8_lossy(key_id)
                )));
            };
            let aad = aad(id, &b[..head_len]);
            let opened = cipher
                .decrypt(
                    Nonce::from_slice(nonce),
                    Payload {
                        msg: sealed,
                        aad: &aad,
                    },
                )
                .map_err(|_| unreadable("does not open (altered, or sealed for another record)"))?;
            Bytes::from(opened)
        } else {
            b.slice(2..)
        };
        let hlen = payload
            .get(..4)
            .and_then(|l| l.try_into().ok())
            .map(u32::from_be_bytes)
            .ok_or_else(|| unreadable("truncated payload"))? as usize;
        let headers = payload
            .get(4..4 + hlen)
            .and_then(StoredResponse::decode_headers)
            .ok_or_else(|| unreadable("corrupt headers"))?;
        let body = payload.slice(4 + hlen..);
        let body = if flags & FLAG_ZSTD != 0 {
            let corrupt = || unreadable("corrupt compressed body");
            let (len, z) = body.split_first_chunk::<4>().ok_or_else(corrupt)?;
            let len = u32::from_be_bytes(*len) as usize;
            // A record in clear can be altered in the store: a body declaring more than any
            // record could hold is not inflated (a 33 KB record declaring 1 GiB took 3 GiB
            // for three replays).
            if len > self.max_body.unwrap_or(MAX_BODY).min(MAX_BODY) {
                return Err(unreadable(
                    "its compressed body declares more than any recorded answer can hold",
                ));
            }
            let out = zstd::bulk::decompress(z, len).map_err(|_| corrupt())?;
            if out.len() != len {
                return Err(corrupt());
            }
            Bytes::from(out)
        } else {
            body
        };
        Ok(StoredResponse {
            status: stored.status,
            headers,
            body,
        })
    }
}

fn aad(id: &RecordId, head: &[u8]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(32 + head.len());
    aad.extend_from_slice(id.as_bytes());
    aad.extend_from_slice(head);
    aad
}

/// Bodies larger than this are opened on the blocking pool.
const OFF_THREAD: usize = 1024 * 1024;

/// Whether opening `stored` may take long: a body over [`OFF_THREAD`], or a compressed one
/// that declares it inflates beyond that (its stored size says nothing about it). A sealed
/// compressed body's declared length is sealed too: it counts as heavy.
fn heavy_to_open(stored: &StoredResponse) -> bool {
    let b = &stored.body;
    if b.len() > OFF_THREAD {
        return true;
    }
    let is_envelope = stored.headers.len() == 1 && stored.headers[0].0 == MARKER;
    let Some(&flags) = b.get(1).filter(|_| is_envelope) else {
        return false;
    };
    if flags & FLAG_ZSTD == 0 {
        return false;
    }
    if flags & FLAG_SEALED != 0 {
        return true;
    }
    // In clear: version, flags, the headers' length and the headers, then the body's
    // declared length. Anything that does not parse is refused by `open` at once.
    let read_u32 = |at: usize| {
        b.get(at..at + 4)
            .and_then(|l| l.try_into().ok())
            .map(|l| u32::from_be_bytes(l) as usize)
    };
    read_u32(2)
        .and_then(|hlen| read_u32(6 + hlen))
        .is_some_and(|len| len > OFF_THREAD)
}

/// A store whose recorded answers go through an [`Envelope`].
pub struct Enveloped {
    inner: Arc<dyn Store>,
    envelope: Envelope,
}

impl Enveloped {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>, envelope: Envelope) -> Enveloped {
        Enveloped { inner, envelope }
    }
}

impl super::Layer for Enveloped {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            match self.inner.claim(req).await? {
                // Opening allocates the body anew: room for it (as sealed) first.
                Claim::Replay(stored)
                    if !crate::store::room_for(req.room.as_ref(), stored.body.len()) =>
                {
                    Ok(Claim::NoRoom {
                        status: stored.status,
                    })
                }
                // A large body, or one that inflates large, is opened off the serving thread:
                // inflating or decrypting megabytes would hold up every other request on it.
                // The room it took stays taken until the opening ends, even if the claim's
                // caller gives up on it first.
                Claim::Replay(stored) if heavy_to_open(&stored) => {
                    let (envelope, id, room) = (self.envelope.clone(), req.id, req.room.clone());
                    tokio::task::spawn_blocking(move || {
                        let opened = envelope.open(&id, stored);
                        drop(room);
                        opened
                    })
                    .await
                    .map_err(|e| StoreError::Backend(format!("opening a record: {e}")))?
                    .map(Claim::Replay)
                }
                Claim::Replay(stored) => Ok(Claim::Replay(self.envelope.open(&req.id, stored)?)),
                other => Ok(other),
            }
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        if !self.envelope.is_active() {
            return self.inner.record(id, owner, response);
        }
        Box::pin(async move {
            let closed = self.envelope.close(id, response);
            self.inner.record(id, owner, &closed).await
        })
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> StoreFuture<'a, Option<RecordView>> {
        Box::pin(async move {
            let mut view = self.inner.inspect(id, with_body).await?;
            // The admin view's body is text made from the stored bytes: an envelope's
            // would be noise (and a sealed one is meant to stay sealed in the store's view).
            if let Some(v) = view.as_mut() {
                if v.body.is_some() && self.envelope.is_active() {
                    v.body = Some("(kept in an envelope: sealed or compressed at rest)".into());
                }
            }
            Ok(view)
        })
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
        any_namespace: bool,
    ) -> StoreFuture<'a, Completed> {
        if !self.envelope.is_active() {
            return self.inner.complete(id, response, force, any_namespace);
        }
        Box::pin(async move {
            let closed = self.envelope.close(id, response);
            self.inner.complete(id, &closed, force, any_namespace).await
        })
    }

    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a crate::fingerprint::Fingerprint,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        if !self.envelope.is_active() {
            return self.inner.supersede(id, fingerprint, response);
        }
        Box::pin(async move {
            let closed = self.envelope.close(id, response);
            self.inner.supersede(id, fingerprint, &closed).await
        })
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::*;

    fn key(id: &str, byte: u8) -> String {
        format!(
            "{id}:{}",
            base64::engine::general_purpose::STANDARD.encode([byte; 32])
        )
    }

    fn answer(body: &[u8]) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                (
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                ),
                ("x-card".into(), Bytes::from_static(b"4242")),
            ],
            body: Bytes::copy_from_slice(body),
        }
    }

    fn sealing(keys: &[String], compress: Option<usize>) -> Envelope {
        Envelope {
            keys: Some(Keyring::parse(keys).unwrap()),
            compress_min_bytes: compress,
            max_body: None,
        }
    }

    /// An answer kept in clear (compression on, the body too small for it) opens to a
    /// slice of what the store gave back, not a copy: a copy doubled what each large replay
    /// held while it was served.
    #[test]
    fn an_answer_in_clear_opens_without_a_copy() {
        let id = RecordId::from_bytes([9; 32]);
        let env = Envelope {
            keys: None,
            compress_min_bytes: Some(1024 * 1024),
            max_body: None,
        };
        let closed = env.close(&id, &answer(b"{\"id\":\"tr_1\"}"));
        let stored = closed.body.as_ptr_range();
        let opened = env.open(&id, closed.clone()).unwrap();
        assert_eq!(&opened.body[..], b"{\"id\":\"tr_1\"}");
        assert!(
            stored.contains(&opened.body.as_ptr()),
            "the body was copied"
        );
    }

    #[test]
    fn sealed_answers_open_to_what_was_recorded_and_show_nothing() {
        let id = RecordId::from_bytes([7; 32]);
        let body = b"{\"pan\":\"4242424242424242\"}".repeat(100);
        for compress in [None, Some(16)] {
            let env = sealing(&[key("k1", 1)], compress);
            let closed = env.close(&id, &answer(&body));
            let raw = [closed.body.as_ref(), closed.encode_headers().as_slice()].concat();
            assert!(
                !raw.windows(4).any(|w| w == b"4242"),
                "clear text in {compress:?}"
            );
            assert!(!raw.windows(12).any(|w| w == b"content-type"));
            assert_eq!(env.open(&id, closed).unwrap(), answer(&body));
        }
    }

    #[test]
    fn a_sealed_answer_does_not_open_under_another_record_or_altered() {
        let env = sealing(&[key("k1", 1)], None);
        let closed = env.close(&RecordId::from_bytes([7; 32]), &answer(b"x"));
        let other = RecordId::from_bytes([8; 32]);
        assert!(matches!(
            env.open(&other, closed.clone()),
            Err(StoreError::Unreadable(_))
        ));
        let mut body = closed.body.to_vec();
        // Flip the compression flag: it is in the additional data.
        body[1] ^= FLAG_ZSTD;
        let altered = StoredResponse {
            body: body.into(),
            ..closed
        };
        let id = RecordId::from_bytes([7; 32]);
        assert!(matches!(
            env.open(&id, altered),
            Err(StoreError::Unreadable(_))
        ));
    }

    #[test]
    fn rotation_opens_under_any_listed_key_and_refuses_a_removed_one() {
        let id = RecordId::from_bytes([1; 32]);
        let old = sealing(&[key("old", 1)], None).close(&id, &answer(b"a"));
        let rotated = sealing(&[key("new", 2), key("old", 1)], None);
        assert_eq!(rotated.open(&id, old.clone()).unwrap(), answer(b"a"));
        let new = rotated.close(&id, &answer(b"b"));
        let err = sealing(&[key("new", 2)], None).open(&id, old).unwrap_err();
        assert!(err.to_string().contains("`old`"), "{err}");
        assert_eq!(
            sealing(&[key("new", 2)], None).open(&id, new).unwrap(),
            answer(b"b")
        );
    }

    #[test]
    fn only_large_or_sealed_compressed_bodies_are_opened_off_the_serving_thread() {
        let id = RecordId::from_bytes([5; 32]);
        let zipping = Envelope {
            keys: None,
            compress_min_bytes: Some(64),
            max_body: None,
        };
        let small = b"{\"amount\":100}".repeat(80);
        let large = b"{\"amount\":100}".repeat(80_000);
        assert!(!heavy_to_open(&zipping.close(&id, &answer(&small))));
        assert!(heavy_to_open(&zipping.close(&id, &answer(&large))));
        assert!(
            !heavy_to_open(&answer(&small)),
            "a body stored in clear, small"
        );
        let sealed = sealing(&[key("k", 1)], Some(64));
        assert!(heavy_to_open(&sealed.close(&id, &answer(&small))));
        assert!(!heavy_to_open(
            &sealing(&[key("k", 1)], None).close(&id, &answer(&small))
        ));
    }

    // A record in clear altered in the store to declare 1 GiB: unreadable, not inflated.
    #[test]
    fn a_compressed_body_declaring_more_than_any_record_holds_is_unreadable() {
        let env = Envelope {
            keys: None,
            compress_min_bytes: Some(64),
            max_body: Some(1024 * 1024),
        };
        let id = RecordId::from_bytes([4; 32]);
        let closed = env.close(&id, &answer(&b"{\"amount\":100}".repeat(800)));
        assert_eq!(
            env.open(&id, closed.clone()).unwrap(),
            answer(&b"{\"amount\":100}".repeat(800))
        );
        // The declared length sits just before the zstd frame, after the headers.
        let b = closed.body.to_vec();
        let hlen = u32::from_be_bytes(b[2..6].try_into().unwrap()) as usize;
        let at = 2 + 4 + hlen;
        let mut tampered = b.clone();
        tampered[at..at + 4].copy_from_slice(&(1u32 << 30).to_be_bytes());
        let altered = StoredResponse {
            body: Bytes::from(tampered),
            ..closed.clone()
        };
        assert!(matches!(
            env.open(&id, altered),
            Err(StoreError::Unreadable(_))
        ));
        // Declaring less than it inflates to is as unreadable.
        let mut short = b;
        short[at..at + 4].copy_from_slice(&100u32.to_be_bytes());
        let altered = StoredResponse {
            body: Bytes::from(short),
            ..closed
        };
        assert!(matches!(
            env.open(&id, altered),
            Err(StoreError::Unreadable(_))
        ));
    }

    #[test]
    fn compression_alone_round_trips_and_keeps_small_or_incompressible_bodies_as_they_are() {
        let env = Envelope {
            keys: None,
            compress_min_bytes: Some(64),
            max_body: None,
        };
        let id = RecordId::from_bytes([3; 32]);
        let big = b"{\"amount\":100}".repeat(80);
        let closed = env.close(&id, &answer(&big));
        assert!(closed.body.len() < big.len() / 4, "{}", closed.body.len());
        assert_eq!(closed.body[1], FLAG_ZSTD);
        assert_eq!(env.open(&id, closed).unwrap(), answer(&big));
        let small = env.close(&id, &answer(b"tiny"));
        assert_eq!(small.body[1], 0);
        assert_eq!(env.open(&id, small).unwrap(), answer(b"tiny"));
        // An answer stored in clear (before an envelope was configured) is read as it is.
        assert_eq!(env.open(&id, answer(b"old")).unwrap(), answer(b"old"));
    }

    #[test]
    fn bad_keys_are_refused_without_printing_them() {
        for (entries, needle) in [
            (vec!["nocolon".to_string()], "entry 0"),
            (vec!["k1:!!!".to_string()], "base64"),
            (vec!["k1:AAAA".to_string()], "32 bytes"),
            (vec![key("k1", 1), key("k1", 2)], "twice"),
            (vec![key("bad id", 1)], "key id"),
        ] {
            let err = Keyring::parse(&entries).unwrap_err();
            assert!(err.contains(needle), "{err}");
            assert!(!err.contains("AQEB"), "{err}");
        }
    }
}
