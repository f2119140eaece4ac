use super::*;

fn canon(s: &str) -> String {
    String::from_utf8(canonicalize(s.as_bytes()).expect("canonicalizes")).expect("utf8")
}

fn exact(s: &str) -> String {
    exact_ignoring(s, &[])
}

fn exact_ignoring(s: &str, ignore: &[&str]) -> String {
    let pointers: Vec<JsonPointer> = ignore
        .iter()
        .map(|p| JsonPointer::parse(p).expect("pointer"))
        .collect();
    String::from_utf8(canonicalize_exact(s.as_bytes(), &pointers).expect("canonicalizes"))
        .expect("utf8")
}

fn err(s: &[u8]) -> JcsError {
    canonicalize(s).expect_err("must be refused")
}

#[test]
fn sorts_keys_by_utf16_code_units() {
    // U+FB33 (UTF-16 FB33) sorts after U+1F602 (UTF-16 D83D DE02), though its UTF-8 is
    // smaller.
    assert_eq!(
        canon(r#"{"\ufb33":1,"\ud83d\ude02":2,"\u20ac":3}"#),
        "{\"€\":3,\"😂\":2,\"\u{fb33}\":1}"
    );
    assert_eq!(
        canon(r#"{"b":1,"a":2,"":3,"aa":4}"#),
        r#"{"":3,"a":2,"aa":4,"b":1}"#
    );
}

#[test]
fn utf16_order_agrees_with_encode_utf16() {
    let samples = [
        "",
        "a",
        "ab",
        "b",
        "\u{7f}",
        "\u{80}",
        "é",
        "\u{d7ff}",
        "\u{e000}",
        "\u{fb33}",
        "\u{ffff}",
        "\u{10000}",
        "😂",
        "😂a",
        "a😂",
        "\u{10ffff}",
        "\u{fffd}",
        "ÿ",
    ];
    for a in samples {
        for b in samples {
            assert_eq!(
                cmp_utf16(a, b),
                a.encode_utf16().cmp(b.encode_utf16()),
                "{a:?} vs {b:?}"
            );
        }
    }
}

#[test]
fn escapes_minimally() {
    assert_eq!(
        canon("\"\\u0000\\u0008\\t\\n\\u000b\\f\\r\\u001f\\\"\\\\\\/\\u007f\\u2028\\u00e9\""),
        "\"\\u0000\\b\\t\\n\\u000b\\f\\r\\u001f\\\"\\\\/\u{7f}\u{2028}é\""
    );
    assert_eq!(canon(r#""\u001F""#), r#""\u001f""#);
}

#[test]
fn numbers_follow_ecmascript() {
    assert_eq!(
        canon(
            "[333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001, -0, 1e21, 1e-7]"
        ),
        "[333333333.3333333,1e+30,4.5,0.002,1e-27,0,1e+21,1e-7]"
    );
}

#[test]
fn whitespace_and_scalars() {
    assert_eq!(
        canon(" \t\r\n[ true , false,null ,{ } ,[ ]]\n"),
        "[true,false,null,{},[]]"
    );
    assert_eq!(canon("\"x\""), "\"x\"");
    assert_eq!(canon("17"), "17");
}

#[test]
fn exact_mode_rules() {
    assert_eq!(exact("[4.50,4.5,45e-1]"), "[4.5,4.5,4.5]");
    assert_ne!(exact("9007199254740993"), exact("9007199254740992"));
    assert_eq!(exact("1e400"), "1e+400");
    assert_ne!(exact("1e400"), exact("2e400"));
    assert_ne!(exact("333333333.33333329"), exact("333333333.3333333"));
    assert_ne!(exact("0.10000000000000001"), exact("0.1"));
    assert_eq!(exact("[1.0,1,1e0,100,1e2]"), "[1,1,1,100,100]");
    assert_eq!(exact("-0.0"), "0");
}

#[test]
fn plain_mode_refuses_out_of_range() {
    assert!(matches!(
        err(b"[1e400]"),
        JcsError::Number(NumberError::OutOfRange)
    ));
}

#[test]
fn refuses_syntax_errors() {
    for bad in [
        "",
        " ",
        "{",
        "[1,]",
        "[,1]",
        "{\"a\":1,}",
        "{\"a\" 1}",
        "{a:1}",
        "01",
        "1.",
        ".5",
        "-",
        "+1",
        "1e",
        "1e+",
        "tru",
        "nul",
        "[1 2]",
        "\"abc",
        "\"\\x\"",
        "\"\\u12\"",
        "\"\\u12g4\"",
        "NaN",
        "Infinity",
        "'a'",
        "{\"a\":1}}",
        "[1]x",
        "1 2",
        "\u{a0}1",
    ] {
        assert!(
            matches!(err(bad.as_bytes()), JcsError::Syntax { .. }),
            "{bad:?} gave {:?}",
            canonicalize(bad.as_bytes())
        );
    }
    assert!(matches!(err(b"\"a\x01b\""), JcsError::Syntax { .. }));
    assert!(matches!(err(b"\"a\tb\""), JcsError::Syntax { .. }));
}

#[test]
fn refuses_bom_and_trailing_data() {
    assert!(matches!(
        err(b"\xEF\xBB\xBF{}"),
        JcsError::Syntax { offset: 0, .. }
    ));
    assert!(matches!(err(b"{} x"), JcsError::Syntax { offset: 3, .. }));
    assert!(matches!(err(b"{}\0"), JcsError::Syntax { .. }));
}

#[test]
fn refuses_duplicate_names_at_any_depth() {
    assert!(matches!(
        err(br#"{"a":1,"a":2}"#),
        JcsError::DuplicateMember { .. }
    ));
    assert!(matches!(
        err(br#"[{"x":{"b":1,"c":2,"b":3}}]"#),
        JcsError::DuplicateMember { .. }
    ));
    // Compared after unescaping.
    assert_eq!(
        err(br#"{"a":1,"\u0061":2}"#),
        JcsError::DuplicateMember { name: "a".into() }
    );
    assert!(matches!(
        err(br#"{"\ud83d\ude02":1,"\uD83D\uDE02":2}"#),
        JcsError::DuplicateMember { .. }
    ));
    assert!(canonicalize_exact(br#"{"a":1,"a":2}"#, &[]).is_err());
}

#[test]
fn refuses_lone_surrogates() {
    for bad in [
        r#""\ud800""#,
        r#""\ud800x""#,
        r#""\ud800\u0041""#,
        r#""\udc00""#,
        r#""\ude02\ud83d""#,
        r#"{"\ud800":1}"#,
    ] {
        assert!(
            matches!(err(bad.as_bytes()), JcsError::LoneSurrogate { .. }),
            "{bad}"
        );
    }
    assert_eq!(canon(r#""\ud83d\ude02""#), "\"😂\"");
}

#[test]
fn refuses_invalid_utf8() {
    assert_eq!(err(b"\"\xff\""), JcsError::InvalidUtf8 { offset: 1 });
    assert!(matches!(
        err(b"\"\xed\xa0\x80\""),
        JcsError::InvalidUtf8 { .. }
    ));
    assert!(matches!(err(b"[\"\xc3\"]"), JcsError::InvalidUtf8 { .. }));
}

#[test]
fn nesting_limit() {
    let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
    assert!(canonicalize(ok.as_bytes()).is_ok());
    let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
    assert!(matches!(err(deep.as_bytes()), JcsError::TooDeep { .. }));
    let deep_obj = format!(
        "{}1{}",
        "{\"a\":".repeat(MAX_DEPTH + 1),
        "}".repeat(MAX_DEPTH + 1)
    );
    assert!(matches!(err(deep_obj.as_bytes()), JcsError::TooDeep { .. }));
    // Unbalanced deep input must fail cleanly, not overflow the stack.
    assert!(canonicalize("[".repeat(100_000).as_bytes()).is_err());
}

#[test]
fn ignore_removes_members() {
    let doc = r#"{"amount":100,"meta":{"ts":"2024-01-01","nonce":"x","keep":1},"items":[{"id":1,"ts":5},{"id":2,"ts":6}]}"#;
    assert_eq!(
        exact_ignoring(
            doc,
            &[
                "/meta/ts",
                "/meta/nonce",
                "/items/1/ts",
                "/missing",
                "/items/9",
                "/amount/x"
            ]
        ),
        r#"{"amount":100,"items":[{"id":1,"ts":5},{"id":2}],"meta":{"keep":1}}"#
    );
    // Array elements named by index are removed; indices refer to the parsed document.
    assert_eq!(exact_ignoring("[0,1,2,3]", &["/1", "/2"]), "[0,3]");
    assert_eq!(exact_ignoring("[0,1,2,3]", &["/2", "/1", "/1"]), "[0,3]");
    assert_eq!(exact_ignoring("[0,1]", &["/-", "/01"]), "[0,1]");
    // Parent and child both named.
    assert_eq!(
        exact_ignoring(r#"{"a":{"b":1},"c":2}"#, &["/a/b", "/a"]),
        r#"{"c":2}"#
    );
    // Escaped names.
    assert_eq!(
        exact_ignoring(
            r#"{"a/b":1,"m~n":2,"\u00e9":3,"x":4}"#,
            &["/a~1b", "/m~0n", "/é"]
        ),
        r#"{"x":4}"#
    );
    assert_eq!(exact_ignoring(r#"{"":1,"x":2}"#, &["/"]), r#"{"x":2}"#);
    // The root pointer drops the whole document.
    assert_eq!(exact_ignoring(r#"{"a":1}"#, &[""]), "");
}

#[test]
fn ignore_finds_names_in_utf16_order() {
    let doc = r#"{"\ufb33":1,"\ud83d\ude02":2,"a":3,"\u20ac":4}"#;
    assert_eq!(
        exact_ignoring(doc, &["/😂"]),
        "{\"a\":3,\"€\":4,\"\u{fb33}\":1}"
    );
    assert_eq!(
        exact_ignoring(doc, &["/\u{fb33}"]),
        "{\"a\":3,\"€\":4,\"😂\":2}"
    );
}
