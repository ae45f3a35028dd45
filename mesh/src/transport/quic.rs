//! QUIC transport (quinn): one connection per peer, one bidirectional stream per
//! request.
//!
//! The connection's first stream carries `Hello` → `Welcome` and is then finished;
//! every later stream carries exactly one request exchange. Streams are independent,
//! so a slow or broken request never delays the others, and a bad frame costs only
//! its own stream.

use std::collections::HashMap;
use std::future::pending;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use mcpgw_certs::MESH_SERVER_NAME;
use mcpgw_wire::{ErrorFrame, ErrorKind, Frame};
use parking_lot::Mutex;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, IdleTimeout, RecvStream, SendStream, TransportConfig, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::net::UdpSocket;
use tokio::time::{Instant, timeout};
use tracing::{debug, warn};

use super::client::{ExState, greet as client_greet, resolve};
use super::error::{LinkError, quic_tls_cause};
use super::framed::{FrameReader, FrameWriter, SendError};
use super::guard::HandshakePermit;
use super::observe::{self, OpenConnection};
use super::server::{
    CallerEvent, ExchangeEnd, ExchangeLink, ServerShared, greet as server_greet, serve_next,
    timed_out,
};
use super::tls::{ConnectionLife, IdentityBook};
use super::{ClientTls, MeshError, MeshLimits, PeerInfo, ServerTls, TransportKind};

/// Application error code on a stream the caller abandons (reset and stop).
const CANCEL_CODE: VarInt = VarInt::from_u32(1);
/// Application error code on a stream the owner abandons (write failed, stopping).
const ABORT_CODE: VarInt = VarInt::from_u32(2);
/// Application error code closing a connection whose greeting failed.
const GREETING_FAILED: VarInt = VarInt::from_u32(3);
/// Application error code closing a connection that outlived its maximum age or its
/// peer's certificate.
const CONNECTION_TOO_OLD: VarInt = VarInt::from_u32(4);
/// Application error code closing a retired connection once nothing uses it.
const RETIRED: VarInt = VarInt::from_u32(0);

/// rustls client config, as quinn takes it.
fn quic_client_crypto(tls: Arc<rustls::ClientConfig>) -> Result<Arc<QuicClientConfig>, MeshError> {
    QuicClientConfig::try_from(tls)
        .map(Arc::new)
        .map_err(|e| MeshError::Config(format!("client TLS config cannot be used for QUIC: {e}")))
}

/// The most concurrent streams a server allows one peer: quinn keeps a table entry for
/// every stream it allows, so absurd budgets must not turn into gigabytes.
const MAX_STREAMS: u32 = 1 << 20;

/// Streams a new connection may open at first. quinn makes a table entry for every
/// stream it allows when the connection starts (tens of thousands cost a noticeable
/// part of a handshake), so the limit starts here and doubles whenever half of it is
/// in use, up to what both budgets need.
const INITIAL_STREAMS: u32 = 1024;

/// How long a caller waits for stream credit the owner is about to raise before it
/// calls the owner busy.
const CREDIT_WAIT: Duration = Duration::from_secs(1);

/// Streams the server may allow one peer: both budgets, plus room for the greeting
/// stream and for streams whose close is still being acknowledged.
fn stream_ceiling(limits: &MeshLimits) -> u32 {
    let budgets = limits
        .max_in_flight_per_peer
        .saturating_add(limits.max_streams_per_peer);
    u32::try_from(budgets.saturating_add(budgets / 16).saturating_add(16))
        .unwrap_or(u32::MAX)
        .min(MAX_STREAMS)
}

/// Acknowledgement frequency each end asks of the other (the QUIC ACK frequency
/// extension, which both ends here speak). Mesh traffic is request and answer: the
/// answer carries the acknowledgement of the request, and the next request that of
/// the answer, so a datagram that only acknowledges is mostly waste. Asking for an
/// acknowledgement every ten packets, or after 5 ms, removes most of them; loss
/// recovery on a data-centre link still sees an acknowledgement within a few
/// milliseconds.
fn sparse_acks() -> quinn::AckFrequencyConfig {
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(VarInt::from_u32(10))
        .max_ack_delay(Some(Duration::from_millis(5)));
    acks
}

