//! Mesh certificates for mcpgw: a private CA, leaf issuance, and the rustls configs
//! that make every mesh connection mutually authenticated.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
