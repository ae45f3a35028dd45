//! `mcpgw-bench sessions`: what an idle session costs.
//!
//! Opens K legacy sessions on one worker and leaves them idle. The owner's cost is
//! the growth of the worker's resident memory (VmRSS) per session, measured on a
//! standalone worker (no Redis) so nothing else grows with it; the upstream runs in
//! its own process, so its side of each session is not in that figure. The
//! directory's cost is the growth of Redis `used_memory` per session, measured on a
//! one-worker fleet with a Redis of its own. A warm-up batch of sessions is opened
//! before the baseline so one-time costs (pools, allocator arenas) are not charged
//! to the sessions.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::client::{self, Target};
use super::fleet::{Bins, Fleet, FleetSpec, MeshCerts, Proc, RedisServer, UpstreamServer, url_in};
use super::procfs;
use super::redis::RedisClient;
use super::units::utc_timestamp;

/// Flags of `mcpgw-bench sessions`.
#[derive(Debug, Clone, clap::Args)]
pub struct SessionsArgs {
    /// Idle sessions to open on the worker.
    #[arg(long, default_value_t = 10_000)]
    pub count: usize,
    /// Sessions opened before the baseline is read (not counted).
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    /// Sessions opened concurrently.
    #[arg(long, default_value_t = 32)]
    pub parallel: usize,
    /// Directory holding mcpgw and mcpgw-bench [default: beside this binary, then
    /// target/release, then target/debug].
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Use this upstream MCP URL instead of starting the demo upstream.
    #[arg(long)]
    pub upstream: Option<String>,
    /// Directory for logs and sessions.json [default: build/bench/sessions-<UTC timestamp>].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Memory growth of one process while K sessions were opened on it.
#[derive(Debug, Clone, Serialize)]
pub struct OwnerMemory {
    pub pid: u32,
    pub opened: usize,
    pub failed: usize,
    pub open_seconds: f64,
    /// Sessions the worker reports holding afterwards (GET /healthz).
    pub sessions_held: Option<u64>,
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    pub per_session_bytes: f64,
    /// The upstream process's RSS growth per session over the same window, when its
    /// pid is known: not part of the owner's figure, shown so the whole cost is visible.
    pub upstream_per_session_bytes: Option<f64>,
}

/// The directory's side: Redis memory per session.
#[derive(Debug, Clone, Serialize)]
pub struct DirectoryMemory {
    pub used_memory_before_bytes: u64,
    pub used_memory_after_bytes: u64,
    pub per_session_bytes: f64,
    pub keys_before: u64,
    pub keys_after: u64,
    /// The fleet worker's own RSS growth (directory client, ownership bookkeeping).
    pub worker: OwnerMemory,
}

/// A measurement, or why it could not be made.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Outcome<T> {
    Measured(T),
    NotAvailable { not_available: String },
}

impl<T> From<Result<T, String>> for Outcome<T> {
    fn from(result: Result<T, String>) -> Self {
        match result {
            Ok(value) => Outcome::Measured(value),
            Err(reason) => Outcome::NotAvailable {
                not_available: reason,
            },
        }
    }
}

