//! How idemgate reaches Redis, validated from the configuration: one server by URL, a
//! primary found through Sentinel, or a Cluster; the TLS files and credentials that apply
//! to every node of each; and the replica acknowledgement asked of claims and records.
//!
//! Everything that can be checked without the network is checked here, at start, with the
//! key at fault named (exit 64). Files are read here too, so a missing or unreadable
//! certificate is a configuration error rather than a connection failure.

use std::time::Duration;

use crate::config::{Config, ConfigError, Secret};

/// Where the Redis nodes are.
#[derive(Debug, Clone)]
pub enum Topology {
    /// One server (`redis_url`), `redis://` or `rediss://`.
    Single(String),
    /// Sentinels that name the current primary of `master`.
    Sentinel {
        /// `host:port` of each sentinel.
        sentinels: Vec<(String, u16)>,
        /// The monitored master's name.
        master: String,
    },
    /// Any reachable subset of a cluster's nodes; the rest is discovered.
    Cluster {
        /// `host:port` of each seed node.
        nodes: Vec<(String, u16)>,
    },
}

/// PEM bytes, never printed.
#[derive(Clone)]
pub struct Pem(pub Vec<u8>);

impl std::fmt::Debug for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pem({} bytes)", self.0.len())
    }
}

/// TLS to every node (data nodes and sentinels alike).
#[derive(Debug, Clone)]
pub struct Tls {
    /// Trusted roots (`redis_tls_ca_file`); `None`: the system's.
    pub ca: Option<Pem>,
    /// Client certificate chain and key, for servers with `tls-auth-clients yes`.
    pub client: Option<(Pem, Pem)>,
    /// No verification of the server's certificate at all (`redis_tls_insecure`).
    pub insecure: bool,
}

/// `WAIT` after every claim and record.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaAck {
    /// How many replicas must have the write.
    pub replicas: u32,
    /// How long `WAIT` may wait for them.
    pub timeout: Duration,
    /// How many writes with their `WAIT` may be on their way at once, each on a connection
    /// of its own (Redis holds a connection's later calls while its `WAIT` waits).
    pub connections: usize,
}

/// The validated Redis part of the configuration.
#[derive(Debug, Clone)]
pub struct RedisSetup {
    /// Where the nodes are.
    pub topology: Topology,
    /// TLS, when on (a `rediss://` URL or `redis_tls = true`).
    pub tls: Option<Tls>,
    /// ACL user (`redis_username`); `None`: `default`, or the URL's.
    pub username: Option<String>,
    /// Its password (`redis_password`, `IDEMGATE_REDIS_PASSWORD`).
    pub password: Option<Secret>,
    /// Replica acknowledgement (`min_replicas_ack` > 0).
    pub replica_ack: Option<ReplicaAck>,
    /// New records as one string value each (`redis_record_format = "value"`); hashes
    /// otherwise. Both are read either way.
    pub value_records: bool,
    /// Whether the scripts that settle a record publish its key for the duplicates that
    /// wait on other instances: with one server, when `[defaults]` or a route has
    /// `in_progress_wait` above zero at start-up (see `settled.rs`).
    pub publish_settled: bool,
}

