//! The replay budget (`[limits] replay_budget_bytes`): however many SSE answers a
//! worker relays, the events it keeps so clients can resume them stay within one
//! byte budget. Past it every answer still reaches its client whole; only its replay
//! is given up, and a resume that needs a dropped event is told so (410
//! `replay_unavailable`, naming the budget).

#[path = "upstreams_support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use mcpgw_testkit::http::{self, initialize, mcp_headers};
use mcpgw_testkit::{Gateway, Upstream};
use serde_json::json;
use support::{Until, read_stream};

const BUDGET: u64 = 20_000;
const STREAMS: u64 = 4;
/// Progress events per answer: some 200 bytes each, so one answer alone is past the
/// budget.
const EVENTS: u64 = 150;

/// `mcpgw_replay_bytes` and `mcpgw_replay_budget_bytes` of the worker at `admin`.
fn replay_gauges(admin: &str) -> (u64, u64) {
    let metrics = http::request(admin, "GET", "/metrics", &[], b"");
    assert_eq!(metrics.status, 200, "{}", metrics.text());
    let text = metrics.text();
    let gauge = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
    };
    (
        gauge("mcpgw_replay_bytes"),
        gauge("mcpgw_replay_budget_bytes"),
    )
}

fn config_file(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-replay-budget-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("mcpgw.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

#[test]
fn past_the_replay_budget_answers_arrive_whole_a_resume_is_a_410_and_kept_bytes_stay_within_it() {
    let upstream = Upstream::start();
    let config = config_file(&format!("[limits]\nreplay_budget_bytes = {BUDGET}\n"));
    let gateway = Gateway::start(&[
        "--upstream",
        &format!("demo={}", upstream.url),
        "--config",
        &config.display().to_string(),
    ]);
    let admin = gateway.admin.clone().expect("a standalone gateway's admin");
    assert_eq!(replay_gauges(&admin), (0, BUDGET), "nothing kept yet");

    // Scrapes while the answers run: the kept bytes may never pass the budget.
    let running = Arc::new(AtomicBool::new(true));
    let scraper = {
        let (admin, running) = (admin.clone(), Arc::clone(&running));
        thread::spawn(move || {
            let (mut scrapes, mut most) = (0u64, 0u64);
            while running.load(Ordering::Relaxed) {
                let (kept, budget) = replay_gauges(&admin);
                assert!(
                    kept <= budget,
                    "{kept} bytes kept, past the {budget} budget"
                );
                (scrapes, most) = (scrapes + 1, most.max(kept));
            }
            (scrapes, most)
        })
    };
    let answers: Vec<_> = (0..STREAMS)
        .map(|n| {
            let addr = gateway.addr.clone();
            thread::spawn(move || {
                let session = initialize(&addr, "/mcp");
                let body = json!({
                    "jsonrpc": "2.0", "id": 100 + n, "method": "tools/call",
                    "params": {"name": "slow_stream",
                               "arguments": {"count": EVENTS, "interval_ms": 2},
                               "_meta": {"progressToken": "p"}},
                })
                .to_string();
                let read = read_stream(
                    &addr,
                    "POST",
                    "/mcp",
                    &mcp_headers(Some(&session)),
                    body.as_bytes(),
                    Until::End,
                );
                (n, session, read)
            })
        })
        .collect();
    let answers: Vec<_> = answers
        .into_iter()
        .map(|a| a.join().expect("answer thread"))
        .collect();
    running.store(false, Ordering::Relaxed);
    let (scrapes, most) = scraper.join().expect("scraper");
    println!("{scrapes} scrapes while {STREAMS} answers ran; at most {most} bytes kept");

    let mut spent = 0;
    for (n, session, read) in &answers {
        // Every answer is complete: each progress event in order, then its result.
        assert_eq!(read.status, 200);
        let progress: Vec<u64> = read
            .events
            .iter()
            .filter_map(|e| e.data["params"]["progress"].as_u64())
            .collect();
        assert_eq!(progress, (1..=EVENTS).collect::<Vec<_>>(), "answer {n}");
        let last = read.events.last().expect("events");
        assert_eq!(last.data["id"], 100 + n);
        assert!(last.data.get("result").is_some(), "answer {n}: {last:?}");

        // A resume after its first event: replayed whole while it was kept, else
        // told that the budget was spent. Never anything else.
        let first = read.events[0].id.clone().expect("events carry ids");
        let mut headers = mcp_headers(Some(session));
        headers.push(("Last-Event-ID", &first));
        let resumed = http::request(&gateway.addr, "GET", "/mcp", &headers, b"");
        if resumed.status == 200 {
            let rest = support::events_in(&resumed.text());
            assert_eq!(rest.len() as u64, EVENTS, "answer {n}: all after the first");
            continue;
        }
        assert_eq!(
            resumed.outcome(),
            "410 replay_unavailable",
            "answer {n}: {}",
            resumed.text()
        );
        let message = resumed.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        assert!(
            message.contains("the replay budget was spent"),
            "answer {n}: {message}"
        );
        spent += 1;
    }
    // Four answers of some 30 KB each cannot all be kept in 20 KB.
    assert!(spent >= 1, "no answer was past the budget");
    println!("{spent} of {STREAMS} answers past the budget");
    let (kept, budget) = replay_gauges(&admin);
    println!("at the end: {kept} bytes kept");
    assert!(
        kept <= budget,
        "{kept} bytes kept, past the {budget} budget"
    );
}
