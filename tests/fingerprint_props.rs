//! Property tests of JSON fingerprints: equivalent spellings of one document always share a
//! fingerprint, and changing any scalar anywhere always changes it.
//!
//! Crates: `proptest` generates the documents and shrinks failures to small ones.
//!
//! Documents are generated as trees and then spelled out with a seeded random spelling:
//! shuffled member order, random whitespace, random escapes, and random equivalent number
//! lexemes (`4.5`, `45e-1`, `0.450E+01`). An independent model of the canonical form checks
//! the output itself, not only its consistency.

use std::cmp::Ordering;

use proptest::prelude::*;

use idemgate::fingerprint::{fingerprint, jcs, Fingerprint, RequestParts};

/// A decimal: `digits × 10^exp`; `digits` has no leading or trailing zeros, empty for zero.
#[derive(Clone, Debug, PartialEq)]
struct Num {
    negative: bool,
    digits: String,
    exp: i64,
}

#[derive(Clone, Debug)]
enum J {
    Null,
    Bool(bool),
    Num(Num),
    Str(String),
    Arr(Vec<J>),
    /// Member names are unique.
    Obj(Vec<(String, J)>),
}

/// SplitMix64: the spelling choices, reproducible from a proptest-chosen seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn normalized(negative: bool, digits: &str, exp: i64) -> Num {
    let trimmed = digits.trim_start_matches('0');
    let kept = trimmed.trim_end_matches('0');
    let exp = exp + (trimmed.len() - kept.len()) as i64;
    if kept.is_empty() {
        return Num {
            negative,
            digits: String::new(),
            exp: 0,
        };
    }
    Num {
        negative,
        digits: kept.to_owned(),
        exp,
    }
}

fn num() -> impl Strategy<Value = Num> {
    let digits = prop_oneof![
        (0u64..1000).prop_map(|d| d.to_string()),
        any::<u64>().prop_map(|d| d.to_string()),
        "[1-9][0-9]{15,30}",
    ];
    let exp = prop_oneof![-5i64..5, -30i64..30, -400i64..400];
    let decimal = (any::<bool>(), digits, exp).prop_map(|(n, d, e)| normalized(n, &d, e));
    // Doubles, spelled with their shortest digits, so that values exactly at a double are
    // common too.
    let double = any::<f64>()
        .prop_filter("finite", |f| f.is_finite())
        .prop_map(|f| {
            let s = format!("{f:e}");
            let (mantissa, exp) = s.split_once('e').expect("exponent");
            let negative = mantissa.starts_with('-');
            let mantissa = mantissa.trim_start_matches('-');
            let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
            let exp: i64 = exp.parse().expect("exponent");
            normalized(negative, &format!("{int}{frac}"), exp - frac.len() as i64)
        });
    prop_oneof![3 => decimal, 1 => double]
}

fn string() -> impl Strategy<Value = String> {
    let ch = prop_oneof![
        4 => proptest::char::range('a', 'f'),
        1 => proptest::char::range('\u{0}', '\u{1f}'),
        1 => prop::sample::select(vec!['"', '\\', '/', '\u{7f}', '\u{80}', 'é', '€', '\u{2028}', '\u{fb33}', '\u{ffff}', '😂', '\u{10ffff}', '\u{e000}']),
        1 => any::<char>(),
    ];
    prop::collection::vec(ch, 0..6).prop_map(|v| v.into_iter().collect())
}

fn json() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        num().prop_map(J::Num),
        string().prop_map(J::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
            prop::collection::vec((string(), inner), 0..6).prop_map(|members| {
                let mut seen = std::collections::HashSet::new();
                J::Obj(
                    members
                        .into_iter()
                        .filter(|(k, _)| seen.insert(k.clone()))
                        .collect(),
                )
            }),
        ]
    })
}

// ---- Spelling a document ----

fn ws(rng: &mut Rng, out: &mut String) {
    for _ in 0..rng.below(3) {
        out.push([' ', '\t', '\n', '\r'][rng.below(4) as usize]);
    }
}

fn hex4(unit: u16, rng: &mut Rng, out: &mut String) {
    let s = format!("{unit:04x}");
    out.push_str("\\u");
    out.push_str(&if rng.coin() {
        s.to_ascii_uppercase()
    } else {
        s
    });
}

fn spell_str(s: &str, rng: &mut Rng, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let must_escape = c == '"' || c == '\\' || (c as u32) < 0x20;
        if !must_escape && rng.coin() {
            out.push(c);
            continue;
        }
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        match short {
            Some(esc) if rng.coin() => out.push_str(esc),
            _ => {
                let mut units = [0u16; 2];
                for &unit in c.encode_utf16(&mut units).iter() {
                    hex4(unit, rng, out);
                }
            }
        }
    }
    out.push('"');
}

