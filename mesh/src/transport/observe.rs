//! What the mesh transports report for metrics: handshakes by side and outcome, and
//! connections open now. One observer per process (a worker is one process), set once
//! by the gateway; without one, nothing is counted. The connections open now, with
//! the peer certificate each was made with, are listed by [`open_connections`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use mcpgw_certs::PeerIdentity;
use parking_lot::Mutex;

use super::MeshError;

/// Receives mesh connection events. Called on connection set-up and tear-down only,
/// never per request.
pub trait MeshObserver: Send + Sync + 'static {
    /// A handshake ended: `side` is `"caller"` (we dialled) or `"owner"` (we accepted);
    /// `outcome` is `"ok"` or the cause of the failure: `"tls"` (a certificate was
    /// refused, ours or the peer's), `"identity"` (no mesh identity, or not the one
    /// registered for the worker), `"timeout"`, `"refused"` (nothing listens),
    /// `"greeting"` (`Hello`/`Welcome` failed: version, protocol), `"over_cap"` (owner
    /// side: closed unread because too many handshakes were in progress, see
    /// [`MeshLimits::max_handshakes`](super::MeshLimits::max_handshakes)) or `"io"`.
    fn handshake(&self, side: &'static str, outcome: &'static str);

    /// Connections open on `side` changed by `delta` (+1 opened, -1 closed).
    fn connections(&self, side: &'static str, delta: i64);
}

static OBSERVER: OnceLock<Arc<dyn MeshObserver>> = OnceLock::new();

/// Reports every later mesh connection event of this process to `observer` (the first
/// one set stays).
pub fn observe_mesh_with(observer: Arc<dyn MeshObserver>) {
    let _ = OBSERVER.set(observer);
}

pub(crate) fn handshake(side: &'static str, outcome: &'static str) {
    if let Some(observer) = OBSERVER.get() {
        observer.handshake(side, outcome);
    }
}

/// Counts a fresh connection refused for its owner's identity (a `WrongWorker` answer
/// is a successful handshake with news, not a failure).
pub(crate) fn answer_refused(error: &MeshError) {
    if matches!(error, MeshError::IdentityMismatch { .. }) {
        handshake("caller", "identity");
    }
}

/// The outcome label of a failed dial.
pub(crate) fn dial_failure(error: &MeshError) -> &'static str {
    match error {
        MeshError::Tls { .. } => "tls",
        MeshError::IdentityMismatch { .. } => "identity",
        MeshError::ConnectTimeout { .. } => "timeout",
        MeshError::Refused { .. } => "refused",
        MeshError::VersionMismatch { .. } | MeshError::Protocol(_) | MeshError::Remote(_) => {
            "greeting"
        }
        _ => "io",
    }
}

/// A mesh connection open now, as [`open_connections`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OpenConnectionInfo {
    /// `"caller"` (we dialled) or `"owner"` (we accepted).
    pub side: &'static str,
    /// The peer's mesh identity URI.
    pub peer_identity: String,
    /// SHA-256 of the leaf the peer presented: after a rotation, whether this
    /// connection still rests on an old certificate.
    pub peer_leaf_fingerprint: String,
}

/// Every mesh connection of this process that is open now, by when it opened.
static OPEN: Mutex<BTreeMap<u64, OpenConnectionInfo>> = Mutex::new(BTreeMap::new());
static NEXT_OPEN: AtomicU64 = AtomicU64::new(0);

/// The mesh connections of this process that are open now (QUIC and TCP, both sides),
/// oldest first.
pub fn open_connections() -> Vec<OpenConnectionInfo> {
    OPEN.lock().values().cloned().collect()
}

/// Counts one open connection on `side` for as long as it lives, and lists it with
/// the peer certificate it was made with.
pub(crate) struct OpenConnection {
    side: &'static str,
    key: u64,
}

impl OpenConnection {
    pub(crate) fn new(side: &'static str, peer: &PeerIdentity) -> Self {
        if let Some(observer) = OBSERVER.get() {
            observer.connections(side, 1);
        }
        let key = NEXT_OPEN.fetch_add(1, Ordering::Relaxed);
        OPEN.lock().insert(
            key,
            OpenConnectionInfo {
                side,
                peer_identity: peer.uri.clone(),
                peer_leaf_fingerprint: peer.leaf_fingerprint.clone(),
            },
        );
        OpenConnection { side, key }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        OPEN.lock().remove(&self.key);
        if let Some(observer) = OBSERVER.get() {
            observer.connections(self.side, -1);
        }
    }
}