fn idle_timeout(limits: &MeshLimits) -> Result<IdleTimeout, MeshError> {
    IdleTimeout::try_from(limits.idle_timeout)
        .map_err(|_| MeshError::Config("mesh idle timeout is too large for QUIC".into()))
}

// ---------------------------------------------------------------- server side

/// Binds the QUIC endpoint and spawns its accept loop, and, for material that follows
/// its files, the task that hands each new server config to the endpoint (quinn uses it
/// for new connections only; established ones keep theirs).
pub(crate) fn serve(
    listen: SocketAddr,
    tls: ServerTls,
    shared: Arc<ServerShared>,
) -> Result<Endpoint, MeshError> {
    let config = server_config(tls.config(), &shared.limits)?;
    let endpoint = endpoint_on(listen, Some(config))?;
    if let Some(source) = tls.source() {
        let mut changes = source.subscribe();
        let (endpoint, tls, shared) = (endpoint.clone(), tls.clone(), shared.clone());
        shared.tracker.clone().spawn(async move {
            loop {
                tokio::select! {
                    () = shared.stop.cancelled() => return,
                    changed = changes.changed() => if changed.is_err() { return },
                }
                match server_config(tls.config(), &shared.limits) {
                    Ok(config) => {
                        endpoint.set_server_config(Some(config));
                        debug!("mesh QUIC endpoint: new connections use the reloaded TLS material");
                    }
                    Err(e) => warn!(error = %e, "mesh QUIC endpoint keeps its TLS material: the reloaded one does not suit QUIC"),
                }
            }
        });
    }
    shared
        .tracker
        .spawn(accept_loop(endpoint.clone(), tls, shared.clone()));
    Ok(endpoint)
}

/// The quinn server config: TLS, stream limits, idle timeout, sparse acknowledgements.
fn server_config(
    tls: Arc<rustls::ServerConfig>,
    limits: &MeshLimits,
) -> Result<quinn::ServerConfig, MeshError> {
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| {
        MeshError::Config(format!("server TLS config cannot be used for QUIC: {e}"))
    })?;
    let mut transport = TransportConfig::default();
    // Raised per connection as streams open (see `StreamAllowance`), up to both
    // budgets, so that stream credit never runs out before a budget does.
    let streams = INITIAL_STREAMS.min(stream_ceiling(limits));
    transport
        .max_concurrent_bidi_streams(VarInt::from_u32(streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .max_idle_timeout(Some(idle_timeout(limits)?))
        .ack_frequency_config(Some(sparse_acks()));
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(transport));
    // Workers have fixed addresses; a peer's address changing mid-connection is not
    // something the mesh needs to support.
    config.migration(false);
    Ok(config)
}

/// Kernel buffer asked for each mesh UDP socket. Bursts of datagrams from many
/// concurrent streams overflow the usual ~200 KiB default and are dropped (measured:
/// 1,388 drops in 3 s at 512 concurrent requests), which costs retransmits and tail
/// latency. The kernel caps the request at `net.core.rmem_max`/`wmem_max`.
const UDP_BUFFER_BYTES: usize = 4 << 20;

/// A quinn endpoint on its own UDP socket with large kernel buffers.
fn endpoint_on(bind: SocketAddr, server: Option<quinn::ServerConfig>) -> std::io::Result<Endpoint> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    // Best effort: a smaller buffer still works, only with more drops under bursts.
    let _ = socket.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = socket.set_send_buffer_size(UDP_BUFFER_BYTES);
    socket.bind(&bind.into())?;
    let runtime = quinn::default_runtime()
        .ok_or_else(|| std::io::Error::other("no async runtime for the QUIC endpoint"))?;
    Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        socket.into(),
        runtime,
    )
}

async fn accept_loop(endpoint: Endpoint, tls: ServerTls, shared: Arc<ServerShared>) {
    loop {
        let incoming = tokio::select! {
            () = shared.stop.cancelled() => return,
            incoming = endpoint.accept() => incoming,
        };
        let Some(incoming) = incoming else { return };
        let remote = incoming.remote_address();
        let permit = match shared.handshakes.enter(remote.ip()) {
            Ok(permit) => permit,
            Err(full) => {
                // Refused before any TLS work, with a close the peer understands.
                incoming.refuse();
                observe::handshake("owner", "over_cap");
                shared.handshake_failures.failed(
                    "quic",
                    remote,
                    "over_cap",
                    &format!("connection refused: {}", full.reason()),
                );
                continue;
            }
        };
        shared
            .tracker
            .spawn(connection(incoming, tls.clone(), shared.clone(), permit));
    }
}

