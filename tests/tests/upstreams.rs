//! Upstreams as users have them: an HTTPS upstream (test CA, mutual TLS, a wrong CA,
//! a missing client certificate); stdio servers (`mcp-server-time` from PyPI, and
//! servers built with the official Python SDK) whose child processes live and die
//! with their sessions and workers, get the gateway's environment without its
//! `MCPGW_*` variables, and whose command may not start; an elicitation asked by the
//! upstream mid-call and answered through a third worker, and the requests a
//! 2026-07-28 client cannot receive, declined for it; 2026-07-28 clients on an
//! upstream that keeps state in sessions, told once when it is lost; SSE streams
//! resumed on another worker after their connection dropped, within the replay
//! limits and past them, and kept alive while quiet; and a JSON call cancelled at the
//! upstream when its client goes away.

#[path = "upstreams_support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::tls::{TestCa, TlsTerminator};
use mcpgw_testkit::{Child, Gateway, ScatterProxy, Upstream, python, python_script, run_python};
use serde_json::{Value, json};
use support::{
    Fleet, Until, children_of, read_events, read_stream, running, wait_stopped, worker_at,
};

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

/// `tests/python/NAME.py http PORT` on a free port, once it listens: the process
/// (the server lives as long as it) and the port.
fn python_http_server(name: &str) -> (Child, u16) {
    let port = mcpgw_testkit::free_port();
    let mut server = Child::spawn(
        name,
        &python(),
        &[
            python_script(&format!("{name}.py")).display().to_string(),
            "http".into(),
            port.to_string(),
        ],
    );
    server.wait_for_line(
        &format!("{name} listening"),
        std::time::Duration::from_secs(30),
    );
    mcpgw_testkit::wait_for_listener(
        &format!("127.0.0.1:{port}"),
        std::time::Duration::from_secs(30),
    );
    (server, port)
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
    let ended = http::delete_session(there, "/mcp", &b);
    assert_eq!(ended.status, 200);
    wait_stopped(pid_b, "the process of an ended session");
    let after = call_tool(there, "/mcp", &b, 3, "counter_increment", json!({}));
    assert_eq!(after.status, 404);

    // A child that dies ends its session truthfully, never with a fresh process.
    mcpgw_testkit::signal::send(pid_a, mcpgw_testkit::signal::Signal::SIGKILL);
    wait_stopped(pid_a, "the killed child");
    // Until its worker has reaped the child, a request may still be written to a pipe
    // the worker cannot yet tell is dead, and is then answered "may have run"
    // (tests/tests/stdio_loss.rs); once the session's record is gone, the worker knows.
    let record = format!("mcpgw:pool_owner:{a}");
    mcpgw_testkit::eventually(std::time::Duration::from_secs(30), || {
        match fleet.redis.command(&["EXISTS", &record]).as_str() {
            "0" => Ok(()),
            _ => Err("the session is still recorded"),
        }
    });
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
    let ended = http::delete_session(&gateway.addr, "/mcp", &first);
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

#[test]
fn an_elicitation_mid_call_is_answered_through_a_third_worker() {
    let (_server, port) = python_http_server("stateful_server");
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
        let proxy = ScatterProxy::start_routed(fleet.addrs(), support::by_role);
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

/// A config of one `legacy_only` HTTP route (`demo` at `url`) whose clients are alice
/// and bob (bearer tokens), with `fleet` as its `[fleet]` table.
fn alice_and_bob_on_a_session_based_upstream(url: &str, fleet: &str) -> PathBuf {
    let tokens = temp_file(
        "tokens",
        "alice:alice-token-0123456789\nbob:bob-token-0123456789ab\n",
    );
    temp_file(
        "mcpgw.toml",
        &format!(
            "[fleet]\n{fleet}\n\n[[upstream]]\nname = \"demo\"\nurl = \"{url}\"\nlegacy_only = true\n\n[auth]\ntokens_file = \"{}\"\n",
            tokens.display()
        ),
    )
}

/// With `--adopt never`: how a lost shared session is told (with adoption, its
/// state goes on: the test after this one).
#[test]
fn modern_clients_keep_state_per_principal_on_a_session_based_upstream() {
    let upstream = Upstream::start();
    let config = alice_and_bob_on_a_session_based_upstream(&upstream.url, "adopt = \"never\"");
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

    // When the worker holding alice's upstream session dies, she is told exactly once
    // that her state is lost, and the call after starts afresh: she never silently
    // sees a fresh counter where she expected hers, and is not told twice. First with
    // a call of hers running when it dies, then with none.
    // Told once: the call after the one told runs, in a new upstream session.
    let told_once_then_afresh = |addr: &str| {
        let fresh = alice(addr, "counter_increment", json!({})).unwrap();
        assert_eq!(
            fresh.status,
            200,
            "told once: the call after runs: {}",
            fresh.text()
        );
        assert_eq!(tool_text(&fresh), "1", "in a new upstream session");
        fresh
    };
    let seventh = alice(fleet.addr(0), "counter_increment", json!({})).unwrap();
    assert_eq!(tool_text(&seventh), "7");
    let first = worker_index(&fleet, &seventh, &[0, 1, 2, 3]);
    let elsewhere = (first + 1) % 4;
    let calls_before = upstream.counter("tool_calls");
    let running = std::thread::spawn({
        let addr = fleet.addr(elsewhere).to_owned();
        move || alice(&addr, "sleep_ms", json!({"ms": 600_000}))
    });
    mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
        (upstream.counter("tool_calls") > calls_before)
            .then_some(())
            .ok_or("the call has not reached the upstream")
    });
    let (first_pid, _) = worker_at(&fleet, first);
    mcpgw_testkit::signal::send(first_pid, mcpgw_testkit::signal::Signal::SIGKILL);
    let told = running
        .join()
        .unwrap()
        .expect("an answer to the running call");
    eprintln!("the running call: {}", told.text());
    assert_eq!(told.outcome(), "502 outcome_unknown", "{}", told.text());
    assert_eq!(told.json()["error"]["data"]["retryable"], false);
    assert!(
        error_message(&told).contains("the state of that session is lost"),
        "{}",
        told.text()
    );
    let fresh = told_once_then_afresh(fleet.addr(elsewhere));
    let others: Vec<usize> = (0..4).filter(|&i| i != first).collect();
    let second = worker_index(&fleet, &fresh, &others);

    // No call running: the next call, through the worker that replaced the first dead
    // one (it never had a mesh connection to this holder, so it knows its request
    // did not reach it), is told the session is gone.
    let (second_pid, _) = worker_at(&fleet, second);
    mcpgw_testkit::signal::send(second_pid, mcpgw_testkit::signal::Signal::SIGKILL);
    let replacement = fleet.addr(first);
    // Until the death is proven the gateway may say "not known yet, retry" (a
    // retryable 503 that did not reach the owner): that does not tell the loss.
    let mut unproven = Vec::new();
    let told = mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
        let answer = alice(replacement, "counter_increment", json!({}))?;
        if answer.status == 503 && answer.json()["error"]["data"]["retryable"] == true {
            unproven.push(answer.outcome());
            return Err(answer.outcome());
        }
        Ok(answer)
    });
    eprintln!(
        "after the second holder died: {unproven:?}, then {}",
        told.text()
    );
    assert_eq!(told.outcome(), "404 session_gone", "{}", told.text());
    assert_eq!(told.error_code(), Some(-32001));
    assert!(
        error_message(&told).contains("your next request starts a new one, without that state"),
        "{}",
        told.text()
    );
    told_once_then_afresh(replacement);
}

