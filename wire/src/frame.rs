//! The frame types: what one mesh message can say.
//!
//! The enum and field order *is* the wire format (bincode encodes enum variants by
//! their index and struct fields in declaration order). A new frame is appended at the
//! end, in a new [`PROTOCOL_VERSION`], and [`Frame::since`] names the version that
//! introduced it; a frame's shape never changes within the versions a worker speaks.
//! `Hello` and `Welcome` keep their tag and layout in every version, so a peer of
//! another version can always read them: the caller's `Hello` names the newest version
//! it speaks, the owner answers with the version both will speak ([`negotiate`]) or
//! refuses with both numbers, and no frame newer than that version is sent on the
//! connection. A worker speaks its own version and the one before
//! ([`OLDEST_PROTOCOL_VERSION`]), so old and new workers forward to each other for
//! the length of a rolling upgrade; `tests/golden.rs` keeps the previous version's
//! frames as bytes its code wrote.

use bytes::Bytes;
use wincode::{SchemaRead, SchemaWrite};

/// The newest mesh protocol version this code speaks, carried in [`Frame::Hello`].
///
/// History: 2 reshaped [`AuthContext`] (mode, subject, scopes, expiry, route) for edge
/// authentication with JWTs, and (separately) added the TCP mesh's per-exchange credit
/// frames; 3 is both together; 4 adds [`Frame::GoAway`].
pub const PROTOCOL_VERSION: u32 = 4;

/// The oldest version this code still speaks: the one before [`PROTOCOL_VERSION`].
pub const OLDEST_PROTOCOL_VERSION: u32 = 3;

/// The version an owner that speaks `oldest..=newest` and a caller whose newest is
/// `callers` will speak: the newest both know. `None` when they share none (two
/// versions apart), which the owner refuses, naming both numbers.
pub fn negotiate(oldest: u32, newest: u32, callers: u32) -> Option<u32> {
    let agreed = newest.min(callers);
    (agreed >= oldest).then_some(agreed)
}

/// One mesh message.
#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub enum Frame {
    /// Caller → owner, first frame of every TCP connection and of a QUIC connection's
    /// first stream: who is calling, and which worker the caller expects to reach.
    Hello {
        /// The caller's [`PROTOCOL_VERSION`].
        version: u32,
        /// The caller's worker id, for the owner's logs.
        worker_id: String,
        /// The worker id the directory gave for this address. The owner does not
        /// refuse a mismatch: it answers with its own id and the caller decides,
        /// because "this address answers as another worker" is proof for the caller.
        expect_worker_id: String,
    },
    /// Owner → caller, answer to `Hello`: the owner's version and real worker id.
    Welcome {
        /// The owner's [`PROTOCOL_VERSION`].
        version: u32,
        /// The worker id of the process that holds this mesh endpoint.
        worker_id: String,
    },
    /// Caller → owner: run this request.
    Request(Box<RequestFrame>),
    /// Owner → caller: the response status and headers; precedes any `Chunk`.
    Head(ResponseHead),
    /// Owner → caller: one body chunk. An SSE event is one chunk, relayed as it comes.
    Chunk(Bytes),
    /// Owner → caller: the response is complete.
    End,
    /// Either direction: the request (or the connection, before `Welcome`) failed.
    Error(ErrorFrame),
    /// Caller → owner: the caller gave up; the owner stops work for this request.
    Cancel,
    /// Caller → owner, on a multiplexed (TCP) connection: the caller consumed this many
    /// more body bytes of the exchange, so the owner may send that many more. Each
    /// exchange starts with a window agreed by configuration; credit keeps one slow
    /// reader from stalling the other exchanges on its connection (as HTTP/2's
    /// `WINDOW_UPDATE` does). QUIC has stream flow control of its own and never sends it.
    Credit(u32),
    /// Owner → caller, on a multiplexed (TCP) connection, since version 4: the owner is
    /// draining; exchanges in flight finish, and the caller sends no new one here (it
    /// retires the connection, as at its maximum age).
    GoAway,
}

impl Frame {
    /// Bytes a [`Frame::Chunk`] body adds to its payload (the `u32` enum tag and the
    /// `u64` length), so a sender can split a payload to fit the maximum frame size.
    pub const CHUNK_OVERHEAD: usize = 12;

    /// The largest body chunk one frame of at most `max_frame` bytes carries (at least
    /// one byte, so that splitting a body always makes progress).
    pub fn max_chunk(max_frame: usize) -> usize {
        max_frame.saturating_sub(Self::CHUNK_OVERHEAD).max(1)
    }

    /// The protocol version that introduced this frame: it is never sent on a
    /// connection whose agreed version is older.
    pub fn since(&self) -> u32 {
        match self {
            Frame::GoAway => 4,
            _ => 3,
        }
    }

    /// The variant's name, for log lines that must not print request contents.
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "Hello",
            Frame::Welcome { .. } => "Welcome",
            Frame::Request(_) => "Request",
            Frame::Head(_) => "Head",
            Frame::Chunk(_) => "Chunk",
            Frame::End => "End",
            Frame::Error(_) => "Error",
            Frame::Cancel => "Cancel",
            Frame::GoAway => "GoAway",
            Frame::Credit(_) => "Credit",
        }
    }
}

