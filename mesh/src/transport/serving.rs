//! The owner's engine, shared by every transport's owner: the state of one server
//! ([`ServerShared`]), the `Hello` → `Welcome` greeting, and serving one request
//! exchange (admission, deadline, cancellation, streaming) over whatever
//! [`ExchangeLink`] the transport provides. The facade that starts a server is
//! `MeshServer` (in `server`).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use mcpgw_wire::{
    ErrorFrame, ErrorKind, Frame, OLDEST_PROTOCOL_VERSION, RequestFrame, WireError, negotiate,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use super::budget::{Budgets, Permit, StreamClass, is_event_stream};
use super::config::{MeshLimits, TransportKind};
use super::error::LinkError;
use super::framed::{FrameReader, FrameWriter, SendError};
use super::guard::{FAILURE_LOG_INTERVAL, FailureLog, HandshakeGate};
use super::observe::Observer;
use super::service::{MeshService, PeerInfo, ResponsePart};

/// State shared by one server's accept loop, connections and requests.
pub(crate) struct ServerShared {
    /// The transport, for [`PeerInfo`].
    pub(crate) kind: TransportKind,
    /// Our worker id, answered in `Welcome`.
    pub(crate) worker_id: String,
    /// Runs the requests.
    pub(crate) service: Arc<dyn MeshService>,
    /// Frame size, in-flight and timeout limits.
    pub(crate) limits: MeshLimits,
    /// Set by [`MeshServerHandle::drain`]: new requests get `Error(Draining)`.
    pub(crate) draining: AtomicBool,
    /// Cancelled with `draining` set: a multiplexed connection tells its caller
    /// (`GoAway`, to callers of protocol 4 or newer) so it stops opening exchanges here.
    pub(crate) drain_started: CancellationToken,
    /// Cancelled to stop everything at once.
    pub(crate) stop: CancellationToken,
    /// Every task the server spawned, so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
    /// The tasks that serve one exchange each, so shutdown can let their last frames
    /// go out before it closes the connections.
    pub(crate) exchanges: TaskTracker,
    /// Exchanges in flight per peer (its authenticated identity; see
    /// [`budget_key`]), short and long, for
    /// `max_in_flight_per_peer` and `max_streams_per_peer`.
    pub(crate) budgets: Arc<Budgets>,
    /// Connections accepted so far, to number them.
    pub(crate) connections: std::sync::atomic::AtomicU64,
    /// Handshakes in progress per source address and in all, for
    /// `max_handshakes_per_addr` and `max_handshakes`.
    pub(crate) handshakes: Arc<HandshakeGate>,
    /// Rate-limits the log lines about handshakes that failed or were refused before
    /// the peer was authenticated (anyone can cause those).
    pub(crate) handshake_failures: FailureLog,
    /// Told of every handshake and of every connection's open and close.
    pub(crate) observer: Observer,
}

