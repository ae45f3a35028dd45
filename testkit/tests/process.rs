//! The guarantees the rest of the suite leans on: children die with the test binary
//! (and not with the test thread that started them), a dropped handle kills the whole
//! process group, and a paused process is never left stopped.

use std::process::Command;
use std::time::Duration;

use mcpgw_testkit::signal::{self, IfStillPaused, Paused};
use mcpgw_testkit::{Child, eventually};

const WITHIN: Duration = Duration::from_secs(30);

/// Set in the copy of this test binary that [`a_child_dies_with_the_test_binary`]
/// starts: that copy starts a child, prints its pid and exits without running any
/// destructor.
const ORPHAN_PROBE: &str = "MCPGW_TESTKIT_ORPHAN_PROBE";

fn sleeper() -> Child {
    Child::spawn("sleep", std::path::Path::new("sleep"), &["600"])
}

/// Gone, or a zombie nobody reaps yet: either way it runs no more.
fn dead(pid: u32) -> bool {
    matches!(signal::state_of(pid), None | Some('Z' | 'X'))
}

#[test]
fn a_child_dies_with_the_test_binary() {
    if std::env::var_os(ORPHAN_PROBE).is_some() {
        let child = sleeper();
        println!("orphan pid={}", child.pid());
        // No destructor runs: only the kernel can end the child now.
        std::process::exit(0);
    }
    let output = Command::new(std::env::current_exe().expect("own path"))
        .args([
            "--exact",
            "a_child_dies_with_the_test_binary",
            "--nocapture",
        ])
        .env(ORPHAN_PROBE, "1")
        .output()
        .expect("run a copy of this test binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let pid: u32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("orphan pid="))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("the probe printed no pid: {stdout}"));
    eventually(WITHIN, || {
        if dead(pid) {
            Ok(())
        } else {
            Err(format!("the orphan {pid} still runs"))
        }
    });
}

#[test]
fn a_child_started_on_a_finished_thread_lives_on() {
    let (child, thread_id) = std::thread::spawn(|| (sleeper(), nix::unistd::gettid()))
        .join()
        .expect("thread");
    // Wait until the thread is entirely gone (past the point where the kernel would
    // send a parent-death signal), then check the child is untouched.
    let task = format!("/proc/self/task/{thread_id}");
    eventually(WITHIN, || {
        if std::path::Path::new(&task).exists() {
            Err("the thread still exists")
        } else {
            Ok(())
        }
    });
    assert!(
        !dead(child.pid()),
        "the child died with the thread that started it"
    );
}

#[test]
fn dropping_a_child_kills_its_whole_group() {
    let mut shell = Child::spawn(
        "sh",
        std::path::Path::new("sh"),
        &["-c", "sleep 600 & echo grandchild=$!; wait"],
    );
    let line = shell.wait_for_line("grandchild=", WITHIN);
    let grandchild: u32 = line
        .trim_start_matches("grandchild=")
        .trim()
        .parse()
        .expect("pid");
    assert!(!dead(grandchild));
    drop(shell);
    eventually(WITHIN, || {
        if dead(grandchild) {
            Ok(())
        } else {
            Err(format!("grandchild {grandchild} still runs"))
        }
    });
}

#[test]
fn a_paused_process_is_resumed_even_when_the_test_fails() {
    let child = sleeper();
    let pid = child.pid();
    let failed = std::panic::catch_unwind(|| {
        let _paused = Paused::stop(pid);
        assert_eq!(signal::state_of(pid), Some('T'), "stopped");
        panic!("the test fails while the process is stopped");
    });
    assert!(failed.is_err());
    eventually(WITHIN, || match signal::state_of(pid) {
        Some('T') => Err("still stopped"),
        _ => Ok(()),
    });
    assert!(!dead(pid), "resumed, not killed");
}

#[test]
fn a_paused_process_can_be_killed_instead() {
    let child = sleeper();
    let pid = child.pid();
    drop(Paused::stop_then(pid, IfStillPaused::Kill));
    eventually(WITHIN, || {
        if dead(pid) {
            Ok(())
        } else {
            Err(format!("{pid} still runs"))
        }
    });
}
