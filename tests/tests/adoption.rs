//! Session adoption (issue #23): an HTTP upstream's session outlives its owner worker.
//! When the owner is proven dead (kill -9, or paused past its lease) the next request
//! for the session, on any worker, adopts it: exactly one worker becomes the new owner
//! and the upstream session goes on with its state. When the owner drains, it hands its
//! sessions over instead of ending them. What cannot continue still ends truthfully: a
//! stdio session (its process died with its worker) and a session its upstream forgot
//! get `session_gone`, never a fresh session behind the old id.
//!
//! Every test loads real processes: Redis, two supervisors on a TCP mesh, the demo
//! upstream (whose `counter_increment` shows whether a session kept its state) and,
//! for stdio, the Python SDK's stateful server. No test waits a guessed time: each
//! polls for the condition it needs, with a deadline that only catches a hang.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use mcpgw_testkit::admin::{admin_of, scrape};
use mcpgw_testkit::fleet::{
    FLEET_CHANGE_WITHIN, LocalFleet, MeshCerts, SupervisorSpec, owner_of, start_supervisor,
};
use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::process::Child;
use mcpgw_testkit::scatter::BACKEND_REFUSED;
use mcpgw_testkit::signal::{self, Paused, Signal};
use mcpgw_testkit::{RedisServer, Upstream, eventually, python, python_script};
use mcpgw_tests::load::{
    Load, Outcome, assert_truthful, every_session_progressed, every_session_progressed_or_gone,
};
use serde_json::json;

/// Bound for every wait below: generous, so that only a hang fails a test.
const WITHIN: Duration = FLEET_CHANGE_WITHIN;

/// The header on the one answer whose request adopted its session.
const ADOPTED: &str = "mcpgw-adopted";

/// Sessions of one owner: enough that several race to be adopted at once, few enough
/// that their load threads leave the two cores to the fleet.
const SESSIONS: usize = 8;

/// A short lease, so that an owner paused past it is declared dead within the test.
const SHORT_LEASE: [&str; 2] = ["--lease-ms", "2000"];

fn owner(session: &str) -> String {
    owner_of(session)
}

/// `n` sessions opened through host-a that all have the same owner (host-a's port
/// scatters initializes over its workers: sessions of the other worker are ended
/// again). Each has counted to 1 through host-b, so every session is in use, and the
/// upstream holds exactly these `n` sessions.
fn sessions_of_one_owner(fleet: &LocalFleet, n: usize) -> Vec<String> {
    let mut by_owner: HashMap<String, Vec<String>> = HashMap::new();
    let sessions = eventually(WITHIN, || {
        let session = initialize(&fleet.a.addr, "/mcp");
        let mine = by_owner.entry(owner(&session)).or_default();
        mine.push(session);
        if mine.len() == n {
            Ok(mine.clone())
        } else {
            Err(format!("{} sessions of one owner so far", mine.len()))
        }
    });
    for other in by_owner
        .values()
        .flatten()
        .filter(|s| !sessions.contains(s))
    {
        let ended = http::delete_session(&fleet.a.addr, "/mcp", other);
        assert_eq!(ended.status, 200, "ending {other}: {}", ended.text());
    }
    for (i, session) in sessions.iter().enumerate() {
        let first = call_tool(
            &fleet.b.addr,
            "/mcp",
            session,
            2 + i as u64,
            "counter_increment",
            json!({}),
        );
        assert_eq!(first.expect_tool_text(), "1", "{session}");
    }
    sessions
}

/// Sum over the live workers' `/metrics` of every sample of `metric` whose labels
/// include `label` (e.g. `cause="death"`).
fn fleet_metric(fleet: &LocalFleet, metric: &str, label: &str) -> u64 {
    fleet
        .leases()
        .keys()
        .map(|id| {
            scrape(&admin_of(&fleet.redis, id))
                .into_iter()
                .filter(|(sample, _)| {
                    sample
                        .split_once('{')
                        .is_some_and(|(name, labels)| name == metric && labels.contains(label))
                })
                .map(|(_, value)| value as u64)
                .sum::<u64>()
        })
        .sum()
}

/// Waits until the fleet's `metric{label}` reached `expected`, then checks it did not
/// pass it: a counter that lags its answers is fine, one that counts twice is not.
#[track_caller]
fn assert_fleet_metric(fleet: &LocalFleet, metric: &str, label: &str, expected: u64) {
    let reached = eventually(WITHIN, || {
        let now = fleet_metric(fleet, metric, label);
        if now >= expected {
            Ok(now)
        } else {
            Err(format!("{metric}{{{label}}} at {now}, expected {expected}"))
        }
    });
    assert_eq!(
        reached, expected,
        "{metric}{{{label}}} summed over the fleet"
    );
}

fn assert_adoptions(fleet: &LocalFleet, death: u64, drain: u64) {
    assert_fleet_metric(
        fleet,
        "mcpgw_sessions_adopted_total",
        "cause=\"death\"",
        death,
    );
    assert_fleet_metric(
        fleet,
        "mcpgw_sessions_adopted_total",
        "cause=\"drain\"",
        drain,
    );
}

/// How the old owner may have answered between losing its sessions and their adoption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OldOwner {
    /// Killed or paused: it answered nothing after `since`.
    Silent,
    /// Draining: it finished the requests it had, before the adoption.
    Finishing,
}

/// Each session was adopted exactly once after `since` (the moment its owner stopped
/// serving): one answer, given after `since`, carries `mcpgw-adopted: cause`, a 200
/// from a worker other than `old_owner`. Before it, after `since`, only `old_owner` finishing its requests
/// served the session (and only when `old` allows it); every answer after it came
/// from that same new owner and carried no `mcpgw-adopted`. Returns the new owner of
/// each session.
fn assert_adopted_once(
    outcomes: &[Outcome],
    sessions: &[String],
    old_owner: &str,
    since: Instant,
    cause: &str,
    old: OldOwner,
) -> BTreeMap<String, String> {
    let flagged: Vec<&Outcome> = outcomes.iter().filter(|o| o.adopted.is_some()).collect();
    assert_eq!(
        flagged.len(),
        sessions.len(),
        "one answer per session says it adopted the session: {flagged:#?}"
    );
    let mut new_owners = BTreeMap::new();
    for session in sessions {
        let of_session = || outcomes.iter().filter(move |o| &o.session == session);
        let adopter = of_session()
            .find(|o| o.adopted.is_some())
            .unwrap_or_else(|| panic!("{session} was adopted"));
        assert_eq!(adopter.status, 200, "{session}: served: {adopter:?}");
        assert_eq!(adopter.adopted.as_deref(), Some(cause), "{adopter:?}");
        // Its request may have left the client a moment before `since`: it reached the
        // edge's forward only after the owner stopped (the owner refused it, so it never
        // ran there: the counters above prove it ran once). Only its answer is bound to
        // come after `since` (clean-clone CI, 2026-12-01: started just before the kill,
        // answered 31 ms later, adopted, counter exact).
        assert!(adopter.finished > since, "{session}: {adopter:?}");
        let new_owner = adopter
            .owner
            .clone()
            .unwrap_or_else(|| panic!("{session}: the adopting answer names its owner"));
        assert_ne!(new_owner, old_owner, "{session}: a new owner: {adopter:?}");
        for o in of_session().filter(|o| o.status == 200 && o.started > since) {
            if o.started < adopter.started {
                assert!(
                    old == OldOwner::Finishing && o.owner.as_deref() == Some(old_owner),
                    "{session}: served before its adoption, by {:?} (old owner {old_owner}, \
                     {old:?}): {o:?}",
                    o.owner
                );
            } else if o.started > adopter.started {
                assert_eq!(o.adopted, None, "{session}: adopted once only: {o:?}");
                assert_eq!(
                    o.owner.as_deref(),
                    Some(new_owner.as_str()),
                    "{session}: one new owner fleet-wide: {o:?}"
                );
            }
        }
        new_owners.insert(session.clone(), new_owner);
    }
    new_owners
}