impl std::fmt::Debug for ServerShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerShared")
            .field("kind", &self.kind)
            .field("worker_id", &self.worker_id)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl ServerShared {
    pub(crate) fn new(
        kind: TransportKind,
        worker_id: String,
        service: Arc<dyn MeshService>,
        mut limits: MeshLimits,
        observer: Observer,
    ) -> Arc<Self> {
        // Zero would refuse every request; one is the least that serves.
        limits.max_in_flight_per_peer = limits.max_in_flight_per_peer.max(1);
        limits.max_streams_per_peer = limits.max_streams_per_peer.max(1);
        let budgets = Budgets::new(limits.max_in_flight_per_peer, limits.max_streams_per_peer);
        let handshakes = HandshakeGate::new(limits.max_handshakes_per_addr, limits.max_handshakes);
        Arc::new(ServerShared {
            kind,
            worker_id,
            service,
            limits,
            draining: AtomicBool::new(false),
            drain_started: CancellationToken::new(),
            stop: CancellationToken::new(),
            tracker: TaskTracker::new(),
            exchanges: TaskTracker::new(),
            budgets,
            connections: std::sync::atomic::AtomicU64::new(0),
            handshakes,
            handshake_failures: FailureLog::new(FAILURE_LOG_INTERVAL),
            observer,
        })
    }

    /// A number for the next accepted connection (1, 2, …), unique in this server.
    pub(crate) fn next_connection(&self) -> u64 {
        self.connections.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Takes a slot of `class` for `peer`, or answers with the `Busy` error frame that
    /// says which budget is full.
    pub(crate) fn admit(self: &Arc<Self>, peer: &str, class: StreamClass) -> Result<Permit, Frame> {
        self.budgets.admit(peer, class).map_err(|full| {
            Frame::Error(ErrorFrame::new(
                ErrorKind::Busy,
                format!(
                    "worker {} already runs {} {} exchanges for mesh member {peer}: retry shortly",
                    self.worker_id,
                    full.limit,
                    full.class.name()
                ),
            ))
        })
    }
}

/// Answers the caller's `Hello`. Returns the caller's worker id and the protocol
/// version agreed, or `None` when the connection must close (bad greeting, versions
/// two apart, caller gone).
pub(crate) async fn greet<R, W>(
    shared: &ServerShared,
    remote: SocketAddr,
    presented: &str,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> Option<(String, u32)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let newest = shared.limits.max_protocol_version;
    let first = match timeout(shared.limits.connect_timeout, reader.next()).await {
        Err(_) => {
            warn!(%remote, "mesh peer sent no Hello within the connect timeout; closing");
            return None;
        }
        Ok(Ok(Some(frame))) => frame,
        Ok(Ok(None)) => return None,
        Ok(Err(e @ LinkError::BadFrame(_))) => {
            warn!(%remote, error = %e.reason(), "mesh peer's first frame is not a valid Hello; closing");
            let _ = writer.send(&error_for(&e)).await;
            return None;
        }
        Ok(Err(e)) => {
            debug!(%remote, error = %e.reason(), "mesh connection broke before Hello");
            return None;
        }
    };
    match first {
        Frame::Hello {
            version,
            worker_id,
            expect_worker_id,
        } => {
            let Some(agreed) = negotiate(OLDEST_PROTOCOL_VERSION, newest, version) else {
                warn!(%remote, peer_worker = %worker_id, theirs = version, ours = newest,
                    "mesh peer's protocol version is two or more apart from ours; refusing");
                // `Welcome` keeps its layout in every version, so the caller can read our
                // version from it and refuse with both numbers; the error frame says why
                // the connection is about to close.
                let welcome = Frame::Welcome {
                    version: newest,
                    worker_id: shared.worker_id.clone(),
                };
                let _ = writer.send(&welcome).await;
                let _ = writer
                    .send(&Frame::Error(ErrorFrame::new(
                        ErrorKind::VersionMismatch,
                        format!(
                            "this worker speaks mesh protocol versions \
                             {OLDEST_PROTOCOL_VERSION} to {newest}, the caller {version}: \
                             workers one release apart forward to each other, two apart do \
                             not; upgrade the older workers one release at a time"
                        ),
                    )))
                    .await;
                return None;
            };
            let welcome = Frame::Welcome {
                version: agreed,
                worker_id: shared.worker_id.clone(),
            };
            let registered = timeout(
                shared.limits.connect_timeout,
                shared.service.registered_identity(&worker_id),
            )
            .await
            .ok()
            .flatten();
            if let Some(registered) = registered
                && registered != presented
            {
                warn!(%remote, peer_worker = %worker_id, %registered, %presented,
                    "mesh peer claims a worker registered with another identity; refusing");
                let _ = writer
                    .send(&Frame::Error(ErrorFrame::new(
                        ErrorKind::Internal,
                        format!(
                            "refused: worker {worker_id} registered identity {registered}, \
                             and this connection's certificate carries {presented}"
                        ),
                    )))
                    .await;
                return None;
            }
            if expect_worker_id != shared.worker_id {
                // Not refused here: the caller decides, and this answer is its proof.
                debug!(%remote, expected = %expect_worker_id, ours = %shared.worker_id,
                    "mesh peer expected another worker at this address");
            }
            writer.send(&welcome).await.ok()?;
            Some((worker_id, agreed))
        }
        other => {
            warn!(%remote, frame = other.name(), "mesh peer did not start with Hello; closing");
            let _ = writer
                .send(&Frame::Error(ErrorFrame::new(
                    ErrorKind::Malformed,
                    format!("expected Hello first, got {}", other.name()),
                )))
                .await;
            None
        }
    }
}

/// The error frame that answers a frame the codec rejected.
pub(crate) fn error_for(e: &LinkError) -> Frame {
    let kind = match e {
        LinkError::BadFrame(mcpgw_wire::WireError::FrameTooLarge { .. }) => ErrorKind::TooLarge,
        _ => ErrorKind::Malformed,
    };
    Frame::Error(ErrorFrame::new(kind, e.reason()))
}

/// How an exchange ended, for the link that carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExchangeEnd {
    /// `End` or `Error` was sent, or the caller cancelled: nothing more is owed.
    Clean,
    /// The exchange was abandoned (caller gone, write failed or timed out, stopping).
    Broken,
}

