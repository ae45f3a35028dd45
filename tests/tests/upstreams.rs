//! Upstreams as users have them: an HTTPS upstream (test CA, mutual TLS, a wrong CA,
//! a missing client certificate); stdio servers (`mcp-server-time` from PyPI, and a
//! stateful server built with the official Python SDK) whose child processes live and
//! die with their sessions and workers; an elicitation asked by the upstream mid-call
//! and answered through a third worker; 2026-07-28 clients on an upstream that keeps
//! state in sessions; and an SSE stream resumed on another worker after its
//! connection dropped.

#[path = "upstreams_support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::tls::{TestCa, TlsTerminator};
use mcpgw_testkit::{Child, Gateway, ScatterProxy, Upstream, python, python_script, run_python};
use serde_json::{Value, json};
use support::{Fleet, children_of, read_events, running, wait_stopped, worker_at};

const INIT: &[u8] = br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"mcpgw-tests","version":"0"}}}"#;

fn tool_text(response: &http::Response) -> String {
    response.tool_text().unwrap_or_else(|| {
        panic!(
            "no tool result ({}): {}",
            response.status,
            String::from_utf8_lossy(&response.body)
        )
    })
}

fn reason(response: &http::Response) -> String {
    response.json()["error"]["data"]["reason"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// A file in a fresh temporary directory of this test process.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-upstreams-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write temp file");
    path
}

fn venv_bin(name: &str) -> String {
    python()
        .parent()
        .expect("venv bin dir")
        .join(name)
        .display()
        .to_string()
}

/// `--upstream NAME=stdio:…` running the stateful SDK-built server.
fn stateful_stdio(name: &str) -> String {
    format!(
        "{name}=stdio:{} {} stdio",
        python().display(),
        python_script("stateful_server.py").display()
    )
}

/// Every request to the next worker in turn: each of them sees the session.
fn round_robin(_method: &str, _body: &[u8]) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn https_upstream_works_through_a_forward_and_tls_failures_say_what_is_wrong() {
    let upstream = Upstream::start();
    let ca = TestCa::new("upstream");
    let (server_cert, server_key) = ca.issue("server");
    let (client_cert, client_key) = ca.issue("gateway");
    let mtls = TlsTerminator::start(
        &upstream.addr(),
        &server_cert,
        &server_key,
        Some(&ca.ca_file()),
    );
    let stranger = TestCa::new("stranger");
    let url = format!(
        "https://127.0.0.1:{}/mcp",
        mtls.addr.rsplit(':').next().unwrap()
    );
    let config = temp_file(
        "mcpgw.toml",
        &format!(
            r#"
[[upstream]]
name = "secure"
url = "{url}"
tls_ca = "{ca}"
tls_client_cert = "{cert}"
tls_client_key = "{key}"

[[upstream]]
name = "wrongca"
url = "{url}"
tls_ca = "{stranger}"
tls_client_cert = "{cert}"
tls_client_key = "{key}"

[[upstream]]
name = "nocert"
url = "{url}"
tls_ca = "{ca}"
"#,
            ca = ca.ca_file().display(),
            cert = client_cert.display(),
            key = client_key.display(),
            stranger = stranger.ca_file().display(),
        ),
    );
    let fleet = Fleet::start(2, &["--config".into(), config.display().to_string()]);
    let (_, owner) = worker_at(&fleet, 0);

    let path = "/servers/secure/mcp";
    let session = initialize(fleet.addr(0), path);
    for (n, addr) in [(1, fleet.addr(1)), (2, fleet.addr(0)), (3, fleet.addr(1))] {
        let response = call_tool(addr, path, &session, n, "counter_increment", json!({}));
        assert_eq!(response.status, 200);
        assert_eq!(tool_text(&response), n.to_string(), "one upstream session");
        assert_eq!(response.header("mcpgw-owner-worker"), Some(owner.as_str()));
    }

    let mut headers = mcp_headers(None);
    headers.retain(|(k, _)| *k != "MCP-Protocol-Version");
    let wrong = http::request(
        fleet.addr(1),
        "POST",
        "/servers/wrongca/mcp",
        &headers,
        INIT,
    );
    eprintln!("wrong CA: {}", String::from_utf8_lossy(&wrong.body));
    assert_eq!(wrong.status, 502);
    assert_eq!(reason(&wrong), "upstream_tls");
    let message = wrong.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("wrongca"), "names the upstream: {message}");
    assert!(
        message.contains("not signed by a CA"),
        "says why: {message}"
    );

    let refused = http::request(fleet.addr(0), "POST", "/servers/nocert/mcp", &headers, INIT);
    eprintln!(
        "no client certificate: {}",
        String::from_utf8_lossy(&refused.body)
    );
    assert_eq!(refused.status, 502);
    assert_eq!(reason(&refused), "upstream_tls");
    let message = refused.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("nocert") && message.contains("client certificate"),
        "{message}"
    );

    // The platform's roots by default: here SSL_CERT_FILE makes the test CA one.
    let plain_tls = TlsTerminator::start(&upstream.addr(), &server_cert, &server_key, None);
    let url = format!(
        "demo=https://127.0.0.1:{}/mcp",
        plain_tls.addr.rsplit(':').next().unwrap()
    );
    let ca_file = ca.ca_file().display().to_string();
    let standalone = Gateway::start_with_env(&["--upstream", &url], &[("SSL_CERT_FILE", &ca_file)]);
    let session = initialize(&standalone.addr, "/mcp");
    let response = call_tool(
        &standalone.addr,
        "/mcp",
        &session,
        2,
        "echo",
        json!({"text": "tls"}),
    );
    assert_eq!(tool_text(&response), "tls");
}

