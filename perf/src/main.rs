//! `mcpgw-bench`: the tools that exercise mcpgw from the outside, over HTTP
//! as a user would: a fast, stateful demo upstream MCP server to put behind
//! the gateway (`upstream`), and the load generator with its reports (`run`,
//! `compare`, `sessions`, `failover`; see `bench`).
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod bench;
mod upstream;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "mcpgw-bench",
    version,
    about = "Demo upstream MCP server and load tools for mcpgw"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the demo upstream MCP server (Streamable HTTP at /mcp, counters at /stats, the
    /// ids of the requests run in each session at /executed).
    Upstream(upstream::UpstreamConfig),
    /// Drive concurrent MCP sessions against gateway URLs and report latency,
    /// throughput, forwarding, Redis commands and CPU per request.
    Run(bench::run::RunArgs),
    /// Start Redis, the demo upstream and fleets, and run the same load through
    /// every configuration (direct, sticky, QUIC, TCP, Redis pub/sub, round-robin)
    /// at several concurrency levels; write report.md, report.json and chart.svg.
    ///
    /// The defaults take about two minutes on a 2-core machine: 6 configurations ×
    /// 4 concurrency levels × (0.5 s warm-up + 3 s measured), about 15 s of start-up
    /// and the idle-session measurement (2 × 10,000 sessions). A configuration whose
    /// fleet does not start is reported as not available.
    Compare(bench::compare::CompareArgs),
    /// Open K idle sessions on one worker and report memory per session (owner
    /// RSS, Redis directory).
    Sessions(bench::sessions::SessionsArgs),
    /// Kill (kill -9) or pause (SIGSTOP) a worker that owns sessions, round after
    /// round, and report how long its clients wait for a truthful answer
    /// (p50/p90/max).
    Failover(bench::failover::FailoverArgs),
    /// A fleet of N workers behind round-robin routing, thousands of legacy sessions
    /// each holding its GET stream open through a random worker, and a closed-loop
    /// tools/call load on top: requests/s, p50/p99 of forwarded calls, errors by class,
    /// memory per session with a held stream.
    Scale(bench::scale::ScaleArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr: stdout carries the machine-read "listening on" line.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Upstream(config) => upstream::run(config).await,
        Command::Run(args) => bench::run::main(args).await,
        Command::Compare(args) => bench::compare::main(args).await,
        Command::Sessions(args) => bench::sessions::main(args).await,
        Command::Failover(args) => bench::failover::main(args).await,
        Command::Scale(args) => bench::scale::main(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line with the causes, not a backtrace: these are usage and
            // environment errors, and the message says what to do.
            eprintln!("mcpgw-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}
