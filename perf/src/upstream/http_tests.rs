//! The server over a real socket, spoken to as a client would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::{Upstream, serve};

/// Generous: only a server that buffers a stream or never answers waits this long.
const PATIENCE: Duration = Duration::from_secs(30);

const MODERN_META: &str = r#"{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{}}"#;

struct TestServer {
    address: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start(sse_always: bool) -> TestServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let task = tokio::spawn(serve(listener, Arc::new(Upstream::new(sse_always))));
    TestServer { address, task }
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {:?}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }
}

async fn send(address: SocketAddr, request: Request<Full<Bytes>>) -> hyper::Response<Incoming> {
    let stream = TcpStream::connect(address).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    tokio::time::timeout(PATIENCE, sender.send_request(request))
        .await
        .expect("answered in time")
        .expect("response")
}

async fn exchange(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://{address}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let response = send(address, request).await;
    let (parts, body) = response.into_parts();
    let body = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

async fn post(address: SocketAddr, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut all = vec![
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    all.extend_from_slice(headers);
    exchange(address, "POST", "/mcp", &all, body).await
}

async fn initialize(address: SocketAddr) -> String {
    let answer = post(
        address,
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#,
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json()["result"]["protocolVersion"], "2025-03-26");
    answer
        .header("mcp-session-id")
        .expect("session id")
        .to_owned()
}

async fn call_tool(
    address: SocketAddr,
    session: &str,
    id: u64,
    name: &str,
    arguments: Value,
) -> Answer {
    let body = json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":{"name":name,"arguments":arguments}});
    post(address, &[("mcp-session-id", session)], &body.to_string()).await
}

async fn stats(address: SocketAddr) -> Value {
    exchange(address, "GET", "/stats", &[], "").await.json()
}

fn sse_data(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|line| line.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).expect("event data is JSON"))
        .collect()
}

#[tokio::test]
async fn legacy_sessions_keep_separate_state_and_end_on_delete() {
    let server = start(false).await;
    let first = initialize(server.address).await;
    let second = initialize(server.address).await;
    assert_ne!(first, second);
    assert_eq!(first.len(), 32);

    let note = post(
        server.address,
        &[("mcp-session-id", &first)],
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
    )
    .await;
    assert_eq!(note.status, StatusCode::ACCEPTED);
    assert!(note.body.is_empty());

    for expected in ["1", "2"] {
        let answer = call_tool(server.address, &first, 2, "counter_increment", json!({})).await;
        assert_eq!(answer.header("content-type"), Some("application/json"));
        assert_eq!(answer.json()["result"]["content"][0]["text"], expected);
    }
    let answer = call_tool(server.address, &second, 3, "counter_increment", json!({})).await;
    assert_eq!(
        answer.json()["result"]["structuredContent"],
        json!({"value": 1})
    );

    assert_eq!(
        stats(server.address).await,
        json!({"requests": 5, "tool_calls": 3, "during_sleep": 0, "resource_lists": 0, "sessions_open": 2, "sessions_created": 2, "last_traceparent": null})
    );

    let deleted = exchange(
        server.address,
        "DELETE",
        "/mcp",
        &[("mcp-session-id", &first)],
        "",
    )
    .await;
    assert_eq!(deleted.status, StatusCode::OK);
    let again = exchange(
        server.address,
        "DELETE",
        "/mcp",
        &[("mcp-session-id", &first)],
        "",
    )
    .await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    let answer = call_tool(server.address, &first, 4, "echo", json!({"text": "x"})).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.json()["error"]["code"], -32001);
    assert_eq!(answer.json()["id"], 4);

    let counters = stats(server.address).await;
    assert_eq!(counters["sessions_open"], 1);
    assert_eq!(counters["requests"], 5, "refused requests are not executed");
}

