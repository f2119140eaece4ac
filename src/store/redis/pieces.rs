//! Large bodies, written and read a piece per round trip.

use super::*;

/// Where a large body is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Body {
    /// In the record's hash, as `b0`, `b1`, ...
    Pieces,
    /// In the previous version's string `idemgate:{<id>}:body`.
    OldKey,
    /// Inline (`bd`), longer than the claim's room: read on its own once room is taken.
    Inline,
    /// In a value record (`value.rs`), longer than the claim's room: the value is read
    /// whole once room is taken.
    Value,
}

/// Bodies up to this size are kept inline in the record, and come back with the claim.
pub(super) const INLINE_MAX: usize = 256 * 1024;
/// Larger ones are written and read in pieces of this size, one round trip each.
pub(super) const CHUNK: usize = crate::store::RECORD_PIECE;
pub(super) const OLD_BODY_SUFFIX: &[u8] = b":body";

/// Lowercase hex of 32 bytes (a record id, a fingerprint), without allocating.
pub(super) fn hex64(bytes: &[u8; 32]) -> [u8; 64] {
    let mut out = [0u8; 64];
    // The buffer is exactly twice the input's length, the only way encoding can fail.
    let _ = hex::encode_to_slice(bytes, &mut out);
    out
}

impl RedisStore {
    /// Reads a body of `len` bytes the claim did not bring, a piece per round trip: from
    /// the record's hash (`Body::Pieces`, or `Body::Inline` in one) or from the previous
    /// version's key (`Body::OldKey`). Plain HGET and
    /// GETRANGE, each of one key, so that they follow a slot migration too.
    pub(super) async fn read_large(
        &self,
        id: &RecordId,
        at: Body,
        len: usize,
    ) -> Result<Bytes, StoreError> {
        let mut c = self.conn.clone();
        if at == Body::Value {
            let mut get = redis::cmd("GET");
            get.arg(&Self::key(id)[..]);
            let got: Option<Vec<u8>> = query_keyed(&mut c, &get).await.map_err(backend)?;
            return body_of(got.ok_or_else(|| corrupt("a value record vanished"))?, len);
        }
        if at == Body::Inline {
            // One piece, the record's `bd`.
            let mut hget = redis::cmd("HGET");
            hget.arg(&Self::key(id)[..]).arg("bd");
            let got: Option<Vec<u8>> = query_keyed(&mut c, &hget).await.map_err(backend)?;
            return match got {
                Some(body) if body.len() == len => Ok(Bytes::from(body)),
                _ => Err(corrupt("an inline body is not the length its claim said")),
            };
        }
        let mut body = bytes::BytesMut::with_capacity(len);
        let mut piece = 0usize;
        while body.len() < len {
            let chunk: Vec<u8> = match at {
                Body::Pieces => {
                    let mut hget = redis::cmd("HGET");
                    hget.arg(&Self::key(id)[..]).arg(format!("b{piece}"));
                    let got: Option<Vec<u8>> = query_keyed(&mut c, &hget).await.map_err(backend)?;
                    piece += 1;
                    // An empty piece would never get the body any longer.
                    match got {
                        Some(chunk) if !chunk.is_empty() && chunk.len() <= len - body.len() => {
                            chunk
                        }
                        _ => return Err(corrupt("a large body's pieces do not add up to it")),
                    }
                }
                // (`Body::Inline` and `Body::Value` were read above.)
                Body::OldKey | Body::Inline | Body::Value => {
                    let end = (body.len() + CHUNK).min(len);
                    let mut getrange = redis::cmd("GETRANGE");
                    getrange
                        .arg(&Self::old_body_key(id)[..])
                        .arg(body.len())
                        .arg(end - 1);
                    let chunk: Vec<u8> = query_keyed(&mut c, &getrange).await.map_err(backend)?;
                    if chunk.len() != end - body.len() {
                        return Err(corrupt("a large body is shorter than its record says"));
                    }
                    chunk
                }
            };
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    }

    /// Records a response whose body is larger than [`INLINE_MAX`]: the body a piece per
    /// round trip, then the record.
    pub(super) async fn record_large(
        &self,
        id: &RecordId,
        owner: &OwnerToken,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let mut pieces = 0usize;
        for (i, chunk) in response.body.chunks(CHUNK).enumerate() {
            let piece = i.to_string();
            let args: [&[u8]; 2] = [piece.as_bytes(), chunk];
            if !self
                .owner_checked(&self.scripts.write_chunk, id, owner, &args, None)
                .await?
            {
                return Ok(false);
            }
            pieces = i + 1;
        }
        let status = response.status.to_string();
        let headers = response.encode_headers();
        let len = response.body.len().to_string();
        let pieces = pieces.to_string();
        let script = &self.scripts.record_large;
        let mut cmd = evalsha(script, &Self::key(id));
        cmd.arg(owner.as_str())
            .arg(status)
            .arg(&headers[..])
            .arg(len)
            .arg(pieces);
        // The record counts as written only once the replicas have it, like any record.
        self.answer_written(script, cmd, "record", "a large body was not all written")
            .await
    }
}
