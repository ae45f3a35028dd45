//! Hardening with real processes: nothing one client (or a crashed worker) does may cost
//! other users their service or make Redis grow without bound. Forged session ids,
//! idle sessions, session limits and quotas, oversized heads, slow bodies, connection
//! floods, dead workers nobody asks about, a Redis stall under a crowd of requests, and
//! a configuration that would trust Redis with identities.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use mcpgw_testkit::admin::{admin_of, scrape};
use mcpgw_testkit::fleet::{LocalFleet, PREFIX, leases, owner_of, recorded_owner};
use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::redis::RanCommand;
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{Gateway, Upstream, eventually};
use serde_json::json;

/// Bound of every wait: only a hang reaches it.
const WITHIN: Duration = Duration::from_secs(60);

/// A configuration file holding `toml`, for settings that have no flag.
fn config_file(toml: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("config file");
    file.write_all(toml.as_bytes()).expect("write config");
    file
}

#[test]
fn forged_session_ids_are_answered_404_and_cost_no_redis_write() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "1000"]);
    // Fixed width, so that no forged owner's name contains another's.
    let owner = |n: usize| format!("made-up-worker-{n:04}");
    let forged = |n: usize| format!("{:032x}.{}", n + 1, owner(n));
    // A missing lease proves death only once the directory is older than a lease.
    eventually(WITHIN, || {
        let r = call_tool(
            &fleet.a.addr,
            "/mcp",
            &forged(0),
            1,
            "echo",
            json!({"text": "x"}),
        );
        match r.status {
            404 => Ok(()),
            other => Err(format!("still {other}: {}", r.text())),
        }
    });
    let live: Vec<String> = fleet.leases().into_keys().collect();
    assert_eq!(live.len(), 2, "one worker per host: {live:?}");
    let log = fleet.redis.record_commands();
    let count = 1000;
    for n in 1..=count {
        let r = call_tool(
            &fleet.a.addr,
            "/mcp",
            &forged(n),
            1,
            "echo",
            json!({"text": "x"}),
        );
        assert_eq!(
            r.outcome(),
            "404 session_gone",
            "forged id {n}: {}",
            r.text()
        );
    }
    let ran = log.commands();
    // Each forged request was looked up in Redis, so the log saw what it cost.
    let unseen: Vec<usize> = (1..=count)
        .filter(|&n| !ran.iter().any(|c| c.mentions(&owner(n))))
        .collect();
    assert!(
        unseen.is_empty(),
        "{} of {count} forged ids never reached Redis (e.g. {:?}) among {} commands",
        unseen.len(),
        &unseen[..unseen.len().min(5)],
        ran.len()
    );
    // Meanwhile the live workers renew their leases and take sweeper turns: those
    // writes name them. Any other write, or one that names a forged owner, was the
    // forged requests' doing.
    let foreign: Vec<&RanCommand> = ran
        .iter()
        .filter(|c| !c.writes().is_empty())
        .filter(|c| c.mentions("made-up-worker-") || !live.iter().any(|id| c.mentions(id)))
        .collect();
    assert!(
        foreign.is_empty(),
        "{} writes besides the live workers' upkeep, e.g. {:#?}",
        foreign.len(),
        &foreign[..foreign.len().min(3)]
    );
    let theirs = ran.iter().filter(|c| c.mentions("made-up-worker-")).count();
    let upkeep = ran.iter().filter(|c| !c.writes().is_empty()).count();
    println!(
        "{count} forged ids: {theirs} commands in Redis, none writing; meanwhile {upkeep} \
         writing commands of the live workers' upkeep"
    );
}

