//! `mcpgw-bench failover`: how long the clients of a failed worker wait for the truth.
//!
//! A fleet of two workers (one per supervisor: host-a and host-b) shares one Redis.
//! Each round opens sessions on host-a's worker (the victim) and drives each of them
//! in a closed loop through host-b's worker, so every request is forwarded to the
//! victim. Then the victim gets its fault: `kill -9` (a crashed process) or SIGSTOP (a
//! host gone silent: no refusal, no answer). From the moment the signal is sent, the
//! round measures the time to the first truthful answer (404 `session_gone` or
//! `session_not_found`, 502 `outcome_unknown`) for the victim's sessions, and the time
//! until every one of them had one. A stopped victim is then resumed (it learns it was
//! declared dead and exits); either way its supervisor starts a replacement under a
//! new id, and the next round's victim is that replacement.
//!
//! The figures back the README's failover numbers: about a second after `kill -9`
//! (a forwarded request that gets no answer head within a second makes the caller
//! check the owner), and about one lease after SIGSTOP.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderValue;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Serialize;

use super::client::{self, Connection, Target};
use super::fleet::{Bins, MeshCerts, Proc, RedisServer, UpstreamServer, url_in};
use super::mix::{Era, Op};
use super::procfs;
use super::sessions::now_unix;
use super::units::{parse_duration, utc_timestamp};

/// Flags of `mcpgw-bench failover`. The defaults take about two minutes here: 10
/// rounds of `kill -9` (about 1 s each, plus the replacement's start) and 10 of
/// SIGSTOP (about one lease each, plus the fenced worker's exit and replacement).
#[derive(Debug, Clone, clap::Args)]
pub struct FailoverArgs {
    /// Faults to inject, each for --rounds rounds.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "kill,stop")]
    pub faults: Vec<Fault>,
    /// Rounds per fault.
    #[arg(long, default_value_t = 10)]
    pub rounds: usize,
    /// Sessions opened on the victim each round.
    #[arg(long, default_value_t = 8)]
    pub sessions: usize,
    /// Worker lease of the fleet (`--lease-ms`): a silent owner is declared dead when
    /// it expires.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Mesh transport of the fleet (quic, tcp, redis).
    #[arg(long, default_value = "quic")]
    pub transport: String,
    /// Longest a round waits for every session's truthful answer (and for the
    /// replacement worker) before it is reported as timed out.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub round_timeout: Duration,
    /// Report directory [default: build/bench/failover-<UTC timestamp>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory holding mcpgw and mcpgw-bench [default: beside this binary, then
    /// target/release, then target/debug].
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
}

/// What happens to the victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fault {
    /// SIGKILL: the process is gone, its sockets close, its address refuses.
    Kill,
    /// SIGSTOP: the process is silent but its sockets stay open, like a lost host.
    Stop,
}

impl Fault {
    fn signal(self) -> Signal {
        match self {
            Fault::Kill => Signal::SIGKILL,
            Fault::Stop => Signal::SIGSTOP,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Fault::Kill => "kill -9",
            Fault::Stop => "SIGSTOP",
        }
    }
}

/// How long a client pauses between its requests: fine enough to time an answer to
/// a few milliseconds, light enough to leave the CPU to the fleet.
const PACE: Duration = Duration::from_millis(10);
/// How long starting a process, opening a session or a probe may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Key prefix of the fleet in its Redis.
const KEY_PREFIX: &str = "failover:";

/// One answer a client got (or did not get).
#[derive(Debug, Clone)]
struct Answer {
    sent: Instant,
    answered: Instant,
    /// `200`, `404 session_gone`, `503 ownership_unknown`, … or, with no HTTP answer,
    /// the failure class (`io`, `connect`, `timeout`).
    label: String,
}

/// Whether an answer tells the client the truth about a dead owner: the session is
/// gone, or the outcome of the request is unknown.
fn is_truthful(label: &str) -> bool {
    matches!(
        label,
        "404 session_gone" | "404 session_not_found" | "502 outcome_unknown"
    )
}

/// `status reason` of an HTTP answer, reading `error.data.reason` only from
/// non-success answers (errors are rare, so parsing them costs nothing).
fn label_of(status: u16, body: &[u8]) -> String {
    if (200..300).contains(&status) {
        return status.to_string();
    }
    let reason = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["data"]["reason"].as_str().map(str::to_owned));
    match reason {
        Some(reason) => format!("{status} {reason}"),
        None => status.to_string(),
    }
}

