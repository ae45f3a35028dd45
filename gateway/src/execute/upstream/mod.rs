//! Clients of upstream MCP servers. Each transport turns one MCP HTTP exchange into
//! its own terms; Streamable HTTP is the first, stdio child processes will sit beside
//! it behind the same `Upstream` type.

mod http;

use std::time::Duration;

use ::http::{HeaderMap, Method, StatusCode};
use bytes::Bytes;

pub use self::http::HttpUpstream;
use crate::body::ReplyBody;

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
}

impl UpstreamError {
    /// The HTTP status and a short machine-readable reason for the client.
    pub fn status_and_reason(&self) -> (StatusCode, &'static str) {
        match self {
            UpstreamError::Unreachable { .. } => (StatusCode::BAD_GATEWAY, "upstream_unreachable"),
            UpstreamError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
            UpstreamError::Failed { .. } => (StatusCode::BAD_GATEWAY, "upstream_failed"),
        }
    }
}

/// A configured upstream MCP server.
pub enum Upstream {
    Http(HttpUpstream),
}

impl Upstream {
    pub fn name(&self) -> &str {
        match self {
            Upstream::Http(u) => u.name(),
        }
    }

    pub async fn send(&self, request: UpstreamRequest) -> Result<UpstreamReply, UpstreamError> {
        match self {
            Upstream::Http(u) => u.send(request).await,
        }
    }
}
