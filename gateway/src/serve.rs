//! `mcpgw serve` and `mcpgw worker`: runs one worker (standalone, or as a member of a
//! supervised fleet) from start to exit: joins the fleet, serves, and stops in order
//! on a signal (drain) or when fenced (exit for a fresh id).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{error, info, warn};

use mcpgw_certs::MeshTlsFiles;
use mcpgw_mesh::directory::{Directory, DirectoryConfig, DirectoryError};
use mcpgw_mesh::transport::{
    MeshClient, MeshServer, MeshServerHandle, SameHostRoute, TransportKind,
};

use crate::adoption::AdoptionKeys;
use crate::auth::Authenticator;
use crate::config::{AdoptMode, Config, MeshSameHost, MeshTransport};
use crate::execute::Executor;
use crate::fleet::Fleet;
use crate::forward::caller::Forwarder;
use crate::forward::owner::OwnerService;
use crate::front;
use crate::lease::LeaseHolder;
use crate::process::{self, StopSignals, generate_worker_id};
use crate::process::{DRAIN_GRACE, NOT_MINE_GRACE};
use crate::session::Session;
use crate::worker::Worker;

/// How long a fenced worker lets answers already being written go out before it exits.
const FENCED_GRACE: Duration = Duration::from_millis(500);

/// Runs a validated configuration: first builds the authenticator, which reads the
/// token, key and JWKS files it names, so a bad one stops the start (exit 2, as an
/// invalid setting does) before any worker runs. A standalone worker keeps it; a
/// fleet's workers each build their own from the configuration they are handed.
pub fn run(config: Config) -> ExitCode {
    let auth = match Authenticator::new(&config) {
        Ok(auth) => auth,
        Err(e) => {
            eprintln!("mcpgw: {e}");
            return ExitCode::from(2);
        }
    };
    if config.fleet.redis_url.is_some() {
        return crate::supervisor::run(config);
    }
    let threads = config.fleet.threads;
    block_on(threads, run_worker(config, None, auth))
}

/// The hidden `mcpgw worker` command: one worker process of a supervised fleet, with
/// the configuration the supervisor validated and the id it chose.
pub fn run_worker_process() -> ExitCode {
    // A worker never outlives its supervisor: if the supervisor dies (even by
    // SIGKILL), the kernel sends SIGTERM and the worker drains and exits.
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
        eprintln!("mcpgw worker: cannot follow the supervisor's lifetime: {e}");
    }
    // The supervisor may have died between our fork and the line above (then the
    // death signal was never armed). Compare with the pid it gave us, not with 1: in a
    // container the supervisor itself may be PID 1.
    let supervisor = std::env::var(process::ENV_WORKER_OF_SUPERVISOR)
        .ok()
        .and_then(|pid| pid.parse::<i32>().ok());
    if let Some(supervisor) = supervisor
        && nix::unistd::getppid() != nix::unistd::Pid::from_raw(supervisor)
    {
        eprintln!("mcpgw worker: the supervisor is already gone; exiting");
        return ExitCode::FAILURE;
    }
    let slot = (|| {
        std::env::var_os(process::ENV_WORKER_OF_SUPERVISOR)?;
        let mut config = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut config).ok()?;
        let config: Config = serde_json::from_str(&config).ok()?;
        let index = std::env::var(process::ENV_WORKER_INDEX)
            .ok()?
            .parse()
            .ok()?;
        let id = std::env::var(process::ENV_WORKER_ID_ASSIGNED)
            .ok()
            .unwrap_or_else(generate_worker_id);
        Some((config, Slot { index, id }))
    })();
    match slot {
        Some((config, slot)) => match Authenticator::new(&config) {
            Ok(auth) => block_on(config.fleet.threads, run_worker(config, Some(slot), auth)),
            Err(e) => exit_with(WorkerError::Fatal(e.to_string())),
        },
        None => {
            eprintln!(
                "mcpgw worker: started without a supervisor's configuration; use `mcpgw serve`"
            );
            ExitCode::from(2)
        }
    }
}

