//! `mcpgw-bench compare`: every way a request can reach its session's owner, side
//! by side, in one run on one machine, with the same load.
//!
//! Configurations (legacy sessions, two workers, one per supervisor and URL, so
//! "sticky" and "forward" are exact):
//!
//! | name | path of a request |
//! |---|---|
//! | `direct` | client → demo upstream (no gateway): the floor |
//! | `sticky` | client → owner worker → upstream (QUIC fleet; nothing forwarded) |
//! | `quic` | client → other worker → QUIC mesh → owner → upstream |
//! | `tcp` | the same over the TCP mesh |
//! | `unix` | the same over the same-host path (`--mesh-same-host unix`: Unix socket, no TLS) |
//! | `redis` | the same over the Redis pub/sub baseline |
//! | `round-robin` | requests alternate over both workers (QUIC fleet): half forwarded |
//! | `modern` | 2026-07-28 stateless requests, round-robin (QUIC fleet); optional |
//! | `virtual` | client → owner worker → virtual server of three members → upstream |
//! | `virtual-tcp` | the same, every request to the other worker, over the TCP mesh |
//!
//! Every fleet serves the demo upstream twice: as the plain route `demo`, and as
//! the virtual server `all` ([`super::fleet::VIRTUAL_SERVER`]) whose three members are
//! routes to the same upstream, so `virtual` against `sticky` (and `virtual-tcp`
//! against `tcp`) is what federation adds to a call, with the same upstream, fleet
//! and load.
//!
//! Each fleet gets its own Redis (so Redis command counts belong to one fleet),
//! all fleets run for the whole sweep, and the sweep runs concurrency in the outer
//! loop, so slow drift of the machine touches every configuration alike. A fleet
//! that does not start (for example a transport this mcpgw build does not have) is
//! reported as not available; the rest of the run goes on.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::fleet::{Bins, Fleet, FleetSpec, MeshCerts, RedisServer, UpstreamServer};
use super::loopback::{self, LoopbackRtt};
use super::mix::{Era, Mix};
use super::report;
use super::routing::Routing;
use super::run::{LoadSpec, RunResult, parse_rate, run_load};
use super::sessions::{self, SessionsPlan, SessionsReport, now_unix};
use super::svg;
use super::targets::{self, TargetCheck};
use super::units::{grouped, ms, parse_duration, utc_timestamp};

/// Flags of `mcpgw-bench compare`. The defaults finish in about three minutes on a
/// 2-core machine: 9 configurations × 4 concurrency levels × (0.5 s warm-up + 3 s
/// measured + session set-up), plus fleet start-up, the loopback probe and
/// 2 × 10,000 idle sessions.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Configurations, in report order (direct, sticky, quic, tcp, unix, redis,
    /// round-robin, modern, virtual, virtual-tcp).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,sticky,quic,tcp,unix,redis,round-robin,virtual,virtual-tcp"
    )]
    pub configs: Vec<ConfigName>,
    /// Concurrent sessions per run; each configuration runs at each level. The
    /// lowest level shows the added latency with the least queueing.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,512")]
    pub concurrency: Vec<usize>,
    /// Measured time per run.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Open-loop rate sweep after the concurrency sweep: offered requests per
    /// second, e.g. 500,1000,2000,4000. Each configuration runs at each rate (lowest
    /// first) until it saturates; latency counts from the intended send time.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate)]
    pub rates: Vec<f64>,
    /// After the sweep, how many times each configuration's bracket around its
    /// saturation rate (last sustained, first saturated) is halved by a run at its
    /// middle.
    #[arg(long, default_value_t = 2)]
    pub refine_steps: usize,
    /// Sessions of each open-loop run (the offered rate is spread over them).
    #[arg(long, default_value_t = 64)]
    pub rate_sessions: usize,
    /// Unmeasured load before each run's measurement.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub warmup: Duration,
    /// tools/call echo : tools/list.
    #[arg(long, default_value_t = Mix::default())]
    pub mix: Mix,
    /// Deadline of one request.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Idle sessions for the memory figures (`sessions`); 0 skips them.
    #[arg(long, default_value_t = 10_000)]
    pub idle_sessions: usize,
    /// Report directory [default: build/bench/<UTC timestamp>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory holding mcpgw and mcpgw-bench [default: beside this binary, then
    /// target/release, then target/debug].
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Reuse this Redis for every fleet (separate key prefixes) instead of starting
    /// one per fleet. Its other traffic then shows up in the command counts.
    #[arg(long)]
    pub redis: Option<String>,
    /// Reuse this upstream MCP URL instead of starting the demo upstream.
    #[arg(long)]
    pub upstream: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ConfigName {
    Direct,
    Sticky,
    Quic,
    Tcp,
    Unix,
    Redis,
    RoundRobin,
    Modern,
    Virtual,
    VirtualTcp,
}

