//! Many exchanges per peer: the TCP mesh multiplexes them on few connections with a
//! credit window each, and both transports keep separate budgets for short requests
//! and held streams, refusing at once when one is full.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{
    CALLER, OWNER, Pki, TEST_TIMEOUT, body_of, header, init_tracing, limits, request,
    serve_on_loopback,
};
use futures_util::StreamExt;
use futures_util::stream::{self, BoxStream};
use mcpgw_mesh::transport::{
    ForwardedResponse, MeshClient, MeshError, MeshLimits, MeshServerHandle, MeshService, PeerInfo,
    ResponsePart, TransportKind,
};
use mcpgw_wire::{RequestFrame, ResponseHead};
use tokio::sync::{Barrier, Semaphore};

both_transports!(
    a_full_long_budget_refuses_at_once_and_short_requests_go_on,
    a_full_owner_budget_answers_busy_at_once,
    an_sse_answer_moves_to_the_long_budget,
    two_thousand_held_streams_leave_room_for_requests,
);

/// Chunk size of `/flood`.
const FLOOD_CHUNK: usize = 16 * 1024;
/// Chunks of `/flood`.
const FLOOD_CHUNKS: usize = 64;

/// What the test service saw.
#[derive(Default)]
struct Seen {
    started: AtomicUsize,
    cancelled: AtomicUsize,
    /// Chunks `/flood` produced so far.
    flooded: AtomicUsize,
}

struct Service {
    seen: Arc<Seen>,
    /// `/together` answers only once this many of them are running.
    together: Arc<Barrier>,
    /// `/gated` produces one chunk per permit.
    gate: Arc<Semaphore>,
}

/// Counts a cancellation when dropped before the response ended.
struct Watch {
    seen: Arc<Seen>,
    done: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.done {
            self.seen.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn head(content_type: &str, peer: &PeerInfo) -> ResponsePart {
    ResponsePart::Head(ResponseHead {
        status: 200,
        headers: vec![
            ("content-type".into(), content_type.into()),
            ("x-peer-addr".into(), peer.addr.to_string()),
        ],
    })
}

impl MeshService for Service {
    fn serve(&self, request: RequestFrame, peer: PeerInfo) -> BoxStream<'static, ResponsePart> {
        self.seen.started.fetch_add(1, Ordering::SeqCst);
        let watch = Watch {
            seen: self.seen.clone(),
            done: false,
        };
        match request.path.as_str() {
            // A held stream: an SSE head, then nothing until the caller lets go.
            "/hold" => stream::once(async move { head("text/event-stream", &peer) })
                .chain(stream::unfold(watch, |watch| async move {
                    std::future::pending::<()>().await;
                    Some((ResponsePart::End, watch))
                }))
                .boxed(),
            "/echo" => {
                let mut watch = watch;
                watch.done = true;
                stream::iter([
                    head("application/json", &peer),
                    ResponsePart::Chunk(request.body),
                    ResponsePart::End,
                ])
                .boxed()
            }
            // Waits for all its siblings, then three chunks naming the request,
            // yielding between them so the exchanges' chunks interleave.
            "/together" => {
                let together = self.together.clone();
                let name = String::from_utf8_lossy(&request.body).into_owned();
                stream::unfold((0usize, watch), move |(i, mut watch)| {
                    let together = together.clone();
                    let name = name.clone();
                    let peer = peer.clone();
                    async move {
                        match i {
                            0 => {
                                together.wait().await;
                                Some((head("text/plain", &peer), (1, watch)))
                            }
                            1..=3 => {
                                tokio::task::yield_now().await;
                                let chunk = Bytes::from(format!("{name}:{i};"));
                                Some((ResponsePart::Chunk(chunk), (i + 1, watch)))
                            }
                            4 => {
                                watch.done = true;
                                Some((ResponsePart::End, (5, watch)))
                            }
                            _ => None,
                        }
                    }
                })
                .boxed()
            }
            // A large body, produced as fast as the transport takes it.
            "/flood" => {
                let seen = self.seen.clone();
                stream::once(async move { head("application/octet-stream", &peer) })
                    .chain(stream::unfold((0usize, watch), move |(i, mut watch)| {
                        let seen = seen.clone();
                        async move {
                            if i == FLOOD_CHUNKS {
                                watch.done = true;
                                return Some((ResponsePart::End, (i + 1, watch)));
                            }
                            if i > FLOOD_CHUNKS {
                                return None;
                            }
                            seen.flooded.fetch_add(1, Ordering::SeqCst);
                            let chunk = Bytes::from(vec![b'f'; FLOOD_CHUNK]);
                            Some((ResponsePart::Chunk(chunk), (i + 1, watch)))
                        }
                    }))
                    .boxed()
            }
            // A stream whose chunks the test releases one by one.
            "/gated" => {
                let gate = self.gate.clone();
                stream::once(async move { head("text/event-stream", &peer) })
                    .chain(stream::unfold(watch, move |watch| {
                        let gate = gate.clone();
                        async move {
                            gate.acquire().await.ok()?.forget();
                            Some((ResponsePart::Chunk(Bytes::from_static(b"tick;")), watch))
                        }
                    }))
                    .boxed()
            }
            other => panic!("no test route {other}"),
        }
    }
}

struct Pair {
    _pki: Pki,
    server: MeshServerHandle,
    client: MeshClient,
    seen: Arc<Seen>,
    gate: Arc<Semaphore>,
    kind: TransportKind,
}

impl Pair {
    async fn start(
        kind: TransportKind,
        server_limits: MeshLimits,
        client_limits: MeshLimits,
        together: usize,
    ) -> Self {
        init_tracing();
        let pki = Pki::new("multiplex test CA");
        let owner = pki.member("owner");
        let caller = pki.member("caller");
        let seen = Arc::new(Seen::default());
        let gate = Arc::new(Semaphore::new(0));
        let service = Arc::new(Service {
            seen: seen.clone(),
            together: Arc::new(Barrier::new(together.max(1))),
            gate: gate.clone(),
        });
        let server =
            serve_on_loopback(kind, owner.server_config(), OWNER, service, server_limits).await;
        let client = MeshClient::new(kind, caller.client_config(), CALLER, client_limits, None)
            .expect("client");
        Self {
            _pki: pki,
            server,
            client,
            seen,
            gate,
            kind,
        }
    }

