//! TCP transport (tokio-rustls): a few persistent TLS connections per peer, each
//! carrying many exchanges at once.
//!
//! Each connection starts with `Hello` → `Welcome` in plain mesh framing; after that
//! every frame names its exchange (`mcpgw_wire::MuxCodec`). One task per connection
//! end reads and routes frames; one writes, sending everything that gathered while it
//! was busy (frames of different exchanges) in one write.
//!
//! Backpressure is per exchange, as in HTTP/2: the owner sends body bytes only against
//! credit, a window ([`MeshLimits::stream_window`]) the caller tops up with
//! `Credit` frames as it reads. So one caller that stops reading a stream holds at
//! most one window of memory and never stalls the other exchanges of its connection.
//! A caller that gives up sends `Cancel` for that exchange only; the connection
//! serves on.
//!
//! - `mux`: the outbox and writer task, and the frame reader, shared by both ends;
//! - `owner`: serving a connection's exchanges;
//! - `caller`: routing a connection's frames to the exchanges waiting for them;
//! - `same_host`: the same engine over a Unix socket, without TLS, between workers of
//!   one user on one kernel (opt-in).
//!
//! The rustls configs are applied in one place each: the server's acceptor per
//! accepted connection ([`serve`]), the client's connector per dial
//! ([`TcpClient::dial`]).

mod caller;
mod mux;
mod owner;
mod same_host;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use mcpgw_certs::{MESH_SERVER_NAME, PeerIdentity};
use mcpgw_wire::Frame;
use parking_lot::Mutex;
use rustls::pki_types::ServerName;
use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, timeout};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, warn};

pub(crate) use caller::TcpExchange;
pub(crate) use same_host::{SameHostBook, SameHostSocket, serve as serve_same_host};
pub use same_host::{SameHostRoute, kernel_boot_id, prepare_socket_path};

use self::caller::{CallerConn, read_loop};
use self::mux::{MuxReader, Outbox, write_loop};
use super::calling::{greet as client_greet, resolve};
use super::config::MeshLimits;
use super::error::{LinkError, MeshError, tls_cause};
use super::framed::{FrameReader, FrameWriter};
use super::guard::HandshakePermit;
use super::observe::{self, Link, Observer};
use super::serving::{AdmittedConnection, ServerShared, admit_connection, greet as server_greet};
use super::tls::{ClientTls, ConnectionLife, IdentityBook, ServerTls, renewal_lead};

/// Sets the socket options every mesh TCP connection wants, on both ends.
fn tune(stream: &TcpStream, limits: &MeshLimits) {
    // A chunk is one small write that must leave now, not when Nagle decides.
    if let Err(e) = stream.set_nodelay(true) {
        debug!(error = %e, "cannot set TCP_NODELAY on a mesh connection");
    }
    // Keepalive finds a peer host that vanished without a FIN or RST.
    let idle = limits.idle_timeout.max(Duration::from_secs(1));
    let keepalive = TcpKeepalive::new()
        .with_time(idle)
        .with_interval((idle / 3).max(Duration::from_secs(1)));
    if let Err(e) = SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        debug!(error = %e, "cannot enable TCP keepalive on a mesh connection");
    }
}

// ---------------------------------------------------------------- server side

/// Binds the TCP listener and spawns its accept loop.
pub(crate) async fn serve(
    listen: SocketAddr,
    tls: ServerTls,
    shared: Arc<ServerShared>,
) -> Result<SocketAddr, MeshError> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    shared
        .tracker
        .spawn(accept_loop(listener, tls, shared.clone()));
    Ok(addr)
}