/// One round's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RoundResult {
    pub round: usize,
    pub victim: String,
    /// From the signal to the first truthful answer of any victim session.
    pub first_truthful_ms: Option<f64>,
    /// From the signal until every victim session had a truthful answer.
    pub all_told_ms: Option<f64>,
    /// Answers to requests that were in flight when the signal was sent, by label:
    /// those the victim may have executed, so only `502 outcome_unknown` (or a 200
    /// that was already on its way back) tells the whole truth.
    pub answers_in_flight: BTreeMap<String, u64>,
    /// Answers to requests sent after the signal, by label.
    pub answers_after_fault: BTreeMap<String, u64>,
    /// Successes for requests sent after the signal: must be 0 (a dead or silent
    /// owner cannot answer, and no other worker may).
    pub untruthful: u64,
    /// Set when a round did not complete.
    pub error: Option<String>,
}

/// Percentiles over the completed rounds of one fault, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Spread {
    pub rounds: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub max_ms: f64,
}

impl Spread {
    /// Nearest-rank percentiles of `values` (none when empty).
    pub fn of(values: &[f64]) -> Option<Spread> {
        if values.is_empty() {
            return None;
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            let index = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
            sorted[index - 1]
        };
        Some(Spread {
            rounds: sorted.len(),
            p50_ms: rank(0.50),
            p90_ms: rank(0.90),
            max_ms: sorted[sorted.len() - 1],
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FaultReport {
    pub fault: Fault,
    pub first_truthful: Option<Spread>,
    pub all_told: Option<Spread>,
    pub rounds: Vec<RoundResult>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FailoverReport {
    pub started_utc: String,
    pub transport: String,
    pub lease_ms: u64,
    pub sessions_per_round: usize,
    pub faults: Vec<FaultReport>,
}

pub async fn main(args: FailoverArgs) -> anyhow::Result<()> {
    if args.sessions == 0 || args.rounds == 0 {
        anyhow::bail!("--sessions and --rounds must be at least 1");
    }
    let started_utc = utc_timestamp(now_unix());
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("build/bench").join(format!("failover-{started_utc}")));
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", logs.display()))?;
    let bins = Bins::locate(args.bin_dir.as_deref()).map_err(anyhow::Error::msg)?;
    let redis = RedisServer::start("redis", &logs)
        .await
        .map_err(anyhow::Error::msg)?;
    let upstream = UpstreamServer::start(&bins, &logs)
        .await
        .map_err(anyhow::Error::msg)?;
    let certs = MeshCerts::create(&bins, &out.join("certs"), &["host-a", "host-b"])
        .await
        .map_err(anyhow::Error::msg)?;
    let fleet = Pair::start(&bins, &certs, &redis.url, &upstream.url, &args, &logs).await;
    let result = match fleet {
        Ok(pair) => {
            let measured = measure(&pair, &args).await;
            pair.stop().await;
            measured
        }
        Err(e) => Err(e),
    };
    upstream.proc.stop().await;
    redis.proc.stop().await;
    let faults = result.map_err(anyhow::Error::msg)?;
    let report = FailoverReport {
        started_utc,
        transport: args.transport.clone(),
        lease_ms: u64::try_from(args.lease.as_millis()).unwrap_or(u64::MAX),
        sessions_per_round: args.sessions,
        faults,
    };
    let table = render(&report);
    println!("\n{table}");
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(out.join("failover.json"), json)?;
    std::fs::write(out.join("failover.md"), table)?;
    println!("report: {}", out.join("failover.md").display());
    Ok(())
}

/// The two supervisors: host-a holds the victims, host-b forwards to them.
struct Pair {
    a: Proc,
    b: Proc,
    a_target: Target,
    b_target: Target,
}

impl Pair {
    async fn start(
        bins: &Bins,
        certs: &MeshCerts,
        redis_url: &str,
        upstream_url: &str,
        args: &FailoverArgs,
        logs: &Path,
    ) -> Result<Pair, String> {
        let (a, a_url) =
            start_supervisor(bins, certs, "host-a", redis_url, upstream_url, args, logs).await?;
        let b = start_supervisor(bins, certs, "host-b", redis_url, upstream_url, args, logs).await;
        let (b, b_url) = match b {
            Ok(started) => started,
            Err(e) => {
                a.stop().await;
                return Err(e);
            }
        };
        Ok(Pair {
            a,
            b,
            a_target: Target::parse(&a_url)?,
            b_target: Target::parse(&b_url)?,
        })
    }

    async fn stop(self) {
        self.a.stop().await;
        self.b.stop().await;
    }
}

/// `mcpgw serve --workers 1` for `member`; returns the process and its MCP URL.
async fn start_supervisor(
    bins: &Bins,
    certs: &MeshCerts,
    member: &str,
    redis_url: &str,
    upstream_url: &str,
    args: &FailoverArgs,
    logs: &Path,
) -> Result<(Proc, String), String> {
    let cert = |name: String| certs.dir.join(name).display().to_string();
    let lease_ms = args.lease.as_millis().to_string();
    let argv: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--redis",
        redis_url,
        "--key-prefix",
        KEY_PREFIX,
        "--upstream",
        &format!("demo={upstream_url}"),
        "--mesh-transport",
        &args.transport,
        "--mesh-listen",
        "127.0.0.1:0",
        "--lease-ms",
        &lease_ms,
        "--mesh-ca",
        &cert("ca.crt".into()),
        "--mesh-cert",
        &cert(format!("{member}.crt")),
        "--mesh-key",
        &cert(format!("{member}.key")),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (proc, line) = Proc::start(
        &format!("failover-{member}"),
        &bins.mcpgw,
        &argv,
        logs,
        "mcpgw listening on",
    )
    .await?;
    match url_in(&line) {
        Some(base) => Ok((proc, format!("{base}/mcp"))),
        None => {
            proc.stop().await;
            Err(format!("{member}: no address in {line:?}"))
        }
    }
}

async fn measure(pair: &Pair, args: &FailoverArgs) -> Result<Vec<FaultReport>, String> {
    let mut reports = Vec::new();
    let mut previous_victim: Option<String> = None;
    for &fault in &args.faults {
        let mut rounds = Vec::new();
        for index in 1..=args.rounds {
            let result = round(pair, args, fault, index, previous_victim.as_deref()).await;
            match &result {
                Ok(r) => {
                    previous_victim = Some(r.victim.clone());
                    eprintln!(
                        "{} round {index}/{}: first truthful answer {}, all {} sessions {}; \
                         in flight at the fault: {}; sent after: {}",
                        fault.label(),
                        args.rounds,
                        r.first_truthful_ms
                            .map_or("none".into(), |v| format!("{v:.0} ms")),
                        args.sessions,
                        r.all_told_ms
                            .map_or("not all".into(), |v| format!("{v:.0} ms")),
                        summary(&r.answers_in_flight),
                        summary(&r.answers_after_fault)
                    );
                }
                Err(e) => eprintln!("{} round {index}/{}: {e}", fault.label(), args.rounds),
            }
            match result {
                Ok(r) => rounds.push(r),
                // The fleet is in an unknown state: report what was measured.
                Err(e) => {
                    rounds.push(RoundResult {
                        round: index,
                        victim: previous_victim.clone().unwrap_or_default(),
                        first_truthful_ms: None,
                        all_told_ms: None,
                        answers_in_flight: BTreeMap::new(),
                        answers_after_fault: BTreeMap::new(),
                        untruthful: 0,
                        error: Some(e),
                    });
                    break;
                }
            }
        }
        let firsts: Vec<f64> = rounds.iter().filter_map(|r| r.first_truthful_ms).collect();
        let alls: Vec<f64> = rounds.iter().filter_map(|r| r.all_told_ms).collect();
        reports.push(FaultReport {
            fault,
            first_truthful: Spread::of(&firsts),
            all_told: Spread::of(&alls),
            rounds,
        });
    }
    Ok(reports)
}

fn summary(labels: &BTreeMap<String, u64>) -> String {
    if labels.is_empty() {
        return "–".into();
    }
    labels
        .iter()
        .map(|(label, n)| format!("{label} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the clients of one round share with the coordinator.
struct Shared {
    stop: AtomicBool,
    /// Answers per session, in order.
    answers: Vec<Mutex<Vec<Answer>>>,
}

async fn round(
    pair: &Pair,
    args: &FailoverArgs,
    fault: Fault,
    index: usize,
    previous_victim: Option<&str>,
) -> Result<RoundResult, String> {
    // The victim: host-a's one worker, once it is a new one (the last round's victim
    // must have been replaced).
    let victim = wait_for(args.round_timeout, || async {
        match client::probe_health(&pair.a_target, SETUP_TIMEOUT).await {
            Some(health) if Some(health.worker_id.as_str()) != previous_victim => {
                procfs::sole_worker(pair.a.pid).map(|pid| (health.worker_id, pid))
            }
            _ => None,
        }
    })
    .await
    .ok_or("host-a has no new worker serving")?;
    let (victim_id, victim_pid) = victim;
    let sessions = open_sessions(pair, args, &victim_id).await?;
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        answers: sessions.iter().map(|_| Mutex::new(Vec::new())).collect(),
    });
    let tasks: Vec<_> = sessions
        .iter()
        .cloned()
        .enumerate()
        .map(|(slot, session)| {
            let shared = Arc::clone(&shared);
            let target = pair.b_target.clone();
            let timeout = args.round_timeout;
            tokio::spawn(drive(shared, slot, target, session, timeout))
        })
        .collect();
    // Every session works through host-b before the fault.
    let warmed = wait_for(SETUP_TIMEOUT, || async {
        shared
            .answers
            .iter()
            .all(|a| lock(a).iter().filter(|x| x.label == "200").count() >= 3)
            .then_some(())
    })
    .await;
    if warmed.is_none() {
        shared.stop.store(true, Ordering::Relaxed);
        return Err("the sessions did not work through host-b before the fault".into());
    }
    let pid = Pid::from_raw(i32::try_from(victim_pid).map_err(|_| "pid out of range")?);
    kill(pid, fault.signal()).map_err(|e| format!("cannot signal the victim: {e}"))?;
    let fault_at = Instant::now();
    let told = wait_for(args.round_timeout, || async {
        shared
            .answers
            .iter()
            .all(|a| {
                lock(a)
                    .iter()
                    .any(|x| x.answered > fault_at && is_truthful(&x.label))
            })
            .then_some(())
    })
    .await;
    shared.stop.store(true, Ordering::Relaxed);
    if fault == Fault::Stop {
        // Resumed, it finds its lease taken, drops its sessions and exits.
        let _ = kill(pid, Signal::SIGCONT);
    }
    // In-flight requests of the clients end with the truth or time out.
    for task in tasks {
        let _ = task.await;
    }
    let gone = wait_for(args.round_timeout, || async {
        (!Path::new(&format!("/proc/{victim_pid}")).exists()).then_some(())
    })
    .await;

    let mut first_per_session = Vec::new();
    let mut answers_in_flight = BTreeMap::new();
    let mut answers_after_fault = BTreeMap::new();
    let mut untruthful = 0;
    for answers in &shared.answers {
        let answers = lock(answers);
        if let Some(first) = answers
            .iter()
            .filter(|x| x.answered > fault_at && is_truthful(&x.label))
            .map(|x| x.answered - fault_at)
            .min()
        {
            first_per_session.push(first);
        }
        for answer in answers.iter().filter(|x| x.answered > fault_at) {
            if answer.sent > fault_at {
                *answers_after_fault.entry(answer.label.clone()).or_insert(0) += 1;
                if answer.label == "200" {
                    untruthful += 1;
                }
            } else {
                *answers_in_flight.entry(answer.label.clone()).or_insert(0) += 1;
            }
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let error = match (told, gone) {
        (None, _) => Some(format!(
            "not every session got a truthful answer within {:?}",
            args.round_timeout
        )),
        (_, None) => Some(format!(
            "the victim (pid {victim_pid}) still exists {:?} after the round",
            args.round_timeout
        )),
        _ => None,
    };
    let result = RoundResult {
        round: index,
        victim: victim_id,
        first_truthful_ms: first_per_session.iter().min().copied().map(ms),
        all_told_ms: told.and(first_per_session.iter().max().copied()).map(ms),
        answers_in_flight,
        answers_after_fault,
        untruthful,
        error: error.clone(),
    };
    match error {
        // A victim that never went away would make every later round measure nothing.
        Some(e) if gone.is_none() => Err(e),
        _ => Ok(result),
    }
}

/// Opens `--sessions` sessions on host-a and checks that the victim owns them.
async fn open_sessions(
    pair: &Pair,
    args: &FailoverArgs,
    victim: &str,
) -> Result<Vec<HeaderValue>, String> {
    let mut slot: Option<Connection> = None;
    let mut sessions = Vec::with_capacity(args.sessions);
    while sessions.len() < args.sessions {
        let opened = client::open_session(&mut slot, &pair.a_target, SETUP_TIMEOUT)
            .await
            .map_err(|class| format!("initialize on host-a failed: {class}"))?;
        if opened.owner.as_deref() != Some(victim) {
            return Err(format!(
                "a session on host-a is owned by {:?}, not the victim {victim}",
                opened.owner
            ));
        }
        sessions.push(opened.id);
    }
    Ok(sessions)
}

/// One session's closed loop of `tools/call echo` through host-b.
async fn drive(
    shared: Arc<Shared>,
    slot: usize,
    target: Target,
    session: HeaderValue,
    timeout: Duration,
) {
    let mut connection: Option<Connection> = None;
    let mut id = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        id += 1;
        let Ok(request) =
            client::mix_request(&target, Era::Legacy, Op::CallEcho, id, Some(&session))
        else {
            return;
        };
        let sent = Instant::now();
        let outcome = client::exchange_on(&mut connection, &target, request, timeout).await;
        let label = match outcome {
            Ok(answer) => label_of(answer.status.as_u16(), &answer.body),
            Err(failure) => failure.class(),
        };
        lock(&shared.answers[slot]).push(Answer {
            sent,
            answered: Instant::now(),
            label,
        });
        tokio::time::sleep(PACE).await;
    }
}

/// Polls `check` every few milliseconds until it returns `Some`, or `within` passes.
async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
    within: Duration,
    mut check: impl FnMut() -> F,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// The answers are plain data appended whole, so a poisoned lock still holds a
// consistent value.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The report as a Markdown table.
fn render(report: &FailoverReport) -> String {
    let mut out = format!(
        "## Failover: time to the first truthful answer\n\n\
         {} mesh, lease {} ms, {} sessions on the victim per round, each driven through \
         the other worker; times from the signal.\n\n\
         | fault | rounds | first truthful answer p50 / p90 / max | every session told p50 / p90 / max | answers to requests in flight at the fault | answers to requests sent after it | 200 after it |\n\
         |---|---:|---:|---:|---|---|---:|\n",
        report.transport, report.lease_ms, report.sessions_per_round
    );
    let spread = |s: &Option<Spread>| match s {
        Some(s) => format!(
            "{:.2} / {:.2} / {:.2} s",
            s.p50_ms / 1000.0,
            s.p90_ms / 1000.0,
            s.max_ms / 1000.0
        ),
        None => "–".into(),
    };
    for fault in &report.faults {
        let total = |pick: fn(&RoundResult) -> &BTreeMap<String, u64>| {
            let mut labels = BTreeMap::new();
            for round in &fault.rounds {
                for (label, n) in pick(round) {
                    *labels.entry(label.clone()).or_insert(0) += n;
                }
            }
            summary(&labels)
        };
        let failed = fault.rounds.iter().filter(|r| r.error.is_some()).count();
        let rounds = if failed > 0 {
            format!("{} ({failed} incomplete)", fault.rounds.len())
        } else {
            fault.rounds.len().to_string()
        };
        out.push_str(&format!(
            "| {} | {rounds} | {} | {} | {} | {} | {} |\n",
            fault.fault.label(),
            spread(&fault.first_truthful),
            spread(&fault.all_told),
            total(|r| &r.answers_in_flight),
            total(|r| &r.answers_after_fault),
            fault.rounds.iter().map(|r| r.untruthful).sum::<u64>(),
        ));
    }
    for fault in &report.faults {
        for round in fault.rounds.iter().filter(|r| r.error.is_some()) {
            out.push_str(&format!(
                "\n{} round {}: {}",
                fault.fault.label(),
                round.round,
                round.error.as_deref().unwrap_or_default()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(
            Spread::of(&values),
            Some(Spread {
                rounds: 10,
                p50_ms: 5.0,
                p90_ms: 9.0,
                max_ms: 10.0
            })
        );
        let one = Spread::of(&[1020.0]).expect("one value");
        assert_eq!(
            (one.p50_ms, one.p90_ms, one.max_ms),
            (1020.0, 1020.0, 1020.0)
        );
        assert_eq!(Spread::of(&[]), None);
    }

    #[test]
    fn answers_are_labelled_by_status_and_reason() {
        let gone = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32001,"message":"gone","data":{"reason":"session_gone"}}}"#;
        assert_eq!(label_of(404, gone), "404 session_gone");
        assert!(is_truthful(&label_of(404, gone)));
        let unknown = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32000,"message":"x","data":{"reason":"ownership_unknown","retryable":true}}}"#;
        assert_eq!(label_of(503, unknown), "503 ownership_unknown");
        assert!(!is_truthful("503 ownership_unknown"));
        assert_eq!(label_of(200, b"not even json"), "200");
        assert_eq!(label_of(502, b""), "502");
        assert!(is_truthful("502 outcome_unknown"));
        assert!(
            !is_truthful("502"),
            "a 502 without the reason is no answer about the owner"
        );
    }
}
