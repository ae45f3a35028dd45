//! `mcpgw-bench run`: closed-loop or open-loop load against one or more gateway URLs.
//!
//! Closed loop (the default): every load session is a task that sends its next
//! request when the previous answer is complete, so offered load follows the
//! system's speed. A slow moment then hides itself: the sessions simply wait, and
//! the requests they would have sent meanwhile are never measured (coordinated
//! omission).
//!
//! Open loop (`--rate N`): requests are due on a fixed schedule, request k at
//! `k / N` seconds, dealt round-robin to the sessions (each still sends one request
//! at a time). A session that is still busy when its next request is due sends it
//! as soon as it is free, and that request's latency counts from when it was due,
//! not from when it was sent: the wait a user would have seen is in the figures
//! (coordinated omission corrected, as wrk2 and k6's constant-arrival-rate do). Legacy sessions open with
//! `initialize` and learn their owner from the `mcpgw-owner-worker` header; the
//! routing mode then decides, per request, which URL (which worker) gets it.
//!
//! Measurement starts after every session is open and a warm-up has passed, so
//! connection setup and first-use costs (mesh handshakes, pools) stay out of the
//! figures; the CPU and Redis counters are read at the same two instants.

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use http::HeaderValue;
use serde::Serialize;
use tokio::sync::Barrier;

use super::client::{self, Connection, Target};
use super::latency::{self, LatencySummary, new_histogram};
use super::mix::{Era, Mix, Op};
use super::procfs;
use super::redis::{self, RedisClient};
use super::report;
use super::routing::{Routing, pick_url};
use super::units::parse_duration;

/// Flags of `mcpgw-bench run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// A gateway MCP endpoint, e.g. http://127.0.0.1:8080/mcp; repeat for several.
    /// `sticky` and `forward` are exact when each URL reaches one worker
    /// (`mcpgw serve --workers 1` per URL).
    #[arg(long = "url", required = true)]
    pub urls: Vec<String>,
    /// Concurrent load sessions (each one request at a time).
    #[arg(long, default_value_t = 64)]
    pub sessions: usize,
    /// Protocol era: legacy sessions, or modern (2026-07-28) stateless requests.
    #[arg(long, value_enum, default_value_t = Era::Legacy)]
    pub era: Era,
    /// Which worker each request reaches: sticky (the owner), round-robin over the
    /// URLs, or forward (never the owner).
    #[arg(long, value_enum, default_value_t = Routing::RoundRobin)]
    pub routing: Routing,
    /// tools/call echo : tools/list.
    #[arg(long, default_value_t = Mix::default())]
    pub mix: Mix,
    /// Measured time (ignored with --requests).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Measure this many requests instead of a duration.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Open loop: offer this many requests per second in total, spread evenly over
    /// the sessions, and measure latency from each request's intended send time.
    /// Without it the load is closed-loop. Give enough --sessions for the latency
    /// at this rate (a session sends one request at a time).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Unmeasured load before measuring starts.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Deadline of one request (connect included).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Redis of the fleet, to count Redis commands per request (INFO commandstats).
    #[arg(long)]
    pub redis: Option<String>,
    /// More gateway process ids to count CPU for (children included). The workers
    /// behind the URLs are found through GET /healthz.
    #[arg(long = "pid")]
    pub pids: Vec<u32>,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the result as a Markdown table here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Name of this run in reports.
    #[arg(long, default_value = "run")]
    pub label: String,
    /// Leave the legacy sessions open afterwards instead of deleting them.
    #[arg(long)]
    pub keep_sessions: bool,
}

/// Everything one load run needs; `compare` builds these directly.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub label: String,
    pub urls: Vec<String>,
    pub sessions: usize,
    pub era: Era,
    pub routing: Routing,
    pub mix: Mix,
    pub duration: Duration,
    pub requests: Option<u64>,
    /// Open loop at this many requests per second; None: closed loop.
    pub rate: Option<f64>,
    pub warmup: Duration,
    pub timeout: Duration,
    pub redis_url: Option<String>,
    pub pids: Vec<u32>,
    /// The upstream's pid, when it runs here: its CPU is reported apart, and not
    /// counted as "other" load.
    pub upstream_pid: Option<u32>,
    /// Show a progress line on stderr (only when it is a terminal).
    pub progress: bool,
    /// DELETE the legacy sessions after measuring.
    pub cleanup: bool,
}

