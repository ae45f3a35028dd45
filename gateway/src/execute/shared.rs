//! 2026-07-28 clients on upstreams that keep state in sessions (stdio upstreams, and
//! HTTP upstreams configured `legacy_only`).
//!
//! Such a client has no session, yet its calls must reach the same upstream state
//! whichever worker receives them. So the gateway holds one upstream session per
//! (principal, route), named by an id derived from both ([`shared_session_id`]),
//! owned by the worker that opened it and recorded in the directory like any session:
//! every other worker forwards the client's calls there over the mesh. The first
//! call of a principal opens it (the directory's `SET NX` decides between two workers
//! opening at once). Each call is translated: sent in the legacy protocol the session
//! speaks, its results marked as 2026-07-28 results. Server-to-client requests cannot
//! reach a 2026-07-28 client here, so the gateway answers them with an error.
//!
//! When the session ends under the gateway (its process exits, its owner dies, its
//! upstream forgets it), the next call is answered `session_gone` once, and the one
//! after opens a new session: the client learns that its state was lost, then
//! carries on with fresh state.

use super::Executor;
use crate::dispatch::Router;
use crate::reason::Reason;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tracing::{debug, info};

use super::streams::SessionStreams;
use super::upstream::{UpstreamError, UpstreamReply, read_answer};
use super::{ACCEPT_BOTH, is_sse, lost_while_running, upstream_error};
use crate::link::UpstreamLink;
use mcpgw_mesh::directory::{Claim, SessionState};

use crate::body;
use crate::fleet::Fleet;
use crate::mcp::{self, GatewayError};
use crate::reply::Reply;
use crate::request::Call;
use crate::session::Session;
use crate::worker::{Route, Worker};

/// The legacy protocol version the gateway asks for when it opens a shared session.
const SHARED_PROTOCOL_VERSION: &str = "2025-11-25";
/// Largest `initialize` answer read whole.
const MAX_INITIALIZE_BYTES: usize = 1024 * 1024;

