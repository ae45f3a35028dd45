//! A deliberately raw HTTP/1.1 client: one request per connection, bytes exactly as
//! given (so tests can send malformed headers), chunked bodies decoded, and a timed
//! mode that stamps every SSE event with the moment it arrived. Plus the MCP requests
//! tests send most: initialize, a tool call, a 2026-07-28 request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The legacy protocol version tests speak.
pub const LEGACY_VERSION: &str = "2025-11-25";
/// The sessionless protocol version.
pub const MODERN_VERSION: &str = "2026-07-28";

/// How long a request may wait for its answer: far longer than any test needs, so it
/// only ends a hang.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as (lossy) text, for failure messages.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; fails the test if it is not.
    #[track_caller]
    pub fn json(&self) -> Value {
        self.try_json()
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.text()))
    }

    pub fn try_json(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// The JSON-RPC messages of the body, whether it is JSON or an SSE stream.
    pub fn messages(&self) -> Vec<Value> {
        let is_sse = self
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"));
        if !is_sse {
            return self.try_json().into_iter().collect();
        }
        sse_data(&String::from_utf8_lossy(&self.body))
            .filter_map(|d| serde_json::from_str(&d).ok())
            .collect()
    }

    /// The text of the first tool result in the body (JSON or SSE), if any.
    pub fn tool_text(&self) -> Option<String> {
        self.messages().iter().find_map(|m| {
            m.get("result")?["content"][0]["text"]
                .as_str()
                .map(str::to_owned)
        })
    }

    /// The text of the first tool result; fails the test (showing the answer) if there
    /// is none.
    #[track_caller]
    pub fn expect_tool_text(&self) -> String {
        self.tool_text().unwrap_or_else(|| {
            panic!(
                "no tool result in a {} answer: {}",
                self.status,
                self.text()
            )
        })
    }

    /// The `error` member of a JSON-RPC error body.
    pub fn error(&self) -> Option<Value> {
        self.try_json().ok()?.get("error").cloned()
    }

    /// The JSON-RPC error code of an error body.
    pub fn error_code(&self) -> Option<i64> {
        self.error()?["code"].as_i64()
    }

    /// `error.data.reason` of an error body: what the gateway says happened.
    pub fn reason(&self) -> Option<String> {
        self.error()?["data"]["reason"].as_str().map(str::to_owned)
    }

    /// "status reason" (e.g. `404 session_gone`), for compact assertions and messages.
    pub fn outcome(&self) -> String {
        match self.reason() {
            Some(reason) => format!("{} {reason}", self.status),
            None => self.status.to_string(),
        }
    }
}

/// The `data:` payloads of the SSE events in `text`.
pub fn sse_data(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split("\n\n").filter_map(|event| {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect();
        (!data.is_empty()).then(|| data.join("\n"))
    })
}

/// Sends one request and reads the whole response; fails the test if there is no
/// HTTP answer.
#[track_caller]
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    try_request(addr, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path} via {addr}: {e}"))
}

/// Like [`request`], but a connection that fails or closes without an HTTP answer is
/// an `Err` (saying why) instead of a failed test: load and fault tests count those.
pub fn try_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Response, String> {
    exchange(addr, method, path, headers, body, |_| {})
}

/// Sends one request and stamps each SSE event of the answer with the time since the
/// request was sent, so tests can check that a stream arrives incrementally.
#[track_caller]
pub fn request_timed(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (Response, Vec<Duration>) {
    let start = Instant::now();
    let mut arrivals = SseArrivals::default();
    let response = exchange(addr, method, path, headers, body, |chunk| {
        arrivals.feed(chunk, start.elapsed())
    })
    .unwrap_or_else(|e| panic!("{method} {path} via {addr}: {e}"));
    (response, arrivals.times)
}

/// Counts complete SSE events as body bytes arrive, whatever the chunking.
#[derive(Default)]
struct SseArrivals {
    pending: Vec<u8>,
    times: Vec<Duration>,
}

impl SseArrivals {
    fn feed(&mut self, chunk: &[u8], at: Duration) {
        self.pending.extend_from_slice(chunk);
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            if String::from_utf8_lossy(&event)
                .lines()
                .any(|l| l.starts_with("data:"))
            {
                self.times.push(at);
            }
        }
    }
}

fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    mut on_chunk: impl FnMut(&[u8]),
) -> Result<Response, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(READ_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    stream.write_all(&bytes).map_err(|e| format!("send: {e}"))?;

    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader
        .read_line(&mut status_line)
        .map_err(|e| format!("read status line: {e}"))?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no HTTP answer (status line {status_line:?})"))?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .map_err(|e| format!("read header: {e}"))?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size_line = String::new();
            if reader.read_line(&mut size_line).unwrap_or(0) == 0 {
                break;
            }
            let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("0"), 16)
                .map_err(|_| format!("bad chunk size line {size_line:?}"))?;
            if size == 0 {
                break;
            }
            let mut chunk = vec![0u8; size + 2];
            reader
                .read_exact(&mut chunk)
                .map_err(|e| format!("read chunk: {e}"))?;
            chunk.truncate(size);
            on_chunk(&chunk);
            body.extend_from_slice(&chunk);
        }
    } else {
        let mut buf = [0u8; 8192];
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    on_chunk(&buf[..n]);
                    body.extend_from_slice(&buf[..n]);
                }
            }
        }
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// Headers of a legacy MCP POST, optionally in a session.
pub fn mcp_headers(session: Option<&str>) -> Vec<(&str, &str)> {
    let mut headers = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        ("MCP-Protocol-Version", LEGACY_VERSION),
    ];
    if let Some(session) = session {
        headers.push(("Mcp-Session-Id", session));
    }
    headers
}

/// `DELETE` of a legacy session (its client ending it); the answer, unchecked.
#[track_caller]
pub fn delete_session(addr: &str, path: &str, session: &str) -> Response {
    request(addr, "DELETE", path, &mcp_headers(Some(session)), b"")
}

/// The body of a legacy `initialize`.
pub fn initialize_body(id: u64) -> Vec<u8> {
    json!({
        "jsonrpc": "2.0", "id": id, "method": "initialize",
        "params": {"protocolVersion": LEGACY_VERSION, "capabilities": {},
                   "clientInfo": {"name": "mcpgw-tests", "version": "0"}},
    })
    .to_string()
    .into_bytes()
}

/// Sends `initialize` and returns the answer as is (tests of refused initializes).
pub fn try_initialize(addr: &str, path: &str) -> Result<Response, String> {
    try_request(
        addr,
        "POST",
        path,
        &[
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ],
        &initialize_body(1),
    )
}

/// Opens a legacy session through `addr` (initialize, then the initialized
/// notification) and returns its id.
#[track_caller]
pub fn initialize(addr: &str, path: &str) -> String {
    let response =
        try_initialize(addr, path).unwrap_or_else(|e| panic!("initialize via {addr}: {e}"));
    assert_eq!(response.status, 200, "initialize: {}", response.text());
    let session = response
        .header("mcp-session-id")
        .unwrap_or_else(|| panic!("initialize returned no Mcp-Session-Id"))
        .to_owned();
    let note = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    let ack = request(addr, "POST", path, &mcp_headers(Some(&session)), note);
    assert_eq!(ack.status, 202, "notifications/initialized: {}", ack.text());
    session
}

/// The body of a JSON-RPC request.
pub fn rpc_body(id: u64, method: &str, params: Value) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        .to_string()
        .into_bytes()
}

/// The body of a `tools/call`.
pub fn tool_call_body(id: u64, tool: &str, arguments: Value) -> Vec<u8> {
    rpc_body(
        id,
        "tools/call",
        json!({ "name": tool, "arguments": arguments }),
    )
}

/// Calls a tool in a legacy session; fails the test if there is no HTTP answer.
#[track_caller]
pub fn call_tool(
    addr: &str,
    path: &str,
    session: &str,
    id: u64,
    tool: &str,
    arguments: Value,
) -> Response {
    request(
        addr,
        "POST",
        path,
        &mcp_headers(Some(session)),
        &tool_call_body(id, tool, arguments),
    )
}

/// Like [`call_tool`], but no HTTP answer (refused, reset) is an `Err`.
pub fn try_call_tool(
    addr: &str,
    session: &str,
    id: u64,
    tool: &str,
    arguments: Value,
) -> Result<Response, String> {
    try_request(
        addr,
        "POST",
        "/mcp",
        &mcp_headers(Some(session)),
        &tool_call_body(id, tool, arguments),
    )
}

/// Headers of a 2026-07-28 request: the method (and name) travel as headers too.
pub fn modern_headers<'a>(method: &'a str, name: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        ("MCP-Protocol-Version", MODERN_VERSION),
        ("Mcp-Method", method),
    ];
    if let Some(name) = name {
        headers.push(("Mcp-Name", name));
    }
    headers
}

/// The body of a 2026-07-28 request: the protocol version and client capabilities
/// travel in `_meta` of every request.
pub fn modern_body(id: u64, method: &str, params: Value) -> Vec<u8> {
    let mut params = params;
    params["_meta"] = json!({
        "io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
    });
    rpc_body(id, method, params)
}

/// Milliseconds since `start`, for timing reports in test output.
pub fn elapsed_ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_counted_whatever_the_chunking() {
        let mut arrivals = SseArrivals::default();
        let stream = b"event: message\ndata: {\"a\":1}\n\ndata: {\"b\":2}\n\n: comment\n\n";
        for (i, byte) in stream.iter().enumerate() {
            arrivals.feed(&[*byte], Duration::from_millis(i as u64));
        }
        assert_eq!(arrivals.times.len(), 2, "comments are not events");
        let data: Vec<String> = sse_data(std::str::from_utf8(stream).unwrap()).collect();
        assert_eq!(data, ["{\"a\":1}", "{\"b\":2}"]);
    }
}
