//! Mesh frames exchanged between mcpgw workers: types, codec and protocol version.
//! Holds no I/O policy; transports in `mcpgw-mesh` decide how frames travel.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
