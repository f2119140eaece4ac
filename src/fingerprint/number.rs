//! Number serialization for RFC 8785 and for the exact-decimal rule of fingerprints.
//!
//! Crates: `ryu` gives the shortest round-trip digits of a double, which is the digit choice
//! ECMAScript's `Number::toString` makes; only the layout around those digits is done here.
//!
//! Both modes share one layout function, [`write_es_layout`], which writes a decimal given as
//! significant digits `s` (no leading or trailing zeros) and a point position `n` (the value is
//! `0.s × 10^n`) the way ECMAScript lays out `Number::toString`. In plain mode the digits are
//! those of the nearest double. In exact mode they are the input's own digits, because the rule
//! is "ECMAScript form unless that form would denote a different decimal", and when the
//! ECMAScript form denotes the input's decimal its digits *are* the input's normalized digits.
//! So exact mode never goes through a double, and the output is a function of the decimal value
//! alone: two lexemes give the same text exactly when they denote the same number.

use thiserror::Error;

/// Exponents beyond this many decimal digits are refused rather than handled with big
/// integers: no payment API sends them, and refusing only means the raw bytes are hashed.
const MAX_EXPONENT_DIGITS: usize = 17;

/// Up to this many significant digits, a decimal in the normal double range survives a round
/// trip through a double unchanged (DBL_DIG), so its shortest round-trip digits are its own.
const FAST_PATH_MAX_DIGITS: usize = 15;
/// Point positions for which every such decimal is a normal (not subnormal, finite) double.
const FAST_PATH_MIN_POINT: i64 = -300;
const FAST_PATH_MAX_POINT: i64 = 300;

#[derive(Error, Debug, Clone, PartialEq, Eq)]
pub enum NumberError {
    /// RFC 8785 only admits numbers that are finite IEEE-754 doubles.
    #[error("number is outside the range of an IEEE-754 double")]
    OutOfRange,
    #[error("number exponent has more than {MAX_EXPONENT_DIGITS} digits")]
    ExponentTooLarge,
}

/// A decimal number taken apart: sign, significant digits (ASCII, no leading or trailing
/// zeros; empty for zero) and point position `n` such that the value is `0.digits × 10^n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decimal {
    pub negative: bool,
    pub digits: Vec<u8>,
    pub point: i64,
}

impl Decimal {
    pub(crate) fn new() -> Self {
        Decimal {
            negative: false,
            digits: Vec::with_capacity(32),
            point: 0,
        }
    }

    fn is_zero(&self) -> bool {
        self.digits.is_empty()
    }
}

/// Splits a lexeme that matches the RFC 8259 number grammar (or `ryu`'s output, which is a
/// subset of it) into a normalized [`Decimal`], reusing `dec`'s buffer.
pub(crate) fn decompose(lexeme: &[u8], dec: &mut Decimal) -> Result<(), NumberError> {
    dec.digits.clear();
    dec.negative = false;
    dec.point = 0;
    let mut i = 0;
    if lexeme.first() == Some(&b'-') {
        dec.negative = true;
        i = 1;
    }
    // Digits before the decimal point, then after it.
    let int_start = i;
    while i < lexeme.len() && lexeme[i].is_ascii_digit() {
        i += 1;
    }
    let int_digits = &lexeme[int_start..i];
    let mut frac_digits: &[u8] = &[];
    if i < lexeme.len() && lexeme[i] == b'.' {
        let start = i + 1;
        i = start;
        while i < lexeme.len() && lexeme[i].is_ascii_digit() {
            i += 1;
        }
        frac_digits = &lexeme[start..i];
    }
    let mut exponent: i64 = 0;
    if i < lexeme.len() && (lexeme[i] == b'e' || lexeme[i] == b'E') {
        i += 1;
        let mut exp_negative = false;
        match lexeme.get(i) {
            Some(b'-') => {
                exp_negative = true;
                i += 1;
            }
            Some(b'+') => i += 1,
            _ => {}
        }
        let exp_digits = &lexeme[i..];
        let significant = exp_digits
            .iter()
            .position(|&b| b != b'0')
            .map_or(&[][..], |p| &exp_digits[p..]);
        if significant.len() > MAX_EXPONENT_DIGITS {
            return Err(NumberError::ExponentTooLarge);
        }
        for &b in significant {
            exponent = exponent * 10 + i64::from(b - b'0');
        }
        if exp_negative {
            exponent = -exponent;
        }
    }

    // Significant digits of int ++ frac, without leading zeros.
    let mut leading_skipped: usize = 0;
    for &b in int_digits.iter().chain(frac_digits.iter()) {
        if dec.digits.is_empty() && b == b'0' {
            leading_skipped += 1;
        } else {
            dec.digits.push(b);
        }
    }
    while dec.digits.last() == Some(&b'0') {
        dec.digits.pop();
    }
    if dec.digits.is_empty() {
        return Ok(());
    }
    // value = 0.digits × 10^(int_len - leading_skipped + exponent)
    let int_len = i64::try_from(int_digits.len()).map_err(|_| NumberError::ExponentTooLarge)?;
    let skipped = i64::try_from(leading_skipped).map_err(|_| NumberError::ExponentTooLarge)?;
    dec.point = int_len
        .checked_sub(skipped)
        .and_then(|p| p.checked_add(exponent))
        .ok_or(NumberError::ExponentTooLarge)?;
    Ok(())
}

