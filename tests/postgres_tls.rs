//! idemgate on PostgreSQL over TLS, through the real binary, against a server of the
//! test's own with `ssl = on` that serves TCP over TLS only (no plain `host` line in its
//! pg_hba.conf) and wants a client certificate from one role (`clientcert=verify-full`).
//! Certificates are made per test binary with rcgen: the server's is for 127.0.0.1 and
//! `db.idemgate.test`, signed by a CA of its own.
//!
//! verify-full with the right CA (URL form, and the settings form with a DNS name) executes
//! once and replays; a wrong CA, and a wrong name under verify-full, stop start-up with
//! rustls' reason; verify-ca takes a certificate for another name; require encrypts,
//! warns, and with a root certificate verifies the chain; a client certificate where the
//! server wants one; a certificate that fails after start-up is logged as a TLS failure;
//! conflicts, half pairs and unreadable files are exit 64 naming the key.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use common::certs::{Ca, Dir};
use common::postgres::{PgServer, Ssl};
use common::{retry_until, start_up_failure, Gate, Upstream};

/// The role whose connections must present a certificate (CN = the role).
const CERT_ROLE: &str = "certuser";

/// The names the server's certificate is for.
const SERVER_NAMES: [&str; 2] = ["127.0.0.1", "db.idemgate.test"];

/// The TLS server this binary's tests share, and the files they point idemgate at.
struct Shared {
    pg: PgServer,
    /// `ca.pem` (the server's CA, which also signed the client certificate),
    /// `other-ca.pem`, `client.crt` and `client.key` (CN = [`CERT_ROLE`]).
    files: Dir,
}

impl Shared {
    fn file(&self, name: &str) -> String {
        self.files.path(name).to_str().unwrap().to_string()
    }
}

fn shared() -> Arc<Shared> {
    static SHARED: Mutex<Weak<Shared>> = Mutex::new(Weak::new());
    let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = slot.upgrade() {
        return s;
    }
    let ca = Ca::new("idemgate test postgres ca");
    let server = ca.leaf(&SERVER_NAMES);
    let client = ca.leaf_with(&[], |p| {
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, CERT_ROLE);
    });
    let files = Dir::new();
    files.write("ca.pem", &ca.pem());
    files.write("other-ca.pem", &Ca::new("another ca").pem());
    files.write("client.crt", &client.cert);
    files.write("client.key", &client.key);
    let pg = PgServer::start_ssl(&Ssl {
        cert: &server.cert,
        key: &server.key,
        client_ca: Some(&ca.pem()),
        client_cert_role: Some(CERT_ROLE),
    });
    pg.psql(
        "postgres",
        &format!("CREATE ROLE {CERT_ROLE} LOGIN SUPERUSER"),
    );
    let s = Arc::new(Shared { pg, files });
    *slot = Arc::downgrade(&s);
    s
}

async fn setup() -> (Arc<Shared>, String) {
    let s = tokio::task::spawn_blocking(shared).await.unwrap();
    let url = s.pg.fresh_db().await;
    (s, url)
}

/// The fresh database's name, from its TCP URL.
fn db_of(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

fn start(up: &Upstream, url: &str, env: &[(&str, &str)]) -> Gate {
    let mut all = vec![("IDEMGATE_POSTGRES_URL", url)];
    all.extend_from_slice(env);
    Gate::start(&up.url(), "", &all)
}

/// Runs the binary to its exit: its code and its log.
fn exits(up: &Upstream, url: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut all = vec![("IDEMGATE_POSTGRES_URL", url)];
    all.extend_from_slice(env);
    Gate::run_to_exit(&up.url(), "", &all)
}

async fn post(g: &Gate, key: &str) -> common::Answer {
    common::post_url(
        &common::client(),
        &g.url("/pay"),
        Some(key),
        "{\"amount\":1}",
        &[],
    )
    .await
}

/// One key executes once and replays.
async fn executes_once_and_replays(g: &Gate, up: &Upstream, key: &str) {
    let first = post(g, key).await;
    assert_eq!(first.status, 201, "{:?}\n{}", first.body, g.log());
    let again = post(g, key).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "{}", g.log());
    assert_eq!(again.body, first.body);
    assert_eq!(up.hits(), 1);
}

