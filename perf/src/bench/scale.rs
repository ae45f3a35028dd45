//! `mcpgw-bench scale`: the mesh at fleet scale.
//!
//! Starts a fleet of N single-worker supervisors (default 4) sharing one Redis, opens
//! thousands of legacy sessions (default 10,000), each on a random worker, and has
//! every session hold its `GET` event stream open through another random worker, as
//! the official SDK clients do behind a load balancer. Then, with all those streams
//! held, it runs a closed-loop `tools/call` load whose requests go to the workers in
//! round-robin order, and reports:
//!
//! - requests per second, and p50/p99 of the forwarded calls (and of the local ones);
//! - errors by class, while opening sessions and streams and under load, and streams
//!   that ended before the end of the run;
//! - the workers' memory per session, per held stream, and per session with its
//!   stream held (the growth of all workers' resident memory, divided by the count).
//!
//! It talks to the fleet only over HTTP, as a user would.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::header::{ACCEPT, HOST};
use http::{HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};

use super::client::{self, Connection, Target};
use super::fleet::{Bins, Fleet, FleetSpec, MeshCerts, RedisServer, UpstreamServer};
use super::latency::{self, LatencySummary, new_histogram};
use super::mix::{Era, LEGACY_VERSION, Op};
use super::procfs;
use super::sessions::now_unix;
use super::units::{parse_duration, utc_timestamp};

/// Flags of `mcpgw-bench scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Workers in the fleet (one supervisor with `--workers 1` each), all behind
    /// round-robin routing.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Legacy sessions, each holding its GET stream open through a random worker.
    #[arg(long, default_value_t = 10_000)]
    pub sessions: usize,
    /// Closed-loop tools/call load sessions on top of the held streams.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Measured time of the load.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Unmeasured load before measuring.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Mesh transport: quic, tcp, or redis.
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// Sessions and streams opened concurrently.
    #[arg(long, default_value_t = 64)]
    pub parallel: usize,
    /// Deadline of one request or stream opening.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Directory holding mcpgw and mcpgw-bench [default: beside this binary, then
    /// target/release, then target/debug].
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Report directory [default: build/bench/scale-<UTC timestamp>].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// What `scale` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub transport: String,
    pub workers: usize,
    pub sessions: usize,
    pub concurrency: usize,
    /// Sessions opened, and how long that took.
    pub sessions_opened: usize,
    pub session_open_s: f64,
    /// Streams open (200 with an SSE head) before the load began, and how long that took.
    pub streams_opened: usize,
    pub stream_open_s: f64,
    /// Streams whose GET went through a worker other than the session's owner.
    pub streams_forwarded: usize,
    /// Failures while opening sessions and streams, by class.
    pub setup_errors: BTreeMap<String, u64>,
    /// Streams that ended before the run did, by why.
    pub streams_ended_early: BTreeMap<String, u64>,
    /// Streams still open when the run ended.
    pub streams_alive_at_end: usize,
    pub memory: MemoryFigures,
    pub load: LoadFigures,
}

/// The workers' resident memory, summed over the fleet.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryFigures {
    /// Before any session.
    pub rss_start_bytes: u64,
    /// After the sessions were opened.
    pub rss_sessions_bytes: u64,
    /// After every session's stream was opened.
    pub rss_streams_bytes: u64,
    /// Growth per session (owner state, directory client).
    pub per_session_bytes: f64,
    /// Further growth per held stream: the owner's exchange and upstream stream, and
    /// for a forwarded stream also the relaying worker's side.
    pub per_held_stream_bytes: f64,
    /// Both: what one session with its stream held costs the fleet.
    pub per_session_with_stream_bytes: f64,
}

/// The closed-loop `tools/call` load run on top of the held streams.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadFigures {
    pub window_s: f64,
    pub requests: u64,
    pub ok: u64,
    pub throughput_rps: f64,
    /// Share of successful answers that crossed the mesh.
    pub forwarded_fraction: f64,
    pub forwarded_latency: LatencySummary,
    pub local_latency: LatencySummary,
    pub errors: BTreeMap<String, u64>,
}