/// `/executed` names every request that ran in each session, by id and in order,
/// including one that ran twice and those of a session since ended; a request refused
/// before it ran (an unknown session) is not there.
#[tokio::test]
async fn executed_names_the_ids_that_ran_in_each_session() {
    let server = start(false).await;
    let first = initialize(server.address).await;
    let second = initialize(server.address).await;
    for id in [7, 8, 7] {
        call_tool(server.address, &first, id, "counter_increment", json!({})).await;
    }
    call_tool(server.address, &second, 9, "counter_increment", json!({})).await;
    exchange(
        server.address,
        "DELETE",
        "/mcp",
        &[("mcp-session-id", &second)],
        "",
    )
    .await;
    let refused = call_tool(server.address, &second, 10, "counter_increment", json!({})).await;
    assert_eq!(refused.status, StatusCode::NOT_FOUND);
    let executed = exchange(server.address, "GET", "/executed", &[], "").await;
    assert_eq!(executed.status, StatusCode::OK);
    assert_eq!(
        executed.json(),
        json!({"sessions": {first: [7, 8, 7], second: [9]}, "dropped": 0})
    );
    let posted = exchange(server.address, "POST", "/executed", &[], "").await;
    assert_eq!(posted.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn bad_legacy_requests_get_a_status_and_a_jsonrpc_error() {
    let server = start(false).await;
    let session = initialize(server.address).await;
    let with_session = [("mcp-session-id", session.as_str())];
    let ping = r#"{"jsonrpc":"2.0","id":9,"method":"ping"}"#;

    let cases: [(Answer, StatusCode, i64); 6] = [
        (
            post(server.address, &[], ping).await,
            StatusCode::BAD_REQUEST,
            -32600,
        ),
        (
            post(server.address, &[("mcp-session-id", "feedface")], ping).await,
            StatusCode::NOT_FOUND,
            -32001,
        ),
        (
            post(server.address, &with_session, &format!("[{ping}]")).await,
            StatusCode::BAD_REQUEST,
            -32600,
        ),
        (
            post(server.address, &with_session, r#"{"jsonrpc":"2.0","#).await,
            StatusCode::BAD_REQUEST,
            -32700,
        ),
        (
            exchange(
                server.address,
                "POST",
                "/mcp",
                &[("content-type", "text/plain")],
                ping,
            )
            .await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            -32600,
        ),
        (
            post(
                server.address,
                &[("mcp-protocol-version", "1999-01-01")],
                ping,
            )
            .await,
            StatusCode::BAD_REQUEST,
            -32022,
        ),
    ];
    for (answer, status, code) in cases {
        assert_eq!(answer.status, status, "{:?}", answer.body);
        assert_eq!(answer.json()["jsonrpc"], "2.0");
        assert_eq!(answer.json()["error"]["code"], code, "{:?}", answer.body);
    }

    let unknown_method = post(
        server.address,
        &with_session,
        r#"{"jsonrpc":"2.0","id":10,"method":"nope"}"#,
    )
    .await;
    assert_eq!(unknown_method.json()["error"]["code"], -32601);
    let unknown_tool = call_tool(server.address, &session, 11, "nope", json!({})).await;
    assert_eq!(unknown_tool.json()["error"]["code"], -32602);

    // After all that, the server still answers.
    let pong = post(server.address, &with_session, ping).await;
    assert_eq!(pong.json(), json!({"jsonrpc":"2.0","id":9,"result":{}}));
}

#[tokio::test]
async fn modern_requests_need_no_session_and_matching_headers() {
    let server = start(false).await;
    let echo = format!(
        r#"{{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{{"name":"echo","arguments":{{"text":"hi"}},"_meta":{MODERN_META}}}}}"#
    );
    let routing = [
        ("mcp-protocol-version", "2026-07-28"),
        ("mcp-method", "tools/call"),
        ("mcp-name", "echo"),
    ];
    let answer = post(server.address, &routing, &echo).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(answer.header("mcp-session-id").is_none());
    assert_eq!(
        answer.json(),
        json!({"jsonrpc":"2.0","id":2,"result":{"content":[{"type":"text","text":"hi"}],"isError":false,"resultType":"complete"}})
    );

    let wrong_name = [
        ("mcp-protocol-version", "2026-07-28"),
        ("mcp-method", "tools/call"),
        ("mcp-name", "other"),
    ];
    let answer = post(server.address, &wrong_name, &echo).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.json()["error"]["code"], -32020);

    let no_envelope = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"hi"}}}"#;
    let answer = post(server.address, &routing, no_envelope).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.json()["error"]["code"], -32602);

    let answer = post(
        server.address,
        &routing,
        r#"{"jsonrpc":"2.0","method":"notifications/cancelled"}"#,
    )
    .await;
    assert_eq!(answer.status, StatusCode::ACCEPTED);

    for method in ["GET", "DELETE"] {
        let answer = exchange(
            server.address,
            method,
            "/mcp",
            &[("mcp-protocol-version", "2026-07-28")],
            "",
        )
        .await;
        assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED, "{method}");
        assert_eq!(answer.header("allow"), Some("POST"));
        assert_eq!(answer.json()["error"]["code"], -32600);
    }

    let answer = post(
        server.address,
        &[("mcp-protocol-version", "2027-01-01")],
        &echo,
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.json()["error"]["code"], -32022);
    assert_eq!(answer.json()["error"]["data"]["requested"], "2027-01-01");

    assert_eq!(
        stats(server.address).await,
        json!({"requests": 1, "tool_calls": 1, "during_sleep": 0, "resource_lists": 0, "sessions_open": 0, "sessions_created": 0, "last_traceparent": null})
    );
}

