//! The fleet directory on Redis Sentinel (issue #24): real `redis-server` primary and
//! replica, three real sentinels, two hosts of one worker each. Replication is
//! asynchronous, so a promoted replica may lack the last writes: these tests check
//! that a failover costs no session, runs no call twice, and that new sessions open
//! again once the replica is promoted.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mcpgw_testkit::admin::{admin_of, scrape};
use mcpgw_testkit::eventually;
use mcpgw_testkit::fleet::{
    FLEET_CHANGE_WITHIN, LocalFleet, PREFIX, owner_of, recorded_owner, run_mcpgw,
};
use mcpgw_testkit::gateway::RateLimited;
use mcpgw_testkit::http::{self, call_tool, initialize};
use mcpgw_testkit::redis::RedisTls;
use mcpgw_testkit::sentinel::{PRIMARY_NAME, SentinelSet, data_port};
use mcpgw_testkit::tls::TestCa;
use mcpgw_tests::load::{Load, assert_truthful, every_session_progressed};
use serde_json::json;

/// Bound for every wait: generous, so that only a hang fails a test.
const WITHIN: Duration = FLEET_CHANGE_WITHIN;

/// Two hosts of one worker each on a Sentinel-watched Redis.
fn sentinel_fleet(extra: &[&str]) -> LocalFleet<SentinelSet> {
    LocalFleet::on(SentinelSet::start(), "quic", (1, extra), (1, extra))
}

