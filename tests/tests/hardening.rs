//! Hardening with real processes: nothing one client (or a crashed worker) does may cost
//! other users their service or make Redis grow without bound. Forged session ids,
//! idle sessions, session quotas, slow bodies, connection floods, dead workers nobody
//! asks about, a Redis stall under a crowd of requests, and a configuration that would
//! trust Redis with identities.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use mcpgw_testkit::fleet::{LocalFleet, PREFIX, leases, owner_of, recorded_owner};
use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{Gateway, RedisServer, Upstream, eventually};
use serde_json::json;

/// Bound of every wait: only a hang reaches it.
const WITHIN: Duration = Duration::from_secs(60);

/// Every key in Redis, except the sweeper's turn (it comes and goes by itself).
fn keys(redis: &RedisServer) -> BTreeSet<String> {
    redis
        .keys("*")
        .into_iter()
        .filter(|k| k != &format!("{PREFIX}sweeper"))
        .collect()
}

#[test]
fn forged_session_ids_cost_no_redis_write_and_are_answered_404() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "1000"]);
    let forged = |n: usize| format!("{:032x}.made-up-worker-{n}", n + 1);
    // A missing lease proves death only once the directory is older than a lease.
    eventually(WITHIN, || {
        let r = call_tool(&fleet.a.addr, "/mcp", &forged(0), 1, "echo", json!({"text": "x"}));
        match r.status {
            404 => Ok(()),
            other => Err(format!("still {other}: {}", r.text())),
        }
    });
    let before = keys(&fleet.redis);
    for n in 1..=1000 {
        let r = call_tool(&fleet.a.addr, "/mcp", &forged(n), 1, "echo", json!({"text": "x"}));
        assert_eq!(r.status, 404, "forged id {n}: {}", r.text());
        assert_eq!(r.reason().as_deref(), Some("session_gone"));
    }
    assert_eq!(keys(&fleet.redis), before, "forged ids changed Redis's keys");
}

#[test]
fn an_idle_session_expires_and_a_session_with_a_held_stream_does_not() {
    let upstream = Upstream::start();
    let url = format!("demo={}", upstream.url);
    let gateway = Gateway::start(&["--upstream", &url, "--session-idle-timeout-ms", "1500"]);
    let idle = initialize(&gateway.addr, "/mcp");
    let held = initialize(&gateway.addr, "/mcp");
    assert_eq!(upstream.stats()["sessions_open"], 2);
    // Hold a GET stream on one session for longer than the idle timeout.
    let stream_addr = gateway.addr.clone();
    let stream_session = held.clone();
    let holder = thread::spawn(move || {
        let mut socket = TcpStream::connect(&stream_addr).expect("connect");
        let request = format!(
            "GET /mcp HTTP/1.1\r\nHost: {stream_addr}\r\nAccept: text/event-stream\r\n\
             Mcp-Session-Id: {stream_session}\r\nMCP-Protocol-Version: 2025-11-25\r\n\r\n"
        );
        socket.write_all(request.as_bytes()).expect("send GET");
        let mut head = [0u8; 12];
        socket.read_exact(&mut head).expect("stream head");
        assert_eq!(&head, b"HTTP/1.1 200", "the stream opened");
        thread::sleep(Duration::from_millis(4000));
        drop(socket);
    });
    // The idle session ends: 404, and its upstream session is gone too.
    eventually(WITHIN, || {
        let r = call_tool(&gateway.addr, "/mcp", &idle, 2, "echo", json!({"text": "x"}));
        match r.outcome().as_str() {
            "404 session_not_found" => Ok(()),
            other => Err(other.to_owned()),
        }
    });
    assert_eq!(upstream.stats()["sessions_open"], 1, "the idle session ended upstream");
    holder.join().expect("the stream holder");
    // Held for 4 s against a 1.5 s timeout, and still alive right after.
    let r = call_tool(&gateway.addr, "/mcp", &held, 3, "echo", json!({"text": "still"}));
    assert_eq!(r.status, 200, "a held stream keeps the session alive: {}", r.text());
}

