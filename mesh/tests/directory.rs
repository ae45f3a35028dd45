//! The directory against a real `redis-server` (Debian package `redis-server`), one
//! fresh server per test on a free port, with persistence off.
//!
//! Leases that must expire are set up with a long lease and shortened only once the
//! setup is done, and expiry is awaited by polling Redis: no step depends on the
//! machine being fast enough to finish within a short lease.

mod common;

use std::time::{Duration, Instant};

use common::{RedisServer, eventually_async, redis_conn};
use mcpgw_mesh::directory::{
    Claim, Directory, DirectoryConfig, DirectoryError, GoneHow, Lease, LeaseRenewal, Remembered,
    SessionQuota, WorkerInfo,
};

fn config(server: &RedisServer, lease: Duration) -> DirectoryConfig {
    DirectoryConfig {
        redis_url: server.url(),
        prefix: "t*st:".into(),
        lease,
        op_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

async fn directory(server: &RedisServer, lease: Duration) -> Directory {
    Directory::connect(config(server, lease)).await.unwrap()
}

fn info() -> WorkerInfo {
    WorkerInfo {
        pid: std::process::id(),
        host: "test-host".into(),
        started_unix_ms: 1,
        version: "0.1.0".into(),
        admin: None,
        mesh_identity: None,
        same_host: None,
    }
}

const LONG: Duration = Duration::from_secs(60);
/// What a lease is cut to when a test wants it to expire.
const SHORT: Duration = Duration::from_millis(300);
/// Bound of every wait: only a hang reaches it.
const WITHIN: Duration = Duration::from_secs(30);

/// Makes `lease` expire soon: renewed through a directory whose lease time is SHORT.
async fn expire_soon(server: &RedisServer, lease: &Lease) {
    let short = directory(server, SHORT).await;
    let renewal = short.renew_lease(lease).await.unwrap();
    assert!(
        matches!(renewal, LeaseRenewal::Renewed { .. }),
        "{renewal:?}"
    );
}

/// Waits until Redis no longer holds worker `id`'s lease.
async fn wait_until_expired(dir: &Directory, id: &str) {
    eventually_async(WITHIN, || async {
        match dir.worker(id).await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err(format!("{id}'s lease is still alive")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

#[tokio::test]
async fn a_second_registration_of_a_live_id_is_refused() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let lease = dir
        .register_worker("w1", &info(), "10.0.0.1:7000")
        .await
        .unwrap();
    assert_eq!(lease.id(), "w1");

    let err = dir
        .register_worker("w1", &info(), "10.0.0.2:7000")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, DirectoryError::WorkerIdTaken { id } if id == "w1"),
        "{err:?}"
    );
    assert!(err.to_string().contains("WORKER_ID"), "{err}");

    dir.register_worker("w2", &info(), "10.0.0.2:7000")
        .await
        .unwrap();
    assert_eq!(
        dir.worker_addr("w1").await.unwrap().as_deref(),
        Some("10.0.0.1:7000")
    );
    assert_eq!(dir.worker_addr("nobody").await.unwrap(), None);

    let workers = dir.workers().await.unwrap();
    let ids: Vec<&str> = workers.iter().map(|w| w.id.as_str()).collect();
    assert_eq!(ids, ["w1", "w2"]);
    assert_eq!(workers[0].info, info());
    assert_eq!(workers[0].lease_token, lease.token());
    assert_eq!(workers[0].addr.as_deref(), Some("10.0.0.1:7000"));

    assert!(dir.deregister(&lease).await.unwrap());
    assert_eq!(dir.worker_addr("w1").await.unwrap(), None);
    dir.register_worker("w1", &info(), "10.0.0.1:7000")
        .await
        .unwrap();
}

#[tokio::test]
async fn an_expired_lease_frees_the_id_and_renewal_keeps_it() {
    // Renewed every sixth of its time: a stall of most of the lease still passes.
    const KEPT: Duration = Duration::from_secs(3);
    let server = RedisServer::start();
    let long = directory(&server, LONG).await;
    let renewing = directory(&server, KEPT).await;

    let kept = renewing
        .register_worker("kept", &info(), "a:1")
        .await
        .unwrap();
    let registered = Instant::now();
    let dropped = long
        .register_worker("dropped", &info(), "a:2")
        .await
        .unwrap();
    expire_soon(&server, &dropped).await;
    // Renew "kept" until well past its own lease time: without the renewals it would
    // have expired by then.
    while registered.elapsed() < KEPT + KEPT / 3 {
        tokio::time::sleep(KEPT / 6).await;
        let renewal = renewing.renew_lease(&kept).await.unwrap();
        let LeaseRenewal::Renewed { valid_until } = renewal else {
            panic!("renewal failed: {renewal:?}");
        };
        assert!(valid_until > kept.valid_until());
    }
    // "dropped" was not renewed: its id is free, and its address is gone with it.
    wait_until_expired(&long, "dropped").await;
    assert_eq!(long.worker_addr("dropped").await.unwrap(), None);
    long.register_worker("dropped", &info(), "a:3")
        .await
        .unwrap();
    assert!(matches!(
        long.register_worker("kept", &info(), "a:4").await,
        Err(DirectoryError::WorkerIdTaken { .. })
    ));
}

#[tokio::test]
async fn renewal_after_another_process_took_the_id_is_lost() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let old = dir.register_worker("w", &info(), "a:1").await.unwrap();
    expire_soon(&server, &old).await;
    wait_until_expired(&dir, "w").await;
    let new = dir.register_worker("w", &info(), "a:2").await.unwrap();

    assert_eq!(dir.renew_lease(&old).await.unwrap(), LeaseRenewal::Lost);
    // The old holder cannot delete the new registration either.
    assert!(!dir.deregister(&old).await.unwrap());
    assert!(matches!(
        dir.renew_lease(&new).await.unwrap(),
        LeaseRenewal::Renewed { .. }
    ));
    assert_eq!(dir.worker_addr("w").await.unwrap().as_deref(), Some("a:2"));
}

#[tokio::test]
async fn claiming_a_session_is_first_come_and_needs_a_lease() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    dir.register_worker("a", &info(), "a:1").await.unwrap();
    dir.register_worker("b", &info(), "b:1").await.unwrap();

    assert_eq!(
        dir.claim_session("s1", "a", None).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        dir.claim_session("s1", "b", None).await.unwrap(),
        Claim::Taken
    );
    // The recorded owner claiming again is confirmed (a claim whose answer was lost
    // may have landed): it changes nothing.
    assert_eq!(
        dir.claim_session("s1", "a", None).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(dir.session_owner("s1").await.unwrap().as_deref(), Some("a"));
    assert_eq!(dir.session_owner("s2").await.unwrap(), None);
    assert_eq!(dir.worker_sessions("a").await.unwrap(), ["s1"]);
    assert!(dir.worker_sessions("b").await.unwrap().is_empty());

    let err = dir.claim_session("s3", "ghost", None).await.unwrap_err();
    assert!(
        matches!(err, DirectoryError::NotRegistered { .. }),
        "{err:?}"
    );
    assert_eq!(dir.session_owner("s3").await.unwrap(), None);

    assert!(matches!(
        dir.claim_session("bad id", "a", None).await,
        Err(DirectoryError::InvalidName { .. })
    ));
    assert_eq!(dir.session_owner("bad id").await.unwrap(), None);
}

#[tokio::test]
async fn release_deletes_only_its_own_ownership() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    dir.register_worker("a", &info(), "a:1").await.unwrap();
    assert_eq!(
        dir.claim_session("s1", "a", None).await.unwrap(),
        Claim::Claimed
    );

    assert!(!dir.release_session("s1", "b", None).await.unwrap());
    assert_eq!(dir.session_owner("s1").await.unwrap().as_deref(), Some("a"));

    assert!(dir.release_session("s1", "a", None).await.unwrap());
    assert_eq!(dir.session_owner("s1").await.unwrap(), None);
    assert!(dir.worker_sessions("a").await.unwrap().is_empty());
    assert!(!dir.release_session("s1", "a", None).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_worker_is_reclaimed_exactly_once() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let other = directory(&server, LONG).await;
    let dead = dir.register_worker("dead", &info(), "a:1").await.unwrap();
    other
        .register_worker("alive", &info(), "b:1")
        .await
        .unwrap();
    for sid in ["s1", "s2", "s3"] {
        assert_eq!(
            dir.claim_session(sid, "dead", None).await.unwrap(),
            Claim::Claimed
        );
    }
    assert_eq!(
        other.claim_session("s4", "alive", None).await.unwrap(),
        Claim::Claimed
    );
    // s3 changed hands behind the dead worker's back (its set still lists it): the
    // reclaim must leave it alone.
    let mut raw = redis_conn(&server).await;
    let _: () = redis::cmd("SET")
        .arg("t*st:pool_owner:s3")
        .arg("alive")
        .query_async(&mut raw)
        .await
        .unwrap();

    expire_soon(&server, &dead).await;
    wait_until_expired(&other, "dead").await;
    let racers: Vec<_> = (0..8)
        .map(|_| {
            let d = other.clone();
            tokio::spawn(async move { d.reclaim_worker("dead", None).await })
        })
        .collect();
    let mut winners = Vec::new();
    for r in racers {
        if let Some(freed) = r.await.unwrap().unwrap() {
            winners.push(freed);
        }
    }
    assert_eq!(winners, [vec!["s1".to_string(), "s2".to_string()]]);
    assert_eq!(other.session_owner("s1").await.unwrap(), None);
    assert_eq!(other.session_owner("s2").await.unwrap(), None);
    assert_eq!(
        other.session_owner("s3").await.unwrap().as_deref(),
        Some("alive")
    );
    assert_eq!(
        other.session_owner("s4").await.unwrap().as_deref(),
        Some("alive")
    );
    assert!(other.worker_sessions("dead").await.unwrap().is_empty());
    assert_eq!(other.reclaim_worker("dead", None).await.unwrap(), None);

    // A worker that dies without sessions is reclaimed once too, and an id that
    // registers again can be reclaimed again after it dies.
    let again = dir.register_worker("dead", &info(), "a:2").await.unwrap();
    expire_soon(&server, &again).await;
    wait_until_expired(&other, "dead").await;
    assert_eq!(
        other.reclaim_worker("dead", None).await.unwrap(),
        Some(vec![])
    );
    assert_eq!(other.reclaim_worker("dead", None).await.unwrap(), None);
}

#[tokio::test]
async fn reclaim_is_refused_while_the_lease_is_alive_unless_its_token_is_proven_stale() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    assert_eq!(
        dir.claim_session("s1", "w", None).await.unwrap(),
        Claim::Claimed
    );

    assert_eq!(dir.reclaim_worker("w", None).await.unwrap(), None);
    assert_eq!(
        dir.reclaim_worker("w", Some("not-the-token"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(dir.session_owner("s1").await.unwrap().as_deref(), Some("w"));
    assert!(matches!(
        dir.renew_lease(&lease).await.unwrap(),
        LeaseRenewal::Renewed { .. }
    ));

    // Proven stale (say, its address answered as another worker): reclaimed, and the
    // old holder learns at its next renewal that it lost its lease.
    assert_eq!(
        dir.reclaim_worker("w", Some(lease.token())).await.unwrap(),
        Some(vec!["s1".to_string()])
    );
    assert_eq!(dir.session_owner("s1").await.unwrap(), None);
    assert_eq!(dir.worker_addr("w").await.unwrap(), None);
    assert_eq!(dir.renew_lease(&lease).await.unwrap(), LeaseRenewal::Lost);
    assert!(matches!(
        dir.claim_session("s2", "w", None).await,
        Err(DirectoryError::NotRegistered { .. })
    ));
}

#[tokio::test]
async fn a_frozen_redis_gives_unavailable_within_the_deadline() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    let op_timeout = dir.config().op_timeout;

    let paused = server.pause();
    let checks: Vec<(&str, Result<(), DirectoryError>)> = vec![
        (
            "session_owner",
            timed(op_timeout, dir.session_owner("s1")).await.map(drop),
        ),
        (
            "claim_session",
            timed(op_timeout, dir.claim_session("s1", "w", None))
                .await
                .map(drop),
        ),
        (
            "renew_lease",
            timed(op_timeout, dir.renew_lease(&lease)).await.map(drop),
        ),
        ("workers", timed(op_timeout, dir.workers()).await.map(drop)),
        (
            "generation",
            timed(op_timeout, dir.generation()).await.map(drop),
        ),
        (
            "reclaim_worker",
            timed(op_timeout, dir.reclaim_worker("x", None))
                .await
                .map(drop),
        ),
    ];
    paused.resume();

    for (op, result) in checks {
        let err = result.expect_err(op);
        assert!(
            matches!(err, DirectoryError::Unavailable { .. }),
            "{op}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("did not answer within 500ms") && text.contains("retry"),
            "{text}"
        );
    }

    // Once Redis runs again the same directory answers again.
    eventually_async(WITHIN, || async {
        match dir.renew_lease(&lease).await {
            Ok(LeaseRenewal::Renewed { .. }) => Ok(()),
            other => Err(format!("no recovery yet: {other:?}")),
        }
    })
    .await;
}

/// Runs a directory call and checks it came back by the deadline, with slack that
/// only a hang exceeds (a slow machine must not fail it).
async fn timed<T>(
    op_timeout: Duration,
    call: impl std::future::Future<Output = Result<T, DirectoryError>>,
) -> Result<T, DirectoryError> {
    let start = Instant::now();
    let result = call.await;
    let elapsed = start.elapsed();
    assert!(
        elapsed >= op_timeout || result.is_ok(),
        "answered early: {elapsed:?}"
    );
    assert!(elapsed < op_timeout + WITHIN, "took {elapsed:?}");
    result
}

#[tokio::test]
async fn a_flushed_directory_is_noticed_and_rebuilt_by_the_owners() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let g1 = dir.generation().await.unwrap();
    assert_eq!(dir.generation().await.unwrap(), g1);
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    assert_eq!(lease.generation(), g1);
    for sid in ["s1", "s2"] {
        assert_eq!(
            dir.claim_session(sid, "w", None).await.unwrap(),
            Claim::Claimed
        );
    }

    let mut raw = redis_conn(&server).await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut raw).await.unwrap();

    assert_eq!(
        dir.renew_lease(&lease).await.unwrap(),
        LeaseRenewal::DirectoryLost
    );
    let g2 = dir.generation().await.unwrap();
    assert_ne!(g2, g1);

    // Another worker created s2 meanwhile (only possible if ids collide; it shows the
    // owner learns which sessions it must drop).
    dir.register_worker("x", &info(), "b:1").await.unwrap();
    assert_eq!(
        dir.claim_session("s2", "x", None).await.unwrap(),
        Claim::Claimed
    );

    let again = dir.register_worker("w", &info(), "a:1").await.unwrap();
    assert_eq!(again.generation(), g2);
    let sids = vec!["s1".to_string(), "s2".to_string()];
    assert_eq!(
        dir.reclaim_sessions_after_loss("w", &sids).await.unwrap(),
        ["s2"]
    );
    assert_eq!(dir.session_owner("s1").await.unwrap().as_deref(), Some("w"));
    assert_eq!(dir.session_owner("s2").await.unwrap().as_deref(), Some("x"));
    assert_eq!(dir.worker_sessions("w").await.unwrap(), ["s1"]);
}

#[tokio::test]
async fn the_directory_reconnects_after_redis_restarts_empty() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let g1 = dir.generation().await.unwrap();
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();

    server.restart_empty();

    let renewal = eventually_async(WITHIN, || async {
        match dir.renew_lease(&lease).await {
            Ok(r) => Ok(r),
            Err(e @ DirectoryError::Unavailable { .. }) => Err(format!("no reconnect yet: {e}")),
            Err(e) => panic!("{e:?}"),
        }
    })
    .await;
    assert_eq!(renewal, LeaseRenewal::DirectoryLost);
    assert_ne!(dir.generation().await.unwrap(), g1);
}

