//! MCP Streamable HTTP semantics the gateway enforces before anything runs: protocol
//! eras, the headers that carry them, message classification, and JSON-RPC errors.

use crate::reason::Reason;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};

pub const HEADER_SESSION_ID: &str = "mcp-session-id";
pub const HEADER_PROTOCOL_VERSION: &str = "mcp-protocol-version";
pub const HEADER_METHOD: &str = "mcp-method";
pub const HEADER_NAME: &str = "mcp-name";
pub const HEADER_LAST_EVENT_ID: &str = "last-event-id";

/// The log tag of the session a request names in `Mcp-Session-Id`, if any.
pub fn session_tag(headers: &HeaderMap) -> Option<crate::digest::SessionTag> {
    headers.get(HEADER_SESSION_ID).and_then(session_tag_of)
}

/// The log tag of an `Mcp-Session-Id` value. A SHA-256 costs about as much as a
/// twentieth of a local request, so the edge keeps the value and hashes it only for a
/// request it logs.
pub fn session_tag_of(value: &HeaderValue) -> Option<crate::digest::SessionTag> {
    value.to_str().ok().map(crate::digest::tag_of)
}

/// Revisions that open a session with `initialize` and carry `Mcp-Session-Id`.
pub const LEGACY_VERSIONS: &[&str] = &["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
/// Revisions without sessions: every request carries its own protocol envelope.
pub const MODERN_VERSIONS: &[&str] = &["2026-07-28"];

/// Methods whose `Mcp-Name` header mirrors a body parameter (2026-07-28).
const NAME_BEARING_METHODS: &[(&str, &str)] = &[
    ("tools/call", "name"),
    ("prompts/get", "name"),
    ("resources/read", "uri"),
];

/// Longest session id accepted; ours are far shorter, and a bound keeps logs and
/// directory keys small.
pub const MAX_SESSION_ID_LEN: usize = 256;

/// JSON-RPC error codes the gateway answers with.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    /// Implementation-defined server error: the gateway could not complete the call
    /// (upstream unreachable, timeout, capacity); `data.reason` says which.
    pub const GATEWAY_ERROR: i64 = -32000;
    /// The session does not exist (any more): re-initialize.
    pub const SESSION_NOT_FOUND: i64 = -32001;
    /// 2026-07-28: an HTTP routing header disagrees with the body.
    pub const HEADER_MISMATCH: i64 = -32020;
    /// 2026-07-28: the requested protocol version is not served.
    pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;
}

/// The protocol era of one request, decided by its `MCP-Protocol-Version` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Era {
    /// 2024-11-05 … 2025-11-25: sessions.
    Legacy,
    /// 2026-07-28 and later: no sessions.
    Modern,
}