impl fmt::Display for ConfigName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ConfigName {
    pub fn as_str(self) -> &'static str {
        match self {
            ConfigName::Direct => "direct",
            ConfigName::Sticky => "sticky",
            ConfigName::Quic => "quic",
            ConfigName::Tcp => "tcp",
            ConfigName::Unix => "unix",
            ConfigName::Redis => "redis",
            ConfigName::RoundRobin => "round-robin",
            ConfigName::Modern => "modern",
            ConfigName::Virtual => "virtual",
            ConfigName::VirtualTcp => "virtual-tcp",
        }
    }

    /// The mesh transport of the fleet it runs on; None for `direct`.
    pub fn transport(self) -> Option<&'static str> {
        match self {
            ConfigName::Direct => None,
            ConfigName::Quic => Some("quic"),
            // A TCP fleet with the same-host path on (see `Fleet::start`).
            ConfigName::Unix => Some("unix"),
            // The default transport, as a user's fleet would run.
            ConfigName::Sticky
            | ConfigName::Tcp
            | ConfigName::RoundRobin
            | ConfigName::Modern
            | ConfigName::Virtual
            | ConfigName::VirtualTcp => Some("tcp"),
            ConfigName::Redis => Some("redis"),
        }
    }

    pub fn routing(self) -> Routing {
        match self {
            ConfigName::Direct | ConfigName::Sticky | ConfigName::Virtual => Routing::Sticky,
            ConfigName::Quic
            | ConfigName::Tcp
            | ConfigName::Unix
            | ConfigName::Redis
            | ConfigName::VirtualTcp => Routing::Forward,
            ConfigName::RoundRobin | ConfigName::Modern => Routing::RoundRobin,
        }
    }

    pub fn era(self) -> Era {
        match self {
            ConfigName::Modern => Era::Modern,
            _ => Era::Legacy,
        }
    }

    /// Whether its requests go to the virtual server rather than the plain route.
    pub fn is_virtual(self) -> bool {
        matches!(self, ConfigName::Virtual | ConfigName::VirtualTcp)
    }

    /// Whether the open-loop sweep runs it. The sweep compares transports; a virtual
    /// server's cost is read off the closed-loop runs against its plain route.
    pub fn sweeps(self) -> bool {
        !self.is_virtual()
    }

    /// The plain-route configuration with the same path through the fleet.
    pub fn plain_counterpart(self) -> Option<ConfigName> {
        match self {
            ConfigName::Virtual => Some(ConfigName::Sticky),
            ConfigName::VirtualTcp => Some(ConfigName::Tcp),
            _ => None,
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            ConfigName::Direct => "client → upstream, no gateway",
            ConfigName::Sticky => "every request to the owner worker (nothing forwarded)",
            ConfigName::Quic => "every request to the other worker, forwarded over the QUIC mesh",
            ConfigName::Tcp => "every request to the other worker, forwarded over the TCP mesh",
            ConfigName::Unix => {
                "every request to the other worker, forwarded over the same-host path (Unix socket, no TLS)"
            }
            ConfigName::Redis => {
                "every request to the other worker, forwarded over Redis pub/sub (baseline)"
            }
            ConfigName::RoundRobin => {
                "requests alternate over both workers (TCP mesh, the default)"
            }
            ConfigName::Modern => "2026-07-28 stateless requests alternating over both workers",
            ConfigName::Virtual => {
                "every request to the owner worker, through a virtual server of three members"
            }
            ConfigName::VirtualTcp => {
                "every request to the other worker (TCP mesh), through a virtual server of three members"
            }
        }
    }
}

/// One configuration's outcome over the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigOutcome {
    pub name: ConfigName,
    pub description: String,
    /// Why it did not run, when it did not.
    pub not_available: Option<String>,
    /// One run per concurrency level, in sweep order.
    pub runs: Vec<RunResult>,
    /// One open-loop run per offered rate (`--rates`), lowest first, up to and
    /// including the first saturated rate.
    pub sweep: Vec<RunResult>,
    /// Where the open-loop sweep saturated this configuration; null without one.
    pub saturation: Option<Saturation>,
    /// The open-loop run at half the baseline's saturation rate; null without one.
    pub at_half_baseline: Option<RunResult>,
}

