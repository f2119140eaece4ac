//! The admin listener's people: `[[admin_operators]]` (a name, the SHA-256 of that
//! person's token, a role) and `admin_hosts`, the names under which the listener may be
//! reached besides IP literals and `localhost`.
//!
//! The configuration never holds an operator's token, only its digest: whoever reads the
//! file learns nobody's token.

use serde::{Deserialize, Serialize};

use super::{invalid, Config, ConfigError};

/// What an operator may do on the admin listener, each role including the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// `/metrics`, `/observe`, `/readyz`'s error detail, list, show, lookup.
    Read,
    /// Also `complete` and `release`: what changes what a payment's retry receives.
    Decide,
    /// Also `POST /config/reload` and `GET /scope-secret`.
    Admin,
}

impl Role {
    /// As written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Decide => "decide",
            Role::Admin => "admin",
        }
    }
}

/// One `[[admin_operators]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminOperator {
    /// Who: the actor of every audit line this token writes.
    pub name: String,
    /// The hex SHA-256 of the operator's token (`printf %s "$TOKEN" | sha256sum`).
    pub token_sha256: String,
    /// `read`, `decide` or `admin`.
    pub role: Role,
    /// Whether a `read` operator may see recorded bodies (`GET /records/{id}?body=1`);
    /// `decide` and `admin` always may.
    #[serde(default)]
    pub read_bodies: bool,
}

impl AdminOperator {
    /// The digest, decoded (checked by [`check`]).
    pub fn digest(&self) -> Option<[u8; 32]> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(self.token_sha256.trim(), &mut out).ok()?;
        Some(out)
    }
}

/// The name `admin_token` acts under.
pub const ADMIN_TOKEN_NAME: &str = "admin";

/// What `config check` refuses in `admin_operators` and `admin_hosts`.
pub fn check(config: &Config) -> Result<(), ConfigError> {
    let mut names = std::collections::BTreeSet::new();
    let mut digests = std::collections::BTreeSet::new();
    for (i, op) in config.admin_operators.iter().enumerate() {
        let key = |field: &str| format!("admin_operators[{i}].{field}");
        let name = op.name.trim();
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b))
        {
            return Err(invalid(
                key("name"),
                "must be 1 to 64 letters, digits, `.`, `_`, `@` or `-`",
            ));
        }
        if name == "anonymous" {
            return Err(invalid(
                key("name"),
                "`anonymous` is who an open admin listener's callers are",
            ));
        }
        if name == ADMIN_TOKEN_NAME && config.admin_token.is_some() {
            return Err(invalid(
                key("name"),
                "`admin` is the operator admin_token acts as: rename the entry or remove admin_token",
            ));
        }
        let Some(digest) = op.digest() else {
            return Err(invalid(
                key("token_sha256"),
                "must be the 64 hex characters of the token's SHA-256 (`printf %s \"$TOKEN\" | sha256sum`)",
            ));
        };
        if !names.insert(name.to_string()) {
            return Err(invalid(key("name"), format!("`{name}` is named twice")));
        }
        if !digests.insert(digest) {
            return Err(invalid(
                key("token_sha256"),
                "another operator has the same token: give each person their own",
            ));
        }
    }
    if let Some(token) = &config.admin_token {
        use sha2::Digest;
        let digest: [u8; 32] = sha2::Sha256::digest(token.expose().as_bytes()).into();
        if digests.contains(&digest) {
            return Err(invalid(
                "admin_operators",
                "an operator's token_sha256 is admin_token's: give each person their own",
            ));
        }
    }
    for (i, host) in config.admin_hosts.iter().enumerate() {
        if parse_host_entry(host).is_none() {
            return Err(invalid(
                format!("admin_hosts[{i}]"),
                "must be a host name, optionally with `:port` (`idemgate.internal`, `gate:9901`)",
            ));
        }
    }
    Ok(())
}

/// An `admin_hosts` entry: the name in lower case, and the port it gives (any when none).
pub fn parse_host_entry(entry: &str) -> Option<(String, Option<u16>)> {
    let (name, port) = match entry.rsplit_once(':') {
        Some((n, p)) => (n, Some(p.parse::<u16>().ok()?)),
        None => (entry, None),
    };
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
    ok.then(|| (name.to_ascii_lowercase(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> Config {
        use figment::providers::{Format, Serialized, Toml};
        figment::Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(toml))
            .extract()
            .expect("config")
    }

    const HASH: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn malformed_duplicate_and_clashing_entries_are_refused_by_key() {
        let entry = |name: &str, hash: &str| {
            format!("[[admin_operators]]\nname = \"{name}\"\ntoken_sha256 = \"{hash}\"\nrole = \"read\"\n")
        };
        assert!(check(&config(&entry("alice", HASH))).is_ok());
        let e = check(&config(&entry("alice", "abc"))).unwrap_err();
        assert!(
            e.to_string().contains("admin_operators[0].token_sha256"),
            "{e}"
        );
        let two = format!(
            "{}{}",
            entry("alice", HASH),
            entry("alice", &"0".repeat(64))
        );
        assert!(check(&config(&two))
            .unwrap_err()
            .to_string()
            .contains("named twice"));
        let same = format!("{}{}", entry("alice", HASH), entry("bob", HASH));
        assert!(check(&config(&same))
            .unwrap_err()
            .to_string()
            .contains("same token"));
        let beside = format!(
            "admin_token = \"0123456789abcdef-token\"\n{}",
            entry("admin", HASH)
        );
        assert!(check(&config(&beside))
            .unwrap_err()
            .to_string()
            .contains("admin_token"));
        assert!(check(&config("admin_hosts = [\"gate:x\"]")).is_err());
        assert!(check(&config("admin_hosts = [\"Gate.Internal:9901\"]")).is_ok());
        let role =
            figment::Figment::from(figment::providers::Serialized::defaults(Config::default()))
                .merge(
                    <figment::providers::Toml as figment::providers::Format>::string(
                        &entry("alice", HASH).replace("\"read\"", "\"owner\""),
                    ),
                )
                .extract::<Config>();
        assert!(role.is_err(), "an unknown role");
    }

    #[test]
    fn host_entries_are_lower_case_with_an_optional_port() {
        assert_eq!(
            parse_host_entry("Gate.Internal"),
            Some(("gate.internal".into(), None))
        );
        assert_eq!(
            parse_host_entry("gate:9901"),
            Some(("gate".into(), Some(9901)))
        );
        assert_eq!(parse_host_entry("gate:"), None);
        assert_eq!(parse_host_entry("a b"), None);
    }
}