impl RedisSetup {
    /// Validates the Redis keys of `c`; `Ok(None)` when no Redis is configured.
    pub fn from_config(c: &Config) -> Result<Option<RedisSetup>, ConfigError> {
        let chosen = [
            ("redis_url", c.redis_url.is_some()),
            ("redis_sentinels", !c.redis_sentinels.is_empty()),
            ("redis_cluster_nodes", !c.redis_cluster_nodes.is_empty()),
        ];
        let set: Vec<&str> = chosen
            .iter()
            .filter(|(_, on)| *on)
            .map(|(k, _)| *k)
            .collect();
        if set.len() > 1 {
            return Err(invalid(
                set[1],
                format!("set only one of redis_url, redis_sentinels and redis_cluster_nodes (also set: {})", set[0]),
            ));
        }
        let Some(which) = set.first() else {
            return no_redis(c).map(|()| None);
        };
        let (topology, url_tls) = match *which {
            "redis_url" => {
                let url = c.redis_url.clone().unwrap_or_default();
                redis::Client::open(url.as_str())
                    .map_err(|e| invalid("redis_url", url_error(&url, &e)))?;
                let tls = url.starts_with("rediss://");
                if c.redis_tls && !tls {
                    return Err(invalid(
                        "redis_tls",
                        "redis_url says redis:// (plain TCP): write rediss:// for TLS",
                    ));
                }
                (Topology::Single(url), tls)
            }
            "redis_sentinels" => {
                let master = c.redis_sentinel_master.clone().unwrap_or_default();
                if master.is_empty() {
                    return Err(invalid(
                        "redis_sentinel_master",
                        "required with redis_sentinels: the name the sentinels monitor",
                    ));
                }
                let (sentinels, tls) = host_ports("redis_sentinels", &c.redis_sentinels, c)?;
                (Topology::Sentinel { sentinels, master }, tls)
            }
            _ => {
                let (nodes, tls) = host_ports("redis_cluster_nodes", &c.redis_cluster_nodes, c)?;
                (Topology::Cluster { nodes }, tls)
            }
        };
        if c.redis_sentinel_master.is_some() && !matches!(topology, Topology::Sentinel { .. }) {
            return Err(invalid(
                "redis_sentinel_master",
                "only used with redis_sentinels",
            ));
        }
        let tls = if url_tls {
            Some(tls_files(c)?)
        } else {
            for (key, set) in tls_keys(c) {
                if set {
                    return Err(invalid(
                        key,
                        "TLS is off: use a rediss:// URL, or redis_tls = true with redis_sentinels or redis_cluster_nodes",
                    ));
                }
            }
            None
        };
        if c.redis_username.as_deref() == Some("") {
            return Err(invalid("redis_username", "must not be empty"));
        }
        if c.redis_username.is_some() && c.redis_password.is_none() {
            return Err(invalid(
                "redis_password",
                "required with redis_username (or IDEMGATE_REDIS_PASSWORD)",
            ));
        }
        let replica_ack = replica_ack(c)?;
        Ok(Some(RedisSetup {
            topology,
            tls,
            username: c.redis_username.clone(),
            password: c.redis_password.clone(),
            replica_ack,
            value_records: c.redis_record_format == crate::config::RedisRecordFormat::Value,
            publish_settled: c.waits_anywhere(),
        }))
    }

