//! One `mcpgw serve` process in front of the real demo upstream: the session
//! protocol, the modern protocol, streaming, and every kind of bad input.

use std::time::Duration;

use mcpgw_testkit::http::{
    self, call_tool, delete_session, initialize, mcp_headers, modern_body, modern_headers, request,
};
use mcpgw_testkit::{Gateway, Upstream, eventually};
use serde_json::json;

fn start() -> (Upstream, Gateway) {
    start_with(&[])
}

/// The demo upstream and a gateway in front of it, started with `flags` too.
fn start_with(flags: &[&str]) -> (Upstream, Gateway) {
    let upstream = Upstream::start();
    let route = format!("demo={}", upstream.url);
    let mut args = vec!["--upstream", route.as_str()];
    args.extend_from_slice(flags);
    let gateway = Gateway::start(&args);
    (upstream, gateway)
}

fn tool_text(response: &http::Response) -> String {
    response.expect_tool_text()
}

#[test]
fn legacy_sessions_are_isolated_and_end_with_delete() {
    let (upstream, gateway) = start();
    let addr = &gateway.addr;
    for path in ["/mcp", "/servers/demo/mcp"] {
        let a = initialize(addr, path);
        let b = initialize(addr, path);
        assert_ne!(a, b);
        assert_eq!(
            tool_text(&call_tool(
                addr,
                path,
                &a,
                2,
                "counter_increment",
                json!({})
            )),
            "1"
        );
        assert_eq!(
            tool_text(&call_tool(
                addr,
                path,
                &a,
                3,
                "counter_increment",
                json!({})
            )),
            "2"
        );
        assert_eq!(
            tool_text(&call_tool(
                addr,
                path,
                &b,
                2,
                "counter_increment",
                json!({})
            )),
            "1",
            "a second session starts at 1: one upstream session per client session"
        );
        let deleted = delete_session(addr, path, &a);
        assert_eq!(deleted.status, 200);
        let after = call_tool(addr, path, &a, 4, "counter_increment", json!({}));
        assert_eq!(
            after.outcome(),
            "404 session_not_found",
            "a deleted session is gone: {}",
            after.text()
        );
        assert_eq!(after.error_code(), Some(-32001));
    }
    assert_eq!(
        upstream.stats()["sessions_open"],
        json!(2),
        "DELETE ended the upstream session too; the two b sessions remain"
    );
}

/// The number in a metrics scrape of `admin` for `sample` (name and labels); 0 when
/// absent.
fn metric(admin: &str, sample: &str) -> f64 {
    let scrape = request(admin, "GET", "/metrics", &[], b"");
    assert_eq!(scrape.status, 200, "{}", scrape.text());
    scrape
        .text()
        .lines()
        .filter_map(|line| line.rsplit_once(' '))
        .find(|(name, _)| *name == sample)
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or(0.0)
}

/// Reads what an SSE response has sent since, until nothing more comes for a moment:
/// `Err` once the gateway ended the response (its last chunk) or the connection.
fn still_open(stream: &mut std::net::TcpStream) -> Result<(), String> {
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| e.to_string())?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match std::io::Read::read(stream, &mut buf) {
            Ok(0) => return Err("the gateway closed the connection".into()),
            Ok(n) => {
                seen.extend_from_slice(&buf[..n]);
                if seen.windows(5).any(|w| w == b"0\r\n\r\n") {
                    let seen = String::from_utf8_lossy(&seen);
                    return Err(format!("the response ended: {seen:?}"));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(());
            }
            Err(e) => return Err(format!("the stream broke: {e}")),
        }
    }
}

