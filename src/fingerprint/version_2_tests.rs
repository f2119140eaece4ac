use super::*;
use proptest::prelude::*;
use std::io::Write;

fn with_query(q: Option<&str>, order: QueryOrder) -> Fingerprint {
    let parts = RequestParts {
        method: "POST",
        path: "/p",
        query: q,
        content_type: Some("application/json"),
        body: b"{}",
        ..RequestParts::default()
    };
    fingerprint_with(
        &parts,
        &Rules {
            query_order: order,
            ..Rules::default()
        },
    )
}

fn sorted(q: Option<&str>) -> Fingerprint {
    with_query(q, QueryOrder::Sorted)
}

#[test]
fn queries_compare_as_sorted_pairs() {
    assert_eq!(sorted(Some("a=1&b=2")), sorted(Some("b=2&a=1")));
    assert_eq!(sorted(Some("a=%31&b=x+y")), sorted(Some("b=x%20y&a=1")));
    assert_ne!(sorted(Some("a=1&a=2")), sorted(Some("a=2&a=1")));
    assert_ne!(sorted(Some("a=1")), sorted(Some("a=2")));
    assert_eq!(sorted(Some("")), sorted(None));
    assert_ne!(sorted(Some("a")), sorted(None));
    let significant = |q| with_query(Some(q), QueryOrder::Significant);
    assert_ne!(significant("a=1&b=2"), significant("b=2&a=1"));
    assert_eq!(significant("a=%31"), significant("a=1"));
    assert_eq!(with_query(Some(""), QueryOrder::Significant), sorted(None));
    // A query already in order is the same request under either setting.
    assert_eq!(significant("a=1&b=2"), sorted(Some("b=2&a=1")));
}

#[test]
fn a_version_1_record_compares_in_version_1() {
    // The running fleet's records: an identical retry matches in version 1, a
    // reordered one does not (only for records made before the upgrade).
    let parts = |q| RequestParts {
        method: "POST",
        path: "/p",
        query: Some(q),
        content_type: Some("application/json"),
        body: b"{}",
        ..RequestParts::default()
    };
    let rules = Rules::default();
    let recorded = fingerprint_as(1, &parts("a=1&b=2"), &rules);
    assert_eq!(fingerprint_as(1, &parts("a=1&b=2"), &rules), recorded);
    assert_ne!(fingerprint_as(1, &parts("b=2&a=1"), &rules), recorded);
    // Under version 2 both are one request, and never equal a version-1 digest.
    let v2 = fingerprint_as(2, &parts("a=1&b=2"), &rules);
    assert_eq!(fingerprint_as(2, &parts("b=2&a=1"), &rules), v2);
    assert_ne!(v2, recorded);
}

fn multipart(boundary: &str, amount: &str) -> (String, Vec<u8>) {
    let ct = format!("multipart/form-data; boundary={boundary}");
    let body = multipart::tests::body(
        boundary,
        &[
            ("Content-Disposition: form-data; name=\"amount\"", amount),
            (
                "Content-Disposition: form-data; name=\"f\"; filename=\"a.csv\"\r\nContent-Type: text/csv",
                "x,y\r\n1,2",
            ),
        ],
    );
    (ct, body)
}

/// A `POST /p` with this content type and body.
fn post<'a>(ct: &'a str, body: &'a [u8]) -> RequestParts<'a> {
    RequestParts {
        method: "POST",
        path: "/p",
        content_type: Some(ct),
        body,
        ..RequestParts::default()
    }
}

fn fp_of(ct: &str, body: &[u8]) -> Fingerprint {
    fingerprint(&post(ct, body), &[])
}

#[test]
fn multipart_compares_by_parts() {
    let (ct1, b1) = multipart("----a1", "100");
    let (ct2, b2) = multipart("xyz", "100");
    let (ct3, b3) = multipart("xyz", "101");
    assert_ne!(b1, b2);
    assert_eq!(fp_of(&ct1, &b1), fp_of(&ct2, &b2));
    assert_ne!(fp_of(&ct1, &b1), fp_of(&ct3, &b3));
    // Malformed (a boundary that is not the body's, none at all): raw bytes.
    assert_ne!(
        fp_of("multipart/form-data; boundary=q", &b1),
        fp_of(&ct1, &b1)
    );
    assert_eq!(
        fp_of("multipart/form-data; boundary=q", &b1),
        fp_of("multipart/form-data", &b1)
    );
    assert_ne!(
        fp_of("multipart/form-data; boundary=q", &b1),
        fp_of("multipart/form-data; boundary=q", &b2)
    );
    // Version 1 compared them raw.
    let v1 = |ct: &str, body: &[u8]| fingerprint_as(1, &post(ct, body), &Rules::default());
    assert_ne!(v1(&ct1, &b1), v1(&ct2, &b2));
}