/// A worker's place in a supervised fleet.
struct Slot {
    /// 0..N: offsets the mesh port.
    index: usize,
    id: String,
}

/// Why a worker stopped, other than a clean drain.
enum WorkerError {
    /// Restarting would not help (bad certificates, id already leased).
    Fatal(String),
    /// Something that may pass (Redis not reachable yet).
    Failed(String),
    /// The fleet declared this worker dead: a replacement must take a new id.
    Fenced,
}

/// Runs a worker on a runtime of `threads` threads (`None`: one per CPU it may use).
fn block_on(
    threads: Option<usize>,
    work: impl std::future::Future<Output = Result<(), WorkerError>>,
) -> ExitCode {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = threads {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mcpgw: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(work);
    // Tasks still running (a connection being written, a probe) must not hold the
    // exit up.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => exit_with(error),
    }
}

/// The exit (and its log line) for why a worker stopped.
fn exit_with(error: WorkerError) -> ExitCode {
    match error {
        WorkerError::Fatal(message) => {
            error!("{message}");
            eprintln!("mcpgw: {message}");
            ExitCode::from(process::EXIT_FATAL)
        }
        WorkerError::Failed(message) => {
            error!("{message}");
            eprintln!("mcpgw: {message}");
            ExitCode::FAILURE
        }
        WorkerError::Fenced => ExitCode::from(process::EXIT_FENCED),
    }
}

