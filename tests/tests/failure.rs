//! Truthful failure (docs: the decision table, and the README's "What clients see" and
//! "When workers, hosts or Redis fail") with real processes: owners killed, paused
//! past and within their lease, killed mid-request, replaced at their address; Redis
//! paused and restarted empty; workers and supervisors drained. A session-bearing
//! request is answered by its owner or with an error that tells the truth (status and
//! `data.reason`); never by a fresh session.
//!
//! The tests of a session's end run with `--adopt never`: they show how a session that
//! does not go on is told so (a stdio session's end looks the same). Sessions that
//! outlive their owner are tests/tests/adoption.rs.
//!
//! No test here waits a guessed time: each polls for the condition it needs, with a
//! deadline that only catches a hang. Where a fault must last (Redis paused past the
//! lease), the duration is the fault, not synchronisation.

use std::thread;
use std::time::{Duration, Instant};

use mcpgw_testkit::fleet::{FLEET_CHANGE_WITHIN, LocalFleet, PREFIX, owner_of, recorded_owner};
use mcpgw_testkit::http::{self, call_tool, initialize, try_call_tool};
use mcpgw_testkit::signal::{self, Paused, Signal};
use mcpgw_testkit::{ScatterProxy, eventually};
use mcpgw_tests::load::{Load, Outcome, assert_truthful, every_session_progressed};
use serde_json::json;

/// Bound for every wait below: generous, so that only a hang fails a test.
const WITHIN: Duration = FLEET_CHANGE_WITHIN;

/// A forward timeout no test waits for: an answer that comes while a test still runs
/// was decided by proof or a lease, never by this timeout.
const NEVER: &str = "600000";

fn owner(session: &str) -> String {
    owner_of(session)
}

fn sessions_on(proxy: &ScatterProxy, n: usize) -> Vec<String> {
    (0..n).map(|_| initialize(&proxy.addr, "/mcp")).collect()
}

fn proxy_for(fleet: &LocalFleet) -> ScatterProxy {
    ScatterProxy::start(vec![fleet.a.addr.clone(), fleet.b.addr.clone()])
}

/// The answers an unconfirmable owner gets: 503, `Retry-After: 1`, retryable.
fn assert_unknown(o: &Outcome) {
    assert_eq!(o.status, 503, "{o:?}");
    assert!(
        matches!(o.detail.as_str(), "ownership_unknown" | "lease_in_doubt"),
        "503 says why: {o:?}"
    );
    assert_eq!(o.retry_after.as_deref(), Some("1"), "{o:?}");
}

#[test]
fn killing_an_owner_answers_its_sessions_truthfully_and_spares_the_rest() {
    killing_an_owner("quic", &[]);
}

/// The same over the same-host path: a killed owner leaves its socket file with no
/// listener, and a connect refused there proves it dead as a refused TCP port does.
#[test]
fn killing_an_owner_reached_over_the_same_host_path_proves_it_dead() {
    let sockets = tempfile::tempdir().expect("socket dir");
    let dir = sockets.path().to_str().expect("utf-8 path");
    killing_an_owner(
        "tcp",
        &["--mesh-same-host", "unix", "--mesh-socket-dir", dir],
    );
}

/// A lease no test waits out: a dead owner's sessions are told gone within the test
/// only on proof of its death (its address refuses), never by its lease expiring.
const LONG_LEASE_MS: u64 = 60_000;

fn killing_an_owner(transport: &str, extra: &[&str]) {
    let lease_ms = LONG_LEASE_MS.to_string();
    let mut flags = vec![
        "--forward-timeout-ms",
        NEVER,
        "--adopt",
        "never",
        "--lease-ms",
        &lease_ms,
    ];
    flags.extend_from_slice(extra);
    let fleet = LocalFleet::start(transport, 2, &flags);
    let proxy = proxy_for(&fleet);
    let sessions = sessions_on(&proxy, 12);
    let victim = owner(&sessions[0]);
    let victim_pid = fleet.pid_of(&victim);
    let supervisor = signal::parent_of(victim_pid).expect("the victim's supervisor");
    let load = Load::through(&proxy.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let socket_dir = extra
        .iter()
        .position(|flag| *flag == "--mesh-socket-dir")
        .and_then(|at| extra.get(at + 1));
    if socket_dir.is_some() {
        let unix_calls: usize = mcpgw_testkit::fleet::leases(&fleet.redis)
            .keys()
            .map(|id| {
                let admin = mcpgw_testkit::admin::admin_of(&fleet.redis, id);
                mcpgw_testkit::admin::links_on(&admin, "caller", "unix")
            })
            .sum();
        assert!(
            unix_calls > 0,
            "the load is forwarded over the same-host path"
        );
    }
    signal::send(victim_pid, Signal::SIGKILL);
    // Once the process is gone (not just a zombie), its sockets are closed: from here
    // on no request can reach it.
    signal::wait_until_gone(victim_pid, WITHIN);
    let killed_at = Instant::now();
    if let Some(dir) = socket_dir {
        // Killed, it could not remove its socket: a connect there is refused, which is
        // the proof the callers act on.
        let socket = std::path::Path::new(dir).join(format!("{victim}.sock"));
        assert!(socket.exists(), "{} stays behind", socket.display());
    }
    let (mine, others): (Vec<String>, Vec<String>) =
        sessions.iter().cloned().partition(|s| owner(s) == victim);
    // Each of the victim's sessions has been told it is gone, and every other session
    // kept working after the kill.
    load.wait_until(|outcomes| {
        let untold: Vec<&String> = mine
            .iter()
            .filter(|s| {
                !outcomes.iter().any(|o| {
                    &o.session == *s
                        && o.started > killed_at
                        && (o.status, o.detail.as_str()) == (404, "session_gone")
                })
            })
            .collect();
        if !untold.is_empty() {
            return Err(format!("not yet told gone: {untold:?}"));
        }
        every_session_progressed(&others, 3, killed_at)(outcomes)
    });
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
                match o.status {
                    // session_not_found: the race that
                    // a_session_reclaimed_by_another_worker_is_gone_everywhere shows.
                    404 => assert!(
                        matches!(o.detail.as_str(), "session_gone" | "session_not_found"),
                        "{o:?}"
                    ),
                    502 => assert_eq!(o.detail, "outcome_unknown", "{o:?}"),
                    503 => assert_unknown(o),
                    _ => panic!("a dead owner's session gets a documented error only: {o:?}"),
                }
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
    // Not a speed target: an ordering against the lease. Only the proof of death can
    // answer before half the lease; its expiry could not have.
    let lease = Duration::from_millis(LONG_LEASE_MS);
    assert!(
        first < lease / 2,
        "the first truthful answer came {first:?} after the kill, not well before the \
         {lease:?} lease could expire: death was not proven"
    );
    for session in &mine {
        let last = outcomes
            .iter()
            .rev()
            .find(|o| &o.session == session)
            .expect("victim sessions were exercised");
        assert_eq!(last.status, 404, "in the end the session is gone: {last:?}");
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    // The supervisor replaced the dead worker, under a new id.
    let workers = eventually(WITHIN, || {
        let now = mcpgw_testkit::fleet::workers_of(&fleet.redis, supervisor);
        if now.len() == 2 { Ok(now) } else { Err(now) }
    });
    assert!(!workers.contains_key(&victim), "{workers:?}");
}

/// The seed's failure: a stateful call on a session whose owner is gone must never
/// be served on a fresh session with 200. Also: the gone status can be 409.
#[test]
fn a_stateful_call_on_a_lost_session_never_returns_200() {
    let fleet = LocalFleet::start(
        "tcp",
        1,
        &["--session-gone-status", "409", "--adopt", "never"],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let first = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "session_append",
        json!({"item": "a"}),
    );
    assert_eq!(first.status, 200, "{}", first.text());
    let pid = fleet.pid_of(&owner(&session));
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    for id in 3..8 {
        let r = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            id,
            "session_append",
            json!({"item": "b"}),
        );
        // A request written on the pooled connection to the dead owner may be "outcome
        // unknown"; anything else is "gone" with the configured status.
        assert!(
            matches!(
                r.outcome().as_str(),
                "409 session_gone" | "502 outcome_unknown"
            ),
            "never a fresh session: {} {}",
            r.outcome(),
            r.text()
        );
        let read = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            id + 100,
            "session_read",
            json!({}),
        );
        assert_ne!(read.status, 200, "{}", read.text());
    }
    let r = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        9,
        "session_read",
        json!({}),
    );
    assert_eq!(r.outcome(), "409 session_gone", "{}", r.text());
    let error = r.error().unwrap_or_default();
    assert_eq!(error["code"], -32001);
    assert_eq!(error["data"]["retryable"], false);
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("initialize"),
        "tells the client what to do: {message}"
    );
}

