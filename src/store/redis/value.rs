//! A record kept as one string value (`redis_record_format = "value"`), beside the hash
//! form every version reads.
//!
//! A new key's claim is one bare `SET <key> <record> NX GET PX <retention>`: absent, the
//! record is created in progress; present, the same reply brings it back, and a completed
//! record is replayed from it (one bare command, where a hash needs a script). The answer
//! is written by one owner-fenced script (`RECORD_VALUE`: `GET`, compare, `SET ... KEEPTTL`).
//!
//! Layout, columns as the scripts count them (1-based), all ASCII up to the headers:
//!
//! | columns | what |
//! |---|---|
//! | 1 | state: `p` in progress, `c` completed, `n` completed but not kept, `u` unknown |
//! | 2 | the layout's version, `1` |
//! | 3-34 | owner token (32 hex digits) |
//! | 35-98 | fingerprint (64 hex digits) |
//! | 99-103 | fingerprint version, 5 digits |
//! | 104-116 | retention (ms) the record was created with, 13 digits |
//! | 117-129 | lease mark: the lease is live while the key's `PTTL` is above it |
//! | 130-142 | busy mark: the owner may be working while `PTTL` is above it |
//! | 143-145 | status (`000` until an answer is recorded) |
//! | 146-153 | headers' length, 8 digits |
//! | 154- | headers ([`StoredResponse::encode_headers`]), then the body |
//!
//! Times stay on Redis's clock without a `TIME` call: the key expires at claim time +
//! retention on Redis's own clock, so `PTTL` says how long ago the claim was made, and a
//! lease of `L` ms is live while `PTTL > retention - L` (a renewal moves the mark to
//! `PTTL - L`). No client clock decides whether a lease is live.
//!
//! A value holds no withdrawal notes and no large body: a script that writes either (an
//! owner's release, an operator's delete or completion, a superseding answer, a body over
//! [`VALUE_BODY_MAX`]) first turns the value into the hash it stands for (`as_hash`,
//! same fields, same expiry) and goes on as on a hash. An instance of a version that reads
//! hashes only meets a value with `WRONGTYPE`: its call fails (503), it executes nothing.

use super::*;

/// Length of the fixed part before the headers.
pub(super) const HEAD: usize = 153;
/// Bodies up to this size are kept in the value; larger ones turn the record into a hash.
/// The room a claim takes before asking ([`crate::limits::REPLAY_INLINE`]): a value
/// replayed by the bare claim comes back whole, body included.
pub(super) const VALUE_BODY_MAX: usize = crate::limits::REPLAY_INLINE;

/// Whether a Redis of `version` (`INFO`'s `redis_version`) takes `SET` with both `NX` and
/// `GET`, the value form's claim: 7.0 and later.
pub(super) fn claims_with_set_nx_get(version: &str) -> bool {
    version
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok())
        .is_some_and(|major| major >= 7)
}

/// The in-progress record a claim creates.
pub(super) fn claim_value(req: &ClaimRequest) -> Vec<u8> {
    let retention = req.retention.as_millis() as u64;
    let lease_mark = retention.saturating_sub(req.lease.as_millis() as u64);
    let busy_mark = retention.saturating_sub(req.busy_for.as_millis() as u64);
    let mut v = Vec::with_capacity(HEAD);
    v.extend_from_slice(b"p1");
    v.extend_from_slice(req.owner.as_str().as_bytes());
    v.extend_from_slice(&hex64(&req.fingerprint.0));
    v.extend_from_slice(
        format!(
            "{:05}{retention:013}{lease_mark:013}{busy_mark:013}000{:08}",
            req.fingerprint_version, 0
        )
        .as_bytes(),
    );
    v
}

/// Status and headers' length as the value keeps them (columns 143-153).
pub(super) fn answer_head(status: u16, headers_len: usize) -> String {
    format!("{:03}{headers_len:08}", status.min(999))
}

/// A number in columns `from..=to` (1-based) of a value.
fn number(v: &[u8], from: usize, to: usize) -> Option<u64> {
    std::str::from_utf8(v.get(from - 1..to)?).ok()?.parse().ok()
}

