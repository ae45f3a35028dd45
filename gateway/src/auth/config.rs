//! The `[auth]` part of the configuration: the mode of each route, how JWTs are
//! verified, the public URL for OAuth resource metadata, and the rate limit. It is one
//! typed struct inside [`crate::config::Config`], read from the file and the flags
//! there. Its shape is checked with the rest of the configuration
//! ([`AuthConfig::validate_shape`], pure); its key material when `serve` builds the
//! real [`super::Authenticator`], before any worker starts.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Deserializer, Serialize};

use crate::config::error::{ConfigError, invalid};

/// Leeway on `exp` and `nbf` when none is configured: clocks of the issuer and the
/// gateway may disagree by this much.
pub const DEFAULT_LEEWAY_SECS: u64 = 30;
/// Largest accepted leeway; more would keep expired tokens alive for too long.
pub const MAX_LEEWAY_SECS: u64 = 300;
/// An unknown `kid` refetches the JWKS at most once per this interval.
pub const DEFAULT_JWKS_REFRESH_INTERVAL: Duration = Duration::from_secs(60);
/// The JWKS is refetched in the background when older than this (keys removed by the
/// issuer stop working within this time).
pub const DEFAULT_JWKS_MAX_AGE: Duration = Duration::from_secs(15 * 60);
/// Deadline of one rate-limit round trip to Redis when none is configured.
pub const DEFAULT_RATE_LIMIT_TIMEOUT: Duration = Duration::from_millis(250);

/// How clients of a route authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// No credentials; a session belongs to whoever holds its id.
    Public,
    /// Static bearer tokens from `tokens_file`.
    ApiKey,
    /// JWT access tokens (OAuth 2.1 bearer), verified with the configured keys.
    Jwt,
}

/// Where the rate limiter's answer comes from when Redis does not give one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailMode {
    /// Let the request through (availability over strictness); logged.
    #[default]
    Open,
    /// Refuse it with 503 + `Retry-After` (strictness over availability).
    Closed,
}

/// Everything about edge authentication. Serialized with the rest of the
/// configuration to the worker processes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Mode of every route not set in `routes`; without it, `api-key` when
    /// `tokens_file` is set, else `public`.
    pub mode: Option<Mode>,
    /// API keys: `principal:token` lines.
    pub tokens_file: Option<PathBuf>,
    /// The gateway's public base URL (`https://mcp.example.com`), as clients reach it:
    /// the `resource` of OAuth metadata and the default JWT audience. Without it the
    /// request's `Host` header is used with `http://`.
    pub public_url: Option<String>,
    /// JWT verification shared by every `jwt` route (each may override parts).
    pub jwt: JwtSettings,
    /// Per-route settings, by upstream name.
    pub routes: BTreeMap<String, RouteSettings>,
    /// Per-principal rate limit; none when absent.
    pub rate_limit: Option<RateLimitConfig>,
}

/// How JWTs are verified.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JwtSettings {
    /// The only accepted `iss`.
    pub issuer: Option<String>,
    /// Accepted `aud` values (a token must name one). Defaults to the route's resource
    /// URL when `public_url` is set.
    #[serde(deserialize_with = "one_or_many")]
    pub audience: Vec<String>,
    /// Signing keys as a JWKS: a file path, or an `https://` URL (`http://` only to a
    /// loopback address).
    pub jwks: Option<String>,
    /// Trust only these CAs (PEM) for the JWKS URL instead of the platform's roots.
    pub jwks_ca: Option<PathBuf>,
    /// Keys given directly: a PEM public key or an HMAC secret file each.
    pub keys: Vec<StaticKey>,
    pub leeway_secs: Option<u64>,
    pub jwks_refresh_interval_ms: Option<u64>,
    pub jwks_max_age_ms: Option<u64>,
    /// Authorization servers named in the resource metadata; defaults to the issuer.
    pub authorization_servers: Vec<String>,
}

/// One key from the configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StaticKey {
    /// Matched against the token header's `kid`; a key without one matches tokens of
    /// its algorithm that carry no `kid`.
    pub kid: Option<String>,
    /// The one algorithm this key verifies (`RS256`, `ES256`, `EdDSA`, `HS256`, …).
    pub alg: String,
    /// A PEM public key (RSA, EC or Ed25519).
    pub pem_file: Option<PathBuf>,
    /// A file whose bytes are the HMAC secret (at least 32 bytes).
    pub secret_file: Option<PathBuf>,
}

