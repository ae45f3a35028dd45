//! Mesh transports end to end: a real server and client on loopback, real mTLS with
//! a CA and leaves made in-process, every test run over both QUIC and TCP.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use mcpgw_mesh::transport::{MeshClient, MeshError, MeshLimits, TransportKind};
use mcpgw_wire::{ErrorFrame, ErrorKind};

both_transports!(
    round_trip,
    hundred_concurrent_requests_on_one_peer,
    chunks_arrive_while_the_owner_still_produces,
    dropping_the_response_cancels_at_the_owner,
    dropping_the_forward_before_the_head_cancels_at_the_owner,
    owner_deadline_bounds_the_time_to_the_head,
    a_started_stream_outlives_the_deadline,
    wrong_expected_worker_is_proof,
    closed_port_is_refused,
    silent_port_is_a_timeout_not_proof,
    client_from_another_ca_is_rejected,
    client_without_certificate_is_rejected,
    server_from_another_ca_is_rejected,
    oversized_request_gets_too_large_and_the_peer_still_serves,
    remote_error_frame_then_next_request,
    service_ending_without_end_is_internal,
    draining_server_refuses_new_requests,
    request_over_local_frame_limit_is_not_sent,
    in_flight_limit_answers_busy,
    shutdown_finishes_in_flight_then_refuses,
);

// ------------------------------------------------------------------ tests

async fn round_trip(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let body = "hello mesh, three chunks please";
    let response = mesh.forward("/echo", body).await.expect("forward");
    let head = response.head().clone();
    assert_eq!(head.status, 200);
    assert_eq!(header(&head, "x-served-by"), Some(OWNER));
    assert_eq!(header(&head, "x-peer-worker"), Some(CALLER));
    assert_eq!(
        header(&head, "x-peer-identity"),
        Some("caller"),
        "identity from the client cert"
    );
    let (got, chunks) = body_of(response).await.expect("body");
    assert_eq!(got, body.as_bytes());
    assert_eq!(chunks, 3);
}

async fn hundred_concurrent_requests_on_one_peer(kind: TransportKind) {
    scenarios::hundred_concurrent_requests_on_one_peer(Mesh::start(kind).await).await;
}

async fn chunks_arrive_while_the_owner_still_produces(kind: TransportKind) {
    scenarios::chunks_arrive_while_the_owner_still_produces(Mesh::start(kind).await).await;
}

async fn dropping_the_response_cancels_at_the_owner(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let response = mesh.forward("/hang", "").await.expect("forward");
    assert_eq!(response.head().status, 200);
    drop(response);
    mesh.await_cancelled(1).await;
    // The peer is still usable (TCP: the cancelled connection drained back to the pool).
    let (got, _) = body_of(
        mesh.forward("/echo", "after cancel")
            .await
            .expect("forward"),
    )
    .await
    .expect("body");
    assert_eq!(got, b"after cancel");
}

async fn dropping_the_forward_before_the_head_cancels_at_the_owner(kind: TransportKind) {
    scenarios::dropping_the_forward_before_the_head_cancels_at_the_owner(Mesh::start(kind).await)
        .await;
}

/// The deadline bounds the time to the head: an owner that has not started answering
/// by then stops, and says so.
async fn owner_deadline_bounds_the_time_to_the_head(kind: TransportKind) {
    scenarios::owner_deadline_bounds_the_time_to_the_head(Mesh::start(kind).await).await;
}

/// Once the head is out, a stream (SSE, a session's GET stream) runs past the
/// request's deadline for as long as the owner produces it.
async fn a_started_stream_outlives_the_deadline(kind: TransportKind) {
    scenarios::a_started_stream_outlives_the_deadline(Mesh::start(kind).await).await;
}