/// README: "a session with no request and no held `GET` stream for [the idle timeout]
/// ends". A session beside it that is left idle shows that the timeout has passed.
#[test]
fn notifications_get_202_and_a_held_get_stream_stays_open_and_keeps_its_session() {
    let (_upstream, gateway) = start_with(&["--session-idle-timeout-ms", "1000"]);
    let addr = &gateway.addr;
    let admin = gateway
        .admin
        .clone()
        .expect("a standalone gateway announces its admin");
    let held = initialize(addr, "/mcp");
    let note = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":99}}"#;
    let ack = request(addr, "POST", "/mcp", &mcp_headers(Some(&held)), note);
    assert_eq!(ack.status, 202);

    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let get = format!(
        "GET /mcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept: text/event-stream\r\n\
         Mcp-Session-Id: {held}\r\nMCP-Protocol-Version: 2025-11-25\r\n\r\n"
    );
    std::io::Write::write_all(&mut stream, get.as_bytes()).unwrap();
    let mut head = [0u8; 512];
    let n = std::io::Read::read(&mut stream, &mut head).unwrap();
    let head = String::from_utf8_lossy(&head[..n]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");

    // Opened last, so it would not expire before the held one if the stream did not
    // keep that one alive.
    let idle = initialize(addr, "/mcp");
    let expired = r#"mcpgw_sessions_ended_total{reason="expired"}"#;
    eventually(Duration::from_secs(60), || match metric(&admin, expired) {
        n if n >= 1.0 => Ok(()),
        n => Err(n),
    });
    still_open(&mut stream).unwrap_or_else(|e| panic!("past the idle timeout: {e}"));
    let answer = call_tool(addr, "/mcp", &held, 2, "echo", json!({"text": "here"}));
    assert_eq!(
        answer.status,
        200,
        "the held session lives: {}",
        answer.text()
    );
    still_open(&mut stream).unwrap_or_else(|e| panic!("after a request in the session: {e}"));
    let gone = call_tool(addr, "/mcp", &idle, 2, "echo", json!({"text": "gone"}));
    assert_eq!(gone.outcome(), "404 session_not_found", "{}", gone.text());
    assert_eq!(
        metric(&admin, expired),
        1.0,
        "only the idle session expired"
    );
}

#[test]
fn sse_events_are_relayed_as_they_arrive() {
    let (_upstream, gateway) = start();
    let addr = &gateway.addr;
    let session = initialize(addr, "/mcp");
    let body = json!({
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": { "name": "slow_stream", "arguments": { "count": 10, "interval_ms": 100 },
                    "_meta": { "progressToken": "p7" } },
    });
    let (response, arrivals) = http::request_timed(
        addr,
        "POST",
        "/mcp",
        &mcp_headers(Some(&session)),
        body.to_string().as_bytes(),
    );
    assert_eq!(response.status, 200);
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    let messages = response.messages();
    assert_eq!(messages.len(), 11, "10 progress events and the result");
    assert_eq!(messages[0]["method"], "notifications/progress");
    assert_eq!(messages[10]["id"], 7);
    assert_eq!(arrivals.len(), 11);
    let first = arrivals[0];
    let last = arrivals[10];
    eprintln!("first event at {first:?}, result at {last:?}");
    assert!(
        last - first >= Duration::from_millis(500),
        "events must arrive spread over the stream (first {first:?}, last {last:?}), not in one burst"
    );
}

#[test]
fn modern_requests_pass_through_without_sessions() {
    let (_upstream, gateway) = start();
    let addr = &gateway.addr;
    let response = request(
        addr,
        "POST",
        "/mcp",
        &modern_headers("tools/call", Some("echo")),
        &modern_body(
            1,
            "tools/call",
            json!({"name": "echo", "arguments": {"text": "hi"}}),
        ),
    );
    assert_eq!(response.status, 200);
    assert!(
        response.header("mcp-session-id").is_none(),
        "no session minted"
    );
    assert_eq!(tool_text(&response), "hi");

    let mismatch = request(
        addr,
        "POST",
        "/mcp",
        &modern_headers("tools/call", Some("other")),
        &modern_body(
            2,
            "tools/call",
            json!({"name": "echo", "arguments": {"text": "hi"}}),
        ),
    );
    assert_eq!(mismatch.status, 400);
    assert_eq!(mismatch.error_code(), Some(-32020));
    assert_eq!(mismatch.json()["id"], 2);

    for method in ["GET", "DELETE"] {
        let refused = request(
            addr,
            method,
            "/mcp",
            &[
                ("MCP-Protocol-Version", "2026-07-28"),
                ("Accept", "text/event-stream"),
            ],
            b"",
        );
        assert_eq!(refused.status, 405, "{method}");
        assert!(refused.error_code().is_some());
    }
}

