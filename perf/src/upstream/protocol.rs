//! MCP-over-HTTP request classification, without I/O.
//!
//! Everything here decides from headers and a decoded body what kind of
//! message arrived and whether it is acceptable; `server.rs` only moves bytes.
//! Two protocol eras share the `/mcp` endpoint and are told apart by the
//! `MCP-Protocol-Version` header: the session era (`initialize` +
//! `Mcp-Session-Id`) and the 2026-07-28 era (self-contained requests whose
//! `params._meta` carries the envelope, mirrored in routing headers).

use std::borrow::Cow;

use serde::Serialize;
use serde_json::{Map, Value, json};

/// Protocol versions of the session era, oldest first.
pub const LEGACY_VERSIONS: [&str; 4] = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
/// The version a legacy `initialize` gets when it asks for one we do not speak.
pub const LATEST_LEGACY_VERSION: &str = "2025-11-25";
/// The sessionless protocol version.
pub const MODERN_VERSION: &str = "2026-07-28";

pub const HEADER_PROTOCOL_VERSION: &str = "mcp-protocol-version";
pub const HEADER_SESSION_ID: &str = "mcp-session-id";
pub const HEADER_METHOD: &str = "mcp-method";
pub const HEADER_NAME: &str = "mcp-name";

pub const META_PROTOCOL_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
pub const META_CLIENT_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// Server-defined: the `Mcp-Session-Id` names no live session.
pub const SESSION_NOT_FOUND: i64 = -32001;
/// MCP: the resource URI names nothing this server holds.
pub const RESOURCE_NOT_FOUND: i64 = -32002;
/// 2026-07-28: a routing header disagrees with the body it travels with.
pub const HEADER_MISMATCH: i64 = -32020;
/// 2026-07-28: the requested protocol version is not served here.
pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;

/// Which protocol era a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Era {
    /// Session protocol: `initialize` mints an `Mcp-Session-Id` that every later request carries.
    Legacy,
    /// 2026-07-28: every request is self-contained; there is no session.
    Modern,
}

/// A JSON-RPC error object, ready to be sent with the request's id.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RpcError {
    pub code: i64,
    pub message: Cow<'static, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            code,
            message: message.into(),
            data: None,
        }
    }

    pub fn parse_error(detail: impl std::fmt::Display) -> Self {
        Self::new(
            PARSE_ERROR,
            format!("Parse error: the body is not valid JSON ({detail})"),
        )
    }

    pub fn invalid_request(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(INVALID_REQUEST, message)
    }

    pub fn invalid_params(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(INVALID_PARAMS, message)
    }

    pub fn method_not_found(method: &str) -> Self {
        Self::new(METHOD_NOT_FOUND, format!("Method not found: {method}"))
    }

    pub fn header_mismatch(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(HEADER_MISMATCH, message)
    }

    pub fn unsupported_version(requested: &str) -> Self {
        let supported: Vec<&str> = LEGACY_VERSIONS
            .iter()
            .copied()
            .chain([MODERN_VERSION])
            .collect();
        Self {
            code: UNSUPPORTED_PROTOCOL_VERSION,
            message: Cow::Borrowed("Unsupported protocol version"),
            data: Some(json!({ "supported": supported, "requested": requested })),
        }
    }

    pub fn session_not_found() -> Self {
        Self::new(
            SESSION_NOT_FOUND,
            "Session not found: it ended or never existed; send initialize without Mcp-Session-Id to start a new session",
        )
    }

    pub fn session_required() -> Self {
        Self::invalid_request(
            "Bad Request: this request needs the Mcp-Session-Id header; send initialize first and use the id it returns",
        )
    }

    /// The HTTP status a 2026-07-28 server owes for this error when it is
    /// the whole answer (the spec maps envelope and dispatch errors to 4xx).
    /// Session-era servers answer dispatch errors with 200.
    pub fn modern_http_status(&self) -> u16 {
        match self.code {
            PARSE_ERROR
            | INVALID_REQUEST
            | INVALID_PARAMS
            | HEADER_MISMATCH
            | UNSUPPORTED_PROTOCOL_VERSION => 400,
            METHOD_NOT_FOUND => 404,
            _ => 200,
        }
    }
}

