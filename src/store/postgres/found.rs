//! What a claim's row says: claimed, withdrawn, or the record found there.

use std::time::Duration;

use bytes::Bytes;
use tokio_postgres::Row;

use super::{col, corrupt};
use crate::store::{Claim, ClaimRequest, StoreError, StoredResponse};

fn lease_left(ms: i64) -> Duration {
    Duration::from_millis(ms.max(1) as u64)
}

/// What a claim's row says.
pub(super) enum Found {
    Claim(Claim),
    /// A completed record whose body was longer than the claim's room: not read yet.
    Unread {
        status: u16,
        headers: Vec<(String, Bytes)>,
        len: usize,
    },
}

pub(super) fn found(row: &Row, req: &ClaimRequest) -> Result<Option<Found>, StoreError> {
    if col::<bool>(row, 0)? {
        return Ok(Some(Found::Claim(Claim::Claimed)));
    }
    let Some(state) = col::<Option<i16>>(row, 2)? else {
        // No live row visible: withdrawn, or made by a claim that committed after this
        // statement's snapshot (run it again).
        return Ok(col::<bool>(row, 1)?.then_some(Found::Claim(Claim::Withdrawn)));
    };
    let fp: Vec<u8> = col(row, 3)?;
    let fv: i32 = col(row, 4)?;
    let fv = u16::try_from(fv).map_err(|_| corrupt("fingerprint version out of range"))?;
    Ok(Some(Found::Claim(if fv != req.fingerprint_version {
        Claim::OtherVersion(fv)
    } else if fp.as_slice() != req.fingerprint.0.as_slice() {
        Claim::Mismatch
    } else if state == 1 {
        let status: Option<i32> = col(row, 6)?;
        let status = status
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| corrupt("completed without a status"))?;
        let headers: Option<Vec<u8>> = col(row, 7)?;
        let body: Option<Vec<u8>> = col(row, 8)?;
        let len: Option<i64> = col(row, 9)?;
        let len = usize::try_from(len.unwrap_or(0)).unwrap_or(usize::MAX);
        let Some(headers) = headers else {
            // Completed without headers: the answer was too large to keep.
            return Ok(Some(Found::Claim(Claim::NotKept { status })));
        };
        let headers = StoredResponse::decode_headers(&headers)
            .ok_or_else(|| corrupt("undecodable headers"))?;
        match body {
            None if len > 0 => {
                return Ok(Some(Found::Unread {
                    status,
                    headers,
                    len,
                }))
            }
            body => Claim::Replay(StoredResponse {
                status,
                headers,
                body: Bytes::from(body.unwrap_or_default()),
            }),
        }
    } else {
        let left: i64 = col(row, 5)?;
        if state == 0 && left > 0 {
            Claim::InFlight {
                lease_left: lease_left(left),
            }
        } else {
            Claim::Unknown
        }
    })))
}