#[tokio::test]
async fn connecting_to_nothing_fails_clearly_without_leaking_the_password() {
    let refusing = mcpgw_testkit::refusing_port();
    let port = refusing.port;
    let cfg = DirectoryConfig {
        redis_url: format!("redis://user:hunter2@127.0.0.1:{port}"),
        connect_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let start = Instant::now();
    // The bound only catches a hang; the connect timeout is what ends the attempt.
    let err = tokio::time::timeout(WITHIN, Directory::connect(cfg))
        .await
        .expect("gave up, not hung")
        .unwrap_err();
    println!("gave up after {:?}", start.elapsed());
    assert!(matches!(err, DirectoryError::Connect { .. }), "{err:?}");
    let text = err.to_string();
    assert!(!text.contains("hunter2"), "{text}");
    assert!(
        text.contains(&format!("redis://***@127.0.0.1:{port}")),
        "{text}"
    );

    let err = Directory::connect(DirectoryConfig {
        redis_url: "hunter2".into(),
        ..Default::default()
    })
    .await
    .unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

#[tokio::test]
async fn a_wrong_password_is_rejected_without_echoing_it() {
    let server = RedisServer::start();
    let mut raw = redis_conn(&server).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("right-one")
        .query_async(&mut raw)
        .await
        .unwrap();
    let cfg = DirectoryConfig {
        redis_url: format!("redis://:wrong-one@127.0.0.1:{}", server.port),
        connect_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let err = Directory::connect(cfg.clone()).await.unwrap_err();
    assert!(!err.to_string().contains("wrong-one"), "{err}");

    let ok = DirectoryConfig {
        redis_url: format!("redis://:right-one@127.0.0.1:{}", server.port),
        ..cfg
    };
    let dir = Directory::connect(ok).await.unwrap();
    dir.generation().await.unwrap();
}

/// What a lease running out in Redis does, without waiting for it: claiming many
/// sessions takes longer than a short lease on a busy machine.
async fn expire_lease(server: &RedisServer, id: &str) {
    let mut raw = redis_conn(server).await;
    let _: i64 = redis::cmd("DEL")
        .arg(format!("t*st:worker:{id}"))
        .arg(format!("t*st:worker_addr:{id}"))
        .query_async(&mut raw)
        .await
        .unwrap();
}

async fn key_count(server: &RedisServer) -> i64 {
    let mut raw = redis_conn(server).await;
    redis::cmd("DBSIZE").query_async(&mut raw).await.unwrap()
}

#[tokio::test]
async fn reclaiming_an_id_that_never_held_a_lease_runs_no_write_command() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    dir.register_worker("w", &info(), "a:1").await.unwrap();
    let log = server.record_commands();
    for n in 0..50 {
        let forged = format!("made-up-{n:02}");
        assert_eq!(dir.reclaim_worker(&forged, None).await.unwrap(), None);
    }
    let ran = log.commands();
    // Every reclaim reached Redis: the log saw what each one cost.
    for n in 0..50 {
        let forged = format!("made-up-{n:02}");
        assert!(
            ran.iter().any(|c| c.mentions(&forged)),
            "no command for {forged} among {ran:#?}"
        );
    }
    // Nothing else uses this Redis: every write in the log was a forged reclaim's.
    let writes: Vec<_> = ran.iter().flat_map(|c| c.writes()).collect();
    assert!(
        writes.is_empty(),
        "{} write commands for forged ids, e.g. {:#?}",
        writes.len(),
        &writes[..writes.len().min(3)]
    );
}

#[tokio::test]
async fn a_large_dead_worker_is_reclaimed_in_batches_and_leaves_no_key() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let other = directory(&server, LONG).await;
    dir.register_worker("big", &info(), "a:1").await.unwrap();
    other
        .register_worker("alive", &info(), "b:1")
        .await
        .unwrap();
    let baseline = key_count(&server).await;
    // More than two batches of the script's 500.
    let sids: Vec<String> = (0..1_234).map(|n| format!("s{n}")).collect();
    for sid in &sids {
        assert_eq!(
            dir.claim_session(sid, "big", None).await.unwrap(),
            Claim::Claimed
        );
    }
    expire_lease(&server, "big").await;
    let freed = other.reclaim_worker("big", None).await.unwrap().unwrap();
    assert_eq!(freed.len(), sids.len());
    assert_eq!(other.session_owner("s999").await.unwrap(), None);
    // Only the live worker's lease and address, the registry and the generation stay.
    let mut raw = redis_conn(&server).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*big*")
        .query_async(&mut raw)
        .await
        .unwrap();
    // Only the short-lived record of when it was reclaimed, and it expires.
    assert_eq!(
        keys,
        ["t*st:worker_gone:big"],
        "keys of the dead worker remain"
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg("t*st:worker_gone:big")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 0, "the reclaim record expires: {ttl}");
    let gone = other.gone_record("big").await.unwrap().expect("a record");
    assert_eq!(gone.how, GoneHow::Reclaimed);
    assert_eq!(other.gone_record("alive").await.unwrap(), None);
    assert!(key_count(&server).await <= baseline + 1);
    // Reclaimed: its registration can never be resumed (fencing).
    assert_eq!(other.reclaim_worker("big", None).await.unwrap(), None);
}

#[tokio::test]
async fn a_reclaim_interrupted_after_the_first_batch_is_finished_by_the_next_caller() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    dir.register_worker("big", &info(), "a:1").await.unwrap();
    for n in 0..700 {
        dir.claim_session(&format!("s{n}"), "big", None)
            .await
            .unwrap();
    }
    expire_lease(&server, "big").await;
    // The first reclaimer's own batches: simulate one that died after proving the
    // death, by removing the worker from the registry by hand.
    let mut raw = redis_conn(&server).await;
    let _: i64 = redis::cmd("ZREM")
        .arg("t*st:workers")
        .arg("big")
        .query_async(&mut raw)
        .await
        .unwrap();
    // A later caller (the sweeper) is not the winner, but it frees what is left.
    assert_eq!(dir.reclaim_worker("big", None).await.unwrap(), None);
    assert!(dir.worker_sessions("big").await.unwrap().is_empty());
    assert_eq!(dir.session_owner("s5").await.unwrap(), None);
}

