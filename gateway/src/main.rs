//! mcpgw: an MCP gateway that runs as a fleet of worker processes and keeps every
//! client session on the one worker that holds its live upstream connection.
//!
//! This binary holds the command line ([`commands`]), the supervisor, the HTTP front,
//! MCP semantics, sessions, upstream clients and the affinity decisions; the mesh and
//! the directory live in `mcpgw-mesh`, frames in `mcpgw-wire`, certificates in
//! `mcpgw-certs`.
//!
//! A request's path through the modules (docs/architecture.md tells it in full):
//! [`front`] accepts it and [`request`] checks it into a [`request::Call`];
//! [`dispatch`] decides with its [`dispatch::table`] where it runs; [`execute`] runs
//! it here, or [`forward::caller`] sends it to the owner, whose
//! [`forward::owner`] runs it through [`execute`] in turn. [`worker`] holds the
//! state they share, [`lease`] says whether the worker may act, [`fleet`] is its
//! membership, [`serve`] and [`supervisor`] run the processes ([`process`]).
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod admin;
mod adoption;
mod auth;
mod body;
mod commands;
mod config;
mod decision;
mod digest;
mod dispatch;
mod execute;
mod federation;
mod fleet;
mod forward;
mod front;
mod lease;
mod link;
mod mcp;
mod metrics;
mod process;
mod reason;
mod reply;
mod request;
mod serve;
mod session;
mod sse;
mod supervisor;
mod trace;
mod worker;

use std::process::ExitCode;

/// mimalloc instead of glibc malloc: allocation was 13–17 % of a forwarded request's
/// CPU in profiles, and many small per-request buffers are mimalloc's strong case.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    commands::run()
}
