//! What an operator gets (`deploy/monitoring/`): the alert rules pass `promtool check
//! rules` and their unit tests (`promtool test rules`: each alert fires on the series
//! of its fault, none on a quiet fleet), and every mcpgw metric the rules and the
//! Grafana dashboard query is one a worker exports.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use mcpgw_testkit::http;
use mcpgw_testkit::{Gateway, Upstream};

fn monitoring_dir() -> PathBuf {
    mcpgw_testkit::workspace_root().join("deploy/monitoring")
}

/// Runs promtool with `args` in deploy/monitoring; fails the test, saying what to
/// install, when promtool is missing (unless `MCPGW_ALLOW_SKIP` names `promtool`, then
/// `None`).
fn promtool(args: &[&str]) -> Option<std::process::Output> {
    match Command::new("promtool")
        .args(args)
        .current_dir(monitoring_dir())
        .output()
    {
        Ok(out) => Some(out),
        Err(e) => {
            assert!(
                mcpgw_testkit::skip_allowed("promtool"),
                "promtool cannot run ({e}): install Debian's prometheus package (make deps does), \
                 or set MCPGW_ALLOW_SKIP=promtool"
            );
            println!("SKIPPED (MCPGW_ALLOW_SKIP=promtool): promtool cannot run: {e}");
            None
        }
    }
}

#[test]
fn the_alert_rules_are_valid_and_their_unit_tests_pass() {
    for args in [
        &["check", "rules", "alerts.yml"][..],
        &["test", "rules", "alerts_test.yml"],
    ] {
        let Some(out) = promtool(args) else { return };
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The metric families a worker exports: those it lists in `/metrics` (a family
/// without labels is listed before its first sample), and those gateway/src/metrics.rs
/// registers (one with labels is listed only once it has a sample).
fn exported_families() -> BTreeSet<String> {
    let upstream = Upstream::start();
    let gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let admin = gateway
        .admin
        .as_deref()
        .expect("a standalone worker's admin address");
    let text = http::request(admin, "GET", "/metrics", &[], b"").text();
    let mut families: BTreeSet<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next().map(str::to_owned))
        .collect();
    let source =
        std::fs::read_to_string(mcpgw_testkit::workspace_root().join("gateway/src/metrics.rs"))
            .expect("read gateway/src/metrics.rs");
    // `add(\n r,\n "name",` and `add_seconds(...)`, whose unit adds `_seconds`.
    let words: Vec<&str> = source.split_whitespace().collect();
    let registered: Vec<String> = words
        .windows(3)
        .filter_map(|w| {
            let unit = match w[0] {
                "add(" => "",
                "add_seconds(" => "_seconds",
                _ => return None,
            };
            let name = w[2].strip_prefix('"')?.strip_suffix("\",")?;
            Some(format!("mcpgw_{name}{unit}"))
        })
        .collect();
    assert!(
        registered.len() > 20,
        "read the registrations of gateway/src/metrics.rs: {registered:?}"
    );
    families.extend(registered);
    families
}

/// Every `mcpgw_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("mcpgw_") {
        let name: String = text[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(name);
    }
    names
}

#[test]
fn every_metric_the_rules_and_the_dashboard_query_is_exported() {
    let families = exported_families();
    assert!(families.len() > 20, "a worker's families: {families:?}");
    let known = |name: &str| {
        families.contains(name)
            || ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .any(|suffix| {
                    name.strip_suffix(suffix)
                        .is_some_and(|family| families.contains(family))
                })
    };
    for file in ["alerts.yml", "dashboard.json"] {
        let text = std::fs::read_to_string(monitoring_dir().join(file)).expect("read");
        if file.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(&text).expect("the dashboard is JSON");
        }
        let unknown: Vec<String> = metric_names(&text)
            .into_iter()
            .filter(|name| !known(name))
            .collect();
        assert!(
            unknown.is_empty(),
            "{file} queries metrics no worker exports: {unknown:?} (exported: {families:?})"
        );
    }
}
