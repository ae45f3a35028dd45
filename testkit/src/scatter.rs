//! A scattering load balancer for tests: every HTTP request it receives goes out on a
//! fresh connection to a randomly chosen backend (or to the one a test's routing
//! function picks), and the answer streams back as it arrives. Behind it, a client's
//! session requests land on every worker, the way an L4 balancer plus SO_REUSEPORT
//! scatter them in production.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

/// The header on an answer the proxy gave itself, instead of a backend.
pub const PROXY_HEADER: &str = "x-scatter-proxy";
/// [`PROXY_HEADER`]'s value when the chosen backend refused the connection: the
/// request reached no backend (an L4 balancer would have tried another).
pub const BACKEND_REFUSED: &str = "backend_refused";

pub struct ScatterProxy {
    /// `host:port` clients connect to.
    pub addr: String,
    /// Set on drop: the accept loop ends at its next connection.
    stop: Arc<AtomicBool>,
    /// Requests sent to each backend, in the order of `backends`.
    pub sent: Arc<Vec<AtomicU64>>,
}

/// Picks the backend of a request from its HTTP method and body (taken modulo the
/// number of backends): a test decides which worker sees what.
pub type Route = fn(method: &str, body: &[u8]) -> usize;

impl ScatterProxy {
    /// Each request to a random backend.
    #[track_caller]
    pub fn start(backends: Vec<String>) -> ScatterProxy {
        Self::start_routed(backends, |_, _| random_index(usize::MAX))
    }

    /// Each request to the backend `route` picks.
    #[track_caller]
    pub fn start_routed(backends: Vec<String>, route: Route) -> ScatterProxy {
        assert!(!backends.is_empty(), "a scatter proxy needs a backend");
        let listener = TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("cannot bind the scatter proxy: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("scatter proxy address: {e}"))
            .to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let sent: Arc<Vec<AtomicU64>> =
            Arc::new(backends.iter().map(|_| AtomicU64::new(0)).collect());
        let backends = Arc::new(backends);
        {
            let stop = Arc::clone(&stop);
            let sent = Arc::clone(&sent);
            thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let backends = Arc::clone(&backends);
                    let sent = Arc::clone(&sent);
                    thread::spawn(move || serve_client(client, &backends, &sent, route));
                }
            });
        }
        ScatterProxy { addr, stop, sent }
    }

    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// Requests sent to each backend so far, in the order of the backends.
    pub fn sent_counts(&self) -> Vec<u64> {
        self.sent
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }
}

impl Drop for ScatterProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(&self.addr);
    }
}

fn random_index(n: usize) -> usize {
    let mut bytes = [0u8; 8];
    let _ = getrandom_fill(&mut bytes);
    (u64::from_le_bytes(bytes) % n as u64) as usize
}

fn getrandom_fill(buf: &mut [u8]) -> std::io::Result<()> {
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// Serves the one request of a client connection on a fresh backend connection, then
/// closes both (the backend's answer says `Connection: close`).
fn serve_client(client: TcpStream, backends: &[String], sent: &[AtomicU64], route: Route) {
    let _ = client.set_nodelay(true);
    let Ok(mut writer) = client.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(client);
    // Read one request head.
    let mut head = Vec::new();
    let mut method = String::new();
    let mut content_length = 0usize;
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if head.is_empty() {
            method = line.split_whitespace().next().unwrap_or("").to_owned();
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            content_length = v.trim().parse().unwrap_or(0);
        }
        if lower.starts_with("connection:") {
            continue;
        }
        if line == "\r\n" || line == "\n" {
            head.extend_from_slice(b"Connection: close\r\n\r\n");
            break;
        }
        head.extend_from_slice(line.as_bytes());
    }
    let mut body = vec![0u8; content_length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let index = route(&method, &body) % backends.len();
    sent[index].fetch_add(1, Ordering::Relaxed);
    let Ok(mut backend) = TcpStream::connect(&backends[index]) else {
        // Said in a header of its own, so a test tells this answer (nothing reached a
        // gateway) from a gateway's 502.
        let _ = writer.write_all(
            format!(
                "HTTP/1.1 502 Bad Gateway\r\n{PROXY_HEADER}: {BACKEND_REFUSED}\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        );
        return;
    };
    let _ = backend.set_nodelay(true);
    if backend
        .write_all(&head)
        .and_then(|_| backend.write_all(&body))
        .is_err()
    {
        return;
    }
    // The backend closes after its answer (Connection: close), and its answer says
    // so, so the client opens a new connection for its next request.
    let mut buf = [0u8; 16384];
    loop {
        match backend.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if writer.write_all(&buf[..n]).is_err() {
                    let _ = backend.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
    }
    let _ = writer.shutdown(Shutdown::Both);
}