    async fn forward(
        &self,
        method: &str,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<ForwardedResponse, MeshError> {
        let mut frame = request(path, body);
        frame.method = method.into();
        self.client
            .forward(&self.server.local_addr().to_string(), OWNER, frame)
            .await
    }

    async fn echo(&self, text: &'static str) {
        let response = self
            .forward("POST", "/echo", text)
            .await
            .unwrap_or_else(|e| panic!("{}: a short request failed: {e}", self.kind));
        let (body, _) = body_of(response).await.expect("echo body");
        assert_eq!(body, text.as_bytes());
    }

    /// Waits (bounded by the test's timeout) until `counter` reaches `n`.
    async fn await_count(counter: &AtomicUsize, n: usize) {
        while counter.load(Ordering::SeqCst) < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn one_connection() -> MeshLimits {
    MeshLimits {
        tcp_pool_size: 1,
        ..limits()
    }
}

async fn within(test: impl Future<Output = ()>) {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out");
}

// ------------------------------------------------------------------ TCP multiplexing

/// Forty exchanges in flight at once on a single TCP connection: none can answer
/// before all forty run (a barrier), so they cannot have taken turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_exchanges_interleave_on_one_tcp_connection() {
    within(async {
        const N: usize = 40;
        let pair = Pair::start(TransportKind::Tcp, limits(), one_connection(), N).await;
        let calls = (0..N).map(|i| {
            let pair = &pair;
            async move {
                let response = pair.forward("POST", "/together", format!("r{i}")).await?;
                let conn = header(response.head(), "x-peer-addr").map(str::to_owned);
                let (body, _) = body_of(response).await?;
                Ok::<_, MeshError>((i, conn, body))
            }
        });
        let results = futures_util::future::join_all(calls).await;
        let mut conns = std::collections::HashSet::new();
        for result in results {
            let (i, conn, body) = result.expect("exchange");
            assert_eq!(body, format!("r{i}:1;r{i}:2;r{i}:3;").as_bytes());
            conns.insert(conn);
        }
        assert_eq!(
            conns.len(),
            1,
            "all exchanges shared one connection: {conns:?}"
        );
    })
    .await;
}

/// A response nobody reads holds one credit window at the owner and stalls nothing
/// else on its connection; once read, it arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_does_not_delay_another_exchange() {
    within(async {
        let window = MeshLimits {
            stream_window: 2 * FLOOD_CHUNK,
            ..one_connection()
        };
        let pair = Pair::start(TransportKind::Tcp, window.clone(), window, 1).await;
        let mut flood = pair
            .forward("POST", "/flood", "")
            .await
            .expect("flood head");
        let flood_conn = header(flood.head(), "x-peer-addr").map(str::to_owned);
        // Nobody reads the flood; other exchanges on its connection still complete.
        for _ in 0..5 {
            let response = pair.forward("POST", "/echo", "beside").await.expect("echo");
            assert_eq!(
                header(response.head(), "x-peer-addr").map(str::to_owned),
                flood_conn
            );
            assert_eq!(body_of(response).await.expect("body").0, b"beside");
        }
        // The owner produced one window (sent) and gathered at most one more while
        // waiting for credit: four chunks, never the whole body.
        let produced = pair.seen.flooded.load(Ordering::SeqCst);
        assert!(
            produced <= 4,
            "the owner ran {produced} chunks ahead of an idle reader"
        );
        let mut total = 0;
        while let Some(chunk) = flood.next_chunk().await {
            total += chunk.expect("flood chunk").len();
        }
        assert_eq!(
            total,
            FLOOD_CHUNK * FLOOD_CHUNKS,
            "credit let the whole body through"
        );
    })
    .await;
}

/// Dropping one exchange cancels it at the owner; its sibling on the same connection
/// streams on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_ends_only_its_exchange() {
    within(async {
        let pair = Pair::start(TransportKind::Tcp, limits(), one_connection(), 1).await;
        let held = pair.forward("GET", "/hold", "").await.expect("held stream");
        let mut gated = pair
            .forward("GET", "/gated", "")
            .await
            .expect("gated stream");
        assert_eq!(
            header(held.head(), "x-peer-addr"),
            header(gated.head(), "x-peer-addr"),
            "both on one connection"
        );
        drop(held);
        Pair::await_count(&pair.seen.cancelled, 1).await;
        pair.gate.add_permits(1);
        let tick = gated.next_chunk().await.expect("a chunk").expect("ok");
        assert_eq!(&tick[..], b"tick;");
        assert_eq!(
            pair.seen.cancelled.load(Ordering::SeqCst),
            1,
            "only the dropped one"
        );
        pair.echo("the connection serves on").await;
        drop(gated);
        Pair::await_count(&pair.seen.cancelled, 2).await;
    })
    .await;
}

// ------------------------------------------------------------------ budgets, both transports

async fn a_full_long_budget_refuses_at_once_and_short_requests_go_on(kind: TransportKind) {
    let small = MeshLimits {
        max_in_flight_per_peer: 2,
        max_streams_per_peer: 4,
        ..limits()
    };
    let pair = Pair::start(kind, limits(), small, 1).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(pair.forward("GET", "/hold", "").await.expect("held stream"));
    }
    match pair.forward("GET", "/hold", "").await {
        Err(e @ MeshError::BudgetExhausted { .. }) => {
            assert!(e.is_budget_exhausted());
            assert!(!e.proves_peer_gone(), "a full budget proves nothing");
            assert!(!e.may_have_executed(), "it was never sent");
        }
        other => panic!("{kind}: expected BudgetExhausted, got {other:?}"),
    }
    assert_eq!(
        pair.seen.started.load(Ordering::SeqCst),
        4,
        "the fifth was not sent"
    );
    // Held streams never make a short request wait.
    for _ in 0..5 {
        pair.echo("short").await;
    }
    // Letting go of a stream frees its slot.
    drop(held.pop());
    held.push(
        pair.forward("GET", "/hold", "")
            .await
            .expect("a freed slot"),
    );
}