#[tokio::test]
async fn the_session_quota_counts_fleet_wide_and_frees_with_release() {
    let server = RedisServer::start();
    let a = directory(&server, LONG).await;
    let b = directory(&server, LONG).await;
    a.register_worker("a", &info(), "a:1").await.unwrap();
    b.register_worker("b", &info(), "b:1").await.unwrap();
    let quota = |key| {
        Some(SessionQuota {
            key,
            limit: 2,
            ttl: Duration::from_secs(60),
        })
    };
    assert_eq!(
        a.claim_session("s1", "a", quota("alice")).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        b.claim_session("s2", "b", quota("alice")).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        a.claim_session("s3", "a", quota("alice")).await.unwrap(),
        Claim::OverQuota
    );
    assert_eq!(
        a.session_owner("s3").await.unwrap(),
        None,
        "nothing recorded"
    );
    // Another principal is unaffected.
    assert_eq!(
        a.claim_session("s4", "a", quota("bob")).await.unwrap(),
        Claim::Claimed
    );
    // Releasing one frees a slot.
    assert!(b.release_session("s2", "b", Some("alice")).await.unwrap());
    assert_eq!(
        a.claim_session("s3", "a", quota("alice")).await.unwrap(),
        Claim::Claimed
    );
    // A session whose record vanished (reclaimed with its dead owner) stops counting.
    let mut raw = redis_conn(&server).await;
    let _: i64 = redis::cmd("DEL")
        .arg("t*st:pool_owner:s1")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        a.claim_session("s5", "a", quota("alice")).await.unwrap(),
        Claim::Claimed
    );
    // The principal's name is never part of a key.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*alice*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[tokio::test]