async fn connection(
    incoming: quinn::Incoming,
    tls: ServerTls,
    shared: Arc<ServerShared>,
    permit: HandshakePermit,
) {
    let remote = incoming.remote_address();
    let limits = &shared.limits;
    let failures = &shared.handshake_failures;
    let conn = match timeout(limits.connect_timeout, incoming).await {
        Err(_) => {
            observe::handshake("owner", "timeout");
            failures.failed(
                "quic",
                remote,
                "timeout",
                "QUIC handshake not finished within the connect timeout",
            );
            return;
        }
        Ok(Err(e)) => {
            let cause = quic_tls_cause(&e);
            let outcome = if cause.is_some() { "tls" } else { "io" };
            let reason = cause.unwrap_or_else(|| e.to_string());
            observe::handshake("owner", outcome);
            failures.failed("quic", remote, outcome, &reason);
            return;
        }
        Ok(Ok(conn)) => conn,
    };
    let identity =
        match peer_chain(&conn).and_then(|chain| tls.peer(&chain).map_err(|e| e.to_string())) {
            Ok(identity) => identity,
            Err(reason) => {
                observe::handshake("owner", "identity");
                failures.failed("quic", remote, "identity", &reason);
                conn.close(GREETING_FAILED, b"no mesh identity");
                return;
            }
        };
    let greeting = tokio::select! {
        () = shared.stop.cancelled() => return,
        stream = timeout(limits.connect_timeout, conn.accept_bi()) => stream,
    };
    let Ok(Ok((send, recv))) = greeting else {
        debug!(%remote, "mesh peer opened no greeting stream; closing");
        observe::handshake("owner", "greeting");
        conn.close(GREETING_FAILED, b"no greeting");
        return;
    };
    let mut reader = FrameReader::new(recv, limits.max_frame);
    let mut writer = FrameWriter::new(send, limits.max_frame);
    let greeted = server_greet(&shared, remote, &identity.uri, &mut reader, &mut writer).await;
    let Some((worker_id, protocol)) = greeted else {
        observe::handshake("owner", "greeting");
        let _ = writer.get_mut().finish();
        // Let the refusal reach the caller: it closes the connection when it has read
        // it. Closing first would discard the frames still in flight.
        let _ = timeout(limits.connect_timeout, conn.closed()).await;
        conn.close(GREETING_FAILED, b"greeting failed");
        return;
    };
    let _ = writer.get_mut().finish();
    drop((reader, writer));
    observe::handshake("owner", "ok");
    // Authenticated and greeted: no longer a handshake in progress.
    drop(permit);
    let _open = OpenConnection::new("owner", &identity);
    let close_at = ConnectionLife::owner_close_at(limits.max_connection_age, identity.not_after);
    let peer = PeerInfo {
        addr: remote,
        identity: identity.member,
        worker_id,
        transport: TransportKind::Quic,
        protocol,
        connection: shared.next_connection(),
    };
    debug!(%remote, peer = %peer.worker_id, identity = %peer.identity, "mesh QUIC peer connected");
    let allowance = Arc::new(StreamAllowance {
        open: AtomicU32::new(0),
        allowed: AtomicU32::new(INITIAL_STREAMS.min(stream_ceiling(limits))),
        ceiling: stream_ceiling(limits),
    });
    // Made once: each `cancelled()` future takes the token's lock when first polled.
    let stopped = shared.stop.cancelled();
    let too_old = tokio::time::sleep_until(close_at);
    tokio::pin!(stopped, too_old);
    loop {
        let stream = tokio::select! {
            () = &mut stopped => {
                conn.close(VarInt::from_u32(0), b"mesh server stopped");
                return;
            }
            () = &mut too_old => {
                // The caller should have moved on at the maximum age; one that did not,
                // or whose certificate just expired, is cut off here.
                warn!(%remote, peer = %peer.worker_id, identity = %peer.identity, "mesh QUIC connection closed: it outlived its maximum age or its peer's certificate");
                conn.close(CONNECTION_TOO_OLD, b"connection outlived its age or certificate");
                return;
            }
            stream = conn.accept_bi() => stream,
        };
        match stream {
            Ok((send, recv)) => {
                let held = allowance.opened(&conn);
                shared.exchanges.spawn(serve_stream(
                    send,
                    recv,
                    peer.clone(),
                    shared.clone(),
                    held,
                ));
            }
            Err(e) => {
                debug!(%remote, peer = %peer.worker_id, reason = %e, "mesh QUIC connection closed");
                return;
            }
        }
    }
}