/// `mcpgw-bench scale`.
pub async fn main(args: ScaleArgs) -> anyhow::Result<()> {
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("build/bench").join(format!("scale-{}", utc_timestamp(now_unix())))
    });
    std::fs::create_dir_all(&out)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", out.display()))?;
    if !matches!(args.transport.as_str(), "quic" | "tcp" | "redis") {
        anyhow::bail!(
            "--transport {:?}: expected quic, tcp or redis",
            args.transport
        );
    }
    if args.workers < 2 || args.sessions == 0 || args.concurrency == 0 {
        anyhow::bail!("scale needs at least 2 workers, 1 session and 1 load session");
    }
    let bins = Bins::locate(args.bin_dir.as_deref()).map_err(anyhow::Error::msg)?;
    let redis = RedisServer::start("scale-redis", &out)
        .await
        .map_err(anyhow::Error::msg)?;
    let upstream = match UpstreamServer::start(&bins, &out).await {
        Ok(upstream) => upstream,
        Err(e) => {
            redis.proc.stop().await;
            anyhow::bail!(e);
        }
    };
    let members: Vec<String> = (0..args.workers).map(|i| format!("host-{i}")).collect();
    let member_refs: Vec<&str> = members.iter().map(String::as_str).collect();
    let result = async {
        let certs = MeshCerts::create(&bins, &out.join("scale-certs"), &member_refs).await?;
        let spec = FleetSpec {
            name: "scale",
            transport: &args.transport,
            redis_url: &redis.url,
            upstream_url: &upstream.url,
            members: &member_refs,
            key_prefix: "mcpgw:",
        };
        let fleet = Fleet::start(&bins, &certs, &spec, &out).await?;
        let measured = measure(&args, &fleet).await;
        fleet.stop().await;
        measured
    }
    .await;
    upstream.proc.stop().await;
    redis.proc.stop().await;
    let report = result.map_err(anyhow::Error::msg)?;
    print!("{}", markdown(&report));
    let path = out.join("scale.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    let md = out.join("scale.md");
    std::fs::write(&md, markdown(&report))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", md.display()))?;
    println!("\nreport: {}", path.display());
    Ok(())
}

/// One worker of the fleet: its URL and the pid of the worker process.
struct Worker {
    target: Target,
    id: String,
    pid: u32,
}

/// A session of the run: its id, and the index of its owner in the worker list.
struct Session {
    id: HeaderValue,
    owner: usize,
}

