//! The owner's server against a hand-driven peer that speaks raw frames: bad frames,
//! wrong versions and misplaced frames get error frames, and never cost the
//! connection's other work. On TCP, frames after the greeting are multiplexed: each
//! names its exchange, and errors come back on the exchange they concern.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use common::*;
use mcpgw_certs::{MESH_SERVER_NAME, MeshTls};
use mcpgw_mesh::transport::{MESH_ALPN, MeshLimits, TransportKind};
use mcpgw_wire::{
    ErrorKind, Frame, MeshCodec, MuxCodec, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, WireError,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::Decoder;

/// A peer that writes and reads frames by hand.
struct Raw<R, W> {
    r: R,
    w: W,
    buf: BytesMut,
    codec: MeshCodec,
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Raw<R, W> {
    fn new(r: R, w: W) -> Self {
        Self {
            r,
            w,
            buf: BytesMut::new(),
            codec: MeshCodec::default(),
        }
    }

    async fn send(&mut self, frame: &Frame) {
        let bytes = self.codec.encode_frame(frame).expect("encode");
        self.send_raw(&bytes).await;
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        self.w.write_all(bytes).await.expect("write");
        self.w.flush().await.expect("flush");
    }

    /// The next frame, or `None` at end of stream.
    async fn next(&mut self) -> Option<Result<Frame, WireError>> {
        let read = async {
            loop {
                match self.codec.decode(&mut self.buf) {
                    Ok(Some(frame)) => return Some(Ok(frame)),
                    Err(e) => return Some(Err(e)),
                    Ok(None) => {}
                }
                if self.r.read_buf(&mut self.buf).await.ok()? == 0 {
                    return None;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("peer answered in time")
    }

    async fn expect_error(&mut self, kind: ErrorKind) {
        match self.next().await {
            Some(Ok(Frame::Error(e))) if e.kind == kind => {}
            other => panic!("expected Error({kind:?}), got {other:?}"),
        }
    }

    /// Reads a whole response: head status, then body until End.
    async fn expect_response(&mut self) -> (u16, Vec<u8>) {
        let status = match self.next().await {
            Some(Ok(Frame::Head(head))) => head.status,
            other => panic!("expected Head, got {other:?}"),
        };
        let mut body = Vec::new();
        loop {
            match self.next().await {
                Some(Ok(Frame::Chunk(c))) => body.extend_from_slice(&c),
                Some(Ok(Frame::End)) => return (status, body),
                other => panic!("expected Chunk or End, got {other:?}"),
            }
        }
    }
}

/// A TCP peer past its greeting, speaking multiplexed frames.
struct Muxed<R, W> {
    raw: Raw<R, W>,
    mux: MuxCodec,
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Muxed<R, W> {
    async fn send(&mut self, exchange: u64, frame: &Frame) {
        let mut bytes = BytesMut::new();
        self.mux
            .encode(exchange, frame, &mut bytes)
            .expect("encode");
        self.raw.send_raw(&bytes).await;
    }

    /// The next frame and its exchange.
    async fn next(&mut self) -> (u64, Frame) {
        let raw = &mut self.raw;
        let mux = &mut self.mux;
        let read = async {
            loop {
                match mux.decode(&mut raw.buf) {
                    Ok(Some(pair)) => return pair,
                    Err(e) => panic!("the owner sent a bad frame: {e}"),
                    Ok(None) => {}
                }
                let n = raw.r.read_buf(&mut raw.buf).await.expect("read");
                assert!(n > 0, "the owner closed the connection");
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("peer answered in time")
    }

    async fn expect_error(&mut self, exchange: u64, kind: ErrorKind) {
        match self.next().await {
            (id, Frame::Error(e)) if id == exchange && e.kind == kind => {}
            other => panic!("expected Error({kind:?}) on exchange {exchange}, got {other:?}"),
        }
    }

    /// Reads a whole response of `exchange`: head status, then body until End.
    async fn expect_response(&mut self, exchange: u64) -> (u16, Vec<u8>) {
        let status = match self.next().await {
            (id, Frame::Head(head)) if id == exchange => head.status,
            other => panic!("expected Head on exchange {exchange}, got {other:?}"),
        };
        let mut body = Vec::new();
        loop {
            match self.next().await {
                (id, Frame::Chunk(c)) if id == exchange => body.extend_from_slice(&c),
                (id, Frame::End) if id == exchange => return (status, body),
                other => panic!("expected Chunk or End on exchange {exchange}, got {other:?}"),
            }
        }
    }
}

fn hello(version: u32) -> Frame {
    Frame::Hello {
        version,
        worker_id: "raw-1".into(),
        expect_worker_id: OWNER.into(),
    }
}

/// A frame with a valid length prefix and a body that is no frame.
fn garbage_frame() -> Vec<u8> {
    let body = [0xFFu8, 0xFF, 0xFF, 0x7F, 1, 2, 3];
    let mut out = BytesMut::new();
    out.put_u32(body.len() as u32);
    out.extend_from_slice(&body);
    out.to_vec()
}

fn request_frame(path: &str, body: &'static str) -> Frame {
    Frame::Request(Box::new(request(path, body)))
}

fn client_tls(member: &MeshTls) -> Arc<rustls::ClientConfig> {
    let mut config = (*member.client_config()).clone();
    config.alpn_protocols = vec![MESH_ALPN.to_vec()];
    Arc::new(config)
}

type TcpRaw = Raw<
    tokio::io::ReadHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    tokio::io::WriteHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
>;

async fn tcp_raw(mesh: &Mesh) -> TcpRaw {
    let tls = client_tls(&mesh.pki.member("raw"));
    let stream = tokio::net::TcpStream::connect(mesh.server.local_addr())
        .await
        .expect("connect");
    let name = rustls::pki_types::ServerName::try_from(MESH_SERVER_NAME).expect("name");
    let tls = tokio_rustls::TlsConnector::from(tls)
        .connect(name, stream)
        .await
        .expect("TLS");
    let (r, w) = tokio::io::split(tls);
    Raw::new(r, w)
}

type TcpMuxed = Muxed<
    tokio::io::ReadHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    tokio::io::WriteHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
>;

async fn greeted_tcp(mesh: &Mesh, max_frame: usize) -> TcpMuxed {
    greeted_tcp_at(mesh, max_frame, PROTOCOL_VERSION).await
}

/// A raw TCP peer greeted as a caller whose newest protocol is `version`.
async fn greeted_tcp_at(mesh: &Mesh, max_frame: usize, version: u32) -> TcpMuxed {
    let offered = version;
    let mut raw = tcp_raw(mesh).await;
    raw.send(&hello(offered)).await;
    match raw.next().await {
        Some(Ok(Frame::Welcome { version, worker_id })) => {
            assert_eq!(version, offered, "the owner agrees on the caller's version");
            assert_eq!(worker_id, OWNER);
        }
        other => panic!("expected Welcome, got {other:?}"),
    }
    Muxed {
        raw,
        mux: MuxCodec::new(max_frame),
    }
}

async fn within_timeout(test: impl Future<Output = ()>) {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out");
}

#[tokio::test]
async fn tcp_malformed_frame_gets_an_error_and_the_connection_serves_on() {
    within_timeout(async {
        let small = MeshLimits {
            max_frame: 64 * 1024,
            ..limits()
        };
        let mesh = Mesh::start_with(TransportKind::Tcp, small, limits()).await;
        let mut raw = greeted_tcp(&mesh, 1 << 20).await;
        // Exchange 5's frame is no frame: answered on exchange 5.
        let mut garbage = BytesMut::new();
        garbage.put_u32(12);
        garbage.extend_from_slice(&5u64.to_le_bytes());
        garbage.extend_from_slice(&[0xFF, 0xFF, 0xFF, 0x7F]);
        raw.raw.send_raw(&garbage).await;
        raw.expect_error(5, ErrorKind::Malformed).await;
        // Too short to name an exchange: answered on exchange 0, which no caller uses.
        raw.raw.send_raw(&garbage_frame()).await;
        raw.expect_error(0, ErrorKind::Malformed).await;
        // A frame that is not a request where a request belongs.
        raw.send(6, &Frame::End).await;
        raw.expect_error(6, ErrorKind::Malformed).await;
        // An oversized frame: skipped whole, answered TooLarge on its exchange.
        let mut big = BytesMut::new();
        big.put_u32(100 * 1024);
        big.extend_from_slice(&7u64.to_le_bytes());
        raw.raw.send_raw(&big).await;
        raw.expect_error(7, ErrorKind::TooLarge).await;
        raw.raw.send_raw(&vec![0u8; 100 * 1024 - 8]).await;
        // Still in sync: a real request is served on the same connection.
        raw.send(8, &request_frame("/echo", "still here")).await;
        assert_eq!(raw.expect_response(8).await, (200, b"still here".to_vec()));
        assert_eq!(mesh.record.started.load(Ordering::SeqCst), 1);
    })
    .await;
}

#[tokio::test]
async fn tcp_exchanges_of_one_connection_are_independent() {
    within_timeout(async {
        let mesh = Mesh::start(TransportKind::Tcp).await;
        let mut raw = greeted_tcp(&mesh, 1 << 20).await;
        // A request that never ends, then one that does, on the same connection.
        raw.send(1, &request_frame("/hang", "")).await;
        assert!(matches!(raw.next().await, (1, Frame::Head(_))));
        raw.send(2, &request_frame("/echo", "beside it")).await;
        assert_eq!(raw.expect_response(2).await, (200, b"beside it".to_vec()));
        // A repeated running id is refused and does not run twice.
        raw.send(1, &request_frame("/echo", "again")).await;
        raw.expect_error(1, ErrorKind::Malformed).await;
        assert_eq!(mesh.record.started.load(Ordering::SeqCst), 2);
        // Cancelling the first ends it, and only it.
        raw.send(1, &Frame::Cancel).await;
        mesh.await_cancelled(1).await;
        raw.send(3, &request_frame("/echo", "after")).await;
        let (status, body) = loop {
            // The cancelled exchange's last word may come first.
            match raw.next().await {
                (1, Frame::Error(_)) => continue,
                (3, Frame::Head(head)) => {
                    let mut body = Vec::new();
                    loop {
                        match raw.next().await {
                            (3, Frame::Chunk(c)) => body.extend_from_slice(&c),
                            (3, Frame::End) => break,
                            other => panic!("expected exchange 3's body, got {other:?}"),
                        }
                    }
                    break (head.status, body);
                }
                other => panic!("expected exchange 3's head, got {other:?}"),
            }
        };
        assert_eq!((status, body), (200, b"after".to_vec()));
    })
    .await;
}

#[tokio::test]
async fn tcp_a_caller_two_versions_older_is_refused_with_both_versions() {
    within_timeout(async {
        let mesh = Mesh::start(TransportKind::Tcp).await;
        let mut raw = tcp_raw(&mesh).await;
        raw.send(&hello(OLDEST_PROTOCOL_VERSION - 1)).await;
        match raw.next().await {
            Some(Ok(Frame::Welcome { version, .. })) => assert_eq!(version, PROTOCOL_VERSION),
            other => panic!("expected Welcome with the owner's version, got {other:?}"),
        }
        raw.expect_error(ErrorKind::VersionMismatch).await;
        assert!(
            raw.next().await.is_none(),
            "the owner closes the connection"
        );
    })
    .await;
}

#[tokio::test]
async fn tcp_request_before_hello_is_refused() {
    within_timeout(async {
        let mesh = Mesh::start(TransportKind::Tcp).await;
        let mut raw = tcp_raw(&mesh).await;
        raw.send(&request_frame("/echo", "no hello")).await;
        raw.expect_error(ErrorKind::Malformed).await;
        assert!(
            raw.next().await.is_none(),
            "the owner closes the connection"
        );
        assert_eq!(mesh.record.started.load(Ordering::SeqCst), 0);
    })
    .await;
}

#[tokio::test]
async fn quic_bad_streams_do_not_disturb_other_streams() {
    within_timeout(async {
        init_tracing();
        let mesh = Mesh::start(TransportKind::Quic).await;
        let crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(client_tls(&mesh.pki.member("raw")))
                .expect("QUIC TLS");
        let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse::<SocketAddr>().expect("addr"))
            .expect("endpoint");
        let conn = endpoint
            .connect_with(
                quinn::ClientConfig::new(Arc::new(crypto)),
                mesh.server.local_addr(),
                MESH_SERVER_NAME,
            )
            .expect("connect")
            .await
            .expect("handshake");
        let open = || async {
            let (send, recv) = conn.open_bi().await.expect("stream");
            Raw::new(recv, send)
        };

        let mut greeting = open().await;
        greeting.send(&hello(PROTOCOL_VERSION)).await;
        assert!(matches!(
            greeting.next().await,
            Some(Ok(Frame::Welcome { .. }))
        ));

        // A long-running request on its own stream.
        let mut hanging = open().await;
        hanging.send(&request_frame("/hang", "")).await;
        assert!(matches!(hanging.next().await, Some(Ok(Frame::Head(_)))));

        let mut garbage = open().await;
        garbage.send_raw(&garbage_frame()).await;
        garbage.expect_error(ErrorKind::Malformed).await;

        let mut oversized = open().await;
        let mut big = BytesMut::new();
        big.put_u32(64 << 20);
        oversized.send_raw(&big).await;
        oversized.expect_error(ErrorKind::TooLarge).await;

        let mut echo = open().await;
        echo.send(&request_frame("/echo", "next stream")).await;
        assert_eq!(echo.expect_response().await, (200, b"next stream".to_vec()));

        // The long-running request was never disturbed...
        assert_eq!(mesh.record.cancelled.load(Ordering::SeqCst), 0);
        // ...and a Cancel frame stops it, answered Cancelled.
        hanging.send(&Frame::Cancel).await;
        hanging.expect_error(ErrorKind::Cancelled).await;
        mesh.await_cancelled(1).await;
    })
    .await;
}

/// A caller newer than the owner is answered with the owner's newest version, which
/// the caller then speaks (it speaks the version before its own too).
#[tokio::test]
async fn tcp_a_newer_caller_is_answered_with_the_owners_version() {
    within_timeout(async {
        let mesh = Mesh::start(TransportKind::Tcp).await;
        let mut raw = tcp_raw(&mesh).await;
        raw.send(&hello(PROTOCOL_VERSION + 1)).await;
        match raw.next().await {
            Some(Ok(Frame::Welcome { version, .. })) => assert_eq!(version, PROTOCOL_VERSION),
            other => panic!("expected Welcome, got {other:?}"),
        }
    })
    .await;
}

/// A draining owner tells a caller of protocol 4 to go away (`GoAway`, new in 4), and
/// never sends that frame to a caller of protocol 3, which could not read it: that one
/// learns of the drain from its next request's `Error(Draining)`.
#[tokio::test]
async fn tcp_a_draining_owner_sends_go_away_only_to_callers_that_read_it() {
    within_timeout(async {
        let mesh = Mesh::start(TransportKind::Tcp).await;
        let mut current = greeted_tcp_at(&mesh, mcpgw_wire::DEFAULT_MAX_FRAME, 4).await;
        let mut previous = greeted_tcp_at(
            &mesh,
            mcpgw_wire::DEFAULT_MAX_FRAME,
            OLDEST_PROTOCOL_VERSION,
        )
        .await;
        // Both connections work before the drain.
        current
            .send(1, &Frame::Request(Box::new(request("/echo", "a"))))
            .await;
        assert_eq!(current.expect_response(1).await, (200, b"a".to_vec()));
        previous
            .send(1, &Frame::Request(Box::new(request("/echo", "b"))))
            .await;
        assert_eq!(previous.expect_response(1).await, (200, b"b".to_vec()));
        mesh.server.drain();
        assert_eq!(current.next().await, (0, Frame::GoAway));
        previous
            .send(2, &Frame::Request(Box::new(request("/echo", "c"))))
            .await;
        // The first frame the older caller gets after the drain is its request's
        // refusal: no GoAway came before it.
        previous.expect_error(2, ErrorKind::Draining).await;
    })
    .await;
}
