//! The Redis pub/sub baseline transport end to end: a fresh `redis-server` per test,
//! and a real owner and caller talking through it behind the same interface as QUIC
//! and TCP.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use mcpgw_mesh::transport::{MeshClient, MeshError, MeshLimits, MeshServer, TransportKind};
use mcpgw_wire::{ErrorFrame, ErrorKind};

/// Runs each test body with a fresh Redis, bounded by [`TEST_TIMEOUT`].
macro_rules! redis_tests {
    ($($name:ident),* $(,)?) => {
        mod over_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let redis = super::RedisServer::start();
                    tokio::time::timeout(super::TEST_TIMEOUT, super::$name(&redis))
                        .await
                        .expect("test timed out");
                }
            )*
        }
    };
}

redis_tests!(
    round_trip,
    hundred_concurrent_requests_on_one_peer,
    chunks_arrive_while_the_owner_still_produces,
    dropping_the_response_cancels_at_the_owner,
    dropping_the_forward_before_the_head_cancels_at_the_owner,
    a_worker_without_a_subscriber_is_refused,
    one_subscriber_per_worker_channel,
    a_started_stream_outlives_the_deadline,
    owner_deadline_bounds_the_time_to_the_head,
    remote_error_frames_reach_the_caller,
    oversized_request_gets_too_large_and_the_owner_still_serves,
    request_over_local_frame_limit_is_not_sent,
    draining_and_busy_owners_refuse,
    shutdown_finishes_in_flight_then_refuses,
    subscriptions_come_back_after_redis_restarts,
    a_silent_owner_is_presumed_dead_after_the_idle_timeout,
    an_owner_stops_for_a_caller_that_vanished,
    garbage_on_the_channel_costs_nothing,
);

async fn start(redis: &RedisServer) -> Mesh {
    Mesh::start_redis(&redis.url(), limits(), limits()).await
}

/// Waits (bounded) until `channel` has `n` subscribers.
async fn await_numsub(redis: &RedisServer, channel: &str, n: u64) {
    eventually_async(TEST_TIMEOUT / 2, || async {
        let now = redis.numsub(channel);
        if now == n {
            Ok(())
        } else {
            Err(format!("{channel} has {now} subscribers, expected {n}"))
        }
    })
    .await;
}

// ------------------------------------------------------------------ tests

async fn round_trip(redis: &RedisServer) {
    let mesh = start(redis).await;
    assert_eq!(mesh.client.kind(), TransportKind::Redis);
    let body = "hello mesh, three chunks please";
    let response = mesh.forward("/echo", body).await.expect("forward");
    let head = response.head().clone();
    assert_eq!(head.status, 200);
    assert_eq!(header(&head, "x-served-by"), Some(OWNER));
    assert_eq!(header(&head, "x-peer-worker"), Some(CALLER));
    assert_eq!(
        header(&head, "x-peer-identity"),
        Some(""),
        "no mTLS over Redis: no identity"
    );
    let (got, chunks) = body_of(response).await.expect("body");
    assert_eq!(got, body.as_bytes());
    assert_eq!(chunks, 3, "each chunk is its own message");
}

async fn hundred_concurrent_requests_on_one_peer(redis: &RedisServer) {
    scenarios::hundred_concurrent_requests_on_one_peer(start(redis).await).await;
}

async fn chunks_arrive_while_the_owner_still_produces(redis: &RedisServer) {
    scenarios::chunks_arrive_while_the_owner_still_produces(start(redis).await).await;
}

async fn dropping_the_response_cancels_at_the_owner(redis: &RedisServer) {
    let mesh = start(redis).await;
    let response = mesh.forward("/hang", "").await.expect("forward");
    assert_eq!(response.head().status, 200);
    drop(response);
    mesh.await_cancelled(1).await;
    let (got, _) = body_of(
        mesh.forward("/echo", "after cancel")
            .await
            .expect("forward"),
    )
    .await
    .expect("body");
    assert_eq!(got, b"after cancel");
}

async fn dropping_the_forward_before_the_head_cancels_at_the_owner(redis: &RedisServer) {
    scenarios::dropping_the_forward_before_the_head_cancels_at_the_owner(start(redis).await).await;
}

