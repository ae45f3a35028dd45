//! The admin listener: one per worker, separate from the public port and on loopback
//! by default, for operators and their tools. `/healthz` (alive), `/readyz` (fit to
//! take traffic, with the reasons when not), `/state` (this worker as JSON),
//! `/metrics` (Prometheus), and `POST /drain` (drain as on SIGTERM).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::body::{self, ReplyBody};
use crate::worker::Worker;

/// Binds the admin listener (before the worker announces itself, so its address can be
/// announced too).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the admin endpoints for as long as the process runs: through a drain too,
/// so `/readyz` says "draining" until the very end.
pub async fn serve(worker: Arc<Worker>, listener: TcpListener) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let worker = Arc::clone(&worker);
        let service = service_fn(move |request| {
            let worker = Arc::clone(&worker);
            async move { Ok::<_, Infallible>(answer(&worker, &request)) }
        });
        let connection = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                debug!(%peer, error = %e, "admin connection ended with an error");
            }
        });
    }
}

fn answer(worker: &Worker, request: &Request<Incoming>) -> Response<ReplyBody> {
    if request.uri().path() == "/drain" {
        return drain(worker, request.method());
    }
    if request.method() != Method::GET {
        return json(
            StatusCode::METHOD_NOT_ALLOWED,
            serde_json::json!({"error": "the admin endpoints answer GET only"}),
        );
    }
    match request.uri().path() {
        "/healthz" => json(StatusCode::OK, serde_json::json!({"status": "alive"})),
        "/readyz" => {
            let readiness = Readiness::of(worker);
            let status = if readiness.ready() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            json(status, readiness.to_json())
        }
        "/state" => json(StatusCode::OK, state(worker)),
        "/metrics" => metrics(worker),
        path => json(
            StatusCode::NOT_FOUND,
            serde_json::json!({
                "error": format!("no admin endpoint at {path:?}: use /healthz, /readyz, /state, /metrics or POST /drain"),
            }),
        ),
    }
}

/// `POST /drain`: the drain SIGTERM starts (the public port closes, exchanges in flight
/// finish, sessions end, the lease is deleted, the process exits 0). Anyone who can
/// reach the admin listener may ask, which is why it binds loopback by default.
fn drain(worker: &Worker, method: &Method) -> Response<ReplyBody> {
    if method != Method::POST {
        return json(
            StatusCode::METHOD_NOT_ALLOWED,
            serde_json::json!({"error": "a drain is requested with POST /drain"}),
        );
    }
    worker.request_drain("the admin listener (POST /drain)");
    json(
        StatusCode::ACCEPTED,
        serde_json::json!({
            "worker_id": worker.id,
            "draining": true,
            "message": "draining as on SIGTERM: no new requests; sessions end once the \
                        exchanges in flight have finished, then the worker exits",
        }),
    )
}

/// Whether the worker is fit to take traffic, check by check.
struct Readiness {
    /// Not draining or fenced.
    serving: bool,
    /// Its lease is valid by its own clock: Redis answered recently enough. Always
    /// true for a standalone worker.
    lease_valid: bool,
    /// The mesh leaf in use has not expired (true without mesh certificates): an
    /// expired leaf can neither dial nor be dialled.
    mesh_cert_valid: bool,
}

impl Readiness {
    fn of(worker: &Worker) -> Readiness {
        Readiness {
            serving: !worker.draining(),
            lease_valid: worker.lease_valid(),
            mesh_cert_valid: worker
                .mesh_tls
                .get()
                .is_none_or(|tls| tls.current().leaf_not_after() > std::time::SystemTime::now()),
        }
    }

    fn ready(&self) -> bool {
        self.serving && self.lease_valid && self.mesh_cert_valid
    }

    fn to_json(&self) -> serde_json::Value {
        let mut reasons = Vec::new();
        if !self.serving {
            reasons.push("draining: the worker takes no new sessions and is stopping");
        }
        if !self.lease_valid {
            reasons
                .push("lease not confirmed: the fleet directory (Redis) has not answered in time");
        }
        if !self.mesh_cert_valid {
            reasons.push(
                "mesh certificate expired: issue a new leaf (`mcpgw certs issue` or `certs rotate \
                 reissue`); the worker picks it up without a restart",
            );
        }
        serde_json::json!({
            "ready": self.ready(),
            "checks": {
                "serving": self.serving,
                "lease_valid": self.lease_valid,
                "mesh_cert_valid": self.mesh_cert_valid,
            },
            "reasons": reasons,
        })
    }
}

/// The Prometheus scrape: gauges that mirror state are read now, then everything is
/// encoded in the OpenMetrics text format.
fn metrics(worker: &Worker) -> Response<ReplyBody> {
    let metrics = &worker.metrics;
    metrics.set_worker_state(crate::metrics::WorkerState {
        sessions_owned: worker.sessions.len(),
        draining: worker.draining(),
        lease_valid: worker.lease_valid(),
        replay_bytes: worker.replay_budget.used(),
        replay_budget_bytes: worker.replay_budget.limit(),
        runtime_threads: tokio::runtime::Handle::current().metrics().num_workers(),
    });
    if let Some(tls) = worker.mesh_tls.get() {
        metrics.set_mesh_certs(tls);
    }
    if let Some((passed, refused)) = worker.auth.rate_limit_unavailable() {
        metrics.set_rate_limit_unavailable(passed, refused);
    }
    if let Some((caller, owner)) = worker.mesh_streams.get() {
        metrics.set_mesh_streams("caller", caller.counts());
        metrics.set_mesh_streams("owner", owner.counts());
    }
    match metrics.encode() {
        Ok(text) => {
            let mut response = Response::new(body::full(Bytes::from(text)));
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        Err(e) => json(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({"error": format!("metrics could not be encoded: {e}")}),
        ),
    }
}

fn state(worker: &Worker) -> serde_json::Value {
    serde_json::json!({
        "worker_id": worker.id,
        "pid": std::process::id(),
        "host": crate::process::hostname(),
        "version": env!("CARGO_PKG_VERSION"),
        "sessions": worker.sessions.len(),
        "draining": worker.draining(),
        "fleet": worker.fleet().is_some(),
        "lease_valid": worker.lease_valid(),
        "mesh_cert": worker.mesh_tls.get().map(|tls| {
            let material = tls.current();
            let stats = tls.stats();
            serde_json::json!({
                "identity": material.leaf().uri,
                "leaf_fingerprint": material.leaf_fingerprint(),
                "leaf_not_after": mcpgw_certs::inspect::rfc3339(
                    material.leaf_not_after().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)),
                "ca_fingerprints": material.ca_fingerprints(),
                "reloads": stats.reloaded,
                "refused": stats.refused,
                "pending_refusal": stats.pending_refusal,
            })
        }),
        // Each open mesh connection with the peer leaf it was made with: after a
        // rotation, shows when no connection rests on an old certificate any more.
        "mesh_connections": mcpgw_mesh::transport::open_connections(),
    })
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<ReplyBody> {
    let mut response = Response::new(body::full(Bytes::from(value.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