async fn run_worker(
    config: Config,
    slot: Option<Slot>,
    auth: Authenticator,
) -> Result<(), WorkerError> {
    let config = Arc::new(config);
    let worker_id = match &slot {
        Some(slot) => slot.id.clone(),
        None => config
            .fleet
            .worker_id
            .clone()
            .unwrap_or_else(generate_worker_id),
    };
    let worker = Worker::new(worker_id, Arc::clone(&config), auth)
        .map_err(|e| WorkerError::Fatal(e.message))?;
    // aws-lc seeds its random generator from CPU jitter on first use, once per process
    // (up to 20 ms here, 419 million instructions under callgrind): paid now, before
    // the worker says it is ready, instead of by its first mesh or upstream handshake.
    if aws_lc_rs::rand::fill(&mut [0u8; 1]).is_err() {
        return Err(WorkerError::Fatal(
            "the system's random number generator failed".into(),
        ));
    }
    // Before anything says "ready": see StopSignals.
    let signals = StopSignals::install();
    let index = slot.as_ref().map_or(0, |slot| slot.index);
    let admin_addr = offset_addr(config.admin_listen, index)?;
    let admin = crate::admin::bind(admin_addr).await.map_err(|e| {
        WorkerError::Fatal(format!("cannot bind the admin listener {admin_addr}: {e}"))
    })?;
    let admin_addr = admin
        .local_addr()
        .map_err(|e| WorkerError::Failed(format!("cannot read the admin address: {e}")))?;
    let mesh = match &slot {
        Some(slot) => Some(join_fleet(&worker, &config, slot.index, admin_addr).await?),
        None => None,
    };
    let listener = process::bind_shared(config.listen)
        .map_err(|e| WorkerError::Fatal(format!("cannot listen on {}: {e}", config.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| WorkerError::Failed(format!("cannot read the bound address: {e}")))?;
    // `Some(grace)`: stop taking requests and let open ones finish within `grace`.
    let (stop_tx, stop_rx) = watch::channel(None::<Duration>);
    let stop = tokio::spawn(decide_stop(Arc::clone(&worker), stop_tx, signals));
    // The lease is renewed for as long as this worker holds sessions: through the
    // lame duck, the port's drain and the handover, which together may outlast the
    // lease many times over. A draining owner whose lease lapsed would refuse the
    // forwarded requests of sessions it still holds ("owner in doubt").
    let (lease_ends, lease_ends_rx) = watch::channel(false);
    let heartbeat = mesh
        .as_ref()
        .map(|_| tokio::spawn(heartbeat(Arc::clone(&worker), lease_ends_rx)));
    tokio::spawn(expire_idle_sessions(Arc::clone(&worker), stop_rx.clone()));
    tokio::spawn(crate::admin::serve(Arc::clone(&worker), admin));
    if mesh.is_some() {
        tokio::spawn(sweep_dead_workers(Arc::clone(&worker), stop_rx.clone()));
    }
    match &mesh {
        Some(mesh) => println!(
            "{} id={} mesh={} admin={admin_addr} pid={}",
            process::READY_PREFIX,
            worker.id,
            mesh.advertised,
            std::process::id()
        ),
        None => announce(&config, addr, admin_addr),
    }
    info!(worker = %worker.id, %addr, admin = %admin_addr, "worker serving");
    front::serve(Arc::clone(&worker), listener, stop_rx)
        .await
        .map_err(|e| WorkerError::Failed(format!("front failed: {e}")))?;
    stop.abort();
    if *worker.fenced().borrow() {
        // Sessions are already dropped and their records belong to whoever reclaimed
        // them; the lease is not ours to delete.
        if let Some(mesh) = mesh {
            mesh.server.shutdown(Duration::ZERO).await;
        }
        return Err(WorkerError::Fenced);
    }
    drain(&worker, mesh, lease_ends, heartbeat).await;
    info!(worker = %worker.id, "worker stopped");
    Ok(())
}

/// The one place that decides how this process ends: a signal or an operator's drain
/// request (`mcpgw drain`, `POST /drain`) drains it, a fence stops it at once for a
/// replacement under a new id. Sends the grace the port's exchanges get.
async fn decide_stop(
    worker: Arc<Worker>,
    stop_tx: watch::Sender<Option<Duration>>,
    signals: Option<StopSignals>,
) {
    let mut fenced = worker.fenced();
    let mut drain_requested = worker.drain_requests();
    let grace = tokio::select! {
        () = StopSignals::wait(signals) => DRAIN_GRACE,
        _ = drain_requested.wait_for(|requested| *requested) => DRAIN_GRACE,
        _ = fenced.wait_for(|fenced| *fenced) => FENCED_GRACE,
    };
    // Draining from the decision on, not once the port is done: /readyz says so
    // through the grace, and a request still arriving opens no session here.
    worker.start_draining();
    let delay = worker.config.limits.drain_delay;
    if grace == DRAIN_GRACE && !delay.is_zero() {
        // Lame duck: the port still serves (every answer says `Connection: close`)
        // while load balancers that follow /readyz take this worker out, so that
        // no connection is opened to it once it closes. A fence ends the pause at
        // once.
        info!(worker = %worker.id, ?delay, "draining: serving as a lame duck before the port closes");
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = fenced.wait_for(|fenced| *fenced) => {
                let _ = stop_tx.send(Some(FENCED_GRACE));
                return;
            }
        }
    }
    let _ = stop_tx.send(Some(grace));
}

/// The drain, once the public port is closed and its exchanges are done. Sessions that
/// can continue elsewhere are handed over first, while the mesh still takes requests,
/// each once the forwarded calls running in it finished (requests arriving meanwhile
/// wait): from then on a forwarded request for one is answered "not mine", and its
/// edge adopts it, so no client sees an error and no two workers act for it at once.
/// Then forwarded requests in flight finish; only then do the other sessions end
/// (upstream and in the directory), so later requests for them get a fast "gone".
async fn drain(
    worker: &Arc<Worker>,
    mesh: Option<MeshMembership>,
    lease_ends: watch::Sender<bool>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
) {
    worker.start_draining();
    end_sessions(worker, Ending::HandOver).await;
    if let Some(mesh) = &mesh
        && !mesh.server.wait_idle(DRAIN_GRACE).await
    {
        warn!(worker = %worker.id, "forwarded requests still running at the drain deadline");
    }
    end_sessions(worker, Ending::End).await;
    // The heartbeat ends before the lease is deregistered, so it can never write the
    // lease back after it was removed.
    let _ = lease_ends.send(true);
    if let Some(heartbeat) = heartbeat {
        let _ = heartbeat.await;
    }
    if let Some(fleet) = worker.fleet() {
        fleet.lease.deregister().await;
    }
    if let Some(mesh) = mesh {
        // Requests still arriving for the ended sessions are answered "not mine" (the
        // caller then finds them ended) rather than cut by a closing endpoint.
        tokio::time::sleep(NOT_MINE_GRACE).await;
        mesh.server.shutdown(Duration::from_secs(1)).await;
    }
}

/// The keys sessions are recorded for adoption with, or none when `--adopt never`.
/// Without a key file the upstream session ids are recorded in the clear, which the
/// log says once.
fn adoption_keys(config: &Config) -> Result<Option<AdoptionKeys>, WorkerError> {
    if config.fleet.adopt == AdoptMode::Never {
        return Ok(None);
    }
    match &config.fleet.adoption_key_file {
        Some(path) => AdoptionKeys::load(path)
            .map(Some)
            .map_err(WorkerError::Fatal),
        None => {
            info!(
                "adoption records hold upstream session ids in the clear (no --adoption-key-file): the directory is inside the trust boundary"
            );
            Ok(Some(AdoptionKeys::default()))
        }
    }
}

/// Hands over (see [`Ending`]) or ends the sessions of a draining worker, upstream and
/// in the directory: many at a time, and within the drain's grace. A session not ended
/// by then (Redis or the upstream not answering) is left to expire upstream and to the
/// fleet's sweeper.
async fn end_sessions(worker: &Arc<Worker>, ending: Ending) {
    use futures_util::StreamExt;
    let ids = worker.sessions.ids();
    let total = ids.len();
    let ending = futures_util::stream::iter(ids).for_each_concurrent(ENDING_AT_ONCE, |id| {
        let worker = Arc::clone(worker);
        async move {
            let Some(session) = worker.sessions.get(&id) else {
                return;
            };
            match ending {
                Ending::HandOver => {
                    if hand_over(&worker, &session).await {
                        worker.metrics.session_ended("handed_over", 1);
                    }
                }
                Ending::End => {
                    Executor::of(&worker).end_session(&session).await;
                    worker.metrics.session_ended("drained", 1);
                }
            }
        }
    });
    if tokio::time::timeout(DRAIN_GRACE, ending).await.is_err() {
        let left = worker.sessions.len();
        warn!(worker = %worker.id, total, left, "sessions still ending at the drain deadline; the sweeper takes their records");
    }
}

/// Which sessions a pass of [`end_sessions`] takes.
#[derive(Clone, Copy)]
enum Ending {
    /// Those that can continue elsewhere, handed over for adoption.
    HandOver,
    /// All that are left, ended here and upstream.
    End,
}

/// Leaves `session` for another worker to adopt instead of ending it, when its state
/// lives in its HTTP upstream. Only once no call of it runs here: from the moment the
/// move begins no exchange enters it (requests for it wait for the move, then go to the
/// adopter), its streams end, and the calls still running in it finish first, so the
/// adopter never acts while this worker still does. False when it cannot continue
/// elsewhere, its calls ran past the drain's grace, or the directory did not take it:
/// then it is ended as before.
async fn hand_over(worker: &Worker, session: &Session) -> bool {
    let Some(fleet) = worker.fleet() else {
        return false;
    };
    if fleet.adoption.is_none() || !session.link.continues_elsewhere() {
        return false;
    }
    let Some(transit) = worker.sessions.begin_transit(&session.id) else {
        return false;
    };
    session.streams.close();
    if tokio::time::timeout(DRAIN_GRACE, session.unused())
        .await
        .is_err()
    {
        warn!(session = %session.tag, "calls still running in the session at the drain deadline; ending it");
        return false;
    }
    let handed_over = match fleet
        .directory
        .hand_over_session(&session.id, &worker.id)
        .await
    {
        Ok(true) => {
            worker.sessions.remove(&session.id);
            true
        }
        Ok(false) => false,
        Err(e) => {
            warn!(session = %session.tag, error = %e, "could not hand the session over; ending it");
            false
        }
    };
    // Requests that waited for the move go on now: to the adopter, or (not handed
    // over) here until the session ends.
    drop(transit);
    handed_over
}

/// Sessions a drain ends at once: each may wait on Redis and the upstream.
const ENDING_AT_ONCE: usize = 64;

/// Ends idle sessions until the worker stops, checking a few times per idle timeout.
async fn expire_idle_sessions(worker: Arc<Worker>, mut stop: watch::Receiver<Option<Duration>>) {
    let period = (worker.config.limits.session_idle_timeout / 4)
        .clamp(Duration::from_millis(50), Duration::from_secs(30));
    loop {
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            _ = stop.wait_for(Option::is_some) => return,
        }
        let expired = Executor::of(&worker).expire_idle_sessions().await;
        if expired > 0 {
            info!(worker = %worker.id, expired, "idle sessions ended");
        }
    }
}