/// The state of a 2026-07-28 principal on a session-based HTTP upstream outlives the
/// worker that holds its upstream session: killed, the next call (on any worker)
/// adopts the session and the counter goes on; drained, the same. Each adoption is
/// told once, in the `mcpgw-adopted` header of the call that made it.
#[test]
fn a_modern_principals_state_on_a_session_based_upstream_outlives_its_worker() {
    let upstream = Upstream::start();
    let config = alice_and_bob_on_a_session_based_upstream(&upstream.url, "lease_ms = 3000");
    let fleet = Fleet::start(3, &["--config".into(), config.display().to_string()]);
    // (A host whose worker just died is without one until its replacement starts.)
    let count = |addr: &str| {
        let answer = mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
            alice(addr, "counter_increment", json!({}))
        });
        assert_eq!(answer.status, 200, "{}", answer.text());
        answer
    };
    for expected in ["1", "2", "3"] {
        assert_eq!(tool_text(&count(fleet.addr(0))), expected);
    }
    for (cause, signal) in [
        ("death", mcpgw_testkit::signal::Signal::SIGKILL),
        ("drain", mcpgw_testkit::signal::Signal::SIGTERM),
    ] {
        let last = count(fleet.addr(0));
        let before: u64 = tool_text(&last).parse().expect("a count");
        let holder = worker_index(&fleet, &last, &[0, 1, 2]);
        let (pid, id) = worker_at(&fleet, holder);
        mcpgw_testkit::signal::send(pid, signal);
        wait_stopped(pid, "the holder of alice's upstream session");
        let through = (holder + 1) % 3;
        // Until its death is proven the answer may be a retryable 503; never a fresh
        // session, never "gone".
        let adopted = mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
            let answer = alice(fleet.addr(through), "counter_increment", json!({}))?;
            match answer.status {
                503 if answer.json()["error"]["data"]["retryable"] == true => Err(answer.outcome()),
                _ => Ok(answer),
            }
        });
        assert_eq!(adopted.status, 200, "{cause}: {}", adopted.text());
        assert_eq!(
            tool_text(&adopted),
            (before + 1).to_string(),
            "{cause}: the counter goes on"
        );
        assert_eq!(
            adopted.header("mcpgw-adopted"),
            Some(cause),
            "{cause}: the adopting answer says so"
        );
        assert_ne!(adopted.header("mcpgw-owner-worker"), Some(id.as_str()));
        let next = count(fleet.addr(holder));
        assert_eq!(tool_text(&next), (before + 2).to_string(), "{cause}");
        assert_eq!(next.header("mcpgw-adopted"), None, "{cause}: told once");
    }
}

