//! No input panics the canonicalizer or the fingerprint, and canonical output is a fixed point
//! of canonicalization in both modes.

#![no_main]

use idemgate::fingerprint::{fingerprint, jcs, JsonPointer, RequestParts};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(canonical) = jcs::canonicalize(data) {
        let again = jcs::canonicalize(&canonical).expect("canonical output must be accepted");
        assert_eq!(
            again, canonical,
            "plain RFC 8785 output is not a fixed point"
        );
    }
    if let Ok(canonical) = jcs::canonicalize_exact(data, &[]) {
        let again =
            jcs::canonicalize_exact(&canonical, &[]).expect("canonical output must be accepted");
        assert_eq!(again, canonical, "exact output is not a fixed point");
    }

    // Pointers taken from the input itself exercise removal on whatever it parsed to.
    let pointers: Vec<JsonPointer> = std::str::from_utf8(data)
        .ok()
        .into_iter()
        .flat_map(|s| s.lines().take(4))
        .filter(|line| !line.is_empty())
        .filter_map(|line| JsonPointer::parse(line).ok())
        .collect();
    for pointer in &pointers {
        let reparsed = JsonPointer::parse(&pointer.to_string()).expect("display re-parses");
        assert_eq!(&reparsed, pointer);
    }
    if let Ok(canonical) = jcs::canonicalize_exact(data, &pointers) {
        if !canonical.is_empty() {
            let again = jcs::canonicalize_exact(&canonical, &[])
                .expect("canonical output must be accepted");
            assert_eq!(
                again, canonical,
                "output with removals is not a fixed point"
            );
        }
    }

    for content_type in [
        "application/json",
        "application/x-www-form-urlencoded",
        "application/octet-stream",
    ] {
        let parts = RequestParts {
            method: "POST",
            path: "/v1/charges",
            query: None,
            content_type: Some(content_type),
            body: data,
            ..Default::default()
        };
        fingerprint(&parts, &pointers);
    }
});
