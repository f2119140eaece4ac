//! Validation: a [`Config`] checked into the plain [`Settings`], every error naming its key.

use std::sync::Arc;

use hyper::{Method, Uri};

use super::at_rest::{at_rest, AtRest};
use super::policy::resolve;
use super::{invalid, Config, ConfigError, Mode, Policy, Route};
use crate::scope::jwt::JwtVerifier;
use crate::scope::template::{self, Template};
use crate::scope::{path, ScopeSecret};

/// The upstream origin, split for building request URIs.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `http` or `https`.
    pub scheme: hyper::http::uri::Scheme,
    /// `host:port` (or `host` alone: the scheme's port).
    pub authority: hyper::http::uri::Authority,
    /// The `Host` header every forwarded request carries: the authority, made once.
    pub host: hyper::header::HeaderValue,
    /// The `X-Forwarded-Proto` of every forwarded request: how clients reached idemgate
    /// (`https` when `listen` speaks TLS).
    pub forwarded_proto: hyper::header::HeaderValue,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// What it was made from (for start-up logging and the admin API).
    pub config: Config,
    /// The upstream origin.
    pub upstream: Upstream,
    /// Policy for requests that match no route. Shared (`Arc`) because every protected
    /// request carries its policy into its own task: a clone must not allocate.
    pub default_policy: Arc<Policy>,
    /// Routes, longest prefix first, each prefix in the normal form of its own rules.
    pub routes: Vec<(String, Arc<Policy>)>,
    /// The namespace of every record id (`default` on the embedded store).
    pub namespace: String,
    /// Verifies bearer tokens for `tenant_jwt_claim`; present when keys are configured.
    pub jwt: Option<Arc<JwtVerifier>>,
    /// How recorded answers are kept at rest (sealed, compressed).
    pub at_rest: AtRest,
    /// The operator's scope secret (`scope_secret`, `scope_secret_file`), if pinned.
    pub pinned_secret: Option<ScopeSecret>,
    // Whether any policy protects a method: decides between 400 and pass-through for a
    // path that cannot be normalized (and so matched to a route).
    pub(super) protected_methods: Vec<Method>,
    // The same, of routes that enforce: a path that cannot be normalized on a method only
    // observed routes protect is forwarded and counted, never refused.
    pub(super) enforced_methods: Vec<Method>,
}

impl Settings {
    /// Each route's configured path (`default` for the defaults) and its mode.
    pub fn modes(&self) -> Vec<(String, Mode)> {
        std::iter::once(&self.default_policy)
            .chain(self.routes.iter().map(|(_, p)| p))
            .map(|p| (p.route.clone().unwrap_or_else(|| "default".into()), p.mode))
            .collect()
    }
}

impl Settings {
    /// Validates a configuration: the first problem found, in the order of the checks.
    pub fn new(config: Config) -> Result<Settings, ConfigError> {
        // Whether `listen` speaks TLS. The listener's files, and the upstream's, are read
        // where the process is wired (`wiring`), which names their keys as this does.
        let tls_listener = config.tls_cert_file.is_some() && config.tls_key_file.is_some();
        let upstream = parse_upstream(&config, tls_listener)?;
        check_times_and_counts(&config)?;
        check_exclusive_and_telemetry(&config)?;
        let namespace = namespace(&config)?;
        let jwt = jwt(&config)?;
        let mut at_rest = at_rest(&config)?;
        let (default_policy, mut routes) = policies(&config, jwt.is_some())?;
        check_room_for_answers(&config, &default_policy, &routes)?;
        routes.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        for (i, (_, policy)) in routes.iter_mut().enumerate() {
            Arc::make_mut(policy).index = i + 1;
        }
        let (protected_methods, enforced_methods) = methods(&default_policy, &routes);
        // What a replay may inflate to: the largest answer any route records, or what an
        // operator may complete a record with.
        let largest = std::iter::once(&default_policy)
            .chain(routes.iter().map(|(_, p)| p))
            .map(|p| usize::try_from(p.max_response_bytes).unwrap_or(usize::MAX))
            .max()
            .unwrap_or(0);
        at_rest.max_body = Some(largest.max(crate::limits::ADMIN_MAX_BODY));
        let pinned_secret = pinned_secret(&config)?;
        let (check, create) = (
            config.scope_secret_check_interval,
            config.scope_secret_create_delay,
        );
        if !create.is_zero() && create <= check {
            return Err(invalid(
                "scope_secret_create_delay",
                format!("must be longer than scope_secret_check_interval ({}), so that running instances put a lost secret back before a new one is made; 0s only for a store no other instance uses", humantime_serde::re::humantime::format_duration(check)),
            ));
        }
        Ok(Settings {
            pinned_secret,
            config,
            upstream,
            default_policy,
            routes,
            namespace,
            jwt,
            at_rest,
            protected_methods,
            enforced_methods,
        })
    }
}

