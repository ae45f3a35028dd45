//! Test scenarios every transport must pass, written once against a started `Mesh`
//! (QUIC, TCP, or the Redis baseline).

use std::sync::atomic::Ordering;
use std::time::Duration;

use mcpgw_mesh::transport::MeshError;
use mcpgw_wire::{ErrorFrame, ErrorKind};

use super::*;

/// Once the head is out, a stream (SSE, a session's GET stream) runs past the
/// request's deadline for as long as the owner produces it.
pub async fn a_started_stream_outlives_the_deadline(mesh: Mesh) {
    let mut req = request("/gated", "3");
    req.deadline_ms = 200;
    let mut response = mesh
        .client
        .forward(&mesh.addr(), OWNER, req)
        .await
        .expect("head");
    let first = response.next_chunk().await.expect("a chunk").expect("ok");
    assert_eq!(&first[..], b"event 1\n");
    tokio::time::sleep(Duration::from_millis(600)).await;
    mesh.record.gate.add_permits(1);
    let (rest, _) = body_of(response).await.expect("the stream goes on");
    assert_eq!(rest, b"event 2\nevent 3\n");
}

pub async fn chunks_arrive_while_the_owner_still_produces(mesh: Mesh) {
    let mut response = mesh.forward("/gated", "4").await.expect("forward");
    let first = response.next_chunk().await.expect("a chunk").expect("ok");
    assert_eq!(&first[..], b"event 1\n");
    // The owner cannot produce chunk 2 before we open the gate, so the first chunk was
    // relayed while the response was still being produced.
    assert_eq!(mesh.record.produced.load(Ordering::SeqCst), 1);
    mesh.record.gate.add_permits(1);
    let (rest, chunks) = body_of(response).await.expect("rest");
    assert_eq!(rest, b"event 2\nevent 3\nevent 4\n");
    assert_eq!(chunks, 3);
}

pub async fn dropping_the_forward_before_the_head_cancels_at_the_owner(mesh: Mesh) {
    let mut call = Box::pin(mesh.forward("/silent", ""));
    tokio::select! {
        result = &mut call => panic!("a silent owner sends no head, got {result:?}"),
        () = mesh.await_started(1) => {}
    }
    drop(call);
    mesh.await_cancelled(1).await;
}

pub async fn hundred_concurrent_requests_on_one_peer(mesh: Mesh) {
    let calls = (0..100).map(|i| {
        let mesh = &mesh;
        async move {
            let body = format!("request number {i} with some padding");
            let response = mesh.forward("/echo", body.clone()).await?;
            let (got, _) = body_of(response).await?;
            assert_eq!(
                got,
                body.as_bytes(),
                "request {i} got another request's body"
            );
            Ok::<_, MeshError>(())
        }
    });
    let results = futures_util::future::join_all(calls).await;
    for (i, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("request {i} failed: {e}"));
    }
    assert_eq!(
        mesh.record.started.load(Ordering::SeqCst),
        100,
        "each request ran exactly once"
    );
}

/// The deadline bounds the time to the head: an owner that has not started answering
/// by then stops, and says so.
pub async fn owner_deadline_bounds_the_time_to_the_head(mesh: Mesh) {
    let mut req = request("/silent", "");
    req.deadline_ms = 300;
    match mesh.client.forward(&mesh.addr(), OWNER, req).await {
        Err(MeshError::Remote(ErrorFrame {
            kind: ErrorKind::DeadlineExceeded,
            ..
        })) => {}
        other => panic!("expected Remote(DeadlineExceeded), got {other:?}"),
    }
    mesh.await_cancelled(1).await;
}