#[tokio::test]
async fn slow_stream_sends_each_event_as_it_happens() {
    let server = start(false).await;
    let session = initialize(server.address).await;
    // The second step is an hour away: the first can only arrive if it is flushed on its own.
    let body = json!({"jsonrpc":"2.0","id":5,"method":"tools/call","params":{
        "name":"slow_stream","arguments":{"count":2,"interval_ms":60_000},"_meta":{"progressToken":"tok"}}});
    let request = Request::post(format!("http://{}/mcp", server.address))
        .header("content-type", "application/json")
        .header("mcp-session-id", &session)
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let response = send(server.address, request).await;
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    let mut body = response.into_body();
    let mut received = Vec::new();
    while sse_data(&received).is_empty() {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .expect("first event in time");
        let frame = frame.expect("stream still open").expect("frame");
        received.extend_from_slice(frame.data_ref().expect("data frame"));
    }
    let events = sse_data(&received);
    assert_eq!(
        events[0],
        json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"tok","progress":1,"total":2,"message":"step 1"}})
    );
    drop(body);

    // A short stream runs to its result, and the client going away above did not hurt the server.
    let answer = call_tool(
        server.address,
        &session,
        6,
        "slow_stream",
        json!({"count": 3, "interval_ms": 1}),
    )
    .await;
    let events = sse_data(&answer.body);
    assert_eq!(events.len(), 4);
    let logged: Vec<&str> = events[..3]
        .iter()
        .filter_map(|event| event["params"]["data"].as_str())
        .collect();
    assert_eq!(
        logged,
        ["step 1", "step 2", "step 3"],
        "without a progress token the steps are logged"
    );
    assert_eq!(events[3]["id"], 6);
    assert_eq!(
        events[3]["result"]["structuredContent"],
        json!({"steps": 3})
    );
}

#[tokio::test]
async fn get_stream_opens_at_once_and_closes_with_its_session() {
    let server = start(false).await;
    let session = initialize(server.address).await;
    let request = Request::get(format!("http://{}/mcp", server.address))
        .header("accept", "text/event-stream")
        .header("mcp-session-id", &session)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = send(server.address, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let opening = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .expect("opening comment in time");
    let opening = opening
        .expect("stream open")
        .expect("frame")
        .into_data()
        .unwrap_or_default();
    assert_eq!(&opening[..], b": keepalive\n\n");

    let deleted = exchange(
        server.address,
        "DELETE",
        "/mcp",
        &[("mcp-session-id", &session)],
        "",
    )
    .await;
    assert_eq!(deleted.status, StatusCode::OK);
    let end = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .expect("stream ended with the session");
    assert!(end.is_ok());

    let unknown = exchange(
        server.address,
        "GET",
        "/mcp",
        &[
            ("accept", "text/event-stream"),
            ("mcp-session-id", &session),
        ],
        "",
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn sse_always_answers_every_request_as_an_event_stream() {
    let server = start(true).await;
    let answer = post(
        server.address,
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
    )
    .await;
    assert_eq!(answer.header("content-type"), Some("text/event-stream"));
    let session = answer
        .header("mcp-session-id")
        .expect("session id")
        .to_owned();
    let events = sse_data(&answer.body);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["result"]["protocolVersion"], "2025-11-25");

    let answer = call_tool(
        server.address,
        &session,
        2,
        "echo",
        json!({"text": "streamed"}),
    )
    .await;
    assert_eq!(answer.header("content-type"), Some("text/event-stream"));
    assert_eq!(
        sse_data(&answer.body)[0]["result"]["content"][0]["text"],
        "streamed"
    );
}