#[test]
fn mcp_server_time_over_stdio_serves_sessions_scattered_over_four_workers() {
    let upstream = format!(
        "time=stdio:{} --local-timezone UTC",
        venv_bin("mcp-server-time")
    );
    let fleet = Fleet::start(4, &["--upstream".into(), upstream]);
    let proxy = ScatterProxy::start_routed(fleet.addrs(), round_robin);
    for mode in ["legacy", "2026-07-28"] {
        let out = run_python("upstream_client.py", &[&proxy.url(), mode, "time"]);
        assert_eq!(
            out["tools"],
            json!(["convert_time", "get_current_time"]),
            "{mode}"
        );
        assert_eq!(
            out["zones"],
            json!(["UTC", "Europe/Paris", "Asia/Tokyo", "America/New_York"]),
            "{mode}"
        );
        assert!(
            out["converted"]
                .as_str()
                .unwrap()
                .ends_with("T21:00:00+09:00"),
            "{mode}: 12:00 UTC is 21:00 in Tokyo: {}",
            out["converted"]
        );
    }
    let sent = proxy.sent_counts();
    assert!(
        sent.iter().all(|&n| n >= 2),
        "every worker took requests: {sent:?}"
    );
}

#[test]
fn stdio_sessions_get_their_own_processes_which_live_and_die_with_them() {
    let fleet = Fleet::start(2, &["--upstream".into(), stateful_stdio("st")]);
    let (worker_pid, _) = worker_at(&fleet, 0);
    let (here, there) = (fleet.addr(0), fleet.addr(1));
    let pid_of = |session: &str| -> u32 {
        tool_text(&call_tool(there, "/mcp", session, 9, "pid", json!({})))
            .parse()
            .unwrap()
    };

    // Two sessions, two processes, separate state; requests forwarded or not.
    let a = initialize(here, "/mcp");
    let b = initialize(here, "/mcp");
    let (pid_a, pid_b) = (pid_of(&a), pid_of(&b));
    assert_ne!(pid_a, pid_b, "one process per session");
    let children = children_of(worker_pid);
    assert!(
        children.contains(&pid_a) && children.contains(&pid_b),
        "the owner worker runs them: {children:?}"
    );
    let count = |addr: &str, session: &str| {
        tool_text(&call_tool(
            addr,
            "/mcp",
            session,
            2,
            "counter_increment",
            json!({}),
        ))
    };
    assert_eq!(count(there, &a), "1");
    assert_eq!(count(here, &a), "2");
    assert_eq!(
        count(there, &b),
        "1",
        "the second process has its own state"
    );

    // Ending a session ends its process.
    let ended = http::request(there, "DELETE", "/mcp", &mcp_headers(Some(&b)), b"");
    assert_eq!(ended.status, 200);
    wait_stopped(pid_b, "the process of an ended session");
    let after = call_tool(there, "/mcp", &b, 3, "counter_increment", json!({}));
    assert_eq!(after.status, 404);

    // A child that dies ends its session truthfully, never with a fresh process.
    mcpgw_testkit::signal::send(pid_a, mcpgw_testkit::signal::Signal::SIGKILL);
    wait_stopped(pid_a, "the killed child");
    for addr in [there, here] {
        let answer = call_tool(addr, "/mcp", &a, 4, "counter_increment", json!({}));
        eprintln!(
            "after the child died, via {addr}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.status, 404, "via {addr}");
        assert_eq!(answer.error_code(), Some(-32001));
        assert_eq!(reason(&answer), "session_gone");
        let detail = answer.json()["error"]["data"]["detail"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(detail.contains("killed by signal 9"), "{detail}");
    }

    // kill -9 of the worker leaves no child behind.
    let c = initialize(here, "/mcp");
    let d = initialize(here, "/mcp");
    let orphans_to_be = [pid_of(&c), pid_of(&d)];
    assert!(orphans_to_be.iter().all(|pid| running(*pid)));
    mcpgw_testkit::signal::send(worker_pid, mcpgw_testkit::signal::Signal::SIGKILL);
    for pid in orphans_to_be {
        wait_stopped(pid, "a child of a worker killed with SIGKILL");
    }
}

#[test]
fn the_process_limit_is_a_clear_503_and_a_place_frees_when_a_session_ends() {
    let config = temp_file(
        "mcpgw.toml",
        &format!(
            "[[upstream]]\nname = \"st\"\ncommand = [\"{}\", \"{}\", \"stdio\"]\nmax_processes = 1\n",
            python().display(),
            python_script("stateful_server.py").display()
        ),
    );
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    let first = initialize(&gateway.addr, "/mcp");
    let mut headers = mcp_headers(None);
    headers.retain(|(k, _)| *k != "MCP-Protocol-Version");
    let refused = http::request(&gateway.addr, "POST", "/mcp", &headers, INIT);
    eprintln!("past the limit: {}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.status, 503);
    assert_eq!(reason(&refused), "process_limit");
    assert!(refused.header("retry-after").is_some());
    let message = refused.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("st") && message.contains("maximum of 1"),
        "{message}"
    );
    let ended = http::request(
        &gateway.addr,
        "DELETE",
        "/mcp",
        &mcp_headers(Some(&first)),
        b"",
    );
    assert_eq!(ended.status, 200);
    let next = initialize(&gateway.addr, "/mcp");
    let answer = call_tool(
        &gateway.addr,
        "/mcp",
        &next,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(
        tool_text(&answer),
        "1",
        "a fresh process for the new session"
    );
}

/// Sends each request to the worker its role calls for: initialize and everything
/// else to worker 0 (the owner), `tools/call` to worker 1 (forwarded), and the
/// client's answers to the server's requests to worker 2 (forwarded too).
fn by_role(method: &str, body: &[u8]) -> usize {
    let message: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    match (method, message.get("method").and_then(Value::as_str)) {
        ("POST", Some("tools/call")) => 1,
        ("POST", None) if message.get("id").is_some() => 2,
        _ => 0,
    }
}

#[test]
fn an_elicitation_mid_call_is_answered_through_a_third_worker() {
    let port = mcpgw_testkit::free_port();
    let mut server = Child::spawn(
        "stateful_server",
        &python(),
        &[
            python_script("stateful_server.py").display().to_string(),
            "http".into(),
            port.to_string(),
        ],
    );
    server.wait_for_line(
        "stateful_server listening",
        std::time::Duration::from_secs(30),
    );
    mcpgw_testkit::wait_for_listener(
        &format!("127.0.0.1:{port}"),
        std::time::Duration::from_secs(30),
    );
    let fleet = Fleet::start(
        3,
        &[
            "--upstream".into(),
            format!("web=http://127.0.0.1:{port}/mcp"),
            "--upstream".into(),
            stateful_stdio("st"),
        ],
    );
    for route in ["web", "st"] {
        let proxy = ScatterProxy::start_routed(fleet.addrs(), by_role);
        let url = format!("http://{}/servers/{route}/mcp", proxy.addr);
        let out = run_python("upstream_client.py", &[&url, "legacy", "elicit"]);
        assert_eq!(out["asked"], json!(["What is the answer?"]), "{route}");
        assert_eq!(out["text"], "answered: forty-two", "{route}");
        assert_eq!(out["is_error"], false, "{route}");
        let sent = proxy.sent_counts();
        assert!(
            sent[1] >= 1 && sent[2] >= 1,
            "{route}: the call went to worker 1, the answer to worker 2: {sent:?}"
        );
    }
}

#[test]
fn modern_clients_keep_state_per_principal_on_a_session_based_upstream() {
    let upstream = Upstream::start();
    let tokens = temp_file(
        "tokens",
        "alice:alice-token-0123456789\nbob:bob-token-0123456789ab\n",
    );
    let config = temp_file(
        "mcpgw.toml",
        &format!(
            "[[upstream]]\nname = \"demo\"\nurl = \"{}\"\nlegacy_only = true\n\n[auth]\ntokens_file = \"{}\"\n",
            upstream.url,
            tokens.display()
        ),
    );
    let fleet = Fleet::start(4, &["--config".into(), config.display().to_string()]);
    let proxy = ScatterProxy::start_routed(fleet.addrs(), round_robin);
    let counter = |token: &str| {
        run_python(
            "upstream_client.py",
            &[&proxy.url(), "2026-07-28", "counter", token],
        )["values"]
            .clone()
    };
    assert_eq!(counter("alice-token-0123456789"), json!(["1", "2", "3"]));
    assert_eq!(
        counter("bob-token-0123456789ab"),
        json!(["1", "2", "3"]),
        "another principal starts at 1"
    );
    assert_eq!(
        counter("alice-token-0123456789"),
        json!(["4", "5", "6"]),
        "a principal's state outlives one client"
    );
    assert!(
        proxy.sent_counts().iter().all(|&n| n >= 2),
        "{:?}",
        proxy.sent_counts()
    );

    // When the worker holding alice's upstream session dies, she is told once that
    // her state is lost, then starts afresh; she never silently sees a fresh counter
    // where she expected hers.
    let modern = |addr: &str| {
        let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"counter_increment","arguments":{}}}"#;
        let headers = [
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
            ("MCP-Protocol-Version", "2026-07-28"),
            ("Mcp-Method", "tools/call"),
            ("Mcp-Name", "counter_increment"),
            ("Authorization", "Bearer alice-token-0123456789"),
        ];
        http::request(addr, "POST", "/mcp", &headers, body)
    };
    let seventh = modern(fleet.addr(0));
    assert_eq!(tool_text(&seventh), "7");
    let owner = seventh.header("mcpgw-owner-worker").unwrap().to_owned();
    let holder = (0..4)
        .find(|&i| worker_at(&fleet, i).1 == owner)
        .expect("the owner is one of the workers");
    let (holder_pid, _) = worker_at(&fleet, holder);
    mcpgw_testkit::signal::send(holder_pid, mcpgw_testkit::signal::Signal::SIGKILL);
    let elsewhere = fleet.addr((holder + 1) % 4);
    let mut told = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let fresh = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no answer after {told:?}"
        );
        let answer = modern(elsewhere);
        if answer.status == 200 {
            break tool_text(&answer);
        }
        let message = answer.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        told.push((answer.status, reason(&answer), message));
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    eprintln!("after the owner died: {told:?}, then {fresh}");
    assert!(
        !told.is_empty(),
        "the loss is told before state starts afresh"
    );
    assert!(
        told.iter().all(|(_, r, _)| {
            ["session_gone", "outcome_unknown", "ownership_unknown"].contains(&r.as_str())
        }),
        "{told:?}"
    );
    // The answer that proved the death says the state is lost (session_gone, or
    // outcome_unknown for a call that was running when the owner died).
    let (_, _, last) = told.last().unwrap();
    assert!(last.contains("state") && last.contains("lost"), "{last}");
    assert_eq!(fresh, "1", "a new upstream session, told as such first");
}