/// A rate is sustained when the achieved rate is at least [`ACHIEVED_SHARE`] of
/// the offered one, no request was left unsent, at most [`ERROR_SHARE`] of the
/// requests failed, and p99 stays within [`P99_GROWTH`] × the Redis baseline's p99 at
/// the lowest swept rate (see [`P99Yardstick`]). The saturation rate is the lowest
/// offered rate that is not.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Saturation {
    /// The highest offered rate below the saturation rate (req/s); null when the
    /// lowest rate already saturated.
    pub sustained_rps: Option<f64>,
    /// The lowest offered rate that was not sustained; null when every swept rate was.
    pub saturated_at_rps: Option<f64>,
    /// Why that rate counts as saturated.
    pub reason: Option<String>,
}

pub const ACHIEVED_SHARE: f64 = 0.95;
pub const ERROR_SHARE: f64 = 0.01;
pub const P99_GROWTH: f64 = 10.0;

/// The p99 that a swept rate's p99 may grow to [`P99_GROWTH`] times of before the
/// rate counts as saturated: the Redis baseline's p99 at the lowest swept rate, one
/// bound for every configuration, as a latency objective is. (A bound of each
/// configuration's own made the better transport's the tighter: on 2026-12-06 TCP's
/// was 14.5 ms and the baseline's 30.6 ms, so TCP counted as saturated at 6,000 req/s
/// with a p99 of 19 ms while the baseline, sustained there, collapsed at 7,000.)
/// A configuration's own p99 at its lowest rate stands in while the baseline has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P99Yardstick {
    pub p99_us: u64,
    /// Whether it is the baseline's, not the configuration's own.
    pub baseline: bool,
}

impl P99Yardstick {
    /// The baseline's p99 at its lowest swept rate, when it has one.
    fn of_baseline(outcomes: &[ConfigOutcome]) -> Option<P99Yardstick> {
        let baseline = outcomes.iter().find(|o| o.name == ConfigName::Redis)?;
        Some(P99Yardstick {
            p99_us: baseline.sweep.first()?.latency.p99_us,
            baseline: true,
        })
    }
}

/// Why `run` is not sustained, judged against `yardstick`; None when it is sustained.
pub fn saturated_because(run: &RunResult, yardstick: P99Yardstick) -> Option<String> {
    let offered = run.offered_rps?;
    let errors: u64 = run.errors.values().sum();
    if run.unsent > 0 {
        return Some(format!("{} requests never sent", grouped(run.unsent)));
    }
    if run.throughput_rps < offered * ACHIEVED_SHARE {
        return Some(format!(
            "achieved {} of {} req/s offered (< {:.0} %)",
            grouped(run.throughput_rps.round() as u64),
            grouped(offered.round() as u64),
            ACHIEVED_SHARE * 100.0
        ));
    }
    if errors as f64 > run.requests as f64 * ERROR_SHARE {
        return Some(format!(
            "{} errors of {} requests",
            grouped(errors),
            grouped(run.requests)
        ));
    }
    if run.latency.p99_us as f64 > yardstick.p99_us.max(1) as f64 * P99_GROWTH {
        return Some(format!(
            "p99 {} ms > {P99_GROWTH:.0} × {} ms, {} p99 at the lowest rate",
            ms(run.latency.p99_us),
            ms(yardstick.p99_us),
            if yardstick.baseline {
                "the baseline's"
            } else {
                "its own"
            }
        ));
    }
    None
}

/// Refinement rates are rounded to this step, so reports read as round numbers.
const REFINE_STEP_RPS: f64 = 100.0;

impl ConfigOutcome {
    /// Whether open-loop runs are made of it: it is swept and available.
    fn runs_open_loop(&self) -> bool {
        self.name.sweeps() && self.not_available.is_none()
    }

    /// Whether the sweep's next rate runs it: it runs open loop and has not saturated yet.
    fn sweeps_on(&self) -> bool {
        let saturated = self
            .saturation
            .as_ref()
            .is_some_and(|s| s.saturated_at_rps.is_some());
        self.runs_open_loop() && !saturated
    }

