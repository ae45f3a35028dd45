//! Closed-loop load for fault tests: one thread per legacy session calling the demo
//! upstream's `counter_increment` through a chosen worker until stopped, recording
//! every answer (never panicking on one), and the checks that judge the record against
//! what the upstream says it ran (`GET /executed`): each session progressed; every 200
//! carries a counter value; a call told it succeeded ran once, a call told it did not
//! run (a retryable 503, `upstream_unreachable`, `session_gone`, ...) never ran, a call
//! of unknown outcome ran at most once; and the counter moved by exactly one per call
//! it was told succeeded.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use mcpgw_testkit::http::{self, try_call_tool};
use mcpgw_testkit::{Upstream, eventually};
use serde_json::json;

/// Every request of every load in this test process gets an id of its own from here
/// on, so the upstream's record of what ran names each request without knowing which
/// gateway session (or which load) it belonged to, and no id a test sends by hand (they
/// are small) is taken for one of the load's.
static NEXT_ID: AtomicU64 = AtomicU64::new(1_000_000_000);

/// What one request of the load got.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub session: String,
    /// The JSON-RPC id the request was sent with: unique in the test process.
    pub id: u64,
    pub started: Instant,
    pub finished: Instant,
    /// 0: no HTTP answer at all (the connection was refused or reset).
    pub status: u16,
    /// The counter value for a 200 that carries one, else `data.reason` (`proxy: …`
    /// for an answer a test's proxy gave itself; or what was wrong with the answer, or
    /// why there was none).
    pub detail: String,
    /// `Retry-After` of the answer.
    pub retry_after: Option<String>,
    /// `mcpgw-owner-worker`: who executed it.
    pub owner: Option<String>,
    /// `mcpgw-edge-worker`: the worker the client reached.
    pub edge: Option<String>,
    /// `mcpgw-adopted`: this request adopted its session (`death`, `drain`).
    pub adopted: Option<String>,
}

impl Outcome {
    /// The counter value, for a success.
    pub fn value(&self) -> Option<u64> {
        (self.status == 200)
            .then(|| self.detail.parse().ok())
            .flatten()
    }

    /// The answer may hide a run of the call: no answer at all, `outcome_unknown`, or
    /// an upstream that took too long or broke its answer off (docs/clients.md: "the
    /// upstream may have run the call").
    pub fn ambiguous(&self) -> bool {
        self.status == 0
            || (self.status != 200
                && matches!(
                    self.detail.as_str(),
                    "outcome_unknown" | "upstream_timeout" | "upstream_failed"
                ))
    }

    /// What the answer told the client about whether the call ran.
    pub fn claim(&self) -> Claim {
        match self.value() {
            Some(value) => Claim::Ran(value),
            None if self.status == 200 => Claim::NoCounter,
            None if self.ambiguous() => Claim::MayHaveRun,
            None => Claim::DidNotRun,
        }
    }
}

/// What one answer says about its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A 200 with the counter value: it ran, once.
    Ran(u64),
    /// A 200 without a counter value (a JSON-RPC error inside a 200, such as
    /// `member_lost`): never progress, always a failure of the check.
    NoCounter,
    /// No answer, or one that says the outcome is unknown: it ran once or not at all.
    MayHaveRun,
    /// Any other error: retry, re-initialize, ...; whichever, it did not run.
    DidNotRun,
}

/// Judges one answer of `session`'s request `id` that started at `started`.
pub fn judge(
    session: &str,
    id: u64,
    started: Instant,
    answer: Result<http::Response, String>,
) -> Outcome {
    let header = |r: &http::Response, name| r.header(name).map(str::to_owned);
    let (status, detail) = match &answer {
        Ok(r) if r.status == 200 => match r.tool_text() {
            Some(text) if text.parse::<u64>().is_ok() => (200, text),
            _ => (200, format!("no counter value in a 200: {}", r.text())),
        },
        Ok(r) => (
            r.status,
            r.reason()
                .or_else(|| {
                    r.header(mcpgw_testkit::scatter::PROXY_HEADER)
                        .map(|said| format!("proxy: {said}"))
                })
                .unwrap_or_else(|| format!("no data.reason in {:?}", r.text())),
        ),
        Err(e) => (0, e.clone()),
    };
    let headers = |name| answer.as_ref().ok().and_then(|r| header(r, name));
    Outcome {
        session: session.to_owned(),
        id,
        started,
        finished: Instant::now(),
        status,
        detail,
        retry_after: headers("retry-after"),
        owner: headers("mcpgw-owner-worker"),
        edge: headers("mcpgw-edge-worker"),
        adopted: headers("mcpgw-adopted"),
    }
}

