//! The owner's side of forwarding: a request frame from a peer worker becomes a call
//! again and runs on this worker's normal local path (never through the public
//! port), and the reply streams back as mesh response parts.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use http::{HeaderMap, Method};
use http_body_util::BodyExt;
use mcpgw_mesh::transport::{MeshService, PeerInfo, ResponsePart};
use mcpgw_wire::{ErrorFrame, ErrorKind, RequestFrame, ResponseHead};
use tracing::{debug, info};

use super::BadHeader;
use crate::decision::{self, Decision, Fact, Known, Refusal, SessionKind, Side};
use crate::dispatch::Router;
use crate::execute::Executor;
use crate::reply::Reply;
use crate::request;
use crate::worker::Worker;

/// The owner's end of the mesh: serves forwarded requests with this worker.
pub struct OwnerService(pub Arc<Worker>);

impl MeshService for OwnerService {
    fn serve(&self, request: RequestFrame, peer: PeerInfo) -> BoxStream<'static, ResponsePart> {
        serve_stream(Arc::clone(&self.0), request, peer)
    }

    /// From the caller's lease in the directory (one round trip per new connection).
    /// A directory that cannot answer lets the caller in: it is a mesh member either
    /// way, and refusing would cut forwarding off for as long as Redis is away.
    fn registered_identity(&self, worker_id: &str) -> BoxFuture<'static, Option<String>> {
        let worker = Arc::clone(&self.0);
        let worker_id = worker_id.to_owned();
        Box::pin(async move {
            let fleet = worker.fleet()?;
            match fleet.directory.worker_endpoint(&worker_id).await {
                Ok(endpoint) => endpoint.and_then(|endpoint| endpoint.identity),
                Err(e) => {
                    debug!(caller = %worker_id, error = %e, "caller's identity unknown: directory unavailable");
                    None
                }
            }
        })
    }
}

fn serve_stream(
    worker: Arc<Worker>,
    request: RequestFrame,
    peer: PeerInfo,
) -> BoxStream<'static, ResponsePart> {
    let deadline = Duration::from_millis(u64::from(request.deadline_ms));
    // Boxed at once: the request's whole local path is inside, kilobytes that every
    // wrapper below would otherwise copy again as it takes the future in.
    let run = Box::pin(async move {
        let request_id = request.request_id;
        match serve_forwarded(&worker, request, &peer.worker_id).await {
            Ok(reply) => reply_parts(reply),
            Err(frame) => {
                debug!(request_id, peer = %peer.worker_id, kind = ?frame.kind, "forwarded request refused: {}", frame.message);
                futures_util::stream::iter([ResponsePart::Error(frame)]).boxed()
            }
        }
    });
    // The head must come within the deadline; the body may stream on after it.
    let timed = async move {
        match tokio::time::timeout(deadline, run).await {
            Ok(parts) => parts,
            Err(_) => futures_util::stream::iter([ResponsePart::Error(ErrorFrame {
                kind: ErrorKind::DeadlineExceeded,
                message: format!("the owner did not start answering within {deadline:?}"),
            })])
            .boxed(),
        }
    };
    futures_util::stream::once(timed).flatten().boxed()
}

/// Runs a forwarded request exactly as a local one: the same checks, the same path.
/// `edge`: the worker that forwarded it.
async fn serve_forwarded(
    worker: &Arc<Worker>,
    mut frame: RequestFrame,
    edge: &str,
) -> Result<Reply, ErrorFrame> {
    let malformed = |message: String| ErrorFrame {
        kind: ErrorKind::Malformed,
        message,
    };
    let method = Method::from_bytes(frame.method.as_bytes())
        .map_err(|_| malformed(format!("bad HTTP method {:?}", frame.method)))?;
    let mut headers = super::header_map(std::mem::take(&mut frame.headers), |bad| {
        Err(malformed(match bad {
            BadHeader::Name(name) => format!("bad header name {name:?}"),
            BadHeader::Value(name) => format!("bad value for header {name}"),
        }))
    })?;
    // The owner's span, a child of the edge's (whose context came in the frame).
    let span = worker
        .tracer
        .as_ref()
        .and_then(|tracer| tracer.begin(&mut headers));
    // With `--log-requests`, the owner says what it ran for whom, as the edge does:
    // with both lines, a run is found where it happened.
    let logged = worker.config.log_requests.then(|| {
        let session = crate::mcp::session_tag(&headers);
        (session, tokio::time::Instant::now())
    });
    let result = run_forwarded(worker, frame, method, headers).await;
    if let Some((session, started)) = logged {
        let status = result.as_ref().map_or(0, |reply| reply.status.as_u16());
        let refused = result.as_ref().err().map(|frame| frame.kind);
        info!(
            worker = %worker.id,
            edge,
            session = session.map(|tag| tag.to_string()).unwrap_or_default(),
            status,
            refused = ?refused,
            duration_ms = started.elapsed().as_secs_f64() * 1000.0,
            "served a forwarded request"
        );
    }
    if let (Some(tracer), Some(span)) = (&worker.tracer, span) {
        let (status, error) = match &result {
            Ok(reply) => (reply.status.as_u16(), reply.status.is_server_error()),
            Err(_) => (0, true),
        };
        tracer.finish(
            span,
            crate::trace::SpanFacts {
                name: "mcpgw forwarded".to_owned(),
                attributes: vec![
                    ("mcpgw.worker", serde_json::json!(worker.id)),
                    ("mcpgw.edge_worker", serde_json::json!(edge)),
                    ("http.response.status_code", serde_json::json!(status)),
                ],
                error,
            },
        );
    }
    result
}

