//! The public HTTP front: accepts client connections on the shared port (within the
//! worker's connection cap), turns each request into a checked call (within the head
//! size, body size and body time limits), and writes the reply (streams relayed as
//! they come). Every refusal is one log line and a JSON-RPC error body.

use crate::dispatch::Router;
use crate::reason::Reason;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, StatusCode, request::Parts};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::{debug, info, warn};

use crate::auth;
use crate::body::{self, ReplyBody};
use crate::mcp::{self, GatewayError};
use crate::reply::{HEADER_EDGE_WORKER, Reply};
use crate::request;
use crate::worker::Worker;

/// Serves clients until `stop` holds a grace period, then closes the port (after
/// serving the connections waiting in its queue) and lets open exchanges finish for up
/// to that long.
pub async fn serve(
    worker: Arc<Worker>,
    listener: std::net::TcpListener,
    mut stop: watch::Receiver<Option<Duration>>,
) -> std::io::Result<()> {
    let listener = TcpListener::from_std(listener)?;
    let mut front = Front::new(worker);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                match accepted {
                    Ok((stream, peer)) => front.serve(stream, peer),
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            _ = stop.wait_for(Option::is_some) => break,
        }
    }
    // Connections the kernel already completed wait in the listener's queue (a load
    // balancer may have sent its request on one): closing the listener would reset
    // them, and a request that was sent cannot be replayed safely. So they are taken
    // and served first; only a connection completed after the last of them can still
    // be reset, which is why the port closes only once load balancers stopped sending
    // (the lame duck's delay, or the operator taking the worker out of the balancer).
    let queued = take_queued(listener);
    if !queued.is_empty() {
        info!(worker = %front.worker.id, connections = queued.len(), "serving the connections queued at the port's close");
    }
    for (stream, peer) in queued {
        front.serve(stream, peer);
    }
    let grace = stop.borrow().unwrap_or_default();
    if tokio::time::timeout(grace, front.finish()).await.is_err() {
        warn!(
            ?grace,
            "connections still open after the drain deadline; closing them"
        );
    }
    Ok(())
}

/// How long a connection must have started no request, once the drain reaches it,
/// before it is closed: a request already in its socket (unread by hyper, which would
/// take the connection for idle) starts well within this and is served.
const QUIET_BEFORE_CLOSE: Duration = Duration::from_millis(250);

/// The public port's connections: how each is served, and what a drain waits for.
struct Front {
    worker: Arc<Worker>,
    keep_alive: hyper::server::conn::http1::Builder,
    /// For connections accepted once the worker drains: one request, then close.
    one_request: hyper::server::conn::http1::Builder,
    /// Set when the port has closed: every connection ends once quiet.
    closing: watch::Sender<bool>,
    /// One permit per open connection (the connection cap); all of them back means
    /// every connection ended.
    connections: Arc<Semaphore>,
    refusals: RefusalLog,
}

impl Front {
    fn new(worker: Arc<Worker>) -> Front {
        let limits = &worker.config.limits;
        let builder = |keep_alive: bool| {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .keep_alive(keep_alive)
                .timer(TokioTimer::new())
                // Slow-loris guard: a client must send its headers within this time.
                .header_read_timeout(Duration::from_secs(30))
                // A larger head gets hyper's own 431.
                .max_buf_size(limits.max_header_bytes);
            builder
        };
        Front {
            keep_alive: builder(true),
            one_request: builder(false),
            closing: watch::channel(false).0,
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            refusals: RefusalLog::default(),
            worker,
        }
    }

