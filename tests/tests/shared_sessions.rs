//! The shared upstream session of a 2026-07-28 principal on a stateful route (a stdio
//! server here) is lost truthfully, whichever worker gets the next call: after idle
//! expiry, after its owner's death (reclaimed by another session's request, or by the
//! sweeper), the first call through another worker is told (404 `session_gone`), the
//! second starts afresh, and no worker tells it twice. A directory rebuilt empty, or
//! a claim whose answer Redis never sent, never turns into a silent fresh session.
//!
//! Such a client holds no session id, so "no record" cannot tell it anything: the
//! directory remembers that the session existed (`session_seen:<sid>`) until one call
//! is told (docs/architecture.md, "Redis keys").

use std::time::{Duration, Instant};

use mcpgw_testkit::fleet::{MeshCerts, supervisor_flags, workers_of};
use mcpgw_testkit::http::{self, Response};
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{Gateway, RedisServer, eventually, python, python_script};
use serde_json::json;

/// Two hosts of one worker each, serving the stateful SDK server over stdio.
struct TwoHosts {
    redis: RedisServer,
    gateways: Vec<Gateway>,
    _certs: MeshCerts,
}

impl TwoHosts {
    fn start(extra: &[&str]) -> TwoHosts {
        let redis = RedisServer::start();
        let certs = MeshCerts::create(&["host-a", "host-b"]);
        let upstream = format!(
            "counter=stdio:{} {} stdio",
            python().display(),
            python_script("stateful_server.py").display()
        );
        let gateways = ["host-a", "host-b"]
            .iter()
            .map(|member| {
                let mut args = supervisor_flags(&redis.url(), 1, "tcp", &certs, member);
                args.extend(["--upstream".into(), upstream.clone()]);
                args.extend(["--lease-ms".into(), "3000".into()]);
                args.extend(extra.iter().map(|s| s.to_string()));
                let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                Gateway::start(&refs)
            })
            .collect();
        TwoHosts {
            redis,
            gateways,
            _certs: certs,
        }
    }

    fn addr(&self, host: usize) -> &str {
        &self.gateways[host].addr
    }

    /// The id and pid of host `host`'s worker now.
    fn worker(&self, host: usize) -> (String, u32) {
        let workers = workers_of(&self.redis, self.gateways[host].pid());
        workers
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("host {host} has no live worker"))
    }

    /// Waits until the directory is older than a lease (3 s here), so a missing record
    /// proves absence.
    fn wait_settled(&self) {
        eventually(Duration::from_secs(60), || {
            let generation = self.redis.command(&["GET", "mcpgw:generation"]);
            let born: u64 = generation
                .rsplit_once('@')
                .and_then(|(_, ms)| ms.parse().ok())
                .ok_or(format!("no generation yet: {generation:?}"))?;
            let time = self.redis.command(&["TIME"]);
            let mut parts = time.split_whitespace();
            let secs: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
            let micros: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
            let age = (secs * 1000 + micros / 1000).saturating_sub(born);
            (age > 3000)
                .then_some(())
                .ok_or(format!("directory {age} ms old"))
        });
    }

    /// The shared session's record in the directory: its owner, if any.
    fn shared_owner(&self) -> Option<String> {
        let keys = self.redis.keys("mcpgw:pool_owner:shared-*");
        keys.first()
            .map(|key| self.redis.command(&["GET", key]))
            .filter(|owner| !owner.is_empty())
    }
}

/// One 2026-07-28 `tools/call` (anonymous: public routes share one session per
/// route) through `addr`.
fn call(addr: &str, tool: &str) -> Response {
    let body = http::modern_body(1, "tools/call", json!({"name": tool, "arguments": {}}));
    http::request(
        addr,
        "POST",
        "/mcp",
        &http::modern_headers("tools/call", Some(tool)),
        &body,
    )
}

fn count(addr: &str) -> Response {
    call(addr, "counter_increment")
}

/// A `counter_increment` through `addr`; no HTTP answer (refused: a worker starting)
/// is an `Err`.
fn try_count(addr: &str) -> Result<Response, String> {
    let tool = "counter_increment";
    let body = http::modern_body(1, "tools/call", json!({"name": tool, "arguments": {}}));
    let headers = http::modern_headers("tools/call", Some(tool));
    http::try_request(addr, "POST", "/mcp", &headers, &body)
}