impl Executor<'_> {
    /// The first call of a principal on a route: opens the shared session here, claims
    /// it in the directory, and runs the call in it. If another worker claimed it
    /// meanwhile, ours is closed and the call goes there.
    pub(crate) async fn open_shared(&self, call: Call) -> Result<Reply, GatewayError> {
        let id = call.id();
        let Some(key) = call.session_id.clone() else {
            return Err(GatewayError::session_not_found().with_id(id));
        };
        let opening = self.worker.sessions.opening(&key);
        let guard = opening.lock().await;
        if let Some(session) = self
            .worker
            .sessions
            .get(&key)
            .filter(|s| s.ended().is_none())
        {
            drop(guard);
            return self.run_shared(call, session).await;
        }
        self.admit_new_session()
            .map_err(|e| e.with_id(id.clone()))?;
        let route = &self.worker.routes[call.upstream];
        let streams = self.worker.new_streams();
        let (link, init) = self
            .initialize_shared(route, &key, &streams)
            .await
            .map_err(|e| e.with_id(id.clone()))?;
        let mut session = Session::new(
            key.clone(),
            call.upstream,
            call.auth.subject.clone(),
            link,
            streams,
        );
        session.shared = true;
        session.upstream_init = Some(init);
        if let Some(fleet) = self.worker.fleet() {
            let claimed = self.claim_shared(fleet, &session).await;
            if !matches!(claimed, Ok(true)) {
                self.close_link(route, &session.link).await;
            }
            match claimed {
                Ok(true) => {}
                Ok(false) => {
                    // Another worker opened it first: use theirs.
                    drop(guard);
                    debug!(session = %crate::digest::tag_of(&key), "shared session opened elsewhere first");
                    return Router::of(self.worker)
                        .forward_counted(&call, None)
                        .await
                        .map_err(|unanswered| {
                            Router::of(self.worker).refuse_shared(
                                &unanswered.situation,
                                &unanswered.why,
                                &call,
                            )
                        });
                }
                Err(e) => return Err(e.with_id(id)),
            }
        }
        let session = self.worker.sessions.insert(session);
        info!(session = %session.tag, upstream = route.name(), "shared session opened for 2026-07-28 clients");
        drop(guard);
        self.run_shared(call, session).await
    }

    /// Opens the upstream session a shared session lives in: initialize, then
    /// `notifications/initialized`. The link and the upstream's initialize answer; on
    /// failure, the link is closed.
    async fn initialize_shared(
        &self,
        route: &Route,
        key: &str,
        streams: &SessionStreams,
    ) -> Result<(UpstreamLink, Value), GatewayError> {
        let (link, reply) = self
            .open_link(
                route,
                initialize_headers(None),
                initialize_body(),
                key,
                streams,
            )
            .await
            .map_err(|e| upstream_error(e, Value::Null))?;
        let name = route.name();
        let timeout = self.worker.config.limits.upstream_request_timeout;
        let init = match read_initialize(reply, name, timeout).await {
            Ok(init) => init,
            Err(why) => {
                self.close_link(route, &link).await;
                return Err(GatewayError::gateway(
                    StatusCode::BAD_GATEWAY,
                    Reason::UpstreamInitializeFailed,
                    format!("upstream {name} did not open a session for 2026-07-28 clients: {why}"),
                ));
            }
        };
        let version = negotiated_version(Some(&init)).to_owned();
        let initialized = self
            .send_on_link(
                route,
                &link,
                Method::POST,
                initialize_headers(Some(&version)),
                Bytes::from_static(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            )
            .await;
        match initialized {
            Ok(reply) => {
                let _ = reply.body.collect().await;
                Ok((link, init))
            }
            Err(e) => {
                self.close_link(route, &link).await;
                Err(upstream_error(e, Value::Null))
            }
        }
    }

    /// Records `session` as this worker's in the directory: `Ok(false)` when another
    /// worker opened it first. A worker that cannot confirm its lease claims nothing,
    /// as for a client's own session.
    async fn claim_shared(&self, fleet: &Fleet, session: &Session) -> Result<bool, GatewayError> {
        let (kind, adoption_guard, payload) = fleet
            .adoption_record(session, None)
            .map_err(crate::worker::claim_refused)?;
        let unavailable = |detail: String| {
            GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                Reason::DirectoryUnavailable,
                "the fleet directory did not record the session for your state in time; \
                 nothing was run: retry",
            )
            .with_data(json!({ "retryable": true }))
            .with_retry_after(1)
            .with_log_detail(detail)
        };
        if !self.worker.lease_confirmed().await {
            return Err(unavailable(
                "this worker could not confirm its lease".into(),
            ));
        }
        let state = kind.map(|kind| SessionState {
            kind,
            guard: &adoption_guard,
            payload: &payload,
        });
        match fleet
            .directory
            .claim_remembered_session(&session.id, &self.worker.id, state)
            .await
        {
            Ok(Claim::Claimed) => Ok(true),
            Ok(Claim::Taken | Claim::OverQuota) => Ok(false),
            // If the claim lands late, its record names this worker for a session it
            // does not hold: the next call here, or forwarded here, confirms it by
            // claiming again (a claim by the recorded owner succeeds) before anything
            // else is opened.
            Err(e) => Err(unavailable(e.to_string())),
        }
    }

    /// Runs a 2026-07-28 call in its shared session.
    pub(crate) async fn run_shared(
        &self,
        call: Call,
        session: Arc<Session>,
    ) -> Result<Reply, GatewayError> {
        let id = call.id();
        if session.principal != call.auth.subject || !session.shared {
            return Err(GatewayError::session_not_found().with_id(id));
        }
        if let Some(why) = session.ended() {
            self.worker.sessions.forget_retired(&session.id);
            // In a fleet the directory decides who tells the end (any worker may get
            // the next call); standalone, this entry is the only memory of it.
            return match self.worker.fleet() {
                // Boxed: finding may open the session anew and run this call in it.
                Some(fleet) => Box::pin(Router::of(self.worker).find_shared(fleet, call)).await,
                None => Err(Router::of(self.worker)
                    .shared_lost(session.upstream, why)
                    .with_id(id)),
            };
        }
        session.touch();
        let method = call
            .message
            .as_ref()
            .and_then(|m| m.method())
            .unwrap_or("")
            .to_owned();
        if method == "server/discover" {
            return Ok(discover(id, session.upstream_init.as_ref()));
        }
        let mut headers = call.headers;
        let version = negotiated_version(session.upstream_init.as_ref());
        headers.insert(
            mcp::HEADER_PROTOCOL_VERSION,
            HeaderValue::from_str(version)
                .unwrap_or(HeaderValue::from_static(SHARED_PROTOCOL_VERSION)),
        );
        let reply = self
            .send_in_session(&session, Method::POST, headers, legacy_body(call.body))
            .await;
        let lost = match reply {
            Ok(reply)
                if reply.status == StatusCode::NOT_FOUND
                    && matches!(
                        session.link,
                        UpstreamLink::Http {
                            session_id: Some(_)
                        }
                    ) =>
            {
                "the upstream no longer knows it".to_owned()
            }
            Ok(reply) => return Ok(self.modernize(reply, &session, cacheable(&method)).await),
            Err(UpstreamError::Exited { detail, .. }) => format!("its upstream process {detail}"),
            // Written, then the process died: the call may have run ("gone" would have
            // the client run it again); this answer also tells that the state is lost.
            Err(UpstreamError::ExitedWhileRunning { detail, .. }) => {
                self.session_lost(&session.id, &format!("its upstream process {detail}"))
                    .await;
                self.worker.sessions.forget_retired(&session.id);
                self.take_told_end(&session).await;
                return Err(lost_while_running(
                    self.worker.routes[session.upstream].name(),
                    &detail,
                    "your next request starts a new one, without that state",
                )
                .with_id(id));
            }
            Err(e) => return Err(upstream_error(e, id)),
        };
        self.session_lost(&session.id, &lost).await;
        self.worker.sessions.forget_retired(&session.id);
        self.take_told_end(&session).await;
        Err(Router::of(self.worker)
            .shared_lost(session.upstream, &lost)
            .with_id(id))
    }

    /// This call's answer tells that `session` ended: its directory record is made
    /// sure gone and the directory's memory of it taken (as `find_shared` does for
    /// `ForwardedThenLost`), so no later call is told again. The process's exit handler
    /// may still be releasing the record: releasing again under the opening lock (no
    /// new session of this id can be claimed here meanwhile; a release removes only
    /// this worker's record) means the memory is there to take once it returns.
    async fn take_told_end(&self, session: &Arc<Session>) {
        let Some(fleet) = self.worker.fleet() else {
            return;
        };
        let opening = self.worker.sessions.opening(&session.id);
        let _guard = opening.lock().await;
        if self
            .worker
            .sessions
            .get(&session.id)
            .is_some_and(|newer| !Arc::ptr_eq(&newer, session))
        {
            return;
        }
        fleet.release(session).await;
        let _ = fleet.directory.remembered_session(&session.id).await;
    }

    /// A legacy answer as a 2026-07-28 client expects it: results say they are
    /// complete; server-to-client requests, which it cannot receive here, are answered
    /// upstream with an error instead of being passed on.
    async fn modernize(
        &self,
        reply: UpstreamReply,
        session: &Arc<Session>,
        cacheable: bool,
    ) -> Reply {
        let mut headers = HeaderMap::new();
        if let Some(content_type) = reply.headers.get(CONTENT_TYPE) {
            headers.insert(CONTENT_TYPE, content_type.clone());
        }
        if !is_sse(&reply.headers) {
            let body = match reply.body.collect().await {
                Ok(collected) => {
                    let bytes = collected.to_bytes();
                    match serde_json::from_slice::<Value>(&bytes) {
                        Ok(mut message) => {
                            mark_complete(&mut message, cacheable);
                            Bytes::from(message.to_string())
                        }
                        Err(_) => bytes,
                    }
                }
                Err(e) => {
                    let error = upstream_error(
                        UpstreamError::Failed {
                            name: self.worker.routes[session.upstream].name().to_owned(),
                            detail: e.to_string(),
                        },
                        Value::Null,
                    );
                    return Reply::from_error(&error);
                }
            };
            return Reply {
                status: reply.status,
                headers,
                body: body::full(body),
            };
        }
        let worker = Arc::clone(self.worker);
        let session = Arc::clone(session);
        let events = body::sse_events(reply.body, self.worker.config.limits.max_sse_event_bytes)
            .map_frame(move |frame| {
                frame.map_data(|event| modernize_event(&event, &worker, &session, cacheable))
            });
        Reply {
            status: reply.status,
            headers,
            body: events.boxed_unsync(),
        }
    }
}

