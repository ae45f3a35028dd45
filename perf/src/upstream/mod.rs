//! `mcpgw-bench upstream`: a fast, stateful demo MCP server.
//!
//! It stands behind the gateway in `make run`, the integration tests and the
//! benchmarks. It speaks Streamable HTTP at `/mcp` in both protocol eras
//! (session-based legacy versions and sessionless 2026-07-28), keeps
//! per-session state so tests can prove session affinity, and counts every
//! request it executes (`GET /stats`) and the id of each request that ran in a
//! session (`GET /executed`) so tests can prove nothing ran twice, and that nothing a
//! client was told did not run ran.
//! It is plain hyper on tokio so that it costs little next to the gateway.

mod body;
mod executed;
mod methods;
mod protocol;
mod server;
mod session;
mod stats;
mod tools;

#[cfg(test)]
mod http_tests;

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

pub use server::Upstream;

/// Settings of the `upstream` subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct UpstreamConfig {
    /// Address to listen on. Port 0 picks a free port; the line printed on
    /// stdout at start names the real one.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Answer every request as an SSE stream, as the official Python SDK
    /// does, instead of a single application/json body.
    #[arg(long)]
    pub sse_always: bool,
    /// Stall once: when the Nth POST to /mcp arrives (initialize included), the
    /// server answers nothing for --stall-ms, as a garbage-collection pause or a
    /// stuck disk would; every POST arriving meanwhile waits for the stall to end.
    /// Shows whether a load generator's latency figures see a slow moment.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub stall_after: Option<u64>,
    /// Length of the --stall-after stall, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 200, requires = "stall_after",
          value_parser = clap::value_parser!(u64).range(1..=tools::MAX_SLEEP_MS))]
    pub stall_ms: u64,
    /// Answer every `ping` in a session only after this many milliseconds, as a slow
    /// server would (the gateway pings a virtual server's members as it adopts a
    /// session: tests use it to widen that moment).
    #[arg(long, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(1..=tools::MAX_SLEEP_MS))]
    pub ping_delay_ms: Option<u64>,
    /// List N generated resources (`demo://item/0` …) after the session's state,
    /// in pages of --resource-page: a member with a large list, for the gateway's
    /// merge (its tests and benchmarks).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub resources: usize,
    /// Resources per `resources/list` page (with --resources); a page's
    /// `nextCursor` is the position of the next one.
    #[arg(long, value_name = "N", default_value_t = 2_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub resource_page: u64,
}

/// Binds, announces the address on stdout, and serves until SIGINT or SIGTERM.
pub async fn run(config: UpstreamConfig) -> anyhow::Result<()> {
    let listener = TcpListener::bind(config.listen).await.with_context(|| {
        format!(
            "cannot listen on {}; pick another --listen address",
            config.listen
        )
    })?;
    let address = listener
        .local_addr()
        .context("cannot read the bound address")?;
    {
        // Tests and scripts read this line to learn the port: exactly one line, flushed now.
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "mcpgw-bench upstream listening on http://{address}/mcp"
        )
        .context("cannot write to stdout")?;
        stdout.flush().context("cannot flush stdout")?;
    }
    tracing::info!(%address, sse_always = config.sse_always, stall_after = config.stall_after, "upstream MCP server ready");
    let mut upstream = Upstream::new(config.sse_always);
    if config.resources > 0 {
        upstream =
            upstream.with_generated_resources(config.resources, config.resource_page as usize);
    }
    if let Some(after) = config.stall_after {
        upstream = upstream.with_stall(after, Duration::from_millis(config.stall_ms));
    }
    if let Some(delay) = config.ping_delay_ms {
        upstream = upstream.with_ping_delay(Duration::from_millis(delay));
    }
    let upstream = Arc::new(upstream);
    tokio::select! {
        () = serve(listener, upstream) => Ok(()),
        result = shutdown_signal() => result,
    }
}

/// Serves connections from `listener` forever.
pub async fn serve(listener: TcpListener, upstream: Arc<Upstream>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Usually out of file descriptors: back off instead of spinning, and keep serving.
                tracing::warn!(%error, "accept failed; retrying shortly");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Small JSON-RPC answers must not wait for Nagle.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, %peer, "cannot set TCP_NODELAY");
        }
        let upstream = Arc::clone(&upstream);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let upstream = Arc::clone(&upstream);
                async move { Ok::<_, Infallible>(upstream.handle(request).await) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            if let Err(error) = connection.await {
                tracing::debug!(%error, %peer, "connection ended with an error");
            }
        });
    }
}

async fn shutdown_signal() -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install the SIGTERM handler")?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result.context("cannot listen for SIGINT")?,
        _ = terminate.recv() => {}
    }
    tracing::info!("shutting down");
    Ok(())
}
