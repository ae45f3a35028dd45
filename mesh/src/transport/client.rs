//! The caller's facade over the transports: [`MeshClient`], which dispatches to the
//! transport's peer pool, and reading a forwarded response, whichever link carries
//! it. What the transports' callers share (the greeting, resolving) is in `calling`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, BoxStream, StreamExt};
use mcpgw_wire::{Frame, MeshCodec, RequestFrame, ResponseHead};
use tokio::time::{Instant, timeout_at};

use super::budget::{Budgets, Permit, StreamClass, is_event_stream};
use super::calling::ExState;
use super::config::{MeshLimits, TransportKind};
use super::error::{LinkError, MeshError};
use super::observe::{MeshObserver, Observer};
use super::redis::RedisTransportConfig;
use super::tcp::SameHostRoute;
use super::tls::{ClientTls, IdentityBook};
use super::{quic, redis, tcp};

/// How long after a request's own deadline the caller still waits for the owner's
/// answer. The owner stops the request at the deadline and says so; if that answer
/// does not arrive within this grace, the link is presumed broken.
pub const CALLER_DEADLINE_GRACE: Duration = Duration::from_secs(2);

/// The caller's side of the mesh: a pool of connections to peers, made on first use
/// and reused. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct MeshClient {
    inner: Arc<ClientInner>,
}

struct ClientInner {
    /// The transport and its pool.
    transport: Transport,
    /// Encodes requests before any I/O, so a request too large is refused locally.
    max_frame: usize,
    /// Exchanges in flight per peer address, short and long, so that a full budget
    /// fails at once and held streams never make a short request wait.
    budgets: Arc<Budgets>,
    /// The identity each expected worker registered, checked against the certificate
    /// of every connection that claims to lead to it.
    identities: Arc<IdentityBook>,
}

fn budgets_for(limits: &MeshLimits) -> Arc<Budgets> {
    Budgets::new(limits.max_in_flight_per_peer, limits.max_streams_per_peer)
}

enum Transport {
    Quic(quic::caller::QuicClient),
    Tcp(tcp::TcpClient),
    Redis(redis::RedisClient),
}

impl fmt::Debug for MeshClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeshClient")
            .field("kind", &self.kind())
            .finish_non_exhaustive()
    }
}

impl MeshClient {
    /// A client for `kind`. `tls` comes from `mcpgw-certs` (our leaf, mesh CA): a fixed
    /// config, or a `MeshTlsSource` whose new material every new dial uses; the mesh
    /// ALPN is added here when it is missing. `local_worker_id` is announced in every `Hello`.
    /// `observer`, when given, is told of this client's dials and connections (see
    /// [`MeshObserver`]); each client reports to its own, so workers sharing a process
    /// keep their counts apart. Sockets are opened on first use, so this needs no
    /// runtime.
    pub fn new(
        kind: TransportKind,
        tls: impl Into<ClientTls>,
        local_worker_id: impl Into<String>,
        limits: MeshLimits,
        observer: Option<Arc<dyn MeshObserver>>,
    ) -> Result<Self, MeshError> {
        let observer = Observer::from(observer);
        let tls = tls.into();
        let worker_id = local_worker_id.into();
        let max_frame = limits.max_frame;
        let budgets = budgets_for(&limits);
        let identities = Arc::new(IdentityBook::default());
        let transport = match kind {
            TransportKind::Quic => Transport::Quic(quic::caller::QuicClient::new(
                tls,
                worker_id,
                limits,
                identities.clone(),
                observer,
            )?),
            TransportKind::Tcp => Transport::Tcp(tcp::TcpClient::new(
                tls,
                worker_id,
                limits,
                identities.clone(),
                observer,
            )),
            TransportKind::Redis => {
                return Err(MeshError::Config(
                    "the Redis transport takes no TLS config: make its client with \
                     MeshClient::new_redis"
                        .into(),
                ));
            }
        };
        Ok(Self {
            inner: Arc::new(ClientInner {
                transport,
                max_frame,
                budgets,
                identities,
            }),
        })
    }