/// How idemgate's connections to database `db` are protected, as the server sees them:
/// the TLS version of each (empty: none open).
fn idemgate_tls(s: &Shared, db: &str) -> String {
    s.pg.psql(
        db,
        "SELECT coalesce(string_agg(coalesce(s.version, 'plain'), ','), '') FROM pg_stat_activity a \
         JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'idemgate' AND s.ssl",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_right_ca_executes_once_and_replays() {
    let (s, url) = setup().await;
    let up = Upstream::start().await;
    let db = db_of(&url).to_string();
    // The URL form, the host an IP address (checked against the certificate's IP SAN).
    let url = format!("{url}?sslmode=verify-full&sslrootcert={}", s.file("ca.pem"));
    let g = start(&up, &url, &[]);
    executes_once_and_replays(&g, &up, "full-1").await;
    let tls = idemgate_tls(&s, &db);
    assert!(tls.starts_with("TLSv1.3"), "{tls:?}");
    assert!(!g.log().contains("not verified"), "{}", g.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_form_verifies_a_dns_name() {
    let (s, url) = setup().await;
    let up = Upstream::start().await;
    let db = db_of(&url).to_string();
    // The name is checked, the address dialled (`hostaddr`): no resolver involved.
    let url = format!(
        "host=db.idemgate.test hostaddr=127.0.0.1 port={} user=postgres dbname={db} sslmode=verify-full",
        s.pg.port
    );
    let ca = s.file("ca.pem");
    let g = start(&up, &url, &[("IDEMGATE_POSTGRES_TLS_CA_FILE", &ca)]);
    executes_once_and_replays(&g, &up, "settings-1").await;
    assert!(!idemgate_tls(&s, &db).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_stops_start_up_with_the_tls_reason() {
    let (s, url) = setup().await;
    let up = Upstream::start().await;
    let other = s.file("other-ca.pem");
    for mode in ["verify-full", "verify-ca", "require"] {
        // `require` with a root certificate verifies the chain, as libpq does.
        let (code, log) = exits(
            &up,
            &format!("{url}?sslmode={mode}"),
            &[("IDEMGATE_POSTGRES_TLS_CA_FILE", &other)],
        );
        assert_eq!(code, Some(69), "{mode}: {log}");
        assert!(
            log.contains("TLS failed") && log.contains("UnknownIssuer"),
            "{mode}: {log}"
        );
    }
    assert_eq!(up.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_name_stops_verify_full_and_verify_ca_takes_it() {
    let (s, url) = setup().await;
    let up = Upstream::start().await;
    let db = db_of(&url).to_string();
    let wrong = |mode: &str| {
        format!(
            "postgres://postgres@other.idemgate.test:{}/{db}?hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={}",
            s.pg.port,
            s.file("ca.pem")
        )
    };
    let (code, log) = exits(&up, &wrong("verify-full"), &[]);
    assert_eq!(code, Some(69), "{log}");
    assert!(
        log.contains("TLS failed") && log.contains("not valid for name"),
        "{log}"
    );
    // The chain is verified, the name is not.
    let g = start(&up, &wrong("verify-ca"), &[]);
    executes_once_and_replays(&g, &up, "ca-1").await;
    assert!(!idemgate_tls(&s, &db).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_encrypts_without_verifying_and_warns() {
    let (s, url) = setup().await;
    let up = Upstream::start().await;
    let db = db_of(&url).to_string();
    // No CA anywhere: the system's roots do not know this server's, so only a server that
    // is not verified at all is reached. The server takes TCP over TLS only.
    let g = start(&up, &format!("{url}?sslmode=require"), &[]);
    executes_once_and_replays(&g, &up, "require-1").await;
    assert!(!idemgate_tls(&s, &db).is_empty());
    let log = g.log();
    assert!(
        log.contains("sslmode=require") && log.contains("not verified"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_requiring_a_client_certificate() {
    let (s, url) = setup().await;
    let up = Upstream::start().await;
    let db = db_of(&url).to_string();
    let base = format!(
        "postgres://{CERT_ROLE}@127.0.0.1:{}/{db}?sslmode=verify-full&sslrootcert={}",
        s.pg.port,
        s.file("ca.pem")
    );
    // Without one: the server refuses the connection after the handshake.
    let (code, log) = exits(&up, &base, &[]);
    assert_eq!(code, Some(69), "{log}");
    assert!(log.contains("certificate"), "{log}");
    // With one, in the URL (sslcert, sslkey).
    let with = format!(
        "{base}&sslcert={}&sslkey={}",
        s.file("client.crt"),
        s.file("client.key")
    );
    let g = start(&up, &with, &[]);
    executes_once_and_replays(&g, &up, "client-1").await;
    drop(g);
    // With one, in the settings.
    let (cert, key) = (s.file("client.crt"), s.file("client.key"));
    let g = start(
        &up,
        &base,
        &[
            ("IDEMGATE_POSTGRES_TLS_CERT_FILE", &cert),
            ("IDEMGATE_POSTGRES_TLS_KEY_FILE", &key),
        ],
    );
    let again = post(&g, "client-1").await;
    assert!(again.replayed(), "{}", g.log());
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_that_fails_after_start_up_is_logged_as_tls() {
    // A server of this test's own: it is restarted with another certificate.
    let ca = Ca::new("runtime ca");
    let good = ca.leaf(&SERVER_NAMES);
    let pg = tokio::task::spawn_blocking(move || {
        PgServer::start_ssl(&Ssl {
            cert: &good.cert,
            key: &good.key,
            client_ca: None,
            client_cert_role: None,
        })
    })
    .await
    .unwrap();
    let files = Dir::new();
    let ca_file = files.write("ca.pem", &ca.pem());
    let up = Upstream::start().await;
    let url = format!("{}?sslmode=verify-full", pg.url("postgres"));
    let g = start(&up, &url, &[("IDEMGATE_POSTGRES_TLS_CA_FILE", &ca_file)]);
    assert_eq!(post(&g, "before").await.status, 201);
    let expired = ca.leaf_with(&SERVER_NAMES, |p| {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    });
    pg.write_ssl(&expired.cert, &expired.key);
    let _pg = tokio::task::spawn_blocking(move || {
        pg.restart();
        pg
    })
    .await
    .unwrap();
    retry_until(
        Duration::from_secs(15),
        async || post(&g, &format!("after-{}", up.hits())).await,
        |a| {
            assert_eq!(a.status, 503, "{:?}\n{}", a.body, g.log());
            g.log().contains("TLS failed")
        },
    )
    .await;
    assert!(
        g.log().contains("TLS failed"),
        "no TLS failure logged:\n{}",
        g.log()
    );
    let log = g.log();
    assert!(log.contains("certificate expired"), "{log}");
    assert_eq!(up.hits(), 1);
}

// --- Start-up refusals: no server needed -------------------------------------------------

/// Variables, the key an error names, and words of its reason.
type Case<'a> = (Vec<(&'a str, String)>, &'a str, &'a str);

fn refused(env: &[(&str, &str)]) -> String {
    let mut all = vec![("IDEMGATE_NAMESPACE", "pgtls")];
    all.extend_from_slice(env);
    let (code, err) = start_up_failure(&all);
    assert_eq!(code, Some(64), "{env:?}: {err}");
    assert!(!err.contains("hunter2"), "{err}");
    err
}

#[test]
fn conflicts_half_pairs_and_bad_files_are_exit_64_naming_the_key() {
    let ca = Ca::new("ca");
    let (a, b) = (ca.leaf(&["127.0.0.1"]), ca.leaf(&["127.0.0.1"]));
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let other_ca = dir.write("other.pem", &ca.pem());
    let cert = dir.write("a.crt", &a.cert);
    let key = dir.write("a.key", &a.key);
    let wrong_key = dir.write("b.key", &b.key);
    let missing = dir.path("missing.pem").to_str().unwrap().to_string();
    let url = "postgres://app:hunter2@127.0.0.1:1/x?sslmode=verify-full";
    let url_with = |extra: &str| format!("{url}&{extra}");
    // The variables, the key the error names, and what it says.
    let cases: Vec<Case> = vec![
        // A key and a different URL parameter for the same file.
        (
            vec![
                (
                    "IDEMGATE_POSTGRES_URL",
                    url_with(&format!("sslrootcert={other_ca}")),
                ),
                ("IDEMGATE_POSTGRES_TLS_CA_FILE", ca_file.clone()),
            ],
            "`postgres_tls_ca_file`",
            "conflicts with sslrootcert",
        ),
        (
            vec![
                (
                    "IDEMGATE_POSTGRES_URL",
                    url_with(&format!("sslkey={wrong_key}")),
                ),
                ("IDEMGATE_POSTGRES_TLS_CERT_FILE", cert.clone()),
                ("IDEMGATE_POSTGRES_TLS_KEY_FILE", key.clone()),
            ],
            "`postgres_tls_key_file`",
            "conflicts with sslkey",
        ),
        // Half a pair, in the settings and in the URL.
        (
            vec![
                ("IDEMGATE_POSTGRES_URL", url.to_string()),
                ("IDEMGATE_POSTGRES_TLS_CERT_FILE", cert.clone()),
            ],
            "`postgres_tls_key_file`",
            "required with postgres_tls_cert_file",
        ),
        (
            vec![("IDEMGATE_POSTGRES_URL", url_with(&format!("sslkey={key}")))],
            "`postgres_url`",
            "required with sslkey in postgres_url",
        ),
        // A key that is not the certificate's.
        (
            vec![
                ("IDEMGATE_POSTGRES_URL", url.to_string()),
                ("IDEMGATE_POSTGRES_TLS_CERT_FILE", cert.clone()),
                ("IDEMGATE_POSTGRES_TLS_KEY_FILE", wrong_key.clone()),
            ],
            "`postgres_tls_key_file`",
            "does not belong to the certificate",
        ),
        // Files that cannot be read.
        (
            vec![
                ("IDEMGATE_POSTGRES_URL", url.to_string()),
                ("IDEMGATE_POSTGRES_TLS_CA_FILE", missing.clone()),
            ],
            "`postgres_tls_ca_file`",
            "cannot read",
        ),
        (
            vec![(
                "IDEMGATE_POSTGRES_URL",
                url_with(&format!("sslrootcert={missing}")),
            )],
            "`postgres_url`",
            "sslrootcert: cannot read",
        ),
        // No silent fallback to plain text.
        (
            vec![(
                "IDEMGATE_POSTGRES_URL",
                "postgres://app:hunter2@127.0.0.1:1/x?sslmode=prefer".to_string(),
            )],
            "`postgres_url`",
            "falls back to plain text",
        ),
        // TLS files with TLS off.
        (
            vec![
                (
                    "IDEMGATE_POSTGRES_URL",
                    "postgres://app:hunter2@127.0.0.1:1/x".to_string(),
                ),
                ("IDEMGATE_POSTGRES_TLS_CA_FILE", ca_file.clone()),
            ],
            "`postgres_tls_ca_file`",
            "TLS is off",
        ),
        // A TLS key without PostgreSQL.
        (
            vec![("IDEMGATE_POSTGRES_TLS_CA_FILE", ca_file.clone())],
            "`postgres_tls_ca_file`",
            "no postgres_url",
        ),
    ];
    for (env, key, why) in &cases {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let err = refused(&env);
        assert!(err.contains(key) && err.contains(why), "{env:?}: {err}");
    }
    // The same file in both places is no conflict: start-up gets as far as the network
    // (nothing listens on port 1: exit 69, unreachable).
    let (code, err) = start_up_failure(&[
        ("IDEMGATE_NAMESPACE", "pgtls"),
        (
            "IDEMGATE_POSTGRES_URL",
            &url_with(&format!("sslrootcert={ca_file}")),
        ),
        ("IDEMGATE_POSTGRES_TLS_CA_FILE", &ca_file),
    ]);
    assert_eq!(code, Some(69), "{err}");
}
