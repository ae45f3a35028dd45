//! A Redis Sentinel deployment on free loopback ports: a primary and one replica
//! (real `redis-server`s, [`RedisServer`]) watched by three real sentinels
//! (`redis-server --sentinel`, the program the Debian `redis-sentinel` package runs),
//! with a quorum of two and a one-second down-after time, so that killing the primary
//! promotes the replica within seconds.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::redis::{RedisTls, Resp, query, texts};
use crate::{RedisServer, eventually};

/// The name the sentinels monitor the primary under.
pub const PRIMARY_NAME: &str = "mcpgw-primary";
/// How long setting up replication and the sentinels' discovery may take.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How long a sentinel waits before it calls a silent primary down.
const DOWN_AFTER_MS: u64 = 1000;

pub struct SentinelSet {
    // Field order is drop order: sentinels first, so none fails over while the data
    // servers go.
    sentinels: Vec<std::process::Child>,
    /// Ports of the sentinels.
    pub sentinel_ports: Vec<u16>,
    /// The primary at start.
    pub primary: RedisServer,
    /// Its replica at start.
    pub replica: RedisServer,
    dir: PathBuf,
    /// TLS everywhere (data servers, replication, sentinels), beside plain ports the
    /// tests' own commands use.
    tls: Option<(RedisTls, Vec<u16>)>,
}

impl SentinelSet {
    /// Starts the primary, its replica and three sentinels, and waits until the
    /// replica is in sync and every sentinel knows the replica and the two other
    /// sentinels (without which no failover can be authorised).
    #[track_caller]
    pub fn start() -> SentinelSet {
        Self::start_serving(None)
    }

    /// Like [`start`](Self::start), with TLS for every connection the deployment
    /// makes or takes: the primary, its replica and the sentinels serve TLS on ports of
    /// their own, replication and the sentinels' links run over TLS, and the sentinels
    /// name the data servers' TLS ports ([`SentinelSet::url`] is `rediss+sentinel://`).
    #[track_caller]
    pub fn start_tls(tls: &RedisTls) -> SentinelSet {
        Self::start_serving(Some(tls))
    }

    #[track_caller]
    fn start_serving(tls: Option<&RedisTls>) -> SentinelSet {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let start = || match tls {
            Some(tls) => RedisServer::start_tls(tls),
            None => RedisServer::start(),
        };
        let primary = start();
        let replica = start();
        let reply = replica.command(&["REPLICAOF", "127.0.0.1", &data_port(&primary).to_string()]);
        assert_eq!(reply, "OK", "REPLICAOF");
        eventually(READY_WITHIN, || {
            let info = replica.command(&["INFO", "replication"]);
            if info.contains("master_link_status:up") {
                Ok(())
            } else {
                Err(info)
            }
        });
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-test-sentinel-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let mut sentinels = Vec::new();
        let mut sentinel_ports = Vec::new();
        let mut tls_ports = Vec::new();
        for i in 0..3 {
            let port = crate::free_port();
            let conf = dir.join(format!("sentinel-{i}.conf"));
            let mut text = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {PRIMARY_NAME} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {PRIMARY_NAME} {DOWN_AFTER_MS}\n\
                 sentinel failover-timeout {PRIMARY_NAME} 10000\n\
                 sentinel parallel-syncs {PRIMARY_NAME} 1\n",
                dir = dir.display(),
                primary = data_port(&primary),
            );
            if let Some(tls) = tls {
                let tls_port = crate::free_port();
                // The same directives as the servers' flags, one per line.
                for pair in tls.args(tls_port).chunks(2) {
                    text.push_str(&format!(
                        "{} {}\n",
                        pair[0].trim_start_matches("--"),
                        pair[1]
                    ));
                }
                tls_ports.push(tls_port);
            }
            std::fs::write(&conf, text)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", conf.display()));
            let mut command = Command::new("redis-server");
            command
                .arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let child = crate::process::spawn(command)
                .unwrap_or_else(|e| panic!("cannot run redis-server --sentinel: {e}"));
            sentinels.push(child);
            sentinel_ports.push(port);
        }
        let set = SentinelSet {
            sentinels,
            sentinel_ports,
            primary,
            replica,
            dir,
            tls: tls.map(|tls| (tls.clone(), tls_ports)),
        };
        for &port in &set.sentinel_ports {
            eventually(READY_WITHIN, || {
                let replicas = sentinel_command(port, &["SENTINEL", "replicas", PRIMARY_NAME])?;
                let peers = sentinel_command(port, &["SENTINEL", "sentinels", PRIMARY_NAME])?;
                let knows_replica = replicas.contains(&data_port(&set.replica).to_string());
                let peer_count = peers.lines().filter(|l| *l == "runid").count();
                if knows_replica && peer_count == 2 {
                    Ok(())
                } else {
                    Err(format!(
                        "sentinel {port}: replica known {knows_replica}, {peer_count} peers"
                    ))
                }
            });
        }
        set
    }

    /// `redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/<name>`, or with TLS
    /// `rediss+sentinel://` to the sentinels' TLS ports, trusting the test CA.
    pub fn url(&self) -> String {
        let hosts = |ports: &[u16]| {
            ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        match &self.tls {
            None => format!(
                "redis+sentinel://{}/{PRIMARY_NAME}",
                hosts(&self.sentinel_ports)
            ),
            Some((tls, ports)) => format!(
                "rediss+sentinel://{}/{PRIMARY_NAME}?{}",
                hosts(ports),
                tls.query(None)
            ),
        }
    }

    /// The port of the server the first sentinel that answers names as primary.
    pub fn primary_port(&self) -> Result<u16, String> {
        let mut last = String::from("no sentinel answered");
        for &port in &self.sentinel_ports {
            match sentinel_command(port, &["SENTINEL", "get-master-addr-by-name", PRIMARY_NAME]) {
                Ok(addr) => {
                    let mut parts = addr.lines();
                    let _host = parts.next();
                    if let Some(p) = parts.next().and_then(|p| p.parse().ok()) {
                        return Ok(p);
                    }
                    last = format!("sentinel {port}: unexpected answer {addr:?}");
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for child in &mut self.sentinels {
            crate::signal::kill_group(child.id());
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The port the deployment reaches a data server at: its TLS port when it has one.
pub fn data_port(server: &RedisServer) -> u16 {
    server.tls.as_ref().map_or(server.port, |tls| tls.port)
}

/// One command to a sentinel (or any Redis) on `port`; arrays come back as their
/// elements joined by newlines, nested arrays flattened; an error reply is `Err`.
pub fn sentinel_command(port: u16, args: &[&str]) -> Result<String, String> {
    fn flatten(resp: Resp, out: &mut Vec<String>) {
        match resp {
            Resp::Array(items) => items.into_iter().for_each(|i| flatten(i, out)),
            other => out.extend(texts(vec![other])),
        }
    }
    match query(port, args)? {
        Resp::Text(text) if text.starts_with('-') => Err(format!("{args:?}: {text}")),
        Resp::Text(text) => Ok(text),
        Resp::Nil => Ok(String::new()),
        array => {
            let mut out = Vec::new();
            flatten(array, &mut out);
            Ok(out.join("\n"))
        }
    }
}
