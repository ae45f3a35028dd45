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
//! | `redis` | the same over the Redis pub/sub baseline |
//! | `round-robin` | requests alternate over both workers (QUIC fleet): half forwarded |
//! | `modern` | 2026-07-28 stateless requests, round-robin (QUIC fleet); optional |
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
use super::run::{LoadSpec, RunResult, run_load};
use super::sessions::{self, SessionsPlan, SessionsReport, now_unix};
use super::svg;
use super::targets::{self, TargetCheck};
use super::units::{grouped, ms, parse_duration, utc_timestamp};

/// Flags of `mcpgw-bench compare`. The defaults finish in about two minutes on a
/// 2-core machine: 6 configurations × 4 concurrency levels × (0.5 s warm-up + 3 s
/// measured + session set-up), plus fleet start-up, the loopback probe and
/// 2 × 10,000 idle sessions.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Configurations, in report order (direct, sticky, quic, tcp, redis,
    /// round-robin, modern).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,sticky,quic,tcp,redis,round-robin"
    )]
    pub configs: Vec<ConfigName>,
    /// Concurrent sessions per run; each configuration runs at each level. The
    /// lowest level shows the added latency with the least queueing.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,512")]
    pub concurrency: Vec<usize>,
    /// Measured time per run.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub duration: Duration,
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
    Redis,
    RoundRobin,
    Modern,
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
            ConfigName::Redis => "redis",
            ConfigName::RoundRobin => "round-robin",
            ConfigName::Modern => "modern",
        }
    }

    /// The mesh transport of the fleet it runs on; None for `direct`.
    pub fn transport(self) -> Option<&'static str> {
        match self {
            ConfigName::Direct => None,
            ConfigName::Quic => Some("quic"),
            // The default transport, as a user's fleet would run.
            ConfigName::Sticky | ConfigName::Tcp | ConfigName::RoundRobin | ConfigName::Modern => {
                Some("tcp")
            }
            ConfigName::Redis => Some("redis"),
        }
    }

    pub fn routing(self) -> Routing {
        match self {
            ConfigName::Direct | ConfigName::Sticky => Routing::Sticky,
            ConfigName::Quic | ConfigName::Tcp | ConfigName::Redis => Routing::Forward,
            ConfigName::RoundRobin | ConfigName::Modern => Routing::RoundRobin,
        }
    }

    pub fn era(self) -> Era {
        match self {
            ConfigName::Modern => Era::Modern,
            _ => Era::Legacy,
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            ConfigName::Direct => "client → upstream, no gateway",
            ConfigName::Sticky => "every request to the owner worker (nothing forwarded)",
            ConfigName::Quic => "every request to the other worker, forwarded over the QUIC mesh",
            ConfigName::Tcp => "every request to the other worker, forwarded over the TCP mesh",
            ConfigName::Redis => {
                "every request to the other worker, forwarded over Redis pub/sub (baseline)"
            }
            ConfigName::RoundRobin => {
                "requests alternate over both workers (TCP mesh, the default)"
            }
            ConfigName::Modern => "2026-07-28 stateless requests alternating over both workers",
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
        })
        .collect();
    for &concurrency in &args.concurrency {
        for outcome in outcomes.iter_mut() {
            if outcome.not_available.is_some() {
                continue;
            }
            let name = outcome.name;
            let (urls, redis_url, pids) = match name.transport() {
                None => (vec![upstream_url.clone()], None, Vec::new()),
                Some(transport) => match fleets.get(transport) {
                    Some(Ok(f)) => (
                        f.fleet.urls.clone(),
                        Some(f.redis_url.clone()),
                        f.fleet.pids(),
                    ),
                    _ => continue,
                },
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
    let targets = targets::evaluate(&outcomes, idle_sessions.as_ref(), machine.loopback.as_ref());
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
    format!(
        "{:<12} c={:<4} {:>8} req/s  p50 {} ms  p99 {} ms  forwarded {}  errors {}  other load {} cores",
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
