//! TCP transport (tokio-rustls): a bounded pool of persistent TLS connections per
//! peer, one request in flight per connection, like an HTTP/1 pool.
//!
//! Each connection starts with `Hello` → `Welcome`, then carries one exchange after
//! another. A connection goes back to the pool after `End` or `Error`; a caller that
//! gives up early sends `Cancel` and drains the connection back to a clean state in
//! the background (or drops it if that takes too long).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mcpgw_certs::MESH_SERVER_NAME;
use mcpgw_wire::Frame;
use rustls::pki_types::ServerName;
use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, timeout, timeout_at};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tracing::{debug, warn};

use super::client::{ExState, greet as client_greet, resolve};
use super::error::{LinkError, tls_cause};
use super::framed::{FrameReader, FrameWriter};
use super::server::{ExchangeEnd, ServerShared, greet as server_greet, serve_next};
use super::{MeshError, MeshLimits, PeerInfo, TransportKind};

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
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<ServerShared>,
) -> Result<SocketAddr, MeshError> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    shared.tracker.spawn(accept_loop(
        listener,
        TlsAcceptor::from(tls),
        shared.clone(),
    ));
    Ok(addr)
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, shared: Arc<ServerShared>) {
    loop {
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, remote)) => {
                shared
                    .tracker
                    .spawn(connection(stream, remote, acceptor.clone(), shared.clone()));
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
    acceptor: TlsAcceptor,
    shared: Arc<ServerShared>,
) {
    let limits = &shared.limits;
    tune(&stream, limits);
    let tls = match timeout(limits.connect_timeout, acceptor.accept(stream)).await {
        Err(_) => {
            warn!(%remote, "mesh TLS handshake timed out");
            return;
        }
        Ok(Err(e)) => {
            let reason = tls_cause(&e).unwrap_or_else(|| e.to_string());
            warn!(%remote, %reason, "mesh TLS handshake failed");
            return;
        }
        Ok(Ok(tls)) => tls,
    };
    let identity = match tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|leaf| mcpgw_certs::peer_identity(leaf))
    {
        Some(Ok(identity)) => identity,
        Some(Err(e)) => {
            warn!(%remote, error = %e, "mesh peer has no mesh identity; closing");
            return;
        }
        None => {
            warn!(%remote, "mesh peer presented no certificate; closing");
            return;
        }
    };
    let (read, write) = tokio::io::split(tls);
    let mut reader = FrameReader::new(read, limits.max_frame);
    let mut writer = FrameWriter::new(write, limits.max_frame);
    let Some(worker_id) = server_greet(&shared, remote, &mut reader, &mut writer).await else {
        let _ = writer.get_mut().shutdown().await;
        return;
    };
    let peer = PeerInfo {
        addr: remote,
        identity,
        worker_id,
        transport: TransportKind::Tcp,
    };
    debug!(%remote, peer = %peer.worker_id, identity = %peer.identity, "mesh TCP peer connected");
    loop {
        let incoming = tokio::select! {
            () = shared.stop.cancelled() => break,
            incoming = reader.next() => incoming,
        };
        match serve_next(&shared, &peer, incoming, &mut reader, &mut writer).await {
            Some(ExchangeEnd::Clean) => {}
            Some(ExchangeEnd::Broken) | None => break,
        }
    }
    let _ = timeout(Duration::from_secs(1), writer.get_mut().shutdown()).await;
}

// ---------------------------------------------------------------- client side

type TlsStream = tokio_rustls::client::TlsStream<TcpStream>;

/// One pooled connection, greeted.
struct TcpConn {
    reader: FrameReader<ReadHalf<TlsStream>>,
    writer: FrameWriter<WriteHalf<TlsStream>>,
    /// The worker id this connection's `Welcome` named.
    worker_id: String,
}

/// The TCP peer pool.
pub(crate) struct TcpClient {
    /// TLS client (our leaf, mesh CA, ALPN).
    connector: TlsConnector,
    /// Announced in `Hello`.
    worker_id: String,
    /// Pool size, timeouts, frame size.
    limits: MeshLimits,
    /// Pool per peer address, as the directory spells it.
    peers: Mutex<HashMap<String, Arc<TcpPeer>>>,
}

/// One peer's pool.
struct TcpPeer {
    /// One permit per connection the pool may have busy: bounds requests in flight.
    slots: Arc<Semaphore>,
    /// Connections ready for a request, most recently used last.
    idle: Mutex<Vec<TcpConn>>,
    /// The last failed dial: requests that were already waiting for a pool slot when
    /// it failed get its error instead of each waiting out the connect timeout again.
    last_failure: Mutex<Option<(Instant, MeshError)>>,
}

impl TcpPeer {
    /// An idle connection that is still quiet (not closed by the peer).
    fn take_idle(&self) -> Option<TcpConn> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(mut conn) = idle.pop() {
            if !conn.reader.has_news() {
                return Some(conn);
            }
            debug!(peer = %conn.worker_id, "dropping a pooled mesh connection the peer closed");
        }
        None
    }

    /// The last dial failure, if it happened after `asked`.
    fn failed_since(&self, asked: Instant) -> Option<MeshError> {
        let last = self.last_failure.lock().ok()?;
        last.as_ref()
            .filter(|(at, _)| *at >= asked)
            .map(|(_, e)| e.clone())
    }

    fn record_dial(&self, outcome: Option<&MeshError>) {
        if let Ok(mut last) = self.last_failure.lock() {
            *last = outcome.map(|e| (Instant::now(), e.clone()));
        }
    }

    fn put_idle(&self, conn: TcpConn) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(conn);
        }
    }
}