impl From<&RunArgs> for LoadSpec {
    fn from(args: &RunArgs) -> Self {
        LoadSpec {
            label: args.label.clone(),
            urls: args.urls.clone(),
            sessions: args.sessions,
            era: args.era,
            routing: args.routing,
            mix: args.mix,
            duration: args.duration,
            requests: args.requests,
            rate: args.rate,
            warmup: args.warmup,
            timeout: args.timeout,
            redis_url: args.redis.clone(),
            pids: args.pids.clone(),
            upstream_pid: None,
            progress: true,
            cleanup: !args.keep_sessions,
        }
    }
}

/// The outcome of one load run.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub label: String,
    pub urls: Vec<String>,
    /// Worker id behind each URL (GET /healthz); null for a URL that is no gateway.
    pub workers: Vec<Option<String>>,
    pub era: Era,
    pub routing: Routing,
    pub mix: String,
    pub sessions: usize,
    /// Time to open every session (initialize + initialized), unmeasured.
    pub setup_s: f64,
    /// Measured time: from the start of measuring until the last counted answer.
    pub window_s: f64,
    /// Open loop: the offered rate (requests per second); null for a closed loop.
    pub offered_rps: Option<f64>,
    /// Open loop: counted requests that were due but never sent, because their
    /// session was still behind when the window's grace time (as long as the
    /// window, at least 1 s) ran out. Non-zero means far past saturation.
    pub unsent: u64,
    /// Counted requests: successes plus errors.
    pub requests: u64,
    pub ok: u64,
    /// Errors by class (`http 503`, `json-rpc -32001`, `timeout`, …).
    pub errors: BTreeMap<String, u64>,
    /// Errors during set-up and warm-up, not part of `requests`.
    pub unmeasured_errors: BTreeMap<String, u64>,
    /// Successful requests per second (open loop: the rate actually achieved).
    pub throughput_rps: f64,
    /// Latency of every successful request. Open loop: from the request's intended
    /// send time to its answer (coordinated omission corrected).
    pub latency: LatencySummary,
    /// Open loop: latency from the actual send to the answer, as a closed loop
    /// would measure it; the gap to `latency` is time spent waiting to be sent.
    pub service_latency: Option<LatencySummary>,
    /// Open loop: how long after its due time each request left, among those whose
    /// session was free when it fell due: the load generator's own punctuality, which
    /// is in `latency` too and is not the gateway's.
    pub send_lag: Option<LatencySummary>,
    /// Latency of the successful `tools/call` requests alone.
    pub tools_call_latency: LatencySummary,
    /// Share of successful answers whose edge and owner workers differ; null when
    /// the answers carry no worker headers (no gateway in the path).
    pub forwarded_fraction: Option<f64>,
    /// Redis commands per counted request (all clients, `info` excluded).
    pub redis_commands_per_request: Option<f64>,
    /// Redis commands during the window, by command.
    pub redis_commands: Option<BTreeMap<String, u64>>,
    pub cpu: CpuFigures,
    /// Packets on this machine during the window (all processes), when readable.
    pub network: Option<NetworkFigures>,
}

/// What the window cost in packets: the mesh's share shows as the difference to
/// sticky; UDP drops and TCP retransmissions show loss that inflates the tail.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NetworkFigures {
    pub tcp_segments_per_request: f64,
    pub udp_datagrams_per_request: f64,
    pub tcp_retransmitted: u64,
    pub udp_receive_buffer_drops: u64,
}

/// CPU seconds per 1,000 counted requests, from utime + stime in /proc.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuFigures {
    pub clock_ticks_per_second: u64,
    /// The gateway processes (workers behind the URLs, and --pid trees).
    pub gateway_s_per_1k: Option<f64>,
    /// Gateway CPU seconds per second of the window (cores busy).
    pub gateway_cores: Option<f64>,
    /// The Redis server, when it runs on this machine.
    pub redis_s_per_1k: Option<f64>,
    /// This process: the load generator.
    pub loadgen_s_per_1k: Option<f64>,
    /// The upstream, when its pid is known.
    pub upstream_s_per_1k: Option<f64>,
    /// Cores the whole machine kept busy during the window.
    pub machine_cores: Option<f64>,
    /// Cores used by everything else (not the gateway, Redis, upstream or load
    /// generator): other work on the machine that skews the figures when high.
    pub other_cores: Option<f64>,
}

