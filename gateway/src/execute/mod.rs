//! Local execution: runs a checked call against this worker's upstream sessions. A
//! forwarded request from another worker runs through here too, so the owner executes
//! it exactly as if its client had connected directly.
//!
//! `mod.rs` opens legacy sessions, runs requests in them and ends them, whatever the
//! upstream's transport (`upstream/`); `streams.rs` makes their SSE answers
//! resumable; `shared.rs` serves 2026-07-28 clients of upstreams that keep state in
//! sessions; `stateless.rs` answers without the session when its owner is unknown.

pub mod shared;
pub mod stateless;
pub mod streams;
pub mod upstream;

use crate::reason::Reason;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{ACCEPT, CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;
use tracing::{debug, warn};

use crate::body::{self, ReplyBody};
use crate::dispatch::refuse;
use crate::link::UpstreamLink;
use crate::mcp::{self, Era, GatewayError};
use crate::reply::{HEADER_OWNER_WORKER, Reply};
use crate::request::Call;
use crate::session::{self, Session, SessionUse};
use crate::worker::{Route, Worker};
use streams::{EventId, SessionStreams};
use upstream::{Upstream, UpstreamError, UpstreamReply, UpstreamRequest};

/// Largest `tools/list` answer read for tool names (metric labels); larger ones pass
/// through unread.
const TOOL_LIST_OBSERVED_BYTES: usize = 1024 * 1024;

/// What the gateway asks an upstream to answer in: JSON or a stream of events.
pub(crate) const ACCEPT_BOTH: HeaderValue =
    HeaderValue::from_static("application/json, text/event-stream");

/// The executing stage: runs a call in this process, in its session (opening, using
/// and ending sessions, their streams and upstream links) or without one. It keeps
/// nothing of its own: the sessions and routes are the worker's, which the router
/// and the lease renewal read as well; it borrows the worker for one call.
#[derive(Clone, Copy)]
pub struct Executor<'w> {
    pub(crate) worker: &'w Arc<Worker>,
}

impl<'w> Executor<'w> {
    pub fn of(worker: &'w Arc<Worker>) -> Self {
        Executor { worker }
    }

    /// The session `call` names, if this worker holds it, held for the exchange. A
    /// lease past its own deadline is revalidated first (one attempt shared by every
    /// request that waits for it); if that fenced the worker, the session is gone.
    ///
    /// A session moving between this worker and another (adopted here, or handed over
    /// by a drain) is waited for first, a bounded time: then it is held here (adopted)
    /// or not (handed over, or its adoption failed), and the caller decides from that.
    pub(crate) async fn hold_session(&self, call: &Call) -> Option<SessionUse> {
        let id = call.session_id.as_deref()?;
        let sessions = &self.worker.sessions;
        let bound = self.transit_wait();
        sessions.wait_transit(id, bound).await;
        let held = || sessions.enter(id);
        let mut local = held();
        // Its move may have begun between the wait and the look: wait for it once more.
        if local.is_none() && sessions.wait_transit(id, bound).await {
            local = held();
        }
        if local.is_some() && !self.worker.lease_confirmed().await {
            return held();
        }
        local
    }

    /// How long a request waits for its session's move between workers: a drain's
    /// grace at most (a handover waits that long for the calls running in the session),
    /// and well within a forward's deadline, so the owner answers before its caller
    /// gives up on it.
    pub(crate) fn transit_wait(&self) -> std::time::Duration {
        crate::process::DRAIN_GRACE.min(self.worker.config.mesh.forward_timeout / 2)
    }

    /// Runs `call` here, holding its session (if any) until the answer is fully sent.
    pub(crate) async fn execute_held(
        &self,
        call: Call,
        held: Option<SessionUse>,
    ) -> Result<Reply, GatewayError> {
        // The last moment before acting for a session, whichever path brought the call
        // here (a session held here, or one adopted a moment ago): this worker acts only
        // while its own lease clock says the fleet cannot have declared it dead. A
        // directory answer that reached it late (it was paused while the answer was on
        // its way) proves nothing now.
        if held.is_some() && !self.worker.lease_valid() {
            return Err(refuse::situation(
                self.worker.gone_status(),
                &crate::decision::Situation::LocalLeaseInDoubt,
                refuse::LEASE_IN_DOUBT_WHY,
                call.id(),
            ));
        }
        let session = held.as_ref().map(|held| Arc::clone(held.session()));
        let mut reply = self.execute_local(call, session).await?;
        if let Some(held) = held {
            reply.body = crate::body::hold(reply.body, held);
        }
        Ok(reply)
    }