async fn measure(args: &ScaleArgs, fleet: &Fleet) -> Result<ScaleReport, String> {
    let mut workers = Vec::new();
    for (url, supervisor) in fleet.urls.iter().zip(&fleet.supervisors) {
        let target = Target::parse(url)?;
        let health = client::probe_health(&target, args.timeout)
            .await
            .ok_or_else(|| format!("{url} does not answer /healthz"))?;
        // The public port says who answers, not its pid (that is on the admin port):
        // each supervisor of this fleet runs one worker, its only child.
        let pid = procfs::sole_worker(supervisor.pid).ok_or_else(|| {
            format!(
                "{url}: its supervisor (pid {}) does not run exactly one worker process",
                supervisor.pid
            )
        })?;
        workers.push(Worker {
            target,
            id: health.worker_id,
            pid,
        });
    }
    let workers = Arc::new(workers);
    let mut setup_errors = BTreeMap::new();
    let mut rng = Rng::seeded();
    let rss_start = fleet_rss(&workers)?;

    let started = Instant::now();
    let homes: Vec<usize> = (0..args.sessions)
        .map(|_| rng.below(workers.len()))
        .collect();
    let (sessions, errors) = open_sessions(&workers, &homes, args).await;
    let session_open_s = started.elapsed().as_secs_f64();
    merge(&mut setup_errors, &errors);
    if sessions.is_empty() {
        return Err(format!("no session could be opened: {setup_errors:?}"));
    }
    settle().await;
    let rss_sessions = fleet_rss(&workers)?;

    let vias: Vec<usize> = sessions.iter().map(|_| rng.below(workers.len())).collect();
    let streams_forwarded = sessions
        .iter()
        .zip(&vias)
        .filter(|(s, via)| s.owner != **via)
        .count();
    let (stop_tx, stop_rx) = watch::channel(false);
    let ended = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u64>::new()));
    let alive = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (streams_opened, errors, holders) = open_streams(
        &workers,
        &sessions,
        &vias,
        args,
        stop_rx,
        Arc::clone(&ended),
        Arc::clone(&alive),
    )
    .await;
    let stream_open_s = started.elapsed().as_secs_f64();
    merge(&mut setup_errors, &errors);
    settle().await;
    let rss_streams = fleet_rss(&workers)?;

    let load = run_load(&workers, &sessions, args).await;
    let streams_alive_at_end = alive.load(Ordering::SeqCst);
    let _ = stop_tx.send(true);
    for holder in holders {
        let _ = holder.await;
    }
    let opened = sessions.len() as f64;
    let per_session = (rss_sessions as f64 - rss_start as f64) / opened;
    let per_stream = if streams_opened > 0 {
        (rss_streams as f64 - rss_sessions as f64) / streams_opened as f64
    } else {
        0.0
    };
    let streams_ended_early = std::mem::take(&mut *lock(&ended));
    Ok(ScaleReport {
        transport: args.transport.clone(),
        workers: workers.len(),
        sessions: args.sessions,
        concurrency: args.concurrency,
        sessions_opened: sessions.len(),
        session_open_s,
        streams_opened,
        stream_open_s,
        streams_forwarded,
        setup_errors,
        streams_ended_early,
        streams_alive_at_end,
        memory: MemoryFigures {
            rss_start_bytes: rss_start,
            rss_sessions_bytes: rss_sessions,
            rss_streams_bytes: rss_streams,
            per_session_bytes: per_session,
            per_held_stream_bytes: per_stream,
            per_session_with_stream_bytes: per_session + per_stream,
        },
        load,
    })
}

/// The workers' resident memory, summed.
fn fleet_rss(workers: &[Worker]) -> Result<u64, String> {
    workers
        .iter()
        .map(|w| {
            procfs::rss_bytes(w.pid)
                .ok_or_else(|| format!("cannot read VmRSS of worker {} ({})", w.id, w.pid))
        })
        .sum()
}

/// Lets deferred work (pooled connections, frees) finish before memory is read.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

fn merge(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (class, n) in from {
        *into.entry(class.clone()).or_default() += n;
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens one session per entry of `homes` on that worker; returns the sessions and
/// the failures by class.
async fn open_sessions(
    workers: &Arc<Vec<Worker>>,
    homes: &[usize],
    args: &ScaleArgs,
) -> (Vec<Session>, BTreeMap<String, u64>) {
    let homes = Arc::new(homes.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.parallel.clamp(1, homes.len().max(1)) {
        let (workers, homes, next) = (Arc::clone(workers), Arc::clone(&homes), Arc::clone(&next));
        let timeout = args.timeout;
        tasks.spawn(async move {
            // One keep-alive connection per worker for this opener.
            let mut slots: Vec<Option<Connection>> = workers.iter().map(|_| None).collect();
            let mut opened = Vec::new();
            let mut errors = BTreeMap::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&home) = homes.get(i) else { break };
                let target = &workers[home].target;
                match client::open_session(&mut slots[home], target, timeout).await {
                    Ok(session) => {
                        let owner = session
                            .owner
                            .and_then(|id| workers.iter().position(|w| w.id == id))
                            .unwrap_or(home);
                        opened.push(Session {
                            id: session.id,
                            owner,
                        });
                    }
                    Err(class) => *errors.entry(format!("initialize: {class}")).or_default() += 1,
                }
            }
            (opened, errors)
        });
    }
    let mut sessions = Vec::new();
    let mut errors = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        if let Ok((opened, failed)) = done {
            sessions.extend(opened);
            merge(&mut errors, &failed);
        }
    }
    (sessions, errors)
}

