//! Redis pub/sub transport: the measured baseline (`--mesh-transport redis`), never the
//! default.
//!
//! The established way to reach the worker that owns a session is to pass the request
//! through Redis pub/sub. mcpgw implements it behind the same [`MeshServer`] /
//! [`MeshClient`] interface as QUIC and TCP, and as well as it can be built (no polling,
//! one Redis round trip per message, `Bytes` end to end), so that benchmarks compare
//! the designs rather than a weak implementation of one of them.
//!
//! # Trust
//!
//! There is no mTLS here: Redis is the trust boundary, as in the baseline design. Any
//! client that may `PUBLISH` on this Redis can send a worker a request with any auth
//! context, so the Redis must be private to the fleet (network policy, ACL user,
//! `rediss://`). [`PeerInfo::identity`] is empty and [`PeerInfo::addr`] unspecified
//! for requests that came this way.
//!
//! # Channels
//!
//! - `{prefix}pool_rpc:{worker_id}`: the worker's request channel. Its mesh server is
//!   the one subscriber, on a dedicated pub/sub connection (docs/architecture.md, invariant 2: a
//!   second subscriber would run each request twice, so binding refuses when the
//!   channel has another one). Callers publish `Request` and `Cancel` there.
//! - `{prefix}pool_reply:{worker_id}`: the worker's reply channel, one per caller
//!   worker rather than one per request: subscribing per request would add two Redis
//!   round trips to every request, and the request could only go out once the
//!   subscription was confirmed. The caller's mesh client is its one subscriber and
//!   routes each reply to its request by the exchange id in the message.
//!
//! The channel follows from the worker id, so the address the directory holds for a
//! Redis worker is informational, and "answers as another worker" cannot happen.
//!
//! # Messages
//!
//! Each payload is a short routing header and one `mcpgw-wire` frame, the bytes
//! [`MeshCodec`] produces (length prefix, bincode-format body); integers big-endian:
//!
//! ```text
//! to the owner:  version u32 | exchange u64 | caller id length u16 | caller id | frame
//! to the caller: version u32 | exchange u64 | frame, or nothing for a keep-alive
//! ```
//!
//! The version, exchange id and caller id keep their place in every protocol version,
//! so an owner of another version can still answer `Error(VersionMismatch)` to the
//! right caller. Exchange ids are the caller's (from a random start, so a reply meant
//! for an earlier process under the same id is not taken for a new request's).
//!
//! A response is `Head`, `Chunk`*, `End` | `Error`, one message each, published as the
//! service produces them, so SSE events arrive one by one. An exchange awaits each
//! `PUBLISH` before the next: that keeps the order, and the reply says how many
//! subscribers got the message.
//!
//! # Refused, unknown, alive
//!
//! - A request `PUBLISH` that reaches no subscriber proves that no process serves the
//!   owner's channel: [`MeshError::Refused`], and the request went nowhere. (During a
//!   Redis restart every worker is briefly unsubscribed, so this proof is only as good
//!   as Redis's uptime; that is inherent to the baseline design.)
//! - An owner whose reply reaches no subscriber knows its caller is gone and stops.
//! - While a response is quiet, the owner publishes a keep-alive every third of its
//!   [`MeshLimits::idle_timeout`]; a caller that hears nothing at all from the owner for
//!   its idle timeout presumes it dead ([`MeshError::LostMidResponse`]), as the QUIC
//!   idle timeout and TCP keepalive do for the other transports. A zero idle timeout
//!   turns both off. The request's deadline bounds the time to the head as usual;
//!   after the head the stream runs on.
//!
//! # Cancellation
//!
//! Dropping a [`ForwardedResponse`] (or the forward future) before the end publishes
//! `Cancel` for its exchange to the owner's channel, and the owner drops the service's
//! stream. A `Cancel` that reaches no subscriber (the owner is re-subscribing) is
//! published again for a while. Pub/sub keeps nothing, so best effort is all there is.
//!
//! # Reconnection
//!
//! Publishing goes over a [`ConnectionManager`], which reconnects by itself. Pub/sub
//! connections do not: each subscription runs in a task that re-subscribes, with
//! backoff, as soon as its stream ends. While the caller's reply subscription is down,
//! every exchange waiting on it fails ([`MeshError::LostMidResponse`]: its replies may
//! be lost) and new forwards wait for it up to the connect timeout.
//!
//! # Layout
//!
//! - `config`: [`RedisTransportConfig`], where Redis is and how channels are named;
//! - `message`: the routing header around each frame (pure, tested without Redis);
//! - `conn`: Redis clients, the publisher, subscriptions that come back by themselves;
//! - `owner`: the request channel's subscriber and the exchanges it serves;
//! - `caller`: publishing requests and routing replies to the exchange they belong to.

mod caller;
mod config;
mod conn;
mod message;
mod owner;

pub(crate) use caller::{RedisClient, RedisExchange};
pub use config::RedisTransportConfig;
pub(crate) use owner::serve;