    /// Files an open-loop run at `rate` and moves the saturation bracket: a sustained
    /// rate raises its lower end, a saturated one lowers its upper end. The sweep
    /// stays ordered by rate.
    /// `baseline`: the baseline's p99 yardstick, once it has one.
    fn record_swept(&mut self, rate: f64, result: RunResult, baseline: Option<P99Yardstick>) {
        let yardstick = baseline.unwrap_or(P99Yardstick {
            p99_us: self.sweep.first().unwrap_or(&result).latency.p99_us,
            baseline: false,
        });
        let reason = saturated_because(&result, yardstick);
        let previous = self.saturation.take().unwrap_or_default();
        self.saturation = Some(match reason {
            None => Saturation {
                sustained_rps: Some(previous.sustained_rps.map_or(rate, |s| s.max(rate))),
                ..previous
            },
            Some(reason) => match previous.saturated_at_rps {
                Some(at) if at < rate => previous,
                _ => Saturation {
                    sustained_rps: previous.sustained_rps,
                    saturated_at_rps: Some(rate),
                    reason: Some(reason),
                },
            },
        });
        let at = self
            .sweep
            .partition_point(|r| r.offered_rps.is_some_and(|offered| offered < rate));
        self.sweep.insert(at, result);
    }

    /// The rate halfway between the highest sustained and the lowest saturated rate,
    /// when the two are further apart than one refinement step.
    fn bracket_middle(&self) -> Option<f64> {
        if !self.runs_open_loop() {
            return None;
        }
        let saturation = self.saturation.as_ref()?;
        let (low, high) = (saturation.sustained_rps?, saturation.saturated_at_rps?);
        let middle = ((low + high) / 2.0 / REFINE_STEP_RPS).round() * REFINE_STEP_RPS;
        (middle > low && middle < high).then_some(middle)
    }
}

/// `rates` in ascending order, each once.
fn sorted_rates(rates: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut rates: Vec<f64> = rates.collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    rates
}

/// What every open-loop run of `compare` shares: the flags, the fleets, the upstream.
struct OpenLoop<'a> {
    args: &'a CompareArgs,
    fleets: &'a BTreeMap<&'static str, Result<FleetUnderTest, String>>,
    upstream_url: &'a str,
    upstream_pid: Option<u32>,
}

impl OpenLoop<'_> {
    /// Runs `outcome`'s configuration at `rate`; a failed run marks the
    /// configuration not available (and answers None).
    async fn run(&self, outcome: &mut ConfigOutcome, rate: f64) -> Option<RunResult> {
        let name = outcome.name;
        let (urls, redis_url, pids) = load_target(name, self.fleets, self.upstream_url)?;
        let spec = LoadSpec {
            label: name.as_str().into(),
            urls,
            sessions: self.args.rate_sessions,
            era: name.era(),
            routing: name.routing(),
            mix: self.args.mix,
            duration: self.args.duration,
            requests: None,
            rate: Some(rate),
            warmup: self.args.warmup,
            timeout: self.args.timeout,
            redis_url,
            pids,
            upstream_pid: self.upstream_pid,
            progress: true,
            cleanup: true,
        };
        match run_load(&spec).await {
            Ok(result) => {
                eprintln!("{}", summary_line(&result));
                Some(result)
            }
            Err(e) => {
                eprintln!("{name} at {rate} req/s: failed: {e}");
                outcome.not_available = Some(format!("run at {rate} req/s failed: {e}"));
                None
            }
        }
    }
}

/// Everything `compare` measured: report.json.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub started_utc: String,
    pub total_seconds: f64,
    pub machine: Machine,
    pub settings: Settings,
    pub configurations: Vec<ConfigOutcome>,
    pub idle_sessions: Option<SessionsReport>,
    pub targets: Vec<TargetCheck>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub kernel: Option<String>,
    pub cpu_model: Option<String>,
    pub loopback: Option<LoopbackRtt>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub concurrency: Vec<usize>,
    /// Offered rates of the open-loop sweep (req/s); empty without one.
    pub rates: Vec<f64>,
    /// Bisections of each configuration's bracket around its saturation rate.
    pub refine_steps: usize,
    /// The offered rate of the runs at half the baseline's saturation rate; null
    /// when the baseline did not saturate (or did not run).
    pub half_baseline_rps: Option<f64>,
    pub rate_sessions: usize,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub mix: String,
    pub workers: usize,
    pub mcpgw: String,
    pub upstream: String,
    pub redis: String,
}

/// The two members of every fleet: one supervisor (and one worker) each.
const MEMBERS: [&str; 2] = ["host-a", "host-b"];

/// A started fleet and the Redis it uses.
struct FleetUnderTest {
    fleet: Fleet,
    redis_url: String,
    /// The Redis we started for this fleet (None when reusing --redis).
    own_redis: Option<RedisServer>,
}

