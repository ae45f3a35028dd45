//! What can go wrong forwarding a request, sorted by what the gateway may conclude.

use std::io;

use mcpgw_wire::{ErrorFrame, ErrorKind, WireError};

/// Why a forwarded request failed. Each variant says whether the owner is provably
/// gone, whether the request may have run, and what to do next; see
/// [`proves_peer_gone`](Self::proves_peer_gone) and
/// [`may_have_executed`](Self::may_have_executed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// Nothing listens at the peer's mesh address (TCP reset, ICMP port unreachable;
    /// over Redis, a request that reached no subscriber on the worker's channel):
    /// proof that the owner process is gone. The request was not sent (over Redis:
    /// received by no one). `addr` is the Redis channel there.
    #[error("mesh peer {addr} refused the connection: the worker that owned it is gone")]
    Refused {
        /// The address dialled.
        addr: String,
    },
    /// The address answered as another worker: proof that the expected worker is gone
    /// from it. The request was not sent.
    #[error(
        "mesh peer {addr} answers as worker {found:?}, not {expected:?}: the expected worker is gone"
    )]
    WrongWorker {
        /// The address dialled.
        addr: String,
        /// The worker id the directory gave.
        expected: String,
        /// The worker id that answered.
        found: String,
    },
    /// The peer's certificate is a valid mesh leaf, but not of the member registered
    /// for the worker expected there: it may not speak for that worker, nor tell that
    /// the worker left. Not proof of anything (the expected worker may be alive
    /// elsewhere, or its address was taken by another host); the request was not sent.
    #[error(
        "mesh peer {addr} presents identity {presented}, but worker {expected:?} registered \
         {registered}: refusing to treat it as that worker (check that every host's leaf \
         names its own member, and that no address is shared by two hosts)"
    )]
    IdentityMismatch {
        /// The address dialled.
        addr: String,
        /// The worker id the directory gave.
        expected: String,
        /// The identity registered with that worker's lease.
        registered: String,
        /// The identity in the peer's certificate.
        presented: String,
    },
    /// The peer did not complete the connection in time. Not proof of anything: the
    /// owner may be alive behind a slow or partitioned network. The request was not sent.
    #[error(
        "mesh peer {addr} did not complete the connection within the connect timeout: \
         ownership unknown, retry later"
    )]
    ConnectTimeout {
        /// The address dialled.
        addr: String,
    },
    /// Connecting failed for another reason (no route, reset during the handshake,
    /// bad address). Not proof. The request was not sent.
    #[error("cannot connect to mesh peer {addr}: {reason}")]
    Connect {
        /// The address dialled.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// TLS rejected a certificate, ours or the peer's: a mesh configuration problem
    /// (wrong CA bundle, expired leaf, missing mesh identity). The request was not sent.
    #[error("mesh TLS handshake with {addr} failed: {reason}")]
    Tls {
        /// The address dialled.
        addr: String,
        /// What the handshake rejected, and what to do.
        reason: String,
    },
    /// The peer's mesh protocol versions and ours have none in common (two releases
    /// apart). The request was not sent.
    #[error(
        "mesh peer {addr} speaks protocol version {theirs}, this worker up to {ours} and \
         the one before: workers one release apart forward to each other, two apart do \
         not; upgrade the older workers one release at a time"
    )]
    VersionMismatch {
        /// The address dialled.
        addr: String,
        /// Our version.
        ours: u32,
        /// The peer's version.
        theirs: u32,
    },
    /// The request does not fit in one mesh frame. It was not sent.
    #[error("request cannot be forwarded: {0}")]
    RequestTooLarge(String),
    /// This worker already has as many exchanges of this class in flight to the peer
    /// as its budget allows (short requests and long-lived streams have separate
    /// budgets). Not proof of anything; the request was not sent; retry shortly.
    #[error(
        "mesh budget exhausted: {limit} {class} exchanges already in flight to {addr}; \
         the request was not sent, retry shortly"
    )]
    BudgetExhausted {
        /// The address dialled.
        addr: String,
        /// Which budget: `short-request` or `long-lived-stream`.
        class: &'static str,
        /// The budget's limit per peer.
        limit: usize,
    },
    /// The owner answered with an error frame (for example `NotOwner`, `Busy`,
    /// `Draining`, `DeadlineExceeded`).
    #[error("mesh peer answered with an error: {0}")]
    Remote(ErrorFrame),
    /// The connection died after the request was sent: its outcome is unknown. Never
    /// retry it elsewhere; answer "outcome unknown".
    #[error("mesh connection lost after the request was sent, outcome unknown: {0}")]
    LostMidResponse(String),
    /// The request's deadline (plus grace) passed at the caller without an answer from
    /// the owner; the request was cancelled and its outcome is unknown.
    #[error("mesh peer did not finish the response before the deadline: outcome unknown")]
    DeadlineExceeded,
    /// The peer broke the mesh protocol (unexpected or undecodable frame). If the
    /// request had been sent, its outcome is unknown.
    #[error("mesh protocol violation by peer: {0}")]
    Protocol(String),
    /// A local socket could not be set up (bind, socket options).
    #[error("mesh socket setup failed: {0}")]
    Io(String),
    /// The TLS config cannot be used for this transport (the Redis transport takes
    /// none: it has its own constructors).
    #[error("mesh TLS config unusable: {0}")]
    Config(String),
    /// The Redis that carries the Redis transport could not be used: bad URL,
    /// unreachable, it refused a command, this worker's reply subscription is down, or
    /// the worker's request channel already has a subscriber. Not proof of anything;
    /// the request was not sent.
    #[error("mesh Redis transport: {0}")]
    Redis(String),
}

