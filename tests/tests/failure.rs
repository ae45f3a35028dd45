//! Truthful failure (DESIGN.md's decision table) with real processes: owners killed,
//! paused past and within their lease, Redis paused and restarted empty, workers
//! drained. A session-bearing request is answered by its owner or with an error that
//! tells the truth; never by a fresh session.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use mcpgw_tests::ScatterProxy;
use mcpgw_tests::fleet::{LocalFleet, signal};
use mcpgw_tests::http::{self, call_tool, initialize};
use serde_json::json;

/// The worker a session id names as its owner.
fn owner(session: &str) -> String {
    session
        .split_once('.')
        .map(|(_, o)| o.to_owned())
        .unwrap_or_default()
}

#[derive(Debug, Clone)]
struct Outcome {
    session: String,
    started: Instant,
    finished: Instant,
    status: u16,
    /// The counter value for a 200, else the error reason.
    detail: String,
}

/// Closed-loop load: one thread per session, `counter_increment` through `addr`
/// (a scattering proxy), until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Load {
    fn start(addr: &str, sessions: &[String]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let threads = sessions
            .iter()
            .cloned()
            .map(|session| {
                let (stop, outcomes, addr) = (stop.clone(), outcomes.clone(), addr.to_owned());
                thread::spawn(move || {
                    let mut id = 1000;
                    while !stop.load(Ordering::Relaxed) {
                        id += 1;
                        let started = Instant::now();
                        let body = json!({
                            "jsonrpc": "2.0", "id": id, "method": "tools/call",
                            "params": {"name": "counter_increment", "arguments": {}},
                        })
                        .to_string();
                        let answer = http::try_request(
                            &addr,
                            "POST",
                            "/mcp",
                            &http::mcp_headers(Some(&session)),
                            body.as_bytes(),
                        );
                        // No HTTP answer at all (status 0): the connection was reset
                        // before any gateway code read it, e.g. queued at a killed
                        // process's listener.
                        let (status, detail) = match answer {
                            Ok(r) if r.status == 200 => (200, r.tool_text().unwrap_or_default()),
                            Ok(r) => (
                                r.status,
                                r.json()["error"]["data"]["reason"]
                                    .as_str()
                                    .unwrap_or("")
                                    .to_owned(),
                            ),
                            Err(e) => (0, e),
                        };
                        outcomes.lock().unwrap().push(Outcome {
                            session: session.clone(),
                            started,
                            finished: Instant::now(),
                            status,
                            detail,
                        });
                        thread::sleep(Duration::from_millis(20));
                    }
                })
            })
            .collect();
        Load {
            stop,
            outcomes,
            threads,
        }
    }

    fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        let mut all = self.outcomes.lock().unwrap().clone();
        all.sort_by_key(|o| o.started);
        all
    }
}

fn sessions_on(proxy: &ScatterProxy, n: usize) -> Vec<String> {
    (0..n).map(|_| initialize(&proxy.addr, "/mcp")).collect()
}

fn proxy_for(fleet: &LocalFleet) -> ScatterProxy {
    ScatterProxy::start(vec![fleet.a.addr.clone(), fleet.b.addr.clone()])
}

/// Counter values of one session's successful calls, in order.
fn values(outcomes: &[Outcome], session: &str) -> Vec<u64> {
    outcomes
        .iter()
        .filter(|o| o.session == session && o.status == 200)
        .filter_map(|o| o.detail.parse().ok())
        .collect()
}

fn assert_counting_on(outcomes: &[Outcome], session: &str) {
    let v = values(outcomes, session);
    assert!(!v.is_empty(), "session {session} made progress");
    for pair in v.windows(2) {
        assert!(
            pair[1] > pair[0],
            "session {session} kept its state (never a fresh session): {v:?}"
        );
    }
}