/// `mcpgw-bench run`.
pub async fn main(args: RunArgs) -> anyhow::Result<()> {
    let result = run_load(&LoadSpec::from(&args))
        .await
        .map_err(anyhow::Error::msg)?;
    let table = match result.offered_rps {
        Some(_) => report::open_loop_markdown(std::slice::from_ref(&result)),
        None => report::runs_markdown(std::slice::from_ref(&result)),
    };
    print!("{table}");
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&result)?;
        std::fs::write(path, json + "\n")
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, table)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// What every load session reads, fixed for the run.
struct Plan {
    targets: Vec<Target>,
    /// Worker id → index of the URL that reaches it.
    owner_urls: HashMap<String, usize>,
    era: Era,
    routing: Routing,
    mix: Mix,
    timeout: Duration,
}

/// What the coordinator and the sessions share while the load runs.
#[derive(Default)]
struct Flags {
    /// Set when warm-up ends: requests started from now on are counted.
    measuring: AtomicBool,
    /// Set when the duration is over: sessions send no new request.
    stop: AtomicBool,
    /// With --requests: how many counted requests may be started in total.
    budget: Option<u64>,
    /// Counted requests started so far (only kept with a budget).
    claimed: AtomicU64,
    /// Counted answers so far, for the progress line.
    completed: AtomicU64,
    /// Counted errors so far, for the progress line.
    failed: AtomicU64,
}

/// The open-loop timetable: request k (over all sessions) is due at
/// `start + k / rate`; requests `first..end` are counted.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    start: Instant,
    rate: f64,
    sessions: u64,
    first: u64,
    end: u64,
    /// No request is sent after this instant; the rest count as unsent.
    deadline: Instant,
}

impl Schedule {
    fn due(&self, k: u64) -> Instant {
        self.start + Duration::from_secs_f64(k as f64 / self.rate)
    }
}

/// The open-loop timetable as the sessions see it: the schedule, and each session's
/// gate, which [`pace`] opens once per request of that session as it falls due.
#[derive(Clone)]
struct Paced {
    schedule: Schedule,
    gates: Arc<[Gate]>,
}

/// How many of one session's requests have fallen due.
#[derive(Default)]
struct Gate {
    due: AtomicU64,
    opened: tokio::sync::Notify,
}

impl Gate {
    /// Waits until the session's `n`-th request (from 0) is due.
    async fn wait_for(&self, n: u64) {
        loop {
            let opened = self.opened.notified();
            if self.due.load(Ordering::Acquire) > n {
                return;
            }
            opened.await;
        }
    }
}

/// Opens each request's gate at its due time, from a thread of its own. tokio's timer
/// counts whole milliseconds: a request that slept on it left up to a millisecond (on
/// a busy runtime, more) after it was due, and that lateness of the load generator
/// was counted as the gateway's latency, alike for every configuration. A thread
/// sleeping on the kernel's high-resolution timer wakes within tens of microseconds,
/// and opens every gate that fell due meanwhile. It ends with the timetable, or when
/// no session is left to wait (the run ended early).
fn pace(paced: Paced) {
    // The kernel lets a sleeping thread wake up to its timer slack late (50 µs by
    // default), to group wake-ups; this thread's wake-ups are the schedule.
    let _ = nix::sys::prctl::set_timerslack(1_000);
    let Paced { schedule, gates } = paced;
    let sessions = gates.len() as u64;
    let mut k = 0;
    while k < schedule.end && Arc::strong_count(&gates) > 1 {
        let now = Instant::now();
        let due = schedule.due(k);
        if due > now {
            std::thread::sleep(due - now);
            continue;
        }
        while k < schedule.end && schedule.due(k) <= now {
            let gate = &gates[(k % sessions) as usize];
            gate.due.fetch_add(1, Ordering::Release);
            gate.opened.notify_one();
            k += 1;
        }
    }
}

