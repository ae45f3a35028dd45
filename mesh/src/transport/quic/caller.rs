//! The caller's end of QUIC: the peer pool (one connection per peer address, dialled
//! by one task at a time and replaced make-before-break at its maximum age), the probe
//! that notices a closed UDP port at once, and one request's stream pair.

use std::collections::HashMap;
use std::future::pending;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use mcpgw_certs::{MESH_SERVER_NAME, PeerIdentity};
use mcpgw_wire::{ErrorFrame, ErrorKind, Frame};
use parking_lot::Mutex;
use quinn::crypto::rustls::QuicClientConfig;
use quinn::{Connection, Endpoint, RecvStream, SendStream, TransportConfig, VarInt};
use tokio::net::UdpSocket;
use tokio::time::{Instant, timeout};
use tracing::debug;

use super::{
    CONNECTION_TOO_OLD, GREETING_FAILED, endpoint_on, idle_timeout, peer_chain, sparse_acks,
};
use crate::transport::calling::{ExState, greet, resolve};
use crate::transport::config::MeshLimits;
use crate::transport::error::{LinkError, MeshError, quic_tls_cause};
use crate::transport::framed::{FrameReader, FrameWriter, SendError};
use crate::transport::observe::{self, Link, Observer};
use crate::transport::tls::{ClientTls, ConnectionLife, IdentityBook, renewal_lead};

/// Application error code on a stream the caller abandons (reset and stop).
const CANCEL_CODE: VarInt = VarInt::from_u32(1);

/// Application error code closing a retired connection once nothing uses it.
const RETIRED: VarInt = VarInt::from_u32(0);

/// rustls client config, as quinn takes it.
fn quic_client_crypto(tls: Arc<rustls::ClientConfig>) -> Result<Arc<QuicClientConfig>, MeshError> {
    QuicClientConfig::try_from(tls)
        .map(Arc::new)
        .map_err(|e| MeshError::Config(format!("client TLS config cannot be used for QUIC: {e}")))
}

/// How long a caller waits for stream credit the owner is about to raise before it
/// calls the owner busy.
const CREDIT_WAIT: Duration = Duration::from_secs(1);

/// How long a replacement dial that failed waits before it tries again.
const RENEW_RETRY: Duration = Duration::from_millis(50);

/// The QUIC peer pool: one connection per peer address.
pub(crate) struct QuicClient {
    /// Shared with the tasks that dial replacements in the background.
    pool: Arc<QuicPool>,
}

/// What dials, greets and pools QUIC connections.
struct QuicPool {
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
    /// Told of every dial and of every connection's open and close.
    observer: Observer,
}

/// One peer's connection, made by one task at a time.
#[derive(Default)]
struct PeerSlot {
    /// The live connection, if any: read by every forward without waiting.
    live: Mutex<Option<PeerConn>>,
    /// Set while a task dials the live connection's replacement.
    renewing: std::sync::atomic::AtomicBool,
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

    /// Makes `new` the live connection if `old` still is (or none is): a connection
    /// dialled meanwhile by a request that found none stays.
    fn replace(&self, old: &PeerConn, new: PeerConn) {
        let mut live = self.live.lock();
        let still_old = live
            .as_ref()
            .is_none_or(|pc| pc.conn.stable_id() == old.conn.stable_id());
        if still_old {
            *live = Some(new);
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
        observer: Observer,
    ) -> Result<Self, MeshError> {
        let pool = QuicPool::new(tls, worker_id, limits, identities, observer)?;
        Ok(QuicClient {
            pool: Arc::new(pool),
        })
    }

    pub(crate) fn forget_peer(&self, peer_addr: &str) {
        self.pool.peers.lock().remove(peer_addr);
    }

    /// Opens a stream to the peer and writes the encoded request on it.
    pub(crate) async fn send_request(
        &self,
        peer_addr: &str,
        expect: &str,
        request: &[u8],
    ) -> Result<QuicExchange, MeshError> {
        self.pool.send_request(peer_addr, expect, request).await
    }
}

impl QuicPool {
    fn new(
        tls: ClientTls,
        worker_id: String,
        limits: MeshLimits,
        identities: Arc<IdentityBook>,
        observer: Observer,
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
            observer,
        })
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

