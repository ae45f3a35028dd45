//! A mesh connection at its maximum age is replaced make-before-break: the caller
//! dials its replacement ahead of time and keeps giving the old connection new
//! requests until the new one is up, so a slow handshake costs no request. A proxy
//! of the test's own stands between caller and owner and holds every second new
//! connection's handshake longer than the connect timeout (TCP: the connection; QUIC:
//! the new connection's Initial packets), the way a stalled host does.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use mcpgw_mesh::transport::{MeshError, MeshLimits, TransportKind};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::task::JoinHandle;

both_transports!(
    a_slow_handshake_at_the_maximum_age_costs_no_request,
    an_owner_that_dies_during_a_replacement_is_proven_gone_without_the_connect_timeout,
);

/// How the proxy treats new connections.
#[derive(Default)]
struct ProxyCounts {
    /// New connections seen (TCP connections; QUIC: new Initial destination ids).
    connections: AtomicUsize,
    /// Of which held back for [`HOLD`].
    held: AtomicUsize,
}

/// Longer than the caller's connect timeout in these tests.
const HOLD: Duration = Duration::from_millis(900);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(400);
const MAX_AGE: Duration = Duration::from_millis(1500);

/// A proxy on a loopback port in front of `owner`, holding every second new
/// connection for [`HOLD`]. Dropping the returned task handles (abort) kills it.
struct HoldingProxy {
    addr: SocketAddr,
    counts: Arc<ProxyCounts>,
    tasks: Arc<parking_lot::Mutex<Vec<JoinHandle<()>>>>,
}

impl HoldingProxy {
    async fn start(kind: TransportKind, owner: SocketAddr) -> HoldingProxy {
        let counts = Arc::new(ProxyCounts::default());
        let tasks = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let addr = match kind {
            TransportKind::Tcp => tcp_proxy(owner, counts.clone(), tasks.clone()).await,
            TransportKind::Quic => udp_proxy(owner, counts.clone(), tasks.clone()).await,
            TransportKind::Redis => unreachable!("no handshakes on the Redis transport"),
        };
        HoldingProxy {
            addr,
            counts,
            tasks,
        }
    }