#[test]
fn an_idle_session_expires_and_a_session_with_a_held_stream_does_not() {
    // One upstream per session, so each one's end is seen on its own upstream.
    let (held_upstream, idle_upstream) = (Upstream::start(), Upstream::start());
    let routes = format!("held={},idle={}", held_upstream.url, idle_upstream.url);
    let gateway = Gateway::start(&["--upstream", &routes, "--session-idle-timeout-ms", "1500"]);
    let held = initialize(&gateway.addr, "/servers/held/mcp");
    let stream = open_stream(&gateway.addr, "/servers/held/mcp", &held);
    let opened = Instant::now();
    // Opened after the stream: once it has expired, the held session has gone without
    // a request for longer than the idle timeout too.
    let idle = initialize(&gateway.addr, "/servers/idle/mcp");
    // Watched upstream, without touching either session (a request counts as activity).
    let open_at = |upstream: &Upstream| upstream.stats()["sessions_open"].as_u64();
    eventually(WITHIN, || match open_at(&idle_upstream) {
        Some(0) => Ok(()),
        other => Err(format!("{other:?} idle sessions open upstream")),
    });
    println!(
        "the idle session expired; the held one has had no request for {:?}",
        opened.elapsed()
    );
    let r = call_tool(
        &gateway.addr,
        "/servers/idle/mcp",
        &idle,
        2,
        "echo",
        json!({"text": "x"}),
    );
    assert_eq!(r.outcome(), "404 session_not_found", "{}", r.text());
    let r = call_tool(
        &gateway.addr,
        "/servers/held/mcp",
        &held,
        3,
        "echo",
        json!({"text": "still"}),
    );
    assert_eq!(
        r.status,
        200,
        "a held stream keeps the session alive: {}",
        r.text()
    );
    assert_eq!(r.expect_tool_text(), "still");
    // Released, it expires like any other.
    drop(stream);
    eventually(WITHIN, || match open_at(&held_upstream) {
        Some(0) => Ok(()),
        other => Err(format!("{other:?} held sessions open upstream")),
    });
    let r = call_tool(
        &gateway.addr,
        "/servers/held/mcp",
        &held,
        4,
        "echo",
        json!({"text": "x"}),
    );
    assert_eq!(r.outcome(), "404 session_not_found", "{}", r.text());
}

/// Opens the GET stream of `session` at `path` and returns the connection holding it.
fn open_stream(addr: &str, path: &str, session: &str) -> TcpStream {
    let mut socket = TcpStream::connect(addr).expect("connect");
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\
         Mcp-Session-Id: {session}\r\nMCP-Protocol-Version: 2025-11-25\r\n\r\n"
    );
    socket.write_all(request.as_bytes()).expect("send GET");
    let mut head = [0u8; 12];
    socket.read_exact(&mut head).expect("stream head");
    assert_eq!(&head, b"HTTP/1.1 200", "the stream opened");
    socket
}

#[test]
fn an_expired_session_leaves_no_directory_record() {
    let fleet = LocalFleet::start("quic", 1, &["--session-idle-timeout-ms", "1000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let owner = owner_of(&session);
    assert_eq!(
        recorded_owner(&fleet.redis, &session).as_deref(),
        Some(owner.as_str())
    );
    eventually(WITHIN, || match recorded_owner(&fleet.redis, &session) {
        None => Ok(()),
        Some(o) => Err(format!("still recorded for {o}")),
    });
    // Asked through the other host, the session is gone, not unknown.
    let r = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "echo",
        json!({"text": "x"}),
    );
    assert_eq!(r.outcome(), "404 session_not_found", "{}", r.text());
}

/// A tokens file with two principals.
fn tokens_file() -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("tokens file");
    writeln!(file, "alice:alice-token-0123456789abcdef").unwrap();
    writeln!(file, "bob:bob-token-0123456789abcdefgh").unwrap();
    file
}

fn initialize_as(addr: &str, token: &str) -> http::Response {
    let bearer = format!("Bearer {token}");
    let mut headers = mcp_headers(None);
    headers.push(("authorization", &bearer));
    http::request(addr, "POST", "/mcp", &headers, &http::initialize_body(1))
}