async fn lease_state_tells_a_young_directory_from_a_stable_one() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    let state = dir.lease_state("w").await.unwrap();
    assert!(state.alive);
    assert_eq!(state.generation, lease.generation());
    assert!(state.generation_age < Duration::from_secs(30), "{state:?}");
    let gone = dir.lease_state("nobody").await.unwrap();
    assert!(!gone.alive);
    // Redis loses everything: no generation until someone registers again.
    let mut raw = redis_conn(&server).await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut raw).await.unwrap();
    let empty = dir.lease_state("w").await.unwrap();
    assert!(!empty.alive);
    assert_eq!(empty.generation, "");
}

#[tokio::test]
async fn one_sweeper_at_a_time_and_candidates_include_silent_set_holders() {
    let server = RedisServer::start();
    let dir = directory(&server, SHORT).await;
    let period = Duration::from_secs(30);
    assert!(dir.take_sweeper_turn("w1", period).await.unwrap());
    assert!(!dir.take_sweeper_turn("w2", period).await.unwrap());
    dir.register_worker("dead", &info(), "a:1").await.unwrap();
    dir.claim_session("s1", "dead", None).await.unwrap();
    let candidates = dir
        .reclaim_candidates(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(candidates, ["dead"]);
}

async fn raw_get(server: &RedisServer, key: &str) -> Option<String> {
    let mut raw = redis_conn(server).await;
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut raw)
        .await
        .unwrap()
}

