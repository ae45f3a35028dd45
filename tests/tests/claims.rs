//! What the README and docs/configuration.md promise, each checked once with real
//! processes: workers (and their stdio children) do not outlive a supervisor killed
//! with `kill -9`; a 2024-11-05 client gets a session; `MCPGW_*` variables win over
//! the file; a request in flight keeps its session alive under idle expiry; the
//! file's `[mesh] max_handshakes_per_address` reaches the mesh port.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use mcpgw_testkit::fleet::{MeshCerts, supervisor_flags};
use mcpgw_testkit::http::{self, Response};
use mcpgw_testkit::signal::{Signal, send};
use mcpgw_testkit::{Gateway, RedisServer, Upstream, eventually, python, python_script};
use serde_json::{Value, json};

/// The pids of every descendant of `root`, from /proc.
fn descendants(root: u32) -> BTreeSet<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `pid (comm) state ppid ...`: comm may hold spaces, so read after its ')'.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = BTreeSet::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in &parents {
            if ppid == parent && found.insert(pid) {
                frontier.push(pid);
            }
        }
    }
    found
}

/// Whether `pid` is a process that still runs (a zombie has ended).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
        })
        .is_some_and(|state| state != "Z")
}

#[test]
fn workers_and_their_stdio_children_end_with_a_supervisor_killed_with_sigkill() {
    let redis = RedisServer::start();
    let stdio = format!(
        "st=stdio:{} {} stdio",
        python().display(),
        python_script("stateful_server.py").display()
    );
    let certs = MeshCerts::create(&["host-a"]);
    let mut args = supervisor_flags(&redis.url(), 2, "tcp", &certs, "host-a");
    args.extend(["--upstream".into(), stdio]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gateway = Gateway::start(&args);
    // A session's stdio child, under one of the workers.
    let session = http::initialize(&gateway.addr, "/mcp");
    let counted = http::call_tool(
        &gateway.addr,
        "/mcp",
        &session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(counted.expect_tool_text(), "1");
    let supervisor = gateway.pid();
    let family = descendants(supervisor);
    assert!(
        family.len() >= 3,
        "two workers and a stdio child under the supervisor: {family:?}"
    );
    // The supervisor alone, not its process group.
    send(supervisor, Signal::SIGKILL);
    let started = Instant::now();
    eventually(Duration::from_secs(60), || {
        let left: Vec<u32> = family.iter().copied().filter(|&pid| running(pid)).collect();
        match left.is_empty() {
            true => Ok(()),
            false => Err(format!("still running: {left:?}")),
        }
    });
    eprintln!(
        "every worker and stdio child ended {:?} after the supervisor",
        started.elapsed()
    );
}

#[test]
fn a_2024_11_05_client_gets_a_session() {
    let upstream = Upstream::start();
    let gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2024-11-05", "capabilities": {},
        "clientInfo": {"name": "claims", "version": "0"}}});
    // A 2024-11-05 client sends no MCP-Protocol-Version header (it came in 2025-06-18).
    let headers = [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    let opened = http::request(
        &gateway.addr,
        "POST",
        "/mcp",
        &headers,
        initialize.to_string().as_bytes(),
    );
    assert_eq!(opened.status, 200, "{}", opened.text());
    let session = opened
        .header("mcp-session-id")
        .unwrap_or_else(|| panic!("a session id: {}", opened.text()))
        .to_owned();
    let with_session: Vec<(&str, &str)> = headers
        .iter()
        .copied()
        .chain([("Mcp-Session-Id", session.as_str())])
        .collect();
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let acked = http::request(
        &gateway.addr,
        "POST",
        "/mcp",
        &with_session,
        note.to_string().as_bytes(),
    );
    assert_eq!(acked.status, 202, "{}", acked.text());
    let call = http::tool_call_body(2, "echo", json!({"text": "from 2024"}));
    let answered = http::request(&gateway.addr, "POST", "/mcp", &with_session, &call);
    assert_eq!(answered.status, 200, "{}", answered.text());
    assert_eq!(answered.expect_tool_text(), "from 2024");
}