#[test]
fn a_principal_at_its_quota_gets_429_fleet_wide_while_others_open_sessions() {
    let tokens = tokens_file();
    let path = tokens.path().display().to_string();
    let fleet = LocalFleet::start(
        "quic",
        1,
        &[
            "--auth-tokens-file",
            &path,
            "--max-sessions-per-principal",
            "2",
        ],
    );
    let alice = "alice-token-0123456789abcdef";
    // One session on each host: the quota is counted fleet-wide, not per worker.
    let first = initialize_as(&fleet.a.addr, alice);
    assert_eq!(first.status, 200);
    assert_eq!(initialize_as(&fleet.b.addr, alice).status, 200);
    for addr in [&fleet.a.addr, &fleet.b.addr] {
        let r = initialize_as(addr, alice);
        assert_eq!(r.outcome(), "429 session_quota", "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("30"));
        assert_eq!(r.json()["error"]["data"]["scope"], "principal");
        assert_eq!(r.json()["error"]["data"]["limit"], 2);
    }
    let bob = initialize_as(&fleet.a.addr, "bob-token-0123456789abcdefgh");
    assert_eq!(bob.status, 200, "another principal still opens sessions");
    // Ending one of alice's sessions (through the other host) frees a slot.
    let session = first
        .header("mcp-session-id")
        .expect("a session id")
        .to_owned();
    let bearer = format!("Bearer {alice}");
    let mut headers = mcp_headers(Some(&session));
    headers.push(("authorization", &bearer));
    let ended = http::request(&fleet.b.addr, "DELETE", "/mcp", &headers, b"");
    assert_eq!(ended.status, 200, "{}", ended.text());
    assert_eq!(initialize_as(&fleet.b.addr, alice).status, 200);
}

/// Sends initialize as a client behind a load balancer whose `X-Forwarded-For` reads
/// `forwarded_for`; every request comes from 127.0.0.1, the balancer's address.
fn initialize_forwarded_for(addr: &str, forwarded_for: &str) -> http::Response {
    let mut headers = mcp_headers(None);
    headers.push(("X-Forwarded-For", forwarded_for));
    http::request(addr, "POST", "/mcp", &headers, &http::initialize_body(1))
}

#[track_caller]
fn assert_address_quota_full(r: &http::Response, limit: u64) {
    assert_eq!(r.outcome(), "429 session_quota", "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("30"));
    let data = &r.json()["error"]["data"];
    assert_eq!(data["scope"], "client_address", "{data}");
    assert_eq!(data["limit"], limit, "{data}");
    assert_eq!(r.header("mcp-session-id"), None, "no session was opened");
}

#[test]
fn behind_a_trusted_balancer_each_forwarded_client_has_its_own_address_quota_fleet_wide() {
    let flags = [
        "--trust-forwarded-for",
        "--max-sessions-per-client-address",
        "2",
    ];
    let fleet = LocalFleet::start("quic", 1, &flags);
    let hosts = [&fleet.a.addr, &fleet.b.addr];
    // One session on each host: the quota is counted fleet-wide.
    for host in hosts {
        let r = initialize_forwarded_for(host, "198.51.100.7");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Only the last entry counts (the one the balancer appended): a client cannot
    // leave its quota by sending an X-Forwarded-For of its own.
    for host in hosts {
        let r = initialize_forwarded_for(host, "203.0.113.1, 198.51.100.7");
        assert_address_quota_full(&r, 2);
    }
    // Another client behind the same balancer has a quota of its own.
    for host in hosts {
        let r = initialize_forwarded_for(host, "198.51.100.8");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_address_quota_full(&initialize_forwarded_for(hosts[0], "198.51.100.8"), 2);
}

#[test]
fn without_trust_forwarded_for_every_client_behind_one_address_shares_its_quota() {
    let flags = ["--max-sessions-per-client-address", "2"];
    let fleet = LocalFleet::start("quic", 1, &flags);
    for (host, client) in [
        (&fleet.a.addr, "198.51.100.7"),
        (&fleet.b.addr, "198.51.100.8"),
    ] {
        let r = initialize_forwarded_for(host, client);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Whatever X-Forwarded-For says, both came from 127.0.0.1, whose quota is full.
    assert_address_quota_full(&initialize_forwarded_for(&fleet.a.addr, "198.51.100.9"), 2);
}

#[test]
fn past_max_sessions_a_worker_answers_initialize_503_until_a_session_ends() {
    let upstream = Upstream::start();
    let url = format!("demo={}", upstream.url);
    let gateway = Gateway::start(&["--upstream", &url, "--max-sessions", "2"]);
    let first = initialize(&gateway.addr, "/mcp");
    initialize(&gateway.addr, "/mcp");
    let refused = http::try_initialize(&gateway.addr, "/mcp").expect("an answer");
    assert_eq!(refused.outcome(), "503 session_limit", "{}", refused.text());
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(
        refused.header("mcp-session-id"),
        None,
        "no session was opened"
    );
    assert_eq!(
        upstream.stats()["sessions_open"],
        2,
        "the refused initialize opened nothing upstream"
    );
    // The limit counts live sessions: ending one makes room.
    let ended = http::delete_session(&gateway.addr, "/mcp", &first);
    assert_eq!(ended.status, 200, "{}", ended.text());
    initialize(&gateway.addr, "/mcp");
}

#[test]
fn a_request_head_past_max_header_bytes_gets_431_and_the_worker_keeps_serving() {
    let upstream = Upstream::start();
    let url = format!("demo={}", upstream.url);
    // Below the 64 KiB default, so a 431 at 20 KiB shows the setting is applied.
    let config = config_file("[limits]\nmax_header_bytes = 16384\n");
    let config = config.path().display().to_string();
    let gateway = Gateway::start(&["--upstream", &url, "--config", &config]);
    let initialize_padded = |bytes: usize| {
        let padding = "a".repeat(bytes);
        let mut headers = mcp_headers(None);
        headers.push(("X-Padding", &padding));
        http::try_request(
            &gateway.addr,
            "POST",
            "/mcp",
            &headers,
            &http::initialize_body(1),
        )
    };
    let r = initialize_padded(8 * 1024).expect("an answer under the limit");
    assert_eq!(
        r.status,
        200,
        "a head under the limit is served: {}",
        r.text()
    );
    let r = initialize_padded(20 * 1024).expect("an answer past the limit");
    // Hyper's own answer: no JSON-RPC body, and the connection ends.
    assert_eq!(r.status, 431, "{}", r.text());
    assert_eq!(r.body, b"", "431 comes without a body");
    assert_eq!(r.header("connection"), Some("close"));
    assert_eq!(
        upstream.stats()["sessions_open"],
        1,
        "the refused head opened nothing"
    );
    let r = initialize_padded(8 * 1024).expect("an answer after the refusal");
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_slow_body_is_cut_with_408_and_the_worker_keeps_serving() {
    let upstream = Upstream::start();
    let url = format!("demo={}", upstream.url);
    let gateway = Gateway::start(&["--upstream", &url, "--body-timeout-ms", "500"]);
    let mut slow = TcpStream::connect(&gateway.addr).expect("connect");
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: 100\r\n\r\n{{\"jsonrpc\"",
        gateway.addr
    );
    slow.write_all(head.as_bytes()).expect("send head");
    // The rest of the body never comes.
    slow.set_read_timeout(Some(WITHIN)).unwrap();
    let mut answer = String::new();
    let _ = slow.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    // Meanwhile and afterwards, others are served.
    let session = initialize(&gateway.addr, "/mcp");
    let r = call_tool(
        &gateway.addr,
        "/mcp",
        &session,
        2,
        "echo",
        json!({"text": "ok"}),
    );
    assert_eq!(r.expect_tool_text(), "ok");
}

#[test]
fn past_the_connection_cap_new_connections_get_503_and_existing_ones_are_served() {
    let upstream = Upstream::start();
    let url = format!("demo={}", upstream.url);
    let gateway = Gateway::start(&["--upstream", &url, "--max-connections", "4"]);
    // Four idle keep-alive connections take every slot.
    let held: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(&gateway.addr).expect("connect"))
        .collect();
    // Wait until the worker accepted all four, then a fifth is refused with 503.
    let refused = eventually(WITHIN, || {
        match http::try_request(&gateway.addr, "GET", "/healthz", &[], b"") {
            Ok(r) if r.status == 503 => Ok(r),
            Ok(r) => Err(format!("answered {}", r.status)),
            Err(e) => Err(e),
        }
    });
    assert_eq!(refused.reason().as_deref(), Some("connection_limit"));
    assert_eq!(refused.header("retry-after"), Some("1"));
    // A held connection is still served.
    let mut first = &held[0];
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", gateway.addr);
    first
        .write_all(request.as_bytes())
        .expect("write on a held connection");
    let mut head = [0u8; 12];
    first
        .read_exact(&mut head)
        .expect("an answer on a held connection");
    assert_eq!(&head, b"HTTP/1.1 200");
    drop(held);
    // Freed slots take new connections again.
    eventually(WITHIN, || {
        match http::try_request(&gateway.addr, "GET", "/healthz", &[], b"") {
            Ok(r) if r.status == 200 => Ok(()),
            Ok(r) => Err(format!("answered {}", r.status)),
            Err(e) => Err(e),
        }
    });
}

#[test]
fn a_dead_worker_with_thousands_of_sessions_leaves_no_key_behind() {
    // Its sessions' adoption records wait an idle timeout for a request that adopts
    // them, then go too.
    let flags = [
        "--lease-ms",
        "2000",
        "--max-sessions-per-principal",
        "0",
        "--session-idle-timeout-ms",
        "5000",
    ];
    let fleet = LocalFleet::start("quic", 1, &flags);
    let count = 5000;
    let sessions: Vec<String> = thread::scope(|scope| {
        let workers: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    (0..count / 8)
                        .map(|_| initialize(&fleet.a.addr, "/mcp"))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("an opener thread"))
            .collect()
    });
    assert_eq!(sessions.len(), count);
    let dead = owner_of(&sessions[0]);
    let pid = leases(&fleet.redis)[&dead].pid;
    signal::send(pid, Signal::SIGKILL);
    // Nobody asks about its sessions again: the sweeper alone must clean up, including
    // the short-lived record of the reclaim (four leases) and, through their expiry,
    // the adoption records.
    eventually(Duration::from_secs(120), || {
        let left: Vec<String> = fleet
            .redis
            .keys("*")
            .into_iter()
            .filter(|k| k.contains(&dead) || k.starts_with(&format!("{PREFIX}pool_owner:")))
            .collect();
        match left.len() {
            0 => Ok(()),
            n => Err(format!(
                "{n} keys left, e.g. {:?}",
                &left[..left.len().min(3)]
            )),
        }
    });
}

/// Renewal attempts worker behind `admin` finished (answered or failed), and how many
/// times a renewal left its lease in doubt.
fn renewals(admin: &str) -> (f64, f64) {
    let metrics = scrape(admin);
    let attempts = metrics
        .iter()
        .filter(|(sample, _)| {
            sample.starts_with("mcpgw_directory_calls_total{")
                && sample.contains("op=\"renew_lease\"")
        })
        .map(|(_, n)| n)
        .sum();
    let in_doubt = metrics
        .get("mcpgw_leases_in_doubt_total")
        .copied()
        .unwrap_or(0.0);
    (attempts, in_doubt)
}

#[test]
fn a_crowd_of_requests_shares_one_lease_revalidation_while_redis_stalls() {
    // A renewal attempt against the paused Redis lasts the whole directory timeout:
    // far longer than the crowd takes to arrive, so every request of the crowd comes
    // while one attempt runs (or starts it).
    let config = config_file("[fleet]\ndirectory_timeout_ms = 8000\n");
    let config = config.path().display().to_string();
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "2000", "--config", &config]);
    let sessions: Vec<String> = (0..20).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let owner = owner_of(&sessions[0]);
    assert!(
        sessions.iter().all(|s| owner_of(s) == owner),
        "host-a's one worker owns every session it opened"
    );
    let admin = admin_of(&fleet.redis, &owner);
    let paused = fleet.redis.pause();
    // Past the owner's own lease deadline (lease − a fifth), as the owner sees it.
    let stalled = Instant::now();
    eventually(WITHIN, || match scrape(&admin).get("mcpgw_lease_valid") {
        Some(v) if *v == 0.0 => Ok(()),
        other => Err(format!("lease_valid {other:?}")),
    });
    println!(
        "the lease fell in doubt {:?} into the stall",
        stalled.elapsed()
    );
    let (attempts_before, in_doubt_before) = renewals(&admin);
    let crowd = 200;
    let barrier = Arc::new(Barrier::new(crowd));
    let (answers, answered) = mpsc::channel();
    for i in 0..crowd {
        let (barrier, answers) = (barrier.clone(), answers.clone());
        let (session, addr) = (sessions[i % sessions.len()].clone(), fleet.a.addr.clone());
        // Not scoped: should the test fail, it does not wait for the crowd.
        thread::spawn(move || {
            barrier.wait();
            let r = http::try_request(
                &addr,
                "POST",
                "/mcp",
                &mcp_headers(Some(&session)),
                &http::tool_call_body(i as u64, "echo", json!({"text": "x"})),
            );
            let _ = answers.send(r);
        });
    }
    // Until the crowd is answered, a second finished attempt means requests that
    // waited for one attempt started their own.
    let mut got = Vec::new();
    let attempts = eventually(WITHIN, || {
        got.extend(answered.try_iter());
        let attempts = renewals(&admin).0 - attempts_before;
        assert!(
            attempts <= 1.0 || got.len() == crowd,
            "{attempts} renewal attempts finished while {} of {crowd} requests still waited: \
             revalidation is not shared",
            crowd - got.len()
        );
        match got.len() {
            n if n == crowd => Ok(attempts),
            n => Err(format!(
                "{n} of {crowd} answered, {attempts} attempts finished"
            )),
        }
    });
    println!(
        "{crowd} requests answered {:?} into the stall",
        stalled.elapsed()
    );
    let (_, in_doubt_after) = renewals(&admin);
    drop(paused);
    assert_eq!(
        attempts, 1.0,
        "the crowd of {crowd} shared one renewal attempt"
    );
    for r in &got {
        let r = r.as_ref().expect("an HTTP answer");
        assert_eq!(r.outcome(), "503 lease_in_doubt", "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    // The doubt is counted once per request that met it (and once per heartbeat).
    assert!(
        in_doubt_after - in_doubt_before >= crowd as f64,
        "leases_in_doubt moved by {}",
        in_doubt_after - in_doubt_before
    );
}

#[test]
fn redis_restarted_empty_never_makes_a_live_owners_sessions_gone_on_a_cold_edge() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "3000"]);
    let sessions: Vec<String> = (0..6).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    // Host-b never forwarded: it must look every owner up in the directory, which has
    // just been lost. A missing lease there proves nothing.
    let restarted = Instant::now();
    fleet.redis.restart_empty();
    // Until the owner has registered again and re-claimed its sessions, host-b may only
    // say "retry" (503); then every session answers through it.
    let mut refused: BTreeSet<String> = BTreeSet::new();
    let mut reached = vec![false; sessions.len()];
    let mut id = 100;
    eventually(WITHIN, || {
        for (session, reached) in sessions.iter().zip(reached.iter_mut()) {
            id += 1;
            let r = call_tool(
                &fleet.b.addr,
                "/mcp",
                session,
                id,
                "echo",
                json!({"text": "x"}),
            );
            match (r.status, r.reason().as_deref()) {
                (200, _) => *reached = true,
                (503, Some("ownership_unknown" | "lease_in_doubt")) => {
                    assert_eq!(r.header("retry-after"), Some("1"), "{}", r.text());
                    refused.insert(r.outcome());
                }
                _ => panic!(
                    "a live owner's session answered {}: {}",
                    r.outcome(),
                    r.text()
                ),
            }
        }
        match reached.iter().filter(|r| !**r).count() {
            0 => Ok(()),
            n => Err(format!("{n} sessions not reached yet")),
        }
    });
    println!(
        "every session answered through host-b {:?} after the restart; meanwhile {refused:?}",
        restarted.elapsed()
    );
}

#[test]
fn the_redis_baseline_refuses_to_start_with_edge_authentication() {
    let tokens = tokens_file();
    let output = std::process::Command::new(mcpgw_testkit::bin("mcpgw"))
        .args([
            "serve",
            "--workers",
            "2",
            "--redis",
            "redis://127.0.0.1:1/",
            "--mesh-transport",
            "redis",
            "--upstream",
            "demo=http://127.0.0.1:1/mcp",
            "--auth-tokens-file",
        ])
        .arg(tokens.path())
        .output()
        .expect("run mcpgw");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("mesh.transport") && stderr.contains("trust boundary"),
        "{stderr}"
    );
}