/// Takes a turn at sweeping dead workers' keys every sweep interval (one worker of the
/// fleet sweeps at a time) until the worker stops.
async fn sweep_dead_workers(worker: Arc<Worker>, mut stop: watch::Receiver<Option<Duration>>) {
    let Some(fleet) = worker.fleet() else { return };
    let fleet = Arc::clone(fleet);
    loop {
        tokio::select! {
            () = tokio::time::sleep(fleet.config.fleet.sweep_interval()) => {}
            _ = stop.wait_for(Option::is_some) => return,
        }
        if let Err(e) = fleet.sweep().await {
            warn!(worker = %worker.id, error = %e, "sweeping dead workers failed; the next turn retries");
        }
    }
}

/// Renews the lease every third of its time until `lease_ends` says the worker gives
/// it up, or the worker is fenced (the lease is lost for good).
async fn heartbeat(worker: Arc<Worker>, mut lease_ends: watch::Receiver<bool>) {
    let period = worker.config.fleet.lease / 3;
    let mut fenced = worker.fenced();
    loop {
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            () = failover_seen(&worker) => {}
            _ = lease_ends.wait_for(|ends| *ends) => return,
            _ = fenced.wait_for(|fenced| *fenced) => return,
        }
        worker.renew_lease(false).await;
    }
}

