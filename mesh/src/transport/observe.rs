//! What the mesh transports report for metrics: handshakes by side and outcome, and
//! connections open now. Each `MeshClient` and `MeshServer` reports to the observer it
//! was given at construction, so two workers in one process (as the tests and the
//! benchmark run them) each count their own; without one, nothing is counted. The
//! connections open now, with the peer certificate each was made with, are listed by
//! [`open_connections`], for the whole process.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mcpgw_certs::PeerIdentity;
use parking_lot::Mutex;

use super::error::MeshError;

/// Receives mesh connection events. Called on connection set-up and tear-down only,
/// never per request.
pub trait MeshObserver: Send + Sync + 'static {
    /// A handshake ended: `side` is `"caller"` (we dialled) or `"owner"` (we accepted);
    /// `outcome` is `"ok"` or the cause of the failure: `"tls"` (a certificate was
    /// refused, ours or the peer's), `"identity"` (no mesh identity, or not the one
    /// registered for the worker), `"timeout"`, `"refused"` (nothing listens),
    /// `"greeting"` (`Hello`/`Welcome` failed: version, protocol), `"over_cap"` (owner
    /// side: closed unread because too many handshakes were in progress, see
    /// [`MeshLimits::max_handshakes`](super::config::MeshLimits::max_handshakes)) or `"io"`.
    fn handshake(&self, side: &'static str, outcome: &'static str);

    /// Connections open on `side` changed by `delta` (+1 opened, -1 closed).
    fn connections(&self, side: &'static str, delta: i64);
}

/// The observer one client or server reports to, if it was given one; cloned into
/// every connection it opens, so a connection reports its close to the same one.
#[derive(Clone, Default)]
pub(crate) struct Observer(Option<Arc<dyn MeshObserver>>);

impl From<Option<Arc<dyn MeshObserver>>> for Observer {
    fn from(observer: Option<Arc<dyn MeshObserver>>) -> Self {
        Observer(observer)
    }
}

impl Observer {
    pub(crate) fn handshake(&self, side: &'static str, outcome: &'static str) {
        if let Some(observer) = &self.0 {
            observer.handshake(side, outcome);
        }
    }

    /// Counts a fresh connection refused for its owner's identity (a `WrongWorker`
    /// answer is a successful handshake with news, not a failure).
    pub(crate) fn answer_refused(&self, error: &MeshError) {
        if matches!(error, MeshError::IdentityMismatch { .. }) {
            self.handshake("caller", "identity");
        }
    }

    /// Counts one open connection on `side` for as long as the value lives, and lists
    /// it with the peer certificate it was made with and the link it runs over.
    pub(crate) fn open(
        &self,
        side: &'static str,
        peer: &PeerIdentity,
        link: Link,
    ) -> OpenConnection {
        OpenConnection::new(self.clone(), side, peer, link)
    }

    fn connections(&self, side: &'static str, delta: i64) {
        if let Some(observer) = &self.0 {
            observer.connections(side, delta);
        }
    }
}

/// What a mesh connection runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    /// TLS with mutual certificates, over TCP or QUIC.
    Tls,
    /// A Unix socket between two processes of one user on one kernel (the same-host
    /// path): the kernel vouches for the peer, no TLS.
    Unix,
}

impl Link {
    fn as_str(self) -> &'static str {
        match self {
            Link::Tls => "tls",
            Link::Unix => "unix",
        }
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
    /// `"tls"` (mTLS over TCP or QUIC) or `"unix"` (the same-host path, no TLS).
    pub link: &'static str,
    /// The peer's mesh identity URI; on the same-host path `unix:…` (the caller names
    /// the socket, the owner the peer's uid and pid).
    pub peer_identity: String,
    /// SHA-256 of the leaf the peer presented: after a rotation, whether this
    /// connection still rests on an old certificate. Empty on the same-host path.
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
    /// Told of the close, as it was told of the open.
    observer: Observer,
    side: &'static str,
    key: u64,
}

impl OpenConnection {
    fn new(observer: Observer, side: &'static str, peer: &PeerIdentity, link: Link) -> Self {
        observer.connections(side, 1);
        let key = NEXT_OPEN.fetch_add(1, Ordering::Relaxed);
        OPEN.lock().insert(
            key,
            OpenConnectionInfo {
                side,
                link: link.as_str(),
                peer_identity: peer.uri.clone(),
                peer_leaf_fingerprint: peer.leaf_fingerprint.clone(),
            },
        );
        OpenConnection {
            observer,
            side,
            key,
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        OPEN.lock().remove(&self.key);
        self.observer.connections(self.side, -1);
    }
}