/// How many streams one connection may open, raised as they are used.
struct StreamAllowance {
    /// Streams being served.
    open: AtomicU32,
    /// The limit last given to quinn.
    allowed: AtomicU32,
    /// What both budgets need; the limit never goes past it.
    ceiling: u32,
}

impl StreamAllowance {
    /// Counts a stream that opened, doubling the connection's limit once half of it is
    /// in use, so a caller finds credit before it needs it.
    fn opened(self: &Arc<Self>, conn: &Connection) -> OpenStream {
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        let allowed = self.allowed.load(Ordering::Relaxed);
        if open.saturating_mul(2) >= allowed && allowed < self.ceiling {
            let raised = allowed.saturating_mul(2).min(self.ceiling);
            if self
                .allowed
                .compare_exchange(allowed, raised, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                conn.set_max_concurrent_bi_streams(VarInt::from_u32(raised));
            }
        }
        OpenStream(self.clone())
    }
}

/// One open stream in a connection's allowance; counted down when dropped.
struct OpenStream(Arc<StreamAllowance>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves the one request a stream carries.
async fn serve_stream(
    send: SendStream,
    recv: RecvStream,
    peer: PeerInfo,
    shared: Arc<ServerShared>,
    _held: OpenStream,
) {
    let mut link = QuicLink {
        reader: FrameReader::new(recv, shared.limits.max_frame),
        writer: FrameWriter::new(send, shared.limits.max_frame),
    };
    // A large request may take a while to arrive; a stream that sends nothing at all
    // must not hold a stream slot forever.
    let wait = shared
        .limits
        .idle_timeout
        .max(shared.limits.connect_timeout);
    let first = tokio::select! {
        () = shared.stop.cancelled() => return,
        first = timeout(wait, link.reader.next()) => first,
    };
    let Ok(first) = first else {
        warn!(peer = %peer.worker_id, "mesh QUIC stream sent no request in time; reset");
        let _ = link.writer.get_mut().reset(ABORT_CODE);
        return;
    };
    match serve_next(&shared, &peer, first, &mut link).await {
        Some(ExchangeEnd::Clean) => {
            let _ = link.writer.get_mut().finish();
            if shared.draining.load(std::sync::atomic::Ordering::Relaxed) {
                // Shutdown closes the connection once every exchange task ended, which
                // would discard data still unacknowledged: wait for the caller's ack.
                let stopped = link.writer.get_mut().stopped();
                let _ = timeout(Duration::from_secs(1), stopped).await;
            }
        }
        Some(ExchangeEnd::Broken) | None => {
            let _ = link.writer.get_mut().reset(ABORT_CODE);
        }
    }
    // Whatever the caller still sends on this stream is not needed.
    let _ = link.reader.get_mut().stop(VarInt::from_u32(0));
}

/// One exchange's stream pair, owner side.
///
/// The caller finishes its side right after the request (its FIN travels with it), so
/// the end of the receive side means "nothing more to say", not "gone". A caller that
/// gives up resets its side and stops ours (`STOP_SENDING`), and either is noticed at
/// once, even while the response is quiet.
struct QuicLink {
    reader: FrameReader<RecvStream>,
    writer: FrameWriter<SendStream>,
}

impl ExchangeLink for QuicLink {
    fn queue(&mut self, frame: Frame) -> Result<(), mcpgw_wire::WireError> {
        self.writer.queue(&frame)
    }

    fn queued_len(&self) -> usize {
        self.writer.queued_len()
    }

    fn gather_limit(&self) -> usize {
        self.writer.max_frame()
    }

    fn max_chunk(&self) -> usize {
        self.writer
            .max_frame()
            .saturating_sub(Frame::CHUNK_OVERHEAD)
            .max(1)
    }

    async fn flush(&mut self, by: Instant) -> Result<(), SendError> {
        match tokio::time::timeout_at(by, self.writer.flush_queued()).await {
            Ok(result) => result,
            Err(_) => Err(timed_out()),
        }
    }

    async fn caller_event(&mut self) -> CallerEvent {
        let stopped = self.writer.get_mut().stopped();
        let read = async {
            match self.reader.next().await {
                Ok(Some(Frame::Cancel)) => CallerEvent::Cancelled,
                // The caller finished its side: it waits for the answer.
                Ok(None) => pending().await,
                Err(LinkError::Broken { .. }) => CallerEvent::Gone,
                Ok(Some(other)) => CallerEvent::Unexpected(other.name()),
                Err(e) => CallerEvent::Bad(e),
            }
        };
        tokio::select! {
            event = read => event,
            _ = stopped => CallerEvent::Gone,
        }
    }
}

/// The peer's certificate chain (already verified by the TLS layer).
fn peer_chain(conn: &Connection) -> Result<Vec<CertificateDer<'static>>, String> {
    conn.peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|chain| *chain)
        .ok_or_else(|| "no peer certificate".to_owned())
}

