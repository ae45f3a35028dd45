//! The public HTTP front: accepts client connections on the shared port, turns each
//! request into a checked call, and writes the reply (streams relayed as they come).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, StatusCode, request::Parts};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::auth;
use crate::body::{self, ReplyBody};
use crate::mcp::{self, GatewayError};
use crate::reply::{HEADER_EDGE_WORKER, Reply};
use crate::request;
use crate::worker::Worker;

/// Serves clients until `stop` holds a grace period, then closes the port and lets
/// open exchanges finish for up to that long.
pub async fn serve(
    worker: Arc<Worker>,
    listener: std::net::TcpListener,
    mut stop: watch::Receiver<Option<Duration>>,
) -> std::io::Result<()> {
    let listener = TcpListener::from_std(listener)?;
    let graceful = GracefulShutdown::new();
    let http = {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .keep_alive(true)
            .timer(TokioTimer::new())
            // Slow-loris guard: a client must send its headers within this time.
            .header_read_timeout(Duration::from_secs(30));
        builder
    };
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let worker = Arc::clone(&worker);
                let service = service_fn(move |req| {
                    let worker = Arc::clone(&worker);
                    async move { Ok::<_, Infallible>(handle(worker, req).await) }
                });
                let connection = http.serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        debug!(%peer, error = %e, "client connection ended with an error");
                    }
                });
            }
            _ = stop.wait_for(Option::is_some) => break,
        }
    }
    drop(listener);
    let grace = stop.borrow().unwrap_or_default();
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(
            ?grace,
            "connections still open after the drain deadline; closing them"
        );
    }
    Ok(())
}

async fn handle(worker: Arc<Worker>, request: Request<Incoming>) -> Response<ReplyBody> {
    let (parts, body) = request.into_parts();
    if parts.uri.path() == "/healthz" {
        return health(&worker);
    }
    // Kept for the challenge of a 401/403, which points at the route's metadata under
    // the URL this client used (only the edge knows it).
    let path = parts.uri.path().to_owned();
    let base = worker.auth.base_url(&parts.headers);
    if let Some(resource) = path.strip_prefix(auth::metadata::WELL_KNOWN) {
        let reply = worker.auth.metadata(
            &parts.method,
            worker.routes.resolve(resource),
            resource,
            base.as_deref(),
        );
        let mut response = into_response(reply);
        response
            .headers_mut()
            .insert(HEADER_EDGE_WORKER, worker.id_header.clone());
        return response;
    }
    let reply = match accept_call(&worker, parts, body).await {
        Ok(reply) => reply,
        Err((error, method, path)) => {
            // The one log line for a refused request; the client gets the same words.
            if error.status.is_server_error() {
                warn!(%method, path, status = error.status.as_u16(), code = error.code, "{}", error.message);
            } else {
                info!(%method, path, status = error.status.as_u16(), code = error.code, "{}", error.message);
            }
            Reply::from_error(&error)
        }
    };
    let mut response = into_response(reply);
    let status = response.status();
    worker.auth.complete_challenge(
        worker.routes.resolve(&path),
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

type Refusal = (GatewayError, http::Method, String);

/// Authenticates the client for the route, checks the request, reads its body,
/// checks its scopes, counts it against the rate limit (here, once per client request,
/// never again at an owner), and dispatches the call; a refusal carries what the log
/// line needs.
async fn accept_call(worker: &Arc<Worker>, parts: Parts, body: Incoming) -> Result<Reply, Refusal> {
    let path = parts.uri.path().to_owned();
    let refuse = |e: GatewayError| (e, parts.method.clone(), path.clone());
    let route = worker
        .routes
        .resolve(&path)
        .ok_or_else(|| worker.routes.not_found(&path))
        .map_err(refuse)?;
    let auth = worker
        .auth
        .authenticate(route, &parts.headers)
        .await
        .map_err(refuse)?;
    let (upstream, era) = request::check_head(&worker.routes, &parts.method, &path, &parts.headers)
        .map_err(refuse)?;
    let body = read_body(body, &parts, worker.config.limits.max_body_bytes)
        .await
        .map_err(refuse)?;
    let call = request::parse_call(
        upstream,
        era,
        parts.method.clone(),
        &path,
        &parts.headers,
        body,
        auth,
    )
    .map_err(refuse)?;
    worker.auth.authorize(&call).map_err(refuse)?;
    worker.auth.admit(&call).await.map_err(refuse)?;
    worker.dispatch(call).await.map_err(refuse)
}

async fn read_body(body: Incoming, parts: &Parts, max: usize) -> Result<Bytes, GatewayError> {
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
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(GatewayError::invalid_request(format!(
            "could not read the request body: {e}"
        ))),
    }
}

fn health(worker: &Worker) -> Response<ReplyBody> {
    let body = serde_json::json!({
        "worker_id": worker.id,
        "pid": std::process::id(),
        "sessions": worker.sessions.len(),
        "draining": worker.draining(),
    });
    let mut response = Response::new(body::full(Bytes::from(body.to_string())));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn into_response(reply: Reply) -> Response<ReplyBody> {
    let mut response = Response::new(reply.body);
    *response.status_mut() = reply.status;
    *response.headers_mut() = reply.headers;
    response
}
