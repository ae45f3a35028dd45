//! Mesh frames exchanged between mcpgw workers: types, codec and protocol version.
//! Holds no I/O policy; transports in `mcpgw-mesh` decide how frames travel.
//!
//! A frame on the wire is a big-endian `u32` body length followed by the body in
//! bincode 1.x format (fixed-width little-endian integers, `u64` lengths, `u32` enum
//! tags), produced and parsed by the `wincode` crate. [`MeshCodec`] does the framing
//! for `tokio_util::codec`; [`MeshCodec::encode_frame`] and
//! [`MeshCodec::decode_frame`] do it for whole messages (the Redis baseline transport).
//!
//! One exchange, on a TCP connection or a QUIC connection's first stream:
//! the caller sends [`Frame::Hello`], the owner answers [`Frame::Welcome`] (or
//! [`Frame::Error`] with [`ErrorKind::VersionMismatch`]). Then, per request:
//! [`Frame::Request`] from the caller; [`Frame::Head`], any number of
//! [`Frame::Chunk`], then [`Frame::End`] or [`Frame::Error`] from the owner; the
//! caller may send [`Frame::Cancel`] at any time before the end.
//!
//! A TCP connection carries many exchanges at once: after the greeting, each frame is
//! preceded by its exchange id ([`MuxCodec`]), and the owner sends body bytes only
//! against [`Frame::Credit`] from the caller, a window per exchange.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod codec;
mod frame;
mod mux;

pub use codec::{DEFAULT_MAX_FRAME, MAX_FRAME_LIMIT, MeshCodec, WireError};
pub use frame::{
    AuthContext, AuthMode, ErrorFrame, ErrorKind, Frame, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION,
    RequestFrame, ResponseHead, negotiate,
};
pub use mux::{MuxCodec, MuxError};
