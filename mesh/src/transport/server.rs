//! The owner's side, shared by both transports: binding, the `Hello` → `Welcome`
//! greeting, and serving one request exchange (deadline, cancellation, streaming).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use mcpgw_wire::{ErrorFrame, ErrorKind, Frame, PROTOCOL_VERSION, RequestFrame};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use super::error::LinkError;
use super::framed::{FrameReader, FrameWriter, SendError};
use super::{MeshError, MeshLimits, MeshService, PeerInfo, ResponsePart, TransportKind};
use super::{RedisTransportConfig, quic, redis, tcp};

/// Starts mesh servers. See [`MeshServer::bind`].
#[derive(Debug)]
pub struct MeshServer;

impl MeshServer {
    /// Binds the worker's mesh endpoint on `listen` and starts serving forwarded
    /// requests with `service`.
    ///
    /// `tls` comes from `mcpgw-certs` (client certificates from the mesh CA required);
    /// the mesh ALPN is added here. `local_worker_id` is what `Welcome` answers, so that
    /// callers can tell this worker from a successor on the same address. QUIC binds
    /// its own UDP socket (never `SO_REUSEPORT`: one consumer per worker endpoint).
    pub async fn bind(
        kind: TransportKind,
        listen: SocketAddr,
        tls: Arc<ServerConfig>,
        local_worker_id: impl Into<String>,
        service: Arc<dyn MeshService>,
        limits: MeshLimits,
    ) -> Result<MeshServerHandle, MeshError> {
        let mut tls = (*tls).clone();
        tls.alpn_protocols = vec![super::MESH_ALPN.to_vec()];
        let shared = ServerShared::new(kind, local_worker_id.into(), service, limits);
        let (local_addr, endpoint) = match kind {
            TransportKind::Quic => {
                let endpoint = quic::serve(listen, Arc::new(tls), shared.clone())?;
                let addr = endpoint.local_addr()?;
                (addr, Some(endpoint))
            }
            TransportKind::Tcp => (
                tcp::serve(listen, Arc::new(tls), shared.clone()).await?,
                None,
            ),
            TransportKind::Redis => {
                return Err(MeshError::Config(
                    "the Redis transport takes no TLS config and binds no socket: start it \
                     with MeshServer::bind_redis"
                        .into(),
                ));
            }
        };
        debug!(%local_addr, %kind, worker_id = %shared.worker_id, "mesh server listening");
        Ok(MeshServerHandle {
            local_addr,
            shared,
            quic_endpoint: endpoint,
            redis_channel: None,
        })
    }

    /// Starts serving forwarded requests with `service` on this worker's Redis request
    /// channel (`{prefix}pool_rpc:{local_worker_id}`), the measured baseline transport.
    ///
    /// Subscribes on a dedicated pub/sub connection and fails if Redis is unreachable
    /// within [`MeshLimits::connect_timeout`] or if the channel already has another
    /// subscriber (another process with this worker id). No mTLS: Redis is the trust
    /// boundary. [`MeshServerHandle::local_addr`] is the unspecified address `0.0.0.0:0`;
    /// [`MeshServerHandle::redis_channel`] names the channel.
    pub async fn bind_redis(
        redis: RedisTransportConfig,
        local_worker_id: impl Into<String>,
        service: Arc<dyn MeshService>,
        limits: MeshLimits,
    ) -> Result<MeshServerHandle, MeshError> {
        let shared = ServerShared::new(
            TransportKind::Redis,
            local_worker_id.into(),
            service,
            limits,
        );
        let channel = redis::serve(&redis, shared.clone()).await?;
        debug!(%channel, worker_id = %shared.worker_id, "mesh server subscribed");
        Ok(MeshServerHandle {
            local_addr: SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)),
            shared,
            quic_endpoint: None,
            redis_channel: Some(channel),
        })
    }
}

/// A running mesh server. Dropping it stops the server at once (in-flight requests
/// are cancelled); [`shutdown`](Self::shutdown) lets them finish first.
#[derive(Debug)]
pub struct MeshServerHandle {
    /// Where the server listens (with the real port when bound to port 0).
    local_addr: SocketAddr,
    /// State shared with the accept loop and every connection task.
    shared: Arc<ServerShared>,
    /// The QUIC endpoint, closed on stop so peers learn at once instead of timing out.
    quic_endpoint: Option<quinn::Endpoint>,
    /// The Redis transport's request channel; `None` for QUIC and TCP.
    redis_channel: Option<String>,
}

impl MeshServerHandle {
    /// The address the server listens on (`0.0.0.0:0` for the Redis transport, which
    /// listens on no socket).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The Redis channel the server takes requests on; `None` for QUIC and TCP.
    pub fn redis_channel(&self) -> Option<&str> {
        self.redis_channel.as_deref()
    }