    /// Serves one accepted connection (within the connection cap).
    fn serve(&mut self, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let _ = stream.set_nodelay(true);
        let max = self.worker.config.limits.max_connections;
        let Ok(permit) = Arc::clone(&self.connections).try_acquire_owned() else {
            self.refusals.note(max);
            tokio::spawn(refuse_connection(stream, max));
            return;
        };
        let started = Arc::new(AtomicU64::new(0));
        let worker = Arc::clone(&self.worker);
        let counted = Arc::clone(&started);
        let service = service_fn(move |req| {
            let worker = Arc::clone(&worker);
            counted.fetch_add(1, Ordering::Relaxed);
            async move {
                let mut response = handle(Arc::clone(&worker), req, peer).await;
                if worker.draining() {
                    // A lame duck's answers end their connections, so that clients and
                    // load balancers open the next one elsewhere instead of reusing
                    // one that the closing port would cut.
                    response
                        .headers_mut()
                        .insert(CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(response)
            }
        });
        let builder = if self.worker.draining() {
            &self.one_request
        } else {
            &self.keep_alive
        };
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let mut closing = self.closing.subscribe();
        tokio::spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => Some(ended),
                _ = closing.wait_for(|closing| *closing) => None,
            };
            let ended = match ended {
                Some(ended) => ended,
                // Not closed while a request may sit unread in its socket: hyper would
                // take the connection for idle and close it under a request the client
                // sent and cannot tell whether it ran. So it is closed (gracefully: an
                // exchange in progress finishes) once it has begun no request for
                // QUIET_BEFORE_CLOSE.
                None => loop {
                    let seen = started.load(Ordering::Relaxed);
                    tokio::select! {
                        ended = connection.as_mut() => break ended,
                        () = tokio::time::sleep(QUIET_BEFORE_CLOSE) => {
                            if started.load(Ordering::Relaxed) == seen {
                                connection.as_mut().graceful_shutdown();
                                break connection.await;
                            }
                        }
                    }
                },
            };
            if let Err(e) = ended {
                debug!(%peer, error = %e, "client connection ended with an error");
            }
            drop(permit);
        });
    }

    /// Ends every connection once it is quiet (its exchange done, no request begun for
    /// [`QUIET_BEFORE_CLOSE`]) and waits until all have ended.
    async fn finish(self) {
        let _ = self.closing.send(true);
        let all = u32::try_from(self.worker.config.limits.max_connections).unwrap_or(u32::MAX);
        let _ = self.connections.acquire_many(all).await;
    }
}

/// Closes the listener after taking every connection waiting in its accept queue
/// (non-blocking accepts until the queue is empty). An accept error other than an
/// empty queue ends the taking: the listener closes as before.
fn take_queued(listener: TcpListener) -> Vec<(tokio::net::TcpStream, SocketAddr)> {
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(e) => {
            warn!(error = %e, "cannot take the connections queued at the port's close");
            return Vec::new();
        }
    };
    let mut queued = Vec::new();
    if listener.set_nonblocking(true).is_err() {
        return queued;
    }
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                let stream = stream
                    .set_nonblocking(true)
                    .and_then(|()| tokio::net::TcpStream::from_std(stream));
                match stream {
                    Ok(stream) => queued.push((stream, peer)),
                    Err(e) => debug!(%peer, error = %e, "a queued connection could not be served"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    warn!(error = %e, "accept failed while taking the queued connections");
                }
                break;
            }
        }
    }
    queued
}

/// Past the connection cap: a 503 with a JSON-RPC body, then the connection closes.
/// What the client sent is read first (briefly), so the answer is not lost to a reset.
async fn refuse_connection(mut stream: tokio::net::TcpStream, max: usize) {
    let error = GatewayError::gateway(
        StatusCode::SERVICE_UNAVAILABLE,
        Reason::ConnectionLimit,
        format!(
            "this worker serves its maximum of {max} connections: retry shortly, reuse \
             connections, or add workers"
        ),
    )
    .with_reason(Reason::ConnectionLimit)
    .with_data(serde_json::json!({ "retryable": true}))
    .with_retry_after(1);
    let body = error.body();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut sink = [0u8; 16 * 1024];
    let _ = tokio::time::timeout(
        Duration::from_millis(200),
        tokio::io::AsyncReadExt::read(&mut stream, &mut sink),
    )
    .await;
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(&body).await;
    let _ = stream.shutdown().await;
}

/// Logs refused connections once per burst, not once per connection: a flood must not
/// become a flood of log lines.
#[derive(Default)]
struct RefusalLog {
    refused: u64,
    last_logged: Option<tokio::time::Instant>,
}

impl RefusalLog {
    fn note(&mut self, max: usize) {
        self.refused += 1;
        let now = tokio::time::Instant::now();
        if self
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(10))
        {
            warn!(
                max_connections = max,
                refused = self.refused,
                "connection cap reached: refusing new connections with 503"
            );
            self.last_logged = Some(now);
            self.refused = 0;
        }
    }
}