/// Decides the era from the `MCP-Protocol-Version` header value.
pub fn era_of(version: Option<&str>) -> Result<Era, GatewayError> {
    match version {
        None => Ok(Era::Legacy),
        Some(v) if LEGACY_VERSIONS.contains(&v) => Ok(Era::Legacy),
        Some(v) if MODERN_VERSIONS.contains(&v) => Ok(Era::Modern),
        Some(v) => Err(GatewayError::new(
            StatusCode::BAD_REQUEST,
            code::UNSUPPORTED_PROTOCOL_VERSION,
            format!(
                "unsupported MCP-Protocol-Version {:?}: use one of {}",
                truncate(v, 64),
                LEGACY_VERSIONS
                    .iter()
                    .chain(MODERN_VERSIONS)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .with_data(json!({
            "supported": LEGACY_VERSIONS.iter().chain(MODERN_VERSIONS).collect::<Vec<_>>(),
            "requested": truncate(v, 64),
        }))),
    }
}

/// What kind of JSON-RPC message a POST body holds.
#[derive(Debug, Clone, PartialEq)]
pub enum MessageKind {
    Request {
        id: Value,
        method: String,
    },
    Notification {
        method: String,
    },
    /// A client's answer to a server-initiated request.
    Response {
        id: Value,
    },
}

/// One parsed client message: its kind, the tool a `tools/call` names, and the body
/// it came from, whose JSON tree is built only when a path asks for it
/// ([`Message::json`]): a request that is relayed as it came never needs one, and
/// building it cost about 6,000 of a local request's 78,000 instructions.
#[derive(Debug, Clone)]
pub struct Message {
    pub kind: MessageKind,
    tool: Option<String>,
    body: Bytes,
    json: std::sync::OnceLock<Value>,
}

impl Message {
    /// The whole message as a JSON tree, built on first use.
    pub fn json(&self) -> &Value {
        self.json.get_or_init(|| tree_of(&self.body))
    }

    /// The whole message as a JSON tree, taken.
    pub fn into_json(self) -> Value {
        match self.json.into_inner() {
            Some(json) => json,
            None => tree_of(&self.body),
        }
    }

    /// `params.name` of a `tools/call`, when it is a string.
    pub fn tool_name(&self) -> Option<&str> {
        self.tool.as_deref()
    }

    /// The JSON-RPC id to echo in an error, or null when there is none.
    pub fn id(&self) -> Value {
        kind_id(&self.kind)
    }

    pub fn method(&self) -> Option<&str> {
        match &self.kind {
            MessageKind::Request { method, .. } | MessageKind::Notification { method } => {
                Some(method)
            }
            MessageKind::Response { .. } => None,
        }
    }

    pub fn is_initialize(&self) -> bool {
        matches!(&self.kind, MessageKind::Request { method, .. } if method == "initialize")
    }
}

/// How deep serde_json builds a tree: its recursion limit. The envelope's parse skips
/// params without counting their depth, so [`parse_message`] refuses deeper bodies
/// itself; whatever it accepts, [`tree_of`] can build.
const MAX_TREE_DEPTH: usize = 127;

/// Whether valid JSON `body` nests arrays and objects at most `limit` deep.
fn nests_within(body: &[u8], limit: usize) -> bool {
    // Each level takes two bytes, its opening and its closing bracket.
    if body.len() < 2 * (limit + 1) {
        return true;
    }
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &byte in body {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return false;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    true
}

/// A body that [`parse_message`] already read as JSON, as a tree.
fn tree_of(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or(Value::Null)
}

/// The members of a JSON-RPC message the gateway decides on; everything else is
/// checked to be JSON and skipped.
#[derive(serde::Deserialize)]
struct Envelope<'a> {
    #[serde(default, borrow)]
    jsonrpc: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    id: Member,
    #[serde(default)]
    method: Member,
    #[serde(default, borrow)]
    params: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    result: Present,
    #[serde(default)]
    error: Present,
}

/// A member that may be absent, apart from one that is `null` (which `Option` would
/// fold into absent).
#[derive(Default)]
struct Member(Option<Value>);

impl<'de> serde::Deserialize<'de> for Member {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(|value| Member(Some(value)))
    }
}

/// Whether a member is there (`null` included), its value checked and skipped: a
/// client's answer to a server's request need not be built to be told one.
#[derive(Default)]
struct Present(bool);

impl<'de> serde::Deserialize<'de> for Present {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(deserializer).map(|_| Present(true))
    }
}

/// The one member of a `tools/call`'s params the hot path needs.
#[derive(serde::Deserialize)]
struct ToolParams {
    #[serde(default)]
    name: Option<Value>,
}

fn not_json(e: &serde_json::Error) -> GatewayError {
    GatewayError::parse_error(format!(
        "request body is not valid JSON ({e}): send one JSON-RPC message"
    ))
}

/// A key that one object of a message names twice, and where: parsers disagree on
/// which of the two values counts (serde_json's tree keeps the last, a struct refuses,
/// others keep the first), so the gateway's checks and the upstream could read two
/// different messages from one body.
#[derive(Debug, Default)]
struct RepeatedKey {
    key: String,
    /// The keys (and `[index]`es) leading to the object, innermost first.
    path: Vec<String>,
}

