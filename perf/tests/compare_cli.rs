//! `mcpgw-bench compare` on a real two-worker fleet (Redis, the mesh, the demo
//! upstream), briefly: the virtual server beside its plain route, sticky and
//! forwarded; and the open-loop sweep from a sustained rate to saturation.

use std::process::Command;

/// What one `compare` run wrote, and what it said on stderr.
struct Compared {
    report: serde_json::Value,
    /// report.json as text, for failure messages.
    text: String,
    markdown: String,
    stderr: String,
}

/// Runs `mcpgw-bench compare` with `args` against this build's binaries and reads its
/// reports; fails the test when it fails.
fn compare(args: &[&str]) -> Compared {
    let out = tempfile::tempdir().expect("a temporary directory");
    let mcpgw = mcpgw_testkit::bin("mcpgw");
    let bin_dir = mcpgw.parent().expect("the binaries' directory");
    let output = Command::new(env!("CARGO_BIN_EXE_mcpgw-bench"))
        .arg("compare")
        .args(args)
        .arg("--bin-dir")
        .arg(bin_dir)
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("run mcpgw-bench compare");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "compare failed: {stderr}");
    let text = std::fs::read_to_string(out.path().join("report.json")).expect("report.json");
    let report = serde_json::from_str(&text).expect("JSON");
    let markdown = std::fs::read_to_string(out.path().join("report.md")).expect("report.md");
    Compared {
        report,
        text,
        markdown,
        stderr,
    }
}

#[test]
fn compare_runs_the_virtual_server_beside_its_plain_route_and_reports_both() {
    let Compared {
        report,
        text,
        markdown,
        stderr,
    } = compare(&[
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
    ]);
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
    for row in ["| 2 | virtual vs sticky |", "| 2 | virtual-tcp vs tcp |"] {
        assert!(
            markdown.contains("## Virtual server: three members against the plain route")
                && markdown.contains(row),
            "report.md sets the virtual server beside its plain route ({row}):\n{markdown}"
        );
    }
}

/// The open-loop sweep on a real fleet: a rate no machine sustains saturates every
/// configuration, the bracket is narrowed by a run between its ends, and every
/// configuration runs once more at half the baseline's saturation rate.
#[test]
fn compare_sweeps_to_saturation_narrows_the_bracket_and_compares_at_half_the_baseline() {
    let Compared {
        report,
        text,
        markdown,
        stderr,
    } = compare(&[
        "--configs",
        "sticky,redis",
        "--concurrency",
        "1",
        "--duration",
        "1s",
        "--warmup",
        "100ms",
        "--rates",
        "100,100000",
        "--rate-sessions",
        "4",
        "--refine-steps",
        "1",
        "--idle-sessions",
        "0",
    ]);
    let config = |name: &str| {
        report["configurations"]
            .as_array()
            .and_then(|all| all.iter().find(|c| c["name"] == name))
            .unwrap_or_else(|| panic!("{name} is in the report: {text}"))
            .clone()
    };
    let offered = |run: &serde_json::Value| run["offered_rps"].as_f64().unwrap_or(-1.0);
    let baseline = config("redis")["saturation"]["saturated_at_rps"]
        .as_f64()
        .unwrap_or_else(|| panic!("100,000 req/s saturates the baseline: {text}"));
    for name in ["sticky", "redis"] {
        let config = config(name);
        assert!(config["not_available"].is_null(), "{name} ran: {stderr}");
        let saturation = &config["saturation"];
        let saturated = saturation["saturated_at_rps"]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} saturated: {saturation}"));
        let rates: Vec<f64> = config["sweep"]
            .as_array()
            .map(|runs| runs.iter().map(offered).collect())
            .unwrap_or_default();
        assert_eq!(
            rates.first(),
            Some(&100.0),
            "{name}: the sweep ran, from the lowest rate: {config}"
        );
        assert!(
            rates.windows(2).all(|w| w[0] < w[1]),
            "{name}: sweep in rate order: {rates:?}"
        );
        // A slow moment may saturate even the low rate; then there is no bracket.
        if let Some(sustained) = saturation["sustained_rps"].as_f64() {
            assert!(
                rates.contains(&100_000.0),
                "{name}: the sweep went on to the rate no machine sustains: {rates:?}"
            );
            assert!(
                rates.iter().any(|&r| r > sustained && r < 100_000.0),
                "{name}: a run between {sustained} and 100,000 req/s narrowed the bracket: {rates:?}"
            );
            assert!(
                saturated < 100_000.0,
                "{name}: the middle run saturated too: {saturation}"
            );
        }
        let at_half = &config["at_half_baseline"];
        assert_eq!(
            offered(at_half),
            (baseline / 2.0).round(),
            "{name} ran at half the baseline's saturation rate: {at_half}"
        );
    }
    for part in [
        "## Open loop: latency at a fixed offered rate",
        "### At half the Redis baseline's saturation rate",
        "The mesh's open-loop saturation rate",
    ] {
        assert!(
            markdown.contains(part),
            "report.md has {part:?}:\n{markdown}"
        );
    }
}
