//! Edge authentication: the receiving worker decides who the client is, once, and
//! the resulting auth context travels with a forwarded request (docs/architecture.md,
//! invariant 4). The owner never sees the credential; it checks only what the context
//! says: the route and mode match its own configuration, the credential has not
//! expired meanwhile ([`Authenticator::check_forwarded`]), and the subject is the
//! session's creator (in [`crate::execute`]).
//!
//! Each route (`/servers/{name}/mcp`) has a mode: `public`, `api-key`
//! ([`api_key`]), or `jwt` ([`jwt`], keys from the configuration or a JWKS,
//! [`jwks`]). Routes in `jwt` mode publish OAuth protected resource metadata and
//! point to it from their challenges ([`metadata`]), and may require scopes, per route
//! and per tool. An optional per-principal rate limit ([`rate_limit`]) is counted
//! here, once per client request. Tokens appear in no log line, error body or label.

pub mod api_key;
pub mod config;
pub mod jwks;
pub mod jwt;
pub mod metadata;
pub mod rate_limit;

use crate::reason::Reason;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{AUTHORIZATION, CACHE_CONTROL, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use mcpgw_wire::{AuthContext, AuthMode};
use serde_json::json;

use crate::config::error::invalid;
use crate::config::{Config, ConfigError};
use crate::mcp::{self, GatewayError};
use crate::reply::Reply;
use crate::request::Call;
use api_key::ApiKeys;
use config::{Mode, ResolvedJwt, RouteSettings};
use jwks::{Jwks, JwksSource, KeySet, load_static_key};
use jwt::{JwtVerifier, TokenProblem};
use rate_limit::RateLimiter;

/// How the edge authenticates clients, route by route.
pub struct Authenticator {
    /// Indexed like `config.upstreams` (a route's index is its upstream's).
    routes: Vec<RoutePolicy>,
    /// The configured public base URL, without a trailing slash.
    public_base: Option<String>,
    /// The per-principal rate limit, when configured.
    limiter: Option<RateLimiter>,
}

/// A JWKS as configured: its path or URL, and the CA its URL is checked with.
type JwksId = (String, Option<PathBuf>);

/// What one route asks of its clients.
struct RoutePolicy {
    name: String,
    mode: Mode,
    api_keys: Option<Arc<ApiKeys>>,
    jwt: Option<JwtVerifier>,
    /// Scopes every request needs.
    scopes: Vec<String>,
    /// More scopes a `tools/call` of a tool needs.
    tool_scopes: BTreeMap<String, Vec<String>>,
    /// For the resource metadata.
    authorization_servers: Vec<String>,
}

impl Mode {
    fn wire(self) -> AuthMode {
        match self {
            Mode::Public => AuthMode::Public,
            Mode::ApiKey => AuthMode::ApiKey,
            Mode::Jwt => AuthMode::Jwt,
        }
    }
}

impl Authenticator {
    /// Builds every route's policy: reads the token file, the configured keys and JWKS
    /// files, so a bad one stops the start with its field named. JWKS URLs are fetched
    /// on first use.
    pub fn new(config: &Config) -> Result<Authenticator, ConfigError> {
        let auth = &config.auth;
        let names: Vec<&str> = config.upstreams.iter().map(|u| u.name.as_str()).collect();
        auth.validate_shape(&names, config.fleet.redis_url.as_deref())?;
        let mut policies = Policies::new(config)?;
        let routes = config
            .upstreams
            .iter()
            .map(|upstream| policies.route(&upstream.name))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Authenticator {
            routes,
            public_base: auth.public_base().map(str::to_owned),
            limiter: rate_limiter(config)?,
        })
    }

    /// Who the client of a request on `route` is, or why it may not ask (401; 503
    /// when the keys to decide cannot be loaded).
    pub async fn authenticate(
        &self,
        route: usize,
        headers: &HeaderMap,
    ) -> Result<AuthContext, GatewayError> {
        let policy = self.policy(route)?;
        let context =
            |subject: String, scopes: Vec<String>, expires_at_ms: Option<u64>| AuthContext {
                mode: policy.mode.wire(),
                subject,
                scopes,
                expires_at_ms,
                route: policy.name.clone(),
            };
        match (policy.mode, &policy.api_keys, &policy.jwt) {
            (Mode::ApiKey, Some(keys), _) => {
                let token = bearer(headers, policy)?;
                match keys.principal_of(token) {
                    Some(principal) => Ok(context(principal.to_owned(), Vec::new(), None)),
                    None => Err(unauthorized(
                        policy,
                        Reason::InvalidToken,
                        Some("unknown_key"),
                        "invalid bearer token: check the token you were issued".into(),
                    )),
                }
            }
            (Mode::Jwt, _, Some(verifier)) => {
                let token = bearer(headers, policy)?;
                match verifier.verify(token, now_ms()).await {
                    Ok(granted) => Ok(context(
                        granted.subject,
                        granted.scopes,
                        Some(granted.expires_at_ms),
                    )),
                    Err(problem) => {
                        let error = if problem == TokenProblem::KeysUnavailable {
                            GatewayError::gateway(
                                StatusCode::SERVICE_UNAVAILABLE,
                                Reason::KeysUnavailable,
                                problem.message(verifier),
                            )
                            .with_retry_after(1)
                        } else {
                            unauthorized(
                                policy,
                                Reason::InvalidToken,
                                Some(problem.code()),
                                problem.message(verifier),
                            )
                        };
                        Err(match problem.log_detail(verifier) {
                            Some(detail) => error.with_log_detail(detail),
                            None => error,
                        })
                    }
                }
            }
            (Mode::Public, _, _) => Ok(context(String::new(), Vec::new(), None)),
            // `new` gives every api-key route its keys and every jwt route its
            // verifier; a route without them is refused, never served as public.
            (mode, _, _) => Err(GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                Reason::NoRoutePolicy,
                format!(
                    "route {} is in {} mode without its keys",
                    policy.name,
                    mode.wire().name()
                ),
            )),
        }
    }

    /// Whether the authenticated `call` has the scopes its route and tool need (403
    /// with `insufficient_scope` otherwise). Decided at the edge only.
    pub fn authorize(&self, call: &Call) -> Result<(), GatewayError> {
        let policy = self.policy(call.upstream)?;
        if policy.mode != Mode::Jwt {
            return Ok(());
        }
        let mut needed: Vec<&String> = policy.scopes.iter().collect();
        if let Some(extra) = tool_name(call).and_then(|tool| policy.tool_scopes.get(tool)) {
            needed.extend(extra.iter().filter(|s| !policy.scopes.contains(s)));
        }
        let missing: Vec<&String> = needed
            .iter()
            .copied()
            .filter(|scope| !call.auth.scopes.contains(scope))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let needed: Vec<String> = needed.into_iter().cloned().collect();
        Err(GatewayError::new(
            StatusCode::FORBIDDEN,
            mcp::code::GATEWAY_ERROR,
            format!(
                "insufficient scope: this request needs {}, and the token lacks {}; request a \
                 token with these scopes",
                needed.join(" "),
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        )
        .with_reason(Reason::InsufficientScope)
        .with_data(json!({ "required_scopes": needed,
            "missing_scopes": missing,
        }))
        .with_id(call.id()))
    }

    /// Counts one client request against its principal's rate limit. Called by the
    /// receiving worker only, once per client request.
    pub async fn admit(&self, call: &Call) -> Result<(), GatewayError> {
        match (&self.limiter, self.principal(call)) {
            (Some(limiter), Some(principal)) => limiter
                .admit(&principal)
                .await
                .map_err(|e| e.with_id(call.id())),
            // Public requests have no principal and are not limited.
            _ => Ok(()),
        }
    }

    /// Requests the rate limiter could not count (Redis failed): let through, and
    /// refused; `None` without a rate limit.
    pub fn rate_limit_unavailable(&self) -> Option<(u64, u64)> {
        self.limiter.as_ref().map(RateLimiter::unavailable_counts)
    }

    /// Who the client of `call` is across routes: an API key's principal, or a JWT's
    /// subject within its issuer (two issuers may each have an "alice", and they are
    /// two people). `None` in public mode. Keys what is counted per principal over
    /// several routes: rate-limit buckets, session and process quotas. What belongs to
    /// one route (a session, a shared session, a catalog) is keyed by the subject
    /// alone, since every request of a route is verified by that route's one issuer
    /// (a virtual server calls a member route as the client only under the same
    /// policy: [`Authenticator::same_policy`]).
    pub fn principal(&self, call: &Call) -> Option<String> {
        let policy = self.routes.get(call.upstream)?;
        match (call.auth.mode, &policy.jwt) {
            (AuthMode::Public, _) => None,
            (AuthMode::ApiKey, _) => Some(format!("api-key:{}", call.auth.subject)),
            (AuthMode::Jwt, Some(verifier)) => {
                Some(format!("jwt:{:?}:{}", verifier.issuer, call.auth.subject))
            }
            // A jwt context on a route without a verifier: check_forwarded refuses
            // it; counted apart from every verified principal meanwhile.
            (AuthMode::Jwt, None) => Some(format!("jwt-unverified:{}", call.auth.subject)),
        }
    }

    /// What a new session counts against in the per-principal session quota: the
    /// [`Authenticator::principal`], or in public mode the client's address.
    pub fn quota_key(&self, call: &Call) -> String {
        match (self.principal(call), call.client) {
            (Some(principal), _) => format!("principal:{principal}"),
            (None, Some(addr)) => format!("addr:{addr}"),
            (None, None) => "public".to_owned(),
        }
    }

    /// Whether routes `a` and `b` authenticate clients by one policy: one mode, and
    /// for API keys or JWTs the same keys and, for JWTs, the same issuer. Only then
    /// is a subject authenticated on one a principal of the other; a mode alone is not
    /// enough (two jwt routes of different issuers each have their own "alice").
    pub fn same_policy(&self, a: usize, b: usize) -> bool {
        let (Some(a), Some(b)) = (self.routes.get(a), self.routes.get(b)) else {
            return false;
        };
        if a.mode != b.mode {
            return false;
        }
        let same_keys = match (&a.api_keys, &b.api_keys) {
            (Some(x), Some(y)) => Arc::ptr_eq(x, y),
            (None, None) => true,
            _ => false,
        };
        let same_issuer = match (&a.jwt, &b.jwt) {
            (Some(x), Some(y)) => {
                x.issuer == y.issuer
                    && Arc::ptr_eq(&x.static_keys, &y.static_keys)
                    && match (&x.jwks, &y.jwks) {
                        (Some(p), Some(q)) => Arc::ptr_eq(p, q),
                        (None, None) => true,
                        _ => false,
                    }
            }
            (None, None) => true,
            _ => false,
        };
        same_keys && same_issuer
    }

    /// The owner's check of a forwarded call's auth context: the edge authenticated it
    /// for this route in this route's mode, and the credential is still honoured now
    /// (so a token that expires mid-session stops working here at the same moment as
    /// at every edge).
    pub fn check_forwarded(&self, call: &Call) -> Result<(), GatewayError> {
        let policy = self.policy(call.upstream)?;
        let auth = &call.auth;
        if auth.route != policy.name || auth.mode != policy.mode.wire() {
            return Err(unauthorized(
                policy,
                Reason::AuthContextMismatch,
                None,
                format!(
                    "the receiving worker authenticated this request for route {:?} in mode {}, \
                     but route {:?} is in mode {} here: the fleet's configurations differ; retry \
                     once they agree",
                    auth.route,
                    auth.mode.name(),
                    policy.name,
                    policy.mode.wire().name()
                ),
            )
            .with_id(call.id()));
        }
        if !auth.honoured_at(now_ms()) {
            let problem = TokenProblem::Expired { seconds_ago: 0 };
            return Err(unauthorized(
                policy,
                Reason::InvalidToken,
                Some(problem.code()),
                "invalid bearer token: it expired; get a new token".into(),
            )
            .with_id(call.id()));
        }
        Ok(())
    }

    /// The base URL clients reach this gateway at, for metadata URLs.
    pub fn base_url(&self, request: &HeaderMap) -> Option<String> {
        metadata::base_url(self.public_base.as_deref(), request)
    }

    /// Points the challenge of a 401/403 on a `jwt` route at the route's resource
    /// metadata (RFC 9728 §5.1). Runs at the edge for every answer, so challenges made
    /// by the owner get the URL the client used too.
    pub fn complete_challenge(
        &self,
        route: Option<usize>,
        resource_path: &str,
        base: Option<&str>,
        status: StatusCode,
        headers: &mut HeaderMap,
    ) {
        if !matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return;
        }
        let (Some(policy), Some(base)) = (route.and_then(|r| self.routes.get(r)), base) else {
            return;
        };
        if policy.mode != Mode::Jwt {
            return;
        }
        let completed = headers
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                metadata::with_resource_metadata(v, &metadata::metadata_url(base, resource_path))
            })
            .and_then(|v| HeaderValue::from_str(&v).ok());
        if let Some(value) = completed {
            headers.insert(WWW_AUTHENTICATE, value);
        }
    }

    /// The protected resource metadata of the route at `resource_path` (the part of
    /// the request path after the well-known prefix).
    pub fn metadata(
        &self,
        method: &Method,
        route: Option<usize>,
        resource_path: &str,
        base: Option<&str>,
    ) -> Reply {
        let refuse = |status: StatusCode, message: String| {
            Reply::from_error(&GatewayError::new(
                status,
                mcp::code::METHOD_NOT_FOUND,
                message,
            ))
        };
        if *method != Method::GET {
            return refuse(
                StatusCode::METHOD_NOT_ALLOWED,
                "protected resource metadata is read with GET".into(),
            );
        }
        let Some(policy) = route.and_then(|r| self.routes.get(r)) else {
            return refuse(
                StatusCode::NOT_FOUND,
                format!(
                    "no protected resource at {:?}: metadata is served at \
                     {}/servers/{{name}}/mcp for routes in jwt mode",
                    resource_path.chars().take(128).collect::<String>(),
                    metadata::WELL_KNOWN
                ),
            );
        };
        if policy.mode != Mode::Jwt {
            return refuse(
                StatusCode::NOT_FOUND,
                format!(
                    "route {} is in {} mode, not OAuth: it has no protected resource metadata",
                    policy.name,
                    policy.mode.wire().name()
                ),
            );
        }
        let Some(base) = base else {
            return refuse(
                StatusCode::BAD_REQUEST,
                "cannot tell this gateway's public URL: send a Host header, or configure \
                 [auth] public_url"
                    .into(),
            );
        };
        let mut scopes: Vec<String> = policy
            .scopes
            .iter()
            .chain(policy.tool_scopes.values().flatten())
            .cloned()
            .collect();
        scopes.sort_unstable();
        scopes.dedup();
        let document = metadata::document(
            base,
            resource_path,
            &policy.name,
            &policy.authorization_servers,
            &scopes,
        );
        let mut reply = Reply::json(StatusCode::OK, Bytes::from(document.to_string()));
        reply.headers.insert(
            CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=300"),
        );
        reply
    }

    fn policy(&self, route: usize) -> Result<&RoutePolicy, GatewayError> {
        self.routes.get(route).ok_or_else(|| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                Reason::NoRoutePolicy,
                format!("route {route} has no auth policy"),
            )
        })
    }
}

