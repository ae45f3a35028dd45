//! Clients of upstream MCP servers. Each transport turns one MCP HTTP exchange into
//! its own terms: Streamable HTTP (`http.rs`, with TLS from `tls.rs` for `https://`)
//! passes it on as is; stdio (`stdio.rs`) runs a child process per session and maps
//! the exchange onto newline-delimited JSON-RPC (`conversation.rs`). The gateway's
//! own requests to an upstream read their answer whole with `answer.rs`.

mod answer;
mod conversation;
mod http;
pub mod stdio;
pub(crate) mod tls;

use crate::reason::Reason;
use std::time::Duration;

use ::http::{HeaderMap, Method, StatusCode};
use bytes::Bytes;

pub(crate) use self::answer::read_answer;
pub use self::http::HttpUpstream;
pub use self::stdio::{StdioProcess, StdioUpstream};
use crate::body::ReplyBody;
use crate::config::{Limits, UpstreamConfig, UpstreamTarget, VirtualServer};

/// One request to an upstream, already translated to the upstream's session.
pub struct UpstreamRequest {
    pub method: Method,
    /// Headers to send (MCP headers, accept, content type); never client credentials.
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Time allowed until the upstream starts answering.
    pub timeout: Duration,
}

/// The upstream's answer: status, headers, and a body that streams as it arrives.
pub struct UpstreamReply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: ReplyBody,
}

/// Why an upstream exchange failed before it produced an answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The upstream could not be reached (refused, DNS, connect timeout).
    #[error("upstream {name} unreachable: {detail}")]
    Unreachable { name: String, detail: String },
    /// The upstream accepted the request but did not start answering in time.
    #[error("upstream {name} did not answer within {timeout:?}")]
    Timeout { name: String, timeout: Duration },
    /// The exchange broke after it started.
    #[error("upstream {name} failed: {detail}")]
    Failed { name: String, detail: String },
    /// The TLS handshake failed: a certificate the gateway does not trust, or one the
    /// upstream does not accept.
    #[error("upstream {name}: TLS handshake failed: {detail}")]
    Tls { name: String, detail: String },
    /// This worker already runs as many child processes of the upstream as allowed.
    #[error(
        "upstream {name}: this worker runs its maximum of {max} processes of it; retry \
         (another worker may have room) or end idle sessions"
    )]
    ProcessLimit { name: String, max: usize },
    /// This worker already runs as many child processes of the upstream for one
    /// principal (public mode: one client address) as allowed.
    #[error(
        "upstream {name}: this {scope} already runs its maximum of {max} processes of it \
         on this worker: end sessions you no longer use (DELETE), or wait for idle ones \
         to expire"
    )]
    ProcessQuota {
        name: String,
        max: usize,
        /// `principal` or `client address`.
        scope: &'static str,
    },
    /// The upstream's process could not be started.
    #[error("upstream {name}: cannot start its process: {detail}")]
    Spawn { name: String, detail: String },
    /// The upstream's settings cannot be used (a CA bundle that holds no CA); found
    /// when the worker starts.
    #[error("{0}")]
    Config(String),
    /// The session's upstream process has exited; the session ended with it.
    #[error("upstream {name}: its process for this session {detail}")]
    Exited { name: String, detail: String },
    /// The request was written to the session's process, which then ended before it
    /// answered: the request may have run; the session ended with the process.
    #[error(
        "upstream {name}: its process for this session {detail} after this request was \
         sent to it"
    )]
    ExitedWhileRunning { name: String, detail: String },
}

impl UpstreamError {
    /// The HTTP status and a short machine-readable reason for the client.
    pub fn status_and_reason(&self) -> (StatusCode, Reason) {
        match self {
            UpstreamError::Unreachable { .. } => {
                (StatusCode::BAD_GATEWAY, Reason::UpstreamUnreachable)
            }
            UpstreamError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, Reason::UpstreamTimeout),
            UpstreamError::Failed { .. } => (StatusCode::BAD_GATEWAY, Reason::UpstreamFailed),
            UpstreamError::Tls { .. } => (StatusCode::BAD_GATEWAY, Reason::UpstreamTls),
            UpstreamError::ProcessLimit { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, Reason::ProcessLimit)
            }
            UpstreamError::ProcessQuota { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, Reason::ProcessQuota)
            }
            UpstreamError::Spawn { .. } => (StatusCode::BAD_GATEWAY, Reason::UpstreamSpawnFailed),
            UpstreamError::Exited { .. } => (StatusCode::BAD_GATEWAY, Reason::UpstreamExited),
            UpstreamError::ExitedWhileRunning { .. } => {
                (StatusCode::BAD_GATEWAY, Reason::OutcomeUnknown)
            }
            UpstreamError::Config(_) => (StatusCode::INTERNAL_SERVER_ERROR, Reason::Config),
        }
    }
}

/// A configured upstream MCP server.
pub enum Upstream {
    Http(HttpUpstream),
    Stdio(StdioUpstream),
    /// A virtual server: its sessions are federated over its members' (`federation`).
    Virtual(VirtualUpstream),
}

/// The client side of a virtual server: its name and members; each member is reached
/// through its own upstream's client.
pub struct VirtualUpstream {
    pub name: String,
    pub server: VirtualServer,
    /// What 2026-07-28 requests learnt from its members' lists, while they allow it.
    pub catalogs: crate::federation::modern::catalog::ModernCatalogs,
}

impl Upstream {
    pub fn new(config: &UpstreamConfig, limits: &Limits) -> Result<Upstream, UpstreamError> {
        Ok(match &config.target {
            UpstreamTarget::Http { url, tls } => Upstream::Http(HttpUpstream::new(
                &config.name,
                url,
                tls,
                limits.upstream_connect_timeout,
            )?),
            UpstreamTarget::Stdio(command) => {
                Upstream::Stdio(StdioUpstream::new(&config.name, command.clone()))
            }
            UpstreamTarget::Virtual(server) => Upstream::Virtual(VirtualUpstream {
                name: config.name.clone(),
                server: server.clone(),
                catalogs: Default::default(),
            }),
        })
    }
}