#[test]
fn a_sentinel_failover_loses_no_session_and_runs_no_call_twice() {
    let fleet = sentinel_fleet(&["--lease-ms", "3000"]);
    let sessions: Vec<String> = (0..8).map(|_| initialize(&fleet.a.addr, "/mcp")).collect();
    let targets: Vec<(String, String)> = sessions
        .iter()
        .map(|s| (s.clone(), fleet.host_not_owning(s)))
        .collect();
    // Warm-up: every session once through its non-owner, so each worker has the
    // other's mesh address before Redis fails over.
    for (session, addr) in &targets {
        let r = call_tool(addr, "/mcp", session, 1, "session_read", json!({}));
        assert_eq!(r.status, 200, "warm-up via {addr}: {}", r.text());
    }
    let owners: HashMap<String, String> =
        sessions.iter().map(|s| (s.clone(), owner_of(s))).collect();
    let load = Load::start(&targets, WITHIN);
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let old_primary = fleet.redis.primary.port;
    // Replication is asynchronous: the replica that will be promoted may lack the
    // last writes. Make it lack the most important ones for sure: every session's
    // owner record, deleted on the replica alone (writes to a replica are not
    // replicated anywhere) just before the primary dies.
    let replica = &fleet.redis.replica;
    assert_eq!(
        replica.command(&["CONFIG", "SET", "replica-read-only", "no"]),
        "OK"
    );
    for session in &sessions {
        replica.command(&["DEL", &format!("{PREFIX}pool_owner:{session}")]);
    }
    // A session claimed in the last moment before the kill, never called yet: the
    // promotion loses its whole claim (owner record, adoption record, quota count).
    let last = initialize(&fleet.b.addr, "/mcp");
    for key in [
        format!("{PREFIX}pool_owner:{last}"),
        format!("{PREFIX}session_state:{last}"),
    ] {
        replica.command(&["DEL", &key]);
    }
    replica.command(&[
        "SREM",
        &format!("{PREFIX}worker_sessions:{}", owner_of(&last)),
        &last,
    ]);
    fleet.redis.primary.kill();
    let killed_at = Instant::now();
    // The sentinels promote the replica.
    eventually(WITHIN, || match fleet.redis.primary_port() {
        Ok(port) if port == fleet.redis.replica.port => Ok(()),
        other => Err(format!("primary still {other:?} (was {old_primary})")),
    });
    println!("replica promoted {:?} after the kill", killed_at.elapsed());
    // A new session opens again on the promoted replica, through either host.
    let fresh = eventually(WITHIN, || {
        let r = http::try_initialize(&fleet.a.addr, "/mcp")?;
        match r.header("mcp-session-id") {
            Some(sid) if r.status == 200 => Ok(sid.to_owned()),
            _ => Err(r.outcome()),
        }
    });
    println!(
        "first new session {:?} after the kill of the primary",
        killed_at.elapsed()
    );
    assert_eq!(
        recorded_owner(&fleet.redis.replica, &fresh),
        Some(owner_of(&fresh)),
        "the new session is recorded on the promoted replica"
    );
    let first = call_tool(
        &fleet.b.addr,
        "/mcp",
        &fresh,
        2,
        "counter_increment",
        json!({}),
    );
    assert_eq!(
        first.expect_tool_text(),
        "1",
        "the new session has its own state"
    );
    // The session claimed last is served, or unknown while its owner re-asserts it;
    // never "not found", and it has its own state.
    let last_via = fleet.host_not_owning(&last);
    let first_of_last = eventually(WITHIN, || {
        let r = http::try_call_tool(&last_via, &last, 3, "counter_increment", json!({}))?;
        match r.status {
            200 => Ok(r),
            503 if r.header("retry-after").is_some() => Err(r.outcome()),
            _ => panic!(
                "the session claimed before the kill is never lost: {}",
                r.outcome()
            ),
        }
    });
    assert_eq!(first_of_last.expect_tool_text(), "1");
    // The owners re-asserted every session record on the new primary.
    let owners: HashMap<String, String> = owners
        .into_iter()
        .chain([(last.clone(), owner_of(&last))])
        .collect();
    eventually(WITHIN, || {
        let missing: Vec<&String> = sessions
            .iter()
            .chain([&last])
            .filter(|s| recorded_owner(&fleet.redis.replica, s).as_ref() != owners.get(*s))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("{missing:?}"))
        }
    });
    load.wait_until(every_session_progressed(&sessions, 3, Instant::now()));
    let outcomes = load.finish();
    for o in &outcomes {
        match o.status {
            200 => {}
            // Until the new primary answered and the owners re-asserted: unknown.
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
    // Every worker renews through the promoted replica, and status finds no worker
    // that follows another primary.
    let promoted = format!("127.0.0.1:{}", fleet.redis.replica.port);
    eventually(WITHIN, || {
        let out = run_mcpgw(&["status", "--redis", &fleet.redis.url(), "--json"]);
        let status: serde_json::Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
        let followed: Vec<&serde_json::Value> = status["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|w| w["state"] == "live")
            .map(|w| &w["redis_primary"])
            .collect();
        let disagreeing = status["problems"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["kind"] == "primary_disagreement");
        if followed.len() == 2 && followed.iter().all(|p| **p == promoted) && !disagreeing {
            Ok(())
        } else {
            Err(format!("{status}"))
        }
    });
    // Each worker saw the failover once and counted it.
    for id in owners.values().collect::<std::collections::BTreeSet<_>>() {
        let admin = admin_of(&fleet.redis.replica, id);
        let metrics = scrape(&admin);
        assert_eq!(
            metrics.get("mcpgw_directory_failovers_total").copied(),
            Some(1.0),
            "worker {id}"
        );
    }
}

#[test]
fn mcpgw_status_names_the_sentinel_primary_and_its_replica() {
    let fleet = sentinel_fleet(&[]);
    let out = run_mcpgw(&["status", "--redis", &fleet.redis.url(), "--json"]);
    let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
    let redis = &status["redis"];
    assert_eq!(redis["topology"], "sentinel", "{status}");
    assert_eq!(redis["primary_name"], PRIMARY_NAME, "{status}");
    assert_eq!(
        redis["primary"],
        format!("127.0.0.1:{}", fleet.redis.primary.port),
        "{status}"
    );
    assert_eq!(
        redis["replicas"],
        json!([format!("127.0.0.1:{}", fleet.redis.replica.port)]),
        "{status}"
    );
    assert_eq!(
        status["workers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    // Each worker says, with its renewals, which primary it follows.
    let primary = format!("127.0.0.1:{}", fleet.redis.primary.port);
    eventually(WITHIN, || {
        let out = run_mcpgw(&["status", "--redis", &fleet.redis.url(), "--json"]);
        let status: serde_json::Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
        let all_follow = status["workers"]
            .as_array()
            .is_some_and(|ws| ws.iter().all(|w| w["redis_primary"] == primary.as_str()));
        if all_follow {
            Ok(())
        } else {
            Err(format!("{status}"))
        }
    });
}

#[test]
fn a_tls_sentinel_deployment_carries_the_fleet_through_a_failover() {
    let ca = TestCa::new("sentinel-tls");
    let (cert, key) = ca.issue("redis");
    let tls = RedisTls {
        ca: ca.ca_file(),
        cert,
        key,
        auth_clients: false,
    };
    let lease: &[&str] = &["--lease-ms", "3000"];
    let fleet = LocalFleet::on(SentinelSet::start_tls(&tls), "tcp", (1, lease), (1, lease));
    let session = initialize(&fleet.a.addr, "/mcp");
    let via = fleet.host_not_owning(&session);
    let first = call_tool(&via, "/mcp", &session, 1, "counter_increment", json!({}));
    assert_eq!(first.expect_tool_text(), "1", "forwarded to its owner");
    // The sentinels name the data servers' TLS ports, and so does status.
    let out = run_mcpgw(&["status", "--redis", &fleet.redis.url(), "--json"]);
    let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
    let (primary, replica) = (
        data_port(&fleet.redis.primary),
        data_port(&fleet.redis.replica),
    );
    assert_eq!(status["redis"]["topology"], "sentinel", "{status}");
    assert_eq!(
        status["redis"]["primary"],
        format!("127.0.0.1:{primary}"),
        "{status}"
    );
    assert_eq!(
        status["redis"]["replicas"],
        json!([format!("127.0.0.1:{replica}")]),
        "{status}"
    );
    fleet.redis.primary.kill();
    eventually(WITHIN, || match fleet.redis.primary_port() {
        Ok(port) if port == replica => Ok(()),
        other => Err(format!("primary still {other:?} (was {primary})")),
    });
    let fresh = eventually(WITHIN, || {
        let r = http::try_initialize(&fleet.b.addr, "/mcp")?;
        match r.header("mcp-session-id") {
            Some(sid) if r.status == 200 => Ok(sid.to_owned()),
            _ => Err(r.outcome()),
        }
    });
    // Until every worker follows the new primary, a forward may find the directory
    // silent: a retryable 503 that never ran (the counts prove it), never a lost
    // session.
    let settled = |addr: &str, session: &str, id: u64| {
        eventually(WITHIN, || {
            let r = http::try_call_tool(addr, session, id, "counter_increment", json!({}))?;
            match r.status {
                200 => Ok(r),
                503 if r.header("retry-after").is_some() => Err(r.outcome()),
                _ => panic!("no session is lost to a failover: {}", r.outcome()),
            }
        })
    };
    assert_eq!(settled(&fleet.a.addr, &fresh, 2).expect_tool_text(), "1");
    // The old session goes on where it was.
    assert_eq!(settled(&via, &session, 3).expect_tool_text(), "2");
}

/// The per-principal rate limit kept behind Sentinel: the limiter follows the failover
/// to the promoted replica, and a bucket that replicated keeps its count there.
#[test]
fn the_rate_limiter_follows_a_sentinel_failover() {
    const BUCKET: &str = "mcpgw:ratelimit:api-key:alice";
    let redis = SentinelSet::start();
    let upstream = mcpgw_testkit::Upstream::start();
    let limited = RateLimited::start(&upstream.url, &redis.url(), 3);
    let call = |session: &str| {
        let body = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                          "params": {"name": "echo", "arguments": {"text": "hi"}}});
        limited.post(Some(session), body.to_string().as_bytes())
    };
    // A burst of three: initialize and two calls, then the bucket is empty.
    let opened = limited.post(None, &http::initialize_body(1));
    assert_eq!(opened.status, 200, "{}", opened.text());
    let session = opened.header("mcp-session-id").expect("session").to_owned();
    for _ in 0..2 {
        assert_eq!(call(&session).status, 200);
    }
    assert_eq!(call(&session).outcome(), "429 rate_limited");
    // The bucket replicated (four requests counted) before the primary dies.
    eventually(WITHIN, || {
        match redis.replica.command(&["HGET", BUCKET, "requests"]) {
            n if n == "4" => Ok(()),
            n => Err(format!("replica counts {n:?}")),
        }
    });
    let replica = data_port(&redis.replica);
    redis.primary.kill();
    eventually(WITHIN, || match redis.primary_port() {
        Ok(port) if port == replica => Ok(()),
        other => Err(format!("primary still {other:?}")),
    });
    // Refused while the limiter cannot count, then limited by the promoted replica's
    // bucket: never let through by a fresh one.
    eventually(WITHIN, || {
        let r = call(&session);
        match r.outcome().as_str() {
            "429 rate_limited" => Ok(()),
            "503 rate_limit_unavailable" => Err(r.outcome()),
            other => panic!("the limit holds across the failover: {other} {}", r.text()),
        }
    });
    let counted: u64 = redis
        .replica
        .command(&["HGET", BUCKET, "requests"])
        .parse()
        .expect("a count");
    assert!(counted >= 5, "the promoted replica counts on: {counted}");
}
