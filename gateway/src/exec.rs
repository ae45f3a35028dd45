//! The local execution path: runs a checked call against this worker's upstream
//! sessions. A forwarded request from another worker runs through here too, so the
//! owner executes it exactly as if its client had connected directly.

use std::sync::Arc;

use http::header::{ACCEPT, CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use tracing::{debug, warn};

use crate::body::{self, ReplyBody};
use crate::mcp::{self, Era, GatewayError};
use crate::request::Call;
use crate::session::{self, Session};
use crate::upstream::{UpstreamError, UpstreamReply, UpstreamRequest};
use crate::worker::Worker;

/// An answer on its way to the client: status, headers and a streaming body.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: ReplyBody,
}

impl Reply {
    pub fn from_error(error: &GatewayError) -> Reply {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(seconds) = error.retry_after {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if error.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"mcpgw\""),
            );
        }
        Reply {
            status: error.status,
            headers,
            body: body::full(error.body()),
        }
    }
}

/// The worker that executed the request (the session's owner). With
/// [`HEADER_EDGE_WORKER`] it shows clients and benchmarks whether a request was
/// forwarded. Worker ids are not secret: they are in every session id.
pub const HEADER_OWNER_WORKER: &str = "mcpgw-owner-worker";
/// The worker that received the request from the client.
pub const HEADER_EDGE_WORKER: &str = "mcpgw-edge-worker";

const ACCEPT_BOTH: HeaderValue = HeaderValue::from_static("application/json, text/event-stream");

impl Worker {
    /// Runs `call` here. `session` is the local session the call names, already looked
    /// up by the caller (None for initialize and modern calls).
    pub async fn execute_local(
        self: &Arc<Self>,
        call: Call,
        session: Option<Arc<Session>>,
    ) -> Result<Reply, GatewayError> {
        let mut reply = match (call.era, session) {
            (Era::Modern, _) => self.pass_through(call).await,
            (Era::Legacy, None) if call.is_initialize() => self.open_session(call).await,
            (Era::Legacy, None) => Err(GatewayError::session_not_found().with_id(call.id())),
            (Era::Legacy, Some(session)) => self.run_in_session(call, session).await,
        }?;
        reply
            .headers
            .insert(HEADER_OWNER_WORKER, self.id_header.clone());
        Ok(reply)
    }

    /// 2026-07-28: no session; the request goes upstream as it came.
    async fn pass_through(&self, call: Call) -> Result<Reply, GatewayError> {
        let id = call.id();
        let reply = self
            .send_upstream(call.upstream, call.method, call.headers, call.body, None)
            .await
            .map_err(|e| upstream_error(e, id))?;
        Ok(relay(reply, None))
    }

