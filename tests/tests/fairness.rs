//! No client takes more than its share, and no answer is cut to make room: one client
//! address at its stdio process quota gets 429 while another still opens sessions on
//! the same route; a stdio session past its maximum lifetime ends like a lost one;
//! seventeen SSE answers running at once in one session all end with their results.

// The shared helpers re-export process checks this file does not use.
#[allow(unused_imports)]
#[path = "upstreams_support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use mcpgw_testkit::http::{self, call_tool, mcp_headers};
use mcpgw_testkit::{Gateway, Upstream, python, python_script};
use serde_json::{Value, json};
use support::{Until, read_stream};

/// A config file in a fresh temporary directory of this test process.
fn config_file(text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-fairness-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("mcpgw.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// A stdio route running the SDK's stateful server, with `extra` upstream settings;
/// client addresses come from `X-Forwarded-For`, as behind a load balancer.
fn stdio_gateway(extra: &str) -> Gateway {
    let config = config_file(&format!(
        "trust_forwarded_for = true\n[[upstream]]\nname = \"st\"\ncommand = [\"{}\", \"{}\", \"stdio\"]\n{extra}",
        python().display(),
        python_script("stateful_server.py").display()
    ));
    Gateway::start(&["--config", &config.display().to_string()])
}

/// Headers of a client at address `client`.
fn from<'a>(client: &'a str, session: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut headers = mcp_headers(session);
    headers.push(("X-Forwarded-For", client));
    headers
}

/// Initialize as a client at `client`; on success also sends `initialized`.
fn initialize_from(addr: &str, client: &str) -> http::Response {
    let answer = http::request(
        addr,
        "POST",
        "/mcp",
        &from(client, None),
        &http::initialize_body(1),
    );
    if let Some(session) = answer.header("mcp-session-id") {
        let note = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        let ack = http::request(addr, "POST", "/mcp", &from(client, Some(session)), note);
        assert_eq!(ack.status, 202, "initialized: {}", ack.text());
    }
    answer
}

fn session_of(answer: &http::Response) -> String {
    answer
        .header("mcp-session-id")
        .unwrap_or_else(|| panic!("no session: {} {}", answer.status, answer.text()))
        .to_owned()
}

#[test]
fn a_client_address_at_its_stdio_process_quota_gets_429_while_another_opens_sessions() {
    let gateway = stdio_gateway("max_processes = 8\nmax_processes_per_principal = 2\n");
    let addr = gateway.addr.as_str();
    let (greedy, other) = ("198.51.100.7", "198.51.100.8");
    let first = session_of(&initialize_from(addr, greedy));
    session_of(&initialize_from(addr, greedy));

    let refused = initialize_from(addr, greedy);
    eprintln!("past the quota: {}", refused.text());
    assert_eq!(refused.outcome(), "429 process_quota", "{}", refused.text());
    assert_eq!(refused.header("retry-after"), Some("30"));
    let error = &refused.json()["error"];
    assert_eq!(error["data"]["scope"], "client_address");
    assert_eq!(error["data"]["limit"], 2);
    let message = error["message"].as_str().unwrap_or("");
    assert!(
        message.contains("upstream st") && message.contains("end sessions you no longer use"),
        "{message}"
    );
    assert!(refused.header("mcp-session-id").is_none());

    // The route has room: another client address opens a session and uses it.
    let theirs = session_of(&initialize_from(addr, other));
    let answer = call_tool(addr, "/mcp", &theirs, 2, "counter_increment", json!({}));
    assert_eq!(
        answer.tool_text().as_deref(),
        Some("1"),
        "{}",
        answer.text()
    );

    // Ending a session gives its place back (once its child is gone).
    let ended = http::request(addr, "DELETE", "/mcp", &from(greedy, Some(&first)), b"");
    assert_eq!(ended.status, 200, "{}", ended.text());
    let again = mcpgw_testkit::eventually(Duration::from_secs(20), || {
        let answer = initialize_from(addr, greedy);
        match answer.status {
            200 => Ok(answer),
            _ => Err(answer.outcome()),
        }
    });
    session_of(&again);
}

#[test]
fn a_stdio_session_past_its_maximum_lifetime_is_gone_with_the_reason() {
    // Long enough for the child to start and answer once on a busy machine.
    let gateway = stdio_gateway("max_session_lifetime_ms = 6000\n");
    let addr = gateway.addr.as_str();
    let opened = Instant::now();
    let session = session_of(&initialize_from(addr, "198.51.100.9"));
    let answer = call_tool(addr, "/mcp", &session, 2, "counter_increment", json!({}));
    assert_eq!(
        answer.tool_text().as_deref(),
        Some("1"),
        "{}",
        answer.text()
    );
    // Requests keep the session from idling; only its lifetime ends it.
    let mut id = 3;
    let gone = mcpgw_testkit::eventually(Duration::from_secs(30), || {
        id += 1;
        let answer = call_tool(addr, "/mcp", &session, id, "counter_increment", json!({}));
        match answer.status {
            200 => Err(format!("still served: {}", answer.text())),
            _ => Ok(answer),
        }
    });
    eprintln!(
        "ended after {:?}: {}",
        opened.elapsed(),
        String::from_utf8_lossy(&gone.body)
    );
    assert!(
        opened.elapsed() >= Duration::from_millis(6000),
        "ended before its lifetime was up"
    );
    // A call running at the moment the lifetime ran out was told its outcome is unknown
    // (it was written to the child); the call after it hears the session is gone.
    let gone = if gone.outcome() == "502 outcome_unknown" {
        assert_eq!(
            gone.json()["error"]["data"]["session_ended"],
            true,
            "{}",
            gone.text()
        );
        call_tool(
            addr,
            "/mcp",
            &session,
            id + 1,
            "counter_increment",
            json!({}),
        )
    } else {
        gone
    };
    assert_eq!(gone.outcome(), "404 session_gone", "{}", gone.text());
    let detail = gone.json()["error"]["data"]["detail"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(detail.contains("maximum lifetime of 6000 ms"), "{detail}");
}

/// A `slow_stream` call of `count` progress events `interval_ms` apart, then the result.
fn slow_stream_body(id: u64, count: u64, interval_ms: u64) -> Vec<u8> {
    json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "slow_stream", "arguments": {"count": count, "interval_ms": interval_ms},
                   "_meta": {"progressToken": "p"}},
    })
    .to_string()
    .into_bytes()
}