impl TcpClient {
    pub(crate) fn new(
        tls: Arc<rustls::ClientConfig>,
        worker_id: String,
        limits: MeshLimits,
    ) -> Self {
        Self {
            connector: TlsConnector::from(tls),
            worker_id,
            limits,
            peers: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn forget_peer(&self, peer_addr: &str) {
        if let Ok(mut peers) = self.peers.lock() {
            peers.remove(peer_addr);
        }
    }

    fn peer(&self, peer_addr: &str) -> Arc<TcpPeer> {
        let new_peer = || {
            Arc::new(TcpPeer {
                slots: Arc::new(Semaphore::new(self.limits.tcp_pool_size.max(1))),
                idle: Mutex::new(Vec::new()),
                last_failure: Mutex::new(None),
            })
        };
        let Ok(mut peers) = self.peers.lock() else {
            return new_peer();
        };
        peers
            .entry(peer_addr.to_owned())
            .or_insert_with(new_peer)
            .clone()
    }

    /// Connects, handshakes and greets; all within the connect timeout.
    async fn dial(&self, peer_addr: &str, expect: &str) -> Result<TcpConn, MeshError> {
        let addr_str = || peer_addr.to_owned();
        let attempt = async {
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
            let tls =
                self.connector
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
            let (read, write) = tokio::io::split(tls);
            let mut reader = FrameReader::new(read, self.limits.max_frame);
            let mut writer = FrameWriter::new(write, self.limits.max_frame);
            let worker_id =
                client_greet(peer_addr, &self.worker_id, expect, &mut reader, &mut writer).await?;
            Ok(TcpConn {
                reader,
                writer,
                worker_id,
            })
        };
        timeout(self.limits.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| Err(MeshError::ConnectTimeout { addr: addr_str() }))
    }

    /// Takes a connection from the peer's pool (dialling one if none is idle) and
    /// writes the encoded request on it.
    pub(crate) async fn send_request(
        &self,
        peer_addr: &str,
        expect: &str,
        request: &[u8],
        deadline: Instant,
    ) -> Result<TcpExchange, MeshError> {
        let peer = self.peer(peer_addr);
        let asked = Instant::now();
        let permit = match timeout_at(deadline, peer.slots.clone().acquire_owned()).await {
            Ok(Ok(permit)) => permit,
            _ => {
                return Err(MeshError::Saturated {
                    addr: peer_addr.to_owned(),
                });
            }
        };
        loop {
            let (mut conn, pooled) = match peer.take_idle() {
                Some(conn) => (conn, true),
                None => {
                    if let Some(e) = peer.failed_since(asked) {
                        return Err(e);
                    }
                    let dialled = self.dial(peer_addr, expect).await;
                    peer.record_dial(dialled.as_ref().err());
                    (dialled?, false)
                }
            };
            if conn.worker_id != expect {
                let found = conn.worker_id.clone();
                // The connection is sound; it just leads to another worker.
                peer.put_idle(conn);
                return Err(MeshError::WrongWorker {
                    addr: peer_addr.to_owned(),
                    expected: expect.to_owned(),
                    found,
                });
            }
            match conn.writer.send_encoded(request).await {
                Ok(()) => {
                    return Ok(TcpExchange {
                        conn: Some(conn),
                        peer,
                        permit: Some(permit),
                        state: ExState::Open,
                        drain_timeout: self.limits.connect_timeout,
                    });
                }
                // A pooled connection the peer closed since its last use: the request
                // did not get through whole, so it cannot have run; try another.
                Err(e) if pooled => {
                    debug!(peer = %peer_addr, error = %e, "pooled mesh connection was dead; retrying");
                }
                Err(e) => {
                    return Err(MeshError::Connect {
                        addr: peer_addr.to_owned(),
                        reason: format!("connection lost while sending the request: {e}"),
                    });
                }
            }
        }
    }
}

/// One request's pooled connection, caller side.
pub(crate) struct TcpExchange {
    /// The connection; taken when the exchange is released.
    conn: Option<TcpConn>,
    /// Where the connection goes back to.
    peer: Arc<TcpPeer>,
    /// The pool slot; held until the connection is back or gone.
    permit: Option<OwnedSemaphorePermit>,
    pub(crate) state: ExState,
    /// How long a cancelled exchange may take to drain before the connection is dropped.
    drain_timeout: Duration,
}

impl TcpExchange {
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        match &mut self.conn {
            Some(conn) => conn.reader.next().await,
            None => Ok(None),
        }
    }

    /// Returns the connection to the pool after a clean end, drops it when broken, and
    /// cancels an open exchange: `Cancel`, then drain to the owner's final frame in the
    /// background so the connection can be reused.
    pub(crate) fn release(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        match self.state {
            ExState::Clean => {
                self.peer.put_idle(conn);
                self.permit.take();
            }
            ExState::Broken => {
                self.permit.take();
            }
            ExState::Open => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                let peer = self.peer.clone();
                let permit = self.permit.take();
                let within = self.drain_timeout;
                runtime.spawn(async move {
                    // Holding the permit keeps the pool bounded while draining.
                    let _permit = permit;
                    if let Ok(Some(conn)) = timeout(within, cancel_and_drain(conn)).await {
                        peer.put_idle(conn);
                    }
                });
            }
        }
    }
}

impl Drop for TcpExchange {
    fn drop(&mut self) {
        self.release();
    }
}

/// Sends `Cancel` and reads until the owner's final frame; the connection is then
/// clean. `None` when the connection broke on the way.
async fn cancel_and_drain(mut conn: TcpConn) -> Option<TcpConn> {
    conn.writer.send(&Frame::Cancel).await.ok()?;
    loop {
        match conn.reader.next().await {
            Ok(Some(Frame::End | Frame::Error(_))) => return Some(conn),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return None,
        }
    }
}