/// Picks the era from the `MCP-Protocol-Version` header. No header means
/// the session era: legacy clients omit it on `initialize`, and the
/// 2025-03-26 transport says to assume that version when it is missing.
pub fn era_of(protocol_version_header: Option<&[u8]>) -> Result<Era, RpcError> {
    let Some(raw) = protocol_version_header else {
        return Ok(Era::Legacy);
    };
    match std::str::from_utf8(raw) {
        Ok(MODERN_VERSION) => Ok(Era::Modern),
        Ok(version) if LEGACY_VERSIONS.contains(&version) => Ok(Era::Legacy),
        Ok(version) => Err(RpcError::unsupported_version(version)),
        Err(_) => Err(RpcError::unsupported_version(&String::from_utf8_lossy(raw))),
    }
}

/// Whether a POST's `Content-Type` says JSON (`application/json`, any parameters).
pub fn is_json_content_type(content_type: Option<&[u8]>) -> bool {
    content_type
        .and_then(|value| std::str::from_utf8(value).ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media_type| media_type.trim().eq_ignore_ascii_case("application/json"))
}

/// Whether an `Accept` header admits `text/event-stream`.
pub fn accepts_event_stream(accept: Option<&[u8]>) -> bool {
    accept
        .and_then(|value| std::str::from_utf8(value).ok())
        .is_some_and(|value| {
            value.split(',').any(|range| {
                let media_range = range.split(';').next().unwrap_or_default().trim();
                ["text/event-stream", "text/*", "*/*"]
                    .iter()
                    .any(|accepted| media_range.eq_ignore_ascii_case(accepted))
            })
        })
}

/// The version a legacy `initialize` agrees to: the client's if we speak it.
pub fn negotiate_legacy_version(requested: Option<&str>) -> &'static str {
    requested
        .and_then(|wanted| {
            LEGACY_VERSIONS
                .iter()
                .copied()
                .find(|known| *known == wanted)
        })
        .unwrap_or(LATEST_LEGACY_VERSION)
}

/// One decoded POST body, by the role it plays in JSON-RPC.
#[derive(Debug, PartialEq)]
pub enum Message<'a> {
    /// Owes a response.
    Request {
        id: &'a Value,
        method: &'a str,
        params: Option<&'a Map<String, Value>>,
    },
    /// Fire-and-forget: acknowledged with 202.
    Notification { method: &'a str },
    /// The client answering a server-initiated request; this server sends none, so it is only acknowledged.
    ClientResponse,
}

/// Sorts a decoded body into a [`Message`], or says why it is not one.
pub fn classify_message(body: &Value) -> Result<Message<'_>, RpcError> {
    let object = match body {
        Value::Object(object) => object,
        Value::Array(_) => {
            return Err(RpcError::invalid_request(
                "Invalid Request: batches are not supported; send one JSON-RPC message per POST",
            ));
        }
        _ => {
            return Err(RpcError::invalid_request(
                "Invalid Request: the body must be one JSON-RPC object",
            ));
        }
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(RpcError::invalid_request(
            r#"Invalid Request: "jsonrpc" must be "2.0""#,
        ));
    }
    let id = object.get("id");
    if let Some(id) = id
        && !(id.is_string() || id.is_i64() || id.is_u64())
    {
        return Err(RpcError::invalid_request(
            "Invalid Request: \"id\" must be a string or an integer",
        ));
    }
    match (object.get("method"), id) {
        (Some(Value::String(method)), Some(id)) => {
            let params = match object.get("params") {
                None | Some(Value::Null) => None,
                Some(Value::Object(params)) => Some(params),
                Some(_) => {
                    return Err(RpcError::invalid_params(
                        "Invalid params: \"params\" must be an object",
                    ));
                }
            };
            Ok(Message::Request { id, method, params })
        }
        (Some(Value::String(method)), None) => Ok(Message::Notification { method }),
        (Some(_), _) => Err(RpcError::invalid_request(
            "Invalid Request: \"method\" must be a string",
        )),
        (None, Some(_)) if object.contains_key("result") || object.contains_key("error") => {
            Ok(Message::ClientResponse)
        }
        (None, _) => Err(RpcError::invalid_request(
            "Invalid Request: a message needs \"method\" (request or notification) or \"result\"/\"error\" (response)",
        )),
    }
}

