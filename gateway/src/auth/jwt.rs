//! JWT access tokens: signature (the key pins the algorithm; `none` and algorithm
//! confusion are refused), issuer, audience, expiry and not-before with a small leeway,
//! and the subject and scopes the token grants. Verification uses the `jsonwebtoken`
//! crate on aws-lc-rs (the workspace's one crypto library); expiry and not-before are
//! checked here, with the same arithmetic the owner uses again later
//! ([`mcpgw_wire::AuthContext::honoured_at`]).

use std::str::FromStr;
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use serde_json::{Map, Value};
use tracing::warn;

use super::jwks::{Jwks, KeySet, KeysUnavailable, VerifyingKey};

/// Longest token accepted; real access tokens are a few KiB.
const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Longest `sub` accepted: it keys sessions and rate-limit buckets.
const MAX_SUBJECT_BYTES: usize = 256;

/// What a valid token establishes.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedToken {
    pub subject: String,
    pub scopes: Vec<String>,
    /// Unix milliseconds from which the token is no longer honoured (`exp` + leeway).
    pub expires_at_ms: u64,
}

/// Why a token was refused. None of these carries token content.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenProblem {
    /// Not three base64url parts with JSON header and claims.
    Malformed(&'static str),
    /// `alg: none`, or an algorithm this gateway does not verify.
    AlgorithmRefused {
        none: bool,
    },
    /// The token's algorithm is not its key's (e.g. HS256 with an RSA public key).
    AlgorithmMismatch {
        token: Algorithm,
        keys: Vec<Algorithm>,
    },
    /// No key matches the token's `kid` (after at most one refetch per interval).
    UnknownKey,
    BadSignature,
    WrongIssuer,
    WrongAudience,
    Expired {
        seconds_ago: u64,
    },
    NotYetValid {
        seconds_left: u64,
    },
    MissingClaim(String),
    /// The JWKS could not be loaded and no other key of the route fits: nothing can
    /// be verified right now.
    KeysUnavailable,
}

impl TokenProblem {
    /// The `data.problem` of the error body.
    pub fn code(&self) -> &'static str {
        match self {
            TokenProblem::Malformed(_) => "malformed",
            TokenProblem::AlgorithmRefused { .. } => "algorithm_refused",
            TokenProblem::AlgorithmMismatch { .. } => "algorithm_mismatch",
            TokenProblem::UnknownKey => "unknown_key",
            TokenProblem::BadSignature => "bad_signature",
            TokenProblem::WrongIssuer => "wrong_issuer",
            TokenProblem::WrongAudience => "wrong_audience",
            TokenProblem::Expired { .. } => "expired",
            TokenProblem::NotYetValid { .. } => "not_yet_valid",
            TokenProblem::MissingClaim(_) => "missing_claim",
            TokenProblem::KeysUnavailable => "keys_unavailable",
        }
    }

    /// The error message: what was wrong and what to do. It never says where the
    /// keys come from (a file path, an internal URL): that is [`Self::log_detail`].
    pub fn message(&self, verifier: &JwtVerifier) -> String {
        match self {
            TokenProblem::Malformed(what) => {
                format!("invalid bearer token: {what}; send a JWT access token")
            }
            TokenProblem::AlgorithmRefused { none: true } => {
                "invalid bearer token: alg \"none\" is refused, tokens must be signed".into()
            }
            TokenProblem::AlgorithmRefused { none: false } => {
                "invalid bearer token: its alg is not one this gateway verifies".into()
            }
            TokenProblem::AlgorithmMismatch { token, keys } => format!(
                "invalid bearer token: signed with {token:?}, but its key verifies only {}; \
                 refused (a key never verifies another algorithm)",
                keys.iter()
                    .map(|a| format!("{a:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            TokenProblem::UnknownKey => format!(
                "invalid bearer token: no key this route trusts matches its kid (or, \
                 without a kid, its alg); get a token from the issuer {}",
                verifier.issuer
            ),
            TokenProblem::BadSignature => {
                "invalid bearer token: the signature does not verify".into()
            }
            TokenProblem::WrongIssuer => format!(
                "invalid bearer token: its issuer is not {}; get a token from that issuer",
                verifier.issuer
            ),
            TokenProblem::WrongAudience => format!(
                "invalid bearer token: its audience is not this resource ({}); request a \
                 token for it",
                verifier.audience.join(", ")
            ),
            TokenProblem::Expired { seconds_ago } => {
                format!("invalid bearer token: it expired {seconds_ago} s ago; get a new token")
            }
            TokenProblem::NotYetValid { seconds_left } => format!(
                "invalid bearer token: it is not valid for another {seconds_left} s (nbf); \
                 check the clocks of the issuer and the client"
            ),
            TokenProblem::MissingClaim(claim) => {
                format!("invalid bearer token: it has no {claim} claim")
            }
            TokenProblem::KeysUnavailable => "cannot verify bearer tokens right now: the \
                 signing keys could not be loaded; retry shortly"
                .into(),
        }
    }

    /// What the request's log line says beyond the message: where the route's keys
    /// come from, for the problems an operator fixes there.
    pub fn log_detail(&self, verifier: &JwtVerifier) -> Option<String> {
        match self {
            TokenProblem::UnknownKey | TokenProblem::KeysUnavailable => {
                Some(format!("keys of the route: {}", verifier.key_source()))
            }
            _ => None,
        }
    }
}

/// A short fixed text for `error_description` in `WWW-Authenticate`, by
/// [`TokenProblem::code`] (no quotes, nothing of the token).
pub fn describe(problem_code: &str) -> &'static str {
    match problem_code {
        "malformed" => "The access token is not a well-formed JWT",
        "algorithm_refused" => "The token algorithm is refused",
        "algorithm_mismatch" => "The token algorithm does not match its key",
        "unknown_key" => "The token signing key is unknown",
        "bad_signature" => "The token signature is invalid",
        "wrong_issuer" => "The token issuer is not accepted",
        "wrong_audience" => "The token audience is not this resource",
        "expired" => "The access token expired",
        "not_yet_valid" => "The access token is not valid yet",
        "missing_claim" => "The access token lacks a required claim",
        _ => "The access token is not valid",
    }
}

