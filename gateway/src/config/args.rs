//! `mcpgw serve`'s flags (each with its `MCPGW_*` environment variable, which clap
//! folds in) and how they apply over the file's values.

use clap::Args;

use super::file::split_command;
use super::*;
use crate::auth::config::AuthArgs;

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
    /// Threads of each worker's async runtime [default: one per CPU it may use].
    #[arg(long, env = "MCPGW_THREADS")]
    pub threads: Option<usize>,
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
    /// Same-host path (default off): `unix` lets workers on one kernel and of one user
    /// forward over a Unix socket, without TLS (TCP transport only).
    #[arg(long, env = "MCPGW_MESH_SAME_HOST", value_enum)]
    pub mesh_same_host: Option<MeshSameHost>,
    /// Directory of the same-host sockets (default $XDG_RUNTIME_DIR/mcpgw-mesh, else
    /// /tmp/mcpgw-mesh-<uid>); workers that should find each other share it.
    #[arg(long, env = "MCPGW_MESH_SOCKET_DIR")]
    pub mesh_socket_dir: Option<PathBuf>,
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
    #[arg(long, env = "MCPGW_DRAIN_DELAY_MS", long_help = crate::process::drain_delay_help())]
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

impl Config {
    /// Applies the flags (and their environment variables) over what the file set.
    pub(super) fn apply_args(&mut self, a: &ServeArgs) -> Result<(), ConfigError> {
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
        self.apply_fleet_args(a);
        self.auth.apply_args(&a.auth);
        self.apply_mesh_args(a)?;
        self.apply_limit_args(a);
        if a.trust_forwarded_for {
            self.trust_forwarded_for = true;
        }
        self.apply_telemetry_args(a)?;
        if let Some(listen) = &a.admin_listen {
            self.admin_listen = parse_addr("--admin-listen", listen)?;
        }
        Ok(())
    }

    fn apply_fleet_args(&mut self, a: &ServeArgs) {
        set(&mut self.fleet.workers, a.workers);
        set(&mut self.fleet.threads, a.threads.map(Some));
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
        set_ms(&mut self.fleet.directory_timeout, a.directory_timeout_ms);
    }

    fn apply_mesh_args(&mut self, a: &ServeArgs) -> Result<(), ConfigError> {
        set_ms(&mut self.mesh.forward_timeout, a.forward_timeout_ms);
        if let Some(listen) = &a.mesh_listen {
            self.mesh.listen = parse_addr("--mesh-listen", listen)?;
        }
        if a.mesh_advertise.is_some() {
            self.mesh.advertise = a.mesh_advertise.clone();
        }
        set(&mut self.mesh.transport, a.mesh_transport);
        set(&mut self.mesh.same_host, a.mesh_same_host);
        if a.mesh_socket_dir.is_some() {
            self.mesh.socket_dir = a.mesh_socket_dir.clone();
        }
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
        Ok(())
    }

    fn apply_limit_args(&mut self, a: &ServeArgs) {
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
        set_ms(&mut self.limits.drain_delay, a.drain_delay_ms);
        set(&mut self.limits.replay_budget_bytes, a.replay_budget_bytes);
        set(
            &mut self.limits.replay_session_bytes,
            a.replay_session_bytes,
        );
    }

    /// Telemetry: spans exported over OTLP, and request logging.
    fn apply_telemetry_args(&mut self, a: &ServeArgs) -> Result<(), ConfigError> {
        set(&mut self.otlp_endpoint, a.otlp_endpoint.clone().map(Some));
        set(&mut self.otlp_ca, a.otlp_ca.clone().map(Some));
        set(&mut self.otlp_sample_ratio, a.otlp_sample_ratio);
        if let Some(list) = &a.otlp_headers {
            self.otlp_headers = OtlpHeaders::parse(list)?;
        }
        if a.log_requests {
            self.log_requests = true;
        }
        Ok(())
    }
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
