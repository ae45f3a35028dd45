//! HTTP handling for `/mcp`, `/stats` and `/executed`: reads the request, lets
//! `protocol` and `methods` decide, and writes the answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{ACCEPT, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use super::body::{Body, EVENT_QUEUE, sse_event};
use super::executed::Executed;
use super::methods::{self, Reply};
use super::protocol::{
    self, Era, HEADER_METHOD, HEADER_NAME, HEADER_PROTOCOL_VERSION, HEADER_SESSION_ID,
    INTERNAL_ERROR, Message, RoutingHeader, RoutingHeaders, RpcError,
};
use super::session::{Session, SessionStore};
use super::stats::Stats;
use super::tools::{self, SlowStream};

/// Larger bodies are refused with 413; MCP requests are small.
const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// How often an idle GET stream sends a comment, so proxies with an idle
/// read timeout keep it open.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEPALIVE_COMMENT: &[u8] = b": keepalive\n\n";

/// The server's shared state.
#[derive(Debug)]
pub struct Upstream {
    /// Answer every request as an SSE stream (as the official Python SDK
    /// does) instead of `application/json`, to exercise the gateway's relay.
    sse_always: bool,
    sessions: SessionStore,
    stats: Stats,
    /// The id of every request run in a session, for `GET /executed`.
    executed: Executed,
    stall: Option<Stall>,
    /// `--ping-delay-ms`: how long every `ping` in a session waits before its answer,
    /// as a slow or distant server's would (the gateway pings a virtual server's
    /// members when it adopts a session).
    ping_delay: Option<Duration>,
    /// `--resources`: generated resources listed in pages.
    generated: Option<methods::GeneratedResources>,
}

/// `--stall-after`: one server-wide pause, triggered by the Nth POST.
#[derive(Debug)]
struct Stall {
    after: u64,
    length: Duration,
    posts: AtomicU64,
    /// When the stall ends, once it has begun.
    until: parking_lot::Mutex<Option<Instant>>,
}

impl Stall {
    /// Counts this POST and returns the end of the stall it must wait for, if any.
    fn check(&self) -> Option<Instant> {
        let n = self.posts.fetch_add(1, Ordering::Relaxed) + 1;
        let mut until = self.until.lock();
        if n == self.after {
            let end = Instant::now() + self.length;
            tracing::info!(
                post = n,
                ms = self.length.as_millis() as u64,
                "stalling once (--stall-after)"
            );
            *until = Some(end);
        }
        (*until).filter(|end| *end > Instant::now())
    }
}

impl Upstream {
    pub fn new(sse_always: bool) -> Self {
        Self {
            sse_always,
            sessions: SessionStore::default(),
            stats: Stats::default(),
            executed: Executed::default(),
            stall: None,
            ping_delay: None,
            generated: None,
        }
    }

    /// Makes every `ping` in a session wait `delay` before it is answered.
    pub fn with_ping_delay(mut self, delay: Duration) -> Self {
        self.ping_delay = Some(delay);
        self
    }

    /// Lists `count` generated resources besides the session's state, `page` per
    /// `resources/list` page.
    pub fn with_generated_resources(mut self, count: usize, page: usize) -> Self {
        self.generated = Some(methods::GeneratedResources { count, page });
        self
    }

    /// Makes the Nth POST (1-based) begin a server-wide pause of `length`.
    pub fn with_stall(mut self, after: u64, length: Duration) -> Self {
        self.stall = Some(Stall {
            after,
            length,
            posts: AtomicU64::new(0),
            until: parking_lot::Mutex::new(None),
        });
        self
    }

    /// Answers one HTTP request. Every failure becomes a response, so a
    /// bad request never costs the connection or the server.
    pub async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<Body> {
        match request.uri().path() {
            "/mcp" => self.mcp(request).await,
            "/stats" if request.method() == Method::GET => json_response(
                StatusCode::OK,
                self.stats.to_json(&self.sessions).to_string().into_bytes(),
            ),
            "/stats" => method_not_allowed("GET", "/stats only answers GET"),
            "/executed" if request.method() == Method::GET => json_response(
                StatusCode::OK,
                self.executed.to_json().to_string().into_bytes(),
            ),
            "/executed" => method_not_allowed("GET", "/executed only answers GET"),
            path => error_response(
                StatusCode::NOT_FOUND,
                &Value::Null,
                &RpcError::invalid_request(format!(
                    "Not Found: nothing is served at {path}; MCP is at /mcp, counters at /stats \
                     and the ids that ran at /executed"
                )),
            ),
        }
    }

