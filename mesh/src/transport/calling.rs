//! The caller's engine, shared by every transport's caller: the `Hello` → `Welcome`
//! greeting, resolving a peer's address, and what an exchange knows about its link
//! when it ends. The transports build their peer pools on it; the facade over them
//! is `MeshClient` (in `client`).

use std::net::SocketAddr;
use std::time::Duration;

use mcpgw_wire::{Frame, OLDEST_PROTOCOL_VERSION};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::timeout;

use super::error::{LinkError, MeshError};
use super::framed::{FrameReader, FrameWriter};

/// What the caller knows about an exchange's link when the exchange is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExState {
    /// The response is still running: dropping cancels it at the owner.
    Open,
    /// The exchange ended with `End` or `Error`: the link can be reused.
    Clean,
    /// The link is unusable.
    Broken,
}

/// Says `Hello` (offering protocol versions up to `newest`) on a fresh link and reads
/// `Welcome`: the real worker id at `addr`, and the protocol version the owner chose.
pub(crate) async fn greet<R, W>(
    addr: &str,
    local_worker_id: &str,
    expect_worker_id: &str,
    newest: u32,
    reader: &mut FrameReader<R>,
    writer: &mut FrameWriter<W>,
) -> Result<(String, u32), MeshError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let hello = Frame::Hello {
        version: newest,
        worker_id: local_worker_id.to_owned(),
        expect_worker_id: expect_worker_id.to_owned(),
    };
    let connect_err = |reason: String| MeshError::Connect {
        addr: addr.to_owned(),
        reason,
    };
    // A write failure here is reported by the read that follows, with the TLS alert
    // that caused it when there is one (TLS 1.3 servers reject client certificates
    // after the client considers the handshake done).
    let sent = writer.send(&hello).await;
    match reader.next().await {
        Ok(Some(Frame::Welcome { version, worker_id })) => {
            // The owner answers with the version both speak; an owner too old or too
            // new for us answers with its own, and refuses.
            if !(OLDEST_PROTOCOL_VERSION..=newest).contains(&version) {
                return Err(MeshError::VersionMismatch {
                    addr: addr.to_owned(),
                    ours: newest,
                    theirs: version,
                });
            }
            Ok((worker_id, version))
        }
        Ok(Some(Frame::Error(e))) => Err(connect_err(format!("peer refused the greeting: {e}"))),
        Ok(Some(other)) => Err(MeshError::Protocol(format!(
            "expected Welcome, got {}",
            other.name()
        ))),
        Ok(None) => Err(connect_err(match sent {
            Err(e) => format!("connection closed during the greeting: {e}"),
            Ok(()) => "peer closed the connection without answering Hello".into(),
        })),
        Err(LinkError::Broken {
            tls: Some(reason), ..
        }) => Err(MeshError::Tls {
            addr: addr.to_owned(),
            reason,
        }),
        Err(LinkError::Broken { reason, .. }) => Err(connect_err(reason)),
        Err(LinkError::BadFrame(e)) => Err(MeshError::Protocol(e.to_string())),
    }
}

/// Resolves `host:port` (an IP literal needs no lookup).
pub(crate) async fn resolve(peer_addr: &str, within: Duration) -> Result<SocketAddr, MeshError> {
    if let Ok(addr) = peer_addr.parse() {
        return Ok(addr);
    }
    let lookup = timeout(within, tokio::net::lookup_host(peer_addr)).await;
    let connect_err = |reason: String| MeshError::Connect {
        addr: peer_addr.to_owned(),
        reason,
    };
    match lookup {
        Err(_) => Err(MeshError::ConnectTimeout {
            addr: peer_addr.to_owned(),
        }),
        Ok(Err(e)) => Err(connect_err(format!("cannot resolve the address: {e}"))),
        Ok(Ok(mut addrs)) => addrs
            .next()
            .ok_or_else(|| connect_err("the name resolves to no address".into())),
    }
}
