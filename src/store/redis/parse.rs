//! Reading Redis's replies into records, claims and errors.

use super::*;

pub(super) const KEY_PREFIX: &[u8] = b"idemgate:{";
pub(super) const KEY_LEN: usize = KEY_PREFIX.len() + 64 + 1;

/// One `name:value` line of an `INFO` reply.
pub(super) fn info_field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

pub(super) fn backend(e: redis::RedisError) -> StoreError {
    if e.code() == Some("OOM") {
        return StoreError::Full(e.to_string());
    }
    // A certificate refused at run time (a server restarted with an expired one): said
    // as such, in rustls' words, as at start-up.
    if crate::store::redis::link::tls_failure(&e) {
        return StoreError::Backend(format!("Redis TLS failed: {e}"));
    }
    StoreError::Backend(e.to_string())
}

/// Whether Redis refused a call for the type of the key it names (a value record where a
/// hash was read, or the other way round).
pub(super) fn wrong_type(e: &redis::RedisError) -> bool {
    e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE")
}

pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

pub(super) fn bytes_of(v: &Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Int(i) => Some(Bytes::from(i.to_string())),
        _ => None,
    }
}

pub(super) fn text_of(v: &Value) -> Option<String> {
    bytes_of(v).and_then(|b| String::from_utf8(b.to_vec()).ok())
}

/// The status and headers of a completed record, the second and third items of a claim's
/// reply.
fn answer_head(items: &[Value]) -> Result<(u16, Vec<(String, Bytes)>), StoreError> {
    let status: u16 = items
        .get(1)
        .and_then(text_of)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| corrupt("status"))?;
    let headers = items
        .get(2)
        .and_then(bytes_of)
        .and_then(|b| StoredResponse::decode_headers(&b))
        .ok_or_else(|| corrupt("headers"))?;
    Ok((status, headers))
}

/// A claim's reply: what it found, or a completed record whose large body is still to read.
pub(super) enum Parsed {
    Claim(Claim),
    Large {
        status: u16,
        headers: Vec<(String, Bytes)>,
        at: Body,
        len: usize,
    },
}

pub(super) fn parse_claim(v: Value) -> Result<Parsed, StoreError> {
    let items = match v {
        Value::Array(items) => items,
        // A new key's claim, the most frequent reply after a replay, is its tag alone: a
        // bare string costs Redis less than a table of one item (about 5,000 instructions
        // of the claim's 87,000, bench/redis_scripts).
        Value::BulkString(tag) if tag == b"claimed" => return Ok(Parsed::Claim(Claim::Claimed)),
        _ => return Err(corrupt("claim reply is neither an array nor `claimed`")),
    };
    let tag = items.first().and_then(text_of).unwrap_or_default();
    let at = match tag.as_str() {
        "completed_pieces" => Some(Body::Pieces),
        "completed_large" => Some(Body::OldKey),
        "completed_inline" => Some(Body::Inline),
        "completed_value" => Some(Body::Value),
        _ => None,
    };
    if let Some(at) = at {
        let (status, headers) = answer_head(&items)?;
        let len = items
            .get(3)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("body length"))?;
        return Ok(Parsed::Large {
            status,
            headers,
            at,
            len,
        });
    }
    parse_claim_tag(&tag, items).map(Parsed::Claim)
}

pub(super) fn parse_claim_tag(tag: &str, items: Vec<Value>) -> Result<Claim, StoreError> {
    match tag {
        "claimed" => Ok(Claim::Claimed),
        "mismatch" => Ok(Claim::Mismatch),
        "not_kept" => items
            .get(1)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .map(|status| Claim::NotKept { status })
            .ok_or_else(|| corrupt("status")),
        "unknown" => Ok(Claim::Unknown),
        "withdrawn" => Ok(Claim::Withdrawn),
        "version" => items
            .get(1)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .map(Claim::OtherVersion)
            .ok_or_else(|| corrupt("fingerprint version")),
        "in_progress" => {
            let ms: u64 = items
                .get(1)
                .and_then(text_of)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| corrupt("lease left"))?;
            Ok(Claim::InFlight {
                lease_left: Duration::from_millis(ms),
            })
        }
        "completed" => {
            let (status, headers) = answer_head(&items)?;
            // The reply's own buffer becomes the body: an inline body (up to 256 KiB) is
            // not copied again.
            let body = match items.into_iter().nth(3) {
                Some(Value::BulkString(b)) => Bytes::from(b),
                _ => return Err(corrupt("body")),
            };
            Ok(Claim::Replay(StoredResponse {
                status,
                headers,
                body,
            }))
        }
        other => Err(corrupt(&format!("claim reply tag {other:?}"))),
    }
}

#[cfg(test)]
mod replies {
    use super::*;

    /// A new key's claim is the bare tag, and a replay's body is the reply's own buffer.
    #[test]
    fn a_claim_reads_the_bare_tag_and_keeps_the_replayed_body_where_it_came() {
        let claimed = parse_claim(Value::BulkString(b"claimed".to_vec())).unwrap();
        assert!(matches!(claimed, Parsed::Claim(Claim::Claimed)));
        let answer = StoredResponse {
            status: 201,
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::new(),
        };
        let body = b"{\"id\":\"tr_1\"}".to_vec();
        let at = body.as_ptr();
        let reply = Value::Array(vec![
            Value::BulkString(b"completed".to_vec()),
            Value::BulkString(b"201".to_vec()),
            Value::BulkString(answer.encode_headers()),
            Value::BulkString(body),
        ]);
        let Parsed::Claim(Claim::Replay(replayed)) = parse_claim(reply).unwrap() else {
            panic!("not a replay");
        };
        assert_eq!(&replayed.body[..], b"{\"id\":\"tr_1\"}");
        assert_eq!(replayed.body.as_ptr(), at, "the body was copied");
        assert_eq!(replayed.headers, answer.headers);
    }
}
