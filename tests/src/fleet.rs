//! A local fleet for tests: mesh certificates made by `mcpgw certs`, and supervisors
//! that share one Redis.

use std::path::PathBuf;
use std::process::Command;

use crate::process::Gateway;

/// A mesh CA and leaves in a temporary directory, made with the real `mcpgw certs`.
pub struct MeshCerts {
    pub dir: PathBuf,
}

impl MeshCerts {
    /// A CA plus leaves for each of `members`.
    pub fn create(members: &[&str]) -> MeshCerts {
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-test-certs-{}-{}",
            std::process::id(),
            crate::free_port()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let dir_arg = dir.display().to_string();
        run_mcpgw(&["certs", "init", "--dir", &dir_arg]);
        for member in members {
            run_mcpgw(&["certs", "issue", "--dir", &dir_arg, "--name", member]);
        }
        MeshCerts { dir }
    }

    /// The `--mesh-*` flags for `member`.
    pub fn flags(&self, member: &str) -> Vec<String> {
        vec![
            "--mesh-ca".into(),
            self.dir.join("ca.crt").display().to_string(),
            "--mesh-cert".into(),
            self.dir.join(format!("{member}.crt")).display().to_string(),
            "--mesh-key".into(),
            self.dir.join(format!("{member}.key")).display().to_string(),
        ]
    }
}

impl Drop for MeshCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run_mcpgw(args: &[&str]) {
    let output = Command::new(crate::bin("mcpgw"))
        .args(args)
        .output()
        .expect("run mcpgw");
    assert!(
        output.status.success(),
        "mcpgw {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Options of one supervisor in a test fleet.
pub struct SupervisorSpec<'a> {
    pub redis_url: &'a str,
    pub upstream_url: &'a str,
    pub workers: usize,
    /// "quic" or "tcp".
    pub transport: &'a str,
    pub certs: &'a MeshCerts,
    /// Certificate member name of this supervisor's host.
    pub member: &'a str,
    /// More flags.
    pub extra: &'a [&'a str],
}

/// Starts `mcpgw serve --workers N --redis …` and waits until every worker serves.
pub fn start_supervisor(spec: &SupervisorSpec<'_>) -> Gateway {
    let workers = spec.workers.to_string();
    let upstream = format!("demo={}", spec.upstream_url);
    let mut args: Vec<String> = vec![
        "--workers".into(),
        workers,
        "--redis".into(),
        spec.redis_url.into(),
        "--upstream".into(),
        upstream,
        "--mesh-transport".into(),
        spec.transport.into(),
        "--mesh-listen".into(),
        "127.0.0.1:0".into(),
    ];
    args.extend(spec.certs.flags(spec.member));
    args.extend(spec.extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Gateway::start(&refs)
}

/// Redis, the demo upstream, certificates and two supervisors ("host-a", "host-b")
/// of `workers` workers each.
pub struct LocalFleet {
    pub redis: crate::RedisServer,
    pub upstream: crate::Upstream,
    pub certs: MeshCerts,
    pub a: Gateway,
    pub b: Gateway,
}

impl LocalFleet {
    pub fn start(transport: &str, workers: usize, extra: &[&str]) -> LocalFleet {
        let redis = crate::RedisServer::start();
        let upstream = crate::Upstream::start();
        let certs = MeshCerts::create(&["host-a", "host-b"]);
        let redis_url = redis.url();
        let spec = |member| SupervisorSpec {
            redis_url: &redis_url,
            upstream_url: &upstream.url,
            workers,
            transport,
            certs: &certs,
            member,
            extra,
        };
        let a = start_supervisor(&spec("host-a"));
        let b = start_supervisor(&spec("host-b"));
        LocalFleet {
            redis,
            upstream,
            certs,
            a,
            b,
        }
    }

    /// Worker leases in the directory: id → (pid, mesh address).
    pub fn leases(&self) -> std::collections::HashMap<String, (u64, String)> {
        leases(&self.redis)
    }

    /// The pid of worker `id`.
    pub fn pid_of(&self, id: &str) -> u64 {
        self.leases()
            .get(id)
            .map(|(pid, _)| *pid)
            .unwrap_or_else(|| panic!("worker {id} has no lease"))
    }
}

/// Sends a signal (TERM, KILL, STOP, CONT) to a process.
pub fn signal(pid: u64, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill -{name} {pid}");
}

/// Worker leases in a directory: id → (pid, mesh address).
pub fn leases(redis: &crate::RedisServer) -> std::collections::HashMap<String, (u64, String)> {
    redis
        .keys("mcpgw:worker:*")
        .into_iter()
        .filter_map(|key| {
            let id = key.strip_prefix("mcpgw:worker:")?.to_owned();
            let lease: serde_json::Value = serde_json::from_str(&redis.get(&key)?).ok()?;
            let addr = redis.get(&format!("mcpgw:worker_addr:{id}"))?;
            Some((id, (lease["pid"].as_u64()?, addr)))
        })
        .collect()
}