async fn handle(
    worker: Arc<Worker>,
    request: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ReplyBody> {
    let (mut parts, body) = request.into_parts();
    if parts.uri.path() == "/healthz" {
        return health(&worker);
    }
    // Kept for the challenge of a 401/403, which points at the route's metadata under
    // the URL this client used (only the edge knows it).
    let path = parts.uri.path().to_owned();
    let base = worker.auth.base_url(&parts.headers);
    if let Some(resource) = path.strip_prefix(auth::metadata::WELL_KNOWN) {
        return metadata_response(&worker, &parts.method, resource, base.as_deref());
    }
    let arrived = tokio::time::Instant::now();
    let route = worker.endpoints.resolve(&path);
    let http_method = parts.method.clone();
    // Kept as the value (a shared reference to the request's bytes), hashed only if logged.
    let session = parts.headers.get(mcp::HEADER_SESSION_ID).cloned();
    let mut method_label = "none";
    // Before the call is built from the headers: the span's context replaces the
    // client's `traceparent`, so the owner and the upstream become its children.
    let span = worker
        .tracer
        .as_ref()
        .and_then(|tracer| tracer.begin(&mut parts.headers));
    let accepted = accept_call(&worker, route, parts, body, peer, &mut method_label).await;
    let (reply, refusal) = match accepted {
        Ok(reply) => (reply, None),
        Err(error) => (Reply::from_error(&error), Some(error)),
    };
    let route_label = match route {
        Some(index) => worker.routes[index].label(),
        None => &worker.unrouted_label,
    };
    let elapsed = arrived.elapsed();
    worker
        .metrics
        .request(route_label, method_label, reply.status, elapsed);
    let record = RequestRecord {
        worker: &worker,
        http_method: &http_method,
        route: route_label,
        method: method_label,
        session,
        reply: &reply,
        refusal: refusal.as_ref(),
        elapsed,
    };
    if let (Some(tracer), Some(span)) = (&worker.tracer, span) {
        tracer.finish(span, edge_span_facts(&record));
    }
    log_request(&record);
    let mut response = into_response(reply);
    let status = response.status();
    worker.auth.complete_challenge(
        route,
        &path,
        base.as_deref(),
        status,
        response.headers_mut(),
    );
    response
        .headers_mut()
        .insert(HEADER_EDGE_WORKER, worker.id_header.clone());
    response
}

/// The protected-resource metadata of the route `resource` names (RFC 9728).
fn metadata_response(
    worker: &Worker,
    method: &http::Method,
    resource: &str,
    base: Option<&str>,
) -> Response<ReplyBody> {
    let reply = worker
        .auth
        .metadata(method, worker.endpoints.resolve(resource), resource, base);
    let mut response = into_response(reply);
    response
        .headers_mut()
        .insert(HEADER_EDGE_WORKER, worker.id_header.clone());
    response
}

/// What the edge's span of a request says: no session id (a credential), no token.
fn edge_span_facts(record: &RequestRecord<'_>) -> crate::trace::SpanFacts {
    let (owner, reason) = (record.owner(), record.reason());
    let mut attributes = vec![
        ("mcp.method.name", serde_json::json!(record.method)),
        ("http.route", serde_json::json!(record.route)),
        (
            "http.response.status_code",
            serde_json::json!(record.reply.status.as_u16()),
        ),
        ("mcpgw.worker", serde_json::json!(record.worker.id)),
        ("mcpgw.forwarded", serde_json::json!(record.forwarded())),
    ];
    if !owner.is_empty() {
        attributes.push(("mcpgw.owner_worker", serde_json::json!(owner)));
    }
    if !reason.is_empty() {
        attributes.push(("mcpgw.reason", serde_json::json!(reason)));
    }
    crate::trace::SpanFacts {
        name: format!("mcpgw {}", record.method),
        attributes,
        error: record.reply.status.is_server_error(),
    }
}

/// What the one log line of a request says.
struct RequestRecord<'a> {
    worker: &'a Worker,
    http_method: &'a http::Method,
    route: &'a str,
    /// The MCP method (a bounded label, see [`crate::metrics::method_label`]).
    method: &'static str,
    /// The session id the request carried: a credential, logged only as its tag.
    session: Option<http::HeaderValue>,
    reply: &'a Reply,
    /// The gateway's own refusal, when it refused (its message and log detail).
    refusal: Option<&'a GatewayError>,
    elapsed: Duration,
}

