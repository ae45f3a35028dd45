//! Mesh transports: how a worker forwards a request to the worker that owns its
//! session, and how the owner serves it.
//!
//! Three transports sit behind one interface, chosen by [`TransportKind`]:
//!
//! - **QUIC** (quinn): one connection per peer, reused for every request, one
//!   bidirectional stream per request. Requests never queue behind each other.
//! - **TCP** (tokio-rustls): a few persistent connections per peer
//!   ([`MeshLimits::tcp_pool_size`]), each multiplexing many exchanges by id, with a
//!   credit window per exchange ([`MeshLimits::stream_window`]) so that one slow
//!   reader never stalls the others (as HTTP/2 does).
//! - **Redis** pub/sub: the established alternative, kept as a measured baseline and
//!   never the default. Requests and response parts travel as messages through Redis;
//!   Redis, not mTLS, is its trust boundary. Made with [`MeshServer::bind_redis`] and
//!   [`MeshClient::new_redis`]; see [`RedisTransportConfig`] and the `redis` module
//!   source for its channels, liveness and cancellation.
//!
//! QUIC and TCP use TLS 1.3 with mutual authentication: the rustls configs come from
//! `mcpgw-certs` (mesh CA, mesh URI SAN required on both sides); this module only adds
//! the ALPN protocol [`MESH_ALPN`] and dials with SNI [`mcpgw_certs::MESH_SERVER_NAME`].
//!
//! # Protocol
//!
//! Frames are `mcpgw-wire` frames. A connection starts with `Hello` → `Welcome` (on
//! TCP as its first exchange, on QUIC on a first, short-lived stream), which tells the
//! caller the real worker id behind the address: an address that answers as another
//! worker is proof that the expected worker is gone ([`MeshError::WrongWorker`]).
//! Then, per request: `Request` → `Head`, `Chunk`*, `End` | `Error`. Chunks are
//! written and flushed as the service produces them, so SSE events arrive one by one.
//! On TCP every frame after the greeting carries its exchange id, and the owner sends
//! body bytes only against the caller's `Credit`.
//!
//! # Budgets
//!
//! Each peer has two budgets, on the caller's side and on the owner's: short
//! requests ([`MeshLimits::max_in_flight_per_peer`]) and long-lived exchanges
//! ([`MeshLimits::max_streams_per_peer`]: a `GET` stream, or an answer whose head says
//! `text/event-stream`, which moves over when the head is seen). Held streams never
//! make a short request wait, and a full budget refuses at once
//! ([`MeshError::BudgetExhausted`] here, `Error(Busy)` from the owner; see
//! [`MeshError::is_budget_exhausted`]), never by waiting.
//!
//! # Cancellation and deadlines
//!
//! Dropping a [`ForwardedResponse`] (or the [`MeshClient::forward`] future) before the
//! end cancels the request at the owner: QUIC resets and stops the stream; TCP sends
//! `Cancel` for that exchange, and the connection carries on with the others. The owner
//! drops the service's response stream, which is how a [`MeshService`] learns of a
//! cancellation. The owner also stops a request when its `deadline_ms` passes and
//! answers `Error(DeadlineExceeded)`; the caller gives up [`CALLER_DEADLINE_GRACE`]
//! later if the owner's answer never comes.
//!
//! # Refused or unknown
//!
//! The gateway's decision table needs to tell "the owner is gone" (proof) from "the
//! owner did not answer" (unknown); see [`MeshError::proves_peer_gone`].
//!
//! - TCP: a connect to a port nobody listens on fails at once with `ECONNREFUSED`
//!   ([`MeshError::Refused`]); a silent host runs into [`MeshLimits::connect_timeout`]
//!   ([`MeshError::ConnectTimeout`]).
//! - QUIC: quinn ignores ICMP errors, so a dial to a closed UDP port just runs into the
//!   handshake timeout. To keep the proof, the QUIC dialer probes the address with a
//!   one-byte datagram from a *connected* UDP socket while the handshake runs: the
//!   kernel reports the peer's ICMP "port unreachable" on that socket as
//!   `ECONNREFUSED`, and the dial fails with [`MeshError::Refused`] within
//!   milliseconds. (A live QUIC endpoint drops a one-byte datagram unread.) Where ICMP
//!   is filtered, the dial ends in [`MeshError::ConnectTimeout`], which is not proof.
//!   A peer that dies *after* the connection is up is noticed when the connection's
//!   idle timeout ([`MeshLimits::idle_timeout`]) expires, or at once if it closed its
//!   endpoint on the way out.
//! - Redis: a request published to a worker's channel that reaches no subscriber
//!   ([`MeshError::Refused`]); an owner that stops answering mid-response is noticed
//!   when its keep-alives stop for [`MeshLimits::idle_timeout`].

