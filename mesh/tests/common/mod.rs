//! Shared harness for the mesh tests: a test service that records what it saw, and a
//! server/client pair on loopback. Processes, Redis, the in-process PKI and polling
//! come from `mcpgw-testkit`.
#![allow(dead_code)] // each test crate uses a different part of the harness

pub mod scenarios;

#[allow(unused_imports)] // not every test crate starts a Redis or needs each helper
pub use mcpgw_testkit::pki::{Pki, YEAR};
#[allow(unused_imports)]
pub use mcpgw_testkit::{RedisServer, eventually_async};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::{self, BoxStream};
use mcpgw_mesh::transport::{
    ForwardedResponse, MeshClient, MeshError, MeshLimits, MeshServer, MeshServerHandle,
    MeshService, PeerInfo, RedisTransportConfig, ResponsePart, ServerTls, TransportKind,
};
use mcpgw_wire::{AuthContext, AuthMode, ErrorFrame, ErrorKind, RequestFrame, ResponseHead};
use tokio::sync::Semaphore;

/// Runs each named `async fn(TransportKind)` as a test on QUIC and on TCP, each bounded
/// by [`TEST_TIMEOUT`].
#[macro_export]
macro_rules! both_transports {
    ($($name:ident),* $(,)?) => {
        $crate::both_transports!(@on quic, Quic; $($name),*);
        $crate::both_transports!(@on tcp, Tcp; $($name),*);
    };
    (@on $module:ident, $kind:ident; $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    tokio::time::timeout(super::TEST_TIMEOUT, super::$name(super::TransportKind::$kind))
                        .await
                        .expect("test timed out");
                }
            )*
        }
    };
}

/// A mesh server on a free loopback port, serving `service` as worker `worker`.
pub async fn serve_on_loopback(
    kind: TransportKind,
    tls: impl Into<ServerTls>,
    worker: &str,
    service: Arc<dyn MeshService>,
    limits: MeshLimits,
) -> MeshServerHandle {
    MeshServer::bind(
        kind,
        "127.0.0.1:0".parse().expect("addr"),
        tls,
        worker,
        service,
        limits,
        None,
    )
    .await
    .expect("bind mesh server")
}

pub const OWNER: &str = "owner-1";
pub const CALLER: &str = "caller-1";
/// Upper bound for any one test; generous so that a slow machine never fails a test.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------ test service

/// What the test service saw; shared with the test body.
pub struct Record {
    /// Requests the service started.
    pub started: AtomicUsize,
    /// Responses dropped before they were complete (the transport cancelled them).
    pub cancelled: AtomicUsize,
    /// Chunks produced by `/gated`.
    pub produced: AtomicUsize,
    /// `/gated` waits on this between its first chunk and the rest.
    pub gate: Semaphore,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            started: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            produced: AtomicUsize::new(0),
            gate: Semaphore::new(0),
        }
    }
}

pub struct TestService {
    pub record: Arc<Record>,
}

/// Counts a cancellation if dropped before `done` is set.
pub struct CancelProbe {
    record: Arc<Record>,
    done: bool,
}

