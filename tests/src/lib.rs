//! Test support for mcpgw: starts real Redis, mcpgw and demo-upstream processes on
//! ephemeral loopback ports, and finds the Python MCP SDK the build installed.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
