//! The owner's facade over the transports: [`MeshServer`] binds the transport a worker
//! serves on, and [`MeshServerHandle`] drains and stops it. What the transports'
//! owners share (the greeting, serving one exchange) is in `serving`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::timeout;
use tracing::{debug, warn};

use super::config::{MeshLimits, TransportKind};
use super::error::MeshError;
use super::observe::{MeshObserver, Observer};
use super::redis::RedisTransportConfig;
use super::service::MeshService;
use super::serving::ServerShared;
use super::tls::ServerTls;
use super::{quic, redis, tcp};

/// Starts mesh servers. See [`MeshServer::bind`].
#[derive(Debug)]
pub struct MeshServer;

impl MeshServer {
    /// Binds the worker's mesh endpoint on `listen` and starts serving forwarded
    /// requests with `service`.
    ///
    /// `observer`, when given, is told of this server's handshakes and connections
    /// (see [`MeshObserver`]); each server reports to its own, so workers sharing a
    /// process keep their counts apart.
    ///
    /// `tls` comes from `mcpgw-certs` (client certificates from the mesh CA required):
    /// a fixed config, or a `MeshTlsSource` whose new material every new handshake uses
    /// (see the `tls` module); the mesh ALPN is added here when it is missing. `local_worker_id` is what `Welcome` answers, so that
    /// callers can tell this worker from a successor on the same address. QUIC binds
    /// its own UDP socket (never `SO_REUSEPORT`: one consumer per worker endpoint).
    pub async fn bind(
        kind: TransportKind,
        listen: SocketAddr,
        tls: impl Into<ServerTls>,
        local_worker_id: impl Into<String>,
        service: Arc<dyn MeshService>,
        limits: MeshLimits,
        observer: Option<Arc<dyn MeshObserver>>,
    ) -> Result<MeshServerHandle, MeshError> {
        let tls = tls.into();
        let shared = ServerShared::new(
            kind,
            local_worker_id.into(),
            service,
            limits,
            observer.into(),
        );
        let (local_addr, endpoint) = match kind {
            TransportKind::Quic => {
                let endpoint = quic::owner::serve(listen, tls, shared.clone())?;
                let addr = endpoint.local_addr()?;
                (addr, Some(endpoint))
            }
            TransportKind::Tcp => (tcp::serve(listen, tls, shared.clone()).await?, None),
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
            same_host: None,
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
            // Over Redis there are no handshakes or connections of the mesh's own.
            Observer::default(),
        );
        let channel = redis::serve(&redis, shared.clone()).await?;
        debug!(%channel, worker_id = %shared.worker_id, "mesh server subscribed");
        Ok(MeshServerHandle {
            local_addr: SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)),
            shared,
            quic_endpoint: None,
            redis_channel: Some(channel),
            same_host: None,
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
    /// The same-host Unix socket, when served; its file goes with the handle.
    same_host: Option<tcp::SameHostSocket>,
}

impl MeshServerHandle {
    /// Handshakes in progress at the mesh port now (each holds a place of
    /// [`MeshLimits::max_handshakes`](super::config::MeshLimits::max_handshakes) and of
    /// its source address's `max_handshakes_per_addr`).
    pub fn handshakes_in_progress(&self) -> usize {
        self.shared.handshakes.in_progress()
    }

    /// What this server has in flight, by budget, for metrics.
    pub fn stream_counter(&self) -> super::budget::StreamCounter {
        super::budget::StreamCounter(Arc::clone(&self.shared.budgets))
    }

    /// The address the server listens on (`0.0.0.0:0` for the Redis transport, which
    /// listens on no socket).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Also serves this worker's requests on the Unix socket `path` (the same-host
    /// path): the TCP transport's framing and budgets, no TLS, for callers of this
    /// process's own uid on this kernel; others are refused at accept (see the
    /// `tcp::same_host` module source). The socket file is removed when the server
    /// stops. TCP transport only.
    pub fn serve_same_host(&mut self, path: &std::path::Path) -> Result<(), MeshError> {
        if self.shared.kind != TransportKind::Tcp {
            return Err(MeshError::Config(format!(
                "the same-host mesh path runs the TCP transport's framing; the {} \
                 transport has none",
                self.shared.kind
            )));
        }
        let socket = tcp::serve_same_host(path, self.shared.clone())?;
        debug!(path = %path.display(), worker_id = %self.shared.worker_id, "mesh same-host socket listening");
        self.same_host = Some(socket);
        Ok(())
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
        self.shared.drain_started.cancel();
    }

    /// Drains and waits up to `grace` for the requests in flight to finish, while the
    /// endpoint keeps answering (`Draining`), so the owner can end its sessions before
    /// it stops listening. Returns whether everything finished in time.
    pub async fn wait_idle(&self, grace: Duration) -> bool {
        self.drain();
        timeout(grace, self.shared.budgets.wait_idle())
            .await
            .is_ok()
    }

    /// Drains, waits up to `grace` for in-flight requests to finish, then stops.
    pub async fn shutdown(self, grace: Duration) {
        self.drain();
        self.shared.tracker.close();
        let in_flight = self.shared.tracker.clone();
        // Connection tasks wait for their next request forever; only request tasks
        // are worth waiting for, so wait for the in-flight count to reach zero.
        if timeout(grace, self.shared.budgets.wait_idle())
            .await
            .is_err()
        {
            warn!(
                in_flight = self.shared.budgets.total(),
                "mesh server shutdown: grace period over, cancelling requests still in flight"
            );
        }
        // The last frames of the requests that just finished may still be on their
        // way (a QUIC stream waits for its data to be acknowledged while draining).
        self.shared.exchanges.close();
        let _ = timeout(Duration::from_secs(1), self.shared.exchanges.wait()).await;
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