mod budget;
mod calling;
mod client;
mod error;
mod framed;
mod guard;
mod observe;
mod quic;
mod redis;
mod server;
mod serving;
mod tcp;
mod tls;

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use mcpgw_wire::{ErrorFrame, RequestFrame, ResponseHead};

pub use self::redis::RedisTransportConfig;
pub use budget::{StreamCounter, StreamCounts};
pub use client::{CALLER_DEADLINE_GRACE, ForwardedResponse, MeshClient};
pub use error::MeshError;
pub use observe::{MeshObserver, OpenConnectionInfo, open_connections};
pub use server::{MeshServer, MeshServerHandle};
pub use tls::{ClientTls, ServerTls, hard_age, mesh_tls_settings};

/// ALPN protocol id of the mesh. Both transports require it, so a mesh port never
/// talks to an HTTP client by accident, and a future incompatible protocol can
/// take `mcpgw-mesh/2`.
pub const MESH_ALPN: &[u8] = b"mcpgw-mesh/1";

/// Which transport carries mesh traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// QUIC over UDP: one connection per peer, one stream per request.
    Quic,
    /// TLS over TCP: a few connections per peer, each multiplexing many exchanges.
    Tcp,
    /// Redis pub/sub: the measured baseline; a request channel per worker, a reply
    /// channel per caller worker, no mTLS.
    Redis,
}

impl TransportKind {
    /// The transport's name, as the `--mesh-transport` flag spells it and as metrics
    /// and logs label it: one spelling everywhere, so a dashboard's label is a valid
    /// flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Quic => "quic",
            TransportKind::Tcp => "tcp",
            TransportKind::Redis => "redis",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "quic" => Ok(TransportKind::Quic),
            "tcp" => Ok(TransportKind::Tcp),
            "redis" => Ok(TransportKind::Redis),
            other => Err(format!(
                "unknown mesh transport {other:?}: expected \"quic\", \"tcp\" or \"redis\""
            )),
        }
    }
}

