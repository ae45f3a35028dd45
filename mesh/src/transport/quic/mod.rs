//! QUIC transport (quinn): one connection per peer, one bidirectional stream per
//! request.
//!
//! The connection's first stream carries `Hello` → `Welcome` and is then finished;
//! every later stream carries exactly one request exchange. Streams are independent,
//! so a slow or broken request never delays the others, and a bad frame costs only
//! its own stream.
//!
//! - this module: what both ends share: the UDP endpoint, the idle timeout, the
//!   acknowledgement frequency, the close codes, reading the peer's certificate chain;
//! - `owner`: the endpoint's accept loop, and serving one stream's exchange;
//! - `caller`: the peer pool, dialling (with the probe that notices a closed UDP
//!   port), and one request's stream pair.

pub(super) mod caller;
pub(super) mod owner;

use std::net::SocketAddr;
use std::time::Duration;

use quinn::{Connection, Endpoint, IdleTimeout, VarInt};
use rustls::pki_types::CertificateDer;

use super::config::MeshLimits;
use super::error::MeshError;

/// Application error code closing a connection whose greeting failed.
pub(super) const GREETING_FAILED: VarInt = VarInt::from_u32(3);
/// Application error code closing a connection that outlived its maximum age or its
/// peer's certificate.
pub(super) const CONNECTION_TOO_OLD: VarInt = VarInt::from_u32(4);

/// Acknowledgement frequency each end asks of the other (the QUIC ACK frequency
/// extension, which both ends here speak). Mesh traffic is request and answer: the
/// answer carries the acknowledgement of the request, and the next request that of
/// the answer, so a datagram that only acknowledges is mostly waste. Asking for an
/// acknowledgement every ten packets, or after 5 ms, removes most of them; loss
/// recovery on a data-centre link still sees an acknowledgement within a few
/// milliseconds.
pub(super) fn sparse_acks() -> quinn::AckFrequencyConfig {
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(VarInt::from_u32(10))
        .max_ack_delay(Some(Duration::from_millis(5)));
    acks
}

/// The mesh idle timeout as quinn takes it; both ends set the same one, so either
/// notices a silent peer after it.
pub(super) fn idle_timeout(limits: &MeshLimits) -> Result<IdleTimeout, MeshError> {
    IdleTimeout::try_from(limits.idle_timeout)
        .map_err(|_| MeshError::Config("mesh idle timeout is too large for QUIC".into()))
}

/// Kernel buffer asked for each mesh UDP socket. Bursts of datagrams from many
/// concurrent streams overflow the usual ~200 KiB default and are dropped (measured:
/// 1,388 drops in 3 s at 512 concurrent requests), which costs retransmits and tail
/// latency. The kernel caps the request at `net.core.rmem_max`/`wmem_max`.
const UDP_BUFFER_BYTES: usize = 4 << 20;

/// A quinn endpoint on its own UDP socket with large kernel buffers.
pub(super) fn endpoint_on(
    bind: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<Endpoint> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    // Best effort: a smaller buffer still works, only with more drops under bursts.
    let _ = socket.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = socket.set_send_buffer_size(UDP_BUFFER_BYTES);
    socket.bind(&bind.into())?;
    let runtime = quinn::default_runtime()
        .ok_or_else(|| std::io::Error::other("no async runtime for the QUIC endpoint"))?;
    Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        socket.into(),
        runtime,
    )
}

/// The peer's certificate chain (already verified by the TLS layer).
pub(super) fn peer_chain(conn: &Connection) -> Result<Vec<CertificateDer<'static>>, String> {
    conn.peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|chain| *chain)
        .ok_or_else(|| "no peer certificate".to_owned())
}
