//! Closed-loop load for fault tests: one thread per legacy session calling the demo
//! upstream's `counter_increment` through a chosen worker until stopped, recording
//! every answer (never panicking on one), and the checks that judge the record: that
//! each session progressed, and that its counter moved by exactly one per call it was
//! told succeeded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use mcpgw_testkit::eventually;
use mcpgw_testkit::http::{self, try_call_tool};
use serde_json::json;

/// What one request of the load got.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub session: String,
    pub started: Instant,
    pub finished: Instant,
    /// 0: no HTTP answer at all (the connection was refused or reset).
    pub status: u16,
    /// The counter value for a 200, else `data.reason` (or what was wrong with the
    /// answer, or why there was none).
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

    /// The answer may hide a run of the call: 502 `outcome_unknown`, or no answer.
    pub fn ambiguous(&self) -> bool {
        self.status == 0 || (self.status == 502 && self.detail == "outcome_unknown")
    }
}

/// Judges one answer of `session`'s request that started at `started`.
pub fn judge(session: &str, started: Instant, answer: Result<http::Response, String>) -> Outcome {
    let header = |r: &http::Response, name| r.header(name).map(str::to_owned);
    let (status, detail) = match &answer {
        Ok(r) if r.status == 200 => (200, r.tool_text().unwrap_or_default()),
        Ok(r) => (
            r.status,
            r.reason()
                .unwrap_or_else(|| format!("no data.reason in {:?}", r.text())),
        ),
        Err(e) => (0, e.clone()),
    };
    let headers = |name| answer.as_ref().ok().and_then(|r| header(r, name));
    Outcome {
        session: session.to_owned(),
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
                    let mut id = 1000;
                    while !stop.load(Ordering::Relaxed) {
                        id += 1;
                        let started = Instant::now();
                        let answer =
                            try_call_tool(&addr, &session, id, "counter_increment", json!({}));
                        lock(&outcomes).push(judge(&session, started, answer));
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

/// Successful calls of `session` that started after `since`.
pub fn successes_since(outcomes: &[Outcome], session: &str, since: Instant) -> usize {
    outcomes
        .iter()
        .filter(|o| o.session == session && o.status == 200 && o.started > since)
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
            "{:>6}..{:<6} {} {} edge={} owner={} adopted={}",
            ms(o.started),
            ms(o.finished),
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

/// The session kept its state, and its counter moved by exactly one per call it was
/// told succeeded: a call may have run unseen only where its answer said the outcome is
/// unknown (502 `outcome_unknown`, or no HTTP answer at all), at most once each, and
/// possibly later than the calls after it (an owner paused mid-call that wakes before
/// it learns it was replaced). A fresh session would restart at 1; a retryable answer
/// that hid a run would show as a count doubled.
#[track_caller]
pub fn assert_counting_on(outcomes: &[Outcome], session: &str) {
    let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.session == session).collect();
    let mut last: Option<u64> = None;
    // Unknown outcomes not yet seen to have run.
    let mut unaccounted = 0;
    for o in &mine {
        if let Some(value) = o.value() {
            if let Some(last) = last {
                let ran_unseen = value.checked_sub(last + 1);
                assert!(
                    ran_unseen.is_some_and(|n| n <= unaccounted),
                    "session {session}: counter went {last} -> {value} with {unaccounted} \
                     answers of unknown outcome not yet accounted for (a fresh session, or \
                     a call run twice); its whole history:\n{}",
                    history(&mine)
                );
                unaccounted -= ran_unseen.unwrap_or(0);
            }
            last = Some(value);
        } else if o.ambiguous() {
            unaccounted += 1;
        }
    }
    assert!(last.is_some(), "session {session} made progress");
}