/// A PUBLISH that reaches no subscriber is the Redis form of a refused connection:
/// proof that nothing serves that worker's channel, at once.
async fn a_worker_without_a_subscriber_is_refused(redis: &RedisServer) {
    let mesh = Mesh::start_redis(&redis.url(), limits(), patient()).await;
    let started = std::time::Instant::now();
    let err = mesh
        .client
        .forward("ignored:0", "worker-that-is-gone", request("/echo", "x"))
        .await
        .expect_err("nobody subscribes");
    assert!(
        matches!(&err, MeshError::Refused { addr } if addr == "t*st:pool_rpc:worker-that-is-gone"),
        "expected Refused naming the channel, got {err:?}"
    );
    assert!(err.proves_peer_gone());
    assert!(!err.may_have_executed());
    // Yet not proof of death: an owner whose subscriber is reconnecting to Redis
    // looks the same for a moment, so only its lease can tell.
    assert!(!mesh.client.refusal_proves_death());
    assert_eq!(mesh.client.label(), "redis");
    assert!(
        started.elapsed() < patient().connect_timeout,
        "refusal must not wait for a timeout ({:?})",
        started.elapsed()
    );
    assert_eq!(mesh.record.started.load(Ordering::SeqCst), 0);
}

/// Invariant 2 (docs/architecture.md) over Redis: exactly one subscriber per worker request channel,
/// and a second process under the same worker id cannot become another.
async fn one_subscriber_per_worker_channel(redis: &RedisServer) {
    let mesh = start(redis).await;
    let config = redis_config(&redis.url());
    let request_channel = config.request_channel(OWNER);
    assert_eq!(mesh.server.redis_channel(), Some(request_channel.as_str()));
    assert_eq!(redis.numsub(&request_channel), 1);
    assert_eq!(redis.numsub(&config.reply_channel(CALLER)), 1);

    let twin = MeshServer::bind_redis(
        config.clone(),
        OWNER,
        std::sync::Arc::new(TestService {
            record: mesh.record.clone(),
        }),
        limits(),
    )
    .await
    .expect_err("a second subscriber for the same worker id");
    assert!(matches!(twin, MeshError::Redis(_)), "{twin:?}");
    eprintln!("refused as: {twin}");
    assert_eq!(redis.numsub(&request_channel), 1);

    let (got, _) = body_of(mesh.forward("/echo", "once").await.expect("forward"))
        .await
        .expect("body");
    assert_eq!(got, b"once");
    assert_eq!(
        mesh.record.started.load(Ordering::SeqCst),
        1,
        "the request ran exactly once"
    );
}

/// Once the head is out, a stream runs past the request's deadline for as long as the
/// owner produces it.
async fn a_started_stream_outlives_the_deadline(redis: &RedisServer) {
    scenarios::a_started_stream_outlives_the_deadline(start(redis).await).await;
}

/// The deadline bounds the time to the head: an owner that has not started answering
/// by then stops, and says so.
async fn owner_deadline_bounds_the_time_to_the_head(redis: &RedisServer) {
    scenarios::owner_deadline_bounds_the_time_to_the_head(start(redis).await).await;
}

async fn remote_error_frames_reach_the_caller(redis: &RedisServer) {
    let mesh = start(redis).await;
    let err = mesh.forward("/not-mine", "").await.expect_err("not mine");
    assert_eq!(err.remote().map(|e| e.kind), Some(ErrorKind::NotOwner));
    assert!(!err.proves_peer_gone());

    let mut response = mesh.forward("/truncated", "").await.expect("head");
    assert_eq!(
        &response.next_chunk().await.expect("chunk").expect("ok")[..],
        b"partial"
    );
    match response.next_chunk().await {
        Some(Err(MeshError::Remote(ErrorFrame {
            kind: ErrorKind::Internal,
            ..
        }))) => {}
        other => panic!("expected Remote(Internal), got {other:?}"),
    }
}