/// A fleet of two hosts, two workers each, on the TCP mesh.
fn two_by_two(extra: &[&str]) -> LocalFleet {
    LocalFleet::start("tcp", 2, extra)
}

#[test]
fn killing_the_owner_of_http_sessions_has_them_adopted_once_each_and_counting_on() {
    let fleet = two_by_two(&[]);
    let sessions = sessions_of_one_owner(&fleet, SESSIONS);
    let victim = owner(&sessions[0]);
    let victim_pid = fleet.pid_of(&victim);
    let created = fleet.upstream.counter("sessions_created");
    // Through host-b: both its workers race for every session once its owner is dead.
    let load = Load::through(&fleet.b.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let killed_at = Instant::now();
    signal::send(victim_pid, Signal::SIGKILL);
    signal::wait_until_gone(victim_pid, WITHIN);
    let gone_at = Instant::now();
    load.wait_until(every_session_progressed_or_gone(&sessions, 3, gone_at));
    let outcomes = load.finish();

    for o in &outcomes {
        match (o.status, o.detail.as_str()) {
            (200, _) | (502, "outcome_unknown") => {}
            // A connection to the owner reset while the kernel tore the dying process
            // down proves nothing (a refusal would): nothing was sent, retry. Once the
            // process is gone its address refuses, and that is proof.
            (503, "ownership_unknown") if o.started < gone_at => {}
            _ => panic!(
                "served, or the call in flight at the kill told it may have run; \
                 never gone: {o:?}"
            ),
        }
    }
    let unknown = outcomes.iter().filter(|o| o.status == 502).count();
    eprintln!(
        "{} requests, {unknown} answered 502 outcome_unknown around the kill",
        outcomes.len()
    );
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    let new_owners = assert_adopted_once(
        &outcomes,
        &sessions,
        &victim,
        killed_at,
        "death",
        OldOwner::Silent,
    );
    eprintln!("new owners: {new_owners:?}");
    assert_adoptions(&fleet, SESSIONS as u64, 0);
    assert_eq!(
        fleet.upstream.counter("sessions_created"),
        created,
        "the upstream sessions went on: none was opened again"
    );
}

#[test]
fn an_owner_paused_past_its_lease_is_adopted_from_and_fences_itself_when_resumed() {
    let fleet = two_by_two(&SHORT_LEASE);
    let sessions = sessions_of_one_owner(&fleet, SESSIONS);
    let fenced = owner(&sessions[0]);
    let fenced_pid = fleet.pid_of(&fenced);
    let load = Load::through(&fleet.b.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let paused = Paused::stop(fenced_pid);
    let paused_at = Instant::now();
    // Declared dead once its lease expired, and every session adopted meanwhile.
    load.wait_until(every_session_progressed_or_gone(&sessions, 3, paused_at));
    paused.resume();
    let resumed_at = Instant::now();
    eprintln!("owner {fenced} paused at {paused_at:?}, resumed at {resumed_at:?}");
    // It learns it was declared dead and exits; its supervisor replaces it.
    signal::wait_until_gone(fenced_pid, WITHIN);
    load.wait_until(every_session_progressed_or_gone(
        &sessions,
        3,
        Instant::now(),
    ));
    let outcomes = load.finish();

    for o in &outcomes {
        match o.status {
            200 => {}
            502 => assert_eq!(o.detail, "outcome_unknown", "{o:?}"),
            // Not sent to the silent owner: nothing ran, the client may retry.
            503 => assert!(
                matches!(o.detail.as_str(), "ownership_unknown" | "lease_in_doubt"),
                "{o:?}"
            ),
            _ => panic!("a paused owner's sessions are never gone: {o:?}"),
        }
        if o.started > paused_at && o.status == 200 {
            assert_ne!(
                o.owner.as_deref(),
                Some(fenced.as_str()),
                "the fenced owner answered for a session after its pause: {o:?}"
            );
        }
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    assert_adopted_once(
        &outcomes,
        &sessions,
        &fenced,
        paused_at,
        "death",
        OldOwner::Silent,
    );
    // Not even an error answer names the fenced owner once its session was adopted.
    for session in &sessions {
        let adopted_at = outcomes
            .iter()
            .find(|o| &o.session == session && o.adopted.is_some())
            .map(|o| o.started)
            .expect("adopted");
        for o in outcomes
            .iter()
            .filter(|o| &o.session == session && o.started >= adopted_at)
        {
            assert_ne!(o.owner.as_deref(), Some(fenced.as_str()), "{o:?}");
        }
    }
    let after_resume = outcomes
        .iter()
        .filter(|o| o.started > resumed_at && o.status == 200)
        .count();
    assert!(
        after_resume > 0,
        "the sessions were served after the resume"
    );
    assert!(
        !fleet.leases().contains_key(&fenced),
        "the fenced worker holds no lease"
    );
    assert_adoptions(&fleet, SESSIONS as u64, 0);
}

/// A whole host frozen past its lease and past its mesh connections' maximum age (what
/// `docker pause` does to a container), with requests for every session arriving at
/// it meanwhile: on waking, its workers learn they were declared dead, fence
/// themselves, and answer the requests queued at them for sessions that went on
/// elsewhere. None of those answers may say "retry" for a call that ran (the upstream's
/// record of what ran shows it), and each answer is one a paused owner's sessions may
/// get: served, retry (nothing ran), or outcome unknown; never gone.
#[test]
fn a_host_frozen_past_its_lease_answers_its_queued_requests_truthfully_on_waking() {
    let lease_ms = 3000;
    let logs = tempfile::tempdir().expect("log dir");
    let fleet = LocalFleet::start_logged(
        "quic",
        2,
        &[
            "--lease-ms",
            &lease_ms.to_string(),
            "--mesh-max-connection-age-ms",
            "4000",
        ],
        logs.path(),
    );
    let proxy =
        mcpgw_testkit::ScatterProxy::start(vec![fleet.a.addr.clone(), fleet.b.addr.clone()]);
    let sessions: Vec<String> = (0..SESSIONS * 2)
        .map(|_| initialize(&proxy.addr, "/mcp"))
        .collect();
    let frozen = fleet.workers_of(&fleet.a);
    assert_eq!(frozen.len(), 2, "host-a's workers: {frozen:?}");
    let frozen_owned: Vec<&String> = sessions
        .iter()
        .filter(|s| frozen.contains_key(&owner(s)))
        .collect();
    assert!(
        !frozen_owned.is_empty(),
        "the scattered initializes gave host-a sessions to lose"
    );
    let load = Load::through(&proxy.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let mut paused: Vec<Paused> = frozen.values().copied().map(Paused::stop).collect();
    paused.push(Paused::stop(fleet.a.pid()));
    let paused_at = Instant::now();
    // The fault: twice the lease and a second, as the compose test's `docker pause`.
    thread::sleep(Duration::from_millis(2 * lease_ms + 1000));
    for p in paused.into_iter().rev() {
        p.resume();
    }
    let resumed_at = Instant::now();
    eprintln!("host-a frozen at {paused_at:?}, thawed at {resumed_at:?}");
    load.wait_until(every_session_progressed_or_gone(
        &sessions,
        3,
        Instant::now(),
    ));
    // Woken, each frozen worker found itself declared dead, fenced itself and exited.
    for pid in frozen.values() {
        signal::wait_until_gone(*pid, WITHIN);
    }
    let outcomes = load.finish();

    // Requests really waited at the frozen host, and were answered after it woke.
    let queued: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| {
            o.started > paused_at
                && o.started < resumed_at
                && o.finished > resumed_at
                && o.edge
                    .as_ref()
                    .is_some_and(|edge| frozen.contains_key(edge))
        })
        .collect();
    let mut classes: BTreeMap<String, usize> = BTreeMap::new();
    for o in &queued {
        *classes
            .entry(match o.value() {
                Some(_) => "200".to_owned(),
                None => format!("{} {}", o.status, o.detail),
            })
            .or_default() += 1;
    }
    eprintln!("requests queued at the frozen host, answered after the thaw: {classes:?}");
    assert!(
        !queued.is_empty(),
        "no request waited at the frozen host to be answered after the thaw"
    );
    // The answers a paused owner's sessions may get (as in the paused-owner test).
    for o in &outcomes {
        match o.status {
            200 => {}
            // host-a's port refused while its fenced workers were replaced: the request
            // reached no worker (the proxy said so), and the check below shows it never
            // ran.
            502 if o.detail == format!("proxy: {BACKEND_REFUSED}") => {}
            502 => assert_eq!(o.detail, "outcome_unknown", "{o:?}"),
            503 => assert!(
                matches!(o.detail.as_str(), "ownership_unknown" | "lease_in_doubt"),
                "{o:?}"
            ),
            _ => panic!("a frozen host's sessions are never gone: {o:?}"),
        }
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    // Each session host-a owned was adopted once, by death; none of host-b's was.
    for session in &sessions {
        let adoptions: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| &o.session == session && o.adopted.is_some())
            .collect();
        let expected = usize::from(frozen.contains_key(&owner(session)));
        assert_eq!(adoptions.len(), expected, "{session}: {adoptions:#?}");
        for o in adoptions {
            assert_eq!(o.adopted.as_deref(), Some("death"), "{o:?}");
            assert!(o.finished > paused_at, "{o:?}");
        }
    }
    assert_adoptions(&fleet, frozen_owned.len() as u64, 0);
    // The frozen workers fenced themselves (their own words), and hold no lease.
    let log = std::fs::read_to_string(logs.path().join("host-a.log")).expect("host-a's log");
    let leases = fleet.leases();
    for id in frozen.keys() {
        assert!(
            log.lines()
                .any(|line| line.contains("fenced: declared dead by the fleet")
                    && line.contains(id.as_str())),
            "worker {id} logged no fencing; host-a's log:\n{log}"
        );
        assert!(!leases.contains_key(id), "fenced {id} holds no lease");
    }
}

#[test]
fn draining_the_owner_hands_its_http_sessions_over_without_an_error() {
    let fleet = two_by_two(&[]);
    let sessions = sessions_of_one_owner(&fleet, SESSIONS);
    let drained = owner(&sessions[0]);
    let drained_pid = fleet.pid_of(&drained);
    let (created, open) = (
        fleet.upstream.counter("sessions_created"),
        fleet.upstream.counter("sessions_open"),
    );
    let load = Load::through(&fleet.b.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let drain_at = Instant::now();
    signal::send(drained_pid, Signal::SIGTERM);
    signal::wait_until_gone(drained_pid, WITHIN);
    load.wait_until(every_session_progressed_or_gone(
        &sessions,
        3,
        Instant::now(),
    ));
    let outcomes = load.finish();

    let errors: Vec<&Outcome> = outcomes.iter().filter(|o| o.status != 200).collect();
    assert!(
        errors.is_empty(),
        "a drain costs no request an error; {} of {} requests got one, first: {:#?}",
        errors.len(),
        outcomes.len(),
        &errors[..errors.len().min(3)]
    );
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    // Requests that reached the draining owner finish there; then the session is
    // adopted.
    assert_adopted_once(
        &outcomes,
        &sessions,
        &drained,
        drain_at,
        "drain",
        OldOwner::Finishing,
    );
    assert_adoptions(&fleet, 0, SESSIONS as u64);
    assert_eq!(
        (
            fleet.upstream.counter("sessions_created"),
            fleet.upstream.counter("sessions_open")
        ),
        (created, open),
        "the drained owner handed its upstream sessions over instead of ending them"
    );
}

/// `--upstream NAME=stdio:…` running the SDK's stateful server.
fn stateful_stdio(name: &str) -> String {
    format!(
        "{name}=stdio:{} {} stdio",
        python().display(),
        python_script("stateful_server.py").display()
    )
}

/// A `counter_increment` on `path`; no HTTP answer is an `Err`.
fn try_count(addr: &str, path: &str, session: &str, id: u64) -> Result<http::Response, String> {
    try_call(addr, path, session, id, "counter_increment")
}

/// A call of `tool` (no arguments) on `path`; no HTTP answer is an `Err`.
fn try_call(
    addr: &str,
    path: &str,
    session: &str,
    id: u64,
    tool: &str,
) -> Result<http::Response, String> {
    http::try_request(
        addr,
        "POST",
        path,
        &mcp_headers(Some(session)),
        &http::tool_call_body(id, tool, json!({})),
    )
}

/// The first answer to `counter_increment` on a session whose owner was killed that
/// is not `502 outcome_unknown` (a request sent on a pooled connection to the dead
/// owner may get that once).
fn first_answer_after_the_kill(addr: &str, path: &str, session: &str) -> http::Response {
    first_call_after_the_kill(addr, path, session, "counter_increment")
}

/// [`first_answer_after_the_kill`] for a call of `tool`.
fn first_call_after_the_kill(addr: &str, path: &str, session: &str, tool: &str) -> http::Response {
    let mut id = 100;
    eventually(WITHIN, || {
        id += 1;
        let r = try_call(addr, path, session, id, tool)?;
        if r.outcome() == "502 outcome_unknown" {
            Err(r.outcome())
        } else {
            Ok(r)
        }
    })
}

#[test]
fn a_stdio_session_ends_with_its_owner_while_an_http_session_of_the_same_owner_goes_on() {
    let stdio = stateful_stdio("st");
    let fleet = LocalFleet::start("tcp", 1, &["--upstream", &stdio]);
    let (web, st) = ("/servers/demo/mcp", "/servers/st/mcp");
    // Host-a has one worker: it owns both sessions.
    let web_session = initialize(&fleet.a.addr, web);
    let st_session = initialize(&fleet.a.addr, st);
    let victim = owner(&web_session);
    assert_eq!(owner(&st_session), victim);
    for (path, session) in [(web, &web_session), (st, &st_session)] {
        let r = try_count(&fleet.b.addr, path, session, 2).expect("an answer");
        assert_eq!(r.expect_tool_text(), "1", "{path}");
    }
    let pid = fleet.pid_of(&victim);
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);

    let gone = first_answer_after_the_kill(&fleet.b.addr, st, &st_session);
    assert_eq!(
        gone.outcome(),
        "404 session_gone",
        "a stdio session cannot be adopted: its process died with its owner: {}",
        gone.text()
    );
    assert_eq!(gone.header(ADOPTED), None, "{:?}", gone.headers);
    let web_answer = first_answer_after_the_kill(&fleet.b.addr, web, &web_session);
    assert_eq!(
        web_answer.expect_tool_text(),
        "2",
        "the HTTP session of the same owner was adopted and goes on"
    );
    assert_eq!(web_answer.header(ADOPTED), Some("death"));
    // Gone everywhere and for good: never a fresh process behind the old id.
    for (i, addr) in [&fleet.b.addr, &fleet.a.addr, &fleet.b.addr]
        .iter()
        .enumerate()
    {
        let r = eventually(WITHIN, || try_count(addr, st, &st_session, 200 + i as u64));
        assert_eq!(r.outcome(), "404 session_gone", "via {addr}: {}", r.text());
    }
    assert_fleet_metric(&fleet, "mcpgw_adoptions_refused_total", "why=\"stdio\"", 1);
    assert_adoptions(&fleet, 1, 0);
}

/// Kills the fleet's upstream and starts a new one at the same address: it knows none
/// of the sessions the old one had.
fn restart_upstream_empty(fleet: &mut LocalFleet) {
    let addr = fleet.upstream.addr();
    fleet.upstream.child.signal(Signal::SIGKILL);
    fleet.upstream.child.wait_exit(WITHIN);
    let bench = mcpgw_testkit::bin("mcpgw-bench");
    let mut child = Child::spawn("upstream", &bench, &["upstream", "--listen", &addr]);
    child.wait_for_line("listening on", WITHIN);
    fleet.upstream = Upstream {
        child,
        url: format!("http://{addr}/mcp"),
    };
}

#[test]
fn a_session_its_upstream_forgot_is_gone_after_its_owner_dies_never_restarted() {
    let mut fleet = LocalFleet::start("tcp", 1, &[]);
    let sessions: Vec<String> = (0..3).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let victim = owner(&sessions[0]);
    for (i, session) in sessions.iter().enumerate() {
        assert_eq!(owner(session), victim, "host-a has one worker");
        let r = try_count(&fleet.b.addr, "/mcp", session, 2 + i as u64).expect("an answer");
        assert_eq!(r.expect_tool_text(), "1");
    }
    restart_upstream_empty(&mut fleet);
    let pid = fleet.pid_of(&victim);
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);

    for session in &sessions {
        let r = first_answer_after_the_kill(&fleet.b.addr, "/mcp", session);
        assert_eq!(
            r.outcome(),
            "404 session_gone",
            "the upstream forgot the session: it cannot go on: {}",
            r.text()
        );
        assert_eq!(r.header(ADOPTED), None, "{:?}", r.headers);
        for (i, addr) in [&fleet.a.addr, &fleet.b.addr].iter().enumerate() {
            let again = eventually(WITHIN, || try_count(addr, "/mcp", session, 300 + i as u64));
            assert_eq!(
                again.outcome(),
                "404 session_gone",
                "never a counter starting over at 1: via {addr}: {}",
                again.text()
            );
        }
    }
    assert_eq!(
        fleet.upstream.counter("sessions_created"),
        0,
        "no fresh upstream session was opened behind an old id"
    );
    assert_fleet_metric(
        &fleet,
        "mcpgw_adoptions_refused_total",
        "why=\"upstream_forgot\"",
        sessions.len() as u64,
    );
    assert_adoptions(&fleet, 0, 0);
}

#[test]
fn with_adopt_never_a_dead_owners_sessions_are_gone_as_before() {
    let fleet = two_by_two(&["--adopt", "never"]);
    let sessions = sessions_of_one_owner(&fleet, 4);
    let victim = owner(&sessions[0]);
    let victim_pid = fleet.pid_of(&victim);
    let load = Load::through(&fleet.b.addr, &sessions, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 2, Instant::now()));
    signal::send(victim_pid, Signal::SIGKILL);
    signal::wait_until_gone(victim_pid, WITHIN);
    let gone_at = Instant::now();
    load.wait_until(|outcomes| {
        let untold: Vec<&String> = sessions
            .iter()
            .filter(|s| {
                !outcomes.iter().any(|o| {
                    &o.session == *s
                        && o.started > gone_at
                        && (o.status, o.detail.as_str()) == (404, "session_gone")
                })
            })
            .collect();
        // An adopted session settles the wait too: the assertions below then fail at
        // once.
        let adopted = outcomes.iter().any(|o| o.adopted.is_some());
        if untold.is_empty() || adopted {
            Ok(())
        } else {
            Err(format!("not yet told gone: {untold:?}"))
        }
    });
    let outcomes = load.finish();
    for o in &outcomes {
        assert_eq!(o.adopted, None, "nothing is adopted: {o:?}");
        if o.started > gone_at {
            assert!(
                matches!(
                    (o.status, o.detail.as_str()),
                    (404, "session_gone" | "session_not_found") | (502, "outcome_unknown")
                ),
                "a dead owner's session is gone: {o:?}"
            );
        }
    }
    for session in &sessions {
        let last = outcomes
            .iter()
            .rev()
            .find(|o| &o.session == session)
            .expect("exercised");
        assert_eq!(last.status, 404, "in the end the session is gone: {last:?}");
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
    assert_adoptions(&fleet, 0, 0);
}

/// Bytes one connection received, shared with the thread that reads them.
type Received = Arc<Mutex<Vec<u8>>>;

/// A TCP relay in front of the upstream that keeps what the upstream sent on each
/// connection: how a test learns the upstream's own session ids, which the gateway
/// never shows its clients.
struct Relay {
    /// `host:port` the gateway is pointed at.
    addr: String,
    /// The upstream's bytes, one buffer per connection (so a header line is never
    /// split by another connection's bytes).
    answers: Arc<Mutex<Vec<Received>>>,
}

impl Relay {
    fn start(upstream: &str) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let addr = listener.local_addr().expect("relay address").to_string();
        let answers: Arc<Mutex<Vec<Received>>> = Arc::default();
        let (upstream, kept) = (upstream.to_owned(), answers.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let answer = Arc::new(Mutex::new(Vec::new()));
                lock(&kept).push(answer.clone());
                let (client_in, server_out) = (client.try_clone(), server.try_clone());
                let (Ok(client_in), Ok(server_out)) = (client_in, server_out) else {
                    continue;
                };
                thread::spawn(move || copy(client_in, server_out, None));
                thread::spawn(move || copy(server, client, Some(answer)));
            }
        });
        Relay { addr, answers }
    }

    fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// Every `Mcp-Session-Id` the upstream handed out so far.
    fn upstream_session_ids(&self) -> Vec<String> {
        lock(&self.answers)
            .iter()
            .flat_map(|answer| {
                String::from_utf8_lossy(&lock(answer))
                    .lines()
                    .filter_map(|line| {
                        let (name, value) = line.split_once(':')?;
                        name.eq_ignore_ascii_case("mcp-session-id")
                            .then(|| value.trim().to_owned())
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// Copies `from` to `to` until either side ends, keeping the bytes in `keep`.
fn copy(mut from: TcpStream, mut to: TcpStream, keep: Option<Arc<Mutex<Vec<u8>>>>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if let Some(keep) = &keep {
                    lock(keep).extend_from_slice(&buf[..n]);
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A fleet of one worker per host whose demo route reaches the upstream through a
/// relay.
fn fleet_behind_relay(extra: &[&str]) -> (LocalFleet, Relay) {
    fleet_behind_relay_hosts(extra, extra)
}

/// Like [`fleet_behind_relay`], with flags of their own for host-a and host-b.
fn fleet_behind_relay_hosts(extra_a: &[&str], extra_b: &[&str]) -> (LocalFleet, Relay) {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let relay = Relay::start(&upstream.addr());
    let certs = MeshCerts::create(&["host-a", "host-b"]);
    let (redis_url, relay_url) = (redis.url(), relay.url());
    let spec = |member, extra| SupervisorSpec {
        redis_url: &redis_url,
        upstream_url: &relay_url,
        workers: 1,
        transport: "tcp",
        certs: &certs,
        member,
        extra,
    };
    let a = start_supervisor(&spec("host-a", extra_a));
    let b = start_supervisor(&spec("host-b", extra_b));
    let fleet = LocalFleet {
        a,
        b,
        certs,
        upstream,
        redis,
    };
    (fleet, relay)
}

/// The session's adoption record as Redis holds it, whatever the value's type.
fn adoption_record(redis: &RedisServer, session: &str) -> String {
    let key = format!("mcpgw:session_state:{session}");
    match redis.command(&["TYPE", &key]).as_str() {
        "string" => redis.command(&["GET", &key]),
        "hash" => redis.command(&["HGETALL", &key]),
        other => panic!("{key}: no record (type {other:?})"),
    }
}

/// One session opened on host-a and counted to 1 through host-b; its upstream
/// session id, as the upstream handed it out.
fn session_and_upstream_id(fleet: &LocalFleet, relay: &Relay) -> (String, String) {
    let session = initialize(&fleet.a.addr, "/mcp");
    let r = try_count(&fleet.b.addr, "/mcp", &session, 2).expect("an answer");
    assert_eq!(r.expect_tool_text(), "1");
    let ids = relay.upstream_session_ids();
    assert_eq!(ids.len(), 1, "the upstream opened one session: {ids:?}");
    (session, ids[0].clone())
}

/// An `--adoption-key-file` in `dir` named `name` holding `keys` (64 hex characters
/// each; the first seals); its path.
fn key_file(dir: &tempfile::TempDir, name: &str, keys: &[String]) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, keys.join("\n") + "\n").expect("write the key file");
    path.display().to_string()
}

#[test]
fn with_a_key_file_the_record_seals_the_upstream_session_id_and_still_adopts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let keys_arg = key_file(&dir, "keys", &["3c".repeat(32), "a7".repeat(32)]);
    let (fleet, relay) = fleet_behind_relay(&["--adoption-key-file", &keys_arg]);
    let (session, upstream_id) = session_and_upstream_id(&fleet, &relay);
    let record = adoption_record(&fleet.redis, &session);
    assert!(
        !record.contains(&upstream_id),
        "the upstream's session id {upstream_id} is sealed: {record:?}"
    );
    let pid = fleet.pid_of(&owner(&session));
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    let r = first_answer_after_the_kill(&fleet.b.addr, "/mcp", &session);
    assert_eq!(r.expect_tool_text(), "2", "the sealed record was opened");
    assert_eq!(r.header(ADOPTED), Some("death"));
}

#[test]
fn without_a_key_file_the_record_holds_the_upstream_session_id_in_the_clear() {
    let (fleet, relay) = fleet_behind_relay(&[]);
    let (session, upstream_id) = session_and_upstream_id(&fleet, &relay);
    let record = adoption_record(&fleet.redis, &session);
    assert!(
        record.contains(&upstream_id),
        "the upstream's session id {upstream_id} is in the record: {record:?}"
    );
}

#[test]
fn a_worker_without_the_sealing_key_refuses_the_adoption_and_the_session_is_gone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sealing = key_file(&dir, "a", &["3c".repeat(32)]);
    let other = key_file(&dir, "b", &["a7".repeat(32)]);
    let (fleet, relay) = fleet_behind_relay_hosts(
        &["--adoption-key-file", &sealing],
        &["--adoption-key-file", &other],
    );
    let (session, _) = session_and_upstream_id(&fleet, &relay);
    let pid = fleet.pid_of(&owner(&session));
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    let r = first_answer_after_the_kill(&fleet.b.addr, "/mcp", &session);
    assert_eq!(
        r.outcome(),
        "404 session_gone",
        "host-b cannot open the record: {}",
        r.text()
    );
    assert_eq!(r.header(ADOPTED), None, "{:?}", r.headers);
    assert_fleet_metric(
        &fleet,
        "mcpgw_adoptions_refused_total",
        "why=\"key_unknown\"",
        1,
    );
    assert_adoptions(&fleet, 0, 0);
    assert_eq!(
        relay.upstream_session_ids().len(),
        1,
        "no fresh upstream session behind the old id"
    );
}

/// A record in the clear where keys are configured was written by a worker without the
/// key file, or by anyone who can write to Redis: a keyed worker does not take an
/// upstream session id from it.
#[test]
fn a_worker_with_keys_refuses_a_record_in_the_clear_and_the_session_is_gone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let keyed = key_file(&dir, "b", &["3c".repeat(32)]);
    let (fleet, relay) = fleet_behind_relay_hosts(&[], &["--adoption-key-file", &keyed]);
    let (session, upstream_id) = session_and_upstream_id(&fleet, &relay);
    let record = adoption_record(&fleet.redis, &session);
    assert!(
        record.contains(&format!("clear:{upstream_id}")),
        "{record:?}"
    );
    let pid = fleet.pid_of(&owner(&session));
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    let r = first_answer_after_the_kill(&fleet.b.addr, "/mcp", &session);
    assert_eq!(
        r.outcome(),
        "404 session_gone",
        "host-b does not take an upstream session id from a record in the clear: {}",
        r.text()
    );
    assert_eq!(r.header(ADOPTED), None, "{:?}", r.headers);
    assert_fleet_metric(
        &fleet,
        "mcpgw_adoptions_refused_total",
        "why=\"record_not_sealed\"",
        1,
    );
    assert_adoptions(&fleet, 0, 0);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The route of the virtual server `vs`: the demo upstream over HTTP (prefix `demo`)
/// and the SDK's stateful server over stdio (`st`), both with `counter_increment`.
const VS: &str = "/servers/vs/mcp";

/// Flags that add `vs` (and its stdio member `st`) to a fleet's demo upstream; the
/// configuration file lives in `dir`.
fn virtual_server_flags(dir: &tempfile::TempDir) -> Vec<String> {
    let config = dir.path().join("vs.toml");
    std::fs::write(
        &config,
        "[[server]]\nname = \"vs\"\n\
         [[server.member]]\nupstream = \"demo\"\n\
         [[server.member]]\nupstream = \"st\"\n",
    )
    .expect("write the virtual server's configuration");
    vec![
        "--upstream".into(),
        stateful_stdio("st"),
        "--config".into(),
        config.display().to_string(),
    ]
}

/// A fleet of one worker per host serving `vs`, and a `vs` session owned by host-a's
/// worker whose two counters (HTTP and stdio member) stand at 2, counted through
/// host-b. Returns the fleet, the session and its owner.
fn virtual_session_counted_twice(dir: &tempfile::TempDir) -> (LocalFleet, String, String) {
    let flags = virtual_server_flags(dir);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let fleet = LocalFleet::start("tcp", 1, &flags);
    let session = initialize(&fleet.a.addr, VS);
    let owner = owner(&session);
    for (id, expected) in [(2, "1"), (4, "2")] {
        for (offset, tool) in [(0, "demo__counter_increment"), (1, "st__counter_increment")] {
            let r = try_call(&fleet.b.addr, VS, &session, id + offset, tool).expect("an answer");
            assert_eq!(r.expect_tool_text(), expected, "{tool}");
            assert_eq!(
                r.header("mcpgw-owner-worker"),
                Some(owner.as_str()),
                "{tool}"
            );
        }
    }
    let names = vs_tool_names(&fleet.b.addr, &session).0;
    assert!(
        names.contains(&"st__counter_increment".to_owned()),
        "{names:?}"
    );
    (fleet, session, owner)
}

/// The tool names `vs` lists in `session` through `addr` (once it serves: a host's
/// killed worker is being replaced), and the members it says are missing.
fn vs_tool_names(addr: &str, session: &str) -> (Vec<String>, Vec<String>) {
    let r = eventually(WITHIN, || {
        http::try_request(
            addr,
            "POST",
            VS,
            &mcp_headers(Some(session)),
            &http::rpc_body(90, "tools/list", json!({})),
        )
    });
    assert_eq!(r.status, 200, "tools/list: {}", r.text());
    let result = r
        .messages()
        .into_iter()
        .find_map(|m| m.get("result").cloned())
        .unwrap_or_else(|| panic!("a tools/list result: {}", r.text()));
    let names = result["tools"]
        .as_array()
        .expect("a tool list")
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect();
    let missing = result["_meta"]["mcpgw/federation"]["missing"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|m| m["member"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    (names, missing)
}

/// After its owner left a `vs` session (`cause`: how): the adopting answer counts the
/// HTTP member on exactly (3), the stdio member's tools answer `member_lost` with why,
/// the list lost them, and the session goes on through either host, adopted once.
fn assert_vs_session_went_on_without_its_stdio_member(
    fleet: &LocalFleet,
    session: &str,
    old_owner: &str,
    cause: &str,
) {
    let created = fleet.upstream.counter("sessions_created");
    let adopted = first_call_after_the_kill(&fleet.b.addr, VS, session, "demo__counter_increment");
    assert_eq!(
        adopted.expect_tool_text(),
        "3",
        "the HTTP member's counter goes on exactly: {}",
        adopted.text()
    );
    assert_eq!(
        adopted.header(ADOPTED),
        Some(cause),
        "{:?}",
        adopted.headers
    );
    let new_owner = adopted
        .header("mcpgw-owner-worker")
        .expect("the answer names its owner")
        .to_owned();
    assert_ne!(new_owner, old_owner);
    for (id, tool) in [(20, "st__counter_increment"), (21, "st__pid")] {
        let lost = try_call(&fleet.b.addr, VS, session, id, tool).expect("an answer");
        assert_eq!(lost.outcome(), "200 member_lost", "{tool}: {}", lost.text());
        assert_eq!(
            lost.header(ADOPTED),
            None,
            "adopted once: {:?}",
            lost.headers
        );
        let error = lost.error().expect("a JSON-RPC error");
        assert_eq!(error["data"]["member"], "st", "{error}");
        let detail = error["data"]["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("ended with the worker that held this session"),
            "the member-lost answer says why: {error}"
        );
    }
    let (names, missing) = vs_tool_names(&fleet.a.addr, session);
    assert!(
        names.contains(&"demo__counter_increment".to_owned())
            && !names.iter().any(|n| n.starts_with("st__")),
        "the list without the lost member: {names:?}"
    );
    assert_eq!(missing, ["st"], "the list says which member is missing");
    let again = try_call(&fleet.a.addr, VS, session, 30, "demo__counter_increment")
        .expect("host-a serves again");
    assert_eq!(again.expect_tool_text(), "4", "through the other host too");
    assert_eq!(
        again.header(ADOPTED),
        None,
        "adopted once: {:?}",
        again.headers
    );
    assert_eq!(again.header("mcpgw-owner-worker"), Some(new_owner.as_str()));
    assert_eq!(
        fleet.upstream.counter("sessions_created"),
        created,
        "the HTTP member's upstream session went on: none was opened again"
    );
}

#[test]
fn a_virtual_servers_session_outlives_its_killed_owner_without_its_stdio_member() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (fleet, session, victim) = virtual_session_counted_twice(&dir);
    let pid = fleet.pid_of(&victim);
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    assert_vs_session_went_on_without_its_stdio_member(&fleet, &session, &victim, "death");
    assert_adoptions(&fleet, 1, 0);
    assert_fleet_metric(&fleet, "mcpgw_adoptions_refused_total", "why=", 0);
}

#[test]
fn a_draining_owner_hands_a_virtual_servers_session_over_without_its_stdio_member() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (fleet, session, drained) = virtual_session_counted_twice(&dir);
    let open = fleet.upstream.counter("sessions_open");
    let pid = fleet.pid_of(&drained);
    signal::send(pid, Signal::SIGTERM);
    signal::wait_until_gone(pid, WITHIN);
    assert_eq!(
        fleet.upstream.counter("sessions_open"),
        open,
        "the drained owner handed the HTTP member's session over instead of ending it"
    );
    assert_vs_session_went_on_without_its_stdio_member(&fleet, &session, &drained, "drain");
    assert_adoptions(&fleet, 0, 1);
}

#[test]
fn a_virtual_servers_session_whose_members_are_all_gone_is_gone_after_its_owner_dies() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut fleet, session, victim) = virtual_session_counted_twice(&dir);
    restart_upstream_empty(&mut fleet);
    let pid = fleet.pid_of(&victim);
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);
    let gone = first_call_after_the_kill(&fleet.b.addr, VS, &session, "demo__counter_increment");
    assert_eq!(
        gone.outcome(),
        "404 session_gone",
        "the HTTP member's upstream forgot it and the stdio member died: {}",
        gone.text()
    );
    assert_eq!(gone.header(ADOPTED), None, "{:?}", gone.headers);
    assert_eq!(
        fleet.upstream.counter("sessions_created"),
        0,
        "no fresh member session behind the old id"
    );
    assert_fleet_metric(
        &fleet,
        "mcpgw_adoptions_refused_total",
        "why=\"upstream_forgot\"",
        1,
    );
    assert_adoptions(&fleet, 0, 0);
}