impl MeshError {
    /// True when the error proves that the expected owner is gone from its address
    /// (refused, or answered as another worker). Everything else is "unknown".
    pub fn proves_peer_gone(&self) -> bool {
        matches!(
            self,
            MeshError::Refused { .. } | MeshError::WrongWorker { .. }
        )
    }

    /// True when the request may have run at the owner, so it must not be retried
    /// elsewhere (docs/architecture.md: "forwarded, then the owner died before answering").
    pub fn may_have_executed(&self) -> bool {
        match self {
            MeshError::LostMidResponse(_) | MeshError::DeadlineExceeded => true,
            MeshError::Protocol(_) => true,
            MeshError::Remote(frame) => matches!(
                frame.kind,
                ErrorKind::DeadlineExceeded | ErrorKind::Cancelled | ErrorKind::Internal
            ),
            _ => false,
        }
    }

    /// True when a budget refused the request, here ([`MeshError::BudgetExhausted`]) or
    /// at the owner (`Error(Busy)`): the owner is alive and the request did not run, so
    /// the answer is "busy, retry shortly", never "gone" or "unknown".
    pub fn is_budget_exhausted(&self) -> bool {
        match self {
            MeshError::BudgetExhausted { .. } => true,
            MeshError::Remote(frame) => frame.kind == ErrorKind::Busy,
            _ => false,
        }
    }

    /// The owner's error frame, if the owner answered with one.
    pub fn remote(&self) -> Option<&ErrorFrame> {
        match self {
            MeshError::Remote(frame) => Some(frame),
            _ => None,
        }
    }
}

impl From<io::Error> for MeshError {
    fn from(e: io::Error) -> Self {
        MeshError::Io(e.to_string())
    }
}

/// What a frame reader saw instead of the frame it wanted, in a form both transports
/// share. `Tls` carries a rustls explanation when the stream died of a TLS alert.
#[derive(Debug)]
pub(crate) enum LinkError {
    /// The stream ended or broke; `tls` is set when a TLS alert is the cause.
    Broken { reason: String, tls: Option<String> },
    /// A frame arrived that did not decode or was too large (stream still in sync).
    BadFrame(WireError),
}

impl LinkError {
    pub(crate) fn reason(&self) -> String {
        match self {
            LinkError::Broken { reason, .. } => reason.clone(),
            LinkError::BadFrame(e) => e.to_string(),
        }
    }
}

/// Digs a TLS cause out of an I/O error from tokio-rustls or quinn, in words that say
/// what to do; `None` when the error is not about TLS.
pub(crate) fn tls_cause(err: &io::Error) -> Option<String> {
    let inner = err.get_ref()?;
    if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
        return Some(mcpgw_certs::explain_tls_error(tls));
    }
    if let Some(quinn::ReadError::ConnectionLost(conn)) = inner.downcast_ref::<quinn::ReadError>() {
        return quic_tls_cause(conn);
    }
    if let Some(quinn::WriteError::ConnectionLost(conn)) = inner.downcast_ref::<quinn::WriteError>()
    {
        return quic_tls_cause(conn);
    }
    None
}

/// The TLS cause of a QUIC connection error: a CONNECTION_CLOSE carrying a crypto
/// error code (0x100 + TLS alert) from the peer, or a local TLS failure.
pub(crate) fn quic_tls_cause(err: &quinn::ConnectionError) -> Option<String> {
    let code = match err {
        quinn::ConnectionError::ConnectionClosed(close) => u64::from(close.error_code),
        quinn::ConnectionError::TransportError(te) => u64::from(te.code),
        _ => return None,
    };
    if !(0x100..=0x1ff).contains(&code) {
        return None;
    }
    if let quinn::ConnectionError::TransportError(te) = err {
        // A local failure: the reason is rustls's own text about the peer's certificate.
        return Some(format!("{}: {}", te.code, te.reason));
    }
    let alert = rustls::AlertDescription::from((code & 0xff) as u8);
    Some(mcpgw_certs::explain_tls_error(
        &rustls::Error::AlertReceived(alert),
    ))
}
