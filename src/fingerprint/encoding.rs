//! `Content-Encoding`d bodies: the fingerprint is taken over the decoded content, so a gzip
//! body whose header says another mtime, or the same JSON sent unencoded, is the same request.
//!
//! Crates: `flate2` (pure-Rust miniz_oxide backend) for gzip and deflate, `brotli-decompressor`
//! for br. Every decoder is read in a loop into a buffer that never grows past the limit
//! (`max_body_bytes`), so a small bomb is refused having cost at most that much memory.
//! A decode's work, what its decoders read plus what they write across every layer, is
//! bounded too ([`WORK_PER_LIMIT`] times the limit): layers that each fit cannot add up to
//! many times the limit. How many layers a request may name is the proxy's to bound
//! (`max_content_codings`, counted by [`count`]) before anything is decoded.

use std::cell::Cell;
use std::io::{self, Read};

/// How many times the limit a decode may read plus write in all, across its layers. Two
/// layers whose output each fits never reach it: the body (at most the limit) read, the
/// first layer's output written and read again, the second's written.
pub const WORK_PER_LIMIT: u64 = 4;

/// Decoding would produce more than the limit, or do more than its work budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge;

/// What [`decode`] made of a body.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// No coding but `identity`: the body is its content.
    Identity,
    /// Every coding was known and the content decoded, within the limit.
    Content(Vec<u8>),
    /// A coding this build does not know, or a body that does not decode under its codings:
    /// fingerprinted over its raw bytes, with the codings.
    Raw,
}

/// The codings of a `Content-Encoding` value, in the order they were applied: tokens
/// trimmed and lowercased, `identity` and empty list members dropped.
pub(crate) fn codings(content_encoding: Option<&str>) -> Vec<String> {
    members(content_encoding.unwrap_or_default())
        .map(str::to_ascii_lowercase)
        .collect()
}

/// How many codings a `Content-Encoding` value (or one of its lines) names, as [`codings`]
/// lists them: `identity` and empty list members are not counted.
pub fn count(content_encoding: &str) -> usize {
    members(content_encoding).count()
}

/// The codings a `Content-Encoding` value names, as written: its list members trimmed,
/// without the empty ones and `identity`.
fn members(content_encoding: &str) -> impl Iterator<Item = &str> {
    content_encoding
        .split(',')
        .map(|t| t.trim_matches(|c| c == ' ' || c == '\t'))
        .filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case("identity"))
}

/// Whether [`decode`] may take long enough to belong off the serving thread: what it costs
/// grows with its output, which a small body can make as large as the limit.
pub fn is_heavy(content_encoding: Option<&str>, body: &[u8], limit: usize) -> bool {
    const OFF_THREAD: usize = 64 * 1024;
    const INLINE_OUTPUT: usize = 1024 * 1024;
    (body.len() > OFF_THREAD || limit > INLINE_OUTPUT) && !codings(content_encoding).is_empty()
}

/// Undoes the codings of `content_encoding` (last applied first), never holding more than
/// `limit` bytes of output at any step, and stopping once its decoders have read plus
/// written more than [`WORK_PER_LIMIT`] times `limit` in all.
pub fn decode(
    content_encoding: Option<&str>,
    body: &[u8],
    limit: usize,
) -> Result<Decoded, TooLarge> {
    let codings = codings(content_encoding);
    if codings.is_empty() {
        return Ok(Decoded::Identity);
    }
    if !codings.iter().all(|c| known(c)) {
        return Ok(Decoded::Raw);
    }
    let work = Work {
        spent: Cell::new(0),
        budget: u64::try_from(limit)
            .unwrap_or(u64::MAX)
            .saturating_mul(WORK_PER_LIMIT),
    };
    let mut content: Option<Vec<u8>> = None;
    for coding in codings.iter().rev() {
        let input = content.as_deref().unwrap_or(body);
        match decode_one(coding, input, limit, &work) {
            Ok(out) => content = Some(out),
            Err(Failure::TooLarge) => return Err(TooLarge),
            Err(Failure::Corrupt) => return Ok(Decoded::Raw),
        }
    }
    Ok(content.map_or(Decoded::Identity, Decoded::Content))
}

fn known(coding: &str) -> bool {
    matches!(coding, "gzip" | "x-gzip" | "deflate" | "br")
}

enum Failure {
    TooLarge,
    Corrupt,
}