async fn oversized_request_gets_too_large_and_the_owner_still_serves(redis: &RedisServer) {
    let server_limits = MeshLimits {
        max_frame: 64 * 1024,
        ..limits()
    };
    let client_limits = MeshLimits {
        max_frame: 1024 * 1024,
        ..limits()
    };
    let mesh = Mesh::start_redis(&redis.url(), server_limits, client_limits).await;
    let err = mesh
        .forward("/echo", vec![7u8; 100 * 1024])
        .await
        .expect_err("too large for the owner");
    assert_eq!(
        err.remote().map(|e| e.kind),
        Some(ErrorKind::TooLarge),
        "{err:?}"
    );
    assert!(!err.may_have_executed());
    let (got, _) = body_of(mesh.forward("/echo", "after").await.expect("forward after"))
        .await
        .expect("body");
    assert_eq!(got, b"after");
    assert_eq!(
        mesh.record.started.load(Ordering::SeqCst),
        1,
        "the oversized request never ran"
    );
}

async fn request_over_local_frame_limit_is_not_sent(redis: &RedisServer) {
    let small = MeshLimits {
        max_frame: 1024,
        ..limits()
    };
    let mesh = Mesh::start_redis(&redis.url(), limits(), small).await;
    let err = mesh
        .forward("/echo", vec![0u8; 4096])
        .await
        .expect_err("too large");
    assert!(matches!(err, MeshError::RequestTooLarge(_)), "{err:?}");
    assert_eq!(mesh.record.started.load(Ordering::SeqCst), 0);
}

async fn draining_and_busy_owners_refuse(redis: &RedisServer) {
    let one = MeshLimits {
        max_in_flight_per_peer: 1,
        ..limits()
    };
    let mesh = Mesh::start_redis(&redis.url(), one, limits()).await;
    let mut running = mesh.forward("/gated", "2").await.expect("first request");
    let err = mesh.forward("/echo", "second").await.expect_err("busy");
    assert_eq!(
        err.remote().map(|e| e.kind),
        Some(ErrorKind::Busy),
        "{err:?}"
    );
    assert!(!err.may_have_executed());

    mesh.server.drain();
    let err = mesh.forward("/echo", "x").await.expect_err("draining");
    assert_eq!(err.remote().map(|e| e.kind), Some(ErrorKind::Draining));
    // The request already running finishes.
    assert!(running.next_chunk().await.expect("chunk").is_ok());
    mesh.record.gate.add_permits(1);
    let (rest, _) = body_of(running).await.expect("finishes");
    assert_eq!(rest, b"event 2\n");
}

async fn shutdown_finishes_in_flight_then_refuses(redis: &RedisServer) {
    let Mesh {
        server,
        client,
        record,
        ..
    } = start(redis).await;
    let channel = server.redis_channel().expect("redis channel").to_owned();
    let mut in_flight = client
        .forward("", OWNER, request("/gated", "2"))
        .await
        .expect("forward");
    assert!(in_flight.next_chunk().await.expect("chunk").is_ok());
    let shutdown = tokio::spawn(server.shutdown(Duration::from_secs(20)));
    eventually_async(TEST_TIMEOUT / 2, || async {
        let err = client
            .forward("", OWNER, request("/echo", "x"))
            .await
            .expect_err("draining");
        match err.remote().map(|e| e.kind) {
            Some(ErrorKind::Draining) => Ok(()),
            _ => Err(format!("not draining yet: {err:?}")),
        }
    })
    .await;
    record.gate.add_permits(1);
    let (rest, _) = body_of(in_flight)
        .await
        .expect("in-flight request finishes");
    assert_eq!(rest, b"event 2\n");
    shutdown.await.expect("shutdown");
    assert_eq!(
        record.cancelled.load(Ordering::SeqCst),
        0,
        "nothing was cut off"
    );
    // The worker unsubscribed on its way out: its channel refuses, which is proof.
    assert_eq!(redis.numsub(&channel), 0);
    let err = client
        .forward("", OWNER, request("/echo", "x"))
        .await
        .expect_err("stopped");
    assert!(
        matches!(err, MeshError::Refused { .. }),
        "expected Refused, got {err:?}"
    );
}