/// One session's measurements, merged at the end.
struct SessionStats {
    all: Histogram<u64>,
    calls: Histogram<u64>,
    /// Open loop: latency from the actual send.
    service: Histogram<u64>,
    /// Open loop: due → sent, for requests whose session was free when due.
    send_lag: Histogram<u64>,
    ok: u64,
    unsent: u64,
    /// When the last counted answer came.
    last_answer: Option<Instant>,
    errors: BTreeMap<String, u64>,
    unmeasured_errors: BTreeMap<String, u64>,
    /// Successful answers that crossed the mesh.
    forwarded: u64,
    /// Successful answers that carried both worker headers.
    with_worker_headers: u64,
}

impl SessionStats {
    fn new() -> Self {
        SessionStats {
            all: new_histogram(),
            calls: new_histogram(),
            service: new_histogram(),
            send_lag: new_histogram(),
            ok: 0,
            unsent: 0,
            last_answer: None,
            errors: BTreeMap::new(),
            unmeasured_errors: BTreeMap::new(),
            forwarded: 0,
            with_worker_headers: 0,
        }
    }

    fn merge(&mut self, other: &SessionStats) {
        // Histograms of the same precision always merge.
        let _ = self.all.add(&other.all);
        let _ = self.calls.add(&other.calls);
        let _ = self.service.add(&other.service);
        let _ = self.send_lag.add(&other.send_lag);
        self.ok += other.ok;
        self.unsent += other.unsent;
        self.last_answer = self.last_answer.max(other.last_answer);
        merge_counts(&mut self.errors, &other.errors);
        merge_counts(&mut self.unmeasured_errors, &other.unmeasured_errors);
        self.forwarded += other.forwarded;
        self.with_worker_headers += other.with_worker_headers;
    }
}

fn merge_counts(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (class, count) in from {
        *into.entry(class.clone()).or_default() += count;
    }
}

/// A session's connections and id, handed back for the DELETE after measuring.
struct Leftover {
    slots: Vec<Option<Connection>>,
    session: HeaderValue,
    url: usize,
}

struct SessionOutcome {
    stats: SessionStats,
    leftover: Option<Leftover>,
}