/// A virtual server `vs` with the demo upstream as its one (HTTP) member; the
/// configuration file lives in `dir`.
fn http_only_virtual_server(dir: &tempfile::TempDir) -> Vec<String> {
    let config = dir.path().join("vs.toml");
    std::fs::write(
        &config,
        "[[server]]\nname = \"vs\"\n[[server.member]]\nupstream = \"demo\"\n",
    )
    .expect("write the virtual server's configuration");
    vec!["--config".into(), config.display().to_string()]
}

/// The counter values of `answers` that are 200s, sorted.
fn counted(answers: &[&http::Response]) -> Vec<u64> {
    let mut values: Vec<u64> = answers
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| {
            r.expect_tool_text()
                .parse()
                .unwrap_or_else(|_| panic!("a counter value: {}", r.text()))
        })
        .collect();
    values.sort_unstable();
    values
}

/// Issue #41, item 4: while one worker adopts a session (it won the directory's claim
/// and is still building the session's link: its HTTP member answers `ping` slowly), a
/// request for the session on a third worker is sent to the adopter, which does not
/// hold the session yet. That request waits for the adoption and runs in the session,
/// or is refused as retryable; it is never told the session is gone, and the counter
/// goes on exactly.
#[test]
fn a_request_on_a_third_worker_during_an_adoption_is_never_told_gone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let flags = http_only_virtual_server(&dir);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let redis = RedisServer::start();
    // The adopter pings every member before it registers the session: 3 s here.
    let upstream = Upstream::start_with(&["--ping-delay-ms", "3000"]);
    let certs = MeshCerts::create(&["host-a", "host-b", "host-c"]);
    let redis_url = redis.url();
    let host = |member| {
        start_supervisor(&SupervisorSpec {
            redis_url: &redis_url,
            upstream_url: &upstream.url,
            workers: 1,
            transport: "tcp",
            certs: &certs,
            member,
            extra: &flags,
        })
    };
    let (a, b, c) = (host("host-a"), host("host-b"), host("host-c"));
    let session = initialize(&a.addr, VS);
    let victim = owner(&session);
    let first = try_call(&a.addr, VS, &session, 2, "demo__counter_increment").expect("an answer");
    assert_eq!(first.expect_tool_text(), "1");
    let pid = mcpgw_testkit::fleet::leases(&redis)
        .get(&victim)
        .map(|lease| lease.pid)
        .expect("the owner's lease");
    signal::send(pid, Signal::SIGKILL);
    signal::wait_until_gone(pid, WITHIN);

    let adopting = {
        let (addr, session) = (b.addr.clone(), session.clone());
        thread::spawn(move || {
            first_call_after_the_kill(&addr, VS, &session, "demo__counter_increment")
        })
    };
    // The adopter won the claim: the directory names it while it pings the member.
    let adopter = eventually(WITHIN, || {
        mcpgw_testkit::fleet::recorded_owner(&redis, &session)
            .filter(|owner| owner != &victim)
            .ok_or("not claimed by an adopter yet")
    });
    let during = try_call(&c.addr, VS, &session, 300, "demo__counter_increment")
        .expect("an answer from host-c");
    let adopted = adopting.join().expect("the adopting request's thread");
    assert_eq!(adopted.status, 200, "{}", adopted.text());
    assert_eq!(
        adopted.header(ADOPTED),
        Some("death"),
        "{:?}",
        adopted.headers
    );
    assert_eq!(adopted.header("mcpgw-owner-worker"), Some(adopter.as_str()));
    eprintln!("during the adoption, host-c answered {}", during.outcome());
    match during.outcome().as_str() {
        "200" => assert_eq!(
            during.header("mcpgw-owner-worker"),
            Some(adopter.as_str()),
            "run by the adopter once it holds the session: {:?}",
            during.headers
        ),
        "503 ownership_unknown" => {
            assert!(
                during.header("retry-after").is_some(),
                "{:?}",
                during.headers
            );
        }
        other => panic!(
            "a request during the adoption runs in the session or is refused as \
             retryable, never gone: {other}: {}",
            during.text()
        ),
    }
    let values = counted(&[&adopted, &during]);
    let next = values.len() as u64 + 2;
    assert_eq!(
        values,
        (2..next).collect::<Vec<_>>(),
        "each request ran once, in order"
    );
    let after = try_call(&c.addr, VS, &session, 301, "demo__counter_increment").expect("an answer");
    assert_eq!(
        after.expect_tool_text(),
        next.to_string(),
        "the counter goes on exactly"
    );
    assert_eq!(after.header(ADOPTED), None, "adopted once");
}