/// Settings of one route (`[auth.routes.NAME]`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouteSettings {
    pub mode: Option<Mode>,
    /// Scopes every request on the route needs (`jwt` mode).
    pub scopes: Vec<String>,
    /// More scopes a `tools/call` of the named tool needs.
    pub tool_scopes: BTreeMap<String, Vec<String>>,
    /// Overrides of [`JwtSettings`] for this route.
    pub issuer: Option<String>,
    #[serde(deserialize_with = "one_or_many")]
    pub audience: Vec<String>,
    pub jwks: Option<String>,
    pub jwks_ca: Option<PathBuf>,
    /// Keys of this route's issuer given directly (`[[auth.routes.NAME.keys]]`).
    pub keys: Vec<StaticKey>,
    pub authorization_servers: Vec<String>,
}

/// A token bucket per principal, kept in Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Sustained requests per second per principal.
    pub per_second: f64,
    /// Requests a principal may send at once after being idle.
    pub burst: u32,
    /// The Redis of the buckets; defaults to the fleet's.
    #[serde(default)]
    pub redis_url: Option<String>,
    /// What happens when Redis does not answer within `timeout_ms`.
    #[serde(default)]
    pub on_redis_error: FailMode,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// The JWT settings of one route, with the route's overrides and the defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedJwt {
    pub issuer: String,
    pub audience: Vec<String>,
    /// The route names its own issuer, JWKS or keys, so it trusts only its own keys
    /// (`jwks` here, and `[[auth.routes.NAME.keys]]`); otherwise it trusts the keys of
    /// `[auth.jwt]`, which belong to that issuer. A key is never trusted for another
    /// issuer's tokens.
    pub own_keys: bool,
    pub jwks: Option<String>,
    pub jwks_ca: Option<PathBuf>,
    pub leeway_secs: u64,
    pub jwks_refresh_interval: Duration,
    pub jwks_max_age: Duration,
    pub authorization_servers: Vec<String>,
}

/// Flags of `mcpgw serve` about authentication (flattened into its arguments).
#[derive(Debug, Clone, Default, Args)]
pub struct AuthArgs {
    /// API keys: a file of `principal:token` lines. Without it (and without JWT
    /// settings), public mode.
    #[arg(long, env = "MCPGW_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// JWKS of the token issuer (file path or https:// URL); puts every route in jwt
    /// mode.
    #[arg(long, env = "MCPGW_JWT_JWKS")]
    pub jwt_jwks: Option<String>,
    /// The accepted token issuer (`iss`); puts every route in jwt mode.
    #[arg(long, env = "MCPGW_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// An accepted token audience (`aud`); repeat or comma-separate for several; puts
    /// every route in jwt mode.
    #[arg(long, env = "MCPGW_JWT_AUDIENCE", value_delimiter = ',')]
    pub jwt_audience: Vec<String>,
    /// The gateway's public base URL, e.g. https://mcp.example.com (OAuth metadata).
    #[arg(long, env = "MCPGW_PUBLIC_URL")]
    pub public_url: Option<String>,
}

impl AuthConfig {
    /// Lays the flags over the file's settings.
    pub fn apply_args(&mut self, args: &AuthArgs) {
        if args.auth_tokens_file.is_some() {
            self.tokens_file = args.auth_tokens_file.clone();
        }
        if args.public_url.is_some() {
            self.public_url = args.public_url.clone();
        }
        let jwt_flags =
            args.jwt_jwks.is_some() || args.jwt_issuer.is_some() || !args.jwt_audience.is_empty();
        if !jwt_flags {
            return;
        }
        if args.jwt_jwks.is_some() {
            self.jwt.jwks = args.jwt_jwks.clone();
        }
        if args.jwt_issuer.is_some() {
            self.jwt.issuer = args.jwt_issuer.clone();
        }
        if !args.jwt_audience.is_empty() {
            self.jwt.audience = args.jwt_audience.clone();
        }
        // The quick start: every route in jwt mode, whatever the file said.
        self.mode = Some(Mode::Jwt);
        for route in self.routes.values_mut() {
            route.mode = Some(Mode::Jwt);
        }
    }