/// Pub/sub connections do not reconnect by themselves: both subscriptions come back
/// after Redis restarts, a response in flight fails as lost (its replies may be gone)
/// and is cancelled at the owner, and forwarding works again.
async fn subscriptions_come_back_after_redis_restarts(redis: &RedisServer) {
    let mesh = start(redis).await;
    let config = redis_config(&redis.url());
    let mut hanging = mesh.forward("/hang", "").await.expect("head");

    redis.restart_empty();
    match hanging.next_chunk().await {
        Some(Err(MeshError::LostMidResponse(reason))) => eprintln!("in flight: {reason}"),
        other => panic!("expected LostMidResponse, got {other:?}"),
    }
    await_numsub(redis, &config.request_channel(OWNER), 1).await;
    await_numsub(redis, &config.reply_channel(CALLER), 1).await;
    // The caller published Cancel once the owner listened again.
    mesh.await_cancelled(1).await;

    let (got, _) = body_of(mesh.forward("/echo", "again").await.expect("forward"))
        .await
        .expect("body");
    assert_eq!(got, b"again");
}

/// An owner that took the request and then went silent (hung, or gone without closing
/// anything) is noticed by the missing keep-alives within the idle timeout, long
/// before the request's deadline; the outcome is unknown.
async fn a_silent_owner_is_presumed_dead_after_the_idle_timeout(redis: &RedisServer) {
    let config = redis_config(&redis.url());
    // A subscriber that takes requests and never answers.
    let mut mute = redis::Client::open(redis.url())
        .expect("url")
        .get_async_pubsub()
        .await
        .expect("pubsub");
    mute.subscribe(config.request_channel("mute-1"))
        .await
        .expect("subscribe");
    let quick = MeshLimits {
        idle_timeout: Duration::from_millis(500),
        ..limits()
    };
    let client = MeshClient::new_redis(config, CALLER, quick)
        .await
        .expect("client");
    // A deadline far beyond the test's own bound: only the idle timeout can end this.
    let mut patient_request = request("/echo", "x");
    patient_request.deadline_ms = 600_000;
    let started = std::time::Instant::now();
    let err = client
        .forward("", "mute-1", patient_request)
        .await
        .expect_err("nobody answers");
    assert!(
        matches!(err, MeshError::LostMidResponse(_)),
        "expected LostMidResponse, got {err:?}"
    );
    assert!(err.may_have_executed(), "it was delivered: outcome unknown");
    eprintln!("presumed dead after {:?}", started.elapsed());
    drop(mute);
}

/// A caller that vanishes without a Cancel (crashed) is noticed by the owner: its next
/// keep-alive reaches no subscriber on the caller's reply channel.
async fn an_owner_stops_for_a_caller_that_vanished(redis: &RedisServer) {
    let quick = MeshLimits {
        idle_timeout: Duration::from_millis(600),
        ..limits()
    };
    let Mesh {
        server: _server,
        client,
        record,
        ..
    } = Mesh::start_redis(&redis.url(), quick.clone(), quick).await;
    let response = client
        .forward("", OWNER, request("/hang", ""))
        .await
        .expect("head");
    // No Cancel: the response is leaked, then the whole client goes.
    std::mem::forget(response);
    drop(client);
    eventually_async(TEST_TIMEOUT / 2, || async {
        match record.cancelled.load(Ordering::SeqCst) {
            0 => Err("the owner has not noticed its caller is gone"),
            _ => Ok(()),
        }
    })
    .await;
}

/// Bytes that are not a mesh message are logged and dropped; the channel serves on.
async fn garbage_on_the_channel_costs_nothing(redis: &RedisServer) {
    let mesh = start(redis).await;
    let channel = redis_config(&redis.url()).request_channel(OWNER);
    let mut conn = redis_conn(redis).await;
    for garbage in [&b""[..], b"x", &[0u8; 13], &[0xffu8; 64]] {
        let n: i64 = redis::cmd("PUBLISH")
            .arg(&channel)
            .arg(garbage)
            .query_async(&mut conn)
            .await
            .expect("publish");
        assert_eq!(n, 1);
    }
    let (got, _) = body_of(mesh.forward("/echo", "still here").await.expect("forward"))
        .await
        .expect("body");
    assert_eq!(got, b"still here");
    assert_eq!(mesh.record.started.load(Ordering::SeqCst), 1);
}
