//! What `idemgate config check` prints: the effective configuration with its secrets
//! replaced by placeholders that still pass validation.

use super::Config;

/// The configuration as TOML with its secrets replaced by placeholders that still pass
/// validation (so the output is a configuration `idemgate config check` accepts): what
/// `idemgate config check` prints.
pub fn redacted_toml(config: &Config) -> Result<String, String> {
    let mut value = serde_json::to_value(config).map_err(|e| e.to_string())?;
    if let serde_json::Value::Object(map) = &mut value {
        for (key, placeholder) in [
            ("admin_token", REDACTED_TOKEN),
            ("jwt_hs256_secret", REDACTED_JWT),
            ("redis_password", REDACTED),
            ("scope_secret", REDACTED_SCOPE),
        ] {
            if map.get(key).is_some_and(|v| !v.is_null()) {
                map.insert(key.into(), serde_json::Value::String(placeholder.into()));
            }
        }
        if let Some(serde_json::Value::Array(keys)) = map.get_mut("encryption_keys") {
            for k in keys.iter_mut() {
                if let serde_json::Value::String(s) = k {
                    let id = s.split(':').next().unwrap_or("").to_string();
                    *s = format!("{id}:{REDACTED_KEY}");
                }
            }
        }
        for key in ["redis_url", "postgres_url"] {
            if let Some(serde_json::Value::String(s)) = map.get_mut(key) {
                *s = redact_url(s);
            }
        }
    }
    let mut out = String::from(
        "# The effective configuration. Secrets that are set are shown as placeholders\n# (REDACTED..., an all-zero scope secret and all-zero encryption keys).\n",
    );
    out.push_str(&to_toml(value)?);
    Ok(out)
}

const REDACTED: &str = "REDACTED";
const REDACTED_TOKEN: &str = "REDACTED-REDACTED-REDACTED";
const REDACTED_JWT: &str = "REDACTED-REDACTED-REDACTED-REDACTED";
const REDACTED_SCOPE: &str = "0000000000000000000000000000000000000000000000000000000000000000";
const REDACTED_KEY: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// A URL's password (`scheme://user:password@host`, `password=` in its query) or a
/// key=value connection string's (`password=x`, `password = x`, `password='x y'`) replaced
/// by `REDACTED`, in every spelling the parsers accept: a URL's user part runs to its last
/// `@` (PostgreSQL's parser takes a password with `/` or `?` in it), so everything between
/// the first `:` and that `@` goes, and a little too much rather than too little.
fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return redact_keywords(url);
    };
    let mut out = url.to_string();
    let rest = scheme_end + 3;
    if let (Some(at), Some(colon)) = (out[rest..].rfind('@'), out[rest..].find(':')) {
        if colon < at {
            out.replace_range(rest + colon + 1..rest + at, REDACTED);
        }
    }
    // `?password=...` and `&password=...` in the query.
    let mut searched = 0;
    while let Some(i) = out[searched..].find("password=") {
        let at = searched + i;
        let start = at + "password=".len();
        let boundary = at > 0 && matches!(out.as_bytes()[at - 1], b'?' | b'&');
        if boundary {
            let end = out[start..]
                .find(['&', '#'])
                .map_or(out.len(), |j| start + j);
            out.replace_range(start..end, REDACTED);
            searched = start + REDACTED.len();
        } else {
            searched = start;
        }
    }
    out
}

/// A key=value connection string with its `password` value replaced (any case, spaces
/// around `=`, a value in single quotes with backslash escapes).
fn redact_keywords(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < bytes.len() {
        let at_token = i == 0 || bytes[i - 1].is_ascii_whitespace();
        let is_password = at_token
            && s.get(i..i + 8)
                .is_some_and(|w| w.eq_ignore_ascii_case("password"));
        if !is_password {
            let ch = s[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
            continue;
        }
        let mut j = i + 8;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() {
            j += 1;
        }
        if bytes.get(j) != Some(&b'=') {
            out.push_str(&s[i..i + 8]);
            i += 8;
            continue;
        }
        j += 1;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() {
            j += 1;
        }
        out.push_str(&s[i..j]);
        if bytes.get(j) == Some(&b'\'') {
            // Quoted: up to the closing quote that no backslash escapes.
            let mut k = j + 1;
            while k < bytes.len() && bytes[k] != b'\'' {
                k += if bytes[k] == b'\\' { 2 } else { 1 };
            }
            out.push('\'');
            out.push_str(REDACTED);
            out.push('\'');
            i = (k + 1).min(bytes.len());
        } else {
            let mut k = j;
            while k < bytes.len() && !bytes[k].is_ascii_whitespace() {
                k += 1;
            }
            out.push_str(REDACTED);
            i = k;
        }
    }
    out
}

/// Dotted names of the settings that are absent (`null`) in `value`.
pub(super) fn unset_keys(value: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_json::Value::Object(map) = value {
        for (k, v) in map {
            let name = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                serde_json::Value::Null => out.push(name),
                serde_json::Value::Object(_) => unset_keys(v, &name, out),
                _ => {}
            }
        }
    }
}

/// `value` without its nulls, as TOML.
pub(super) fn to_toml(mut value: serde_json::Value) -> Result<String, String> {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.retain(|_, v| !v.is_null());
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut value);
    toml::to_string(&value).map_err(|e| e.to_string())
}

#[cfg(test)]
mod redaction_tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_redacted() {
        assert_eq!(
            redact_url("rediss://idemgate:s3cret@redis:6380/0"),
            "rediss://idemgate:REDACTED@redis:6380/0"
        );
        assert_eq!(redact_url("redis://redis:6379/0"), "redis://redis:6379/0");
        assert_eq!(
            redact_url("postgres://app:p%40ss@db/pay?sslmode=disable"),
            "postgres://app:REDACTED@db/pay?sslmode=disable"
        );
        assert_eq!(
            redact_url("host=db user=app password=hunter2 dbname=pay"),
            "host=db user=app password=REDACTED dbname=pay"
        );
    }

    /// Every spelling PostgreSQL's parser accepts, the secret gone from each.
    #[test]
    fn postgres_passwords_are_redacted_in_every_spelling() {
        for (given, secret) in [
            ("postgres://app:pa/ss@db/pay", "pa/ss"),
            ("postgres://app:pa?ss@db/pay?sslmode=disable", "pa?ss"),
            ("postgresql://app:a#b@db:5432/pay", "a#b"),
            (
                "postgres://app@db/pay?password=hunter2&sslmode=disable",
                "hunter2",
            ),
            ("host=db user=app password = hunter2 dbname=pay", "hunter2"),
            ("host=db user=app password= hunter2", "hunter2"),
            ("host=db password='x y' user=app", "x y"),
            ("host=db PASSWORD='it\\'s secret' user=app", "s secret"),
            ("password=hunter2", "hunter2"),
        ] {
            let shown = redact_url(given);
            assert!(!shown.contains(secret), "{given} -> {shown}");
            assert!(shown.contains(REDACTED), "{given} -> {shown}");
        }
        // What is not a password stays.
        assert_eq!(
            redact_keywords("host=db user=app password='x y' dbname=pay"),
            "host=db user=app password='REDACTED' dbname=pay"
        );
        assert_eq!(
            redact_url("postgres://app:pa/ss@db/pay?sslmode=disable"),
            "postgres://app:REDACTED@db/pay?sslmode=disable"
        );
    }
}
