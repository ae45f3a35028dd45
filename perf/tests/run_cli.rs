//! `mcpgw-bench run` against the demo upstream (no gateway): the load generator
//! speaks MCP correctly in both eras, counts every answer, and writes its JSON.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Kills the server even when an assertion fails first.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_upstream() -> (Server, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_mcpgw-bench"))
        .args(["upstream", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start mcpgw-bench upstream");
    let mut server = Server(child);
    let stdout = server.0.stdout.take().expect("stdout is piped");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the announcement");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("unexpected announcement: {line:?}"))
        .to_owned();
    (server, url)
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
    let (_upstream, url) = start_upstream();
    let dir = std::env::temp_dir().join(format!("mcpgw-bench-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for era in ["legacy", "modern"] {
        let report = run(&url, era, &dir.join(format!("{era}.json")));
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
    }
    let _ = std::fs::remove_dir_all(&dir);
}