    async fn mcp(&self, request: Request<Incoming>) -> Response<Body> {
        let era = match protocol::era_of(header(request.headers(), HEADER_PROTOCOL_VERSION)) {
            Ok(era) => era,
            Err(error) => return error_response(StatusCode::BAD_REQUEST, &Value::Null, &error),
        };
        match (request.method(), era) {
            (&Method::POST, _) => {
                let (parts, body) = request.into_parts();
                self.post(era, &parts, body).await
            }
            (&Method::GET, Era::Legacy) => self.open_event_stream(request.headers()),
            (&Method::DELETE, Era::Legacy) => self.end_session(request.headers()),
            (&Method::GET | &Method::DELETE, Era::Modern) => method_not_allowed(
                "POST",
                "Method Not Allowed: protocol 2026-07-28 has no sessions, so there is no stream to GET and \
                 nothing to DELETE; send each request as a POST",
            ),
            _ => method_not_allowed(
                "GET, POST, DELETE",
                "Method Not Allowed: /mcp takes POST, GET and DELETE",
            ),
        }
    }

    async fn post(&self, era: Era, parts: &Parts, body: Incoming) -> Response<Body> {
        if let Some(end) = self.stall.as_ref().and_then(Stall::check) {
            tokio::time::sleep_until(end.into()).await;
        }
        if let Some(traceparent) = parts
            .headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
        {
            self.stats.record_traceparent(traceparent);
        }
        if !protocol::is_json_content_type(header(&parts.headers, CONTENT_TYPE.as_str())) {
            return error_response(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                &Value::Null,
                &RpcError::invalid_request(
                    "Unsupported Media Type: POST a JSON-RPC message as application/json",
                ),
            );
        }
        let body = match read_body(body).await {
            Ok(body) => body,
            Err((status, error)) => return error_response(status, &Value::Null, &error),
        };
        let decoded: Value = match serde_json::from_slice(&body) {
            Ok(decoded) => decoded,
            Err(error) => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    &Value::Null,
                    &RpcError::parse_error(error),
                );
            }
        };
        let message = match protocol::classify_message(&decoded) {
            Ok(message) => message,
            Err(error) => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    &protocol::id_for_error(&decoded),
                    &error,
                );
            }
        };
        match era {
            Era::Legacy => self.post_legacy(&parts.headers, message).await,
            Era::Modern => self.post_modern(&parts.headers, message).await,
        }
    }

    async fn post_legacy(&self, headers: &HeaderMap, message: Message<'_>) -> Response<Body> {
        let session_id = header(headers, HEADER_SESSION_ID);
        if let Message::Request {
            id,
            method: "initialize",
            params,
        } = message
        {
            if session_id.is_some() {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    id,
                    &RpcError::invalid_request(
                        "Bad Request: initialize starts a new session, so it must not carry Mcp-Session-Id; \
                         send it without the header",
                    ),
                );
            }
            return self.initialize(id, params).await;
        }
        let request_id = match message {
            Message::Request { id, .. } => id,
            Message::Notification { .. } | Message::ClientResponse => &Value::Null,
        };
        let session = match self.find_session(session_id) {
            Ok(session) => session,
            // The request's id goes on the refusal so the client can match it to what it sent.
            Err((status, error)) => return error_response(status, request_id, &error),
        };
        match message {
            Message::Request { id, method, params } => {
                if session.is_sleeping() {
                    self.stats.record_during_sleep();
                }
                // find_session took the id as UTF-8, so it reads as a string here too.
                if let Some(session_id) = session_id.and_then(|raw| std::str::from_utf8(raw).ok()) {
                    self.executed.record(session_id, id);
                }
                let reply = self.execute(Era::Legacy, method, params, Some(&session));
                let _sleeping = matches!(reply, Reply::Sleep(_)).then(|| session.begin_sleep());
                if let Some(delay) = self.ping_delay.filter(|_| method == "ping") {
                    tokio::time::sleep(delay).await;
                }
                self.respond(Era::Legacy, id, reply).await
            }
            Message::Notification { .. } | Message::ClientResponse => accepted(),
        }
    }

    async fn initialize(&self, id: &Value, params: Option<&Map<String, Value>>) -> Response<Body> {
        let (session_id, session) = match self.sessions.create() {
            Ok(created) => created,
            Err(error) => {
                tracing::error!(%error, "cannot draw randomness for a session id");
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    id,
                    &RpcError::new(
                        INTERNAL_ERROR,
                        "Internal error: could not mint a session id; try again",
                    ),
                );
            }
        };
        let Ok(session_header) = HeaderValue::from_str(&session_id) else {
            // Hex ids always make valid header values; should that ever break,
            // the client must not get a success it cannot use.
            self.sessions.end(&session_id);
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                id,
                &RpcError::new(
                    INTERNAL_ERROR,
                    "Internal error: minted an unusable session id",
                ),
            );
        };
        let reply = self.execute(Era::Legacy, "initialize", params, Some(&session));
        let mut response = self.respond(Era::Legacy, id, reply).await;
        response
            .headers_mut()
            .insert(HEADER_SESSION_ID, session_header);
        response
    }

    async fn post_modern(&self, headers: &HeaderMap, message: Message<'_>) -> Response<Body> {
        match message {
            Message::Request { id, method, params } => {
                let routing = RoutingHeaders {
                    protocol_version: routing_header(headers, HEADER_PROTOCOL_VERSION),
                    method: routing_header(headers, HEADER_METHOD),
                    name: routing_header(headers, HEADER_NAME),
                };
                if let Err(error) = protocol::validate_modern_request(method, params, &routing) {
                    return error_response(status(error.modern_http_status()), id, &error);
                }
                let reply = self.execute(Era::Modern, method, params, None);
                self.respond(Era::Modern, id, reply).await
            }
            Message::Notification { .. } => accepted(),
            Message::ClientResponse => error_response(
                StatusCode::BAD_REQUEST,
                &Value::Null,
                &RpcError::invalid_request(
                    "Invalid Request: at 2026-07-28 the server sends no requests, so there is nothing to respond to",
                ),
            ),
        }
    }

    /// The one place a request is counted and run.
    fn execute(
        &self,
        era: Era,
        method: &str,
        params: Option<&Map<String, Value>>,
        session: Option<&Arc<Session>>,
    ) -> Reply {
        self.stats.record_request(method);
        if let Some(generated) = &self.generated {
            match method {
                "resources/list" => return generated.page(era, params, session.is_some()),
                "resources/read" => {
                    if let Some(read) = generated.read(era, params) {
                        return read;
                    }
                }
                _ => {}
            }
        }
        methods::dispatch(era, method, params, session.map(|session| session.state()))
    }

    async fn respond(&self, era: Era, id: &Value, reply: Reply) -> Response<Body> {
        match reply {
            Reply::Result(result) => self.answer(protocol::encode_result(id, &result)),
            Reply::Shared(result) => self.answer(protocol::encode_result(id, result)),
            Reply::Error(error) => {
                let status = match era {
                    Era::Legacy => StatusCode::OK,
                    Era::Modern => status(error.modern_http_status()),
                };
                let encoded = protocol::encode_error(id, &error);
                if status == StatusCode::OK {
                    self.answer(encoded)
                } else {
                    json_response(status, encoded)
                }
            }
            Reply::Sleep(duration) => {
                tokio::time::sleep(duration).await;
                let result = methods::finish_result(era, tools::slept_result(duration));
                self.answer(protocol::encode_result(id, &result))
            }
            Reply::Stream {
                plan,
                progress_token,
            } => stream_progress(era, id.clone(), plan, progress_token),
        }
    }

    /// A 200 answer in the configured style.
    fn answer(&self, json: Vec<u8>) -> Response<Body> {
        if self.sse_always {
            event_stream_response(Body::whole(sse_event(&json)))
        } else {
            json_response(StatusCode::OK, json)
        }
    }

    /// Legacy GET: the session's server-to-client stream. This server never
    /// sends requests of its own, so the stream only carries keepalives; it
    /// exists because clients open it and gateways must relay it.
    fn open_event_stream(&self, headers: &HeaderMap) -> Response<Body> {
        if !protocol::accepts_event_stream(header(headers, ACCEPT.as_str())) {
            return error_response(
                StatusCode::NOT_ACCEPTABLE,
                &Value::Null,
                &RpcError::invalid_request(
                    "Not Acceptable: GET opens the session's SSE stream; send Accept: text/event-stream",
                ),
            );
        }
        let session = match self.find_session(header(headers, HEADER_SESSION_ID)) {
            Ok(session) => session,
            Err((status, error)) => return error_response(status, &Value::Null, &error),
        };
        let (sender, receiver) = mpsc::channel(1);
        tokio::spawn(async move {
            let ended = session.ended();
            tokio::pin!(ended);
            // The first tick fires at once: hyper holds the response head until
            // the body yields a chunk, so an opening comment is what lets the
            // client see the stream start.
            let mut keepalive = tokio::time::interval(KEEPALIVE_INTERVAL);
            keepalive.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = &mut ended => break,
                    () = sender.closed() => break,
                    _ = keepalive.tick() => {
                        // A client too far behind to take a keepalive does not need another one.
                        if let Err(mpsc::error::TrySendError::Closed(_)) =
                            sender.try_send(Bytes::from_static(KEEPALIVE_COMMENT))
                        {
                            break;
                        }
                    }
                }
            }
        });
        event_stream_response(Body::Events(receiver))
    }

    fn end_session(&self, headers: &HeaderMap) -> Response<Body> {
        let Some(raw_id) = header(headers, HEADER_SESSION_ID) else {
            return error_response(
                StatusCode::BAD_REQUEST,
                &Value::Null,
                &RpcError::session_required(),
            );
        };
        let ended = std::str::from_utf8(raw_id).is_ok_and(|id| self.sessions.end(id));
        if ended {
            empty_response(StatusCode::OK)
        } else {
            error_response(
                StatusCode::NOT_FOUND,
                &Value::Null,
                &RpcError::session_not_found(),
            )
        }
    }

    /// The session a request names, or the status and error that refuse it.
    fn find_session(&self, raw_id: Option<&[u8]>) -> Result<Arc<Session>, (StatusCode, RpcError)> {
        let Some(raw_id) = raw_id else {
            return Err((StatusCode::BAD_REQUEST, RpcError::session_required()));
        };
        std::str::from_utf8(raw_id)
            .ok()
            .and_then(|id| self.sessions.get(id))
            .ok_or_else(|| (StatusCode::NOT_FOUND, RpcError::session_not_found()))
    }
}