// ---------------------------------------------------------------- client side

/// The QUIC peer pool: one connection per peer address.
pub(crate) struct QuicClient {
    /// TLS material, read at every dial.
    tls: ClientTls,
    /// quinn transport limits, the same for every dial.
    transport: Arc<TransportConfig>,
    /// Identities registered for the workers we expect.
    identities: Arc<IdentityBook>,
    /// Announced in `Hello`.
    worker_id: String,
    /// Timeouts and frame size.
    limits: MeshLimits,
    /// Client endpoints by address family ([IPv4, IPv6]), bound on first use to an
    /// ephemeral port. Separate from the server endpoint so that draining the server
    /// never closes the connections this worker still forwards over.
    endpoints: Mutex<[Option<Endpoint>; 2]>,
    /// Connection slot per peer address, as the directory spells it.
    peers: Mutex<HashMap<String, Arc<PeerSlot>>>,
}

/// One peer's connection, made by one task at a time.
#[derive(Default)]
struct PeerSlot {
    /// The live connection, if any: read by every forward without waiting.
    live: Mutex<Option<PeerConn>>,
    /// Held while dialling. The last failed attempt: callers that were already
    /// waiting for it get its error instead of dialling again one after another.
    dialling: tokio::sync::Mutex<Option<(Instant, MeshError)>>,
}

impl PeerSlot {
    /// The live connection, unless it closed.
    fn current(&self) -> Option<PeerConn> {
        let mut live = self.live.lock();
        match &*live {
            // Old enough: new requests go to a new connection (with the material in use
            // now). Streams still open keep this one alive until they end.
            Some(pc) if pc.conn.close_reason().is_none() && !pc.life.retire_due() => {
                Some(pc.clone())
            }
            Some(_) => {
                *live = None;
                None
            }
            None => None,
        }
    }
}

#[derive(Clone)]
struct PeerConn {
    conn: Connection,
    /// The worker id this connection's `Welcome` named.
    worker_id: String,
    /// The mesh identity (URI) in the owner's certificate.
    identity: String,
    /// When it stops taking new streams, and when it closes.
    life: ConnectionLife,
    /// Held by the peer's slot and by every exchange on this connection: when the slot
    /// has let go of it (retired, forgotten) and its last exchange ends, it closes.
    in_use: Arc<InUse>,
}

/// Dropped with the last holder of a connection: tells the connection's task, whose
/// handle would otherwise keep it open until the peer's certificate expires, to close
/// it.
struct InUse(tokio_util::sync::CancellationToken);

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