/// README: "owner died after the request was sent to it: 502, outcome_unknown; it was
/// not re-run elsewhere". The owner is killed while the upstream executes the call.
#[test]
fn an_owner_lost_mid_request_gets_502_and_the_call_is_never_rerun_quic() {
    owner_lost_mid_request("quic");
}

#[test]
fn an_owner_lost_mid_request_gets_502_and_the_call_is_never_rerun_tcp() {
    owner_lost_mid_request("tcp");
}

fn owner_lost_mid_request(transport: &str) {
    let fleet = LocalFleet::start(
        transport,
        1,
        &["--forward-timeout-ms", NEVER, "--adopt", "never"],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let warm = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(warm.status, 200, "{}", warm.text());
    let owner_pid = fleet.pid_of(&owner(&session));
    let before = fleet.upstream.counter("tool_calls");
    let call = {
        let (addr, session) = (fleet.b.addr.clone(), session.clone());
        thread::spawn(move || try_call_tool(&addr, &session, 3, "sleep_ms", json!({"ms": 120_000})))
    };
    // The owner forwarded the call upstream and waits for its answer.
    eventually(WITHIN, || {
        let now = fleet.upstream.counter("tool_calls");
        if now > before { Ok(()) } else { Err(now) }
    });
    signal::send(owner_pid, Signal::SIGKILL);
    let lost = match call.join() {
        Ok(answer) => answer.expect("an HTTP answer from host-b"),
        Err(panic) => std::panic::resume_unwind(panic),
    };
    assert_eq!(lost.outcome(), "502 outcome_unknown", "{}", lost.text());
    let error = lost.error().unwrap_or_default();
    assert_eq!(lost.json()["id"], 3, "answers the request it was sent");
    assert_eq!(error["data"]["retryable"], false, "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("not re-executed"),
        "says it was not re-run: {message}"
    );
    // From now on the session is gone (its owner is proven dead), and nothing ran the
    // call again: the upstream executed it exactly once.
    let gone = eventually(WITHIN, || {
        let r = try_call_tool(&fleet.b.addr, &session, 4, "session_read", json!({}))?;
        if r.status == 404 {
            Ok(r)
        } else {
            Err(r.outcome())
        }
    });
    assert_eq!(gone.outcome(), "404 session_gone", "{}", gone.text());
    assert_eq!(
        fleet.upstream.counter("tool_calls"),
        before + 1,
        "the lost call ran once, upstream, and was never re-run elsewhere"
    );
}

/// A request sent to an owner that then stops answering within its lease may run when
/// the owner wakes: the answer is "outcome unknown, the session goes on", never a
/// retryable 503 (a client retrying a counter on a 503 would count twice).
#[test]
fn an_owner_paused_within_its_lease_gets_outcome_unknown_then_serves_again() {
    let fleet = LocalFleet::start(
        "quic",
        1,
        &["--lease-ms", "20000", "--forward-timeout-ms", "1000"],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let call = call_while_owner_paused(&fleet, &session);
    let paused = &call.answer;
    eprintln!(
        "paused owner answered {} in {:?}",
        paused.outcome(),
        call.took
    );
    assert_eq!(paused.outcome(), "502 outcome_unknown", "{}", paused.text());
    assert!(
        call.lease_held,
        "the owner's lease was gone when it was answered: not within its lease"
    );
    let data = &paused.json()["error"]["data"];
    assert_eq!(data["retryable"], false, "{data}");
    assert_eq!(data["session_may_continue"], true, "{data}");
    assert_eq!(paused.header("retry-after"), None);
    // After SIGCONT the session works again, with its state: the counter goes on
    // from the first call's 1 (the paused call may or may not have run meanwhile).
    let value = eventually(WITHIN, || {
        let r = try_call_tool(&fleet.b.addr, &session, 4, "counter_increment", json!({}))?;
        assert_ne!(r.status, 404, "a paused owner's session is not gone");
        if r.status == 200 {
            Ok(r.expect_tool_text())
        } else {
            Err(r.outcome())
        }
    });
    assert!(
        matches!(value.as_str(), "2" | "3"),
        "the same session, not a fresh one: {value}"
    );
}

/// Fencing and proof by an expired lease: an owner paused past its lease is declared
/// dead; once resumed it finds its lease taken, drops its sessions and exits, and its
/// supervisor starts a replacement under a new id. Every worker then says "gone".
#[test]
fn an_owner_paused_past_its_lease_is_fenced_and_replaced_and_everyone_says_gone() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "2000", "--adopt", "never"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let ok = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    let fenced = owner(&session);
    let pid = fleet.pid_of(&fenced);
    let paused = Paused::stop(pid);
    // Requests wait on the silent owner until its lease expires in Redis: one that was
    // sent to it gets "outcome unknown"; from then on the session is gone.
    let mut answers = Vec::new();
    let gone = eventually(WITHIN, || {
        let r = try_call_tool(&fleet.b.addr, &session, 3, "counter_increment", json!({}))?;
        answers.push(r.outcome());
        match r.outcome().as_str() {
            "404 session_gone" => Ok(r),
            "502 outcome_unknown" => Err(r.outcome()),
            other => panic!(
                "only the truth while the owner is silent: {other}: {}",
                r.text()
            ),
        }
    });
    eprintln!("while paused: {answers:?}");
    assert_eq!(gone.json()["error"]["data"]["retryable"], false);
    assert!(
        !fleet.leases().contains_key(&fenced),
        "the dead worker's lease was reclaimed"
    );
    paused.resume();
    // The resumed worker learns it was declared dead and exits; host-a's supervisor
    // starts a replacement under a new id.
    signal::wait_until_gone(pid, WITHIN);
    let replacement = eventually(WITHIN, || {
        let now = fleet.workers_of(&fleet.a);
        now.into_iter()
            .next()
            .ok_or("no live worker under host-a yet")
    });
    assert_ne!(replacement.0, fenced, "a new id");
    assert_ne!(replacement.1, pid, "a new process");
    for (i, addr) in [&fleet.a.addr, &fleet.b.addr, &fleet.a.addr, &fleet.b.addr]
        .iter()
        .enumerate()
    {
        let r = eventually(WITHIN, || {
            try_call_tool(
                addr,
                &session,
                10 + i as u64,
                "counter_increment",
                json!({}),
            )
        });
        assert_eq!(r.outcome(), "404 session_gone", "via {addr}: {}", r.text());
    }
}

/// README: "an owner acts for its sessions only while its lease is valid by its own
/// clock". Redis stops answering; once the owner's own deadline passes it answers
/// 503 `lease_in_doubt` and runs nothing until it has renewed.
#[test]
fn an_owner_that_cannot_renew_its_lease_answers_lease_in_doubt_and_runs_nothing() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "2000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let call = |id| try_call_tool(&fleet.a.addr, &session, id, "counter_increment", json!({}));
    let first = call(2).expect("answer");
    assert_eq!(first.expect_tool_text(), "1");
    let mut last_value: u64 = 1;
    let paused = fleet.redis.pause();
    let doubt = eventually(WITHIN, || {
        let r = call(3)?;
        match r.status {
            // Still within its lease by its own clock.
            200 => {
                last_value = r.expect_tool_text().parse().expect("a counter");
                Err("still acting within the lease".to_owned())
            }
            _ => Ok(r),
        }
    });
    assert_eq!(doubt.outcome(), "503 lease_in_doubt", "{}", doubt.text());
    assert_eq!(doubt.header("retry-after"), Some("1"));
    assert_eq!(doubt.json()["error"]["data"]["retryable"], true);
    paused.resume();
    let after = eventually(WITHIN, || {
        let r = call(4)?;
        if r.status == 200 {
            Ok(r)
        } else {
            Err(r.outcome())
        }
    });
    assert_eq!(
        after.expect_tool_text(),
        (last_value + 1).to_string(),
        "the same session, and the refused calls did not run"
    );
}