    /// The `redis-cli` connection flags that reach the server holding idemgate's keys, for
    /// the commands that messages tell an operator to run: host and port, `-n` database,
    /// `--tls` (with `--cacert` when `redis_tls_ca_file` is set), `--user` and `-a` taken
    /// from `IDEMGATE_REDIS_PASSWORD` (never the password itself), `-c` on a Cluster. Through
    /// Sentinel, the primary's address is asked of the first sentinel.
    pub fn cli(&self) -> String {
        let mut flags: Vec<String> = Vec::new();
        let mut username = self.username.clone();
        let mut url_password = false;
        match &self.topology {
            Topology::Single(url) => {
                if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) {
                    match info.addr() {
                        redis::ConnectionAddr::Tcp(h, p)
                        | redis::ConnectionAddr::TcpTls {
                            host: h, port: p, ..
                        } => {
                            flags.push(format!("-h {h} -p {p}"));
                        }
                        redis::ConnectionAddr::Unix(path) => {
                            flags.push(format!("-s {}", path.display()));
                        }
                        other => flags.push(format!("-u <{other}>")),
                    }
                    let settings = info.redis_settings();
                    if settings.db() != 0 {
                        flags.push(format!("-n {}", settings.db()));
                    }
                    if username.is_none() {
                        username = settings.username().map(str::to_string);
                    }
                    url_password = url
                        .split_once("://")
                        .and_then(|(_, rest)| rest.split_once('@'))
                        .is_some_and(|(user, _)| user.contains(':'));
                }
            }
            Topology::Sentinel { sentinels, master } => {
                let (h, p) = sentinels.first().cloned().unwrap_or_default();
                flags.push(format!(
                    "-h <primary> -p <port> (of `redis-cli -h {h} -p {p} SENTINEL get-master-addr-by-name {master}`)"
                ));
            }
            Topology::Cluster { nodes } => {
                let (h, p) = nodes.first().cloned().unwrap_or_default();
                flags.push(format!("-c -h {h} -p {p}"));
            }
        }
        if let Some(tls) = &self.tls {
            flags.push("--tls".into());
            if tls.ca.is_some() {
                flags.push("--cacert <redis_tls_ca_file>".into());
            }
            if tls.client.is_some() {
                flags.push("--cert <redis_tls_cert_file> --key <redis_tls_key_file>".into());
            }
            if tls.insecure {
                flags.push("--insecure".into());
            }
        }
        if let Some(u) = username {
            flags.push(format!("--user {u}"));
        }
        if self.password.is_some() || url_password {
            flags.push("--askpass".into());
        }
        format!("redis-cli {}", flags.join(" "))
    }

    /// The addresses that error messages name.
    pub fn addresses(&self) -> String {
        match &self.topology {
            Topology::Single(url) => redis::IntoConnectionInfo::into_connection_info(url.as_str())
                .map(|i| i.addr().to_string())
                .unwrap_or_else(|_| "redis_url".into()),
            Topology::Sentinel { sentinels, master } => {
                format!("sentinels {} (master {master})", join(sentinels))
            }
            Topology::Cluster { nodes } => format!("cluster nodes {}", join(nodes)),
        }
    }
}

/// Why `url` does not parse, without any of it (it may hold a password). A URL with a
/// user part gets the likely cause: a password with a character that URLs reserve.
fn url_error(url: &str, e: &redis::RedisError) -> String {
    let has_user = url
        .split_once("://")
        .is_some_and(|(_, rest)| rest.contains('@'));
    if has_user {
        format!(
            "{e}: if the password holds any of @ : / ? # % (or other characters URLs reserve), \
             percent-encode it in the URL (`/` as %2F, `#` as %23, `%` as %25), or leave it out \
             of redis_url and set IDEMGATE_REDIS_PASSWORD (or redis_password) instead, which \
             is taken verbatim"
        )
    } else {
        e.to_string()
    }
}

