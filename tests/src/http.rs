//! A deliberately raw HTTP/1.1 client: one request per connection, bytes exactly as
//! given (so tests can send malformed headers), chunked bodies decoded, and a
//! streaming mode that timestamps every piece of the body as it arrives.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

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

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The JSON-RPC messages of the body, whether it is JSON or an SSE stream.
    pub fn messages(&self) -> Vec<serde_json::Value> {
        let is_sse = self
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"));
        if !is_sse {
            return vec![self.json()];
        }
        String::from_utf8_lossy(&self.body)
            .split("\n\n")
            .filter_map(|event| {
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                (!data.is_empty()).then(|| data.join("\n"))
            })
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

    /// The JSON-RPC error code of an error body.
    pub fn error_code(&self) -> Option<i64> {
        self.json()["error"]["code"].as_i64()
    }
}

/// Sends one request and reads the whole response.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    request_raw(addr, method, path, headers, body, |_| {})
}

/// Sends one request; `on_chunk` sees each body read (after de-chunking) with the time
/// it arrived, so tests can check that a stream arrives incrementally.
pub fn request_raw(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    on_chunk: impl FnMut(&[u8]),
) -> Response {
    try_request_raw(addr, method, path, headers, body, on_chunk)
        .unwrap_or_else(|e| panic!("{method} {path} via {addr}: {e}"))
}

/// Like [`request`], but a connection that fails or closes without an HTTP answer is
/// an `Err` (with why) instead of a panic: load tests count those.
pub fn try_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Response, String> {
    try_request_raw(addr, method, path, headers, body, |_| {})
}

fn try_request_raw(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    mut on_chunk: impl FnMut(&[u8]),
) -> Result<Response, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
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
        reader.read_line(&mut line).expect("header line");
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
                .unwrap_or(0);
            if size == 0 {
                break;
            }
            let mut chunk = vec![0u8; size + 2];
            reader.read_exact(&mut chunk).expect("chunk");
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
        ("MCP-Protocol-Version", "2025-11-25"),
    ];
    if let Some(session) = session {
        headers.push(("Mcp-Session-Id", session));
    }
    headers
}

/// Opens a legacy session through `addr` and returns its id.
pub fn initialize(addr: &str, path: &str) -> String {
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"mcpgw-tests","version":"0"}}}"#;
    let mut headers = mcp_headers(None);
    headers.retain(|(k, _)| *k != "MCP-Protocol-Version");
    let response = request(addr, "POST", path, &headers, body);
    assert_eq!(
        response.status,
        200,
        "initialize: {}",
        String::from_utf8_lossy(&response.body)
    );
    let session = response
        .header("mcp-session-id")
        .expect("initialize returns Mcp-Session-Id")
        .to_owned();
    let note = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    let ack = request(addr, "POST", path, &mcp_headers(Some(&session)), note);
    assert_eq!(ack.status, 202, "notifications/initialized");
    session
}

/// Calls a tool in a legacy session and returns the JSON-RPC result of the response.
pub fn call_tool(
    addr: &str,
    path: &str,
    session: &str,
    id: u64,
    tool: &str,
    arguments: serde_json::Value,
) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": { "name": tool, "arguments": arguments },
    });
    request(
        addr,
        "POST",
        path,
        &mcp_headers(Some(session)),
        body.to_string().as_bytes(),
    )
}

/// Seconds since `start`, for timing reports in test output.
pub fn elapsed_ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}