    /// Runs `call` here. `session` is the local session the call names, already looked
    /// up by the caller (None for initialize and modern calls).
    pub async fn execute_local(
        &self,
        call: Call,
        session: Option<Arc<Session>>,
    ) -> Result<Reply, GatewayError> {
        // A tools/call is counted where it runs (here), by upstream and tool name.
        let tool = call
            .message
            .as_ref()
            .and_then(|m| m.tool_name())
            .map(str::to_owned);
        let upstream = call.upstream;
        let route = &self.worker.routes[upstream];
        let lists_tools = call
            .message
            .as_ref()
            .is_some_and(|m| m.method() == Some("tools/list"));
        let virtual_server = matches!(route.upstream(), Upstream::Virtual(_));
        // The large and less frequent paths are boxed, so that a call in a session
        // does not carry (and copy) a future sized for a virtual server's or an
        // initialize's (see `Router::dispatch`).
        let result = match (call.era, session) {
            // A 2026-07-28 call on a virtual server: its members' calls made for it.
            (Era::Modern, _) if virtual_server => Box::pin(self.serve_federated_modern(call)).await,
            // A 2026-07-28 call bound to its (principal, route) session (`shared.rs`).
            (Era::Modern, Some(session)) => self.run_shared(call, session).await,
            (Era::Modern, None) if call.session_id.is_some() => {
                Box::pin(self.open_shared(call)).await
            }
            (Era::Modern, None) => self.pass_through(call).await,
            (Era::Legacy, None) if call.is_initialize() => Box::pin(self.open_session(call)).await,
            (Era::Legacy, None) => Err(GatewayError::session_not_found().with_id(call.id())),
            (Era::Legacy, Some(session)) => self.run_in_session(call, session).await,
        };
        if let Some(tool) = tool {
            let status = match &result {
                Ok(reply) => reply.status,
                Err(error) => error.status,
            };
            self.worker
                .metrics
                .tool_call(upstream, route.label(), &tool, status);
        }
        let mut reply = result?;
        if lists_tools && reply.status.is_success() {
            let metrics = Arc::clone(&self.worker.metrics);
            reply.body = body::observe_end(reply.body, TOOL_LIST_OBSERVED_BYTES, move |answer| {
                metrics.learn_tools_from_answer(upstream, &answer)
            });
        }
        // A virtual server's answer came from a member call that said where it ran
        // (a stateful member's shared session may live on another worker).
        reply
            .headers
            .entry(HEADER_OWNER_WORKER)
            .or_insert_with(|| self.worker.id_header.clone());
        Ok(reply)
    }

    /// 2026-07-28 on a stateless upstream: no session; the request goes upstream as it came.
    async fn pass_through(&self, call: Call) -> Result<Reply, GatewayError> {
        let id = call.id();
        let reply = self
            .send_upstream(
                &self.worker.routes[call.upstream],
                call.method,
                call.headers,
                call.body,
                None,
            )
            .await
            .map_err(|e| upstream_error(e, id))?;
        Ok(relay(
            reply,
            None,
            self.worker.config.limits.max_sse_event_bytes,
        ))
    }

