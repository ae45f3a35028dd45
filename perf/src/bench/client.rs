//! The load generator's HTTP side: one keep-alive HTTP/1.1 connection per (session,
//! URL), requests built from pre-serialized bodies, and answers judged by status and
//! a byte search, never by a JSON parser, so the client stays cheap next to the
//! gateway it shares the CPU with.

use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::mix::{Era, INITIALIZE_BODY, INITIALIZED_BODY, LEGACY_VERSION, MODERN_VERSION, Op};

pub const HEADER_SESSION_ID: &str = "mcp-session-id";
pub const HEADER_PROTOCOL_VERSION: &str = "mcp-protocol-version";
pub const HEADER_EDGE_WORKER: &str = "mcpgw-edge-worker";
pub const HEADER_OWNER_WORKER: &str = "mcpgw-owner-worker";

const ACCEPT_BOTH: HeaderValue = HeaderValue::from_static("application/json, text/event-stream");
const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// One MCP endpoint the load is sent to, e.g. `http://127.0.0.1:8080/mcp`.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` to connect to.
    pub authority: String,
    /// The request path, e.g. `/mcp`.
    pub path: String,
    host: HeaderValue,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|_| format!("{url:?} is not a URL like http://127.0.0.1:8080/mcp"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!("{url:?}: the bench speaks plain http:// only"));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{url:?} has no host"))?
            .as_str()
            .to_owned();
        let authority = if authority.contains(':') {
            authority
        } else {
            format!("{authority}:80")
        };
        let path = match uri.path() {
            "" | "/" => "/mcp".to_owned(),
            path => path.to_owned(),
        };
        let host = HeaderValue::from_str(&authority)
            .map_err(|_| format!("{url:?}: the host is not a valid header value"))?;
        Ok(Target {
            authority,
            path,
            host,
        })
    }
}

/// Why an exchange produced no HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The TCP connection could not be made.
    Connect(String),
    /// The connection broke (reset, closed mid-answer).
    Io(String),
    /// No complete answer within the request timeout.
    Timeout,
}

impl Failure {
    /// The short class the report counts errors by.
    pub fn class(&self) -> String {
        match self {
            Failure::Connect(_) => "connect".into(),
            Failure::Io(_) => "io".into(),
            Failure::Timeout => "timeout".into(),
        }
    }
}

/// A complete HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// True when the edge and owner headers both exist and differ: the gateway
    /// forwarded this request over its mesh. None when the answer carries no worker
    /// headers (not a gateway, e.g. the direct upstream).
    pub fn forwarded(&self) -> Option<bool> {
        let edge = self.headers.get(HEADER_EDGE_WORKER)?;
        let owner = self.headers.get(HEADER_OWNER_WORKER)?;
        Some(edge != owner)
    }

    /// The error class of this answer, or None when it is a success.
    pub fn error_class(&self) -> Option<String> {
        error_class(self.status, &self.body)
    }
}

/// Judges an answer without parsing it: a non-2xx status, a JSON-RPC `"error"`
/// member, or a tool result flagged `"isError":true` is an error.
pub fn error_class(status: StatusCode, body: &[u8]) -> Option<String> {
    if !status.is_success() {
        return Some(format!("http {}", status.as_u16()));
    }
    if let Some(at) = find(body, b"\"error\":") {
        let code = error_code(&body[at..]);
        return Some(match code {
            Some(code) => format!("json-rpc {code}"),
            None => "json-rpc error".into(),
        });
    }
    if find(body, b"\"isError\":true").is_some() {
        return Some("tool error".into());
    }
    None
}

/// The `"code":N` following an error member, read by hand: errors are rare, and this
/// keeps the success path free of any parsing.
fn error_code(from_error: &[u8]) -> Option<i64> {
    let at = find(from_error, b"\"code\":")? + b"\"code\":".len();
    let rest = std::str::from_utf8(&from_error[at..]).ok()?.trim_start();
    let end = rest
        .find(|c: char| !(c == '-' || c.is_ascii_digit()))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A keep-alive HTTP/1.1 connection to one target.
pub struct Connection {
    sender: http1::SendRequest<Full<Bytes>>,
}

impl Connection {
    pub async fn open(target: &Target, timeout: Duration) -> Result<Connection, Failure> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect(&target.authority))
            .await
            .map_err(|_| Failure::Connect(format!("connect to {} timed out", target.authority)))?
            .map_err(|e| Failure::Connect(format!("{}: {e}", target.authority)))?;
        // Small requests must not wait for Nagle.
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::Connect(format!("{}: {e}", target.authority)))?;
        tokio::spawn(async move {
            // The connection ends when its sender is dropped or the peer closes it;
            // either way the next request notices and reconnects.
            let _ = connection.await;
        });
        Ok(Connection { sender })
    }

    /// Sends `request` and reads the whole answer.
    pub async fn exchange(&mut self, request: Request<Full<Bytes>>) -> Result<Answer, Failure> {
        self.sender
            .ready()
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| Failure::Io(e.to_string()))?
            .to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