#[test]
fn an_expired_session_leaves_no_directory_record() {
    let fleet = LocalFleet::start("quic", 1, &["--session-idle-timeout-ms", "1000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let owner = owner_of(&session);
    assert_eq!(recorded_owner(&fleet.redis, &session).as_deref(), Some(owner.as_str()));
    eventually(WITHIN, || match recorded_owner(&fleet.redis, &session) {
        None => Ok(()),
        Some(o) => Err(format!("still recorded for {o}")),
    });
    // Asked through the other host, the session is gone, not unknown.
    let r = call_tool(&fleet.b.addr, "/mcp", &session, 2, "echo", json!({"text": "x"}));
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
        &["--auth-tokens-file", &path, "--max-sessions-per-principal", "2"],
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
    let r = call_tool(&gateway.addr, "/mcp", &session, 2, "echo", json!({"text": "ok"}));
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
    first.write_all(request.as_bytes()).expect("write on a held connection");
    let mut head = [0u8; 12];
    first.read_exact(&mut head).expect("an answer on a held connection");
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
    let flags = ["--lease-ms", "2000", "--max-sessions-per-principal", "0"];
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
    // the short-lived record of the reclaim (four leases).
    eventually(Duration::from_secs(120), || {
        let left: Vec<String> = fleet
            .redis
            .keys("*")
            .into_iter()
            .filter(|k| k.contains(&dead) || k.starts_with(&format!("{PREFIX}pool_owner:")))
            .collect();
        match left.len() {
            0 => Ok(()),
            n => Err(format!("{n} keys left, e.g. {:?}", &left[..left.len().min(3)])),
        }
    });
}

#[test]
fn a_crowd_of_requests_shares_one_lease_revalidation_while_redis_stalls() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "2000"]);
    let sessions: Vec<String> = (0..20).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let owner = owner_of(&sessions[0]);
    // Only sessions host-a owns are local to the requests below.
    let local: Vec<String> = sessions.into_iter().filter(|s| owner_of(s) == owner).collect();
    let renewals = || {
        fleet
            .redis
            .command_calls()
            .into_iter()
            .filter(|(name, _)| name == "evalsha")
            .map(|(_, n)| n)
            .sum::<u64>()
    };
    let paused = fleet.redis.pause();
    // Past the owner's own lease deadline (lease − a fifth).
    thread::sleep(Duration::from_millis(2500));
    let crowd = 200;
    let barrier = Arc::new(Barrier::new(crowd));
    let answers: Vec<(u16, Duration)> = thread::scope(|scope| {
        let threads: Vec<_> = (0..crowd)
            .map(|i| {
                let (barrier, session, addr) =
                    (barrier.clone(), local[i % local.len()].clone(), fleet.a.addr.clone());
                scope.spawn(move || {
                    barrier.wait();
                    let started = Instant::now();
                    let r = call_tool(&addr, "/mcp", &session, i as u64, "echo", json!({"text": "x"}));
                    (r.status, started.elapsed())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a crowd thread"))
            .collect()
    });
    let evalsha_before_resume = renewals();
    drop(paused);
    for (status, _) in &answers {
        assert!(matches!(status, 200 | 503), "only 200 or 503: {status}");
    }
    // Nobody waited for Redis to come back: a request waits at most for the attempt
    // already running (one directory timeout), not for one attempt per request ahead.
    let slowest = answers.iter().map(|(_, t)| *t).max().unwrap_or_default();
    assert!(
        slowest < Duration::from_secs(5),
        "a request waited {slowest:?} while Redis was paused"
    );
    // Redis ran the commands queued while it was paused: renewal scripts are few, not
    // one per request.
    let queued = eventually(WITHIN, || {
        let now = renewals();
        if now > evalsha_before_resume { Ok(now - evalsha_before_resume) } else { Err("none ran yet") }
    });
    assert!(
        queued < 50,
        "{queued} scripts queued for {crowd} requests: revalidation is not shared"
    );
}

#[test]
fn redis_restarted_empty_never_makes_a_live_owners_sessions_gone_on_a_cold_edge() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "3000"]);
    let sessions: Vec<String> = (0..6).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    // Host-b never forwarded: it must look every owner up in the directory, which has
    // just been lost. A missing lease there proves nothing.
    fleet.redis.restart_empty();
    let until = Instant::now() + Duration::from_secs(8);
    let mut answered = 0;
    let mut id = 100;
    while Instant::now() < until {
        for session in &sessions {
            id += 1;
            let r = call_tool(&fleet.b.addr, "/mcp", session, id, "echo", json!({"text": "x"}));
            assert!(
                matches!(r.status, 200 | 503),
                "a live owner's session answered {}: {}",
                r.status,
                r.text()
            );
            answered += usize::from(r.status == 200);
        }
        thread::sleep(Duration::from_millis(50));
    }
    assert!(answered > 0, "the owner re-registered and host-b reached it again");
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