fn gzip(data: &[u8], mtime: u32) -> Vec<u8> {
    let mut e = flate2::GzBuilder::new()
        .mtime(mtime)
        .write(Vec::new(), flate2::Compression::default());
    e.write_all(data).expect("write");
    e.finish().expect("finish")
}

fn coded(encoding: Option<&str>, body: &[u8]) -> Fingerprint {
    let decoded = match decode_content(encoding, body, 1 << 20).expect("within limit") {
        Decoded::Content(c) => Some(c),
        Decoded::Identity | Decoded::Raw => None,
    };
    fingerprint(
        &RequestParts {
            method: "POST",
            path: "/p",
            content_type: Some("application/json"),
            content_encoding: encoding,
            body,
            decoded: decoded.as_deref(),
            ..RequestParts::default()
        },
        &[],
    )
}

#[test]
fn coded_bodies_compare_by_content() {
    let json = br#"{"amount":100,"to":"x"}"#;
    let plain = coded(None, json);
    assert_eq!(coded(Some("gzip"), &gzip(json, 1)), plain);
    assert_eq!(coded(Some("gzip"), &gzip(json, 2)), plain);
    // Canonicalized as the same body unencoded would be.
    let respelled = br#"{ "to": "x", "amount": 1e2 }"#;
    assert_eq!(coded(Some("GZIP"), &gzip(respelled, 5)), plain);
    assert_ne!(coded(Some("gzip"), &gzip(br#"{"amount":101}"#, 1)), plain);
    // Unknown codings and bodies that do not decode: raw, never equal to the same bytes
    // unencoded.
    assert_ne!(coded(Some("zstd"), json), coded(None, json));
    assert_ne!(coded(Some("gzip"), json), coded(None, json));
    assert_eq!(coded(Some("zstd"), json), coded(Some(" ZSTD"), json));
    assert_eq!(coded(Some("identity"), json), plain);
}

fn pair() -> impl Strategy<Value = (String, String)> {
    ("[a-c%+]{0,3}", "[0-2%+ =]{0,3}")
}

proptest! {
    /// Moving pairs of different names around never changes a sorted query's
    /// fingerprint; the relative order of each name's values is all that counts.
    #[test]
    fn reordering_distinct_names_keeps_the_fingerprint(
        pairs in prop::collection::vec(pair(), 0..6),
        seed in any::<u64>(),
    ) {
        let q = |ps: &[(String, String)]| {
            ps.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
        };
        // A stable sort by the decoded name of a permutation gives the same list.
        let mut shuffled: Vec<(usize, (String, String))> =
            pairs.iter().cloned().enumerate().collect();
        let mut s = seed;
        for i in (1..shuffled.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let j = (s >> 33) as usize % (i + 1);
            shuffled.swap(i, j);
        }
        // Restore each name's own order: only pairs of different names moved.
        let name = |k: &str| form::canonicalize(format!("{k}=").as_bytes());
        let mut by_name: std::collections::BTreeMap<Vec<u8>, Vec<usize>> = Default::default();
        for (i, (k, _)) in pairs.iter().enumerate() {
            by_name.entry(name(k)).or_default().push(i);
        }
        let mut next: std::collections::BTreeMap<Vec<u8>, usize> = Default::default();
        let reordered: Vec<(String, String)> = shuffled
            .iter()
            .map(|(_, (k, _))| {
                let n = name(k);
                let slot = next.entry(n.clone()).or_default();
                let i = by_name[&n][*slot];
                *slot += 1;
                pairs[i].clone()
            })
            .collect();
        prop_assert_eq!(sorted(Some(&q(&pairs))), sorted(Some(&q(&reordered))));
    }

    /// Any gzip header (mtime) and level give the content's fingerprint.
    #[test]
    fn gzip_is_its_content(body in prop::collection::vec(any::<u8>(), 0..200), mtime in any::<u32>()) {
        prop_assert_eq!(coded(Some("gzip"), &gzip(&body, mtime)), coded(None, &body));
    }

    /// A multipart body fingerprints the same under any boundary that does not occur
    /// in its parts.
    #[test]
    fn any_boundary_gives_the_same_parts(amount in "[0-9]{1,6}", a in "[a-zA-Z0-9]{1,20}", b in "[a-zA-Z0-9]{1,20}") {
        let (ct1, b1) = multipart(&format!("=_{a}"), &amount);
        let (ct2, b2) = multipart(&format!("=_{b}"), &amount);
        prop_assert_eq!(fp_of(&ct1, &b1), fp_of(&ct2, &b2));
    }
}