fn join(addrs: &[(String, u16)]) -> String {
    addrs
        .iter()
        .map(|(h, p)| format!("{h}:{p}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

fn tls_keys(c: &Config) -> [(&'static str, bool); 4] {
    [
        ("redis_tls_ca_file", c.redis_tls_ca_file.is_some()),
        ("redis_tls_cert_file", c.redis_tls_cert_file.is_some()),
        ("redis_tls_key_file", c.redis_tls_key_file.is_some()),
        ("redis_tls_insecure", c.redis_tls_insecure),
    ]
}

/// Without any Redis, a Redis-only key is a mistake worth stopping for: the operator
/// believes records are replicated or encrypted when they are in memory.
fn no_redis(c: &Config) -> Result<(), ConfigError> {
    let mut keys = tls_keys(c).to_vec();
    keys.extend([
        ("redis_tls", c.redis_tls),
        ("redis_username", c.redis_username.is_some()),
        ("redis_password", c.redis_password.is_some()),
        ("redis_sentinel_master", c.redis_sentinel_master.is_some()),
        ("min_replicas_ack", c.min_replicas_ack > 0),
    ]);
    match keys.into_iter().find(|(_, set)| *set) {
        Some((key, _)) => Err(invalid(
            key,
            "no Redis is configured (redis_url, redis_sentinels or redis_cluster_nodes)",
        )),
        None => Ok(()),
    }
}

/// `host:port`, `redis://host:port` or `rediss://host:port` for each entry of `list`;
/// with it, whether TLS is on: `rediss://` on every entry, or `redis_tls = true` (with bare
/// `host:port` entries). A mix of schemes, or `redis://` with `redis_tls = true`, is refused.
fn host_ports(
    key: &str,
    list: &[String],
    c: &Config,
) -> Result<(Vec<(String, u16)>, bool), ConfigError> {
    let mut schemes: Vec<(usize, &str)> = Vec::new();
    let nodes = list
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let bad = || {
                invalid(
                    format!("{key}[{i}]"),
                    format!("`{s}` is not host:port (or rediss://host:port)"),
                )
            };
            let (scheme, rest) = match s.split_once("://") {
                Some((scheme @ ("redis" | "rediss"), rest)) => (Some(scheme), rest),
                Some(_) => return Err(bad()),
                None => (None, s.as_str()),
            };
            if let Some(scheme) = scheme {
                schemes.push((i, scheme));
            }
            let rest = rest.strip_suffix('/').unwrap_or(rest);
            if rest.contains(['@', '/', '?', '#']) {
                return Err(invalid(
                    format!("{key}[{i}]"),
                    "give only the scheme, host and port: the user and password are redis_username and redis_password (or IDEMGATE_REDIS_PASSWORD), TLS files the redis_tls_* keys",
                ));
            }
            let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port: u16 = port.parse().map_err(|_| bad())?;
            if host.is_empty() || port == 0 {
                return Err(bad());
            }
            Ok((host.to_string(), port))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tls = match schemes.first() {
        None => c.redis_tls,
        Some((_, first)) => {
            if schemes.len() < list.len() || schemes.iter().any(|(_, s)| s != first) {
                return Err(invalid(
                    key,
                    "give every entry the same scheme (rediss:// for TLS), or none and redis_tls",
                ));
            }
            let on = *first == "rediss";
            if c.redis_tls && !on {
                return Err(invalid(
                    "redis_tls",
                    format!("{key} say redis:// (plain TCP): write rediss:// for TLS"),
                ));
            }
            on
        }
    };
    Ok((nodes, tls))
}

fn read(key: &str, path: &std::path::Path) -> Result<Pem, ConfigError> {
    let bytes = std::fs::read(path)
        .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(invalid(
            key,
            format!("{} holds no PEM block", path.display()),
        ));
    }
    Ok(Pem(bytes))
}

fn tls_files(c: &Config) -> Result<Tls, ConfigError> {
    let ca = match &c.redis_tls_ca_file {
        Some(p) => Some(read("redis_tls_ca_file", p)?),
        None => None,
    };
    let client = match (&c.redis_tls_cert_file, &c.redis_tls_key_file) {
        (Some(cert), Some(key)) => {
            let (cert_pem, key_pem) = (
                read("redis_tls_cert_file", cert)?,
                read("redis_tls_key_file", key)?,
            );
            // As the server will check it, so that a certificate it refuses fails here,
            // naming the file, rather than as Redis's "invalid peer certificate".
            crate::tls::certified_key(&cert_pem.0, &key_pem.0, crate::tls::Role::Client).map_err(
                |(side, why)| match side {
                    crate::tls::Side::Cert => {
                        invalid("redis_tls_cert_file", format!("{}: {why}", cert.display()))
                    }
                    crate::tls::Side::Key => {
                        invalid("redis_tls_key_file", format!("{}: {why}", key.display()))
                    }
                },
            )?;
            Some((cert_pem, key_pem))
        }
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                "redis_tls_key_file",
                "required with redis_tls_cert_file",
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                "redis_tls_cert_file",
                "required with redis_tls_key_file",
            ))
        }
    };
    Ok(Tls {
        ca,
        client,
        insecure: c.redis_tls_insecure,
    })
}