/// Sessions on a fleet of one worker per host, each used once through both hosts, so
/// that every worker has the other's mesh address cached before Redis misbehaves.
///
/// Without the warm-up a worker that must look an owner up in the directory right
/// after Redis returns may find the owner's lease expired (or not yet re-registered)
/// before the owner renews it, and rightly declare it dead: README's "unless another
/// worker reclaimed it". That race is real; these tests check the other path, the one
/// where the owners carry on with their sessions.
fn warm_sessions(fleet: &LocalFleet, proxy: &ScatterProxy, n: usize) -> Vec<String> {
    let sessions = sessions_on(proxy, n);
    for session in &sessions {
        for addr in [&fleet.a.addr, &fleet.b.addr] {
            let r = call_tool(addr, "/mcp", session, 1, "session_read", json!({}));
            assert_eq!(r.status, 200, "warm-up via {addr}: {}", r.text());
        }
    }
    sessions
}

#[test]
fn redis_paused_past_the_lease_loses_no_session_and_admits_none() {
    let lease = Duration::from_secs(2);
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "2000"]);
    let proxy = proxy_for(&fleet);
    let sessions = warm_sessions(&fleet, &proxy, 8);
    let load = Load::through(&proxy.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 2, Instant::now()));
    let paused = fleet.redis.pause();
    let paused_at = Instant::now();
    // Owners stop acting once their own lease deadline passes: every session gets a 503.
    load.wait_until(|outcomes| {
        let serving: Vec<&String> = sessions
            .iter()
            .filter(|s| {
                !outcomes
                    .iter()
                    .any(|o| &o.session == *s && o.started > paused_at && o.status == 503)
            })
            .collect();
        if serving.is_empty() {
            Ok(())
        } else {
            Err(format!("not yet refused: {serving:?}"))
        }
    });
    // New sessions get 503 meanwhile, and no session is created for them.
    let refused = http::try_initialize(&proxy.addr, "/mcp").expect("an answer");
    assert_eq!(
        refused.outcome(),
        "503 directory_unavailable",
        "{}",
        refused.text()
    );
    assert!(refused.header("mcp-session-id").is_none());
    // The fault itself: Redis stays silent past the lease, so leases expire in Redis
    // and must be taken back afterwards.
    if let Some(rest) = (lease * 2).checked_sub(paused_at.elapsed()) {
        thread::sleep(rest);
    }
    paused.resume();
    let resumed_at = Instant::now();
    load.wait_until(every_session_progressed(&sessions, 2, resumed_at));
    let outcomes = load.finish();
    let unavailable = outcomes.iter().filter(|o| o.status == 503).count();
    eprintln!(
        "{} requests, {unavailable} answered 503 during the Redis pause",
        outcomes.len()
    );
    for o in &outcomes {
        match o.status {
            200 => {}
            503 => assert_unknown(o),
            _ => panic!("only 200 or 503: {o:?}"),
        }
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    for session in &sessions {
        assert_eq!(
            recorded_owner(&fleet.redis, session).as_deref(),
            Some(owner(session).as_str()),
            "{session} is still recorded for its owner"
        );
    }
    assert_eq!(
        fleet.redis.keys("mcpgw:pool_owner:*").len(),
        sessions.len(),
        "the refused initialize left no record"
    );
    eventually(WITHIN, || {
        let open = fleet.upstream.counter("sessions_open");
        if open == sessions.len() as u64 {
            Ok(())
        } else {
            Err(open)
        }
    });
}