/// The id to echo on an error about `body`: its own when usable, else null.
pub fn id_for_error(body: &Value) -> Value {
    match body.get("id") {
        Some(id) if id.is_string() || id.is_i64() || id.is_u64() => id.clone(),
        _ => Value::Null,
    }
}

/// One routing header of a 2026-07-28 request, as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutingHeader<'a> {
    Absent,
    Once(&'a [u8]),
    /// Sent more than once: a first-copy reader and a last-copy reader
    /// along the path would disagree, so the request is refused.
    Repeated,
}

impl<'a> RoutingHeader<'a> {
    fn value(self) -> Option<&'a [u8]> {
        match self {
            RoutingHeader::Once(value) => Some(value),
            RoutingHeader::Absent | RoutingHeader::Repeated => None,
        }
    }
}

/// The routing headers of a 2026-07-28 request.
#[derive(Debug, Clone, Copy)]
pub struct RoutingHeaders<'a> {
    pub protocol_version: RoutingHeader<'a>,
    pub method: RoutingHeader<'a>,
    pub name: RoutingHeader<'a>,
}

/// Which `params` field the `Mcp-Name` header mirrors for `method`, if any.
pub fn name_bearing_param(method: &str) -> Option<&'static str> {
    match method {
        "tools/call" | "prompts/get" => Some("name"),
        "resources/read" => Some("uri"),
        _ => None,
    }
}

/// Checks a 2026-07-28 request's envelope (`params._meta`) and that its
/// routing headers say what its body says, in the order the reference SDK
/// uses so clients get the same first complaint from either server.
pub fn validate_modern_request(
    method: &str,
    params: Option<&Map<String, Value>>,
    headers: &RoutingHeaders<'_>,
) -> Result<(), RpcError> {
    for (header, value) in [
        (HEADER_PROTOCOL_VERSION, headers.protocol_version),
        (HEADER_METHOD, headers.method),
        (HEADER_NAME, headers.name),
    ] {
        if value == RoutingHeader::Repeated {
            return Err(RpcError::header_mismatch(format!(
                "{header} header appears more than once"
            )));
        }
    }
    let Some(meta) = params
        .and_then(|params| params.get("_meta"))
        .and_then(Value::as_object)
    else {
        return Err(RpcError::invalid_params(format!(
            "params._meta must be an object carrying the required '{META_PROTOCOL_VERSION}' and \
             '{META_CLIENT_CAPABILITIES}' envelope keys"
        )));
    };
    let missing: Vec<&str> = [META_PROTOCOL_VERSION, META_CLIENT_CAPABILITIES]
        .into_iter()
        .filter(|key| !meta.contains_key(*key))
        .collect();
    if !missing.is_empty() {
        return Err(RpcError::invalid_params(format!(
            "params._meta is missing the required envelope key(s): {}",
            missing.join(", ")
        )));
    }
    let body_version = meta.get(META_PROTOCOL_VERSION).and_then(Value::as_str);
    let header_version = headers.protocol_version.value();
    if header_version.is_none() || header_version != body_version.map(str::as_bytes) {
        return Err(RpcError::header_mismatch(format!(
            "{HEADER_PROTOCOL_VERSION} header does not match the request envelope's protocol version"
        )));
    }
    if headers.method.value() != Some(method.as_bytes()) {
        return Err(RpcError::header_mismatch(format!(
            "{HEADER_METHOD} header does not match the request body's method"
        )));
    }
    if let Some(param) = name_bearing_param(method)
        && let Some(body_value) = params.and_then(|params| params.get(param))
        && !body_value.is_null()
    {
        let header_value = headers.name.value().and_then(decode_header_value);
        let matches = match (header_value.as_deref(), body_value) {
            (Some(header_value), Value::String(body_value)) => header_value == body_value,
            // A non-string name can never equal a header.
            _ => false,
        };
        if !matches {
            return Err(RpcError::header_mismatch(format!(
                "{HEADER_NAME} header does not match the request body's '{param}' parameter"
            )));
        }
    }
    if body_version != Some(MODERN_VERSION) {
        // Only reachable if the header said so too, and the header picked this era.
        return Err(RpcError::unsupported_version(
            body_version.unwrap_or_default(),
        ));
    }
    Ok(())
}