    /// The mode of route `name`.
    pub fn mode_of(&self, name: &str) -> Mode {
        self.routes
            .get(name)
            .and_then(|r| r.mode)
            .or(self.mode)
            .unwrap_or(if self.tokens_file.is_some() {
                Mode::ApiKey
            } else {
                Mode::Public
            })
    }

    /// The public base URL without a trailing slash, when configured.
    pub fn public_base(&self) -> Option<&str> {
        self.public_url.as_deref().map(|u| u.trim_end_matches('/'))
    }

    /// The JWT settings of route `name`; `is_default` says whether it is also served
    /// at `/mcp` (its resource URL then has two spellings).
    pub fn jwt_of(&self, name: &str, is_default: bool) -> Result<ResolvedJwt, ConfigError> {
        let route = self.routes.get(name).cloned().unwrap_or_default();
        let field = |what: &str| format!("auth.routes.{name}.{what}");
        let own_keys = route.issuer.is_some() || route.jwks.is_some() || !route.keys.is_empty();
        let issuer = route
            .issuer
            .or_else(|| self.jwt.issuer.clone())
            .ok_or_else(|| {
                invalid(
                    &field("issuer"),
                    "a jwt route needs the accepted issuer: set [auth.jwt] issuer or pass --jwt-issuer",
                )
            })?;
        let mut audience = if route.audience.is_empty() {
            self.jwt.audience.clone()
        } else {
            route.audience
        };
        if audience.is_empty()
            && let Some(base) = self.public_base()
        {
            audience.push(format!("{base}/servers/{name}/mcp"));
            if is_default {
                audience.push(format!("{base}/mcp"));
            }
        }
        if audience.is_empty() {
            return Err(invalid(
                &field("audience"),
                "a jwt route needs the accepted audience (MCP servers must check it): set \
                 [auth.jwt] audience, pass --jwt-audience, or set public_url to use the \
                 route's URL",
            ));
        }
        let leeway_secs = self.jwt.leeway_secs.unwrap_or(DEFAULT_LEEWAY_SECS);
        if leeway_secs > MAX_LEEWAY_SECS {
            return Err(invalid(
                "auth.jwt.leeway_secs",
                format!("at most {MAX_LEEWAY_SECS} seconds"),
            ));
        }
        let ms = |v: Option<u64>, default: Duration| v.map_or(default, Duration::from_millis);
        let jwks_refresh_interval = ms(
            self.jwt.jwks_refresh_interval_ms,
            DEFAULT_JWKS_REFRESH_INTERVAL,
        );
        let jwks_max_age = ms(self.jwt.jwks_max_age_ms, DEFAULT_JWKS_MAX_AGE);
        if jwks_refresh_interval < Duration::from_secs(1) || jwks_max_age < Duration::from_secs(1) {
            return Err(invalid(
                "auth.jwt.jwks_refresh_interval_ms",
                "the JWKS intervals must be at least 1000 ms (the issuer's endpoint is not to be hammered)",
            ));
        }
        let authorization_servers = if !route.authorization_servers.is_empty() {
            route.authorization_servers
        } else if !self.jwt.authorization_servers.is_empty() {
            self.jwt.authorization_servers.clone()
        } else {
            vec![issuer.clone()]
        };
        Ok(ResolvedJwt {
            issuer,
            audience,
            own_keys,
            jwks: if own_keys {
                route.jwks
            } else {
                self.jwt.jwks.clone()
            },
            jwks_ca: route.jwks_ca.or_else(|| self.jwt.jwks_ca.clone()),
            leeway_secs,
            jwks_refresh_interval,
            jwks_max_age,
            authorization_servers,
        })
    }

    /// Checks what does not need the key material (the authenticator checks that).
    pub fn validate_shape(
        &self,
        route_names: &[&str],
        fleet_redis: Option<&str>,
    ) -> Result<(), ConfigError> {
        self.validate_route_names(route_names)?;
        self.validate_public_url()?;
        self.validate_route_modes()?;
        if let Some(limit) = &self.rate_limit {
            limit.validate(fleet_redis)?;
        }
        Ok(())
    }

