//! The `mcpgw` command line: `serve` (and the hidden `worker` and `stdio-exec` it
//! starts), and the operator commands `certs`, `status` and `drain`, one file each.

pub mod certs;
pub mod drain;
pub mod status;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Config, ServeArgs};
use crate::{execute, process, serve};

#[derive(Debug, Parser)]
#[command(name = "mcpgw", version, about = "A horizontally scaled MCP gateway")]
pub struct Cli {
    /// Log lines as text (for people) or JSON (for log pipelines); workers inherit it.
    #[arg(long, global = true, env = process::ENV_LOG_FORMAT, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How log lines are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs go to stderr, filtered by `RUST_LOG` (default `info`). Every worker process
/// logs under its own id (each line's fields name it where it matters).
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    // Workers started by a supervisor log the way it does.
    process::set_log_format(match format {
        LogFormat::Json => "json",
        LogFormat::Text => "text",
    });
}

// Parsed once at start; the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve MCP clients: one worker, or a supervisor of --workers N processes.
    Serve(ServeArgs),
    /// Mesh certificates: a private CA and leaves for mesh members.
    #[command(subcommand)]
    Certs(certs::CertsCommand),
    /// The fleet as the directory sees it (workers, sessions, certificate expiry) and the
    /// problems an operator must see. Exits 1 when it finds one, 2 when Redis cannot
    /// be read.
    Status(status::StatusArgs),
    /// Drains a worker (by id) or every worker of a host, as SIGTERM would, through the
    /// directory. Exits 1 when no live worker matches.
    Drain(drain::DrainArgs),
    /// One worker of a fleet, started by `mcpgw serve` (not for direct use).
    #[command(hide = true)]
    Worker,
    /// A stdio upstream's child, started by a worker (not for direct use).
    #[command(hide = true, name = execute::upstream::stdio::EXEC_SUBCOMMAND)]
    StdioExec {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
}

/// Runs the command line: parses it, sets up logging, and runs the command.
pub fn run() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Serve(args) => {
            let config = match Config::load(&args) {
                Ok(config) => config,
                Err(e) => {
                    eprintln!("mcpgw: {e}");
                    return ExitCode::from(2);
                }
            };
            serve::run(config)
        }
        Command::Worker => serve::run_worker_process(),
        Command::Certs(command) => certs::run(command),
        Command::Status(args) => status::run(args),
        Command::Drain(args) => drain::run(args),
        Command::StdioExec { command } => execute::upstream::stdio::exec_child(command),
    }
}