/// What the owner hears from the caller while a response runs.
#[derive(Debug)]
pub(crate) enum CallerEvent {
    /// `Cancel` (or a reset stream): the caller gave up on this exchange.
    Cancelled,
    /// The caller's link is gone (connection closed or broken).
    Gone,
    /// A frame that has no place during a response; its name.
    Unexpected(&'static str),
    /// A frame that did not decode (the link stays in sync).
    Bad(LinkError),
}

/// The owner's end of one exchange: where its response frames go and where it hears
/// from the caller. A QUIC stream pair, or one exchange of a multiplexed TCP
/// connection (which sends body bytes only against the caller's credit).
pub(crate) trait ExchangeLink: Send {
    /// Queues `frame` behind those already queued, without sending.
    fn queue(&mut self, frame: Frame) -> Result<(), WireError>;
    /// Bytes queued and not yet sent, to bound how much is gathered into one write.
    fn queued_len(&self) -> usize;
    /// How many queued bytes are worth gathering before a send: a response that is
    /// ready faster than it can leave is not pulled further ahead than this.
    fn gather_limit(&self) -> usize;
    /// The largest body chunk one frame may carry.
    fn max_chunk(&self) -> usize;
    /// Sends everything queued, giving up at `by` (a caller that stops reading cannot
    /// hold the exchange forever).
    fn flush(&mut self, by: Instant) -> impl Future<Output = Result<(), SendError>> + Send;
    /// Resolves when the caller says something during the response.
    fn caller_event(&mut self) -> impl Future<Output = CallerEvent> + Send;
}

pub(crate) fn timed_out() -> SendError {
    SendError::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "caller did not take the response before the deadline",
    ))
}