/// The durations that must not be zero, the admin token and operators, and the counts
/// and limits of the process.
fn check_times_and_counts(config: &Config) -> Result<(), ConfigError> {
    for (key, d) in [
        ("store_timeout", config.store_timeout),
        ("redis_connect_timeout", config.redis_connect_timeout),
        ("header_read_timeout", config.header_read_timeout),
        ("redis_info_interval", config.redis_info_interval),
        (
            "scope_secret_check_interval",
            config.scope_secret_check_interval,
        ),
        ("body_read_timeout", config.body_read_timeout),
        ("idle_timeout", config.idle_timeout),
        ("send_timeout", config.send_timeout),
    ] {
        if d.is_zero() {
            return Err(invalid(key, "must be greater than zero"));
        }
    }
    if let Some(token) = &config.admin_token {
        let t = token.expose();
        if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "admin_token",
                "must be at least 16 visible ASCII characters (e.g. `openssl rand -hex 32`)",
            ));
        }
    }
    super::operators::check(config)?;
    for (key, n) in [
        ("memory_max_records", config.memory_max_records),
        ("memory_max_bytes", config.memory_max_bytes),
        (
            "h2_max_concurrent_streams",
            config.h2_max_concurrent_streams as usize,
        ),
        ("max_connections", config.max_connections),
        ("max_in_flight", config.max_in_flight),
        ("max_buffered_bytes", config.max_buffered_bytes),
    ] {
        if n == 0 {
            return Err(invalid(key, "must be at least 1"));
        }
    }
    if config.max_upstream_connections <= config.max_in_flight {
        return Err(invalid(
            "max_upstream_connections",
            format!(
                "must be greater than max_in_flight ({}): protected requests use up to max_in_flight upstream connections, and pass-through requests need the rest",
                config.max_in_flight
            ),
        ));
    }
    if config.worker_threads == 0 {
        return Err(invalid("worker_threads", "must be at least 1"));
    }
    Ok(())
}

/// One store at most, and the telemetry endpoint and log filter.
fn check_exclusive_and_telemetry(config: &Config) -> Result<(), ConfigError> {
    let stores = [
        config.redis_url.is_some(),
        config.store_path.is_some(),
        config.postgres_url.is_some(),
    ];
    if stores.iter().filter(|s| **s).count() > 1 {
        return Err(invalid(
            "store_path",
            "redis_url, store_path and postgres_url exclude each other: choose one store",
        ));
    }
    if let Some(endpoint) = &config.otlp_endpoint {
        let ok = endpoint
            .parse::<Uri>()
            .ok()
            .is_some_and(|u| u.scheme_str() == Some("http") && u.authority().is_some());
        if !ok {
            return Err(invalid(
                "otlp_endpoint",
                "must be http://host:port (OTLP over HTTP, no TLS: run the collector beside idemgate)",
            ));
        }
    }
    if let Some(filter) = &config.log_level {
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(filter) {
            return Err(invalid(
                "log_level",
                format!("is not a log filter (`info`, `warn,idemgate=debug`): {e}"),
            ));
        }
    }
    Ok(())
}