/// Runs one load as `spec` says and measures it.
pub async fn run_load(spec: &LoadSpec) -> Result<RunResult, String> {
    if spec.sessions == 0 {
        return Err("--sessions must be at least 1".into());
    }
    if let Some(rate) = spec.rate
        && !(rate.is_finite() && rate > 0.0)
    {
        return Err(format!(
            "--rate must be a positive number of requests per second, not {rate}"
        ));
    }
    let targets = spec
        .urls
        .iter()
        .map(|url| Target::parse(url))
        .collect::<Result<Vec<_>, _>>()?;
    if targets.is_empty() {
        return Err("give at least one --url".into());
    }
    if spec.routing == Routing::Forward && targets.len() < 2 {
        return Err("forward routing needs at least two URLs (two workers)".into());
    }

    // Who is behind each URL: the owner map for routing, and pids for CPU.
    let mut owner_urls = HashMap::new();
    let mut workers = Vec::with_capacity(targets.len());
    let mut gateway_pids = spec.pids.clone();
    for (index, target) in targets.iter().enumerate() {
        let health = client::probe_health(target, spec.timeout).await;
        if let Some(health) = &health {
            owner_urls.entry(health.worker_id.clone()).or_insert(index);
            gateway_pids.extend(health.pid);
        }
        workers.push(health.map(|h| h.worker_id));
    }
    if spec.era == Era::Legacy && spec.routing != Routing::RoundRobin && targets.len() > 1 {
        let distinct: std::collections::HashSet<&String> = workers.iter().flatten().collect();
        if distinct.len() < targets.len() {
            eprintln!(
                "mcpgw-bench: warning: the URLs do not each reach one distinct worker ({workers:?}); \
                 {} routing is approximate (see the forwarded fraction)",
                spec.routing
            );
        }
    }

    let mut redis = match &spec.redis_url {
        Some(url) => Some(RedisClient::connect(url).await?),
        None => None,
    };
    let redis_pid = match redis.as_mut() {
        Some(redis) => local_redis_pid(redis).await,
        None => None,
    };

    let plan = Arc::new(Plan {
        targets,
        owner_urls,
        era: spec.era,
        routing: spec.routing,
        mix: spec.mix,
        timeout: spec.timeout,
    });
    let flags = Arc::new(Flags {
        budget: spec.requests,
        ..Flags::default()
    });
    let ready = Arc::new(Barrier::new(spec.sessions + 1));
    let (timetable, schedule_rx) = tokio::sync::watch::channel(None);
    let setup_started = Instant::now();
    let handles: Vec<_> = (0..spec.sessions)
        .map(|index| {
            tokio::spawn(drive_session(
                index,
                Arc::clone(&plan),
                Arc::clone(&flags),
                Arc::clone(&ready),
                schedule_rx.clone(),
            ))
        })
        .collect();
    drop(schedule_rx);
    ready.wait().await;
    let setup = setup_started.elapsed();
    // Open loop: the measured window is fixed by the timetable, not by a stop flag.
    let (duration, paced) = match spec.rate {
        Some(rate) => {
            let duration = match spec.requests {
                Some(requests) => Duration::from_secs_f64(requests as f64 / rate),
                None => spec.duration,
            };
            let start = Instant::now();
            let first = (spec.warmup.as_secs_f64() * rate).ceil() as u64;
            let counted = spec
                .requests
                .unwrap_or_else(|| (duration.as_secs_f64() * rate).round() as u64);
            let schedule = Schedule {
                start,
                rate,
                sessions: spec.sessions as u64,
                first,
                end: first + counted,
                deadline: start + spec.warmup + duration + duration.max(Duration::from_secs(1)),
            };
            let paced = Paced {
                schedule,
                gates: (0..spec.sessions).map(|_| Gate::default()).collect(),
            };
            let pacer = paced.clone();
            std::thread::Builder::new()
                .name("open-loop pacer".into())
                .spawn(move || pace(pacer))
                .map_err(|e| format!("cannot start the open-loop pacer thread: {e}"))?;
            (duration, Some(paced))
        }
        None => (spec.duration, None),
    };
    // Sessions that could not open have returned; nobody listening is fine.
    let schedule = paced.as_ref().map(|paced| paced.schedule);
    let _ = timetable.send(Some(paced));
    match &schedule {
        Some(schedule) => tokio::time::sleep_until(schedule.due(schedule.first).into()).await,
        None => tokio::time::sleep(spec.warmup).await,
    }

    let clock = procfs::clock_ticks_per_second();
    let before = Snapshot::take(&gateway_pids, redis_pid, spec.upstream_pid, redis.as_mut()).await;
    flags.measuring.store(true, Ordering::Relaxed);
    let started = match &schedule {
        Some(schedule) => schedule.due(schedule.first),
        None => Instant::now(),
    };
    let progress = (spec.progress && std::io::stderr().is_terminal()).then(|| {
        tokio::spawn(show_progress(
            spec.label.clone(),
            Arc::clone(&flags),
            started,
            duration,
            spec.requests,
        ))
    });
    if spec.requests.is_none() && schedule.is_none() {
        tokio::time::sleep(spec.duration).await;
        flags.stop.store(true, Ordering::Relaxed);
    }
    let mut totals = SessionStats::new();
    let mut leftovers = Vec::new();
    for handle in handles {
        let outcome = handle
            .await
            .map_err(|e| format!("a load session failed: {e}"))?;
        totals.merge(&outcome.stats);
        leftovers.extend(outcome.leftover);
    }
    // Open loop: the window ends with the last counted answer, so a run that fell
    // behind shows a longer window and a lower achieved rate.
    let window = match (&schedule, totals.last_answer) {
        (Some(_), Some(last)) => last.saturating_duration_since(started),
        _ => started.elapsed(),
    };
    let after = Snapshot::take(&gateway_pids, redis_pid, spec.upstream_pid, redis.as_mut()).await;
    if let Some(progress) = progress {
        progress.abort();
        eprint!("\r\x1b[K");
    }
    if spec.cleanup {
        close_sessions(&plan, leftovers).await;
    }

    let opened = spec.sessions as u64
        - totals
            .unmeasured_errors
            .iter()
            .filter(|(class, _)| class.starts_with("initialize"))
            .map(|(_, count)| count)
            .sum::<u64>();
    if opened == 0 {
        return Err(format!(
            "no load session could be opened: {}",
            report::errors_cell(&totals.unmeasured_errors, spec.sessions as u64)
        ));
    }
    let requests = totals.ok + totals.errors.values().sum::<u64>();
    let window_s = window.as_secs_f64();
    let per_1k =
        |ticks: u64| (requests > 0).then(|| ticks as f64 / clock as f64 / requests as f64 * 1000.0);
    let gateway_ticks = (!gateway_pids.is_empty())
        .then(|| after.gateway_ticks.saturating_sub(before.gateway_ticks));
    let delta = |b: Option<u64>, a: Option<u64>| Some(a?.saturating_sub(b?));
    let redis_ticks = delta(before.redis_ticks, after.redis_ticks);
    let upstream_ticks = delta(before.upstream_ticks, after.upstream_ticks);
    let machine_ticks = delta(before.machine_ticks, after.machine_ticks);
    let own_ticks = after.own_ticks.saturating_sub(before.own_ticks);
    let cores = |ticks: u64| (window_s > 0.0).then(|| ticks as f64 / clock as f64 / window_s);
    let ours = gateway_ticks.unwrap_or(0)
        + redis_ticks.unwrap_or(0)
        + upstream_ticks.unwrap_or(0)
        + own_ticks;
    let redis_commands = match (&before.redis_commands, &after.redis_commands) {
        (Some(b), Some(a)) => Some(redis::command_delta(b, a)),
        _ => None,
    };
    Ok(RunResult {
        label: spec.label.clone(),
        urls: spec.urls.clone(),
        workers,
        era: spec.era,
        routing: spec.routing,
        mix: spec.mix.to_string(),
        sessions: spec.sessions,
        setup_s: setup.as_secs_f64(),
        window_s,
        offered_rps: spec.rate,
        unsent: totals.unsent,
        requests,
        ok: totals.ok,
        throughput_rps: if window_s > 0.0 {
            totals.ok as f64 / window_s
        } else {
            0.0
        },
        latency: LatencySummary::of(&totals.all),
        service_latency: schedule.map(|_| LatencySummary::of(&totals.service)),
        send_lag: schedule.map(|_| LatencySummary::of(&totals.send_lag)),
        tools_call_latency: LatencySummary::of(&totals.calls),
        forwarded_fraction: (totals.with_worker_headers > 0)
            .then(|| totals.forwarded as f64 / totals.with_worker_headers as f64),
        redis_commands_per_request: redis_commands.as_ref().and_then(|commands| {
            (requests > 0).then(|| commands.values().sum::<u64>() as f64 / requests as f64)
        }),
        redis_commands,
        cpu: CpuFigures {
            clock_ticks_per_second: clock,
            gateway_s_per_1k: gateway_ticks.and_then(per_1k),
            gateway_cores: gateway_ticks.and_then(cores),
            redis_s_per_1k: redis_ticks.and_then(per_1k),
            loadgen_s_per_1k: per_1k(own_ticks),
            upstream_s_per_1k: upstream_ticks.and_then(per_1k),
            machine_cores: machine_ticks.and_then(cores),
            other_cores: machine_ticks.and_then(|m| cores(m.saturating_sub(ours))),
        },
        network: before.net.zip(after.net).and_then(|(b, a)| {
            (requests > 0).then(|| NetworkFigures {
                tcp_segments_per_request: a.tcp_in_segments.saturating_sub(b.tcp_in_segments)
                    as f64
                    / requests as f64,
                udp_datagrams_per_request: a.udp_in_datagrams.saturating_sub(b.udp_in_datagrams)
                    as f64
                    / requests as f64,
                tcp_retransmitted: a.tcp_retransmitted.saturating_sub(b.tcp_retransmitted),
                udp_receive_buffer_drops: a
                    .udp_receive_buffer_drops
                    .saturating_sub(b.udp_receive_buffer_drops),
            })
        }),
        errors: totals.errors,
        unmeasured_errors: totals.unmeasured_errors,
    })
}

