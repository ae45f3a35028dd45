//! The load side of `mcpgw-bench`: `run` (closed-loop load against gateway URLs),
//! `compare` (every forwarding configuration side by side, in one run, on one
//! machine) and `sessions` (memory per idle session).
//!
//! It talks to the gateway only over HTTP, as a user would, and reads the machine's
//! own counters (/proc, Redis INFO) around each measured window.

mod client;
pub mod compare;
mod fleet;
mod latency;
mod loopback;
mod mix;
mod procfs;
mod redis;
mod report;
mod routing;
pub mod run;
pub mod sessions;
mod svg;
mod targets;
mod units;
