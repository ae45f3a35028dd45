//! Configuration: one typed struct, built in one place from a TOML file, environment
//! variables and command-line flags (flags win over environment, environment over the
//! file, the file over defaults). An invalid value is refused at start with the field
//! name and the problem.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use mcpgw_mesh::directory::DirectoryConfig;
use mcpgw_mesh::transport::MeshLimits;

use crate::auth::config::{AuthArgs, AuthConfig};

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
    /// Edge authentication: modes per route, JWT keys, rate limit (`[auth]`).
    pub auth: AuthConfig,
    /// The admin listener of worker 0 (`/healthz`, `/readyz`, `/state`); worker i
    /// listens on port + i (port 0: each worker picks a free port and logs it).
    pub admin_listen: SocketAddr,
    /// Take the client's address from the last `X-Forwarded-For` entry (set by the
    /// load balancer in front) instead of the connection's peer. Only behind a proxy
    /// that sets it: a client could forge it otherwise.
    pub trust_forwarded_for: bool,
    /// Log one line per successful request too (failed ones are always logged).
    pub log_requests: bool,
    /// OTLP/HTTP traces endpoint (`http://collector:4318/v1/traces`, or `https://`);
    /// none: no spans.
    pub otlp_endpoint: Option<String>,
    /// CAs (PEM) that sign an `https://` collector's certificate, instead of the
    /// platform's root certificates.
    pub otlp_ca: Option<PathBuf>,
    /// Fraction of new traces recorded (0.0 to 1.0); a client's `traceparent` decides
    /// for its own trace.
    pub otlp_sample_ratio: f64,
    /// Headers sent with every export request (a collector's API key, a tenant).
    pub otlp_headers: OtlpHeaders,
}

/// Headers for the OTLP collector. Their values are usually credentials: `Debug`
/// shows only the names, and configuration errors never quote a value.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtlpHeaders(pub BTreeMap<String, String>);

impl std::fmt::Debug for OtlpHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

impl OtlpHeaders {
    /// `name=value,name=value`, as `OTEL_EXPORTER_OTLP_HEADERS` spells them.
    fn parse(list: &str) -> Result<Self, ConfigError> {
        let mut headers = BTreeMap::new();
        for pair in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((name, value)) = pair.split_once('=') else {
                return Err(invalid(
                    "telemetry.otlp_headers",
                    "expected name=value pairs separated by commas (a value is not shown)",
                ));
            };
            headers.insert(name.trim().to_owned(), value.trim().to_owned());
        }
        Ok(Self(headers))
    }

    /// The headers, their values marked sensitive (never printed by `http`); an error
    /// names the header, never its value.
    pub fn header_map(&self) -> Result<http::HeaderMap, ConfigError> {
        let mut headers = http::HeaderMap::new();
        for (name, value) in &self.0 {
            let name = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                invalid(
                    "telemetry.otlp_headers",
                    format!("{name:?} is not an HTTP header name"),
                )
            })?;
            let mut value = http::HeaderValue::from_str(value).map_err(|_| {
                invalid(
                    "telemetry.otlp_headers",
                    format!("the value of {name} is not a valid HTTP header value (not shown)"),
                )
            })?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        Ok(headers)
    }
}

/// One upstream MCP server: its route name, where it is, and how the gateway reaches it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpstreamConfig {
    /// Route name: clients reach it at `/servers/{name}/mcp`.
    pub name: String,
    pub target: UpstreamTarget,
    /// The upstream speaks only the session-based protocol (2025-*), or keeps state in
    /// its sessions: a 2026-07-28 client then gets one upstream session per (principal,
    /// route), held by one worker, instead of a stateless pass-through. Always true
    /// for stdio upstreams (a process is a session).
    pub legacy_only: bool,
}

/// Where an upstream is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum UpstreamTarget {
    /// Streamable HTTP at `url` (`http://` or `https://`).
    Http { url: String, tls: UpstreamTls },
    /// A command the gateway runs once per session and speaks to over stdin/stdout.
    Stdio(StdioCommand),
    /// A virtual server (`[[server]]`): no upstream of its own, its members' tools
    /// behind one route (see `federation`).
    Virtual(VirtualServer),
}

/// A `[[server]]` table: which configured upstreams it joins and how their names show.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VirtualServer {
    pub prefix: PrefixRule,
    /// Between a member's prefix and a tool's own name (`demo__echo`).
    pub separator: String,
    pub members: Vec<MemberConfig>,
}

/// When a member's prefix goes in front of its names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PrefixRule {
    /// Every name carries its member's prefix: names never collide.
    #[default]
    Always,
    /// Only names that more than one member has carry their prefix.
    Conflicts,
    /// Names as the members give them; a name two members have is the earlier one's.
    Never,
}

/// One `[[server.member]]`: a configured upstream and what of it the server exposes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemberConfig {
    /// The member's upstream, by name and by its index in `Config::upstreams`.
    pub upstream: String,
    pub index: usize,
    pub prefix: String,
    pub tools: NameFilter,
    pub prompts: NameFilter,
    /// Initialize fails without this member (else the session opens without it).
    pub required: bool,
}

/// Include and exclude patterns (`*` matches any run of characters); an empty include
/// list includes everything.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameFilter {
    #[serde(default)]
    pub include: Vec<String>,
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// TLS settings of an `https://` upstream.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct UpstreamTls {
    /// PEM bundle of the CAs to trust instead of the platform's root certificates
    /// (which honour `SSL_CERT_FILE`).
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM) for upstreams that require mutual TLS.
    pub client_cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub client_key: Option<PathBuf>,
}

impl UpstreamTls {
    /// The files, each with the name of its `[[upstream]]` key.
    fn files(&self) -> [(&'static str, Option<&Path>); 3] {
        [
            ("tls_ca", self.ca.as_deref()),
            ("tls_client_cert", self.client_cert.as_deref()),
            ("tls_client_key", self.client_key.as_deref()),
        ]
    }
}

/// A stdio upstream: the command every session starts.
#[derive(Clone, Serialize, Deserialize)]
pub struct StdioCommand {
    /// The program, found on `PATH` unless it is a path.
    pub program: String,
    pub args: Vec<String>,
    /// Set in the child's environment, which is otherwise the gateway's own minus its
    /// `MCPGW_*` variables (they hold the gateway's configuration).
    pub env: BTreeMap<String, String>,
    /// Working directory of the child; the gateway's own when unset.
    pub cwd: Option<PathBuf>,
    /// Child processes of this upstream one worker runs at most (one per session);
    /// past it initialize gets 503.
    pub max_processes: usize,
    /// Child processes of this upstream one worker runs at most for one principal (in
    /// public mode: one client address); past it initialize gets 429.
    #[serde(default = "default_max_processes_per_principal")]
    pub max_processes_per_principal: usize,
    /// How long a session's child may live at most, then it is ended and the session
    /// with it (404 `session_gone`); `None`: as long as the session is used.
    #[serde(default)]
    pub max_session_lifetime: Option<Duration>,
}

fn default_max_processes_per_principal() -> usize {
    DEFAULT_MAX_STDIO_PROCESSES_PER_PRINCIPAL
}

impl std::fmt::Debug for StdioCommand {
    // Environment values are often credentials: only their names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StdioCommand")
            .field("program", &self.program)
            .field("args", &self.args.len())
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("cwd", &self.cwd)
            .field("max_processes", &self.max_processes)
            .field(
                "max_processes_per_principal",
                &self.max_processes_per_principal,
            )
            .field("max_session_lifetime", &self.max_session_lifetime)
            .finish()
    }
}

/// Child processes per stdio upstream and worker, unless configured.
pub const DEFAULT_MAX_STDIO_PROCESSES: usize = 32;
/// Child processes per stdio upstream, worker and principal, unless configured.
pub const DEFAULT_MAX_STDIO_PROCESSES_PER_PRINCIPAL: usize = 8;