impl QuicClient {
    pub(crate) fn new(
        tls: ClientTls,
        worker_id: String,
        limits: MeshLimits,
        identities: Arc<IdentityBook>,
    ) -> Result<Self, MeshError> {
        // Checked once here, so a config that cannot work fails at start, not at a dial.
        quic_client_crypto(tls.config())?;
        let mut transport = TransportConfig::default();
        transport
            .max_idle_timeout(Some(idle_timeout(&limits)?))
            // Keep-alives make silence mean "peer gone", not "nothing to say". A zero
            // idle timeout means "never time out" to QUIC, and needs none.
            .keep_alive_interval((!limits.idle_timeout.is_zero()).then(|| limits.idle_timeout / 3))
            // Owners never open streams towards callers.
            .max_concurrent_bidi_streams(VarInt::from_u32(0))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .ack_frequency_config(Some(sparse_acks()));
        Ok(Self {
            tls,
            transport: Arc::new(transport),
            identities,
            worker_id,
            limits,
            endpoints: Mutex::new([None, None]),
            peers: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn forget_peer(&self, peer_addr: &str) {
        self.peers.lock().remove(peer_addr);
    }

    fn slot(&self, peer_addr: &str) -> Arc<PeerSlot> {
        let mut peers = self.peers.lock();
        if let Some(slot) = peers.get(peer_addr) {
            return slot.clone();
        }
        peers.entry(peer_addr.to_owned()).or_default().clone()
    }

    fn endpoint_for(&self, addr: SocketAddr) -> Result<Endpoint, MeshError> {
        let mut endpoints = self.endpoints.lock();
        let (index, bind): (usize, SocketAddr) = if addr.is_ipv4() {
            (0, (Ipv4Addr::UNSPECIFIED, 0).into())
        } else {
            (1, (Ipv6Addr::UNSPECIFIED, 0).into())
        };
        if let Some(endpoint) = &endpoints[index] {
            return Ok(endpoint.clone());
        }
        let endpoint = endpoint_on(bind, None)?;
        endpoints[index] = Some(endpoint.clone());
        Ok(endpoint)
    }

    /// The peer's live connection, dialling it if needed.
    async fn connection(&self, peer_addr: &str, expect: &str) -> Result<PeerConn, MeshError> {
        let slot = self.slot(peer_addr);
        if let Some(pc) = slot.current() {
            return Ok(pc);
        }
        let asked = Instant::now();
        let mut last_failure = slot.dialling.lock().await;
        if let Some(pc) = slot.current() {
            return Ok(pc);
        }
        if let Some((at, err)) = &*last_failure
            && *at >= asked
        {
            return Err(err.clone());
        }
        match self.dial(peer_addr, expect).await {
            Ok(pc) => {
                *slot.live.lock() = Some(pc.clone());
                *last_failure = None;
                Ok(pc)
            }
            Err(e) => {
                *last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Forgets `pc` if it is still the peer's current connection.
    fn invalidate(&self, peer_addr: &str, pc: &PeerConn) {
        let slot = self.slot(peer_addr);
        let mut live = slot.live.lock();
        if live
            .as_ref()
            .is_some_and(|c| c.conn.stable_id() == pc.conn.stable_id())
        {
            *live = None;
        }
    }

    /// Connects and greets, racing the handshake against a probe that notices at once
    /// when nothing listens on the peer's UDP port (see the module docs of `transport`).
    async fn dial(&self, peer_addr: &str, expect: &str) -> Result<PeerConn, MeshError> {
        let addr = resolve(peer_addr, self.limits.connect_timeout).await?;
        let endpoint = self.endpoint_for(addr)?;
        let attempt = async {
            // The TLS material is taken per dial, so new material reaches the next
            // connection.
            let mut config = quinn::ClientConfig::new(quic_client_crypto(self.tls.config())?);
            config.transport_config(self.transport.clone());
            let connecting = endpoint
                .connect_with(config, addr, MESH_SERVER_NAME)
                .map_err(|e| MeshError::Connect {
                    addr: peer_addr.to_owned(),
                    reason: e.to_string(),
                })?;
            let conn = connecting
                .await
                .map_err(|e| connection_error(peer_addr, &e))?;
            let identity = peer_chain(&conn)
                .and_then(|chain| self.tls.peer(&chain).map_err(|e| e.to_string()))
                .map_err(|reason| MeshError::Tls {
                    addr: peer_addr.to_owned(),
                    reason,
                })?;
            match self.greet(&conn, peer_addr, expect).await {
                Ok(worker_id) => {
                    let life = ConnectionLife::starting_now(
                        self.limits.max_connection_age,
                        identity.not_after,
                    );
                    // A connection never outlives its peer's certificate, busy or not,
                    // nor its last user.
                    let expiring = conn.clone();
                    let open = OpenConnection::new("caller", &identity);
                    let unused = tokio_util::sync::CancellationToken::new();
                    let let_go = unused.clone();
                    tokio::spawn(async move {
                        let _open = open;
                        tokio::select! {
                            () = tokio::time::sleep_until(life.close_at) => {
                                expiring.close(CONNECTION_TOO_OLD, b"the peer's certificate expired");
                            }
                            () = let_go.cancelled() => {
                                expiring.close(RETIRED, b"retired");
                            }
                            _ = expiring.closed() => {}
                        }
                    });
                    Ok(PeerConn {
                        conn,
                        worker_id,
                        identity: identity.uri,
                        life,
                        in_use: Arc::new(InUse(unused)),
                    })
                }
                Err(e) => {
                    // A TLS 1.3 server rejects our certificate after our side of the
                    // handshake is done; the close reason says so.
                    let e = match (conn.close_reason(), &e) {
                        (Some(reason), MeshError::Connect { .. } | MeshError::Protocol(_)) => {
                            connection_error(peer_addr, &reason)
                        }
                        _ => e,
                    };
                    conn.close(GREETING_FAILED, b"greeting failed");
                    Err(e)
                }
            }
        };
        let dialled = tokio::select! {
            result = timeout(self.limits.connect_timeout, attempt) => {
                result.unwrap_or_else(|_| Err(MeshError::ConnectTimeout { addr: peer_addr.to_owned() }))
            }
            () = udp_port_refused(addr) => {
                debug!(%addr, "mesh QUIC peer port unreachable (ICMP): nothing listens there");
                Err(MeshError::Refused { addr: peer_addr.to_owned() })
            }
        };
        observe::handshake(
            "caller",
            dialled
                .as_ref()
                .map_or_else(observe::dial_failure, |_| "ok"),
        );
        dialled
    }

    async fn greet(
        &self,
        conn: &Connection,
        peer_addr: &str,
        expect: &str,
    ) -> Result<String, MeshError> {
        let (send, recv) = conn
            .open_bi()
            .await
            .map_err(|e| connection_error(peer_addr, &e))?;
        let mut writer = FrameWriter::new(send, self.limits.max_frame);
        let mut reader = FrameReader::new(recv, self.limits.max_frame);
        let (worker_id, _protocol) = client_greet(
            peer_addr,
            &self.worker_id,
            expect,
            self.limits.max_protocol_version,
            &mut reader,
            &mut writer,
        )
        .await?;
        let _ = writer.get_mut().finish();
        Ok(worker_id)
    }

    /// Opens a stream to the peer and writes the encoded request on it.
    pub(crate) async fn send_request(
        &self,
        peer_addr: &str,
        expect: &str,
        request: &[u8],
    ) -> Result<QuicExchange, MeshError> {
        let mut retried = false;
        loop {
            let pc = self.connection(peer_addr, expect).await?;
            let answer =
                self.identities
                    .check_answer(peer_addr, expect, &pc.worker_id, &pc.identity);
            if answer.is_err() && !retried {
                // A pooled connection to a worker that lived at this address before
                // (killed hosts close nothing) proves nothing about the one there now:
                // only a fresh handshake does.
                self.invalidate(peer_addr, &pc);
                retried = true;
                continue;
            }
            answer.inspect_err(observe::answer_refused)?;
            // The owner raises its stream limit before it runs out, up to both budgets:
            // a lack of credit is at most a moment's wait for that raise, or an owner
            // whose budgets are smaller than ours, which is Busy, not a hang.
            let (send, recv) = match timeout(CREDIT_WAIT, pc.conn.open_bi()).await {
                Err(_) => {
                    return Err(MeshError::Remote(ErrorFrame::new(
                        ErrorKind::Busy,
                        format!(
                            "mesh peer {peer_addr} grants this worker no more QUIC streams \
                             right now (its budgets are smaller than ours): retry shortly"
                        ),
                    )));
                }
                Ok(Err(e)) => {
                    // The connection died before the request left: safe to redial once.
                    self.invalidate(peer_addr, &pc);
                    if !retried {
                        retried = true;
                        continue;
                    }
                    return Err(connection_error(peer_addr, &e));
                }
                Ok(Ok(pair)) => pair,
            };
            let mut exchange = QuicExchange {
                writer: FrameWriter::new(send, self.limits.max_frame),
                reader: FrameReader::new(recv, self.limits.max_frame),
                state: ExState::Open,
                released: false,
                _in_use: pc.in_use.clone(),
            };
            match exchange.writer.send_encoded(request).await {
                Ok(()) => {
                    // Nothing more goes this way (a cancel is a reset): the FIN leaves
                    // with the request instead of in a packet of its own later.
                    let _ = exchange.writer.get_mut().finish();
                    return Ok(exchange);
                }
                // The owner stopped reading: it refused the request (too large,
                // malformed) and its answer is on the receive side.
                Err(SendError::Io(e)) if is_stopped(&e) => return Ok(exchange),
                Err(e) => {
                    // Not all of the request left, so the owner cannot have run it.
                    exchange.state = ExState::Broken;
                    self.invalidate(peer_addr, &pc);
                    if !retried {
                        retried = true;
                        continue;
                    }
                    return Err(MeshError::Connect {
                        addr: peer_addr.to_owned(),
                        reason: format!("connection lost while sending the request: {e}"),
                    });
                }
            }
        }
    }
}

fn is_stopped(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<quinn::WriteError>())
        .is_some_and(|w| matches!(w, quinn::WriteError::Stopped(_)))
}

/// Sorts a QUIC connection error into the mesh's categories.
fn connection_error(peer_addr: &str, e: &quinn::ConnectionError) -> MeshError {
    let addr = peer_addr.to_owned();
    if let Some(reason) = quic_tls_cause(e) {
        return MeshError::Tls { addr, reason };
    }
    match e {
        quinn::ConnectionError::TimedOut => MeshError::ConnectTimeout { addr },
        // The endpoint at that address exists but serves no connections: it was closed
        // by a worker that stopped (the mesh server refuses only when stopping).
        quinn::ConnectionError::ConnectionClosed(close)
            if close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED =>
        {
            MeshError::Refused { addr }
        }
        other => MeshError::Connect {
            addr,
            reason: other.to_string(),
        },
    }
}

/// Resolves only if the kernel reports that nothing listens on `addr`'s UDP port;
/// otherwise never resolves.
///
/// quinn's socket is unconnected, and Linux reports ICMP errors on UDP only to
/// connected sockets, so quinn never learns of them. This probe sends one-byte
/// datagrams (too short to be QUIC; a live endpoint drops them) from a connected
/// socket, whose `recv` then fails with `ECONNREFUSED` if the host answered "port
/// unreachable". Resends cover a lost datagram or ICMP rate limiting.
async fn udp_port_refused(addr: SocketAddr) {
    let bind: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let Ok(socket) = UdpSocket::bind(bind).await else {
        return pending().await;
    };
    if socket.connect(addr).await.is_err() {
        return pending().await;
    }
    let refused = |e: &std::io::Error| e.kind() == std::io::ErrorKind::ConnectionRefused;
    let mut wait = Duration::from_millis(25);
    let mut buf = [0u8; 64];
    loop {
        match socket.send(&[0]).await {
            Err(e) if refused(&e) => return,
            Err(_) => return pending().await,
            Ok(_) => {}
        }
        match timeout(wait, socket.recv(&mut buf)).await {
            Ok(Err(e)) if refused(&e) => return,
            Ok(Err(_)) => return pending().await,
            // Silence (or a stray datagram): the port may well be live.
            _ => {}
        }
        wait = (wait * 2).min(Duration::from_millis(400));
    }
}

/// One request's stream pair, caller side.
pub(crate) struct QuicExchange {
    writer: FrameWriter<SendStream>,
    reader: FrameReader<RecvStream>,
    pub(crate) state: ExState,
    /// Set once the streams were finished or cancelled.
    released: bool,
    /// Keeps the connection open while this exchange lives (declared last: dropped
    /// after the streams are released).
    _in_use: Arc<InUse>,
}

impl QuicExchange {
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        self.reader.next().await
    }

    /// Finishes the streams as `state` says: a clean end just finishes our side; an
    /// open or broken exchange resets and stops both, which cancels at the owner.
    pub(crate) fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        match self.state {
            // Our side was finished with the request.
            ExState::Clean => {}
            // The reset reaches the owner if our side is still in flight; the stop
            // always does, and tells it to stop answering.
            ExState::Open | ExState::Broken => {
                let _ = self.writer.get_mut().reset(CANCEL_CODE);
                let _ = self.reader.get_mut().stop(CANCEL_CODE);
            }
        }
    }
}

impl Drop for QuicExchange {
    fn drop(&mut self) {
        self.release();
    }
}