fn spell_num(n: &Num, rng: &mut Rng, out: &mut String) {
    if n.negative && (!n.digits.is_empty() || rng.coin()) {
        out.push('-');
    }
    let (int, frac, exp): (String, String, i64) = if n.digits.is_empty() {
        let frac = "0".repeat(rng.below(3) as usize);
        ("0".into(), frac, rng.below(7) as i64 - 3)
    } else {
        let trailing = rng.below(3) as usize;
        let mantissa = format!("{}{}", n.digits, "0".repeat(trailing));
        let exp = n.exp - trailing as i64;
        let len = mantissa.len();
        let point = rng.below(len as u64 + 1) as usize;
        if point == 0 {
            let zeros = rng.below(3) as usize;
            let frac = format!("{}{}", "0".repeat(zeros), mantissa);
            ("0".into(), frac, exp + (len + zeros) as i64)
        } else {
            let (i, f) = mantissa.split_at(point);
            (i.into(), f.into(), exp + (len - point) as i64)
        }
    };
    out.push_str(&int);
    if !frac.is_empty() {
        out.push('.');
        out.push_str(&frac);
    }
    if exp != 0 || rng.coin() {
        out.push(if rng.coin() { 'e' } else { 'E' });
        if exp < 0 {
            out.push('-');
        } else if rng.coin() {
            out.push('+');
        }
        out.push_str(&"0".repeat(rng.below(2) as usize));
        out.push_str(&exp.unsigned_abs().to_string());
    }
}

fn spell(v: &J, rng: &mut Rng, out: &mut String) {
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => spell_num(n, rng, out),
        J::Str(s) => spell_str(s, rng, out),
        J::Arr(items) => {
            out.push('[');
            ws(rng, out);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    ws(rng, out);
                }
                spell(item, rng, out);
                ws(rng, out);
            }
            out.push(']');
        }
        J::Obj(members) => {
            let mut order: Vec<usize> = (0..members.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            out.push('{');
            ws(rng, out);
            for (n, &i) in order.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                    ws(rng, out);
                }
                spell_str(&members[i].0, rng, out);
                ws(rng, out);
                out.push(':');
                ws(rng, out);
                spell(&members[i].1, rng, out);
                ws(rng, out);
            }
            out.push('}');
        }
    }
}

fn spelled(v: &J, seed: u64) -> String {
    let mut rng = Rng(seed);
    let mut out = String::new();
    ws(&mut rng, &mut out);
    spell(v, &mut rng, &mut out);
    ws(&mut rng, &mut out);
    out
}

// ---- An independent model of the canonical form ----

fn model_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// ECMA-262 Number::toString layout of `0.digits × 10^n`, which under the exactness rule is
/// the canonical text of every number.
fn model_num(n: &Num, out: &mut String) {
    if n.digits.is_empty() {
        out.push('0');
        return;
    }
    if n.negative {
        out.push('-');
    }
    let d = &n.digits;
    let k = d.len() as i64;
    let point = k + n.exp;
    if k <= point && point <= 21 {
        out.push_str(d);
        out.push_str(&"0".repeat((point - k) as usize));
    } else if 0 < point && point <= 21 {
        out.push_str(&d[..point as usize]);
        out.push('.');
        out.push_str(&d[point as usize..]);
    } else if -6 < point && point <= 0 {
        out.push_str("0.");
        out.push_str(&"0".repeat((-point) as usize));
        out.push_str(d);
    } else {
        out.push_str(&d[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&d[1..]);
        }
        let e = point - 1;
        out.push_str(&format!("e{}{}", if e < 0 { '-' } else { '+' }, e.abs()));
    }
}

fn model(v: &J, out: &mut String) {
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => model_num(n, out),
        J::Str(s) => model_str(s, out),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                model(item, out);
            }
            out.push(']');
        }
        J::Obj(members) => {
            let mut sorted: Vec<&(String, J)> = members.iter().collect();
            sorted.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (name, value)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                model_str(name, out);
                out.push(':');
                model(value, out);
            }
            out.push('}');
        }
    }
}

// ---- Changing one scalar ----

fn count_scalars(v: &J) -> usize {
    match v {
        J::Arr(items) => items.iter().map(count_scalars).sum(),
        J::Obj(members) => members.iter().map(|(_, v)| count_scalars(v)).sum(),
        _ => 1,
    }
}