/// Verifies the tokens of one route.
pub struct JwtVerifier {
    pub issuer: String,
    pub audience: Vec<String>,
    pub leeway_secs: u64,
    /// Keys from the configuration: the route's own, or `[auth.jwt]`'s when the route
    /// uses that issuer's keys (never another issuer's).
    pub static_keys: Arc<KeySet>,
    /// Keys from a JWKS, shared by every route that names the same one.
    pub jwks: Option<Arc<Jwks>>,
}

/// The part of a JWT header read before verification.
#[derive(serde::Deserialize)]
struct Header {
    alg: Option<String>,
    kid: Option<String>,
    crit: Option<Value>,
}

/// Which keys may verify a token.
enum Selection<'a> {
    Keys(Vec<&'a VerifyingKey>),
    /// Keys exist for its `kid` (or, without a `kid`, at all), none for its algorithm.
    WrongAlgorithm(Vec<Algorithm>),
    NoKey,
}

impl JwtVerifier {
    /// Where the keys come from, for the log only.
    fn key_source(&self) -> String {
        let configured = format!("{} configured key(s)", self.static_keys.len());
        match &self.jwks {
            Some(jwks) if self.static_keys.keys.is_empty() => format!("JWKS {}", jwks.describe()),
            Some(jwks) => format!("JWKS {} and {configured}", jwks.describe()),
            None => configured,
        }
    }