/// Resolves when the fleet directory saw a Redis failover (never without a fleet).
async fn failover_seen(worker: &Worker) {
    match worker.fleet() {
        Some(fleet) => fleet.lease.failover_seen().await,
        None => std::future::pending().await,
    }
}

/// What a fleet worker keeps of its mesh membership.
struct MeshMembership {
    server: MeshServerHandle,
    /// The address peers dial, as registered in the directory.
    advertised: String,
}

/// Binds the mesh endpoint and registers the worker (refusing to start if its id is
/// leased).
async fn join_fleet(
    worker: &Arc<Worker>,
    config: &Arc<Config>,
    index: usize,
    admin_addr: std::net::SocketAddr,
) -> Result<MeshMembership, WorkerError> {
    mcpgw_certs::install_crypto_provider();
    let bound = match config.mesh.transport {
        MeshTransport::Redis => bind_redis_mesh(worker, config).await?,
        MeshTransport::Quic | MeshTransport::Tcp => bind_tls_mesh(worker, config, index).await?,
    };
    let (directory, lease) = register(worker, config, admin_addr, &bound).await?;
    if let Some(tls) = &bound.tls {
        follow_reloads(tls, &lease);
        let _ = worker.mesh_tls.set(tls.clone());
    }
    let boot_id = bound.same_host.as_ref().map(|route| route.boot_id.as_str());
    let (client, probe_client) = mesh_clients(worker, config, bound.kind, bound.dial).await?;
    if let Some(boot_id) = boot_id {
        for mesh in [&client, &probe_client] {
            mesh.use_same_host(boot_id)
                .map_err(|e| WorkerError::Fatal(e.to_string()))?;
        }
    }
    let forwarder = Forwarder::new(
        worker.id.clone(),
        directory.clone(),
        Arc::clone(&lease),
        client,
        probe_client,
        Arc::clone(config),
        Arc::clone(&worker.metrics),
    );
    let fleet = Arc::new(Fleet::new(
        worker.id.clone(),
        directory,
        lease,
        Arc::clone(config),
        Arc::clone(&worker.metrics),
        adoption_keys(config)?,
    ));
    let _ = worker.mesh_streams.set((
        forwarder.mesh.stream_counter(),
        bound.server.stream_counter(),
    ));
    worker.join(fleet, forwarder);
    let (server, advertised) = (bound.server, bound.advertised);
    info!(worker = %worker.id, mesh = %advertised, transport = %bound.kind, "joined the fleet");
    Ok(MeshMembership { server, advertised })
}

