//! The mesh port against peers that take more than their share: handshakes that never
//! finish (anyone who reaches the port can open them) and a mesh leaf that declares
//! made-up worker ids to get fresh budgets.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, Once};
use std::time::Instant;

use common::*;
use mcpgw_mesh::transport::{MESH_ALPN, MeshClient, MeshLimits, TransportKind};
use mcpgw_wire::ErrorKind;
use tokio::io::AsyncReadExt;

both_transports!(
    silent_handshakes_are_capped_per_address_and_logged_in_few_lines,
    made_up_worker_ids_share_one_identity_budget,
);

const FLOOD: usize = 500;
/// The tests' own flood sources, so that each test counts only its own log lines
/// (all tests of this file share one process and one log).
const TCP_FLOODER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const QUIC_FLOODER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
const FAILURE_LINE: &str = "mesh handshakes failed or refused before authentication";

/// Everything the mesh logs in this process, to count lines.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock().expect("log").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the capturing subscriber before `common` can install its own.
fn capture_log() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        tracing_subscriber::fmt()
            .with_env_filter("mcpgw_mesh=debug")
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .init();
    });
}

/// The failure lines about handshakes from `source`.
fn failure_lines(source: Ipv4Addr) -> Vec<String> {
    let log = LOG.lock().expect("log");
    let remote = format!("remote={source}:");
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| l.contains(FAILURE_LINE) && l.contains(&remote))
        .map(str::to_owned)
        .collect()
}

/// Opens `FLOOD` TCP connections from `TCP_FLOODER` that never send a byte; returns
/// them with a count of those the server has closed.
async fn silent_tcp_flood(server: SocketAddr) -> (Vec<tokio::task::JoinHandle<()>>, Arc<()>) {
    let closed = Arc::new(());
    let mut held = Vec::new();
    for _ in 0..FLOOD {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(IpAddr::V4(TCP_FLOODER), 0))
            .expect("bind the flood source");
        let mut stream = socket.connect(server).await.expect("connect");
        let closed = closed.clone();
        held.push(tokio::spawn(async move {
            // Holds the connection; a read returns only when the server closes it.
            let mut byte = [0u8; 1];
            let _ = stream.read(&mut byte).await;
            // Counted by the clones that are gone.
            drop(closed);
            std::future::pending::<()>().await;
        }));
    }
    (held, closed)
}

/// Starts `FLOOD` QUIC handshakes from `QUIC_FLOODER` that never finish: they go
/// through a relay that passes the client's datagrams to the server and drops every
/// answer. Returns what keeps them going.
async fn silent_quic_flood(
    pki: &Pki,
    server: SocketAddr,
) -> (quinn::Endpoint, Vec<quinn::Connecting>) {
    let relay = tokio::net::UdpSocket::bind(SocketAddr::new(IpAddr::V4(QUIC_FLOODER), 0))
        .await
        .expect("bind relay");
    let relay_addr = relay.local_addr().expect("relay addr");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        loop {
            let Ok((n, from)) = relay.recv_from(&mut buf).await else {
                return;
            };
            if from != server {
                let _ = relay.send_to(&buf[..n], server).await;
            }
        }
    });
    let mut tls = (*pki.member("flooder").client_config()).clone();
    tls.alpn_protocols = vec![MESH_ALPN.to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls)).expect("QUIC TLS");
    let mut endpoint =
        quinn::Endpoint::client(SocketAddr::new(IpAddr::V4(QUIC_FLOODER), 0)).expect("endpoint");
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let connecting = (0..FLOOD)
        .map(|_| {
            endpoint
                .connect(relay_addr, mcpgw_certs::MESH_SERVER_NAME)
                .expect("start a handshake")
        })
        .collect();
    (endpoint, connecting)
}