async fn raw_pttl(server: &RedisServer, key: &str) -> i64 {
    let mut raw = redis_conn(server).await;
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut raw)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_fleet_snapshot_shows_every_worker_with_what_its_keys_say() {
    use mcpgw_mesh::directory::LeaseView;
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let not_after = std::time::UNIX_EPOCH + Duration::from_millis(4_000_000_000_000);
    dir.register_worker_with_cert("w1", &info(), "a:1", Some(not_after))
        .await
        .unwrap();
    dir.register_worker("w2", &info(), "b:1").await.unwrap();
    // A worker of the Redis transport: its address is its request channel.
    dir.register_worker("r1", &info(), "t*st:pool_rpc:r1")
        .await
        .unwrap();
    dir.register_worker("dead", &info(), "c:1").await.unwrap();
    for (sid, owner) in [("s1", "w1"), ("s2", "w1"), ("s3", "w2"), ("s4", "dead")] {
        assert_eq!(
            dir.claim_session(sid, owner, None).await.unwrap(),
            Claim::Claimed
        );
    }
    expire_lease(&server, "dead").await;
    let mut raw = redis_conn(&server).await;
    let _: () = redis::cmd("SET")
        .arg("t*st:pool_owner:s5")
        .arg("ghost")
        .query_async(&mut raw)
        .await
        .unwrap();
    // One listener on r1's channel.
    let mut listener = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    listener.subscribe("t*st:pool_rpc:r1").await.unwrap();

    let snapshot = dir.fleet_snapshot().await.unwrap();
    let ids: Vec<&str> = snapshot.workers.iter().map(|w| w.id.as_str()).collect();
    assert_eq!(ids, ["dead", "r1", "w1", "w2"], "each id once, sorted");
    let worker = |id: &str| {
        snapshot
            .workers
            .iter()
            .find(|w| w.id == id)
            .cloned()
            .unwrap()
    };
    let w1 = worker("w1");
    assert_eq!(w1.lease, LeaseView::Live(info()));
    assert_eq!(w1.addr.as_deref(), Some("a:1"));
    assert_eq!(w1.sessions_owned, 2);
    assert_eq!(w1.cert_not_after_unix_ms, Some(4_000_000_000_000));
    assert!(!w1.drain_requested);
    assert_eq!(w1.request_channel_subscribers, None, "not a channel");
    let renewed = w1.last_renewal_unix_ms.unwrap();
    assert!(renewed <= snapshot.redis_now_unix_ms);
    assert_eq!(worker("w2").cert_not_after_unix_ms, None);
    assert_eq!(worker("r1").request_channel_subscribers, Some(1));
    let dead = worker("dead");
    assert_eq!(dead.lease, LeaseView::Absent);
    assert_eq!(dead.sessions_owned, 1);
    assert!(dead.last_renewal_unix_ms.is_some(), "not reclaimed yet");
    let records: Vec<(&str, u64)> = snapshot
        .session_records
        .iter()
        .map(|(owner, n)| (owner.as_str(), *n))
        .collect();
    assert_eq!(records, [("dead", 1), ("ghost", 1), ("w1", 2), ("w2", 1)]);
    let created = snapshot.generation_created_unix_ms.unwrap();
    assert!(created <= snapshot.redis_now_unix_ms);
}