    /// A client for the Redis transport, the measured baseline: requests go to
    /// `{prefix}pool_rpc:{worker}`, replies come back on this worker's
    /// `{prefix}pool_reply:{local_worker_id}`. Unlike [`new`](Self::new) this connects
    /// at once: it subscribes to the reply channel before any request may go out, and
    /// fails if Redis is unreachable within [`MeshLimits::connect_timeout`]. No mTLS:
    /// Redis is the trust boundary.
    pub async fn new_redis(
        redis: RedisTransportConfig,
        local_worker_id: impl Into<String>,
        limits: MeshLimits,
    ) -> Result<Self, MeshError> {
        let max_frame = limits.max_frame;
        let budgets = budgets_for(&limits);
        let client = redis::RedisClient::new(redis, local_worker_id.into(), limits).await?;
        Ok(Self {
            inner: Arc::new(ClientInner {
                transport: Transport::Redis(client),
                max_frame,
                budgets,
                identities: Arc::default(),
            }),
        })
    }

    /// What this client has in flight, by budget, for metrics.
    pub fn stream_counter(&self) -> super::budget::StreamCounter {
        super::budget::StreamCounter(Arc::clone(&self.inner.budgets))
    }

    /// The transport this client uses.
    pub fn kind(&self) -> TransportKind {
        match self.inner.transport {
            Transport::Quic(_) => TransportKind::Quic,
            Transport::Tcp(_) => TransportKind::Tcp,
            Transport::Redis(_) => TransportKind::Redis,
        }
    }