    /// Every `[auth.routes.NAME]` names a configured route: a misspelt name would
    /// leave the route it meant with the default mode.
    fn validate_route_names(&self, route_names: &[&str]) -> Result<(), ConfigError> {
        for name in self.routes.keys() {
            if !route_names.contains(&name.as_str()) {
                return Err(invalid(
                    &format!("auth.routes.{name}"),
                    format!(
                        "no upstream is named {name:?} (configured: {})",
                        route_names.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_public_url(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.public_url {
            let uri: http::Uri = url
                .parse()
                .map_err(|_| invalid("auth.public_url", format!("{url:?} is not a URL")))?;
            if !matches!(uri.scheme_str(), Some("http" | "https"))
                || uri.host().is_none()
                || uri.query().is_some()
            {
                return Err(invalid(
                    "auth.public_url",
                    format!("{url:?} must look like https://host[:port][/prefix]"),
                ));
            }
        }
        Ok(())
    }

    /// Scopes and keys only mean something to a JWT route.
    fn validate_route_modes(&self) -> Result<(), ConfigError> {
        for (name, route) in &self.routes {
            let mode = self.mode_of(name);
            let scoped = !route.scopes.is_empty() || !route.tool_scopes.is_empty();
            if scoped && mode != Mode::Jwt {
                return Err(invalid(
                    &format!("auth.routes.{name}.scopes"),
                    "scopes come from JWTs: set mode = \"jwt\" for this route",
                ));
            }
            if !route.keys.is_empty() && mode != Mode::Jwt {
                return Err(invalid(
                    &format!("auth.routes.{name}.keys"),
                    "keys verify JWTs: set mode = \"jwt\" for this route",
                ));
            }
        }
        Ok(())
    }
}

impl RateLimitConfig {
    /// `fleet_redis` is where the buckets are kept unless `redis_url` says otherwise.
    fn validate(&self, fleet_redis: Option<&str>) -> Result<(), ConfigError> {
        if !(self.per_second.is_finite() && self.per_second > 0.0) {
            return Err(invalid(
                "auth.rate_limit.per_second",
                "must be a number greater than 0",
            ));
        }
        if self.burst == 0 {
            return Err(invalid("auth.rate_limit.burst", "must be at least 1"));
        }
        if self.timeout_ms == Some(0) {
            return Err(invalid(
                "auth.rate_limit.timeout_ms",
                "must be greater than 0",
            ));
        }
        match self.redis_url.as_deref().or(fleet_redis) {
            None => Err(invalid(
                "auth.rate_limit.redis_url",
                "the rate limit is kept in Redis: set redis_url or run a fleet (--redis)",
            )),
            Some(url)
                if !mcpgw_mesh::REDIS_SCHEMES
                    .iter()
                    .any(|scheme| url.starts_with(scheme)) =>
            {
                Err(invalid(
                    "auth.rate_limit.redis_url",
                    "must start with redis://, rediss://, redis+sentinel://, \
                     rediss+sentinel://, redis+cluster:// or rediss+cluster://",
                ))
            }
            Some(_) => Ok(()),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout_ms
            .map_or(DEFAULT_RATE_LIMIT_TIMEOUT, Duration::from_millis)
    }
}

/// `audience = "x"` and `audience = ["x", "y"]` both read as a list.
fn one_or_many<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> AuthConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn modes_fall_back_from_route_to_default_to_tokens_file() {
        let mut auth = parse(
            r#"
tokens_file = "keys"
[routes.open]
mode = "public"
[routes.secure]
mode = "jwt"
scopes = ["mcp"]
"#,
        );
        assert_eq!(auth.mode_of("open"), Mode::Public);
        assert_eq!(auth.mode_of("secure"), Mode::Jwt);
        assert_eq!(auth.mode_of("other"), Mode::ApiKey);
        auth.tokens_file = None;
        assert_eq!(auth.mode_of("other"), Mode::Public);
        auth.apply_args(&AuthArgs {
            jwt_issuer: Some("https://idp".into()),
            ..AuthArgs::default()
        });
        for name in ["open", "secure", "other"] {
            assert_eq!(auth.mode_of(name), Mode::Jwt, "{name}");
        }
    }

    #[test]
    fn jwt_settings_resolve_with_overrides_and_defaults() {
        let auth = parse(
            r#"
public_url = "https://mcp.example.com/"
[jwt]
issuer = "https://idp.example.com"
jwks = "https://idp.example.com/jwks.json"
[routes.b]
audience = "special"
issuer = "https://other-idp"
"#,
        );
        let a = auth.jwt_of("a", true).unwrap();
        assert_eq!(
            a.audience,
            [
                "https://mcp.example.com/servers/a/mcp",
                "https://mcp.example.com/mcp"
            ]
        );
        assert_eq!(a.authorization_servers, ["https://idp.example.com"]);
        assert_eq!(a.leeway_secs, DEFAULT_LEEWAY_SECS);
        let b = auth.jwt_of("b", false).unwrap();
        assert_eq!(
            (b.issuer.as_str(), b.audience.as_slice()),
            ("https://other-idp", &["special".to_owned()][..])
        );
        assert!(!a.own_keys);
        assert_eq!(a.jwks.as_deref(), Some("https://idp.example.com/jwks.json"));
        // The keys of [auth.jwt] belong to its issuer: a route with another issuer
        // does not inherit them.
        assert!(b.own_keys);
        assert_eq!(b.jwks, None);
    }

    #[test]
    fn a_route_naming_its_own_issuer_jwks_or_keys_trusts_only_its_own_keys() {
        let auth = parse(
            r#"
[jwt]
issuer = "https://idp"
audience = "aud"
jwks = "https://idp/jwks.json"
[routes.inherits]
audience = "other-aud"
[routes.issuer]
issuer = "https://other-idp"
[routes.jwks]
jwks = "/etc/route-jwks.json"
[[routes.keys.keys]]
alg = "HS256"
secret_file = "route.secret"
"#,
        );
        let own = |name: &str| {
            let resolved = auth.jwt_of(name, false).unwrap();
            (resolved.own_keys, resolved.jwks)
        };
        assert_eq!(
            own("inherits"),
            (false, Some("https://idp/jwks.json".into()))
        );
        assert_eq!(own("issuer"), (true, None));
        assert_eq!(own("jwks"), (true, Some("/etc/route-jwks.json".into())));
        assert_eq!(own("keys"), (true, None));
        let keys_without_jwt = parse("[[routes.demo.keys]]\nalg = \"HS256\"\n");
        assert_eq!(
            keys_without_jwt
                .validate_shape(&["demo"], None)
                .unwrap_err()
                .field,
            "auth.routes.demo.keys"
        );
    }

    #[test]
    fn problems_name_their_field() {
        let no_audience = parse("[jwt]\nissuer = \"i\"\n");
        assert_eq!(
            no_audience.jwt_of("a", false).unwrap_err().field,
            "auth.routes.a.audience"
        );
        let no_issuer = AuthConfig::default();
        assert_eq!(
            no_issuer.jwt_of("a", false).unwrap_err().field,
            "auth.routes.a.issuer"
        );
        let unknown_route = parse("[routes.nope]\nmode = \"public\"\n");
        assert_eq!(
            unknown_route
                .validate_shape(&["demo"], None)
                .unwrap_err()
                .field,
            "auth.routes.nope"
        );
        let scopes_without_jwt = parse("[routes.demo]\nscopes = [\"x\"]\n");
        assert_eq!(
            scopes_without_jwt
                .validate_shape(&["demo"], None)
                .unwrap_err()
                .field,
            "auth.routes.demo.scopes"
        );
        let limit_without_redis = parse("[rate_limit]\nper_second = 1.0\nburst = 1\n");
        assert_eq!(
            limit_without_redis
                .validate_shape(&["demo"], None)
                .unwrap_err()
                .field,
            "auth.rate_limit.redis_url"
        );
        assert!(
            limit_without_redis
                .validate_shape(&["demo"], Some("redis://127.0.0.1:6379"))
                .is_ok()
        );
        assert!(toml::from_str::<AuthConfig>("bogus = 1").is_err());
    }
}