/// Opens every session's GET stream through `vias[i]` and leaves it open until `stop`
/// turns true; returns how many opened, the failures by class, and the holder tasks.
async fn open_streams(
    workers: &Arc<Vec<Worker>>,
    sessions: &[Session],
    vias: &[usize],
    args: &ScaleArgs,
    stop: watch::Receiver<bool>,
    ended: Arc<std::sync::Mutex<BTreeMap<String, u64>>>,
    alive: Arc<AtomicUsize>,
) -> (
    usize,
    BTreeMap<String, u64>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let opening = Arc::new(Semaphore::new(args.parallel.max(1)));
    let mut waiting = Vec::with_capacity(sessions.len());
    let mut holders = Vec::with_capacity(sessions.len());
    for (session, &via) in sessions.iter().zip(vias) {
        let (opened_tx, opened_rx) = tokio::sync::oneshot::channel();
        let target = workers[via].target.clone();
        let id = session.id.clone();
        let opening = Arc::clone(&opening);
        let (stop, ended, alive) = (stop.clone(), Arc::clone(&ended), Arc::clone(&alive));
        let timeout = args.timeout;
        holders.push(tokio::spawn(async move {
            let permit = opening.acquire_owned().await.ok();
            hold_stream(&target, &id, timeout, opened_tx, permit, stop, ended, alive).await;
        }));
        waiting.push(opened_rx);
    }
    let mut opened = 0;
    let mut errors = BTreeMap::new();
    for rx in waiting {
        match rx.await {
            Ok(Ok(())) => opened += 1,
            Ok(Err(class)) => *errors.entry(format!("GET stream: {class}")).or_default() += 1,
            Err(_) => *errors.entry("GET stream: task ended".into()).or_default() += 1,
        }
    }
    (opened, errors, holders)
}

/// Opens one session's GET stream, reports the outcome of the opening, and keeps
/// reading the stream until `stop`; a stream that ends earlier is counted in `ended`.
#[allow(clippy::too_many_arguments)]
async fn hold_stream(
    target: &Target,
    session: &HeaderValue,
    timeout: Duration,
    opened: tokio::sync::oneshot::Sender<Result<(), String>>,
    opening: Option<tokio::sync::OwnedSemaphorePermit>,
    mut stop: watch::Receiver<bool>,
    ended: Arc<std::sync::Mutex<BTreeMap<String, u64>>>,
    alive: Arc<AtomicUsize>,
) {
    let open = async {
        let stream = TcpStream::connect(&target.authority)
            .await
            .map_err(|e| format!("connect: {}", e.kind()))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = Request::builder()
            .method(Method::GET)
            .uri(target.path.as_str())
            .header(HOST, target.authority.as_str())
            .header(ACCEPT, "text/event-stream")
            .header(client::HEADER_PROTOCOL_VERSION, LEGACY_VERSION)
            .header(client::HEADER_SESSION_ID, session.clone())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("io: {e}"))?;
        let status = response.status();
        if status != StatusCode::OK {
            let body = response
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let class = client::error_class(status, &body)
                .unwrap_or_else(|| format!("http {}", status.as_u16()));
            return Err(with_reason(class, &body));
        }
        Ok::<_, String>((sender, response.into_body()))
    };
    let (sender, mut body) = match tokio::time::timeout(timeout, open).await {
        Ok(Ok(opened_stream)) => opened_stream,
        Ok(Err(class)) => {
            let _ = opened.send(Err(class));
            return;
        }
        Err(_) => {
            let _ = opened.send(Err("timeout".into()));
            return;
        }
    };
    drop(opening);
    alive.fetch_add(1, Ordering::SeqCst);
    let _ = opened.send(Ok(()));
    let why = loop {
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    break None;
                }
            }
            frame = body.frame() => match frame {
                Some(Ok(_)) => {}
                Some(Err(e)) => break Some(format!("broke: {e}")),
                None => break Some("ended".to_owned()),
            },
        }
    };
    alive.fetch_sub(1, Ordering::SeqCst);
    if let Some(why) = why {
        *lock(&ended).entry(why).or_default() += 1;
    }
    drop(sender);
}