#[test]
fn killing_an_owner_answers_its_sessions_truthfully_and_spares_the_rest() {
    let fleet = LocalFleet::start("quic", 2, &[]);
    let proxy = proxy_for(&fleet);
    let sessions = sessions_on(&proxy, 12);
    let victim = owner(&sessions[0]);
    let victim_pid = fleet.pid_of(&victim);
    let load = Load::start(&proxy.addr, &sessions);
    thread::sleep(Duration::from_secs(2));
    signal(victim_pid, "KILL");
    // Once the process is gone (or a zombie), its sockets are closed: from here on
    // no request can reach it.
    wait_until_dead(victim_pid);
    let killed_at = Instant::now();
    thread::sleep(Duration::from_secs(8));
    let outcomes = load.finish();

    let mut first_truthful: Option<Duration> = None;
    let mut reset = 0;
    for o in &outcomes {
        if o.status == 0 {
            // A connection the kernel reset with the killed process: it was queued at
            // that worker's listener when it died, so it started before the kill.
            assert!(
                o.started < killed_at,
                "no HTTP answer after the kill: {o:?}"
            );
            reset += 1;
            continue;
        }
        if owner(&o.session) == victim {
            if o.started > killed_at {
                assert_ne!(
                    o.status, 200,
                    "a dead owner's session must never answer 200: {o:?}"
                );
                assert!(
                    matches!(o.status, 404 | 502 | 503),
                    "documented answers only: {o:?}"
                );
                if matches!(o.status, 404 | 502) && first_truthful.is_none() {
                    first_truthful = Some(o.finished - killed_at);
                }
            }
        } else {
            assert_eq!(
                o.status, 200,
                "sessions of live owners see no errors: {o:?}"
            );
        }
    }
    let first = first_truthful.expect("the dead owner's sessions got a truthful answer");
    eprintln!(
        "first truthful answer {first:?} after kill -9 of the owner; {reset} connections \
         queued at the killed worker's listener were reset"
    );
    assert!(first < Duration::from_secs(10), "answered in {first:?}");
    let last_victim = outcomes
        .iter()
        .rev()
        .find(|o| owner(&o.session) == victim)
        .expect("victim sessions were exercised");
    assert_eq!(
        last_victim.status, 404,
        "in the end the session is gone: {last_victim:?}"
    );
    assert_eq!(last_victim.detail, "session_gone");
    for session in sessions.iter().filter(|s| owner(s) != victim) {
        assert_counting_on(&outcomes, session);
    }
    // The supervisor replaced the dead worker.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fleet.leases().values().all(|(pid, _)| *pid != victim_pid) && fleet.leases().len() < 4 {
        assert!(Instant::now() < deadline, "no replacement worker");
        thread::sleep(Duration::from_millis(100));
    }
}

/// The seed's failure: a stateful call on a session whose owner is gone must never
/// be served on a fresh session with 200. Also: the gone status can be 409.
#[test]
fn a_stateful_call_on_a_lost_session_never_returns_200() {
    let fleet = LocalFleet::start("tcp", 1, &["--session-gone-status", "409"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let first = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "session_append",
        json!({"item": "a"}),
    );
    assert_eq!(first.status, 200);
    signal(fleet.pid_of(&owner(&session)), "KILL");
    thread::sleep(Duration::from_millis(200));
    for id in 3..8 {
        let r = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            id,
            "session_append",
            json!({"item": "b"}),
        );
        assert_ne!(r.status, 200, "never a fresh session");
        assert!(
            matches!(r.status, 409 | 502),
            "gone (409 as configured) or outcome unknown: {}",
            r.status
        );
        let read = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            id + 100,
            "session_read",
            json!({}),
        );
        assert_ne!(read.status, 200);
    }
    let r = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        9,
        "session_read",
        json!({}),
    );
    assert_eq!(r.status, 409);
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("initialize"),
        "tells the client what to do: {message}"
    );
}