/// `mcpgw-bench compare`.
pub async fn main(args: CompareArgs) -> anyhow::Result<()> {
    let begun = Instant::now();
    let started_utc = utc_timestamp(now_unix());
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("build/bench").join(&started_utc));
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", logs.display()))?;
    let bins = Bins::locate(args.bin_dir.as_deref()).map_err(anyhow::Error::msg)?;
    if args.concurrency.contains(&0) {
        anyhow::bail!("--concurrency levels must be at least 1");
    }
    if !args.rates.is_empty() && args.rate_sessions == 0 {
        anyhow::bail!("--rate-sessions must be at least 1");
    }
    let mut configs = args.configs.clone();
    configs.dedup();
    eprintln!(
        "mcpgw-bench compare: {} configurations × concurrency {:?}, {:?} each after {:?} warm-up; mcpgw at {}",
        configs.len(),
        args.concurrency,
        args.duration,
        args.warmup,
        bins.mcpgw.display()
    );

    let loopback = tokio::task::spawn_blocking(|| loopback::measure(loopback::DEFAULT_ITERATIONS))
        .await
        .ok()
        .and_then(Result::ok);
    if let Some(rtt) = &loopback {
        eprintln!(
            "loopback TCP round trip: p50 {:.1} µs, p99 {:.1} µs on {}; p50 {} µs on one CPU",
            rtt.p50_us,
            rtt.p99_us,
            rtt.placement,
            rtt.same_cpu_p50_us
                .map_or("?".into(), |p| format!("{p:.1}"))
        );
    }

    let (upstream_url, upstream_pid, own_upstream) = match &args.upstream {
        Some(url) => (url.clone(), None, None),
        None => {
            let upstream = UpstreamServer::start(&bins, &logs)
                .await
                .map_err(anyhow::Error::msg)?;
            (
                upstream.url.clone(),
                Some(upstream.proc.pid),
                Some(upstream),
            )
        }
    };
    let certs = MeshCerts::create(&bins, &out.join("certs"), &MEMBERS)
        .await
        .map_err(anyhow::Error::msg)?;

    // Start every fleet the configurations need, once each.
    let mut fleets: BTreeMap<&'static str, Result<FleetUnderTest, String>> = BTreeMap::new();
    for transport in configs.iter().filter_map(|c| c.transport()) {
        if fleets.contains_key(transport) {
            continue;
        }
        let started = start_fleet(&bins, &certs, transport, &args, &upstream_url, &logs).await;
        match &started {
            Ok(f) => eprintln!("fleet {transport}: {}", f.fleet.urls.join(", ")),
            Err(reason) => eprintln!("fleet {transport}: not available: {reason}"),
        }
        fleets.insert(transport, started);
    }

    let mut outcomes: Vec<ConfigOutcome> = configs
        .iter()
        .map(|&name| ConfigOutcome {
            name,
            description: name.description().into(),
            not_available: name
                .transport()
                .and_then(|t| fleets.get(t))
                .and_then(|f| f.as_ref().err().cloned()),
            runs: Vec::new(),
            sweep: Vec::new(),
            saturation: None,
            at_half_baseline: None,
        })
        .collect();
    for &concurrency in &args.concurrency {
        for outcome in outcomes.iter_mut() {
            if outcome.not_available.is_some() {
                continue;
            }
            let name = outcome.name;
            let Some((urls, redis_url, pids)) = load_target(name, &fleets, &upstream_url) else {
                continue;
            };
            let spec = LoadSpec {
                label: name.as_str().into(),
                urls,
                sessions: concurrency,
                era: name.era(),
                routing: name.routing(),
                mix: args.mix,
                duration: args.duration,
                requests: None,
                rate: None,
                warmup: args.warmup,
                timeout: args.timeout,
                redis_url,
                pids,
                upstream_pid,
                progress: true,
                cleanup: true,
            };
            match run_load(&spec).await {
                Ok(result) => {
                    eprintln!("{}", summary_line(&result));
                    outcome.runs.push(result);
                }
                Err(e) => {
                    eprintln!("{name} c={concurrency}: failed: {e}");
                    outcome.not_available =
                        Some(format!("run at concurrency {concurrency} failed: {e}"));
                }
            }
        }
    }
    let rates = sorted_rates(args.rates.iter().copied());
    let open = OpenLoop {
        args: &args,
        fleets: &fleets,
        upstream_url: &upstream_url,
        upstream_pid,
    };
    // Rates in the outer loop, as concurrency above, so drift touches every
    // configuration alike; a configuration stops at its first saturated rate.
    for &rate in &rates {
        // Known from the second rate on: the first rate, where every configuration
        // is judged against itself, only fixes each one's own yardstick.
        let baseline = P99Yardstick::of_baseline(&outcomes);
        for outcome in outcomes.iter_mut().filter(|o| o.sweeps_on()) {
            if let Some(result) = open.run(outcome, rate).await {
                outcome.record_swept(rate, result, baseline);
            }
        }
    }
    // The doubling steps of a sweep leave the saturation rate known within a factor
    // of two; halving the bracket a few times makes configurations comparable.
    let baseline = P99Yardstick::of_baseline(&outcomes);
    for _ in 0..args.refine_steps {
        for outcome in outcomes.iter_mut() {
            let Some(rate) = outcome.bracket_middle() else {
                continue;
            };
            if let Some(result) = open.run(outcome, rate).await {
                outcome.record_swept(rate, result, baseline);
            }
        }
    }
    // The p99 target compares the transports at one offered rate that the baseline
    // sustains comfortably: half of its saturation rate.
    let half_baseline_rps = outcomes
        .iter()
        .find(|o| o.name == ConfigName::Redis)
        .and_then(|o| o.saturation.as_ref()?.saturated_at_rps)
        .map(|rate| (rate / 2.0).round());
    if let Some(rate) = half_baseline_rps {
        for outcome in outcomes.iter_mut().filter(|o| o.runs_open_loop()) {
            outcome.at_half_baseline = open.run(outcome, rate).await;
        }
    }
    // The report's rates: every one a configuration ran, refinements included.
    let rates = sorted_rates(
        outcomes
            .iter()
            .flat_map(|o| o.sweep.iter().filter_map(|r| r.offered_rps)),
    );
    for (_, fleet) in fleets {
        if let Ok(f) = fleet {
            f.fleet.stop().await;
            if let Some(redis) = f.own_redis {
                redis.proc.stop().await;
            }
        }
    }

    let idle_sessions = if args.idle_sessions > 0 {
        eprintln!(
            "idle sessions: opening {} on one worker…",
            grouped(args.idle_sessions as u64)
        );
        let plan = SessionsPlan {
            count: args.idle_sessions,
            warmup: 200,
            parallel: 32,
        };
        Some(sessions::measure(&bins, &plan, &upstream_url, upstream_pid, &logs).await)
    } else {
        None
    };
    if let Some(upstream) = own_upstream {
        upstream.proc.stop().await;
    }

    let machine = Machine {
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|s| s.trim().to_owned()),
        cpu_model: cpu_model(),
        loopback,
    };
    let settings = Settings {
        concurrency: args.concurrency.clone(),
        rates,
        refine_steps: args.refine_steps,
        half_baseline_rps,
        rate_sessions: args.rate_sessions,
        duration_s: args.duration.as_secs_f64(),
        warmup_s: args.warmup.as_secs_f64(),
        mix: args.mix.to_string(),
        workers: MEMBERS.len(),
        mcpgw: bins.mcpgw.display().to_string(),
        upstream: match &args.upstream {
            Some(url) => format!("reused: {url}"),
            None => "demo upstream (mcpgw-bench upstream), own process".into(),
        },
        redis: match &args.redis {
            Some(url) => format!("reused: {url}"),
            None => "one redis-server per fleet".into(),
        },
    };
    let targets = targets::evaluate(
        &outcomes,
        idle_sessions.as_ref(),
        machine.loopback.as_ref(),
        machine.cores,
    );
    let report = CompareReport {
        started_utc,
        total_seconds: begun.elapsed().as_secs_f64(),
        machine,
        settings,
        configurations: outcomes,
        idle_sessions,
        targets,
    };
    write_report(&out, &report)?;
    println!("{}", report::compare_summary(&report));
    println!("report: {}", out.join("report.md").display());
    println!("chart:  {}", out.join("chart.svg").display());
    Ok(())
}