#[tokio::test]
async fn a_drain_request_reaches_the_worker_at_its_next_renewal_and_ends_with_it() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    assert!(matches!(
        dir.renew_lease(&lease).await.unwrap(),
        LeaseRenewal::Renewed { .. }
    ));
    assert!(dir.request_drain("w").await.unwrap());
    let ttl = raw_pttl(&server, "t*st:drain:w").await;
    assert!(
        ttl > LONG.as_millis() as i64 && ttl <= 3 * LONG.as_millis() as i64,
        "the request lives two to three leases: {ttl} ms"
    );
    // Every renewal reports it until the worker is gone, so a lost answer costs nothing.
    for _ in 0..2 {
        assert!(matches!(
            dir.renew_lease(&lease).await.unwrap(),
            LeaseRenewal::DrainRequested { .. }
        ));
    }
    let snapshot = dir.fleet_snapshot().await.unwrap();
    assert!(snapshot.workers[0].drain_requested);
    assert!(dir.deregister(&lease).await.unwrap());
    assert_eq!(raw_get(&server, "t*st:drain:w").await, None);

    // No lease, no request: no write command runs for an id nobody holds.
    let log = server.record_commands();
    assert!(!dir.request_drain("nobody").await.unwrap());
    let ran = log.commands();
    assert!(ran.iter().any(|c| c.mentions("nobody")), "{ran:#?}");
    let writes: Vec<_> = ran.iter().flat_map(|c| c.writes()).collect();
    assert!(
        writes.is_empty(),
        "a drain request for nobody wrote: {writes:#?}"
    );
    drop(log);

    // A request left for an earlier holder of an id is not the next holder's.
    let mut raw = redis_conn(&server).await;
    let _: () = redis::cmd("SET")
        .arg("t*st:drain:w")
        .arg("1")
        .query_async(&mut raw)
        .await
        .unwrap();
    let again = dir.register_worker("w", &info(), "a:2").await.unwrap();
    assert!(matches!(
        dir.renew_lease(&again).await.unwrap(),
        LeaseRenewal::Renewed { .. }
    ));
}

#[tokio::test]
async fn renewals_publish_the_current_certificate_expiry() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let first = std::time::UNIX_EPOCH + Duration::from_millis(2_000_000_000_000);
    let mut lease = dir
        .register_worker_with_cert("w", &info(), "a:1", Some(first))
        .await
        .unwrap();
    assert_eq!(lease.cert_not_after(), Some(first));
    assert_eq!(
        raw_get(&server, "t*st:worker_cert:w").await.as_deref(),
        Some("2000000000000")
    );
    let ttl = raw_pttl(&server, "t*st:worker_cert:w").await;
    assert!(
        ttl > 0 && ttl <= LONG.as_millis() as i64,
        "lives one lease: {ttl}"
    );
    // A reloaded certificate shows from the next renewal on.
    let reloaded = std::time::UNIX_EPOCH + Duration::from_millis(2_100_000_000_000);
    lease.set_cert_not_after(Some(reloaded));
    dir.renew_lease(&lease).await.unwrap();
    assert_eq!(
        raw_get(&server, "t*st:worker_cert:w").await.as_deref(),
        Some("2100000000000")
    );
    assert!(dir.deregister(&lease).await.unwrap());
    assert_eq!(raw_get(&server, "t*st:worker_cert:w").await, None);
}

