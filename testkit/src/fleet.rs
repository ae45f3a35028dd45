//! A local fleet: mesh certificates made by the real `mcpgw certs`, supervisors that
//! share one Redis, and what the directory says about their workers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::gateway::Gateway;
use crate::redis::RedisServer;
use crate::upstream::Upstream;

/// The default Redis key prefix of mcpgw.
pub const PREFIX: &str = "mcpgw:";

/// A mesh CA and leaves in a temporary directory, made with the real `mcpgw certs`.
pub struct MeshCerts {
    /// Removed on drop.
    dir: tempfile::TempDir,
}

impl MeshCerts {
    /// A CA plus leaves for each of `members`.
    #[track_caller]
    pub fn create(members: &[&str]) -> MeshCerts {
        let dir = tempfile::Builder::new()
            .prefix("mcpgw-test-certs-")
            .tempdir()
            .unwrap_or_else(|e| panic!("temp dir for certificates: {e}"));
        let dir_arg = dir.path().display().to_string();
        run_mcpgw(&["certs", "init", "--dir", &dir_arg]);
        for member in members {
            run_mcpgw(&["certs", "issue", "--dir", &dir_arg, "--name", member]);
        }
        MeshCerts { dir }
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// The `--mesh-*` flags for `member`.
    pub fn flags(&self, member: &str) -> Vec<String> {
        let path = |name: String| self.dir.path().join(name).display().to_string();
        vec![
            "--mesh-ca".into(),
            path("ca.crt".into()),
            "--mesh-cert".into(),
            path(format!("{member}.crt")),
            "--mesh-key".into(),
            path(format!("{member}.key")),
        ]
    }
}

/// Runs `mcpgw ARGS…` to completion; its standard output. Panics with its output when
/// it fails.
#[track_caller]
pub fn run_mcpgw(args: &[&str]) -> String {
    let output = Command::new(crate::bin("mcpgw"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run mcpgw {args:?}: {e}"));
    assert!(
        output.status.success(),
        "mcpgw {args:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Options of one supervisor in a test fleet.
pub struct SupervisorSpec<'a> {
    pub redis_url: &'a str,
    pub upstream_url: &'a str,
    pub workers: usize,
    /// "quic", "tcp" or "redis".
    pub transport: &'a str,
    pub certs: &'a MeshCerts,
    /// Certificate member name of this supervisor's host.
    pub member: &'a str,
    /// More flags; a `--mesh-listen` here replaces the default `127.0.0.1:0`.
    pub extra: &'a [&'a str],
}

/// The `mcpgw serve` flags of a fleet supervisor on this machine: `workers` workers,
/// the fleet's Redis, the mesh `transport` on free loopback ports, and `member`'s
/// certificates. Upstreams and anything else come on top.
pub fn supervisor_flags(
    redis_url: &str,
    workers: usize,
    transport: &str,
    certs: &MeshCerts,
    member: &str,
) -> Vec<String> {
    let mut args: Vec<String> = [
        "--workers",
        &workers.to_string(),
        "--redis",
        redis_url,
        "--mesh-transport",
        transport,
        "--mesh-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(certs.flags(member));
    args
}

/// Starts `mcpgw serve --workers N --redis …` and waits until every worker serves.
pub fn start_supervisor(spec: &SupervisorSpec<'_>) -> Gateway {
    let args = supervisor_args(spec);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Gateway::start(&refs)
}

/// Like [`start_supervisor`], with the supervisor's and its workers' log lines appended
/// to `log` (for a test that reads what a worker logged, such as its fencing).
pub fn start_supervisor_logged(spec: &SupervisorSpec<'_>, log: &Path) -> Gateway {
    let args = supervisor_args(spec);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Gateway::start_logged(&refs, log)
}

fn supervisor_args(spec: &SupervisorSpec<'_>) -> Vec<String> {
    let mut args = supervisor_flags(
        spec.redis_url,
        spec.workers,
        spec.transport,
        spec.certs,
        spec.member,
    );
    if spec.extra.contains(&"--mesh-listen")
        && let Some(default) = args.iter().position(|a| a == "--mesh-listen")
    {
        args.drain(default..default + 2);
    }
    args.extend(["--upstream".into(), format!("demo={}", spec.upstream_url)]);
    args.extend(spec.extra.iter().map(|s| s.to_string()));
    args
}

/// What a test fleet keeps its directory on: one Redis, a Sentinel set or a Cluster.
pub trait Directory {
    /// The `--redis` URL the workers are given.
    fn url(&self) -> String;
}

impl Directory for RedisServer {
    fn url(&self) -> String {
        RedisServer::url(self)
    }
}

impl Directory for crate::sentinel::SentinelSet {
    fn url(&self) -> String {
        crate::sentinel::SentinelSet::url(self)
    }
}

impl Directory for crate::cluster::RedisCluster {
    fn url(&self) -> String {
        crate::cluster::RedisCluster::url(self)
    }
}

/// A directory (one Redis unless said otherwise), the demo upstream, certificates and
/// two supervisors ("host-a", "host-b") of `workers` workers each.
pub struct LocalFleet<D: Directory = RedisServer> {
    // Field order is drop order: the supervisors go first, so no worker sees its
    // Redis or upstream vanish while it still runs.
    pub a: Gateway,
    pub b: Gateway,
    pub certs: MeshCerts,
    pub upstream: Upstream,
    pub redis: D,
}

impl LocalFleet {
    pub fn start(transport: &str, workers: usize, extra: &[&str]) -> LocalFleet {
        Self::start_hosts(transport, (workers, extra), (workers, extra))
    }

    /// Like [`start`](Self::start), with a worker count and flags of their own for
    /// host-a and host-b.
    pub fn start_hosts(
        transport: &str,
        hosts_a: (usize, &[&str]),
        hosts_b: (usize, &[&str]),
    ) -> LocalFleet {
        LocalFleet::on(RedisServer::start(), transport, hosts_a, hosts_b)
    }

    /// Like [`start`](Self::start), with host-a's and host-b's log lines in
    /// `logs/host-a.log` and `logs/host-b.log`.
    pub fn start_logged(
        transport: &str,
        workers: usize,
        extra: &[&str],
        logs: &Path,
    ) -> LocalFleet {
        let hosts = (workers, extra);
        LocalFleet::on_logged(RedisServer::start(), transport, hosts, hosts, Some(logs))
    }
}

impl<D: Directory> LocalFleet<D> {
    /// A fleet whose directory is `redis`, with a worker count and flags of their own
    /// for host-a and host-b.
    pub fn on(
        redis: D,
        transport: &str,
        hosts_a: (usize, &[&str]),
        hosts_b: (usize, &[&str]),
    ) -> LocalFleet<D> {
        Self::on_logged(redis, transport, hosts_a, hosts_b, None)
    }

    /// Like [`on`](Self::on); with `logs`, each supervisor's (and its workers') log
    /// lines go to `host-a.log` and `host-b.log` in that directory instead of the
    /// test's stderr.
    pub fn on_logged(
        redis: D,
        transport: &str,
        (workers_a, extra_a): (usize, &[&str]),
        (workers_b, extra_b): (usize, &[&str]),
        logs: Option<&Path>,
    ) -> LocalFleet<D> {
        let upstream = Upstream::start();
        let certs = MeshCerts::create(&["host-a", "host-b"]);
        let redis_url = redis.url();
        let spec = |member, workers, extra| SupervisorSpec {
            redis_url: &redis_url,
            upstream_url: &upstream.url,
            workers,
            transport,
            certs: &certs,
            member,
            extra,
        };
        let start = |spec: &SupervisorSpec<'_>| match logs {
            Some(dir) => start_supervisor_logged(spec, &dir.join(format!("{}.log", spec.member))),
            None => start_supervisor(spec),
        };
        let a = start(&spec("host-a", workers_a, extra_a));
        let b = start(&spec("host-b", workers_b, extra_b));
        LocalFleet {
            a,
            b,
            certs,
            upstream,
            redis,
        }
    }

    /// The address of the host that does not own `session`, in a fleet of one worker
    /// per host (a host's `/healthz` names the worker that answered it).
    #[track_caller]
    pub fn host_not_owning(&self, session: &str) -> String {
        let health = crate::http::request(&self.a.addr, "GET", "/healthz", &[], b"");
        let worker_of_a = health
            .header("mcpgw-edge-worker")
            .unwrap_or_else(|| panic!("host-a's /healthz names no worker: {}", health.text()));
        if owner_of(session) == worker_of_a {
            self.b.addr.clone()
        } else {
            self.a.addr.clone()
        }
    }
}

impl LocalFleet {
    /// Worker leases in the directory: id → lease.
    pub fn leases(&self) -> HashMap<String, WorkerLease> {
        leases(&self.redis)
    }

    /// Waits until a worker other than `dead` holds a lease at mesh address `addr` (a
    /// supervisor's replacement on a fixed port) and returns its id.
    #[track_caller]
    pub fn replacement_at(&self, dead: &str, addr: &str) -> String {
        crate::eventually(FLEET_CHANGE_WITHIN, || {
            self.leases()
                .into_iter()
                .find(|(id, lease)| id != dead && lease.addr == addr)
                .map(|(id, _)| id)
                .ok_or("no replacement at the same mesh address yet")
        })
    }

    /// The pid of worker `id`, from its lease.
    #[track_caller]
    pub fn pid_of(&self, id: &str) -> u32 {
        self.leases()
            .get(id)
            .map(|lease| lease.pid)
            .unwrap_or_else(|| panic!("worker {id} has no lease"))
    }

    /// The leased workers that are children of `supervisor`: id → pid.
    pub fn workers_of(&self, supervisor: &Gateway) -> HashMap<String, u32> {
        workers_of(&self.redis, supervisor.pid())
    }
}

/// What a worker's lease in the directory says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLease {
    pub pid: u32,
    /// Its mesh address (`host:port`; the request channel over the Redis transport).
    pub addr: String,
}

/// Worker leases in a directory with the default prefix: id → lease.
pub fn leases(redis: &RedisServer) -> HashMap<String, WorkerLease> {
    redis
        .keys(&format!("{PREFIX}worker:*"))
        .into_iter()
        .filter_map(|key| {
            let id = key.strip_prefix(&format!("{PREFIX}worker:"))?.to_owned();
            let lease: serde_json::Value = serde_json::from_str(&redis.get(&key)?).ok()?;
            let addr = redis.get(&format!("{PREFIX}worker_addr:{id}"))?;
            let pid = u32::try_from(lease["pid"].as_u64()?).ok()?;
            Some((id, WorkerLease { pid, addr }))
        })
        .collect()
}

/// The leased workers whose parent process is `supervisor`: id → pid.
pub fn workers_of(redis: &RedisServer, supervisor: u32) -> HashMap<String, u32> {
    leases(redis)
        .into_iter()
        .filter(|(_, lease)| crate::signal::parent_of(lease.pid) == Some(supervisor))
        .map(|(id, lease)| (id, lease.pid))
        .collect()
}

/// The worker a session id names as its owner (`<32 hex>.<worker id>`).
pub fn owner_of(session: &str) -> String {
    session
        .split_once('.')
        .map(|(_, owner)| owner.to_owned())
        .unwrap_or_default()
}

/// The directory's record of a session's owner.
pub fn recorded_owner(redis: &RedisServer, session: &str) -> Option<String> {
    redis.get(&format!("{PREFIX}pool_owner:{session}"))
}

/// Generous bound for fleet-level changes (a replacement worker registering, a lease
/// expiring, a drain finishing) on a slow, shared machine.
pub const FLEET_CHANGE_WITHIN: Duration = Duration::from_secs(60);
