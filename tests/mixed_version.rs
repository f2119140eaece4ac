//! A rolling upgrade: an instance of the previous release and one of this build on one
//! Redis, each retry sent to the other version. The previous release is built from this
//! repository's history (tests/setup/previous-release, the release before the changes to
//! record ids and fingerprints) by tests/setup/install.sh into the tests' cache
//! (~/.cache/idemgate-tests), once per machine; later runs and other clones reuse it.
//!
//! What must hold, as docs/production.md ("Namespaces and upgrades") says:
//! - a retry on this build of an operation the previous release ran is a replay, and an
//!   honest retry is never a 422 (records are compared in their own fingerprint version);
//! - a retry on the previous release of an operation this build ran (a fingerprint
//!   version it does not know) gets 409 `in-progress` with `Retry-After`, never a second
//!   execution and never a 422, and replays once it reaches an upgraded instance;
//! - what this build changed in record ids makes such a retry another record: it executes
//!   again, which is why the docs ask to let retries finish, or drain traffic to the old
//!   version, before switching. The test pins that for the tenant of a `tenant_jwt_claim`
//!   route (it now includes the key source and the issuer), so the docs cannot go stale.
//!   (Raw bytes outside ASCII, which the previous release re-encoded as other characters,
//!   change ids too; the previous release forwarded a mangled path for them anyway. So do
//!   escapes of reserved characters such as `%40`, which the scope now decodes.)
//! - on SQLite and PostgreSQL, with two namespaces on one store: the previous release opens
//!   a database this build migrated (the `namespace` column is added under the same schema
//!   version), and the records it writes, which carry no namespace, are seen by every
//!   namespace and released by another one's operator only with `?any_namespace=true`.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::PathBuf;

use common::*;

const SECRET: &str = "mixed-version-jwt-secret-0123456789abcdef";

/// The previous release (the last commit before record ids and fingerprints changed, named in
/// tests/setup/previous-release), built once per machine by the tests' shared set-up.
fn previous_binary() -> PathBuf {
    common::setup::previous_release()
}

/// `POST path` with `auth` and `key`: status and whether it was a replay.
async fn pay(
    c: &reqwest::Client,
    g: &Gate,
    path: &str,
    auth: &str,
    key: &str,
    body: &str,
) -> (u16, bool) {
    let (status, replayed, _) = pay_problem(c, g, path, auth, key, body).await;
    (status, replayed)
}

