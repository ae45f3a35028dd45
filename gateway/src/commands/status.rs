//! `mcpgw status`: the fleet as the directory sees it, and the problems an operator
//! must see. The directory reads live in `mcpgw_mesh::directory`
//! ([`Directory::fleet_snapshot`], pure data); what counts as a problem is decided
//! here, by [`find_problems`], a pure function of that snapshot; the rest prints.
//!
//! Exit codes: 0 the fleet looks healthy; 1 a problem was found (each is one line that
//! says what is wrong and what to do); 2 the directory could not be read.

use std::collections::BTreeMap;
use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use mcpgw_mesh::directory::{
    Directory, DirectoryConfig, DirectoryError, FleetSnapshot, LeaseView, Topology, WorkerSnapshot,
};
use serde::Serialize;

const DAY_MS: u64 = 24 * 3600 * 1000;

/// Where the fleet directory is: shared by `mcpgw status` and `mcpgw drain`.
#[derive(Debug, clap::Args)]
pub struct DirectoryArgs {
    /// Redis URL of the fleet directory, as given to `mcpgw serve` (the password never
    /// appears in any output).
    #[arg(long, env = "MCPGW_REDIS_URL")]
    pub redis: String,
    /// Prefix of the fleet's Redis keys, as given to `mcpgw serve`.
    #[arg(long, env = "MCPGW_KEY_PREFIX", default_value = "mcpgw:")]
    pub key_prefix: String,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub directory: DirectoryArgs,
    /// The fleet's lease time in ms, as given to `mcpgw serve`: a worker's sessions
    /// without its lease count as a problem only in a directory older than one lease
    /// (after Redis came back empty, live workers need that long to register again).
    #[arg(long, env = "MCPGW_LEASE_MS", default_value_t = 10_000)]
    pub lease_ms: u64,
    /// A mesh certificate expiring within this many days is a problem.
    #[arg(long, default_value_t = 7)]
    pub warn_days: u32,
    /// Print JSON instead of a table (the same data, and the problems).
    #[arg(long)]
    pub json: bool,
}

/// What the problem checks need besides the snapshot.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// The fleet's lease time.
    pub lease: Duration,
    /// Certificates expiring within this are a problem.
    pub cert_warning: Duration,
}

