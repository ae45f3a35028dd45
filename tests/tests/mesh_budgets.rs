//! Held streams at fleet scale, through real workers: thousands of sessions' `GET`
//! streams forwarded from one worker to their owner leave room for requests, closing
//! them frees their budget, and a full budget is an immediate 503 with `Retry-After`,
//! never a hang. On QUIC and on TCP.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use mcpgw_testkit::fleet::LocalFleet;
use mcpgw_testkit::http::{self, call_tool, initialize};
use serde_json::json;

/// A session's `GET` stream, held open while this value lives.
struct HeldStream {
    _socket: TcpStream,
}

/// What a `GET` through `addr` for `session` was answered.
enum Opened {
    /// 200 with an SSE head: the stream is open.
    Stream(HeldStream),
    /// Any other answer, read whole.
    Refused(http::Response),
}

/// Opens `session`'s event stream through `addr` and reads the response head.
fn open_stream(addr: &str, session: &str) -> Opened {
    let mut socket = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    // Generous: a hang would show as this read timing out, never as a slow pass.
    socket
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    let request = format!(
        "GET /mcp HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\
         MCP-Protocol-Version: 2025-11-25\r\nMcp-Session-Id: {session}\r\n\r\n"
    );
    socket.write_all(request.as_bytes()).expect("send GET");
    let mut reader = BufReader::new(socket.try_clone().expect("clone socket"));
    let mut status_line = String::new();
    reader.read_line(&mut status_line).expect("status line");
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer to GET: {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let event_stream = headers
        .iter()
        .any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream"));
    if status == 200 && event_stream {
        return Opened::Stream(HeldStream { _socket: socket });
    }
    let length: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    std::io::Read::read_exact(&mut reader, &mut body).expect("error body");
    Opened::Refused(http::Response {
        status,
        headers,
        body,
    })
}

fn expect_stream(addr: &str, session: &str) -> HeldStream {
    match open_stream(addr, session) {
        Opened::Stream(stream) => stream,
        Opened::Refused(response) => panic!(
            "GET stream refused with {}: {}",
            response.status,
            String::from_utf8_lossy(&response.body)
        ),
    }
}

/// Opens one stream per session through `addr`, eight at a time.
fn open_streams(addr: &str, sessions: &[String]) -> Vec<HeldStream> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = sessions
            .chunks(sessions.len().div_ceil(8).max(1))
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|s| expect_stream(addr, s))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("opener thread"))
            .collect()
    })
}

/// Opens `n` sessions at `addr`, eight at a time.
fn sessions_at(addr: &str, n: usize) -> Vec<String> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|t| {
                scope.spawn(move || {
                    (0..n)
                        .filter(|i| i % 8 == t)
                        .map(|_| initialize(addr, "/mcp"))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("initialize thread"))
            .collect()
    })
}

/// A `tools/call` through `addr` for a session owned elsewhere, answered by the owner.
fn call_succeeds(addr: &str, session: &str, transport: &str) {
    let response = call_tool(
        addr,
        "/mcp",
        session,
        7,
        "echo",
        json!({"text": "still here"}),
    );
    assert_eq!(
        response.status,
        200,
        "{transport}: tools/call beside the held streams: {}",
        String::from_utf8_lossy(&response.body)
    );
    assert_eq!(response.tool_text().as_deref(), Some("still here"));
    let edge = response.header("mcpgw-edge-worker").unwrap_or_default();
    let owner = response.header("mcpgw-owner-worker").unwrap_or_default();
    assert!(
        !owner.is_empty() && owner != edge,
        "{transport}: it crossed the mesh"
    );
}

/// The 503 a full budget must give: at once, retryable, saying why.
fn assert_budget_refusal(response: &http::Response, transport: &str) {
    assert_eq!(
        response.status,
        503,
        "{transport}: {}",
        String::from_utf8_lossy(&response.body)
    );
    assert!(
        response.header("retry-after").is_some(),
        "{transport}: 503 carries Retry-After"
    );
    let body = response.json();
    assert_eq!(
        body["error"]["data"]["reason"], "mesh_budget_exhausted",
        "{body}"
    );
    assert_eq!(body["error"]["data"]["retryable"], true, "{body}");
}