/// Adoption (docs/architecture.md, "Adoption"): a session its owner left, by death or
/// drain, is taken by exactly one of many racing workers; what cannot continue, or is
/// not the asker's, is never taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_left_session_is_adopted_by_exactly_one_worker_and_only_by_its_guard() {
    use mcpgw_mesh::directory::{AdoptCause, Adoption, SessionKind, SessionState};
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let dead = dir.register_worker("dead", &info(), "a:1").await.unwrap();
    let adopters: Vec<String> = (0..8).map(|i| format!("adopter-{i}")).collect();
    for id in &adopters {
        dir.register_worker(id, &info(), "b:1").await.unwrap();
    }
    let state = |kind| SessionState {
        kind,
        guard: "g1",
        payload: r#"{"route":"r|with|bars"}"#,
    };
    for (sid, kind) in [("http", SessionKind::Http), ("stdio", SessionKind::Stdio)] {
        assert_eq!(
            dir.claim_session_with_state(sid, "dead", None, Some(state(kind)))
                .await
                .unwrap(),
            Claim::Claimed
        );
    }
    // While its owner lives, nobody takes it.
    assert_eq!(
        dir.adopt_session("http", "adopter-0", "g1").await.unwrap(),
        Adoption::OwnedBy("dead".into())
    );
    expire_soon(&server, &dead).await;
    wait_until_expired(&dir, "dead").await;
    assert!(dir.reclaim_worker("dead", None).await.unwrap().is_some());
    let mut raw = redis_conn(&server).await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg("t*st:session_state:http")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 0, "a left record waits a bounded time: PTTL {ttl}");
    // Another principal or route (another guard) learns nothing.
    assert_eq!(
        dir.adopt_session("http", "adopter-0", "g2").await.unwrap(),
        Adoption::NoRecord
    );
    let racers: Vec<_> = adopters
        .iter()
        .map(|id| {
            let (d, id) = (dir.clone(), id.clone());
            tokio::spawn(async move { (id.clone(), d.adopt_session("http", &id, "g1").await) })
        })
        .collect();
    let mut winners = Vec::new();
    let mut told = Vec::new();
    for racer in racers {
        let (id, outcome) = racer.await.unwrap();
        match outcome.unwrap() {
            Adoption::Adopted { payload, cause } => {
                assert_eq!(payload, r#"{"route":"r|with|bars"}"#);
                assert_eq!(cause, AdoptCause::Death);
                winners.push(id);
            }
            Adoption::OwnedBy(owner) => told.push(owner),
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one adopter: {winners:?}");
    assert!(told.iter().all(|owner| owner == &winners[0]), "{told:?}");
    assert_eq!(
        dir.session_owner("http").await.unwrap().as_deref(),
        Some(winners[0].as_str())
    );
    assert!(dir.worker_sessions(&winners[0]).await.unwrap() == ["http"]);
    let ttl: i64 = redis::cmd("PTTL")
        .arg("t*st:session_state:http")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        ttl, -1,
        "an adopted session's record lives as long as it does"
    );
    assert!(matches!(
        dir.adopt_session("http", &winners[0], "g1").await.unwrap(),
        Adoption::AlreadyOwned { .. }
    ));
    // A stdio session cannot continue: the first asker is told (once), then nothing.
    assert_eq!(
        dir.adopt_session("stdio", "adopter-0", "g1").await.unwrap(),
        Adoption::CannotContinue
    );
    assert_eq!(
        dir.adopt_session("stdio", "adopter-1", "g1").await.unwrap(),
        Adoption::NoRecord
    );
    // An adopter without a lease adopts nothing.
    let taken = dir
        .release_session("http", &winners[0], None)
        .await
        .unwrap();
    assert!(taken, "released by its new owner");
    assert_eq!(
        dir.adopt_session("http", "adopter-1", "g1").await.unwrap(),
        Adoption::NoRecord,
        "an ended session's record goes with it"
    );
}

#[tokio::test]
async fn a_draining_owner_hands_over_only_its_own_http_sessions() {
    use mcpgw_mesh::directory::{AdoptCause, Adoption, SessionKind, SessionState};
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    for id in ["drainer", "other"] {
        dir.register_worker(id, &info(), "a:1").await.unwrap();
    }
    let state = |kind| SessionState {
        kind,
        guard: "g",
        payload: "{}",
    };
    for (sid, kind) in [("h", SessionKind::Http), ("s", SessionKind::Stdio)] {
        dir.claim_session_with_state(sid, "drainer", None, Some(state(kind)))
            .await
            .unwrap();
    }
    dir.claim_session("plain", "drainer", None).await.unwrap();
    assert!(!dir.hand_over_session("h", "other").await.unwrap());
    assert!(!dir.hand_over_session("s", "drainer").await.unwrap());
    assert!(!dir.hand_over_session("plain", "drainer").await.unwrap());
    assert!(dir.hand_over_session("h", "drainer").await.unwrap());
    assert_eq!(dir.session_owner("h").await.unwrap(), None);
    assert_eq!(
        dir.worker_sessions("drainer").await.unwrap(),
        ["plain", "s"]
    );
    assert_eq!(
        dir.adopt_session("h", "other", "g").await.unwrap(),
        Adoption::Adopted {
            payload: "{}".into(),
            cause: AdoptCause::Drain
        }
    );
}

/// A TCP relay on one address whose backend a test can change, dropping every
/// connection it carries: a managed failover endpoint (one DNS name or virtual IP)
/// behind which a replica is promoted.
struct FailoverEndpoint {
    port: u16,
    backend: std::sync::Arc<std::sync::Mutex<u16>>,
    carried: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl FailoverEndpoint {
    fn start(backend: u16) -> FailoverEndpoint {
        use std::net::{TcpListener, TcpStream};
        use std::sync::{Arc, Mutex};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the endpoint");
        let port = listener.local_addr().expect("endpoint address").port();
        let backend = Arc::new(Mutex::new(backend));
        let carried: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (to, kept) = (backend.clone(), carried.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let port = *to.lock().unwrap_or_else(|e| e.into_inner());
                let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let streams = (client.try_clone(), server.try_clone());
                let (Ok(client_out), Ok(server_out)) = streams else {
                    continue;
                };
                {
                    let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                    for s in [&client, &server] {
                        if let Ok(s) = s.try_clone() {
                            kept.push(s);
                        }
                    }
                }
                std::thread::spawn(move || relay(client, server_out));
                std::thread::spawn(move || relay(server, client_out));
            }
        });
        FailoverEndpoint {
            port,
            backend,
            carried,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// New connections go to `port`; every connection carried so far is cut.
    fn move_to(&self, port: u16) {
        *self.backend.lock().unwrap_or_else(|e| e.into_inner()) = port;
        for s in self
            .carried
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn relay(mut from: std::net::TcpStream, mut to: std::net::TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// A primary P and its replica R, in sync.
fn primary_and_replica() -> (RedisServer, RedisServer) {
    let primary = RedisServer::start();
    let replica = RedisServer::start();
    let port = primary.port.to_string();
    assert_eq!(replica.command(&["REPLICAOF", "127.0.0.1", &port]), "OK");
    mcpgw_testkit::eventually(WITHIN, || {
        let info = replica.command(&["INFO", "replication"]);
        if info.contains("master_link_status:up") {
            Ok(())
        } else {
            Err(info)
        }
    });
    (primary, replica)
}

/// The first answer of `remembered_session` once the directory answers at all (a
/// call that meets the cut connection is "unknown", and so are those while the
/// server behind the URL is checked).
async fn first_answer(dir: &Directory, sid: &str) -> Remembered {
    eventually_async(WITHIN, || async {
        match dir.remembered_session(sid).await {
            Ok(answer) => Ok(answer),
            Err(e @ DirectoryError::Unavailable { .. }) => Err(e.to_string()),
            Err(e) => panic!("{e:?}"),
        }
    })
    .await
}

#[tokio::test]
async fn a_replica_promoted_behind_a_plain_url_makes_lost_records_unknown_not_absent() {
    let (primary, replica) = primary_and_replica();
    let endpoint = FailoverEndpoint::start(primary.port);
    let dir = Directory::connect(DirectoryConfig {
        redis_url: endpoint.url(),
        ..config(&primary, LONG)
    })
    .await
    .unwrap();
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    // The replica holds the generation (and the lease) before it is cut off.
    let generation_key = "t*st:generation";
    eventually_async(WITHIN, || async {
        match replica.get(generation_key) {
            Some(g) if g == lease.generation() => Ok(()),
            other => Err(format!("the replica holds generation {other:?}")),
        }
    })
    .await;
    // Asynchronous replication loses the newest write: the replica is cut off before
    // the shared session is claimed on the primary.
    assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), "OK");
    assert_eq!(
        dir.claim_remembered_session("shared", "w", None)
            .await
            .unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        dir.remembered_session("shared").await.unwrap(),
        Remembered::Owner("w".into())
    );
    assert_eq!(replica.get("t*st:pool_owner:shared"), None, "lost");

    // The replica is promoted behind the same address.
    endpoint.move_to(replica.port);

    match first_answer(&dir, "shared").await {
        Remembered::Absent {
            generation,
            rebuilt,
            ..
        } => {
            assert!(
                rebuilt && generation != lease.generation(),
                "a record the promoted replica lost must not read as proven absent \
                 (a settled generation, nobody rebuilt): generation {generation:?} \
                 (registered under {:?}), rebuilt {rebuilt}",
                lease.generation()
            );
        }
        other => panic!("the promoted replica never held the record: {other:?}"),
    }
    assert_eq!(dir.failovers_seen(), 1);
    assert!(dir.take_failover(), "the lease holder is told to re-assert");
}

#[tokio::test]
async fn a_reconnection_to_the_same_server_behind_a_plain_url_is_no_failover() {
    let (primary, _replica) = primary_and_replica();
    let endpoint = FailoverEndpoint::start(primary.port);
    let dir = Directory::connect(DirectoryConfig {
        redis_url: endpoint.url(),
        ..config(&primary, LONG)
    })
    .await
    .unwrap();
    dir.register_worker("w", &info(), "a:1").await.unwrap();
    assert_eq!(
        dir.claim_remembered_session("shared", "w", None)
            .await
            .unwrap(),
        Claim::Claimed
    );
    // Every connection is cut; the same server answers behind the address.
    endpoint.move_to(primary.port);
    assert_eq!(
        first_answer(&dir, "shared").await,
        Remembered::Owner("w".into())
    );
    assert_eq!(dir.failovers_seen(), 0);
    assert!(!dir.take_failover());
}

/// A primary restarted without persistence comes back empty under a new replication
/// id: the directory counts it as a failover (the case to catch: everything it held is
/// lost), besides the lost generation its owners notice at their next renewal.
#[tokio::test]
async fn a_plain_url_server_restarted_empty_is_marked_as_a_failover() {
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    let lease = dir.register_worker("w", &info(), "a:1").await.unwrap();
    assert_eq!(
        dir.claim_remembered_session("shared", "w", None)
            .await
            .unwrap(),
        Claim::Claimed
    );

    server.restart_empty();

    match first_answer(&dir, "shared").await {
        Remembered::Absent {
            generation,
            rebuilt,
            ..
        } => assert!(
            rebuilt && generation != lease.generation(),
            "generation {generation:?}, rebuilt {rebuilt}"
        ),
        other => panic!("the restarted server is empty: {other:?}"),
    }
    assert_eq!(dir.failovers_seen(), 1);
    assert!(dir.take_failover());
    // The owner's next renewal learns the directory was lost, as before.
    assert_eq!(
        dir.renew_lease(&lease).await.unwrap(),
        LeaseRenewal::DirectoryLost
    );
}

/// A session its owner handed over still counts toward its quota key while it waits
/// to be adopted, and is counted again as it is adopted; an adoption that would put the
/// key over its limit (its count expired and it opened new sessions since) changes
/// nothing and leaves the session adoptable.
#[tokio::test]
async fn a_handed_over_session_keeps_counting_and_its_adoption_is_within_the_quota() {
    use mcpgw_mesh::directory::{AdoptCause, Adoption, SessionKind, SessionState};
    let server = RedisServer::start();
    let dir = directory(&server, LONG).await;
    for id in ["drainer", "adopter"] {
        dir.register_worker(id, &info(), "a:1").await.unwrap();
    }
    let quota = Some(SessionQuota {
        key: "alice",
        limit: 2,
        ttl: Duration::from_secs(60),
    });
    let state = Some(SessionState {
        kind: SessionKind::Http,
        guard: "g",
        payload: "{}",
    });
    for sid in ["h1", "h2"] {
        assert_eq!(
            dir.claim_session_with_state(sid, "drainer", quota, state)
                .await
                .unwrap(),
            Claim::Claimed
        );
    }
    assert!(dir.hand_over_session("h1", "drainer").await.unwrap());
    assert_eq!(
        dir.claim_session("h3", "adopter", quota).await.unwrap(),
        Claim::OverQuota,
        "a handed-over session still counts"
    );
    assert_eq!(
        dir.adopt_session_within("h1", "adopter", "g", quota)
            .await
            .unwrap(),
        Adoption::Adopted {
            payload: "{}".into(),
            cause: AdoptCause::Drain
        },
        "its own place in the count is kept for it"
    );
    assert_eq!(
        dir.claim_session("h3", "adopter", quota).await.unwrap(),
        Claim::OverQuota,
        "the adopted session counts"
    );
    // The key's count expired meanwhile, and it opened two new sessions since.
    assert!(dir.hand_over_session("h2", "drainer").await.unwrap());
    for key in server.keys("*principal_sessions:*") {
        server.command(&["DEL", &key]);
    }
    for sid in ["n1", "n2"] {
        assert_eq!(
            dir.claim_session(sid, "adopter", quota).await.unwrap(),
            Claim::Claimed
        );
    }
    assert_eq!(
        dir.adopt_session_within("h2", "adopter", "g", quota)
            .await
            .unwrap(),
        Adoption::OverQuota
    );
    assert!(
        dir.release_session("n1", "adopter", Some("alice"))
            .await
            .unwrap()
    );
    assert!(
        matches!(
            dir.adopt_session_within("h2", "adopter", "g", quota)
                .await
                .unwrap(),
            Adoption::Adopted { .. }
        ),
        "still adoptable once there is room"
    );
}
