//! The supervisor of `mcpgw serve --workers N`: starts N fresh worker processes (each
//! with its own worker id), restarts one that dies under a new id (also one that exits
//! 0 after a drain of its own: `mcpgw drain` replaces a worker), and passes SIGTERM on
//! so every worker drains.

use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

use crate::config::Config;
use crate::process::{
    ENV_WORKER_ID_ASSIGNED, ENV_WORKER_INDEX, ENV_WORKER_OF_SUPERVISOR, EXIT_FATAL, READY_PREFIX,
    StopSignals,
};

/// First and longest delay before a dead worker's replacement starts.
const RESTART_BACKOFF_MIN: Duration = Duration::from_millis(100);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The wait before a slot's next start after `failures` starts in a row that did not
/// serve: doubling from the minimum up to the maximum.
fn restart_delay(failures: u32) -> Duration {
    RESTART_BACKOFF_MIN
        .saturating_mul(1 << failures.min(6))
        .min(RESTART_BACKOFF_MAX)
}

/// How long workers may take after SIGTERM, beyond their lame-duck delay and the
/// drain's worst case, before they are killed.
const STOP_MARGIN: Duration = Duration::from_secs(2);

pub fn run(config: Config) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mcpgw: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(supervise(config))
}

enum Event {
    Ready {
        slot: usize,
        line: String,
    },
    /// A backoff delay for a dead worker's replacement has passed.
    Restart {
        slot: usize,
    },
    Exited {
        slot: usize,
        generation: u32,
        code: Option<i32>,
        ready: bool,
    },
}

async fn supervise(mut config: Config) -> ExitCode {
    // Hold the public port (bound, not listening) so `--listen host:0` gives every
    // worker the same port, and so it is never taken by someone else between restarts.
    let reservation = match crate::process::reserve_shared(config.listen) {
        Ok(socket) => socket,
        Err(e) => {
            eprintln!("mcpgw: cannot bind {}: {e}", config.listen);
            return ExitCode::FAILURE;
        }
    };
    if let Some(addr) = reservation.local_addr().ok().and_then(|a| a.as_socket()) {
        config.listen = addr;
    }
    let config = Arc::new(config);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut slots = Slots::new(Arc::clone(&config), events_tx);
    // Before the workers start (and the supervisor says it is ready): see StopSignals.
    let signals = StopSignals::install();
    if let Err((slot, e)) = slots.start_all() {
        eprintln!("mcpgw: cannot start worker {slot}: {e}");
        return ExitCode::FAILURE;
    }
    tokio::spawn({
        let stop_tx = stop_tx.clone();
        async move {
            StopSignals::wait(signals).await;
            let _ = stop_tx.send(true);
        }
    });
    let mut stopping = stop_rx.clone();
    let mut exit = ExitCode::SUCCESS;
    loop {
        tokio::select! {
            _ = stopping.changed() => break,
            event = events.recv() => {
                let Some(event) = event else { break };
                if let Some(code) = slots.on(event) {
                    exit = code;
                    break;
                }
            }
        }
    }
    let _ = stop_tx.send(true);
    let deadline = config.limits.drain_delay + crate::process::DRAIN_WORST_CASE + STOP_MARGIN;
    stop_all(&slots.pids, &mut events, deadline).await;
    drop(reservation);
    exit
}

/// The worker slots and what the supervisor knows of each: its process, which start
/// it is on, whether it serves, and how often its replacements died before serving.
struct Slots {
    config: Arc<Config>,
    events: mpsc::UnboundedSender<Event>,
    pids: Vec<Option<u32>>,
    generations: Vec<u32>,
    ready: Vec<bool>,
    failures: Vec<u32>,
    /// Every worker served once: the fleet was announced.
    announced: bool,
}

impl Slots {
    fn new(config: Arc<Config>, events: mpsc::UnboundedSender<Event>) -> Slots {
        let workers = config.fleet.workers;
        Slots {
            config,
            events,
            pids: vec![None; workers],
            generations: vec![0; workers],
            ready: vec![false; workers],
            failures: vec![0; workers],
            announced: false,
        }
    }

    /// Starts every slot's first worker; the first that cannot start, with why.
    fn start_all(&mut self) -> Result<(), (usize, String)> {
        for slot in 0..self.pids.len() {
            let started = spawn_worker(&self.config, slot, 0, self.events.clone());
            self.pids[slot] = Some(started.map_err(|e| (slot, e.to_string()))?);
        }
        Ok(())
    }

    /// Acts on one event; `Some(code)`: the fleet stops, exiting with `code`.
    fn on(&mut self, event: Event) -> Option<ExitCode> {
        match event {
            Event::Ready { slot, line } => {
                info!(slot, "{line}");
                self.ready[slot] = true;
                if !self.announced && self.ready.iter().all(|r| *r) {
                    self.announced = true;
                    let (public, workers) = (self.config.listen, self.pids.len());
                    println!("mcpgw listening on http://{public} ({workers} workers)");
                }
                None
            }
            Event::Exited {
                slot,
                generation,
                code,
                ready,
            } if generation == self.generations[slot] => self.exited(slot, code, ready),
            Event::Exited { .. } => None,
            Event::Restart { slot } => {
                self.restart(slot);
                None
            }
        }
    }