#[test]
fn an_owner_paused_within_its_lease_gets_503_then_serves_again() {
    let fleet = LocalFleet::start(
        "quic",
        1,
        &["--lease-ms", "20000", "--forward-timeout-ms", "1000"],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let (paused, took) = call_while_owner_paused(&fleet, &session);
    eprintln!("paused owner answered {} in {took:?}", paused.status);
    assert_eq!(
        paused.status,
        503,
        "{}",
        String::from_utf8_lossy(&paused.body)
    );
    assert!(paused.header("retry-after").is_some());
    assert_eq!(paused.json()["error"]["data"]["retryable"], true);
    // After SIGCONT the session works again, with its state.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            4,
            "session_read",
            json!({}),
        );
        if r.status == 200 {
            break;
        }
        assert_ne!(r.status, 404, "a paused owner's session is not gone");
        assert!(
            Instant::now() < deadline,
            "session never came back: {}",
            r.status
        );
        thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn an_owner_paused_past_its_lease_is_fenced_and_everyone_says_gone() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "2000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    assert_eq!(
        call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            2,
            "counter_increment",
            json!({})
        )
        .status,
        200
    );
    let pid = fleet.pid_of(&owner(&session));
    signal(pid, "STOP");
    thread::sleep(Duration::from_secs(5));
    // A request already on its way to the paused owner may get "outcome unknown";
    // from then on the session is gone.
    let during = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        3,
        "counter_increment",
        json!({}),
    );
    assert!(matches!(during.status, 404 | 502), "{}", during.status);
    let gone = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        4,
        "counter_increment",
        json!({}),
    );
    assert_eq!(gone.status, 404, "lease expired: the session is gone");
    signal(pid, "CONT");
    // The resumed worker learns it was declared dead; every worker says "gone".
    for (i, addr) in [&fleet.a.addr, &fleet.b.addr, &fleet.a.addr, &fleet.b.addr]
        .iter()
        .enumerate()
    {
        // A fenced worker exits and its supervisor restarts it: wait for the port.
        mcpgw_tests::wait_for_listener(addr, Duration::from_secs(15));
        let r = call_tool(
            addr,
            "/mcp",
            &session,
            10 + i as u64,
            "counter_increment",
            json!({}),
        );
        assert_eq!(
            r.status,
            404,
            "via {addr}: {}",
            String::from_utf8_lossy(&r.body)
        );
        thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn redis_paused_past_the_lease_loses_no_session() {
    let fleet = LocalFleet::start("quic", 2, &["--lease-ms", "2000"]);
    let proxy = proxy_for(&fleet);
    let sessions = sessions_on(&proxy, 8);
    let load = Load::start(&proxy.addr, &sessions);
    thread::sleep(Duration::from_secs(1));
    signal(u64::from(fleet.redis.pid()), "STOP");
    thread::sleep(Duration::from_secs(5));
    signal(u64::from(fleet.redis.pid()), "CONT");
    thread::sleep(Duration::from_secs(4));
    let outcomes = load.finish();
    let unavailable = outcomes.iter().filter(|o| o.status == 503).count();
    eprintln!(
        "{} requests, {unavailable} answered 503 during the Redis pause",
        outcomes.len()
    );
    for o in &outcomes {
        assert!(matches!(o.status, 200 | 503), "only 200 or 503: {o:?}");
    }
    for session in &sessions {
        assert_counting_on(&outcomes, session);
        let tail = outcomes
            .iter()
            .rev()
            .find(|o| &o.session == session)
            .unwrap();
        assert_eq!(
            tail.status, 200,
            "{session} works again after Redis returns"
        );
    }
    assert!(
        unavailable > 0,
        "past the lease, owners stopped acting (503) while Redis was gone"
    );
}

#[test]
fn redis_restarted_empty_loses_no_session() {
    let mut fleet = LocalFleet::start("quic", 2, &["--lease-ms", "3000"]);
    let proxy = proxy_for(&fleet);
    let sessions = sessions_on(&proxy, 8);
    let load = Load::start(&proxy.addr, &sessions);
    thread::sleep(Duration::from_secs(1));
    fleet.redis.restart_empty();
    thread::sleep(Duration::from_secs(6));
    let outcomes = load.finish();
    for o in &outcomes {
        assert!(
            matches!(o.status, 200 | 503),
            "no session is lost to a forgetful Redis: {o:?}"
        );
    }
    for session in &sessions {
        assert_counting_on(&outcomes, session);
        let tail = outcomes
            .iter()
            .rev()
            .find(|o| &o.session == session)
            .unwrap();
        assert_eq!(tail.status, 200, "{session} works after the rebuild");
        assert_eq!(
            fleet
                .redis
                .get(&format!("mcpgw:pool_owner:{session}"))
                .as_deref(),
            Some(owner(session).as_str()),
            "ownership was re-claimed"
        );
    }
    let fresh = initialize(&proxy.addr, "/mcp");
    assert!(
        !fresh.is_empty(),
        "new sessions work again without a restart"
    );
}

#[test]
fn a_drained_worker_finishes_in_flight_requests_then_its_sessions_are_gone() {
    let fleet = LocalFleet::start("tcp", 2, &[]);
    let proxy = proxy_for(&fleet);
    let sessions = sessions_on(&proxy, 8);
    let victim = owner(&sessions[0]);
    let mine: Vec<String> = sessions
        .iter()
        .filter(|s| owner(s) == victim)
        .cloned()
        .collect();
    // Slow calls in flight on the victim's sessions, some through other workers.
    let in_flight: Vec<_> = mine
        .iter()
        .flat_map(|s| [s.clone(), s.clone()])
        .enumerate()
        .map(|(i, session)| {
            let addr = if i % 2 == 0 {
                fleet.a.addr.clone()
            } else {
                fleet.b.addr.clone()
            };
            thread::spawn(move || {
                call_tool(
                    &addr,
                    "/mcp",
                    &session,
                    500 + i as u64,
                    "sleep_ms",
                    json!({"ms": 1500}),
                )
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(400));
    signal(fleet.pid_of(&victim), "TERM");
    for handle in in_flight {
        let r = handle.join().unwrap();
        assert_eq!(
            r.status,
            200,
            "in-flight requests finish: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    // Once drained, its sessions are gone, answered fast.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let started = Instant::now();
        let r = call_tool(
            &proxy.addr,
            "/mcp",
            &mine[0],
            900,
            "counter_increment",
            json!({}),
        );
        if r.status == 404 {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "gone is answered fast"
            );
            break;
        }
        assert!(
            matches!(r.status, 200 | 503),
            "during the drain: {}",
            r.status
        );
        assert!(
            Instant::now() < deadline,
            "the drained session never became gone"
        );
        thread::sleep(Duration::from_millis(200));
    }
    // Other sessions are untouched.
    for session in sessions.iter().filter(|s| owner(s) != victim) {
        let r = call_tool(
            &proxy.addr,
            "/mcp",
            session,
            901,
            "counter_increment",
            json!({}),
        );
        assert_eq!(r.status, 200);
    }
}

/// A session belongs to the principal that created it: another principal using its
/// id, on the owner or through another worker, is answered as if it did not exist.
#[test]
fn another_principal_cannot_use_a_session() {
    let tokens = std::env::temp_dir().join(format!("mcpgw-tokens-{}", std::process::id()));
    std::fs::write(
        &tokens,
        "alice:alice-token-0123456789\nbob:bob-token-0123456789ab\n",
    )
    .unwrap();
    let tokens_arg = tokens.display().to_string();
    let fleet = LocalFleet::start("quic", 1, &["--auth-tokens-file", &tokens_arg]);
    let init = br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}"#;
    let headers = |token: &'static str, session: Option<&str>| {
        let mut h = vec![
            ("Content-Type", "application/json".to_owned()),
            ("Accept", "application/json, text/event-stream".to_owned()),
            ("Authorization", format!("Bearer {token}")),
        ];
        if let Some(s) = session {
            h.push(("Mcp-Session-Id", s.to_owned()));
            h.push(("MCP-Protocol-Version", "2025-11-25".to_owned()));
        }
        h
    };
    let send = |addr: &str, token: &'static str, session: Option<&str>, body: &[u8]| {
        let h = headers(token, session);
        let refs: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        mcpgw_tests::http::request(addr, "POST", "/mcp", &refs, body)
    };
    let opened = send(&fleet.a.addr, "alice-token-0123456789", None, init);
    assert_eq!(opened.status, 200);
    let session = opened.header("mcp-session-id").unwrap().to_owned();
    let call = br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"counter_increment","arguments":{}}}"#;
    for addr in [&fleet.a.addr, &fleet.b.addr] {
        let mine = send(addr, "alice-token-0123456789", Some(&session), call);
        assert_eq!(mine.status, 200, "alice via {addr}");
        let theirs = send(addr, "bob-token-0123456789ab", Some(&session), call);
        assert_eq!(
            theirs.status, 404,
            "bob via {addr} is told it does not exist"
        );
        assert_eq!(theirs.error_code(), Some(-32001));
        let anonymous = mcpgw_tests::http::request(
            addr,
            "POST",
            "/mcp",
            &[
                ("Content-Type", "application/json"),
                ("Mcp-Session-Id", &session),
            ],
            call,
        );
        assert_eq!(anonymous.status, 401);
        assert!(anonymous.header("www-authenticate").is_some());
        let wrong = send(addr, "not-a-valid-token-at-all", Some(&session), call);
        assert_eq!(wrong.status, 401);
    }
    // Bob's attempts changed nothing: alice's counter went 1, 2, now 3.
    let third = send(
        &fleet.b.addr,
        "alice-token-0123456789",
        Some(&session),
        call,
    );
    assert!(
        String::from_utf8_lossy(&third.body).contains("\"3\""),
        "{}",
        String::from_utf8_lossy(&third.body)
    );
    let _ = std::fs::remove_file(&tokens);
}