/// The namespace of every record id: required with a shared store (after checking that
/// Redis is not set beside another store), `default` on the embedded one.
fn namespace(config: &Config) -> Result<String, ConfigError> {
    // How Redis is reached is checked where it is set up (`store::redis::setup`).
    let redis = config.redis_url.is_some()
        || !config.redis_sentinels.is_empty()
        || !config.redis_cluster_nodes.is_empty();
    if redis && (config.store_path.is_some() || config.postgres_url.is_some()) {
        return Err(invalid(
            "store_path",
            "Redis, store_path and postgres_url exclude each other: choose one store",
        ));
    }
    let shared = redis || config.postgres_url.is_some();
    match (&config.namespace, shared) {
        (Some(ns), _) => {
            let ok = (1..=64).contains(&ns.len())
                && ns
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
            if !ok {
                return Err(invalid(
                    "namespace",
                    "must be 1 to 64 characters of letters, digits, '.', '_', ':' or '-'",
                ));
            }
            Ok(ns.clone())
        }
        (None, true) => Err(invalid(
            "namespace",
            "is required with Redis and PostgreSQL: name the service whose records these are (e.g. `payments`), so that two services sharing one store never see each other's records",
        )),
        (None, false) => Ok("default".to_string()),
    }
}

/// The verifier of bearer tokens, when keys are configured (`jwt_hs256_secret`,
/// `jwks_file`), with its audience and cache.
fn jwt(config: &Config) -> Result<Option<Arc<JwtVerifier>>, ConfigError> {
    if let Some(secret) = &config.jwt_hs256_secret {
        if secret.expose().len() < 32 {
            return Err(invalid(
                "jwt_hs256_secret",
                "must be at least 32 bytes (RFC 7518 3.2: a key as long as the hash)",
            ));
        }
    }
    let jwks = match &config.jwks_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| invalid("jwks_file", format!("cannot read {}: {e}", p.display())))?,
        ),
        None => None,
    };
    let jwt = if config.jwt_hs256_secret.is_some() || jwks.is_some() {
        let secret = config
            .jwt_hs256_secret
            .as_ref()
            .map(|s| s.expose().as_bytes());
        let mut verifier =
            JwtVerifier::new(secret, jwks.as_deref()).map_err(|e| invalid("jwks_file", e))?;
        if let Some(aud) = &config.jwt_audience {
            let list = aud.list();
            if list.is_empty() || list.iter().any(|a| a.is_empty()) {
                return Err(invalid(
                    "jwt_audience",
                    "must be a non-empty audience or a list of them",
                ));
            }
            verifier = verifier.with_audience(list);
        }
        Some(Arc::new(verifier.with_cache(config.jwt_cache_entries)))
    } else {
        None
    };
    if config.jwt_audience.is_some() && jwt.is_none() {
        return Err(invalid(
            "jwt_audience",
            "needs keys to verify tokens with: set jwt_hs256_secret and/or jwks_file",
        ));
    }
    if config.jwt_cache_entries > 10_000_000 {
        return Err(invalid(
            "jwt_cache_entries",
            "must be at most 10000000 (each entry may hold a 4 KiB token)",
        ));
    }
    Ok(jwt)
}

/// Each route's key (its normalized path, or a template's shape) and policy.
type Routes = Vec<(String, Arc<Policy>)>;

/// The defaults' policy and each route's, keyed by its normalized path (or a template's
/// shape), in the order written.
fn policies(config: &Config, jwt_keys: bool) -> Result<(Arc<Policy>, Routes), ConfigError> {
    // A client CA without a listener to use it is refused where the listener is built.
    let client_ca = config.tls_client_ca_file.is_some();
    let d = &config.defaults;
    let default_policy = Arc::new(resolve(
        "defaults",
        None,
        d,
        &Route::default(),
        jwt_keys,
        client_ca,
    )?);
    let mut routes = Vec::new();
    for (i, r) in config.routes.iter().enumerate() {
        let at = format!("routes[{i}]");
        if !r.path.starts_with('/') {
            return Err(invalid(format!("{at}.path"), "must start with '/'"));
        }
        let mut policy = resolve(&at, Some(r.path.clone()), d, r, jwt_keys, client_ca)?;
        let mut prefix = path::normalize(&r.path, policy.path_rules)
            .map_err(|e| invalid(format!("{at}.path"), e.to_string()))?
            .into_owned();
        if template::is_template(&r.path) {
            let rules = policy.path_rules;
            let t = Template::parse(&prefix, rules.case_insensitive)
                .map_err(|e| invalid(format!("{at}.path"), e.to_string()))?;
            // Two templates of one shape are one route; the key keeps its length, so
            // routes still sort longest first.
            prefix = t.shape();
            policy.template = Some(t);
        }
        if routes
            .iter()
            .any(|(p, _): &(String, Arc<Policy>)| *p == prefix)
        {
            return Err(invalid(
                format!("{at}.path"),
                "another route has the same path (after normalization)",
            ));
        }
        routes.push((prefix, Arc::new(policy)));
    }
    Ok((default_policy, routes))
}