/// A `sleep_ms` call of `ms` on `addr` in `session`.
fn try_sleep(addr: &str, session: &str, id: u64, ms: u64) -> Result<http::Response, String> {
    http::try_request(
        addr,
        "POST",
        "/mcp",
        &mcp_headers(Some(session)),
        &http::tool_call_body(id, "sleep_ms", json!({ "ms": ms })),
    )
}

/// Issue #41, item 5: a drain hands a session over only once no call of it runs at
/// the owner. A slow call (forwarded from host-b) runs at host-a's worker when it is
/// drained; a request for the same session through host-b meanwhile must not run at
/// the upstream while the slow call still runs there (the demo upstream counts
/// requests that begin in a session during one of its `sleep_ms` calls), unless the
/// draining owner itself ran it.
#[test]
fn a_drain_hands_a_session_over_only_after_the_calls_running_in_it() {
    let fleet = LocalFleet::start("tcp", 1, &[]);
    let session = initialize(&fleet.a.addr, "/mcp");
    let drained = owner(&session);
    let first = try_count(&fleet.b.addr, "/mcp", &session, 2).expect("an answer");
    assert_eq!(first.expect_tool_text(), "1");
    let calls = fleet.upstream.counter("tool_calls");
    let slow = {
        let (addr, session) = (fleet.b.addr.clone(), session.clone());
        thread::spawn(move || try_sleep(&addr, &session, 3, 4000))
    };
    eventually(WITHIN, || {
        (fleet.upstream.counter("tool_calls") > calls)
            .then_some(())
            .ok_or("the slow call has not reached the upstream yet")
    });
    let admin = admin_of(&fleet.redis, &drained);
    signal::send(fleet.pid_of(&drained), Signal::SIGTERM);
    // The drain has begun (its sessions are being handed over) once the worker says so.
    eventually(WITHIN, || {
        let ready = http::try_request(&admin, "GET", "/readyz", &[], b"")?;
        ready
            .text()
            .contains("draining")
            .then_some(())
            .ok_or_else(|| format!("not draining yet: {}", ready.text()))
    });
    let mut id = 10;
    let next = eventually(WITHIN, || {
        id += 1;
        let r = try_count(&fleet.b.addr, "/mcp", &session, id)?;
        match r.outcome().as_str() {
            "200" => Ok(r),
            "503 ownership_unknown" => Err(r.outcome()),
            other => panic!(
                "served or told to retry, never an error: {other}: {}",
                r.text()
            ),
        }
    });
    let slow = slow
        .join()
        .expect("the slow call's thread")
        .expect("an answer");
    assert_eq!(slow.status, 200, "the slow call finished: {}", slow.text());
    assert_eq!(next.expect_tool_text(), "2", "the counter goes on exactly");
    eprintln!(
        "the request during the slow call was served by {:?} (drained: {drained})",
        next.header("mcpgw-owner-worker")
    );
    if next.header("mcpgw-owner-worker") != Some(drained.as_str()) {
        assert_eq!(next.header(ADOPTED), Some("drain"), "{:?}", next.headers);
        assert_eq!(
            fleet.upstream.counter("during_sleep"),
            0,
            "the adopter ran the request while the slow call still ran at the drained owner"
        );
    }
}