async fn wrong_expected_worker_is_proof(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let err = mesh
        .client
        .forward(&mesh.addr(), "owner-0-previous", request("/echo", "x"))
        .await
        .expect_err("another worker answers");
    match &err {
        MeshError::WrongWorker {
            found, expected, ..
        } => {
            assert_eq!(found, OWNER);
            assert_eq!(expected, "owner-0-previous");
        }
        other => panic!("{kind}: expected WrongWorker, got {other:?}"),
    }
    assert!(err.proves_peer_gone());
    assert!(!err.may_have_executed());
    assert_eq!(mesh.record.started.load(Ordering::SeqCst), 0);
    // The same address still serves a caller that expects the right worker.
    mesh.forward("/echo", "x").await.expect("right worker");
}

async fn closed_port_is_refused(kind: TransportKind) {
    let mesh = Mesh::start_with(kind, limits(), patient()).await;
    let (addr, _held) = closed_port(kind);
    let started = std::time::Instant::now();
    let err = mesh
        .client
        .forward(&addr.to_string(), OWNER, request("/echo", "x"))
        .await
        .expect_err("nothing listens");
    assert!(
        matches!(err, MeshError::Refused { .. }),
        "{kind}: expected Refused, got {err:?}"
    );
    assert!(err.proves_peer_gone());
    // A refusal at the owner's address is proof of its death on both transports, so
    // the gateway may act on it without asking the directory.
    assert!(mesh.client.refusal_proves_death(), "{kind}");
    assert_eq!(mesh.client.label(), kind.to_string());
    assert!(
        started.elapsed() < patient().connect_timeout,
        "{kind}: refusal must not wait for the connect timeout ({:?})",
        started.elapsed()
    );
}

/// A loopback port on which nothing listens for `kind`, and for TCP what holds it
/// refusing until dropped (a UDP port is only free a moment ago: a socket bound to it
/// would take the datagrams instead of letting the kernel refuse them).
fn closed_port(kind: TransportKind) -> (SocketAddr, Option<mcpgw_testkit::RefusingPort>) {
    let (port, held) = match kind {
        TransportKind::Quic => (mcpgw_testkit::free_udp_port(), None),
        TransportKind::Tcp => {
            let held = mcpgw_testkit::refusing_port();
            (held.port, Some(held))
        }
        TransportKind::Redis => unreachable!("the Redis transport has its own tests"),
    };
    (SocketAddr::from(([127, 0, 0, 1], port)), held)
}

async fn silent_port_is_a_timeout_not_proof(kind: TransportKind) {
    let connect_timeout = Duration::from_millis(500);
    let quick = MeshLimits {
        connect_timeout,
        ..limits()
    };
    let mesh = Mesh::start_with(kind, limits(), quick).await;
    // A port that is open but never speaks the mesh protocol: a live host whose worker
    // does not answer. That is "unknown", never proof.
    let (addr, _keep) = match kind {
        TransportKind::Quic => {
            let s = tokio::net::UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("udp");
            (s.local_addr().expect("addr"), Box::new(s) as Box<dyn Send>)
        }
        TransportKind::Tcp => {
            let s = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("tcp");
            (s.local_addr().expect("addr"), Box::new(s) as Box<dyn Send>)
        }
        TransportKind::Redis => unreachable!("the Redis transport has its own tests"),
    };
    let err = mesh
        .client
        .forward(&addr.to_string(), OWNER, request("/echo", "x"))
        .await
        .expect_err("nobody answers");
    assert!(
        matches!(err, MeshError::ConnectTimeout { .. }),
        "{kind}: expected ConnectTimeout, got {err:?}"
    );
    assert!(!err.proves_peer_gone());
}

/// A client whose TLS is rejected must see a TLS error, and the service must never run.
async fn assert_rejected(mesh: &Mesh, client: MeshClient) {
    let err = client
        .forward(&mesh.addr(), OWNER, request("/echo", "x"))
        .await
        .expect_err("rejected");
    assert!(
        matches!(err, MeshError::Tls { .. }),
        "{}: expected a TLS error, got {err:?}",
        mesh.kind
    );
    eprintln!("{}: rejected as: {err}", mesh.kind);
    assert!(
        !err.proves_peer_gone(),
        "a TLS failure proves nothing about the owner"
    );
    assert_eq!(
        mesh.record.started.load(Ordering::SeqCst),
        0,
        "no request ran"
    );
}