/// A 2026-07-28 call of alice's through `addr`; no HTTP answer is an `Err`.
fn alice(addr: &str, tool: &str, arguments: Value) -> Result<http::Response, String> {
    let body = http::modern_body(
        1,
        "tools/call",
        json!({"name": tool, "arguments": arguments}),
    );
    let mut headers = http::modern_headers("tools/call", Some(tool));
    headers.push(("Authorization", "Bearer alice-token-0123456789"));
    http::try_request(addr, "POST", "/mcp", &headers, &body)
}

/// Which of the workers `among` executed `answer`.
fn worker_index(fleet: &Fleet, answer: &http::Response, among: &[usize]) -> usize {
    let owner = answer
        .header("mcpgw-owner-worker")
        .expect("the answer names its owner");
    among
        .iter()
        .copied()
        .find(|&i| worker_at(fleet, i).1 == owner)
        .unwrap_or_else(|| panic!("{owner} is none of the workers {among:?}"))
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

    // An id the gateway never issued is a client error (events it no longer has are
    // a 410: see the replay-limit test below).
    let mut forged = headers.clone();
    forged.push(("Last-Event-ID", "not-an-id"));
    let answer = http::request(fleet.addr(1), "GET", "/mcp", &forged, b"");
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert_eq!(answer.error_code(), Some(-32600));
    let message = answer.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(message.contains("Last-Event-ID"), "{message}");
}

/// `GET /mcp` in `session` with `Last-Event-ID: after`, through `addr`.
fn resume(addr: &str, session: &str, after: &str) -> http::Response {
    let mut headers = mcp_headers(Some(session));
    headers.push(("Last-Event-ID", after));
    http::request(addr, "GET", "/mcp", &headers, b"")
}

/// A `slow_stream` call of `count` progress events sent at once, then the result.
fn slow_stream_body(id: u64, count: u64) -> Vec<u8> {
    json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "slow_stream", "arguments": {"count": count, "interval_ms": 0},
                   "_meta": {"progressToken": "p"}},
    })
    .to_string()
    .into_bytes()
}