impl RequestRecord<'_> {
    /// The worker that ran the request, as its answer says; empty when none did.
    fn owner(&self) -> &str {
        self.reply
            .headers
            .get(crate::reply::HEADER_OWNER_WORKER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// Whether another worker ran it.
    fn forwarded(&self) -> bool {
        let owner = self.owner();
        !owner.is_empty() && owner != self.worker.id
    }

    /// The refusal's `data.reason`; empty when the gateway did not refuse.
    fn reason(&self) -> &str {
        self.refusal
            .and_then(|e| e.reason)
            .map(Reason::as_str)
            .unwrap_or("")
    }
}

/// One line per failed request (a successful one only with `--log-requests`): worker,
/// route, method, session hash, whether it was forwarded and to whom, status, reason
/// and duration. Never a token or a whole session id.
fn log_request(record: &RequestRecord<'_>) {
    let status = record.reply.status;
    let failed = status.is_client_error() || status.is_server_error();
    if !failed && !record.worker.config.log_requests {
        return;
    }
    let (owner, forwarded, reason) = (record.owner(), record.forwarded(), record.reason());
    let session = record
        .session
        .as_ref()
        .and_then(mcp::session_tag_of)
        .map(|tag| tag.to_string())
        .unwrap_or_default();
    let message = record.refusal.map_or("", |e| e.message.as_str());
    let detail = record
        .refusal
        .and_then(|e| e.log_detail.as_deref())
        .unwrap_or("");
    let duration_ms = record.elapsed.as_secs_f64() * 1000.0;
    macro_rules! line {
        ($level:ident) => {
            $level!(
                worker = %record.worker.id,
                http = %record.http_method,
                route = record.route,
                method = record.method,
                session,
                forwarded,
                owner,
                status = status.as_u16(),
                reason,
                duration_ms,
                detail,
                "{message}"
            )
        };
    }
    if status.is_server_error() {
        line!(warn);
    } else {
        line!(info);
    }
}

/// Authenticates the client for the route, checks the request, reads its body,
/// checks its scopes, counts it against the rate limit (here, once per client request,
/// never again at an owner), and dispatches the call. `route`: the path's route, as
/// [`handle`] resolved it once.
async fn accept_call(
    worker: &Arc<Worker>,
    route: Option<usize>,
    parts: Parts,
    body: Incoming,
    peer: SocketAddr,
    method_label: &mut &'static str,
) -> Result<Reply, GatewayError> {
    let path = parts.uri.path();
    let route = route.ok_or_else(|| worker.endpoints.not_found(path))?;
    let auth = worker.auth.authenticate(route, &parts.headers).await?;
    let era = request::check_head_of(&parts.method, &parts.headers)?;
    let limits = &worker.config.limits;
    let body = read_body(body, &parts, limits.max_body_bytes, limits.body_timeout).await?;
    let mut call = request::parse_call(
        route,
        era,
        parts.method.clone(),
        path,
        &parts.headers,
        body,
        auth,
    )?;
    *method_label =
        crate::metrics::method_label(call.message.as_ref().and_then(|m| m.method()), &call.method);
    call.client = Some(client_addr(
        peer,
        &parts.headers,
        worker.config.trust_forwarded_for,
    ));
    worker.auth.authorize(&call)?;
    worker.auth.admit(&call).await?;
    let expires_at_ms = call.auth.expires_at_ms;
    let reply = Router::of(worker).dispatch(call).await?;
    Ok(match expires_at_ms {
        Some(at) if crate::execute::is_sse(&reply.headers) => end_at_expiry(reply, at),
        _ => reply,
    })
}

/// A stream held with a credential that expires ends at the expiry with an SSE error
/// event that says why: the owner checks the credential per request, and a held stream
/// is one request that would otherwise outlive it.
fn end_at_expiry(mut reply: Reply, expires_at_ms: u64) -> Reply {
    let left = Duration::from_millis(expires_at_ms.saturating_sub(crate::auth::now_ms()));
    let error = GatewayError::new(
        StatusCode::UNAUTHORIZED,
        crate::mcp::code::GATEWAY_ERROR,
        "the bearer token this stream was opened with has expired, so the stream ended: \
         get a new token and open the stream again",
    )
    .with_reason(Reason::InvalidToken)
    .with_data(serde_json::json!({ "problem": "expired" }));
    let mut event = b"event: message\ndata: ".to_vec();
    event.extend_from_slice(&error.body());
    event.extend_from_slice(b"\n\n");
    reply.body = crate::body::end_at(
        reply.body,
        tokio::time::Instant::now() + left,
        Bytes::from(event),
    );
    reply
}

/// The client's address: the connection's peer, or, behind a trusted proxy, the last
/// `X-Forwarded-For` entry (the one the proxy itself appended). Only that entry: the
/// ones before it are the client's own words. When it does not parse, the header is
/// ignored (the peer stands), never an earlier entry used in its place.
fn client_addr(peer: SocketAddr, headers: &http::HeaderMap, trust_forwarded_for: bool) -> IpAddr {
    if !trust_forwarded_for {
        return peer.ip();
    }
    let Some(last_line) = headers.get_all("x-forwarded-for").iter().next_back() else {
        return peer.ip();
    };
    let rightmost = last_line
        .to_str()
        .ok()
        .and_then(|line| line.rsplit(',').next())
        .map(str::trim)
        .unwrap_or("");
    rightmost
        .parse::<IpAddr>()
        .or_else(|_| rightmost.parse::<SocketAddr>().map(|addr| addr.ip()))
        .unwrap_or(peer.ip())
}

async fn read_body(
    body: Incoming,
    parts: &Parts,
    max: usize,
    deadline: Duration,
) -> Result<Bytes, GatewayError> {
    let too_large = || {
        GatewayError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            mcp::code::INVALID_REQUEST,
            format!("request body exceeds the {max}-byte limit: send a smaller message"),
        )
    };
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Err(too_large());
    }
    let read = tokio::time::timeout(deadline, Limited::new(body, max).collect());
    match read.await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => Err(GatewayError::invalid_request(format!(
            "could not read the request body: {e}"
        ))),
        Err(_) => Err(GatewayError::new(
            StatusCode::REQUEST_TIMEOUT,
            mcp::code::INVALID_REQUEST,
            format!(
                "the request body did not arrive within {}s: send the whole message at once",
                deadline.as_secs_f64()
            ),
        )
        .with_reason(Reason::BodyTimeout)),
    }
}