/// Where `name`'s load goes: its URLs, the fleet's Redis and the pids whose CPU
/// counts; None when its fleet did not start.
fn load_target(
    name: ConfigName,
    fleets: &BTreeMap<&'static str, Result<FleetUnderTest, String>>,
    upstream_url: &str,
) -> Option<(Vec<String>, Option<String>, Vec<u32>)> {
    let Some(transport) = name.transport() else {
        return Some((vec![upstream_url.to_owned()], None, Vec::new()));
    };
    let fleet = fleets.get(transport)?.as_ref().ok()?;
    let urls = if name.is_virtual() {
        &fleet.fleet.virtual_urls
    } else {
        &fleet.fleet.urls
    };
    Some((
        urls.clone(),
        Some(fleet.redis_url.clone()),
        fleet.fleet.pids(),
    ))
}

async fn start_fleet(
    bins: &Bins,
    certs: &MeshCerts,
    transport: &'static str,
    args: &CompareArgs,
    upstream_url: &str,
    logs: &Path,
) -> Result<FleetUnderTest, String> {
    let (redis_url, own_redis) = match &args.redis {
        Some(url) => (url.clone(), None),
        None => {
            let redis = RedisServer::start(&format!("redis-{transport}"), logs).await?;
            (redis.url.clone(), Some(redis))
        }
    };
    let prefix = format!("mcpgw-bench-{transport}:");
    let spec = FleetSpec {
        name: transport,
        transport,
        redis_url: &redis_url,
        upstream_url,
        members: &MEMBERS,
        key_prefix: &prefix,
    };
    match Fleet::start(bins, certs, &spec, logs).await {
        Ok(fleet) => Ok(FleetUnderTest {
            fleet,
            redis_url,
            own_redis,
        }),
        Err(reason) => {
            if let Some(redis) = own_redis {
                redis.proc.stop().await;
            }
            Err(reason)
        }
    }
}