/// A forwarded client request, already authenticated by the receiving worker.
#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct RequestFrame {
    /// Caller-chosen id, echoed in logs on both sides to correlate one request.
    pub request_id: u64,
    /// The MCP session the request belongs to; `None` for sessionless (modern) requests.
    pub session_id: Option<String>,
    /// The HTTP method of the client request (`POST`, `GET`, `DELETE`).
    pub method: String,
    /// The HTTP path of the client request, with query.
    pub path: String,
    /// The MCP-relevant request headers (names lower-case), in client order.
    pub headers: Vec<(String, String)>,
    /// The request body as the client sent it.
    pub body: Bytes,
    /// What the receiving worker established about the client (docs/architecture.md, invariant 4:
    /// the edge decides auth, once).
    pub auth: AuthContext,
    /// Time left for this request in milliseconds, relative so that clock skew
    /// between hosts does not matter. The owner stops the request when it passes;
    /// `0` means no time is left (the owner refuses it at once), `u32::MAX` is about
    /// 49 days, for streams meant to stay open.
    pub deadline_ms: u32,
}

/// Status and headers of a response, sent before its body.
#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct ResponseHead {
    /// HTTP status code.
    pub status: u16,
    /// Response headers (names lower-case), in order.
    pub headers: Vec<(String, String)>,
}

/// The authentication outcome the receiving worker forwards with a request. It holds
/// what the owner needs to act for the client and never the credential itself: the
/// owner cannot (and need not) verify a token, it trusts the edge because the edge
/// proved by mTLS that it is a mesh worker (docs/architecture.md, invariant 4).
#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct AuthContext {
    /// How the client authenticated; the owner refuses a mode its route does not use.
    pub mode: AuthMode,
    /// Who the client is (the JWT `sub`, the API key's principal, empty in public
    /// mode); the owner checks it against the session's creator.
    pub subject: String,
    /// Scopes the credential grants (JWT `scope`/`scp`), for policies downstream.
    pub scopes: Vec<String>,
    /// Unix time in milliseconds from which the credential is no longer honoured (its
    /// expiry plus the configured leeway); `None` when it never expires. The owner
    /// checks it again when it executes, so a token that expires mid-session stops
    /// working on every worker at the same moment.
    pub expires_at_ms: Option<u64>,
    /// The route (upstream name) the edge authenticated the request for; the owner
    /// refuses a context whose route is not the request path's.
    pub route: String,
}

impl AuthContext {
    /// Whether the credential is still honoured at `now_ms` (Unix milliseconds).
    pub fn honoured_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|deadline| now_ms < deadline)
    }
}

/// How a client authenticated at the receiving worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, SchemaWrite, SchemaRead)]
pub enum AuthMode {
    /// Public mode: no credentials; the subject is empty.
    Public,
    /// A static API key (bearer token) from the gateway's token file.
    ApiKey,
    /// A JWT access token verified by the gateway (OAuth 2.1 bearer).
    Jwt,
}

impl AuthMode {
    /// The name used in configuration, logs and error messages.
    pub fn name(self) -> &'static str {
        match self {
            AuthMode::Public => "public",
            AuthMode::ApiKey => "api-key",
            AuthMode::Jwt => "jwt",
        }
    }
}

/// A failure reported by a peer, for one request or for the connection.
#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct ErrorFrame {
    /// What kind of failure, for the caller's decision table.
    pub kind: ErrorKind,
    /// Human-readable detail, for logs.
    pub message: String,
}

impl ErrorFrame {
    /// An error frame of `kind` with a human-readable `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ErrorFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// Why a peer failed a request or a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, SchemaWrite, SchemaRead)]
pub enum ErrorKind {
    /// The peers speak different protocol versions; upgrade the older worker.
    VersionMismatch,
    /// A frame did not decode or came out of order; the request was not run.
    Malformed,
    /// A frame exceeded the receiver's maximum frame size; the request was not run.
    TooLarge,
    /// The owner is at its in-flight limit for this peer; retry later.
    Busy,
    /// The owner does not hold that session ("not mine"); ask the directory again.
    NotOwner,
    /// The owner is shutting down and takes no new requests.
    Draining,
    /// The request's deadline passed at the owner; its outcome is unknown.
    DeadlineExceeded,
    /// The request was cancelled before it completed.
    Cancelled,
    /// The owner failed for a reason of its own; see the message.
    Internal,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_is_honoured_until_its_deadline_and_not_at_it() {
        let mut auth = AuthContext {
            mode: AuthMode::Jwt,
            subject: "alice".into(),
            scopes: Vec::new(),
            expires_at_ms: Some(1_000),
            route: "demo".into(),
        };
        assert!(auth.honoured_at(999));
        assert!(!auth.honoured_at(1_000));
        auth.expires_at_ms = None;
        assert!(auth.honoured_at(u64::MAX));
    }
}