/// One load session: open (legacy), wait for everyone, then request until told to stop.
async fn drive_session(
    index: usize,
    plan: Arc<Plan>,
    flags: Arc<Flags>,
    ready: Arc<Barrier>,
    mut timetable: tokio::sync::watch::Receiver<Option<Option<Paced>>>,
) -> SessionOutcome {
    let url_count = plan.targets.len();
    let home = index % url_count;
    let mut slots: Vec<Option<Connection>> = (0..url_count).map(|_| None).collect();
    let mut stats = SessionStats::new();
    let opened = match plan.era {
        Era::Legacy => client::open_session(&mut slots[home], &plan.targets[home], plan.timeout)
            .await
            .map(Some),
        Era::Modern => Ok(None),
    };
    // Every session waits here, opened or not, so the coordinator never hangs.
    ready.wait().await;
    let opened = match opened {
        Ok(opened) => opened,
        Err(class) => {
            *stats
                .unmeasured_errors
                .entry(format!("initialize: {class}"))
                .or_default() += 1;
            return SessionOutcome {
                stats,
                leftover: None,
            };
        }
    };
    let session = opened.as_ref().map(|o| o.id.clone());
    let owner = opened
        .as_ref()
        .and_then(|o| o.owner.as_deref())
        .and_then(|worker| plan.owner_urls.get(worker).copied());

    // Some(schedule): open loop; None: closed loop.
    let paced = timetable
        .wait_for(Option::is_some)
        .await
        .ok()
        .and_then(|published| published.clone())
        .flatten();
    let schedule = paced.as_ref().map(|paced| paced.schedule);

    let mut seq: u64 = 0;
    let mut next_due = index as u64;
    loop {
        let (counted, due, waited) = match &schedule {
            None => {
                if flags.stop.load(Ordering::Relaxed) {
                    break;
                }
                let counted = flags.measuring.load(Ordering::Relaxed);
                if counted
                    && let Some(budget) = flags.budget
                    && flags.claimed.fetch_add(1, Ordering::Relaxed) >= budget
                {
                    break;
                }
                (counted, None, false)
            }
            Some(schedule) => {
                let k = next_due;
                if k >= schedule.end {
                    break;
                }
                let due = schedule.due(k);
                let now = Instant::now();
                if now > schedule.deadline {
                    stats.unsent += counted_from(k, schedule);
                    break;
                }
                let waited = due > now;
                if waited && let Some(paced) = &paced {
                    paced.gates[index].wait_for(k / schedule.sessions).await;
                }
                next_due += schedule.sessions;
                (k >= schedule.first, Some(due), waited)
            }
        };
        // Offsetting the mix by the session index spreads the tools/list requests.
        let op = plan.mix.op(seq + index as u64);
        let url = pick_url(plan.routing, url_count, home, owner, seq);
        let target = &plan.targets[url];
        let request = match client::mix_request(target, plan.era, op, seq + 1, session.as_ref()) {
            Ok(request) => request,
            Err(_) => {
                // Only a session id that is no valid header could cause this.
                *stats.errors.entry("bad session id".into()).or_default() += 1;
                break;
            }
        };
        let sent = Instant::now();
        let outcome = client::exchange_on(&mut slots[url], target, request, plan.timeout).await;
        let answered = Instant::now();
        let since = |from: Instant| {
            u64::try_from(answered.saturating_duration_since(from).as_micros()).unwrap_or(u64::MAX)
        };
        // Open loop: from when the request was due, so time spent waiting for this
        // session to be free is part of the latency.
        let micros = since(due.unwrap_or(sent));
        let error = match &outcome {
            Ok(answer) => answer.error_class(),
            Err(failure) => Some(failure.class()),
        };
        match (error, counted) {
            (None, true) => {
                stats.ok += 1;
                stats.last_answer = Some(answered);
                latency::record(&mut stats.all, micros);
                if let Some(due) = due {
                    latency::record(&mut stats.service, since(sent));
                    if waited {
                        let lag = sent.saturating_duration_since(due).as_micros();
                        latency::record(
                            &mut stats.send_lag,
                            u64::try_from(lag).unwrap_or(u64::MAX),
                        );
                    }
                }
                if op == Op::CallEcho {
                    latency::record(&mut stats.calls, micros);
                }
                if let Some(forwarded) = outcome.as_ref().ok().and_then(|a| a.forwarded()) {
                    stats.with_worker_headers += 1;
                    stats.forwarded += u64::from(forwarded);
                }
                flags.completed.fetch_add(1, Ordering::Relaxed);
            }
            (Some(class), true) => {
                stats.last_answer = Some(answered);
                *stats.errors.entry(class).or_default() += 1;
                flags.completed.fetch_add(1, Ordering::Relaxed);
                flags.failed.fetch_add(1, Ordering::Relaxed);
            }
            (Some(class), false) => {
                *stats
                    .unmeasured_errors
                    .entry(format!("warm-up: {class}"))
                    .or_default() += 1;
            }
            (None, false) => {}
        }
        seq += 1;
    }
    let leftover = session.map(|session| Leftover {
        url: pick_url(Routing::Sticky, url_count, home, owner, 0),
        slots,
        session,
    });
    SessionOutcome { stats, leftover }
}