impl RepeatedKey {
    fn refusal(&self) -> GatewayError {
        let at = match self.path.is_empty() {
            true => "the top level".to_owned(),
            false => {
                let mut at = String::new();
                for step in self.path.iter().rev() {
                    if !at.is_empty() && !step.starts_with('[') {
                        at.push('.');
                    }
                    at.push_str(truncate(step, 64));
                }
                at
            }
        };
        GatewayError::invalid_request(format!(
            "request body repeats the key {:?} in one object (at {at}): name each key \
             once, since the gateway and the upstream could read different values",
            truncate(&self.key, 64)
        ))
        .with_data(json!({ "repeated_key": truncate(&self.key, 64), "at": at }))
    }
}

/// The first key an object anywhere in `body` repeats; `None` when there is none or
/// `body` is not JSON (which the envelope's parse then says).
fn repeated_key(body: &[u8]) -> Option<RepeatedKey> {
    use serde::de::DeserializeSeed;
    let found = std::cell::RefCell::new(None);
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let _ = KeyScan { found: &found }.deserialize(&mut deserializer);
    found.into_inner()
}

/// Walks a JSON value checking that no object repeats a key; what it finds goes to
/// `found`, and the walk stops with an error there.
#[derive(Clone, Copy)]
struct KeyScan<'s> {
    found: &'s std::cell::RefCell<Option<RepeatedKey>>,
}

impl KeyScan<'_> {
    /// Adds `step` to the path of a repetition found below it.
    fn below<E>(self, step: impl FnOnce() -> String) -> impl FnOnce(E) -> E {
        move |error| {
            if let Some(found) = self.found.borrow_mut().as_mut() {
                found.path.push(step());
            }
            error
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for KeyScan<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyScan<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
        let mut index = 0usize;
        while items
            .next_element_seed(self)
            .map_err(self.below(|| format!("[{index}]")))?
            .is_some()
        {
            index += 1;
        }
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut members: A) -> Result<(), A::Error> {
        // Objects are small: a scan of the keys so far costs less than hashing them,
        // up to a few dozen; past that a set keeps a large object linear.
        const SCANNED: usize = 32;
        let mut keys: Vec<std::borrow::Cow<'de, str>> = Vec::new();
        let mut many: Option<rustc_hash::FxHashSet<std::borrow::Cow<'de, str>>> = None;
        while let Some(key) = members.next_key_seed(KeyText)? {
            let repeated = match &mut many {
                Some(set) => !set.insert(key.clone()),
                None if keys.len() < SCANNED => keys.contains(&key),
                None => {
                    let set: rustc_hash::FxHashSet<_> = keys.drain(..).collect();
                    let repeated = set.contains(&key);
                    many = Some(set);
                    repeated
                }
            };
            if repeated {
                *self.found.borrow_mut() = Some(RepeatedKey {
                    key: key.into_owned(),
                    path: Vec::new(),
                });
                return Err(serde::de::Error::custom("repeated key"));
            }
            members
                .next_value_seed(self)
                .map_err(self.below(|| key.to_string()))?;
            match &mut many {
                Some(set) => {
                    set.insert(key);
                }
                None => keys.push(key),
            }
        }
        Ok(())
    }
}

/// An object's key, borrowed from the body unless it has escapes.
struct KeyText;

impl<'de> serde::de::DeserializeSeed<'de> for KeyText {
    type Value = std::borrow::Cow<'de, str>;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyText {
    type Value = std::borrow::Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object key")
    }
    fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(key))
    }
    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(key.to_owned()))
    }
}

