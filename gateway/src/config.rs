//! Configuration: one typed struct, built in one place from a TOML file, environment
//! variables and command-line flags (flags win over environment, environment over the
//! file, the file over defaults). An invalid value is refused at start with the field
//! name and the problem.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

/// A configuration value that cannot be used, named by its field.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {field}: {problem}")]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

fn invalid(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_owned(),
        problem: problem.into(),
    }
}

/// Everything one worker (and the supervisor) needs. Serialized to hand the resolved
/// configuration to worker processes, so every worker sees exactly what was validated.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    /// Public address clients connect to; every worker binds it with SO_REUSEPORT.
    pub listen: SocketAddr,
    pub upstreams: Vec<UpstreamConfig>,
    pub limits: Limits,
    pub fleet: FleetConfig,
    pub mesh: MeshConfig,
    /// `principal:token` lines; without it the gateway runs in public mode.
    pub auth_tokens_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpstreamConfig {
    /// Route name: clients reach it at `/servers/{name}/mcp`.
    pub name: String,
    /// Streamable HTTP endpoint of the upstream MCP server.
    pub url: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Limits {
    /// Largest request body accepted; larger gets 413.
    pub max_body_bytes: usize,
    pub upstream_connect_timeout: Duration,
    /// Time allowed for the upstream to start answering (the response head); streams
    /// may then run as long as the upstream keeps them open.
    pub upstream_request_timeout: Duration,
    /// Live sessions one worker holds at most; past it, initialize gets 503.
    pub max_sessions: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FleetConfig {
    /// Worker processes this supervisor runs.
    pub workers: usize,
    /// The fleet directory; without it a single worker runs with an in-memory one.
    pub redis_url: Option<String>,
    pub key_prefix: String,
    /// How long a worker's lease lives without renewal. Shorter finds a lost host
    /// sooner; longer rides out longer Redis or network stalls without fencing.
    pub lease: Duration,
    /// Deadline of every directory call; past it, ownership is unknown.
    pub directory_timeout: Duration,
    /// Fixed worker id (tests and debugging); normally generated per process.
    pub worker_id: Option<String>,
    /// HTTP status for "session gone: re-initialize": 404 as the MCP spec says, or 409
    /// for clients that follow a "session reassigned" contract.
    pub gone_status: u16,
    /// When a session's owner cannot be confirmed, answer ping and the list methods
    /// without the session (from a short-lived upstream session) instead of 503.
    pub stateless_when_unknown: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MeshTransport {
    Quic,
    Tcp,
    /// Redis pub/sub through the fleet's Redis: the measured baseline, never the
    /// default. Needs --redis; no mesh certificates (Redis is its trust boundary).
    Redis,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MeshConfig {
    /// Where worker 0 binds its mesh endpoint; worker i binds port + i (port 0: each
    /// worker picks a free port).
    pub listen: SocketAddr,
    /// `host` or `host:port` peers dial, when it differs from the bind address
    /// (containers); with a port, worker i advertises port + i.
    pub advertise: Option<String>,
    pub transport: MeshTransport,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// How long a forwarded request may wait for the owner's answer to begin.
    pub forward_timeout: Duration,
    /// Connect deadline to a peer; past it the owner is unreachable (unknown, not dead).
    pub connect_timeout: Duration,
    pub max_frame_bytes: usize,
    /// Short requests in flight to (and from) one peer; past it, 503 at once.
    pub max_in_flight_per_peer: usize,
    /// Long-lived exchanges (GET streams, SSE answers) to (and from) one peer; a
    /// separate budget, so held streams never make a short request wait.
    pub max_streams_per_peer: usize,
    /// TCP mesh: connections per peer, each multiplexing many exchanges.
    pub tcp_connections_per_peer: usize,
    /// TCP mesh: body bytes an owner may send on one exchange ahead of the caller.
    pub stream_window_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstreams: Vec::new(),
            limits: Limits {
                max_body_bytes: 4 * 1024 * 1024,
                upstream_connect_timeout: Duration::from_secs(5),
                upstream_request_timeout: Duration::from_secs(60),
                max_sessions: 100_000,
            },
            fleet: FleetConfig {
                workers: 1,
                redis_url: None,
                key_prefix: "mcpgw:".into(),
                lease: Duration::from_secs(10),
                directory_timeout: Duration::from_millis(500),
                worker_id: None,
                gone_status: 404,
                stateless_when_unknown: false,
            },
            mesh: MeshConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                advertise: None,
                transport: MeshTransport::Tcp,
                ca: None,
                cert: None,
                key: None,
                forward_timeout: Duration::from_secs(30),
                connect_timeout: Duration::from_secs(2),
                max_frame_bytes: 8 * 1024 * 1024,
                max_in_flight_per_peer: 1024,
                max_streams_per_peer: 32_768,
                tcp_connections_per_peer: 2,
                stream_window_bytes: 256 * 1024,
            },
            auth_tokens_file: None,
        }
    }
}

/// Flags of `mcpgw serve`; each also reads an `MCPGW_*` environment variable.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// TOML configuration file.
    #[arg(long, short, env = "MCPGW_CONFIG")]
    pub config: Option<PathBuf>,
    /// Public listen address, e.g. 0.0.0.0:8080.
    #[arg(long, env = "MCPGW_LISTEN")]
    pub listen: Option<String>,
    /// An upstream as name=URL; repeat for several. Replaces the file's upstreams.
    #[arg(long = "upstream", env = "MCPGW_UPSTREAMS", value_delimiter = ',')]
    pub upstreams: Vec<String>,
    /// Worker processes to run.
    #[arg(long, env = "MCPGW_WORKERS")]
    pub workers: Option<usize>,
    /// Redis URL of the fleet directory, e.g. redis://127.0.0.1:6379/0.
    #[arg(long, env = "MCPGW_REDIS_URL")]
    pub redis: Option<String>,
    /// Prefix of every Redis key.
    #[arg(long, env = "MCPGW_KEY_PREFIX")]
    pub key_prefix: Option<String>,
    /// Worker lease in milliseconds.
    #[arg(long, env = "MCPGW_LEASE_MS")]
    pub lease_ms: Option<u64>,
    /// Fixed worker id (only with --workers 1; normally generated).
    #[arg(long, env = "MCPGW_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Time for a session's owner to start answering a forwarded request, in ms.
    #[arg(long, env = "MCPGW_FORWARD_TIMEOUT_MS")]
    pub forward_timeout_ms: Option<u64>,
    /// API keys: a file of `principal:token` lines. Without it, public mode.
    #[arg(long, env = "MCPGW_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// While a session's owner cannot be confirmed, answer ping and */list without the
    /// session instead of 503.
    #[arg(long, env = "MCPGW_STATELESS_WHEN_UNKNOWN")]
    pub stateless_when_unknown: bool,
    /// Status for a session whose owner is gone: 404 (MCP) or 409.
    #[arg(long, env = "MCPGW_SESSION_GONE_STATUS")]
    pub session_gone_status: Option<u16>,
    /// Mesh bind address of worker 0 (worker i uses port + i; port 0 picks free ports).
    #[arg(long, env = "MCPGW_MESH_LISTEN")]
    pub mesh_listen: Option<String>,
    /// Mesh address peers dial: host or host:port (worker i advertises port + i).
    #[arg(long, env = "MCPGW_MESH_ADVERTISE")]
    pub mesh_advertise: Option<String>,
    /// Mesh transport between workers (default tcp: measured fastest, and it notices
    /// a dead owner at once).
    #[arg(long, env = "MCPGW_MESH_TRANSPORT", value_enum)]
    pub mesh_transport: Option<MeshTransport>,
    /// Mesh CA bundle (PEM).
    #[arg(long, env = "MCPGW_MESH_CA")]
    pub mesh_ca: Option<PathBuf>,
    /// This host's mesh leaf certificate (PEM).
    #[arg(long, env = "MCPGW_MESH_CERT")]
    pub mesh_cert: Option<PathBuf>,
    /// This host's mesh leaf key (PEM).
    #[arg(long, env = "MCPGW_MESH_KEY")]
    pub mesh_key: Option<PathBuf>,
    /// Largest request body in bytes.
    #[arg(long, env = "MCPGW_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Upstream request timeout in milliseconds (time to the response head).
    #[arg(long, env = "MCPGW_UPSTREAM_TIMEOUT_MS")]
    pub upstream_timeout_ms: Option<u64>,
    /// Most live sessions per worker.
    #[arg(long, env = "MCPGW_MAX_SESSIONS")]
    pub max_sessions: Option<usize>,
}

