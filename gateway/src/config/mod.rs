//! Configuration: one typed struct, built in one place from a TOML file, environment
//! variables and command-line flags (flags win over environment, environment over the
//! file, the file over defaults). An invalid value is refused at start with the field
//! name and the problem.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use mcpgw_mesh::directory::DirectoryConfig;
use mcpgw_mesh::transport::MeshLimits;

use crate::auth::config::AuthConfig;

mod args;
pub(crate) mod error;
mod file;
mod validate;

pub use args::ServeArgs;
pub use error::ConfigError;
use error::invalid;

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
    /// What one member may put into one merged list, and what routing a URI may cost.
    pub merge: MergeLimits,
}

/// Bounds of a virtual server's merges (`[[server]]` keys of the same names): a
/// member's list is data from a peer, and one client's list or read must not cost a
/// worker without bound. The defaults serve real servers (a GitHub or filesystem
/// server lists hundreds to a few thousand items) with room to spare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergeLimits {
    /// Items one member may contribute to one merged list; past it the member's list
    /// is cut (its pages are no longer followed) and the answer says so in `_meta`.
    pub max_member_items: usize,
    /// The same in bytes (the items as JSON): a few huge items cost what many do.
    pub max_member_bytes: usize,
    /// Resource templates one member may contribute: every template is tried against
    /// a URI no member listed, so they bound what routing one read costs.
    pub max_member_templates: usize,
    /// A URI longer than this is routed by the URIs members listed only, never matched
    /// against templates (the match is linear in the URI's length per template).
    pub max_template_uri_bytes: usize,
    /// An unknown name or URI reads the members' lists again at most once per this
    /// interval per session (per list); within it the catalog's answer stands.
    pub unknown_refresh_interval: std::time::Duration,
}

impl Default for MergeLimits {
    fn default() -> Self {
        MergeLimits {
            max_member_items: 10_000,
            max_member_bytes: 8 * 1024 * 1024,
            max_member_templates: 1_000,
            max_template_uri_bytes: 2_048,
            unknown_refresh_interval: std::time::Duration::from_secs(2),
        }
    }
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
    /// Matched against resource URIs and resource templates as written (never
    /// renamed): what of the member's resources the server lists and reaches.
    pub resources: NameFilter,
    /// Initialize fails without this member (else the session opens without it).
    pub required: bool,
    /// How long a merged list waits for this member before it is returned without it
    /// (and says so); `None`: the upstream request timeout.
    pub list_timeout: Option<std::time::Duration>,
}

impl MemberConfig {
    /// How long a merged list waits for this member.
    pub fn list_deadline(&self, limits: &Limits) -> std::time::Duration {
        self.list_timeout
            .unwrap_or(limits.upstream_request_timeout)
            .min(limits.upstream_request_timeout)
    }
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
    /// Threads of each worker's async runtime. `None`: one per CPU the process may
    /// use. One thread answers sooner at low concurrency (no second thread to wake)
    /// and serves less under load (docs/performance.md); for several workers or
    /// containers sharing few cores.
    #[serde(default)]
    pub threads: Option<usize>,
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

/// Whether workers on one kernel also forward to each other without TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MeshSameHost {
    /// Every forward crosses the mesh transport (TLS over loopback TCP on one host).
    #[default]
    Off,
    /// A worker also serves a Unix socket, and a peer on the same kernel (same boot
    /// id, the socket reachable) and of the same user forwards over it: the TCP
    /// transport's framing, no TLS; the kernel vouches for the peer. TCP transport only.
    Unix,
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
    /// `max_streams_per_peer`, `max_handshakes_per_address` (`max_handshakes_per_addr`),
    /// `max_handshakes`, `tcp_connections_per_peer` (`tcp_pool_size`),
    /// `stream_window_bytes` (`stream_window`), `max_connection_age_ms` and
    /// `protocol_version` (`max_protocol_version`: the one before the current holds a
    /// fleet at the previous release's protocol while a rolling upgrade runs).
    pub limits: MeshLimits,
    /// The same-host path (off unless the operator allows it).
    pub same_host: MeshSameHost,
    /// Where each worker's same-host socket (`<worker id>.sock`) lives; `None`: see
    /// [`MeshConfig::socket_dir`].
    pub socket_dir: Option<PathBuf>,
}

impl MeshConfig {
    /// The directory of the same-host sockets: the one configured, else
    /// `$XDG_RUNTIME_DIR/mcpgw-mesh` (a per-user runtime directory), else
    /// `/tmp/mcpgw-mesh-<uid>`. Workers that should find each other must share it;
    /// the mesh refuses one that is not this user's own.
    pub fn socket_dir(&self) -> PathBuf {
        if let Some(dir) = &self.socket_dir {
            return dir.clone();
        }
        match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
            Some(runtime) if runtime.is_absolute() => runtime.join("mcpgw-mesh"),
            _ => std::env::temp_dir().join(format!("mcpgw-mesh-{}", nix::unistd::geteuid())),
        }
    }

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
                threads: None,
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
                same_host: MeshSameHost::Off,
                socket_dir: None,
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