    /// Stops taking new requests: each is answered `Error(Draining)`. Requests in
    /// flight go on. The endpoint keeps listening, because a refused connection would
    /// tell callers this worker is gone while it still finishes its work.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
    }

    /// Drains and waits up to `grace` for the requests in flight to finish, while the
    /// endpoint keeps answering (`Draining`), so the owner can end its sessions before
    /// it stops listening. Returns whether everything finished in time.
    pub async fn wait_idle(&self, grace: Duration) -> bool {
        self.drain();
        let settled = async {
            while self.shared.total_in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        timeout(grace, settled).await.is_ok()
    }

    /// Drains, waits up to `grace` for in-flight requests to finish, then stops.
    pub async fn shutdown(self, grace: Duration) {
        self.drain();
        self.shared.tracker.close();
        let in_flight = self.shared.tracker.clone();
        // Connection tasks wait for their next request forever; only request tasks
        // are worth waiting for, so wait for the in-flight count to reach zero.
        let settled = async {
            while self.shared.total_in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if timeout(grace, settled).await.is_err() {
            warn!(
                in_flight = self.shared.total_in_flight(),
                "mesh server shutdown: grace period over, cancelling requests still in flight"
            );
        }
        self.stop();
        let _ = timeout(Duration::from_secs(1), in_flight.wait()).await;
        if let Some(endpoint) = &self.quic_endpoint {
            // Let peers receive the close, so they learn at once instead of timing out.
            let _ = timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        }
    }

    fn stop(&self) {
        self.shared.stop.cancel();
        if let Some(endpoint) = &self.quic_endpoint {
            endpoint.close(quinn::VarInt::from_u32(0), b"mesh server stopped");
        }
    }
}

impl Drop for MeshServerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

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
    /// Cancelled to stop everything at once.
    pub(crate) stop: CancellationToken,
    /// Every task the server spawned, so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
    /// Requests in flight per peer worker id, for `max_in_flight_per_peer`.
    in_flight: Mutex<HashMap<String, usize>>,
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
    fn new(
        kind: TransportKind,
        worker_id: String,
        service: Arc<dyn MeshService>,
        mut limits: MeshLimits,
    ) -> Arc<Self> {
        // Zero would refuse every request; one is the least that serves.
        limits.max_in_flight_per_peer = limits.max_in_flight_per_peer.max(1);
        Arc::new(ServerShared {
            kind,
            worker_id,
            service,
            limits,
            draining: AtomicBool::new(false),
            stop: CancellationToken::new(),
            tracker: TaskTracker::new(),
            in_flight: Mutex::new(HashMap::new()),
        })
    }

    fn total_in_flight(&self) -> usize {
        self.in_flight
            .lock()
            .map(|m| m.values().sum())
            .unwrap_or_default()
    }

    /// Takes an in-flight slot for `peer`, or `None` when it is at its limit.
    pub(crate) fn admit(self: &Arc<Self>, peer: &str) -> Option<InFlight> {
        let mut map = self.in_flight.lock().ok()?;
        let n = map.entry(peer.to_owned()).or_default();
        if *n >= self.limits.max_in_flight_per_peer {
            return None;
        }
        *n += 1;
        Some(InFlight {
            shared: self.clone(),
            peer: peer.to_owned(),
        })
    }
}

/// One admitted request; frees its slot when dropped.
pub(crate) struct InFlight {
    shared: Arc<ServerShared>,
    peer: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut map) = self.shared.in_flight.lock()
            && let Some(n) = map.get_mut(&self.peer)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.peer);
            }
        }
    }
}

