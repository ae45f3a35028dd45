//! Test support for mcpgw: starts real Redis, mcpgw and demo-upstream processes on
//! ephemeral loopback ports, speaks raw HTTP/1.1 to them (so tests can send what a
//! well-behaved client library never would), and runs the official Python MCP SDK
//! that `make test` installs under `build/venv`.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod fleet;
pub mod http;
pub mod process;
pub mod redis;
pub mod scatter;

use std::path::PathBuf;

pub use process::{Child, Gateway, Upstream};
pub use redis::RedisServer;
pub use scatter::ScatterProxy;

/// The workspace root (one level above this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where the workspace's binaries were built (`make test` builds them first).
pub fn bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("MCPGW_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| workspace_root().join("target"));
            target.join("debug")
        });
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `make test` (it builds the binaries first) or `cargo build --workspace --bins`",
        path.display()
    );
    path
}

/// The virtualenv Python with the MCP SDK.
pub fn python() -> PathBuf {
    let path = std::env::var_os("MCPGW_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("build/venv/bin/python"));
    assert!(
        path.is_file(),
        "{} is missing: run `make deps` (or `make test`) to install the MCP Python SDK",
        path.display()
    );
    path
}

/// A Python script of the test suite.
pub fn python_script(name: &str) -> PathBuf {
    workspace_root().join("tests/python").join(name)
}

/// Runs a Python test script to completion and returns its last stdout line parsed as
/// JSON; a non-zero exit fails the test with the script's output.
pub fn run_python(script: &str, args: &[&str]) -> serde_json::Value {
    let output = std::process::Command::new(python())
        .arg(python_script(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{script} {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
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

/// A port that was free a moment ago (for processes that cannot report their own).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

/// Waits until something accepts TCP connections at `addr` (`host:port`).
pub fn wait_for_listener(addr: &str, timeout: std::time::Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "{addr} did not accept connections within {timeout:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
