//! How recorded answers are kept at rest, as plain values: the sealing keys and the
//! compression threshold. The store's envelope (`store::seal`) is built from them where
//! the process is wired.

use std::fmt;

use base64::Engine as _;

use super::{invalid, Config, ConfigError};

/// One configured encryption key: `<id>:<base64 of 32 bytes>`.
#[derive(Clone, PartialEq, Eq)]
pub struct SealingKey {
    /// Named in every envelope it seals, so that a rotated-out key is told apart.
    pub id: String,
    /// The AES-256 key.
    pub key: [u8; 32],
}

impl fmt::Debug for SealingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SealingKey({})", self.id)
    }
}

impl SealingKey {
    /// Parses `<id>:<base64 of 32 bytes>` entries, the first the one that seals. The id is
    /// 1 to 32 characters of letters, digits, `-`, `_` or `.`; ids are unique. Errors name
    /// the entry by position and id, never by its key.
    pub fn parse_all<S: AsRef<str>>(entries: &[S]) -> Result<Vec<SealingKey>, String> {
        let mut keys: Vec<SealingKey> = Vec::new();
        for (i, entry) in entries.iter().enumerate() {
            let entry = entry.as_ref().trim();
            let Some((id, b64)) = entry.split_once(':') else {
                return Err(format!("entry {i} is not `<id>:<base64 key>`"));
            };
            let id_ok = (1..=32).contains(&id.len())
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !id_ok {
                return Err(format!(
                    "entry {i}: the key id must be 1 to 32 letters, digits, '-', '_' or '.'"
                ));
            }
            if keys.iter().any(|k| k.id == id) {
                return Err(format!("entry {i}: key id `{id}` is listed twice"));
            }
            let raw = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|_| format!("key `{id}` is not valid base64"))?;
            let key = <[u8; 32]>::try_from(raw.as_slice()).map_err(|_| {
                format!(
                    "key `{id}` must be 32 bytes (base64 of `openssl rand 32`), not {}",
                    raw.len()
                )
            })?;
            keys.push(SealingKey {
                id: id.to_string(),
                key,
            });
        }
        if keys.is_empty() {
            return Err("no keys".into());
        }
        Ok(keys)
    }
}

/// How recorded answers are kept at rest (sealed, compressed).
#[derive(Debug, Clone, Default)]
pub struct AtRest {
    /// `encryption_keys` then `encryption_keys_file`; `None`: stored in clear.
    pub keys: Option<Vec<SealingKey>>,
    /// `compress_min_bytes`.
    pub compress_min_bytes: Option<usize>,
    /// The largest body a record can hold (the largest `max_response_bytes`, or what an
    /// operator may complete with).
    pub max_body: Option<usize>,
}

/// The keys and the compression threshold of recorded answers.
pub(super) fn at_rest(config: &Config) -> Result<AtRest, ConfigError> {
    let mut entries: Vec<String> = config
        .encryption_keys
        .iter()
        .map(|k| k.expose().to_string())
        .collect();
    if let Some(p) = &config.encryption_keys_file {
        let text = std::fs::read_to_string(p).map_err(|e| {
            invalid(
                "encryption_keys_file",
                format!("cannot read {}: {e}", p.display()),
            )
        })?;
        entries.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
    }
    let keys = if entries.is_empty() {
        None
    } else {
        Some(SealingKey::parse_all(&entries).map_err(|e| invalid("encryption_keys", e))?)
    };
    if config.compress_min_bytes == Some(0) {
        return Err(invalid("compress_min_bytes", "must be at least 1"));
    }
    Ok(AtRest {
        keys,
        compress_min_bytes: config.compress_min_bytes,
        max_body: None,
    })
}
