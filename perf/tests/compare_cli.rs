//! `mcpgw-bench compare` with the virtual-server configurations, briefly: a real
//! two-worker fleet (Redis, TCP mesh, the demo upstream) serves the same load
//! through the plain route and through the three-member virtual server, sticky and
//! forwarded, and the report sets them side by side.

use std::process::Command;

#[test]
fn compare_runs_the_virtual_server_beside_its_plain_route_and_reports_both() {
    let out = tempfile::tempdir().expect("a temporary directory");
    let mcpgw = mcpgw_testkit::bin("mcpgw");
    let bin_dir = mcpgw.parent().expect("the binaries' directory");
    let output = Command::new(env!("CARGO_BIN_EXE_mcpgw-bench"))
        .args([
            "compare",
            "--configs",
            "sticky,tcp,virtual,virtual-tcp",
            "--concurrency",
            "2",
            "--duration",
            "600ms",
            "--warmup",
            "200ms",
            "--idle-sessions",
            "0",
            "--bin-dir",
        ])
        .arg(bin_dir)
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("run mcpgw-bench compare");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "compare failed: {stderr}");

    let text = std::fs::read_to_string(out.path().join("report.json")).expect("report.json");
    let report: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    for (name, forwarded) in [
        ("sticky", 0.0),
        ("tcp", 1.0),
        ("virtual", 0.0),
        ("virtual-tcp", 1.0),
    ] {
        let config = report["configurations"]
            .as_array()
            .and_then(|all| all.iter().find(|c| c["name"] == name))
            .unwrap_or_else(|| panic!("{name} is in the report: {text}"));
        assert!(
            config["not_available"].is_null(),
            "{name} ran: {}\n{stderr}",
            config["not_available"]
        );
        let run = &config["runs"][0];
        assert_eq!(run["errors"], serde_json::json!({}), "{name}: {run}");
        assert!(
            run["tools_call_latency"]["count"].as_u64().unwrap_or(0) > 0,
            "{name} measured echo calls: {run}"
        );
        assert_eq!(
            run["forwarded_fraction"].as_f64(),
            Some(forwarded),
            "{name}: forwarded share"
        );
    }
    let markdown = std::fs::read_to_string(out.path().join("report.md")).expect("report.md");
    for row in ["| 2 | virtual vs sticky |", "| 2 | virtual-tcp vs tcp |"] {
        assert!(
            markdown.contains("## Virtual server: three members against the plain route")
                && markdown.contains(row),
            "report.md sets the virtual server beside its plain route ({row}):\n{markdown}"
        );
    }
}