impl UpstreamConfig {
    /// A plain Streamable HTTP upstream.
    pub fn http(name: &str, url: &str) -> UpstreamConfig {
        UpstreamConfig {
            name: name.to_owned(),
            target: UpstreamTarget::Http {
                url: url.to_owned(),
                tls: UpstreamTls::default(),
            },
            legacy_only: false,
        }
    }

    /// What the upstream is, for the start-up announcement: the URL, or the stdio
    /// program (never its arguments or environment, which may hold credentials).
    pub fn describe(&self) -> String {
        match &self.target {
            UpstreamTarget::Http { url, .. } => url.clone(),
            UpstreamTarget::Stdio(command) => format!("stdio: {}", command.program),
            UpstreamTarget::Virtual(server) => format!(
                "virtual server of {}",
                server
                    .members
                    .iter()
                    .map(|m| m.upstream.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
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
    /// Sessions one authenticated principal holds at most, fleet-wide; past it
    /// initialize gets 429. 0: no quota.
    pub max_sessions_per_principal: usize,
    /// Sessions one client address holds at most in public mode (no principal),
    /// fleet-wide. Off (0) by default: behind a load balancer every client shares its
    /// address unless `trust_forwarded_for` is set.
    pub max_sessions_per_client_address: usize,
    /// A session no exchange has used for this long ends (upstream and in the
    /// directory); a held GET stream or a request in flight keeps it alive.
    pub session_idle_timeout: Duration,
    /// Largest upstream SSE event buffered while waiting for its end; past it the
    /// stream ends with an error event and the session survives.
    pub max_sse_event_bytes: usize,
    /// Client connections one worker serves at once; past it new connections get a
    /// 503 and are closed, existing ones go on.
    pub max_connections: usize,
    /// Time for a client to send a whole request body; past it, 408.
    pub body_timeout: Duration,
    /// Largest request head (request line and headers); past it, 431.
    pub max_header_bytes: usize,
    /// Bytes all replay logs of one worker keep at most (events kept so a client can
    /// resume a stream); past it new events and streams are delivered but not kept.
    pub replay_budget_bytes: usize,
    /// Bytes the replay logs of one session keep at most.
    pub replay_session_bytes: usize,
    /// Lame duck: after a drain is decided (`/readyz` already 503, no new sessions),
    /// the public port keeps accepting and serving for this long, answering with
    /// `Connection: close`, so that load balancers that follow readiness stop sending
    /// before the port closes (what a Kubernetes preStop pause does from outside).
    #[serde(default)]
    pub drain_delay: Duration,
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
    /// How often one worker of the fleet (whichever takes the turn) looks for dead
    /// workers whose sessions no request touches, and deletes their keys. A dead
    /// worker's keys are gone within about a lease plus two of these. Unset: the
    /// lease time, so directory traffic stays time-based and small.
    pub sweep_interval: Option<Duration>,
    /// Whether another worker adopts a session whose owner died or drained, when its
    /// state lives in its HTTP upstream.
    pub adopt: AdoptMode,
    /// Keys that seal the upstream session ids in the directory's adoption records
    /// (one per line, 64 hex digits; the first seals). Unset: recorded in the clear.
    pub adoption_key_file: Option<PathBuf>,
}

/// Which sessions outlive their worker (`--adopt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AdoptMode {
    /// Sessions whose upstream is HTTP: another worker takes them on.
    Http,
    /// None: every session ends with its owner, and clients see each owner change.
    Never,
}

impl FleetConfig {
    /// The sweep interval in effect.
    pub fn sweep_interval(&self) -> Duration {
        self.sweep_interval.unwrap_or(self.lease)
    }
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
    /// The trust domain of mesh identities (`spiffe://{domain}/mesh/{member}`), as
    /// `mcpgw certs init --trust-domain` set it.
    pub trust_domain: String,
    /// Period of the fallback check of the certificate files (a file watcher sees
    /// most changes at once).
    pub cert_reload_interval: Duration,
    /// The mesh endpoint's limits, handed to the mesh server and clients as they are;
    /// their defaults are `MeshLimits::default()`. File keys (and flags) map onto them:
    /// `connect_timeout_ms`, `max_frame_bytes` (`max_frame`), `max_in_flight_per_peer`,
    /// `max_streams_per_peer`, `tcp_connections_per_peer` (`tcp_pool_size`),
    /// `stream_window_bytes` (`stream_window`), `max_connection_age_ms` and
    /// `protocol_version` (`max_protocol_version`: the one before the current holds a
    /// fleet at the previous release's protocol while a rolling upgrade runs).
    pub limits: MeshLimits,
}

impl MeshConfig {
    /// The mTLS files, each with the name of its setting.
    fn certificate_files(&self) -> [(&'static str, Option<&Path>); 3] {
        [
            ("mesh.ca", self.ca.as_deref()),
            ("mesh.cert", self.cert.as_deref()),
            ("mesh.key", self.key.as_deref()),
        ]
    }
}

impl Default for Config {
    fn default() -> Self {
        // The fleet directory's and the mesh's own defaults are the production values;
        // the settings that configure them start from there.
        let directory = DirectoryConfig::default();
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstreams: Vec::new(),
            limits: Limits {
                max_body_bytes: 4 * 1024 * 1024,
                upstream_connect_timeout: Duration::from_secs(5),
                upstream_request_timeout: Duration::from_secs(60),
                max_sessions: 100_000,
                max_sessions_per_principal: 1_000,
                max_sessions_per_client_address: 0,
                session_idle_timeout: Duration::from_secs(30 * 60),
                max_sse_event_bytes: 16 * 1024 * 1024,
                max_connections: 10_000,
                body_timeout: Duration::from_secs(30),
                max_header_bytes: 64 * 1024,
                replay_budget_bytes: 256 * 1024 * 1024,
                replay_session_bytes: 4 * 1024 * 1024,
                drain_delay: Duration::ZERO,
            },
            fleet: FleetConfig {
                workers: 1,
                redis_url: None,
                key_prefix: directory.prefix,
                lease: directory.lease,
                directory_timeout: directory.op_timeout,
                worker_id: None,
                gone_status: 404,
                stateless_when_unknown: false,
                sweep_interval: None,
                adopt: AdoptMode::Http,
                adoption_key_file: None,
            },
            mesh: MeshConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                advertise: None,
                transport: MeshTransport::Tcp,
                ca: None,
                cert: None,
                key: None,
                forward_timeout: Duration::from_secs(30),
                trust_domain: mcpgw_certs::DEFAULT_TRUST_DOMAIN.to_owned(),
                cert_reload_interval: Duration::from_secs(10),
                limits: MeshLimits::default(),
            },
            auth: AuthConfig::default(),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            trust_forwarded_for: false,
            log_requests: false,
            otlp_endpoint: None,
            otlp_ca: None,
            otlp_sample_ratio: 1.0,
            otlp_headers: OtlpHeaders::default(),
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
    /// An upstream as name=URL (http:// or https://) or name=stdio:COMMAND ARG... (split
    /// into words as a shell would, without a shell); repeat for several. Replaces the
    /// file's upstreams. Commas separate upstreams, so a stdio command with a comma
    /// needs the file's `[[upstream]] command = [...]`.
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
    #[command(flatten)]
    pub auth: AuthArgs,
    /// While a session's owner cannot be confirmed, answer ping and */list without the
    /// session instead of 503.
    #[arg(long, env = "MCPGW_STATELESS_WHEN_UNKNOWN")]
    pub stateless_when_unknown: bool,
    /// Status for a session whose owner is gone: 404 (MCP) or 409.
    #[arg(long, env = "MCPGW_SESSION_GONE_STATUS")]
    pub session_gone_status: Option<u16>,
    /// Sessions another worker adopts when their owner dies or drains: http (those of
    /// HTTP upstreams, the default) or never.
    #[arg(long, env = "MCPGW_ADOPT", value_enum)]
    pub adopt: Option<AdoptMode>,
    /// File of adoption keys (64 hex digits per line; the first seals) that seal
    /// upstream session ids in the directory.
    #[arg(long, env = "MCPGW_ADOPTION_KEY_FILE")]
    pub adoption_key_file: Option<PathBuf>,
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
    /// Trust domain of mesh identities (default mcpgw), as `mcpgw certs init` set it.
    #[arg(long, env = "MCPGW_MESH_TRUST_DOMAIN")]
    pub mesh_trust_domain: Option<String>,
    /// Milliseconds a mesh connection takes new requests before a fresh one replaces
    /// it (default 600000, ten minutes); owners close one still open at 1.5× this.
    #[arg(long, env = "MCPGW_MESH_MAX_CONNECTION_AGE_MS")]
    pub mesh_max_connection_age_ms: Option<u64>,
    /// Milliseconds between fallback checks of the mesh certificate files (default
    /// 10000; a file watcher sees most changes at once).
    #[arg(long, env = "MCPGW_MESH_CERT_RELOAD_INTERVAL_MS")]
    pub mesh_cert_reload_interval_ms: Option<u64>,
    /// Newest mesh protocol version to offer (default: the current one; the one
    /// before holds the fleet at the previous release's protocol during an upgrade).
    #[arg(long, env = "MCPGW_MESH_PROTOCOL_VERSION")]
    pub mesh_protocol_version: Option<u32>,
    /// Largest request body in bytes.
    #[arg(long, env = "MCPGW_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Upstream request timeout in milliseconds (time to the response head).
    #[arg(long, env = "MCPGW_UPSTREAM_TIMEOUT_MS")]
    pub upstream_timeout_ms: Option<u64>,
    /// Most live sessions per worker.
    #[arg(long, env = "MCPGW_MAX_SESSIONS")]
    pub max_sessions: Option<usize>,
    /// Most sessions per authenticated principal, fleet-wide; 0: no quota.
    #[arg(long, env = "MCPGW_MAX_SESSIONS_PER_PRINCIPAL")]
    pub max_sessions_per_principal: Option<usize>,
    /// Most sessions per client address in public mode, fleet-wide; 0 (default): no quota.
    #[arg(long, env = "MCPGW_MAX_SESSIONS_PER_CLIENT_ADDRESS")]
    pub max_sessions_per_client_address: Option<usize>,
    /// A session idle this long (no request, no held stream) ends, in milliseconds.
    #[arg(long, env = "MCPGW_SESSION_IDLE_TIMEOUT_MS")]
    pub session_idle_timeout_ms: Option<u64>,
    /// Client connections per worker; past it new connections get 503.
    #[arg(long, env = "MCPGW_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Time for a client to send a whole request body, in milliseconds; then 408.
    #[arg(long, env = "MCPGW_BODY_TIMEOUT_MS")]
    pub body_timeout_ms: Option<u64>,
    /// Deadline of each fleet directory (Redis) call, in milliseconds (default 500);
    /// past it ownership is unknown (503, retry).
    #[arg(long, env = "MCPGW_DIRECTORY_TIMEOUT_MS")]
    pub directory_timeout_ms: Option<u64>,
    /// On a drain, keep serving the public port this long (milliseconds, default 0)
    /// with /readyz at 503 and `Connection: close`, before it closes.
    #[arg(long, env = "MCPGW_DRAIN_DELAY_MS")]
    pub drain_delay_ms: Option<u64>,
    /// Bytes all replay logs of a worker keep at most (default 268435456, 256 MiB).
    #[arg(long, env = "MCPGW_REPLAY_BUDGET_BYTES")]
    pub replay_budget_bytes: Option<usize>,
    /// Bytes the replay logs of one session keep at most (default 4194304, 4 MiB).
    #[arg(long, env = "MCPGW_REPLAY_SESSION_BYTES")]
    pub replay_session_bytes: Option<usize>,
    /// Admin listener of worker 0 (worker i uses port + i; port 0 picks free ports).
    #[arg(long, env = "MCPGW_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// Log a line for every request, not only for failed ones.
    #[arg(long, env = "MCPGW_LOG_REQUESTS")]
    pub log_requests: bool,
    /// Export spans as OTLP/HTTP JSON to this traces endpoint
    /// (e.g. http://127.0.0.1:4318/v1/traces); off by default.
    #[arg(long, env = "MCPGW_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// CA bundle (PEM) for an https:// OTLP endpoint, instead of the platform's roots.
    #[arg(long, env = "MCPGW_OTLP_CA")]
    pub otlp_ca: Option<PathBuf>,
    /// Fraction of new traces to record, 0.0 to 1.0 (default 1.0); requests that carry
    /// a traceparent follow its sampled flag.
    #[arg(long, env = "MCPGW_OTLP_SAMPLE_RATIO")]
    pub otlp_sample_ratio: Option<f64>,
    /// Headers for every export request, `name=value,name=value` (a collector's API
    /// key); prefer the environment variable or the file to keep keys out of `ps`.
    #[arg(long, env = "MCPGW_OTLP_HEADERS", hide_env_values = true)]
    pub otlp_headers: Option<String>,
    /// Take the client address from X-Forwarded-For (only behind a proxy that sets it).
    #[arg(long, env = "MCPGW_TRUST_FORWARDED_FOR")]
    pub trust_forwarded_for: bool,
}

/// The TOML file's shape: every field optional, defaults fill the rest.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    trust_forwarded_for: Option<bool>,
    #[serde(default, rename = "upstream")]
    upstreams: Vec<FileUpstream>,
    #[serde(default, rename = "server")]
    servers: Vec<FileServer>,
    #[serde(default)]
    limits: FileLimits,
    #[serde(default)]
    fleet: FileFleet,
    #[serde(default)]
    mesh: FileMesh,
    #[serde(default)]
    auth: AuthConfig,
    #[serde(default)]
    admin: FileAdmin,
    #[serde(default)]
    telemetry: FileTelemetry,
}

/// One `[[upstream]]` table: `url` (http, https, or `stdio:COMMAND ARG…`) or
/// `command`, and the settings that go with each.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileUpstream {
    name: String,
    url: Option<String>,
    command: Option<FileCommand>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<PathBuf>,
    max_processes: Option<usize>,
    max_processes_per_principal: Option<usize>,
    max_session_lifetime_ms: Option<u64>,
    tls_ca: Option<PathBuf>,
    tls_client_cert: Option<PathBuf>,
    tls_client_key: Option<PathBuf>,
    #[serde(default)]
    legacy_only: bool,
}

/// One `[[server]]` table: a virtual server joining configured upstreams.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileServer {
    name: String,
    #[serde(default)]
    prefix: PrefixRule,
    separator: Option<String>,
    #[serde(default, rename = "member")]
    members: Vec<FileMember>,
}

/// One `[[server.member]]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileMember {
    upstream: String,
    prefix: Option<String>,
    #[serde(default)]
    tools: NameFilter,
    #[serde(default)]
    prompts: NameFilter,
    required: Option<bool>,
}