/// Checks and runs a forwarded request whose head was read into `headers`.
async fn run_forwarded(
    worker: &Arc<Worker>,
    frame: RequestFrame,
    method: Method,
    headers: HeaderMap,
) -> Result<Reply, ErrorFrame> {
    let call = match checked_call(worker, frame, method, &headers) {
        Ok(call) => call,
        Err(refusal) => return Ok(refusal),
    };
    // A lease past its own deadline is revalidated first, as at the edge: an owner
    // whose heartbeat is merely late serves, and only one in real doubt refuses.
    let executor = Executor::of(worker);
    let session = executor.hold_session(&call).await;
    let (situation, decided) = owner_decision(worker, &call, session.is_some()).await;
    match decided {
        Decision::ExecuteHere => {}
        Decision::NotMine => {
            let id = call.session_id.as_deref().unwrap_or_default();
            return Err(ErrorFrame {
                kind: ErrorKind::NotOwner,
                message: format!(
                    "worker {} does not hold session {}",
                    worker.id,
                    crate::digest::tag_of(id)
                ),
            });
        }
        // The caller decides what an owner in doubt means for its client.
        Decision::Refuse(Refusal::LeaseInDoubt) => {
            return Err(ErrorFrame {
                kind: ErrorKind::Draining,
                message: "owner cannot confirm its lease right now".into(),
            });
        }
        Decision::Refuse(_) | Decision::Forward | Decision::Ask(_) => {
            let error = Router::of(worker).refuse(
                &situation,
                "the worker that held it was declared dead and dropped it",
                call.id(),
            );
            return Ok(Reply::from_error(&error));
        }
    }
    Ok(match executor.execute_held(call, session).await {
        Ok(reply) => reply,
        Err(error) => Reply::from_error(&error),
    })
}

/// The forwarded request as a call, checked as the edge checked it; else the
/// refusal to relay.
fn checked_call(
    worker: &Arc<Worker>,
    frame: RequestFrame,
    method: Method,
    headers: &HeaderMap,
) -> Result<request::Call, Reply> {
    let checked = request::check_head(&worker.endpoints, &method, &frame.path, headers).and_then(
        |(upstream, era)| {
            request::parse_call(
                upstream,
                era,
                method,
                &frame.path,
                headers,
                frame.body,
                frame.auth,
            )
        },
    );
    let call = match checked {
        // A 2026-07-28 call binds to its principal's shared session here too.
        Ok(call) => Router::of(worker).bind_shared_session(call),
        // The edge ran the same checks; a refusal here is still an answer to relay.
        Err(error) => return Err(Reply::from_error(&error)),
    };
    // The edge authenticated the client; the owner checks that the context fits this
    // route and that the credential has not expired since (invariant 4).
    match worker.auth.check_forwarded(&call) {
        Ok(()) => Ok(call),
        Err(error) => Err(Reply::from_error(&error)),
    }
}

/// What the decision core says of `call` at its owner, asked again once the one
/// fact it may ask for (whether the directory records the session here) is in.
async fn owner_decision(
    worker: &Arc<Worker>,
    call: &request::Call,
    held_here: bool,
) -> (decision::Situation, Decision) {
    let mut known = Known {
        has_session_id: call.session_id.is_some(),
        held_here,
        ..worker.knows(
            Side::Owner,
            match call.is_shared_bound() {
                true => SessionKind::Shared,
                false => SessionKind::Own,
            },
        )
    };
    loop {
        let situation = decision::situation(&known);
        match decision::decide(&situation) {
            Decision::Ask(Fact::OwnRecord) => {
                let id = call.session_id.as_deref().unwrap_or_default();
                known.recorded_here = Some(Router::of(worker).records_as_own(id).await);
            }
            decided => return (situation, decided),
        }
    }
}

/// Streams a reply as mesh response parts: head, one chunk per body frame, end.
fn reply_parts(reply: Reply) -> BoxStream<'static, ResponsePart> {
    let head = ResponsePart::Head(ResponseHead {
        status: reply.status.as_u16(),
        headers: super::header_pairs(&reply.headers, 0),
    });
    let body = futures_util::stream::unfold(Some(reply.body), |body| async move {
        let mut body = body?;
        loop {
            match body.frame().await {
                None => return Some((ResponsePart::End, None)),
                Some(Err(e)) => {
                    let part = ResponsePart::Error(ErrorFrame {
                        kind: ErrorKind::Internal,
                        message: format!("upstream stream broke: {e}"),
                    });
                    return Some((part, None));
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Some((ResponsePart::Chunk(data), Some(body)));
                    }
                }
            }
        }
    });
    futures_util::stream::once(async move { head })
        .chain(body)
        .boxed()
}
