//! mcpgw's integration tests: real Redis, mcpgw workers, upstreams and the official
//! Python MCP SDK as processes, driven from `tests/*.rs`. The support they share
//! (processes, Redis, raw HTTP, signals, polling) lives in `mcpgw-testkit`; this crate
//! holds only the tests.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
