//! A stdio upstream's child that dies while a call written to it runs: the call may
//! have run, so its client hears 502 `outcome_unknown` (never retryable) with the end
//! of the session in the same answer, never a bare `session_gone` that would have it
//! re-initialize and run the call twice. Legacy clients, answered as JSON and as a
//! stream, and 2026-07-28 clients of the route's shared session, told once.

#[path = "upstreams_support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::time::Duration;

use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::signal::{Signal, send};
use mcpgw_testkit::{eventually, python, python_script};
use serde_json::{Value, json};
use support::{Fleet, children_of, wait_stopped, worker_at};

/// `--upstream NAME=stdio:…` running the server whose `hang` call can be caught running.
fn hanging_stdio(name: &str) -> String {
    format!(
        "{name}=stdio:{} {}",
        python().display(),
        python_script("hanging_server.py").display()
    )
}

/// A path, not yet created, that `hang` creates once the call runs in the server.
fn marker(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "mcpgw-stdio-loss-{}-{what}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ))
}

fn tool_text(response: &http::Response) -> String {
    response.tool_text().unwrap_or_else(|| {
        panic!(
            "no tool result ({}): {}",
            response.status,
            String::from_utf8_lossy(&response.body)
        )
    })
}

fn error_message(response: &http::Response) -> String {
    response.error().map_or_else(String::new, |e| {
        e["message"].as_str().unwrap_or_default().to_owned()
    })
}

/// Waits until the `hang` call has reached the server (it created `marker`), then
/// kills the server's process with SIGKILL; `pid` must be a child of `worker_pid`.
fn kill_once_running(marker: &std::path::Path, pid: u32, worker_pid: u32) {
    eventually(Duration::from_secs(60), || {
        marker
            .exists()
            .then_some(())
            .ok_or("the call has not reached the server")
    });
    assert!(
        children_of(worker_pid).contains(&pid),
        "the server {pid} runs as a child of the worker {worker_pid}"
    );
    send(pid, Signal::SIGKILL);
    wait_stopped(pid, "the killed server");
}

/// The checks every answer to a call whose server died under it must pass.
fn assert_outcome_unknown_with_session_end(error: &Value, what: &str) {
    let data = &error["data"];
    assert_eq!(data["reason"], "outcome_unknown", "{what}: {error}");
    assert_eq!(data["retryable"], false, "{what}: {error}");
    assert_eq!(data["session_ended"], true, "{what}: {error}");
    let detail = data["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("killed by signal 9"),
        "{what}: data.detail says how the process ended: {error}"
    );
    let message = error["message"].as_str().unwrap_or_default();
    for words in ["may have run", "check the upstream's state before retrying"] {
        assert!(message.contains(words), "{what}: {words:?} in {message:?}");
    }
    assert!(
        !message.contains("retry later"),
        "{what}: no bare retry advice: {message:?}"
    );
}

#[test]
fn a_legacy_call_running_when_its_stdio_child_dies_is_502_outcome_unknown_then_session_gone() {
    let fleet = Fleet::start(2, &["--upstream".into(), hanging_stdio("hang")]);
    let (worker_pid, _) = worker_at(&fleet, 0);
    let (owner, edge) = (fleet.addr(0).to_owned(), fleet.addr(1).to_owned());

    // Answered as JSON (the server writes nothing before its answer), or as a
    // stream (it reports progress first): then the error is the stream's last event,
    // the status already sent (200); each directly and through a forward.
    for (via, progress) in [
        (&owner, false),
        (&edge, false),
        (&owner, true),
        (&edge, true),
    ] {
        let what = format!("via {via}, progress {progress}");
        let session = initialize(&owner, "/mcp");
        let pid: u32 = tool_text(&call_tool(&owner, "/mcp", &session, 2, "pid", json!({})))
            .parse()
            .expect("a pid");
        let file = marker("legacy");
        let mut params = json!({"name": "hang", "arguments": {"marker": file}});
        if progress {
            params["_meta"] = json!({"progressToken": "p"});
        }
        let body = http::rpc_body(3, "tools/call", params);
        let error = if progress {
            // Killed once its stream has begun: the progress event reached the client.
            let text = stream_killed_after_progress(via, &session, &body, || {
                kill_once_running(&file, pid, worker_pid)
            });
            eprintln!("{what}: the running call: {text}");
            assert!(text.starts_with("HTTP/1.1 200"), "{what}: a stream: {text}");
            let last = text
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .filter_map(|data| serde_json::from_str::<Value>(data).ok())
                .next_back()
                .expect("events");
            assert_eq!(
                last["id"], 3,
                "{what}: the stream ends with the call's answer"
            );
            last["error"].clone()
        } else {
            let running = std::thread::spawn({
                let (via, session) = (via.clone(), session.clone());
                move || http::try_request(&via, "POST", "/mcp", &mcp_headers(Some(&session)), &body)
            });
            kill_once_running(&file, pid, worker_pid);
            let told = running
                .join()
                .unwrap()
                .expect("an answer to the running call");
            eprintln!("{what}: the running call: {}", told.text());
            assert_eq!(told.outcome(), "502 outcome_unknown", "{what}");
            told.error().expect("an error")
        };
        assert_outcome_unknown_with_session_end(&error, &what);

        // The session ended with its process: later requests hear it, never a
        // fresh process behind the old id.
        let after = call_tool(via, "/mcp", &session, 4, "counter_increment", json!({}));
        eprintln!("{what}: the request after: {}", after.text());
        assert_eq!(
            after.outcome(),
            "404 session_gone",
            "{what}: {}",
            after.text()
        );
        let _ = std::fs::remove_file(&file);
    }
}