/// Something an operator must act on. Each variant's `Display` is one line that says
/// what is wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Problem {
    /// No worker holds a lease: the fleet is down, or the flags name another directory.
    NoLiveWorker,
    /// Live workers registered at one mesh address: only one process answers there.
    DuplicateMeshAddress { addr: String, workers: Vec<String> },
    /// One process holds leases under several worker ids.
    DuplicateProcess {
        host: String,
        pid: u32,
        workers: Vec<String>,
    },
    /// A worker without a lease still has a session set, in a directory older than a
    /// lease: its sessions cannot be served, and they have not been reclaimed.
    ExpiredLeaseOwnsSessions {
        worker: String,
        sessions: u64,
        records: u64,
    },
    /// Session records name a worker that holds no lease (and has no session set).
    OrphanedSessionRecords { worker: String, records: u64 },
    /// A Redis-transport request channel has more or fewer than one subscriber.
    RequestChannelSubscribers {
        worker: String,
        channel: String,
        subscribers: u64,
    },
    /// A worker's mesh certificate expires within the warning time, or has expired.
    CertificateExpiring {
        worker: String,
        host: String,
        not_after_unix_ms: u64,
        /// Negative once expired.
        ms_left: i64,
    },
    /// Live workers run different versions.
    MixedVersions {
        versions: BTreeMap<String, Vec<String>>,
    },
    /// A live lease whose value this version cannot read.
    UnreadableLease { worker: String },
    /// Live workers renewed their leases through another primary than the one this
    /// read reached (Sentinel, Cluster): primary → workers.
    PrimaryDisagreement {
        reached: String,
        elsewhere: BTreeMap<String, Vec<String>>,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::NoLiveWorker => write!(
                f,
                "no live worker: no worker holds a lease in this directory, so the fleet is \
                 down or --redis / --key-prefix name another fleet's directory"
            ),
            Problem::DuplicateMeshAddress { addr, workers } => write!(
                f,
                "duplicate identity: workers {} are registered at one mesh address, {addr}, \
                 where only one process can answer; requests for the others' sessions reach \
                 the wrong worker. Find the process that is not the worker it claims and stop \
                 it (check --mesh-advertise)",
                list(workers)
            ),
            Problem::DuplicateProcess { host, pid, workers } => write!(
                f,
                "duplicate identity: process {pid} on host {host} holds leases under several \
                 worker ids ({}); a process is exactly one worker. Stop that process (its \
                 supervisor starts a clean replacement), or if these are two hosts sharing a \
                 hostname, give them distinct hostnames",
                list(workers)
            ),
            Problem::ExpiredLeaseOwnsSessions {
                worker,
                sessions,
                records,
            } => write!(
                f,
                "expired lease still owns sessions: worker {worker} holds no lease but its \
                 session set lists {} ({} name it); \
                 clients of those sessions are told they are gone, yet the records were not \
                 freed. Live workers sweep them within about a lease plus two sweep \
                 intervals: if this persists, no live worker is sweeping (check the workers' \
                 logs for sweep errors)",
                count(*sessions, "session"),
                count(*records, "session record")
            ),
            Problem::OrphanedSessionRecords { worker, records } => write!(
                f,
                "orphaned session records: {} (pool_owner keys) name worker {worker}, which \
                 holds no lease and has no session set, so no sweep will free them; those \
                 sessions are gone. Delete the pool_owner keys whose value is {worker}",
                count(*records, "session record")
            ),
            Problem::RequestChannelSubscribers {
                worker,
                channel,
                subscribers: 0,
            } => write!(
                f,
                "worker {worker}'s request channel {channel} has no subscriber: requests \
                 forwarded to it over Redis are lost until it subscribes again; restart \
                 that worker if this persists"
            ),
            Problem::RequestChannelSubscribers {
                worker,
                channel,
                subscribers,
            } => write!(
                f,
                "worker {worker}'s request channel {channel} has {subscribers} subscribers: \
                 more than one process takes its requests, so one request may run twice; \
                 stop every subscriber that is not worker {worker} (PUBSUB NUMSUB {channel} \
                 must be 1)"
            ),
            Problem::CertificateExpiring {
                worker,
                host,
                not_after_unix_ms,
                ms_left,
            } => {
                let date = date_of(*not_after_unix_ms);
                if *ms_left <= 0 {
                    write!(
                        f,
                        "expired certificate: worker {worker} (host {host}) holds a mesh \
                         certificate that expired {} ago ({date}); peers refuse it. Issue its \
                         leaf again (`mcpgw certs issue --name NAME`; `mcpgw certs inspect` on \
                         {host} names it) and install it on {host}",
                        days(ms_left.unsigned_abs())
                    )
                } else {
                    write!(
                        f,
                        "certificate close to expiry: worker {worker} (host {host}) holds a \
                         mesh certificate that expires in {} ({date}). Issue its leaf again \
                         (`mcpgw certs issue --name NAME`; `mcpgw certs inspect` on {host} \
                         names it) and install it on {host}",
                        days(ms_left.unsigned_abs())
                    )
                }
            }
            Problem::MixedVersions { versions } => {
                let each: Vec<String> = versions
                    .iter()
                    .map(|(version, ids)| format!("{version} ({})", list(ids)))
                    .collect();
                write!(
                    f,
                    "workers of different versions: {}; expected during a rolling upgrade, \
                     otherwise finish the upgrade",
                    each.join(", ")
                )
            }
            Problem::PrimaryDisagreement { reached, elsewhere } => {
                let each: Vec<String> = elsewhere
                    .iter()
                    .map(|(primary, ids)| format!("{} through {primary}", list(ids)))
                    .collect();
                write!(
                    f,
                    "workers disagree about the Redis primary: this read reached {reached}, \
                     but workers last renewed {}. Right after a failover this clears within \
                     a lease as they follow the new primary; if it persists, those workers \
                     reach another deployment or a demoted primary: check their --redis URL, \
                     their logs, and that the old primary is a replica now",
                    each.join(", ")
                )
            }
            Problem::UnreadableLease { worker } => write!(
                f,
                "worker {worker}'s lease does not parse (written by another version?): its \
                 host, process and version cannot be checked; run status from the version \
                 the fleet runs"
            ),
        }
    }
}