/// The embedded store reserves room for the largest answer a route records with each
/// claim: below one reservation, every new key would get 503 forever. `routes` in the
/// order written.
fn check_room_for_answers(
    config: &Config,
    default_policy: &Policy,
    routes: &[(String, Arc<Policy>)],
) -> Result<(), ConfigError> {
    let embedded = config.redis_url.is_none()
        && config.redis_sentinels.is_empty()
        && config.redis_cluster_nodes.is_empty()
        && config.store_path.is_none()
        && config.postgres_url.is_none();
    if !embedded {
        return Ok(());
    }
    let named = std::iter::once((
        "defaults.max_response_bytes".to_string(),
        default_policy.max_response_bytes,
    ))
    .chain(
        config
            .routes
            .iter()
            .zip(routes)
            .enumerate()
            .filter(|(_, (r, _))| r.max_response_bytes.is_some())
            .map(|(i, (_, (_, p)))| {
                (
                    format!("routes[{i}].max_response_bytes"),
                    p.max_response_bytes,
                )
            }),
    );
    if let Some((key, largest)) = named.max_by_key(|(_, n)| *n) {
        let needed = largest.saturating_add(crate::limits::ANSWER_HEAD_ROOM as u64);
        if (config.memory_max_bytes as u64) < needed {
            return Err(invalid(
                "memory_max_bytes",
                format!(
                    "must be at least {needed} bytes: each new key reserves room for its answer ({key} = {largest}, plus 65536 for its head and upkeep), so every new key would get 503; raise memory_max_bytes or lower {key}"
                ),
            ));
        }
    }
    Ok(())
}

/// The methods any policy protects, and those of policies that enforce.
fn methods(
    default_policy: &Arc<Policy>,
    routes: &[(String, Arc<Policy>)],
) -> (Vec<Method>, Vec<Method>) {
    let policies = routes.iter().map(|(_, p)| p).chain([default_policy]);
    let mut protected_methods: Vec<Method> = Vec::new();
    let mut enforced_methods: Vec<Method> = Vec::new();
    for p in policies {
        for m in &p.methods {
            if !protected_methods.contains(m) {
                protected_methods.push(m.clone());
            }
            if p.mode == Mode::Enforce && !enforced_methods.contains(m) {
                enforced_methods.push(m.clone());
            }
        }
    }
    (protected_methods, enforced_methods)
}

/// The operator's pinned scope secret, if any (`scope_secret` or `scope_secret_file`).
fn pinned_secret(config: &Config) -> Result<Option<ScopeSecret>, ConfigError> {
    let (key, hex) = match (&config.scope_secret, &config.scope_secret_file) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "scope_secret_file",
                "set scope_secret or scope_secret_file (IDEMGATE_SCOPE_SECRET counts as scope_secret), not both",
            ))
        }
        (Some(s), None) => ("scope_secret", s.expose().to_string()),
        (None, Some(p)) => {
            let text = std::fs::read_to_string(p).map_err(|e| {
                invalid("scope_secret_file", format!("cannot read {}: {e}", p.display()))
            })?;
            ("scope_secret_file", text)
        }
        (None, None) => return Ok(None),
    };
    ScopeSecret::from_hex(hex.trim())
        .map(Some)
        .ok_or_else(|| invalid(key, "must be 64 hex digits (as `GET /scope-secret` on the admin listener shows the current one)"))
}