/// A mesh endpoint bound and not yet registered.
struct BoundMesh {
    kind: TransportKind,
    server: MeshServerHandle,
    /// The address (or Redis channel) peers reach it at.
    advertised: String,
    dial: Dial,
    /// The mesh TLS material, whose identity and leaf expiry are published with the
    /// lease (none over the Redis transport, which has no certificates).
    tls: Option<mcpgw_certs::MeshTlsSource>,
    /// The same-host socket served beside the endpoint, published with the lease.
    same_host: Option<SameHostRoute>,
}

/// What this worker's mesh client needs to reach its peers: the mTLS material, or the
/// Redis that carries the baseline transport.
enum Dial {
    Tls(mcpgw_certs::MeshTlsSource),
    Redis(mcpgw_mesh::transport::RedisTransportConfig),
}

/// The measured baseline: requests travel through the fleet's Redis, on channels named
/// by worker id. No socket to bind and no mTLS (Redis is the trust boundary).
async fn bind_redis_mesh(worker: &Arc<Worker>, config: &Config) -> Result<BoundMesh, WorkerError> {
    let redis = mcpgw_mesh::transport::RedisTransportConfig {
        redis_url: config.fleet.redis_url.clone().unwrap_or_default(),
        prefix: config.fleet.key_prefix.clone(),
    };
    let service = Arc::new(OwnerService(Arc::clone(worker)));
    let limits = config.mesh.limits.clone();
    let server = MeshServer::bind_redis(redis.clone(), worker.id.clone(), service, limits)
        .await
        .map_err(|e| WorkerError::Failed(format!("cannot take the mesh channel: {e}")))?;
    // Callers derive the channel from the worker id; the directory records it for
    // operators.
    let advertised = server.redis_channel().unwrap_or_default().to_owned();
    Ok(BoundMesh {
        kind: TransportKind::Redis,
        server,
        advertised,
        dial: Dial::Redis(redis),
        tls: None,
        same_host: None,
    })
}