/// A host that goes silent (no refusal, no answer) is declared dead when its lease
/// expires, and a request waiting on it is answered then, not after the forward
/// timeout (30 s by default).
#[test]
fn a_silent_owner_is_answered_within_its_lease_not_the_forward_timeout() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "3000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let (r, took) = call_while_owner_paused(&fleet, &session);
    eprintln!("silent owner: answered {} after {took:?}", r.status);
    assert!(
        matches!(r.status, 502 | 404),
        "the truth once the lease expired: {}",
        r.status
    );
    assert!(
        took < Duration::from_secs(10),
        "answered within the lease, not the forward timeout: {took:?}"
    );
}

/// Waits until `pid` is gone: reaped by its supervisor. (A zombie leader is not
/// enough: the other threads of a multi-threaded process may still hold its sockets.)
fn wait_until_dead(pid: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < deadline, "process {pid} was not reaped");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Opt-in: while a session's owner cannot be confirmed, session-independent methods
/// (ping, the list methods) are answered without the session; anything stateful
/// still gets the truthful 503.
#[test]
fn idempotent_methods_may_be_answered_statelessly_while_ownership_is_unknown() {
    let fleet = LocalFleet::start(
        "quic",
        1,
        &[
            "--lease-ms",
            "20000",
            "--forward-timeout-ms",
            "1000",
            "--stateless-when-unknown",
        ],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let pid = fleet.pid_of(&owner(&session));
    signal(pid, "STOP");
    let list = br#"{"jsonrpc":"2.0","id":7,"method":"tools/list"}"#;
    let listed = http::request(
        &fleet.b.addr,
        "POST",
        "/mcp",
        &http::mcp_headers(Some(&session)),
        list,
    );
    let stateful = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        8,
        "counter_increment",
        json!({}),
    );
    signal(pid, "CONT");
    assert_eq!(
        listed.status,
        200,
        "{}",
        String::from_utf8_lossy(&listed.body)
    );
    assert_eq!(listed.header("mcpgw-stateless"), Some("1"));
    let tools = &listed.messages()[0]["result"]["tools"];
    assert!(tools.as_array().is_some_and(|t| !t.is_empty()), "{tools}");
    assert_eq!(listed.messages()[0]["id"], 7);
    assert_eq!(
        stateful.status, 503,
        "stateful calls are never answered without the session"
    );
    // The temporary upstream session was ended again.
    let deadline = Instant::now() + Duration::from_secs(5);
    while fleet.upstream.stats()["sessions_open"] != json!(1) {
        assert!(
            Instant::now() < deadline,
            "temporary upstream session left open: {}",
            fleet.upstream.stats()
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// One stateful call through host-b while the session's owner is stopped (SIGSTOP),
/// after a first call proved the session works; the owner is resumed afterwards.
fn call_while_owner_paused(fleet: &LocalFleet, session: &str) -> (http::Response, Duration) {
    let ok = call_tool(
        &fleet.b.addr,
        "/mcp",
        session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(ok.status, 200);
    let pid = fleet.pid_of(&owner(session));
    signal(pid, "STOP");
    let started = Instant::now();
    let answer = call_tool(
        &fleet.b.addr,
        "/mcp",
        session,
        3,
        "counter_increment",
        json!({}),
    );
    let took = started.elapsed();
    signal(pid, "CONT");
    (answer, took)
}