/// As [`pay`], with idemgate's problem name and whether a `Retry-After` came.
async fn pay_problem(
    c: &reqwest::Client,
    g: &Gate,
    path: &str,
    auth: &str,
    key: &str,
    body: &str,
) -> (u16, bool, Option<(String, bool)>) {
    let res = c
        .post(g.url(path))
        .header("authorization", auth)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let h = res.headers();
    let replayed = h.get("idempotent-replayed").is_some_and(|v| v == "true");
    let problem = h
        .get("idemgate-error")
        .and_then(|v| v.to_str().ok())
        .map(|p| (p.to_string(), h.contains_key("retry-after")));
    (res.status().as_u16(), replayed, problem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_across_a_rolling_upgrade() {
    let old_bin = previous_binary();
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let jwt = [
        ("IDEMGATE_JWT_HS256_SECRET", SECRET),
        // Only `/jwt` takes its tenant from the token; elsewhere, the header.
    ];
    let route = r#"[{path="/jwt", tenant_jwt_claim="sub"}]"#;
    let env = [jwt[0], ("IDEMGATE_ROUTES", route)];
    let old = Gate::start_binary(&old_bin, &up.url(), &redis.url(), &env);
    let new = Gate::start(&up.url(), &redis.url(), &env);
    let c = client();
    let auth = "Bearer acct-1";
    let body = r#"{"from":"acc-1","to":"acc-2","amount":1000}"#;
    let reordered = r#"{"amount":1000, "to":"acc-2","from":"acc-1"}"#;

    // A retry on the new version of what the old one ran: a replay, in the old one's
    // fingerprint version (a reordered JSON body was one request in both).
    let hits = up.hits();
    assert_eq!(
        pay(&c, &old, "/v1/transfers", auth, "a", body).await,
        (201, false)
    );
    assert_eq!(
        pay(&c, &new, "/v1/transfers", auth, "a", reordered).await,
        (201, true),
        "a retry on the new version of what the old one ran"
    );
    let path = "/v1/transfers?currency=EUR&memo=rent";
    assert_eq!(
        pay(&c, &old, path, auth, "a-query", body).await,
        (201, false)
    );
    assert_eq!(
        pay(&c, &new, path, auth, "a-query", body).await,
        (201, true)
    );
    // The other way: the old version does not know the new fingerprint version, so it
    // waits (409 in-progress, Retry-After), and the next retry on a new instance replays.
    assert_eq!(
        pay(&c, &new, "/v1/transfers", auth, "b", body).await,
        (201, false)
    );
    assert_eq!(
        pay_problem(&c, &old, "/v1/transfers", auth, "b", reordered).await,
        (409, false, Some(("in-progress".into(), true))),
        "a retry on the old version of what the new one ran"
    );
    assert_eq!(
        pay(&c, &new, "/v1/transfers", auth, "b", reordered).await,
        (201, true)
    );
    assert_eq!(up.hits(), hits + 3, "one execution per operation");

    // A record the old version made is compared in its own fingerprint version: another
    // body under its key is still a 422 on the new one, not a replay.
    assert_eq!(
        pay(&c, &old, "/v1/transfers", auth, "mismatch", body)
            .await
            .0,
        201
    );
    let other = r#"{"from":"acc-1","to":"acc-2","amount":9999}"#;
    assert_eq!(
        pay(&c, &new, "/v1/transfers", auth, "mismatch", other)
            .await
            .0,
        422
    );

    // What changed record ids, as the docs say: a retry across the upgrade is another
    // record and executes again.
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let token =
        common::idp::hs256_bearer(SECRET, &serde_json::json!({"sub": "acct-1", "exp": exp}));
    let hits = up.hits();
    assert_eq!(
        pay(&c, &old, "/jwt", &token, "jwt", body).await,
        (201, false)
    );
    assert_eq!(
        pay(&c, &new, "/jwt", &token, "jwt", body).await,
        (201, false)
    );
    assert_eq!(
        up.hits(),
        hits + 2,
        "a tenant_jwt_claim route across the upgrade"
    );
    // ... and within one version it is still one operation.
    assert_eq!(
        pay(&c, &new, "/jwt", &token, "jwt", body).await,
        (201, true)
    );
    assert_eq!(
        pay(&c, &old, "/jwt", &token, "jwt", body).await,
        (201, true)
    );
    // An ASCII path under the header tenant was not changed, including its escapes.
    let hits = up.hits();
    let escaped = "/v1/payees/jos%C3%A9";
    assert_eq!(
        pay(&c, &old, escaped, auth, "escaped", body).await,
        (201, false)
    );
    assert_eq!(
        pay(&c, &new, escaped, auth, "escaped", body).await,
        (201, true)
    );
    assert_eq!(up.hits(), hits + 1);
    // The escape of a reserved character is decoded now (`%40` and `@` are one account, as
    // every framework decodes them), so that spelling is another record across the upgrade:
    // it executes again, as docs/path-spellings.md says.
    let hits = up.hits();
    let reserved = "/v1/accounts/alice%40example.com/transfers";
    assert_eq!(
        pay(&c, &old, reserved, auth, "reserved", body).await,
        (201, false)
    );
    assert_eq!(
        pay(&c, &new, reserved, auth, "reserved", body).await,
        (201, false)
    );
    assert_eq!(
        up.hits(),
        hits + 2,
        "an escaped reserved character across the upgrade"
    );
    drop((old, new));
}

/// Switching a fleet to `redis_record_format = "value"` (docs/production.md): instances of
/// this build read both forms whichever they write, so hash-writing and value-writing ones
/// replay each other's records; an instance of a version that reads hashes only meets a
/// value record with Redis's `WRONGTYPE`, answers 503, and executes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_switching_to_value_records() {
    let old_bin = previous_binary();
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let old = Gate::start_binary(&old_bin, &up.url(), &redis.url(), &[]);
    let hash = Gate::start(&up.url(), &redis.url(), &[]);
    let value = Gate::start(
        &up.url(),
        &redis.url(),
        &[("IDEMGATE_REDIS_RECORD_FORMAT", "value")],
    );
    let c = client();
    let auth = "Bearer acct-1";
    let body = r#"{"from":"acc-1","to":"acc-2","amount":1000}"#;
    let path = "/v1/transfers";
    let hits = up.hits();

    // Hashes, by either version, replay on a value-writing instance.
    assert_eq!(pay(&c, &old, path, auth, "old", body).await, (201, false));
    assert_eq!(pay(&c, &value, path, auth, "old", body).await, (201, true));
    assert_eq!(pay(&c, &hash, path, auth, "hash", body).await, (201, false));
    assert_eq!(pay(&c, &value, path, auth, "hash", body).await, (201, true));
    // A value record replays on a hash-writing instance of this build ...
    assert_eq!(
        pay(&c, &value, path, auth, "value", body).await,
        (201, false)
    );
    assert_eq!(pay(&c, &hash, path, auth, "value", body).await, (201, true));
    assert_eq!(
        pay(&c, &value, path, auth, "value", body).await,
        (201, true)
    );
    // ... and the previous version refuses it rather than running it again.
    let (status, replayed, problem) = pay_problem(&c, &old, path, auth, "value", body).await;
    assert_eq!((status, replayed), (503, false), "{problem:?}");
    let other = r#"{"from":"acc-1","to":"acc-2","amount":9999}"#;
    assert_eq!(pay(&c, &hash, path, auth, "value", other).await.0, 422);
    assert_eq!(up.hits(), hits + 3, "one execution per operation");
    drop((old, hash, value));
}

/// The SQL stores across the upgrade that keeps each record's namespace, with two
/// namespaces on one store: the previous release opens the database this build migrated
/// (the column is added under the same schema version), both versions replay each other's
/// records, and a record the previous release wrote carries no namespace: every namespace
/// sees it (`namespace: null`), and another namespace's operator cannot release it without
/// `?any_namespace=true`.
async fn sql_store_across_the_namespace_upgrade(store: &[(&str, &str)]) {
    let old_bin = previous_binary();
    let up = Upstream::start().await;
    let env = |namespace| {
        let mut env = store.to_vec();
        env.push(("IDEMGATE_NAMESPACE", namespace));
        env
    };
    // The previous release makes the schema, this build migrates it, and the previous
    // release opens it again once migrated.
    let old = Gate::start_binary(&old_bin, &up.url(), "", &env("alpha"));
    let alpha = Gate::start(&up.url(), "", &env("alpha"));
    let beta = Gate::start(&up.url(), "", &env("beta"));
    let reopened = Gate::start_binary(&old_bin, &up.url(), "", &env("alpha"));
    let c = client();
    let (auth, body, path) = ("Bearer acct-1", r#"{"amount":1000}"#, "/v1/transfers");

    assert_eq!(pay(&c, &old, path, auth, "old", body).await, (201, false));
    assert_eq!(pay(&c, &alpha, path, auth, "old", body).await, (201, true));
    assert_eq!(pay(&c, &alpha, path, auth, "new", body).await, (201, false));
    // The previous release, on the migrated database: a replay of its own record, and
    // for this build's (a fingerprint version it does not know) a wait, never a second
    // execution.
    assert_eq!(
        pay(&c, &reopened, path, auth, "old", body).await,
        (201, true)
    );
    assert_eq!(
        pay_problem(&c, &reopened, path, auth, "new", body).await,
        (409, false, Some(("in-progress".into(), true)))
    );
    assert_eq!(up.hits(), 2, "one execution per operation");

    let list = async |g: &Gate| -> Vec<serde_json::Value> {
        let page: serde_json::Value = c
            .get(g.admin_url("/records"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        page["records"].as_array().cloned().unwrap_or_default()
    };
    let theirs = list(&beta).await;
    assert_eq!(
        theirs.len(),
        1,
        "beta sees the unscoped record alone: {theirs:?}"
    );
    assert_eq!(theirs[0]["namespace"], serde_json::Value::Null);
    let mine = list(&alpha).await;
    assert_eq!(mine.len(), 2, "{mine:?}");
    assert!(mine.iter().any(|r| r["namespace"] == "alpha"), "{mine:?}");
    let unscoped = theirs[0]["id"].as_str().unwrap();
    let refused = c
        .delete(beta.admin_url(&format!(
            "/records/{unscoped}?completed=true&reason=test+releases+it"
        )))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    assert_eq!(refused, 409);
    assert_eq!(pay(&c, &old, path, auth, "old", body).await, (201, true));
    assert_eq!(up.hits(), 2);
    drop((old, alpha, beta, reopened));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_across_the_namespace_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    sql_store_across_the_namespace_upgrade(&[("IDEMGATE_STORE_PATH", path)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_across_the_namespace_upgrade() {
    let pg = tokio::task::spawn_blocking(common::postgres::PgServer::start)
        .await
        .unwrap();
    let url = pg.fresh_db().await;
    sql_store_across_the_namespace_upgrade(&[("IDEMGATE_POSTGRES_URL", &url)]).await;
}
