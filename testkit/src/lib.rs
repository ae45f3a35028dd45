//! Test support for mcpgw, in one place for every test crate (`tests/`, `mesh/tests`,
//! `perf/tests`): real Redis, mcpgw, demo-upstream and Python processes on loopback
//! ports; a raw HTTP/1.1 and SSE client (so tests can send what a well-behaved client
//! library never would); signals with guards that never leave a process stopped; and
//! [`eventually`], the polling helper tests use instead of fixed sleeps.
//!
//! Every process a test starts dies with the test binary, however the binary ends
//! (see [`process::spawn`]), and is killed with its whole process group when its
//! handle is dropped, so a failed test leaves nothing running.
//!
//! Deadlines in this crate are generous upper bounds that only catch hangs; a test
//! never fails because the machine is slow (speed belongs in `mcpgw-bench`).
//!
//! This crate is a leaf: it may depend on `mcpgw-certs`, never on `mcpgw-mesh`,
//! `mcpgw` or `mcpgw-perf`, which use it as a dev-dependency.
// `deny`, not `forbid`: one `pre_exec` in `process.rs` needs `unsafe`, allowed there
// alone with the reason written beside it.
#![deny(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod admin;
pub mod cluster;
pub mod fleet;
pub mod gateway;
pub mod http;
pub mod pki;
pub mod poll;
pub mod ports;
pub mod process;
pub mod python;
pub mod redis;
pub mod scatter;
pub mod sentinel;
pub mod signal;
pub mod tls;
pub mod upstream;

use std::path::PathBuf;

pub use gateway::Gateway;
pub use poll::{eventually, eventually_async};
pub use ports::{
    RefusingPort, free_port, free_udp_port, refusing_port, wait_for_listener, wait_until_refused,
};
pub use process::Child;
pub use python::{python, python_script, run_python};
pub use redis::RedisServer;
pub use scatter::ScatterProxy;
pub use signal::Paused;
pub use upstream::Upstream;

/// Whether `MCPGW_ALLOW_SKIP` (comma-separated) names `what`: a check that cannot run
/// here fails unless the environment says it may be skipped, so no skip passes
/// unchecked in CI.
pub fn skip_allowed(what: &str) -> bool {
    std::env::var("MCPGW_ALLOW_SKIP").is_ok_and(|skips| skips.split(',').any(|s| s.trim() == what))
}

/// The workspace root (one level above this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A binary of the workspace (`mcpgw`, `mcpgw-bench`), from `MCPGW_BIN_DIR`, else the
/// cargo target directory's `debug/` (`make test` builds the binaries first).
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
