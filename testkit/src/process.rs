//! Child processes that cannot outlive the test: each is the leader of its own
//! process group (so dropping its handle kills everything it started, such as an
//! mcpgw supervisor's workers), and the kernel kills it when the test binary ends,
//! even by SIGKILL or an abort that runs no destructor.

use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::signal;

/// Starts `command` as the leader of a new process group, set to receive SIGKILL when
/// the test binary ends.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the
/// process. Test threads end with their test, while fleets may be shared across tests
/// (statics, or a handle passed to another thread), so a child forked on a test thread
/// would be killed under the feet of whoever still uses it. Every child is therefore
/// forked on one spawner thread that lives as long as the test binary: its death
/// signal fires exactly when the binary ends.
pub fn spawn(command: Command) -> io::Result<std::process::Child> {
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply_tx))
        .map_err(|_| io::Error::other("the testkit spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("the testkit spawner thread did not answer"))?
}

type SpawnJob = (Command, mpsc::Sender<io::Result<std::process::Child>>);

/// The spawner thread's inbox. The sender lives in a static, so the channel never
/// closes and the thread never returns.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnJob>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(spawn_bound(&mut command));
                }
            })
            .unwrap_or_else(|e| panic!("cannot start the testkit spawner thread: {e}"));
        Mutex::new(tx)
    })
}

/// Forks `command` on the current thread (the spawner), bound to this process.
fn spawn_bound(command: &mut Command) -> io::Result<std::process::Child> {
    let test_process = nix::unistd::getpid();
    command.process_group(0);
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe work is allowed. It makes two system calls (prctl, getppid) and
    // builds an io::Error from a raw errno: no allocation, no lock, no shared state.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(move || die_with(test_process));
    }
    command.spawn()
}

/// In the child, before exec: SIGKILL when the forking thread (the spawner, alive as
/// long as the test binary) ends. If the test binary ended before this call, the
/// child has been re-parented already and must not run at all.
fn die_with(test_process: Pid) -> io::Result<()> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
    if nix::unistd::getppid() != test_process {
        return Err(io::Error::from(nix::errno::Errno::ESRCH));
    }
    Ok(())
}

/// A running child process, killed with its process group when dropped. Its stdout
/// lines are collected so a test can wait for a readiness line (and are echoed to the
/// test's stderr with the child's name); its stderr goes to the test's stderr.
pub struct Child {
    pub name: String,
    process: std::process::Child,
    lines: mpsc::Receiver<String>,
    /// Set once the process was waited for: its pid may then name another process,
    /// so its group is no longer ours to signal.
    reaped: bool,
}

impl Child {
    pub fn spawn(name: &str, program: &Path, args: &[impl AsRef<OsStr>]) -> Child {
        Self::spawn_with_env(name, program, args, &[])
    }

    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[impl AsRef<OsStr>],
        env: &[(&str, &str)],
    ) -> Child {
        let mut command = Command::new(program);
        command.args(args);
        for (key, value) in env {
            command.env(key, value);
        }
        Self::from_command(name, command)
            .unwrap_or_else(|e| panic!("cannot start {name} ({}): {e}", program.display()))
    }

    /// Starts `command` with stdin closed, stdout collected and stderr inherited.
    pub fn from_command(name: &str, command: Command) -> io::Result<Child> {
        Self::from_command_with_stderr(name, command, Stdio::inherit())
    }

    /// Like [`from_command`](Self::from_command), with stderr going to `stderr` (a
    /// file, for tests that read what the child logged).
    pub fn from_command_with_stderr(
        name: &str,
        mut command: Command,
        stderr: Stdio,
    ) -> io::Result<Child> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut process = spawn(command)?;
        let stdout = process
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("stdout was not piped"))?;
        let (tx, lines) = mpsc::channel();
        let label = name.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                eprintln!("[{label}] {line}");
                // Keep draining after the receiver is gone, so the child never blocks
                // on a full pipe.
                let _ = tx.send(line);
            }
        });
        Ok(Child {
            name: name.to_owned(),
            process,
            lines,
            reaped: false,
        })
    }

    /// Waits for a stdout line containing `needle` and returns it. Fails the test if
    /// the process exits or prints no such line within `within`.
    #[track_caller]
    pub fn wait_for_line(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => {
                    let status = self.process.try_wait().ok().flatten();
                    panic!(
                        "{} printed no line containing {needle:?} within {within:?} (exit status: {status:?})",
                        self.name
                    );
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// Sends `signal` to this process alone (not its group).
    #[track_caller]
    pub fn signal(&self, signal: Signal) {
        signal::send(self.pid(), signal);
    }

    /// Stops this process (SIGSTOP) until the returned guard is resumed or dropped.
    pub fn pause(&self) -> signal::Paused {
        signal::Paused::stop(self.pid())
    }

    /// The exit code once the process has exited, `None` while it runs. A process
    /// killed by a signal has no code: `Some(None)`.
    pub fn try_exit(&mut self) -> Option<Option<i32>> {
        match self.process.try_wait() {
            Ok(Some(status)) => {
                self.reaped = true;
                Some(status.code())
            }
            _ => None,
        }
    }

    /// Waits for the process to exit and returns its exit code (`None` when a signal
    /// ended it). Fails the test if it still runs after `within`.
    #[track_caller]
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let name = self.name.clone();
        crate::eventually(within, || {
            self.try_exit()
                .ok_or_else(|| format!("{name} is still running"))
        })
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // The whole group: an mcpgw supervisor's workers die with it at once, even
        // stopped ones, instead of draining for seconds after their parent is gone.
        if !self.reaped {
            signal::kill_group(self.pid());
        }
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Whether any thread of `pid` runs (exists and is neither a zombie nor dead), from
/// `/proc`. Every thread, not only the leader's `stat`: a killed process's leader shows
/// `Z` while its other threads still exit, and its files (a pipe's read end among
/// them) are released only when the last one has, so a write to its stdin can still
/// succeed while the leader looks dead.
pub fn running(pid: u32) -> bool {
    let alive = |stat: &str| {
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X')
    };
    match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(tasks) => tasks.flatten().any(|task| {
            std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| alive(&stat))
        }),
        Err(_) => std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| alive(&s)),
    }
}

/// Pids of the running children of `parent`, from `/proc`.
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let (_, rest) = stat.rsplit_once(") ")?;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .filter(|pid| running(*pid))
        .collect()
}