    /// The transport's name as a metric label (`"quic"`, `"tcp"` or `"redis"`).
    pub fn label(&self) -> &'static str {
        self.kind().as_str()
    }

    /// Whether [`MeshError::Refused`] from this client proves the owner gone, so a
    /// caller may act on it without asking the directory.
    ///
    /// QUIC and TCP: yes. A refusal there is a closed port (or an endpoint closed by a
    /// worker that stopped) at the address the owner registered, and a `WrongWorker`
    /// answer is another worker's greeting there; a live owner shows neither. The
    /// same-host path keeps this true: it answers `Refused` only for a socket file with
    /// no listener at the path named by the owner's id, and a path with no such file
    /// (another container's filesystem) is no answer at all: the dial goes over TCP. Redis
    /// pub/sub: no. "No subscriber on the owner's channel" is also what an owner looks
    /// like for the moment its subscriber reconnects to Redis, so only the directory's
    /// lease can tell.
    pub fn refusal_proves_death(&self) -> bool {
        match self.inner.transport {
            Transport::Quic(_) | Transport::Tcp(_) => true,
            Transport::Redis(_) => false,
        }
    }

    /// Forwards `request` to the worker `expect_worker_id` at `peer_addr` (`host:port`
    /// from the directory) and waits for the response head.
    ///
    /// Resolves once the owner answered with `Head` (the body follows through
    /// [`ForwardedResponse::next_chunk`]) or with an error frame
    /// ([`MeshError::Remote`]). Dropping the future after the request was sent cancels
    /// it at the owner. A stale pooled connection is replaced transparently, once, as
    /// long as the request cannot have reached the owner. The Redis transport needs no
    /// address: it publishes to the channel of `expect_worker_id`.
    ///
    /// The request draws from the peer's budget of its class (a `GET` from the
    /// long-lived budget, anything else from the short one, moving to the long one when
    /// its head says `text/event-stream`) until the response ends or is dropped; a full
    /// budget fails at once with [`MeshError::BudgetExhausted`].
    pub async fn forward(
        &self,
        peer_addr: &str,
        expect_worker_id: &str,
        request: RequestFrame,
    ) -> Result<ForwardedResponse, MeshError> {
        self.forward_tracked(
            peer_addr,
            expect_worker_id,
            request,
            &AtomicBool::new(false),
        )
        .await
    }

    /// [`forward`](Self::forward), setting `sent` once the request has left for the
    /// owner (handed to an established connection). A caller that gives up while
    /// `sent` is still false knows the request cannot have run.
    pub async fn forward_tracked(
        &self,
        peer_addr: &str,
        expect_worker_id: &str,
        request: RequestFrame,
        sent: &AtomicBool,
    ) -> Result<ForwardedResponse, MeshError> {
        let deadline = Instant::now()
            + Duration::from_millis(u64::from(request.deadline_ms))
            + CALLER_DEADLINE_GRACE;
        let class = StreamClass::of_request(&request.method);
        let mut permit = self.inner.budgets.admit(peer_addr, class).map_err(|full| {
            MeshError::BudgetExhausted {
                addr: peer_addr.to_owned(),
                class: full.class.name(),
                limit: full.limit,
            }
        })?;
        let frame = Frame::Request(Box::new(request));
        let encode = || {
            MeshCodec::new(self.inner.max_frame)
                .encode_frame(&frame)
                .map_err(|e| MeshError::RequestTooLarge(e.to_string()))
        };
        let mut exchange = match &self.inner.transport {
            Transport::Quic(q) => Exchange::Quic(
                q.send_request(peer_addr, expect_worker_id, &encode()?)
                    .await?,
            ),
            // Encoded with its exchange id straight into the connection's outbox.
            Transport::Tcp(t) => {
                Exchange::Tcp(t.send_request(peer_addr, expect_worker_id, &frame).await?)
            }
            // Encoded behind its routing header by the transport, in one buffer.
            Transport::Redis(r) => {
                Exchange::Redis(r.send_request(expect_worker_id, &frame, deadline).await?)
            }
        };
        sent.store(true, std::sync::atomic::Ordering::Release);
        let head = read_head(&mut exchange, deadline).await?;
        if is_event_stream(&head) {
            permit.promote();
        }
        Ok(ForwardedResponse {
            head,
            exchange,
            done: false,
            permit: Some(permit),
        })
    }

    /// Records the mesh identity (URI SAN) that worker `worker_id` registered with its
    /// lease: from then on a connection that claims to lead to that worker is used only
    /// if its certificate carries that identity ([`MeshError::IdentityMismatch`]
    /// otherwise, which proves nothing). `None` forgets it: any mesh member's
    /// certificate is accepted, as for a worker never recorded.
    pub fn expect_identity(&self, worker_id: &str, identity: Option<&str>) {
        match identity {
            Some(identity) => self.inner.identities.record(worker_id, identity),
            None => self.inner.identities.forget(worker_id),
        }
    }

    /// Turns the same-host path on for this client: from then on a worker whose
    /// advertised [`SameHostRoute`] names `our_boot_id` (this kernel) is dialled over
    /// its Unix socket first, and over TCP when that socket cannot be used from here
    /// (see the `tcp::same_host` module source). TCP transport only.
    pub fn use_same_host(&self, our_boot_id: &str) -> Result<(), MeshError> {
        match &self.inner.transport {
            Transport::Tcp(t) => {
                t.same_host().enable(our_boot_id);
                Ok(())
            }
            _ => Err(MeshError::Config(format!(
                "the same-host mesh path runs the TCP transport's framing; the {} \
                 transport has none",
                self.label()
            ))),
        }
    }

    /// Records the same-host route worker `worker_id` advertised with its lease (or
    /// that it advertised none). Kept only when the same-host path is on and the route
    /// names this kernel; otherwise the worker is reached over TCP as before.
    pub fn expect_same_host(&self, worker_id: &str, route: Option<&SameHostRoute>) {
        if let Transport::Tcp(t) = &self.inner.transport {
            t.same_host().record(worker_id, route);
        }
    }

    /// Drops pooled connections to `peer_addr`, for when the directory says the worker
    /// there is gone. Requests in flight on them are not affected.
    pub fn forget_peer(&self, peer_addr: &str) {
        match &self.inner.transport {
            Transport::Quic(q) => q.forget_peer(peer_addr),
            Transport::Tcp(t) => t.forget_peer(peer_addr),
            // No connection per peer: the channel follows from the worker id.
            Transport::Redis(_) => {}
        }
    }
}

/// A response being relayed from the owner: the head, then body chunks as they come.
///
/// Dropping it before the body ended cancels the request at the owner.
pub struct ForwardedResponse {
    /// Status and headers, as the owner sent them.
    head: ResponseHead,
    /// The stream (QUIC), pooled connection (TCP) or reply queue (Redis) carrying the
    /// body.
    exchange: Exchange,
    /// Set once `End`, an error, or a failure ended the body.
    done: bool,
    /// The exchange's place in the peer's budget; given back when the body ends.
    permit: Option<Permit>,
}