    /// Verifies `token` at `now_ms` (Unix milliseconds).
    pub async fn verify(&self, token: &str, now_ms: u64) -> Result<VerifiedToken, TokenProblem> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(TokenProblem::Malformed("it is longer than 16 KiB"));
        }
        let header = read_header(token)?;
        let alg = match header.alg.as_deref() {
            None => return Err(TokenProblem::Malformed("its header has no alg")),
            Some(alg) if alg.eq_ignore_ascii_case("none") => {
                return Err(TokenProblem::AlgorithmRefused { none: true });
            }
            Some(alg) => Algorithm::from_str(alg)
                .map_err(|_| TokenProblem::AlgorithmRefused { none: false })?,
        };
        if header.crit.is_some() {
            return Err(TokenProblem::Malformed(
                "its header names critical extensions (crit) this gateway does not support",
            ));
        }
        let kid = header.kid.as_deref();
        // A JWKS that cannot be loaded refuses only tokens no configured key serves.
        let (mut jwks_keys, mut unavailable) = (None, false);
        if let Some(jwks) = &self.jwks {
            match jwks.keys().await {
                Ok(keys) => jwks_keys = Some(keys),
                Err(KeysUnavailable) => unavailable = true,
            }
        }
        let mut selection = self.select(jwks_keys.as_deref(), kid, alg);
        if unavailable && matches!(selection, Selection::NoKey) {
            return Err(TokenProblem::KeysUnavailable);
        }
        if matches!(selection, Selection::NoKey)
            && let Some(jwks) = &self.jwks
            && let Some(fresh) = jwks.refresh_for_unknown(kid).await
        {
            jwks_keys = Some(fresh);
            selection = self.select(jwks_keys.as_deref(), kid, alg);
        }
        let keys = match selection {
            Selection::Keys(keys) => keys,
            Selection::WrongAlgorithm(keys) => {
                return Err(TokenProblem::AlgorithmMismatch { token: alg, keys });
            }
            Selection::NoKey => return Err(TokenProblem::UnknownKey),
        };
        let mut last = TokenProblem::BadSignature;
        for key in keys {
            match self.check_signature_and_claims(token, key) {
                Ok(claims) => return self.grant(&claims, now_ms),
                // Another key with the same kid/alg may still verify it (rotation).
                Err(TokenProblem::BadSignature) => last = TokenProblem::BadSignature,
                Err(problem) => return Err(problem),
            }
        }
        Err(last)
    }

    fn select<'a>(
        &'a self,
        jwks: Option<&'a KeySet>,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Selection<'a> {
        let all = self
            .static_keys
            .keys
            .iter()
            .chain(jwks.into_iter().flat_map(|set| set.keys.iter()));
        let named: Vec<&VerifyingKey> = match kid {
            Some(kid) => all.filter(|k| k.kid.as_deref() == Some(kid)).collect(),
            None => all.collect(),
        };
        if named.is_empty() {
            return Selection::NoKey;
        }
        let fitting: Vec<&VerifyingKey> = named.iter().copied().filter(|k| k.alg == alg).collect();
        if fitting.is_empty() {
            let mut algs: Vec<Algorithm> = named.iter().map(|k| k.alg).collect();
            algs.dedup();
            return Selection::WrongAlgorithm(algs);
        }
        Selection::Keys(fitting)
    }

    /// Signature, issuer and audience through `jsonwebtoken`, with the key's algorithm
    /// as the only one allowed.
    fn check_signature_and_claims(
        &self,
        token: &str,
        key: &VerifyingKey,
    ) -> Result<Map<String, Value>, TokenProblem> {
        let mut validation = Validation::new(key.alg);
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.leeway = 0;
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&self.audience);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        match jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &validation) {
            Ok(data) => Ok(data.claims),
            Err(e) => Err(match e.kind() {
                ErrorKind::InvalidSignature => TokenProblem::BadSignature,
                ErrorKind::InvalidIssuer => TokenProblem::WrongIssuer,
                ErrorKind::InvalidAudience => TokenProblem::WrongAudience,
                ErrorKind::MissingRequiredClaim(claim) => TokenProblem::MissingClaim(claim.clone()),
                ErrorKind::InvalidAlgorithm => TokenProblem::AlgorithmMismatch {
                    token: key.alg,
                    keys: vec![key.alg],
                },
                ErrorKind::InvalidClaimFormat(_) => {
                    TokenProblem::Malformed("a registered claim has the wrong type")
                }
                ErrorKind::Base64(_)
                | ErrorKind::Json(_)
                | ErrorKind::Utf8(_)
                | ErrorKind::InvalidToken => {
                    TokenProblem::Malformed("its parts are not base64url-encoded JSON")
                }
                other => {
                    // A key that cannot verify at all is a configuration problem: say so
                    // in the log; the client only learns that the signature failed.
                    warn!(kid = ?key.kid, alg = ?key.alg, problem = ?other, "a configured key could not verify a token");
                    TokenProblem::BadSignature
                }
            }),
        }
    }

    /// Expiry, not-before, subject and scopes of verified claims.
    fn grant(
        &self,
        claims: &Map<String, Value>,
        now_ms: u64,
    ) -> Result<VerifiedToken, TokenProblem> {
        let exp = numeric_date(claims, "exp")?.ok_or(TokenProblem::MissingClaim("exp".into()))?;
        let leeway_ms = self.leeway_secs.saturating_mul(1000);
        let expires_at_ms = exp.saturating_mul(1000).saturating_add(leeway_ms);
        if now_ms >= expires_at_ms {
            return Err(TokenProblem::Expired {
                seconds_ago: now_ms.saturating_sub(exp.saturating_mul(1000)) / 1000,
            });
        }
        if let Some(nbf) = numeric_date(claims, "nbf")? {
            let valid_from_ms = nbf.saturating_mul(1000).saturating_sub(leeway_ms);
            if now_ms < valid_from_ms {
                return Err(TokenProblem::NotYetValid {
                    seconds_left: (valid_from_ms - now_ms).div_ceil(1000),
                });
            }
        }
        let subject = match claims.get("sub") {
            Some(Value::String(sub)) if !sub.is_empty() && sub.len() <= MAX_SUBJECT_BYTES => {
                sub.clone()
            }
            Some(Value::String(_)) => {
                return Err(TokenProblem::Malformed(
                    "its sub is empty or longer than 256 bytes",
                ));
            }
            _ => return Err(TokenProblem::MissingClaim("sub".into())),
        };
        Ok(VerifiedToken {
            subject,
            scopes: scopes_of(claims),
            expires_at_ms,
        })
    }
}

