//! The load side of `mcpgw-bench`: `run` (closed-loop load against gateway URLs),
//! `compare` (every forwarding configuration side by side, in one run, on one
//! machine), `sessions` (memory per idle session), `failover` (time to the first
//! truthful answer after a worker is killed or paused) and `scale` (a fleet holding
//! thousands of sessions' event streams under load).
//!
//! It talks to the gateway only over HTTP, as a user would, and reads the machine's
//! own counters (/proc, Redis INFO) around each measured window.

mod client;
pub mod compare;
pub mod failover;
mod fleet;
mod latency;
mod loopback;
mod mix;
mod procfs;
mod redis;
mod report;
mod routing;
pub mod run;
pub mod scale;
pub mod sessions;
mod svg;
mod targets;
mod units;