/// README: "fleet directory unreachable at initialize: 503, directory_unavailable;
/// retry; no session was created", and for a worker that must ask the directory who
/// owns a session: "Redis unreachable: 503, Retry-After: 1, ownership_unknown".
#[test]
fn while_the_directory_is_unreachable_nothing_is_created_and_ownership_is_unknown() {
    let fleet = LocalFleet::start("quic", 1, &[]);
    // Opened on host-a and never used through host-b: host-b must ask the directory.
    let existing = initialize(&fleet.a.addr, "/mcp");
    let paused = fleet.redis.pause();
    let refused = http::try_initialize(&fleet.a.addr, "/mcp");
    let unknown = try_call_tool(&fleet.b.addr, &existing, 2, "counter_increment", json!({}));
    paused.resume();
    let refused = refused.expect("an answer to initialize");
    assert_eq!(
        refused.outcome(),
        "503 directory_unavailable",
        "{}",
        refused.text()
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert!(refused.header("mcp-session-id").is_none(), "no session id");
    assert_eq!(
        refused.error().unwrap_or_default()["data"]["retryable"],
        true
    );
    assert_eq!(refused.json()["id"], 1);
    let unknown = unknown.expect("an answer to the call");
    assert_eq!(
        unknown.outcome(),
        "503 ownership_unknown",
        "{}",
        unknown.text()
    );
    assert_eq!(unknown.header("retry-after"), Some("1"));
    assert_eq!(
        unknown.error().unwrap_or_default()["data"]["retryable"],
        true
    );
    // The upstream session opened for the refused initialize was ended. (That the
    // directory holds no record of it is checked by
    // `a_refused_initialize_leaves_no_record_in_the_directory`.)
    eventually(WITHIN, || {
        let open = fleet.upstream.counter("sessions_open");
        if open == 1 { Ok(()) } else { Err(open) }
    });
    assert_eq!(fleet.upstream.counter("sessions_created"), 2);
    assert_eq!(
        recorded_owner(&fleet.redis, &existing),
        Some(owner(&existing))
    );
    // Once the directory answers, the retry works and the old session goes on.
    let session = initialize(&fleet.a.addr, "/mcp");
    assert_eq!(
        recorded_owner(&fleet.redis, &session),
        Some(owner(&session))
    );
    let again = eventually(WITHIN, || {
        let r = try_call_tool(&fleet.b.addr, &existing, 3, "counter_increment", json!({}))?;
        if r.status == 200 {
            Ok(r)
        } else {
            Err(r.outcome())
        }
    });
    assert_eq!(
        again.expect_tool_text(),
        "1",
        "the refused call did not run"
    );
}

/// README: "fleet directory unreachable at initialize: … no session was created" —
/// in the directory too.
#[test]
fn a_refused_initialize_leaves_no_record_in_the_directory() {
    let fleet = LocalFleet::start("quic", 1, &[]);
    // A first session, as on any running fleet (it also loads the claim script into
    // Redis, so the queued claim can run when Redis answers again).
    let first = initialize(&fleet.a.addr, "/mcp");
    let paused = fleet.redis.pause();
    let refused = http::try_initialize(&fleet.a.addr, "/mcp").expect("an answer");
    paused.resume();
    assert_eq!(
        refused.outcome(),
        "503 directory_unavailable",
        "{}",
        refused.text()
    );
    // The next claim of the same worker travels on the same Redis connection, after
    // the refused one: once it is recorded, the refused one has run or never will.
    let session = initialize(&fleet.a.addr, "/mcp");
    let mut recorded = fleet.redis.keys("mcpgw:pool_owner:*");
    recorded.sort();
    let mut handed_out = vec![
        format!("mcpgw:pool_owner:{first}"),
        format!("mcpgw:pool_owner:{session}"),
    ];
    handed_out.sort();
    assert_eq!(
        recorded, handed_out,
        "only the sessions that were handed out are recorded"
    );
}

#[test]
fn redis_restarted_empty_loses_no_session() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "3000"]);
    let proxy = proxy_for(&fleet);
    let sessions = warm_sessions(&fleet, &proxy, 8);
    let load = Load::through(&proxy.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 2, Instant::now()));
    fleet.redis.restart_empty();
    let restarted_at = Instant::now();
    // The owners notice the new generation, register again and re-claim every session.
    eventually(WITHIN, || {
        let missing: Vec<&String> = sessions
            .iter()
            .filter(|s| recorded_owner(&fleet.redis, s) != Some(owner(s)))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(missing)
        }
    });
    load.wait_until(every_session_progressed(&sessions, 2, restarted_at));
    let outcomes = load.finish();
    for o in &outcomes {
        match o.status {
            200 => {}
            // Until the owners re-claimed them, missing records mean "unknown".
            503 => assert_unknown(o),
            _ => panic!("no session is lost to a forgetful Redis: {o:?}"),
        }
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    for session in &sessions {
        let tail = outcomes
            .iter()
            .rev()
            .find(|o| &o.session == session)
            .expect("exercised");
        assert_eq!(tail.status, 200, "{session} works after the rebuild");
    }
    // New sessions work again without a restart: recorded, and with their own state.
    let fresh = initialize(&proxy.addr, "/mcp");
    assert_eq!(recorded_owner(&fleet.redis, &fresh), Some(owner(&fresh)));
    let first = call_tool(
        &proxy.addr,
        "/mcp",
        &fresh,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(first.expect_tool_text(), "1");
}

#[test]
fn a_drained_worker_finishes_in_flight_requests_then_its_sessions_are_gone() {
    let fleet = LocalFleet::start("tcp", 2, &["--adopt", "never"]);
    let proxy = proxy_for(&fleet);
    let sessions = sessions_on(&proxy, 8);
    let victim = owner(&sessions[0]);
    let mine: Vec<String> = sessions
        .iter()
        .filter(|s| owner(s) == victim)
        .cloned()
        .collect();
    let open_before = fleet.upstream.counter("sessions_open");
    let calls_before = fleet.upstream.counter("tool_calls");
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
                try_call_tool(
                    &addr,
                    &session,
                    500 + i as u64,
                    "sleep_ms",
                    json!({"ms": 1500}),
                )
            })
        })
        .collect();
    let expected = calls_before + in_flight.len() as u64;
    eventually(WITHIN, || {
        let now = fleet.upstream.counter("tool_calls");
        if now >= expected { Ok(()) } else { Err(now) }
    });
    signal::send(fleet.pid_of(&victim), Signal::SIGTERM);
    for handle in in_flight {
        let r = match handle.join() {
            Ok(answer) => answer.expect("an HTTP answer"),
            Err(panic) => std::panic::resume_unwind(panic),
        };
        assert_eq!(r.status, 200, "in-flight requests finish: {}", r.text());
    }
    // Once drained, its sessions are ended upstream and in the directory, and gone.
    let gone = eventually(WITHIN, || {
        let r = try_call_tool(&proxy.addr, &mine[0], 900, "counter_increment", json!({}))?;
        match r.status {
            404 => Ok(r),
            200 => Err(r.outcome()),
            // The owner is draining: unknown until the session has ended.
            503 => {
                assert_eq!(
                    r.reason().as_deref(),
                    Some("ownership_unknown"),
                    "{}",
                    r.text()
                );
                Err(r.outcome())
            }
            _ => panic!("during the drain: {} {}", r.outcome(), r.text()),
        }
    });
    assert!(
        matches!(
            gone.reason().as_deref(),
            Some("session_not_found" | "session_gone")
        ),
        "{}",
        gone.text()
    );
    for session in &mine {
        assert_eq!(recorded_owner(&fleet.redis, session), None, "{session}");
    }
    eventually(WITHIN, || {
        let open = fleet.upstream.counter("sessions_open");
        if open == open_before - mine.len() as u64 {
            Ok(())
        } else {
            Err(open)
        }
    });
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
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// A drain can outlast the lease: the public port waits for its exchanges (here a
/// four-second call), and only then are the sessions handed over or ended. Through all
/// of it the owner still holds its sessions and keeps its lease, so a request for one
/// forwarded to it meanwhile is served, not refused as "owner in doubt". (Compose CI
/// found it: a draining owner whose lease lapsed mid-drain answered `Draining`, and
/// its edge told the client 503 `ownership_unknown`.)
#[test]
fn a_draining_owner_keeps_its_lease_and_serves_forwarded_requests_until_its_sessions_end() {
    let fleet = LocalFleet::start("tcp", 1, &["--lease-ms", "1500", "--adopt", "never"]);
    let sessions: Vec<String> = (0..2).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let victim = owner(&sessions[0]);
    assert_eq!(owner(&sessions[1]), victim, "host-a runs one worker");
    let victim_pid = fleet.pid_of(&victim);
    let admin = mcpgw_testkit::admin::admin_of(&fleet.redis, &victim);
    let lease_key = format!("{PREFIX}worker:{victim}");
    // Milliseconds the lease has left in the directory (negative: it is gone).
    let lease_left = || -> i64 {
        let pttl = fleet.redis.command(&["PTTL", &lease_key]);
        pttl.trim()
            .parse()
            .unwrap_or_else(|_| panic!("PTTL {lease_key}: {pttl:?}"))
    };
    let calls_before = fleet.upstream.counter("tool_calls");
    let slow = {
        let (addr, session) = (fleet.a.addr.clone(), sessions[0].clone());
        thread::spawn(move || {
            let answer = try_call_tool(&addr, &session, 2, "sleep_ms", json!({"ms": 4000}));
            (answer, Instant::now())
        })
    };
    eventually(WITHIN, || {
        let now = fleet.upstream.counter("tool_calls");
        if now > calls_before { Ok(()) } else { Err(now) }
    });
    signal::send(victim_pid, Signal::SIGTERM);
    // The lease's deadline as it stood when the drain began (a renewal since can only
    // have moved it later, which makes the wait below the longer).
    let left = lease_left();
    assert!(
        left > 0,
        "the owner holds its lease as it starts draining: {left}"
    );
    let original_deadline = Instant::now() + Duration::from_millis(left as u64);
    // The drain has begun (/readyz says so), and the lease's original deadline has
    // passed while the lease lives on: renewed by the draining owner, or Redis would
    // have expired it.
    eventually(WITHIN, || {
        let ready = http::request(&admin, "GET", "/readyz", &[], b"");
        if ready.status != 503 {
            return Err(format!("/readyz {}: not draining yet", ready.status));
        }
        if Instant::now() <= original_deadline {
            return Err("the lease's original deadline is still ahead".to_owned());
        }
        let left = lease_left();
        assert!(left > 0, "the draining owner let its lease lapse: {left}");
        Ok(())
    });
    let forwarded = call_tool(
        &fleet.b.addr,
        "/mcp",
        &sessions[1],
        3,
        "counter_increment",
        json!({}),
    );
    let forwarded_at = Instant::now();
    assert_eq!(forwarded.status, 200, "{}", forwarded.text());
    assert_eq!(forwarded.expect_tool_text(), "1");
    assert_eq!(
        forwarded.header("mcpgw-owner-worker"),
        Some(victim.as_str()),
        "served by its draining owner"
    );
    let (slow, slow_at) = match slow.join() {
        Ok(answer) => answer,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    let slow = slow.expect("an HTTP answer");
    assert_eq!(slow.status, 200, "{}", slow.text());
    assert!(
        forwarded_at < slow_at,
        "the forwarded request was served while the drain still waited for the slow call"
    );
    // Once the slow call is done, the drain ends the sessions and the worker exits.
    signal::wait_until_gone(victim_pid, WITHIN);
    assert!(
        !fleet.leases().contains_key(&victim),
        "the drained worker gave its lease up"
    );
}

/// README: "Drain (SIGTERM to a worker or the supervisor): the public port closes,
/// exchanges and forwarded requests in flight finish, then the sessions end upstream
/// and in the directory, so later requests for them get a fast 404."
#[test]
fn draining_the_supervisor_closes_the_port_and_ends_its_sessions() {
    let fleet = LocalFleet::start("tcp", 2, &["--adopt", "never"]);
    let mine: Vec<String> = (0..4).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let theirs = initialize(&fleet.b.addr, "/mcp");
    let a_workers = fleet.workers_of(&fleet.a);
    assert_eq!(a_workers.len(), 2);
    let calls_before = fleet.upstream.counter("tool_calls");
    let in_flight: Vec<_> = mine
        .iter()
        .enumerate()
        .map(|(i, session)| {
            // Half straight to host-a's port, half forwarded from host-b.
            let addr = if i % 2 == 0 {
                fleet.a.addr.clone()
            } else {
                fleet.b.addr.clone()
            };
            let session = session.clone();
            thread::spawn(move || {
                try_call_tool(&addr, &session, 50, "sleep_ms", json!({"ms": 1500}))
            })
        })
        .collect();
    let expected = calls_before + in_flight.len() as u64;
    eventually(WITHIN, || {
        let now = fleet.upstream.counter("tool_calls");
        if now >= expected { Ok(()) } else { Err(now) }
    });
    fleet.a.child.signal(Signal::SIGTERM);
    for handle in in_flight {
        let r = match handle.join() {
            Ok(answer) => answer.expect("an HTTP answer"),
            Err(panic) => std::panic::resume_unwind(panic),
        };
        assert_eq!(r.status, 200, "in-flight requests finish: {}", r.text());
    }
    mcpgw_testkit::wait_until_refused(&fleet.a.addr, WITHIN);
    let mut supervisor = fleet.a;
    assert_eq!(
        supervisor.child.wait_exit(WITHIN),
        Some(0),
        "a drained supervisor exits cleanly"
    );
    // Every session of host-a ended upstream and in the directory; its workers
    // deregistered.
    for session in &mine {
        assert_eq!(recorded_owner(&fleet.redis, session), None, "{session}");
    }
    let leases = mcpgw_testkit::fleet::leases(&fleet.redis);
    for id in a_workers.keys() {
        assert!(!leases.contains_key(id), "{id} deregistered: {leases:?}");
    }
    eventually(WITHIN, || {
        // Only host-b's session is still open upstream.
        let open = fleet.upstream.counter("sessions_open");
        if open == 1 { Ok(()) } else { Err(open) }
    });
    for (i, session) in mine.iter().enumerate() {
        let r = call_tool(
            &fleet.b.addr,
            "/mcp",
            session,
            60 + i as u64,
            "counter_increment",
            json!({}),
        );
        assert_eq!(r.status, 404, "{}", r.text());
        assert!(
            matches!(
                r.reason().as_deref(),
                Some("session_not_found" | "session_gone")
            ),
            "{}",
            r.text()
        );
    }
    let r = call_tool(
        &fleet.b.addr,
        "/mcp",
        &theirs,
        70,
        "counter_increment",
        json!({}),
    );
    assert_eq!(
        r.expect_tool_text(),
        "1",
        "host-b's own session is untouched"
    );
}

/// README: "session's owner provably gone (… reclaimed): 404, data.reason:
/// session_gone". Worker X proves the killed owner dead and reclaims its sessions;
/// worker Y still holds a pooled QUIC connection to the dead owner and sends the next
/// request on it.
#[test]
fn a_session_reclaimed_by_another_worker_is_gone_everywhere() {
    let never = ["--forward-timeout-ms", NEVER, "--adopt", "never"];
    let fleet = LocalFleet::start_hosts("quic", (2, &never), (1, &never));
    let session = initialize(&fleet.a.addr, "/mcp");
    let victim = owner(&session);
    // Host-b's one worker forwards once: it keeps a pooled connection to the owner.
    let warm = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(warm.status, 200, "{}", warm.text());
    let pid = fleet.pid_of(&victim);
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    // Host-a's port now reaches only the other host-a worker: it proves the owner dead
    // (its address refuses) and reclaims the session.
    let proven = call_tool(
        &fleet.a.addr,
        "/mcp",
        &session,
        3,
        "counter_increment",
        json!({}),
    );
    // Gone, proven by the refusal; or, when this worker still held a pooled connection
    // to the owner (initialize's notification went through it) and sent the request
    // on it before anyone knew, outcome unknown: it cannot tell whether the owner died
    // before or after the request reached it. Either way the owner is now reclaimed.
    assert!(
        matches!(
            proven.outcome().as_str(),
            "404 session_gone" | "502 outcome_unknown"
        ),
        "{}",
        proven.text()
    );
    assert_eq!(recorded_owner(&fleet.redis, &session), None);
    // A request that leaves within a millisecond or so of the reclaim cannot be told
    // apart from one that was already on its way (then 502 outcome_unknown is the
    // truth); this one leaves clearly after it.
    std::thread::sleep(Duration::from_millis(100));
    let pooled = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        4,
        "counter_increment",
        json!({}),
    );
    assert_eq!(pooled.outcome(), "404 session_gone", "{}", pooled.text());
}

