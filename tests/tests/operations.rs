//! Operating the fleet with real processes: each worker's admin listener (metrics,
//! readiness), trace context through a forward, and log lines that never carry a
//! token or a whole session id.

use std::io::Write;
use std::thread;
use std::time::Duration;

use mcpgw_testkit::admin::{admin_of, moved, scrape};
use mcpgw_testkit::fleet::{
    LocalFleet, MeshCerts, leases, owner_of, recorded_owner, supervisor_flags,
};
use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{Gateway, RedisServer, Upstream, eventually};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(60);

#[test]
fn local_forwarded_failed_expired_and_refused_requests_move_exactly_their_metrics() {
    let fleet = LocalFleet::start("quic", 1, &["--session-idle-timeout-ms", "2000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let owner = owner_of(&session);
    let leases = leases(&fleet.redis);
    let edge = leases
        .keys()
        .find(|id| **id != owner)
        .expect("host-b's worker")
        .clone();
    let (owner_admin, edge_admin) = (
        admin_of(&fleet.redis, &owner),
        admin_of(&fleet.redis, &edge),
    );
    // tools/list teaches the owner the tool names that may become labels.
    let list = http::request(
        &fleet.a.addr,
        "POST",
        "/mcp",
        &mcp_headers(Some(&session)),
        &http::rpc_body(2, "tools/list", json!({})),
    );
    assert_eq!(list.status, 200);
    let (owner_before, edge_before) = (scrape(&owner_admin), scrape(&edge_admin));

    // Local on the owner, forwarded from the edge, and failed (no session header).
    let local = call_tool(
        &fleet.a.addr,
        "/mcp",
        &session,
        3,
        "echo",
        json!({"text": "a"}),
    );
    assert_eq!(local.status, 200);
    let forwarded = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        4,
        "echo",
        json!({"text": "b"}),
    );
    assert_eq!(forwarded.status, 200);
    let failed = http::request(
        &fleet.b.addr,
        "POST",
        "/mcp",
        &mcp_headers(None),
        &http::tool_call_body(5, "echo", json!({"text": "c"})),
    );
    assert_eq!(failed.status, 400);
    let (owner_after, edge_after) = (scrape(&owner_admin), scrape(&edge_admin));

    let calls = r#"mcpgw_requests_total{route="demo",method="tools/call",outcome="2xx"}"#;
    assert_eq!(
        moved(&owner_before, &owner_after, calls),
        1.0,
        "the local call, at the owner"
    );
    assert_eq!(
        moved(&edge_before, &edge_after, calls),
        1.0,
        "the forwarded call, at the edge"
    );
    let tool = r#"mcpgw_tool_calls_total{upstream="demo",tool="echo",outcome="2xx"}"#;
    assert_eq!(
        moved(&owner_before, &owner_after, tool),
        2.0,
        "both ran at the owner"
    );
    assert_eq!(
        moved(&edge_before, &edge_after, tool),
        0.0,
        "nothing ran at the edge"
    );
    let forwards = r#"mcpgw_forwards_total{transport="quic",outcome="answered"}"#;
    assert_eq!(moved(&edge_before, &edge_after, forwards), 1.0);
    assert_eq!(moved(&owner_before, &owner_after, forwards), 0.0);
    // Refused while its body was checked: counted without an MCP method.
    let refused = r#"mcpgw_requests_total{route="demo",method="none",outcome="4xx"}"#;
    assert_eq!(
        moved(&edge_before, &edge_after, refused),
        1.0,
        "the failed one"
    );
    assert_eq!(
        owner_after.get("mcpgw_sessions_owned"),
        Some(&1.0),
        "the owner holds the session"
    );
    assert!(owner_after.contains_key(r#"mcpgw_build_info{version="0.1.0"}"#));

    // A GET stream held through the edge is one long-lived exchange on each side.
    let mut stream = std::net::TcpStream::connect(&fleet.b.addr).expect("connect");
    let get = format!(
        "GET /mcp HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\
         Mcp-Session-Id: {session}\r\nMCP-Protocol-Version: 2025-11-25\r\n\r\n"
    );
    stream.write_all(get.as_bytes()).expect("send GET");
    let long = |admin: &str, side: &str| {
        scrape(admin)
            .get(&format!(
                r#"mcpgw_mesh_streams{{side="{side}",budget="long"}}"#
            ))
            .copied()
    };
    eventually(WITHIN, || {
        match (long(&edge_admin, "caller"), long(&owner_admin, "owner")) {
            (Some(1.0), Some(1.0)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    drop(stream);
    eventually(WITHIN, || match long(&edge_admin, "caller") {
        Some(0.0) => Ok(()),
        other => Err(format!("{other:?}")),
    });
    // Expired: the idle session ends on the owner, counted once.
    eventually(WITHIN, || {
        let now = scrape(&owner_admin);
        match now.get(r#"mcpgw_sessions_ended_total{reason="expired"}"#) {
            Some(n) if *n == 1.0 => Ok(now),
            other => Err(format!("{other:?}")),
        }
    });
    // No label carries a session id.
    let text = http::request(&owner_admin, "GET", "/metrics", &[], b"").text();
    assert!(!text.contains(&session), "a session id in the metrics");
}

/// A `tools/call` with `traceparent`, on a session made at host-a and sent through
/// host-b, so that it is forwarded: the session, and the edge and owner workers.
fn traced_forwarded_call(fleet: &LocalFleet, traceparent: &str) -> (String, String, String) {
    let session = initialize(&fleet.a.addr, "/mcp");
    let mut headers = mcp_headers(Some(&session));
    headers.push(("traceparent", traceparent));
    let r = http::request(
        &fleet.b.addr,
        "POST",
        "/mcp",
        &headers,
        &http::tool_call_body(2, "echo", json!({"text": "traced"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let worker = |header: &str| r.header(header).unwrap_or_default().to_owned();
    let (edge, owner) = (worker("mcpgw-edge-worker"), worker("mcpgw-owner-worker"));
    assert_ne!(edge, owner, "forwarded");
    (session, edge, owner)
}

/// The `traceparent` of the last request the fleet's upstream received.
fn upstream_traceparent(fleet: &LocalFleet) -> String {
    fleet.upstream.stats()["last_traceparent"]
        .as_str()
        .map(str::to_owned)
        .expect("the upstream saw a traceparent")
}

#[test]
fn a_traceparent_from_the_client_reaches_the_upstream_through_a_forward() {
    let fleet = LocalFleet::start("tcp", 1, &[]);
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    traced_forwarded_call(&fleet, traceparent);
    let seen = upstream_traceparent(&fleet);
    let trace_id = |tp: &str| tp.split('-').nth(1).map(str::to_owned);
    assert_eq!(
        trace_id(&seen),
        trace_id(traceparent),
        "same trace id upstream"
    );
}

/// A stand-in OTLP/HTTP collector (no collector runs here): answers every POST with
/// 200 and keeps the JSON bodies and the `authorization` headers they came with.
struct Collector {
    addr: String,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    authorizations: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Collector {
    fn start() -> Collector {
        use std::io::BufReader;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let authorizations = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (kept, seen) = (bodies.clone(), authorizations.clone());
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (kept, seen) = (kept.clone(), seen.clone());
                thread::spawn(move || {
                    let mut writer = stream.try_clone().expect("clone");
                    let mut reader = BufReader::new(stream);
                    // Keep-alive: one request after another until the client closes.
                    loop {
                        let Some(body) = read_request(&mut reader, |name, value| {
                            if name.eq_ignore_ascii_case("authorization") {
                                seen.lock().expect("lock").push(value.to_owned());
                            }
                        }) else {
                            return;
                        };
                        if let Ok(json) = serde_json::from_slice(&body) {
                            kept.lock().expect("lock").push(json);
                        }
                        let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                        if writer.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Collector {
            addr,
            bodies,
            authorizations,
        }
    }

    /// Waits until both spans of a forwarded call in `trace` (the edge's and the
    /// owner's) have arrived.
    #[track_caller]
    fn wait_for_edge_and_owner_spans(&self, trace: &str) {
        eventually(WITHIN, || {
            let spans = self.spans();
            let of_trace = spans.iter().filter(|s| s["traceId"] == trace).count();
            if of_trace >= 2 {
                Ok(())
            } else {
                Err(format!(
                    "spans of {trace} so far: {of_trace}; all: {spans:?}"
                ))
            }
        });
    }

    /// Every span received so far.
    fn spans(&self) -> Vec<serde_json::Value> {
        let bodies = self.bodies.lock().expect("lock");
        bodies
            .iter()
            .flat_map(|body| {
                body["resourceSpans"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .flat_map(|rs| rs["scopeSpans"].as_array().cloned().unwrap_or_default())
            .flat_map(|ss| ss["spans"].as_array().cloned().unwrap_or_default())
            .collect()
    }
}

#[test]
fn a_forwarded_request_makes_an_edge_and_an_owner_span_in_the_clients_trace() {
    let collector = Collector::start();
    let endpoint = format!("http://{}/v1/traces", collector.addr);
    let fleet = LocalFleet::start("tcp", 1, &["--otlp-endpoint", &endpoint]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace}-{client_span}-01");
    let (session, edge_worker, owner_worker) = traced_forwarded_call(&fleet, &traceparent);
    // Batches leave within a second.
    let (edge, owner) = eventually(WITHIN, || {
        let spans: Vec<serde_json::Value> = collector
            .spans()
            .into_iter()
            .filter(|s| s["traceId"] == trace)
            .collect();
        let edge = spans
            .iter()
            .find(|s| s["name"] == "mcpgw tools/call")
            .cloned();
        let owner = spans
            .iter()
            .find(|s| s["name"] == "mcpgw forwarded")
            .cloned();
        match (edge, owner) {
            (Some(edge), Some(owner)) => Ok((edge, owner)),
            _ => Err(format!("spans of the trace so far: {spans:?}")),
        }
    });
    assert_eq!(edge["parentSpanId"], client_span, "{edge}");
    assert_eq!(owner["parentSpanId"], edge["spanId"], "{owner}");
    let attribute = |span: &serde_json::Value, key: &str| {
        span["attributes"]
            .as_array()
            .and_then(|a| a.iter().find(|kv| kv["key"] == key))
            .map(|kv| kv["value"].clone())
            .unwrap_or_default()
    };
    assert_eq!(
        attribute(&edge, "mcpgw.worker")["stringValue"],
        edge_worker.as_str()
    );
    assert_eq!(attribute(&edge, "mcpgw.forwarded")["boolValue"], true);
    assert_eq!(
        attribute(&owner, "mcpgw.worker")["stringValue"],
        owner_worker.as_str()
    );
    assert_eq!(
        attribute(&owner, "mcpgw.edge_worker")["stringValue"],
        edge_worker.as_str()
    );
    // The upstream is the owner span's child, in the same trace.
    let seen = upstream_traceparent(&fleet);
    let owner_span = owner["spanId"].as_str().unwrap_or_default();
    assert_eq!(seen, format!("00-{trace}-{owner_span}-01"));
    // No span carries the session id.
    let everything = serde_json::to_string(&collector.spans()).unwrap_or_default();
    assert!(
        !everything.contains(&session),
        "a span carries the session id"
    );
}

/// An `https://` collector (a TLS terminator with a test CA in front of the stand-in,
/// trusted with `--otlp-ca`) that wants an API key (`--otlp-headers`), and a sample
/// ratio of zero: a client's sampled trace is
/// still recorded (its `traceparent` decides), while a request that starts a trace
/// records nothing and reaches the upstream with an unsampled `traceparent`, so nothing
/// after the gateway records it either.
#[test]
fn spans_go_to_an_https_collector_and_new_traces_follow_the_sample_ratio() {
    use mcpgw_testkit::tls::{TestCa, TlsTerminator};
    let collector = Collector::start();
    let ca = TestCa::new("collector");
    let (cert, key) = ca.issue("collector");
    let https = TlsTerminator::start(&collector.addr, &cert, &key, None);
    let endpoint = format!("https://{}/v1/traces", https.addr);
    let ca_file = ca.ca_file().display().to_string();
    let fleet = LocalFleet::start(
        "tcp",
        1,
        &[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-ca",
            &ca_file,
            "--otlp-sample-ratio",
            "0",
            "--otlp-headers",
            "authorization=Bearer collector-key",
        ],
    );
    let trace = "5bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
    traced_forwarded_call(&fleet, &traceparent);
    collector.wait_for_edge_and_owner_spans(trace);
    let keys = collector.authorizations.lock().expect("lock").clone();
    assert!(
        !keys.is_empty(),
        "every export carries the configured header"
    );
    assert!(keys.iter().all(|k| k == "Bearer collector-key"), "{keys:?}");
    // No traceparent from the client: the trace starts here, and ratio 0 records none.
    let session = initialize(&fleet.a.addr, "/mcp");
    let r = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "echo",
        json!({"text": "x"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = upstream_traceparent(&fleet);
    let started_here = seen.split('-').nth(1).unwrap_or_default().to_owned();
    assert_ne!(started_here, trace, "a trace of its own");
    assert!(seen.ends_with("-00"), "unsampled: {seen}");
    // A sampled call after it, through the same workers: once its spans arrive, any
    // span of the unrecorded trace (queued before them) would have arrived too.
    let marker = "6bf92f3577b34da6a3ce929d0e0e4736";
    traced_forwarded_call(&fleet, &format!("00-{marker}-00f067aa0ba902b7-01"));
    collector.wait_for_edge_and_owner_spans(marker);
    let recorded = collector
        .spans()
        .into_iter()
        .filter(|s| s["traceId"] == started_here.as_str())
        .count();
    assert_eq!(recorded, 0, "a trace outside the sample ratio was recorded");
}

#[test]
fn readyz_follows_redis_and_the_drain() {
    // The pause below must outlast the owner's own deadline (lease − a fifth) but not
    // the lease in Redis, or the owner would be reclaimed and fenced: a long lease
    // leaves a wide gap between the two.
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "8000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let owner = owner_of(&session);
    let admin = admin_of(&fleet.redis, &owner);
    let ready = |admin: &str| http::try_request(admin, "GET", "/readyz", &[], b"");
    assert_eq!(ready(&admin).expect("readyz").status, 200);
    // Redis unreachable past the lease: not ready, with the reason; ready again after.
    let paused = fleet.redis.pause();
    let not_ready = eventually(WITHIN, || match ready(&admin) {
        Ok(r) if r.status == 503 => Ok(r),
        Ok(r) => Err(format!("still {}", r.status)),
        Err(e) => Err(e),
    });
    assert_eq!(
        not_ready.json()["checks"]["lease_valid"],
        false,
        "{}",
        not_ready.text()
    );
    drop(paused);
    eventually(WITHIN, || match ready(&admin) {
        Ok(r) if r.status == 200 => Ok(()),
        Ok(r) => Err(format!("still {}: {}", r.status, r.text())),
        Err(e) => Err(e),
    });
    // Draining: not ready from the start of the drain, while a slow call in flight
    // still runs (within the drain's grace).
    let slow_addr = fleet.a.addr.clone();
    let slow_session = session.clone();
    let slow = thread::spawn(move || {
        mcpgw_testkit::http::try_call_tool(
            &slow_addr,
            &slow_session,
            9,
            "sleep_ms",
            json!({"ms": 5000}),
        )
    });
    eventually(WITHIN, || {
        let calls = fleet.upstream.counter("tool_calls");
        if calls >= 1 { Ok(()) } else { Err(calls) }
    });
    let pid = leases(&fleet.redis)[&owner].pid;
    signal::send(pid, Signal::SIGTERM);
    let draining = eventually(WITHIN, || match ready(&admin) {
        Ok(r) if r.status == 503 => Ok(r),
        Ok(r) => Err(format!("still {}", r.status)),
        Err(e) => Err(e),
    });
    assert!(
        !slow.is_finished(),
        "/readyz said draining only once the call in flight had finished"
    );
    assert_eq!(
        draining.json()["checks"]["serving"],
        false,
        "{}",
        draining.text()
    );
    let answer = slow.join().expect("the slow call").expect("an HTTP answer");
    assert_eq!(
        answer.status,
        200,
        "the call in flight finished: {}",
        answer.text()
    );
}

/// A supervisor of one worker for `member` of a fleet on `redis`, with `flags` on top,
/// its stderr (the workers' log lines) appended to `log`.
fn logged_supervisor(
    redis: &RedisServer,
    transport: &str,
    certs: &MeshCerts,
    member: &str,
    flags: &[&str],
    log: &std::path::Path,
) -> Gateway {
    let mut args = supervisor_flags(&redis.url(), 1, transport, certs, member);
    args.extend(flags.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Gateway::start_logged(&refs, log)
}

#[test]
fn no_log_line_carries_a_token_or_a_whole_session_id() {
    let logs = tempfile::tempdir().expect("log dir");
    let log = logs.path().join("gateway.log");
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let certs = MeshCerts::create(&["host-a", "host-b"]);
    let mut tokens = tempfile::NamedTempFile::new().expect("tokens");
    let token = "a-secret-token-never-logged-7f3c";
    writeln!(tokens, "alice:{token}").unwrap();
    let tokens_path = tokens.path().display().to_string();
    let demo = format!("demo={}", upstream.url);
    let start = |member: &str| {
        let flags = [
            "--upstream",
            &demo,
            "--auth-tokens-file",
            &tokens_path,
            "--log-requests",
            "--session-idle-timeout-ms",
            "3000",
        ];
        logged_supervisor(&redis, "quic", &certs, member, &flags, &log)
    };
    let (a, b) = (start("host-a"), start("host-b"));
    let bearer = format!("Bearer {token}");
    let with_token = |session: Option<&str>| {
        let mut headers = mcp_headers(session);
        headers.push(("authorization", bearer.as_str()));
        headers
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect::<Vec<_>>()
    };
    let send = |addr: &str, session: Option<&str>, body: &[u8]| {
        let headers = with_token(session);
        let refs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        http::request(addr, "POST", "/mcp", &refs, body)
    };
    let opened = send(&a.addr, None, &http::initialize_body(1));
    let session = opened
        .header("mcp-session-id")
        .expect("a session")
        .to_owned();
    // Successes (logged with --log-requests), forwarded ones, and failures of every
    // kind: a wrong token, a forged session, a bad body, a session that expired.
    for addr in [&a.addr, &b.addr] {
        let r = send(
            addr,
            Some(&session),
            &http::tool_call_body(2, "echo", json!({"text": "x"})),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let wrong = http::request(
        &b.addr,
        "POST",
        "/mcp",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer not-the-token-but-secret-too"),
        ],
        &http::initialize_body(3),
    );
    assert_eq!(wrong.status, 401);
    let forged = format!("{:032x}.{}", 7, owner_of(&session));
    assert_eq!(
        send(
            &b.addr,
            Some(&forged),
            &http::tool_call_body(4, "echo", json!({}))
        )
        .status,
        404
    );
    assert_eq!(send(&a.addr, Some(&session), b"{not json").status, 400);
    // Expired: its owner counted it and the directory no longer records it.
    let owner_admin = admin_of(&redis, &owner_of(&session));
    eventually(WITHIN, || {
        let ended = scrape(&owner_admin)
            .get(r#"mcpgw_sessions_ended_total{reason="expired"}"#)
            .copied();
        match (ended, recorded_owner(&redis, &session)) {
            (Some(1.0), None) => Ok(()),
            other => Err(format!("expired count, directory record: {other:?}")),
        }
    });
    let expired = send(
        &b.addr,
        Some(&session),
        &http::tool_call_body(5, "echo", json!({})),
    );
    assert_eq!(
        expired.outcome(),
        "404 session_not_found",
        "{}",
        expired.text()
    );
    drop((a, b));
    let text = std::fs::read_to_string(&log).expect("the log");
    assert!(text.lines().count() > 5, "the gateways logged: {text}");
    for (what, secret) in [
        ("the token", token),
        ("the wrong token", "not-the-token-but-secret-too"),
        ("the session id", session.as_str()),
        ("the forged session id", forged.as_str()),
    ] {
        let found: Vec<&str> = text.lines().filter(|l| l.contains(secret)).collect();
        assert!(found.is_empty(), "{what} appears in the logs: {found:?}");
    }
}

/// `GET /readyz` of an admin listener.
#[track_caller]
fn readyz(admin: &str) -> http::Response {
    http::request(admin, "GET", "/readyz", &[], b"")
}

/// README: "`/readyz` fails with `mesh_cert_valid: false` once the leaf in use has
/// expired". host-a's worker reloads a leaf that expires seconds later; host-b's keeps
/// its own.
#[test]
fn readyz_fails_with_mesh_cert_valid_false_once_the_leaf_in_use_expires() {
    let fleet = LocalFleet::start("tcp", 1, &[]);
    let admin_of_only = |supervisor: &Gateway| {
        let workers = fleet.workers_of(supervisor);
        assert_eq!(workers.len(), 1, "{workers:?}");
        let id = workers.into_keys().next().expect("a worker");
        admin_of(&fleet.redis, &id)
    };
    let (a_admin, b_admin) = (admin_of_only(&fleet.a), admin_of_only(&fleet.b));
    let dir = fleet.certs.dir();
    let ca =
        mcpgw_certs::load_pem_files(&dir.join("ca.crt"), &dir.join("ca.key")).expect("the mesh CA");
    // Long enough for the worker to take it: its file watcher sees a new leaf at once.
    let validity = Duration::from_secs(10);
    let issued = std::time::SystemTime::now();
    let leaf = mcpgw_certs::issue_leaf(&ca, "host-a", validity).expect("a short-lived leaf");
    mcpgw_certs::write_pem_files(&dir, "host-a", &leaf).expect("write the leaf");
    // Valid at least until here (X.509 times are whole seconds).
    let valid_until = issued + validity - Duration::from_secs(1);
    eventually(WITHIN, || {
        let cert = http::request(&a_admin, "GET", "/state", &[], b"").json()["mesh_cert"].clone();
        assert_eq!(
            cert["refused"], 0,
            "the worker refused the new leaf (expired before it was read?): {cert}"
        );
        if cert["reloads"] == 1 {
            Ok(())
        } else {
            Err(cert)
        }
    });
    let before = readyz(&a_admin);
    if std::time::SystemTime::now() < valid_until {
        assert_eq!(
            before.status,
            200,
            "the new leaf is valid: {}",
            before.text()
        );
    } else {
        eprintln!("the leaf expired before /readyz was asked while it was valid");
    }
    let expired = eventually(WITHIN, || match readyz(&a_admin) {
        r if r.status == 503 => Ok(r),
        r => Err(format!("{} {}", r.status, r.text())),
    });
    let seen = std::time::SystemTime::now();
    eprintln!(
        "not ready {:?} after a leaf valid for {validity:?} was issued",
        seen.duration_since(issued).unwrap_or_default()
    );
    assert!(
        seen >= valid_until,
        "not ready before the leaf expired: {}",
        expired.text()
    );
    let doc = expired.json();
    assert_eq!(
        doc["checks"],
        json!({"serving": true, "lease_valid": true, "mesh_cert_valid": false}),
        "{doc}"
    );
    assert!(
        doc["reasons"]
            .to_string()
            .contains("mesh certificate expired"),
        "{doc}"
    );
    let other = readyz(&b_admin);
    assert_eq!(
        other.status,
        200,
        "host-b's leaf is its own: {}",
        other.text()
    );
}

/// README ("Logs"): with `--log-format json` each line is one JSON object; a failed
/// request gets exactly one, from the worker that received it, with route, MCP method,
/// status, reason, duration and an 8-hex hash of the session id (never the id); a
/// request that succeeds gets none without `--log-requests`.
#[test]
fn a_failed_request_gets_one_json_log_line_with_a_hash_of_its_session_never_the_id() {
    let logs = tempfile::tempdir().expect("log dir");
    let log = logs.path().join("gateway.log");
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let certs = MeshCerts::create(&["host-a", "host-b"]);
    let demo = format!("demo={}", upstream.url);
    let start = |member: &str| {
        let flags = ["--upstream", &demo, "--log-format", "json"];
        logged_supervisor(&redis, "tcp", &certs, member, &flags, &log)
    };
    let (a, b) = (start("host-a"), start("host-b"));
    // Succeeded, here and forwarded: no line.
    let live = initialize(&a.addr, "/mcp");
    for addr in [&a.addr, &b.addr] {
        let r = call_tool(addr, "/mcp", &live, 2, "echo", json!({"text": "ok"}));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Failed at the session's owner, and at another worker: a session that ended.
    let ended = initialize(&a.addr, "/mcp");
    let deleted = http::delete_session(&a.addr, "/mcp", &ended);
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    let at_owner = call_tool(&a.addr, "/mcp", &ended, 3, "echo", json!({"text": "x"}));
    let elsewhere = call_tool(&b.addr, "/mcp", &ended, 4, "echo", json!({"text": "x"}));
    for r in [&at_owner, &elsewhere] {
        assert_eq!(r.outcome(), "404 session_not_found", "{}", r.text());
    }
    // Refused by the owner, forwarded: a Last-Event-ID the gateway never issued.
    let resumed = initialize(&a.addr, "/mcp");
    let mut headers = mcp_headers(Some(&resumed));
    headers.push(("Last-Event-ID", "not-an-event-id"));
    let bad_resume = http::request(&b.addr, "GET", "/mcp", &headers, b"");
    assert_eq!(bad_resume.status, 400, "{}", bad_resume.text());
    // Refused before any session: no Mcp-Session-Id.
    let no_session = http::request(
        &b.addr,
        "POST",
        "/mcp",
        &mcp_headers(None),
        &http::tool_call_body(5, "echo", json!({})),
    );
    assert_eq!(no_session.status, 400, "{}", no_session.text());
    drop((a, b));

    let text = std::fs::read_to_string(&log).expect("the log");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .filter(serde_json::Value::is_object)
                .unwrap_or_else(|| panic!("not one JSON object: {line:?}"))
        })
        .collect();
    for (what, id) in [("live", &live), ("ended", &ended), ("resumed", &resumed)] {
        assert!(
            !text.contains(id.as_str()),
            "the {what} session's id is logged"
        );
    }
    let requests: Vec<&serde_json::Value> = lines
        .iter()
        .map(|line| &line["fields"])
        .filter(|fields| fields.get("status").is_some())
        .collect();
    assert_eq!(
        requests.len(),
        4,
        "one line per failed request: {requests:#?}"
    );
    let line = |r: &http::Response, method: &str| {
        let edge = r.header("mcpgw-edge-worker").unwrap_or_default();
        let found: Vec<&serde_json::Value> = requests
            .iter()
            .copied()
            .filter(|f| f["worker"] == edge && f["status"] == r.status && f["http"] == method)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "{method} {} at {edge}: {requests:#?}",
            r.status
        );
        found[0]
    };
    let (owner_line, elsewhere_line) = (line(&at_owner, "POST"), line(&elsewhere, "POST"));
    let (resume_line, none_line) = (line(&bad_resume, "GET"), line(&no_session, "POST"));
    // The session's hash: 8 hex digits, one per session whichever worker logs it.
    let hash = |f: &serde_json::Value| f["session"].as_str().unwrap_or_default().to_owned();
    let is_hash =
        |h: &str| h.len() == 8 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    assert!(is_hash(&hash(owner_line)), "{owner_line}");
    assert_eq!(
        hash(owner_line),
        hash(elsewhere_line),
        "one session, one hash"
    );
    assert!(is_hash(&hash(resume_line)), "{resume_line}");
    assert_ne!(
        hash(resume_line),
        hash(owner_line),
        "another session, another hash"
    );
    assert_eq!(hash(none_line), "", "{none_line}");
    for f in [owner_line, elsewhere_line] {
        assert_eq!(f["route"], "demo", "{f}");
        assert_eq!(f["method"], "tools/call", "{f}");
        assert_eq!(f["reason"], "session_not_found", "{f}");
        assert_eq!(f["forwarded"], false, "{f}");
        assert!(f["duration_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{f}");
    }
    eprintln!("the forwarded refusal's line: {resume_line}");
}

/// A collector that takes export requests and never answers them (hung, or behind a
/// firewall that drops its answers); it counts the requests it received.
struct HungCollector {
    addr: String,
    received: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// Reads one HTTP/1.1 request from `reader`: each header's name and trimmed value
/// to `header`, then its `Content-Length` body. `None` once the client has closed.
fn read_request(
    reader: &mut impl std::io::BufRead,
    mut header: impl FnMut(&str, &str),
) -> Option<Vec<u8>> {
    let mut length = 0usize;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        let head = line.trim_end();
        if head.is_empty() {
            break;
        }
        let Some((name, value)) = head.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("content-length") {
            length = value.trim().parse().unwrap_or(0);
        }
        header(name, value.trim());
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(body)
}

impl HungCollector {
    fn start() -> HungCollector {
        use std::io::BufReader;
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = received.clone();
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let counter = counter.clone();
                thread::spawn(move || {
                    let mut reader = BufReader::new(stream);
                    while read_request(&mut reader, |_, _| {}).is_some() {
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
        HungCollector { addr, received }
    }

    fn received(&self) -> usize {
        self.received.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// README: "when the collector is slow or down, spans are dropped (logged at most once
/// a minute), never waited for". The exporter sends one batch at a time and gives up
/// on each after its deadline.
#[test]
fn spans_for_a_hung_collector_are_dropped_not_waited_for_and_logged_once_a_minute() {
    let collector = HungCollector::start();
    let logs = tempfile::tempdir().expect("log dir");
    let log = logs.path().join("gateway.log");
    let upstream = Upstream::start();
    let endpoint = format!("http://{}/v1/traces", collector.addr);
    let gateway = Gateway::start_logged(
        &[
            "--upstream",
            &format!("demo={}", upstream.url),
            "--otlp-endpoint",
            &endpoint,
        ],
        &log,
    );
    let session = initialize(&gateway.addr, "/mcp");
    let mut id = 1;
    let mut call = || {
        id += 1;
        let r = call_tool(
            &gateway.addr,
            "/mcp",
            &session,
            id,
            "echo",
            json!({"text": "x"}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    };
    // The first batch leaves within a second, and hangs at the collector.
    eventually(WITHIN, || {
        call();
        match collector.received() {
            0 => Err(0),
            n => Ok(n),
        }
    });
    let first_export = std::time::Instant::now();
    // Answered while no export leaves: their spans only joined the queue. A request
    // that waited for its span to be sent could not be answered before the next export.
    eventually(WITHIN, || {
        let before = collector.received();
        for _ in 0..5 {
            call();
        }
        match collector.received() {
            now if now == before => Ok(()),
            now => Err(format!(
                "an export left during the round ({before} -> {now})"
            )),
        }
    });
    // The third export leaves only once the second has failed.
    eventually(WITHIN, || {
        call();
        match collector.received() {
            n if n >= 3 => Ok(()),
            n => Err(n),
        }
    });
    let window = first_export.elapsed();
    let text = std::fs::read_to_string(&log).expect("the log");
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("OTLP span export is failing"))
        .collect();
    eprintln!(
        "{} failure lines for 2 failed exports over {window:?}: {lines:?}",
        lines.len()
    );
    let allowed = 1 + usize::try_from(window.as_secs() / 60).unwrap_or(usize::MAX);
    assert!(
        !lines.is_empty() && lines.len() <= allowed,
        "at most one line a minute, and at least one: {lines:?}"
    );
    assert!(lines[0].contains("no answer within"), "{}", lines[0]);
}

/// README ("Drain"): exchanges in flight when a drain starts finish within its grace
/// (10 s, `DRAIN_GRACE` in `serve.rs`); one still running after it is cut without an
/// answer, and the worker exits 0. `/readyz` says "draining" from the start.
#[test]
fn a_drain_lets_exchanges_finish_within_its_grace_and_cuts_the_rest() {
    const GRACE: Duration = Duration::from_secs(10);
    let upstream = Upstream::start();
    let mut gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let admin = gateway.admin.clone().expect("a standalone gateway's admin");
    let session = initialize(&gateway.addr, "/mcp");
    let call = |id: u64, ms: u64| {
        let (addr, session) = (gateway.addr.clone(), session.clone());
        thread::spawn(move || {
            http::try_call_tool(&addr, &session, id, "sleep_ms", json!({ "ms": ms }))
        })
    };
    let finishing = call(2, 5_000);
    let outliving = call(3, 600_000);
    eventually(WITHIN, || match upstream.counter("tool_calls") {
        n if n >= 2 => Ok(()),
        n => Err(n),
    });
    let drain_began = std::time::Instant::now();
    let accepted = http::request(&admin, "POST", "/drain", &[], b"");
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    let draining = eventually(WITHIN, || {
        match http::try_request(&admin, "GET", "/readyz", &[], b"") {
            Ok(r) if r.status == 503 => Ok(r),
            Ok(r) => Err(format!("still {}", r.status)),
            Err(e) => Err(e),
        }
    });
    assert!(
        !finishing.is_finished(),
        "/readyz said draining only once the exchange in flight had ended"
    );
    assert_eq!(
        draining.json()["checks"]["serving"],
        false,
        "{}",
        draining.text()
    );
    let finished = finishing
        .join()
        .expect("the finishing call")
        .expect("an answer");
    assert_eq!(finished.expect_tool_text(), "slept 5000 ms");
    let cut = outliving.join().expect("the outliving call");
    let cut_after = drain_began.elapsed();
    eprintln!(
        "the exchange outliving the grace ended {cut_after:?} after the drain began: {cut:?}"
    );
    match &cut {
        Err(e) if e.starts_with("no HTTP answer") || e.contains("reset") => {}
        other => panic!("the exchange outliving the grace was not cut: {other:?}"),
    }
    assert!(
        cut_after >= GRACE,
        "cut before the grace was over: {cut_after:?}"
    );
    assert_eq!(
        gateway.child.wait_exit(WITHIN),
        Some(0),
        "a drained worker exits 0"
    );
}

/// README: "A standalone `mcpgw serve` without `--redis` has no supervisor: `POST
/// /drain` stops it", ending its sessions upstream.
#[test]
fn post_drain_stops_a_standalone_worker_which_ends_its_sessions_and_exits_0() {
    let upstream = Upstream::start();
    let mut gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let admin = gateway.admin.clone().expect("a standalone gateway's admin");
    let session = initialize(&gateway.addr, "/mcp");
    let served = call_tool(
        &gateway.addr,
        "/mcp",
        &session,
        2,
        "echo",
        json!({"text": "x"}),
    );
    assert_eq!(served.status, 200, "{}", served.text());
    assert_eq!(upstream.counter("sessions_open"), 1);
    let accepted = http::request(&admin, "POST", "/drain", &[], b"");
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    let doc = accepted.json();
    assert_eq!(doc["draining"], true, "{doc}");
    assert_eq!(
        doc["worker_id"].as_str(),
        served.header("mcpgw-edge-worker"),
        "{doc}"
    );
    assert_eq!(
        gateway.child.wait_exit(WITHIN),
        Some(0),
        "a drained worker exits 0"
    );
    mcpgw_testkit::wait_until_refused(&gateway.addr, WITHIN);
    assert_eq!(
        upstream.counter("sessions_open"),
        0,
        "the drain ended the session upstream"
    );
}

/// Reads an HTTP/1.1 answer with a `Content-Length` body, up to the end of the
/// connection.
fn read_answer(stream: &mut impl std::io::Read) -> http::Response {
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).expect("read the answer");
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    http::Response {
        status,
        headers,
        body: body.as_bytes().to_vec(),
    }
}

/// An initialize whose body arrives once the worker is draining is refused: 503
/// `draining`, retry (another worker takes it). Its head was read before the drain
/// began (the `100 Continue` says so): a draining worker takes no new connections.
#[test]
fn an_initialize_completed_while_the_worker_drains_gets_503_draining() {
    use std::io::{BufRead, BufReader, Write as _};
    let upstream = Upstream::start();
    let mut gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let admin = gateway.admin.clone().expect("a standalone gateway's admin");
    let body = http::initialize_body(1);
    let mut stream = std::net::TcpStream::connect(&gateway.addr).expect("connect");
    stream.set_read_timeout(Some(WITHIN)).expect("read timeout");
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nExpect: 100-continue\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send the head");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut interim = String::new();
    reader
        .read_line(&mut interim)
        .expect("read the interim answer");
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim:?}");
    let mut blank = String::new();
    reader
        .read_line(&mut blank)
        .expect("read the interim answer");
    assert_eq!(blank, "\r\n", "the interim answer has no headers");
    gateway.child.signal(Signal::SIGTERM);
    eventually(WITHIN, || match readyz(&admin) {
        r if r.status == 503 => Ok(()),
        r => Err(format!("still {}", r.status)),
    });
    stream.write_all(&body).expect("send the body");
    let answer = read_answer(&mut reader);
    assert_eq!(answer.outcome(), "503 draining", "{}", answer.text());
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert_eq!(answer.json()["id"], 1, "{}", answer.text());
    assert_eq!(
        upstream.counter("sessions_created"),
        0,
        "no session was opened"
    );
    assert_eq!(
        gateway.child.wait_exit(WITHIN),
        Some(0),
        "a drained worker exits 0"
    );
}

/// Sends a whole `tools/call echo` on a fresh connection, without waiting for the
/// answer (so that the connection can sit in the listener's queue meanwhile).
fn send_echo(addr: &str, session: &str, id: u64) -> std::net::TcpStream {
    let body = http::rpc_body(
        id,
        "tools/call",
        json!({"name": "echo", "arguments": {"text": format!("queued {id}")}}),
    );
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WITHIN)).expect("read timeout");
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nMcp-Session-Id: {session}\r\n\
         MCP-Protocol-Version: 2025-11-25\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send the head");
    stream.write_all(&body).expect("send the body");
    stream
}

/// Connections completed by the kernel but not yet accepted when a drain closes the
/// port are served, not reset: a load balancer may already have sent its request on
/// one, and must not replay a POST that was sent. The worker is stopped (SIGSTOP)
/// while the connections arrive, so they wait in its listener's queue; SIGTERM is
/// then taken at the same moment as they become acceptable.
#[test]
fn connections_queued_when_a_drain_closes_the_port_are_served_not_reset() {
    const QUEUED: u64 = 48;
    let upstream = Upstream::start();
    let mut gateway = Gateway::start(&["--upstream", &format!("demo={}", upstream.url)]);
    let session = initialize(&gateway.addr, "/mcp");
    let paused = signal::Paused::stop(gateway.pid());
    let streams: Vec<_> = (0..QUEUED)
        .map(|i| send_echo(&gateway.addr, &session, 10 + i))
        .collect();
    gateway.child.signal(Signal::SIGTERM);
    paused.resume();
    let mut answered = 0;
    let mut lost = Vec::new();
    for (i, mut stream) in streams.into_iter().enumerate() {
        let mut bytes = Vec::new();
        match std::io::Read::read_to_end(&mut stream, &mut bytes) {
            Ok(_) if bytes.starts_with(b"HTTP/1.1 200") => answered += 1,
            Ok(_) => lost.push(format!(
                "{i}: {:?}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(80)])
            )),
            Err(e) => lost.push(format!("{i}: {e}")),
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {QUEUED} queued connections were not served: {lost:?}",
        lost.len()
    );
    assert_eq!(answered, QUEUED);
    assert_eq!(
        gateway.child.wait_exit(WITHIN),
        Some(0),
        "a drained worker exits 0"
    );
}

/// `--drain-delay-ms`: after SIGTERM the worker is a lame duck for the delay. /readyz
/// says 503 at once, the public port still takes new connections and serves existing
/// sessions, every answer says `Connection: close`, a new session is refused with
/// 503 `draining`; then the port closes and the worker exits 0.
#[test]
fn a_lame_duck_serves_new_connections_with_connection_close_until_its_drain_delay_ends() {
    let upstream = Upstream::start();
    let mut gateway = Gateway::start(&[
        "--upstream",
        &format!("demo={}", upstream.url),
        "--drain-delay-ms",
        "8000",
    ]);
    let admin = gateway.admin.clone().expect("a standalone gateway's admin");
    let session = initialize(&gateway.addr, "/mcp");
    let before = call_tool(
        &gateway.addr,
        "/mcp",
        &session,
        2,
        "echo",
        json!({"text": "before"}),
    );
    assert_eq!(before.status, 200, "{}", before.text());
    gateway.child.signal(Signal::SIGTERM);
    eventually(WITHIN, || match readyz(&admin) {
        r if r.status == 503 => Ok(()),
        r => Err(format!("still {}", r.status)),
    });
    // A connection opened after the drain decision: accepted and served.
    let mut stream = send_echo(&gateway.addr, &session, 3);
    let answer = read_answer(&mut stream);
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        answer.header("connection"),
        Some("close"),
        "{:?}",
        answer.headers
    );
    let refused = http::request(
        &gateway.addr,
        "POST",
        "/mcp",
        &mcp_headers(None),
        &http::initialize_body(4),
    );
    assert_eq!(refused.outcome(), "503 draining", "{}", refused.text());
    assert_eq!(refused.header("connection"), Some("close"));
    assert_eq!(
        gateway.child.wait_exit(WITHIN),
        Some(0),
        "a drained worker exits 0"
    );
    mcpgw_testkit::wait_until_refused(&gateway.addr, WITHIN);
}
