//! Plain RFC 8785 mode against the published JCS test vectors, byte for byte.
//!
//! Crates: `flate2` reads the gzipped number vectors; `sha2` checks they are the published ones.
//!
//! The vectors live outside the repository, at `../shared/testdata/jcs/` from the project root
//! (`IDEMGATE_JCS_VECTORS` overrides the folder). A clone without that folder skips these tests
//! and says so; under `CI=true` a missing folder fails.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use flate2::read::GzDecoder;
use sha2::{Digest, Sha256};

use idemgate::fingerprint::jcs;

const NUMBERS_FILE: &str = "es6-numbers-100k.txt.gz";
const NUMBERS_LINES: usize = 100_000;
const NUMBERS_SHA256: &str = "22776e6d4b49fa294a0d0f349268e5c28808fe7e0cb2bcbe28f63894e494d4c7";

/// The vectors folder, or None (after saying so) when it is absent outside CI.
fn vectors_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("IDEMGATE_JCS_VECTORS").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../shared/testdata/jcs"
            ))
        },
        PathBuf::from,
    );
    if dir.is_dir() {
        return Some(dir);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("JCS test vectors not found at {}", dir.display());
    }
    println!("skipped: JCS test vectors not found at {}", dir.display());
    None
}

#[test]
fn documents_match_expected_output() {
    let Some(dir) = vectors_dir() else { return };
    let mut entries: Vec<PathBuf> = fs::read_dir(dir.join("input"))
        .expect("read input folder")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    entries.sort();
    assert!(!entries.is_empty(), "no input vectors in {}", dir.display());
    for input_path in &entries {
        let name = input_path.file_name().expect("file name");
        let input = fs::read(input_path).expect("read input");
        let expected = fs::read(dir.join("output").join(name)).expect("read expected output");
        let got =
            jcs::canonicalize(&input).unwrap_or_else(|e| panic!("{}: {e}", input_path.display()));
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&expected),
            "{}",
            input_path.display()
        );
        assert_eq!(got, expected, "{}", input_path.display());
        // The canonical form is a fixed point.
        assert_eq!(jcs::canonicalize(&got).expect("re-canonicalize"), got);
    }
}

#[test]
fn es6_numbers_match_expected_output() {
    let Some(dir) = vectors_dir() else { return };
    let file = fs::File::open(dir.join(NUMBERS_FILE)).expect("open number vectors");
    let reader = BufReader::new(GzDecoder::new(file));
    let mut digest = Sha256::new();
    let mut lines = 0usize;
    let mut failures = Vec::new();
    for line in reader.lines() {
        let line = line.expect("read line");
        digest.update(line.as_bytes());
        digest.update(b"\n");
        lines += 1;
        let (hex, expected) = line.split_once(',').expect("hex,expected");
        let bits = u64::from_str_radix(hex, 16).expect("hex bit pattern");
        let f = f64::from_bits(bits);
        assert!(f.is_finite(), "line {lines}: {line}");
        // Two spellings of the same double: shortest scientific, and the full positional
        // expansion (which takes the many-digit path).
        for lexeme in [format!("{f:e}"), format!("{f}")] {
            let got = jcs::canonicalize(lexeme.as_bytes())
                .unwrap_or_else(|e| panic!("line {lines}: {lexeme}: {e}"));
            if got != expected.as_bytes() && failures.len() < 20 {
                failures.push(format!(
                    "line {lines}: {hex} from {lexeme}: got {} want {expected}",
                    String::from_utf8_lossy(&got)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(lines, NUMBERS_LINES);
    assert_eq!(hex::encode(digest.finalize()), NUMBERS_SHA256);
}