/// README: "Other workers declare it dead only on proof: … or another worker answers
/// there." The owner is killed and its supervisor's replacement binds the same mesh
/// address under a new id, while the dead worker's lease is still alive in Redis: the
/// address answering as another worker is the proof.
#[test]
fn an_address_that_answers_as_another_worker_proves_the_owner_dead() {
    let mesh = format!("127.0.0.1:{}", mcpgw_testkit::free_udp_port());
    // A lease of 10 minutes: within this test, only the address can prove anything.
    let long_lease = ["--lease-ms", "600000", "--adopt", "never"];
    let fleet = LocalFleet::start_hosts(
        "quic",
        (
            1,
            &[
                long_lease[0],
                long_lease[1],
                long_lease[2],
                long_lease[3],
                "--mesh-listen",
                &mesh,
            ],
        ),
        (1, &long_lease),
    );
    // Initialized on host-a and never forwarded: host-b has no connection to it.
    let session = initialize(&fleet.a.addr, "/mcp");
    let dead = owner(&session);
    let dead_lease = fleet.leases().remove(&dead).expect("the owner's lease");
    assert_eq!(dead_lease.addr, mesh);
    signal::send(dead_lease.pid, Signal::SIGKILL);
    signal::wait_until_gone(dead_lease.pid, WITHIN);
    let replacement = fleet.replacement_at(&dead, &mesh);
    assert!(
        fleet.leases().contains_key(&dead),
        "the dead worker's lease is still alive: it proves nothing yet"
    );
    let r = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(r.outcome(), "404 session_gone", "{}", r.text());
    let detail = r.error().unwrap_or_default()["data"]["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        detail.contains(&replacement) && detail.contains("answers as worker"),
        "the proof is named: {detail}"
    );
    assert!(
        !fleet.leases().contains_key(&dead),
        "the proven-dead worker was reclaimed"
    );
    assert_eq!(recorded_owner(&fleet.redis, &session), None);
}