/// Writes `dec` laid out as ECMAScript's `Number::toString` lays out its digits (ECMA-262,
/// Number::toString steps 6-10). Zero (of either sign) is `0`.
pub(crate) fn write_es_layout(dec: &Decimal, out: &mut Vec<u8>) {
    if dec.is_zero() {
        out.push(b'0');
        return;
    }
    if dec.negative {
        out.push(b'-');
    }
    let digits = &dec.digits[..];
    let k = digits.len() as i64;
    let n = dec.point;
    if k <= n && n <= 21 {
        out.extend_from_slice(digits);
        out.resize(out.len() + (n - k) as usize, b'0');
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(n as usize);
        out.extend_from_slice(int);
        out.push(b'.');
        out.extend_from_slice(frac);
    } else if -6 < n && n <= 0 {
        out.extend_from_slice(b"0.");
        out.resize(out.len() + (-n) as usize, b'0');
        out.extend_from_slice(digits);
    } else {
        out.push(digits[0]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.push(b'e');
        let e = n - 1;
        out.push(if e < 0 { b'-' } else { b'+' });
        write_u64(e.unsigned_abs(), out);
    }
}

fn write_u64(mut v: u64, out: &mut Vec<u8>) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

fn fast_path_applies(dec: &Decimal) -> bool {
    dec.digits.len() <= FAST_PATH_MAX_DIGITS
        && (FAST_PATH_MIN_POINT..=FAST_PATH_MAX_POINT).contains(&dec.point)
}

/// Writes `f` as ECMAScript's `Number::toString` does. `f` must be finite.
pub(crate) fn write_f64(f: f64, dec: &mut Decimal, out: &mut Vec<u8>) -> Result<(), NumberError> {
    if !f.is_finite() {
        return Err(NumberError::OutOfRange);
    }
    if f == 0.0 {
        out.push(b'0');
        return Ok(());
    }
    let mut buf = ryu::Buffer::new();
    let shortest = buf.format_finite(f);
    decompose(shortest.as_bytes(), dec)?;
    write_es_layout(dec, out);
    Ok(())
}

/// RFC 8785 serialization of a number lexeme: the value as the nearest IEEE-754 double.
/// `dec` is a working buffer reused across calls.
pub(crate) fn write_plain(
    lexeme: &str,
    dec: &mut Decimal,
    out: &mut Vec<u8>,
) -> Result<(), NumberError> {
    match decompose(lexeme.as_bytes(), dec) {
        Ok(()) if fast_path_applies(dec) => {
            write_es_layout(dec, out);
            Ok(())
        }
        // A huge exponent still has a well-defined double (infinity or zero); let the
        // standard parser decide which.
        Ok(()) | Err(NumberError::ExponentTooLarge) => {
            let f: f64 = lexeme.parse().map_err(|_| NumberError::OutOfRange)?;
            write_f64(f, dec, out)
        }
        Err(e) => Err(e),
    }
}

/// Serialization under the exactness rule: the RFC 8785 form when that form denotes exactly
/// the input's decimal value, otherwise an exact normalized form of the input value. Both are
/// the ECMAScript layout of the input's normalized decimal (see the module comment).
pub(crate) fn write_exact(
    lexeme: &str,
    dec: &mut Decimal,
    out: &mut Vec<u8>,
) -> Result<(), NumberError> {
    decompose(lexeme.as_bytes(), dec)?;
    write_es_layout(dec, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(s: &str) -> String {
        let mut out = Vec::new();
        write_plain(s, &mut Decimal::new(), &mut out).expect("plain");
        String::from_utf8(out).expect("utf8")
    }

    fn exact(s: &str) -> String {
        let mut out = Vec::new();
        write_exact(s, &mut Decimal::new(), &mut out).expect("exact");
        String::from_utf8(out).expect("utf8")
    }

    fn parse(s: &str) -> f64 {
        s.parse().expect("valid float")
    }

    fn es(f: f64) -> String {
        let mut out = Vec::new();
        write_f64(f, &mut Decimal::new(), &mut out).expect("finite");
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn es_layout_matches_ecmascript() {
        assert_eq!(es(0.0), "0");
        assert_eq!(es(-0.0), "0");
        assert_eq!(es(1.0), "1");
        assert_eq!(es(-1.5), "-1.5");
        assert_eq!(es(1e21), "1e+21");
        assert_eq!(es(1e20), "100000000000000000000");
        assert_eq!(es(123456789012345680000.0), "123456789012345680000");
        assert_eq!(es(1e-7), "1e-7");
        assert_eq!(es(1e-6), "0.000001");
        assert_eq!(es(1.5e-7), "1.5e-7");
        assert_eq!(es(0.1), "0.1");
        assert_eq!(es(f64::MAX), "1.7976931348623157e+308");
        assert_eq!(es(5e-324), "5e-324");
        // The literal carries more digits than a double holds, which is the point.
        assert_eq!(es(parse("333333333.33333329")), "333333333.3333333");
        assert_eq!(es(9007199254740993.0), "9007199254740992");
    }

    #[test]
    fn plain_mode_rounds_to_double() {
        assert_eq!(plain("4.50"), "4.5");
        assert_eq!(plain("1E30"), "1e+30");
        assert_eq!(plain("2e-3"), "0.002");
        assert_eq!(plain("0.000000000000000000000000001"), "1e-27");
        assert_eq!(plain("333333333.33333329"), "333333333.3333333");
        assert_eq!(plain("9007199254740993"), "9007199254740992");
        assert_eq!(plain("-0"), "0");
        assert_eq!(plain("-0.0e-5"), "0");
        assert_eq!(plain("1e-400"), "0");
        assert_eq!(plain("1e-99999999999999999999999"), "0");
    }

    #[test]
    fn plain_mode_rejects_non_finite() {
        for s in ["1e400", "-1e309", "1e99999999999999999999999"] {
            assert_eq!(
                write_plain(s, &mut Decimal::new(), &mut Vec::new()),
                Err(NumberError::OutOfRange),
                "{s}"
            );
        }
    }

    #[test]
    fn exact_mode_equal_values_equal_text() {
        assert_eq!(exact("4.50"), "4.5");
        assert_eq!(exact("4.5"), "4.5");
        assert_eq!(exact("45e-1"), "4.5");
        assert_eq!(exact("0.45E+1"), "4.5");
        assert_eq!(exact("1.0"), "1");
        assert_eq!(exact("1e0"), "1");
        assert_eq!(exact("100"), "100");
        assert_eq!(exact("1e2"), "100");
        assert_eq!(exact("-0"), "0");
        assert_eq!(exact("0e10"), "0");
        assert_eq!(exact("0.000"), "0");
    }

    #[test]
    fn exact_mode_keeps_values_doubles_cannot_hold() {
        assert_eq!(exact("9007199254740993"), "9007199254740993");
        assert_eq!(exact("9007199254740992"), "9007199254740992");
        assert_eq!(exact("1e400"), "1e+400");
        assert_eq!(exact("2e400"), "2e+400");
        assert_eq!(exact("1e-400"), "1e-400");
        assert_eq!(exact("333333333.33333329"), "333333333.33333329");
        assert_eq!(exact("333333333.3333333"), "333333333.3333333");
        assert_eq!(exact("0.10000000000000001"), "0.10000000000000001");
        assert_eq!(exact("0.1"), "0.1");
        assert_eq!(exact("1152921504606846976"), "1152921504606846976");
        assert_eq!(exact("1152921504606847000"), "1152921504606847000");
        assert_eq!(
            exact("123456789012345678901234567890"),
            "1.2345678901234567890123456789e+29"
        );
        assert_eq!(exact("-1e-7"), "-1e-7");
    }

    #[test]
    fn exact_mode_uses_es_form_whenever_it_is_exact() {
        // For numbers that round-trip, the exact text is exactly the RFC 8785 text.
        for s in [
            "0.1",
            "5e-324",
            "1.7976931348623157e308",
            "1e21",
            "123.456",
            "-2.5e-10",
            "9007199254740992",
        ] {
            assert_eq!(exact(s), plain(s), "{s}");
        }
    }

    #[test]
    fn exact_mode_rejects_absurd_exponents() {
        assert_eq!(
            write_exact("1e999999999999999999", &mut Decimal::new(), &mut Vec::new()),
            Err(NumberError::ExponentTooLarge)
        );
        // Leading zeros of the exponent do not count.
        assert_eq!(exact("1e0000000000000000000000001"), "10");
    }

    #[test]
    fn fast_path_agrees_with_double_rounding() {
        // Every <=15-digit decimal in the fast-path range must print like its double.
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut dec = Decimal::new();
        for _ in 0..200_000 {
            let digits = 1 + (next() % 15) as u32;
            let mantissa = next() % 10u64.pow(digits);
            let exp = (next() % 601) as i64 - 300 - i64::from(digits);
            let lexeme = format!("{mantissa}e{exp}");
            let mut fast = Vec::new();
            write_plain(&lexeme, &mut dec, &mut fast).expect("in range");
            let f: f64 = lexeme.parse().expect("parse");
            if f != 0.0 && f.abs() < f64::MIN_POSITIVE {
                continue; // subnormal: not in the fast path anyway
            }
            let mut slow = Vec::new();
            write_f64(f, &mut dec, &mut slow).expect("finite");
            assert_eq!(fast, slow, "{lexeme}");
        }
    }
}