/// Retries opening a stream until the budget freed by closed streams takes it.
fn reopens_once_freed(addr: &str, session: &str, transport: &str) -> HeldStream {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match open_stream(addr, session) {
            Opened::Stream(stream) => return stream,
            Opened::Refused(response) => {
                assert_budget_refusal(&response, transport);
                assert!(
                    Instant::now() < deadline,
                    "{transport}: closed streams never gave their budget back"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A fleet of two single-worker supervisors (A and B) whose mesh budgets come from a
/// config file; a forward timeout longer than any read here, so a request that waited
/// for a budget would show as a timeout, not as an answer.
fn fleet_with_budgets(transport: &str, toml: &str) -> (LocalFleet, tempfile_path::Path) {
    let config = tempfile_path::Path::new(toml);
    let fleet = LocalFleet::start(
        transport,
        1,
        &[
            "--config",
            config.as_str(),
            "--forward-timeout-ms",
            "120000",
        ],
    );
    (fleet, config)
}

/// Stops both supervisors with SIGTERM while Redis and the upstream still run, so
/// their workers end thousands of sessions quickly instead of waiting out a
/// directory timeout per session after Redis is gone.
fn stop_in_order(fleet: LocalFleet) {
    let LocalFleet {
        redis,
        upstream,
        certs,
        mut a,
        mut b,
    } = fleet;
    a.child.signal(mcpgw_testkit::signal::Signal::SIGTERM);
    b.child.signal(mcpgw_testkit::signal::Signal::SIGTERM);
    for gateway in [&mut a, &mut b] {
        assert!(
            gateway.child.wait_exit(Duration::from_secs(120)).is_some(),
            "a supervisor did not stop after SIGTERM"
        );
    }
    drop((a, b, upstream, redis, certs));
}

/// A config file removed when dropped.
mod tempfile_path {
    pub struct Path(std::path::PathBuf, String);

    impl Path {
        pub fn new(contents: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "mcpgw-budgets-{}-{}.toml",
                std::process::id(),
                mcpgw_testkit::free_port()
            ));
            std::fs::write(&path, contents).expect("write config");
            let text = path.display().to_string();
            Self(path, text)
        }

        pub fn as_str(&self) -> &str {
            &self.1
        }
    }

    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Two thousand sessions owned by A, each holding its `GET` stream through B, with a
/// budget of exactly that many: one more is refused at once, a `tools/call` through B
/// for an A-session is still answered, and closing the streams frees their budget.
fn two_thousand_held_streams(transport: &str) {
    const STREAMS: usize = 2_000;
    let (fleet, _config) = fleet_with_budgets(
        transport,
        &format!("[mesh]\nmax_streams_per_peer = {STREAMS}\n"),
    );
    let sessions = sessions_at(&fleet.a.addr, STREAMS + 1);
    let (extra, sessions) = sessions.split_last().expect("sessions");
    let started = Instant::now();
    let held = open_streams(&fleet.b.addr, sessions);
    eprintln!(
        "{transport}: {STREAMS} GET streams through B held in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    match open_stream(&fleet.b.addr, extra) {
        Opened::Refused(response) => assert_budget_refusal(&response, transport),
        Opened::Stream(_) => panic!(
            "{transport}: stream {} fit a budget of {STREAMS}",
            STREAMS + 1
        ),
    }
    call_succeeds(&fleet.b.addr, &sessions[0], transport);
    drop(held);
    let first = reopens_once_freed(&fleet.b.addr, &sessions[0], transport);
    let rest = open_streams(&fleet.b.addr, &sessions[1..]);
    assert_eq!(
        rest.len() + 1,
        STREAMS,
        "{transport}: the whole budget came back"
    );
    call_succeeds(&fleet.b.addr, extra, transport);
    drop((first, rest));
    stop_in_order(fleet);
}

/// A small long-lived budget: the streams beyond it get 503 + Retry-After at once,
/// short requests go on, and a closed stream's slot is taken again.
fn a_small_budget_refuses_at_once(transport: &str) {
    let (fleet, _config) = fleet_with_budgets(transport, "[mesh]\nmax_streams_per_peer = 5\n");
    let sessions = sessions_at(&fleet.a.addr, 7);
    let mut held = open_streams(&fleet.b.addr, &sessions[..5]);
    for session in &sessions[5..] {
        match open_stream(&fleet.b.addr, session) {
            Opened::Refused(response) => assert_budget_refusal(&response, transport),
            Opened::Stream(_) => panic!("{transport}: a sixth stream fit a budget of five"),
        }
    }
    call_succeeds(&fleet.b.addr, &sessions[6], transport);
    drop(held.pop());
    held.push(reopens_once_freed(&fleet.b.addr, &sessions[5], transport));
    assert_eq!(held.len(), 5);
    drop(held);
    stop_in_order(fleet);
}

#[test]
fn two_thousand_held_streams_over_quic() {
    two_thousand_held_streams("quic");
}

#[test]
fn two_thousand_held_streams_over_tcp() {
    two_thousand_held_streams("tcp");
}

#[test]
fn a_small_budget_refuses_at_once_over_quic() {
    a_small_budget_refuses_at_once("quic");
}

#[test]
fn a_small_budget_refuses_at_once_over_tcp() {
    a_small_budget_refuses_at_once("tcp");
}