/// One SSE event of a legacy answer, for a 2026-07-28 client.
fn modernize_event(
    event: &Bytes,
    worker: &Arc<Worker>,
    session: &Arc<Session>,
    cacheable: bool,
) -> Bytes {
    let Some(mut message) = event_json(event) else {
        return event.clone();
    };
    if message.get("method").is_some()
        && let Some(request_id) = message.get("id").cloned()
    {
        let method = message["method"].as_str().unwrap_or("").to_owned();
        decline_server_request(worker, session, request_id, &method);
        return Bytes::from(format!(
            ": mcpgw declined a {method} request the upstream sent: 2026-07-28 clients cannot receive it\n\n"
        ));
    }
    mark_complete(&mut message, cacheable);
    Bytes::from(format!("event: message\ndata: {message}\n\n"))
}

/// Answers an upstream's request to the client with an error, in the background.
fn decline_server_request(
    worker: &Arc<Worker>,
    session: &Arc<Session>,
    request_id: Value,
    method: &str,
) {
    let answer = json!({
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {
            "code": mcp::code::METHOD_NOT_FOUND,
            "message": format!(
                "{method} cannot reach this client: it speaks MCP 2026-07-28 through mcpgw, \
                 which does not relay server-to-client requests to such clients"
            ),
        },
    });
    let worker = Arc::clone(worker);
    let session = Arc::clone(session);
    tokio::spawn(async move {
        let version = negotiated_version(session.upstream_init.as_ref()).to_owned();
        let sent = Executor::of(&worker)
            .send_in_session(
                &session,
                Method::POST,
                initialize_headers(Some(&version)),
                Bytes::from(answer.to_string()),
            )
            .await;
        if let Ok(reply) = sent {
            let _ = reply.body.collect().await;
        }
    });
}

