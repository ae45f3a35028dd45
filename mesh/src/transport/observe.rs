//! What the mesh transports report for metrics: handshakes by side and outcome, and
//! connections open now. One observer per process (a worker is one process), set once
//! by the gateway; without one, nothing is counted.

use std::sync::{Arc, OnceLock};

use super::MeshError;

/// Receives mesh connection events. Called on connection set-up and tear-down only,
/// never per request.
pub trait MeshObserver: Send + Sync + 'static {
    /// A handshake ended: `side` is `"caller"` (we dialled) or `"owner"` (we accepted);
    /// `outcome` is `"ok"` or the cause of the failure: `"tls"` (a certificate was
    /// refused, ours or the peer's), `"identity"` (no mesh identity, or not the one
    /// registered for the worker), `"timeout"`, `"refused"` (nothing listens),
    /// `"greeting"` (`Hello`/`Welcome` failed: version, protocol) or `"io"`.
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

/// Counts one open connection on `side` for as long as it lives.
pub(crate) struct OpenConnection(&'static str);

impl OpenConnection {
    pub(crate) fn new(side: &'static str) -> Self {
        if let Some(observer) = OBSERVER.get() {
            observer.connections(side, 1);
        }
        OpenConnection(side)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        if let Some(observer) = OBSERVER.get() {
            observer.connections(self.0, -1);
        }
    }
}