fn counted(response: &Response) -> String {
    assert_eq!(response.status, 200, "{}", response.text());
    response.expect_tool_text()
}

/// Calls until the answer is no longer a retryable 503 (the fleet may not know yet;
/// that tells the client nothing and runs nothing), printing what came before.
fn settled(addr: &str, what: &str) -> Response {
    let started = Instant::now();
    let mut unknown = 0;
    let answer = eventually(Duration::from_secs(60), || {
        let answer = count(addr);
        if answer.status == 503 && answer.json()["error"]["data"]["retryable"] == true {
            unknown += 1;
            return Err(answer.outcome());
        }
        Ok(answer)
    });
    eprintln!(
        "{what}: {} after {unknown} retryable 503s, {:?}",
        answer.outcome(),
        started.elapsed()
    );
    answer
}

/// The principal's first call, through host a. A brand-new directory is younger than a
/// lease, so it cannot prove the session absent yet (it may have been rebuilt and
/// lost it): until then the call is a retryable 503.
fn opened(hosts: &TwoHosts) {
    let first = settled(hosts.addr(0), "the first call in a new fleet");
    assert_eq!(counted(&first), "1");
}

/// The first call after the loss is told, with the wording a 2026-07-28 client
/// needs; the second starts at 1; both through `addr`.
fn told_once_then_fresh(hosts: &TwoHosts, addr: &str, what: &str) {
    let told = settled(addr, what);
    assert_eq!(
        told.outcome(),
        "404 session_gone",
        "{what}: {}",
        told.text()
    );
    assert_eq!(told.error_code(), Some(-32001));
    let message = told.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(
        message.contains("your next request starts a new one, without that state"),
        "{what}: {message}"
    );
    // (A directory rebuilt less than a lease ago cannot prove it absent yet: 503.)
    let fresh = settled(addr, "the call after");
    assert_eq!(counted(&fresh), "1", "{what}: the call after starts afresh");
    // Told once fleet-wide: the other host does not tell it again.
    let other = if addr == hosts.addr(0) {
        hosts.addr(1)
    } else {
        hosts.addr(0)
    };
    // (Its worker may be a replacement still starting: wait until it answers.)
    let next = eventually(Duration::from_secs(60), || try_count(other));
    assert_eq!(
        counted(&next),
        "2",
        "{what}: the other host goes on with the fresh session"
    );
}

#[test]
fn an_idle_expired_shared_session_is_told_once_through_another_worker() {
    let hosts = TwoHosts::start(&["--session-idle-timeout-ms", "2000"]);
    opened(&hosts);
    for expected in ["2", "3"] {
        assert_eq!(counted(&count(hosts.addr(0))), expected);
    }
    let (owner, _) = hosts.worker(0);
    assert_eq!(hosts.shared_owner().as_deref(), Some(owner.as_str()));
    // Its end is recorded when the owner expires it: its directory record goes.
    let started = Instant::now();
    eventually(Duration::from_secs(30), || match hosts.shared_owner() {
        None => Ok(()),
        Some(owner) => Err(format!("still recorded for {owner}")),
    });
    eprintln!("expired after {:?}", started.elapsed());
    told_once_then_fresh(&hosts, hosts.addr(1), "after idle expiry, through host b");
}

#[test]
fn a_shared_session_whose_owner_died_is_told_once_after_another_request_reclaims_it() {
    let hosts = TwoHosts::start(&[]);
    opened(&hosts);
    for expected in ["2", "3"] {
        assert_eq!(counted(&count(hosts.addr(0))), expected);
    }
    // A legacy session on the same worker: its request through host b proves the
    // death and reclaims everything the dead worker held, the shared session too.
    let legacy = http::initialize(hosts.addr(0), "/mcp");
    let (dead, pid) = hosts.worker(0);
    signal::send(pid, Signal::SIGKILL);
    let gone = eventually(Duration::from_secs(60), || {
        let answer = http::call_tool(hosts.addr(1), "/mcp", &legacy, 2, "pid", json!({}));
        match answer.status {
            404 => Ok(answer),
            _ => Err(answer.outcome()),
        }
    });
    assert_eq!(gone.outcome(), "404 session_gone", "{}", gone.text());
    assert_eq!(
        hosts.shared_owner(),
        None,
        "reclaimed with {dead}'s sessions"
    );
    told_once_then_fresh(&hosts, hosts.addr(1), "after the owner's death and reclaim");
}

