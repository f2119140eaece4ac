//! Fingerprint throughput on payment-like JSON bodies, against parsing and re-serializing the
//! same body with `serde_json` in the same run.
//!
//! Crates: `criterion` for the measurements; `serde_json` is the baseline (the work a proxy
//! would do anyway to look at a JSON body).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use idemgate::fingerprint::{fingerprint, JsonPointer, RequestParts};

/// One transfer object of a batch-payout request, varied by `i`.
fn transfer(i: usize) -> String {
    let currencies = ["EUR", "USD", "GBP", "JPY", "CHF"];
    let names = [
        "Zoë Müller",
        "François Dupont",
        "José Álvarez",
        "Łukasz Wiśniewski",
        "王小明",
        "Ayşe Yılmaz",
    ];
    format!(
        concat!(
            "{{\"id\": \"tr_{:08x}\", \"amount\": {}, \"fee\": {}.{:02}, \"fx_rate\": 1.{:06}e0, ",
            "\"currency\": \"{}\", \"destination\": {{\"account\": \"acct_{:06}\", ",
            "\"iban\": \"DE89 3704 0044 0532 0130 {:02}\", \"holder\": \"{}\", ",
            "\"address\": {{\"line1\": \"Straße {} \\u00e4\", \"city\": \"K\\u00f6ln\", \"country\": \"DE\"}}}}, ",
            "\"description\": \"Invoice #{} \\\"Q{}\\\" \\u2014 caf\\u00e9 \\ud83d\\udcb6\\n\", ",
            "\"metadata\": {{\"order_id\": \"ord-{}\", \"attempt\": {}, \"priority\": {}, \"tags\": [\"payout\", \"batch\", null]}}, ",
            "\"created\": 1717171717{:03}}}"
        ),
        0x1000_0000 + i * 7919,
        1000 + i * 137 % 100_000,
        i % 10,
        i % 100,
        (i * 7) % 1_000_000,
        currencies[i % currencies.len()],
        i,
        i % 100,
        names[i % names.len()],
        i % 300,
        20_240_000 + i,
        i % 4 + 1,
        i,
        i % 3,
        if i.is_multiple_of(2) { "true" } else { "false" },
        i % 1000,
    )
}

/// A payout batch of at least `target` bytes (the closing bytes make it a little longer).
fn document(target: usize) -> Vec<u8> {
    let mut doc = String::from(
        "{\"batch_id\": \"batch_7f3a\", \"client_ts\": \"2024-06-01T12:00:00Z\", \"transfers\": [",
    );
    let mut i = 0;
    while doc.len() + 40 < target {
        if i > 0 {
            doc.push_str(", ");
        }
        doc.push_str(&transfer(i));
        i += 1;
    }
    doc.push_str("], \"total_count\": ");
    doc.push_str(&i.to_string());
    doc.push('}');
    doc.into_bytes()
}

fn bench(c: &mut Criterion) {
    let ignore = vec![JsonPointer::parse("/client_ts").expect("pointer")];
    for (label, target) in [("1KiB", 1024), ("64KiB", 64 * 1024)] {
        let body = document(target);
        // Both sides must accept the document, or the comparison means nothing.
        serde_json::from_slice::<serde_json::Value>(&body).expect("valid JSON");
        assert!(idemgate::fingerprint::jcs::canonicalize_exact(&body, &ignore).is_ok());

        let mut group = c.benchmark_group(format!("fingerprint/{label}"));
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("idemgate", body.len()),
            &body,
            |b, body| {
                b.iter(|| {
                    fingerprint(
                        black_box(&RequestParts {
                            method: "POST",
                            path: "/v1/payouts",
                            query: None,
                            content_type: Some("application/json"),
                            body,
                            ..Default::default()
                        }),
                        &ignore,
                    )
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("serde_json_baseline", body.len()),
            &body,
            |b, body| {
                b.iter(|| {
                    let v: serde_json::Value =
                        serde_json::from_slice(black_box(body)).expect("valid JSON");
                    serde_json::to_vec(&v).expect("serializes")
                })
            },
        );
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