    /// The owner's host dies: the port closes and every connection through it ends.
    fn kill(&self) {
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether the `n`th new connection (from 1) is held: every second one.
fn holds(n: usize) -> bool {
    n.is_multiple_of(2)
}

async fn tcp_proxy(
    owner: SocketAddr,
    counts: Arc<ProxyCounts>,
    tasks: Arc<parking_lot::Mutex<Vec<JoinHandle<()>>>>,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let spliced = tasks.clone();
    let accept = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let n = counts.connections.fetch_add(1, Ordering::SeqCst) + 1;
            let held = holds(n);
            if held {
                counts.held.fetch_add(1, Ordering::SeqCst);
            }
            let splice = tokio::spawn(async move {
                if held {
                    tokio::time::sleep(HOLD).await;
                }
                let Ok(mut outbound) = TcpStream::connect(owner).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
            spliced.lock().push(splice);
        }
    });
    tasks.lock().push(accept);
    addr
}

/// The destination connection id of a QUIC v1 Initial packet (long header, type 0).
fn initial_dcid(datagram: &[u8]) -> Option<&[u8]> {
    let first = *datagram.first()?;
    let long_initial = first & 0x80 != 0 && (first >> 4) & 0x03 == 0;
    if !long_initial {
        return None;
    }
    let len = usize::from(*datagram.get(5)?);
    datagram.get(6..6 + len)
}

/// The source connection id of a QUIC long-header packet: the id the owner chose,
/// which the caller's later Initial packets of the same connection are sent to.
fn long_header_scid(datagram: &[u8]) -> Option<&[u8]> {
    if datagram.first()? & 0x80 == 0 {
        return None;
    }
    let dcid_len = usize::from(*datagram.get(5)?);
    let at = 6 + dcid_len;
    let len = usize::from(*datagram.get(at)?);
    datagram.get(at + 1..at + 1 + len)
}

async fn udp_proxy(
    owner: SocketAddr,
    counts: Arc<ProxyCounts>,
    tasks: Arc<parking_lot::Mutex<Vec<JoinHandle<()>>>>,
) -> SocketAddr {
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind"));
    let addr = front.local_addr().expect("addr");
    // One socket towards the owner per caller address, so the owner's answers find
    // their way back.
    let mut backs: std::collections::HashMap<SocketAddr, Arc<UdpSocket>> = Default::default();
    let mut seen: HashSet<Vec<u8>> = HashSet::new();
    // Ids the owner chose: a caller's Initial sent to one belongs to a connection
    // already counted.
    let owner_ids: Arc<parking_lot::Mutex<HashSet<Vec<u8>>>> = Arc::default();
    let mut held_ids: HashSet<Vec<u8>> = HashSet::new();
    let spawned = tasks.clone();
    let relay = tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((len, from)) = front.recv_from(&mut buf).await {
            let datagram = buf[..len].to_vec();
            let back = match backs.get(&from) {
                Some(back) => back.clone(),
                None => {
                    let Ok(back) = UdpSocket::bind("127.0.0.1:0").await else {
                        continue;
                    };
                    let back = Arc::new(back);
                    let (answers, front) = (back.clone(), front.clone());
                    let owner_ids = owner_ids.clone();
                    let answering = tokio::spawn(async move {
                        let mut buf = vec![0u8; 65_536];
                        while let Ok((len, _)) = answers.recv_from(&mut buf).await {
                            if let Some(scid) = long_header_scid(&buf[..len]) {
                                owner_ids.lock().insert(scid.to_vec());
                            }
                            let _ = front.send_to(&buf[..len], from).await;
                        }
                    });
                    spawned.lock().push(answering);
                    backs.insert(from, back.clone());
                    back
                }
            };
            let mut hold = false;
            let first_flight =
                initial_dcid(&datagram).filter(|dcid| !owner_ids.lock().contains(*dcid));
            if let Some(dcid) = first_flight {
                if seen.insert(dcid.to_vec()) {
                    let n = counts.connections.fetch_add(1, Ordering::SeqCst) + 1;
                    if holds(n) {
                        counts.held.fetch_add(1, Ordering::SeqCst);
                        held_ids.insert(dcid.to_vec());
                    }
                }
                hold = held_ids.contains(dcid);
            }
            if hold {
                let late = tokio::spawn(async move {
                    tokio::time::sleep(HOLD).await;
                    let _ = back.send_to(&datagram, owner).await;
                });
                spawned.lock().push(late);
            } else {
                let _ = back.send_to(&datagram, owner).await;
            }
        }
    });
    tasks.lock().push(relay);
    addr
}

/// Connections aged out quickly, a short connect timeout, and one TCP connection per
/// peer (several connections of different ages would hide a replacement's gap).
fn aging() -> MeshLimits {
    MeshLimits {
        connect_timeout: CONNECT_TIMEOUT,
        max_connection_age: MAX_AGE,
        tcp_pool_size: 1,
        ..limits()
    }
}

/// Forwarded requests from `callers` tasks in a loop until `stop`; returns how many
/// were answered and the errors of those that were not.
async fn load(
    mesh: Arc<Mesh>,
    addr: String,
    callers: usize,
    stop: Arc<AtomicBool>,
) -> (usize, Vec<MeshError>) {
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (mesh, addr, stop) = (mesh.clone(), addr.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut answered, mut failed) = (0, Vec::new());
                while !stop.load(Ordering::SeqCst) {
                    match mesh
                        .client
                        .forward(&addr, OWNER, request("/echo", "x"))
                        .await
                    {
                        Ok(response) => match body_of(response).await {
                            Ok(_) => answered += 1,
                            Err(e) => failed.push(e),
                        },
                        Err(e) => failed.push(e),
                    }
                }
                (answered, failed)
            })
        })
        .collect();
    let mut total = (0, Vec::new());
    for task in tasks {
        let (answered, failed) = task.await.expect("a load task");
        total.0 += answered;
        total.1.extend(failed);
    }
    total
}