/// Reads configured keys; a bad one stops the start with `{field}[i]` named.
fn load_keys(specs: &[config::StaticKey], field: &str) -> Result<KeySet, ConfigError> {
    Ok(KeySet {
        keys: specs
            .iter()
            .enumerate()
            .map(|(i, key)| load_static_key(key).map_err(|p| invalid(&format!("{field}[{i}]"), p)))
            .collect::<Result<_, _>>()?,
    })
}

/// The HMAC secrets of the configuration and the issuer each verifies for. An HMAC
/// secret signs as well as it verifies, so one configured for two issuers would let
/// whoever holds it for one mint tokens of the other: such a configuration is refused
/// at start (a warning could scroll by while the routes' separation is void).
#[derive(Default)]
struct SecretOwners {
    /// Issuer, the field naming the key, and the secret; dropped after the start.
    seen: Vec<(String, String, Vec<u8>)>,
}

impl SecretOwners {
    /// Notes the HMAC keys of `keys` as `issuer`'s, or refuses one another issuer has;
    /// `name` names a key by its index and kid. The error names both keys, never the
    /// secret.
    fn note(
        &mut self,
        issuer: &str,
        keys: &KeySet,
        name: impl Fn(usize, Option<&str>) -> String,
    ) -> Result<(), ConfigError> {
        for (i, kid, secret) in keys.hmac_secrets() {
            let field = name(i, kid);
            if let Some((other_issuer, other_field, _)) = self
                .seen
                .iter()
                .find(|(known, _, known_secret)| known != issuer && known_secret == secret)
            {
                return Err(invalid(
                    &field,
                    format!(
                        "its HMAC secret is also that of {other_field}, a key of the \
                         issuer {other_issuer:?}, while this key is for {issuer:?}: either \
                         issuer could sign the other's tokens; give each issuer its own \
                         secret"
                    ),
                ));
            }
            if !self
                .seen
                .iter()
                .any(|(known, known_field, _)| known == issuer && *known_field == field)
            {
                self.seen.push((issuer.to_owned(), field, secret.to_vec()));
            }
        }
        Ok(())
    }
}