/// A scalar of a different value (or type) than `v`, chosen by `how`.
fn changed(v: &J, how: u64) -> J {
    match v {
        J::Null => match how % 4 {
            0 => J::Bool(false),
            1 => J::Num(normalized(false, "0", 0)),
            2 => J::Str(String::new()),
            _ => J::Str("null".into()),
        },
        J::Bool(b) => match how % 3 {
            0 => J::Bool(!b),
            1 => J::Null,
            _ => J::Str(b.to_string()),
        },
        J::Num(n) if n.digits.is_empty() => match how % 3 {
            0 => J::Num(normalized(false, "1", 0)),
            1 => J::Num(normalized(true, "1", -400)),
            _ => J::Str("0".into()),
        },
        J::Num(n) => match how % 6 {
            0 => J::Num(Num {
                negative: !n.negative,
                ..n.clone()
            }),
            1 => J::Num(Num {
                exp: n.exp + 1,
                ..n.clone()
            }),
            2 => J::Num(Num {
                exp: n.exp - 1,
                ..n.clone()
            }),
            // One more digit at the end: differs by one unit in a place the value lacked.
            3 => J::Num(Num {
                digits: format!("{}1", n.digits),
                exp: n.exp - 1,
                ..n.clone()
            }),
            4 => J::Num(normalized(n.negative, "", 0)),
            _ => {
                let mut text = String::new();
                model_num(n, &mut text);
                J::Str(text)
            }
        },
        J::Str(s) => match how % 4 {
            0 => J::Str(format!("{s}x")),
            1 if !s.is_empty() => {
                let mut t = s.clone();
                t.pop();
                J::Str(t)
            }
            2 => J::Str(format!("\u{0}{s}")),
            _ => J::Null,
        },
        J::Arr(_) | J::Obj(_) => unreachable!("not a scalar"),
    }
}

/// `v` with its `index`-th scalar (in document order) changed.
fn with_changed_scalar(v: &J, index: &mut usize, how: u64) -> J {
    match v {
        J::Arr(items) => J::Arr(
            items
                .iter()
                .map(|item| with_changed_scalar(item, index, how))
                .collect(),
        ),
        J::Obj(members) => J::Obj(
            members
                .iter()
                .map(|(k, item)| (k.clone(), with_changed_scalar(item, index, how)))
                .collect(),
        ),
        scalar => {
            let hit = *index == 0;
            *index = index.wrapping_sub(1);
            if hit {
                changed(scalar, how)
            } else {
                scalar.clone()
            }
        }
    }
}

fn fp(body: &str) -> Fingerprint {
    fingerprint(
        &RequestParts {
            method: "POST",
            path: "/v1/transfers",
            query: None,
            content_type: Some("application/json"),
            body: body.as_bytes(),
            ..Default::default()
        },
        &[],
    )
}

fn exact(body: &str) -> Result<String, jcs::JcsError> {
    jcs::canonicalize_exact(body.as_bytes(), &[])
        .map(|c| String::from_utf8(c).expect("canonical output is UTF-8"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn respelled_documents_share_a_fingerprint(v in json(), seed_a in any::<u64>(), seed_b in any::<u64>()) {
        let a = spelled(&v, seed_a);
        let b = spelled(&v, seed_b);
        let mut expected = String::new();
        model(&v, &mut expected);
        let ca = exact(&a).map_err(|e| TestCaseError::fail(format!("{a}: {e}")))?;
        prop_assert_eq!(&ca, &expected, "spelled {}", a);
        prop_assert_eq!(exact(&b).ok(), Some(expected.clone()), "spelled {}", b);
        prop_assert_eq!(fp(&a), fp(&b));
        // The canonical form is itself a spelling of the document.
        prop_assert_eq!(exact(&expected).ok(), Some(expected.clone()));
        prop_assert_eq!(fp(&expected), fp(&a));
        // Plain RFC 8785 agrees between spellings too (both fail only beyond double range).
        prop_assert_eq!(jcs::canonicalize(a.as_bytes()).ok(), jcs::canonicalize(b.as_bytes()).ok());
    }

    #[test]
    fn changing_any_scalar_changes_the_fingerprint(
        v in json(), which in any::<usize>(), how in any::<u64>(), seed_a in any::<u64>(), seed_b in any::<u64>()
    ) {
        let scalars = count_scalars(&v);
        prop_assume!(scalars > 0);
        let mut index = which % scalars;
        let w = with_changed_scalar(&v, &mut index, how);
        let a = spelled(&v, seed_a);
        let b = spelled(&w, seed_b);
        let ca = exact(&a).map_err(|e| TestCaseError::fail(format!("{a}: {e}")))?;
        let cb = exact(&b).map_err(|e| TestCaseError::fail(format!("{b}: {e}")))?;
        prop_assert_ne!(&ca, &cb, "{} vs {}", a, b);
        prop_assert_ne!(fp(&a), fp(&b), "{} vs {}", a, b);
    }
}

#[test]
fn model_sorts_like_the_rfc_example() {
    // Guards the model itself: U+1F602 sorts before U+FB33 in UTF-16 order.
    let a = "\u{1f602}".encode_utf16();
    let b = "\u{fb33}".encode_utf16();
    assert_eq!(a.cmp(b), Ordering::Less);
}
