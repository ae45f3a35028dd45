//! `mcpgw-bench run` against the demo upstream (no gateway): the load generator
//! speaks MCP correctly in both eras, counts every answer, and writes its JSON.

use std::path::Path;
use std::process::Command;

use mcpgw_testkit::Upstream;

fn start_upstream() -> Upstream {
    Upstream::start_binary(Path::new(env!("CARGO_BIN_EXE_mcpgw-bench")), &[])
}

fn run(url: &str, era: &str, out: &std::path::Path) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_mcpgw-bench"))
        .args([
            "run",
            "--url",
            url,
            "--era",
            era,
            "--sessions",
            "4",
            "--requests",
            "420",
            "--warmup",
            "0s",
            "--json",
        ])
        .arg(out)
        .output()
        .expect("run mcpgw-bench run");
    assert!(
        output.status.success(),
        "mcpgw-bench run failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("| run | 4 |"),
        "the table names the run: {stdout}"
    );
    let text = std::fs::read_to_string(out).expect("the JSON report is written");
    serde_json::from_str(&text).expect("the report is JSON")
}

#[test]
fn run_counts_every_request_in_both_eras() {
    let upstream = start_upstream();
    let dir = tempfile::tempdir().expect("temp dir");
    for era in ["legacy", "modern"] {
        let calls_before = upstream.counter("tool_calls");
        let report = run(&upstream.url, era, &dir.path().join(format!("{era}.json")));
        assert_eq!(report["era"], era);
        assert_eq!(
            report["requests"], 420,
            "{era}: exactly the requested count"
        );
        assert_eq!(
            report["ok"], 420,
            "{era}: every answer is a success: {report}"
        );
        assert_eq!(report["errors"], serde_json::json!({}));
        assert_eq!(report["latency"]["count"], 420);
        // 20 : 1 of 420 requests: 400 tools/call (each session's pattern is offset,
        // so allow for the boundary).
        let calls = report["tools_call_latency"]["count"].as_u64().unwrap_or(0);
        assert!((396..=404).contains(&calls), "{era}: {calls} tools/call");
        assert!(
            report["forwarded_fraction"].is_null(),
            "no gateway, no worker headers"
        );
        assert_eq!(report["workers"], serde_json::json!([null]));
        // Every counted success was executed by the server (the count also holds the
        // uncounted requests sent before measuring began).
        let executed = upstream.counter("tool_calls") - calls_before;
        assert!(
            executed >= calls,
            "{era}: {calls} counted tools/call, {executed} executed"
        );
    }
}