fn error_message(response: &http::Response) -> String {
    response.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

#[test]
fn a_resume_within_the_replay_limits_gets_exactly_the_rest_and_past_them_is_a_410() {
    let upstream = Upstream::start();
    let fleet = Fleet::start(2, &["--upstream".into(), format!("demo={}", upstream.url)]);
    // Worker 0 owns the session and keeps its stream logs; every stream request goes
    // through worker 1, as a client behind a load balancer would send it.
    let session = initialize(fleet.addr(0), "/mcp");
    let headers = mcp_headers(Some(&session));
    let via = fleet.addr(1);

    // One stream of 1101 events (1100 progress notifications, then the result), whose
    // client goes away after five: the owner reads on, and keeps the newest 1024.
    let first = read_stream(
        via,
        "POST",
        "/mcp",
        &headers,
        &slow_stream_body(2, 1100),
        Until::Events(5),
    );
    assert_eq!(first.status, 200);
    let seen = first.events[4].id.clone().expect("events carry ids");
    let (stream, seq) = seen
        .rsplit_once(':')
        .expect("ids read <owner>:<stream>:<seq>");
    assert_eq!(seq, "5", "{seen}");
    let id = |seq: u64| format!("{stream}:{seq}");
    let tail = mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
        let answer = resume(via, &session, &id(1100));
        if answer.status == 200 {
            Ok(support::events_in(&answer.text()))
        } else {
            Err(answer.outcome())
        }
    });
    assert_eq!(
        tail.len(),
        1,
        "only the result follows event 1100: {tail:?}"
    );
    assert_eq!(tail[0].id.as_deref(), Some(id(1101).as_str()));
    assert_eq!(tail[0].data["id"], 2);
    assert!(tail[0].data.get("result").is_some(), "{:?}", tail[0]);

    // Events 78 to 1101 are kept: a resume after 77 replays exactly those; after 76
    // one event is missing, after 5 (the last one the client saw) 72 are.
    for (after, lost) in [(5, 72), (76, 1)] {
        let answer = resume(via, &session, &id(after));
        assert_eq!(
            answer.outcome(),
            "410 replay_unavailable",
            "after event {after}: {}",
            answer.text()
        );
        let message = error_message(&answer);
        assert!(
            message.contains(&format!(
                "{lost} event(s) after the last one you saw were dropped"
            )),
            "{message}"
        );
    }
    let rest = resume(via, &session, &id(77));
    assert_eq!(rest.status, 200, "{}", rest.text());
    let rest = support::events_in(&rest.text());
    let ids: Vec<String> = rest.iter().filter_map(|e| e.id.clone()).collect();
    assert_eq!(ids, (78..=1101).map(id).collect::<Vec<_>>());
    let progress: Vec<u64> = rest
        .iter()
        .filter_map(|e| e.data["params"]["progress"].as_u64())
        .collect();
    assert_eq!(progress, (78..=1100).collect::<Vec<_>>());
    assert!(
        rest.last()
            .is_some_and(|e| e.data["id"] == 2 && e.data.get("result").is_some())
    );

    // A session keeps its newest 16 streams: with fifteen more, the first is kept.
    let mut second_stream_first_event = None;
    for n in 0..15 {
        let read = read_stream(
            via,
            "POST",
            "/mcp",
            &headers,
            &slow_stream_body(10 + n, 2),
            Until::End,
        );
        assert_eq!(read.status, 200);
        assert_eq!(read.events.len(), 3, "two progress events, then the result");
        second_stream_first_event.get_or_insert_with(|| read.events[0].id.clone().unwrap());
    }
    let kept = resume(via, &session, &id(1100));
    assert_eq!(kept.status, 200, "sixteen streams: {}", kept.text());
    assert_eq!(support::events_in(&kept.text()).len(), 1);
    // The seventeenth makes the gateway forget the oldest finished one, the first.
    let seventeenth = read_stream(
        via,
        "POST",
        "/mcp",
        &headers,
        &slow_stream_body(30, 2),
        Until::End,
    );
    assert_eq!(seventeenth.events.len(), 3);
    let forgotten = resume(via, &session, &id(1100));
    assert_eq!(
        forgotten.outcome(),
        "410 replay_unavailable",
        "{}",
        forgotten.text()
    );
    let message = error_message(&forgotten);
    assert!(
        message.contains("no longer kept (a session keeps its newest 16 streams)"),
        "{message}"
    );
    let second = resume(via, &session, second_stream_first_event.as_deref().unwrap());
    assert_eq!(
        second.status,
        200,
        "the second stream is kept: {}",
        second.text()
    );
    let second = support::events_in(&second.text());
    assert_eq!(second.len(), 2, "{second:?}");
    assert_eq!(second[0].data["params"]["progress"], 2);
    assert_eq!(second[1].data["id"], 10);
}

#[test]
fn a_quiet_stream_carries_a_keepalive_comment() {
    // A stdio session's GET stream carries what the server writes outside any request:
    // nothing, for this server. (An HTTP upstream may send comments of its own.)
    let fleet = Fleet::start(2, &["--upstream".into(), stateful_stdio("st")]);
    let session = initialize(fleet.addr(0), "/mcp");
    let read = read_stream(
        fleet.addr(1),
        "GET",
        "/mcp",
        &mcp_headers(Some(&session)),
        b"",
        Until::Comment,
    );
    eprintln!("comments on the quiet stream: {:?}", read.comments);
    assert_eq!(read.status, 200);
    assert!(read.events.is_empty(), "{:?}", read.events);
    assert_eq!(
        read.comments.first().map(|c| c.text.as_str()),
        Some("keepalive"),
        "the stream ended without a keep-alive comment"
    );
}

