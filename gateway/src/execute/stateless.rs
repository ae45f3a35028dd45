//! Answers given without the session when its owner cannot be confirmed (opt-in,
//! `--stateless-when-unknown`): only for methods whose answer does not depend on the
//! session's state.

use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use tracing::debug;

use super::ACCEPT_BOTH;
use super::Executor;
use super::upstream::{UpstreamError, UpstreamReply};
use crate::body;
use crate::link::UpstreamLink;
use crate::mcp::{self, GatewayError};
use crate::reply::{HEADER_STATELESS, Reply};
use crate::request::Call;
use crate::worker::Route;

/// Methods whose answer does not depend on the session's state, so a worker may
/// answer them without the session when its owner cannot be reached (opt-in).
pub const STATELESS_METHODS: &[&str] = &[
    "ping",
    "tools/list",
    "resources/list",
    "resources/templates/list",
    "prompts/list",
];

impl Executor<'_> {
    /// Answers a session-independent method without the session, because its owner
    /// cannot be confirmed (`unknown` is the refusal it replaces). `ping` is answered
    /// here; a list method runs on a short-lived upstream session of its own, opened
    /// and ended around it. The reply says so in `mcpgw-stateless: 1`.
    pub async fn answer_statelessly(
        &self,
        call: Call,
        unknown: GatewayError,
    ) -> Result<Reply, GatewayError> {
        let id = call.id();
        let method = call.message.as_ref().and_then(|m| m.method()).unwrap_or("");
        let mut reply = if method == "ping" {
            let body = serde_json::json!({ "jsonrpc": "2.0", "id": id, "result": {} });
            Reply::json(StatusCode::OK, bytes::Bytes::from(body.to_string()))
        } else {
            match self.on_temporary_session(&call).await {
                Ok(reply) => reply,
                Err(e) => {
                    debug!(error = %e, "stateless answer failed; answering unknown");
                    return Err(unknown);
                }
            }
        };
        reply
            .headers
            .insert(HEADER_STATELESS, HeaderValue::from_static("1"));
        Ok(reply)
    }

    async fn on_temporary_session(&self, call: &Call) -> Result<Reply, UpstreamError> {
        let version = call
            .headers
            .get(mcp::HEADER_PROTOCOL_VERSION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("2025-11-25")
            .to_owned();
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, ACCEPT_BOTH);
        // A temporary upstream session: its own upstream session id, or a child
        // process of its own for a stdio upstream.
        let route = &self.worker.routes[call.upstream];
        let streams = self.worker.new_streams();
        let (link, opened) = self
            .open_link(
                route,
                headers.clone(),
                initialize_request(&version),
                "stateless",
                &streams,
            )
            .await?;
        let _ = opened.body.collect().await;
        if let Ok(version) = HeaderValue::from_str(&version) {
            headers.insert(mcp::HEADER_PROTOCOL_VERSION, version);
        }
        let answered = self.ask_initialized(route, &link, headers, call).await;
        // Lists are small: read the answer whole, so the session can end before it
        // is returned.
        let collected = match answered {
            Ok(answered) => read_whole(route, answered).await,
            Err(e) => Err(e),
        };
        self.close_link(route, &link).await;
        let (status, content_type, collected) = collected?;
        let mut reply_headers = HeaderMap::new();
        if let Some(content_type) = content_type {
            reply_headers.insert(CONTENT_TYPE, content_type);
        }
        Ok(Reply {
            status,
            headers: reply_headers,
            body: body::full(collected),
        })
    }

    /// Completes the temporary session's handshake (`notifications/initialized`),
    /// then sends the client's call on it.
    async fn ask_initialized(
        &self,
        route: &Route,
        link: &UpstreamLink,
        headers: HeaderMap,
        call: &Call,
    ) -> Result<UpstreamReply, UpstreamError> {
        let initialized = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        let acked = self
            .send_on_link(
                route,
                link,
                Method::POST,
                headers,
                bytes::Bytes::from_static(initialized),
            )
            .await?;
        let _ = acked.body.collect().await;
        self.send_on_link(
            route,
            link,
            Method::POST,
            call.headers.clone(),
            call.body.clone(),
        )
        .await
    }
}

/// The gateway's own `initialize`, in the protocol version the client asked for.
fn initialize_request(version: &str) -> bytes::Bytes {
    let initialize = serde_json::json!({
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {
            "protocolVersion": version,
            "capabilities": {},
            "clientInfo": { "name": "mcpgw", "version": env!("CARGO_PKG_VERSION") },
        },
    });
    bytes::Bytes::from(initialize.to_string())
}

/// The answer's status, content type and whole body.
async fn read_whole(
    route: &Route,
    answered: UpstreamReply,
) -> Result<(StatusCode, Option<HeaderValue>, bytes::Bytes), UpstreamError> {
    let status = answered.status;
    let content_type = answered.headers.get(CONTENT_TYPE).cloned();
    answered
        .body
        .collect()
        .await
        .map(|c| (status, content_type, c.to_bytes()))
        .map_err(|e| UpstreamError::Failed {
            name: route.name().to_owned(),
            detail: e.to_string(),
        })
}
