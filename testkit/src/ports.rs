//! Loopback ports: free ones for processes that cannot report their own, and waiting
//! for a port to open or to close.

use std::net::{TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

/// A TCP port that was free a moment ago (for processes that cannot report their own;
/// prefer binding port 0 and reading the port back).
#[track_caller]
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free TCP port on 127.0.0.1: {e}"))
}

/// A UDP port that was free a moment ago (QUIC endpoints).
#[track_caller]
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free UDP port on 127.0.0.1: {e}"))
}

/// Waits until something accepts TCP connections at `addr` (`host:port`).
#[track_caller]
pub fn wait_for_listener(addr: &str, within: Duration) {
    crate::eventually(within, || {
        TcpStream::connect(addr)
            .map(drop)
            .map_err(|e| format!("{addr}: {e}"))
    });
}

/// Waits until nothing accepts TCP connections at `addr` any more: the port closed.
#[track_caller]
pub fn wait_until_refused(addr: &str, within: Duration) {
    crate::eventually(within, || match TcpStream::connect(addr) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        Err(e) => Err(format!("{addr}: {e}")),
        Ok(_) => Err(format!("{addr} still accepts connections")),
    });
}