/// Parses and classifies one POST body.
pub fn parse_message(body: &Bytes) -> Result<Message, GatewayError> {
    let opens_object = body
        .iter()
        .find(|byte| !byte.is_ascii_whitespace())
        .is_some_and(|&byte| byte == b'{');
    if !opens_object {
        // Not an object: say what it is (or that it is not JSON at all).
        let json: Value = serde_json::from_slice(body).map_err(|e| not_json(&e))?;
        let what = if json.is_array() {
            "a JSON array (batches are not supported since 2025-06-18): send one JSON-RPC message per POST"
        } else {
            "not a JSON object: send one JSON-RPC message object"
        };
        return Err(GatewayError::invalid_request(format!(
            "request body is {what}"
        )));
    }
    // Before the envelope: its own parse refuses a repeated member it knows as
    // "not JSON", and ignores one it does not know.
    if let Some(repeated) = repeated_key(body) {
        return Err(repeated.refusal());
    }
    let envelope: Envelope<'_> = serde_json::from_slice(body).map_err(|e| not_json(&e))?;
    if !nests_within(body, MAX_TREE_DEPTH) {
        return Err(GatewayError::parse_error(format!(
            "request body nests arrays and objects more than {MAX_TREE_DEPTH} deep: \
             send a flatter JSON-RPC message"
        )));
    }
    let version_ok = envelope.jsonrpc.is_some_and(|raw| {
        raw.get() == "\"2.0\""
            || serde_json::from_str::<Value>(raw.get()).is_ok_and(|v| v.as_str() == Some("2.0"))
    });
    if !version_ok {
        return Err(GatewayError::invalid_request(
            "request body lacks \"jsonrpc\": \"2.0\"",
        ));
    }
    let id = envelope.id.0;
    if let Some(id) = &id
        && !(id.is_string() || id.is_i64() || id.is_u64())
    {
        return Err(GatewayError::invalid_request(
            "JSON-RPC id must be a string or an integer",
        ));
    }
    let is_response = envelope.result.0 || envelope.error.0;
    let kind = match (envelope.method.0, id) {
        (Some(Value::String(method)), Some(id)) => MessageKind::Request { id, method },
        (Some(Value::String(method)), None) => MessageKind::Notification { method },
        (Some(_), _) => {
            return Err(GatewayError::invalid_request(
                "JSON-RPC \"method\" must be a string",
            ));
        }
        (None, Some(id)) if is_response => MessageKind::Response { id },
        (None, _) => {
            return Err(GatewayError::invalid_request(
                "JSON-RPC message has neither \"method\" nor \"result\"/\"error\"",
            ));
        }
    };
    // A notification that says tools/call names its tool too: scopes are checked on it
    // as on a request. One whose name cannot be read is refused: read as "no tool",
    // it would pass a tool's scope check and still reach the upstream.
    let tool = match &kind {
        MessageKind::Request { method, .. } | MessageKind::Notification { method }
            if method == "tools/call" =>
        {
            let name = envelope
                .params
                // Only an object has a name (serde would read an array by position).
                .filter(|raw| raw.get().starts_with('{'))
                .and_then(|raw| serde_json::from_str::<ToolParams>(raw.get()).ok())
                .and_then(|params| match params.name {
                    Some(Value::String(name)) => Some(name),
                    _ => None,
                });
            match name {
                Some(name) => Some(name),
                None => {
                    return Err(GatewayError::new(
                        StatusCode::BAD_REQUEST,
                        code::INVALID_PARAMS,
                        "tools/call needs params.name, the tool's name as a string: send \
                         {\"name\": \"<tool>\", \"arguments\": {...}} as params",
                    )
                    .with_id(kind_id(&kind)));
                }
            }
        }
        _ => None,
    };
    Ok(Message {
        kind,
        tool,
        body: body.clone(),
        json: std::sync::OnceLock::new(),
    })
}

fn kind_id(kind: &MessageKind) -> Value {
    match kind {
        MessageKind::Request { id, .. } | MessageKind::Response { id } => id.clone(),
        MessageKind::Notification { .. } => Value::Null,
    }
}

/// Checks a session id a client sent: visible ASCII only (0x21–0x7E), bounded length.
pub fn validate_session_id(raw: &[u8]) -> Result<&str, GatewayError> {
    let valid = !raw.is_empty()
        && raw.len() <= MAX_SESSION_ID_LEN
        && raw.iter().all(|b| (0x21..=0x7e).contains(b));
    match std::str::from_utf8(raw) {
        Ok(id) if valid => Ok(id),
        _ => Err(GatewayError::new(
            StatusCode::BAD_REQUEST,
            code::INVALID_REQUEST,
            format!(
                "Mcp-Session-Id must be 1 to {MAX_SESSION_ID_LEN} visible ASCII characters: \
                 send the id the gateway returned from initialize"
            ),
        )),
    }
}

