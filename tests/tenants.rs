//! Who the tenant is, through the binary: on a route without a tenant setting the
//! credential in `Authorization`, in `X-Api-Key`, or in both, so that an API that
//! authenticates with `X-Api-Key` is protected by default and its merchants stay apart;
//! and a principal refined by `tenant_qualifier_headers`, so that a platform's sellers on
//! one token stay apart.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::{client, post_url, Idemgate, Upstream};
use idemgate::config::Anonymous;

const PAYMENT: &str = r#"{"amount":1000,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_alone_is_a_tenant_and_two_keys_are_two() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| c.defaults.anonymous = Anonymous::Refuse)
        .binary();
    let c = client();
    let url = format!("http://{}/payments", g.addr);
    let send = |key, headers| post_url(&c, &url, Some(key), PAYMENT, headers);
    let m1: &[(&str, &str)] = &[("X-API-KEY", "merchant-1")];
    let m2: &[(&str, &str)] = &[("x-api-key", "merchant-2")];
    let first = send("pay-1", m1).await;
    assert_eq!(first.status, 201, "{}", g.log());
    let retry = send("pay-1", &[("x-api-key", "merchant-1")]).await;
    assert!(retry.replayed(), "the retry replays");
    assert_eq!(retry.body, first.body);
    assert_eq!(up.hits(), 1);
    // Another merchant's key is another tenant: its payment runs, and its retry replays
    // its own answer.
    let other = send("pay-1", m2).await;
    assert!(!other.replayed());
    assert_ne!(other.body, first.body);
    assert!(send("pay-1", m2).await.replayed());
    assert_eq!(up.hits(), 2);
    // Without either header: refused, nothing forwarded.
    let none = send("pay-1", &[]).await;
    assert_eq!(none.status, 400);
    assert!(none.problem_type().ends_with("/missing-tenant"));
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_with_an_api_key_is_another_tenant_than_authorization_alone() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| c.defaults.anonymous = Anonymous::Refuse)
        .binary();
    let c = client();
    let url = format!("http://{}/payments", g.addr);
    let auth = [("authorization", "Bearer tok")];
    let both = [("authorization", "Bearer tok"), ("x-api-key", "merchant-1")];
    let alone = post_url(&c, &url, Some("pay-2"), PAYMENT, &auth).await;
    assert_eq!(alone.status, 201, "{}", g.log());
    assert!(post_url(
        &c,
        &url,
        Some("pay-2"),
        PAYMENT,
        &[("authorization", "bearer tok")]
    )
    .await
    .replayed());
    let with_key = post_url(&c, &url, Some("pay-2"), PAYMENT, &both).await;
    assert_eq!(with_key.status, 201);
    assert!(
        !with_key.replayed(),
        "the two headers together are another tenant"
    );
    let retry = post_url(&c, &url, Some("pay-2"), PAYMENT, &both).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, with_key.body);
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_platform_s_sellers_on_one_token_are_two_tenants() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.anonymous = Anonymous::Refuse;
            c.defaults.tenant_qualifier_headers = vec!["PayPal-Auth-Assertion".into()];
        })
        .binary();
    let c = client();
    let url = format!("http://{}/v2/checkout/orders", g.addr);
    let token = ("authorization", "Bearer platform-token");
    let seller_a = [token, ("paypal-auth-assertion", "seller-a")];
    let seller_b = [token, ("paypal-auth-assertion", "seller-b")];
    let a = post_url(&c, &url, Some("order-1"), PAYMENT, &seller_a).await;
    let b = post_url(&c, &url, Some("order-1"), PAYMENT, &seller_b).await;
    assert_eq!((a.status, b.status), (201, 201), "{}", g.log());
    assert!(
        !b.replayed(),
        "seller B's order is created, not A's replayed"
    );
    assert_ne!(a.body, b.body);
    assert_eq!(up.hits(), 2);
    let a2 = post_url(&c, &url, Some("order-1"), PAYMENT, &seller_a).await;
    let b2 = post_url(&c, &url, Some("order-1"), PAYMENT, &seller_b).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!((a2.body, b2.body), (a.body, b.body));
    // The token without a seller is the platform acting for itself: another tenant.
    let own = post_url(&c, &url, Some("order-1"), PAYMENT, &[token]).await;
    assert!(!own.replayed());
    assert_eq!(up.hits(), 3);
}

/// Clients of `shop-a` (resolved to `addr`) over HTTP/1.1 and over h2c with prior knowledge.
fn clients(addr: std::net::SocketAddr) -> (reqwest::Client, reqwest::Client) {
    let h1 = reqwest::Client::builder().resolve("shop-a", addr);
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .resolve("shop-a", addr);
    (h1.build().unwrap(), h2.build().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_over_http1_and_authority_over_h2_are_one_tenant() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.anonymous = Anonymous::Refuse;
            c.defaults.tenant_headers = vec!["Authorization".into(), "Host".into()];
        })
        .binary();
    let (h1, h2) = clients(g.addr);
    // `Host: shop-a:<port>` over HTTP/1.1, `:authority: shop-a:<port>` over h2.
    let url = format!("http://shop-a:{}/pay", g.addr.port());
    let auth = [("authorization", "Bearer t")];
    let first = post_url(&h1, &url, Some("host-1"), PAYMENT, &auth).await;
    assert_eq!(first.status, 201, "{}", g.log());
    let retry = post_url(&h2, &url, Some("host-1"), PAYMENT, &auth).await;
    assert!(retry.replayed(), "{} {:?}", retry.status, retry.body);
    // And the other way round.
    let first = post_url(&h2, &url, Some("host-2"), PAYMENT, &auth).await;
    assert_eq!(first.status, 201);
    assert!(post_url(&h1, &url, Some("host-2"), PAYMENT, &auth)
        .await
        .replayed());
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_cookie_line_and_h2_cookie_fields_are_one_tenant() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.anonymous = Anonymous::Refuse;
            c.defaults.tenant_headers = vec!["Cookie".into()];
        })
        .binary();
    let (h1, h2) = clients(g.addr);
    let url = format!("http://shop-a:{}/pay", g.addr.port());
    // As browsers send them over h2: one field per cookie.
    let crumbs = [("cookie", "session=s1"), ("cookie", "cart=c9")];
    let first = post_url(&h2, &url, Some("cookie-1"), PAYMENT, &crumbs).await;
    assert_eq!(first.status, 201, "{}", g.log());
    let line = [("cookie", "session=s1; cart=c9")];
    let retry = post_url(&h1, &url, Some("cookie-1"), PAYMENT, &line).await;
    assert!(retry.replayed(), "{} {:?}", retry.status, retry.body);
    assert_eq!(up.hits(), 1);
    // The HTTP/1.1 upstream got the one line the tenant was read from.
    let seen = up.seen();
    assert_eq!(
        seen[0].headers["cookie"],
        vec!["session=s1; cart=c9".to_string()]
    );
}