/// Liveness for load balancers, and nothing else: details are for operators, on the
/// admin listener. The worker's id is in the header every answer carries.
fn health(worker: &Worker) -> Response<ReplyBody> {
    let (status, state) = if worker.draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else {
        (StatusCode::OK, "ok")
    };
    let body = serde_json::json!({ "status": state });
    let mut response = Response::new(body::full(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(HEADER_EDGE_WORKER, worker.id_header.clone());
    response
}

fn into_response(reply: Reply) -> Response<ReplyBody> {
    let mut response = Response::new(reply.body);
    *response.status_mut() = reply.status;
    *response.headers_mut() = reply.headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_entry_the_trusted_proxy_appended_is_the_client_address() {
        let peer: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let with = |lines: &[&str]| {
            let mut headers = http::HeaderMap::new();
            for line in lines {
                headers.append("x-forwarded-for", line.parse().unwrap());
            }
            client_addr(peer, &headers, true)
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(with(&["203.0.113.9"]), ip("203.0.113.9"));
        assert_eq!(with(&["1.2.3.4, 203.0.113.9"]), ip("203.0.113.9"));
        assert_eq!(with(&["1.2.3.4", "203.0.113.9"]), ip("203.0.113.9"));
        assert_eq!(with(&["203.0.113.9:4711"]), ip("203.0.113.9"));
        // An unparsable last entry: the header is ignored, the client's entry unused.
        assert_eq!(with(&["1.2.3.4, garbage"]), ip("10.0.0.1"));
        assert_eq!(with(&["1.2.3.4", ""]), ip("10.0.0.1"));
        assert_eq!(with(&[]), ip("10.0.0.1"));
        let mut headers = http::HeaderMap::new();
        headers.insert("x-forwarded-for", "203.0.113.9".parse().unwrap());
        assert_eq!(
            client_addr(peer, &headers, false),
            ip("10.0.0.1"),
            "not trusted"
        );
    }
}