/// The cache of one JWKS; a file is read now, so a bad one stops the start (its keys
/// as read are returned too), a URL is fetched on first use.
fn jwks_cache(
    text: &str,
    resolved: &config::ResolvedJwt,
    field: &str,
) -> Result<(Arc<Jwks>, Option<KeySet>), ConfigError> {
    let source =
        JwksSource::parse(text, resolved.jwks_ca.as_deref()).map_err(|p| invalid(field, p))?;
    let mut read = None;
    if let JwksSource::File(path) = &source {
        let bytes = std::fs::read(path)
            .map_err(|e| invalid(field, format!("cannot read {}: {e}", path.display())))?;
        let (set, skipped) = KeySet::parse_jwks(&bytes, true)
            .map_err(|p| invalid(field, format!("{}: {p}", path.display())))?;
        if set.keys.is_empty() {
            return Err(invalid(
                field,
                format!(
                    "{} holds no usable signing key ({skipped} skipped)",
                    path.display()
                ),
            ));
        }
        read = Some(set);
    }
    let cache = Jwks::new(
        source,
        resolved.jwks_refresh_interval,
        resolved.jwks_max_age,
    );
    Ok((cache, read))
}

/// The bearer token of a request, or the 401 that asks for one.
fn bearer<'a>(headers: &'a HeaderMap, policy: &RoutePolicy) -> Result<&'a str, GatewayError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        let message = if headers.contains_key(AUTHORIZATION) {
            "send exactly one Authorization header"
        } else {
            "missing bearer token: send Authorization: Bearer <token>"
        };
        return Err(unauthorized(
            policy,
            Reason::MissingToken,
            None,
            message.into(),
        ));
    };
    let token = value.to_str().ok().and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    match token {
        Some(token) if !token.is_empty() => Ok(token),
        _ => Err(unauthorized(
            policy,
            Reason::MissingToken,
            None,
            "the Authorization header holds no bearer token: send Authorization: Bearer <token>"
                .into(),
        )),
    }
}