/// The TOML file's shape: every field optional, defaults fill the rest.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    #[serde(default, rename = "upstream")]
    upstreams: Vec<UpstreamConfig>,
    #[serde(default)]
    limits: FileLimits,
    #[serde(default)]
    fleet: FileFleet,
    #[serde(default)]
    mesh: FileMesh,
    #[serde(default)]
    auth: FileAuth,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAuth {
    tokens_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLimits {
    max_body_bytes: Option<usize>,
    upstream_connect_timeout_ms: Option<u64>,
    upstream_request_timeout_ms: Option<u64>,
    max_sessions: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFleet {
    workers: Option<usize>,
    redis_url: Option<String>,
    key_prefix: Option<String>,
    lease_ms: Option<u64>,
    directory_timeout_ms: Option<u64>,
    gone_status: Option<u16>,
    stateless_when_unknown: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileMesh {
    listen: Option<String>,
    advertise: Option<String>,
    transport: Option<MeshTransport>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    forward_timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    max_frame_bytes: Option<usize>,
    max_in_flight_per_peer: Option<usize>,
    max_streams_per_peer: Option<usize>,
    tcp_connections_per_peer: Option<usize>,
    stream_window_bytes: Option<usize>,
}

impl Config {
    /// Builds the configuration from file, environment (already folded into `args` by
    /// clap) and flags, then validates it.
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let mut config = Config::default();
        config.apply_file(file)?;
        config.apply_args(args)?;
        config.validate()?;
        Ok(config)
    }

    fn apply_file(&mut self, file: FileConfig) -> Result<(), ConfigError> {
        if let Some(listen) = file.listen {
            self.listen = parse_addr("listen", &listen)?;
        }
        self.upstreams = file.upstreams;
        let l = file.limits;
        set(&mut self.limits.max_body_bytes, l.max_body_bytes);
        set_ms(
            &mut self.limits.upstream_connect_timeout,
            l.upstream_connect_timeout_ms,
        );
        set_ms(
            &mut self.limits.upstream_request_timeout,
            l.upstream_request_timeout_ms,
        );
        set(&mut self.limits.max_sessions, l.max_sessions);
        let f = file.fleet;
        set(&mut self.fleet.workers, f.workers);
        if f.redis_url.is_some() {
            self.fleet.redis_url = f.redis_url;
        }
        set(&mut self.fleet.key_prefix, f.key_prefix);
        set_ms(&mut self.fleet.lease, f.lease_ms);
        set_ms(&mut self.fleet.directory_timeout, f.directory_timeout_ms);
        set(&mut self.fleet.gone_status, f.gone_status);
        set(
            &mut self.fleet.stateless_when_unknown,
            f.stateless_when_unknown,
        );
        let m = file.mesh;
        if let Some(listen) = m.listen {
            self.mesh.listen = parse_addr("mesh.listen", &listen)?;
        }
        if m.advertise.is_some() {
            self.mesh.advertise = m.advertise;
        }
        set(&mut self.mesh.transport, m.transport);
        for (slot, value) in [
            (&mut self.mesh.ca, m.ca),
            (&mut self.mesh.cert, m.cert),
            (&mut self.mesh.key, m.key),
        ] {
            if value.is_some() {
                *slot = value;
            }
        }
        set_ms(&mut self.mesh.forward_timeout, m.forward_timeout_ms);
        if file.auth.tokens_file.is_some() {
            self.auth_tokens_file = file.auth.tokens_file;
        }
        set_ms(&mut self.mesh.connect_timeout, m.connect_timeout_ms);
        set(&mut self.mesh.max_frame_bytes, m.max_frame_bytes);
        set(
            &mut self.mesh.max_in_flight_per_peer,
            m.max_in_flight_per_peer,
        );
        set(&mut self.mesh.max_streams_per_peer, m.max_streams_per_peer);
        set(
            &mut self.mesh.tcp_connections_per_peer,
            m.tcp_connections_per_peer,
        );
        set(&mut self.mesh.stream_window_bytes, m.stream_window_bytes);
        Ok(())
    }

    fn apply_args(&mut self, a: &ServeArgs) -> Result<(), ConfigError> {
        if let Some(listen) = &a.listen {
            self.listen = parse_addr("--listen", listen)?;
        }
        if !a.upstreams.is_empty() {
            self.upstreams = a
                .upstreams
                .iter()
                .map(|spec| parse_upstream_spec(spec))
                .collect::<Result<_, _>>()?;
        }
        set(&mut self.fleet.workers, a.workers);
        if a.redis.is_some() {
            self.fleet.redis_url = a.redis.clone();
        }
        set(&mut self.fleet.key_prefix, a.key_prefix.clone());
        set_ms(&mut self.fleet.lease, a.lease_ms);
        if a.worker_id.is_some() {
            self.fleet.worker_id = a.worker_id.clone();
        }
        set(&mut self.fleet.gone_status, a.session_gone_status);
        if a.stateless_when_unknown {
            self.fleet.stateless_when_unknown = true;
        }
        set_ms(&mut self.mesh.forward_timeout, a.forward_timeout_ms);
        if a.auth_tokens_file.is_some() {
            self.auth_tokens_file = a.auth_tokens_file.clone();
        }
        if let Some(listen) = &a.mesh_listen {
            self.mesh.listen = parse_addr("--mesh-listen", listen)?;
        }
        if a.mesh_advertise.is_some() {
            self.mesh.advertise = a.mesh_advertise.clone();
        }
        set(&mut self.mesh.transport, a.mesh_transport);
        for (slot, value) in [
            (&mut self.mesh.ca, &a.mesh_ca),
            (&mut self.mesh.cert, &a.mesh_cert),
            (&mut self.mesh.key, &a.mesh_key),
        ] {
            if value.is_some() {
                *slot = value.clone();
            }
        }
        set(&mut self.limits.max_body_bytes, a.max_body_bytes);
        set_ms(
            &mut self.limits.upstream_request_timeout,
            a.upstream_timeout_ms,
        );
        set(&mut self.limits.max_sessions, a.max_sessions);
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.upstreams.is_empty() {
            return Err(invalid(
                "upstream",
                "no upstream configured: pass --upstream name=URL or add [[upstream]] to the file",
            ));
        }
        for (i, upstream) in self.upstreams.iter().enumerate() {
            let field = format!("upstream[{i}]");
            if upstream.name.is_empty()
                || !upstream
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(invalid(
                    &format!("{field}.name"),
                    format!(
                        "{:?} must be non-empty letters, digits, '-' or '_' (it becomes a URL path segment)",
                        upstream.name
                    ),
                ));
            }
            if self.upstreams[..i].iter().any(|u| u.name == upstream.name) {
                return Err(invalid(
                    &format!("{field}.name"),
                    format!("{:?} is configured twice", upstream.name),
                ));
            }
            check_upstream_url(&format!("{field}.url"), &upstream.url)?;
        }
        if self.limits.max_body_bytes == 0 {
            return Err(invalid("limits.max_body_bytes", "must be greater than 0"));
        }
        if self.limits.max_sessions == 0 {
            return Err(invalid("limits.max_sessions", "must be greater than 0"));
        }
        if self.limits.upstream_request_timeout.is_zero() {
            return Err(invalid(
                "limits.upstream_request_timeout_ms",
                "must be greater than 0",
            ));
        }
        if self.fleet.workers == 0 || self.fleet.workers > 1024 {
            return Err(invalid("fleet.workers", "must be between 1 and 1024"));
        }
        if self.fleet.workers > 1 && self.fleet.redis_url.is_none() {
            return Err(invalid(
                "fleet.redis_url",
                "several workers need a shared directory: pass --redis redis://HOST:PORT",
            ));
        }
        if let Some(url) = &self.fleet.redis_url
            && !(url.starts_with("redis://") || url.starts_with("rediss://"))
        {
            return Err(invalid(
                "fleet.redis_url",
                "must start with redis:// or rediss://",
            ));
        }
        if self.fleet.worker_id.is_some() && self.fleet.workers != 1 {
            return Err(invalid(
                "fleet.worker_id",
                "a fixed worker id needs --workers 1 (ids must be unique)",
            ));
        }
        if let Some(id) = &self.fleet.worker_id
            && !valid_worker_id(id)
        {
            return Err(invalid(
                "fleet.worker_id",
                "use 1 to 64 letters, digits, '-', '_' or '.'",
            ));
        }
        if !matches!(self.fleet.gone_status, 404 | 409) {
            return Err(invalid(
                "fleet.gone_status",
                "must be 404 (MCP: re-initialize) or 409 (session reassigned)",
            ));
        }
        if self.fleet.lease < Duration::from_secs(1) {
            return Err(invalid("fleet.lease_ms", "must be at least 1000"));
        }
        if self.mesh.transport == MeshTransport::Redis && self.fleet.redis_url.is_none() {
            return Err(invalid(
                "mesh.transport",
                "the redis mesh transport forwards through the fleet's Redis: pass --redis \
                 redis://HOST:PORT",
            ));
        }
        if self.fleet.redis_url.is_some() {
            for (field, value) in [
                ("mesh.ca", &self.mesh.ca),
                ("mesh.cert", &self.mesh.cert),
                ("mesh.key", &self.mesh.key),
            ] {
                match value {
                    // The Redis transport has no mTLS; files given anyway are still checked.
                    None if self.mesh.transport == MeshTransport::Redis => {}
                    None => {
                        return Err(invalid(
                            field,
                            "a fleet (--redis) needs mesh certificates: pass --mesh-ca, \
                             --mesh-cert and --mesh-key (see `mcpgw certs`)",
                        ));
                    }
                    Some(path) if !path.is_file() => {
                        return Err(invalid(
                            field,
                            format!("{} is not a readable file", path.display()),
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        if let Some(path) = &self.auth_tokens_file {
            crate::auth::Authenticator::from_file(path)
                .map_err(|problem| invalid("auth.tokens_file", problem))?;
        }
        for (field, value) in [
            (
                "mesh.max_in_flight_per_peer",
                self.mesh.max_in_flight_per_peer,
            ),
            ("mesh.max_streams_per_peer", self.mesh.max_streams_per_peer),
            (
                "mesh.tcp_connections_per_peer",
                self.mesh.tcp_connections_per_peer,
            ),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if self.mesh.stream_window_bytes < 16 * 1024 {
            return Err(invalid(
                "mesh.stream_window_bytes",
                "must be at least 16 KiB (smaller windows cost a credit update every few events)",
            ));
        }
        if self.mesh.max_frame_bytes < self.limits.max_body_bytes + 64 * 1024 {
            return Err(invalid(
                "mesh.max_frame_bytes",
                "must exceed limits.max_body_bytes by at least 64 KiB (a forwarded request carries the body)",
            ));
        }
        Ok(())
    }

    /// The single-upstream shortcut `/mcp` exists only when it is unambiguous.
    pub fn default_upstream(&self) -> Option<&UpstreamConfig> {
        match self.upstreams.as_slice() {
            [only] => Some(only),
            _ => None,
        }
    }
}

pub fn valid_worker_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid("--config", format!("cannot read {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| {
        invalid(
            &format!("{}", path.display()),
            e.to_string().trim().replace('\n', " "),
        )
    })
}

fn parse_addr(field: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse().map_err(|_| {
        invalid(
            field,
            format!("{text:?} is not an address like 127.0.0.1:8080"),
        )
    })
}

fn parse_upstream_spec(spec: &str) -> Result<UpstreamConfig, ConfigError> {
    let Some((name, url)) = spec.split_once('=') else {
        return Err(invalid(
            "--upstream",
            format!("{spec:?} must look like name=http://host:port/mcp"),
        ));
    };
    Ok(UpstreamConfig {
        name: name.trim().to_owned(),
        url: url.trim().to_owned(),
    })
}

fn check_upstream_url(field: &str, url: &str) -> Result<(), ConfigError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| invalid(field, format!("{url:?} is not a URL")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(invalid(
                field,
                "https upstreams are not implemented yet: use http:// (for example behind a local TLS proxy)",
            ));
        }
        _ => return Err(invalid(field, format!("{url:?} must start with http://"))),
    }
    if uri.host().is_none() {
        return Err(invalid(field, format!("{url:?} has no host")));
    }
    Ok(())
}

fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *slot = value;
    }
}

fn set_ms(slot: &mut Duration, value: Option<u64>) {
    if let Some(ms) = value {
        *slot = Duration::from_millis(ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(upstreams: &[&str]) -> ServeArgs {
        ServeArgs {
            upstreams: upstreams.iter().map(|s| s.to_string()).collect(),
            ..ServeArgs::default()
        }
    }

    #[test]
    fn upstream_flag_alone_is_enough() {
        let config = Config::load(&args(&["demo=http://127.0.0.1:9000/mcp"])).unwrap();
        assert_eq!(config.upstreams[0].name, "demo");
        assert_eq!(
            config.default_upstream().map(|u| u.name.as_str()),
            Some("demo")
        );
        assert_eq!(config.fleet.workers, 1);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (args(&[]), "upstream"),
            (args(&["noequals"]), "--upstream"),
            (args(&["bad name=http://x/mcp"]), "upstream[0].name"),
            (args(&["a=ftp://x/mcp"]), "upstream[0].url"),
            (args(&["a=https://x/mcp"]), "upstream[0].url"),
            (
                args(&["a=http://x/mcp", "a=http://y/mcp"]),
                "upstream[1].name",
            ),
            (
                ServeArgs {
                    workers: Some(4),
                    ..args(&["a=http://x/mcp"])
                },
                "fleet.redis_url",
            ),
            (
                ServeArgs {
                    listen: Some("nowhere".into()),
                    ..args(&["a=http://x/mcp"])
                },
                "--listen",
            ),
            (
                ServeArgs {
                    redis: Some("redis://127.0.0.1:1".into()),
                    ..args(&["a=http://x/mcp"])
                },
                "mesh.ca",
            ),
            (
                ServeArgs {
                    mesh_transport: Some(MeshTransport::Redis),
                    ..args(&["a=http://x/mcp"])
                },
                "mesh.transport",
            ),
        ];
        for (a, field) in cases {
            let err = Config::load(&a).expect_err(field);
            assert_eq!(err.field, field, "{err}");
        }
    }

    #[test]
    fn the_redis_transport_needs_redis_but_no_mesh_certificates() {
        let config = Config::load(&ServeArgs {
            redis: Some("redis://127.0.0.1:1".into()),
            mesh_transport: Some(MeshTransport::Redis),
            ..args(&["a=http://x/mcp"])
        })
        .expect("redis transport without certificates");
        assert_eq!(config.mesh.transport, MeshTransport::Redis);
    }

    #[test]
    fn file_values_are_read_and_flags_win() {
        let dir = std::env::temp_dir().join(format!("mcpgw-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mcpgw.toml");
        std::fs::write(
            &path,
            r#"
listen = "127.0.0.1:9999"
[[upstream]]
name = "one"
url = "http://127.0.0.1:1/mcp"
[[upstream]]
name = "two"
url = "http://127.0.0.1:2/mcp"
[limits]
max_body_bytes = 1000
"#,
        )
        .unwrap();
        let a = ServeArgs {
            config: Some(path.clone()),
            listen: Some("127.0.0.1:7777".into()),
            ..ServeArgs::default()
        };
        let config = Config::load(&a).unwrap();
        assert_eq!(config.listen.port(), 7777);
        assert_eq!(config.upstreams.len(), 2);
        assert!(config.default_upstream().is_none());
        assert_eq!(config.limits.max_body_bytes, 1000);

        std::fs::write(&path, "listen = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
        let err = Config::load(&a).expect_err("unknown key");
        assert!(err.problem.contains("bogus"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