/// Binds the QUIC or TCP endpoint with the mesh TLS material, followed from now on:
/// new handshakes take reloaded material, a bad file is refused and the material in
/// use stays.
async fn bind_tls_mesh(
    worker: &Arc<Worker>,
    config: &Config,
    index: usize,
) -> Result<BoundMesh, WorkerError> {
    let mesh = &config.mesh;
    let (Some(ca), Some(cert), Some(key)) = (&mesh.ca, &mesh.cert, &mesh.key) else {
        return Err(WorkerError::Fatal(
            "a fleet worker needs --mesh-ca, --mesh-cert and --mesh-key".into(),
        ));
    };
    let files = MeshTlsFiles {
        ca: ca.clone(),
        cert: cert.clone(),
        key: key.clone(),
    };
    let trust_domain = mcpgw_certs::TrustDomain::new(&mesh.trust_domain)
        .map_err(|e| WorkerError::Fatal(e.to_string()))?;
    let tls = mcpgw_certs::MeshTlsSource::watch(
        &files,
        &mcpgw_mesh::transport::mesh_tls_settings(trust_domain),
        mcpgw_certs::ReloadOptions {
            poll_interval: mesh.cert_reload_interval,
            ..mcpgw_certs::ReloadOptions::default()
        },
    )
    .map_err(|e| WorkerError::Fatal(e.to_string()))?;
    let kind = if mesh.transport == MeshTransport::Quic {
        TransportKind::Quic
    } else {
        TransportKind::Tcp
    };
    let mut listen = mesh.listen;
    if listen.port() != 0 {
        listen.set_port(offset_port(listen.port(), index)?);
    }
    let mut server = MeshServer::bind(
        kind,
        listen,
        tls.clone(),
        worker.id.clone(),
        Arc::new(OwnerService(Arc::clone(worker))),
        mesh.limits.clone(),
        Some(Arc::clone(&worker.metrics) as _),
    )
    .await
    .map_err(|e| WorkerError::Fatal(format!("cannot bind the mesh endpoint {listen}: {e}")))?;
    let advertised = advertise_addr(mesh.advertise.as_deref(), server.local_addr(), index)
        .map_err(WorkerError::Fatal)?;
    let same_host = match mesh.same_host {
        MeshSameHost::Unix => Some(serve_same_host(&mut server, mesh, &worker.id)?),
        MeshSameHost::Off => None,
    };
    Ok(BoundMesh {
        kind,
        server,
        advertised,
        dial: Dial::Tls(tls.clone()),
        tls: Some(tls),
        same_host,
    })
}

/// Serves the worker's same-host socket beside its TCP endpoint, and says how callers
/// on this kernel reach it.
fn serve_same_host(
    server: &mut MeshServerHandle,
    mesh: &crate::config::MeshConfig,
    worker_id: &str,
) -> Result<SameHostRoute, WorkerError> {
    let boot_id = process::kernel_boot_id().map_err(|e| WorkerError::Fatal(e.to_string()))?;
    let path = mcpgw_mesh::transport::prepare_socket_path(&mesh.socket_dir(), worker_id)
        .map_err(|e| WorkerError::Fatal(e.to_string()))?;
    server.serve_same_host(&path).map_err(|e| {
        WorkerError::Fatal(format!(
            "cannot serve the mesh socket {}: {e}",
            path.display()
        ))
    })?;
    info!(path = %path.display(), "mesh same-host socket: workers of this user on this kernel forward here without TLS");
    Ok(SameHostRoute { boot_id, path })
}

/// Connects to the fleet directory and registers this worker's lease at `bound`'s
/// address (refusing to start if its id is leased).
async fn register(
    worker: &Arc<Worker>,
    config: &Config,
    admin_addr: std::net::SocketAddr,
    bound: &BoundMesh,
) -> Result<(Directory, Arc<LeaseHolder>), WorkerError> {
    let directory = Directory::connect(DirectoryConfig {
        redis_url: config.fleet.redis_url.clone().unwrap_or_default(),
        prefix: config.fleet.key_prefix.clone(),
        lease: config.fleet.lease,
        op_timeout: config.fleet.directory_timeout,
        adoptable_for: config.limits.session_idle_timeout,
        ..DirectoryConfig::default()
    })
    .await
    .map_err(|e| WorkerError::Failed(e.to_string()))?;
    directory.observe_with(Arc::clone(&worker.metrics) as _);
    let registered_at = tokio::time::Instant::now();
    let mut info = process::worker_info(Some(admin_addr.to_string()));
    let tls = bound.tls.as_ref();
    info.mesh_identity = tls.map(|tls| tls.current().leaf().uri.clone());
    info.same_host = bound.same_host.clone();
    let cert_not_after = tls.map(|tls| tls.current().leaf_not_after());
    let lease = match directory
        .register_worker_with_cert(&worker.id, &info, &bound.advertised, cert_not_after)
        .await
    {
        Ok(lease) => lease,
        Err(e @ DirectoryError::WorkerIdTaken { .. }) => {
            return Err(WorkerError::Fatal(format!("refusing to start: {e}")));
        }
        Err(e) => return Err(WorkerError::Failed(e.to_string())),
    };
    let lease = LeaseHolder::new(
        directory.clone(),
        info,
        lease,
        config.fleet.lease,
        registered_at,
    );
    Ok((directory, Arc::new(lease)))
}

