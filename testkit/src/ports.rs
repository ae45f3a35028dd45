//! Loopback ports: free ones for processes that cannot report their own, and waiting
//! for a port to open or to close.

use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, getsockname, socket};

/// A TCP port that was free a moment ago (for processes that cannot report their own;
/// prefer binding port 0 and reading the port back).
#[track_caller]
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free TCP port on 127.0.0.1: {e}"))
}

/// A loopback TCP port that refuses every connection for as long as this value lives:
/// a socket bound to it that never listens. Unlike a port that was merely free a
/// moment ago, no other process of the run can take it meanwhile, so an upstream
/// configured at it stays down.
#[derive(Debug)]
pub struct RefusingPort {
    _bound: OwnedFd,
    pub port: u16,
}

/// A [`RefusingPort`] on 127.0.0.1.
#[track_caller]
pub fn refusing_port() -> RefusingPort {
    let bound = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap_or_else(|e| panic!("no TCP socket: {e}"));
    bind(bound.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, 0))
        .unwrap_or_else(|e| panic!("no free TCP port on 127.0.0.1: {e}"));
    let port = getsockname::<SockaddrIn>(bound.as_raw_fd())
        .unwrap_or_else(|e| panic!("the bound port: {e}"))
        .port();
    RefusingPort {
        _bound: bound,
        port,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusing_port_refuses_connections_and_cannot_be_taken_while_held() {
        let held = refusing_port();
        let addr = format!("127.0.0.1:{}", held.port);
        let refused = TcpStream::connect(&addr).expect_err("nothing listens there");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        let taken = TcpListener::bind(&addr).expect_err("the port is held");
        assert_eq!(taken.kind(), std::io::ErrorKind::AddrInUse);
        // Servers set SO_REUSEADDR (tokio's listeners do): still held.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
            socket.set_reuseaddr(true).expect("SO_REUSEADDR");
            let taken = socket.bind(addr.parse().expect("an address"));
            assert_eq!(
                taken.map(drop).expect_err("held").kind(),
                std::io::ErrorKind::AddrInUse
            );
        });
        drop(held);
        TcpListener::bind(&addr).expect("free again once dropped");
    }
}