#[test]
fn mcpgw_variables_win_over_the_file() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("mcpgw.toml");
    std::fs::write(
        &file,
        format!(
            "[[upstream]]\nname = \"demo\"\nurl = \"{}\"\n\n[limits]\nmax_sessions = 1\n",
            upstream.url
        ),
    )
    .expect("config file");
    let opens = |env: &[(&str, &str)]| -> Vec<u16> {
        let gateway = Gateway::start_with_env(&["--config", &file.display().to_string()], env);
        (1..=2)
            .map(|id| {
                let headers = http::mcp_headers(None);
                let body = http::initialize_body(id);
                http::request(&gateway.addr, "POST", "/mcp", &headers, &body).status
            })
            .collect()
    };
    // The file alone: one session per worker, the second refused.
    assert_eq!(opens(&[]), [200, 503], "the file's max_sessions = 1");
    // The variable wins over it.
    assert_eq!(
        opens(&[("MCPGW_MAX_SESSIONS", "5")]),
        [200, 200],
        "MCPGW_MAX_SESSIONS wins"
    );
}

#[test]
fn a_request_in_flight_keeps_its_session_alive_under_idle_expiry() {
    let upstream = Upstream::start();
    let gateway = Gateway::start(&[
        "--upstream",
        &format!("demo={}", upstream.url),
        "--session-idle-timeout-ms",
        "1000",
    ]);
    let busy = http::initialize(&gateway.addr, "/mcp");
    let idle = http::initialize(&gateway.addr, "/mcp");
    // One call three idle timeouts long; the other session sits idle meanwhile.
    let slow = http::call_tool(
        &gateway.addr,
        "/mcp",
        &busy,
        2,
        "sleep_ms",
        json!({"ms": 3000}),
    );
    assert_eq!(slow.status, 200, "{}", slow.text());
    let after = |session: &str| -> Response {
        http::try_call_tool(&gateway.addr, session, 3, "echo", json!({"text": "x"}))
            .expect("an answer")
    };
    let kept = after(&busy);
    assert_eq!(kept.status, 200, "the busy session lives: {}", kept.text());
    // The control: expiry does run, and ended the idle one.
    let expired = after(&idle);
    assert_eq!(
        expired.status,
        404,
        "the idle session expired: {}",
        expired.text()
    );
    let error: Value = expired.error().expect("a JSON-RPC error");
    assert_eq!(error["code"], -32001, "{error}");
}

/// `[mesh] max_handshakes_per_address` in the file reaches the worker's mesh port:
/// with 2, a third silent connection from one address is closed at once, before any
/// TLS, while the two under the cap wait for their (long) handshake deadline.
#[test]
fn the_files_handshake_cap_reaches_the_mesh_port() {
    use std::io::Read;
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let certs = MeshCerts::create(&["host-a"]);
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("mcpgw.toml");
    std::fs::write(
        &file,
        "[mesh]\nmax_handshakes_per_address = 2\nconnect_timeout_ms = 60000\n",
    )
    .expect("config file");
    let mut args = supervisor_flags(&redis.url(), 1, "tcp", &certs, "host-a");
    args.extend([
        "--config".into(),
        file.display().to_string(),
        "--upstream".into(),
        format!("demo={}", upstream.url),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _gateway = Gateway::start(&args);
    let worker = redis
        .keys("mcpgw:worker_addr:*")
        .pop()
        .expect("the worker's mesh address");
    let mesh = redis.get(&worker).expect("a mesh address");
    let silent: Vec<std::net::TcpStream> = (0..3)
        .map(|_| std::net::TcpStream::connect(&mesh).expect("connect to the mesh port"))
        .collect();
    // Closed: the server ended it (end of stream or reset) within `within`; else open.
    let closed = |stream: &std::net::TcpStream, within: Duration| -> bool {
        stream.set_read_timeout(Some(within)).expect("timeout");
        let mut byte = [0u8; 1];
        match (&*stream).read(&mut byte) {
            // The server sends nothing before the client's hello: any read is its end.
            Ok(0) | Ok(1) => true,
            Ok(_) => unreachable!("a one-byte buffer"),
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    };
    assert!(
        closed(&silent[2], Duration::from_secs(30)),
        "the connection over the cap is closed"
    );
    for (i, stream) in silent[..2].iter().enumerate() {
        assert!(
            !closed(stream, Duration::from_millis(300)),
            "connection {i}, under the cap, still waits for its handshake"
        );
    }
}
