//! Guards the exactness of number handling against the build's `serde_json` configuration.
//!
//! Crates: `serde_json` (a dependency of the project elsewhere) is inspected only to report how
//! it is configured. The fingerprint parser is hand-written and keeps every number lexeme as
//! text, so enabling `arbitrary_precision` anywhere in the dependency graph must not change any
//! canonical form; these tests pin that and would fail if number handling were ever moved onto
//! `serde_json::Value` and started losing or gaining digits with that feature.

use idemgate::fingerprint::jcs;

/// True when some crate in the graph turned on `serde_json/arbitrary_precision`, which makes
/// `Value` keep number text (`0.10000000000000001` stays as written instead of becoming `0.1`).
fn serde_json_arbitrary_precision() -> bool {
    let v: serde_json::Value = serde_json::from_str("0.10000000000000001").expect("valid JSON");
    v != serde_json::json!(0.1)
}

fn exact(s: &str) -> String {
    String::from_utf8(jcs::canonicalize_exact(s.as_bytes(), &[]).expect("canonicalizes"))
        .expect("UTF-8")
}

fn plain(s: &str) -> String {
    String::from_utf8(jcs::canonicalize(s.as_bytes()).expect("canonicalizes")).expect("UTF-8")
}

#[test]
fn exact_numbers_do_not_depend_on_serde_json() {
    println!(
        "serde_json arbitrary_precision: {}",
        serde_json_arbitrary_precision()
    );
    assert_eq!(exact("9007199254740993"), "9007199254740993");
    assert_eq!(exact("9007199254740992"), "9007199254740992");
    assert_eq!(exact("0.10000000000000001"), "0.10000000000000001");
    assert_eq!(exact("1.0"), "1");
    assert_eq!(exact("1e400"), "1e+400");
    assert_eq!(exact("18446744073709551616"), "18446744073709551616");
    assert_eq!(exact("-18446744073709551617"), "-18446744073709551617");
}

#[test]
fn plain_numbers_do_not_depend_on_serde_json() {
    assert_eq!(plain("9007199254740993"), "9007199254740992");
    assert_eq!(plain("0.10000000000000001"), "0.1");
    assert_eq!(plain("1.0"), "1");
    assert_eq!(plain("18446744073709551616"), "18446744073709552000");
    assert!(jcs::canonicalize(b"1e400").is_err());
}