/// An error class with the gateway's `data.reason`, when the body names one.
fn with_reason(class: String, body: &[u8]) -> String {
    let reason = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["data"]["reason"].as_str().map(str::to_owned));
    match reason {
        Some(reason) => format!("{class} {reason}"),
        None => class,
    }
}

/// What one load session counted.
struct LoadStats {
    forwarded: Histogram<u64>,
    local: Histogram<u64>,
    ok: u64,
    errors: BTreeMap<String, u64>,
}

/// The closed-loop `tools/call` load: `concurrency` sessions from the run's own, each
/// sending its next call when the last was answered, to the workers in round-robin
/// order.
async fn run_load(
    workers: &Arc<Vec<Worker>>,
    sessions: &[Session],
    args: &ScaleArgs,
) -> LoadFigures {
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sequence = Arc::new(AtomicU64::new(0));
    let step = (sessions.len() / args.concurrency.max(1)).max(1);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, session) in sessions
        .iter()
        .step_by(step)
        .take(args.concurrency)
        .enumerate()
    {
        let (workers, measuring, stop, sequence) = (
            Arc::clone(workers),
            Arc::clone(&measuring),
            Arc::clone(&stop),
            Arc::clone(&sequence),
        );
        let session = session.id.clone();
        let timeout = args.timeout;
        tasks.spawn(async move {
            let mut slots: Vec<Option<Connection>> = workers.iter().map(|_| None).collect();
            let mut stats = LoadStats {
                forwarded: new_histogram(),
                local: new_histogram(),
                ok: 0,
                errors: BTreeMap::new(),
            };
            let mut turn = i;
            while !stop.load(Ordering::Relaxed) {
                turn += 1;
                let via = turn % workers.len();
                let id = sequence.fetch_add(1, Ordering::Relaxed);
                let target = &workers[via].target;
                let request = match client::mix_request(
                    target,
                    Era::Legacy,
                    Op::CallEcho,
                    id,
                    Some(&session),
                ) {
                    Ok(request) => request,
                    Err(e) => {
                        *stats.errors.entry(e).or_default() += 1;
                        break;
                    }
                };
                let started = Instant::now();
                let outcome = client::exchange_on(&mut slots[via], target, request, timeout).await;
                let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                if !measuring.load(Ordering::Relaxed) {
                    continue;
                }
                match outcome {
                    Ok(answer) => match answer.error_class() {
                        None => {
                            stats.ok += 1;
                            let histogram = if answer.forwarded() == Some(true) {
                                &mut stats.forwarded
                            } else {
                                &mut stats.local
                            };
                            latency::record(histogram, micros);
                        }
                        Some(class) => {
                            *stats
                                .errors
                                .entry(with_reason(class, &answer.body))
                                .or_default() += 1;
                        }
                    },
                    Err(failure) => *stats.errors.entry(failure.class()).or_default() += 1,
                }
            }
            stats
        });
    }
    tokio::time::sleep(args.warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(args.duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut forwarded = new_histogram();
    let mut local = new_histogram();
    let mut ok = 0;
    let mut errors = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        if let Ok(stats) = done {
            let _ = forwarded.add(&stats.forwarded);
            let _ = local.add(&stats.local);
            ok += stats.ok;
            merge(&mut errors, &stats.errors);
        }
    }
    let window_s = started.elapsed().as_secs_f64();
    let requests = ok + errors.values().sum::<u64>();
    LoadFigures {
        window_s,
        requests,
        ok,
        throughput_rps: if window_s > 0.0 {
            ok as f64 / window_s
        } else {
            0.0
        },
        forwarded_fraction: if ok > 0 {
            forwarded.len() as f64 / ok as f64
        } else {
            0.0
        },
        forwarded_latency: LatencySummary::of(&forwarded),
        local_latency: LatencySummary::of(&local),
        errors,
    }
}