async fn accept_loop(listener: TcpListener, tls: ServerTls, shared: Arc<ServerShared>) {
    loop {
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, remote)) => {
                let permit = match shared.handshakes.enter(remote.ip()) {
                    Ok(permit) => permit,
                    Err(full) => {
                        // Closed before any TLS work: the descriptor is free again now.
                        drop(stream);
                        shared.observer.handshake("owner", "over_cap");
                        shared.handshake_failures.failed(
                            "tcp",
                            remote,
                            "over_cap",
                            &format!("connection closed: {}", full.reason()),
                        );
                        continue;
                    }
                };
                // The server's TLS config is taken per accepted connection, so new
                // material reaches the next handshake.
                shared.tracker.spawn(connection(
                    stream,
                    remote,
                    tls.clone(),
                    shared.clone(),
                    permit,
                ));
            }
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                warn!(error = %e, "mesh TCP accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn connection(
    stream: TcpStream,
    remote: SocketAddr,
    material: ServerTls,
    shared: Arc<ServerShared>,
    permit: HandshakePermit,
) {
    let limits = &shared.limits;
    let failures = &shared.handshake_failures;
    tune(&stream, limits);
    let acceptor = TlsAcceptor::from(material.config());
    let tls = match timeout(limits.connect_timeout, acceptor.accept(stream)).await {
        Err(_) => {
            shared.observer.handshake("owner", "timeout");
            failures.failed(
                "tcp",
                remote,
                "timeout",
                "TLS handshake not finished within the connect timeout",
            );
            return;
        }
        Ok(Err(e)) => {
            let reason = tls_cause(&e).unwrap_or_else(|| e.to_string());
            shared.observer.handshake("owner", "tls");
            failures.failed("tcp", remote, "tls", &reason);
            return;
        }
        Ok(Ok(tls)) => tls,
    };
    let identity = match tls
        .get_ref()
        .1
        .peer_certificates()
        .map(|chain| material.peer(chain))
    {
        Some(Ok(identity)) => identity,
        Some(Err(e)) => {
            shared.observer.handshake("owner", "identity");
            failures.failed("tcp", remote, "identity", &format!("no mesh identity: {e}"));
            return;
        }
        None => {
            shared.observer.handshake("owner", "identity");
            failures.failed("tcp", remote, "identity", "no client certificate");
            return;
        }
    };
    let (read, write) = tokio::io::split(tls);
    let mut reader = FrameReader::new(read, limits.max_frame);
    let mut writer = FrameWriter::new(write, limits.max_frame);
    let presented = Some(identity.uri.as_str());
    let greeted = server_greet(&shared, remote, presented, &mut reader, &mut writer).await;
    let Some(greeted) = greeted else {
        shared.observer.handshake("owner", "greeting");
        let _ = writer.get_mut().shutdown().await;
        return;
    };
    serve_greeted(
        shared,
        remote,
        identity,
        greeted,
        permit,
        Link::Tls,
        reader,
        writer,
    )
    .await;
}

/// The end every greeted owner connection shares, over TLS or the same-host socket:
/// admitted under `identity`, then its exchanges served on the multiplexer.
#[allow(clippy::too_many_arguments)]
async fn serve_greeted<R, W>(
    shared: Arc<ServerShared>,
    remote: SocketAddr,
    identity: PeerIdentity,
    greeted: (String, u32),
    permit: HandshakePermit,
    link: Link,
    reader: FrameReader<R>,
    writer: FrameWriter<W>,
) where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let AdmittedConnection {
        peer,
        close_at,
        open: _open,
    } = admit_connection(&shared, remote, identity, greeted, permit, link);
    let (read, leftover) = reader.into_parts();
    let reader = MuxReader::new(read, leftover, shared.limits.max_frame);
    owner::serve_connection(shared.clone(), peer, reader, writer.into_inner(), close_at).await;
}

// ---------------------------------------------------------------- client side

/// What it takes to open a connection to a peer; shared with background dials.
struct Dialer {
    /// TLS client material (our leaf, mesh CA, ALPN), read at every dial.
    tls: ClientTls,
    /// Identities registered for the workers we expect.
    identities: Arc<IdentityBook>,
    /// Announced in `Hello`.
    worker_id: String,
    /// Timeouts, frame size, window.
    limits: MeshLimits,
    /// Cancelled when the client is dropped: its connections' tasks end.
    stop: CancellationToken,
    /// Told of every dial and of every connection's open and close.
    observer: Observer,
    /// Same-host routes of the workers on our kernel, tried before TCP when on.
    same_host: Arc<SameHostBook>,
}

