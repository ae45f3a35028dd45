//! `mcpgw-bench run --rate`: the open-loop generator against the demo upstream.
//! It must send the scheduled number of requests, spread over the window, and its
//! latency must count from the intended send time, so a stall of the server shows
//! in the tail even though only a handful of requests were in flight during it.

use std::path::{Path, PathBuf};
use std::process::Command;

use mcpgw_testkit::Upstream;

/// `MCPGW_BIN_DIR` (a deliberately broken build) when set, else the binary cargo
/// built for this test.
fn bench_bin() -> PathBuf {
    match std::env::var_os("MCPGW_BIN_DIR") {
        Some(dir) => Path::new(&dir).join("mcpgw-bench"),
        None => PathBuf::from(env!("CARGO_BIN_EXE_mcpgw-bench")),
    }
}

fn run(url: &str, args: &[&str], out: &Path) -> serde_json::Value {
    let output = Command::new(bench_bin())
        .args(["run", "--url", url, "--warmup", "0s"])
        .args(args)
        .arg("--json")
        .arg(out)
        .output()
        .expect("run mcpgw-bench run");
    assert!(
        output.status.success(),
        "mcpgw-bench run failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{}", String::from_utf8_lossy(&output.stdout));
    let text = std::fs::read_to_string(out).expect("the JSON report is written");
    serde_json::from_str(&text).expect("the report is JSON")
}

fn ms(report: &serde_json::Value, field: &str) -> f64 {
    report["latency"][field].as_u64().unwrap_or(0) as f64 / 1000.0
}

#[test]
fn open_loop_sends_the_scheduled_number_of_requests_over_the_window() {
    let upstream = Upstream::start_binary(&bench_bin(), &[]);
    let dir = tempfile::tempdir().expect("temp dir");
    let calls_before = upstream.counter("tool_calls");
    let report = run(
        &upstream.url,
        &["--rate", "100", "--duration", "3s", "--sessions", "4"],
        &dir.path().join("open.json"),
    );
    let requests = report["requests"].as_u64().unwrap_or(0);
    println!(
        "offered {} req/s, achieved {:.1} req/s over {:.2} s, {requests} requests",
        report["offered_rps"], report["throughput_rps"], report["window_s"]
    );
    assert_eq!(report["offered_rps"], 100.0, "{report}");
    assert!(
        (294..=306).contains(&requests),
        "100 req/s for 3 s is 300 requests (± 2 %), got {requests}: {report}"
    );
    assert_eq!(
        report["ok"], requests,
        "every answer is a success: {report}"
    );
    assert_eq!(report["unsent"], 0, "{report}");
    assert_eq!(report["latency"]["count"], requests);
    // The requests were spread over the window, not sent in a burst.
    let window = report["window_s"].as_f64().unwrap_or(0.0);
    assert!(
        window >= 2.9,
        "the last of 300 requests at 100 req/s is due after 2.99 s; the window was {window} s"
    );
    // At 100 req/s over 4 sessions every session is free when its next request falls
    // due, so the send lag (due → sent) of every request is measured but those due as
    // the run starts, and it is part of the latency counted from the due time.
    let lag = &report["send_lag"];
    println!(
        "send lag p50 {} µs, p99 {} µs; latency p50 {} µs",
        lag["p50_us"], lag["p99_us"], report["latency"]["p50_us"]
    );
    let lagged = lag["count"].as_u64().unwrap_or(0);
    assert!(
        (requests - 4..=requests).contains(&lagged),
        "{lagged} of {requests} requests had their send lag measured: {report}"
    );
    let lag_p50 = lag["p50_us"].as_u64().expect("a measured send lag p50");
    let latency_p50 = report["latency"]["p50_us"]
        .as_u64()
        .expect("a measured latency p50");
    assert!(lag_p50 <= latency_p50, "{report}");
    let counted_calls = report["tools_call_latency"]["count"].as_u64().unwrap_or(0);
    let executed = upstream.counter("tool_calls") - calls_before;
    assert_eq!(
        executed, counted_calls,
        "without warm-up every tools/call executed is a counted one"
    );
}

#[test]
fn open_loop_tail_shows_a_server_stall_that_the_closed_loop_hides() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The 1,500th POST (about 1.5 s into the open-loop run) stalls the whole server
    // for 200 ms. One session: it is stuck in one request during the stall, and
    // the ~200 requests due meanwhile wait for it; only measuring from the intended
    // send time puts that wait in the figures (from the actual send, one request
    // of 3,000 is slow, below the p99.9).
    let stall = ["--stall-after", "1500", "--stall-ms", "200"];

    let closed_upstream = Upstream::start_binary(&bench_bin(), &stall);
    let closed = run(
        &closed_upstream.url,
        &["--sessions", "1", "--requests", "10000"],
        &dir.path().join("closed.json"),
    );
    let open_upstream = Upstream::start_binary(&bench_bin(), &stall);
    let open = run(
        &open_upstream.url,
        &["--rate", "1000", "--duration", "3s", "--sessions", "1"],
        &dir.path().join("open.json"),
    );
    println!(
        "closed loop: {} requests, p99 {:.1} ms, p99.9 {:.1} ms, max {:.1} ms",
        closed["requests"],
        ms(&closed, "p99_us"),
        ms(&closed, "p999_us"),
        ms(&closed, "max_us")
    );
    println!(
        "open loop:   {} requests at {:.0} req/s achieved, p99 {:.1} ms, p99.9 {:.1} ms, max {:.1} ms; \
         from the actual send: p99.9 {:.1} ms",
        open["requests"],
        open["throughput_rps"].as_f64().unwrap_or(0.0),
        ms(&open, "p99_us"),
        ms(&open, "p999_us"),
        ms(&open, "max_us"),
        open["service_latency"]["p999_us"].as_u64().unwrap_or(0) as f64 / 1000.0
    );
    assert_eq!(open["errors"], serde_json::json!({}), "{open}");
    // The stall happened in both runs (each run's slowest request waited for it).
    assert!(
        ms(&closed, "max_us") >= 150.0,
        "the closed-loop run met the stall: {closed}"
    );
    assert!(
        ms(&open, "max_us") >= 150.0,
        "the open-loop run met the stall: {open}"
    );
    assert!(
        ms(&open, "p999_us") >= 150.0,
        "the open-loop p99.9 shows the 200 ms stall: {open}"
    );
    // ...which the closed loop hides: one request of 10,000 waited for it, below its
    // p99.9.
    assert!(
        ms(&closed, "p999_us") < 150.0,
        "the closed-loop p99.9 hides the stall: {closed}"
    );
}