/// Serves one request: admission, deadline, streaming the service's response, and
/// watching the caller for `Cancel` or disconnection while the response runs.
pub(crate) async fn serve_request<L: ExchangeLink>(
    shared: &Arc<ServerShared>,
    peer: &PeerInfo,
    request: RequestFrame,
    link: &mut L,
) -> ExchangeEnd {
    let request_id = request.request_id;
    let deadline = Instant::now() + Duration::from_millis(u64::from(request.deadline_ms));
    let refuse = |kind, msg: String| Frame::Error(ErrorFrame::new(kind, msg));
    if shared.draining.load(Ordering::SeqCst) {
        let frame = refuse(
            ErrorKind::Draining,
            format!("worker {} is shutting down", shared.worker_id),
        );
        return finish(link, frame, deadline).await;
    }
    if request.deadline_ms == 0 {
        let frame = refuse(
            ErrorKind::DeadlineExceeded,
            "request arrived with no time left".into(),
        );
        return finish(link, frame, deadline).await;
    }
    let class = StreamClass::of_request(&request.method);
    let mut slot = match shared.admit(budget_key(peer), class) {
        Ok(slot) => slot,
        Err(busy) => {
            debug!(request_id, peer = %peer.worker_id, class = class.name(), "mesh budget full; answered Busy");
            return finish(link, busy, deadline).await;
        }
    };

    let mut response = shared.service.serve(request, peer.clone());
    let mut head_sent = false;
    // The deadline bounds the time to the head. After it, a stream (SSE, a session's
    // GET stream) runs as long as the service produces it and the caller reads it;
    // each send is bounded by `stall` so a caller that stops reading cannot hold it.
    let stall = shared.limits.idle_timeout;
    // Made once: each `cancelled()` future takes the token's lock when first polled.
    let stopped = shared.stop.cancelled();
    tokio::pin!(stopped);
    loop {
        let head_deadline = async {
            if head_sent {
                std::future::pending::<()>().await
            } else {
                sleep_until(deadline).await
            }
        };
        let send_by = if head_sent {
            Instant::now() + stall
        } else {
            deadline
        };
        let part = tokio::select! {
            biased;
            () = &mut stopped => return ExchangeEnd::Broken,
            () = head_deadline => {
                drop(response);
                debug!(request_id, peer = %peer.worker_id, "mesh request deadline passed; stopped");
                let frame = refuse(ErrorKind::DeadlineExceeded, "the request's deadline passed at the owner".into());
                // The deadline is over: give the error frame a moment of its own.
                return finish(link, frame, Instant::now() + shared.limits.connect_timeout).await;
            }
            event = link.caller_event() => {
                drop(response);
                let frame = match event {
                    CallerEvent::Cancelled => {
                        debug!(request_id, peer = %peer.worker_id, "mesh request cancelled by caller");
                        refuse(ErrorKind::Cancelled, "cancelled by the caller".into())
                    }
                    CallerEvent::Gone => {
                        debug!(request_id, peer = %peer.worker_id, "mesh caller went away; request stopped");
                        return ExchangeEnd::Broken;
                    }
                    CallerEvent::Unexpected(name) => {
                        warn!(request_id, peer = %peer.worker_id, frame = name,
                            "mesh caller sent a frame during a response; request cancelled");
                        refuse(ErrorKind::Malformed, format!("unexpected {name} during a response"))
                    }
                    CallerEvent::Bad(e) => {
                        warn!(request_id, peer = %peer.worker_id, error = %e.reason(),
                            "mesh caller sent a bad frame during a response; request cancelled");
                        error_for(&e)
                    }
                };
                return finish(link, frame, send_by).await;
            }
            part = response.next() => part,
        };
        // Queue this part and every part that is already ready behind it (a JSON
        // answer is Head, Chunk and End at once), then send them in one go; a stream
        // still gets each event out as it is produced.
        let mut part = part;
        let mut ending: Option<Frame> = None;
        loop {
            let queued = match part {
                Some(ResponsePart::Head(head)) if !head_sent => {
                    head_sent = true;
                    if is_event_stream(&head) {
                        slot.promote();
                    }
                    link.queue(Frame::Head(head))
                }
                Some(ResponsePart::Chunk(bytes)) if head_sent => queue_chunk(link, bytes),
                Some(ResponsePart::End) if head_sent => {
                    ending = Some(Frame::End);
                    break;
                }
                Some(ResponsePart::Error(e)) => {
                    ending = Some(Frame::Error(e));
                    break;
                }
                Some(other) => {
                    warn!(
                        request_id,
                        part = other.name(),
                        head_sent,
                        "mesh service produced a response out of order (Head, Chunk*, End)"
                    );
                    ending = Some(refuse(
                        ErrorKind::Internal,
                        "owner produced a malformed response".into(),
                    ));
                    break;
                }
                None => {
                    warn!(request_id, "mesh service ended a response without End");
                    ending = Some(refuse(
                        ErrorKind::Internal,
                        "owner ended the response without End".into(),
                    ));
                    break;
                }
            };
            if let Err(e) = queued {
                warn!(request_id, error = %e, "mesh response part cannot be encoded");
                ending = Some(refuse(
                    ErrorKind::Internal,
                    format!("owner cannot encode the response: {e}"),
                ));
                break;
            }
            if link.queued_len() >= link.gather_limit() {
                break;
            }
            match response.next().now_or_never() {
                Some(next) => part = next,
                None => break,
            }
        }
        let last = ending.is_some();
        let queued = match ending {
            Some(frame) => link.queue(frame),
            None => Ok(()),
        };
        let written = match queued {
            Ok(()) => {
                let by = if last {
                    send_by.max(Instant::now() + Duration::from_secs(1))
                } else {
                    send_by
                };
                link.flush(by).await
            }
            Err(e) => Err(SendError::Encode(e)),
        };
        match written {
            Ok(()) if last => return ExchangeEnd::Clean,
            Ok(()) => {}
            Err(SendError::Encode(e)) => {
                warn!(request_id, error = %e, "mesh response cannot be encoded");
                let frame = refuse(
                    ErrorKind::Internal,
                    format!("owner cannot encode the response: {e}"),
                );
                return finish(link, frame, deadline).await;
            }
            Err(SendError::Io(e)) => {
                debug!(request_id, error = %e, "mesh caller stopped reading; request stopped");
                return ExchangeEnd::Broken;
            }
        }
    }
}