/// 2026-07-28: `Mcp-Method` (and `Mcp-Name` for name-bearing methods) must agree with
/// the body, so intermediaries routing on headers see the truth.
pub fn check_modern_headers(headers: &HeaderMap, message: &Message) -> Result<(), GatewayError> {
    let Some(method) = message.method() else {
        return Ok(());
    };
    let header_method = headers.get(HEADER_METHOD).map(|v| v.as_bytes());
    if header_method != Some(method.as_bytes()) {
        return Err(GatewayError::header_mismatch(format!(
            "Mcp-Method header does not match the request body's method {:?}",
            truncate(method, 64)
        )));
    }
    let Some(&(_, key)) = NAME_BEARING_METHODS.iter().find(|(m, _)| *m == method) else {
        return Ok(());
    };
    let Some(body_value) = message.json().pointer(&format!("/params/{key}")) else {
        return Ok(());
    };
    let header_value = headers
        .get(HEADER_NAME)
        .and_then(|v| decode_header_value(v.as_bytes()));
    if header_value.as_deref() != body_value.as_str() {
        return Err(GatewayError::header_mismatch(format!(
            "Mcp-Name header does not match the request body's {key:?} parameter"
        )));
    }
    Ok(())
}

/// Decodes an `Mcp-Name`-style header value: verbatim, or `=?base64?…?=` for values
/// that do not survive as an HTTP field. A malformed sentinel decodes to nothing.
pub fn decode_header_value(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?;
    match text
        .strip_prefix("=?base64?")
        .and_then(|t| t.strip_suffix("?="))
    {
        Some(encoded) => String::from_utf8(base64_decode(encoded)?).ok(),
        None => Some(text.to_owned()),
    }
}

/// Standard base64 with padding; small enough not to warrant a dependency.
fn base64_decode(input: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let bytes = input.as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for quad in bytes.chunks(4) {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let decoded = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&decoded[..3 - pad]);
    }
    Some(out)
}