/// Issue #41, item 6: a session handed over by a drain still counts toward its
/// client's fleet-wide session quota, and once adopted it counts at the adopter,
/// within that worker's `--max-sessions`: an adoption that would exceed it is refused
/// as retryable (the session stays adoptable), and goes through once room is made.
#[test]
fn handed_over_and_adopted_sessions_still_count_toward_the_quotas() {
    let quota = ["--max-sessions-per-client-address", "2"];
    let adopter_flags = [quota[0], quota[1], "--max-sessions", "1"];
    let fleet = LocalFleet::start_hosts("tcp", (1, &quota), (1, &adopter_flags));
    let sessions = [
        initialize(&fleet.a.addr, "/mcp"),
        initialize(&fleet.a.addr, "/mcp"),
    ];
    let drained = owner(&sessions[0]);
    assert_eq!(owner(&sessions[1]), drained);
    for (id, session) in sessions.iter().enumerate() {
        let r = try_count(&fleet.b.addr, "/mcp", session, id as u64 + 2).expect("an answer");
        assert_eq!(r.expect_tool_text(), "1");
    }
    let pid = fleet.pid_of(&drained);
    signal::send(pid, Signal::SIGTERM);
    signal::wait_until_gone(pid, WITHIN);

    let adopted = try_count(&fleet.b.addr, "/mcp", &sessions[0], 10).expect("an answer");
    assert_eq!(adopted.expect_tool_text(), "2", "{}", adopted.text());
    assert_eq!(adopted.header(ADOPTED), Some("drain"));
    // One session adopted, one waiting to be: the client's quota of 2 is full.
    let over = eventually(WITHIN, || http::try_initialize(&fleet.a.addr, "/mcp"));
    assert_eq!(
        over.outcome(),
        "429 session_quota",
        "handed-over and adopted sessions count: {}",
        over.text()
    );
    // host-b holds its maximum of one session: it does not adopt the second.
    let full = try_count(&fleet.b.addr, "/mcp", &sessions[1], 11).expect("an answer");
    assert_eq!(full.outcome(), "503 session_limit", "{}", full.text());
    assert_eq!(full.header("retry-after"), Some("1"));
    // Ending the adopted session makes room: the second is adopted, counting on.
    let ended = http::delete_session(&fleet.b.addr, "/mcp", &sessions[0]);
    assert_eq!(ended.status, 200, "{}", ended.text());
    let second = try_count(&fleet.b.addr, "/mcp", &sessions[1], 12).expect("an answer");
    assert_eq!(second.expect_tool_text(), "2", "{}", second.text());
    assert_eq!(second.header(ADOPTED), Some("drain"));
    // One session counts now: room for one more, not two.
    let third = http::try_initialize(&fleet.a.addr, "/mcp").expect("an answer");
    assert_eq!(third.status, 200, "{}", third.text());
    let fourth = http::try_initialize(&fleet.a.addr, "/mcp").expect("an answer");
    assert_eq!(fourth.outcome(), "429 session_quota", "{}", fourth.text());
}
