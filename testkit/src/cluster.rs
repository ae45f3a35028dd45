//! A Redis Cluster on free loopback ports: three primaries, each with one replica
//! (real `redis-server`s with `--cluster-enabled yes`, joined by `redis-cli --cluster
//! create`, both from the Debian `redis-server` package), with a two-second node
//! timeout, so that killing a primary promotes its replica within seconds.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::redis::{Resp, texts};
use crate::{RedisServer, eventually};

/// How long creating the cluster, and a failover, may take.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How long a node waits before it calls a silent peer failed.
const NODE_TIMEOUT_MS: &str = "2000";

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes, makes them a cluster of three primaries with a replica each,
    /// and waits until every node says the cluster is ok.
    #[track_caller]
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    NODE_TIMEOUT_MS,
                    // A replica syncs at once, not after the default five seconds.
                    "--repl-diskless-sync-delay",
                    "0",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli (make deps installs it): {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_ok(&[]);
        // A replica that never synced refuses to take over (its data is too old).
        eventually(READY_WITHIN, || {
            for node in &cluster.nodes {
                let info = node.command(&["INFO", "replication"]);
                if info.contains("role:slave") && !info.contains("master_link_status:up") {
                    return Err(format!("replica {} not in sync: {info}", node.port));
                }
            }
            Ok(())
        });
        cluster
    }

    /// `redis+cluster://` naming the first three nodes as seeds.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self.nodes[..3]
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}/", seeds.join(","))
    }

    /// The node that serves `key`'s slot as primary now, asked of the live nodes
    /// (`dead`: ports not to ask).
    #[track_caller]
    pub fn primary_of(&self, key: &str, dead: &[u16]) -> &RedisServer {
        let asked = self
            .nodes
            .iter()
            .find(|n| !dead.contains(&n.port))
            .expect("a live node");
        let slot: i64 = asked
            .command(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .expect("CLUSTER KEYSLOT answers a number");
        let port = match asked.query(&["CLUSTER", "SLOTS"]) {
            Ok(Resp::Array(ranges)) => ranges.into_iter().find_map(|range| {
                let Resp::Array(parts) = range else {
                    return None;
                };
                let mut parts = parts.into_iter();
                let start: i64 = text(parts.next()?)?.parse().ok()?;
                let end: i64 = text(parts.next()?)?.parse().ok()?;
                let Resp::Array(primary) = parts.next()? else {
                    return None;
                };
                let port: u16 = texts(primary).get(1)?.parse().ok()?;
                (start..=end).contains(&slot).then_some(port)
            }),
            other => panic!("CLUSTER SLOTS: {other:?}"),
        }
        .unwrap_or_else(|| panic!("no primary serves slot {slot}"));
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("slot {slot} is served by unknown port {port}"))
    }

    /// Waits until every node but `dead` reports `cluster_state:ok`.
    #[track_caller]
    pub fn wait_ok(&self, dead: &[u16]) {
        eventually(READY_WITHIN, || {
            for node in self.nodes.iter().filter(|n| !dead.contains(&n.port)) {
                let info = node.command(&["CLUSTER", "INFO"]);
                if !info.contains("cluster_state:ok") {
                    return Err(format!("node {}: {info}", node.port));
                }
            }
            Ok(())
        });
    }
}

fn text(resp: Resp) -> Option<String> {
    match resp {
        Resp::Text(text) => Some(text),
        _ => None,
    }
}
