//! Turning an HTTP exchange (from a client, or forwarded over the mesh) into a checked
//! MCP call. Both entry points run this same code, so a forwarded request is judged
//! exactly as a local one.

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, Method, StatusCode};
use mcpgw_wire::AuthContext;

use crate::config::Config;
use crate::mcp::{self, Era, GatewayError, Message};

/// The client-facing MCP endpoints: `/servers/{name}/mcp`, and `/mcp` when exactly one
/// upstream is configured.
#[derive(Debug, Clone)]
pub struct Endpoints {
    by_name: rustc_hash::FxHashMap<String, usize>,
    default: Option<usize>,
    /// Every route is public, so the 404 for an unknown path may list them: where
    /// clients must authenticate, the route names are not told to strangers.
    list_in_not_found: bool,
}

impl Endpoints {
    pub fn new(config: &Config) -> Self {
        let by_name = config
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| (u.name.clone(), i))
            .collect();
        let default = config.default_upstream().map(|_| 0);
        let list_in_not_found = config
            .upstreams
            .iter()
            .all(|u| config.auth.mode_of(&u.name) == crate::auth::config::Mode::Public);
        Self {
            by_name,
            default,
            list_in_not_found,
        }
    }

    /// The upstream index a path addresses.
    pub fn resolve(&self, path: &str) -> Option<usize> {
        if path == "/mcp" {
            return self.default;
        }
        let name = path.strip_prefix("/servers/")?.strip_suffix("/mcp")?;
        self.by_name.get(name).copied()
    }

    /// The 404 for a path that is no route. It names the routes only when all are
    /// public; otherwise it says how a route path looks, and nothing of which exist.
    pub fn not_found(&self, path: &str) -> GatewayError {
        let path = truncate_path(path);
        let message = if self.list_in_not_found {
            let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
            names.sort_unstable();
            let shortcut = if self.default.is_some() {
                " or /mcp"
            } else {
                ""
            };
            format!(
                "no MCP endpoint at {path:?}: use /servers/{{name}}/mcp{shortcut} (configured: {})",
                names.join(", ")
            )
        } else {
            format!(
                "no MCP endpoint at {path:?}: use /servers/{{name}}/mcp with the name of the \
                 server you were given"
            )
        };
        GatewayError::new(StatusCode::NOT_FOUND, mcp::code::METHOD_NOT_FOUND, message)
    }
}

fn truncate_path(path: &str) -> &str {
    let end = path
        .char_indices()
        .nth(128)
        .map(|(i, _)| i)
        .unwrap_or(path.len());
    &path[..end]
}

/// One checked MCP exchange, ready to run here or to forward to the session's owner.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: Method,
    /// Request path as the client sent it; forwarded unchanged.
    pub path: String,
    pub upstream: usize,
    pub era: Era,
    /// Legacy session id; modern requests have none.
    pub session_id: Option<String>,
    /// The MCP headers worth passing on (to an owner or an upstream).
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The parsed POST body.
    pub message: Option<Message>,
    /// Who the edge authenticated; travels with a forwarded call.
    pub auth: AuthContext,
    /// The client's address as the edge saw it (or as a trusted proxy reported it);
    /// known only at the edge, where sessions are created. Public mode counts session
    /// quotas by it.
    pub client: Option<std::net::IpAddr>,
}

impl Call {
    /// Whether this call was bound to its principal's shared session
    /// ([`crate::dispatch::Router::bind_shared_session`]): a 2026-07-28 call that carries a
    /// session id can only have got it there.
    pub fn is_shared_bound(&self) -> bool {
        self.era == Era::Modern && self.session_id.is_some()
    }

    /// The JSON-RPC id errors should echo.
    pub fn id(&self) -> serde_json::Value {
        self.message
            .as_ref()
            .map(Message::id)
            .unwrap_or(serde_json::Value::Null)
    }

    /// A copy of the parsed message to rewrite (null without one).
    pub fn message_copy(&self) -> serde_json::Value {
        self.message
            .as_ref()
            .map_or(serde_json::Value::Null, |m| m.json().clone())
    }

    pub fn is_initialize(&self) -> bool {
        self.message.as_ref().is_some_and(Message::is_initialize)
    }
}

