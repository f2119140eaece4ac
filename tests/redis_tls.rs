//! Redis over TLS with a private CA and client certificates, and an ACL user limited to
//! idemgate's keys and commands: what works, and what stops start-up with a message that
//! names the address and says TLS.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::topology::{redis_base, tls_node, Cluster, Node, Pki, Sentinels, MASTER};
use common::*;
use idemgate::Config;

fn tls_config(up: &Upstream, node: &Node, host: &str, pki: &Pki) -> Config {
    let mut c = redis_base(up);
    c.redis_url = Some(format!("rediss://{host}:{}/0", node.port));
    c.redis_tls_ca_file = Some(pki.path("ca.crt"));
    c.redis_tls_cert_file = Some(pki.path("client.crt"));
    c.redis_tls_key_file = Some(pki.path("client.key"));
    c
}

async fn one_key_executes_once(app: &idemgate::Running, up: &Upstream) {
    let client = client();
    let first = post(&client, app, "/pay", Some("tls-1"), "{\"a\":1}", &[]).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = post(&client, app, "/pay", Some("tls-1"), "{\"a\":1}", &[]).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ca_and_client_certificate() {
    let pki = Pki::new();
    let node = tls_node(&pki, true, &[]);
    let up = Upstream::start().await;
    let app = spawn_app(tls_config(&up, &node, "localhost", &pki)).await;
    one_key_executes_once(&app, &up).await;
    // The record is on the TLS server: the plain port is closed (port 0).
    let keys = node.cli(&["--scan", "--pattern", "idemgate:{*"]).unwrap();
    assert_eq!(keys.lines().count(), 1, "{keys}");
    app.shutdown().await;
}

async fn start_error(c: Config) -> (i32, String) {
    match idemgate::start(c).await {
        Ok(_) => panic!("idemgate started against a Redis it should not trust"),
        Err(e) => (e.exit_code(), e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_stops_start_up_naming_the_address_and_tls() {
    let pki = Pki::new();
    let node = tls_node(&pki, false, &[]);
    let up = Upstream::start().await;
    let mut c = tls_config(&up, &node, "localhost", &pki);
    c.redis_tls_ca_file = Some(pki.path("other-ca.crt"));
    let (code, msg) = start_error(c).await;
    assert_eq!(code, 69, "{msg}");
    assert!(msg.contains(&format!("localhost:{}", node.port)), "{msg}");
    assert!(msg.contains("TLS"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_name_stops_start_up_unless_verification_is_turned_off() {
    let pki = Pki::new();
    let node = tls_node(&pki, false, &[]);
    let up = Upstream::start().await;
    // The certificate is for `localhost` only.
    let c = tls_config(&up, &node, "127.0.0.1", &pki);
    let (code, msg) = start_error(c.clone()).await;
    assert_eq!(code, 69, "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{}", node.port)), "{msg}");
    assert!(msg.contains("TLS"), "{msg}");
    let mut insecure = c;
    insecure.redis_tls_insecure = true;
    let app = spawn_app(insecure).await;
    one_key_executes_once(&app, &up).await;
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_certificate_stops_start_up() {
    let pki = Pki::new();
    let node = tls_node(&pki, true, &[]);
    let up = Upstream::start().await;
    let mut c = tls_config(&up, &node, "localhost", &pki);
    c.redis_tls_cert_file = None;
    c.redis_tls_key_file = None;
    let (code, msg) = start_error(c).await;
    assert_eq!(code, 69, "{msg}");
    assert!(msg.contains(&format!("localhost:{}", node.port)), "{msg}");
    assert!(msg.contains("TLS"), "{msg}");
}

/// The binary itself: exit code 69 and the message on stderr.
#[test]
fn the_binary_exits_69_on_an_untrusted_redis() {
    let pki = Pki::new();
    let node = tls_node(&pki, false, &[]);
    let url = format!("rediss://localhost:{}/0", node.port);
    let ca = pki.path("other-ca.crt").display().to_string();
    let (mut cmd, _, _, dir) = Gate::command(
        "http://127.0.0.1:9",
        &url,
        &[("IDEMGATE_REDIS_TLS_CA_FILE", ca.as_str())],
    );
    let status = cmd.status().unwrap();
    let log = std::fs::read_to_string(dir.path().join("idemgate.log")).unwrap();
    assert_eq!(status.code(), Some(69), "{log}");
    assert!(
        log.contains("TLS") && log.contains(&format!("localhost:{}", node.port)),
        "{log}"
    );
}

/// The `ACL SETUSER` line that docs/production.md gives, read from that page itself.
fn documented_acl_line(password: &str) -> Vec<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/production.md"))
        .unwrap();
    let line = page
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("ACL SETUSER idemgate "))
        .expect("docs/production.md gives an ACL SETUSER line");
    line.split_whitespace()
        .map(|w| w.replace("<password>", password))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_user_is_enough_and_no_more() {
    let redis = RedisServer::start();
    let password = "s3cret-for-the-test-only";
    let line = documented_acl_line(password);
    let args: Vec<&str> = line.iter().map(String::as_str).collect();
    let ok = redis.command(&args).unwrap();
    assert!(ok.starts_with("+OK"), "{ok}");
    // Nobody else gets in without a password.
    let off = redis
        .command(&["ACL", "SETUSER", "default", "off"])
        .unwrap();
    assert!(off.starts_with("+OK"), "{off}");

    let up = Upstream::start().await;
    let mut c = redis_base(&up);
    c.redis_url = Some(redis.url());
    c.redis_username = Some("idemgate".into());
    c.redis_password = Some(password.into());
    c.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    let app = spawn_app(c.clone()).await;
    one_key_executes_once(&app, &up).await;
    every_path_of_a_record(&app, &up).await;
    app.shutdown().await;

    // Records kept as values: the same line is enough.
    let mut values = c.clone();
    values.redis_record_format = idemgate::config::RedisRecordFormat::Value;
    // Apart from the records above (same keys).
    values.namespace = Some("values".into());
    let up_v = Upstream::start().await;
    values.upstream = up_v.url();
    let app = spawn_app(values).await;
    one_key_executes_once(&app, &up_v).await;
    every_path_of_a_record(&app, &up_v).await;
    app.shutdown().await;

    // The user reaches nothing but idemgate's keys.
    let denied = redis_cli_as(redis.port, password, &["GET", "other:key"]);
    assert!(denied.contains("NOPERM"), "{denied}");
    let denied = redis_cli_as(redis.port, password, &["FLUSHALL"]);
    assert!(denied.contains("NOPERM"), "{denied}");
    // And no channel but the one that says a record settled.
    let published = redis_cli_as(redis.port, password, &["PUBLISH", "idemgate:settled", "x"]);
    assert!(!published.contains("NOPERM"), "{published}");
    let denied = redis_cli_as(redis.port, password, &["PUBLISH", "other", "x"]);
    assert!(denied.contains("NOPERM"), "{denied}");

    // Any database, not only 0: the connection selects it (`SELECT`), which the line
    // allows.
    let mut other_db = c.clone();
    other_db.redis_url = Some(format!("redis://127.0.0.1:{}/3", redis.port));
    let up3 = Upstream::start().await;
    other_db.upstream = up3.url();
    let app = spawn_app(other_db).await;
    one_key_executes_once(&app, &up3).await;
    app.shutdown().await;

    // A wrong password stops start-up (exit 69), naming the address.
    c.redis_password = Some("wrong-password".into());
    let e = idemgate::start(c).await.err().expect("refused");
    assert_eq!(e.exit_code(), 69, "{e}");
    assert!(
        e.to_string().contains(&format!("127.0.0.1:{}", redis.port)),
        "{e}"
    );
}

/// Every other path of a record: in flight, inspected, listed (SCAN), released by an
/// operator; and the instance ready throughout.
async fn every_path_of_a_record(app: &idemgate::Running, up: &Upstream) {
    let client = client();
    let admin = app.admin_addr().unwrap();
    let (done, busy) = post_and_retry_while_running(&client, app, up, "/pay", "acl-2").await;
    assert_eq!(done.status, 201);
    assert_eq!(busy.status, 409, "{:?}", busy.body);
    let id = busy.json()["record_id"].as_str().unwrap().to_string();
    assert!(inspect(&client, admin, &id).await.is_some());
    let listed = client
        .get(format!("http://{admin}/records?state=completed&count=1000"))
        .send()
        .await
        .expect("admin request");
    assert_eq!(listed.status().as_u16(), 200);
    let listed: serde_json::Value = listed.json().await.expect("page json");
    assert!(
        listed["records"]
            .as_array()
            .is_some_and(|r| r.iter().any(|v| v["id"] == id.as_str())),
        "{listed}"
    );
    assert!(release(&client, admin, &id).await);
    assert!(inspect(&client, admin, &id).await.is_none());
    let ready = http_get(admin, "/readyz").unwrap();
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
}

fn redis_cli_as(port: u16, password: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args([
            "-p",
            &port.to_string(),
            "--user",
            "idemgate",
            "--pass",
            password,
            "--no-auth-warning",
        ])
        .args(args)
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The binary with the password in `IDEMGATE_REDIS_PASSWORD`, taken verbatim even where it
/// looks like a number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_comes_from_the_environment_verbatim() {
    let redis = RedisServer::start();
    // Reads as a number (1.2345e71) to a parser that guesses types; long enough that a
    // random hex request or record id in the log does not contain it by chance (with "1e5",
    // about one run in fifty did).
    let password = "12345e67";
    let line = documented_acl_line(password);
    let args: Vec<&str> = line.iter().map(String::as_str).collect();
    assert!(redis.command(&args).unwrap().starts_with("+OK"));
    assert!(redis
        .command(&["ACL", "SETUSER", "default", "off"])
        .unwrap()
        .starts_with("+OK"));
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        &redis.url(),
        &[
            ("IDEMGATE_REDIS_USERNAME", "idemgate"),
            ("IDEMGATE_REDIS_PASSWORD", password),
        ],
    );
    let a = post_url(&client(), &gate.url("/pay"), Some("env-1"), "{}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert!(!gate.log().contains(password), "{}", gate.log());
}

fn tls_files(c: &mut Config, pki: &Pki) {
    c.redis_tls_ca_file = Some(pki.path("ca.crt"));
    c.redis_tls_cert_file = Some(pki.path("client.crt"));
    c.redis_tls_key_file = Some(pki.path("client.key"));
}

/// Posts `key` until it answers 201 (503 `store-unavailable` meanwhile), for at most 20 s.
async fn first_201(app: &idemgate::Running, key: &str) -> Answer {
    let client = client();
    let a = common::retry_until(
        Duration::from_secs(20),
        async || {
            let a = post(&client, app, "/pay", Some(key), "{}", &[]).await;
            assert!(matches!(a.status, 201 | 503), "{key}: {:?}", a.body);
            a
        },
        |a| a.status == 201,
    )
    .await;
    assert_eq!(a.status, 201, "{key}: no 201 within 20 s");
    a
}

/// Sentinels and data nodes that speak only TLS and want client certificates, the
/// sentinels given as `rediss://` URLs: a key executes once and replays; the primary is
/// killed, the sentinels promote the replica (over TLS among themselves), and idemgate
/// follows without a restart: a new key executes once, the old one still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_over_tls_and_a_failover() {
    let pki = Pki::new();
    let mut s = Sentinels::start_tls(1, &pki);
    let up = Upstream::start().await;
    let mut c = redis_base(&up);
    c.redis_sentinels = s
        .sentinels
        .iter()
        .map(|n| format!("rediss://localhost:{}", n.port))
        .collect();
    c.redis_sentinel_master = Some(MASTER.into());
    c.store_timeout = Duration::from_millis(1000);
    tls_files(&mut c, &pki);
    let app = spawn_app(c).await;
    one_key_executes_once(&app, &up).await;
    // The record is on the replica too before its primary dies.
    let replica = 1 - s.index_of(s.primary_port().unwrap());
    eventually(Duration::from_secs(10), "the record on the replica", || {
        s.data[replica]
            .cli(&["--scan", "--pattern", "idemgate:{*"])
            .is_some_and(|k| !k.trim().is_empty())
    })
    .await;
    let old = s.primary_port().unwrap();
    s.fail_over();
    assert_ne!(s.primary_port(), Some(old));
    let after = first_201(&app, "tls-after").await;
    let again = post(&client(), &app, "/pay", Some("tls-after"), "{}", &[]).await;
    assert!(again.replayed(), "{} {:?}", again.status, again.body);
    assert_eq!(again.body, after.body);
    let before = post(&client(), &app, "/pay", Some("tls-1"), "{\"a\":1}", &[]).await;
    assert!(before.replayed(), "{} {:?}", before.status, before.body);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

/// A cluster whose nodes speak only TLS (the cluster bus too) and want client
/// certificates, given one `rediss://` seed: the other nodes are found from the slot map
/// (by IP, which their certificate names) and keys of every primary execute once and
/// replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_over_tls() {
    let pki = Pki::new();
    let cluster = Cluster::start_tls(&pki);
    let up = Upstream::start().await;
    let mut c = redis_base(&up);
    c.redis_cluster_nodes = vec![format!("rediss://localhost:{}", cluster.nodes[0].port)];
    tls_files(&mut c, &pki);
    let app = spawn_app(c).await;
    one_key_executes_once(&app, &up).await;
    let client = client();
    const KEYS: usize = 30;
    for i in 0..KEYS {
        let a = post(&client, &app, "/pay", Some(&format!("c-{i}")), "{}", &[]).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    for i in 0..KEYS {
        let a = post(&client, &app, "/pay", Some(&format!("c-{i}")), "{}", &[]).await;
        assert!(a.replayed(), "c-{i}: {} {:?}", a.status, a.body);
    }
    assert_eq!(up.hits(), KEYS + 1);
    let per_primary = cluster.keys_per_primary();
    assert_eq!(per_primary.len(), 3, "{per_primary:?}");
    assert!(per_primary.iter().all(|(_, n)| *n > 0), "{per_primary:?}");
    app.shutdown().await;
}

/// A CA of rcgen's, and a certificate for `localhost` that it signs, valid from `from` to
/// `to` (years): PEM certificate, PEM key.
fn rcgen_ca() -> (rcgen::CertifiedIssuer<'static, rcgen::KeyPair>, String) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "idemgate test rcgen ca");
    let ca =
        rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
    let pem = ca.pem();
    (ca, pem)
}

fn rcgen_server(
    ca: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    years: (i32, i32),
) -> (String, String) {
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params.not_before = rcgen::date_time_ymd(years.0, 1, 1);
    params.not_after = rcgen::date_time_ymd(years.1, 1, 1);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, ca).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// The Redis that idemgate runs on is restarted with an expired certificate (same port,
/// same CA): the requests that then fail, and `/readyz`, say why in rustls' words, not
/// only that a store call timed out.
#[test]
fn an_expired_certificate_at_run_time_is_named_in_the_log_and_readyz() {
    let pki = Pki::new();
    let (ca, ca_pem) = rcgen_ca();
    let (cert, key) = rcgen_server(&ca, (2020, 2100));
    std::fs::write(pki.path("ca.crt"), &ca_pem).unwrap();
    std::fs::write(pki.path("server.crt"), cert).unwrap();
    std::fs::write(pki.path("server.key"), key).unwrap();
    let mut node = tls_node(&pki, false, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(Upstream::start());
    let ca_file = pki.path("ca.crt").display().to_string();
    let gate = Gate::start(
        &up.url(),
        &format!("rediss://localhost:{}/0", node.port),
        &[("IDEMGATE_REDIS_TLS_CA_FILE", ca_file.as_str())],
    );
    let first = rt.block_on(post_url(
        &client(),
        &gate.url("/pay"),
        Some("k-1"),
        "{}",
        &[],
    ));
    assert_eq!(first.status, 201, "{:?}", first.body);

    let (cert, key) = rcgen_server(&ca, (2020, 2021));
    std::fs::write(pki.path("server.crt"), cert).unwrap();
    std::fs::write(pki.path("server.key"), key).unwrap();
    node.restart_listening();
    let mut last = String::new();
    // rustls' words: "invalid peer certificate: certificate expired: verification time ...".
    let named = |s: &str| s.contains("invalid peer certificate: certificate expired");
    for i in 0..40 {
        let a = rt.block_on(post_url(
            &client(),
            &gate.url("/pay"),
            Some(&format!("after-{i}")),
            "{}",
            &[],
        ));
        assert_eq!(a.status, 503, "{:?}", a.body);
        last = http_get(gate.admin, "/readyz").unwrap_or_default();
        if named(&last) && named(&gate.log()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(last.starts_with("HTTP/1.1 503"), "{last}");
    assert!(named(&last), "/readyz: {last}");
    let log = gate.log();
    assert!(named(&log), "{log}");
    assert!(log.contains("Redis TLS failed"), "{log}");
    // Told at once, not after waiting out store_timeout (500 ms) on reconnection retries.
    let started = std::time::Instant::now();
    let a = rt.block_on(post_url(
        &client(),
        &gate.url("/pay"),
        Some("fast"),
        "{}",
        &[],
    ));
    assert_eq!(a.status, 503, "{:?}", a.body);
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(up.hits(), 1);
}

/// A `redis_url` whose password holds characters that URLs reserve does not parse: the
/// binary exits 64 saying to percent-encode the password or to give it in
/// `IDEMGATE_REDIS_PASSWORD`, and prints no part of it.
#[test]
fn an_unparseable_password_in_redis_url_exits_64_saying_what_to_do() {
    for password in ["s3cret#with/reserved", "s3cret/with?reserved"] {
        let url = format!("redis://idemgate:{password}@127.0.0.1:1/0");
        let (code, err) = start_up_failure(&[
            ("IDEMGATE_REDIS_URL", url.as_str()),
            ("IDEMGATE_NAMESPACE", NAMESPACE),
        ]);
        assert_eq!(code, Some(64), "{err}");
        assert!(err.contains("redis_url"), "{err}");
        assert!(err.contains("percent-encode"), "{err}");
        assert!(err.contains("IDEMGATE_REDIS_PASSWORD"), "{err}");
        for part in ["s3cret", "reserved"] {
            assert!(!err.contains(part), "{err}");
        }
    }
}