    fn exited(&mut self, slot: usize, code: Option<i32>, was_ready: bool) -> Option<ExitCode> {
        self.pids[slot] = None;
        if code == Some(i32::from(EXIT_FATAL)) || (!was_ready && !self.announced) {
            error!(slot, ?code, "worker failed to start; stopping the fleet");
            eprintln!("mcpgw: worker {slot} failed to start (exit {code:?}); see its error above");
            return Some(ExitCode::from(EXIT_FATAL));
        }
        // Back off when replacements keep dying before they serve (Redis down, say),
        // so a broken dependency is not hammered.
        self.failures[slot] = if was_ready {
            0
        } else {
            self.failures[slot] + 1
        };
        let delay = restart_delay(self.failures[slot]);
        // A worker that exits 0 was drained on its own (`mcpgw drain`, `POST /drain`,
        // a signal sent to it alone): the slot is refilled like after a death, under a
        // new id, so a drain replaces a worker.
        if code == Some(0) {
            info!(
                slot,
                ?delay,
                "worker drained and exited; starting a replacement under a new id"
            );
        } else {
            warn!(
                slot,
                ?code,
                ?delay,
                "worker died; starting a replacement under a new id"
            );
        }
        self.restart_after(slot, delay);
        None
    }

    fn restart(&mut self, slot: usize) {
        self.generations[slot] += 1;
        let generation = self.generations[slot];
        match spawn_worker(&self.config, slot, generation, self.events.clone()) {
            Ok(pid) => self.pids[slot] = Some(pid),
            Err(e) => {
                // (The binary being replaced on disk, a process limit: passing
                // conditions.) The slot is tried again, backing off like a replacement
                // that died before it served.
                self.failures[slot] += 1;
                let delay = restart_delay(self.failures[slot]);
                error!(slot, error = %e, ?delay, "cannot restart worker; trying again");
                self.restart_after(slot, delay);
            }
        }
    }

    fn restart_after(&self, slot: usize, delay: Duration) {
        let events = self.events.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = events.send(Event::Restart { slot });
        });
    }
}

/// SIGTERM to every worker, then wait for them to finish draining (SIGKILL at the
/// deadline).
async fn stop_all(
    pids: &[Option<u32>],
    events: &mut mpsc::UnboundedReceiver<Event>,
    within: Duration,
) {
    let live: Vec<u32> = pids.iter().flatten().copied().collect();
    for pid in &live {
        let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGTERM);
    }
    let mut remaining = live.len();
    let deadline = tokio::time::Instant::now() + within;
    while remaining > 0 {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(Event::Exited { .. })) => remaining -= 1,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    if remaining > 0 {
        warn!(
            remaining,
            "workers still running at the stop deadline; killing them"
        );
        for pid in &live {
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
        }
    }
}

fn spawn_worker(
    config: &Arc<Config>,
    slot: usize,
    generation: u32,
    events: mpsc::UnboundedSender<Event>,
) -> std::io::Result<u32> {
    let exe = std::env::current_exe()?;
    let serialized = serde_json::to_string(config.as_ref()).map_err(std::io::Error::other)?;
    let mut command = Command::new(exe);
    command
        .arg("worker")
        .env(ENV_WORKER_OF_SUPERVISOR, std::process::id().to_string())
        .env(ENV_WORKER_INDEX, slot.to_string())
        .env(crate::process::ENV_LOG_FORMAT, crate::process::log_format());
    // A fixed id (tests, debugging) is passed on; otherwise each worker names itself
    // after its own pid, so a replacement always gets a new id.
    match &config.fleet.worker_id {
        Some(fixed) if generation == 0 => {
            command.env(ENV_WORKER_ID_ASSIGNED, fixed);
        }
        Some(fixed) => {
            command.env(ENV_WORKER_ID_ASSIGNED, format!("{fixed}-r{generation}"));
        }
        None => {
            command.env_remove(ENV_WORKER_ID_ASSIGNED);
        }
    }
    let mut child: Child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(false)
        .spawn()?;
    let pid = child.id().unwrap_or(0);
    let stdout = child.stdout.take();
    // The configuration goes over a pipe the worker reads to its end; the write is
    // small enough for the pipe buffer, so it never waits on the worker.
    if let Some(mut stdin) = child.stdin.take() {
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            if let Err(e) = stdin.write_all(serialized.as_bytes()).await {
                warn!(slot, error = %e, "could not hand the configuration to a worker");
            }
        });
    }
    tokio::spawn(async move {
        let mut ready = false;
        if let Some(stdout) = stdout {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with(READY_PREFIX) {
                    ready = true;
                    let _ = events.send(Event::Ready { slot, line });
                } else {
                    println!("{line}");
                }
            }
        }
        let code = child.wait().await.ok().and_then(|s| s.code());
        let _ = events.send(Event::Exited {
            slot,
            generation,
            code,
            ready,
        });
    });
    Ok(pid)
}