async fn client_from_another_ca_is_rejected(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let other = Pki::new("another CA");
    // The impostor trusts both CAs, so its own config loads and it accepts the real
    // server; its leaf, though, is from the other CA, which the owner does not trust.
    let bundle = format!("{}{}", other.ca.cert, mesh.pki.ca.cert);
    std::fs::write(other.dir.path().join("ca.crt"), bundle).expect("bundle");
    let tls = other.member("caller").client_config();
    let client = MeshClient::new(kind, tls, "impostor-1", limits(), None).expect("client");
    assert_rejected(&mesh, client).await;
}

async fn client_without_certificate_is_rejected(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let client = MeshClient::new(
        kind,
        mesh.pki.anonymous_client(),
        "anonymous-1",
        limits(),
        None,
    )
    .expect("client");
    assert_rejected(&mesh, client).await;
}

async fn server_from_another_ca_is_rejected(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let other = Pki::new("another CA");
    let rogue = other.member("owner");
    let service = Arc::new(TestService {
        record: mesh.record.clone(),
    });
    let rogue_server =
        serve_on_loopback(kind, rogue.server_config(), OWNER, service, limits()).await;
    let err = mesh
        .client
        .forward(
            &rogue_server.local_addr().to_string(),
            OWNER,
            request("/echo", "x"),
        )
        .await
        .expect_err("rogue server");
    assert!(
        matches!(err, MeshError::Tls { .. }),
        "{kind}: expected Tls, got {err:?}"
    );
    assert_eq!(mesh.record.started.load(Ordering::SeqCst), 0);
}

async fn oversized_request_gets_too_large_and_the_peer_still_serves(kind: TransportKind) {
    let server_limits = MeshLimits {
        max_frame: 64 * 1024,
        ..limits()
    };
    let client_limits = MeshLimits {
        max_frame: 1024 * 1024,
        tcp_pool_size: 1,
        ..limits()
    };
    let mesh = Mesh::start_with(kind, server_limits, client_limits).await;
    let before = mesh.forward("/echo", "before").await.expect("forward");
    let conn_before = header(before.head(), "x-peer-addr").map(str::to_owned);
    body_of(before).await.expect("body");

    let err = mesh
        .forward("/echo", vec![7u8; 100 * 1024])
        .await
        .expect_err("too large for the owner");
    match &err {
        MeshError::Remote(ErrorFrame {
            kind: ErrorKind::TooLarge,
            ..
        }) => {}
        other => panic!("{kind}: expected Remote(TooLarge), got {other:?}"),
    }
    assert!(!err.may_have_executed());

    let after = mesh.forward("/echo", "after").await.expect("forward after");
    let conn_after = header(after.head(), "x-peer-addr").map(str::to_owned);
    assert_eq!(
        conn_before, conn_after,
        "{kind}: the same connection serves on"
    );
    assert_eq!(body_of(after).await.expect("body").0, b"after");
    assert_eq!(
        mesh.record.started.load(Ordering::SeqCst),
        2,
        "the oversized request never ran"
    );
}

async fn remote_error_frame_then_next_request(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let err = mesh.forward("/not-mine", "").await.expect_err("not mine");
    assert_eq!(err.remote().map(|e| e.kind), Some(ErrorKind::NotOwner));
    assert!(
        !err.proves_peer_gone(),
        "the directory must agree before it is proof"
    );
    mesh.forward("/echo", "next").await.expect("next request");
}

async fn service_ending_without_end_is_internal(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
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
        other => panic!("{kind}: expected Remote(Internal), got {other:?}"),
    }
}

async fn draining_server_refuses_new_requests(kind: TransportKind) {
    let mesh = Mesh::start(kind).await;
    let mut in_flight = mesh.forward("/gated", "2").await.expect("forward");
    mesh.server.drain();
    let err = mesh.forward("/echo", "x").await.expect_err("draining");
    assert_eq!(err.remote().map(|e| e.kind), Some(ErrorKind::Draining));
    // The request already running finishes.
    assert!(in_flight.next_chunk().await.expect("chunk").is_ok());
    mesh.record.gate.add_permits(1);
    let (rest, _) = body_of(in_flight).await.expect("finishes");
    assert_eq!(rest, b"event 2\n");
}

