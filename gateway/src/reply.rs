//! An answer on its way to the client, whichever worker produced it, and the headers
//! every answer carries.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::body::{self, ReplyBody};
use crate::mcp::GatewayError;

/// The worker that executed the request (the session's owner). With
/// [`HEADER_EDGE_WORKER`] it shows clients and benchmarks whether a request was
/// forwarded. Worker ids are not secret: they are in every session id.
pub const HEADER_OWNER_WORKER: &str = "mcpgw-owner-worker";
/// The worker that received the request from the client.
pub const HEADER_EDGE_WORKER: &str = "mcpgw-edge-worker";
/// On the answer whose request took a session on after its owner left it: why the
/// owner left (`death`, `drain`). Later answers do not carry it.
pub const HEADER_ADOPTED: &str = "mcpgw-adopted";
/// Set on an answer given without the session because its owner could not be
/// confirmed (`--stateless-when-unknown`).
pub const HEADER_STATELESS: &str = "mcpgw-stateless";

/// An answer on its way to the client: status, headers and a streaming body.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: ReplyBody,
}

impl Reply {
    /// A JSON-RPC error answer, with the headers its status calls for.
    pub fn from_error(error: &GatewayError) -> Reply {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(seconds) = error.retry_after {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // RFC 6750: a 401 always carries a challenge; a 403 from edge auth carries its
        // insufficient_scope challenge. The edge adds `resource_metadata` later
        // (`Authenticator::complete_challenge`), where it knows the client's URL.
        if let Some(challenge) =
            crate::auth::metadata::challenge_of(error).and_then(|c| HeaderValue::from_str(&c).ok())
        {
            headers.insert(http::header::WWW_AUTHENTICATE, challenge);
        }
        Reply {
            status: error.status,
            headers,
            body: body::full(error.body()),
        }
    }

    /// A complete JSON answer.
    pub fn json(status: StatusCode, body: bytes::Bytes) -> Reply {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Reply {
            status,
            headers,
            body: body::full(body),
        }
    }
}