fn read_header(token: &str) -> Result<Header, TokenProblem> {
    let mut parts = token.split('.');
    let (Some(header), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenProblem::Malformed(
            "it does not have three dot-separated parts",
        ));
    };
    let bytes = URL_SAFE_NO_PAD
        .decode(header)
        .map_err(|_| TokenProblem::Malformed("its header is not base64url"))?;
    serde_json::from_slice(&bytes)
        .map_err(|_| TokenProblem::Malformed("its header is not a JSON object"))
}

/// A NumericDate claim as whole seconds (fractions are allowed by RFC 7519).
fn numeric_date(
    claims: &Map<String, Value>,
    name: &'static str,
) -> Result<Option<u64>, TokenProblem> {
    match claims.get(name) {
        None => Ok(None),
        Some(Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
            (Some(secs), _) => Ok(Some(secs)),
            (None, Some(secs)) if (0.0..1e15).contains(&secs) => Ok(Some(secs as u64)),
            _ => Err(TokenProblem::Malformed(
                "a date claim is not a positive number",
            )),
        },
        Some(_) => Err(TokenProblem::Malformed("a date claim is not a number")),
    }
}

/// Scopes from `scope` (space-separated, RFC 8693/9068) and `scp` (a list or a string,
/// as some issuers send).
fn scopes_of(claims: &Map<String, Value>) -> Vec<String> {
    let mut scopes: Vec<String> = Vec::new();
    let mut add = |value: &Value| match value {
        Value::String(text) => scopes.extend(text.split_whitespace().map(str::to_owned)),
        Value::Array(items) => scopes.extend(
            items
                .iter()
                .filter_map(Value::as_str)
                .flat_map(str::split_whitespace)
                .map(str::to_owned),
        ),
        _ => {}
    };
    for claim in ["scope", "scp"] {
        if let Some(value) = claims.get(claim) {
            add(value);
        }
    }
    scopes.sort_unstable();
    scopes.dedup();
    scopes
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{DecodingKey, EncodingKey, Header as JwtHeader, encode};
    use serde_json::json;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const NOW_MS: u64 = 1_800_000_000_000;

    fn verifier(leeway_secs: u64) -> JwtVerifier {
        JwtVerifier {
            issuer: "https://idp".into(),
            audience: vec!["https://mcp/servers/demo/mcp".into()],
            leeway_secs,
            static_keys: Arc::new(KeySet {
                keys: vec![VerifyingKey {
                    kid: Some("hs".into()),
                    alg: Algorithm::HS256,
                    key: DecodingKey::from_secret(SECRET).unwrap(),
                }],
            }),
            jwks: None,
        }
    }

    fn token(claims: Value, kid: Option<&str>, alg: Algorithm) -> String {
        let mut header = JwtHeader::new(alg);
        header.kid = kid.map(str::to_owned);
        encode(&header, &claims, &EncodingKey::from_secret(SECRET).unwrap()).unwrap()
    }

    fn claims() -> Value {
        json!({"iss": "https://idp", "aud": "https://mcp/servers/demo/mcp", "sub": "alice",
               "exp": NOW_MS / 1000 + 60, "scope": "read write", "scp": ["admin"]})
    }

    fn check(claims: Value) -> Result<VerifiedToken, TokenProblem> {
        let token = token(claims, Some("hs"), Algorithm::HS256);
        futures_util::FutureExt::now_or_never(verifier(5).verify(&token, NOW_MS)).unwrap()
    }

    #[test]
    fn a_valid_token_grants_subject_scopes_and_a_deadline() {
        let granted = check(claims()).unwrap();
        assert_eq!(granted.subject, "alice");
        assert_eq!(granted.scopes, ["admin", "read", "write"]);
        assert_eq!(granted.expires_at_ms, NOW_MS + 65_000);
    }

    #[test]
    fn each_claim_problem_is_named() {
        let with = |key: &str, value: Value| {
            let mut c = claims();
            c[key] = value;
            check(c).unwrap_err()
        };
        assert_eq!(
            with("iss", json!("https://evil")),
            TokenProblem::WrongIssuer
        );
        assert_eq!(with("aud", json!(["other"])), TokenProblem::WrongAudience);
        assert_eq!(
            with("exp", json!(NOW_MS / 1000 - 6)),
            TokenProblem::Expired { seconds_ago: 6 }
        );
        assert!(
            check({
                let mut c = claims();
                c["exp"] = json!(NOW_MS / 1000 - 4);
                c
            })
            .is_ok(),
            "within the leeway"
        );
        assert_eq!(
            with("nbf", json!(NOW_MS / 1000 + 10)),
            TokenProblem::NotYetValid { seconds_left: 5 }
        );
        let mut no_sub = claims();
        no_sub.as_object_mut().unwrap().remove("sub");
        assert_eq!(
            check(no_sub).unwrap_err(),
            TokenProblem::MissingClaim("sub".into())
        );
    }

    #[test]
    fn none_unknown_and_mismatched_algorithms_are_refused() {
        let v = verifier(0);
        let run =
            |token: &str| futures_util::FutureExt::now_or_never(v.verify(token, NOW_MS)).unwrap();
        let b64 = |v: Value| URL_SAFE_NO_PAD.encode(v.to_string());
        let none = format!("{}.{}.", b64(json!({"alg": "none"})), b64(claims()));
        assert_eq!(
            run(&none).unwrap_err(),
            TokenProblem::AlgorithmRefused { none: true }
        );
        let weird = format!("{}.{}.sig", b64(json!({"alg": "XS999"})), b64(claims()));
        assert_eq!(
            run(&weird).unwrap_err(),
            TokenProblem::AlgorithmRefused { none: false }
        );
        let hs384 = token(claims(), Some("hs"), Algorithm::HS384);
        assert!(matches!(
            run(&hs384).unwrap_err(),
            TokenProblem::AlgorithmMismatch { .. }
        ));
        let unknown = token(claims(), Some("nope"), Algorithm::HS256);
        assert_eq!(run(&unknown).unwrap_err(), TokenProblem::UnknownKey);
        let mut tampered = token(claims(), Some("hs"), Algorithm::HS256).into_bytes();
        let at = tampered.len() - 10;
        tampered[at] = if tampered[at] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).unwrap();
        assert_eq!(run(&tampered).unwrap_err(), TokenProblem::BadSignature);
        assert!(matches!(
            run("abc").unwrap_err(),
            TokenProblem::Malformed(_)
        ));
    }
}