#[test]
fn a_stdio_command_that_cannot_start_is_a_502_upstream_spawn_failed() {
    let gateway = Gateway::start(&[
        "--upstream",
        "missing=stdio:/nonexistent/mcp-server --verbose",
        "--upstream",
        "unknown=stdio:mcpgw-no-such-mcp-server",
    ]);
    for (route, program) in [
        ("missing", "/nonexistent/mcp-server"),
        ("unknown", "mcpgw-no-such-mcp-server"),
    ] {
        let answer = http::try_initialize(&gateway.addr, &format!("/servers/{route}/mcp"))
            .unwrap_or_else(|e| panic!("{route}: {e}"));
        eprintln!("{route}: {}", answer.text());
        assert_eq!(
            answer.outcome(),
            "502 upstream_spawn_failed",
            "{route}: {}",
            answer.text()
        );
        let message = error_message(&answer);
        assert!(
            message.contains(route) && message.contains(program),
            "names the upstream and its program: {message}"
        );
    }
}

#[test]
fn stdio_children_get_the_gateway_environment_without_its_mcpgw_variables() {
    let config = temp_file(
        "mcpgw.toml",
        &format!(
            "[[upstream]]\nname = \"env\"\ncommand = [\"{}\", \"{}\"]\nenv = {{ CONFIGURED_FOR_CHILD = \"from the config\" }}\n",
            python().display(),
            python_script("env_server.py").display()
        ),
    );
    let fleet = Fleet::start_with_env(
        1,
        &["--config".into(), config.display().to_string()],
        &[
            ("MCPGW_TEST_SECRET", "the gateway's business"),
            ("INHERITED_BY_CHILD", "yes"),
        ],
    );
    // The premise: the worker's environment holds MCPGW_* variables, this one and
    // those its supervisor sets for it.
    let (worker_pid, _) = worker_at(&fleet, 0);
    let environ = std::fs::read(format!("/proc/{worker_pid}/environ")).expect("worker environ");
    let worker_mcpgw: Vec<String> = environ
        .split(|&b| b == 0)
        .map(|kv| String::from_utf8_lossy(kv).into_owned())
        .filter(|kv| kv.starts_with("MCPGW_"))
        .collect();
    assert!(
        worker_mcpgw
            .iter()
            .any(|kv| kv.starts_with("MCPGW_TEST_SECRET="))
            && worker_mcpgw.len() > 1,
        "{worker_mcpgw:?}"
    );

    let session = initialize(fleet.addr(0), "/mcp");
    let report = call_tool(fleet.addr(0), "/mcp", &session, 2, "environment", json!({}));
    let env: serde_json::Map<String, Value> =
        serde_json::from_str(&tool_text(&report)).expect("the environment as JSON");
    let leaked: Vec<&String> = env.keys().filter(|k| k.starts_with("MCPGW_")).collect();
    assert!(leaked.is_empty(), "the child sees {leaked:?}");
    assert_eq!(env.get("INHERITED_BY_CHILD"), Some(&json!("yes")));
    assert_eq!(
        env.get("CONFIGURED_FOR_CHILD"),
        Some(&json!("from the config"))
    );
}

#[test]
fn an_upstream_asking_a_2026_client_hears_method_not_found_and_the_client_a_comment() {
    let (_server, port) = python_http_server("asking_server");
    let config = temp_file(
        "mcpgw.toml",
        &format!(
            "[[upstream]]\nname = \"stdio\"\ncommand = [\"{}\", \"{}\", \"stdio\"]\n\n\
             [[upstream]]\nname = \"web\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nlegacy_only = true\n",
            python().display(),
            python_script("asking_server.py").display()
        ),
    );
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    for route in ["stdio", "web"] {
        for (kind, method) in [
            ("elicitation", "elicitation/create"),
            ("sampling", "sampling/createMessage"),
            ("roots", "roots/list"),
        ] {
            let read = read_stream(
                &gateway.addr,
                "POST",
                &format!("/servers/{route}/mcp"),
                &http::modern_headers("tools/call", Some("ask_client")),
                &http::modern_body(
                    7,
                    "tools/call",
                    json!({"name": "ask_client", "arguments": {"kind": kind}}),
                ),
                Until::End,
            );
            let what = format!("{route}, {kind}");
            assert_eq!(read.status, 200, "{what}");
            assert!(
                read.events.iter().all(|e| e.data.get("method").is_none()),
                "{what}: the request reached the client: {:?}",
                read.events
            );
            assert!(
                read.comments
                    .iter()
                    .any(|c| c.text.contains(&format!("declined a {method} request"))),
                "{what}: {:?}",
                read.comments
            );
            let heard = read
                .events
                .iter()
                .find(|e| e.data["id"] == 7)
                .and_then(|e| e.data["result"]["content"][0]["text"].as_str())
                .unwrap_or_else(|| panic!("{what}: no result: {:?}", read.events))
                .to_owned();
            assert!(
                heard.starts_with(&format!("error -32601: {method} cannot reach this client")),
                "{what}: the upstream heard {heard:?}"
            );
        }
    }
}

