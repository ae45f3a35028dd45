//! `mcpgw drain`: asks one worker (by id) or every worker of a host to drain, through
//! the directory, from any machine that reaches Redis. The request is a short-lived
//! key (`{p}drain:{id}`) that the worker's next lease renewal reads; the worker then
//! drains exactly as on SIGTERM, and its supervisor starts a replacement under a new
//! id. (On the worker's own machine, `POST /drain` on its admin listener does the same
//! without Redis.)
//!
//! Exit codes: 0 requested; 1 no live worker matched; 2 the directory could not be
//! read.

use std::process::ExitCode;
use std::time::Duration;

use mcpgw_mesh::directory::{Directory, DirectoryError, WorkerEntry};

use super::status::{DirectoryArgs, block_on, connect};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["worker", "host"])))]
pub struct DrainArgs {
    #[command(flatten)]
    pub directory: DirectoryArgs,
    /// The worker to drain, by id (as `mcpgw status` lists it).
    #[arg(long)]
    pub worker: Option<String>,
    /// Drain every worker whose lease names this host.
    #[arg(long)]
    pub host: Option<String>,
}

/// What a drain command did, for the exit code and the message.
enum Outcome {
    /// The listed workers were asked to drain.
    Requested(Vec<WorkerEntry>),
    /// Nothing matched: the message says what was looked for.
    NoMatch(String),
}

/// `mcpgw drain`.
pub fn run(args: DrainArgs) -> ExitCode {
    // The lease time only shapes errors' deadlines here; the drain request's own
    // lifetime follows the worker's lease in Redis.
    let outcome = block_on(async {
        let directory = connect(&args.directory, Duration::from_secs(10)).await?;
        match (&args.worker, &args.host) {
            (Some(id), _) => drain_worker(&directory, id).await,
            (None, Some(host)) => drain_host(&directory, host).await,
            (None, None) => Ok(Outcome::NoMatch("name --worker ID or --host HOST".into())),
        }
    });
    match outcome {
        Ok(Ok(Outcome::Requested(workers))) => {
            for worker in &workers {
                println!(
                    "drain requested for worker {} (host {}, pid {}, mesh {})",
                    worker.id,
                    worker.info.host,
                    worker.info.pid,
                    worker.addr.as_deref().unwrap_or("-")
                );
            }
            println!(
                "each drains at its next lease renewal (within a third of the lease), as on \
                 SIGTERM: no new requests, exchanges in flight finish, its sessions end; its \
                 supervisor then starts a replacement under a new id. `mcpgw status` shows \
                 them as draining until they are gone"
            );
            ExitCode::SUCCESS
        }
        Ok(Ok(Outcome::NoMatch(message))) => {
            eprintln!("mcpgw drain: {message}");
            ExitCode::FAILURE
        }
        Ok(Err(e)) => {
            eprintln!("mcpgw drain: cannot reach the fleet directory: {e}");
            ExitCode::from(2)
        }
        Err(message) => {
            eprintln!("mcpgw drain: {message}");
            ExitCode::from(2)
        }
    }
}

async fn drain_worker(directory: &Directory, id: &str) -> Result<Outcome, DirectoryError> {
    let no_lease = || {
        Outcome::NoMatch(format!(
            "worker {id} holds no lease in the directory (it is not running, or has \
             already stopped): nothing to drain; `mcpgw status` lists the live workers"
        ))
    };
    let Some(worker) = directory.worker(id).await? else {
        return Ok(no_lease());
    };
    if directory.request_drain(id).await? {
        Ok(Outcome::Requested(vec![worker]))
    } else {
        Ok(no_lease())
    }
}

async fn drain_host(directory: &Directory, host: &str) -> Result<Outcome, DirectoryError> {
    let mut requested = Vec::new();
    for worker in directory.workers().await? {
        // A worker that stopped between the listing and the request needs no drain.
        if worker.info.host == host && directory.request_drain(&worker.id).await? {
            requested.push(worker);
        }
    }
    if requested.is_empty() {
        Ok(Outcome::NoMatch(format!(
            "no live worker's lease names host {host:?}: nothing to drain; `mcpgw status` \
             lists the live workers and their hosts"
        )))
    } else {
        Ok(Outcome::Requested(requested))
    }
}
