//! The alert rules (`deploy/prometheus/alerts.yaml`) and the Grafana dashboard
//! (`deploy/grafana/idemgate.json`) against what the binary exports: every metric they name
//! is on `/metrics` of a running idemgate, and every label value they select on (`op="record"`,
//! `outcome=~"store_error|overloaded"`) exists on that metric. The dashboard's expressions,
//! with Grafana's variables filled in, must also parse as PromQL: they are written as
//! recording rules and run through `promtool check rules` (Debian's `prometheus` package,
//! which the tests' shared set-up, tests/setup/install.sh, installs).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use common::*;

const TOKEN: &str = "0123456789abcdef-admin";
const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// Labels that Prometheus's scrape adds (or Kubernetes discovery may): not idemgate's.
const TARGET_LABELS: [&str; 4] = ["job", "instance", "namespace", "pod"];

/// Series that Prometheus makes itself rather than scraping.
const PROMETHEUS_OWN: [&str; 1] = ["up"];

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// A metric with the label matchers written after it: `name{label op "value", ...}`.
#[derive(Debug)]
struct Selector {
    metric: String,
    matchers: Vec<(String, String, String)>,
}

/// The selectors of a PromQL expression. Function names (an identifier before `(`),
/// aggregation operators, keywords, the label lists of `by`/`without`/`on`/`ignoring`/`group_*`,
/// durations and numbers are not metrics; every other identifier is.
fn selectors(expr: &str) -> Vec<Selector> {
    const KEYWORDS: [&str; 14] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "atan2",
        "inf",
        "nan",
    ];
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const AGGREGATIONS: [&str; 12] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let s: Vec<char> = expr.chars().collect();
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let skip_ws = |mut i: usize| {
        while i < s.len() && s[i].is_whitespace() {
            i += 1;
        }
        i
    };
    // A string literal starting at `i`: its value and the index after it.
    let string = |i: usize| -> (String, usize) {
        let quote = s[i];
        let mut out = String::new();
        let mut j = i + 1;
        while j < s.len() && s[j] != quote {
            if s[j] == '\\' && quote != '`' && j + 1 < s.len() {
                j += 1;
            }
            out.push(s[j]);
            j += 1;
        }
        assert!(j < s.len(), "unterminated string in {expr}");
        (out, j + 1)
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c == '"' || c == '\'' || c == '`' {
            i = string(i).1;
        } else if c == '[' {
            // A range or subquery: durations only.
            while i < s.len() && s[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '$' {
            // A Grafana variable left in.
            i += 1;
            while i < s.len() && (ident_char(s[i]) || s[i] == '{' || s[i] == '}') {
                i += 1;
            }
        } else if c.is_ascii_digit() || (c == '.' && i + 1 < s.len() && s[i + 1].is_ascii_digit()) {
            // Numbers (1e-3, 0x1f) and durations (offset 5m).
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '.') {
                i += 1;
            }
        } else if c == '{' {
            // Matchers without a metric name before them.
            i = matchers(&s, i, &string).1;
        } else if ident_start(c) {
            let start = i;
            while i < s.len() && ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let next = skip_ws(i);
            if LABEL_LISTS.contains(&word.as_str()) && next < s.len() && s[next] == '(' {
                let close = (next..s.len()).find(|&j| s[j] == ')').unwrap();
                i = close + 1;
            } else if KEYWORDS.contains(&word.as_str())
                || AGGREGATIONS.contains(&word.as_str())
                || (next < s.len() && s[next] == '(')
            {
                // A keyword, a function, or an aggregation (`sum by (le) (...)`).
            } else {
                let mut found = Vec::new();
                if next < s.len() && s[next] == '{' {
                    let (m, after) = matchers(&s, next, &string);
                    found = m;
                    i = after;
                }
                out.push(Selector {
                    metric: word,
                    matchers: found,
                });
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The label matchers of `{...}` starting at `i`, and the index after `}`.
fn matchers(
    s: &[char],
    mut i: usize,
    string: &dyn Fn(usize) -> (String, usize),
) -> (Vec<(String, String, String)>, usize) {
    assert_eq!(s[i], '{');
    i += 1;
    let mut out = Vec::new();
    loop {
        while i < s.len() && (s[i].is_whitespace() || s[i] == ',') {
            i += 1;
        }
        assert!(i < s.len(), "unterminated matchers");
        if s[i] == '}' {
            return (out, i + 1);
        }
        let start = i;
        while s[i].is_ascii_alphanumeric() || s[i] == '_' {
            i += 1;
        }
        let label: String = s[start..i].iter().collect();
        while s[i].is_whitespace() {
            i += 1;
        }
        let op_start = i;
        while matches!(s[i], '=' | '!' | '~') {
            i += 1;
        }
        let op: String = s[op_start..i].iter().collect();
        while s[i].is_whitespace() {
            i += 1;
        }
        let (value, after) = string(i);
        i = after;
        out.push((label, op, value));
    }
}

/// The `expr:` of every rule in a Prometheus rule file: inline (plain or double-quoted) or
/// a `|`/`>` block. Anything else fails, so that no expression is silently left out.
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        i += 1;
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let value = value.trim();
        if value.starts_with('|') || value.starts_with('>') {
            let indent = line.len() - trimmed.len();
            let mut block = Vec::new();
            while i < lines.len() {
                let l = lines[i];
                let ind = l.len() - l.trim_start().len();
                if !l.trim().is_empty() && ind <= indent {
                    break;
                }
                block.push(l.trim());
                i += 1;
            }
            out.push(block.join(" ").trim().to_string());
        } else if value.starts_with('"') {
            out.push(serde_json::from_str::<String>(value).unwrap());
        } else {
            assert!(
                !value.is_empty() && !value.starts_with('\''),
                "expr form not understood: {line}"
            );
            out.push(value.to_string());
        }
    }
    out
}

/// Every `expr` in the dashboard (panels, rows' nested panels), and the selector of each
/// query variable (`label_values(<selector>, <label>)`).
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::String(e)) = m.get("expr") {
                    out.push(e.clone());
                }
                for (k, child) in m {
                    if k != "templating" {
                        walk(child, out);
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|c| walk(c, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, &mut out);
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] != "query" {
            continue;
        }
        let query = match &var["query"] {
            serde_json::Value::String(q) => q.clone(),
            q => q["query"].as_str().unwrap().to_string(),
        };
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable query not understood: {query}"));
        // label_values(<selector>, <label>); label_values(<label>) names no metric.
        if let Some((selector, _label)) = inner.rsplit_once(',') {
            out.push(selector.trim().to_string());
        }
    }
    out
}