/// How long a replacement dial that failed waits before it tries again.
const RENEW_RETRY: Duration = Duration::from_millis(50);

/// Replaces `peer`'s connections that are old enough, one for one and oldest first,
/// each while it still takes requests (make-before-break, [`ConnectionLife`]): a dial
/// that fails is tried again until the connection retires (then requests dial in the
/// foreground, as without a replacement). A failure that proves the peer gone retires
/// them at once, so requests dial and hear the proof themselves. Its failures are not
/// the peer's last failure: no request waited for them.
async fn renew_connections(dialer: Arc<Dialer>, peer: Arc<TcpPeer>, addr: String, expect: String) {
    while let Some(old) = peer.oldest_due() {
        match dialer.dial(&addr, &expect).await {
            Ok(new) => {
                peer.conns.lock().push(new);
                old.retire();
            }
            Err(e) if e.proves_peer_gone() => {
                debug!(peer = %addr, error = %e, "the replacement of a mesh connection proves its peer gone");
                while let Some(due) = peer.oldest_due() {
                    due.retire();
                }
                break;
            }
            Err(e) => {
                debug!(peer = %addr, error = %e, "dialling the replacement of a mesh connection failed; the old one serves meanwhile");
                tokio::time::sleep(RENEW_RETRY).await;
            }
        }
    }
    peer.renewing.store(false, Ordering::Release);
}

/// The TCP peer pool: up to [`MeshLimits::tcp_pool_size`] multiplexed connections
/// per peer address.
pub(crate) struct TcpClient {
    dialer: Arc<Dialer>,
    /// Pool per peer address, as the directory spells it.
    peers: Mutex<rustc_hash::FxHashMap<String, Arc<TcpPeer>>>,
    /// Ends every connection's tasks when the client goes.
    _stop: DropGuard,
}

/// One peer's connections.
#[derive(Default)]
struct TcpPeer {
    /// Live connections (a dead one is dropped when next seen).
    conns: Mutex<Vec<Arc<CallerConn>>>,
    /// One dial at a time per peer.
    dialing: tokio::sync::Mutex<()>,
    /// Set while a background dial adds a connection.
    growing: AtomicBool,
    /// Set while a background dial replaces connections old enough to be replaced.
    renewing: AtomicBool,
    /// The last failed dial: requests that were already waiting for it when it failed
    /// get its error instead of each waiting out the connect timeout again.
    last_failure: Mutex<Option<(Instant, MeshError)>>,
}

impl TcpPeer {
    /// The least loaded usable connection, and whether the pool should grow (every
    /// connection is busy and there is room for another) or renew (a connection is old
    /// enough for its replacement to be dialled: [`ConnectionLife`]).
    fn pick(&self, pool_size: usize) -> (Option<Arc<CallerConn>>, bool, bool) {
        let mut conns = self.conns.lock();
        conns.retain(|c| {
            if c.usable() && c.life.retire_due() {
                // Old enough: new requests go to a new connection (with the material in
                // use now); this one closes when its exchanges end.
                c.retire();
            }
            c.usable()
        });
        let best = conns.iter().min_by_key(|c| c.load()).cloned();
        let grow = conns.len() < pool_size && best.as_ref().is_some_and(|c| c.load() > 0);
        let renew = conns.iter().any(|c| c.life.renew_due());
        (best, grow, renew)
    }

    /// The oldest usable connection due for replacement, if any.
    fn oldest_due(&self) -> Option<Arc<CallerConn>> {
        let conns = self.conns.lock();
        conns
            .iter()
            .filter(|c| c.usable() && c.life.renew_due() && !c.life.retire_due())
            .min_by_key(|c| c.life.renew_at)
            .cloned()
    }