/// What a bare claim's reply (an existing value) means for `req`: `None` when only a
/// script can tell (a record in progress: is its lease live?).
pub(super) fn decide(v: Vec<u8>, req: &ClaimRequest) -> Result<Option<Claim>, StoreError> {
    if v.len() < HEAD || v[1] != b'1' {
        return Err(corrupt("a record value of another layout"));
    }
    let version = number(&v, 99, 103).ok_or_else(|| corrupt("fingerprint version"))?;
    if version != u64::from(req.fingerprint_version) {
        let version = u16::try_from(version).map_err(|_| corrupt("fingerprint version"))?;
        return Ok(Some(Claim::OtherVersion(version)));
    }
    if v[34..98] != hex64(&req.fingerprint.0) {
        return Ok(Some(Claim::Mismatch));
    }
    let status = || {
        number(&v, 143, 145)
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| corrupt("status"))
    };
    match v[0] {
        b'c' => {
            let status = status()?;
            let hl = number(&v, 146, 153).ok_or_else(|| corrupt("headers' length"))? as usize;
            let headers = v
                .get(HEAD..HEAD + hl)
                .and_then(StoredResponse::decode_headers)
                .ok_or_else(|| corrupt("headers"))?;
            let len = v.len() - HEAD - hl;
            // The body came with the reply (at most VALUE_BODY_MAX and the head): it is
            // kept only with room for it, as every replay's body.
            let fits = req.room.as_ref().is_none_or(|r| len <= r.held());
            if !fits && !crate::store::room_for(req.room.as_ref(), len) {
                return Ok(Some(Claim::NoRoom { status }));
            }
            // The reply's own buffer becomes the body: no copy.
            let body = Bytes::from(v).slice(HEAD + hl..);
            Ok(Some(Claim::Replay(StoredResponse {
                status,
                headers,
                body,
            })))
        }
        b'n' => Ok(Some(Claim::NotKept { status: status()? })),
        b'u' => Ok(Some(Claim::Unknown)),
        b'p' => Ok(None),
        _ => Err(corrupt("record state")),
    }
}

/// The body of a value record (`Body::Value`), `len` bytes as its claim said.
pub(super) fn body_of(v: Vec<u8>, len: usize) -> Result<Bytes, StoreError> {
    let hl = number(&v, 146, 153).ok_or_else(|| corrupt("headers' length"))? as usize;
    if v.first() != Some(&b'c') || v.len() != HEAD + hl + len {
        return Err(corrupt("a body is not the length its claim said"));
    }
    Ok(Bytes::from(v).slice(HEAD + hl..))
}

impl RedisStore {
    /// A value-form claim as one bare command: `SET <key> <value> NX GET PX <retention>`
    /// (with `WAIT` when replicas must acknowledge). `None`: only a script can tell (a
    /// record in progress, or a hash record).
    pub(super) async fn claim_bare(
        &self,
        req: &ClaimRequest,
        value: &[u8],
    ) -> Result<Option<Claim>, StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(&Self::key(&req.id)[..])
            .arg(value)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(req.retention.as_millis() as u64);
        match self.call(None, cmd, true).await? {
            Ok((Value::Nil, acked)) => self
                .claim_acknowledged(req, Claim::Claimed, acked)
                .await
                .map(Some),
            Ok((Value::BulkString(v), _)) => decide(v, req),
            Err(e) if wrong_type(&e) => Ok(None),
            Err(e) => Err(backend(e)),
            Ok(_) => Err(corrupt("a bare claim's reply")),
        }
    }

    /// `claim`, once its replicas are counted: a claim they do not have is taken back.
    pub(super) async fn claim_acknowledged(
        &self,
        req: &ClaimRequest,
        claim: Claim,
        acked: Option<i64>,
    ) -> Result<Claim, StoreError> {
        if claim == Claim::Claimed {
            if let Err(e) = self.acknowledged("claim", acked) {
                // Not forwarded, so not kept: a retry must be able to execute. Should
                // this release be lost too, the claim reads as unknown once its lease
                // runs out (409, never a second execution).
                let _ = self.release(&req.id, &req.owner, req.lease).await;
                return Err(e);
            }
        }
        Ok(claim)
    }
}

#[cfg(test)]
mod layout {
    use super::*;
    use crate::fingerprint::Fingerprint;

    #[test]
    fn set_nx_get_is_asked_of_redis_7_and_later_only() {
        for refused in ["6.2.14", "5.0.7", "", "unknown"] {
            assert!(!claims_with_set_nx_get(refused), "{refused}");
        }
        for taken in ["7.0.15", "7.2.4", "8.4.0", "10.0.0"] {
            assert!(claims_with_set_nx_get(taken), "{taken}");
        }
    }

    #[test]
    fn a_claimed_value_has_the_layout_the_scripts_read() {
        let mut req = ClaimRequest::for_test(RecordId::from_bytes([7; 32]), Fingerprint([9; 32]));
        req.retention = Duration::from_secs(86_400);
        req.lease = Duration::from_secs(30);
        req.busy_for = Duration::from_secs(45);
        let v = claim_value(&req);
        assert_eq!(v.len(), HEAD);
        assert_eq!(&v[2..34], req.owner.as_str().as_bytes());
        assert_eq!(number(&v, 99, 103), Some(1));
        assert_eq!(number(&v, 104, 116), Some(86_400_000));
        assert_eq!(number(&v, 117, 129), Some(86_400_000 - 30_000));
        assert_eq!(number(&v, 130, 142), Some(86_400_000 - 45_000));
        assert_eq!(number(&v, 143, 145), Some(0));
        assert_eq!(number(&v, 146, 153), Some(0));
        assert!(
            decide(v, &req).unwrap().is_none(),
            "in progress: a script decides"
        );
    }
}
