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

/// A URL's password (`scheme://user:password@host`, `password=` in a query or in a
/// key=value connection string) replaced by `REDACTED`.
fn redact_url(url: &str) -> String {
    let mut out = url.to_string();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        let authority_end = out[rest..]
            .find(['/', '?', '#'])
            .map_or(out.len(), |i| rest + i);
        if let Some(at) = out[rest..authority_end].rfind('@') {
            let userinfo = &out[rest..rest + at];
            if let Some(colon) = userinfo.find(':') {
                let (start, end) = (rest + colon + 1, rest + at);
                out.replace_range(start..end, REDACTED);
            }
        }
    }
    let mut searched = 0;
    while let Some(i) = out[searched..].find("password=") {
        let start = searched + i + "password=".len();
        let end = out[start..]
            .find(['&', ' ', '#'])
            .map_or(out.len(), |j| start + j);
        out.replace_range(start..end, REDACTED);
        searched = start + REDACTED.len();
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
}
