//! The official MCP Python SDK (installed by `make deps` under `build/venv`) as a
//! real client and a real server, with a deadline on every script.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::process::Child;

/// How long one client script may run: far longer than any scenario needs, so it only
/// ends a hang (a client waiting forever on an answer that never comes).
pub const SCRIPT_DEADLINE: Duration = Duration::from_secs(180);

/// The virtualenv Python with the MCP SDK.
#[track_caller]
pub fn python() -> PathBuf {
    let path = std::env::var_os("MCPGW_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("build/venv/bin/python"));
    assert!(
        path.is_file(),
        "{} is missing: run `make deps` (or `make test`) to install the MCP Python SDK",
        path.display()
    );
    path
}

/// A Python script of the test suite (`tests/python/`).
pub fn python_script(name: &str) -> PathBuf {
    crate::workspace_root().join("tests/python").join(name)
}

/// Runs a Python test script to completion and returns its last stdout line parsed as
/// JSON. A non-zero exit, or a script still running after [`SCRIPT_DEADLINE`], fails
/// the test with the script's output.
#[track_caller]
pub fn run_python(script: &str, args: &[&str]) -> serde_json::Value {
    run_python_within(script, args, SCRIPT_DEADLINE)
}

/// [`run_python`] with another deadline.
#[track_caller]
pub fn run_python_within(script: &str, args: &[&str], within: Duration) -> serde_json::Value {
    let mut command = Command::new(python());
    command
        .arg(python_script(script))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut process =
        crate::process::spawn(command).unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    // Read both pipes on their own threads: a script that fills one pipe while we
    // wait on the other would block forever.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = drain(process.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(process.stderr.take().map(|p| Box::new(p) as _));
    let deadline = std::time::Instant::now() + within;
    let status = loop {
        match process.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => break None,
        }
    };
    if status.is_none() {
        crate::signal::kill_group(process.id());
        let _ = process.wait();
    }
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let Some(status) = status else {
        panic!(
            "{script} {args:?} still ran after {within:?} and was killed:\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    };
    assert!(
        status.success(),
        "{script} {args:?} failed ({status}):\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    serde_json::from_str(last).unwrap_or_else(|e| {
        panic!("{script}: last line is not JSON ({e}): {last:?}\nstderr:\n{stderr}")
    })
}

/// `tests/python/sdk_server.py`: an upstream MCP server built with the SDK, with a
/// stateful tool, killed when dropped.
pub struct SdkServer {
    pub child: Child,
    /// Its MCP endpoint.
    pub url: String,
}

impl SdkServer {
    #[track_caller]
    pub fn start() -> SdkServer {
        // The SDK's server cannot report a port it chose, so it gets one that was free.
        let port = crate::free_port();
        let mut child = Child::spawn(
            "sdk_server",
            &python(),
            &[
                python_script("sdk_server.py").display().to_string(),
                port.to_string(),
            ],
        );
        child.wait_for_line("sdk_server listening", Duration::from_secs(60));
        crate::wait_for_listener(&format!("127.0.0.1:{port}"), Duration::from_secs(60));
        SdkServer {
            child,
            url: format!("http://127.0.0.1:{port}/mcp"),
        }
    }
}