fn summary_line(result: &RunResult) -> String {
    let offered = result.offered_rps.map_or(String::new(), |rate| {
        format!(" offered {}", grouped(rate.round() as u64))
    });
    format!(
        "{:<12} c={:<4}{offered} {:>8} req/s  p50 {} ms  p99 {} ms  forwarded {}  errors {}  other load {} cores",
        result.label,
        result.sessions,
        grouped(result.throughput_rps.round() as u64),
        ms(result.latency.p50_us),
        ms(result.latency.p99_us),
        result
            .forwarded_fraction
            .map_or("–".into(), |f| format!("{:.0}%", f * 100.0)),
        grouped(result.errors.values().sum()),
        result
            .cpu
            .other_cores
            .map_or("?".into(), |c| format!("{c:.2}")),
    )
}

fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, model)| model.trim().to_owned())
}

fn write_report(out: &Path, report: &CompareReport) -> anyhow::Result<()> {
    let write = |name: &str, text: String| {
        let path = out.join(name);
        std::fs::write(&path, text)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
    };
    write("report.json", serde_json::to_string_pretty(report)? + "\n")?;
    write("report.md", report::compare_markdown(report))?;
    write(
        "chart.svg",
        svg::chart(&svg::ChartData::from_report(report)),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::tests::sample;

    fn open(offered: f64, achieved: f64, p99_us: u64) -> RunResult {
        let mut run = sample("sticky", 64, p99_us / 3, achieved);
        run.offered_rps = Some(offered);
        run.latency.p99_us = p99_us;
        run
    }

    fn own(p99_us: u64) -> P99Yardstick {
        P99Yardstick {
            p99_us,
            baseline: false,
        }
    }

    #[test]
    fn a_rate_is_sustained_until_it_falls_short_fails_or_its_p99_explodes() {
        assert_eq!(saturated_because(&open(1000.0, 990.0, 900), own(600)), None);
        let short = saturated_because(&open(1000.0, 900.0, 900), own(600)).unwrap_or_default();
        assert!(short.contains("achieved 900 of 1,000"), "{short}");
        let slow = saturated_because(&open(1000.0, 1000.0, 6_001), own(600)).unwrap_or_default();
        assert_eq!(
            slow, "p99 6.001 ms > 10 × 0.600 ms, its own p99 at the lowest rate",
            "{slow}"
        );
        let mut unsent = open(1000.0, 1000.0, 900);
        unsent.unsent = 3;
        assert_eq!(
            saturated_because(&unsent, own(600)).as_deref(),
            Some("3 requests never sent")
        );
        let mut failing = open(1000.0, 1000.0, 900);
        failing.errors.insert("http 503".into(), 11);
        let failed = saturated_because(&failing, own(600)).unwrap_or_default();
        assert!(failed.starts_with("11 errors of 1,000"), "{failed}");
        // A closed-loop run has no offered rate to fall short of.
        assert_eq!(
            saturated_because(&sample("sticky", 64, 100, 1.0), own(1)),
            None
        );
    }

    #[test]
    fn refinement_halves_the_bracket_between_sustained_and_saturated_rates() {
        let mut outcome = unswept(ConfigName::Tcp);
        outcome.record_swept(1000.0, open(1000.0, 1000.0, 900), None);
        outcome.record_swept(2000.0, open(2000.0, 2000.0, 1_000), None);
        assert_eq!(outcome.bracket_middle(), None, "nothing saturated yet");
        outcome.record_swept(4000.0, open(4000.0, 3000.0, 9_000), None);
        assert_eq!(outcome.bracket_middle(), Some(3000.0));
        // Sustained in the middle: the lower end rises.
        outcome.record_swept(3000.0, open(3000.0, 2990.0, 2_000), None);
        assert_eq!(outcome.bracket_middle(), Some(3500.0));
        // Saturated in the middle: the upper end falls, with its own reason.
        outcome.record_swept(3500.0, open(3500.0, 3000.0, 2_000), None);
        let saturation = outcome.saturation.clone().expect("a bracket");
        assert_eq!(saturation.sustained_rps, Some(3000.0));
        assert_eq!(saturation.saturated_at_rps, Some(3500.0));
        assert!(
            saturation
                .reason
                .as_deref()
                .unwrap_or_default()
                .contains("of 3,500"),
            "{saturation:?}"
        );
        assert_eq!(outcome.bracket_middle(), Some(3300.0));
        let offered: Vec<f64> = outcome.sweep.iter().filter_map(|r| r.offered_rps).collect();
        assert_eq!(
            offered,
            [1000.0, 2000.0, 3000.0, 3500.0, 4000.0],
            "kept in rate order"
        );
        // Within one step there is nothing left to halve.
        outcome.record_swept(3100.0, open(3100.0, 3100.0, 2_000), None);
        outcome.record_swept(3200.0, open(3200.0, 3000.0, 2_000), None);
        assert_eq!(outcome.bracket_middle(), None);
        // Virtual servers are not swept, so never refined.
        outcome.name = ConfigName::Virtual;
        outcome.saturation = Some(Saturation {
            sustained_rps: Some(1000.0),
            saturated_at_rps: Some(2000.0),
            reason: None,
        });
        assert_eq!(outcome.bracket_middle(), None);
    }

    /// A configuration with no run yet.
    fn unswept(name: ConfigName) -> ConfigOutcome {
        ConfigOutcome {
            name,
            description: String::new(),
            not_available: None,
            runs: Vec::new(),
            sweep: Vec::new(),
            saturation: None,
            at_half_baseline: None,
        }
    }

    #[test]
    fn the_baselines_p99_at_its_lowest_rate_bounds_every_configuration() {
        let tcp = |p99_us| {
            let mut outcome = unswept(ConfigName::Tcp);
            outcome.record_swept(1000.0, open(1000.0, 1000.0, p99_us), None);
            outcome
        };
        let mut redis = tcp(3_000);
        redis.name = ConfigName::Redis;
        let baseline = P99Yardstick::of_baseline(&[tcp(1_000), redis.clone()]);
        assert_eq!(
            baseline,
            Some(P99Yardstick {
                p99_us: 3_000,
                baseline: true
            })
        );
        // 20 ms is more than 10 × TCP's own 1 ms, within 10 × the baseline's 3 ms.
        let mut judged = tcp(1_000);
        judged.record_swept(4000.0, open(4000.0, 4000.0, 20_000), baseline);
        let saturation = judged.saturation.clone().expect("a saturation record");
        assert_eq!(saturation.sustained_rps, Some(4000.0), "{saturation:?}");
        judged.record_swept(8000.0, open(8000.0, 8000.0, 31_000), baseline);
        let saturation = judged.saturation.clone().expect("a saturation record");
        assert_eq!(saturation.saturated_at_rps, Some(8000.0), "{saturation:?}");
        assert_eq!(
            saturation.reason.as_deref(),
            Some("p99 31.000 ms > 10 × 3.000 ms, the baseline's p99 at the lowest rate")
        );
        // Without a baseline in the sweep each configuration keeps its own bound.
        let mut alone = tcp(1_000);
        alone.record_swept(4000.0, open(4000.0, 4000.0, 20_000), None);
        let saturation = alone.saturation.clone().expect("a saturation record");
        assert_eq!(saturation.saturated_at_rps, Some(4000.0), "{saturation:?}");
        assert_eq!(P99Yardstick::of_baseline(&[alone]), None);
    }
}