/// A QUIC fleet of one worker per host whose API keys are alice's and bob's (the
/// returned directory holds the keys file).
fn fleet_of_alice_and_bob() -> (LocalFleet, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "alice:alice-token-0123456789\nbob:bob-token-0123456789ab\n",
    )
    .expect("write tokens");
    let tokens_arg = tokens.display().to_string();
    let fleet = LocalFleet::start("quic", 1, &["--auth-tokens-file", &tokens_arg]);
    (fleet, dir)
}

/// A session belongs to the principal that created it: another principal using its
/// id, on the owner or through another worker, is answered as if it did not exist.
#[test]
fn another_principal_cannot_use_a_session() {
    let (fleet, _tokens) = fleet_of_alice_and_bob();
    let init = http::initialize_body(1);
    let headers = |token: &'static str, session: Option<&str>| {
        let mut h = vec![
            ("Content-Type", "application/json".to_owned()),
            ("Accept", "application/json, text/event-stream".to_owned()),
            ("Authorization", format!("Bearer {token}")),
        ];
        if let Some(s) = session {
            h.push(("Mcp-Session-Id", s.to_owned()));
            h.push(("MCP-Protocol-Version", http::LEGACY_VERSION.to_owned()));
        }
        h
    };
    let send = |addr: &str, token: &'static str, session: Option<&str>, body: &[u8]| {
        let h = headers(token, session);
        let refs: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        http::request(addr, "POST", "/mcp", &refs, body)
    };
    let opened = send(&fleet.a.addr, "alice-token-0123456789", None, &init);
    assert_eq!(opened.status, 200, "{}", opened.text());
    let session = opened
        .header("mcp-session-id")
        .expect("a session id")
        .to_owned();
    let call = http::tool_call_body(2, "counter_increment", json!({}));
    for addr in [&fleet.a.addr, &fleet.b.addr] {
        let mine = send(addr, "alice-token-0123456789", Some(&session), &call);
        assert_eq!(mine.status, 200, "alice via {addr}: {}", mine.text());
        let theirs = send(addr, "bob-token-0123456789ab", Some(&session), &call);
        assert_eq!(
            theirs.status,
            404,
            "bob via {addr} is told it does not exist: {}",
            theirs.text()
        );
        assert_eq!(theirs.error_code(), Some(-32001));
        // `data.reason` is checked by
        // `another_principal_is_told_session_not_found_with_its_reason`.
        let anonymous = http::request(
            addr,
            "POST",
            "/mcp",
            &[
                ("Content-Type", "application/json"),
                ("Mcp-Session-Id", &session),
            ],
            &call,
        );
        assert_eq!(
            anonymous.outcome(),
            "401 missing_token",
            "{}",
            anonymous.text()
        );
        assert!(anonymous.header("www-authenticate").is_some());
        let wrong = send(addr, "not-a-valid-token-at-all", Some(&session), &call);
        assert_eq!(wrong.outcome(), "401 invalid_token", "{}", wrong.text());
    }
    // Bob's attempts changed nothing: alice's counter went 1, 2, now 3.
    let third = send(
        &fleet.b.addr,
        "alice-token-0123456789",
        Some(&session),
        &call,
    );
    assert_eq!(third.expect_tool_text(), "3");
}