async fn request_over_local_frame_limit_is_not_sent(kind: TransportKind) {
    let small = MeshLimits {
        max_frame: 1024,
        ..limits()
    };
    let mesh = Mesh::start_with(kind, limits(), small).await;
    let err = mesh
        .forward("/echo", vec![0u8; 4096])
        .await
        .expect_err("too large");
    assert!(matches!(err, MeshError::RequestTooLarge(_)), "{err:?}");
    assert_eq!(mesh.record.started.load(Ordering::SeqCst), 0);
}

async fn in_flight_limit_answers_busy(kind: TransportKind) {
    let one = MeshLimits {
        max_in_flight_per_peer: 1,
        ..limits()
    };
    let mesh = Mesh::start_with(kind, one, limits()).await;
    let running = mesh.forward("/hang", "").await.expect("first request");
    let err = mesh
        .forward("/echo", "second")
        .await
        .expect_err("over the limit");
    assert_eq!(
        err.remote().map(|e| e.kind),
        Some(ErrorKind::Busy),
        "{err:?}"
    );
    assert!(!err.may_have_executed());
    drop(running);
    mesh.await_cancelled(1).await;
    let (got, _) = body_of(mesh.forward("/echo", "third").await.expect("third"))
        .await
        .expect("body");
    assert_eq!(got, b"third");
}

async fn shutdown_finishes_in_flight_then_refuses(kind: TransportKind) {
    let Mesh {
        server,
        client,
        record,
        pki: _pki,
        ..
    } = Mesh::start(kind).await;
    let addr = server.local_addr().to_string();
    let mut in_flight = client
        .forward(&addr, OWNER, request("/gated", "2"))
        .await
        .expect("forward");
    assert!(in_flight.next_chunk().await.expect("chunk").is_ok());
    let shutdown = tokio::spawn(server.shutdown(Duration::from_secs(20)));
    // Draining: new requests are refused with Draining while the old one runs on.
    eventually_async(TEST_TIMEOUT / 2, || async {
        // The shutdown task may not have run yet: a request served before the drain
        // began is fine, and the next one is tried.
        let err = match client.forward(&addr, OWNER, request("/echo", "x")).await {
            Ok(served) => {
                // Read to the end, so that it does not count as cut off.
                let _ = body_of(served).await;
                return Err(format!("{kind}: not draining yet: a request was served"));
            }
            Err(err) => err,
        };
        match err.remote().map(|e| e.kind) {
            Some(ErrorKind::Draining) => Ok(()),
            _ => Err(format!("{kind}: not draining yet: {err:?}")),
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
    // The worker is gone: its address refuses, which is proof. (A request written on
    // a pooled connection in the instant the owner closed it is "outcome unknown" by
    // design, so the check dials afresh.)
    client.forget_peer(&addr);
    let err = client
        .forward(&addr, OWNER, request("/echo", "x"))
        .await
        .expect_err("stopped");
    assert!(
        matches!(err, MeshError::Refused { .. }),
        "{kind}: expected Refused, got {err:?}"
    );
}

/// The gateway holds responses across awaits and spawns forwards: all of it must be
/// `Send`.
#[allow(dead_code)]
fn public_types_are_send() {
    fn send<T: Send>(_: &T) {}
    fn send_sync_static<T: Send + Sync + 'static>() {}
    send_sync_static::<MeshClient>();
    send_sync_static::<mcpgw_mesh::transport::MeshServerHandle>();
    fn response(r: mcpgw_mesh::transport::ForwardedResponse) {
        send(&r);
        send(&r.into_body_stream());
    }
    fn forward(c: &MeshClient) {
        send(&c.forward("127.0.0.1:1", OWNER, request("/", "")));
    }
    let _ = (response, forward);
}