/// Grafana's variables replaced the way Grafana would: intervals by a duration, the
/// dashboard's own variables by a regex matching anything (they are all used in `=~`).
fn substitute(expr: &str) -> String {
    let mut e = expr.to_string();
    for (var, value) in [
        ("$__rate_interval", "5m"),
        ("${__rate_interval}", "5m"),
        ("$__interval", "1m"),
        ("${__interval}", "1m"),
        ("$__range", "1h"),
        ("${__range}", "1h"),
    ] {
        e = e.replace(var, value);
    }
    let mut out = String::new();
    let mut chars = e.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        if chars.peek() == Some(&'{') {
            for c in chars.by_ref() {
                if c == '}' {
                    break;
                }
            }
        } else {
            while chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
            {
                chars.next();
            }
        }
        out.push_str(".*");
    }
    out
}

/// Metric name → the sample lines of `/metrics` with that name.
fn exported(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let end = line.find(['{', ' ']).unwrap();
        out.entry(line[..end].to_string())
            .or_default()
            .push(line.to_string());
    }
    out
}

/// Each selector's metric is exported, and each label value it selects on (`=` and the
/// alternatives of a `=~` of plain words) is on one of that metric's series.
fn check_against(what: &str, exprs: &[String], metrics: &BTreeMap<String, Vec<String>>) {
    let mut missing = BTreeSet::new();
    for expr in exprs {
        for sel in selectors(expr) {
            if PROMETHEUS_OWN.contains(&sel.metric.as_str()) {
                continue;
            }
            let Some(series) = metrics.get(&sel.metric) else {
                missing.insert(format!("{} (in {expr})", sel.metric));
                continue;
            };
            for (label, op, value) in &sel.matchers {
                let plain = |v: &str| v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if TARGET_LABELS.contains(&label.as_str()) || !(op == "=" || op == "=~") {
                    continue;
                }
                let values: Vec<&str> = if op == "=" {
                    vec![value.as_str()]
                } else if value.split('|').all(plain) {
                    value.split('|').collect()
                } else {
                    continue;
                };
                for v in values {
                    let needle = format!("{label}=\"{v}\"");
                    if !series.iter().any(|l| l.contains(&needle)) {
                        missing.insert(format!("{}{{{needle}}} (in {expr})", sel.metric));
                    }
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "{what} uses series that idemgate does not export:\n{}",
        missing.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_expression_scanner_finds_metrics_and_matchers() {
    let sels = selectors(
        r#"histogram_quantile(0.99, sum by (le, op) (rate(a_bucket{op=~"claim|record", job=~"$job"}[$__rate_interval]))) / ignoring (outcome) group_left sum(rate(b_total{outcome!="x"}[5m] offset 1h)) > 0.1 and on() absent(up{job="idemgate"})"#,
    );
    let names: Vec<&str> = sels.iter().map(|s| s.metric.as_str()).collect();
    assert_eq!(names, ["a_bucket", "b_total", "up"]);
    assert_eq!(
        sels[0].matchers,
        [
            ("op".into(), "=~".into(), "claim|record".into()),
            ("job".into(), "=~".into(), "$job".into())
        ]
    );
    assert_eq!(
        substitute(r#"rate(x{instance=~"$instance", job=~"${job}"}[$__rate_interval])"#),
        r#"rate(x{instance=~".*", job=~".*"}[5m])"#
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_and_dashboard_use_only_exported_metrics() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.admin_token = Some(TOKEN.into()))
        .binary();
    let c = client();
    // A forwarded, a replayed and a pass-through request, so that the labelled series have
    // moved (they exist at 0 from the start anyway).
    let first = post_url(&c, &gate.url("/v1/transfers"), Some("obs-1"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    let again = post_url(&c, &gate.url("/v1/transfers"), Some("obs-1"), TRANSFER, &[]).await;
    assert!(again.replayed());
    let get = c.get(gate.url("/v1/accounts/7")).send().await.unwrap();
    assert!(get.status().is_success());

    let res = c
        .get(gate.admin_url("/metrics"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let text = res.text().await.unwrap();
    let mut metrics = exported(&text);
    assert!(
        text.contains("idemgate_requests_total{route=\"default\",outcome=\"replayed\"} 1"),
        "{text}"
    );
    // The series that exist only with a TLS listener (its certificate's expiry) or a route
    // in observe mode, from a second instance that has both.
    let ca = common::certs::Ca::new("ca");
    let leaf = ca.leaf(&["127.0.0.1"]);
    let files = common::certs::Dir::new();
    let (cert, key) = (
        files.write("tls.crt", &leaf.cert),
        files.write("tls.key", &leaf.key),
    );
    let tls_gate = Idemgate::new(&up.url())
        .set(|c| {
            c.tls_cert_file = Some(cert.into());
            c.tls_key_file = Some(key.into());
            // And the series of a route in observe mode.
            c.defaults.mode = idemgate::config::Mode::Observe;
        })
        .binary();
    let tls_text = c
        .get(tls_gate.admin_url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (name, lines) in exported(&tls_text) {
        metrics.entry(name).or_default().extend(lines);
    }

    let alerts_yaml = repo_file("deploy/prometheus/alerts.yaml");
    let alerts = rule_exprs(&alerts_yaml);
    let rules = alerts_yaml
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(alerts.len(), rules, "one expr per alert");
    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file("deploy/grafana/idemgate.json")).unwrap();
    let panels = dashboard_exprs(&dashboard);
    assert!(panels.len() >= 10, "{panels:?}");

    // The scanner really saw them (an empty list would pass everything).
    let used = |exprs: &[String]| -> BTreeSet<String> {
        exprs
            .iter()
            .flat_map(|e| selectors(e))
            .map(|s| s.metric)
            .collect()
    };
    let in_alerts = used(&alerts);
    for name in [
        "up",
        "idemgate_records_unknown_total",
        "idemgate_store_duration_seconds_bucket",
        "idemgate_scope_secret_agreed",
    ] {
        assert!(in_alerts.contains(name), "{name} not in {in_alerts:?}");
    }
    let in_dashboard = used(&panels);
    for name in [
        "idemgate_requests_total",
        "idemgate_upstream_duration_seconds_bucket",
        "idemgate_redis_evicted_keys",
    ] {
        assert!(
            in_dashboard.contains(name),
            "{name} not in {in_dashboard:?}"
        );
    }
    // A histogram's quantile reads `_bucket`; its family name alone has no samples.
    for name in in_alerts.iter().chain(&in_dashboard) {
        if let Some(base) = name.strip_suffix("_bucket") {
            assert!(
                text.contains(&format!("# TYPE {base} histogram\n")),
                "{name}"
            );
        }
    }

    check_against("alerts.yaml", &alerts, &metrics);
    check_against("the dashboard", &panels, &metrics);

    // Every dashboard expression parses: as recording rules through promtool.
    let substituted: Vec<String> = panels.iter().map(|e| substitute(e)).collect();
    for e in &substituted {
        assert!(!e.contains('$'), "a variable left in {e}");
    }
    common::setup::tools();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard_rules.yaml");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in substituted.iter().enumerate() {
        rules.push_str(&format!(
            "      - record: dashboard:expr_{i}\n        expr: {}\n",
            serde_json::to_string(e).unwrap()
        ));
    }
    std::fs::write(&file, &rules).unwrap();
    let check = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check rules on the dashboard's expressions:\n{}{}\n{rules}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(
        stdout.contains(&format!("SUCCESS: {} rules found", substituted.len())),
        "{stdout}"
    );
}

/// The series the per-route panels, the status-class panel and the held-unknown alert read:
/// requests by route, answers recorded by status class, and the records held `unknown` now,
/// counted by walking the store (and back to 0 once an operator releases them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_status_class_and_held_unknown_series_move() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.routes = vec![idemgate::config::Route {
                path: "/v1/transfers".into(),
                ..Default::default()
            }];
            c.unknown_count_interval = std::time::Duration::from_millis(100);
            c.defaults.upstream_timeout = std::time::Duration::from_millis(300);
        })
        .binary();
    let c = client();
    let metrics = || async {
        c.get(gate.admin_url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let url = gate.url("/v1/transfers");
    assert_eq!(
        post_url(&c, &url, Some("m-1"), TRANSFER, &[]).await.status,
        201
    );
    let failed = post_url(&c, &url, Some("m-2"), TRANSFER, &[(STATUS, "502")]).await;
    assert_eq!(failed.status, 502);
    assert_eq!(
        post_url(&c, &gate.url("/other"), Some("m-3"), TRANSFER, &[])
            .await
            .status,
        201
    );
    // Sent, never answered: held unknown.
    let hung = post_url(&c, &url, Some("m-4"), TRANSFER, &[(FAULT, "hang")]).await;
    assert_eq!(hung.status, 504);
    let text = metrics().await;
    for line in [
        "idemgate_requests_total{route=\"/v1/transfers\",outcome=\"forwarded\"} 2",
        "idemgate_requests_total{route=\"default\",outcome=\"forwarded\"} 1",
        "idemgate_answers_recorded_total{status_class=\"2xx\"} 2",
        "idemgate_answers_recorded_total{status_class=\"5xx\"} 1",
    ] {
        assert!(text.contains(line), "{line} not in:\n{text}");
    }
    let held = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("idemgate_records_held_unknown "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let seen = common::retry_until(
        std::time::Duration::from_secs(5),
        async || held(&metrics().await),
        |seen| *seen == Some(1.0),
    )
    .await;
    assert_eq!(seen, Some(1.0), "one record held unknown");
    // Released by an operator: the count goes back to 0.
    let page: serde_json::Value = c
        .get(gate.admin_url("/records?state=unknown"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = page["records"][0]["id"].as_str().unwrap().to_string();
    let del = c
        .delete(gate.admin_url(&format!("/records/{id}?force=true&reason=test")))
        .send()
        .await
        .unwrap();
    assert!(del.status().is_success(), "{}", del.status());
    let seen = common::retry_until(
        std::time::Duration::from_secs(5),
        async || held(&metrics().await),
        |seen| *seen == Some(0.0),
    )
    .await;
    assert_eq!(seen, Some(0.0), "released: no record held unknown");
}

/// The alert table in docs/operations.md is alerts.yaml's: one row per alert, in its
/// order, with its severity, `for` and expression (whitespace folded, `|` escaped).
#[test]
fn the_operations_alert_table_is_alerts_yaml() {
    let yaml = repo_file("deploy/prometheus/alerts.yaml");
    let exprs = rule_exprs(&yaml);
    // Name, severity and `for` of each rule, in order (`for` absent: "-").
    let mut rules: Vec<(String, String, String)> = Vec::new();
    for line in yaml.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert:") {
            rules.push((name.trim().to_string(), String::new(), "-".to_string()));
        } else if let (Some(v), Some(rule)) = (line.strip_prefix("for:"), rules.last_mut()) {
            rule.2 = v.trim().to_string();
        } else if let (Some(v), Some(rule)) = (line.strip_prefix("severity:"), rules.last_mut()) {
            rule.1 = v.trim().to_string();
        }
    }
    assert_eq!(rules.len(), exprs.len(), "one expr per alert");
    let expected: Vec<String> = rules
        .iter()
        .zip(&exprs)
        .map(|((name, severity, f), expr)| {
            let expr = expr.split_whitespace().collect::<Vec<_>>().join(" ");
            format!(
                "| [{name}](runbook.md#{}) | {severity} | {f} | `{}` |",
                name.to_lowercase(),
                expr.replace('|', "\\|")
            )
        })
        .collect();
    let ops = repo_file("docs/operations.md");
    let marker = "<!-- alerts-table: generated from deploy/prometheus/alerts.yaml";
    let at = ops.find(marker).expect("the alert table's marker");
    let rows: Vec<String> = ops[at..]
        .lines()
        .skip(3)
        .take_while(|l| l.starts_with('|'))
        .map(str::to_string)
        .collect();
    assert_eq!(
        rows,
        expected,
        "docs/operations.md's alert table differs from alerts.yaml; the rows should be:\n{}",
        expected.join("\n")
    );
}