/// README: "session unknown or ended, or created by another principal: 404, -32001,
/// data.reason: session_not_found".
#[test]
fn another_principal_is_told_session_not_found_with_its_reason() {
    let (fleet, _tokens) = fleet_of_alice_and_bob();
    let bearer = |token: &str| format!("Bearer {token}");
    let alice = bearer("alice-token-0123456789");
    let bob = bearer("bob-token-0123456789ab");
    let opened = http::request(
        &fleet.a.addr,
        "POST",
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
            ("Authorization", &alice),
        ],
        &http::initialize_body(1),
    );
    let session = opened
        .header("mcp-session-id")
        .expect("a session id")
        .to_owned();
    for addr in [&fleet.a.addr, &fleet.b.addr] {
        let mut headers = http::mcp_headers(Some(&session));
        headers.push(("Authorization", &bob));
        let theirs = http::request(
            addr,
            "POST",
            "/mcp",
            &headers,
            &http::tool_call_body(2, "counter_increment", json!({})),
        );
        assert_eq!(
            theirs.outcome(),
            "404 session_not_found",
            "via {addr}: {}",
            theirs.text()
        );
    }
}

/// A host that goes silent (no refusal, no answer) is declared dead when its lease
/// expires, and a request waiting on it is answered then, not after the forward
/// timeout: that timeout (ten minutes) is longer than the test client waits for any
/// answer (two minutes), so an answer at all was not decided by it, and the owner's
/// lease is already gone from the directory when it comes.
#[test]
fn a_silent_owner_is_answered_once_its_lease_expires_not_at_the_forward_timeout() {
    let fleet = LocalFleet::start(
        "quic",
        1,
        &["--lease-ms", "3000", "--forward-timeout-ms", NEVER],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let paused = call_while_owner_paused(&fleet, &session);
    let r = &paused.answer;
    eprintln!(
        "silent owner: answered {} after {:?}",
        r.outcome(),
        paused.took
    );
    assert!(
        matches!(
            r.outcome().as_str(),
            "502 outcome_unknown" | "404 session_gone"
        ),
        "the truth once the lease expired: {} {}",
        r.outcome(),
        r.text()
    );
    assert!(
        !paused.lease_held,
        "answered while the silent owner's lease was still in the directory: {}",
        r.text()
    );
}

/// Opt-in: while a session's owner cannot be confirmed, session-independent methods
/// (ping, the list methods) are answered without the session; anything stateful
/// still gets the truthful error. (A long lease: the owner is paused twice, and must
/// not be declared dead meanwhile.)
#[test]
fn idempotent_methods_may_be_answered_statelessly_while_ownership_is_unknown() {
    let fleet = LocalFleet::start(
        "quic",
        1,
        &[
            "--lease-ms",
            "60000",
            "--forward-timeout-ms",
            "1000",
            "--stateless-when-unknown",
        ],
    );
    let session = initialize(&fleet.a.addr, "/mcp");
    let pid = fleet.pid_of(&owner(&session));
    let paused = Paused::stop(pid);
    let send = |id: u64, method: &str| {
        http::request(
            &fleet.b.addr,
            "POST",
            "/mcp",
            &http::mcp_headers(Some(&session)),
            &http::rpc_body(id, method, json!({})),
        )
    };
    let listed = send(7, "tools/list");
    let pinged = send(8, "ping");
    let stateful = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        9,
        "counter_increment",
        json!({}),
    );
    paused.resume();
    assert_eq!(listed.status, 200, "{}", listed.text());
    assert_eq!(listed.header("mcpgw-stateless"), Some("1"));
    let tools = &listed.messages()[0]["result"]["tools"];
    assert!(tools.as_array().is_some_and(|t| !t.is_empty()), "{tools}");
    assert_eq!(listed.messages()[0]["id"], 7);
    assert_eq!(pinged.status, 200, "{}", pinged.text());
    assert_eq!(pinged.header("mcpgw-stateless"), Some("1"));
    assert_eq!(pinged.messages()[0]["id"], 8);
    assert_eq!(
        pinged.messages()[0]["result"],
        json!({}),
        "{}",
        pinged.text()
    );
    // The frozen owner never took a connection, so the call was not sent: "retry".
    assert_eq!(
        stateful.outcome(),
        "503 ownership_unknown",
        "stateful calls are never answered without the session: {}",
        stateful.text()
    );
    // Now with a connection to the owner: requests sent to it and then left without
    // an answer. The list method is still answered without the session (running it
    // twice is harmless); the stateful call may run when the owner wakes, so it is
    // "outcome unknown" with the session kept, never "retry".
    let warm = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        10,
        "counter_increment",
        json!({}),
    );
    assert_eq!(warm.status, 200, "{}", warm.text());
    let paused = Paused::stop(pid);
    let listed = send(11, "tools/list");
    let stateful = call_tool(
        &fleet.b.addr,
        "/mcp",
        &session,
        12,
        "counter_increment",
        json!({}),
    );
    paused.resume();
    assert_eq!(listed.status, 200, "{}", listed.text());
    assert_eq!(listed.header("mcpgw-stateless"), Some("1"));
    assert_eq!(listed.messages()[0]["id"], 11);
    assert_eq!(
        stateful.outcome(),
        "502 outcome_unknown",
        "{}",
        stateful.text()
    );
    assert_eq!(
        stateful.json()["error"]["data"]["session_may_continue"],
        true,
        "{}",
        stateful.text()
    );
    // The temporary upstream sessions were ended again: only the real one is open.
    eventually(WITHIN, || {
        let open = fleet.upstream.counter("sessions_open");
        if open == 1 { Ok(()) } else { Err(open) }
    });
}

/// A call made while its session's owner was stopped, and what held when it was
/// answered.
struct PausedCall {
    answer: http::Response,
    took: Duration,
    /// Whether the owner's lease was still in the directory right after the answer
    /// (read before the owner is resumed, so it cannot have renewed meanwhile).
    lease_held: bool,
}

/// One stateful call through host-b while the session's owner is stopped (SIGSTOP),
/// after a first call proved the session works; the owner is resumed afterwards,
/// also when the call fails the test.
fn call_while_owner_paused(fleet: &LocalFleet, session: &str) -> PausedCall {
    let ok = call_tool(
        &fleet.b.addr,
        "/mcp",
        session,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(ok.expect_tool_text(), "1");
    let owner = owner(session);
    let paused = Paused::stop(fleet.pid_of(&owner));
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
    let lease_held = fleet
        .redis
        .get(&format!("{PREFIX}worker:{owner}"))
        .is_some();
    paused.resume();
    PausedCall {
        answer,
        took,
        lease_held,
    }
}