    /// Legacy `initialize`: opens this client's own upstream session, then mints the
    /// client-facing id and registers ownership.
    async fn open_session(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        let id = call.id();
        self.admit_new_session()
            .map_err(|e| e.with_id(id.clone()))?;
        let upstream_index = call.upstream;
        let reply = self
            .send_upstream(upstream_index, Method::POST, call.headers, call.body, None)
            .await
            .map_err(|e| upstream_error(e, id.clone()))?;
        if !reply.status.is_success() {
            // The upstream refused initialize: its answer is the truth for the client.
            return Ok(relay(reply, None));
        }
        let upstream_session_id = reply.headers.get(mcp::HEADER_SESSION_ID).cloned();
        let session_id = session::mint_session_id(&self.id).map_err(|e| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                "entropy_unavailable",
                format!("could not draw random bytes for a session id: {e}"),
            )
            .with_id(id.clone())
        })?;
        let session = Session {
            id: session_id.clone(),
            upstream: upstream_index,
            upstream_session_id,
            principal: call.auth.principal.clone(),
        };
        if let Err(error) = self.claim_session(&session_id).await {
            // Never hand out a session the fleet cannot route to: end it upstream.
            self.end_upstream_session(&session).await;
            return Err(error.with_id(id));
        }
        self.sessions.insert(session);
        debug!(session = %session_id, upstream = self.upstreams[upstream_index].name(), "session opened");
        let header = HeaderValue::from_str(&session_id).map_err(|_| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                "bad_session_id",
                "minted session id is not a valid header value",
            )
        })?;
        Ok(relay(reply, Some(header)))
    }

    fn admit_new_session(&self) -> Result<(), GatewayError> {
        if self.draining() {
            return Err(GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                "draining",
                "this worker is draining and takes no new sessions: retry, another worker will take it",
            )
            .with_retry_after(1));
        }
        let max = self.config.limits.max_sessions;
        if self.sessions.len() >= max {
            return Err(GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                "session_limit",
                format!("this worker holds its maximum of {max} sessions: retry later or end idle sessions"),
            )
            .with_retry_after(1));
        }
        Ok(())
    }

    async fn run_in_session(
        &self,
        call: Call,
        session: Arc<Session>,
    ) -> Result<Reply, GatewayError> {
        let id = call.id();
        if session.principal != call.auth.principal {
            // Another principal learns nothing about the session, not even that it exists.
            return Err(GatewayError::session_not_found().with_id(id));
        }
        if call.method == Method::DELETE {
            self.end_session(&session).await;
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return Ok(Reply {
                status: StatusCode::OK,
                headers,
                body: body::empty(),
            });
        }
        let reply = self
            .send_upstream(
                session.upstream,
                call.method,
                call.headers,
                call.body,
                session.upstream_session_id.clone(),
            )
            .await
            .map_err(|e| upstream_error(e, id.clone()))?;
        if reply.status == StatusCode::NOT_FOUND && session.upstream_session_id.is_some() {
            // The upstream forgot its session (restart, expiry): ours is gone with it.
            warn!(session = %session.id, "upstream no longer knows the session; ending it");
            self.forget_session(&session.id).await;
            return Err(GatewayError::session_not_found().with_id(id));
        }
        Ok(relay(reply, None))
    }

    /// Ends a session here and upstream (client DELETE, drain).
    pub async fn end_session(&self, session: &Session) {
        self.forget_session(&session.id).await;
        self.end_upstream_session(session).await;
    }

    async fn end_upstream_session(&self, session: &Session) {
        let Some(upstream_id) = session.upstream_session_id.clone() else {
            return;
        };
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, ACCEPT_BOTH);
        match self
            .send_upstream(
                session.upstream,
                Method::DELETE,
                headers,
                bytes::Bytes::new(),
                Some(upstream_id),
            )
            .await
        {
            Ok(reply) => {
                debug!(session = %session.id, status = %reply.status, "upstream session ended")
            }
            Err(e) => debug!(session = %session.id, error = %e, "upstream session end failed"),
        }
    }

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
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            Reply {
                status: StatusCode::OK,
                headers,
                body: body::full(bytes::Bytes::from(body.to_string())),
            }
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
            .insert("mcpgw-stateless", HeaderValue::from_static("1"));
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
        let initialize = serde_json::json!({
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {
                "protocolVersion": version,
                "capabilities": {},
                "clientInfo": { "name": "mcpgw", "version": env!("CARGO_PKG_VERSION") },
            },
        });
        let opened = self
            .send_upstream(
                call.upstream,
                Method::POST,
                headers.clone(),
                bytes::Bytes::from(initialize.to_string()),
                None,
            )
            .await?;
        let upstream_session = opened.headers.get(mcp::HEADER_SESSION_ID).cloned();
        let _ = opened.body.collect().await;
        if let Ok(version) = HeaderValue::from_str(&version) {
            headers.insert(mcp::HEADER_PROTOCOL_VERSION, version);
        }
        let initialized = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        let acked = self
            .send_upstream(
                call.upstream,
                Method::POST,
                headers.clone(),
                bytes::Bytes::from_static(initialized),
                upstream_session.clone(),
            )
            .await?;
        let _ = acked.body.collect().await;
        let answered = self
            .send_upstream(
                call.upstream,
                Method::POST,
                call.headers.clone(),
                call.body.clone(),
                upstream_session.clone(),
            )
            .await?;
        // Lists are small: read the answer whole, so the session can end before it
        // is returned.
        let status = answered.status;
        let content_type = answered.headers.get(CONTENT_TYPE).cloned();
        let collected = answered
            .body
            .collect()
            .await
            .map_err(|e| UpstreamError::Failed {
                name: self.upstreams[call.upstream].name().to_owned(),
                detail: e.to_string(),
            })?
            .to_bytes();
        if upstream_session.is_some() {
            let _ = self
                .send_upstream(
                    call.upstream,
                    Method::DELETE,
                    headers,
                    bytes::Bytes::new(),
                    upstream_session,
                )
                .await;
        }
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

    /// Sends one exchange to an upstream with the session's upstream id.
    async fn send_upstream(
        &self,
        upstream: usize,
        method: Method,
        mut headers: HeaderMap,
        body: bytes::Bytes,
        upstream_session_id: Option<HeaderValue>,
    ) -> Result<UpstreamReply, UpstreamError> {
        if let Some(sid) = upstream_session_id {
            headers.insert(mcp::HEADER_SESSION_ID, sid);
        }
        if !headers.contains_key(ACCEPT) {
            headers.insert(ACCEPT, ACCEPT_BOTH);
        }
        self.upstreams[upstream]
            .send(UpstreamRequest {
                method,
                headers,
                body,
                timeout: self.config.limits.upstream_request_timeout,
            })
            .await
    }
}

/// Builds the client's reply from the upstream's: status and content type pass through,
/// the upstream's session id is replaced by ours, SSE is re-chunked per event.
fn relay(reply: UpstreamReply, session_header: Option<HeaderValue>) -> Reply {
    let mut headers = HeaderMap::new();
    let is_sse = reply
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if let Some(content_type) = reply.headers.get(CONTENT_TYPE) {
        headers.insert(CONTENT_TYPE, content_type.clone());
    }
    if let Some(session) = session_header {
        headers.insert(mcp::HEADER_SESSION_ID, session);
    }
    let body = if is_sse {
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        // Tells nginx-style proxies in front of the gateway not to buffer the stream.
        headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
        body::sse_events(reply.body)
    } else {
        reply.body
    };
    Reply {
        status: reply.status,
        headers,
        body,
    }
}

fn upstream_error(error: UpstreamError, id: serde_json::Value) -> GatewayError {
    let (status, reason) = error.status_and_reason();
    GatewayError::gateway(
        status,
        reason,
        format!("{error}: retry later or check the upstream"),
    )
    .with_id(id)
}