    /// Legacy `initialize`: opens this client's own upstream session (an upstream
    /// session over HTTP, or a child process), then mints the client-facing id and
    /// registers ownership.
    async fn open_session(&self, call: Call) -> Result<Reply, GatewayError> {
        let id = call.id();
        let quota_key = self.worker.auth.quota_key(&call);
        let session_id = self
            .admit_session(&quota_key)
            .map_err(|e| e.with_id(id.clone()))?;
        let route = &self.worker.routes[call.upstream];
        let streams = self.worker.new_streams();
        let (link, reply) = self
            .open_link_for(
                route,
                call.headers,
                call.body,
                &session_id,
                &streams,
                Some(&quota_key),
            )
            .await
            .map_err(|e| upstream_error(e, id.clone()))?;
        let reply = match self.accepted_initialize(route, &link, reply).await {
            Ok(reply) => reply,
            Err(refusal) => return Ok(refusal),
        };
        let session = Session::new(
            session_id.clone(),
            call.upstream,
            call.auth.subject.clone(),
            link,
            streams,
        )
        .with_quota_key(quota_key);
        let initialize = call.message.as_ref().map(|m| m.json());
        self.record_session(route, session, initialize)
            .await
            .map_err(|error| error.with_id(id))?;
        let header = HeaderValue::from_str(&session_id).map_err(|_| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                Reason::BadSessionId,
                "minted session id is not a valid header value",
            )
        })?;
        Ok(relay(
            reply,
            Some(header),
            self.worker.config.limits.max_sse_event_bytes,
        ))
    }

    /// Whether this worker takes one more session for `quota_key`, and if so the
    /// client-facing id it will have.
    fn admit_session(&self, quota_key: &str) -> Result<String, GatewayError> {
        self.admit_new_session()
            .and_then(|()| self.check_local_quota(quota_key))?;
        session::mint_session_id(&self.worker.id).map_err(|e| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                Reason::EntropyUnavailable,
                format!("could not draw random bytes for a session id: {e}"),
            )
        })
    }

    /// The upstream's answer to `initialize` if it opened a session; else (`Err`) the
    /// refusal to give the client, the link already closed.
    async fn accepted_initialize(
        &self,
        route: &Route,
        link: &UpstreamLink,
        reply: UpstreamReply,
    ) -> Result<UpstreamReply, Reply> {
        if !reply.status.is_success() {
            // The upstream refused initialize: its answer is the truth for the client.
            self.close_link(route, link).await;
            return Err(relay(
                reply,
                None,
                self.worker.config.limits.max_sse_event_bytes,
            ));
        }
        // A child whose initialize failed serves no session: it ends, and its
        // answer goes to the client without a session id.
        if !matches!(link, UpstreamLink::Stdio(_)) || is_sse(&reply.headers) {
            return Ok(reply);
        }
        let answer = reply.body.collect().await.map(|c| c.to_bytes());
        let refused = answer.as_ref().map_or(true, |bytes| {
            serde_json::from_slice::<serde_json::Value>(bytes)
                .map_or(true, |message| message.get("result").is_none())
        });
        if refused {
            self.close_link(route, link).await;
            let body = answer.unwrap_or_default();
            return Err(Reply::json(StatusCode::OK, body));
        }
        Ok(UpstreamReply {
            status: reply.status,
            headers: reply.headers,
            body: body::full(answer.unwrap_or_default()),
        })
    }

    /// Claims the new session in the fleet, then keeps it here.
    async fn record_session(
        &self,
        route: &Route,
        session: Session,
        initialize: Option<&serde_json::Value>,
    ) -> Result<(), GatewayError> {
        if let Err(error) = self.worker.claim_session(&session, initialize).await {
            // Never hand out a session the fleet cannot route to: end it upstream. A
            // claim that timed out may still land when Redis answers again: take any
            // such record back, so the directory holds no session nobody was given.
            self.close_link(route, &session.link).await;
            if let Some(fleet) = self.worker.fleet() {
                fleet.release_unclaimed(Arc::new(session));
            }
            return Err(error);
        }
        let session = self.worker.sessions.insert(session);
        self.worker.metrics.session_opened();
        debug!(session = %session.tag, upstream = route.name(), "session opened");
        Ok(())
    }

    /// Standalone, this worker's count is the whole count of a principal's sessions;
    /// in a fleet the directory keeps the fleet-wide one when the session is claimed.
    fn check_local_quota(&self, quota_key: &str) -> Result<(), GatewayError> {
        let quota = self.worker.config.limits.session_quota(quota_key);
        if self.worker.fleet().is_none()
            && quota > 0
            && self.worker.sessions.count_for(quota_key) >= quota
        {
            return Err(refuse::quota_exceeded(quota, quota_key));
        }
        Ok(())
    }

    pub(crate) fn admit_new_session(&self) -> Result<(), GatewayError> {
        if self.worker.draining() {
            return Err(GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                Reason::Draining,
                "this worker is draining and takes no new sessions: retry, another worker will take it",
            )
            .with_retry_after(1));
        }
        let max = self.worker.config.limits.max_sessions;
        if self.worker.sessions.len() >= max {
            return Err(GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                Reason::SessionLimit,
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
        if session.principal != call.auth.subject
            || session.upstream != call.upstream
            || session.shared
        {
            // Another principal learns nothing about the session, not even that it
            // exists; a shared session is not addressable by a legacy client.
            return Err(GatewayError::session_not_found().with_id(id));
        }
        if let Some(why) = session.ended() {
            return Err(self.session_gone(why).with_id(id));
        }
        session.touch();
        match call.method {
            Method::DELETE => {
                self.end_session(&session).await;
                self.worker.metrics.session_ended("deleted", 1);
                Ok(Reply::json(StatusCode::OK, Bytes::new()))
            }
            Method::GET => self.open_stream(call, &session).await,
            _ => {
                let reply = match (&session.link, call.message) {
                    // Parsed at the front door already: routed without a second parse.
                    (UpstreamLink::Federated(link), Some(message)) => Ok(Box::pin(
                        self.answer_federated(link, call.headers, call.body, message.into_json()),
                    )
                    .await),
                    _ => {
                        self.send_in_session(&session, Method::POST, call.headers, call.body)
                            .await
                    }
                };
                let reply = match reply {
                    Ok(reply) => reply,
                    Err(UpstreamError::Exited { detail, .. }) => {
                        let why = format!("its upstream process {detail}");
                        self.session_lost(&session.id, &why).await;
                        return Err(self.session_gone(&why).with_id(id));
                    }
                    // Written, then the process died: never "gone" (a client told
                    // that re-initializes and runs the call again).
                    Err(UpstreamError::ExitedWhileRunning { detail, .. }) => {
                        let why = format!("its upstream process {detail}");
                        self.session_lost(&session.id, &why).await;
                        return Err(lost_while_running(
                            self.worker.routes[session.upstream].name(),
                            &detail,
                            "send initialize without Mcp-Session-Id to start a new session",
                        )
                        .with_id(id));
                    }
                    Err(e) => return Err(upstream_error(e, id)),
                };
                if reply.status == StatusCode::NOT_FOUND
                    && matches!(
                        session.link,
                        UpstreamLink::Http {
                            session_id: Some(_)
                        }
                    )
                {
                    // The upstream forgot its session (restart, expiry): ours is gone with it.
                    let why =
                        "the upstream no longer knows it (it restarted or expired the session)";
                    self.session_lost(&session.id, why).await;
                    return Err(self.session_gone(why).with_id(id));
                }
                Ok(self.relay_in_session(&session, reply))
            }
        }
    }

    /// A legacy `GET`: resumes a stream after `Last-Event-ID`, or takes over the
    /// session's `GET` stream (opening it upstream when it is not open).
    async fn open_stream(&self, call: Call, session: &Session) -> Result<Reply, GatewayError> {
        let id = call.id();
        if let UpstreamLink::Federated(link) = &session.link {
            // A virtual server's members feed the session's GET stream from their own.
            self.follow_member_streams(link);
        }
        if let Some(last) = call.headers.get(mcp::HEADER_LAST_EVENT_ID) {
            return self.resume_stream(last, session).map_err(|e| e.with_id(id));
        }
        if let Some(log) = session.streams.live_get() {
            return self.stream_reply(log.subscribe(None), id);
        }
        if let UpstreamLink::Stdio(_) = session.link {
            // A stdio session's GET stream lives as long as the session itself.
            return Err(self.session_gone("its stream ended").with_id(id));
        }
        let mut headers = call.headers;
        headers.remove(mcp::HEADER_LAST_EVENT_ID);
        let reply = self
            .send_in_session(session, Method::GET, headers, Bytes::new())
            .await
            .map_err(|e| upstream_error(e, id.clone()))?;
        if !(reply.status.is_success() && is_sse(&reply.headers)) {
            return Ok(relay(
                reply,
                None,
                self.worker.config.limits.max_sse_event_bytes,
            ));
        }
        let log = session.streams.new_get(&self.worker.id);
        streams::pump(
            Arc::clone(&log),
            reply.body,
            self.worker.config.limits.max_sse_event_bytes,
        );
        self.stream_reply(log.subscribe(None), id)
    }

    /// `GET` with `Last-Event-ID`: the rest of that stream, from the event after it.
    fn resume_stream(&self, last: &HeaderValue, session: &Session) -> Result<Reply, GatewayError> {
        let event = last.to_str().ok().and_then(EventId::parse).ok_or_else(|| {
            GatewayError::invalid_request(
                "Last-Event-ID is not an event id this gateway issued: send the id of the \
                 last event received, or open the stream without it",
            )
        })?;
        if event.owner != self.worker.id {
            return Err(replay_unavailable(format!(
                "its events were numbered by worker {}, which no longer holds this session",
                event.owner
            )));
        }
        let log = session
            .streams
            .find(event.stream)
            .ok_or_else(|| replay_unavailable(session.streams.why_not_found(event.stream)))?;
        let body = log
            .subscribe(Some(event.seq))
            .map_err(|gap| replay_unavailable(gap.to_string()))?;
        Ok(sse_reply(StatusCode::OK, body))
    }

    fn stream_reply(
        &self,
        body: Result<ReplyBody, streams::ReplayGap>,
        id: serde_json::Value,
    ) -> Result<Reply, GatewayError> {
        body.map(|body| sse_reply(StatusCode::OK, body))
            .map_err(|gap| replay_unavailable(gap.to_string()).with_id(id))
    }

    /// Relays an upstream answer in a legacy session: an SSE answer goes through a
    /// stream log, so the client can resume it after a dropped connection.
    fn relay_in_session(&self, session: &Session, reply: UpstreamReply) -> Reply {
        if !is_sse(&reply.headers) {
            return relay(reply, None, self.worker.config.limits.max_sse_event_bytes);
        }
        let log = session.streams.new_post(&self.worker.id);
        streams::pump(
            Arc::clone(&log),
            reply.body,
            self.worker.config.limits.max_sse_event_bytes,
        );
        match log.subscribe(None) {
            Ok(body) => sse_reply(reply.status, body),
            // A fresh log has nothing to miss.
            Err(gap) => Reply::from_error(&replay_unavailable(gap.to_string())),
        }
    }

    /// Ends the sessions no exchange has used for the idle timeout, upstream and in
    /// the directory; later requests for them get 404. A shared session (2026-07-28
    /// clients) is retired instead, so its clients are told once that its state is
    /// gone before their next call opens a fresh one. Returns how many ended.
    pub async fn expire_idle_sessions(&self) -> usize {
        let idle = self.worker.config.limits.session_idle_timeout;
        let expired = self.worker.sessions.take_idle(idle);
        self.worker
            .metrics
            .session_ended("expired", expired.len() as u64);
        for session in &expired {
            if session.shared {
                let why = format!("it was idle for longer than {}s", idle.as_secs());
                self.worker.sessions.keep_retired(Arc::clone(session), &why);
            }
            if let Some(fleet) = self.worker.fleet() {
                fleet.release(session).await;
            }
            session.streams.close();
            self.close_link(&self.worker.routes[session.upstream], &session.link)
                .await;
        }
        expired.len()
    }

    /// Ends a session here and upstream (client DELETE, drain, idle expiry): forgets it
    /// (registry and directory), ends its streams, then its upstream session or child
    /// process. Later requests for it get 404 `session_not_found`. (For a shared
    /// session the next 2026-07-28 call silently opens a new one; an expiry that wants
    /// those clients told once calls [`Executor::session_lost`] instead.)
    pub async fn end_session(&self, session: &Session) {
        self.worker.forget_session(&session.id).await;
        session.streams.close();
        self.close_link(&self.worker.routes[session.upstream], &session.link)
            .await;
    }

    /// A session ended under the gateway (its process exited, its upstream forgot
    /// it): it is retired with `why`, and later requests hear it (404 `session_gone`).
    /// Does nothing for a session already ended. A child process still running is
    /// ended when the retired session is dropped.
    pub(crate) async fn session_lost(&self, session_id: &str, why: &str) {
        let Some(session) = self.worker.sessions.retire(session_id, why) else {
            return;
        };
        warn!(session = %session.tag, upstream = self.worker.routes[session.upstream].name(), "session ended: {why}");
        self.worker.metrics.session_ended("lost", 1);
        session.streams.close();
        if let Some(fleet) = self.worker.fleet() {
            fleet.release(&session).await;
        }
    }

    /// "Session gone" with the reason, as the fleet answers it (404, or 409 when
    /// configured).
    pub(crate) fn session_gone(&self, why: &str) -> GatewayError {
        let status = self.worker.gone_status();
        GatewayError::new(
            status,
            mcp::code::SESSION_NOT_FOUND,
            format!(
                "session gone: {why}; send initialize without Mcp-Session-Id to start a new session"
            ),
        )
        .with_reason(Reason::SessionGone)
        .with_data(json!({ "detail": why, "retryable": false }))
    }

    /// Opens an upstream session with an `initialize` request: the upstream's own
    /// session over HTTP, or a new child process for stdio.
    pub(crate) async fn open_link(
        &self,
        route: &Route,
        headers: HeaderMap,
        body: Bytes,
        session_id: &str,
        streams: &SessionStreams,
    ) -> Result<(UpstreamLink, UpstreamReply), UpstreamError> {
        self.open_link_for(route, headers, body, session_id, streams, None)
            .await
    }

    /// [`Executor::open_link`] for a client's own session: a stdio child counts against
    /// the process quota of `principal` (its quota key) on this route and worker.
    pub(crate) async fn open_link_for(
        &self,
        route: &Route,
        headers: HeaderMap,
        body: Bytes,
        session_id: &str,
        streams: &SessionStreams,
        principal: Option<&str>,
    ) -> Result<(UpstreamLink, UpstreamReply), UpstreamError> {
        match route.upstream() {
            Upstream::Http(_) => {
                let reply = self
                    .send_upstream(route, Method::POST, headers, body, None)
                    .await?;
                let session_id = reply.headers.get(mcp::HEADER_SESSION_ID).cloned();
                Ok((UpstreamLink::Http { session_id }, reply))
            }
            Upstream::Virtual(server) => {
                self.open_federation(server, &body, session_id, streams, principal)
                    .await
            }
            Upstream::Stdio(stdio) => {
                let unsolicited = streams.new_get(&self.worker.id);
                let process = stdio
                    .start(
                        crate::digest::tag_of(session_id),
                        principal,
                        unsolicited,
                        self.on_process_exit(session_id),
                    )
                    .await?;
                let timeout = self.worker.config.limits.upstream_request_timeout;
                match process
                    .exchange(&body, accepts_json(&headers), timeout)
                    .await
                {
                    Ok(reply) => Ok((UpstreamLink::Stdio(process), reply)),
                    Err(e) => {
                        process.stop().await;
                        Err(e)
                    }
                }
            }
        }
    }

    /// What happens when a session's child process exits: the session ends with it.
    fn on_process_exit(&self, session_id: &str) -> Box<dyn FnOnce(String) + Send> {
        let worker = Arc::downgrade(self.worker);
        let session_id = session_id.to_owned();
        Box::new(move |why| {
            if let Some(worker) = worker.upgrade() {
                tokio::spawn(async move {
                    Executor::of(&worker)
                        .session_lost(&session_id, &format!("its upstream process {why}"))
                        .await;
                });
            }
        })
    }

    /// Sends one exchange in an open upstream session.
    pub(crate) async fn send_in_session(
        &self,
        session: &Session,
        method: Method,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<UpstreamReply, UpstreamError> {
        let route = &self.worker.routes[session.upstream];
        self.send_on_link(route, &session.link, method, headers, body)
            .await
    }

    pub(crate) async fn send_on_link(
        &self,
        route: &Route,
        link: &UpstreamLink,
        method: Method,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<UpstreamReply, UpstreamError> {
        match link {
            UpstreamLink::Http { session_id } => {
                self.send_upstream(route, method, headers, body, session_id.clone())
                    .await
            }
            UpstreamLink::Stdio(process) if method == Method::POST => {
                let timeout = self.worker.config.limits.upstream_request_timeout;
                process
                    .exchange(&body, accepts_json(&headers), timeout)
                    .await
            }
            UpstreamLink::Federated(federated) => {
                // Boxed: a member's exchange comes back through here.
                Box::pin(self.send_federated(federated, method, headers, body)).await
            }
            UpstreamLink::Stdio(_) => Err(UpstreamError::Failed {
                name: route.name().to_owned(),
                detail: format!("{method} has no meaning for a stdio upstream"),
            }),
        }
    }

    /// Ends an upstream session: DELETE over HTTP, or the child process ends.
    pub(crate) async fn close_link(&self, route: &Route, link: &UpstreamLink) {
        match link {
            UpstreamLink::Http { session_id: None } => {}
            UpstreamLink::Http {
                session_id: Some(upstream_id),
            } => {
                let mut headers = HeaderMap::new();
                headers.insert(ACCEPT, ACCEPT_BOTH);
                match self
                    .send_upstream(
                        route,
                        Method::DELETE,
                        headers,
                        Bytes::new(),
                        Some(upstream_id.clone()),
                    )
                    .await
                {
                    Ok(reply) => debug!(status = %reply.status, "upstream session ended"),
                    Err(e) => debug!(error = %e, "upstream session end failed"),
                }
            }
            UpstreamLink::Stdio(process) => process.stop().await,
            // Boxed: each member's link is closed through here.
            UpstreamLink::Federated(federated) => Box::pin(self.close_federation(federated)).await,
        }
    }

    /// Sends one exchange to an HTTP upstream with the session's upstream id.
    pub(crate) async fn send_upstream(
        &self,
        route: &Route,
        method: Method,
        mut headers: HeaderMap,
        body: Bytes,
        upstream_session_id: Option<HeaderValue>,
    ) -> Result<UpstreamReply, UpstreamError> {
        let http = match route.upstream() {
            Upstream::Http(http) => http,
            Upstream::Stdio(_) => {
                return Err(UpstreamError::Failed {
                    name: route.name().to_owned(),
                    detail: "a stdio upstream is reached only in a session".into(),
                });
            }
            Upstream::Virtual(_) => {
                return Err(UpstreamError::Failed {
                    name: route.name().to_owned(),
                    detail: "a virtual server is reached only in a session".into(),
                });
            }
        };
        if let Some(sid) = upstream_session_id {
            headers.insert(mcp::HEADER_SESSION_ID, sid);
        }
        if !headers.contains_key(ACCEPT) {
            headers.insert(ACCEPT, ACCEPT_BOTH);
        }
        http.send(UpstreamRequest {
            method,
            headers,
            body,
            timeout: self.worker.config.limits.upstream_request_timeout,
        })
        .await
    }
}

pub(crate) fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// Whether the client takes a plain JSON answer (else only SSE).
fn accepts_json(headers: &HeaderMap) -> bool {
    let accept: Vec<&str> = headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    accept.is_empty()
        || accept.iter().any(|v| {
            v.split(',').any(|media| {
                let media = media.split(';').next().unwrap_or("").trim();
                media.eq_ignore_ascii_case("application/json") || media == "*/*"
            })
        })
}

/// An SSE answer with the headers streams need.
fn sse_reply(status: StatusCode, body: ReplyBody) -> Reply {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells nginx-style proxies in front of the gateway not to buffer the stream.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Reply {
        status,
        headers,
        body,
    }
}

/// A stream cannot resume where the client asked.
fn replay_unavailable(why: String) -> GatewayError {
    GatewayError::gateway(
        StatusCode::GONE,
        Reason::ReplayUnavailable,
        format!(
            "the stream cannot resume after that event: {why}; open the stream again \
             without Last-Event-ID (events in between are lost)"
        ),
    )
}

/// Builds the client's reply from the upstream's: status and content type pass through,
/// the upstream's session id is replaced by ours, SSE is re-chunked per event (none
/// larger than `max_event` bytes).
fn relay(reply: UpstreamReply, session_header: Option<HeaderValue>, max_event: usize) -> Reply {
    let mut headers = HeaderMap::new();
    let is_sse = is_sse(&reply.headers);
    if let Some(content_type) = reply.headers.get(CONTENT_TYPE) {
        headers.insert(CONTENT_TYPE, content_type.clone());
    }
    if let Some(session) = session_header {
        headers.insert(mcp::HEADER_SESSION_ID, session);
    }
    let body = if is_sse {
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
        body::sse_events(reply.body, max_event)
    } else {
        reply.body
    };
    Reply {
        status: reply.status,
        headers,
        body,
    }
}

/// 502 `outcome_unknown` for a request written to a session's process that then ended
/// before answering: it may have run, and the session ended with the process.
/// `start_anew` tells the client how it gets a new session.
pub(crate) fn lost_while_running(upstream: &str, detail: &str, start_anew: &str) -> GatewayError {
    GatewayError::gateway(
        StatusCode::BAD_GATEWAY,
        Reason::OutcomeUnknown,
        format!(
            "outcome unknown: the process of upstream {upstream} for this session {detail} \
             while running this request; it may have run, and it was not re-run. The \
             session ended with it: check the upstream's state before retrying a \
             non-idempotent call; {start_anew}"
        ),
    )
    .with_data(json!({
        "detail": format!("its upstream process {detail}"),
        "session_ended": true,
        "retryable": false,
    }))
}

pub(crate) fn upstream_error(error: UpstreamError, id: serde_json::Value) -> GatewayError {
    let (status, reason) = error.status_and_reason();
    let message = match &error {
        // Its own words already say what to do.
        UpstreamError::ProcessLimit { .. } | UpstreamError::ProcessQuota { .. } => {
            error.to_string()
        }
        UpstreamError::Tls { .. } => {
            format!("{error}: fix the certificate or the upstream's tls settings")
        }
        UpstreamError::Spawn { .. } => format!("{error}: check the upstream's command"),
        // Sent, then no answer in time: the upstream may have run it.
        UpstreamError::Timeout { .. } => format!(
            "{error}: it may still have run there, so check its state before retrying a \
             non-idempotent call"
        ),
        // Refused or unresolved: the request never left the gateway.
        UpstreamError::Unreachable { .. } => {
            format!("{error}: the request was not sent; retry later or check the upstream")
        }
        // Found the process gone before the request was written to it.
        UpstreamError::Exited { .. } => {
            format!("{error}: the request was not sent to it; retry later or check the upstream")
        }
        UpstreamError::ExitedWhileRunning { .. } => format!(
            "{error}: it may have run, and it was not re-run; check the upstream's state \
             before retrying a non-idempotent call"
        ),
        // The exchange broke, perhaps after the request was sent: it may have run.
        UpstreamError::Failed { .. } => format!(
            "{error}: the request may have reached the upstream, so check its state before \
             retrying a non-idempotent call"
        ),
        _ => format!("{error}: retry later or check the upstream"),
    };
    if let UpstreamError::ProcessQuota { max, scope, .. } = &error {
        // Like the session quota: places free as sessions end, not within a second.
        return GatewayError::gateway(status, reason, message)
            .with_id(id)
            .with_data(json!({ "scope": scope.replace(' ', "_"), "limit": max, "retryable": true }))
            .with_retry_after(refuse::QUOTA_RETRY_AFTER_SECONDS);
    }
    let mut error = GatewayError::gateway(status, reason, message).with_id(id);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        error = error
            .with_reason(reason)
            .with_data(json!({ "retryable": true }))
            .with_retry_after(1);
    }
    error
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers_decide_json_or_sse() {
        let mut h = HeaderMap::new();
        assert!(accepts_json(&h));
        h.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        assert!(!accepts_json(&h));
        h.insert(ACCEPT, ACCEPT_BOTH);
        assert!(accepts_json(&h));
    }

    #[test]
    fn only_a_request_that_provably_never_left_is_told_to_retry() {
        let message = |error| upstream_error(error, json!(1)).message;
        let (name, detail) = ("st".to_owned(), "was killed by signal 9".to_owned());
        let unsent = message(UpstreamError::Unreachable {
            name: name.clone(),
            detail: "connection refused".into(),
        });
        assert!(unsent.contains("not sent; retry later"), "{unsent}");
        let gone = message(UpstreamError::Exited {
            name: name.clone(),
            detail: detail.clone(),
        });
        assert!(gone.contains("not sent to it; retry later"), "{gone}");
        for sent in [
            UpstreamError::Failed {
                name: name.clone(),
                detail: "connection reset".into(),
            },
            UpstreamError::ExitedWhileRunning {
                name: name.clone(),
                detail: detail.clone(),
            },
        ] {
            let text = message(sent);
            assert!(text.contains("state before retrying"), "{text}");
            assert!(!text.contains("retry later"), "{text}");
        }
        let running = upstream_error(UpstreamError::ExitedWhileRunning { name, detail }, json!(1));
        assert_eq!(running.status, StatusCode::BAD_GATEWAY);
        assert_eq!(running.data.as_ref().unwrap()["reason"], "outcome_unknown");
        let lost = lost_while_running("st", "was killed by signal 9", "start anew");
        let data = lost.data.as_ref().unwrap();
        assert_eq!(data["reason"], "outcome_unknown");
        assert_eq!(data["retryable"], false);
        assert_eq!(data["session_ended"], true);
        assert_eq!(
            data["detail"],
            "its upstream process was killed by signal 9"
        );
        assert!(lost.message.contains("may have run"), "{}", lost.message);
    }

    #[test]
    fn upstream_errors_name_the_upstream_and_the_problem() {
        let error = upstream_error(
            UpstreamError::Tls {
                name: "secure".into(),
                detail: "its certificate is not signed by a CA this gateway trusts".into(),
            },
            json!(3),
        );
        assert_eq!(error.status, StatusCode::BAD_GATEWAY);
        assert!(error.message.contains("secure"), "{}", error.message);
        assert_eq!(error.data.as_ref().unwrap()["reason"], "upstream_tls");
        let limit = upstream_error(
            UpstreamError::ProcessLimit {
                name: "time".into(),
                max: 2,
            },
            json!(1),
        );
        assert_eq!(limit.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(limit.retry_after, Some(1));
    }
}