/// Sends a legacy call whose answer is a stream, reads it until its progress event
/// arrived, runs `kill`, and returns everything read (the raw HTTP response).
fn stream_killed_after_progress(
    addr: &str,
    session: &str,
    body: &[u8],
    kill: impl FnOnce(),
) -> String {
    use std::io::Read;
    let headers = mcp_headers(Some(session));
    let mut connection = support::send_request(addr, "POST", "/mcp", &headers, body);
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("notifications/progress") {
        let n = connection.read(&mut buf).expect("the stream's first event");
        let text = String::from_utf8_lossy(&raw).into_owned();
        assert!(n > 0, "the stream ended before its progress event: {text}");
        raw.extend_from_slice(&buf[..n]);
    }
    kill();
    connection
        .read_to_end(&mut raw)
        .expect("the rest of the stream");
    String::from_utf8_lossy(&raw).into_owned()
}

/// A 2026-07-28 call through `addr` (no credentials: public mode's principal).
fn modern(addr: &str, id: u64, tool: &str, arguments: Value) -> http::Response {
    let body = http::modern_body(
        id,
        "tools/call",
        json!({"name": tool, "arguments": arguments}),
    );
    http::request(
        addr,
        "POST",
        "/mcp",
        &http::modern_headers("tools/call", Some(tool)),
        &body,
    )
}

#[test]
fn a_modern_call_running_when_the_shared_stdio_child_dies_is_502_outcome_unknown_told_once() {
    let fleet = Fleet::start(2, &["--upstream".into(), hanging_stdio("hang")]);
    let (worker_pid, _) = worker_at(&fleet, 0);
    let (owner, edge) = (fleet.addr(0).to_owned(), fleet.addr(1).to_owned());
    // First directly at the session's worker, then forwarded to it by another.
    for via in [&owner, &edge] {
        // Opens the shared session at the first worker, or finds it there.
        let opened = modern(&owner, 1, "counter_increment", json!({}));
        assert_eq!(opened.status, 200, "via {via}: {}", opened.text());
        let pid: u32 = tool_text(&modern(&owner, 2, "pid", json!({})))
            .parse()
            .expect("a pid");
        let file = marker("modern");
        let running = std::thread::spawn({
            let (via, file) = (via.clone(), file.clone());
            move || {
                let body = http::modern_body(
                    3,
                    "tools/call",
                    json!({"name": "hang", "arguments": {"marker": file}}),
                );
                http::try_request(
                    &via,
                    "POST",
                    "/mcp",
                    &http::modern_headers("tools/call", Some("hang")),
                    &body,
                )
            }
        });
        kill_once_running(&file, pid, worker_pid);
        let told = running
            .join()
            .unwrap()
            .expect("an answer to the running call");
        eprintln!("via {via}: the running call: {}", told.text());
        assert_eq!(told.outcome(), "502 outcome_unknown", "via {via}");
        assert_outcome_unknown_with_session_end(&told.error().expect("an error"), via);
        assert!(
            error_message(&told).contains("your next request starts a new one"),
            "via {via}: {}",
            told.text()
        );

        // Told once: the next call, through either worker, runs in a new session.
        let fresh = modern(via, 4, "counter_increment", json!({}));
        eprintln!("via {via}: the call after: {}", fresh.text());
        assert_eq!(fresh.status, 200, "via {via}: told once: {}", fresh.text());
        assert_eq!(tool_text(&fresh), "1", "via {via}: in a new session");
        let other = if via == &owner { &edge } else { &owner };
        let again = modern(other, 5, "counter_increment", json!({}));
        assert_eq!(
            again.status,
            200,
            "via {other}: not told again: {}",
            again.text()
        );
        assert_eq!(tool_text(&again), "2", "via {other}: the same new session");
        let _ = std::fs::remove_file(&file);
    }
}
