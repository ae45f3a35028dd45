//! OAuth 2.0 Protected Resource Metadata (RFC 9728), as the MCP authorization spec
//! (2025-06-18 and later) asks: each `jwt` route's document at
//! `/.well-known/oauth-protected-resource{route path}`, and `WWW-Authenticate`
//! challenges (RFC 6750) that point at it.

use http::header::HOST;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use crate::mcp::GatewayError;
use crate::reason::Reason;

/// The well-known prefix; the resource's path follows it.
pub const WELL_KNOWN: &str = "/.well-known/oauth-protected-resource";

/// The base URL clients reach the gateway at: the configured public URL, else
/// `http://` and the request's `Host` (when it is a plain `host[:port]`).
pub fn base_url(public_base: Option<&str>, request: &HeaderMap) -> Option<String> {
    if let Some(base) = public_base {
        return Some(base.to_owned());
    }
    let host = request.get(HOST)?.to_str().ok()?;
    let plain = !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'));
    plain.then(|| format!("http://{host}"))
}

/// Where the metadata of the resource at `resource_path` is served.
pub fn metadata_url(base: &str, resource_path: &str) -> String {
    format!("{base}{WELL_KNOWN}{resource_path}")
}

/// The metadata document of the resource at `base` + `resource_path`.
pub fn document(
    base: &str,
    resource_path: &str,
    route_name: &str,
    authorization_servers: &[String],
    scopes_supported: &[String],
) -> Value {
    let mut document = json!({
        "resource": format!("{base}{resource_path}"),
        "authorization_servers": authorization_servers,
        "bearer_methods_supported": ["header"],
        "resource_name": format!("mcpgw route {route_name}"),
    });
    if !scopes_supported.is_empty() {
        document["scopes_supported"] = json!(scopes_supported);
    }
    document
}

/// A `Bearer` challenge. `error` is an RFC 6750 code with a fixed description (never
/// token content); `scopes` are what the request needs.
pub fn challenge(error: Option<(&str, &str)>, scopes: &[String]) -> String {
    let mut text = String::from("Bearer realm=\"mcpgw\"");
    if let Some((code, description)) = error {
        text.push_str(&format!(
            ", error=\"{code}\", error_description=\"{description}\""
        ));
    }
    if !scopes.is_empty() {
        text.push_str(&format!(", scope=\"{}\"", scopes.join(" ")));
    }
    text
}

/// Adds `resource_metadata` to a gateway challenge that lacks it. The edge does this
/// for every answer, local or relayed from the owner: only the edge knows the URL the
/// client used.
pub fn with_resource_metadata(challenge: &str, url: &str) -> Option<String> {
    (challenge.starts_with("Bearer ") && !challenge.contains("resource_metadata="))
        .then(|| format!("{challenge}, resource_metadata=\"{url}\""))
}

/// Whether `scope` can appear in a challenge (RFC 6749 scope-token: printable ASCII
/// without space, `"` and `\`).
pub fn valid_scope(scope: &str) -> bool {
    !scope.is_empty()
        && scope
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\')
}

/// The `WWW-Authenticate` challenge (RFC 6750) an error answer carries: every 401 has
/// one (with `error="invalid_token"` when a credential was refused, without an error
/// code when none was sent), and a 403 for missing scopes has `insufficient_scope`.
/// It says nothing the error body does not, and never anything of the token.
pub fn challenge_of(error: &GatewayError) -> Option<String> {
    let data = error.data.as_ref();
    let field = |name: &str| data.and_then(|d| d.get(name));
    let reason = error.reason;
    let scopes: Vec<String> = field("required_scopes")
        .and_then(|s| s.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|s| s.as_str())
                .filter(|s| valid_scope(s))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    match (error.status, reason) {
        (StatusCode::UNAUTHORIZED, Some(Reason::InvalidToken)) => {
            let problem = field("problem").and_then(|p| p.as_str()).unwrap_or("");
            Some(challenge(
                Some(("invalid_token", super::jwt::describe(problem))),
                &scopes,
            ))
        }
        (StatusCode::UNAUTHORIZED, _) => Some(challenge(None, &scopes)),
        (StatusCode::FORBIDDEN, Some(Reason::InsufficientScope)) => Some(challenge(
            Some((
                "insufficient_scope",
                "The token lacks a scope this request needs",
            )),
            &scopes,
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn the_base_comes_from_configuration_or_a_plain_host() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            base_url(Some("https://mcp.example.com"), &headers).as_deref(),
            Some("https://mcp.example.com")
        );
        assert_eq!(base_url(None, &headers), None);
        headers.insert(HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert_eq!(
            base_url(None, &headers).as_deref(),
            Some("http://127.0.0.1:8080")
        );
        headers.insert(HOST, HeaderValue::from_static("evil\"host"));
        assert_eq!(base_url(None, &headers), None);
    }

    #[test]
    fn challenges_follow_rfc_6750_and_gain_the_metadata_url_once() {
        assert_eq!(challenge(None, &[]), "Bearer realm=\"mcpgw\"");
        let scoped = challenge(
            Some(("insufficient_scope", "More scope needed")),
            &["a".into(), "b".into()],
        );
        assert_eq!(
            scoped,
            "Bearer realm=\"mcpgw\", error=\"insufficient_scope\", error_description=\"More scope needed\", scope=\"a b\""
        );
        let url = metadata_url("http://h", "/servers/demo/mcp");
        assert_eq!(
            url,
            "http://h/.well-known/oauth-protected-resource/servers/demo/mcp"
        );
        let full = with_resource_metadata(&scoped, &url).unwrap();
        assert!(full.ends_with(&format!(", resource_metadata=\"{url}\"")));
        assert_eq!(with_resource_metadata(&full, &url), None);
        assert!(valid_scope("mcp:tools.read") && !valid_scope("a b") && !valid_scope("q\""));
    }
}
