//! Arbitrary input never panics the canonicalizer, and canonical output is a fixed point.
//!
//! Crates: `proptest` supplies the inputs. This is the stable-toolchain counterpart of the
//! `fuzz/` target: same properties, fewer and less clever inputs.

use proptest::prelude::*;

use idemgate::fingerprint::{fingerprint, jcs, JsonPointer, RequestParts};

fn check(input: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(canonical) = jcs::canonicalize(input) {
        let again = jcs::canonicalize(&canonical)
            .map_err(|e| TestCaseError::fail(format!("canonical output refused: {e}")))?;
        prop_assert_eq!(&again, &canonical);
        prop_assert!(std::str::from_utf8(&canonical).is_ok());
    }
    let pointers: Vec<JsonPointer> = ["/a", "/0", "/a/0/b"]
        .iter()
        .map(|p| JsonPointer::parse(p).expect("pointer"))
        .collect();
    for ignore in [&[][..], &pointers[..]] {
        if let Ok(canonical) = jcs::canonicalize_exact(input, ignore) {
            if !canonical.is_empty() {
                let again = jcs::canonicalize_exact(&canonical, &[])
                    .map_err(|e| TestCaseError::fail(format!("canonical output refused: {e}")))?;
                prop_assert_eq!(&again, &canonical);
            }
        }
    }
    if let Ok(s) = std::str::from_utf8(input) {
        if let Ok(p) = JsonPointer::parse(s) {
            prop_assert_eq!(JsonPointer::parse(&p.to_string()).ok(), Some(p));
        }
    }
    for ct in [
        "application/json",
        "application/x-www-form-urlencoded",
        "text/plain",
    ] {
        let parts = RequestParts {
            method: "POST",
            path: "/",
            query: None,
            content_type: Some(ct),
            body: input,
            ..Default::default()
        };
        fingerprint(&parts, &pointers);
    }
    Ok(())
}

/// Bytes drawn mostly from JSON's own alphabet, so that inputs get past the first token.
fn jsonish() -> impl Strategy<Value = Vec<u8>> {
    let token = prop::sample::select(vec![
        &b"{"[..],
        b"}",
        b"[",
        b"]",
        b":",
        b",",
        b"\"",
        b"\"a\"",
        b"\"\\u",
        b"\\ud83d",
        b"\\ude02",
        b"\\",
        b"0",
        b"1",
        b"9",
        b"-",
        b".",
        b"e",
        b"E+",
        b"400",
        b"true",
        b"null",
        b" ",
        b"\n",
        b"\xc3\xa9",
        b"\xf0\x9f\x98\x82",
        b"\xff",
        b"\x01",
        b"~0",
        b"/",
        b"%41",
        b"&a=",
        b"+",
    ]);
    prop::collection::vec(token, 0..40).prop_map(|tokens| tokens.concat())
}

/// Valid documents with a few bytes overwritten, inserted or removed.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let docs = prop::sample::select(vec![
        r#"{"amount":1050,"currency":"EUR","metadata":{"order":"A-1","note":"caf\u00e9 \ud83d\ude02"},"items":[1,2.5,-3e-7,true,null]}"#,
        r#"[9007199254740993,1e400,0.10000000000000001,-0,"\"\\\/\b\f\n\r\t"]"#,
        r#"{"a":[{"b":{"c":[[[]]]}}],"":{},"\ufb33":"x"}"#,
    ]);
    let edits = prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4);
    (docs, edits).prop_map(|(doc, edits)| {
        let mut bytes = doc.as_bytes().to_vec();
        for (at, byte, op) in edits {
            match op {
                0 if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes[i] = byte;
                }
                1 => {
                    let i = at.index(bytes.len() + 1);
                    bytes.insert(i, byte);
                }
                _ if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes.remove(i);
                }
                _ => {}
            }
        }
        bytes
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn random_bytes(input in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&input)?;
    }

    #[test]
    fn json_alphabet(input in jsonish()) {
        check(&input)?;
    }

    #[test]
    fn mutated_documents(input in mutated()) {
        check(&input)?;
    }
}

#[test]
fn deep_and_long_inputs() {
    for input in [
        "[".repeat(1_000_000),
        "{\"a\":".repeat(100_000),
        format!("{}1{}", "[".repeat(128), "]".repeat(128)),
        format!("1{}", "0".repeat(100_000)),
        format!("0.{}1", "0".repeat(100_000)),
        format!("1e{}", "9".repeat(1000)),
        format!("-1e-{}", "9".repeat(1000)),
        format!("\"{}\"", "\\u00e9".repeat(100_000)),
    ] {
        check(input.as_bytes()).expect("no failure");
    }
}