fn parse_upstream(config: &Config, tls_listener: bool) -> Result<Upstream, ConfigError> {
    let s = &config.upstream;
    let uri: Uri = s
        .parse()
        .map_err(|e| invalid("upstream", format!("not a URI: {e}")))?;
    let scheme = uri.scheme().cloned().ok_or_else(|| {
        invalid(
            "upstream",
            "must be http://host:port or https://host[:port]",
        )
    })?;
    let https = scheme == hyper::http::uri::Scheme::HTTPS;
    if scheme != hyper::http::uri::Scheme::HTTP && !https {
        return Err(invalid("upstream", "must be an http:// or https:// origin"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| invalid("upstream", "must name a host"))?;
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(invalid(
            "upstream",
            "must be an origin without path or query (http://host:port)",
        ));
    }
    let host = hyper::header::HeaderValue::from_str(authority.as_str())
        .map_err(|_| invalid("upstream", "its host:port is not a valid Host header"))?;
    let forwarded_proto =
        hyper::header::HeaderValue::from_static(if tls_listener { "https" } else { "http" });
    Ok(Upstream {
        scheme,
        authority,
        host,
        forwarded_proto,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::tests::settings;

    #[test]
    fn defaults_are_valid_and_match_the_design() {
        let s = settings("").unwrap();
        let p = &s.default_policy;
        assert_eq!(p.methods, vec![Method::POST, Method::PATCH]);
        assert!(!p.require_key);
        assert_eq!(p.retention, Duration::from_secs(86400));
        assert_eq!(p.lease, Duration::from_secs(10));
        assert_eq!(p.max_body_bytes, 1048576);
        assert_eq!(p.max_response_bytes, 4 * 1048576);
        assert_eq!(
            s.config.admin_listen,
            Some("127.0.0.1:9901".parse().unwrap())
        );
    }

    #[test]
    fn listen_addresses_may_name_a_host() {
        let s = settings("listen = \"localhost:8088\"\nadmin_listen = \"localhost:9988\"").unwrap();
        assert!(s.config.listen.ip().is_loopback());
        assert_eq!(s.config.listen.port(), 8088);
        assert_eq!(s.config.admin_listen.map(|a| a.port()), Some(9988));
        let err = settings("listen = \"localhost\"").unwrap_err().to_string();
        assert!(err.contains("listen"), "{err}");
    }

    #[test]
    fn errors_do_not_name_the_profile() {
        let err = settings("[defaults]\nretention = \"soon\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("for key `defaults.retention`"), "{err}");
        assert!(!err.contains("default."), "{err}");
    }

    #[test]
    fn scope_settings_are_validated_naming_their_key() {
        for (toml, key) in [
            ("redis_url = \"redis://127.0.0.1:6379/0\"", "namespace"),
            ("namespace = \"has space\"", "namespace"),
            (
                "[defaults]\ntenant_jwt_claim = \"sub\"",
                "defaults.tenant_jwt_claim",
            ),
            (
                "[[routes]]\npath = \"/a\"\ntenant_jwt_claim = \"sub\"",
                "routes[0].tenant_jwt_claim",
            ),
            ("jwt_hs256_secret = \"short\"", "jwt_hs256_secret"),
            ("jwks_file = \"/nonexistent/jwks.json\"", "jwks_file"),
            (
                "[[routes]]\npath = \"/a/\"\n[[routes]]\npath = \"/a\"",
                "routes[1].path",
            ),
            ("[[routes]]\npath = \"/a%2Fb\"", "routes[0].path"),
            ("[defaults]\nanonymous = \"open\"", "anonymous"),
            ("[defaults]\npath_match = \"loose\"", "path_match"),
        ] {
            let err = settings(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml:?}: {err}");
        }
        let s =
            settings("redis_url = \"redis://127.0.0.1:6379/0\"\nnamespace = \"payments\"").unwrap();
        assert_eq!(s.namespace, "payments");
        assert_eq!(settings("").unwrap().namespace, "default");
        let err = settings("jwt_hs256_secret = \"short\"")
            .unwrap_err()
            .to_string();
        assert!(
            !err.contains("short\""),
            "the secret is never printed: {err}"
        );
    }
}