fn truncate(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

/// An error the gateway answers itself: an HTTP status plus a JSON-RPC error body
/// that says what was wrong and what to do.
#[derive(Debug, Clone)]
pub struct GatewayError {
    pub status: StatusCode,
    pub code: i64,
    pub message: String,
    pub data: Option<Box<Value>>,
    /// Why the gateway answered itself, also written into `data.reason`; read from
    /// here, never parsed back out of the body.
    pub reason: Option<Reason>,
    /// Seconds a client should wait before retrying (sent as `Retry-After`).
    pub retry_after: Option<u32>,
    /// The id of the request being answered, once known.
    pub id: Value,
    /// What the log line may say beyond the client's message (internal addresses,
    /// Redis errors); never sent to the client.
    pub log_detail: Option<Box<str>>,
}

impl GatewayError {
    pub fn new(status: StatusCode, code: i64, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            data: None,
            reason: None,
            retry_after: None,
            id: Value::Null,
            log_detail: None,
        }
    }

    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::INVALID_REQUEST, message)
    }

    pub fn parse_error(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::PARSE_ERROR, message)
    }

    pub fn header_mismatch(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::HEADER_MISMATCH, message)
    }

    /// The session is unknown here and nowhere else claims it: the client must
    /// start a new one (MCP: 404 means re-initialize).
    pub fn session_not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            code::SESSION_NOT_FOUND,
            "session not found: it ended or never existed; send initialize without \
             Mcp-Session-Id to start a new session",
        )
        .with_reason(Reason::SessionNotFound)
        .with_data(json!({ "retryable": false }))
    }

    pub fn gateway(status: StatusCode, reason: Reason, message: impl Into<String>) -> Self {
        Self::new(status, code::GATEWAY_ERROR, message).with_reason(reason)
    }

    /// Sets `data` (an object); a reason set before stays in it.
    pub fn with_data(mut self, mut data: Value) -> Self {
        if let (Some(reason), Some(fields)) = (self.reason, data.as_object_mut()) {
            fields.insert("reason".into(), reason.as_str().into());
        }
        self.data = Some(Box::new(data));
        self
    }

    /// Sets the reason, and `data.reason` with it.
    pub fn with_reason(mut self, reason: Reason) -> Self {
        self.reason = Some(reason);
        let data = self.data.get_or_insert_with(|| Box::new(json!({})));
        if let Some(fields) = data.as_object_mut() {
            fields.insert("reason".into(), reason.as_str().into());
        }
        self
    }

    pub fn with_id(mut self, id: Value) -> Self {
        self.id = id;
        self
    }

    pub fn with_log_detail(mut self, detail: impl Into<String>) -> Self {
        self.log_detail = Some(detail.into().into_boxed_str());
        self
    }

    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The JSON-RPC error body.
    pub fn body(&self) -> Bytes {
        let mut error = json!({ "code": self.code, "message": self.message });
        if let Some(data) = &self.data {
            error["data"] = (**data).clone();
        }
        let body = json!({ "jsonrpc": "2.0", "id": self.id, "error": error });
        Bytes::from(body.to_string())
    }
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &[u8]) -> Result<Message, GatewayError> {
        parse_message(&Bytes::copy_from_slice(body))
    }

    #[test]
    fn the_tree_is_the_whole_body_and_the_tool_is_read_without_it() {
        let body = br#"{"jsonrpc":"2.0","id":"q","method":"tools/call","params":{"name":"echo","arguments":{"text":"hi","n":[1,2]}},"_meta":{}}"#;
        let message = parse(body).unwrap();
        assert_eq!(message.tool_name(), Some("echo"));
        assert!(
            message.json.get().is_none(),
            "no tree until one is asked for"
        );
        let whole: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(message.json(), &whole);
        assert_eq!(message.clone().into_json(), whole);
        assert_eq!(parse(body).unwrap().into_json(), whole);
    }

    #[test]
    fn a_body_too_deep_for_a_tree_is_refused_up_front() {
        // Whatever passes the parse must make a tree later: serde_json stops at a
        // nesting depth of 128, so params nested deeper are refused here too.
        let nested = |levels: usize| {
            format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"deep/params","params":{}"[{{\"",1{}}}"#,
                "[".repeat(levels),
                "]".repeat(levels)
            )
        };
        // The envelope is one level, so params may nest one less than the limit.
        let deepest = nested(MAX_TREE_DEPTH - 1);
        assert!(serde_json::from_str::<Value>(&deepest).is_ok());
        let message = parse(deepest.as_bytes()).unwrap();
        assert!(message.json()["params"].is_array());
        let too_deep = nested(MAX_TREE_DEPTH);
        assert!(
            serde_json::from_str::<Value>(&too_deep).is_err(),
            "the limit moved"
        );
        let err = parse(too_deep.as_bytes()).unwrap_err();
        assert_eq!(err.code, code::PARSE_ERROR, "{}", err.message);
    }

    #[test]
    fn only_a_tools_call_with_a_string_name_names_a_tool() {
        let tool = |body: &[u8]| parse(body).unwrap().tool_name().map(str::to_owned);
        let note = br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"admin"}}"#;
        assert_eq!(
            tool(note).as_deref(),
            Some("admin"),
            "scopes apply to it too"
        );
        let spaced = b"{ \"params\" :\n {\"name\" : \"echo\"}, \"method\":\"tools/call\", \"id\":1, \"jsonrpc\":\"2.0\" }";
        assert_eq!(tool(spaced).as_deref(), Some("echo"));
        let listed = br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"name":"echo"}}"#;
        assert_eq!(tool(listed), None);
    }

    #[test]
    fn a_key_repeated_anywhere_is_refused_naming_it() {
        // The scope check and the upstream must read one value: a parser that keeps
        // the first "name" and one that keeps the last would disagree on the tool.
        for (body, key, at) in [
            (
                &br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","name":"deploy"}}"#[..],
                "name",
                "params",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call"}"#,
                "method",
                "the top level",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}"#,
                "id",
                "the top level",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":"a://x","_meta":{"traceparent":"a","traceparent":"b"}}}"#,
                "traceparent",
                "params._meta",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"items":[{"a":1},{"b":1,"b":2}]}}}"#,
                "b",
                "params.arguments.items[1]",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"result":{"content":[],"content":[]}}"#,
                "content",
                "result",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"x","params":{"key":1,"key":2}}"#,
                "key",
                "params",
            ),
        ] {
            let text = String::from_utf8_lossy(body);
            let err = parse(body).expect_err(&text);
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{text}");
            assert_eq!(err.code, code::INVALID_REQUEST, "{text}: {}", err.message);
            assert!(
                err.message.contains(&format!("{key:?}")) && err.message.contains(at),
                "{text}: {}",
                err.message
            );
            let data = err.data.as_deref().expect("data names the key");
            assert_eq!(data["repeated_key"], key, "{text}");
        }
        // The same key in two different objects is no repetition.
        let fine = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"name":"x","_meta":{"name":1}}}}"#;
        assert_eq!(parse(fine).unwrap().tool_name(), Some("echo"));
    }

    /// Not a test: a workload for counting the repeated-key scan's share of a parse
    /// under callgrind (`valgrind --tool=callgrind <test binary> --ignored
    /// parse_workload`, then `callgrind_annotate --inclusive=yes`), on the benchmark's
    /// `tools/call` body.
    #[test]
    #[ignore]
    fn parse_workload() {
        let body = Bytes::from_static(
            br#"{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"echo","arguments":{"text":"hello"}}}"#,
        );
        for _ in 0..10_000 {
            std::hint::black_box(parse_message(std::hint::black_box(&body)).is_ok());
        }
    }

    #[test]
    fn a_tools_call_whose_name_cannot_be_read_is_refused() {
        for body in [
            &br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":7}}"#[..],
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":["echo"]}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#,
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":null}}"#,
        ] {
            let text = String::from_utf8_lossy(body);
            let err = parse(body).expect_err(&text);
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{text}");
            assert_eq!(err.code, code::INVALID_PARAMS, "{text}: {}", err.message);
            assert!(err.message.contains("params.name"), "{}", err.message);
        }
    }

    #[test]
    fn null_members_are_present_and_escapes_are_read() {
        // A null id is an id, and not a valid one.
        let err = parse(br#"{"jsonrpc":"2.0","id":null,"method":"x"}"#).unwrap_err();
        assert!(err.message.contains("id must be"), "{}", err.message);
        // A null result still makes an answer.
        let answer = parse(br#"{"jsonrpc":"2.0","id":3,"result":null}"#).unwrap();
        assert_eq!(answer.kind, MessageKind::Response { id: 3.into() });
        let escaped = parse(br#"{"jsonrpc":"2\u002e0","id":1,"method":"ping"}"#).unwrap();
        assert_eq!(escaped.method(), Some("ping"));
        let err = parse(br#" [{"jsonrpc":"2.0","id":1,"method":"ping"}]"#).unwrap_err();
        assert!(err.message.contains("batches"), "{}", err.message);
        let err = parse(br#"{"jsonrpc":"2.0","id":1,"method":"ping""#).unwrap_err();
        assert_eq!(err.code, code::PARSE_ERROR);
    }

    #[test]
    fn era_follows_the_protocol_version_header() {
        assert_eq!(era_of(None).ok(), Some(Era::Legacy));
        assert_eq!(era_of(Some("2025-06-18")).ok(), Some(Era::Legacy));
        assert_eq!(era_of(Some("2026-07-28")).ok(), Some(Era::Modern));
        let err = era_of(Some("1999-01-01")).err().map(|e| (e.status, e.code));
        assert_eq!(
            err,
            Some((StatusCode::BAD_REQUEST, code::UNSUPPORTED_PROTOCOL_VERSION))
        );
    }

    #[test]
    fn messages_are_classified() {
        let req = parse(br#"{"jsonrpc":"2.0","id":1,"method":"initialize"}"#).unwrap();
        assert!(req.is_initialize());
        let note = parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#).unwrap();
        assert_eq!(
            note.kind,
            MessageKind::Notification {
                method: "notifications/initialized".into()
            }
        );
        let resp = parse(br#"{"jsonrpc":"2.0","id":"a","result":{}}"#).unwrap();
        assert_eq!(resp.kind, MessageKind::Response { id: "a".into() });
    }

    #[test]
    fn bad_bodies_get_the_right_codes() {
        let cases: &[(&[u8], i64)] = &[
            (b"{not json", code::PARSE_ERROR),
            (b"[1,2]", code::INVALID_REQUEST),
            (b"42", code::INVALID_REQUEST),
            (br#"{"id":1,"method":"x"}"#, code::INVALID_REQUEST),
            (
                br#"{"jsonrpc":"2.0","id":1.5,"method":"x"}"#,
                code::INVALID_REQUEST,
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":7}"#,
                code::INVALID_REQUEST,
            ),
            (br#"{"jsonrpc":"2.0","id":1}"#, code::INVALID_REQUEST),
        ];
        for (body, expected) in cases {
            let err = parse(body).expect_err("must be rejected");
            assert_eq!(err.code, *expected, "{}", String::from_utf8_lossy(body));
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn session_ids_must_be_visible_ascii() {
        assert!(validate_session_id(b"abc-123.XYZ").is_ok());
        assert!(validate_session_id(b"").is_err());
        assert!(validate_session_id(b"has space").is_err());
        assert!(validate_session_id(b"tab\there").is_err());
        assert!(validate_session_id("caf\u{e9}".as_bytes()).is_err());
        assert!(validate_session_id(&[b'a'; MAX_SESSION_ID_LEN + 1]).is_err());
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        map
    }

    #[test]
    fn modern_headers_must_match_the_body() {
        let call =
            parse(br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"echo"}}"#)
                .unwrap();
        let good = headers(&[(HEADER_METHOD, "tools/call"), (HEADER_NAME, "echo")]);
        assert!(check_modern_headers(&good, &call).is_ok());
        let b64 = headers(&[
            (HEADER_METHOD, "tools/call"),
            (HEADER_NAME, "=?base64?ZWNobw==?="),
        ]);
        assert!(check_modern_headers(&b64, &call).is_ok());
        for bad in [
            headers(&[(HEADER_METHOD, "tools/list"), (HEADER_NAME, "echo")]),
            headers(&[(HEADER_METHOD, "tools/call"), (HEADER_NAME, "other")]),
            headers(&[(HEADER_METHOD, "tools/call")]),
            headers(&[(HEADER_NAME, "echo")]),
        ] {
            let err = check_modern_headers(&bad, &call).expect_err("mismatch");
            assert_eq!(err.code, code::HEADER_MISMATCH);
        }
    }

    #[test]
    fn base64_header_values_decode() {
        assert_eq!(decode_header_value(b"plain").as_deref(), Some("plain"));
        assert_eq!(
            decode_header_value(b"=?base64?w6lk?=").as_deref(),
            Some("\u{e9}d")
        );
        assert_eq!(decode_header_value(b"=?base64?!!!?="), None);
    }

    #[test]
    fn error_body_is_json_rpc() {
        let err = GatewayError::session_not_found().with_id(json!(7));
        let body: Value = serde_json::from_slice(&err.body()).unwrap();
        assert_eq!(body["jsonrpc"], "2.0");
        assert_eq!(body["id"], 7);
        assert_eq!(body["error"]["code"], code::SESSION_NOT_FOUND);
        assert_eq!(err.status, StatusCode::NOT_FOUND);
    }
}
