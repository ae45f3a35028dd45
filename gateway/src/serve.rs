//! `mcpgw serve` and `mcpgw worker`: runs one worker (standalone, or as a member of a
//! supervised fleet), waits for a signal, drains.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{error, info, warn};

use mcpgw_certs::MeshTlsFiles;
use mcpgw_mesh::directory::{Directory, DirectoryConfig, DirectoryError};
use mcpgw_mesh::transport::{MeshClient, MeshLimits, MeshServer, MeshServerHandle, TransportKind};

use crate::config::{Config, MeshTransport};
use crate::fleet::{self, Fleet};
use crate::forward::OwnerService;
use crate::worker::Worker;
use crate::{front, supervisor};

/// How long open client exchanges may run on after a shutdown signal.
const DRAIN_GRACE: Duration = Duration::from_secs(10);

pub fn run(config: Config) -> ExitCode {
    if config.fleet.redis_url.is_some() {
        return crate::supervisor::run(config);
    }
    block_on(run_worker(config, None))
}

/// The hidden `mcpgw worker` command: one worker process of a supervised fleet, with
/// the configuration the supervisor validated and the id it chose.
pub fn run_worker_process() -> ExitCode {
    // A worker never outlives its supervisor: if the supervisor dies (even by
    // SIGKILL), the kernel sends SIGTERM and the worker drains and exits.
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
        eprintln!("mcpgw worker: cannot follow the supervisor's lifetime: {e}");
    }
    if nix::unistd::getppid() == nix::unistd::Pid::from_raw(1) {
        eprintln!("mcpgw worker: the supervisor is already gone; exiting");
        return ExitCode::FAILURE;
    }
    let slot = (|| {
        let config = std::env::var(supervisor::ENV_WORKER_CONFIG).ok()?;
        let config: Config = serde_json::from_str(&config).ok()?;
        let index = std::env::var(supervisor::ENV_WORKER_INDEX)
            .ok()?
            .parse()
            .ok()?;
        let id = std::env::var(supervisor::ENV_WORKER_ID_ASSIGNED)
            .ok()
            .unwrap_or_else(generate_worker_id);
        Some((config, Slot { index, id }))
    })();
    match slot {
        Some((config, slot)) => block_on(run_worker(config, Some(slot))),
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

/// Why a worker stopped before serving.
enum WorkerError {
    /// Restarting would not help (bad certificates, id already leased).
    Fatal(String),
    /// Something that may pass (Redis not reachable yet).
    Failed(String),
}

fn block_on(work: impl std::future::Future<Output = Result<(), WorkerError>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mcpgw: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(WorkerError::Fatal(message)) => {
            error!("{message}");
            eprintln!("mcpgw: {message}");
            ExitCode::from(supervisor::EXIT_FATAL)
        }
        Err(WorkerError::Failed(message)) => {
            error!("{message}");
            eprintln!("mcpgw: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run_worker(config: Config, slot: Option<Slot>) -> Result<(), WorkerError> {
    let config = Arc::new(config);
    let worker_id = match &slot {
        Some(slot) => slot.id.clone(),
        None => config
            .fleet
            .worker_id
            .clone()
            .unwrap_or_else(generate_worker_id),
    };
    let worker =
        Worker::new(worker_id, Arc::clone(&config)).map_err(|e| WorkerError::Fatal(e.message))?;
    let mesh = match &slot {
        Some(slot) => Some(join_fleet(&worker, &config, slot.index).await?),
        None => None,
    };
    let listener = front::bind_shared(config.listen)
        .map_err(|e| WorkerError::Fatal(format!("cannot listen on {}: {e}", config.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| WorkerError::Failed(format!("cannot read the bound address: {e}")))?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(true);
    });
    match &mesh {
        Some(mesh) => println!(
            "{} id={} mesh={} pid={}",
            supervisor::READY_PREFIX,
            worker.id,
            mesh.advertised,
            std::process::id()
        ),
        None => announce(&config, addr),
    }
    info!(worker = %worker.id, %addr, "worker serving");
    front::serve(Arc::clone(&worker), listener, shutdown_rx, DRAIN_GRACE)
        .await
        .map_err(|e| WorkerError::Failed(format!("front failed: {e}")))?;
    // Drain: the public port is closed and its exchanges are done; forwarded requests
    // in flight finish next; only then do the sessions end (upstream and in the
    // directory), so later requests for them get a fast "gone".
    worker.start_draining();
    if let Some(mesh) = &mesh
        && !mesh.server.wait_idle(DRAIN_GRACE).await
    {
        warn!(worker = %worker.id, "forwarded requests still running at the drain deadline");
    }
    for id in worker.sessions.ids() {
        if let Some(session) = worker.sessions.get(&id) {
            worker.end_session(&session).await;
        }
    }
    if let Some(fleet) = worker.fleet() {
        fleet.deregister().await;
    }
    if let Some(mesh) = mesh {
        mesh.server.shutdown(Duration::from_secs(1)).await;
    }
    info!(worker = %worker.id, "worker stopped");
    Ok(())
}

/// What a fleet worker keeps of its mesh membership.
struct MeshMembership {
    server: MeshServerHandle,
    /// The address peers dial, as registered in the directory.
    advertised: String,
}

/// Binds the mesh endpoint, registers the worker (refusing to start if its id is
/// leased), and starts the heartbeat.
async fn join_fleet(
    worker: &Arc<Worker>,
    config: &Arc<Config>,
    index: usize,
) -> Result<MeshMembership, WorkerError> {
    mcpgw_certs::install_crypto_provider();
    let mesh = &config.mesh;
    let limits = MeshLimits {
        max_frame: mesh.max_frame_bytes,
        max_in_flight_per_peer: mesh.max_in_flight_per_peer,
        max_streams_per_peer: mesh.max_streams_per_peer,
        tcp_pool_size: mesh.tcp_connections_per_peer,
        stream_window: mesh.stream_window_bytes,
        connect_timeout: mesh.connect_timeout,
        ..MeshLimits::default()
    };
    let service = Arc::new(OwnerService(Arc::clone(worker)));
    /// What this worker's mesh client needs to reach its peers: the mTLS client
    /// config, or the Redis that carries the baseline transport.
    enum Dial<Tls> {
        Tls(Tls),
        Redis(mcpgw_mesh::transport::RedisTransportConfig),
    }
    let (kind, server, advertised, dial) = match mesh.transport {
        // The measured baseline: requests travel through the fleet's Redis, on
        // channels named by worker id. No socket to bind and no mTLS (Redis is the
        // trust boundary).
        MeshTransport::Redis => {
            let redis = mcpgw_mesh::transport::RedisTransportConfig {
                redis_url: config.fleet.redis_url.clone().unwrap_or_default(),
                prefix: config.fleet.key_prefix.clone(),
            };
            let server =
                MeshServer::bind_redis(redis.clone(), worker.id.clone(), service, limits.clone())
                    .await
                    .map_err(|e| {
                        WorkerError::Failed(format!("cannot take the mesh channel: {e}"))
                    })?;
            // Callers derive the channel from the worker id; the directory records it
            // for operators.
            let advertised = server.redis_channel().unwrap_or_default().to_owned();
            (TransportKind::Redis, server, advertised, Dial::Redis(redis))
        }
        MeshTransport::Quic | MeshTransport::Tcp => {
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
            let server_tls = mcpgw_certs::server_config(&files)
                .map_err(|e| WorkerError::Fatal(e.to_string()))?;
            let client_tls = mcpgw_certs::client_config(&files)
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
            let server = MeshServer::bind(
                kind,
                listen,
                server_tls,
                worker.id.clone(),
                service,
                limits.clone(),
            )
            .await
            .map_err(|e| {
                WorkerError::Fatal(format!("cannot bind the mesh endpoint {listen}: {e}"))
            })?;
            let advertised = advertise_addr(mesh.advertise.as_deref(), server.local_addr(), index)
                .map_err(WorkerError::Fatal)?;
            (kind, server, advertised, Dial::Tls(client_tls))
        }
    };
    let redis_url = config.fleet.redis_url.clone().unwrap_or_default();
    let directory = Directory::connect(DirectoryConfig {
        redis_url,
        prefix: config.fleet.key_prefix.clone(),
        lease: config.fleet.lease,
        op_timeout: config.fleet.directory_timeout,
        ..DirectoryConfig::default()
    })
    .await
    .map_err(|e| WorkerError::Failed(e.to_string()))?;
    let lease = match directory
        .register_worker(&worker.id, &fleet::worker_info(), &advertised)
        .await
    {
        Ok(lease) => lease,
        Err(e @ DirectoryError::WorkerIdTaken { .. }) => {
            return Err(WorkerError::Fatal(format!("refusing to start: {e}")));
        }
        Err(e) => return Err(WorkerError::Failed(e.to_string())),
    };
    let (client, probe_client) = match dial {
        Dial::Tls(client_tls) => (
            MeshClient::new(kind, client_tls.clone(), worker.id.clone(), limits.clone())
                .map_err(|e| WorkerError::Fatal(e.to_string()))?,
            MeshClient::new(kind, client_tls, worker.id.clone(), limits)
                .map_err(|e| WorkerError::Fatal(e.to_string()))?,
        ),
        Dial::Redis(redis) => {
            // One client serves both: a second would subscribe the worker's reply
            // channel twice and receive every reply twice, and a probe over Redis is a
            // fresh PUBLISH anyway, with no pooled connection to go stale.
            let client = MeshClient::new_redis(redis, worker.id.clone(), limits)
                .await
                .map_err(|e| WorkerError::Failed(e.to_string()))?;
            (client.clone(), client)
        }
    };
    let fleet = Arc::new(Fleet::new(
        directory,
        lease,
        client,
        probe_client,
        Arc::clone(config),
    ));
    worker.join(Arc::clone(&fleet));
    tokio::spawn(fleet.heartbeat(Arc::clone(worker)));
    info!(worker = %worker.id, mesh = %advertised, transport = %kind, "joined the fleet");
    Ok(MeshMembership { server, advertised })
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
fn announce(config: &Config, addr: std::net::SocketAddr) {
    println!("mcpgw listening on http://{addr}");
    for upstream in &config.upstreams {
        println!("  /servers/{}/mcp -> {}", upstream.name, upstream.url);
    }
    if let Some(only) = config.default_upstream() {
        println!("  /mcp -> {}", only.url);
    }
}

pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process can only be killed; serve until then.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: draining"),
        _ = int.recv() => info!("SIGINT: draining"),
    }
}

/// `host-pid-random`: readable in logs, unique across hosts and restarts.
pub fn generate_worker_id() -> String {
    let host = hostname()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(24)
        .collect::<String>();
    let host = if host.is_empty() {
        "host".to_owned()
    } else {
        host
    };
    let mut random = [0u8; 3];
    let _ = getrandom::fill(&mut random);
    format!(
        "{host}-{}-{:02x}{:02x}{:02x}",
        std::process::id(),
        random[0],
        random[1],
        random[2]
    )
}

/// This host's (container's) name, for worker ids and the lease's host field.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_owned()
}