/// Headers carried from the client to owners and upstreams. Everything else (cookies,
/// credentials, hop-by-hop headers) stays at the edge.
pub fn is_forwarded_header(name: &HeaderName) -> bool {
    let name = name.as_str();
    matches!(
        name,
        "accept"
            | "content-type"
            | mcp::HEADER_PROTOCOL_VERSION
            | mcp::HEADER_METHOD
            | mcp::HEADER_NAME
            | mcp::HEADER_LAST_EVENT_ID
            | "traceparent"
            | "tracestate"
    ) || name.starts_with("mcp-param-")
}

/// Checks the parts that do not need the body, in the order a client would fix them:
/// route (404), method (405), protocol version (400), content type (415).
pub fn check_head(
    endpoints: &Endpoints,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
) -> Result<(usize, Era), GatewayError> {
    let upstream = endpoints
        .resolve(path)
        .ok_or_else(|| endpoints.not_found(path))?;
    Ok((upstream, check_head_of(method, headers)?))
}

/// [`check_head`] for a request whose route is resolved already: method, protocol
/// version, content type; the era it speaks.
pub fn check_head_of(method: &Method, headers: &HeaderMap) -> Result<Era, GatewayError> {
    if !matches!(*method, Method::POST | Method::GET | Method::DELETE) {
        return Err(method_not_allowed(
            method,
            "use POST for messages, GET for the session stream, DELETE to end a session",
        ));
    }
    let version = match headers.get(mcp::HEADER_PROTOCOL_VERSION) {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            GatewayError::invalid_request("MCP-Protocol-Version header is not visible ASCII")
        })?),
    };
    let era = mcp::era_of(version)?;
    if era == Era::Modern && *method != Method::POST {
        return Err(method_not_allowed(
            method,
            "protocol 2026-07-28 has no sessions and no GET stream: send each request as a POST",
        ));
    }
    if *method == Method::POST && !is_json(headers) {
        return Err(GatewayError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            mcp::code::INVALID_REQUEST,
            "POST body must be sent with Content-Type: application/json",
        ));
    }
    Ok(era)
}

/// Checks the rest and builds the call. `body` is already bounded by the size limit.
pub fn parse_call(
    upstream: usize,
    era: Era,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
    auth: AuthContext,
) -> Result<Call, GatewayError> {
    let session_id = match (era, headers.get(mcp::HEADER_SESSION_ID)) {
        // 2026-07-28 has no sessions; a stray header means nothing.
        (Era::Modern, _) | (Era::Legacy, None) => None,
        (Era::Legacy, Some(raw)) => Some(mcp::validate_session_id(raw.as_bytes())?.to_owned()),
    };
    let message = if method == Method::POST {
        let message = mcp::parse_message(&body)?;
        if era == Era::Modern {
            mcp::check_modern_headers(headers, &message).map_err(|e| e.with_id(message.id()))?;
        }
        Some(message)
    } else {
        None
    };
    if era == Era::Legacy {
        check_legacy_session_rules(&method, headers, session_id.as_deref(), message.as_ref())?;
    }
    let mut forwarded = HeaderMap::new();
    for (name, value) in headers {
        if is_forwarded_header(name) {
            forwarded.append(name.clone(), value.clone());
        }
    }
    Ok(Call {
        method,
        path: path.to_owned(),
        upstream,
        era,
        session_id,
        headers: forwarded,
        body,
        message,
        auth,
        client: None,
    })
}

fn check_legacy_session_rules(
    method: &Method,
    headers: &HeaderMap,
    session_id: Option<&str>,
    message: Option<&Message>,
) -> Result<(), GatewayError> {
    let id = message.map(Message::id).unwrap_or(serde_json::Value::Null);
    let initialize = message.is_some_and(Message::is_initialize);
    match (session_id, initialize) {
        (Some(_), true) => Err(GatewayError::invalid_request(
            "initialize must not carry Mcp-Session-Id: it starts a new session",
        )
        .with_id(id)),
        (None, false) => Err(GatewayError::invalid_request(format!(
            "missing Mcp-Session-Id header: send initialize first, then the returned \
             Mcp-Session-Id with every {method} request"
        ))
        .with_id(id)),
        _ if *method == Method::GET && !accepts_event_stream(headers) => Err(GatewayError::new(
            StatusCode::NOT_ACCEPTABLE,
            mcp::code::INVALID_REQUEST,
            "GET opens an SSE stream: send Accept: text/event-stream",
        )),
        _ => Ok(()),
    }
}

