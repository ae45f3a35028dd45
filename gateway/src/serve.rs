//! `mcpgw serve`: starts a worker in this process, waits for a signal, drains.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{error, info};

use crate::config::Config;
use crate::front;
use crate::worker::Worker;

/// How long open client exchanges may run on after a shutdown signal.
const DRAIN_GRACE: Duration = Duration::from_secs(10);

pub fn run(config: Config) -> ExitCode {
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
    match runtime.block_on(run_single(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            error!("{message}");
            eprintln!("mcpgw: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run_single(config: Config) -> Result<(), String> {
    let config = Arc::new(config);
    let worker_id = config
        .fleet
        .worker_id
        .clone()
        .unwrap_or_else(generate_worker_id);
    let worker = Worker::new(worker_id, Arc::clone(&config)).map_err(|e| e.message)?;
    let listener = front::bind_shared(config.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(true);
    });
    announce(&config, addr);
    info!(worker = %worker.id, %addr, "worker serving");
    front::serve(Arc::clone(&worker), listener, shutdown_rx, DRAIN_GRACE)
        .await
        .map_err(|e| format!("front failed: {e}"))?;
    worker.start_draining();
    for session in worker.sessions.take_all() {
        worker.end_session(&session).await;
    }
    info!(worker = %worker.id, "worker stopped");
    Ok(())
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
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
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