#[test]
fn a_dropped_stream_resumes_on_another_worker_without_loss_or_repeats() {
    let upstream = Upstream::start();
    let fleet = Fleet::start(3, &["--upstream".into(), format!("demo={}", upstream.url)]);
    let session = initialize(fleet.addr(0), "/mcp");
    let body = json!({
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "slow_stream", "arguments": {"count": 20, "interval_ms": 50},
                   "_meta": {"progressToken": "p"}},
    })
    .to_string();
    let headers = mcp_headers(Some(&session));
    // Worker 1 relays the owner's stream; its client goes away after five events.
    let (status, first) = read_events(fleet.addr(1), "POST", &headers, body.as_bytes(), Some(5));
    assert_eq!(status, 200);
    assert_eq!(first.len(), 5);
    let last = first
        .last()
        .and_then(|e| e.id.clone())
        .expect("events carry ids");
    let mut resume = headers.clone();
    resume.push(("Last-Event-ID", &last));
    let (status, rest) = read_events(fleet.addr(2), "GET", &resume, b"", None);
    assert_eq!(status, 200, "resumed on a third worker");
    let all: Vec<_> = first.iter().chain(&rest).collect();
    let progress: Vec<u64> = all
        .iter()
        .filter_map(|e| e.data["params"]["progress"].as_u64())
        .collect();
    assert_eq!(
        progress,
        (1..=20).collect::<Vec<_>>(),
        "no event lost, none repeated"
    );
    let results: Vec<_> = all
        .iter()
        .filter(|e| e.data.get("result").is_some())
        .collect();
    assert_eq!(results.len(), 1, "the result once");
    assert_eq!(results[0].data["id"], 7);
    assert!(
        all.last().unwrap().data.get("result").is_some(),
        "the result last"
    );
    let ids: std::collections::HashSet<_> = all.iter().filter_map(|e| e.id.clone()).collect();
    assert_eq!(ids.len(), all.len(), "every event has its own id");

    // An id the gateway never issued, or events it no longer has, are told as such.
    let mut forged = headers.clone();
    forged.push(("Last-Event-ID", "not-an-id"));
    let answer = http::request(fleet.addr(1), "GET", "/mcp", &forged, b"");
    assert_eq!(answer.status, 400);
}
