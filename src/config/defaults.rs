//! The built-in defaults, the bottom layer of every configuration.

use std::net::SocketAddr;
use std::time::Duration;

use super::redact::{to_toml, unset_keys};
use super::{Anonymous, Config, Defaults, Mode, OnAmbiguous, OnStoreError, PathMatch};
use super::{
    PathParams, PgSynchronousCommit, RecordMode, RedisRecordFormat, UpstreamHttp2,
    UPSTREAM_IDLE_TIMEOUT,
};
use crate::fingerprint::QueryOrder;

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstream: "http://127.0.0.1:9000".into(),
            upstream_tls_ca_file: None,
            upstream_tls_server_name: None,
            upstream_tls_cert_file: None,
            upstream_tls_key_file: None,
            upstream_http2: UpstreamHttp2::Offer,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            tls_client_auth: None,
            tls_reload_interval: default_tls_reload_interval(),
            admin_listen: Some(SocketAddr::from(([127, 0, 0, 1], 9901))),
            admin_token: None,
            admin_operators: Vec::new(),
            admin_hosts: Vec::new(),
            redis_url: None,
            store_path: None,
            postgres_url: None,
            postgres_tls_ca_file: None,
            postgres_tls_cert_file: None,
            postgres_tls_key_file: None,
            postgres_synchronous_commit: PgSynchronousCommit::On,
            postgres_async_standbys_acknowledged: false,
            redis_sentinels: Vec::new(),
            redis_sentinel_master: None,
            redis_cluster_nodes: Vec::new(),
            redis_tls: false,
            redis_tls_ca_file: None,
            redis_tls_cert_file: None,
            redis_tls_key_file: None,
            redis_tls_insecure: false,
            redis_username: None,
            redis_password: None,
            redis_record_format: RedisRecordFormat::Hash,
            min_replicas_ack: 0,
            replica_ack_timeout: default_replica_ack_timeout(),
            replica_ack_connections: default_replica_ack_connections(),
            namespace: None,
            jwt_hs256_secret: None,
            jwks_file: None,
            jwt_audience: None,
            jwt_cache_entries: 10_000,
            encryption_keys: Vec::new(),
            encryption_keys_file: None,
            compress_min_bytes: None,
            redis_info_interval: Duration::from_secs(15),
            unknown_count_interval: Duration::from_secs(300),
            scope_secret: None,
            scope_secret_file: None,
            scope_secret_check_interval: Duration::from_secs(5),
            scope_secret_create_delay: Duration::from_secs(12),
            store_timeout: Duration::from_millis(500),
            upstream_idle_timeout: UPSTREAM_IDLE_TIMEOUT,
            redis_connect_timeout: Duration::from_secs(1),
            memory_max_records: 1_000_000,
            memory_max_bytes: 1024 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(10),
            // Longer than the usual load balancer's idle timeout (60 s), so that it is the
            // balancer, not idemgate, that closes an idle connection: otherwise a request it
            // sends just as idemgate closes is lost.
            idle_timeout: Duration::from_secs(75),
            max_connections: 4096,
            h2_max_concurrent_streams: 100,
            max_in_flight: 1024,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(1),
            max_upstream_connections: 2048,
            max_buffered_bytes: 64 * 1024 * 1024,
            max_buffered_bytes_per_connection: None,
            max_buffered_bytes_per_tenant: None,
            max_pass_through_per_connection: None,
            max_pass_through_per_tenant: None,
            send_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
            worker_threads: 1,
            otlp_endpoint: None,
            log_level: None,
            defaults: Defaults::default(),
            routes: Vec::new(),
        }
    }
}

pub(super) fn default_tls_reload_interval() -> Duration {
    Duration::from_secs(5)
}

pub(super) fn default_replica_ack_timeout() -> Duration {
    Duration::from_millis(200)
}

pub(super) fn default_replica_ack_connections() -> usize {
    16
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(10),
            upstream_timeout: Duration::from_secs(30),
            max_body_bytes: 1024 * 1024,
            max_content_codings: 2,
            max_response_bytes: 4 * 1024 * 1024,
            max_key_length: 255,
            tenant_headers: vec!["Authorization".into(), "X-Api-Key".into()],
            tenant_jwt_claim: None,
            tenant_client_cert: None,
            tenant_qualifier_headers: Vec::new(),
            anonymous: Anonymous::Refuse,
            path_match: PathMatch::Normalized,
            case_insensitive_paths: None,
            plus_is_space: None,
            raw_utf8_paths: None,
            framework: None,
            on_store_error: OnStoreError::Reject,
            on_ambiguous: OnAmbiguous::Hold,
            record_mode: RecordMode::BeforeResponse,
            mode: Mode::Enforce,
            error_format: super::ErrorFormatName::Problem,
            error_template: None,
            error_codes: None,
            fingerprint_ignore: Vec::new(),
            query_order: QueryOrder::Sorted,
            path_params: PathParams::Refuse,
            format_suffixes: Vec::new(),
            key_headers: vec![crate::key::HEADER.into()],
            release_on_status: Vec::new(),
            record_control_header: None,
            key_json_pointer: None,
            short_retention_statuses: vec![401, 403, 407],
            short_retention: Duration::from_secs(60),
            method_override_headers: Vec::new(),
            method_override_params: Vec::new(),
            method_case: super::MethodCase::Refuse,
        }
    }
}

/// Every setting with its default, as TOML, then the settings without a default (absent
/// unless set) as comments: what `idemgate config defaults` prints.
pub fn defaults_toml() -> Result<String, String> {
    let value = serde_json::to_value(Config::default()).map_err(|e| e.to_string())?;
    let mut unset = Vec::new();
    unset_keys(&value, "", &mut unset);
    let mut out = to_toml(value)?;
    out.push_str("\n# Without a default (absent unless set):\n");
    for key in unset {
        out.push_str(&format!("# {key}\n"));
    }
    Ok(out)
}