/// Answers the caller's `Hello`. Returns the caller's worker id, or `None` when the
/// connection must close (bad greeting, version mismatch, caller gone).
pub(crate) async fn greet<R, W>(
    shared: &ServerShared,
    remote: SocketAddr,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> Option<String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
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
            let welcome = Frame::Welcome {
                version: PROTOCOL_VERSION,
                worker_id: shared.worker_id.clone(),
            };
            if version != PROTOCOL_VERSION {
                warn!(%remote, peer_worker = %worker_id, theirs = version, ours = PROTOCOL_VERSION,
                    "mesh peer speaks another protocol version; refusing");
                // `Welcome` keeps its layout in every version, so the caller can read our
                // version from it and refuse with both numbers; the error frame says why
                // the connection is about to close.
                let _ = writer.send(&welcome).await;
                let _ = writer
                    .send(&Frame::Error(ErrorFrame::new(
                        ErrorKind::VersionMismatch,
                        format!(
                            "this worker speaks mesh protocol version {PROTOCOL_VERSION}, \
                             the caller {version}: run the same mcpgw version everywhere"
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
            Some(worker_id)
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

/// How an exchange ended, for the connection that carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExchangeEnd {
    /// `End` or `Error` was sent; the connection can carry the next request.
    Clean,
    /// The stream is unusable (caller gone, write failed, stopping).
    Broken,
}

/// Serves one request: admission, deadline, streaming the service's response, and
/// watching the caller for `Cancel` or disconnection while the response runs.
pub(crate) async fn serve_request<R, W>(
    shared: &Arc<ServerShared>,
    peer: &PeerInfo,
    request: RequestFrame,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> ExchangeEnd
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let request_id = request.request_id;
    let deadline = Instant::now() + Duration::from_millis(u64::from(request.deadline_ms));
    let refuse = |kind, msg: String| Frame::Error(ErrorFrame::new(kind, msg));
    if shared.draining.load(Ordering::SeqCst) {
        let frame = refuse(
            ErrorKind::Draining,
            format!("worker {} is shutting down", shared.worker_id),
        );
        return finish(writer, &frame, deadline).await;
    }
    if request.deadline_ms == 0 {
        let frame = refuse(
            ErrorKind::DeadlineExceeded,
            "request arrived with no time left".into(),
        );
        return finish(writer, &frame, deadline).await;
    }
    let Some(_slot) = shared.admit(&peer.worker_id) else {
        let frame = refuse(
            ErrorKind::Busy,
            format!(
                "worker {} already runs {} requests for worker {}",
                shared.worker_id, shared.limits.max_in_flight_per_peer, peer.worker_id
            ),
        );
        return finish(writer, &frame, deadline).await;
    };

    let mut response = shared.service.serve(request, peer.clone());
    let mut head_sent = false;
    // The deadline bounds the time to the head. After it, a stream (SSE, a session's
    // GET stream) runs as long as the service produces it and the caller reads it;
    // each send is bounded by `stall` so a caller that stops reading cannot hold it.
    let stall = shared.limits.idle_timeout;
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
        tokio::select! {
            biased;
            () = shared.stop.cancelled() => return ExchangeEnd::Broken,
            () = head_deadline => {
                drop(response);
                debug!(request_id, peer = %peer.worker_id, "mesh request deadline passed; stopped");
                let frame = refuse(ErrorKind::DeadlineExceeded, "the request's deadline passed at the owner".into());
                // The deadline is over: give the error frame a moment of its own.
                return finish(writer, &frame, Instant::now() + shared.limits.connect_timeout).await;
            }
            incoming = reader.next() => {
                drop(response);
                let frame = match incoming {
                    Ok(Some(Frame::Cancel)) => {
                        debug!(request_id, peer = %peer.worker_id, "mesh request cancelled by caller");
                        refuse(ErrorKind::Cancelled, "cancelled by the caller".into())
                    }
                    Ok(None) | Err(LinkError::Broken { .. }) => {
                        debug!(request_id, peer = %peer.worker_id, "mesh caller went away; request stopped");
                        return ExchangeEnd::Broken;
                    }
                    Ok(Some(other)) => {
                        warn!(request_id, peer = %peer.worker_id, frame = other.name(),
                            "mesh caller sent a frame during a response; request cancelled");
                        refuse(ErrorKind::Malformed, format!("unexpected {} during a response", other.name()))
                    }
                    Err(e) => {
                        warn!(request_id, peer = %peer.worker_id, error = %e.reason(),
                            "mesh caller sent a bad frame during a response; request cancelled");
                        error_for(&e)
                    }
                };
                return finish(writer, &frame, send_by).await;
            }
            part = response.next() => {
                // Queue this part and every part that is already ready behind it
                // (a JSON answer is Head, Chunk and End at once), then write them in
                // one go; a stream still gets each event out as it is produced.
                let mut part = part;
                let mut ending: Option<Frame> = None;
                loop {
                    let queued = match part {
                        Some(ResponsePart::Head(head)) if !head_sent => {
                            head_sent = true;
                            writer.queue(&Frame::Head(head))
                        }
                        Some(ResponsePart::Chunk(bytes)) if head_sent => queue_chunk(writer, bytes),
                        Some(ResponsePart::End) if head_sent => {
                            ending = Some(Frame::End);
                            break;
                        }
                        Some(ResponsePart::Error(e)) => {
                            ending = Some(Frame::Error(e));
                            break;
                        }
                        Some(other) => {
                            warn!(request_id, part = other.name(), head_sent,
                                "mesh service produced a response out of order (Head, Chunk*, End)");
                            ending = Some(refuse(ErrorKind::Internal, "owner produced a malformed response".into()));
                            break;
                        }
                        None => {
                            warn!(request_id, "mesh service ended a response without End");
                            ending = Some(refuse(ErrorKind::Internal, "owner ended the response without End".into()));
                            break;
                        }
                    };
                    if let Err(e) = queued {
                        warn!(request_id, error = %e, "mesh response part cannot be encoded");
                        ending = Some(refuse(ErrorKind::Internal, format!("owner cannot encode the response: {e}")));
                        break;
                    }
                    if writer.queued_len() >= writer.max_frame() {
                        break;
                    }
                    match response.next().now_or_never() {
                        Some(next) => part = next,
                        None => break,
                    }
                }
                let end = match &ending {
                    Some(frame) => writer.queue(frame).map(|()| true),
                    None => Ok(false),
                };
                let written = match end {
                    Ok(ending_queued) => {
                        let by = if ending_queued { send_by.max(Instant::now() + Duration::from_secs(1)) } else { send_by };
                        match timeout_at(by, writer.flush_queued()).await {
                            Ok(result) => result.map(|()| ending_queued),
                            Err(_) => Err(SendError::Io(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "caller did not take the response before the deadline",
                            ))),
                        }
                    }
                    Err(e) => Err(SendError::Encode(e)),
                };
                match written {
                    Ok(true) => return ExchangeEnd::Clean,
                    Ok(false) => {}
                    Err(SendError::Encode(e)) => {
                        warn!(request_id, error = %e, "mesh response cannot be encoded");
                        let frame = refuse(ErrorKind::Internal, format!("owner cannot encode the response: {e}"));
                        return finish(writer, &frame, deadline).await;
                    }
                    Err(SendError::Io(e)) => {
                        debug!(request_id, error = %e, "mesh caller stopped reading; request stopped");
                        return ExchangeEnd::Broken;
                    }
                }
            }
        }
    }
}

/// Sends a frame, giving up at `deadline` (a caller that stops reading cannot hold a
/// request forever).
async fn send<W: AsyncWrite + Unpin>(
    writer: &mut FrameWriter<W>,
    frame: &Frame,
    deadline: Instant,
) -> Result<(), SendError> {
    match timeout_at(deadline, writer.send(frame)).await {
        Ok(result) => result,
        Err(_) => Err(SendError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "caller did not take the response before the deadline",
        ))),
    }
}

/// Queues a body chunk, split so that each frame fits the maximum frame size.
fn queue_chunk<W: AsyncWrite + Unpin>(
    writer: &mut FrameWriter<W>,
    mut bytes: bytes::Bytes,
) -> Result<(), mcpgw_wire::WireError> {
    let piece = writer
        .max_frame()
        .saturating_sub(Frame::CHUNK_OVERHEAD)
        .max(1);
    loop {
        let rest = if bytes.len() > piece {
            bytes.split_off(piece)
        } else {
            bytes::Bytes::new()
        };
        writer.queue(&Frame::Chunk(bytes))?;
        if rest.is_empty() {
            return Ok(());
        }
        bytes = rest;
    }
}

/// Sends the exchange's last frame and reports how the exchange ended.
async fn finish<W: AsyncWrite + Unpin>(
    writer: &mut FrameWriter<W>,
    frame: &Frame,
    deadline: Instant,
) -> ExchangeEnd {
    // The last frame may go out a little after the request's own deadline (it *is*
    // the deadline answer); a minimum of one second keeps a stuck caller bounded.
    let deadline = deadline.max(Instant::now() + Duration::from_secs(1));
    match send(writer, frame, deadline).await {
        Ok(()) => ExchangeEnd::Clean,
        Err(_) => ExchangeEnd::Broken,
    }
}

/// Reads the request that opens an exchange and serves it. Anything but a request
/// is answered with an error frame (and logged), keeping the stream in sync.
pub(crate) async fn serve_next<R, W>(
    shared: &Arc<ServerShared>,
    peer: &PeerInfo,
    incoming: Result<Option<Frame>, LinkError>,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> Option<ExchangeEnd>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let no_deadline = Instant::now() + shared.limits.connect_timeout;
    match incoming {
        Ok(Some(Frame::Request(request))) => {
            Some(serve_request(shared, peer, *request, reader, writer).await)
        }
        // A Cancel that crossed the response's last frame: nothing left to cancel.
        Ok(Some(Frame::Cancel)) => Some(ExchangeEnd::Clean),
        Ok(Some(other)) => {
            warn!(peer = %peer.worker_id, frame = other.name(), "mesh peer sent an unexpected frame; answered with an error");
            let frame = Frame::Error(ErrorFrame::new(
                ErrorKind::Malformed,
                format!("expected Request, got {}", other.name()),
            ));
            Some(finish(writer, &frame, no_deadline).await)
        }
        Ok(None) => None,
        Err(e @ LinkError::BadFrame(_)) => {
            warn!(peer = %peer.worker_id, error = %e.reason(), "mesh peer sent a bad frame; answered with an error");
            Some(finish(writer, &error_for(&e), no_deadline).await)
        }
        Err(LinkError::Broken { reason, .. }) => {
            debug!(peer = %peer.worker_id, %reason, "mesh connection closed");
            None
        }
    }
}
