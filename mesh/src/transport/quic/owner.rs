//! The owner's end of QUIC: the endpoint's accept loop, each connection's
//! authentication and greeting, and serving the one exchange each later stream
//! carries, raising the connection's stream limit as streams are used.

use std::future::pending;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use mcpgw_certs::PeerIdentity;
use mcpgw_wire::Frame;
use quinn::crypto::rustls::QuicServerConfig;
use quinn::{Connection, Endpoint, RecvStream, SendStream, TransportConfig, VarInt};
use tokio::time::{Instant, timeout};
use tracing::{debug, warn};

use super::{
    CONNECTION_TOO_OLD, GREETING_FAILED, endpoint_on, idle_timeout, peer_chain, sparse_acks,
};
use crate::transport::config::MeshLimits;
use crate::transport::error::{LinkError, MeshError, quic_tls_cause};
use crate::transport::framed::{FrameReader, FrameWriter, SendError};
use crate::transport::guard::HandshakePermit;
use crate::transport::observe::Link;
use crate::transport::service::PeerInfo;
use crate::transport::serving::{
    CallerEvent, ExchangeEnd, ExchangeLink, FrameQueue, ServerShared, admit_connection, greet,
    serve_next, timed_out,
};
use crate::transport::tls::ServerTls;

/// Application error code on a stream the owner abandons (write failed, stopping).
const ABORT_CODE: VarInt = VarInt::from_u32(2);

/// The most concurrent streams a server allows one peer: quinn keeps a table entry for
/// every stream it allows, so absurd budgets must not turn into gigabytes.
const MAX_STREAMS: u32 = 1 << 20;

/// Streams a new connection may open at first. quinn makes a table entry for every
/// stream it allows when the connection starts (tens of thousands cost a noticeable
/// part of a handshake), so the limit starts here and doubles whenever half of it is
/// in use, up to what both budgets need.
const INITIAL_STREAMS: u32 = 1024;

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
                shared.observer.handshake("owner", "over_cap");
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

/// One accepted connection: its handshake, its greeting, then the exchanges its later
/// streams carry, until it closes or the server stops.
async fn connection(
    incoming: quinn::Incoming,
    tls: ServerTls,
    shared: Arc<ServerShared>,
    permit: HandshakePermit,
) {
    let remote = incoming.remote_address();
    let Some((conn, identity)) = authenticate(incoming, &tls, &shared).await else {
        return;
    };
    let Some(greeted) = greet_on_first_stream(&conn, &shared, remote, &identity.uri).await else {
        return;
    };
    let admitted = admit_connection(&shared, remote, identity, greeted, permit, Link::Tls);
    serve_streams(&conn, &shared, &admitted.peer, admitted.close_at).await;
}

/// Finishes the QUIC handshake within the connect timeout and reads the mesh identity
/// the caller's certificate proves; `None` (counted and logged as a failed handshake)
/// when either fails.
async fn authenticate(
    incoming: quinn::Incoming,
    tls: &ServerTls,
    shared: &ServerShared,
) -> Option<(Connection, PeerIdentity)> {
    let remote = incoming.remote_address();
    let failures = &shared.handshake_failures;
    let conn = match timeout(shared.limits.connect_timeout, incoming).await {
        Err(_) => {
            shared.observer.handshake("owner", "timeout");
            failures.failed(
                "quic",
                remote,
                "timeout",
                "QUIC handshake not finished within the connect timeout",
            );
            return None;
        }
        Ok(Err(e)) => {
            let cause = quic_tls_cause(&e);
            let outcome = if cause.is_some() { "tls" } else { "io" };
            let reason = cause.unwrap_or_else(|| e.to_string());
            shared.observer.handshake("owner", outcome);
            failures.failed("quic", remote, outcome, &reason);
            return None;
        }
        Ok(Ok(conn)) => conn,
    };
    match peer_chain(&conn).and_then(|chain| tls.peer(&chain).map_err(|e| e.to_string())) {
        Ok(identity) => Some((conn, identity)),
        Err(reason) => {
            shared.observer.handshake("owner", "identity");
            failures.failed("quic", remote, "identity", &reason);
            conn.close(GREETING_FAILED, b"no mesh identity");
            None
        }
    }
}

/// Greets the caller on the first stream it opens. `None` when the greeting failed:
/// the connection is closed by then, after the caller read the refusal.
async fn greet_on_first_stream(
    conn: &Connection,
    shared: &ServerShared,
    remote: SocketAddr,
    presented: &str,
) -> Option<(String, u32)> {
    let limits = &shared.limits;
    let greeting = tokio::select! {
        () = shared.stop.cancelled() => return None,
        stream = timeout(limits.connect_timeout, conn.accept_bi()) => stream,
    };
    let Ok(Ok((send, recv))) = greeting else {
        debug!(%remote, "mesh peer opened no greeting stream; closing");
        shared.observer.handshake("owner", "greeting");
        conn.close(GREETING_FAILED, b"no greeting");
        return None;
    };
    let mut reader = FrameReader::new(recv, limits.max_frame);
    let mut writer = FrameWriter::new(send, limits.max_frame);
    let greeted = greet(shared, remote, Some(presented), &mut reader, &mut writer).await;
    let _ = writer.get_mut().finish();
    if greeted.is_none() {
        shared.observer.handshake("owner", "greeting");
        // Let the refusal reach the caller: it closes the connection when it has read
        // it. Closing first would discard the frames still in flight.
        let _ = timeout(limits.connect_timeout, conn.closed()).await;
        conn.close(GREETING_FAILED, b"greeting failed");
    }
    greeted
}

/// Serves each stream the greeted connection opens as one exchange, until the
/// connection closes, outlives `close_at`, or the server stops.
async fn serve_streams(
    conn: &Connection,
    shared: &Arc<ServerShared>,
    peer: &PeerInfo,
    close_at: Instant,
) {
    let remote = peer.addr;
    let allowance = Arc::new(StreamAllowance {
        open: AtomicU32::new(0),
        allowed: AtomicU32::new(INITIAL_STREAMS.min(stream_ceiling(&shared.limits))),
        ceiling: stream_ceiling(&shared.limits),
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
                let held = allowance.opened(conn);
                // Boxed before it is spawned, as the TCP owner's exchange is: the
                // stream's future is moved whole through the tracker into the task's
                // cell and once more as it finishes; a box is copied once.
                shared.exchanges.spawn(Box::pin(serve_stream(
                    send,
                    recv,
                    peer.clone(),
                    shared.clone(),
                    held,
                )));
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

impl FrameQueue for QuicLink {
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
        Frame::max_chunk(self.writer.max_frame())
    }
}

impl ExchangeLink for QuicLink {
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