/// A small deterministic generator (xorshift64*): the same run places the same
/// sessions and streams on the same workers.
struct Rng(u64);

impl Rng {
    fn seeded() -> Self {
        Rng(0x9E37_79B9_7F4A_7C15)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1) as u64) as usize
    }
}

fn kib(bytes: f64) -> String {
    format!("{:.1} KiB", bytes / 1024.0)
}

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1000.0)
}

fn classes(map: &BTreeMap<String, u64>) -> String {
    if map.is_empty() {
        return "none".into();
    }
    map.iter()
        .map(|(class, n)| format!("{class}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The report as Markdown.
pub fn markdown(r: &ScaleReport) -> String {
    let l = &r.load;
    let m = &r.memory;
    format!(
        "## Scale: {workers} workers ({transport}), {sessions} sessions each holding a GET stream\n\n\
         | figure | value |\n|---|---:|\n\
         | sessions opened | {opened} in {sopen:.1} s |\n\
         | GET streams held | {streams} ({fwd} through a worker that is not the owner), opened in {stopen:.1} s |\n\
         | set-up errors | {setup} |\n\
         | load: tools/call, {conc} sessions, round-robin | {rps:.0} req/s over {window:.1} s |\n\
         | forwarded calls p50 / p99 | {fp50} / {fp99} ms ({fcount} calls, {frac:.0} % of all) |\n\
         | local calls p50 / p99 | {lp50} / {lp99} ms |\n\
         | errors under load | {errors} |\n\
         | streams still open at the end | {alive} of {streams} (ended early: {ended}) |\n\
         | fleet memory per session | {per_session} |\n\
         | fleet memory per held stream | {per_stream} |\n\
         | fleet memory per session with its stream held | {per_both} |\n",
        workers = r.workers,
        transport = r.transport,
        sessions = r.sessions,
        opened = r.sessions_opened,
        sopen = r.session_open_s,
        streams = r.streams_opened,
        fwd = r.streams_forwarded,
        stopen = r.stream_open_s,
        setup = classes(&r.setup_errors),
        conc = r.concurrency,
        rps = l.throughput_rps,
        window = l.window_s,
        fp50 = ms(l.forwarded_latency.p50_us),
        fp99 = ms(l.forwarded_latency.p99_us),
        fcount = l.forwarded_latency.count,
        frac = l.forwarded_fraction * 100.0,
        lp50 = ms(l.local_latency.p50_us),
        lp99 = ms(l.local_latency.p99_us),
        errors = classes(&l.errors),
        alive = r.streams_alive_at_end,
        ended = classes(&r.streams_ended_early),
        per_session = kib(m.per_session_bytes),
        per_stream = kib(m.per_held_stream_bytes),
        per_both = kib(m.per_session_with_stream_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_spreads_over_every_worker() {
        let mut rng = Rng::seeded();
        let mut seen = [0usize; 4];
        for _ in 0..4_000 {
            seen[rng.below(4)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
    }

    #[test]
    fn reasons_are_added_to_error_classes() {
        let body = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32000,"message":"x","data":{"reason":"mesh_budget_exhausted"}}}"#;
        assert_eq!(
            with_reason("http 503".into(), body),
            "http 503 mesh_budget_exhausted"
        );
        assert_eq!(with_reason("timeout".into(), b""), "timeout");
    }

    #[test]
    fn the_report_names_every_figure() {
        let report = ScaleReport {
            transport: "tcp".into(),
            workers: 4,
            sessions: 10,
            concurrency: 2,
            sessions_opened: 10,
            session_open_s: 1.0,
            streams_opened: 10,
            stream_open_s: 1.0,
            streams_forwarded: 7,
            setup_errors: BTreeMap::new(),
            streams_ended_early: BTreeMap::new(),
            streams_alive_at_end: 10,
            memory: MemoryFigures::default(),
            load: LoadFigures::default(),
        };
        let text = markdown(&report);
        for needle in [
            "req/s",
            "p50 / p99",
            "errors under load",
            "per session with its stream held",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }
}