/// `slow_stream`: each event is its own body frame, so it leaves as soon
/// as it is made; the task stops early if the client goes away.
fn stream_progress(
    era: Era,
    id: Value,
    plan: SlowStream,
    progress_token: Option<Value>,
) -> Response<Body> {
    let (sender, receiver) = mpsc::channel(EVENT_QUEUE);
    tokio::spawn(async move {
        for step in 1..=plan.steps {
            if step > 1 {
                tokio::time::sleep(plan.interval).await;
            }
            let (method, params) = plan.step_notification(step, progress_token.as_ref());
            let event = sse_event(&protocol::encode_notification(method, &params));
            if sender.send(event).await.is_err() {
                return;
            }
        }
        let result = methods::finish_result(era, plan.final_result());
        // Nobody is left to tell if this fails: the client is gone.
        let _ = sender
            .send(sse_event(&protocol::encode_result(&id, &result)))
            .await;
    });
    event_stream_response(Body::Events(receiver))
}

async fn read_body(body: Incoming) -> Result<Bytes, (StatusCode, RpcError)> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            RpcError::invalid_request(format!(
                "Payload Too Large: a JSON-RPC message may be at most {MAX_BODY_BYTES} bytes"
            )),
        )),
        Err(error) => Err((
            StatusCode::BAD_REQUEST,
            RpcError::invalid_request(format!(
                "Bad Request: could not read the request body ({error})"
            )),
        )),
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a [u8]> {
    headers.get(name).map(HeaderValue::as_bytes)
}

fn routing_header<'a>(headers: &'a HeaderMap, name: &str) -> RoutingHeader<'a> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => RoutingHeader::Absent,
        (Some(value), None) => RoutingHeader::Once(value.as_bytes()),
        (Some(_), Some(_)) => RoutingHeader::Repeated,
    }
}

fn status(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn json_response(status: StatusCode, json: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::whole(json));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn event_stream_response(body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(
        CACHE_CONTROL,
        HeaderValue::from_static("no-cache, no-transform"),
    );
    // Tells nginx-style proxies not to buffer the events.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

fn error_response(status: StatusCode, id: &Value, error: &RpcError) -> Response<Body> {
    json_response(status, protocol::encode_error(id, error))
}

fn method_not_allowed(allow: &'static str, message: &'static str) -> Response<Body> {
    let mut response = error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &Value::Null,
        &RpcError::invalid_request(message),
    );
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    response
}

fn accepted() -> Response<Body> {
    empty_response(StatusCode::ACCEPTED)
}

fn empty_response(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = status;
    response
}
