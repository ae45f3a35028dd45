//! Local execution: runs a checked call against this worker's upstream sessions. A
//! forwarded request from another worker runs through here too, so the owner executes
//! it exactly as if its client had connected directly.

pub mod stateless;
pub mod upstream;

use std::sync::Arc;

use http::header::{ACCEPT, CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use tracing::{debug, warn};

use crate::body;
use crate::mcp::{self, Era, GatewayError};
use crate::reply::{HEADER_OWNER_WORKER, Reply};
use crate::request::Call;
use crate::session::{self, Session, SessionUse};
use crate::worker::Worker;
use upstream::{UpstreamError, UpstreamReply, UpstreamRequest};

/// What the gateway asks an upstream to answer in: JSON or a stream of events.
pub(crate) const ACCEPT_BOTH: HeaderValue =
    HeaderValue::from_static("application/json, text/event-stream");

impl Worker {
    /// Runs `call` here. `session` is the local session the call names, already looked
    /// up by the caller (None for initialize and modern calls).
    pub async fn execute_local(
        self: &Arc<Self>,
        call: Call,
        session: Option<SessionUse>,
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
            .map_err(|e| upstream_error(e, id.clone()))?;
        Ok(self.relay(reply, None, &id))
    }

    /// Legacy `initialize`: opens this client's own upstream session, then mints the
    /// client-facing id and registers ownership.
    async fn open_session(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        let id = call.id();
        let quota_key = call.quota_key();
        self.admit_new_session(&quota_key)
            .map_err(|e| e.with_id(id.clone()))?;
        let upstream_index = call.upstream;
        let reply = self
            .send_upstream(upstream_index, Method::POST, call.headers, call.body, None)
            .await
            .map_err(|e| upstream_error(e, id.clone()))?;
        if !reply.status.is_success() {
            // The upstream refused initialize: its answer is the truth for the client.
            return Ok(self.relay(reply, None, &id));
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
        let session = Session::new(
            session_id.clone(),
            upstream_index,
            upstream_session_id,
            call.auth.subject.clone(),
            quota_key,
        );
        if let Err(error) = self.claim_session(&session).await {
            // Never hand out a session the fleet cannot route to: end it upstream.
            self.end_upstream_session(&session).await;
            return Err(error.with_id(id));
        }
        self.sessions.insert(session);
        debug!(session = %session::short(&session_id), upstream = self.upstreams[upstream_index].name(), "session opened");
        let header = HeaderValue::from_str(&session_id).map_err(|_| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                "bad_session_id",
                "minted session id is not a valid header value",
            )
        })?;
        Ok(self.relay(reply, Some(header), &id))
    }

    fn admit_new_session(&self, quota_key: &str) -> Result<(), GatewayError> {
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
        // Standalone, this worker's count is the whole count; in a fleet the directory
        // keeps the fleet-wide one when the session is claimed.
        let quota = self.config.limits.max_sessions_per_principal;
        if self.fleet().is_none() && quota > 0 && self.sessions.count_for(quota_key) >= quota {
            return Err(quota_exceeded(quota, quota_key));
        }
        Ok(())
    }

    async fn run_in_session(&self, call: Call, session: SessionUse) -> Result<Reply, GatewayError> {
        let id = call.id();
        if session.principal != call.auth.subject || session.upstream != call.upstream {
            // Another principal (or a request on another route, authenticated by that
            // route's rules) learns nothing about the session, not even that it exists.
            return Err(GatewayError::session_not_found().with_id(id));
        }
        if call.method == Method::DELETE {
            self.end_session(&session).await;
            return Ok(Reply::json(StatusCode::OK, bytes::Bytes::new()));
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
            warn!(session = %session::short(&session.id), "upstream no longer knows the session; ending it");
            self.forget_session(&session.id).await;
            return Err(GatewayError::session_not_found().with_id(id));
        }
        let mut reply = self.relay(reply, None, &id);
        // The session stays in use until its answer is fully sent: a held GET stream
        // keeps it from expiring.
        reply.body = body::hold(reply.body, session);
        Ok(reply)
    }

    /// Ends a session here and upstream (client DELETE, drain).
    pub async fn end_session(&self, session: &Session) {
        self.forget_session(&session.id).await;
        self.end_upstream_session(session).await;
    }

    pub(crate) async fn end_upstream_session(&self, session: &Session) {
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
                debug!(session = %session::short(&session.id), status = %reply.status, "upstream session ended")
            }
            Err(e) => {
                debug!(session = %session::short(&session.id), error = %e, "upstream session end failed")
            }
        }
    }

    /// Sends one exchange to an upstream with the session's upstream id.
    pub(crate) async fn send_upstream(
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

impl Worker {
    /// Builds the client's reply from the upstream's: status and content type pass
    /// through, the upstream's session id is replaced by ours, SSE is re-chunked per
    /// event (an event past the configured size ends the stream with an error event
    /// for request `id`; the session survives).
    pub(crate) fn relay(
        &self,
        reply: UpstreamReply,
        session_header: Option<HeaderValue>,
        id: &serde_json::Value,
    ) -> Reply {
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
            let max = self.config.limits.max_sse_event_bytes;
            body::sse_events(reply.body, max, sse_overflow_event(max, id))
        } else {
            reply.body
        };
        Reply {
            status: reply.status,
            headers,
            body,
        }
    }
}

/// The event sent in place of an upstream event larger than `max` bytes.
fn sse_overflow_event(max: usize, id: &serde_json::Value) -> bytes::Bytes {
    let error = GatewayError::gateway(
        StatusCode::BAD_GATEWAY,
        "upstream_event_too_large",
        format!(
            "the upstream sent an event larger than the gateway's {max}-byte limit; \
             the stream was ended (the session is intact): ask for less, or raise \
             max_sse_event_bytes"
        ),
    )
    .with_id(id.clone());
    let mut event = b"event: message\ndata: ".to_vec();
    event.extend_from_slice(&error.body());
    event.extend_from_slice(b"\n\n");
    bytes::Bytes::from(event)
}

/// 429 for a principal (or client address) at its session quota.
pub(crate) fn quota_exceeded(quota: usize, quota_key: &str) -> GatewayError {
    let scope = if quota_key.starts_with("addr:") {
        "client_address"
    } else {
        "principal"
    };
    GatewayError::gateway(
        StatusCode::TOO_MANY_REQUESTS,
        "session_quota",
        format!(
            "this {} already holds its maximum of {quota} sessions: end sessions you no \
             longer use (DELETE), or wait for idle ones to expire",
            scope.replace('_', " ")
        ),
    )
    .with_data(serde_json::json!({
        "reason": "session_quota", "scope": scope, "limit": quota, "retryable": true,
    }))
    .with_retry_after(QUOTA_RETRY_AFTER_SECONDS)
}

/// Seconds a client at its session quota should wait: sessions free up as clients end
/// them or as idle ones expire, not within a second.
const QUOTA_RETRY_AFTER_SECONDS: u32 = 30;

pub(crate) fn upstream_error(error: UpstreamError, id: serde_json::Value) -> GatewayError {
    let (status, reason) = error.status_and_reason();
    GatewayError::gateway(
        status,
        reason,
        format!("{error}: retry later or check the upstream"),
    )
    .with_id(id)
}