/// How many counted requests of the session whose next one is `k` remain: those
/// `k + j × sessions` in `first..end`.
fn counted_from(k: u64, schedule: &Schedule) -> u64 {
    let step = schedule.sessions.max(1);
    let skip = schedule.first.saturating_sub(k).div_ceil(step);
    let upto = schedule.end.saturating_sub(k).div_ceil(step);
    upto.saturating_sub(skip)
}

/// `--rate`: a positive, finite number of requests per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(rate),
        _ => Err(format!(
            "{text:?} is no rate: give requests per second as a positive number, e.g. 1000"
        )),
    }
}

/// Deletes the load's sessions, a bounded number at a time.
async fn close_sessions(plan: &Arc<Plan>, leftovers: Vec<Leftover>) {
    let mut tasks = tokio::task::JoinSet::new();
    for mut leftover in leftovers {
        let plan = Arc::clone(plan);
        tasks.spawn(async move {
            let url = leftover.url;
            let _ = client::close_session(
                &mut leftover.slots[url],
                &plan.targets[url],
                &leftover.session,
                plan.timeout,
            )
            .await;
        });
        if tasks.len() >= 64 {
            tasks.join_next().await;
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// The Redis server's pid, when that process runs on this machine.
async fn local_redis_pid(redis: &mut RedisClient) -> Option<u32> {
    let pid = u32::try_from(redis.info_number("server", "process_id").await.ok()?).ok()?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    comm.starts_with("redis").then_some(pid)
}

/// Counters read at the start and at the end of the measured window.
struct Snapshot {
    gateway_ticks: u64,
    redis_ticks: Option<u64>,
    own_ticks: u64,
    upstream_ticks: Option<u64>,
    machine_ticks: Option<u64>,
    net: Option<procfs::NetCounters>,
    redis_commands: Option<BTreeMap<String, u64>>,
}

impl Snapshot {
    async fn take(
        gateway_pids: &[u32],
        redis_pid: Option<u32>,
        upstream_pid: Option<u32>,
        redis: Option<&mut RedisClient>,
    ) -> Snapshot {
        let redis_commands = match redis {
            Some(redis) => redis.command_counts().await.ok(),
            None => None,
        };
        Snapshot {
            gateway_ticks: procfs::tree_cpu_ticks(gateway_pids),
            redis_ticks: redis_pid.map(procfs::cpu_ticks),
            own_ticks: procfs::cpu_ticks(std::process::id()),
            upstream_ticks: upstream_pid.map(procfs::cpu_ticks),
            machine_ticks: procfs::machine_busy_ticks(),
            net: procfs::net_counters(),
            redis_commands,
        }
    }
}

async fn show_progress(
    label: String,
    flags: Arc<Flags>,
    started: Instant,
    duration: Duration,
    requests: Option<u64>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let done = flags.completed.load(Ordering::Relaxed);
        let elapsed = started.elapsed();
        let fraction = match requests {
            Some(total) if total > 0 => done as f64 / total as f64,
            _ => elapsed.as_secs_f64() / duration.as_secs_f64().max(1e-9),
        };
        let line = report::progress_line(
            &label,
            fraction,
            done,
            done as f64 / elapsed.as_secs_f64().max(1e-9),
            flags.failed.load(Ordering::Relaxed),
        );
        let mut stderr = std::io::stderr().lock();
        let _ = write!(stderr, "\r\x1b[K{line}");
        let _ = stderr.flush();
    }
}