/// The mesh clients that forward and that probe owners (a probe dials a fresh
/// connection, so it needs a pool of its own).
async fn mesh_clients(
    worker: &Arc<Worker>,
    config: &Config,
    kind: TransportKind,
    dial: Dial,
) -> Result<(MeshClient, MeshClient), WorkerError> {
    let limits = config.mesh.limits.clone();
    match dial {
        Dial::Tls(tls) => {
            let client = || {
                let observer = Some(Arc::clone(&worker.metrics) as _);
                MeshClient::new(
                    kind,
                    tls.clone(),
                    worker.id.clone(),
                    limits.clone(),
                    observer,
                )
                .map_err(|e| WorkerError::Fatal(e.to_string()))
            };
            Ok((client()?, client()?))
        }
        Dial::Redis(redis) => {
            // One client serves both: a second would subscribe the worker's reply
            // channel twice and receive every reply twice, and a probe over Redis is a
            // fresh PUBLISH anyway, with no pooled connection to go stale.
            let client = MeshClient::new_redis(redis, worker.id.clone(), limits)
                .await
                .map_err(|e| WorkerError::Failed(e.to_string()))?;
            Ok((client.clone(), client))
        }
    }
}

/// Keeps the lease's published leaf expiry in step with reloads of the mesh material,
/// for as long as the material is followed.
fn follow_reloads(tls: &mcpgw_certs::MeshTlsSource, lease: &Arc<LeaseHolder>) {
    let mut changes = tls.subscribe();
    let lease = Arc::downgrade(lease);
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let Some(lease) = lease.upgrade() else { return };
            let not_after = changes.borrow_and_update().leaf_not_after();
            lease.publish_cert_not_after(not_after);
        }
    });
}

/// Worker `index`'s address: the configured port + index (port 0 stays 0: free port).
fn offset_addr(
    mut addr: std::net::SocketAddr,
    index: usize,
) -> Result<std::net::SocketAddr, WorkerError> {
    if addr.port() != 0 {
        addr.set_port(offset_port(addr.port(), index)?);
    }
    Ok(addr)
}

fn offset_port(port: u16, index: usize) -> Result<u16, WorkerError> {
    u16::try_from(usize::from(port) + index).map_err(|_| {
        WorkerError::Fatal(format!(
            "mesh port {port} + worker index {index} exceeds 65535"
        ))
    })
}

/// The mesh address peers dial: `--mesh-advertise` (host, or host:port offset by the
/// worker index), else the bound address.
fn advertise_addr(
    advertise: Option<&str>,
    bound: std::net::SocketAddr,
    index: usize,
) -> Result<String, String> {
    match advertise {
        None if bound.ip().is_unspecified() => Err(format!(
            "the mesh binds {bound}, which peers cannot dial: set --mesh-advertise HOST[:PORT]"
        )),
        None => Ok(bound.to_string()),
        Some(advertised) => match advertised.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                let port: u16 = port.parse().unwrap_or(0);
                let port = u16::try_from(usize::from(port) + index)
                    .map_err(|_| format!("advertised mesh port {port} + {index} exceeds 65535"))?;
                Ok(format!("{host}:{port}"))
            }
            _ => Ok(format!("{advertised}:{}", bound.port())),
        },
    }
}

/// One stdout line that scripts and tests wait for, then the endpoints.
fn announce(config: &Config, addr: std::net::SocketAddr, admin: std::net::SocketAddr) {
    println!("mcpgw listening on http://{addr} (admin: http://{admin})");
    for upstream in &config.upstreams {
        println!(
            "  /servers/{}/mcp -> {}",
            upstream.name,
            upstream.describe()
        );
    }
    if let Some(only) = config.default_upstream() {
        println!("  /mcp -> {}", only.describe());
    }
}