/// What one decode has spent of its work budget: bytes its decoders read plus bytes they
/// wrote, over every layer so far.
struct Work {
    spent: Cell<u64>,
    budget: u64,
}

impl Work {
    fn charge(&self, n: usize) {
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        self.spent.set(self.spent.get().saturating_add(n));
    }

    fn spent(&self) -> bool {
        self.spent.get() > self.budget
    }
}

/// A layer's input, charging what its decoder reads of it to the decode's work.
struct Metered<'a> {
    input: &'a [u8],
    work: &'a Work,
}

impl Read for Metered<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.input.read(buf)?;
        self.work.charge(n);
        Ok(n)
    }
}

fn decode_one(coding: &str, input: &[u8], limit: usize, work: &Work) -> Result<Vec<u8>, Failure> {
    let metered = || Metered { input, work };
    match coding {
        // Concatenated members are one gzip body (RFC 1952 section 2.2).
        "gzip" | "x-gzip" => {
            read_bounded(flate2::read::MultiGzDecoder::new(metered()), limit, work)
        }
        // RFC 9110 says zlib (RFC 1950); many clients send a raw deflate stream (RFC 1951)
        // instead. A zlib stream starts with a header whose check bits a raw one's first
        // block almost never has; when it has, and zlib fails, raw is tried too.
        "deflate" => {
            if looks_like_zlib(input) {
                match read_bounded(flate2::read::ZlibDecoder::new(metered()), limit, work) {
                    Err(Failure::Corrupt) => {}
                    done => return done,
                }
            }
            read_bounded(flate2::read::DeflateDecoder::new(metered()), limit, work)
        }
        "br" => read_bounded(
            brotli_decompressor::Decompressor::new(metered(), 16 * 1024),
            limit,
            work,
        ),
        _ => Err(Failure::Corrupt),
    }
}

/// CM = 8 (deflate), a window of at most 32 KiB, and the header check (RFC 1950 section 2.2).
fn looks_like_zlib(input: &[u8]) -> bool {
    match input {
        [cmf, flg, ..] => {
            cmf & 0x0f == 8 && cmf >> 4 <= 7 && (u16::from(*cmf) << 8 | u16::from(*flg)) % 31 == 0
        }
        _ => false,
    }
}