#[test]
fn a_client_that_goes_away_cancels_its_forwarded_json_call_at_the_upstream() {
    a_client_that_goes_away_cancels_its_forwarded_call(&["--mesh-transport", "quic"]);
}

/// The same over the same-host path: the `Cancel` of one exchange travels over the
/// Unix socket as over TLS.
#[test]
fn a_client_that_goes_away_cancels_its_call_forwarded_over_the_same_host_path() {
    let sockets = tempfile::tempdir().expect("socket dir");
    let dir = sockets.path().to_str().expect("utf-8 path");
    let mesh = [
        "--mesh-transport",
        "tcp",
        "--mesh-same-host",
        "unix",
        "--mesh-socket-dir",
        dir,
    ];
    a_client_that_goes_away_cancels_its_forwarded_call(&mesh);
}

fn a_client_that_goes_away_cancels_its_forwarded_call(mesh: &[&str]) {
    let (_server, port) = python_http_server("ticking_server");
    let web = format!("127.0.0.1:{port}");
    let fleet = Fleet::start_on(
        mesh,
        2,
        &[
            "--upstream".into(),
            format!("web=http://{web}/mcp"),
            "--upstream".into(),
            format!(
                "stdio=stdio:{} {} stdio",
                python().display(),
                python_script("ticking_server.py").display()
            ),
        ],
        &[],
    );
    // An HTTP upstream sees the request it was running go away; a stdio one is sent
    // notifications/cancelled.
    for (route, ended_by) in [("web", "disconnected"), ("stdio", "cancelled")] {
        let path = format!("/servers/{route}/mcp");
        let session = initialize(fleet.addr(0), &path);
        let progress = || -> Value {
            if route == "web" {
                return http::request(&web, "GET", "/ticks", &[], b"").json();
            }
            let answer = call_tool(fleet.addr(0), &path, &session, 9, "ticks", json!({}));
            serde_json::from_str(&tool_text(&answer)).expect("ticks as JSON")
        };

        // Through worker 1 the call is forwarded to the owner and answered as plain
        // JSON (an SSE answer would be read on for resumption instead).
        let short = call_tool(
            fleet.addr(1),
            &path,
            &session,
            2,
            "tick",
            json!({"count": 1, "interval_ms": 0}),
        );
        assert_eq!(tool_text(&short), "ticked 1 times", "{route}");
        assert_eq!(short.header("content-type"), Some("application/json"));
        assert_ne!(
            short.header("mcpgw-owner-worker"),
            short.header("mcpgw-edge-worker"),
            "{route}: forwarded"
        );
        if mesh.contains(&"unix") {
            let edge = short.header("mcpgw-edge-worker").unwrap_or_default();
            let admin = mcpgw_testkit::admin::admin_of(&fleet.redis, edge);
            let links = mcpgw_testkit::admin::mesh_links(&admin);
            assert!(
                links.iter().all(|(_, link)| link == "unix") && !links.is_empty(),
                "{route}: forwarded over the same-host path: {links:?}"
            );
        }

        let client = support::send_request(
            fleet.addr(1),
            "POST",
            &path,
            &mcp_headers(Some(&session)),
            &http::tool_call_body(3, "tick", json!({"count": 100_000, "interval_ms": 10})),
        );
        mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
            let now = progress();
            if now["running"] == 1 {
                Ok(())
            } else {
                Err(now)
            }
        });
        let gone = std::time::Instant::now();
        drop(client);
        let after = mcpgw_testkit::eventually(std::time::Duration::from_secs(60), || {
            let now = progress();
            if now["running"] == 0 {
                Ok(now)
            } else {
                Err(now)
            }
        });
        eprintln!(
            "{route}: the call stopped {:?} after its client went away: {after}",
            gone.elapsed()
        );
        assert_eq!(after[ended_by], 1, "{route}: {after}");
        assert_eq!(
            after["finished"], 1,
            "{route}: only the short call ran to its end: {after}"
        );
    }
}