/// Decodes a routing header value. Values that would not survive as a
/// header (non-ASCII, edge whitespace) travel as `=?base64?<payload>?=`;
/// a malformed sentinel decodes to `None` so it never matches by accident.
pub fn decode_header_value(raw: &[u8]) -> Option<Cow<'_, str>> {
    match raw
        .strip_prefix(b"=?base64?")
        .and_then(|rest| rest.strip_suffix(b"?="))
    {
        Some(payload) => decode_base64_canonical(payload)
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .map(Cow::Owned),
        None => std::str::from_utf8(raw).ok().map(Cow::Borrowed),
    }
}

/// Standard-alphabet, padded base64; rejects anything an encoder would not
/// have produced (bad length, stray padding, non-zero trailing bits).
fn decode_base64_canonical(input: &[u8]) -> Option<Vec<u8>> {
    fn sextet(byte: u8) -> Option<u32> {
        Some(match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    if !input.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(input.len() / 4 * 3);
    let quads = input.len() / 4;
    for (index, quad) in input.chunks_exact(4).enumerate() {
        let padding = quad.iter().rev().take_while(|byte| **byte == b'=').count();
        if padding > 2 || (padding > 0 && index + 1 != quads) {
            return None;
        }
        let mut bits = 0u32;
        for &byte in &quad[..4 - padding] {
            bits = (bits << 6) | sextet(byte)?;
        }
        bits <<= 6 * padding as u32;
        let decoded = [(bits >> 16) as u8, (bits >> 8) as u8, bits as u8];
        let keep = 3 - padding;
        if decoded[keep..].iter().any(|byte| *byte != 0) {
            return None;
        }
        out.extend_from_slice(&decoded[..keep]);
    }
    Some(out)
}

/// Adds the 2026-07-28 `resultType` tag; that era's clients require it.
pub fn mark_complete(mut result: Value) -> Value {
    if let Value::Object(object) = &mut result {
        object.insert("resultType".to_owned(), Value::from("complete"));
    }
    result
}

#[derive(Serialize)]
struct SuccessResponse<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    result: &'a Value,
}

#[derive(Serialize)]
struct ErrorResponse<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    error: &'a RpcError,
}

#[derive(Serialize)]
struct Notification<'a> {
    jsonrpc: &'static str,
    method: &'a str,
    params: &'a Value,
}

pub fn encode_result(id: &Value, result: &Value) -> Vec<u8> {
    encode(&SuccessResponse {
        jsonrpc: "2.0",
        id,
        result,
    })
}

pub fn encode_error(id: &Value, error: &RpcError) -> Vec<u8> {
    encode(&ErrorResponse {
        jsonrpc: "2.0",
        id,
        error,
    })
}

pub fn encode_notification(method: &str, params: &Value) -> Vec<u8> {
    encode(&Notification {
        jsonrpc: "2.0",
        method,
        params,
    })
}