/// The problems in `snapshot`, in a stable order: identities, sessions, channels,
/// certificates, versions.
pub fn find_problems(snapshot: &FleetSnapshot, policy: &Policy) -> Vec<Problem> {
    let mut problems = Vec::new();
    let live: Vec<Live<'_>> = snapshot
        .workers
        .iter()
        .filter_map(|w| match &w.lease {
            LeaseView::Live(info) => Some((w, info)),
            _ => None,
        })
        .collect();
    if live.is_empty() {
        problems.push(Problem::NoLiveWorker);
    }
    shared_identities(&live, &mut problems);
    unreadable_leases(snapshot, &mut problems);
    sessions_without_owner(snapshot, policy, &mut problems);
    request_channels(&live, &mut problems);
    expiring_certificates(snapshot, &live, policy, &mut problems);
    primary_disagreement(snapshot, &live, &mut problems);
    mixed_versions(&live, &mut problems);
    problems
}

/// A worker with a live lease, and what the lease publishes.
type Live<'a> = (&'a WorkerSnapshot, &'a mcpgw_mesh::directory::WorkerInfo);

/// Two live workers at one mesh address, or in one process.
fn shared_identities(live: &[Live<'_>], problems: &mut Vec<Problem>) {
    let mut by_addr: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut by_process: BTreeMap<(&str, u32), Vec<String>> = BTreeMap::new();
    for (worker, info) in live {
        if let Some(addr) = worker.addr.as_deref() {
            by_addr.entry(addr).or_default().push(worker.id.clone());
        }
        by_process
            .entry((info.host.as_str(), info.pid))
            .or_default()
            .push(worker.id.clone());
    }
    for (addr, workers) in by_addr {
        if workers.len() > 1 {
            problems.push(Problem::DuplicateMeshAddress {
                addr: addr.to_owned(),
                workers,
            });
        }
    }
    for ((host, pid), workers) in by_process {
        if workers.len() > 1 {
            problems.push(Problem::DuplicateProcess {
                host: host.to_owned(),
                pid,
                workers,
            });
        }
    }
}

fn unreadable_leases(snapshot: &FleetSnapshot, problems: &mut Vec<Problem>) {
    for worker in &snapshot.workers {
        if worker.lease == LeaseView::Unreadable {
            problems.push(Problem::UnreadableLease {
                worker: worker.id.clone(),
            });
        }
    }
}

/// Sessions recorded for a worker whose lease is gone: an expired lease that still owns
/// sessions, or records nobody's set holds.
fn sessions_without_owner(snapshot: &FleetSnapshot, policy: &Policy, problems: &mut Vec<Problem>) {
    // A missing lease proves nothing in a directory younger than a lease: after Redis
    // came back empty, live workers need that long to register again.
    let directory_settled = snapshot.generation_created_unix_ms.is_some_and(|created| {
        snapshot.redis_now_unix_ms.saturating_sub(created) > millis(policy.lease)
    });
    let without_lease = |id: &str| {
        snapshot
            .workers
            .iter()
            .find(|w| w.id == id)
            .is_none_or(|w| w.lease == LeaseView::Absent)
    };
    let mut reported = std::collections::BTreeSet::new();
    if directory_settled {
        for worker in &snapshot.workers {
            if worker.lease == LeaseView::Absent && worker.sessions_owned > 0 {
                reported.insert(worker.id.as_str());
                problems.push(Problem::ExpiredLeaseOwnsSessions {
                    worker: worker.id.clone(),
                    sessions: worker.sessions_owned,
                    records: snapshot
                        .session_records
                        .get(&worker.id)
                        .copied()
                        .unwrap_or(0),
                });
            }
        }
    }
    for (owner, &records) in &snapshot.session_records {
        if records > 0 && without_lease(owner) && !reported.contains(owner.as_str()) {
            let has_set = snapshot
                .workers
                .iter()
                .any(|w| w.id == *owner && w.sessions_owned > 0);
            // While the directory is young a worker's set without its lease is not yet
            // a problem, and neither are the records in it.
            if has_set && !directory_settled {
                continue;
            }
            problems.push(Problem::OrphanedSessionRecords {
                worker: owner.clone(),
                records,
            });
        }
    }
}

/// Over the Redis transport, each live worker's request channel has one subscriber.
fn request_channels(live: &[Live<'_>], problems: &mut Vec<Problem>) {
    for (worker, _) in live {
        if let (Some(subscribers), Some(channel)) =
            (worker.request_channel_subscribers, worker.addr.as_ref())
            && subscribers != 1
        {
            problems.push(Problem::RequestChannelSubscribers {
                worker: worker.id.clone(),
                channel: channel.clone(),
                subscribers,
            });
        }
    }
}

fn expiring_certificates(
    snapshot: &FleetSnapshot,
    live: &[Live<'_>],
    policy: &Policy,
    problems: &mut Vec<Problem>,
) {
    for (worker, info) in live {
        if let Some(not_after) = worker.cert_not_after_unix_ms {
            let ms_left = signed_ms(not_after) - signed_ms(snapshot.redis_now_unix_ms);
            if ms_left < signed_ms(millis(policy.cert_warning)) {
                problems.push(Problem::CertificateExpiring {
                    worker: worker.id.clone(),
                    host: info.host.clone(),
                    not_after_unix_ms: not_after,
                    ms_left,
                });
            }
        }
    }
}

/// Workers that follow another Redis primary than the one this command reached.
fn primary_disagreement(snapshot: &FleetSnapshot, live: &[Live<'_>], problems: &mut Vec<Problem>) {
    if let Some(reached) = &snapshot.primary {
        let mut elsewhere: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (worker, _) in live {
            if let Some(followed) = &worker.followed_primary
                && followed != reached
            {
                elsewhere
                    .entry(followed.clone())
                    .or_default()
                    .push(worker.id.clone());
            }
        }
        if !elsewhere.is_empty() {
            problems.push(Problem::PrimaryDisagreement {
                reached: reached.clone(),
                elsewhere,
            });
        }
    }
}

fn mixed_versions(live: &[Live<'_>], problems: &mut Vec<Problem>) {
    let mut versions: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (worker, info) in live {
        versions
            .entry(info.version.clone())
            .or_default()
            .push(worker.id.clone());
    }
    if versions.len() > 1 {
        problems.push(Problem::MixedVersions { versions });
    }
}

/// `mcpgw status`.
pub fn run(args: StatusArgs) -> ExitCode {
    let policy = Policy {
        lease: Duration::from_millis(args.lease_ms.max(1)),
        cert_warning: Duration::from_millis(u64::from(args.warn_days) * DAY_MS),
    };
    let (snapshot, topology) = match block_on(async {
        let directory = connect(&args.directory, policy.lease).await?;
        let snapshot = directory.fleet_snapshot().await?;
        Ok::<_, DirectoryError>((snapshot, directory.topology()))
    }) {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            eprintln!("mcpgw status: cannot read the fleet directory: {e}");
            return ExitCode::from(2);
        }
        Err(message) => {
            eprintln!("mcpgw status: {message}");
            return ExitCode::from(2);
        }
    };
    let problems = find_problems(&snapshot, &policy);
    if args.json {
        let mut json = to_json(&snapshot, &problems);
        if let Some(fields) = json.as_object_mut() {
            fields.insert("redis".into(), topology_json(&topology));
        }
        println!("{json}");
    } else {
        println!("redis: {topology}");
        print!("{}", table(&snapshot, &problems));
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A directory client for one command: short deadlines, so an unreachable Redis is
/// reported within seconds.
pub(crate) async fn connect(
    args: &DirectoryArgs,
    lease: Duration,
) -> Result<Directory, DirectoryError> {
    Directory::connect(DirectoryConfig {
        redis_url: args.redis.clone(),
        prefix: args.key_prefix.clone(),
        lease,
        op_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(3),
        ..DirectoryConfig::default()
    })
    .await
}

/// Runs one command's async work on a small runtime.
pub(crate) fn block_on<T>(work: impl std::future::Future<Output = T>) -> Result<T, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    Ok(runtime.block_on(work))
}

/// The state column of a worker.
fn state_of(worker: &WorkerSnapshot) -> &'static str {
    match (&worker.lease, worker.drain_requested) {
        (LeaseView::Live(_), true) => "draining",
        (LeaseView::Live(_), false) => "live",
        (LeaseView::Unreadable, _) => "unreadable",
        (LeaseView::Absent, _) => "no lease",
    }
}

fn table(snapshot: &FleetSnapshot, problems: &[Problem]) -> String {
    let now = snapshot.redis_now_unix_ms;
    let header = [
        "WORKER",
        "STATE",
        "HOST",
        "PID",
        "MESH",
        "ADMIN",
        "RENEWED",
        "SESSIONS",
        "VERSION",
        "CERT EXPIRES",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| (*h).to_owned()).collect()];
    for worker in &snapshot.workers {
        let info = match &worker.lease {
            LeaseView::Live(info) => Some(info),
            _ => None,
        };
        let dash = || "-".to_owned();
        rows.push(vec![
            worker.id.clone(),
            state_of(worker).to_owned(),
            info.map_or_else(dash, |i| i.host.clone()),
            info.map_or_else(dash, |i| i.pid.to_string()),
            worker.addr.clone().unwrap_or_else(dash),
            info.and_then(|i| i.admin.clone()).unwrap_or_else(dash),
            worker.last_renewal_unix_ms.map_or_else(dash, |at| {
                format!("{:.1}s ago", now.saturating_sub(at) as f64 / 1000.0)
            }),
            worker.sessions_owned.to_string(),
            info.map_or_else(dash, |i| i.version.clone()),
            worker.cert_not_after_unix_ms.map_or_else(dash, |at| {
                let left = signed_ms(at) - signed_ms(now);
                if left <= 0 {
                    format!("EXPIRED {}", date_of(at))
                } else {
                    format!("{} (in {})", date_of(at), days(left.unsigned_abs()))
                }
            }),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|col| rows.iter().map(|r| r[col].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    let live = snapshot
        .workers
        .iter()
        .filter(|w| matches!(w.lease, LeaseView::Live(_)))
        .count();
    let sessions: u64 = snapshot.workers.iter().map(|w| w.sessions_owned).sum();
    let records: u64 = snapshot.session_records.values().sum();
    out.push_str(&format!(
        "\n{live} live workers, {sessions} sessions owned, {records} session records\n"
    ));
    if problems.is_empty() {
        out.push_str("no problems found\n");
    } else {
        let plural = if problems.len() == 1 { "" } else { "s" };
        out.push_str(&format!("{} problem{plural}:\n", problems.len()));
        for problem in problems {
            out.push_str(&format!("- {problem}\n"));
        }
    }
    out
}

fn to_json(snapshot: &FleetSnapshot, problems: &[Problem]) -> serde_json::Value {
    let now = snapshot.redis_now_unix_ms;
    let workers: Vec<serde_json::Value> = snapshot
        .workers
        .iter()
        .map(|worker| {
            let info = match &worker.lease {
                LeaseView::Live(info) => Some(info),
                _ => None,
            };
            serde_json::json!({
                "id": worker.id,
                "state": state_of(worker),
                "host": info.map(|i| &i.host),
                "pid": info.map(|i| i.pid),
                "started_unix_ms": info.map(|i| i.started_unix_ms),
                "version": info.map(|i| &i.version),
                "mesh_address": worker.addr,
                "admin_address": info.and_then(|i| i.admin.as_ref()),
                "last_renewal_unix_ms": worker.last_renewal_unix_ms,
                "last_renewal_ms_ago": worker.last_renewal_unix_ms.map(|at| now.saturating_sub(at)),
                "sessions": worker.sessions_owned,
                "cert_not_after_unix_ms": worker.cert_not_after_unix_ms,
                "drain_requested": worker.drain_requested,
                "request_channel_subscribers": worker.request_channel_subscribers,
                "redis_primary": worker.followed_primary,
            })
        })
        .collect();
    let problems: Vec<serde_json::Value> = problems
        .iter()
        .map(|problem| {
            let mut value = serde_json::to_value(problem).unwrap_or_default();
            if let Some(fields) = value.as_object_mut() {
                fields.insert("message".into(), problem.to_string().into());
            }
            value
        })
        .collect();
    serde_json::json!({
        "redis_time_unix_ms": now,
        "directory_created_unix_ms": snapshot.generation_created_unix_ms,
        "workers": workers,
        "session_records": snapshot.session_records,
        "problems": problems,
    })
}

/// The Redis deployment `mcpgw status` reached.
fn topology_json(topology: &Topology) -> serde_json::Value {
    match topology {
        Topology::Standalone => serde_json::json!({ "topology": "standalone" }),
        Topology::Sentinel {
            name,
            primary,
            replicas,
        } => serde_json::json!({
            "topology": "sentinel",
            "primary_name": name,
            "primary": primary,
            "replicas": replicas,
        }),
        Topology::Cluster { primary, replicas } => serde_json::json!({
            "topology": "cluster",
            "primary": primary,
            "replicas": replicas,
        }),
    }
}

/// `n thing` or `n things`.
fn count(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

fn list(ids: &[String]) -> String {
    ids.join(", ")
}

/// A duration in days, to a tenth under ten days.
fn days(ms: u64) -> String {
    let days = ms as f64 / DAY_MS as f64;
    if days < 10.0 {
        format!("{days:.1} days")
    } else {
        format!("{days:.0} days")
    }
}

fn date_of(unix_ms: u64) -> String {
    mcpgw_certs::inspect::rfc3339(signed_ms(unix_ms) / 1000)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn signed_ms(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mcpgw_mesh::directory::WorkerInfo;

    const NOW: u64 = 1_800_000_000_000;
    const LEASE: Duration = Duration::from_secs(10);

    fn policy() -> Policy {
        Policy {
            lease: LEASE,
            cert_warning: Duration::from_millis(7 * DAY_MS),
        }
    }

    fn live(id: &str, host: &str, pid: u32, addr: &str) -> WorkerSnapshot {
        WorkerSnapshot {
            id: id.into(),
            lease: LeaseView::Live(WorkerInfo {
                pid,
                host: host.into(),
                started_unix_ms: NOW - 60_000,
                version: "0.1.0".into(),
                admin: Some("127.0.0.1:9000".into()),
                mesh_identity: None,
                same_host: None,
            }),
            addr: Some(addr.into()),
            last_renewal_unix_ms: Some(NOW - 1_000),
            sessions_owned: 0,
            cert_not_after_unix_ms: Some(NOW + 90 * DAY_MS),
            drain_requested: false,
            followed_primary: None,
            request_channel_subscribers: None,
        }
    }

    fn dead(id: &str, sessions: u64) -> WorkerSnapshot {
        WorkerSnapshot {
            id: id.into(),
            lease: LeaseView::Absent,
            addr: None,
            last_renewal_unix_ms: Some(NOW - 30_000),
            sessions_owned: sessions,
            cert_not_after_unix_ms: None,
            drain_requested: false,
            followed_primary: None,
            request_channel_subscribers: None,
        }
    }

    /// A directory created an hour ago.
    fn fleet(workers: Vec<WorkerSnapshot>) -> FleetSnapshot {
        FleetSnapshot {
            redis_now_unix_ms: NOW,
            generation_created_unix_ms: Some(NOW - 3_600_000),
            workers,
            session_records: BTreeMap::new(),
            primary: None,
        }
    }

    fn healthy() -> FleetSnapshot {
        let mut snapshot = fleet(vec![
            live("a1", "host-a", 11, "10.0.0.1:7000"),
            live("a2", "host-a", 12, "10.0.0.1:7001"),
            live("b1", "host-b", 11, "10.0.0.2:7000"),
            live("b2", "host-b", 12, "10.0.0.2:7001"),
        ]);
        snapshot.workers[0].sessions_owned = 3;
        snapshot.session_records.insert("a1".into(), 3);
        snapshot
    }

    #[test]
    fn workers_that_renewed_through_another_primary_are_flagged_by_primary() {
        let mut snapshot = healthy();
        snapshot.primary = Some("10.0.9.2:6379".into());
        for (worker, primary) in snapshot.workers.iter_mut().zip([
            Some("10.0.9.2:6379"),
            Some("10.0.9.1:6379"),
            Some("10.0.9.1:6379"),
            None,
        ]) {
            worker.followed_primary = primary.map(str::to_owned);
        }
        let problems = find_problems(&snapshot, &policy());
        assert_eq!(
            problems,
            [Problem::PrimaryDisagreement {
                reached: "10.0.9.2:6379".into(),
                elsewhere: BTreeMap::from([(
                    "10.0.9.1:6379".into(),
                    vec!["a2".into(), "b1".into()]
                )]),
            }]
        );
        assert!(
            problems[0]
                .to_string()
                .contains("a2, b1 through 10.0.9.1:6379")
        );
        // A standalone Redis has no primary to disagree about.
        snapshot.primary = None;
        assert_eq!(find_problems(&snapshot, &policy()), []);
    }

    #[test]
    fn a_healthy_fleet_has_no_problem() {
        assert_eq!(find_problems(&healthy(), &policy()), []);
    }

    #[test]
    fn an_empty_directory_is_a_fleet_that_is_down() {
        assert_eq!(
            find_problems(&fleet(vec![]), &policy()),
            [Problem::NoLiveWorker]
        );
        // Only dead workers left.
        assert_eq!(
            find_problems(&fleet(vec![dead("gone", 0)]), &policy()),
            [Problem::NoLiveWorker]
        );
    }

    #[test]
    fn two_workers_at_one_mesh_address_are_one_identity_claimed_twice() {
        let mut snapshot = healthy();
        snapshot
            .workers
            .push(live("fake", "host-x", 99, "10.0.0.1:7000"));
        let problems = find_problems(&snapshot, &policy());
        assert_eq!(
            problems,
            [Problem::DuplicateMeshAddress {
                addr: "10.0.0.1:7000".into(),
                workers: vec!["a1".into(), "fake".into()],
            }]
        );
        let line = problems[0].to_string();
        assert!(
            line.contains("a1, fake") && line.contains("10.0.0.1:7000"),
            "{line}"
        );
    }

    #[test]
    fn one_process_under_two_ids_is_flagged_but_equal_pids_on_two_hosts_are_not() {
        let mut snapshot = healthy();
        snapshot
            .workers
            .push(live("a1-again", "host-a", 11, "10.0.0.1:7009"));
        assert_eq!(
            find_problems(&snapshot, &policy()),
            [Problem::DuplicateProcess {
                host: "host-a".into(),
                pid: 11,
                workers: vec!["a1".into(), "a1-again".into()],
            }]
        );
    }

    #[test]
    fn a_dead_workers_keys_do_not_count_as_a_duplicate() {
        let mut snapshot = healthy();
        let mut gone = dead("a1-old", 0);
        gone.addr = Some("10.0.0.1:7000".into());
        snapshot.workers.push(gone);
        assert_eq!(find_problems(&snapshot, &policy()), []);
    }

    #[test]
    fn sessions_of_an_expired_lease_are_flagged_once_the_directory_is_older_than_a_lease() {
        let mut snapshot = healthy();
        snapshot.workers.push(dead("gone", 4));
        snapshot.session_records.insert("gone".into(), 4);
        let problems = find_problems(&snapshot, &policy());
        assert_eq!(
            problems,
            [Problem::ExpiredLeaseOwnsSessions {
                worker: "gone".into(),
                sessions: 4,
                records: 4,
            }],
            "one line for one dead worker, not a second one for its records"
        );
        // Redis came back empty moments ago: owners are still registering again.
        snapshot.generation_created_unix_ms = Some(NOW - 2_000);
        assert_eq!(find_problems(&snapshot, &policy()), []);
        snapshot.generation_created_unix_ms = None;
        assert_eq!(find_problems(&snapshot, &policy()), []);
    }

    #[test]
    fn records_naming_a_worker_without_a_lease_are_orphaned() {
        let mut snapshot = healthy();
        snapshot.session_records.insert("ghost".into(), 2);
        let problems = find_problems(&snapshot, &policy());
        assert_eq!(
            problems,
            [Problem::OrphanedSessionRecords {
                worker: "ghost".into(),
                records: 2,
            }]
        );
        assert!(problems[0].to_string().contains("ghost"));
        // Records are written only under a lease, so even a young directory's orphans
        // without a session set are real.
        snapshot.generation_created_unix_ms = Some(NOW - 2_000);
        assert_eq!(find_problems(&snapshot, &policy()).len(), 1);
    }

    #[test]
    fn a_request_channel_needs_exactly_one_subscriber() {
        let mut snapshot = healthy();
        for worker in &mut snapshot.workers {
            worker.addr = Some(format!("mcpgw:pool_rpc:{}", worker.id));
            worker.request_channel_subscribers = Some(1);
        }
        assert_eq!(find_problems(&snapshot, &policy()), []);
        snapshot.workers[1].request_channel_subscribers = Some(2);
        snapshot.workers[2].request_channel_subscribers = Some(0);
        let problems = find_problems(&snapshot, &policy());
        assert_eq!(
            problems,
            [
                Problem::RequestChannelSubscribers {
                    worker: "a2".into(),
                    channel: "mcpgw:pool_rpc:a2".into(),
                    subscribers: 2,
                },
                Problem::RequestChannelSubscribers {
                    worker: "b1".into(),
                    channel: "mcpgw:pool_rpc:b1".into(),
                    subscribers: 0,
                },
            ]
        );
        assert!(problems[0].to_string().contains("run twice"));
        assert!(problems[1].to_string().contains("no subscriber"));
    }

    #[test]
    fn certificates_within_the_warning_or_expired_are_flagged() {
        let mut snapshot = healthy();
        snapshot.workers[1].cert_not_after_unix_ms = Some(NOW + 2 * DAY_MS);
        snapshot.workers[2].cert_not_after_unix_ms = Some(NOW - DAY_MS);
        snapshot.workers[3].cert_not_after_unix_ms = Some(NOW + 8 * DAY_MS);
        let problems = find_problems(&snapshot, &policy());
        assert_eq!(
            problems,
            [
                Problem::CertificateExpiring {
                    worker: "a2".into(),
                    host: "host-a".into(),
                    not_after_unix_ms: NOW + 2 * DAY_MS,
                    ms_left: 2 * DAY_MS as i64,
                },
                Problem::CertificateExpiring {
                    worker: "b1".into(),
                    host: "host-b".into(),
                    not_after_unix_ms: NOW - DAY_MS,
                    ms_left: -(DAY_MS as i64),
                },
            ]
        );
        assert!(problems[0].to_string().contains("expires in 2.0 days"));
        assert!(problems[1].to_string().contains("expired 1.0 days ago"));
    }

    #[test]
    fn workers_of_two_versions_are_one_problem_naming_both() {
        let mut snapshot = healthy();
        if let LeaseView::Live(info) = &mut snapshot.workers[3].lease {
            info.version = "0.2.0".into();
        }
        let problems = find_problems(&snapshot, &policy());
        let expected: BTreeMap<String, Vec<String>> = [
            (
                "0.1.0".to_owned(),
                vec!["a1".into(), "a2".into(), "b1".into()],
            ),
            ("0.2.0".to_owned(), vec!["b2".into()]),
        ]
        .into();
        assert_eq!(problems, [Problem::MixedVersions { versions: expected }]);
    }

    #[test]
    fn an_unreadable_lease_is_reported() {
        let mut snapshot = healthy();
        snapshot.workers[0].lease = LeaseView::Unreadable;
        snapshot.session_records.clear();
        assert_eq!(
            find_problems(&snapshot, &policy()),
            [Problem::UnreadableLease {
                worker: "a1".into()
            }]
        );
    }

    #[test]
    fn the_table_lists_every_worker_once_and_the_problems() {
        let mut snapshot = healthy();
        snapshot.session_records.insert("ghost".into(), 1);
        let problems = find_problems(&snapshot, &policy());
        let text = table(&snapshot, &problems);
        for id in ["a1", "a2", "b1", "b2"] {
            assert_eq!(
                text.lines()
                    .filter(|l| l.split_whitespace().next() == Some(id))
                    .count(),
                1,
                "{text}"
            );
        }
        assert!(text.contains("4 live workers, 3 sessions owned, 4 session records"));
        assert!(
            text.contains("1 problem:\n- orphaned session records"),
            "{text}"
        );
        let json = to_json(&snapshot, &problems);
        assert_eq!(json["workers"].as_array().map(Vec::len), Some(4));
        assert_eq!(json["problems"][0]["kind"], "orphaned_session_records");
        assert_eq!(json["problems"][0]["worker"], "ghost");
    }
}