fn replica_ack(c: &Config) -> Result<Option<ReplicaAck>, ConfigError> {
    if c.min_replicas_ack == 0 {
        return Ok(None);
    }
    if c.min_replicas_ack > 64 {
        return Err(invalid("min_replicas_ack", "must be at most 64"));
    }
    let t = c.replica_ack_timeout;
    if t.is_zero() {
        return Err(invalid("replica_ack_timeout", "must be greater than zero"));
    }
    // WAIT runs inside the claim's round trip, which store_timeout bounds: a WAIT that may
    // outlast it would turn every slow acknowledgement into a timeout with an unknown
    // outcome instead of a clear refusal.
    if t.as_millis() >= c.store_timeout.as_millis() {
        return Err(invalid(
            "replica_ack_timeout",
            format!(
                "must be shorter than store_timeout ({:?}), which bounds the claim and its WAIT",
                c.store_timeout
            ),
        ));
    }
    if !(1..=1024).contains(&c.replica_ack_connections) {
        return Err(invalid(
            "replica_ack_connections",
            "must be between 1 and 1024",
        ));
    }
    Ok(Some(ReplicaAck {
        replicas: c.min_replicas_ack,
        timeout: t,
        connections: c.replica_ack_connections,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    /// How Redis is reached, once the rest of `c` is valid too (as start-up checks it).
    fn setup(c: Config) -> Result<Option<RedisSetup>, ConfigError> {
        let redis = RedisSetup::from_config(&c)?;
        Settings::new(c)?;
        Ok(redis)
    }

    fn error_of(c: Config) -> String {
        match setup(c) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    }

    fn with(f: impl FnOnce(&mut Config)) -> Config {
        let mut c = Config::default();
        f(&mut c);
        c
    }

    /// The first half of `bad_redis_settings_name_their_key`'s table: settings, and the key
    /// their error must name.
    fn topology_and_tls_cases(pem: &std::path::Path) -> Vec<(Config, &'static str)> {
        let pem = pem.to_path_buf();
        vec![
            (
                with(|c| {
                    c.redis_url = Some("redis://a:1".into());
                    c.redis_cluster_nodes = vec!["a:1".into()];
                }),
                "redis_cluster_nodes",
            ),
            (
                with(|c| c.redis_sentinels = vec!["a:1".into()]),
                "redis_sentinel_master",
            ),
            (
                with(|c| {
                    c.redis_sentinels = vec!["a".into()];
                    c.redis_sentinel_master = Some("m".into());
                }),
                "redis_sentinels[0]",
            ),
            (
                with(|c| c.redis_cluster_nodes = vec!["a:0".into()]),
                "redis_cluster_nodes[0]",
            ),
            (
                with(|c| {
                    c.redis_url = Some("redis://a:1".into());
                    c.redis_tls = true;
                }),
                "redis_tls",
            ),
            (
                with(|c| {
                    c.redis_url = Some("redis://a:1".into());
                    c.redis_tls_ca_file = Some(pem.clone());
                }),
                "redis_tls_ca_file",
            ),
            (
                with(|c| {
                    c.redis_url = Some("rediss://a:1".into());
                    c.redis_tls_ca_file = Some("/nonexistent/ca.pem".into());
                }),
                "redis_tls_ca_file",
            ),
            (
                with(|c| {
                    c.redis_url = Some("rediss://a:1".into());
                    c.redis_tls_cert_file = Some(pem.clone());
                }),
                "redis_tls_key_file",
            ),
            (
                with(|c| {
                    c.redis_url = Some("rediss://a:1".into());
                    c.redis_tls_ca_file = Some(std::env::temp_dir());
                }),
                "redis_tls_ca_file",
            ),
        ]
    }

    /// The second half of the same table.
    fn credential_and_node_cases() -> Vec<(Config, &'static str)> {
        vec![
            (
                with(|c| {
                    c.redis_url = Some("redis://a:1".into());
                    c.redis_username = Some("u".into());
                }),
                "redis_password",
            ),
            (
                with(|c| {
                    c.redis_url = Some("redis://a:1".into());
                    c.min_replicas_ack = 1;
                    c.replica_ack_timeout = c.store_timeout;
                }),
                "replica_ack_timeout",
            ),
            (with(|c| c.min_replicas_ack = 1), "min_replicas_ack"),
            (
                with(|c| {
                    c.redis_url = Some("redis://a:1".into());
                    c.min_replicas_ack = 1;
                    c.replica_ack_connections = 0;
                }),
                "replica_ack_connections",
            ),
            (
                with(|c| c.redis_password = Some("p".into())),
                "redis_password",
            ),
            (with(|c| c.redis_url = Some("nope://".into())), "redis_url"),
            (
                with(|c| {
                    c.redis_sentinels = vec!["rediss://a:1".into(), "b:1".into()];
                    c.redis_sentinel_master = Some("m".into());
                }),
                "redis_sentinels",
            ),
            (
                with(|c| {
                    c.redis_cluster_nodes = vec!["redis://a:1".into()];
                    c.redis_tls = true;
                }),
                "redis_tls",
            ),
            (
                with(|c| c.redis_cluster_nodes = vec!["rediss://u:p@a:1".into()]),
                "redis_cluster_nodes[0]",
            ),
            (
                with(|c| c.redis_cluster_nodes = vec!["http://a:1".into()]),
                "redis_cluster_nodes[0]",
            ),
        ]
    }

    #[test]
    fn bad_redis_settings_name_their_key() {
        let pem = std::env::temp_dir().join(format!("idemgate-setup-{}.pem", std::process::id()));
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .expect("temp file");
        let mut cases = topology_and_tls_cases(&pem);
        cases.extend(credential_and_node_cases());
        for (c, key) in cases {
            let err = error_of(c);
            assert!(err.contains(&format!("`{key}`")), "{key}: {err}");
        }
        let _ = std::fs::remove_file(&pem);
    }

    #[test]
    fn rediss_urls_for_sentinels_and_cluster_nodes_turn_tls_on() {
        let s = setup(with(|c| {
            c.redis_sentinels = vec!["rediss://s1:26379".into(), "rediss://[::1]:26380/".into()];
            c.redis_sentinel_master = Some("m".into());
            c.namespace = Some("payments".into());
        }))
        .expect("valid");
        let r = s.expect("redis");
        assert!(r.tls.is_some());
        assert!(matches!(&r.topology, Topology::Sentinel { sentinels, .. }
            if sentinels == &[("s1".to_string(), 26379), ("::1".to_string(), 26380)]));
        let s = setup(with(|c| {
            c.redis_cluster_nodes = vec!["redis://n1:7000".into(), "redis://n2:7000".into()];
            c.namespace = Some("payments".into());
        }))
        .expect("valid");
        assert!(s.expect("redis").tls.is_none());
    }

    /// A password that breaks the URL is not printed; the message says what to do.
    #[test]
    fn an_unparseable_redis_url_says_to_encode_the_password_without_printing_it() {
        for password in ["pa/ss-word", "pa#ss-word", "pa?ss-word"] {
            let err = error_of(with(|c| {
                c.redis_url = Some(format!("redis://idemgate:{password}@redis:6379/0"));
            }));
            assert!(err.contains("`redis_url`"), "{err}");
            assert!(err.contains("percent-encode"), "{err}");
            assert!(err.contains("IDEMGATE_REDIS_PASSWORD"), "{err}");
            assert!(!err.contains("ss-word"), "{err}");
        }
    }

    #[test]
    fn every_topology_with_tls_and_credentials_is_accepted() {
        let s = setup(with(|c| {
            c.redis_cluster_nodes = vec!["10.0.0.1:7000".into(), "[::1]:7001".into()];
            c.redis_tls = true;
            c.namespace = Some("payments".into());
            c.redis_username = Some("idemgate".into());
            c.redis_password = Some("secret".into());
            c.min_replicas_ack = 1;
        }))
        .expect("valid");
        let r = s.expect("redis");
        assert!(r.tls.is_some());
        assert!(
            matches!(&r.topology, Topology::Cluster { nodes } if nodes[1] == ("::1".to_string(), 7001))
        );
        assert!(r.replica_ack.is_some_and(|a| a.replicas == 1));
        // The password never prints.
        assert!(!format!("{r:?}").contains("secret"));
        assert!(setup(Config::default()).expect("valid").is_none());
    }
}