/// What a tool name may hold (the MCP spec's tool-name characters): prefixes and
/// separators must keep exposed names within it.
fn is_tool_name_text(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl FileServer {
    /// The server as a route, its members resolved against `upstreams` (the real
    /// upstreams: a virtual server is never a member).
    fn resolve(
        self,
        field: &str,
        upstreams: &[UpstreamConfig],
    ) -> Result<UpstreamConfig, ConfigError> {
        if upstreams.iter().any(|u| u.name == self.name) {
            return Err(invalid(
                &format!("{field}.name"),
                format!(
                    "{:?} is the name of an [[upstream]]: a virtual server needs a route name of its own",
                    self.name
                ),
            ));
        }
        let separator = self.separator.unwrap_or_else(|| "__".to_owned());
        if !is_tool_name_text(&separator) {
            return Err(invalid(
                &format!("{field}.separator"),
                format!(
                    "{separator:?} must be letters, digits, '_', '-' or '.' (tool names allow no other)"
                ),
            ));
        }
        if self.members.is_empty() {
            return Err(invalid(
                &format!("{field}.member"),
                "a virtual server needs at least one [[server.member]]",
            ));
        }
        let mut members: Vec<MemberConfig> = Vec::with_capacity(self.members.len());
        for (i, member) in self.members.into_iter().enumerate() {
            let member_field = format!("{field}.member[{i}]");
            let Some(index) = upstreams.iter().position(|u| u.name == member.upstream) else {
                let known: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
                return Err(invalid(
                    &format!("{member_field}.upstream"),
                    format!(
                        "{:?} is not a configured upstream (configured: {})",
                        member.upstream,
                        known.join(", ")
                    ),
                ));
            };
            if let Some(earlier) = members.iter().find(|m| m.index == index) {
                return Err(invalid(
                    &format!("{member_field}.upstream"),
                    format!("{:?} is a member twice", earlier.upstream),
                ));
            }
            let prefix = member.prefix.unwrap_or_else(|| member.upstream.clone());
            if !is_tool_name_text(&prefix) {
                return Err(invalid(
                    &format!("{member_field}.prefix"),
                    format!("{prefix:?} must be letters, digits, '_', '-' or '.'"),
                ));
            }
            members.push(MemberConfig {
                upstream: member.upstream,
                index,
                prefix,
                tools: member.tools,
                prompts: member.prompts,
                required: member.required.unwrap_or(true),
            });
        }
        check_exposed_names(field, self.prefix, &members)?;
        Ok(UpstreamConfig {
            name: self.name,
            target: UpstreamTarget::Virtual(VirtualServer {
                prefix: self.prefix,
                separator,
                members,
            }),
            legacy_only: false,
        })
    }
}

/// Refuses, at start, exposed names that would collide whatever the members list:
/// two members with one prefix (`always`, `conflicts`), or one exact name both
/// include (`never`). Names known only from the members' lists are resolved when
/// listed (`federation::names`).
fn check_exposed_names(
    field: &str,
    rule: PrefixRule,
    members: &[MemberConfig],
) -> Result<(), ConfigError> {
    for (i, member) in members.iter().enumerate() {
        for earlier in &members[..i] {
            let clash = match rule {
                PrefixRule::Always | PrefixRule::Conflicts => {
                    (earlier.prefix == member.prefix).then(|| format!("prefix {:?}", member.prefix))
                }
                PrefixRule::Never => member
                    .tools
                    .include
                    .iter()
                    .find(|name| !name.contains('*') && earlier.tools.include.contains(name))
                    .map(|name| format!("tool {name:?}")),
            };
            if let Some(clash) = clash {
                return Err(invalid(
                    &format!("{field}.member[{i}]"),
                    format!(
                        "members {:?} and {:?} both expose {clash}: their names would collide; \
                         give one a prefix of its own (or prefix = \"always\")",
                        earlier.upstream, member.upstream
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A stdio command as a list of words, or as one line split as a shell would.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FileCommand {
    Words(Vec<String>),
    Line(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTelemetry {
    otlp_endpoint: Option<String>,
    otlp_ca: Option<PathBuf>,
    otlp_sample_ratio: Option<f64>,
    otlp_headers: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAdmin {
    listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLimits {
    max_body_bytes: Option<usize>,
    upstream_connect_timeout_ms: Option<u64>,
    upstream_request_timeout_ms: Option<u64>,
    max_sessions: Option<usize>,
    max_sessions_per_principal: Option<usize>,
    max_sessions_per_client_address: Option<usize>,
    session_idle_timeout_ms: Option<u64>,
    max_sse_event_bytes: Option<usize>,
    max_connections: Option<usize>,
    body_timeout_ms: Option<u64>,
    drain_delay_ms: Option<u64>,
    max_header_bytes: Option<usize>,
    replay_budget_bytes: Option<usize>,
    replay_session_bytes: Option<usize>,
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
    sweep_interval_ms: Option<u64>,
    adopt: Option<AdoptMode>,
    adoption_key_file: Option<PathBuf>,
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
    protocol_version: Option<u32>,
    trust_domain: Option<String>,
    max_connection_age_ms: Option<u64>,
    cert_reload_interval_ms: Option<u64>,
}

impl Limits {
    fn validate(&self) -> Result<(), ConfigError> {
        for (field, zero) in [
            ("limits.max_body_bytes", self.max_body_bytes == 0),
            ("limits.max_sessions", self.max_sessions == 0),
            (
                "limits.session_idle_timeout_ms",
                self.session_idle_timeout.is_zero(),
            ),
            ("limits.body_timeout_ms", self.body_timeout.is_zero()),
            ("limits.max_connections", self.max_connections == 0),
            ("limits.max_sse_event_bytes", self.max_sse_event_bytes == 0),
        ] {
            if zero {
                return Err(invalid(field, "must be greater than 0"));
            }
        }
        if self.max_header_bytes < 8192 {
            return Err(invalid(
                "limits.max_header_bytes",
                "must be at least 8192 (HTTP/1.1 clients send several KiB of headers)",
            ));
        }
        if self.upstream_request_timeout.is_zero() {
            return Err(invalid(
                "limits.upstream_request_timeout_ms",
                "must be greater than 0",
            ));
        }
        Ok(())
    }

    /// The session quota of a quota key (see [`crate::request::Call::quota_key`]): by
    /// principal, or by client address in public mode; 0 means none.
    pub fn session_quota(&self, quota_key: &str) -> usize {
        if quota_key.starts_with("principal:") {
            self.max_sessions_per_principal
        } else if quota_key.starts_with("addr:") {
            self.max_sessions_per_client_address
        } else {
            0
        }
    }
}

impl Config {
    /// Builds the configuration from file, environment (already folded into `args` by
    /// clap) and flags, validates it, and checks that the files it names are there.
    /// What those files hold (keys, tokens, JWKS) is read by whoever uses them: the
    /// authenticator is built by `serve::run` before any worker starts.
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let mut file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        // Virtual servers join upstreams from flags as well as from the file.
        let servers = std::mem::take(&mut file.servers);
        let mut config = Config::default();
        config.apply_file(file)?;
        config.apply_args(args)?;
        config.add_virtual_servers(servers)?;
        config.validate()?;
        config.check_files()?;
        Ok(config)
    }

    fn apply_file(&mut self, file: FileConfig) -> Result<(), ConfigError> {
        if let Some(listen) = file.listen {
            self.listen = parse_addr("listen", &listen)?;
        }
        self.upstreams = file
            .upstreams
            .into_iter()
            .enumerate()
            .map(|(i, u)| u.resolve(&format!("upstream[{i}]")))
            .collect::<Result<_, _>>()?;
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
        set(
            &mut self.limits.max_sessions_per_principal,
            l.max_sessions_per_principal,
        );
        set(
            &mut self.limits.max_sessions_per_client_address,
            l.max_sessions_per_client_address,
        );
        set_ms(
            &mut self.limits.session_idle_timeout,
            l.session_idle_timeout_ms,
        );
        set(&mut self.limits.max_sse_event_bytes, l.max_sse_event_bytes);
        set(&mut self.limits.max_connections, l.max_connections);
        set_ms(&mut self.limits.body_timeout, l.body_timeout_ms);
        set_ms(&mut self.limits.drain_delay, l.drain_delay_ms);
        set(&mut self.limits.max_header_bytes, l.max_header_bytes);
        set(&mut self.limits.replay_budget_bytes, l.replay_budget_bytes);
        set(
            &mut self.limits.replay_session_bytes,
            l.replay_session_bytes,
        );
        set(&mut self.trust_forwarded_for, file.trust_forwarded_for);
        let telemetry = file.telemetry;
        set(&mut self.otlp_endpoint, telemetry.otlp_endpoint.map(Some));
        set(&mut self.otlp_ca, telemetry.otlp_ca.map(Some));
        set(&mut self.otlp_sample_ratio, telemetry.otlp_sample_ratio);
        set(
            &mut self.otlp_headers,
            telemetry.otlp_headers.map(OtlpHeaders),
        );
        if let Some(listen) = file.admin.listen {
            self.admin_listen = parse_addr("admin.listen", &listen)?;
        }
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
        if let Some(ms) = f.sweep_interval_ms {
            self.fleet.sweep_interval = Some(Duration::from_millis(ms));
        }
        set(&mut self.fleet.adopt, f.adopt);
        if f.adoption_key_file.is_some() {
            self.fleet.adoption_key_file = f.adoption_key_file;
        }
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
        self.auth = file.auth;
        let limits = &mut self.mesh.limits;
        set_ms(&mut limits.connect_timeout, m.connect_timeout_ms);
        set(&mut limits.max_frame, m.max_frame_bytes);
        set(&mut limits.max_in_flight_per_peer, m.max_in_flight_per_peer);
        set(&mut limits.max_streams_per_peer, m.max_streams_per_peer);
        set(&mut limits.tcp_pool_size, m.tcp_connections_per_peer);
        set(&mut limits.stream_window, m.stream_window_bytes);
        set(&mut limits.max_protocol_version, m.protocol_version);
        set_ms(&mut limits.max_connection_age, m.max_connection_age_ms);
        set(&mut self.mesh.trust_domain, m.trust_domain);
        set_ms(
            &mut self.mesh.cert_reload_interval,
            m.cert_reload_interval_ms,
        );
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
        set(&mut self.fleet.adopt, a.adopt);
        if a.adoption_key_file.is_some() {
            self.fleet.adoption_key_file = a.adoption_key_file.clone();
        }
        if a.stateless_when_unknown {
            self.fleet.stateless_when_unknown = true;
        }
        set_ms(&mut self.mesh.forward_timeout, a.forward_timeout_ms);
        self.auth.apply_args(&a.auth);
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
        set(&mut self.mesh.trust_domain, a.mesh_trust_domain.clone());
        set_ms(
            &mut self.mesh.limits.max_connection_age,
            a.mesh_max_connection_age_ms,
        );
        set_ms(
            &mut self.mesh.cert_reload_interval,
            a.mesh_cert_reload_interval_ms,
        );
        set(
            &mut self.mesh.limits.max_protocol_version,
            a.mesh_protocol_version,
        );
        set(&mut self.limits.max_body_bytes, a.max_body_bytes);
        set_ms(
            &mut self.limits.upstream_request_timeout,
            a.upstream_timeout_ms,
        );
        set(&mut self.limits.max_sessions, a.max_sessions);
        set(
            &mut self.limits.max_sessions_per_principal,
            a.max_sessions_per_principal,
        );
        set(
            &mut self.limits.max_sessions_per_client_address,
            a.max_sessions_per_client_address,
        );
        set_ms(
            &mut self.limits.session_idle_timeout,
            a.session_idle_timeout_ms,
        );
        set(&mut self.limits.max_connections, a.max_connections);
        set_ms(&mut self.limits.body_timeout, a.body_timeout_ms);
        set_ms(&mut self.fleet.directory_timeout, a.directory_timeout_ms);
        set_ms(&mut self.limits.drain_delay, a.drain_delay_ms);
        set(&mut self.limits.replay_budget_bytes, a.replay_budget_bytes);
        set(
            &mut self.limits.replay_session_bytes,
            a.replay_session_bytes,
        );
        if a.trust_forwarded_for {
            self.trust_forwarded_for = true;
        }
        set(&mut self.otlp_endpoint, a.otlp_endpoint.clone().map(Some));
        set(&mut self.otlp_ca, a.otlp_ca.clone().map(Some));
        set(&mut self.otlp_sample_ratio, a.otlp_sample_ratio);
        if let Some(list) = &a.otlp_headers {
            self.otlp_headers = OtlpHeaders::parse(list)?;
        }
        if a.log_requests {
            self.log_requests = true;
        }
        if let Some(listen) = &a.admin_listen {
            self.admin_listen = parse_addr("--admin-listen", listen)?;
        }
        Ok(())
    }

    /// Appends the `[[server]]` tables as routes after the upstreams they join.
    fn add_virtual_servers(&mut self, servers: Vec<FileServer>) -> Result<(), ConfigError> {
        let real = self.upstreams.len();
        for (i, server) in servers.into_iter().enumerate() {
            let route = server.resolve(&format!("server[{i}]"), &self.upstreams[..real])?;
            self.upstreams.push(route);
        }
        Ok(())
    }

    /// Checks the settings, each against the others. Pure: it reads no file and
    /// builds nothing, so a test can call it on any `Config`; what the settings name on
    /// disk is checked after it ([`Config::check_files`]), and the authenticator is
    /// built from the validated configuration by `serve`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_upstreams()?;
        self.limits.validate()?;
        self.validate_fleet()?;
        self.validate_mesh()?;
        self.validate_auth()?;
        self.validate_telemetry()
    }

    fn validate_upstreams(&self) -> Result<(), ConfigError> {
        if self.upstreams.is_empty() {
            return Err(invalid(
                "upstream",
                "no upstream configured: pass --upstream name=URL (or name=stdio:COMMAND) or add [[upstream]] to the file",
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
            check_upstream_target(&field, &upstream.target)?;
        }
        Ok(())
    }

    fn validate_fleet(&self) -> Result<(), ConfigError> {
        let fleet = &self.fleet;
        if fleet.workers == 0 || fleet.workers > 1024 {
            return Err(invalid("fleet.workers", "must be between 1 and 1024"));
        }
        if fleet.workers > 1 && fleet.redis_url.is_none() {
            return Err(invalid(
                "fleet.redis_url",
                "several workers need a shared directory: pass --redis redis://HOST:PORT",
            ));
        }
        if let Some(url) = &fleet.redis_url
            && !REDIS_SCHEMES.iter().any(|scheme| url.starts_with(scheme))
        {
            return Err(invalid(
                "fleet.redis_url",
                "must start with redis://, rediss://, redis+sentinel://, rediss+sentinel://, \
                 redis+cluster:// or rediss+cluster://",
            ));
        }
        if self.mesh.transport == MeshTransport::Redis
            && fleet
                .redis_url
                .as_deref()
                .is_some_and(|url| !url.starts_with("redis://") && !url.starts_with("rediss://"))
        {
            return Err(invalid(
                "mesh.transport",
                "the redis mesh transport (a benchmark baseline) needs a standalone Redis \
                 (redis:// or rediss://), not Sentinel or Cluster",
            ));
        }
        if fleet.worker_id.is_some() && fleet.workers != 1 {
            return Err(invalid(
                "fleet.worker_id",
                "a fixed worker id needs --workers 1 (ids must be unique)",
            ));
        }
        if let Some(id) = &fleet.worker_id
            && !valid_worker_id(id)
        {
            return Err(invalid(
                "fleet.worker_id",
                "use 1 to 64 letters, digits, '-', '_' or '.'",
            ));
        }
        if !matches!(fleet.gone_status, 404 | 409) {
            return Err(invalid(
                "fleet.gone_status",
                "must be 404 (MCP: re-initialize) or 409 (session reassigned)",
            ));
        }
        if fleet.lease < Duration::from_secs(1) {
            return Err(invalid("fleet.lease_ms", "must be at least 1000"));
        }
        if fleet.sweep_interval() < Duration::from_millis(100) {
            return Err(invalid("fleet.sweep_interval_ms", "must be at least 100"));
        }
        Ok(())
    }

    fn validate_mesh(&self) -> Result<(), ConfigError> {
        let mesh = &self.mesh;
        if mesh.transport == MeshTransport::Redis && self.fleet.redis_url.is_none() {
            return Err(invalid(
                "mesh.transport",
                "the redis mesh transport forwards through the fleet's Redis: pass --redis \
                 redis://HOST:PORT",
            ));
        }
        // The Redis transport has no mTLS; files given anyway are still checked (with
        // the others, in `check_files`).
        if self.fleet.redis_url.is_some() && mesh.transport != MeshTransport::Redis {
            for (field, value) in mesh.certificate_files() {
                if value.is_none() {
                    return Err(invalid(
                        field,
                        "a fleet (--redis) needs mesh certificates: pass --mesh-ca, \
                         --mesh-cert and --mesh-key (see `mcpgw certs`)",
                    ));
                }
            }
        }
        let limits = &mesh.limits;
        for (field, value) in [
            ("mesh.max_in_flight_per_peer", limits.max_in_flight_per_peer),
            ("mesh.max_streams_per_peer", limits.max_streams_per_peer),
            ("mesh.tcp_connections_per_peer", limits.tcp_pool_size),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        let spoken = mcpgw_wire::OLDEST_PROTOCOL_VERSION..=mcpgw_wire::PROTOCOL_VERSION;
        if !spoken.contains(&limits.max_protocol_version) {
            return Err(invalid(
                "mesh.protocol_version",
                format!(
                    "{} is not a version this build speaks: use {} (the current one) or {} \
                     (the one before, to hold the fleet at it during an upgrade)",
                    limits.max_protocol_version,
                    spoken.end(),
                    spoken.start()
                ),
            ));
        }
        if let Err(e) = mcpgw_certs::TrustDomain::new(&mesh.trust_domain) {
            return Err(invalid("mesh.trust_domain", e.to_string()));
        }
        if mesh.cert_reload_interval < Duration::from_millis(100) {
            return Err(invalid(
                "mesh.cert_reload_interval_ms",
                "must be at least 100 ms: each check reads and hashes the certificate files",
            ));
        }
        if limits.stream_window < 16 * 1024 {
            return Err(invalid(
                "mesh.stream_window_bytes",
                "must be at least 16 KiB (smaller windows cost a credit update every few events)",
            ));
        }
        if limits.max_frame < self.limits.max_body_bytes + 64 * 1024 {
            return Err(invalid(
                "mesh.max_frame_bytes",
                "must exceed limits.max_body_bytes by at least 64 KiB (a forwarded request carries the body)",
            ));
        }
        Ok(())
    }

    /// What of `[auth]` needs no key material; the keys, token and JWKS files are read
    /// when the authenticator is built.
    fn validate_auth(&self) -> Result<(), ConfigError> {
        let names: Vec<&str> = self.upstreams.iter().map(|u| u.name.as_str()).collect();
        self.auth
            .validate_shape(&names, self.fleet.redis_url.as_deref())?;
        let edge_auth = self
            .upstreams
            .iter()
            .any(|u| self.auth.mode_of(&u.name) != crate::auth::config::Mode::Public);
        if self.mesh.transport == MeshTransport::Redis && edge_auth {
            return Err(invalid(
                "mesh.transport",
                "the redis mesh transport is a benchmark baseline whose trust boundary is \
                 Redis itself (any Redis client could forge a forwarded request's identity), \
                 so it cannot be combined with edge authentication: use quic or tcp",
            ));
        }
        Ok(())
    }

    fn validate_telemetry(&self) -> Result<(), ConfigError> {
        if let Some(endpoint) = &self.otlp_endpoint {
            let parsed = endpoint.parse::<http::Uri>();
            let scheme_ok = endpoint.starts_with("http://") || endpoint.starts_with("https://");
            if !scheme_ok || parsed.is_err() {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    format!(
                        "{endpoint:?} is not an http:// or https:// URL: give the collector's \
                         OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces"
                    ),
                ));
            }
        }
        self.otlp_headers.header_map()?;
        if !(0.0..=1.0).contains(&self.otlp_sample_ratio) {
            return Err(invalid(
                "telemetry.otlp_sample_ratio",
                format!(
                    "{} is not a fraction: give a number from 0.0 (no new trace recorded) to \
                     1.0 (every one)",
                    self.otlp_sample_ratio
                ),
            ));
        }
        Ok(())
    }

    /// Checks that the files and directories the settings name are there: upstream TLS
    /// files and working directories, and in a fleet the mesh certificates. Run after
    /// [`Config::validate`]; it only looks (the files are read where they are used).
    pub fn check_files(&self) -> Result<(), ConfigError> {
        for (i, upstream) in self.upstreams.iter().enumerate() {
            let field = format!("upstream[{i}]");
            match &upstream.target {
                UpstreamTarget::Http { tls, .. } => {
                    for (what, path) in tls.files() {
                        if let Some(path) = path
                            && !path.is_file()
                        {
                            return Err(not_a_file(&format!("{field}.{what}"), path));
                        }
                    }
                }
                UpstreamTarget::Stdio(command) => {
                    if let Some(cwd) = &command.cwd
                        && !cwd.is_dir()
                    {
                        return Err(invalid(
                            &format!("{field}.cwd"),
                            format!("{} is not a directory", cwd.display()),
                        ));
                    }
                }
                UpstreamTarget::Virtual(_) => {}
            }
        }
        if self.fleet.redis_url.is_some() {
            for (field, path) in self.mesh.certificate_files() {
                if let Some(path) = path
                    && !path.is_file()
                {
                    return Err(not_a_file(field, path));
                }
            }
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

/// The Redis URL schemes the fleet directory accepts (see `mcpgw_mesh::redis_conn`).
pub(crate) const REDIS_SCHEMES: [&str; 6] = [
    "redis://",
    "rediss://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
];

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

/// `--upstream name=URL` or `--upstream name=stdio:COMMAND ARG…`.
fn parse_upstream_spec(spec: &str) -> Result<UpstreamConfig, ConfigError> {
    let Some((name, target)) = spec.split_once('=') else {
        return Err(invalid(
            "--upstream",
            format!(
                "{spec:?} must look like name=http://host:port/mcp or name=stdio:COMMAND ARG..."
            ),
        ));
    };
    let target = target.trim();
    let target = match target.strip_prefix("stdio:") {
        Some(line) => {
            let mut words = split_command("--upstream", line)?;
            let program = words.remove(0);
            UpstreamTarget::Stdio(StdioCommand {
                program,
                args: words,
                env: BTreeMap::new(),
                cwd: None,
                max_processes: DEFAULT_MAX_STDIO_PROCESSES,
                max_processes_per_principal: DEFAULT_MAX_STDIO_PROCESSES_PER_PRINCIPAL,
                max_session_lifetime: None,
            })
        }
        None => return Ok(UpstreamConfig::http(name.trim(), target)),
    };
    Ok(UpstreamConfig {
        name: name.trim().to_owned(),
        target,
        legacy_only: true,
    })
}

/// Splits a command line into words as a POSIX shell would (quotes, backslashes),
/// without running a shell: no variables, globs or pipes.
fn split_command(field: &str, line: &str) -> Result<Vec<String>, ConfigError> {
    let words = shlex::split(line).ok_or_else(|| {
        invalid(
            field,
            "the stdio command has an unterminated quote or a trailing backslash",
        )
    })?;
    if words.is_empty() {
        return Err(invalid(
            field,
            "the stdio command is empty: give the program and its arguments after stdio:",
        ));
    }
    Ok(words)
}

impl FileUpstream {
    fn resolve(self, field: &str) -> Result<UpstreamConfig, ConfigError> {
        let stdio_only = |what: &str, set: bool| -> Result<(), ConfigError> {
            if set {
                Err(invalid(
                    &format!("{field}.{what}"),
                    "applies to stdio upstreams only (command = ..., or url = \"stdio:...\")",
                ))
            } else {
                Ok(())
            }
        };
        let words = match (self.url, self.command) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    field,
                    "give either url (http, https or stdio:...) or command, not both",
                ));
            }
            (None, None) => {
                return Err(invalid(
                    field,
                    "needs url = \"http(s)://host/mcp\" or command = [\"program\", \"arg\", ...]",
                ));
            }
            (None, Some(FileCommand::Words(words))) => words,
            (None, Some(FileCommand::Line(line))) => {
                split_command(&format!("{field}.command"), &line)?
            }
            (Some(url), None) => match url.trim().strip_prefix("stdio:") {
                Some(line) => split_command(&format!("{field}.url"), line)?,
                None => {
                    stdio_only("args", !self.args.is_empty())?;
                    stdio_only("env", !self.env.is_empty())?;
                    stdio_only("cwd", self.cwd.is_some())?;
                    stdio_only("max_processes", self.max_processes.is_some())?;
                    stdio_only(
                        "max_processes_per_principal",
                        self.max_processes_per_principal.is_some(),
                    )?;
                    stdio_only(
                        "max_session_lifetime_ms",
                        self.max_session_lifetime_ms.is_some(),
                    )?;
                    return Ok(UpstreamConfig {
                        name: self.name,
                        target: UpstreamTarget::Http {
                            url: url.trim().to_owned(),
                            tls: UpstreamTls {
                                ca: self.tls_ca,
                                client_cert: self.tls_client_cert,
                                client_key: self.tls_client_key,
                            },
                        },
                        legacy_only: self.legacy_only,
                    });
                }
            },
        };
        for (what, set) in [
            ("tls_ca", self.tls_ca.is_some()),
            ("tls_client_cert", self.tls_client_cert.is_some()),
            ("tls_client_key", self.tls_client_key.is_some()),
        ] {
            if set {
                return Err(invalid(
                    &format!("{field}.{what}"),
                    "applies to https:// upstreams only",
                ));
            }
        }
        let mut words = words;
        words.extend(self.args);
        if words.first().is_none_or(|program| program.is_empty()) {
            return Err(invalid(
                &format!("{field}.command"),
                "is empty: give the program and its arguments",
            ));
        }
        let program = words.remove(0);
        Ok(UpstreamConfig {
            name: self.name,
            target: UpstreamTarget::Stdio(StdioCommand {
                program,
                args: words,
                env: self.env,
                cwd: self.cwd,
                max_processes: self.max_processes.unwrap_or(DEFAULT_MAX_STDIO_PROCESSES),
                max_processes_per_principal: self
                    .max_processes_per_principal
                    .unwrap_or(DEFAULT_MAX_STDIO_PROCESSES_PER_PRINCIPAL),
                // 0 is refused below, not read as "no limit".
                max_session_lifetime: self.max_session_lifetime_ms.map(Duration::from_millis),
            }),
            legacy_only: true,
        })
    }
}

fn check_upstream_target(field: &str, target: &UpstreamTarget) -> Result<(), ConfigError> {
    match target {
        UpstreamTarget::Http { url, tls } => {
            let https = check_upstream_url(&format!("{field}.url"), url)?;
            for (what, path) in tls.files() {
                if path.is_some() && !https {
                    return Err(invalid(
                        &format!("{field}.{what}"),
                        "applies to https:// upstreams only",
                    ));
                }
            }
            if tls.client_cert.is_some() != tls.client_key.is_some() {
                return Err(invalid(
                    &format!("{field}.tls_client_cert"),
                    "a client certificate needs both tls_client_cert and tls_client_key",
                ));
            }
        }
        UpstreamTarget::Stdio(command) => {
            if command.max_processes == 0 {
                return Err(invalid(
                    &format!("{field}.max_processes"),
                    "must be greater than 0",
                ));
            }
            if command.max_processes_per_principal == 0 {
                return Err(invalid(
                    &format!("{field}.max_processes_per_principal"),
                    "must be greater than 0 (set it to max_processes for no cap below that)",
                ));
            }
            if command.max_session_lifetime.is_some_and(|d| d.is_zero()) {
                return Err(invalid(
                    &format!("{field}.max_session_lifetime_ms"),
                    "must be greater than 0 (leave it out for no maximum lifetime)",
                ));
            }
            if let Some(bad) = command.env.keys().find(|k| k.is_empty() || k.contains('=')) {
                return Err(invalid(
                    &format!("{field}.env"),
                    format!("{bad:?} is not a valid environment variable name"),
                ));
            }
        }
        // Checked as its `[[server]]` table was read.
        UpstreamTarget::Virtual(_) => {}
    }
    Ok(())
}

fn not_a_file(field: &str, path: &Path) -> ConfigError {
    invalid(field, format!("{} is not a readable file", path.display()))
}

/// Checks an HTTP upstream URL; returns whether it is `https://`.
fn check_upstream_url(field: &str, url: &str) -> Result<bool, ConfigError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| invalid(field, format!("{url:?} is not a URL")))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => {
            return Err(invalid(
                field,
                format!("{url:?} must start with http://, https:// or stdio:"),
            ));
        }
    };
    if uri.host().is_none() {
        return Err(invalid(field, format!("{url:?} has no host")));
    }
    Ok(https)
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
    fn mesh_certificate_settings_and_the_otlp_endpoint_are_checked() {
        let mut a = args(&["demo=http://127.0.0.1:9000/mcp"]);
        a.otlp_endpoint = Some("grpc://collector:4317".into());
        let error = Config::load(&a).unwrap_err();
        assert_eq!(error.field, "telemetry.otlp_endpoint");
        a.otlp_endpoint = Some("http://127.0.0.1:4318/v1/traces".into());
        for bad in [-0.1, 1.5, f64::NAN] {
            a.otlp_sample_ratio = Some(bad);
            let error = Config::load(&a).unwrap_err();
            assert_eq!(error.field, "telemetry.otlp_sample_ratio", "{bad}");
        }
        a.otlp_sample_ratio = Some(0.25);
        a.mesh_trust_domain = Some("Prod Domain".into());
        assert_eq!(Config::load(&a).unwrap_err().field, "mesh.trust_domain");
        a.mesh_trust_domain = Some("prod.example".into());
        a.mesh_cert_reload_interval_ms = Some(10);
        assert_eq!(
            Config::load(&a).unwrap_err().field,
            "mesh.cert_reload_interval_ms"
        );
        a.mesh_cert_reload_interval_ms = None;
        a.mesh_max_connection_age_ms = Some(5_000);
        let config = Config::load(&a).unwrap();
        assert_eq!(config.mesh.trust_domain, "prod.example");
        assert_eq!(
            config.mesh.limits.max_connection_age,
            Duration::from_secs(5)
        );
        assert_eq!(
            config.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        assert_eq!(config.otlp_sample_ratio, 0.25);
        a.otlp_headers = Some("authorization=Bearer s3cret, x-tenant = blue".into());
        let config = Config::load(&a).unwrap();
        assert_eq!(config.otlp_headers.0["authorization"], "Bearer s3cret");
        assert_eq!(config.otlp_headers.0["x-tenant"], "blue");
        assert!(
            !format!("{config:?}").contains("s3cret"),
            "header values stay out of logs"
        );
        for bad in [
            "authorization Bearer s3cret",
            "authorization=Bearer\u{7f}s3cret",
        ] {
            a.otlp_headers = Some(bad.into());
            let error = Config::load(&a).unwrap_err();
            assert_eq!(error.field, "telemetry.otlp_headers", "{bad}");
            assert!(!error.problem.contains("s3cret"), "{}", error.problem);
        }
        a.otlp_headers = None;
        a.otlp_endpoint = Some("https://collector.example:4318/v1/traces".into());
        assert!(Config::load(&a).is_ok(), "https collectors are taken");
    }

    #[test]
    fn the_mesh_protocol_version_is_one_this_build_speaks() {
        let mut a = args(&["demo=http://127.0.0.1:9000/mcp"]);
        let config = Config::load(&a).unwrap();
        assert_eq!(
            config.mesh.limits.max_protocol_version,
            mcpgw_wire::PROTOCOL_VERSION
        );
        a.mesh_protocol_version = Some(mcpgw_wire::OLDEST_PROTOCOL_VERSION);
        let held = Config::load(&a).unwrap();
        assert_eq!(
            held.mesh.limits.max_protocol_version,
            mcpgw_wire::OLDEST_PROTOCOL_VERSION
        );
        for bad in [
            mcpgw_wire::OLDEST_PROTOCOL_VERSION - 1,
            mcpgw_wire::PROTOCOL_VERSION + 1,
        ] {
            a.mesh_protocol_version = Some(bad);
            let error = Config::load(&a).unwrap_err();
            assert_eq!(error.field, "mesh.protocol_version", "{bad}");
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
            (args(&["a=stdio:"]), "--upstream"),
            (args(&["a=stdio:python 'unterminated"]), "--upstream"),
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
    fn stdio_upstreams_split_like_a_shell_and_hold_sessions_for_modern_clients() {
        let config = Config::load(&args(&[
            "time=stdio:python3 -m mcp_server_time --local-timezone 'Europe/Paris' \"a b\"",
        ]))
        .unwrap();
        let UpstreamTarget::Stdio(command) = &config.upstreams[0].target else {
            panic!("a stdio upstream")
        };
        assert_eq!(command.program, "python3");
        assert_eq!(
            command.args,
            [
                "-m",
                "mcp_server_time",
                "--local-timezone",
                "Europe/Paris",
                "a b"
            ]
        );
        assert_eq!(command.max_processes, DEFAULT_MAX_STDIO_PROCESSES);
        assert!(config.upstreams[0].legacy_only);
        assert_eq!(config.upstreams[0].describe(), "stdio: python3");
        let http = Config::load(&args(&["web=https://example.com/mcp"])).unwrap();
        assert!(!http.upstreams[0].legacy_only);
    }

    fn load_file(text: &str) -> Result<Config, ConfigError> {
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-config-upstreams-{}-{}",
            std::process::id(),
            text.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mcpgw.toml");
        std::fs::write(&path, text).unwrap();
        let loaded = Config::load(&ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        });
        let _ = std::fs::remove_dir_all(&dir);
        loaded
    }

    #[test]
    fn upstream_tables_take_commands_tls_files_and_refuse_mixtures() {
        let readable = std::env::current_dir().unwrap().join("Cargo.toml");
        let readable = readable.display();
        let config = load_file(&format!(
            r#"
[[upstream]]
name = "tool"
command = ["server", "--flag"]
args = ["more"]
env = {{ API_KEY = "secret" }}
cwd = "/"
max_processes = 4

[[upstream]]
name = "line"
command = "server 'two words'"

[[upstream]]
name = "secure"
url = "https://example.com/mcp"
tls_ca = "{readable}"
tls_client_cert = "{readable}"
tls_client_key = "{readable}"

[[upstream]]
name = "old"
url = "http://127.0.0.1:1/mcp"
legacy_only = true
"#
        ))
        .unwrap();
        let UpstreamTarget::Stdio(tool) = &config.upstreams[0].target else {
            panic!("stdio")
        };
        assert_eq!(
            (tool.program.as_str(), tool.args.clone()),
            ("server", vec!["--flag".to_owned(), "more".to_owned()])
        );
        assert_eq!(tool.max_processes, 4);
        assert!(
            !format!("{tool:?}").contains("secret"),
            "environment values stay out of logs"
        );
        let UpstreamTarget::Stdio(line) = &config.upstreams[1].target else {
            panic!("stdio")
        };
        assert_eq!(line.args, ["two words"]);
        assert!(matches!(
            &config.upstreams[2].target,
            UpstreamTarget::Http { tls, .. } if tls.client_key.is_some()
        ));
        assert!(config.upstreams[3].legacy_only);

        let refused = [
            (
                "[[upstream]]\nname = \"a\"\nurl = \"http://x/mcp\"\ntls_ca = \"Cargo.toml\"\n",
                "upstream[0].tls_ca",
            ),
            (
                "[[upstream]]\nname = \"a\"\nurl = \"http://x/mcp\"\ncommand = [\"x\"]\n",
                "upstream[0]",
            ),
            (
                "[[upstream]]\nname = \"a\"\nurl = \"http://x/mcp\"\nenv = { A = \"b\" }\n",
                "upstream[0].env",
            ),
            (
                "[[upstream]]\nname = \"a\"\nurl = \"https://x/mcp\"\ntls_ca = \"/nonexistent/ca.pem\"\n",
                "upstream[0].tls_ca",
            ),
            (
                "[[upstream]]\nname = \"a\"\nurl = \"https://x/mcp\"\ntls_client_cert = \"Cargo.toml\"\n",
                "upstream[0].tls_client_cert",
            ),
            (
                "[[upstream]]\nname = \"a\"\ncommand = [\"x\"]\nmax_processes = 0\n",
                "upstream[0].max_processes",
            ),
            (
                "[[upstream]]\nname = \"a\"\ncommand = [\"x\"]\ntls_ca = \"Cargo.toml\"\n",
                "upstream[0].tls_ca",
            ),
            ("[[upstream]]\nname = \"a\"\n", "upstream[0]"),
        ];
        for (text, field) in refused {
            let err = load_file(text).expect_err(field);
            assert_eq!(err.field, field, "{text}: {err}");
        }
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

    #[test]
    fn server_tables_become_routes_and_bad_ones_are_refused_by_field() {
        let upstreams = "[[upstream]]\nname = \"demo\"\nurl = \"http://x/mcp\"\n\
                         [[upstream]]\nname = \"time\"\nurl = \"http://y/mcp\"\n";
        let load = |servers: &str| {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!(
                "mcpgw-config-servers-{}-{n}.toml",
                std::process::id()
            ));
            std::fs::write(&path, format!("{upstreams}{servers}")).unwrap();
            let loaded = Config::load(&ServeArgs {
                config: Some(path.clone()),
                ..ServeArgs::default()
            });
            let _ = std::fs::remove_file(&path);
            loaded
        };
        let config = load(
            "[[server]]\nname = \"all\"\n[[server.member]]\nupstream = \"demo\"\n\
             tools = { include = [\"echo\"] }\n[[server.member]]\nupstream = \"time\"\n\
             required = false\n",
        )
        .expect("a valid server");
        let route = &config.upstreams[2];
        assert_eq!(route.name, "all");
        let UpstreamTarget::Virtual(server) = &route.target else {
            panic!("a virtual server")
        };
        assert_eq!(server.prefix, PrefixRule::Always);
        assert_eq!(server.separator, "__");
        assert_eq!(server.members[0].prefix, "demo");
        assert_eq!(server.members[1].index, 1);
        assert!(server.members[0].required && !server.members[1].required);
        for (servers, field, words) in [
            (
                "[[server]]\nname = \"all\"\n[[server.member]]\nupstream = \"nope\"\n",
                "server[0].member[0].upstream",
                "not a configured upstream",
            ),
            (
                "[[server]]\nname = \"demo\"\n[[server.member]]\nupstream = \"time\"\n",
                "server[0].name",
                "name of an [[upstream]]",
            ),
            (
                "[[server]]\nname = \"all\"\nprefix = \"never\"\n[[server.member]]\n\
                 upstream = \"demo\"\ntools = { include = [\"echo\"] }\n[[server.member]]\n\
                 upstream = \"time\"\ntools = { include = [\"echo\"] }\n",
                "server[0].member[1]",
                "both expose tool \"echo\"",
            ),
            (
                "[[server]]\nname = \"all\"\nseparator = \"/\"\n[[server.member]]\nupstream = \"demo\"\n",
                "server[0].separator",
                "letters, digits",
            ),
            (
                "[[server]]\nname = \"all\"\n",
                "server[0].member",
                "at least one",
            ),
        ] {
            let err = load(servers).expect_err(field);
            assert_eq!(err.field, field, "{err}");
            assert!(err.problem.contains(words), "{err}");
        }
    }
}
