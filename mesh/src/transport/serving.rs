//! The owner's engine, shared by every transport's owner: the state of one server
//! ([`ServerShared`]), the `Hello` → `Welcome` greeting, and serving one request
//! exchange (admission, deadline, cancellation, streaming) over whatever
//! [`ExchangeLink`] the transport provides. The facade that starts a server is
//! `MeshServer` (in `server`).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use mcpgw_certs::PeerIdentity;
use mcpgw_wire::{
    ErrorFrame, ErrorKind, Frame, OLDEST_PROTOCOL_VERSION, RequestFrame, ResponseHead, WireError,
    negotiate,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use super::budget::{Budgets, Permit, StreamClass, is_event_stream};
use super::config::{MeshLimits, TransportKind};
use super::error::LinkError;
use super::framed::{FrameReader, FrameWriter, SendError};
use super::guard::{FAILURE_LOG_INTERVAL, FailureLog, HandshakeGate, HandshakePermit};
use super::observe::{Link, Observer, OpenConnection};
use super::service::{MeshService, PeerInfo, ResponsePart};
use super::tls::ConnectionLife;

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
/// two apart, an identity that is not the worker's, caller gone). `presented`: the
/// identity the caller's certificate proves; `None` on the same-host path, where the
/// kernel vouched for a process of our own uid and there is no certificate to hold
/// to the registered identity.
pub(crate) async fn greet<R, W>(
    shared: &ServerShared,
    remote: SocketAddr,
    presented: Option<&str>,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> Option<(String, u32)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let first = read_first_frame(shared, remote, reader, writer).await?;
    let Frame::Hello {
        version,
        worker_id,
        expect_worker_id,
    } = first
    else {
        warn!(%remote, frame = first.name(), "mesh peer did not start with Hello; closing");
        let refusal = ErrorFrame::new(
            ErrorKind::Malformed,
            format!("expected Hello first, got {}", first.name()),
        );
        let _ = writer.send(&Frame::Error(refusal)).await;
        return None;
    };
    let newest = shared.limits.max_protocol_version;
    let Some(agreed) = negotiate(OLDEST_PROTOCOL_VERSION, newest, version) else {
        warn!(%remote, peer_worker = %worker_id, theirs = version, ours = newest,
            "mesh peer's protocol version is two or more apart from ours; refusing");
        refuse_version(shared, version, writer).await;
        return None;
    };
    if let Some(presented) = presented
        && !identity_is_the_workers(shared, remote, &worker_id, presented, writer).await
    {
        return None;
    }
    if expect_worker_id != shared.worker_id {
        // Not refused here: the caller decides, and this answer is its proof.
        debug!(%remote, expected = %expect_worker_id, ours = %shared.worker_id,
            "mesh peer expected another worker at this address");
    }
    let welcome = Frame::Welcome {
        version: agreed,
        worker_id: shared.worker_id.clone(),
    };
    writer.send(&welcome).await.ok()?;
    Some((worker_id, agreed))
}

/// The caller's first frame, within the connect timeout; `None` (answered with an
/// error frame where the caller can still read one) when there is none to greet.
async fn read_first_frame<R, W>(
    shared: &ServerShared,
    remote: SocketAddr,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> Option<Frame>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match timeout(shared.limits.connect_timeout, reader.next()).await {
        Err(_) => {
            warn!(%remote, "mesh peer sent no Hello within the connect timeout; closing");
            None
        }
        Ok(Ok(Some(frame))) => Some(frame),
        Ok(Ok(None)) => None,
        Ok(Err(e @ LinkError::BadFrame(_))) => {
            warn!(%remote, error = %e.reason(), "mesh peer's first frame is not a valid Hello; closing");
            let _ = writer.send(&error_for(&e)).await;
            None
        }
        Ok(Err(e)) => {
            debug!(%remote, error = %e.reason(), "mesh connection broke before Hello");
            None
        }
    }
}

/// Refuses a caller whose protocol version is two or more apart from ours.
async fn refuse_version<W: AsyncWrite + Unpin>(
    shared: &ServerShared,
    theirs: u32,
    writer: &mut FrameWriter<W>,
) {
    let newest = shared.limits.max_protocol_version;
    // `Welcome` keeps its layout in every version, so the caller can read our version
    // from it and refuse with both numbers; the error frame says why the connection is
    // about to close.
    let welcome = Frame::Welcome {
        version: newest,
        worker_id: shared.worker_id.clone(),
    };
    let _ = writer.send(&welcome).await;
    let refusal = ErrorFrame::new(
        ErrorKind::VersionMismatch,
        format!(
            "this worker speaks mesh protocol versions {OLDEST_PROTOCOL_VERSION} to {newest}, \
             the caller {theirs}: workers one release apart forward to each other, two apart \
             do not; upgrade the older workers one release at a time"
        ),
    );
    let _ = writer.send(&Frame::Error(refusal)).await;
}

/// Whether the certificate the caller `presented` carries the identity registered for
/// the worker it claims to be (or none is registered, or the directory cannot say in
/// time); a caller speaking as another worker is refused, with an error frame.
async fn identity_is_the_workers<W: AsyncWrite + Unpin>(
    shared: &ServerShared,
    remote: SocketAddr,
    worker_id: &str,
    presented: &str,
    writer: &mut FrameWriter<W>,
) -> bool {
    let registered = timeout(
        shared.limits.connect_timeout,
        shared.service.registered_identity(worker_id),
    )
    .await
    .ok()
    .flatten();
    let Some(registered) = registered.filter(|registered| registered != presented) else {
        return true;
    };
    warn!(%remote, peer_worker = %worker_id, %registered, %presented,
        "mesh peer claims a worker registered with another identity; refusing");
    let refusal = ErrorFrame::new(
        ErrorKind::Internal,
        format!(
            "refused: worker {worker_id} registered identity {registered}, \
             and this connection's certificate carries {presented}"
        ),
    );
    let _ = writer.send(&Frame::Error(refusal)).await;
    false
}

/// A connection that passed authentication and the greeting, as its owner serves it.
pub(crate) struct AdmittedConnection {
    /// Who is on the other end, handed to the service with each of its requests.
    pub(crate) peer: PeerInfo,
    /// When the owner cuts the connection off, busy or not: past its maximum age (with
    /// room for the caller to retire it first) or its peer's certificate.
    pub(crate) close_at: Instant,
    /// Counts the connection as open for the observer until it is dropped.
    pub(crate) open: OpenConnection,
}

/// The owner's side of a greeting that succeeded, the same for every transport that
/// has connections: the handshake is over (its permit frees the caller's slot in the
/// handshake gate), the connection counts as open, and the peer its requests come
/// from is named: by the identity its certificate proves, whose budgets they draw on.
pub(crate) fn admit_connection(
    shared: &ServerShared,
    remote: SocketAddr,
    identity: PeerIdentity,
    (worker_id, protocol): (String, u32),
    permit: HandshakePermit,
    link: Link,
) -> AdmittedConnection {
    shared.observer.handshake("owner", "ok");
    drop(permit);
    let open = shared.observer.open("owner", &identity, link);
    let close_at =
        ConnectionLife::owner_close_at(shared.limits.max_connection_age, identity.not_after);
    let peer = PeerInfo {
        addr: remote,
        identity: identity.member.into(),
        worker_id: worker_id.into(),
        transport: shared.kind,
        protocol,
        connection: shared.next_connection(),
    };
    debug!(%remote, transport = %shared.kind, peer = %peer.worker_id, identity = %peer.identity,
        "mesh peer connected");
    AdmittedConnection {
        peer,
        close_at,
        open,
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

/// Where an owner gathers a response's frames before they leave together: every
/// transport's owner end (the Redis owner's too, which publishes them in one pipeline).
pub(crate) trait FrameQueue: Send {
    /// Queues `frame` behind those already queued, without sending.
    fn queue(&mut self, frame: Frame) -> Result<(), WireError>;
    /// Bytes queued and not yet sent, to bound how much is gathered into one send.
    fn queued_len(&self) -> usize;
    /// How many queued bytes are worth gathering before a send: a response that is
    /// ready faster than it can leave is not pulled further ahead than this.
    fn gather_limit(&self) -> usize;
    /// The largest body chunk one frame may carry.
    fn max_chunk(&self) -> usize;
}

/// The owner's end of one exchange: where its response frames go and where it hears
/// from the caller. A QUIC stream pair, or one exchange of a multiplexed TCP
/// connection (which sends body bytes only against the caller's credit).
pub(crate) trait ExchangeLink: FrameQueue {
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
    let deadline = head_deadline_of(&request);
    let slot = match admit_request(shared, budget_key(peer), &request) {
        Ok(slot) => slot,
        Err(refused) => return finish(link, refused, deadline).await,
    };
    let response = shared.service.serve(request, peer.clone());
    let mut responding = Responding {
        shared,
        peer,
        request_id,
        deadline,
        link,
        order: ResponseOrder::new(slot, request_id),
    };
    responding.run(response).await
}

/// The error frame that ends an exchange with `kind`.
pub(crate) fn refusal(kind: ErrorKind, message: impl Into<String>) -> Frame {
    Frame::Error(ErrorFrame::new(kind, message))
}

/// When the head of `request`'s response must have gone out: the caller stops
/// waiting then.
pub(crate) fn head_deadline_of(request: &RequestFrame) -> Instant {
    Instant::now() + Duration::from_millis(u64::from(request.deadline_ms))
}

/// Takes `request` in, or answers it with the error frame that says why not: the
/// server drains, the request has no time left, or the budget of its class is full
/// for the peer whose budget is `budget_key`. The slot it returns is held until the
/// exchange ends. Every transport's owner admits its requests here.
pub(crate) fn admit_request(
    shared: &Arc<ServerShared>,
    budget_key: &str,
    request: &RequestFrame,
) -> Result<Permit, Frame> {
    if shared.draining.load(Ordering::SeqCst) {
        let message = format!("worker {} is shutting down", shared.worker_id);
        return Err(refusal(ErrorKind::Draining, message));
    }
    if request.deadline_ms == 0 {
        let message = "request arrived with no time left";
        return Err(refusal(ErrorKind::DeadlineExceeded, message));
    }
    let class = StreamClass::of_request(&request.method);
    shared.admit(budget_key, class).inspect_err(|_| {
        debug!(request_id = request.request_id, budget_of = %budget_key, class = class.name(),
            "mesh budget full; answered Busy");
    })
}

/// Where a response stands in `Head, Chunk*, End` (or `Error` at any point), so that
/// a service that breaks the order is caught the same way over every transport; and
/// the budget slot the response runs in, moved to the stream budget when its head
/// says it is an event stream.
pub(crate) struct ResponseOrder {
    /// The exchange's place in its peer's budget.
    slot: Permit,
    /// The head went out: from now on only chunks and the end may follow.
    head_sent: bool,
    /// For log lines about a service that broke the order.
    request_id: u64,
}

/// One part of a response, checked against the order.
pub(crate) enum OrderedPart {
    /// The head, the first part.
    Head(ResponseHead),
    /// A body chunk, after the head.
    Chunk(bytes::Bytes),
    /// The response's last frame: `End`, the service's `Error`, or the internal error
    /// that replaces a part out of order or a response that stopped without `End`.
    Last(Frame),
}

impl ResponseOrder {
    pub(crate) fn new(slot: Permit, request_id: u64) -> Self {
        Self {
            slot,
            head_sent: false,
            request_id,
        }
    }

    pub(crate) fn head_sent(&self) -> bool {
        self.head_sent
    }

    pub(crate) fn request_id(&self) -> u64 {
        self.request_id
    }

    /// What the service's next `part` (`None`: its stream ended) is in the order.
    pub(crate) fn check(&mut self, part: Option<ResponsePart>) -> OrderedPart {
        let request_id = self.request_id;
        match part {
            Some(ResponsePart::Head(head)) if !self.head_sent => {
                self.head_sent = true;
                if is_event_stream(&head) {
                    self.slot.promote();
                }
                OrderedPart::Head(head)
            }
            Some(ResponsePart::Chunk(bytes)) if self.head_sent => OrderedPart::Chunk(bytes),
            Some(ResponsePart::End) if self.head_sent => OrderedPart::Last(Frame::End),
            Some(ResponsePart::Error(e)) => OrderedPart::Last(Frame::Error(e)),
            Some(other) => {
                warn!(
                    request_id,
                    part = other.name(),
                    head_sent = self.head_sent,
                    "mesh service produced a response out of order (Head, Chunk*, End)"
                );
                let message = "owner produced a malformed response";
                OrderedPart::Last(refusal(ErrorKind::Internal, message))
            }
            None => {
                warn!(request_id, "mesh service ended a response without End");
                let message = "owner ended the response without End";
                OrderedPart::Last(refusal(ErrorKind::Internal, message))
            }
        }
    }
}

/// One admitted exchange while its response runs, over a link with its own
/// backpressure (a QUIC stream, a multiplexed TCP exchange).
struct Responding<'a, L> {
    shared: &'a Arc<ServerShared>,
    peer: &'a PeerInfo,
    request_id: u64,
    /// The head must have gone out by then.
    deadline: Instant,
    link: &'a mut L,
    order: ResponseOrder,
}

/// What ended the wait for the service's next part before the part came.
enum Interruption {
    /// The server stops everything at once.
    Stopped,
    /// The request's deadline passed before the head went out.
    HeadDeadline,
    /// The caller cancelled, left or sent something out of place.
    Caller(CallerEvent),
}

impl<L: ExchangeLink> Responding<'_, L> {
    /// Relays the service's response until its end, an interruption, or a caller that
    /// stopped taking it.
    async fn run(&mut self, mut response: BoxStream<'static, ResponsePart>) -> ExchangeEnd {
        let shared = self.shared;
        // The deadline bounds the time to the head. After it, a stream (SSE, a session's
        // GET stream) runs as long as the service produces it and the caller reads it;
        // each send is bounded by `stall` so a caller that stops reading cannot hold it.
        let stall = shared.limits.idle_timeout;
        // Made once: each `cancelled()` future takes the token's lock when first polled.
        let stopped = shared.stop.cancelled();
        tokio::pin!(stopped);
        loop {
            let send_by = if self.order.head_sent() {
                Instant::now() + stall
            } else {
                self.deadline
            };
            let part = match self.next_part(&mut response, stopped.as_mut()).await {
                Ok(part) => part,
                Err(interruption) => {
                    // The service stops before the caller hears why.
                    drop(response);
                    return self.interrupted(interruption, send_by).await;
                }
            };
            let ending = queue_ready(self.link, &mut self.order, part, &mut response);
            if let Some(end) = self.send_queued(ending, send_by).await {
                return end;
            }
        }
    }

    /// Waits for the service's next part, or for what interrupts the response first.
    async fn next_part(
        &mut self,
        response: &mut BoxStream<'static, ResponsePart>,
        stopped: Pin<&mut WaitForCancellationFuture<'_>>,
    ) -> Result<Option<ResponsePart>, Interruption> {
        let (head_sent, deadline) = (self.order.head_sent(), self.deadline);
        let head_deadline = async move {
            if head_sent {
                std::future::pending::<()>().await
            } else {
                sleep_until(deadline).await
            }
        };
        tokio::select! {
            biased;
            () = stopped => Err(Interruption::Stopped),
            () = head_deadline => Err(Interruption::HeadDeadline),
            event = self.link.caller_event() => Err(Interruption::Caller(event)),
            part = response.next() => Ok(part),
        }
    }

    /// Ends an interrupted exchange, telling the caller why where it still listens.
    async fn interrupted(&mut self, why: Interruption, send_by: Instant) -> ExchangeEnd {
        let (request_id, peer) = (self.request_id, &self.peer.worker_id);
        let frame = match why {
            Interruption::Stopped => return ExchangeEnd::Broken,
            Interruption::Caller(CallerEvent::Gone) => {
                debug!(request_id, %peer, "mesh caller went away; request stopped");
                return ExchangeEnd::Broken;
            }
            Interruption::HeadDeadline => {
                debug!(request_id, %peer, "mesh request deadline passed; stopped");
                let message = "the request's deadline passed at the owner";
                let frame = refusal(ErrorKind::DeadlineExceeded, message);
                // The deadline is over: give the error frame a moment of its own.
                let by = Instant::now() + self.shared.limits.connect_timeout;
                return finish(self.link, frame, by).await;
            }
            Interruption::Caller(CallerEvent::Cancelled) => {
                debug!(request_id, %peer, "mesh request cancelled by caller");
                refusal(ErrorKind::Cancelled, "cancelled by the caller")
            }
            Interruption::Caller(CallerEvent::Unexpected(name)) => {
                warn!(request_id, %peer, frame = name,
                    "mesh caller sent a frame during a response; request cancelled");
                refusal(
                    ErrorKind::Malformed,
                    format!("unexpected {name} during a response"),
                )
            }
            Interruption::Caller(CallerEvent::Bad(e)) => {
                warn!(request_id, %peer, error = %e.reason(),
                    "mesh caller sent a bad frame during a response; request cancelled");
                error_for(&e)
            }
        };
        finish(self.link, frame, send_by).await
    }

    /// Sends what is queued, and the response's last frame when it came. `None` while
    /// the response goes on.
    async fn send_queued(
        &mut self,
        ending: Option<Frame>,
        send_by: Instant,
    ) -> Option<ExchangeEnd> {
        let request_id = self.request_id;
        let last = ending.is_some();
        let queued = match ending {
            Some(frame) => self.link.queue(frame),
            None => Ok(()),
        };
        let written = match queued {
            Ok(()) => {
                // As in `finish`: the last frame gets a second at least.
                let by = if last {
                    send_by.max(Instant::now() + Duration::from_secs(1))
                } else {
                    send_by
                };
                self.link.flush(by).await
            }
            Err(e) => Err(SendError::Encode(e)),
        };
        match written {
            Ok(()) if last => Some(ExchangeEnd::Clean),
            Ok(()) => None,
            Err(SendError::Encode(e)) => {
                warn!(request_id, error = %e, "mesh response cannot be encoded");
                let message = format!("owner cannot encode the response: {e}");
                let frame = refusal(ErrorKind::Internal, message);
                Some(finish(self.link, frame, self.deadline).await)
            }
            Err(SendError::Io(e)) => {
                debug!(request_id, error = %e, "mesh caller stopped reading; request stopped");
                Some(ExchangeEnd::Broken)
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

/// Queues `part` and every part that is already ready behind it (a JSON answer is
/// Head, Chunk and End at once), so they leave in one send; a stream still gets each
/// event out as it is produced. Returns the response's last frame once the response
/// ended, unqueued.
pub(crate) fn queue_ready<Q: FrameQueue>(
    queue: &mut Q,
    order: &mut ResponseOrder,
    mut part: Option<ResponsePart>,
    response: &mut BoxStream<'static, ResponsePart>,
) -> Option<Frame> {
    loop {
        let queued = match order.check(part) {
            OrderedPart::Head(head) => queue.queue(Frame::Head(head)),
            OrderedPart::Chunk(bytes) => queue_chunk(queue, bytes),
            OrderedPart::Last(frame) => return Some(frame),
        };
        if let Err(e) = queued {
            warn!(request_id = order.request_id(), error = %e, "mesh response part cannot be encoded");
            let message = format!("owner cannot encode the response: {e}");
            return Some(refusal(ErrorKind::Internal, message));
        }
        if queue.queued_len() >= queue.gather_limit() {
            return None;
        }
        part = response.next().now_or_never()?;
    }
}

/// Queues a body chunk, split so that each frame fits the maximum frame size.
fn queue_chunk<Q: FrameQueue>(link: &mut Q, mut bytes: bytes::Bytes) -> Result<(), WireError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn head(content_type: &str) -> ResponseHead {
        ResponseHead {
            status: 200,
            headers: vec![("content-type".into(), content_type.into())],
        }
    }

    /// A response order over a fresh short slot, and the budgets it draws on.
    fn order() -> (ResponseOrder, Arc<Budgets>) {
        let budgets = Budgets::new(4, 4);
        let slot = budgets.admit("peer", StreamClass::Short).expect("room");
        (ResponseOrder::new(slot, 7), budgets)
    }

    fn internal_message(part: OrderedPart) -> String {
        match part {
            OrderedPart::Last(Frame::Error(e)) if e.kind == ErrorKind::Internal => e.message,
            _ => panic!("expected an internal error as the last frame"),
        }
    }

    #[test]
    fn a_response_in_order_passes_and_ends_with_end() {
        let (mut order, _budgets) = order();
        let first = order.check(Some(ResponsePart::Head(head("application/json"))));
        assert!(matches!(first, OrderedPart::Head(_)));
        assert!(order.head_sent());
        let body = order.check(Some(ResponsePart::Chunk("{}".into())));
        assert!(matches!(body, OrderedPart::Chunk(_)));
        let last = order.check(Some(ResponsePart::End));
        assert!(matches!(last, OrderedPart::Last(Frame::End)));
    }

    #[test]
    fn parts_out_of_order_end_the_response_with_an_internal_error() {
        let (mut order, _budgets) = order();
        let chunk_first = order.check(Some(ResponsePart::Chunk("x".into())));
        assert!(internal_message(chunk_first).contains("malformed"));
        let (mut order, _budgets) = self::order();
        let end_first = order.check(Some(ResponsePart::End));
        assert!(internal_message(end_first).contains("malformed"));
        let (mut order, _budgets) = self::order();
        order.check(Some(ResponsePart::Head(head("application/json"))));
        let second_head = order.check(Some(ResponsePart::Head(head("application/json"))));
        assert!(internal_message(second_head).contains("malformed"));
        let stopped = order.check(None);
        assert!(internal_message(stopped).contains("without End"));
    }

    #[test]
    fn the_services_error_ends_the_response_before_or_after_the_head() {
        let (mut order, _budgets) = order();
        let refused = ErrorFrame::new(ErrorKind::Busy, "busy");
        let last = order.check(Some(ResponsePart::Error(refused.clone())));
        assert!(matches!(last, OrderedPart::Last(Frame::Error(e)) if e == refused));
        let (mut order, _budgets) = self::order();
        order.check(Some(ResponsePart::Head(head("application/json"))));
        let last = order.check(Some(ResponsePart::Error(refused.clone())));
        assert!(matches!(last, OrderedPart::Last(Frame::Error(e)) if e == refused));
    }

    #[test]
    fn an_event_stream_head_moves_the_exchange_to_the_stream_budget() {
        let (mut order, budgets) = order();
        order.check(Some(ResponsePart::Head(head("text/event-stream"))));
        let counts = budgets.counts();
        assert_eq!((counts.short, counts.long), (0, 1));
        let (mut order, budgets) = self::order();
        order.check(Some(ResponsePart::Head(head("application/json"))));
        let counts = budgets.counts();
        assert_eq!((counts.short, counts.long), (1, 0));
    }
}