/// Each bad input gets its status and a JSON-RPC error body, and the gateway keeps
/// serving: a good session works after all of them.
#[test]
fn bad_input_is_refused_clearly_and_the_gateway_keeps_serving() {
    let (_upstream, gateway) = start_with(&["--max-body-bytes", "4096"]);
    let addr = &gateway.addr;
    let session = initialize(addr, "/mcp");
    let json = ("Content-Type", "application/json");
    let in_session = mcp_headers(Some(&session));
    let big = vec![b' '; 5000];
    // (what, path, headers, body, expected status, expected JSON-RPC code)
    type Case<'a> = (
        &'a str,
        &'a str,
        Vec<(&'a str, &'a str)>,
        &'a [u8],
        u16,
        i64,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "malformed JSON",
            "/mcp",
            in_session.clone(),
            b"{\"jsonrpc\":",
            400,
            -32700,
        ),
        (
            "non-object body",
            "/mcp",
            in_session.clone(),
            b"[1,2,3]",
            400,
            -32600,
        ),
        (
            "scalar body",
            "/mcp",
            in_session.clone(),
            b"\"hi\"",
            400,
            -32600,
        ),
        (
            "oversized body",
            "/mcp",
            in_session.clone(),
            &big,
            413,
            -32600,
        ),
        (
            "unknown route",
            "/nope/mcp",
            in_session.clone(),
            b"{}",
            404,
            -32601,
        ),
        (
            "wrong content type",
            "/mcp",
            vec![("Content-Type", "text/plain"), ("Mcp-Session-Id", &session)],
            b"{}",
            415,
            -32600,
        ),
        (
            "unsupported protocol version",
            "/mcp",
            vec![json, ("MCP-Protocol-Version", "1999-01-01")],
            b"{}",
            400,
            -32022,
        ),
        (
            "forbidden characters in the session id",
            "/mcp",
            vec![json, ("Mcp-Session-Id", "bad\u{e9}id")],
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            400,
            -32600,
        ),
        (
            "no session on a non-initialize request",
            "/mcp",
            vec![json],
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            400,
            -32600,
        ),
        (
            "unknown session",
            "/mcp",
            vec![
                json,
                ("Mcp-Session-Id", "00000000000000000000000000000000.nobody"),
            ],
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            404,
            -32001,
        ),
    ];
    for (what, path, headers, body, status, code) in cases {
        let response = request(addr, "POST", path, &headers, body);
        assert_eq!(
            response.status,
            status,
            "{what}: status: {}",
            response.text()
        );
        let error = response.json();
        assert_eq!(error["jsonrpc"], "2.0", "{what}: JSON-RPC body");
        assert_eq!(error["error"]["code"], code, "{what}: code");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.len() > 20,
            "{what}: the message explains: {message:?}"
        );
        match what {
            "unknown session" => assert_eq!(
                response.reason().as_deref(),
                Some("session_not_found"),
                "{what}: {error}"
            ),
            "unsupported protocol version" => {
                let supported: Vec<&str> = error["error"]["data"]["supported"]
                    .as_array()
                    .map(|v| v.iter().filter_map(|s| s.as_str()).collect())
                    .unwrap_or_default();
                for version in ["2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"] {
                    assert!(
                        supported.contains(&version),
                        "data.supported lists {version}: {error}"
                    );
                }
                assert!(!supported.contains(&"1999-01-01"), "{error}");
            }
            _ => {}
        }
    }
    // Still serving, and the session survived every bad request.
    let ok = call_tool(
        addr,
        "/mcp",
        &session,
        9,
        "echo",
        json!({"text": "still here"}),
    );
    assert_eq!(ok.status, 200);
    assert_eq!(tool_text(&ok), "still here");
}

#[test]
fn an_unreachable_upstream_gets_a_gateway_error() {
    let refusing = mcpgw_testkit::refusing_port();
    let port = refusing.port;
    let gateway = Gateway::start(&["--upstream", &format!("gone=http://127.0.0.1:{port}/mcp")]);
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}"#;
    let response = request(
        &gateway.addr,
        "POST",
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ],
        body,
    );
    assert_eq!(response.status, 502);
    assert_eq!(response.json()["id"], 1);
    assert_eq!(
        response.json()["error"]["data"]["reason"],
        "upstream_unreachable"
    );
}

/// A 2026-07-28 call passes straight through (no initialize, no session), so the
/// upstream timeout bounds the slow call alone.
#[test]
fn a_call_the_upstream_does_not_answer_in_time_gets_504_and_may_have_run() {
    let (upstream, gateway) = start_with(&["--upstream-timeout-ms", "300"]);
    let slow = request(
        &gateway.addr,
        "POST",
        "/mcp",
        &modern_headers("tools/call", Some("sleep_ms")),
        &modern_body(
            2,
            "tools/call",
            json!({"name": "sleep_ms", "arguments": {"ms": 3000}}),
        ),
    );
    assert_eq!(slow.outcome(), "504 upstream_timeout", "{}", slow.text());
    assert_eq!(slow.json()["id"], 2);
    // The upstream got the call: the client is told it may have run, not to retry.
    assert_eq!(upstream.counter("tool_calls"), 1);
    let message = slow.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(message.contains("may still have run"), "{message}");
    assert_eq!(slow.header("retry-after"), None);
}

#[test]
fn an_invalid_configuration_exits_2_naming_the_field() {
    let output = std::process::Command::new(mcpgw_testkit::bin("mcpgw"))
        .args(["serve", "--upstream", "demo=ftp://x/mcp"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("upstream[0].url"), "{stderr}");
}
