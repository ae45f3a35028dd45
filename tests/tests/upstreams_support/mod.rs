//! Helpers of the upstream tests, kept small and beside them: a fleet of one-worker
//! supervisors (so each worker has an address of its own and a test can pick the
//! worker), an SSE reader that notes comments and can drop its connection mid-stream,
//! a request whose client goes away before the answer, and process checks.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};

use std::time::{Duration, Instant};

use mcpgw_testkit::fleet::{MeshCerts, supervisor_flags};
use mcpgw_testkit::{Gateway, RedisServer};

// Not every test file that includes this module uses both.
#[allow(unused_imports)]
pub use mcpgw_testkit::process::{children_of, running};

/// Redis and `n` supervisors of one worker each: worker `i` is reached at `addr(i)`.
pub struct Fleet {
    pub redis: RedisServer,
    pub certs: MeshCerts,
    pub gateways: Vec<Gateway>,
}

impl Fleet {
    /// Every supervisor gets `args` (the upstreams: `--upstream …` or `--config …`).
    pub fn start(n: usize, args: &[String]) -> Fleet {
        Self::start_with_env(n, args, &[])
    }

    pub fn start_with_env(n: usize, args: &[String], env: &[(&str, &str)]) -> Fleet {
        Self::start_on(&["--mesh-transport", "quic"], n, args, env)
    }

    /// Like [`start_with_env`](Self::start_with_env), over the mesh that `mesh` flags
    /// choose (`--mesh-transport …` and what goes with it).
    pub fn start_on(mesh: &[&str], n: usize, args: &[String], env: &[(&str, &str)]) -> Fleet {
        let redis = RedisServer::start();
        let members: Vec<String> = (0..n).map(|i| format!("host-{i}")).collect();
        let member_refs: Vec<&str> = members.iter().map(String::as_str).collect();
        let certs = MeshCerts::create(&member_refs);
        let gateways = members
            .iter()
            .map(|member| {
                let mut all = supervisor_flags(&redis.url(), 1, "quic", &certs, member);
                if let Some(at) = all.iter().position(|flag| flag == "--mesh-transport") {
                    all.drain(at..at + 2);
                }
                all.extend(mesh.iter().map(|flag| flag.to_string()));
                all.extend(args.iter().cloned());
                let refs: Vec<&str> = all.iter().map(String::as_str).collect();
                Gateway::start_with_env(&refs, env)
            })
            .collect();
        Fleet {
            redis,
            certs,
            gateways,
        }
    }

    pub fn addr(&self, i: usize) -> &str {
        &self.gateways[i].addr
    }

    pub fn addrs(&self) -> Vec<String> {
        self.gateways.iter().map(|g| g.addr.clone()).collect()
    }
}

/// The pid and id of the worker behind supervisor `i` (of one worker): its id from
/// the header of its public `/healthz`, its pid from its lease in the directory.
pub fn worker_at(fleet: &Fleet, i: usize) -> (u32, String) {
    let health = mcpgw_testkit::http::request(fleet.addr(i), "GET", "/healthz", &[], b"");
    let id = health
        .header("mcpgw-edge-worker")
        .expect("healthz names its worker")
        .to_owned();
    let lease = mcpgw_testkit::fleet::leases(&fleet.redis)
        .remove(&id)
        .expect("the worker holds a lease");
    (lease.pid, id)
}