/// Whose budget a peer's request draws from: the mesh identity its certificate
/// proves, never the worker id it declares in `Hello` (a leaf that declared made-up
/// ids would otherwise get a fresh budget for each). Over Redis, which has no mTLS and
/// where Redis is the trust boundary, the declared worker id.
pub(crate) fn budget_key(peer: &PeerInfo) -> &str {
    if peer.identity.is_empty() {
        &peer.worker_id
    } else {
        &peer.identity
    }
}

/// Queues a body chunk, split so that each frame fits the maximum frame size.
fn queue_chunk<L: ExchangeLink>(link: &mut L, mut bytes: bytes::Bytes) -> Result<(), WireError> {
    let piece = link.max_chunk();
    loop {
        let rest = if bytes.len() > piece {
            bytes.split_off(piece)
        } else {
            bytes::Bytes::new()
        };
        link.queue(Frame::Chunk(bytes))?;
        if rest.is_empty() {
            return Ok(());
        }
        bytes = rest;
    }
}

/// Sends the exchange's last frame and reports how the exchange ended.
async fn finish<L: ExchangeLink>(link: &mut L, frame: Frame, deadline: Instant) -> ExchangeEnd {
    // The last frame may go out a little after the request's own deadline (it *is*
    // the deadline answer); a minimum of one second keeps a stuck caller bounded.
    let deadline = deadline.max(Instant::now() + Duration::from_secs(1));
    if link.queue(frame).is_err() {
        return ExchangeEnd::Broken;
    }
    match link.flush(deadline).await {
        Ok(()) => ExchangeEnd::Clean,
        Err(_) => ExchangeEnd::Broken,
    }
}

/// Reads the request that opens an exchange on a stream and serves it. Anything but a
/// request is answered with an error frame (and logged).
pub(crate) async fn serve_next<L: ExchangeLink>(
    shared: &Arc<ServerShared>,
    peer: &PeerInfo,
    incoming: Result<Option<Frame>, LinkError>,
    link: &mut L,
) -> Option<ExchangeEnd> {
    let no_deadline = Instant::now() + shared.limits.connect_timeout;
    match incoming {
        Ok(Some(Frame::Request(request))) => {
            Some(serve_request(shared, peer, *request, link).await)
        }
        // A Cancel that crossed the response's last frame: nothing left to cancel.
        Ok(Some(Frame::Cancel)) => Some(ExchangeEnd::Clean),
        Ok(Some(other)) => {
            warn!(peer = %peer.worker_id, frame = other.name(), "mesh peer sent an unexpected frame; answered with an error");
            let frame = Frame::Error(ErrorFrame::new(
                ErrorKind::Malformed,
                format!("expected Request, got {}", other.name()),
            ));
            Some(finish(link, frame, no_deadline).await)
        }
        Ok(None) => None,
        Err(e @ LinkError::BadFrame(_)) => {
            warn!(peer = %peer.worker_id, error = %e.reason(), "mesh peer sent a bad frame; answered with an error");
            Some(finish(link, error_for(&e), no_deadline).await)
        }
        Err(LinkError::Broken { reason, .. }) => {
            debug!(peer = %peer.worker_id, %reason, "mesh connection closed");
            None
        }
    }
}
