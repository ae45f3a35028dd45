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
//! - **Same host** (opt-in, beside TCP): the TCP transport's framing over a Unix
//!   socket between two workers of one user on one kernel, no TLS; the kernel vouches
//!   for the peer ([`MeshServerHandle::serve_same_host`],
//!   [`MeshClient::use_same_host`]; see the `tcp::same_host` module source).
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
//!   ([`MeshError::ConnectTimeout`]). On the same-host path, `ECONNREFUSED` (a socket
//!   file named by the worker id with no listener) is the same proof; no such file is
//!   none (another container's filesystem): the caller uses TCP instead.
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
mod config;
mod error;
mod framed;
mod guard;
mod observe;
mod quic;
mod redis;
mod server;
mod service;
mod serving;
mod tcp;
mod tls;

pub use self::redis::RedisTransportConfig;
pub use budget::{StreamCounter, StreamCounts};
pub use client::{CALLER_DEADLINE_GRACE, ForwardedResponse, MeshClient};
pub use config::{MESH_ALPN, MeshLimits, TransportKind};
pub use error::MeshError;
pub use observe::{MeshObserver, OpenConnectionInfo, open_connections};
pub use server::{MeshServer, MeshServerHandle};
pub use service::{MeshService, PeerInfo, ResponsePart};
pub use tcp::{SameHostRoute, kernel_boot_id, prepare_socket_path};
pub use tls::{ClientTls, ServerTls, hard_age, mesh_tls_settings};