/// Waits until `pid` no longer runs; panics with `what` after a generous deadline
/// (a bound on a hang, not a speed requirement).
pub fn wait_stopped(pid: u32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while running(pid) {
        assert!(
            Instant::now() < deadline,
            "{what}: process {pid} still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One SSE event as a client saw it.
#[derive(Debug, Clone)]
pub struct Event {
    pub id: Option<String>,
    pub data: serde_json::Value,
}

/// One SSE comment (a line starting with `:`), and when it came after the request was
/// sent.
#[derive(Debug, Clone)]
pub struct Comment {
    pub text: String,
    pub after: Duration,
}

/// What a client read of an SSE answer.
#[derive(Debug, Default)]
pub struct Stream {
    pub status: u16,
    pub events: Vec<Event>,
    pub comments: Vec<Comment>,
}

/// When [`read_stream`] stops reading and drops the connection.
#[derive(Debug, Clone, Copy)]
pub enum Until {
    /// The server ends the stream.
    End,
    /// This many events arrived (a client whose connection broke).
    Events(usize),
    /// A comment arrived.
    Comment,
}

/// Sends a request to `path` and reads its SSE answer event by event until `until`,
/// then drops the connection as a client whose network broke would.
pub fn read_stream(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    until: Until,
) -> Stream {
    let sent = Instant::now();
    let stream = send_request(addr, method, path, headers, body);
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).expect("status line");
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let mut chunked = false;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header");
        if line.trim().is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
    let mut read = Stream {
        status,
        ..Stream::default()
    };
    let mut pending = String::new();
    let read_some = |reader: &mut BufReader<TcpStream>| -> Option<Vec<u8>> {
        if chunked {
            let mut size = String::new();
            if reader.read_line(&mut size).ok()? == 0 {
                return None;
            }
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            if n == 0 {
                return None;
            }
            let mut chunk = vec![0u8; n + 2];
            reader.read_exact(&mut chunk).ok()?;
            chunk.truncate(n);
            Some(chunk)
        } else {
            let mut buf = vec![0u8; 8192];
            let n = reader.read(&mut buf).ok()?;
            (n > 0).then(|| buf[..n].to_vec())
        }
    };
    'reading: while let Some(chunk) = read_some(&mut reader) {
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find("\n\n") {
            let raw: String = pending.drain(..end + 2).collect();
            let (event, comments) = parse_block(&raw);
            for text in comments {
                read.comments.push(Comment {
                    text,
                    after: sent.elapsed(),
                });
                if matches!(until, Until::Comment) {
                    break 'reading;
                }
            }
            let Some(event) = event else {
                continue;
            };
            read.events.push(event);
            if matches!(until, Until::Events(n) if read.events.len() >= n) {
                break 'reading;
            }
        }
    }
    // Drop the connection as a client whose network broke would.
    let _ = reader.get_ref().shutdown(Shutdown::Both);
    read
}

/// [`read_stream`] on `/mcp`: the status and the events; with `stop_after`, the
/// connection drops after that many events.
pub fn read_events(
    addr: &str,
    method: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    stop_after: Option<usize>,
) -> (u16, Vec<Event>) {
    let until = stop_after.map_or(Until::End, Until::Events);
    let read = read_stream(addr, method, "/mcp", headers, body, until);
    (read.status, read.events)
}

/// Sends a request and returns its connection unread: the request runs until the
/// connection is dropped (a client that goes away before the answer).
pub fn send_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream.write_all(head.as_bytes()).expect("send head");
    stream.write_all(body).expect("send body");
    stream
}

/// The events (with data) in a whole SSE body.
pub fn events_in(text: &str) -> Vec<Event> {
    text.split("\n\n")
        .filter_map(|raw| parse_block(raw).0)
        .collect()
}

/// One SSE block (the lines up to a blank one): its event, when its `data:` lines hold
/// JSON, and the text of its comment lines.
fn parse_block(raw: &str) -> (Option<Event>, Vec<String>) {
    let mut id = None;
    let mut data = Vec::new();
    let mut comments = Vec::new();
    for line in raw.lines() {
        if let Some(v) = line.strip_prefix("id:") {
            id = Some(v.trim().to_owned());
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push(v.trim_start());
        } else if let Some(text) = line.strip_prefix(':') {
            comments.push(text.trim().to_owned());
        }
    }
    let event = serde_json::from_str(&data.join("\n"))
        .ok()
        .map(|data| Event { id, data });
    (event, comments)
}

/// Sends each request to the worker its role calls for: initialize and everything
/// else to worker 0 (the owner), `tools/call` to worker 1 (forwarded), and the
/// client's answers to the server's requests to worker 2 (forwarded too).
pub fn by_role(method: &str, body: &[u8]) -> usize {
    let message: serde_json::Value =
        serde_json::from_slice(body).unwrap_or(serde_json::Value::Null);
    match (
        method,
        message.get("method").and_then(serde_json::Value::as_str),
    ) {
        ("POST", Some("tools/call")) => 1,
        ("POST", None) if message.get("id").is_some() => 2,
        _ => 0,
    }
}