impl<T> Outcome<T> {
    pub fn measured(&self) -> Option<&T> {
        match self {
            Outcome::Measured(value) => Some(value),
            Outcome::NotAvailable { .. } => None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SessionsReport {
    pub count: usize,
    pub warmup: usize,
    /// A standalone worker: the owner's memory per idle session.
    pub owner: Outcome<OwnerMemory>,
    /// A one-worker fleet: Redis memory per session.
    pub directory: Outcome<DirectoryMemory>,
}

/// `mcpgw-bench sessions`.
pub async fn main(args: SessionsArgs) -> anyhow::Result<()> {
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("build/bench").join(format!("sessions-{}", utc_timestamp(now_unix())))
    });
    std::fs::create_dir_all(&out)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", out.display()))?;
    let bins = Bins::locate(args.bin_dir.as_deref()).map_err(anyhow::Error::msg)?;
    let (upstream_url, upstream_pid, started) = match &args.upstream {
        Some(url) => (url.clone(), None, None),
        None => {
            let upstream = UpstreamServer::start(&bins, &out)
                .await
                .map_err(anyhow::Error::msg)?;
            (
                upstream.url.clone(),
                Some(upstream.proc.pid),
                Some(upstream),
            )
        }
    };
    let plan = SessionsPlan {
        count: args.count,
        warmup: args.warmup,
        parallel: args.parallel.max(1),
    };
    let report = measure(&bins, &plan, &upstream_url, upstream_pid, &out).await;
    if let Some(upstream) = started {
        upstream.proc.stop().await;
    }
    print!("{}", super::report::sessions_markdown(&report));
    let json = serde_json::to_string_pretty(&report)?;
    let path = out.join("sessions.json");
    std::fs::write(&path, json + "\n")
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    println!("\nreport: {}", path.display());
    Ok(())
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How many sessions to open and how.
#[derive(Debug, Clone, Copy)]
pub struct SessionsPlan {
    pub count: usize,
    pub warmup: usize,
    pub parallel: usize,
}

/// Both measurements, each on fresh processes; `upstream_pid` is known when the
/// caller started the upstream.
pub async fn measure(
    bins: &Bins,
    plan: &SessionsPlan,
    upstream_url: &str,
    upstream_pid: Option<u32>,
    log_dir: &Path,
) -> SessionsReport {
    let owner = owner_memory(bins, plan, upstream_url, upstream_pid, log_dir).await;
    let directory = directory_memory(bins, plan, upstream_url, log_dir).await;
    SessionsReport {
        count: plan.count,
        warmup: plan.warmup,
        owner: owner.into(),
        directory: directory.into(),
    }
}

async fn owner_memory(
    bins: &Bins,
    plan: &SessionsPlan,
    upstream_url: &str,
    upstream_pid: Option<u32>,
    log_dir: &Path,
) -> Result<OwnerMemory, String> {
    let args: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &format!("demo={upstream_url}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (proc, line) = Proc::start(
        "sessions-standalone",
        &bins.mcpgw,
        &args,
        log_dir,
        "mcpgw listening on",
    )
    .await?;
    let result = async {
        let base = url_in(&line).ok_or_else(|| format!("no address in {line:?}"))?;
        let target = Target::parse(&format!("{base}/mcp"))?;
        // "mcpgw listening on http://ADDR (admin: http://ADMIN)"
        let admin = line
            .split_once("(admin: ")
            .and_then(|(_, rest)| url_in(rest))
            .map(|admin| Target::parse(&admin))
            .transpose()?;
        grow(&target, proc.pid, upstream_pid, plan, admin.as_ref()).await
    }
    .await;
    proc.stop().await;
    result
}

async fn directory_memory(
    bins: &Bins,
    plan: &SessionsPlan,
    upstream_url: &str,
    log_dir: &Path,
) -> Result<DirectoryMemory, String> {
    let redis = RedisServer::start("sessions-redis", log_dir).await?;
    let result = async {
        let certs = MeshCerts::create(bins, &log_dir.join("sessions-certs"), &["host-a"]).await?;
        let spec = FleetSpec {
            name: "sessions-fleet",
            transport: "quic",
            redis_url: &redis.url,
            upstream_url,
            members: &["host-a"],
            key_prefix: "mcpgw:",
        };
        let fleet = Fleet::start(bins, &certs, &spec, log_dir).await?;
        let measured = async {
            let url = fleet.urls.first().ok_or("the fleet has no URL")?;
            let target = Target::parse(url)?;
            // The worker process, not its supervisor, holds the sessions.
            let supervisors = fleet.pids();
            let pid = procfs::with_descendants(&supervisors)
                .into_iter()
                .find(|pid| !supervisors.contains(pid))
                .ok_or("the fleet supervisor has no worker process")?;
            let mut redis_client = RedisClient::connect(&redis.url).await?;
            open_sessions(&target, plan.warmup, plan.parallel).await;
            settle().await;
            let used_before = redis_client.info_number("memory", "used_memory").await?;
            let keys_before = key_count(&mut redis_client).await?;
            let worker = grow(
                &target,
                pid,
                None,
                &SessionsPlan { warmup: 0, ..*plan },
                None,
            )
            .await?;
            let used_after = redis_client.info_number("memory", "used_memory").await?;
            let keys_after = key_count(&mut redis_client).await?;
            Ok::<_, String>(DirectoryMemory {
                used_memory_before_bytes: used_before,
                used_memory_after_bytes: used_after,
                per_session_bytes: per_session(used_before, used_after, worker.opened),
                keys_before,
                keys_after,
                worker,
            })
        }
        .await;
        fleet.stop().await;
        measured
    }
    .await;
    redis.proc.stop().await;
    result
}

async fn key_count(redis: &mut RedisClient) -> Result<u64, String> {
    match redis.command(&["DBSIZE"]).await? {
        super::redis::Resp::Integer(n) => Ok(u64::try_from(n).unwrap_or(0)),
        other => Err(format!("unexpected DBSIZE reply {other:?}")),
    }
}

/// Opens `plan.warmup` sessions, reads RSS, opens `plan.count` more, reads it again
/// (the upstream's too, when `upstream_pid` is given).
async fn grow(
    target: &Target,
    pid: u32,
    upstream_pid: Option<u32>,
    plan: &SessionsPlan,
    admin: Option<&Target>,
) -> Result<OwnerMemory, String> {
    if plan.warmup > 0 {
        open_sessions(target, plan.warmup, plan.parallel).await;
    }
    settle().await;
    let before = procfs::rss_bytes(pid).ok_or_else(|| format!("cannot read VmRSS of {pid}"))?;
    let upstream_before = upstream_pid.and_then(procfs::rss_bytes);
    let started = Instant::now();
    let (opened, failed) = open_sessions(target, plan.count, plan.parallel).await;
    let open_seconds = started.elapsed().as_secs_f64();
    settle().await;
    let after = procfs::rss_bytes(pid).ok_or_else(|| format!("cannot read VmRSS of {pid}"))?;
    let upstream_after = upstream_pid.and_then(procfs::rss_bytes);
    let sessions_held = match admin {
        Some(admin) => held_sessions(admin).await,
        None => None,
    };
    Ok(OwnerMemory {
        pid,
        opened,
        failed,
        open_seconds,
        sessions_held,
        rss_before_bytes: before,
        rss_after_bytes: after,
        per_session_bytes: per_session(before, after, opened),
        upstream_per_session_bytes: upstream_before
            .zip(upstream_after)
            .map(|(before, after)| per_session(before, after, opened)),
    })
}

/// Growth per session; may be negative when the allocator returned memory.
pub fn per_session(before: u64, after: u64, sessions: usize) -> f64 {
    if sessions == 0 {
        return 0.0;
    }
    (after as f64 - before as f64) / sessions as f64
}

/// Lets in-flight work (upstream connections, deferred frees) finish before reading.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

async fn held_sessions(admin: &Target) -> Option<u64> {
    client::probe_state(admin, Duration::from_secs(5))
        .await?
        .sessions
}

/// Opens `count` idle sessions over `parallel` keep-alive connections; returns
/// (opened, failed).
async fn open_sessions(target: &Target, count: usize, parallel: usize) -> (usize, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..parallel.min(count.max(1)) {
        let next = Arc::clone(&next);
        let target = target.clone();
        tasks.spawn(async move {
            let mut slot = None;
            let (mut opened, mut failed) = (0, 0);
            while next.fetch_add(1, Ordering::Relaxed) < count {
                match client::open_session(&mut slot, &target, Duration::from_secs(30)).await {
                    Ok(_) => opened += 1,
                    Err(_) => failed += 1,
                }
            }
            (opened, failed)
        });
    }
    let (mut opened, mut failed) = (0, 0);
    while let Some(result) = tasks.join_next().await {
        if let Ok((o, f)) = result {
            opened += o;
            failed += f;
        }
    }
    (opened, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_divided_over_the_sessions() {
        assert_eq!(per_session(1_000_000, 1_160_000, 10), 16_000.0);
        assert_eq!(per_session(2_000, 1_000, 10), -100.0);
        assert_eq!(per_session(1, 2, 0), 0.0);
    }
}