/// Reads `r` to its end, refusing as soon as more than `limit` bytes came out, or the
/// decode's `work` is spent: the output never holds more than `limit` bytes (plus one chunk
/// of the stack buffer).
fn read_bounded(mut r: impl Read, limit: usize, work: &Work) -> Result<Vec<u8>, Failure> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match r.read(&mut chunk) {
            Ok(0) if work.spent() => return Err(Failure::TooLarge),
            Ok(0) => return Ok(out),
            Ok(n) => {
                work.charge(n);
                if out.len() + n > limit || work.spent() {
                    return Err(Failure::TooLarge);
                }
                out.extend_from_slice(&chunk[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(Failure::Corrupt),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const LIMIT: usize = 1 << 20;

    pub(crate) fn gzip(data: &[u8], mtime: u32) -> Vec<u8> {
        let mut e = flate2::GzBuilder::new()
            .mtime(mtime)
            .write(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn raw_deflate(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    /// A brotli stream of `data` as one uncompressed meta-block (RFC 7932 section 9.2), so
    /// the tests need no encoder: WBITS 16, then ISLAST=0, MNIBBLES=4, MLEN-1, ISUNCOMPRESSED=1,
    /// byte-aligned data, then an empty last meta-block.
    fn brotli_stored(data: &[u8]) -> Vec<u8> {
        assert!(!data.is_empty() && data.len() <= 1 << 16);
        let mut bits: Vec<bool> = Vec::new();
        let put = |v: u32, n: u32, bits: &mut Vec<bool>| {
            for i in 0..n {
                bits.push(v >> i & 1 == 1);
            }
        };
        put(0, 1, &mut bits); // WBITS = 16
        put(0, 1, &mut bits); // ISLAST = 0
        put(0, 2, &mut bits); // MNIBBLES = 4
        put(data.len() as u32 - 1, 16, &mut bits); // MLEN - 1
        put(1, 1, &mut bits); // ISUNCOMPRESSED
        while !bits.len().is_multiple_of(8) {
            bits.push(false);
        }
        let mut out: Vec<u8> = bits
            .chunks(8)
            .map(|b| b.iter().rev().fold(0u8, |a, &x| a << 1 | u8::from(x)))
            .collect();
        out.extend_from_slice(data);
        out.push(0b11); // ISLAST = 1, ISLASTEMPTY = 1
        out
    }

    #[test]
    fn layers_that_each_fit_stop_at_the_work_budget() {
        const SMALL: usize = 64 * 1024;
        // Stored (uncompressed) layers, each about 60 KB: every output fits under SMALL.
        let stored = |data: &[u8]| {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::none());
            e.write_all(data).unwrap();
            e.finish().unwrap()
        };
        let content: Vec<u8> = (0..60_000u32).map(|i| (i % 251) as u8).collect();
        let two = stored(&stored(&content));
        let want = Decoded::Content(content.clone());
        assert_eq!(decode(Some("gzip, gzip"), &two, SMALL), Ok(want));
        // Three read plus write about 360 KB, over 4 x 64 KiB.
        let three = stored(&two);
        assert!(three.len() <= SMALL);
        assert_eq!(
            decode(Some("gzip, gzip, gzip"), &three, SMALL),
            Err(TooLarge)
        );
        assert!(decode(Some("gzip, gzip, gzip"), &three, 2 * SMALL).is_ok());
        assert_eq!(count(" GZIP, identity,, br "), 2);
    }

    #[test]
    fn codings_are_normalized() {
        assert!(codings(None).is_empty());
        assert!(codings(Some("")).is_empty());
        assert!(codings(Some(" identity ")).is_empty());
        assert_eq!(codings(Some("GZip, ,br")), ["gzip", "br"]);
    }

    #[test]
    fn known_codings_decode() {
        let data = br#"{"amount":100}"#;
        let want = Decoded::Content(data.to_vec());
        assert_eq!(decode(Some("gzip"), &gzip(data, 1), LIMIT), Ok(want));
        let want = || Decoded::Content(data.to_vec());
        assert_eq!(decode(Some("x-gzip"), &gzip(data, 9), LIMIT), Ok(want()));
        assert_eq!(decode(Some("deflate"), &zlib(data), LIMIT), Ok(want()));
        assert_eq!(
            decode(Some("deflate"), &raw_deflate(data), LIMIT),
            Ok(want())
        );
        assert_eq!(decode(Some("br"), &brotli_stored(data), LIMIT), Ok(want()));
        // Applied in order, so undone last first.
        let both = brotli_stored(&gzip(data, 3));
        assert_eq!(decode(Some("gzip, br"), &both, LIMIT), Ok(want()));
        assert_eq!(decode(Some("identity"), data, LIMIT), Ok(Decoded::Identity));
        assert_eq!(decode(None, data, LIMIT), Ok(Decoded::Identity));
    }

    #[test]
    fn unknown_or_corrupt_is_raw() {
        let data = b"hello";
        assert_eq!(decode(Some("zstd"), data, LIMIT), Ok(Decoded::Raw));
        assert_eq!(
            decode(Some("gzip, zstd"), &gzip(data, 0), LIMIT),
            Ok(Decoded::Raw)
        );
        assert_eq!(decode(Some("gzip"), data, LIMIT), Ok(Decoded::Raw));
        let mut cut = gzip(data, 0);
        cut.truncate(cut.len() - 4);
        assert_eq!(decode(Some("gzip"), &cut, LIMIT), Ok(Decoded::Raw));
        assert_eq!(decode(Some("br"), b"\xff\xff\xff", LIMIT), Ok(Decoded::Raw));
    }

    #[test]
    fn a_bomb_stops_at_the_limit() {
        let zeros = vec![0u8; 10 << 20];
        let bomb = gzip(&zeros, 0);
        assert!(bomb.len() < 20 * 1024, "{}", bomb.len());
        assert_eq!(decode(Some("gzip"), &bomb, LIMIT), Err(TooLarge));
        let exact = gzip(&zeros[..LIMIT], 0);
        assert_eq!(
            decode(Some("gzip"), &exact, LIMIT),
            Ok(Decoded::Content(zeros[..LIMIT].to_vec()))
        );
        assert_eq!(decode(Some("gzip"), &exact, LIMIT - 1), Err(TooLarge));
        assert!(is_heavy(Some("gzip"), &vec![0; 65 * 1024], LIMIT));
        assert!(!is_heavy(None, &vec![0; 65 * 1024], LIMIT));
        assert!(!is_heavy(Some("gzip"), &bomb, LIMIT));
        assert!(is_heavy(Some("gzip"), &bomb, 8 * LIMIT));
    }
}
