//! The fleet directory on a Redis Cluster endpoint (issue #24): three primaries with a
//! replica each, real `redis-server`s. Every directory key carries the prefix's hash
//! tag, so the whole directory lives in one slot on one primary; the workers follow
//! that slot's primary, and its failover is handled like a Sentinel failover: no
//! session lost, no call run twice, new sessions open again.

use std::time::{Duration, Instant};

use mcpgw_testkit::cluster::RedisCluster;
use mcpgw_testkit::eventually;
use mcpgw_testkit::fleet::{FLEET_CHANGE_WITHIN, LocalFleet, owner_of, run_mcpgw};
use mcpgw_testkit::gateway::RateLimited;
use mcpgw_testkit::http::{self, call_tool, initialize};
use mcpgw_tests::load::{Load, assert_truthful, every_session_progressed};
use serde_json::json;

/// Bound for every wait: generous, so that only a hang fails a test.
const WITHIN: Duration = FLEET_CHANGE_WITHIN;

/// A key of the directory's slot: the default prefix, hash-tagged.
const DIRECTORY_KEY: &str = "{mcpgw:}generation";

/// Two hosts of one worker each on a Redis Cluster.
fn cluster_fleet(extra: &[&str]) -> LocalFleet<RedisCluster> {
    LocalFleet::on(RedisCluster::start(), "tcp", (1, extra), (1, extra))
}

#[test]
fn a_fleet_on_a_redis_cluster_survives_the_failover_of_its_slots_primary() {
    let fleet = cluster_fleet(&["--lease-ms", "3000"]);
    let sessions: Vec<String> = (0..8).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let targets: Vec<(String, String)> = sessions
        .iter()
        .map(|s| (s.clone(), fleet.host_not_owning(s)))
        .collect();
    for (session, addr) in &targets {
        let r = call_tool(addr, "/mcp", session, 1, "session_read", json!({}));
        assert_eq!(r.status, 200, "forwarded via {addr}: {}", r.text());
    }
    let primary = fleet.redis.primary_of(DIRECTORY_KEY, &[]);
    let owners: Vec<String> = sessions
        .iter()
        .map(|s| primary.command(&["GET", &format!("{{mcpgw:}}pool_owner:{s}")]))
        .collect();
    assert!(
        owners.iter().zip(&sessions).all(|(o, s)| *o == owner_of(s)),
        "every record is on the slot's primary, under the hash-tagged prefix: {owners:?}"
    );
    let load = Load::start(&targets, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let dead = primary.port;
    primary.kill();
    let killed_at = Instant::now();
    // The slot's replica takes over.
    let promoted = eventually(WITHIN, || {
        let now = fleet.redis.primary_of(DIRECTORY_KEY, &[dead]);
        if now.port == dead {
            Err(format!("slot still served by {dead}"))
        } else {
            Ok(now.port)
        }
    });
    fleet.redis.wait_ok(&[dead]);
    println!(
        "replica {promoted} promoted {:?} after the kill",
        killed_at.elapsed()
    );
    let fresh = eventually(WITHIN, || {
        let r = http::try_initialize(&fleet.b.addr, "/mcp")?;
        match r.header("mcp-session-id") {
            Some(sid) if r.status == 200 => Ok(sid.to_owned()),
            _ => Err(r.outcome()),
        }
    });
    println!(
        "first new session {:?} after the kill of the slot's primary",
        killed_at.elapsed()
    );
    // Until every worker follows the promoted replica, a forward may find the
    // directory silent: a retryable 503 that never ran (the count proves it).
    let first = eventually(WITHIN, || {
        let r = http::try_call_tool(&fleet.a.addr, &fresh, 2, "counter_increment", json!({}))?;
        match r.status {
            200 => Ok(r),
            503 if r.header("retry-after").is_some() => Err(r.outcome()),
            _ => panic!("no session is lost to a failover: {}", r.outcome()),
        }
    });
    assert_eq!(
        first.expect_tool_text(),
        "1",
        "the new session has its own state"
    );
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let outcomes = load.finish();
    for o in &outcomes {
        match o.status {
            200 => {}
            503 => {
                assert!(
                    matches!(
                        o.detail.as_str(),
                        "directory_unavailable" | "ownership_unknown" | "lease_in_doubt"
                    ),
                    "a 503 during the failover says the state is unknown: {o:?}"
                );
                assert_eq!(o.retry_after.as_deref(), Some("1"), "{o:?}");
            }
            _ => panic!("no session is lost to a failover: {o:?}"),
        }
    }
    assert_truthful(&outcomes, &sessions, &fleet.upstream);
}

#[test]
fn mcpgw_status_names_the_clusters_primary_for_the_directory() {
    let fleet = cluster_fleet(&[]);
    let out = run_mcpgw(&["status", "--redis", &fleet.redis.url(), "--json"]);
    let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
    let primary = fleet.redis.primary_of(DIRECTORY_KEY, &[]);
    assert_eq!(status["redis"]["topology"], "cluster", "{status}");
    assert_eq!(
        status["redis"]["primary"],
        format!("127.0.0.1:{}", primary.port),
        "{status}"
    );
    assert_eq!(
        status["redis"]["replicas"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    assert_eq!(
        status["workers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    let text = run_mcpgw(&["status", "--redis", &fleet.redis.url()]);
    assert!(
        text.lines()
            .next()
            .is_some_and(|l| l.starts_with("redis: cluster: slot primary")),
        "{text}"
    );
}

/// The per-principal rate limit on a Cluster endpoint: every bucket carries the
/// prefix's hash tag, so all of them live on the directory slot's primary.
#[test]
fn the_rate_limiter_counts_on_the_clusters_slot_primary() {
    let redis = RedisCluster::start();
    let upstream = mcpgw_testkit::Upstream::start();
    let limited = RateLimited::start(&upstream.url, &redis.url(), 2);
    let initialize = || limited.post(None, &http::initialize_body(1));
    assert_eq!(initialize().status, 200);
    assert_eq!(initialize().status, 200);
    assert_eq!(initialize().outcome(), "429 rate_limited");
    let bucket = "{mcpgw:}ratelimit:api-key:alice";
    let primary = redis.primary_of(DIRECTORY_KEY, &[]);
    assert_eq!(primary.command(&["HGET", bucket, "requests"]), "3");
}