/// A 401. Its data names the reason (and the scopes the route needs), from which
/// [`metadata::challenge_of`] makes the `WWW-Authenticate` header, at the edge or at an owner.
fn unauthorized(
    policy: &RoutePolicy,
    reason: Reason,
    problem: Option<&str>,
    message: String,
) -> GatewayError {
    let mut data = json!({});
    if let Some(problem) = problem {
        data["problem"] = json!(problem);
    }
    if !policy.scopes.is_empty() {
        data["required_scopes"] = json!(policy.scopes);
    }
    GatewayError::new(StatusCode::UNAUTHORIZED, mcp::code::GATEWAY_ERROR, message)
        .with_reason(reason)
        .with_data(data)
}

/// The tool a `tools/call` names.
fn tool_name(call: &Call) -> Option<&str> {
    call.message.as_ref()?.tool_name()
}

/// Unix time in milliseconds (the clock tokens' `exp` is measured on).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Builds each route's policy from the validated configuration, sharing what routes
/// share: the API keys, [auth.jwt]'s keys, and one cache per JWKS (and CA), so routes
/// naming the same one share its keys and its refresh budget.
struct Policies<'c> {
    config: &'c Config,
    api_keys: Option<Arc<ApiKeys>>,
    /// The keys of [auth.jwt]'s issuer: trusted only by routes that use that issuer
    /// and name no keys of their own.
    global_keys: Arc<KeySet>,
    /// A file's keys as read at start are kept for the check of HMAC secrets.
    caches: Vec<(JwksId, Arc<Jwks>, Option<KeySet>)>,
    secrets: SecretOwners,
}