impl Limits {
    /// The session quota of a quota key (see [`crate::auth::Authenticator::quota_key`]): by
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
    /// clap) and flags ([`Config::from_sources`]), validates it, and checks that the
    /// files it names are there. What those files hold (keys, tokens, JWKS) is read by
    /// whoever uses them: the authenticator is built by `serve::run` before any worker
    /// starts.
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let config = Config::from_sources(args)?;
        config.validate()?;
        config.check_files()?;
        Ok(config)
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

fn parse_addr(field: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse().map_err(|_| {
        invalid(
            field,
            format!("{text:?} is not an address like 127.0.0.1:8080"),
        )
    })
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
        assert_eq!(
            config.fleet.threads, None,
            "one thread per CPU unless asked"
        );
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
                    threads: Some(0),
                    ..args(&["a=http://x/mcp"])
                },
                "fleet.threads",
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
    fn the_same_host_path_is_off_by_default_and_needs_the_tcp_transport() {
        let plain = Config::load(&args(&["a=http://x/mcp"])).expect("defaults");
        assert_eq!(plain.mesh.same_host, MeshSameHost::Off);
        let on = |transport, dir: Option<&str>| ServeArgs {
            mesh_transport: Some(transport),
            mesh_same_host: Some(MeshSameHost::Unix),
            mesh_socket_dir: dir.map(PathBuf::from),
            ..args(&["a=http://x/mcp"])
        };
        let config = Config::load(&on(MeshTransport::Tcp, Some("/run/mcpgw"))).expect("tcp");
        assert_eq!(config.mesh.socket_dir(), PathBuf::from("/run/mcpgw"));
        let quic = Config::load(&on(MeshTransport::Quic, None)).unwrap_err();
        assert_eq!(quic.field, "mesh.same_host");
        let relative = Config::load(&on(MeshTransport::Tcp, Some("sockets"))).unwrap_err();
        assert_eq!(relative.field, "mesh.socket_dir");
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
        load_file_with(text, ServeArgs::default())
    }

    /// Loads `text` as the configuration file, with `args` as the flags.
    fn load_file_with(text: &str, args: ServeArgs) -> Result<Config, ConfigError> {
        // One folder per call: tests run in parallel, and two files of one length
        // (the name's former key) overwrote each other.
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-config-upstreams-{}-{}",
            std::process::id(),
            FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mcpgw.toml");
        std::fs::write(&path, text).unwrap();
        let loaded = Config::load(&ServeArgs {
            config: Some(path),
            ..args
        });
        let _ = std::fs::remove_dir_all(&dir);
        loaded
    }

    #[test]
    fn the_mesh_ports_handshake_caps_come_from_the_file_and_zero_is_refused() {
        let upstream = "[[upstream]]\nname = \"a\"\nurl = \"http://x/mcp\"\n";
        let defaults = load_file(upstream).unwrap();
        assert_eq!(defaults.mesh.limits.max_handshakes_per_addr, 64);
        assert_eq!(defaults.mesh.limits.max_handshakes, 1024);
        let raised = load_file(&format!(
            "[mesh]\nmax_handshakes_per_address = 256\nmax_handshakes = 4096\n\n{upstream}"
        ))
        .unwrap();
        assert_eq!(raised.mesh.limits.max_handshakes_per_addr, 256);
        assert_eq!(raised.mesh.limits.max_handshakes, 4096);
        for key in ["max_handshakes_per_address", "max_handshakes"] {
            let error = load_file(&format!("[mesh]\n{key} = 0\n\n{upstream}")).unwrap_err();
            assert_eq!(error.field, format!("mesh.{key}"));
            assert!(error.problem.contains("at least 1"), "{}", error.problem);
        }
    }

    #[test]
    fn threads_come_from_the_file_and_a_flag_overrides_them() {
        let text = "[fleet]\nthreads = 3\n\n[[upstream]]\nname = \"a\"\nurl = \"http://x/mcp\"\n";
        assert_eq!(load_file(text).unwrap().fleet.threads, Some(3));
        let flagged = load_file_with(
            text,
            ServeArgs {
                threads: Some(1),
                ..ServeArgs::default()
            },
        );
        assert_eq!(flagged.unwrap().fleet.threads, Some(1));
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
        assert_eq!(server.merge, MergeLimits::default());
        let config = load(
            "[[server]]\nname = \"all\"\nmax_member_items = 50000\nmax_member_bytes = 1024\n\
             max_member_templates = 3\nmax_template_uri_bytes = 64\nunknown_refresh_ms = 0\n\
             [[server.member]]\nupstream = \"demo\"\n",
        )
        .expect("a server with merge bounds");
        let UpstreamTarget::Virtual(server) = &config.upstreams[2].target else {
            panic!("a virtual server")
        };
        assert_eq!(
            server.merge,
            MergeLimits {
                max_member_items: 50_000,
                max_member_bytes: 1024,
                max_member_templates: 3,
                max_template_uri_bytes: 64,
                unknown_refresh_interval: std::time::Duration::ZERO,
            }
        );
        for (servers, field, words) in [
            (
                "[[server]]\nname = \"all\"\nmax_member_items = 0\n[[server.member]]\nupstream = \"demo\"\n",
                "server[0].max_member_items",
                "at least 1",
            ),
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