async fn a_full_owner_budget_answers_busy_at_once(kind: TransportKind) {
    let small = MeshLimits {
        max_streams_per_peer: 3,
        ..limits()
    };
    let pair = Pair::start(kind, small, limits(), 1).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(pair.forward("GET", "/hold", "").await.expect("held stream"));
    }
    let err = pair
        .forward("GET", "/hold", "")
        .await
        .expect_err("over the owner's budget");
    assert!(
        err.is_budget_exhausted(),
        "{kind}: expected Busy, got {err:?}"
    );
    assert!(!err.may_have_executed());
    pair.echo("short").await;
    drop(held.pop());
    Pair::await_count(&pair.seen.cancelled, 1).await;
    held.push(
        pair.forward("GET", "/hold", "")
            .await
            .expect("a freed slot"),
    );
}

/// A POST whose answer is an SSE stream leaves the short budget when its head arrives.
async fn an_sse_answer_moves_to_the_long_budget(kind: TransportKind) {
    let one = MeshLimits {
        max_in_flight_per_peer: 1,
        ..limits()
    };
    let pair = Pair::start(kind, one.clone(), one, 1).await;
    let _sse = pair.forward("POST", "/hold", "").await.expect("SSE answer");
    pair.echo("still room for a short request").await;
}

/// Two thousand held streams from one worker to another, then a short request: it is
/// answered, and letting go of the streams frees their budget.
async fn two_thousand_held_streams_leave_room_for_requests(kind: TransportKind) {
    const STREAMS: usize = 2_000;
    let exact = MeshLimits {
        max_streams_per_peer: STREAMS,
        ..limits()
    };
    let pair = Pair::start(kind, exact.clone(), exact, 1).await;
    let open = |n: usize| {
        let pair = &pair;
        futures_util::stream::iter(0..n)
            .map(move |_| async move { pair.forward("GET", "/hold", "").await })
            .buffer_unordered(200)
            .collect::<Vec<_>>()
    };
    let held: Vec<_> = open(STREAMS)
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{kind}: a held stream failed: {e}"));
    pair.echo("through two thousand held streams").await;
    drop(held);
    Pair::await_count(&pair.seen.cancelled, STREAMS).await;
    let again: Vec<_> = open(STREAMS)
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{kind}: the freed budget did not take new streams: {e}"));
    assert_eq!(again.len(), STREAMS);
}