fn encode(message: &impl Serialize) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    match serde_json::to_writer(&mut out, message) {
        Ok(()) => out,
        // Unreachable for these shapes (string keys only), but a reply must still go out.
        Err(_) => br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"Internal error: could not encode the reply"}}"#
            .to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers<'a>(
        version: Option<&'a str>,
        method: Option<&'a str>,
        name: Option<&'a str>,
    ) -> RoutingHeaders<'a> {
        let header = |value: Option<&'a str>| {
            value.map_or(RoutingHeader::Absent, |v| RoutingHeader::Once(v.as_bytes()))
        };
        RoutingHeaders {
            protocol_version: header(version),
            method: header(method),
            name: header(name),
        }
    }

    fn modern_params(extra: Value) -> Map<String, Value> {
        let mut params = json!({
            "_meta": {
                META_PROTOCOL_VERSION: MODERN_VERSION,
                META_CLIENT_CAPABILITIES: {},
            }
        });
        if let (Value::Object(params), Value::Object(extra)) = (&mut params, extra) {
            params.extend(extra);
        }
        match params {
            Value::Object(params) => params,
            _ => Map::new(),
        }
    }

    #[test]
    fn era_follows_the_protocol_version_header() {
        assert_eq!(era_of(None), Ok(Era::Legacy));
        for version in LEGACY_VERSIONS {
            assert_eq!(
                era_of(Some(version.as_bytes())),
                Ok(Era::Legacy),
                "{version}"
            );
        }
        assert_eq!(era_of(Some(b"2026-07-28")), Ok(Era::Modern));
    }

    #[test]
    fn unknown_protocol_version_is_refused_with_the_supported_list() {
        let error = era_of(Some(b"2099-01-01")).expect_err("unknown version must be refused");
        assert_eq!(error.code, UNSUPPORTED_PROTOCOL_VERSION);
        assert_eq!(error.modern_http_status(), 400);
        let data = error.data.expect("data names the versions");
        assert_eq!(data["requested"], "2099-01-01");
        assert_eq!(data["supported"].as_array().map(Vec::len), Some(5));
        assert!(
            data["supported"]
                .as_array()
                .is_some_and(|all| all.contains(&json!(MODERN_VERSION)))
        );
    }

    #[test]
    fn json_content_type_is_recognised_with_parameters() {
        assert!(is_json_content_type(Some(b"application/json")));
        assert!(is_json_content_type(Some(
            b"Application/JSON; charset=utf-8"
        )));
        assert!(!is_json_content_type(Some(b"text/plain")));
        assert!(!is_json_content_type(Some(b"application/jsonl")));
        assert!(!is_json_content_type(None));
    }

    #[test]
    fn event_stream_acceptance_reads_media_ranges() {
        assert!(accepts_event_stream(Some(
            b"application/json, text/event-stream"
        )));
        assert!(accepts_event_stream(Some(b"text/event-stream;q=0.9")));
        assert!(accepts_event_stream(Some(b"*/*")));
        assert!(!accepts_event_stream(Some(b"application/json")));
        assert!(!accepts_event_stream(None));
    }

    #[test]
    fn legacy_initialize_gets_its_version_or_the_latest() {
        assert_eq!(negotiate_legacy_version(Some("2025-03-26")), "2025-03-26");
        assert_eq!(negotiate_legacy_version(Some("2024-11-05")), "2024-11-05");
        assert_eq!(
            negotiate_legacy_version(Some("2026-07-28")),
            LATEST_LEGACY_VERSION
        );
        assert_eq!(
            negotiate_legacy_version(Some("1999-01-01")),
            LATEST_LEGACY_VERSION
        );
        assert_eq!(negotiate_legacy_version(None), LATEST_LEGACY_VERSION);
    }

    #[test]
    fn messages_are_sorted_by_role() {
        let request = json!({"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"cursor":"x"}});
        match classify_message(&request) {
            Ok(Message::Request { id, method, params }) => {
                assert_eq!(id, &json!(7));
                assert_eq!(method, "tools/list");
                assert_eq!(params.and_then(|p| p.get("cursor")), Some(&json!("x")));
            }
            other => panic!("expected a request, got {other:?}"),
        }
        let notification = json!({"jsonrpc":"2.0","method":"notifications/initialized"});
        assert_eq!(
            classify_message(&notification),
            Ok(Message::Notification {
                method: "notifications/initialized"
            })
        );
        let response = json!({"jsonrpc":"2.0","id":"s-1","result":{}});
        assert_eq!(classify_message(&response), Ok(Message::ClientResponse));
        let error_response = json!({"jsonrpc":"2.0","id":3,"error":{"code":1,"message":"no"}});
        assert_eq!(
            classify_message(&error_response),
            Ok(Message::ClientResponse)
        );
    }

    #[test]
    fn malformed_messages_are_invalid_requests() {
        let batch = json!([{"jsonrpc":"2.0","id":1,"method":"ping"}]);
        let error = classify_message(&batch).expect_err("batch");
        assert_eq!(error.code, INVALID_REQUEST);
        assert!(error.message.contains("batches are not supported"));

        for body in [
            json!("ping"),
            json!({"id":1,"method":"ping"}),
            json!({"jsonrpc":"1.0","id":1,"method":"ping"}),
            json!({"jsonrpc":"2.0","id":{"a":1},"method":"ping"}),
            json!({"jsonrpc":"2.0","id":1.5,"method":"ping"}),
            json!({"jsonrpc":"2.0","id":null,"method":"ping"}),
            json!({"jsonrpc":"2.0","id":1,"method":5}),
            json!({"jsonrpc":"2.0","id":1}),
            json!({"jsonrpc":"2.0","result":{}}),
        ] {
            let error = classify_message(&body).expect_err(&body.to_string());
            assert_eq!(error.code, INVALID_REQUEST, "{body}");
        }
        let bad_params = json!({"jsonrpc":"2.0","id":1,"method":"ping","params":[1]});
        assert_eq!(
            classify_message(&bad_params).map_err(|e| e.code),
            Err(INVALID_PARAMS)
        );
    }

    #[test]
    fn error_ids_echo_only_usable_ids() {
        assert_eq!(id_for_error(&json!({"id": 4})), json!(4));
        assert_eq!(id_for_error(&json!({"id": "a"})), json!("a"));
        assert_eq!(id_for_error(&json!({"id": [1]})), Value::Null);
        assert_eq!(id_for_error(&json!([1, 2])), Value::Null);
    }

    #[test]
    fn modern_request_with_matching_headers_passes() {
        let params = modern_params(json!({"name": "echo", "arguments": {"text": "hi"}}));
        let routing = headers(Some(MODERN_VERSION), Some("tools/call"), Some("echo"));
        assert_eq!(
            validate_modern_request("tools/call", Some(&params), &routing),
            Ok(())
        );

        let params = modern_params(json!({"uri": "demo://session/state"}));
        let routing = headers(
            Some(MODERN_VERSION),
            Some("resources/read"),
            Some("demo://session/state"),
        );
        assert_eq!(
            validate_modern_request("resources/read", Some(&params), &routing),
            Ok(())
        );

        let params = modern_params(json!({}));
        let routing = headers(Some(MODERN_VERSION), Some("tools/list"), None);
        assert_eq!(
            validate_modern_request("tools/list", Some(&params), &routing),
            Ok(())
        );
    }

    #[test]
    fn modern_request_without_envelope_is_invalid_params() {
        let routing = headers(Some(MODERN_VERSION), Some("tools/list"), None);
        assert_eq!(
            validate_modern_request("tools/list", None, &routing).map_err(|e| e.code),
            Err(INVALID_PARAMS)
        );

        let mut params = modern_params(json!({}));
        if let Some(Value::Object(meta)) = params.get_mut("_meta") {
            meta.remove(META_CLIENT_CAPABILITIES);
        }
        let error = validate_modern_request("tools/list", Some(&params), &routing)
            .expect_err("missing capabilities");
        assert_eq!(error.code, INVALID_PARAMS);
        assert!(error.message.contains(META_CLIENT_CAPABILITIES));
        assert_eq!(error.modern_http_status(), 400);
    }

    #[test]
    fn modern_header_disagreeing_with_body_is_a_mismatch() {
        let params = modern_params(json!({"name": "echo", "arguments": {}}));
        let cases = [
            headers(None, Some("tools/call"), Some("echo")),
            headers(Some(MODERN_VERSION), Some("tools/list"), Some("echo")),
            headers(Some(MODERN_VERSION), None, Some("echo")),
            headers(Some(MODERN_VERSION), Some("tools/call"), Some("other")),
            headers(Some(MODERN_VERSION), Some("tools/call"), None),
        ];
        for routing in cases {
            let error = validate_modern_request("tools/call", Some(&params), &routing)
                .expect_err("mismatch");
            assert_eq!(error.code, HEADER_MISMATCH, "{routing:?}");
            assert!(error.message.contains("does not match"));
        }
        let duplicated = RoutingHeaders {
            method: RoutingHeader::Repeated,
            ..headers(Some(MODERN_VERSION), None, None)
        };
        let error = validate_modern_request("tools/call", Some(&params), &duplicated)
            .expect_err("duplicate");
        assert_eq!(error.code, HEADER_MISMATCH);
        assert!(error.message.contains("more than once"));
    }

    #[test]
    fn base64_wrapped_name_header_matches_its_decoded_value() {
        // "héllo" as the SDK's header-safe encoder wraps it.
        let params = modern_params(json!({"name": "héllo"}));
        let routing = headers(
            Some(MODERN_VERSION),
            Some("tools/call"),
            Some("=?base64?aMOpbGxv?="),
        );
        assert_eq!(
            validate_modern_request("tools/call", Some(&params), &routing),
            Ok(())
        );
    }

    #[test]
    fn header_values_decode_only_canonical_base64() {
        assert_eq!(decode_header_value(b"echo").as_deref(), Some("echo"));
        assert_eq!(
            decode_header_value(b"=?base64?aGk=?=").as_deref(),
            Some("hi")
        );
        assert_eq!(
            decode_header_value(b"=?base64?aGVsbG8=?=").as_deref(),
            Some("hello")
        );
        assert_eq!(
            decode_header_value(b"=?base64?aGVs?=").as_deref(),
            Some("hel")
        );
        assert_eq!(decode_header_value(b"=?base64??=").as_deref(), Some(""));
        // Non-zero trailing bits, bad length, stray padding, foreign alphabet.
        for bad in [
            "=?base64?aGl=?=",
            "=?base64?aGk?=",
            "=?base64?a=Gk?=",
            "=?base64?aG-k?=",
            "=?base64?/w==?=",
        ] {
            assert_eq!(decode_header_value(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn modern_status_table_matches_the_spec() {
        assert_eq!(RpcError::method_not_found("x").modern_http_status(), 404);
        assert_eq!(RpcError::invalid_params("x").modern_http_status(), 400);
        assert_eq!(RpcError::header_mismatch("x").modern_http_status(), 400);
        assert_eq!(RpcError::new(INTERNAL_ERROR, "x").modern_http_status(), 200);
        assert_eq!(
            RpcError::new(RESOURCE_NOT_FOUND, "x").modern_http_status(),
            200
        );
    }

    #[test]
    fn result_type_is_added_to_objects_only() {
        assert_eq!(
            mark_complete(json!({"tools": []})),
            json!({"tools": [], "resultType": "complete"})
        );
        assert_eq!(mark_complete(json!(null)), json!(null));
    }

    #[test]
    fn replies_are_jsonrpc_envelopes() {
        let result: Value =
            serde_json::from_slice(&encode_result(&json!(1), &json!({"a": 1}))).unwrap_or_default();
        assert_eq!(result, json!({"jsonrpc":"2.0","id":1,"result":{"a":1}}));
        let error: Value =
            serde_json::from_slice(&encode_error(&Value::Null, &RpcError::session_not_found()))
                .unwrap_or_default();
        assert_eq!(error["id"], Value::Null);
        assert_eq!(error["error"]["code"], SESSION_NOT_FOUND);
        assert!(error["error"].get("data").is_none());
        let note: Value =
            serde_json::from_slice(&encode_notification("n", &json!({}))).unwrap_or_default();
        assert_eq!(note, json!({"jsonrpc":"2.0","method":"n","params":{}}));
    }
}