impl Drop for CancelProbe {
    fn drop(&mut self) {
        if !self.done {
            self.record.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

pub fn head(peer: &PeerInfo) -> ResponsePart {
    ResponsePart::Head(ResponseHead {
        status: 200,
        headers: vec![
            ("x-served-by".into(), OWNER.into()),
            ("x-peer-worker".into(), peer.worker_id.to_string()),
            ("x-peer-identity".into(), peer.identity.to_string()),
            ("x-peer-addr".into(), peer.addr.to_string()),
            ("x-peer-connection".into(), peer.connection.to_string()),
            ("x-peer-protocol".into(), peer.protocol.to_string()),
        ],
    })
}

impl MeshService for TestService {
    fn serve(&self, request: RequestFrame, peer: PeerInfo) -> BoxStream<'static, ResponsePart> {
        let record = self.record.clone();
        record.started.fetch_add(1, Ordering::SeqCst);
        let probe = CancelProbe {
            record: record.clone(),
            done: false,
        };
        match request.path.as_str() {
            // The body back in three chunks, with small delays between them.
            "/echo" => {
                let body = request.body.clone();
                let third = body.len().div_ceil(3).max(1);
                let mut parts = vec![head(&peer)];
                parts.extend(
                    body.chunks(third)
                        .map(|c| ResponsePart::Chunk(Bytes::copy_from_slice(c))),
                );
                parts.push(ResponsePart::End);
                stream::unfold(
                    (parts.into_iter(), probe),
                    |(mut parts, mut probe)| async move {
                        let part = parts.next()?;
                        if matches!(part, ResponsePart::Chunk(_)) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        if matches!(part, ResponsePart::End) {
                            probe.done = true;
                        }
                        Some((part, (parts, probe)))
                    },
                )
                .boxed()
            }
            // One chunk, then waits for the test to let it go on: the test can only
            // open the gate if the first chunk reached it while the rest was not yet
            // produced.
            "/gated" => {
                let n: usize = String::from_utf8_lossy(&request.body).parse().unwrap_or(3);
                stream::unfold((0usize, probe), move |(i, mut probe)| {
                    let record = record.clone();
                    let peer = peer.clone();
                    async move {
                        if i == 0 {
                            return Some((head(&peer), (1, probe)));
                        }
                        if i > n {
                            if i == n + 1 {
                                probe.done = true;
                                return Some((ResponsePart::End, (i + 1, probe)));
                            }
                            return None;
                        }
                        if i == 2 {
                            let permit = record.gate.acquire().await.ok()?;
                            permit.forget();
                        }
                        record.produced.fetch_add(1, Ordering::SeqCst);
                        Some((
                            ResponsePart::Chunk(Bytes::from(format!("event {i}\n"))),
                            (i + 1, probe),
                        ))
                    }
                })
                .boxed()
            }
            // A head, then nothing, forever: only cancellation ends it.
            "/hang" => stream::once(async move { head(&peer) })
                .chain(stream::unfold(probe, |probe| async move {
                    std::future::pending::<()>().await;
                    Some((ResponsePart::End, probe))
                }))
                .boxed(),
            // Never even a head.
            "/silent" => stream::unfold(probe, |probe| async move {
                std::future::pending::<()>().await;
                Some((ResponsePart::End, probe))
            })
            .boxed(),
            "/not-mine" => {
                let mut probe = probe;
                probe.done = true;
                stream::iter([ResponsePart::Error(ErrorFrame::new(
                    ErrorKind::NotOwner,
                    "that session is not mine",
                ))])
                .boxed()
            }
            // Ends without End: a service bug the transport reports as Internal.
            "/truncated" => {
                let mut probe = probe;
                probe.done = true;
                stream::iter([
                    head(&peer),
                    ResponsePart::Chunk(Bytes::from_static(b"partial")),
                ])
                .boxed()
            }
            other => {
                let mut probe = probe;
                probe.done = true;
                stream::iter([ResponsePart::Error(ErrorFrame::new(
                    ErrorKind::Internal,
                    format!("no test route {other}"),
                ))])
                .boxed()
            }
        }
    }
}

// ------------------------------------------------------------------ harness

pub struct Mesh {
    pub pki: Pki,
    pub server: MeshServerHandle,
    pub client: MeshClient,
    pub record: Arc<Record>,
    pub kind: TransportKind,
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "mcpgw_mesh=debug".into()),
        )
        .with_test_writer()
        .try_init();
}

pub fn limits() -> MeshLimits {
    MeshLimits {
        connect_timeout: Duration::from_secs(2),
        ..MeshLimits::default()
    }
}

/// Limits whose connect timeout no test waits for (the whole test is bounded by
/// [`TEST_TIMEOUT`]): "answered before the connect timeout" then holds unless the
/// timeout did the work, however slow the machine.
pub fn patient() -> MeshLimits {
    MeshLimits {
        connect_timeout: TEST_TIMEOUT,
        ..limits()
    }
}

impl Mesh {
    pub async fn start(kind: TransportKind) -> Self {
        Self::start_with(kind, limits(), limits()).await
    }