/// The JSON-RPC message in an SSE event's data lines, if there is one.
fn event_json(event: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(event).ok()?;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    if data.is_empty() {
        return None;
    }
    serde_json::from_str(&data.join("\n")).ok()
}

/// Prefix of the `_meta` keys that carry the 2026-07-28 envelope (protocol version,
/// client capabilities, log level): a legacy server refuses requests that carry them.
const ENVELOPE_PREFIX: &str = "io.modelcontextprotocol/";

/// A 2026-07-28 request as the legacy session expects it: without the envelope (the
/// session negotiated its version and capabilities at initialize).
fn legacy_body(body: Bytes) -> Bytes {
    let Ok(mut message) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let Some(params) = message.get_mut("params").and_then(Value::as_object_mut) else {
        return body;
    };
    let Some(meta) = params.get_mut("_meta").and_then(Value::as_object_mut) else {
        return body;
    };
    meta.retain(|key, _| !key.starts_with(ENVELOPE_PREFIX));
    if meta.is_empty() {
        params.remove("_meta");
    }
    Bytes::from(message.to_string())
}

/// Whether 2026-07-28 results of `method` carry caching hints (`ttlMs`, `cacheScope`).
fn cacheable(method: &str) -> bool {
    matches!(
        method,
        "server/discover"
            | "tools/list"
            | "prompts/list"
            | "resources/list"
            | "resources/templates/list"
            | "resources/read"
    )
}

/// Marks a result as complete, as 2026-07-28 results are, and gives a cacheable one
/// caching hints: private to the principal (its session answered), never reused
/// (`ttlMs: 0`), since the upstream's answer may change with the session's state.
fn mark_complete(message: &mut Value, cacheable: bool) {
    if let Some(result) = message.get_mut("result").and_then(Value::as_object_mut) {
        result
            .entry("resultType")
            .or_insert_with(|| Value::from("complete"));
        if cacheable {
            result.entry("ttlMs").or_insert_with(|| Value::from(0));
            result
                .entry("cacheScope")
                .or_insert_with(|| Value::from("private"));
        }
    }
}

/// `server/discover`, answered from what the upstream said at initialize.
fn discover(id: Value, init: Option<&Value>) -> Reply {
    let init = init.cloned().unwrap_or(Value::Null);
    let mut result = json!({
        "supportedVersions": [mcp::MODERN_VERSIONS.first().copied().unwrap_or("2026-07-28")],
        "capabilities": init.get("capabilities").cloned().unwrap_or(json!({})),
    });
    for key in ["serverInfo", "instructions"] {
        if let Some(value) = init.get(key) {
            result[key] = value.clone();
        }
    }
    let mut body = json!({ "jsonrpc": "2.0", "id": id, "result": result });
    mark_complete(&mut body, true);
    Reply::json(StatusCode::OK, Bytes::from(body.to_string()))
}

