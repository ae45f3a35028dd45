//! Signals for fault injection: kill, terminate, pause and resume a process, with a
//! guard that never leaves a paused process stopped, however the test ends.

use std::path::Path;
use std::time::Duration;

pub use nix::sys::signal::Signal;
use nix::sys::signal::{kill, killpg};
use nix::unistd::Pid;

/// Sends `signal` to `pid`; fails the test if the process does not exist.
#[track_caller]
pub fn send(pid: u32, signal: Signal) {
    let raw = i32::try_from(pid).unwrap_or_else(|_| panic!("pid {pid} out of range"));
    if let Err(e) = kill(Pid::from_raw(raw), signal) {
        panic!("cannot send {signal} to process {pid}: {e}");
    }
}

/// SIGKILL to every process in the group `pgid` (a [`crate::Child`] is the leader of
/// its own group). A group that is already gone is fine.
pub fn kill_group(pgid: u32) {
    if let Ok(raw) = i32::try_from(pgid) {
        let _ = killpg(Pid::from_raw(raw), Signal::SIGKILL);
    }
}

/// Whether `pid` still exists (running, stopped, or a zombie not yet reaped).
pub fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The parent of `pid`, from `/proc/{pid}/stat`; `None` once it is gone.
pub fn parent_of(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// The live child processes of `pid`, from `/proc`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| parent_of(child) == Some(pid) && state_of(child) != Some('Z'))
        .collect()
}

/// The scheduler state of `pid` (`R` running, `S` sleeping, `T` stopped, `Z` zombie,
/// …); `None` once it is gone.
pub fn state_of(pid: u32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// The fields of `/proc/{pid}/stat` after the command name: state, parent pid, ….
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: the other
    // fields follow its closing parenthesis.
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Waits until `pid` no longer exists: reaped by its parent. A zombie is not enough:
/// the other threads of a multi-threaded process may still hold its sockets.
#[track_caller]
pub fn wait_until_gone(pid: u32, within: Duration) {
    crate::eventually(within, || {
        if exists(pid) {
            Err(format!("process {pid} still exists"))
        } else {
            Ok(())
        }
    });
}

/// What a [`Paused`] guard does to its process if the test did not resume it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfStillPaused {
    /// SIGCONT: the process carries on (and acts on any signal that waited meanwhile,
    /// such as the SIGTERM its supervisor sent when the test tore the fleet down).
    Resume,
    /// SIGKILL: for a process that must not act again after the test.
    Kill,
}

/// A process stopped with SIGSTOP. Dropping the guard resumes it (or kills it), so a
/// test that fails between the pause and the resume never leaves a process stopped
/// forever, holding ports and ignoring its supervisor's SIGTERM.
#[must_use = "dropping the guard resumes the process at once"]
pub struct Paused {
    pid: u32,
    if_still_paused: IfStillPaused,
    resumed: bool,
}

impl Paused {
    /// SIGSTOP to `pid`; SIGCONT when the guard is dropped.
    #[track_caller]
    pub fn stop(pid: u32) -> Paused {
        Self::stop_then(pid, IfStillPaused::Resume)
    }

    /// SIGSTOP to `pid`; `if_still_paused` when the guard is dropped unresumed.
    /// Returns once every thread of `pid` is stopped: the kernel stops a process when
    /// one of its threads takes the signal, and on a busy machine the others may run
    /// on for milliseconds after kill(2) returned, answering requests sent "after the
    /// pause".
    #[track_caller]
    pub fn stop_then(pid: u32, if_still_paused: IfStillPaused) -> Paused {
        send(pid, Signal::SIGSTOP);
        crate::eventually(std::time::Duration::from_secs(30), || {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                // Gone (or no /proc): nothing of it runs.
                return Ok(());
            };
            let running = tasks
                .filter_map(|task| {
                    let stat = std::fs::read_to_string(task.ok()?.path().join("stat")).ok()?;
                    let state = stat.rsplit_once(") ")?.1.chars().next()?;
                    (!matches!(state, 'T' | 't')).then_some(state)
                })
                .count();
            match running {
                0 => Ok(()),
                n => Err(format!("{n} threads of {pid} not yet stopped")),
            }
        });
        Paused {
            pid,
            if_still_paused,
            resumed: false,
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// SIGCONT now.
    #[track_caller]
    pub fn resume(mut self) {
        self.resumed = true;
        send(self.pid, Signal::SIGCONT);
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if self.resumed {
            return;
        }
        // The process may be gone already (the test killed its group): nothing to do.
        if let Ok(raw) = i32::try_from(self.pid) {
            let signal = match self.if_still_paused {
                IfStillPaused::Resume => Signal::SIGCONT,
                IfStillPaused::Kill => Signal::SIGKILL,
            };
            let _ = kill(Pid::from_raw(raw), signal);
        }
    }
}