    fn failed_since(&self, asked: Instant) -> Option<MeshError> {
        self.last_failure
            .lock()
            .as_ref()
            .filter(|(at, _)| *at >= asked)
            .map(|(_, e)| e.clone())
    }

    fn record_dial(&self, outcome: Result<&Arc<CallerConn>, &MeshError>) {
        match outcome {
            Ok(conn) => {
                *self.last_failure.lock() = None;
                self.conns.lock().push(conn.clone());
            }
            Err(e) => *self.last_failure.lock() = Some((Instant::now(), e.clone())),
        }
    }
}

impl TcpClient {
    pub(crate) fn new(
        tls: ClientTls,
        worker_id: String,
        limits: MeshLimits,
        identities: Arc<IdentityBook>,
        observer: Observer,
    ) -> Self {
        let stop = CancellationToken::new();
        Self {
            dialer: Arc::new(Dialer {
                tls,
                identities,
                worker_id,
                limits,
                stop: stop.clone(),
                observer,
                same_host: Arc::default(),
            }),
            peers: Mutex::default(),
            _stop: stop.drop_guard(),
        }
    }

    /// The same-host routes this client may use.
    pub(crate) fn same_host(&self) -> &SameHostBook {
        &self.dialer.same_host
    }

    /// Lets go of the peer's connections: they close once their exchanges end.
    pub(crate) fn forget_peer(&self, peer_addr: &str) {
        let Some(peer) = self.peers.lock().remove(peer_addr) else {
            return;
        };
        for conn in peer.conns.lock().drain(..) {
            conn.retire();
        }
    }

    fn peer(&self, peer_addr: &str) -> Arc<TcpPeer> {
        if let Some(peer) = self.peers.lock().get(peer_addr) {
            return peer.clone();
        }
        self.peers
            .lock()
            .entry(peer_addr.to_owned())
            .or_default()
            .clone()
    }

    /// A usable connection to the peer: the least loaded one, dialling the first (and,
    /// in the background, more while all are busy, up to the pool size).
    async fn connection(
        &self,
        peer: &Arc<TcpPeer>,
        peer_addr: &str,
        expect: &str,
    ) -> Result<Arc<CallerConn>, MeshError> {
        let pool_size = self.dialer.limits.tcp_pool_size.max(1);
        let (best, grow, renew) = peer.pick(pool_size);
        if renew && !peer.renewing.swap(true, Ordering::AcqRel) {
            let (dialer, peer) = (self.dialer.clone(), peer.clone());
            tokio::spawn(renew_connections(
                dialer,
                peer,
                peer_addr.to_owned(),
                expect.to_owned(),
            ));
        }
        if let Some(conn) = best {
            if grow && !peer.growing.swap(true, Ordering::AcqRel) {
                let dialer = self.dialer.clone();
                let peer = peer.clone();
                let (addr, expect) = (peer_addr.to_owned(), expect.to_owned());
                tokio::spawn(async move {
                    let _one_at_a_time = peer.dialing.lock().await;
                    let dialled = dialer.dial(&addr, &expect).await;
                    if let Err(e) = &dialled {
                        debug!(peer = %addr, error = %e, "adding a mesh connection failed");
                    }
                    peer.record_dial(dialled.as_ref());
                    peer.growing.store(false, Ordering::Release);
                });
            }
            return Ok(conn);
        }
        let asked = Instant::now();
        let _one_at_a_time = peer.dialing.lock().await;
        if let (Some(conn), _, _) = peer.pick(pool_size) {
            return Ok(conn);
        }
        if let Some(e) = peer.failed_since(asked) {
            return Err(e);
        }
        let dialled = self.dialer.dial(peer_addr, expect).await;
        peer.record_dial(dialled.as_ref());
        dialled
    }