impl fmt::Debug for ForwardedResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForwardedResponse")
            .field("head", &self.head)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ForwardedResponse {
    /// The response status and headers.
    pub fn head(&self) -> &ResponseHead {
        &self.head
    }

    /// Takes the head's headers, so the caller can keep their strings instead of
    /// copying them; [`head`](Self::head) has none after.
    pub fn take_headers(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.head.headers)
    }

    /// The next body chunk as soon as the owner sent it; `None` after `End`.
    ///
    /// An error ends the body: [`MeshError::Remote`] when the owner reported one
    /// (e.g. `Internal`), [`MeshError::LostMidResponse`] when the connection died.
    /// After an error or `End`, returns `None`.
    pub async fn next_chunk(&mut self) -> Option<Result<Bytes, MeshError>> {
        if self.done {
            return None;
        }
        // No deadline here: the request's deadline bounds the time to the head; a
        // stream then runs as long as the owner produces it. A dead owner is noticed
        // by the link (QUIC idle timeout with keep-alives, TCP keepalive).
        let outcome = match self.exchange.next().await {
            Ok(Some(Frame::Chunk(bytes))) => return Some(Ok(bytes)),
            Ok(Some(Frame::End)) => {
                self.exchange.set_state(ExState::Clean);
                None
            }
            Ok(Some(Frame::Error(e))) => {
                self.exchange.set_state(ExState::Clean);
                Some(Err(MeshError::Remote(e)))
            }
            Ok(Some(other)) => {
                self.exchange.set_state(ExState::Broken);
                Some(Err(MeshError::Protocol(format!(
                    "expected a body chunk, got {}",
                    other.name()
                ))))
            }
            Ok(None) => {
                self.exchange.set_state(ExState::Broken);
                Some(Err(MeshError::LostMidResponse(
                    "peer closed the stream before the end of the response".into(),
                )))
            }
            Err(LinkError::BadFrame(e)) => {
                self.exchange.set_state(ExState::Broken);
                Some(Err(MeshError::Protocol(e.to_string())))
            }
            Err(LinkError::Broken { reason, .. }) => {
                self.exchange.set_state(ExState::Broken);
                Some(Err(MeshError::LostMidResponse(reason)))
            }
        };
        self.done = true;
        self.exchange.release();
        self.permit = None;
        outcome
    }

    /// The body as a stream of chunks, ending after `End` or after the first error.
    pub fn into_body_stream(self) -> BoxStream<'static, Result<Bytes, MeshError>> {
        stream::unfold(self, |mut response| async move {
            let item = response.next_chunk().await?;
            Some((item, response))
        })
        .boxed()
    }
}

/// One request's link: a QUIC stream pair, a pooled TCP connection, or a Redis
/// exchange's reply queue.
pub(crate) enum Exchange {
    Quic(quic::caller::QuicExchange),
    Tcp(tcp::TcpExchange),
    Redis(redis::RedisExchange),
}

impl Exchange {
    async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        match self {
            Exchange::Quic(x) => x.next().await,
            Exchange::Tcp(x) => x.next().await,
            Exchange::Redis(x) => x.next().await,
        }
    }

    fn set_state(&mut self, state: ExState) {
        match self {
            Exchange::Quic(x) => x.state = state,
            Exchange::Tcp(x) => x.state = state,
            Exchange::Redis(x) => x.state = state,
        }
    }

    /// Gives the link back (pool) or closes it now, instead of when the response is
    /// dropped: a caller may hold a finished response for a while.
    fn release(&mut self) {
        match self {
            Exchange::Quic(x) => x.release(),
            Exchange::Tcp(x) => x.release(),
            Exchange::Redis(x) => x.release(),
        }
    }
}

/// Waits for the response head; an error frame instead of a head ends the exchange.
async fn read_head(exchange: &mut Exchange, deadline: Instant) -> Result<ResponseHead, MeshError> {
    let (state, result) = match timeout_at(deadline, exchange.next()).await {
        // State stays Open: the caller drops the exchange, which cancels at the owner.
        Err(_) => return Err(MeshError::DeadlineExceeded),
        Ok(Ok(Some(Frame::Head(head)))) => return Ok(head),
        Ok(Ok(Some(Frame::Error(e)))) => (ExState::Clean, MeshError::Remote(e)),
        Ok(Ok(Some(other))) => (
            ExState::Broken,
            MeshError::Protocol(format!("expected a response head, got {}", other.name())),
        ),
        Ok(Ok(None)) => (
            ExState::Broken,
            MeshError::LostMidResponse("peer closed the stream without answering".into()),
        ),
        Ok(Err(LinkError::BadFrame(e))) => (ExState::Broken, MeshError::Protocol(e.to_string())),
        Ok(Err(LinkError::Broken { reason, .. })) => {
            (ExState::Broken, MeshError::LostMidResponse(reason))
        }
    };
    exchange.set_state(state);
    exchange.release();
    Err(result)
}