impl<'c> Policies<'c> {
    fn new(config: &'c Config) -> Result<Policies<'c>, ConfigError> {
        let auth = &config.auth;
        let api_keys = match &auth.tokens_file {
            Some(path) => Some(Arc::new(
                ApiKeys::from_file(path).map_err(|problem| invalid("auth.tokens_file", problem))?,
            )),
            None => None,
        };
        Ok(Policies {
            config,
            api_keys,
            global_keys: Arc::new(load_keys(&auth.jwt.keys, "auth.jwt.keys")?),
            caches: Vec::new(),
            secrets: SecretOwners::default(),
        })
    }

    /// The policy of route `name`.
    fn route(&mut self, name: &str) -> Result<RoutePolicy, ConfigError> {
        let auth = &self.config.auth;
        let mode = auth.mode_of(name);
        let settings = auth.routes.get(name).cloned().unwrap_or_default();
        let mut policy = RoutePolicy {
            name: name.to_owned(),
            mode,
            api_keys: None,
            jwt: None,
            scopes: settings.scopes.clone(),
            tool_scopes: settings.tool_scopes.clone(),
            authorization_servers: Vec::new(),
        };
        check_scopes(&policy)?;
        match mode {
            Mode::Public => {}
            Mode::ApiKey => {
                policy.api_keys = Some(self.api_keys.clone().ok_or_else(|| {
                    invalid(
                        &format!("auth.routes.{name}.mode"),
                        "api-key mode needs the keys: set [auth] tokens_file or pass --auth-tokens-file",
                    )
                })?);
            }
            Mode::Jwt => {
                let (verifier, servers) = self.jwt_verifier(name, &settings)?;
                policy.authorization_servers = servers;
                policy.jwt = Some(verifier);
            }
        }
        Ok(policy)
    }

    /// The JWT verifier of route `name` in jwt mode, and its authorization servers.
    fn jwt_verifier(
        &mut self,
        name: &str,
        settings: &RouteSettings,
    ) -> Result<(JwtVerifier, Vec<String>), ConfigError> {
        let default_route = self.config.default_upstream().map(|u| u.name.as_str());
        let resolved = self.config.auth.jwt_of(name, default_route == Some(name))?;
        let (keys_field, jwks_field) = if resolved.own_keys {
            (
                format!("auth.routes.{name}.keys"),
                format!("auth.routes.{name}.jwks"),
            )
        } else {
            ("auth.jwt.keys".to_owned(), "auth.jwt.jwks".to_owned())
        };
        let static_keys = if resolved.own_keys {
            Arc::new(load_keys(&settings.keys, &keys_field)?)
        } else {
            Arc::clone(&self.global_keys)
        };
        self.secrets.note(&resolved.issuer, &static_keys, |i, _| {
            format!("{keys_field}[{i}]")
        })?;
        let jwks = match &resolved.jwks {
            None => None,
            Some(text) => Some(self.jwks_cache(text, &resolved, &jwks_field)?),
        };
        if jwks.is_none() && static_keys.keys.is_empty() {
            return Err(invalid(&jwks_field, no_keys(name, resolved.own_keys)));
        }
        let verifier = JwtVerifier {
            issuer: resolved.issuer,
            audience: resolved.audience,
            leeway_secs: resolved.leeway_secs,
            static_keys,
            jwks,
        };
        Ok((verifier, resolved.authorization_servers))
    }

    /// The one cache of the JWKS `text` (with the resolved CA), made on first use.
    fn jwks_cache(
        &mut self,
        text: &str,
        resolved: &ResolvedJwt,
        jwks_field: &str,
    ) -> Result<Arc<Jwks>, ConfigError> {
        let id = (text.to_owned(), resolved.jwks_ca.clone());
        let at = match self.caches.iter().position(|(known, _, _)| *known == id) {
            Some(at) => at,
            None => {
                let (cache, read) = jwks_cache(text, resolved, jwks_field)?;
                self.caches.push((id, cache, read));
                self.caches.len() - 1
            }
        };
        let (_, cache, read) = &self.caches[at];
        if let Some(read) = read {
            self.secrets.note(&resolved.issuer, read, |_, kid| {
                format!("{jwks_field} (kid {kid:?})")
            })?;
        }
        Ok(Arc::clone(cache))
    }
}

/// Every scope a route names must be a scope token.
fn check_scopes(policy: &RoutePolicy) -> Result<(), ConfigError> {
    let name = &policy.name;
    for scope in policy
        .scopes
        .iter()
        .chain(policy.tool_scopes.values().flatten())
    {
        if !metadata::valid_scope(scope) {
            return Err(invalid(
                &format!("auth.routes.{name}.scopes"),
                format!("{scope:?} is not a scope token (printable ASCII, no space, no quote)"),
            ));
        }
    }
    Ok(())
}

/// What to do about a route in jwt mode that trusts no key.
fn no_keys(name: &str, own_keys: bool) -> String {
    if own_keys {
        format!(
            "route {name} sets its own issuer, jwks or keys, so it trusts only the keys named \
             in [auth.routes.{name}] (those of [auth.jwt] belong to its issuer): set jwks there \
             (a file or an https:// URL) or add [[auth.routes.{name}.keys]]"
        )
    } else {
        format!(
            "route {name} is in jwt mode but has no keys: set jwks (a file or an https:// URL; \
             --jwt-jwks) or [[auth.jwt.keys]]"
        )
    }
}

/// The per-principal rate limiter, on its own Redis or the fleet's.
fn rate_limiter(config: &Config) -> Result<Option<RateLimiter>, ConfigError> {
    let Some(limit) = &config.auth.rate_limit else {
        return Ok(None);
    };
    let url = limit
        .redis_url
        .as_deref()
        .or(config.fleet.redis_url.as_deref())
        .unwrap_or_default();
    RateLimiter::new(limit, url, &config.fleet.key_prefix)
        .map(Some)
        .map_err(|p| invalid("auth.rate_limit.redis_url", p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::UpstreamConfig;

    fn config(auth: &str, names: &[&str]) -> Config {
        Config {
            upstreams: names
                .iter()
                .map(|n| UpstreamConfig::http(n, "http://127.0.0.1:1/mcp"))
                .collect(),
            auth: toml::from_str(auth).unwrap(),
            ..Config::default()
        }
    }

    fn run<T>(future: impl std::future::Future<Output = T>) -> T {
        futures_util::FutureExt::now_or_never(future).expect("no I/O on this path")
    }

    #[test]
    fn public_mode_has_an_anonymous_subject_and_names_the_route() {
        let auth = Authenticator::new(&config("", &["demo"])).unwrap();
        let context = run(auth.authenticate(0, &HeaderMap::new())).unwrap();
        assert_eq!(
            (
                context.mode,
                context.subject.as_str(),
                context.route.as_str()
            ),
            (AuthMode::Public, "", "demo")
        );
        assert!(auth.base_url(&HeaderMap::new()).is_none());
    }

    #[test]
    fn a_missing_token_gets_a_challenge_without_an_error_code() {
        let dir = std::env::temp_dir().join(format!("mcpgw-auth-mod-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("hs.secret");
        std::fs::write(&secret, [7u8; 32]).unwrap();
        let auth = Authenticator::new(&config(
            &format!(
                r#"
mode = "jwt"
public_url = "https://mcp.example.com"
[jwt]
issuer = "https://idp"
[[jwt.keys]]
alg = "HS256"
secret_file = "{}"
[routes.demo]
scopes = ["mcp"]
"#,
                secret.display()
            ),
            &["demo"],
        ))
        .unwrap();
        let error = run(auth.authenticate(0, &HeaderMap::new())).unwrap_err();
        assert_eq!(error.status, StatusCode::UNAUTHORIZED);
        let challenge = metadata::challenge_of(&error).unwrap();
        assert_eq!(challenge, "Bearer realm=\"mcpgw\", scope=\"mcp\"");
        let mut headers = HeaderMap::new();
        headers.insert(WWW_AUTHENTICATE, HeaderValue::from_str(&challenge).unwrap());
        let base = auth.base_url(&HeaderMap::new());
        auth.complete_challenge(
            Some(0),
            "/servers/demo/mcp",
            base.as_deref(),
            error.status,
            &mut headers,
        );
        assert_eq!(
            headers[WWW_AUTHENTICATE],
            "Bearer realm=\"mcpgw\", scope=\"mcp\", resource_metadata=\"https://mcp.example.com/.well-known/oauth-protected-resource/servers/demo/mcp\""
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn configuration_problems_name_their_field() {
        let cases = [
            ("mode = \"api-key\"", "auth.routes.demo.mode"),
            (
                "mode = \"jwt\"\n[jwt]\nissuer = \"i\"\naudience = \"a\"",
                "auth.jwt.jwks",
            ),
            (
                "mode = \"jwt\"\n[jwt]\nissuer = \"i\"\naudience = \"a\"\njwks = \"http://idp.example.com/k\"",
                "auth.jwt.jwks",
            ),
            (
                "mode = \"jwt\"\n[jwt]\nissuer = \"i\"\naudience = \"a\"\njwks = \"/nonexistent/jwks.json\"",
                "auth.jwt.jwks",
            ),
            (
                "[jwt]\nissuer = \"i\"\naudience = \"a\"\njwks = \"https://idp/k\"\n[routes.demo]\nmode = \"jwt\"\nscopes = [\"a b\"]",
                "auth.routes.demo.scopes",
            ),
            (
                "[[jwt.keys]]\nalg = \"none\"\nsecret_file = \"x\"",
                "auth.jwt.keys[0]",
            ),
        ];
        for (text, field) in cases {
            let err = Authenticator::new(&config(text, &["demo"]))
                .err()
                .expect(field);
            assert_eq!(err.field, field, "{text}: {err}");
        }
    }

    /// A directory with HMAC secret files `a.secret`, `b.secret` (different) and
    /// `a-again.secret` (the bytes of `a.secret`).
    fn secrets(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("mcpgw-auth-keys-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.secret"), [1u8; 32]).unwrap();
        std::fs::write(dir.join("a-again.secret"), [1u8; 32]).unwrap();
        std::fs::write(dir.join("b.secret"), [2u8; 32]).unwrap();
        dir
    }

    fn hs256(secret: u8, iss: &str, aud: &str) -> HeaderMap {
        let claims = json!({"iss": iss, "aud": aud, "sub": "mallory", "scope": "admin",
                            "exp": now_ms() / 1000 + 300});
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
        header.kid = Some("k".into());
        let key = jsonwebtoken::EncodingKey::from_secret(&[secret; 32]).unwrap();
        let token = jsonwebtoken::encode(&header, &claims, &key).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        headers
    }

    #[test]
    fn a_static_key_verifies_only_for_the_issuer_it_is_configured_for() {
        let dir = secrets("bound");
        let auth = Authenticator::new(&config(
            &format!(
                r#"
mode = "jwt"
[jwt]
issuer = "https://a"
audience = "aud-a"
[[jwt.keys]]
kid = "k"
alg = "HS256"
secret_file = "{dir}/a.secret"
[routes.b]
issuer = "https://b"
audience = "aud-b"
[[routes.b.keys]]
kid = "k"
alg = "HS256"
secret_file = "{dir}/b.secret"
"#,
                dir = dir.display()
            ),
            &["a", "b"],
        ))
        .unwrap();
        let subject = |route: usize, headers: &HeaderMap| {
            run(auth.authenticate(route, headers)).map(|c| c.subject)
        };
        assert_eq!(
            subject(0, &hs256(1, "https://a", "aud-a")).unwrap(),
            "mallory"
        );
        assert_eq!(
            subject(1, &hs256(2, "https://b", "aud-b")).unwrap(),
            "mallory"
        );
        for (route, token, case) in [
            (
                1,
                hs256(1, "https://b", "aud-b"),
                "a's key, b's claims, on b",
            ),
            (
                0,
                hs256(2, "https://a", "aud-a"),
                "b's key, a's claims, on a",
            ),
        ] {
            let error = subject(route, &token).unwrap_err();
            assert_eq!(
                (error.status, error.reason),
                (StatusCode::UNAUTHORIZED, Some(Reason::InvalidToken)),
                "{case}: {}",
                error.message
            );
            let problem = error.data.as_ref().and_then(|d| d.get("problem").cloned());
            assert_eq!(problem, Some(json!("bad_signature")), "{case}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_hmac_secret_shared_between_issuers_stops_the_start() {
        let dir = secrets("shared");
        let two_issuers = |b_secret: &str, b_issuer: &str| {
            format!(
                r#"
mode = "jwt"
[jwt]
issuer = "https://a"
audience = "aud"
[[jwt.keys]]
alg = "HS256"
secret_file = "{dir}/a.secret"
[routes.b]
issuer = "{b_issuer}"
[[routes.b.keys]]
alg = "HS256"
secret_file = "{dir}/{b_secret}"
"#,
                dir = dir.display()
            )
        };
        let err = Authenticator::new(&config(
            &two_issuers("a-again.secret", "https://b"),
            &["a", "b"],
        ))
        .err()
        .expect("a shared secret is refused");
        assert_eq!(err.field, "auth.routes.b.keys[0]", "{err}");
        assert!(err.problem.contains("auth.jwt.keys[0]"), "{err}");
        assert!(err.problem.contains("https://a"), "{err}");
        // The same secret for routes of one issuer, and different secrets for two
        // issuers, are fine.
        for (secret, issuer) in [("a-again.secret", "https://a"), ("b.secret", "https://b")] {
            Authenticator::new(&config(&two_issuers(secret, issuer), &["a", "b"]))
                .unwrap_or_else(|e| panic!("{secret} for {issuer}: {e}"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_route_with_its_own_issuer_and_no_keys_of_its_own_stops_the_start() {
        let dir = secrets("no-own-keys");
        let err = Authenticator::new(&config(
            &format!(
                "mode = \"jwt\"\n[jwt]\nissuer = \"https://a\"\naudience = \"aud\"\n\
                 [[jwt.keys]]\nalg = \"HS256\"\nsecret_file = \"{}/a.secret\"\n\
                 [routes.b]\nissuer = \"https://b\"\n",
                dir.display()
            ),
            &["a", "b"],
        ))
        .err()
        .expect("no keys for b");
        assert_eq!(err.field, "auth.routes.b.jwks", "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn key_problems_name_the_key_location_in_the_log_only() {
        let dir = secrets("location");
        let jwks = dir.join("route-keys.json");
        std::fs::write(
            &jwks,
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","kid":"ed","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#,
        )
        .unwrap();
        let auth = Authenticator::new(&config(
            &format!(
                "mode = \"jwt\"\n[jwt]\nissuer = \"https://a\"\naudience = \"aud\"\njwks = \"{}\"\n",
                jwks.display()
            ),
            &["a"],
        ))
        .unwrap();
        let error = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(auth.authenticate(0, &hs256(1, "https://a", "aud")))
            .unwrap_err();
        let problem = error.data.as_ref().and_then(|d| d.get("problem").cloned());
        assert_eq!(problem, Some(json!("unknown_key")), "{}", error.message);
        let location = jwks.display().to_string();
        assert!(!error.message.contains(&location), "{}", error.message);
        let detail = error.log_detail.as_deref().unwrap_or_default();
        assert!(
            detail.contains(&location),
            "the log detail names {location}: {detail:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