    /// Starts an exchange for `request` on a connection to the peer.
    pub(crate) async fn send_request(
        &self,
        peer_addr: &str,
        expect: &str,
        request: &Frame,
    ) -> Result<TcpExchange, MeshError> {
        let peer = self.peer(peer_addr);
        let mut retried = false;
        loop {
            let conn = self.connection(&peer, peer_addr, expect).await?;
            let answer = self.dialer.identities.check_answer(
                peer_addr,
                expect,
                &conn.worker_id,
                conn.identity.as_deref(),
            );
            if answer.is_err() && !retried {
                // A pooled connection may lead to a worker that lived at this address
                // before; only a fresh handshake proves who answers there now.
                self.forget_peer(peer_addr);
                retried = true;
                continue;
            }
            answer.inspect_err(|e| self.dialer.observer.answer_refused(e))?;
            match conn.start(request) {
                Ok(exchange) => return Ok(exchange),
                Err(Some(e)) => return Err(MeshError::RequestTooLarge(e.to_string())),
                // The connection closed before the request was queued, so it cannot
                // have reached the owner: try a fresh one, once.
                Err(None) if !retried => {
                    debug!(peer = %peer_addr, "pooled mesh connection was closed; retrying");
                    retried = true;
                }
                Err(None) => {
                    return Err(MeshError::Connect {
                        addr: peer_addr.to_owned(),
                        reason: "the connection closed before the request was sent".into(),
                    });
                }
            }
        }
    }
}

/// The caller's end of a mesh TCP connection, as TLS leaves it.
type CallerStream = tokio_rustls::client::TlsStream<TcpStream>;

impl Dialer {
    /// Opens a connection to `expect` at `peer_addr`: over its same-host socket when it
    /// has a usable one, else over TLS.
    async fn dial(&self, peer_addr: &str, expect: &str) -> Result<Arc<CallerConn>, MeshError> {
        if let Some(dialled) = self.dial_same_host(peer_addr, expect).await {
            return dialled;
        }
        self.dial_tls(peer_addr, expect).await
    }