/// The load: stop it with [`Load::finish`].
pub struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    threads: Vec<thread::JoinHandle<()>>,
    within: Duration,
}

impl Load {
    /// One thread per `(session, address)`, calling through that address; waits of
    /// [`Load::wait_until`] give up after `within` (a bound on a hang).
    pub fn start(targets: &[(String, String)], within: Duration) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let threads = targets
            .iter()
            .cloned()
            .map(|(session, addr)| {
                let (stop, outcomes) = (stop.clone(), outcomes.clone());
                thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
                        let started = Instant::now();
                        let answer =
                            try_call_tool(&addr, &session, id, "counter_increment", json!({}));
                        lock(&outcomes).push(judge(&session, id, started, answer));
                        thread::sleep(Duration::from_millis(20));
                    }
                })
            })
            .collect();
        Load {
            stop,
            outcomes,
            threads,
            within,
        }
    }

    /// Every session through one address (a scattering proxy).
    pub fn through(addr: &str, sessions: &[String], within: Duration) -> Load {
        let targets: Vec<(String, String)> = sessions
            .iter()
            .map(|s| (s.clone(), addr.to_owned()))
            .collect();
        Load::start(&targets, within)
    }

    /// The outcomes so far, in no particular order.
    pub fn snapshot(&self) -> Vec<Outcome> {
        lock(&self.outcomes).clone()
    }

    /// Waits until `condition` holds over the outcomes so far; its `Err` says what is
    /// still missing.
    #[track_caller]
    pub fn wait_until(&self, condition: impl Fn(&[Outcome]) -> Result<(), String>) {
        eventually(self.within, || condition(&self.snapshot()));
    }

    /// Stops the load and returns every outcome in the order the requests started. A
    /// load thread that panicked fails the test here, so "no errors" can never pass
    /// with a dead thread.
    pub fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
        let mut all = lock(&self.outcomes).clone();
        all.sort_by_key(|o| o.started);
        all
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Successful calls of `session` that started after `since`: answers with a counter
/// value (a 200 without one is no progress).
pub fn successes_since(outcomes: &[Outcome], session: &str, since: Instant) -> usize {
    outcomes
        .iter()
        .filter(|o| o.session == session && o.value().is_some() && o.started > since)
        .count()
}

/// A condition for [`Load::wait_until`]: every session made `n` successful calls
/// since `since`.
pub fn every_session_progressed(
    sessions: &[String],
    n: usize,
    since: Instant,
) -> impl Fn(&[Outcome]) -> Result<(), String> + '_ {
    move |outcomes| {
        let behind: Vec<&String> = sessions
            .iter()
            .filter(|s| successes_since(outcomes, s, since) < n)
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} sessions not yet at {n} successes: {behind:?}",
                behind.len()
            ))
        }
    }
}

/// Like [`every_session_progressed`], but a session told it is gone (404) since
/// `since` counts as settled: the test then fails on that answer at once, instead of
/// waiting out the deadline for progress that can never come.
pub fn every_session_progressed_or_gone(
    sessions: &[String],
    n: usize,
    since: Instant,
) -> impl Fn(&[Outcome]) -> Result<(), String> + '_ {
    move |outcomes| {
        let gone = |s: &String| {
            outcomes
                .iter()
                .any(|o| &o.session == s && o.started > since && o.status == 404)
        };
        let behind: Vec<&String> = sessions
            .iter()
            .filter(|s| successes_since(outcomes, s, since) < n && !gone(s))
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} sessions neither at {n} successes nor gone: {behind:?}",
                behind.len()
            ))
        }
    }
}