    /// The peer's live connection, dialling it if needed; its replacement is dialled in
    /// the background once it is old enough ([`ConnectionLife`]).
    async fn connection(
        self: &Arc<Self>,
        peer_addr: &str,
        expect: &str,
    ) -> Result<PeerConn, MeshError> {
        let slot = self.slot(peer_addr);
        if let Some(pc) = slot.current() {
            if pc.life.renew_due() {
                self.renew(&slot, &pc, peer_addr, expect);
            }
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

    /// Dials the replacement of `old`, the slot's live connection, in the background,
    /// once at a time, while `old` takes the requests: again after a failure until
    /// `old` retires (then requests dial in the foreground, as without a replacement).
    /// A failure that proves the peer gone (nothing listens there now) retires `old` at
    /// once: the death it proves must not turn into requests sent on a connection QUIC
    /// has not yet noticed is dead; the next request dials and hears the proof itself.
    /// The replacement's failures are not the slot's last failure: no request waited
    /// for it.
    fn renew(
        self: &Arc<Self>,
        slot: &Arc<PeerSlot>,
        old: &PeerConn,
        peer_addr: &str,
        expect: &str,
    ) {
        use std::sync::atomic::Ordering;
        if slot.renewing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (pool, slot, old) = (self.clone(), slot.clone(), old.clone());
        let (addr, expect) = (peer_addr.to_owned(), expect.to_owned());
        tokio::spawn(async move {
            while !old.life.retire_due() && old.conn.close_reason().is_none() {
                match pool.dial(&addr, &expect).await {
                    Ok(new) => {
                        slot.replace(&old, new);
                        break;
                    }
                    Err(e) if e.proves_peer_gone() => {
                        debug!(peer = %addr, error = %e, "the replacement of a mesh connection proves its peer gone");
                        pool.invalidate(&addr, &old);
                        break;
                    }
                    Err(e) => {
                        debug!(peer = %addr, error = %e, "dialling the replacement of a mesh connection failed; the old one serves meanwhile");
                        tokio::time::sleep(RENEW_RETRY).await;
                    }
                }
            }
            slot.renewing.store(false, Ordering::Release);
        });
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
                Ok(worker_id) => Ok(self.admitted(conn, worker_id, identity)),
                Err(e) => {
                    let e = greeting_error(&conn, peer_addr, e);
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
        self.observer.handshake(
            "caller",
            dialled
                .as_ref()
                .map_or_else(observe::dial_failure, |_| "ok"),
        );
        dialled
    }

    /// A greeted connection, pooled from now on. A connection never outlives its
    /// peer's certificate, busy or not, nor its last user: a task closes it then.
    fn admitted(&self, conn: Connection, worker_id: String, identity: PeerIdentity) -> PeerConn {
        let (max_age, connect) = (self.limits.max_connection_age, self.limits.connect_timeout);
        let life = ConnectionLife::starting_now(
            max_age,
            identity.not_after,
            renewal_lead(max_age, connect),
        );
        let expiring = conn.clone();
        let open = self.observer.open("caller", &identity, Link::Tls);
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
        PeerConn {
            conn,
            worker_id,
            identity: identity.uri,
            life,
            in_use: Arc::new(InUse(unused)),
        }
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
        let (worker_id, _protocol) = greet(
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
    async fn send_request(
        self: &Arc<Self>,
        peer_addr: &str,
        expect: &str,
        request: &[u8],
    ) -> Result<QuicExchange, MeshError> {
        let mut retried = false;
        loop {
            let pc = self.connection(peer_addr, expect).await?;
            let answer =
                self.identities
                    .check_answer(peer_addr, expect, &pc.worker_id, Some(&pc.identity));
            if answer.is_err() && !retried {
                // A pooled connection to a worker that lived at this address before
                // (killed hosts close nothing) proves nothing about the one there now:
                // only a fresh handshake does.
                self.invalidate(peer_addr, &pc);
                retried = true;
                continue;
            }
            answer.inspect_err(|e| self.observer.answer_refused(e))?;
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

/// Why a greeting failed, for the caller. A TLS 1.3 server rejects our certificate
/// after our side of the handshake is done; the connection's close reason says so.
fn greeting_error(conn: &Connection, peer_addr: &str, e: MeshError) -> MeshError {
    match (conn.close_reason(), &e) {
        (Some(reason), MeshError::Connect { .. } | MeshError::Protocol(_)) => {
            connection_error(peer_addr, &reason)
        }
        _ => e,
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