    /// Connects, handshakes and greets, all within the connect timeout, then starts the
    /// connection's reader and writer tasks.
    async fn dial_tls(&self, peer_addr: &str, expect: &str) -> Result<Arc<CallerConn>, MeshError> {
        let limits = &self.limits;
        let attempt = async {
            let (tls, identity) = self.handshake(peer_addr).await?;
            let (read, write) = tokio::io::split(tls);
            let mut reader = FrameReader::new(read, limits.max_frame);
            let mut writer = FrameWriter::new(write, limits.max_frame);
            let (worker_id, _protocol) = client_greet(
                peer_addr,
                &self.worker_id,
                expect,
                limits.max_protocol_version,
                &mut reader,
                &mut writer,
            )
            .await?;
            Ok::<_, MeshError>((reader, writer, worker_id, identity))
        };
        let (reader, writer, worker_id, identity) = timeout(limits.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(MeshError::ConnectTimeout {
                    addr: peer_addr.to_owned(),
                })
            })
            .inspect_err(|e| self.observer.handshake("caller", observe::dial_failure(e)))?;
        self.observer.handshake("caller", "ok");
        Ok(self.start(reader, writer, worker_id, identity, Link::Tls))
    }

    /// Opens the TCP connection and its TLS session, and reads the mesh identity the
    /// owner's certificate proves.
    async fn handshake(&self, peer_addr: &str) -> Result<(CallerStream, PeerIdentity), MeshError> {
        let addr_str = || peer_addr.to_owned();
        let addr = resolve(peer_addr, self.limits.connect_timeout).await?;
        let stream = TcpStream::connect(addr).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                MeshError::Refused { addr: addr_str() }
            } else {
                MeshError::Connect {
                    addr: addr_str(),
                    reason: e.to_string(),
                }
            }
        })?;
        tune(&stream, &self.limits);
        let name = ServerName::try_from(MESH_SERVER_NAME)
            .map_err(|e| MeshError::Config(format!("mesh server name: {e}")))?;
        // The client's TLS config is taken per dial, so new material reaches the next
        // connection.
        let tls = TlsConnector::from(self.tls.config())
            .connect(name, stream)
            .await
            .map_err(|e| match tls_cause(&e) {
                Some(reason) => MeshError::Tls {
                    addr: addr_str(),
                    reason,
                },
                None => MeshError::Connect {
                    addr: addr_str(),
                    reason: format!("TLS handshake failed: {e}"),
                },
            })?;
        let identity = tls
            .get_ref()
            .1
            .peer_certificates()
            .map(|chain| self.tls.peer(chain))
            .unwrap_or_else(|| {
                Err(mcpgw_certs::CertError::Parse(
                    "the peer presented no certificate".into(),
                ))
            })
            .map_err(|e| MeshError::Tls {
                addr: addr_str(),
                reason: e.to_string(),
            })?;
        Ok((tls, identity))
    }

    /// Starts a greeted connection's tasks: the reader that routes frames to their
    /// exchanges, the writer, and the watch on the peer's certificate. Over `Link::Unix`
    /// the kernel vouched for the peer and there is no certificate identity to check.
    fn start<R, W>(
        &self,
        reader: FrameReader<R>,
        writer: FrameWriter<W>,
        worker_id: String,
        identity: PeerIdentity,
        link: Link,
    ) -> Arc<CallerConn>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let limits = &self.limits;
        let (max_age, connect) = (limits.max_connection_age, limits.connect_timeout);
        let life = ConnectionLife::starting_now(
            max_age,
            identity.not_after,
            renewal_lead(max_age, connect),
        );
        let open = self.observer.open("caller", &identity, link);
        let outbox = Outbox::new(limits.max_frame);
        let certified = (link == Link::Tls).then_some(identity.uri);
        let conn = CallerConn::new(
            outbox.clone(),
            worker_id,
            certified,
            life,
            limits.stream_window,
        );
        self.close_when_expired(&conn, life.close_at);
        let (read, leftover) = reader.into_parts();
        let reader = MuxReader::new(read, leftover, limits.max_frame);
        let (reading, stop) = (conn.clone(), self.stop.clone());
        tokio::spawn(async move {
            let _open = open;
            read_loop(reading, reader, stop).await;
        });
        self.spawn_writer(&conn, outbox, writer.into_inner());
        conn
    }

    /// A connection never outlives its peer's certificate, busy or not.
    fn close_when_expired(&self, conn: &Arc<CallerConn>, close_at: Instant) {
        let expiring = conn.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep_until(close_at) => {
                    debug!(peer = %expiring.worker_id, "mesh TCP connection closed: the peer's certificate expired");
                    expiring.fail_all(LinkError::Broken {
                        reason: "the peer's certificate expired".into(),
                        tls: None,
                    });
                }
                () = expiring.dead.cancelled() => {}
                () = stop.cancelled() => {}
            }
        });
    }

    /// Spawns the task that writes what the connection's exchanges queue; a failed
    /// write fails every exchange of the connection.
    fn spawn_writer<W: AsyncWrite + Unpin + Send + 'static>(
        &self,
        conn: &Arc<CallerConn>,
        outbox: Arc<Outbox>,
        write: W,
    ) {
        outbox.attach(Box::new(write));
        let stall = self.limits.idle_timeout;
        let writer_conn = conn.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let written = tokio::select! {
                written = write_loop(&outbox, stall) => written,
                () = stop.cancelled() => Ok(()),
            };
            match written {
                Ok(()) => outbox.shut_down().await,
                Err(e) => {
                    debug!(error = %e, "mesh TCP connection: writing failed");
                    writer_conn.fail_all(LinkError::Broken {
                        reason: format!("writing to the owner failed: {e}"),
                        tls: tls_cause(&e),
                    });
                }
            }
        });
    }
}
