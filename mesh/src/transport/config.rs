//! What a mesh endpoint is made with, on either side: which transport carries the
//! traffic ([`TransportKind`]), the endpoint's limits ([`MeshLimits`], one set of
//! defaults for a first run and the tests), and the ALPN id both transports require.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

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

/// Limits of one mesh endpoint (server or client). The defaults are the production
/// values: the gateway's `[mesh]` settings start from them, and the mesh's own tests
/// run with them unless a test sets its own number. Serializable, so the gateway's
/// configuration holds them as they are and hands them to its workers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
            max_in_flight_per_peer: 1024,
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
