//! Edge authentication: the receiving worker decides who the client is, once, and
//! the resulting auth context travels with a forwarded request (docs/architecture.md, invariant 4).
//!
//! Two modes exist so far: public (no credentials; a session belongs to whoever holds
//! its id) and static API keys (bearer tokens listed in a file). JWT/JWKS and OAuth
//! come later.

use std::path::Path;

use http::header::AUTHORIZATION;
use http::{HeaderMap, StatusCode};
use mcpgw_wire::{AuthContext, AuthScheme};

use crate::mcp::{self, GatewayError};

/// How the edge authenticates clients.
#[derive(Debug, Clone, Default)]
pub struct Authenticator {
    /// (principal, token) pairs; empty means public mode.
    keys: Vec<(String, Vec<u8>)>,
}

impl Authenticator {
    /// Reads `principal:token` lines (blank lines and `#` comments skipped). Errors
    /// name the line, never the token.
    pub fn from_file(path: &Path) -> Result<Authenticator, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((principal, token)) = line.split_once(':') else {
                return Err(format!(
                    "{} line {}: expected principal:token",
                    path.display(),
                    n + 1
                ));
            };
            let (principal, token) = (principal.trim(), token.trim());
            if principal.is_empty() || token.len() < 16 {
                return Err(format!(
                    "{} line {}: needs a principal and a token of at least 16 characters",
                    path.display(),
                    n + 1
                ));
            }
            keys.push((principal.to_owned(), token.as_bytes().to_vec()));
        }
        if keys.is_empty() {
            return Err(format!("{} lists no tokens", path.display()));
        }
        Ok(Authenticator { keys })
    }

    /// The caller's auth context, or 401.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<AuthContext, GatewayError> {
        if self.keys.is_empty() {
            return Ok(AuthContext {
                scheme: AuthScheme::Public,
                principal: String::new(),
                scopes: Vec::new(),
                claims_json: None,
            });
        }
        let presented = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        let Some(presented) = presented else {
            return Err(unauthorized(
                "missing bearer token: send Authorization: Bearer <token>",
            ));
        };
        // Every key is compared in full, so timing does not reveal which one (or how
        // much of one) matched.
        let mut found: Option<&str> = None;
        for (principal, token) in &self.keys {
            if constant_time_eq(token, presented.as_bytes()) {
                found = Some(principal);
            }
        }
        match found {
            Some(principal) => Ok(AuthContext {
                scheme: AuthScheme::ApiKey,
                principal: principal.to_owned(),
                scopes: Vec::new(),
                claims_json: None,
            }),
            None => Err(unauthorized(
                "invalid bearer token: check the token you were issued",
            )),
        }
    }
}

fn unauthorized(message: &str) -> GatewayError {
    GatewayError::new(StatusCode::UNAUTHORIZED, mcp::code::GATEWAY_ERROR, message)
        .with_data(serde_json::json!({ "reason": "unauthorized" }))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        h
    }

    #[test]
    fn public_mode_has_an_anonymous_principal() {
        let auth = Authenticator::default()
            .authenticate(&HeaderMap::new())
            .unwrap();
        assert_eq!(auth.scheme, AuthScheme::Public);
    }

    #[test]
    fn api_keys_map_to_principals_and_refuse_the_rest() {
        let dir = std::env::temp_dir().join(format!("mcpgw-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokens");
        std::fs::write(
            &file,
            "# keys\nalice: aaaaaaaaaaaaaaaaaaaa\nbob:bbbbbbbbbbbbbbbbbbbb\n",
        )
        .unwrap();
        let auth = Authenticator::from_file(&file).unwrap();
        assert_eq!(
            auth.authenticate(&with_bearer("aaaaaaaaaaaaaaaaaaaa"))
                .unwrap()
                .principal,
            "alice"
        );
        assert_eq!(
            auth.authenticate(&with_bearer("bbbbbbbbbbbbbbbbbbbb"))
                .unwrap()
                .principal,
            "bob"
        );
        let wrong = auth
            .authenticate(&with_bearer("aaaaaaaaaaaaaaaaaaab"))
            .unwrap_err();
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
        assert!(!wrong.message.contains("aaaa"), "never echo tokens");
        assert!(auth.authenticate(&HeaderMap::new()).is_err());
        std::fs::write(&file, "alice:short\n").unwrap();
        let err = Authenticator::from_file(&file).unwrap_err();
        assert!(err.contains("line 1") && !err.contains("short"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