#[test]
fn seventeen_sse_answers_running_at_once_in_one_session_all_end_with_their_results() {
    const ANSWERS: u64 = 17;
    const STEPS: u64 = 20;
    let upstream = Upstream::start();
    let gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let addr = gateway.addr.clone();
    let session = mcpgw_testkit::http::initialize(&addr, "/mcp");
    // Each answer runs for about two seconds: all of them are opened well within it.
    let readers: Vec<_> = (0..ANSWERS)
        .map(|n| {
            let (addr, session) = (addr.clone(), session.clone());
            std::thread::spawn(move || {
                let headers = mcp_headers(Some(&session));
                read_stream(
                    &addr,
                    "POST",
                    "/mcp",
                    &headers,
                    &slow_stream_body(100 + n, STEPS, 100),
                    Until::End,
                )
            })
        })
        .collect();
    let answers: Vec<_> = readers
        .into_iter()
        .map(|r| r.join().expect("reader thread"))
        .collect();
    let mut first_ids = Vec::new();
    for (n, answer) in (0..ANSWERS).zip(&answers) {
        assert_eq!(answer.status, 200, "answer {n}");
        let last: Option<&Value> = answer.events.last().map(|e| &e.data);
        assert!(
            last.is_some_and(|m| m["id"] == 100 + n && m.get("result").is_some()),
            "answer {n} ended without its result after {} events: {:?}",
            answer.events.len(),
            answer.events.last()
        );
        assert_eq!(answer.events.len() as u64, STEPS + 1, "answer {n}");
        first_ids.push(answer.events[0].id.clone().expect("events carry ids"));
    }
    // The session keeps 16 streams: one of the seventeen was not kept, which also
    // shows all seventeen ran at once (else a finished one would have made room).
    let mut kept = 0;
    let mut not_kept = Vec::new();
    for id in &first_ids {
        let mut headers = mcp_headers(Some(&session));
        headers.push(("Last-Event-ID", id));
        let resumed = http::request(&addr, "GET", "/mcp", &headers, b"");
        match resumed.status {
            200 => kept += 1,
            _ => not_kept.push(resumed),
        }
    }
    assert_eq!(kept, 16, "sixteen streams are kept for resumption");
    assert_eq!(not_kept.len(), 1);
    let refused = &not_kept[0];
    assert_eq!(
        refused.outcome(),
        "410 replay_unavailable",
        "{}",
        refused.text()
    );
    let message = refused.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(message.contains("was never kept"), "{message}");
}
