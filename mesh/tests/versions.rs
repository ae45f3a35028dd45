//! Workers one protocol version apart forward to each other in both directions,
//! streaming included, for the length of a rolling upgrade; two versions apart they
//! refuse with both numbers and what to do. The previous version is spoken by the
//! current code with `max_protocol_version` set to it, which is what a worker of the
//! previous release offers (its frames are byte for byte those of that release:
//! `wire/tests/golden.rs`).

mod common;

use common::*;
use mcpgw_mesh::MeshError;
use mcpgw_mesh::transport::{MeshLimits, TransportKind};
use mcpgw_wire::{OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION};

both_transports!(
    workers_one_version_apart_forward_both_ways_streaming_included,
    workers_two_versions_apart_refuse_with_both_numbers,
);

fn speaking(newest: u32) -> MeshLimits {
    MeshLimits {
        max_protocol_version: newest,
        ..limits()
    }
}

async fn workers_one_version_apart_forward_both_ways_streaming_included(kind: TransportKind) {
    let (previous, current) = (OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION);
    for (owner, caller, agreed) in [
        (current, previous, previous),
        (previous, current, previous),
        (current, current, current),
    ] {
        let what = format!("{kind}: owner speaks up to {owner}, caller up to {caller}");
        let mesh = Mesh::start_with(kind, speaking(owner), speaking(caller)).await;
        let response = mesh.forward("/echo", "hello").await.expect(&what);
        let protocol = header(response.head(), "x-peer-protocol").map(str::to_owned);
        let (body, _) = body_of(response).await.expect(&what);
        assert_eq!(body, b"hello", "{what}");
        assert_eq!(
            protocol.as_deref(),
            Some(agreed.to_string().as_str()),
            "{what}: the version they agreed on"
        );
        // A streamed answer arrives chunk by chunk across the versions as well.
        scenarios::chunks_arrive_while_the_owner_still_produces(mesh).await;
    }
}

async fn workers_two_versions_apart_refuse_with_both_numbers(kind: TransportKind) {
    let too_old = OLDEST_PROTOCOL_VERSION - 1;
    for (owner, caller) in [(PROTOCOL_VERSION, too_old), (too_old, PROTOCOL_VERSION)] {
        let what = format!("{kind}: owner speaks up to {owner}, caller up to {caller}");
        let mesh = Mesh::start_with(kind, speaking(owner), speaking(caller)).await;
        let error = mesh.forward("/echo", "hello").await.expect_err(&what);
        assert!(
            matches!(error, MeshError::VersionMismatch { .. }),
            "{what}: {error:?}"
        );
        let text = error.to_string();
        assert!(
            text.contains(&owner.to_string()) && text.contains(&caller.to_string()),
            "{what}: the refusal names both versions: {text}"
        );
        assert_eq!(
            mesh.record
                .started
                .load(std::sync::atomic::Ordering::SeqCst),
            0,
            "{what}: nothing ran"
        );
    }
}
