//! The mcpgw fleet mesh: the Redis directory of workers and session owners, and the
//! mutually authenticated transports (QUIC, TCP) that carry forwarded requests.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod directory;
mod redis_conn;
pub mod transport;

pub use redis_conn::{REDIS_SCHEMES, RedisEndpoint};
pub use transport::{
    ForwardedResponse, MeshClient, MeshError, MeshLimits, MeshServer, MeshServerHandle,
    MeshService, PeerInfo, ResponsePart, TransportKind,
};