fn method_not_allowed(method: &Method, advice: &str) -> GatewayError {
    GatewayError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        mcp::code::INVALID_REQUEST,
        format!("{method} is not allowed here: {advice}"),
    )
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

fn accepts_event_stream(headers: &HeaderMap) -> bool {
    headers.get_all(ACCEPT).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',').any(|media| {
                let media = media.split(';').next().unwrap_or("").trim();
                media.eq_ignore_ascii_case("text/event-stream") || media == "*/*"
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::UpstreamConfig;
    use http::HeaderValue;
    use mcpgw_wire::AuthMode;

    fn endpoints(names: &[&str]) -> Endpoints {
        let config = Config {
            upstreams: names
                .iter()
                .map(|n| UpstreamConfig::http(n, "http://127.0.0.1:1/mcp"))
                .collect(),
            ..Config::default()
        };
        Endpoints::new(&config)
    }

    fn public() -> AuthContext {
        AuthContext {
            mode: AuthMode::Public,
            subject: String::new(),
            scopes: Vec::new(),
            expires_at_ms: None,
            route: "demo".into(),
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(*k, HeaderValue::from_str(v).unwrap());
        }
        map
    }

    const JSON: (&str, &str) = ("content-type", "application/json");

    #[test]
    fn endpoints_resolve_names_and_the_single_upstream_shortcut() {
        let one = endpoints(&["demo"]);
        assert_eq!(one.resolve("/mcp"), Some(0));
        assert_eq!(one.resolve("/servers/demo/mcp"), Some(0));
        assert_eq!(one.resolve("/servers/other/mcp"), None);
        let two = endpoints(&["a", "b"]);
        assert_eq!(two.resolve("/mcp"), None);
        assert_eq!(two.resolve("/servers/b/mcp"), Some(1));
        assert!(two.not_found("/x").message.contains("a, b"));
    }

    #[test]
    fn the_not_found_of_a_gateway_with_an_authenticated_route_names_no_route() {
        let mut config = Config {
            upstreams: ["open", "secret-name"]
                .iter()
                .map(|n| UpstreamConfig::http(n, "http://127.0.0.1:1/mcp"))
                .collect(),
            ..Config::default()
        };
        config.auth = toml::from_str("[routes.secret-name]\nmode = \"api-key\"\n").unwrap();
        let message = Endpoints::new(&config).not_found("/x").message;
        assert!(!message.contains("open"), "{message}");
        assert!(!message.contains("secret-name"), "{message}");
        assert!(message.contains("/servers/{name}/mcp"), "{message}");
    }

    fn head_status(method: Method, path: &str, h: &[(&'static str, &str)]) -> Option<u16> {
        check_head(&endpoints(&["demo"]), &method, path, &headers(h))
            .err()
            .map(|e| e.status.as_u16())
    }

    #[test]
    fn head_checks_give_the_documented_statuses() {
        assert_eq!(head_status(Method::POST, "/nope", &[JSON]), Some(404));
        assert_eq!(head_status(Method::PUT, "/mcp", &[JSON]), Some(405));
        assert_eq!(
            head_status(
                Method::POST,
                "/mcp",
                &[JSON, ("mcp-protocol-version", "2030-01-01")]
            ),
            Some(400)
        );
        assert_eq!(
            head_status(Method::POST, "/mcp", &[("content-type", "text/plain")]),
            Some(415)
        );
        assert_eq!(head_status(Method::POST, "/mcp", &[]), Some(415));
        assert_eq!(
            head_status(
                Method::GET,
                "/mcp",
                &[("mcp-protocol-version", "2026-07-28")]
            ),
            Some(405)
        );
        assert_eq!(
            head_status(
                Method::DELETE,
                "/mcp",
                &[("mcp-protocol-version", "2026-07-28")]
            ),
            Some(405)
        );
        assert_eq!(
            head_status(
                Method::POST,
                "/mcp",
                &[("content-type", "application/json; charset=utf-8")]
            ),
            None
        );
    }

    fn call(
        method: Method,
        era: Era,
        h: &[(&'static str, &str)],
        body: &'static str,
    ) -> Result<Call, GatewayError> {
        parse_call(
            0,
            era,
            method,
            "/mcp",
            &headers(h),
            Bytes::from_static(body.as_bytes()),
            public(),
        )
    }

    const INIT: &str = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#;
    const LIST: &str = r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#;

    #[test]
    fn legacy_session_rules() {
        assert!(
            call(Method::POST, Era::Legacy, &[], INIT)
                .unwrap()
                .is_initialize()
        );
        let no_session = call(Method::POST, Era::Legacy, &[], LIST).unwrap_err();
        assert_eq!(
            (no_session.status.as_u16(), no_session.id.clone()),
            (400, 2.into())
        );
        let init_with_session = call(
            Method::POST,
            Era::Legacy,
            &[("mcp-session-id", "abc")],
            INIT,
        )
        .unwrap_err();
        assert_eq!(init_with_session.status.as_u16(), 400);
        let ok = call(
            Method::POST,
            Era::Legacy,
            &[("mcp-session-id", "abc")],
            LIST,
        )
        .unwrap();
        assert_eq!(ok.session_id.as_deref(), Some("abc"));
        assert_eq!(
            call(Method::GET, Era::Legacy, &[], "")
                .unwrap_err()
                .status
                .as_u16(),
            400
        );
        let get_without_accept =
            call(Method::GET, Era::Legacy, &[("mcp-session-id", "abc")], "").unwrap_err();
        assert_eq!(get_without_accept.status.as_u16(), 406);
        assert!(
            call(
                Method::GET,
                Era::Legacy,
                &[("mcp-session-id", "abc"), ("accept", "text/event-stream")],
                ""
            )
            .is_ok()
        );
    }

    #[test]
    fn forbidden_session_id_characters_are_rejected() {
        let mut h = HeaderMap::new();
        h.insert(
            mcp::HEADER_SESSION_ID,
            HeaderValue::from_bytes(b"bad\xffid").unwrap(),
        );
        let err = parse_call(
            0,
            Era::Legacy,
            Method::POST,
            "/mcp",
            &h,
            Bytes::from_static(LIST.as_bytes()),
            public(),
        )
        .unwrap_err();
        assert_eq!(err.status.as_u16(), 400);
        assert!(err.message.contains("Mcp-Session-Id"));
    }

    #[test]
    fn modern_calls_need_matching_headers_and_no_session() {
        let body = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo"}}"#;
        let good = call(
            Method::POST,
            Era::Modern,
            &[
                ("mcp-method", "tools/call"),
                ("mcp-name", "echo"),
                ("mcp-session-id", "ignored"),
            ],
            body,
        )
        .unwrap();
        assert_eq!(good.session_id, None);
        assert!(good.headers.contains_key("mcp-name"));
        let bad = call(
            Method::POST,
            Era::Modern,
            &[("mcp-method", "tools/call"), ("mcp-name", "other")],
            body,
        )
        .unwrap_err();
        assert_eq!(
            (bad.status.as_u16(), bad.code),
            (400, mcp::code::HEADER_MISMATCH)
        );
        assert_eq!(bad.id, serde_json::json!(3));
    }

    #[test]
    fn only_mcp_headers_are_passed_on() {
        let c = call(
            Method::POST,
            Era::Legacy,
            &[
                JSON,
                ("authorization", "Bearer secret"),
                ("cookie", "a=b"),
                ("mcp-param-region", "eu"),
                ("traceparent", "00-abc-def-01"),
            ],
            INIT,
        )
        .unwrap();
        assert!(!c.headers.contains_key("authorization"));
        assert!(!c.headers.contains_key("cookie"));
        assert!(c.headers.contains_key("mcp-param-region"));
        assert!(c.headers.contains_key("traceparent"));
        assert!(c.headers.contains_key("content-type"));
    }
}