async fn silent_handshakes_are_capped_per_address_and_logged_in_few_lines(kind: TransportKind) {
    capture_log();
    // No handshake deadline passes during the test: every failure seen is the cap's.
    let cap = 64;
    let server_limits = MeshLimits {
        max_handshakes_per_addr: cap,
        ..patient()
    };
    let mesh = Mesh::start_with(kind, server_limits, limits()).await;
    let server = mesh.server.local_addr();
    let started = Instant::now();
    let (source, _tcp, _quic) = match kind {
        TransportKind::Tcp => {
            let (held, closed) = silent_tcp_flood(server).await;
            // The cap closes every connection over it at once, before any TLS work;
            // those under it wait for the handshake deadline, which does not come.
            let expect_open = cap + 1; // the count's own handle
            eventually_async(TEST_TIMEOUT / 2, || async {
                match Arc::strong_count(&closed) {
                    n if n <= expect_open => Ok(()),
                    n => Err(format!(
                        "{} of {FLOOD} silent connections still open, expected {cap}",
                        n - 1
                    )),
                }
            })
            .await;
            assert_eq!(
                Arc::strong_count(&closed) - 1,
                cap,
                "exactly the per-address cap of silent connections stays in its handshake"
            );
            (TCP_FLOODER, Some((held, closed)), None)
        }
        TransportKind::Quic => {
            let flood = silent_quic_flood(&mesh.pki, server).await;
            // Only the cap can fail a handshake here: the deadline does not pass.
            eventually_async(TEST_TIMEOUT / 2, || async {
                if failure_lines(QUIC_FLOODER)
                    .iter()
                    .any(|l| l.contains("cause=\"over_cap\""))
                {
                    Ok(())
                } else {
                    Err("no QUIC handshake refused over the cap yet".to_owned())
                }
            })
            .await;
            // The cap's value: exactly that many silent handshakes hold their place.
            eventually_async(TEST_TIMEOUT / 2, || async {
                match mesh.server.handshakes_in_progress() {
                    n if n == cap => Ok(()),
                    n => Err(format!(
                        "{n} QUIC handshakes in progress, expected the cap {cap}"
                    )),
                }
            })
            .await;
            (QUIC_FLOODER, None, Some(flood))
        }
        TransportKind::Redis => unreachable!("no mesh port"),
    };
    eprintln!("{kind}: flood in place after {:?}", started.elapsed());

    // Members from other addresses are still served, on fresh connections too.
    for i in 0..20 {
        let body = format!("during the flood {i}");
        let response = mesh
            .forward("/echo", body.clone())
            .await
            .unwrap_or_else(|e| panic!("{kind}: forward {i} during the flood: {e}"));
        let (got, _) = body_of(response).await.expect("body");
        assert_eq!(got, body.as_bytes());
    }
    let fresh = MeshClient::new(
        kind,
        mesh.pki.member("late").client_config(),
        "late-1",
        limits(),
        None,
    )
    .expect("client");
    let response = fresh
        .forward(&mesh.addr(), OWNER, request("/echo", "fresh"))
        .await
        .unwrap_or_else(|e| panic!("{kind}: a new member's dial during the flood: {e}"));
    assert_eq!(body_of(response).await.expect("body").0, b"fresh");

    let lines = failure_lines(source);
    eprintln!(
        "{kind}: {} log lines about the flood after {:?}:\n{}",
        lines.len(),
        started.elapsed(),
        lines.join("\n")
    );
    assert!(!lines.is_empty(), "the refusals are logged");
    // One line per 10 s interval: the first refusal, and at most one more per
    // interval the test lasted.
    let allowed = 1 + (started.elapsed().as_secs() / 10) as usize;
    assert!(
        lines.len() <= allowed,
        "{} lines about {FLOOD} silent handshakes, expected at most {allowed}",
        lines.len()
    );
}

async fn made_up_worker_ids_share_one_identity_budget(kind: TransportKind) {
    capture_log();
    let budget = 2;
    let server_limits = MeshLimits {
        max_in_flight_per_peer: budget,
        ..limits()
    };
    let mesh = Mesh::start_with(kind, server_limits, limits()).await;
    // One leaf, one client per declared id: each client's own budget is fresh, so
    // only the owner's books can stop the leaf.
    let leaf = mesh.pki.member("leaf");
    let mut held = Vec::new();
    for i in 0..budget {
        let client = MeshClient::new(
            kind,
            leaf.client_config(),
            format!("made-up-{i}"),
            limits(),
            None,
        )
        .expect("client");
        let response = client
            .forward(&mesh.addr(), OWNER, request("/hang", ""))
            .await
            .unwrap_or_else(|e| panic!("{kind}: held exchange {i} within the budget: {e}"));
        held.push((client, response));
    }
    let extra = MeshClient::new(kind, leaf.client_config(), "made-up-extra", limits(), None)
        .expect("client");
    let err = extra
        .forward(&mesh.addr(), OWNER, request("/hang", ""))
        .await
        .expect_err("one identity's budget is used up, whatever id the leaf declares");
    let remote = err.remote().cloned();
    assert_eq!(
        remote.as_ref().map(|e| e.kind),
        Some(ErrorKind::Busy),
        "{err:?}"
    );
    let message = remote.map(|e| e.message).unwrap_or_default();
    assert!(
        message.contains("for mesh member leaf"),
        "the refusal names the identity: {message}"
    );
    // Another identity has its own budget.
    let (got, _) = body_of(mesh.forward("/echo", "other").await.expect("other member"))
        .await
        .expect("body");
    assert_eq!(got, b"other");
}