/// One line per answer, times in ms since the first request: for failure messages.
pub fn history(outcomes: &[&Outcome]) -> String {
    let Some(first) = outcomes.first().map(|o| o.started) else {
        return String::new();
    };
    let ms = |t: Instant| t.duration_since(first).as_millis();
    let lines = outcomes.iter().map(|o| {
        format!(
            "{:>6}..{:<6} #{} {} {} edge={} owner={} adopted={}",
            ms(o.started),
            ms(o.finished),
            o.id,
            o.status,
            o.detail,
            o.edge.as_deref().unwrap_or("-"),
            o.owner.as_deref().unwrap_or("-"),
            o.adopted.as_deref().unwrap_or("-"),
        )
    });
    std::iter::once(format!("(ms since {first:?})"))
        .chain(lines)
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the upstream ran, as `GET /executed` told it: for each request id, the upstream
/// sessions it ran in (one entry per run).
#[derive(Debug, Clone, Default)]
pub struct Runs {
    by_id: HashMap<u64, Vec<String>>,
    /// Runs the upstream's bounded log left out: with any, the check cannot be trusted.
    dropped: u64,
}

impl Runs {
    /// What `upstream` ran so far.
    #[track_caller]
    pub fn of(upstream: &Upstream) -> Runs {
        let executed = upstream.executed();
        let runs = executed.sessions.iter().flat_map(|(session, ids)| {
            ids.iter()
                .filter_map(serde_json::Value::as_u64)
                .map(move |id| (session.clone(), id))
        });
        let mut all = Runs::from_runs(runs);
        all.dropped = executed.dropped;
        all
    }

    /// Runs given as `(upstream session, request id)`, one pair per run.
    pub fn from_runs(runs: impl IntoIterator<Item = (String, u64)>) -> Runs {
        let mut by_id: HashMap<u64, Vec<String>> = HashMap::new();
        for (session, id) in runs {
            by_id.entry(id).or_default().push(session);
        }
        Runs { by_id, dropped: 0 }
    }

    /// The upstream sessions request `id` ran in, once per run.
    pub fn of_id(&self, id: u64) -> &[String] {
        self.by_id.get(&id).map(Vec::as_slice).unwrap_or_default()
    }
}

/// Fails the test unless every one of `sessions` passes [`check_session`] against what
/// `upstream` ran, and no two of them ran calls in one upstream session. Read after the
/// load finished, so every call the load sent has reached the upstream or never will.
#[track_caller]
pub fn assert_truthful(outcomes: &[Outcome], sessions: &[String], upstream: &Upstream) {
    let runs = Runs::of(upstream);
    if let Err(problem) = check_sessions(outcomes, sessions, &runs) {
        panic!("{problem}");
    }
}

/// [`check_session`] for each of `sessions`, and that no upstream session served two of
/// them (a request sent into another client's upstream session).
pub fn check_sessions(
    outcomes: &[Outcome],
    sessions: &[String],
    runs: &Runs,
) -> Result<(), String> {
    let mut served_by: BTreeMap<String, &String> = BTreeMap::new();
    for session in sessions {
        check_session(outcomes, session, runs)?;
        for o in outcomes.iter().filter(|o| &o.session == session) {
            for upstream_session in runs.of_id(o.id) {
                let first = served_by.entry(upstream_session.clone()).or_insert(session);
                if *first != session {
                    return Err(format!(
                        "sessions {first} and {session} both ran calls in upstream session \
                         {upstream_session} (request #{} of {session})",
                        o.id
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Judges `session`'s answers against what the upstream ran (`runs`): the session
/// progressed; every 200 carried a counter value; no request ran twice; a request told
/// it succeeded ran; a request told it did not run (any error but one of unknown
/// outcome) never ran; all its calls ran in one upstream session; and its counter moved
/// by exactly one per call it was told succeeded, a call of unknown outcome counting as
/// one if it ran (possibly later than the calls after it: an owner paused mid-call that
/// wakes before it learns it was replaced). A fresh session would restart at 1; a
/// retryable answer that hid a run shows in `runs`, even where an earlier answer of
/// unknown outcome would have explained the count.
pub fn check_session(outcomes: &[Outcome], session: &str, runs: &Runs) -> Result<(), String> {
    let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.session == session).collect();
    let fail = |what: String| {
        Err(format!(
            "session {session}: {what}; its whole history:\n{}",
            history(&mine)
        ))
    };
    if runs.dropped > 0 {
        return fail(format!(
            "the upstream's log of executed ids left out {} runs, so what ran cannot be \
             told; send fewer requests per upstream",
            runs.dropped
        ));
    }
    let mut upstream_sessions = BTreeSet::new();
    for o in &mine {
        let ran = runs.of_id(o.id);
        upstream_sessions.extend(ran.iter().cloned());
        if ran.len() > 1 {
            return fail(format!(
                "request #{} ran {} times upstream: {o:?}",
                o.id,
                ran.len()
            ));
        }
        match o.claim() {
            Claim::NoCounter => {
                return fail(format!(
                    "a 200 without a counter value is no success: {o:?}"
                ));
            }
            Claim::Ran(_) if ran.is_empty() => {
                return fail(format!(
                    "request #{} was answered with a counter value, but the upstream never \
                     ran it: {o:?}",
                    o.id
                ));
            }
            Claim::DidNotRun if !ran.is_empty() => {
                return fail(format!(
                    "request #{} was told {} {} (it did not run), but it ran upstream: {o:?}",
                    o.id, o.status, o.detail
                ));
            }
            Claim::Ran(_) | Claim::MayHaveRun | Claim::DidNotRun => {}
        }
    }
    if upstream_sessions.len() > 1 {
        return fail(format!(
            "its calls ran in {} upstream sessions: {upstream_sessions:?}",
            upstream_sessions.len()
        ));
    }
    check_counting(&mine).or_else(fail)
}

/// The counter moved by exactly one per call told it succeeded, plus at most one per
/// answer of unknown outcome not yet seen to have run.
fn check_counting(mine: &[&Outcome]) -> Result<(), String> {
    let mut last: Option<u64> = None;
    // Unknown outcomes not yet seen to have run.
    let mut unaccounted = 0;
    for o in mine {
        if let Some(value) = o.value() {
            if let Some(last) = last {
                let ran_unseen = value.checked_sub(last + 1);
                if ran_unseen.is_none_or(|n| n > unaccounted) {
                    return Err(format!(
                        "counter went {last} -> {value} with {unaccounted} answers of unknown \
                         outcome not yet accounted for (a fresh session, or a call run twice)"
                    ));
                }
                unaccounted -= ran_unseen.unwrap_or(0);
            }
            last = Some(value);
        } else if o.ambiguous() {
            unaccounted += 1;
        }
    }
    if last.is_none() {
        return Err("no call was answered with a counter value: no progress".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The checker on fabricated histories: it must fail on each way a gateway can lie
    //! (so a fault test that passes has shown something), and pass on the truth.

    use super::*;

    /// Session `s`'s answers in order, request ids 1, 2, ...: `(status, detail)`.
    fn history_of(answers: &[(u16, &str)]) -> Vec<Outcome> {
        let start = Instant::now();
        answers
            .iter()
            .enumerate()
            .map(|(i, (status, detail))| {
                let at = start + Duration::from_millis(10 * i as u64);
                Outcome {
                    session: "s".into(),
                    id: i as u64 + 1,
                    started: at,
                    finished: at + Duration::from_millis(5),
                    status: *status,
                    detail: (*detail).to_owned(),
                    retry_after: None,
                    owner: None,
                    edge: None,
                    adopted: None,
                }
            })
            .collect()
    }

    /// Request ids that ran, all in upstream session "u".
    fn ran(ids: &[u64]) -> Runs {
        Runs::from_runs(ids.iter().map(|id| ("u".to_owned(), *id)))
    }

    fn check(answers: &[(u16, &str)], ids: &[u64]) -> Result<(), String> {
        check_sessions(&history_of(answers), &["s".to_owned()], &ran(ids))
    }

    #[track_caller]
    fn assert_fails(answers: &[(u16, &str)], ids: &[u64], because: &str) {
        match check(answers, ids) {
            Ok(()) => panic!("the checker passed a lie ({because}): {answers:?}, ran {ids:?}"),
            Err(problem) => assert!(
                problem.contains(because),
                "failed, but not because {because:?}: {problem}"
            ),
        }
    }

    #[test]
    fn a_200_without_a_counter_value_fails_the_check() {
        let member_lost =
            "no counter value in a 200: {\"error\":{\"data\":{\"reason\":\"member_lost\"}}}";
        assert_fails(
            &[(200, "1"), (200, member_lost), (200, "2")],
            &[1, 3],
            "a 200 without a counter value",
        );
    }

    #[test]
    fn a_retryable_answer_for_a_call_that_ran_fails_the_check_even_after_an_unknown_outcome() {
        // The counter alone cannot tell: 1 -> 3 with one unknown outcome before it. The
        // upstream's record can: #3 was told "retry" and ran, #2 did not run.
        assert_fails(
            &[
                (200, "1"),
                (502, "outcome_unknown"),
                (503, "ownership_unknown"),
                (200, "3"),
            ],
            &[1, 3, 4],
            "was told 503 ownership_unknown (it did not run), but it ran",
        );
        assert_fails(
            &[(200, "1"), (502, "upstream_unreachable"), (200, "3")],
            &[1, 2, 3],
            "was told 502 upstream_unreachable",
        );
        assert_fails(
            &[(200, "1"), (404, "session_gone")],
            &[1, 2],
            "was told 404 session_gone",
        );
    }

    #[test]
    fn a_request_run_twice_fails_the_check_even_where_the_count_explains_it() {
        assert_fails(
            &[(200, "1"), (0, "connection reset"), (200, "3")],
            &[1, 2, 2, 3],
            "request #2 ran 2 times",
        );
    }

    #[test]
    fn an_outcome_unknown_may_have_run_or_not() {
        let answers = [
            (200, "1"),
            (502, "outcome_unknown"),
            (503, "lease_in_doubt"),
        ];
        check(
            &[answers[0], answers[1], answers[2], (200, "3")],
            &[1, 2, 4],
        )
        .expect("the unknown outcome ran");
        check(&[answers[0], answers[1], answers[2], (200, "2")], &[1, 4])
            .expect("the unknown outcome did not run");
        check(&[(200, "1"), (0, "reset"), (200, "2")], &[1, 3]).expect("no answer, not run");
    }

    #[test]
    fn the_checker_fails_on_what_the_counter_and_the_log_disagree_on() {
        assert_fails(&[(200, "1"), (200, "2")], &[1], "the upstream never ran it");
        assert_fails(&[(200, "1"), (200, "1")], &[1, 2], "counter went 1 -> 1");
        assert_fails(&[(503, "ownership_unknown")], &[], "no progress");
        let outcomes = history_of(&[(200, "1"), (200, "2")]);
        let two_upstream_sessions = Runs::from_runs([("u".to_owned(), 1), ("v".to_owned(), 2)]);
        let problem = check_session(&outcomes, "s", &two_upstream_sessions)
            .expect_err("one client session, two upstream sessions");
        assert!(problem.contains("2 upstream sessions"), "{problem}");
    }

    #[test]
    fn two_client_sessions_in_one_upstream_session_fail_the_check() {
        let mut outcomes = history_of(&[(200, "1")]);
        let mut other = history_of(&[(200, "1")]);
        other[0].session = "t".into();
        other[0].id = 2;
        outcomes.extend(other);
        let runs = ran(&[1, 2]);
        let problem = check_sessions(&outcomes, &["s".into(), "t".into()], &runs)
            .expect_err("two clients' calls in one upstream session");
        assert!(
            problem.contains("both ran calls in upstream session u"),
            "{problem}"
        );
    }

    #[test]
    fn a_partial_log_is_not_trusted() {
        let mut runs = ran(&[1]);
        runs.dropped = 3;
        let problem =
            check_session(&history_of(&[(200, "1")]), "s", &runs).expect_err("an overflowed log");
        assert!(problem.contains("left out 3 runs"), "{problem}");
    }
}
