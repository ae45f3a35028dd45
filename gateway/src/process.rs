//! What a worker is as an operating-system process: its id, the host it runs on, the
//! signals it obeys, the protocol between supervisor and worker (environment, stdout
//! line, exit codes), and the public port every worker of a host shares.

use std::net::SocketAddr;
use std::time::Duration;

use tracing::{info, warn};

/// Set on a worker process started by a supervisor, to the supervisor's pid: its
/// resolved configuration comes on stdin (never in the environment, where other tools
/// would see the Redis password).
pub const ENV_WORKER_OF_SUPERVISOR: &str = "MCPGW_WORKER_OF_SUPERVISOR";
/// The worker's slot (0..N): picks its mesh port.
pub const ENV_WORKER_INDEX: &str = "MCPGW_WORKER_INDEX";
/// How log lines are written (`text` or `json`); passed on to workers.
pub const ENV_LOG_FORMAT: &str = "MCPGW_LOG_FORMAT";

/// The log format this process chose at start, for the workers it starts.
static LOG_FORMAT: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

pub fn set_log_format(format: &'static str) {
    let _ = LOG_FORMAT.set(format);
}

pub fn log_format() -> &'static str {
    LOG_FORMAT.get().copied().unwrap_or("text")
}

/// A fixed worker id for the process (otherwise it generates its own).
pub const ENV_WORKER_ID_ASSIGNED: &str = "MCPGW_WORKER_ID_ASSIGNED";

/// Stands in for the kernel's boot id, so a test can make a worker look like one of
/// another host (another kernel) while its socket stays reachable. Never set it in
/// production: two hosts that claimed one boot id would try each other's sockets (and
/// fall back to TCP, finding none).
pub const ENV_TEST_BOOT_ID: &str = "MCPGW_TEST_BOOT_ID";

/// The kernel's boot id, which tells whether two workers share a kernel (see
/// [`ENV_TEST_BOOT_ID`]).
pub fn kernel_boot_id() -> Result<String, mcpgw_mesh::transport::MeshError> {
    match std::env::var(ENV_TEST_BOOT_ID) {
        Ok(id) if !id.trim().is_empty() => Ok(id.trim().to_owned()),
        _ => mcpgw_mesh::transport::kernel_boot_id(),
    }
}

/// What a worker prints on stdout once it serves; the supervisor waits for it.
pub const READY_PREFIX: &str = "mcpgw worker ready";

/// Exit code of a worker that must not be restarted as is (bad configuration, its id
/// is already leased): the supervisor stops instead of looping.
pub const EXIT_FATAL: u8 = 3;

/// Exit code of a worker that lost its lease (fenced): the supervisor starts a
/// replacement under a new id.
pub const EXIT_FENCED: u8 = 75;

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

/// What this process publishes about itself with its lease. `admin`: its admin
/// listener's address.
pub fn worker_info(admin: Option<String>) -> mcpgw_mesh::directory::WorkerInfo {
    mcpgw_mesh::directory::WorkerInfo {
        admin,
        pid: std::process::id(),
        host: hostname(),
        started_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        mesh_identity: None,
        same_host: None,
    }
}

/// The process's SIGTERM and SIGINT, caught from the moment [`StopSignals::install`]
/// returns. Installed before the process says it is ready: a signal sent right after
/// the ready line must start a drain, not kill the process (the default action, while
/// no handler is installed) or go unseen (a handler installed with nobody listening).
pub struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Catches both signals from now on; None when the handlers cannot be installed
    /// (the process can then only be killed). Inside the runtime.
    pub fn install() -> Option<StopSignals> {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some(StopSignals { term, int }),
            (Err(e), _) | (_, Err(e)) => {
                warn!(error = %e, "cannot catch SIGTERM and SIGINT: this process drains only when asked over its admin listener");
                None
            }
        }
    }

    /// Resolves when the process is asked to stop; never without handlers.
    pub async fn wait(signals: Option<StopSignals>) {
        let Some(mut signals) = signals else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = signals.term.recv() => info!("SIGTERM: draining"),
            _ = signals.int.recv() => info!("SIGINT: draining"),
        }
    }
}

/// Binds `addr` so that every worker process can bind it too: the kernel spreads
/// connections over them (SO_REUSEPORT).
pub fn bind_shared(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = shared_socket(addr)?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// A bound, not listening, SO_REUSEPORT socket: holds a port for the workers without
/// taking connections (only listening sockets receive them).
pub fn reserve_shared(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    shared_socket(addr)
}

fn shared_socket(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// How long open client exchanges may run on after a shutdown signal.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// How long a drained worker's mesh endpoint stays up after its sessions ended, so
/// peers that still send to it hear "not mine" instead of a closed connection.
pub const NOT_MINE_GRACE: Duration = Duration::from_millis(500);

/// The longest a drain takes after its lame-duck delay: the public port's exchanges,
/// the handover, forwarded requests in flight and ending the sessions (one grace
/// each), then "not mine" answers and the mesh's close. Supervisors, Kubernetes'
/// termination grace and compose's stop grace must allow this plus the delay.
pub const DRAIN_WORST_CASE: Duration = Duration::from_millis(
    4 * DRAIN_GRACE.as_millis() as u64 + NOT_MINE_GRACE.as_millis() as u64 + 1000,
);

/// `--drain-delay-ms`'s long help, which says [`DRAIN_WORST_CASE`]: the deployment
/// checks (tests/tests/kubernetes.rs) read it from there, not from a copy.
pub fn drain_delay_help() -> String {
    format!(
        "On a drain, keep serving the public port this long (milliseconds, default 0) with \
         /readyz at 503 and `Connection: close`, before it closes. After it, a drain takes at \
         most {} s (drain worst case): a supervisor's, Kubernetes' or compose's stop grace \
         must allow the delay plus that.",
        DRAIN_WORST_CASE.as_secs_f64()
    )
}