/// A lazily opened connection slot: opens on first use, and again after a failure.
pub async fn exchange_on(
    slot: &mut Option<Connection>,
    target: &Target,
    request: Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<Answer, Failure> {
    let attempt = async {
        let connection = match slot {
            Some(connection) => connection,
            None => slot.insert(Connection::open(target, timeout).await?),
        };
        connection.exchange(request).await
    };
    let outcome = tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or(Err(Failure::Timeout));
    if outcome.is_err() {
        // A broken or stuck connection is not reused: its state is unknown.
        *slot = None;
    }
    outcome
}

fn post(target: &Target) -> http::request::Builder {
    Request::builder()
        .method(Method::POST)
        .uri(target.path.as_str())
        .header(HOST, target.host.clone())
        .header(CONTENT_TYPE, JSON)
        .header(ACCEPT, ACCEPT_BOTH)
}

/// A request of the mix. `session` is the legacy session id (None for modern load).
pub fn mix_request(
    target: &Target,
    era: Era,
    op: Op,
    id: u64,
    session: Option<&HeaderValue>,
) -> Result<Request<Full<Bytes>>, String> {
    let body = op.body(era, id);
    let mut builder = post(target);
    match era {
        Era::Legacy => {
            builder = builder.header(HEADER_PROTOCOL_VERSION, LEGACY_VERSION);
            if let Some(session) = session {
                builder = builder.header(HEADER_SESSION_ID, session.clone());
            }
        }
        Era::Modern => {
            builder = builder
                .header(HEADER_PROTOCOL_VERSION, MODERN_VERSION)
                .header("mcp-method", op.method());
            if let Some(name) = op.name() {
                builder = builder.header("mcp-name", name);
            }
        }
    }
    builder
        .body(Full::new(body))
        .map_err(|e| format!("cannot build a request: {e}"))
}

/// A legacy session opened by [`open_session`].
pub struct OpenedSession {
    pub id: HeaderValue,
    /// The worker that executed `initialize`, which owns the session.
    pub owner: Option<String>,
}

/// `initialize` and `notifications/initialized` over `slot`. The error is the class
/// the report counts.
pub async fn open_session(
    slot: &mut Option<Connection>,
    target: &Target,
    timeout: Duration,
) -> Result<OpenedSession, String> {
    let request = post(target)
        .body(Full::new(Bytes::from_static(INITIALIZE_BODY.as_bytes())))
        .map_err(|e| e.to_string())?;
    let answer = exchange_on(slot, target, request, timeout)
        .await
        .map_err(|f| f.class())?;
    if let Some(class) = answer.error_class() {
        return Err(class);
    }
    let id = answer
        .headers
        .get(HEADER_SESSION_ID)
        .cloned()
        .ok_or_else(|| "no Mcp-Session-Id".to_owned())?;
    let owner = answer
        .headers
        .get(HEADER_OWNER_WORKER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let request = post(target)
        .header(HEADER_PROTOCOL_VERSION, LEGACY_VERSION)
        .header(HEADER_SESSION_ID, id.clone())
        .body(Full::new(Bytes::from_static(INITIALIZED_BODY.as_bytes())))
        .map_err(|e| e.to_string())?;
    let ack = exchange_on(slot, target, request, timeout)
        .await
        .map_err(|f| f.class())?;
    if ack.status != StatusCode::ACCEPTED {
        return Err(format!(
            "http {} to notifications/initialized",
            ack.status.as_u16()
        ));
    }
    Ok(OpenedSession { id, owner })
}

/// Ends a legacy session (DELETE), so runs do not pile sessions up on the fleet.
pub async fn close_session(
    slot: &mut Option<Connection>,
    target: &Target,
    session: &HeaderValue,
    timeout: Duration,
) -> Result<(), String> {
    let request = Request::builder()
        .method(Method::DELETE)
        .uri(target.path.as_str())
        .header(HOST, target.host.clone())
        .header(HEADER_PROTOCOL_VERSION, LEGACY_VERSION)
        .header(HEADER_SESSION_ID, session.clone())
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let answer = exchange_on(slot, target, request, timeout)
        .await
        .map_err(|f| f.class())?;
    match answer.status.as_u16() {
        200..=299 | 404 => Ok(()),
        status => Err(format!("http {status}")),
    }
}

/// Who a worker is: its id from the public `/healthz` answer (header
/// `mcpgw-edge-worker`), and its pid and session count from its admin listener's
/// `/state` (the public port tells no more than alive or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub worker_id: String,
    pub pid: Option<u32>,
    /// Sessions the worker holds.
    pub sessions: Option<u64>,
}

/// Asks the gateway behind `target` who it is. None when the URL is not a gateway
/// (the direct upstream answers 404) or does not answer.
pub async fn probe_health(target: &Target, timeout: Duration) -> Option<Health> {
    let answer = get(target, "/healthz", timeout).await?;
    let worker_id = answer
        .headers
        .get(HEADER_EDGE_WORKER)
        .and_then(|v| v.to_str().ok())?;
    Some(Health {
        worker_id: worker_id.to_owned(),
        pid: None,
        sessions: None,
    })
}

/// The worker's own account of itself, from its admin listener at `admin`.
pub async fn probe_state(admin: &Target, timeout: Duration) -> Option<Health> {
    let answer = get(admin, "/state", timeout).await?;
    parse_health(&answer.body)
}

async fn get(target: &Target, path: &str, timeout: Duration) -> Option<Answer> {
    let request = Request::builder()
        .method(Method::GET)
        .uri(path)
        .header(HOST, target.host.clone())
        .body(Full::new(Bytes::new()))
        .ok()?;
    let mut slot = None;
    let answer = exchange_on(&mut slot, target, request, timeout)
        .await
        .ok()?;
    answer.status.is_success().then_some(answer)
}

pub fn parse_health(body: &[u8]) -> Option<Health> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(Health {
        worker_id: value.get("worker_id")?.as_str()?.to_owned(),
        pid: value
            .get("pid")
            .and_then(serde_json::Value::as_u64)
            .and_then(|pid| u32::try_from(pid).ok()),
        sessions: value.get("sessions").and_then(serde_json::Value::as_u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_judged_by_status_and_error_members() {
        let ok = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"text","text":"hello"}],"isError":false}}"#;
        assert_eq!(error_class(StatusCode::OK, ok), None);
        let rpc = br#"{"jsonrpc":"2.0","id":3,"error":{"code":-32001,"message":"session gone"}}"#;
        assert_eq!(
            error_class(StatusCode::OK, rpc).as_deref(),
            Some("json-rpc -32001")
        );
        assert_eq!(
            error_class(StatusCode::SERVICE_UNAVAILABLE, rpc).as_deref(),
            Some("http 503")
        );
        let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"message\":\"x\"}}\n\n";
        assert_eq!(
            error_class(StatusCode::OK, sse).as_deref(),
            Some("json-rpc error")
        );
        let tool = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[],"isError":true}}"#;
        assert_eq!(
            error_class(StatusCode::OK, tool).as_deref(),
            Some("tool error")
        );
    }

    #[test]
    fn forwarding_is_read_from_worker_headers() {
        let answer = |edge: Option<&'static str>, owner: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(edge) = edge {
                headers.insert(HEADER_EDGE_WORKER, HeaderValue::from_static(edge));
            }
            if let Some(owner) = owner {
                headers.insert(HEADER_OWNER_WORKER, HeaderValue::from_static(owner));
            }
            Answer {
                status: StatusCode::OK,
                headers,
                body: Bytes::new(),
            }
        };
        assert_eq!(answer(Some("a"), Some("b")).forwarded(), Some(true));
        assert_eq!(answer(Some("a"), Some("a")).forwarded(), Some(false));
        assert_eq!(answer(None, None).forwarded(), None);
    }

    #[test]
    fn targets_and_health_parse() {
        let target = Target::parse("http://127.0.0.1:8080/servers/demo/mcp").unwrap();
        assert_eq!(target.authority, "127.0.0.1:8080");
        assert_eq!(target.path, "/servers/demo/mcp");
        assert_eq!(Target::parse("http://localhost").unwrap().path, "/mcp");
        assert!(Target::parse("https://x/mcp").is_err());
        assert_eq!(
            parse_health(br#"{"worker_id":"w-1","pid":42,"sessions":0}"#),
            Some(Health {
                worker_id: "w-1".into(),
                pid: Some(42),
                sessions: Some(0),
            })
        );
        assert_eq!(parse_health(br#"{"error":{}}"#), None);
    }

    #[test]
    fn mix_requests_carry_the_era_headers() {
        let target = Target::parse("http://127.0.0.1:1/mcp").unwrap();
        let session = HeaderValue::from_static("abc.w1");
        let legacy = mix_request(&target, Era::Legacy, Op::CallEcho, 7, Some(&session)).unwrap();
        assert_eq!(legacy.headers()[HEADER_SESSION_ID], "abc.w1");
        assert_eq!(legacy.headers()[HEADER_PROTOCOL_VERSION], LEGACY_VERSION);
        let modern = mix_request(&target, Era::Modern, Op::CallEcho, 7, None).unwrap();
        assert_eq!(modern.headers()["mcp-method"], "tools/call");
        assert_eq!(modern.headers()["mcp-name"], "echo");
        assert!(modern.headers().get(HEADER_SESSION_ID).is_none());
        let list = mix_request(&target, Era::Modern, Op::ListTools, 8, None).unwrap();
        assert!(list.headers().get("mcp-name").is_none());
    }
}
