//! Operating the fleet with real processes: each worker's admin listener (metrics,
//! readiness), trace context through a forward, and log lines that never carry a
//! token or a whole session id.

use std::collections::HashMap;
use std::io::Write;
use std::thread;
use std::time::Duration;

use mcpgw_testkit::fleet::{LocalFleet, MeshCerts, PREFIX, leases, owner_of};
use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{Gateway, RedisServer, Upstream, eventually};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(60);

/// The admin listener's address of worker `id`, from its lease in the directory.
fn admin_of(redis: &RedisServer, id: &str) -> String {
    let lease = redis
        .get(&format!("{PREFIX}worker:{id}"))
        .unwrap_or_else(|| panic!("{id} holds no lease"));
    let lease: serde_json::Value = serde_json::from_str(&lease).expect("lease JSON");
    lease["admin"]
        .as_str()
        .unwrap_or_else(|| panic!("{id}'s lease names no admin listener: {lease}"))
        .to_owned()
}

/// One scrape of a worker's `/metrics`: sample line (name and labels) → value.
fn scrape(admin: &str) -> HashMap<String, f64> {
    let r = http::request(admin, "GET", "/metrics", &[], b"");
    assert_eq!(r.status, 200, "{}", r.text());
    r.text()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (sample, value) = l.rsplit_once(' ')?;
            Some((sample.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// How much `sample` moved between two scrapes (absent counts as 0).
fn moved(before: &HashMap<String, f64>, after: &HashMap<String, f64>, sample: &str) -> f64 {
    after.get(sample).copied().unwrap_or(0.0) - before.get(sample).copied().unwrap_or(0.0)
}

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
        use std::io::{BufRead, BufReader, Read};
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
                        let mut length = 0usize;
                        let mut line = String::new();
                        loop {
                            line.clear();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            let header = line.trim_end();
                            if header.is_empty() {
                                break;
                            }
                            let Some((name, value)) = header.split_once(':') else {
                                continue;
                            };
                            if name.eq_ignore_ascii_case("content-length") {
                                length = value.trim().parse().unwrap_or(0);
                            } else if name.eq_ignore_ascii_case("authorization") {
                                seen.lock().expect("lock").push(value.trim().to_owned());
                            }
                        }
                        let mut body = vec![0u8; length];
                        if reader.read_exact(&mut body).is_err() {
                            return;
                        }
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
    // Draining: a slow call keeps the worker in its drain long enough to look.
    let slow_addr = fleet.a.addr.clone();
    let slow_session = session.clone();
    let slow = thread::spawn(move || {
        mcpgw_testkit::http::try_call_tool(
            &slow_addr,
            &slow_session,
            9,
            "sleep_ms",
            json!({"ms": 3000}),
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
    let start = |member: &str| {
        let mut args: Vec<String> = [
            "--workers",
            "1",
            "--redis",
            &redis.url(),
            "--upstream",
            &format!("demo={}", upstream.url),
            "--mesh-transport",
            "quic",
            "--mesh-listen",
            "127.0.0.1:0",
            "--auth-tokens-file",
            &tokens_path,
            "--log-requests",
            "--session-idle-timeout-ms",
            "1500",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(certs.flags(member));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Gateway::start_logged(&refs, &log)
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
    thread::sleep(Duration::from_millis(2500));
    let expired = send(
        &b.addr,
        Some(&session),
        &http::tool_call_body(5, "echo", json!({})),
    );
    assert_eq!(expired.status, 404, "{}", expired.text());
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