    pub async fn start_with(
        kind: TransportKind,
        server_limits: MeshLimits,
        client_limits: MeshLimits,
    ) -> Self {
        init_tracing();
        let pki = Pki::new("mesh test CA");
        let owner = pki.member("owner");
        let caller = pki.member("caller");
        let record = Arc::new(Record::default());
        let service = Arc::new(TestService {
            record: record.clone(),
        });
        let server =
            serve_on_loopback(kind, owner.server_config(), OWNER, service, server_limits).await;
        let client = MeshClient::new(kind, caller.client_config(), CALLER, client_limits, None)
            .expect("mesh client");
        Self {
            pki,
            server,
            client,
            record,
            kind,
        }
    }

    /// An owner and a caller on the Redis transport at `redis_url`. `pki` is unused
    /// there (Redis is the trust boundary) and only keeps the harness one shape.
    pub async fn start_redis(
        redis_url: &str,
        server_limits: MeshLimits,
        client_limits: MeshLimits,
    ) -> Self {
        init_tracing();
        let record = Arc::new(Record::default());
        let service = Arc::new(TestService {
            record: record.clone(),
        });
        let server = MeshServer::bind_redis(redis_config(redis_url), OWNER, service, server_limits)
            .await
            .expect("bind mesh server on redis");
        let client = MeshClient::new_redis(redis_config(redis_url), CALLER, client_limits)
            .await
            .expect("mesh client on redis");
        Self {
            pki: Pki::new("unused on redis"),
            server,
            client,
            record,
            kind: TransportKind::Redis,
        }
    }

    /// The server's address: for Redis, `0.0.0.0:0`, which forwarding ignores.
    pub fn addr(&self) -> String {
        self.server.local_addr().to_string()
    }

    pub async fn forward(
        &self,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<ForwardedResponse, MeshError> {
        self.client
            .forward(&self.addr(), OWNER, request(path, body))
            .await
    }

    /// Waits (bounded) until the service has seen `n` cancellations.
    pub async fn await_cancelled(&self, n: usize) {
        self.await_count(&self.record.cancelled, n, "cancellations")
            .await;
    }

    /// Waits (bounded) until the service has started `n` requests.
    pub async fn await_started(&self, n: usize) {
        self.await_count(&self.record.started, n, "started requests")
            .await;
    }

    async fn await_count(&self, counter: &AtomicUsize, n: usize, what: &str) {
        eventually_async(TEST_TIMEOUT / 2, || async {
            let seen = counter.load(Ordering::SeqCst);
            if seen >= n {
                Ok(())
            } else {
                Err(format!(
                    "{}: service saw {seen} {what}, expected {n}",
                    self.kind
                ))
            }
        })
        .await;
    }
}

/// A plain connection to the test Redis, for commands the test sends itself.
pub async fn redis_conn(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the test redis")
}

/// The Redis transport's settings in the tests: a prefix unlike the default, so that
/// nothing depends on it.
pub fn redis_config(redis_url: &str) -> RedisTransportConfig {
    RedisTransportConfig {
        redis_url: redis_url.to_owned(),
        prefix: "t*st:".into(),
    }
}

pub fn request(path: &str, body: impl Into<Bytes>) -> RequestFrame {
    static ID: AtomicUsize = AtomicUsize::new(1);
    RequestFrame {
        request_id: ID.fetch_add(1, Ordering::Relaxed) as u64,
        session_id: Some("session-1".into()),
        method: "POST".into(),
        path: path.into(),
        headers: vec![("mcp-protocol-version".into(), "2025-06-18".into())],
        body: body.into(),
        auth: AuthContext {
            mode: AuthMode::Jwt,
            subject: "alice".into(),
            scopes: vec!["mcp".into()],
            expires_at_ms: None,
            route: "demo".into(),
        },
        deadline_ms: 30_000,
    }
}

pub fn header<'a>(head: &'a ResponseHead, name: &str) -> Option<&'a str> {
    head.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

pub async fn body_of(mut response: ForwardedResponse) -> Result<(Vec<u8>, usize), MeshError> {
    let mut body = Vec::new();
    let mut chunks = 0;
    while let Some(chunk) = response.next_chunk().await {
        body.extend_from_slice(&chunk?);
        chunks += 1;
    }
    Ok((body, chunks))
}