async fn a_slow_handshake_at_the_maximum_age_costs_no_request(kind: TransportKind) {
    let mesh = Arc::new(Mesh::start_with(kind, limits(), aging()).await);
    let owner: SocketAddr = mesh.addr().parse().expect("owner address");
    let proxy = HoldingProxy::start(kind, owner).await;
    let stop = Arc::new(AtomicBool::new(false));
    let running = tokio::spawn(load(mesh.clone(), proxy.addr.to_string(), 4, stop.clone()));
    // Five maximum ages: every connection is replaced several times, and every second
    // replacement's handshake is held past the connect timeout.
    tokio::time::sleep(MAX_AGE * 5).await;
    stop.store(true, Ordering::SeqCst);
    let (answered, failed) = running.await.expect("the load");
    let (connections, held) = (
        proxy.counts.connections.load(Ordering::SeqCst),
        proxy.counts.held.load(Ordering::SeqCst),
    );
    eprintln!(
        "{kind}: {answered} answered, {} failed, {connections} connections, {held} held",
        failed.len()
    );
    assert!(
        connections >= 4 && held >= 2,
        "{kind}: the fault happened: {connections} connections made, {held} held"
    );
    assert!(answered > 100, "{kind}: the load ran: {answered} answered");
    assert!(
        failed.is_empty(),
        "{kind}: {} of {} requests failed while connections were replaced ({connections} \
         connections, {held} handshakes held): first {:?}",
        failed.len(),
        answered + failed.len(),
        failed.first()
    );
}

async fn an_owner_that_dies_during_a_replacement_is_proven_gone_without_the_connect_timeout(
    kind: TransportKind,
) {
    let patient_aging = MeshLimits {
        connect_timeout: Duration::from_secs(20),
        ..aging()
    };
    let mesh = Mesh::start_with(kind, limits(), patient_aging).await;
    let owner: SocketAddr = mesh.addr().parse().expect("owner address");
    let proxy = HoldingProxy::start(kind, owner).await;
    let addr = proxy.addr.to_string();
    // The first connection (not held), then past the point where its replacement is
    // dialled: the replacement (the second connection) is held.
    let first = mesh
        .client
        .forward(&addr, OWNER, request("/echo", "x"))
        .await;
    body_of(first.expect("the first request"))
        .await
        .expect("its answer");
    eventually_async(MAX_AGE * 4, || async {
        let _ = mesh
            .client
            .forward(&addr, OWNER, request("/echo", "x"))
            .await;
        match proxy.counts.held.load(Ordering::SeqCst) {
            0 => Err("no replacement dialled yet".to_owned()),
            _ => Ok(()),
        }
    })
    .await;
    // The owner's host dies with its replacement handshake pending.
    proxy.kill();
    // The replacement's dial is refused, which proves the death as it does without a
    // replacement under way: the old connection, which may not have noticed yet, gets
    // no more requests, and the proof comes well before the (patient) connect timeout.
    // A request sent just before the refusal may be lost in the old connection (as on
    // any connection whose owner dies); that is the gateway's probe's to judge, so each
    // try here is bounded.
    let started = std::time::Instant::now();
    let proven = loop {
        let tried = tokio::time::timeout(
            Duration::from_secs(1),
            mesh.client.forward(&addr, OWNER, request("/echo", "x")),
        )
        .await;
        match tried {
            Ok(Err(e)) if e.proves_peer_gone() => break e,
            Ok(Ok(_)) => panic!("{kind}: answered after the owner died"),
            Ok(Err(_)) | Err(_) => {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "{kind}: no proof of the owner's death after {:?}",
                    started.elapsed()
                );
            }
        }
    };
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{kind}: proof took {:?} ({proven:?})",
        started.elapsed()
    );
}
