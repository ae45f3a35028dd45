//! What the owner's transport hands to the gateway and takes back: the service that
//! runs a forwarded request ([`MeshService`]), who sent it ([`PeerInfo`]), and the
//! pieces of the response ([`ResponsePart`]).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use mcpgw_wire::{ErrorFrame, RequestFrame, ResponseHead};

use super::config::TransportKind;

/// Who sent a forwarded request, as the owner sees it. Each exchange gets its own
/// copy, so the strings are shared, not copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's socket address as seen by this server; the unspecified address
    /// `0.0.0.0:0` over Redis, where the peer's messages come from Redis.
    pub addr: SocketAddr,
    /// The peer's mesh identity from its certificate's URI SAN, verified by mTLS;
    /// empty over Redis, which has no mTLS (Redis is that transport's trust boundary).
    pub identity: Arc<str>,
    /// The worker id the peer announced in `Hello` (vouched for by its certificate
    /// only as far as the identity above goes), or over Redis in each request.
    pub worker_id: Arc<str>,
    /// The transport the request came over.
    pub transport: TransportKind,
    /// The mesh protocol version agreed with the peer at the greeting: no frame newer
    /// than it is sent to the peer.
    pub protocol: u32,
    /// Which of this server's connections carried the request (numbered from 1 as
    /// they are accepted; 0 over Redis), for logs: a caller replacing its connections
    /// shows up as new numbers.
    pub connection: u64,
}

/// One piece of a response produced by a [`MeshService`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponsePart {
    /// Status and headers; must come first (or be replaced by `Error`).
    Head(ResponseHead),
    /// A body chunk; relayed to the caller as soon as it is produced. Chunks larger
    /// than the maximum frame are split.
    Chunk(Bytes),
    /// The response is complete.
    End,
    /// The request failed; ends the response (before or after the head).
    Error(ErrorFrame),
}

impl ResponsePart {
    /// The variant's name, for log lines.
    pub fn name(&self) -> &'static str {
        match self {
            ResponsePart::Head(_) => "Head",
            ResponsePart::Chunk(_) => "Chunk",
            ResponsePart::End => "End",
            ResponsePart::Error(_) => "Error",
        }
    }
}

/// The owner's side of forwarding: runs a forwarded request on the owner's normal
/// local path (docs/architecture.md, invariant 3) and streams the response.
///
/// The transport enforces the response shape: `Head`, then `Chunk`s, then `End` or
/// `Error`. A stream that ends without `End` is reported to the caller as
/// `Error(Internal)`. Dropping the returned stream is how the service learns that
/// the request was cancelled (caller gone, `Cancel`, deadline, shutdown).
pub trait MeshService: Send + Sync + 'static {
    /// Starts serving `request` from `peer`; the stream yields the response parts.
    fn serve(&self, request: RequestFrame, peer: PeerInfo) -> BoxStream<'static, ResponsePart>;

    /// The mesh identity (URI) registered for `worker_id`, the worker a caller's
    /// `Hello` says it is, when known. A caller whose certificate carries another
    /// identity is refused: every mesh member may forward (invariant 4), but none may
    /// speak as another worker (whose budgets and log lines it would use). `None` (not
    /// registered yet, or the directory cannot say) lets the caller in.
    fn registered_identity(&self, worker_id: &str) -> BoxFuture<'static, Option<String>> {
        let _ = worker_id;
        Box::pin(std::future::ready(None))
    }
}

impl<T: MeshService + ?Sized> MeshService for Arc<T> {
    fn serve(&self, request: RequestFrame, peer: PeerInfo) -> BoxStream<'static, ResponsePart> {
        (**self).serve(request, peer)
    }

    fn registered_identity(&self, worker_id: &str) -> BoxFuture<'static, Option<String>> {
        (**self).registered_identity(worker_id)
    }
}