#[test]
fn a_shared_session_swept_with_its_dead_owner_is_told_once() {
    let dir = std::env::temp_dir().join(format!("mcpgw-shared-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("mcpgw.toml");
    std::fs::write(&config, "[fleet]\nsweep_interval_ms = 500\n").expect("config");
    let hosts = TwoHosts::start(&["--config", &config.display().to_string()]);
    opened(&hosts);
    assert_eq!(counted(&count(hosts.addr(0))), "2");
    let (dead, pid) = hosts.worker(0);
    signal::send(pid, Signal::SIGKILL);
    // No request touches it: the sweeper frees the dead worker's keys.
    let started = Instant::now();
    eventually(Duration::from_secs(60), || match hosts.shared_owner() {
        None => Ok(()),
        Some(owner) => Err(format!("still recorded for {owner}")),
    });
    eprintln!(
        "{dead}'s shared session swept after {:?}",
        started.elapsed()
    );
    told_once_then_fresh(&hosts, hosts.addr(1), "after the sweep");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory that restarted empty forgot the record and the memory of it: until the
/// owner registered again and re-claimed its sessions (within a lease) a missing
/// record is unknown, so the other host answers a retryable 503, never a fresh
/// session; then the session goes on where it was (it never ended: nothing to tell).
#[test]
fn a_directory_restarted_empty_never_makes_a_live_shared_session_fresh() {
    let hosts = TwoHosts::start(&[]);
    opened(&hosts);
    for expected in ["2", "3"] {
        assert_eq!(counted(&count(hosts.addr(0))), expected);
    }
    hosts.redis.restart_empty();
    let next = settled(hosts.addr(1), "after Redis restarted empty, through host b");
    assert_eq!(counted(&next), "4", "the owner's session goes on");
    assert_eq!(counted(&count(hosts.addr(0))), "5");
    // And its end is still told once: the rebuilt directory remembers it again.
    let (_, pid) = hosts.worker(0);
    let legacy = http::initialize(hosts.addr(0), "/mcp");
    signal::send(pid, Signal::SIGKILL);
    eventually(Duration::from_secs(60), || {
        let answer = http::call_tool(hosts.addr(1), "/mcp", &legacy, 2, "pid", json!({}));
        (answer.status == 404).then_some(()).ok_or(answer.outcome())
    });
    told_once_then_fresh(&hosts, hosts.addr(1), "after the rebuilt owner died");
}

/// Redis stops answering while the principal's first call opens the shared session
/// (paused once its stdio process has started, so the lookup before it was answered
/// and the claim after it is not): the call gets a retryable 503 (nothing ran), and
/// when Redis answers again the calls work through either host, however late the
/// unanswered claim landed.
#[test]
fn a_claim_that_redis_did_not_answer_leaves_no_principal_locked_out() {
    let hosts = TwoHosts::start(&[]);
    hosts.wait_settled();
    let (_, worker) = hosts.worker(0);
    let opening = std::thread::spawn({
        let addr = hosts.addr(0).to_owned();
        move || count(&addr)
    });
    eventually(Duration::from_secs(60), || {
        (!mcpgw_testkit::process::children_of(worker).is_empty())
            .then_some(())
            .ok_or("no stdio process started yet")
    });
    let first = {
        let _paused = hosts.redis.pause();
        let answer = opening.join().expect("the opening call");
        std::thread::sleep(Duration::from_millis(200));
        answer
    };
    eprintln!("the first call while Redis was paused: {}", first.text());
    assert_eq!(
        first.outcome(),
        "503 directory_unavailable",
        "{}",
        first.text()
    );
    assert_eq!(first.json()["error"]["data"]["retryable"], true);
    let through_b = settled(hosts.addr(1), "through host b after Redis came back");
    assert_eq!(counted(&through_b), "1", "nothing of the first call ran");
    // (Leases renewed late during the pause may still be in doubt for a moment: 503.)
    assert_eq!(counted(&settled(hosts.addr(0), "through host a")), "2");
    assert_eq!(
        counted(&settled(hosts.addr(1), "through host b again")),
        "3"
    );
}