fn negotiated_version(init: Option<&Value>) -> &str {
    init.and_then(|init| init.get("protocolVersion"))
        .and_then(Value::as_str)
        .filter(|v| mcp::LEGACY_VERSIONS.contains(v))
        .unwrap_or(SHARED_PROTOCOL_VERSION)
}

fn initialize_headers(version: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(ACCEPT, ACCEPT_BOTH);
    if let Some(version) = version.and_then(|v| HeaderValue::from_str(v).ok()) {
        headers.insert(mcp::HEADER_PROTOCOL_VERSION, version);
    }
    headers
}

/// The gateway's own `initialize`: no client capabilities, so a well-behaved server
/// sends none of the requests a 2026-07-28 client could not answer.
fn initialize_body() -> Bytes {
    let body = json!({
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {
            "protocolVersion": SHARED_PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": { "name": "mcpgw", "version": env!("CARGO_PKG_VERSION") },
        },
    });
    Bytes::from(body.to_string())
}

/// The `result` of an `initialize` answer (JSON or SSE), or why there is none.
async fn read_initialize(
    reply: UpstreamReply,
    upstream: &str,
    deadline: Duration,
) -> Result<Value, String> {
    let answer = read_answer(reply, upstream, MAX_INITIALIZE_BYTES, deadline).await?;
    match (answer.get("result"), answer.get("error")) {
        (Some(result), _) => Ok(result.clone()),
        (None, Some(error)) => Err(format!("it refused initialize: {error}")),
        (None, None) => Err("its answer held no initialize result".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_marked_complete_and_other_messages_left_alone() {
        let mut response = json!({"jsonrpc":"2.0","id":1,"result":{"content":[]}});
        mark_complete(&mut response, false);
        assert_eq!(response["result"]["resultType"], "complete");
        assert!(response["result"].get("ttlMs").is_none());
        let mut list = json!({"jsonrpc":"2.0","id":1,"result":{"tools":[]}});
        mark_complete(&mut list, true);
        assert_eq!(list["result"]["ttlMs"], 0);
        assert_eq!(list["result"]["cacheScope"], "private");
        let mut already = json!({"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required"}});
        mark_complete(&mut already, false);
        assert_eq!(already["result"]["resultType"], "input_required");
        let mut note = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{}});
        mark_complete(&mut note, false);
        assert!(note.get("result").is_none());
    }

    #[test]
    fn the_modern_envelope_is_taken_off_and_the_rest_of_meta_kept() {
        let body = json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x",
            "_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28",
                     "io.modelcontextprotocol/clientCapabilities":{},"progressToken":7}}});
        let legacy: Value =
            serde_json::from_slice(&legacy_body(Bytes::from(body.to_string()))).unwrap();
        assert_eq!(legacy["params"]["_meta"], json!({"progressToken": 7}));
        let bare = json!({"jsonrpc":"2.0","id":1,"method":"tools/list","params":{
            "_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}});
        let legacy: Value =
            serde_json::from_slice(&legacy_body(Bytes::from(bare.to_string()))).unwrap();
        assert!(legacy["params"].get("_meta").is_none());
    }

    #[test]
    fn discover_is_built_from_the_initialize_result() {
        let init = json!({"protocolVersion":"2025-06-18","capabilities":{"tools":{}},
                          "serverInfo":{"name":"legacy","version":"1"}});
        assert_eq!(negotiated_version(Some(&init)), "2025-06-18");
        assert_eq!(
            negotiated_version(Some(&json!({"protocolVersion":"1999-01-01"}))),
            SHARED_PROTOCOL_VERSION
        );
        let reply = discover(json!(4), Some(&init));
        assert_eq!(reply.status, StatusCode::OK);
    }

    #[test]
    fn event_data_is_read_across_lines() {
        let event = b"id: w:1:1\nevent: message\ndata: {\"a\":\ndata: 1}\n\n";
        assert_eq!(event_json(event), Some(json!({"a":1})));
        assert_eq!(event_json(b": keepalive\n\n"), None);
    }
}