/// Limits of one mesh endpoint (server or client). Defaults serve a first run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshLimits {
    /// Largest frame body, in bytes, sent or accepted. A request body must fit in one
    /// frame; response bodies are split into chunks of at most this size. Larger
    /// frames are answered with `Error(TooLarge)`. Memory per in-flight request grows
    /// with it.
    pub max_frame: usize,
    /// Short requests one peer may have in flight: checked by the caller per peer
    /// address ([`MeshError::BudgetExhausted`] at once) and by the owner per peer mesh
    /// identity, whatever worker id the peer declares (`Error(Busy)`). Held streams never count here, so they cannot make a short
    /// request wait. Each costs an exchange's state on both ends (a few KiB) plus what
    /// its request and response hold.
    pub max_in_flight_per_peer: usize,
    /// Long-lived exchanges one peer may have in flight: `GET` streams, and answers
    /// that turned out to be SSE streams. Checked like `max_in_flight_per_peer`, from a
    /// separate budget. A QUIC owner lets a peer open up to both budgets together,
    /// raising the limit as streams are used (quinn keeps a table entry, about 50
    /// bytes, for every stream it allows).
    pub max_streams_per_peer: usize,
    /// Time to establish a connection: TCP or QUIC handshake, TLS, and `Hello` →
    /// `Welcome`. Shorter detects a silent peer sooner, but gives up on a slow one.
    /// Redis: the time to connect to Redis and for Redis to answer one command.
    pub connect_timeout: Duration,
    /// TCP only: connections kept per peer. Every connection carries many exchanges
    /// at once, so a few are enough; more spread the TLS work over more cores. Each
    /// costs a socket, TLS state and two tasks on both ends.
    pub tcp_pool_size: usize,
    /// TCP only: body bytes the owner may send on one exchange before the caller has
    /// read them (the exchange's credit window). Bounds the memory one unread response
    /// holds at the caller; larger windows move large bodies with fewer credit updates.
    pub stream_window: usize,
    /// How long a silent link is trusted. QUIC: the connection's idle timeout, with
    /// keep-alives every third of it, so only a dead or unreachable peer goes silent
    /// this long. TCP: keepalive probing starts after this much silence. Redis: an
    /// owner sends a keep-alive message every third of it while a response is quiet,
    /// and a caller gives up on an owner silent this long. Zero: never time out.
    pub idle_timeout: Duration,
    /// QUIC and TCP: how long a connection takes new exchanges. A caller then opens a
    /// new one (with the TLS material in use by then) and lets the old one close when
    /// its exchanges end, so no request fails; an owner closes a connection still open
    /// at [`hard_age`] of this. Bounds how long credentials removed by a rotation stay
    /// in use. Zero: connections live until their peer's certificate expires.
    pub max_connection_age: Duration,
    /// QUIC and TCP, owner side: handshakes (TLS and `Hello`) one source IP address
    /// may have in progress. A connection over it is closed at once, before any TLS
    /// work, so one address cannot hold many descriptors with handshakes it never
    /// finishes. Connected peers are not affected; a worker dials at most
    /// `tcp_pool_size` connections per peer at a time.
    pub max_handshakes_per_addr: usize,
    /// QUIC and TCP, owner side: handshakes all addresses together may have in
    /// progress; the same refusal over it. Each costs a socket (TCP), a task and TLS
    /// state (a few KiB) until [`connect_timeout`](Self::connect_timeout) ends it.
    pub max_handshakes: usize,
    /// The newest mesh protocol version this worker offers and accepts
    /// ([`mcpgw_wire::PROTOCOL_VERSION`] by default). Lowering it to the version before
    /// makes a worker speak only what the workers of the previous release speak: to
    /// hold a fleet at the old version until every worker is upgraded, and in tests.
    pub max_protocol_version: u32,
}

impl Default for MeshLimits {
    fn default() -> Self {
        Self {
            max_frame: mcpgw_wire::DEFAULT_MAX_FRAME,
            max_in_flight_per_peer: 256,
            max_streams_per_peer: 32_768,
            connect_timeout: Duration::from_secs(2),
            tcp_pool_size: 2,
            stream_window: 256 * 1024,
            idle_timeout: Duration::from_secs(15),
            max_connection_age: Duration::from_secs(600),
            max_handshakes_per_addr: 64,
            max_handshakes: 1024,
            max_protocol_version: mcpgw_wire::PROTOCOL_VERSION,
        }
    }
}

/// Who sent a forwarded request, as the owner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's socket address as seen by this server; the unspecified address
    /// `0.0.0.0:0` over Redis, where the peer's messages come from Redis.
    pub addr: SocketAddr,
    /// The peer's mesh identity from its certificate's URI SAN, verified by mTLS;
    /// empty over Redis, which has no mTLS (Redis is that transport's trust boundary).
    pub identity: String,
    /// The worker id the peer announced in `Hello` (vouched for by its certificate
    /// only as far as the identity above goes), or over Redis in each request.
    pub worker_id: String,
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
/// local path (DESIGN invariant 3) and streams the response.
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
