//! Validation of a built [`Config`]: pure checks, one function per section, then
//! [`Config::check_files`], which only looks for the files the settings name.

use super::*;
use mcpgw_mesh::REDIS_SCHEMES;

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
}

impl Config {
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
        if fleet
            .threads
            .is_some_and(|threads| threads == 0 || threads > 1024)
        {
            return Err(invalid("fleet.threads", "must be between 1 and 1024"));
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
        self.validate_mesh_transport()?;
        self.validate_mesh_peer_limits()?;
        self.validate_mesh_identity()?;
        self.validate_mesh_sizes()
    }

    /// The transport, the same-host path and what each needs.
    fn validate_mesh_transport(&self) -> Result<(), ConfigError> {
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
        if mesh.same_host == MeshSameHost::Unix && mesh.transport != MeshTransport::Tcp {
            return Err(invalid(
                "mesh.same_host",
                "the same-host path runs the TCP transport's framing over a Unix socket: \
                 use it with --mesh-transport tcp, or leave --mesh-same-host off",
            ));
        }
        if let Some(dir) = &mesh.socket_dir
            && !dir.is_absolute()
        {
            return Err(invalid(
                "mesh.socket_dir",
                "must be an absolute path (every worker resolves it alike)",
            ));
        }
        Ok(())
    }

    /// What one peer may hold open, and the protocol versions offered to it.
    fn validate_mesh_peer_limits(&self) -> Result<(), ConfigError> {
        let limits = &self.mesh.limits;
        for (field, value) in [
            ("mesh.max_in_flight_per_peer", limits.max_in_flight_per_peer),
            ("mesh.max_streams_per_peer", limits.max_streams_per_peer),
            (
                "mesh.max_handshakes_per_address",
                limits.max_handshakes_per_addr,
            ),
            ("mesh.max_handshakes", limits.max_handshakes),
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
        Ok(())
    }

    /// The trust domain of mesh identities, and how often their files are checked.
    fn validate_mesh_identity(&self) -> Result<(), ConfigError> {
        if let Err(e) = mcpgw_certs::TrustDomain::new(&self.mesh.trust_domain) {
            return Err(invalid("mesh.trust_domain", e.to_string()));
        }
        if self.mesh.cert_reload_interval < Duration::from_millis(100) {
            return Err(invalid(
                "mesh.cert_reload_interval_ms",
                "must be at least 100 ms: each check reads and hashes the certificate files",
            ));
        }
        Ok(())
    }

    /// Stream windows and frames, which must fit what a forwarded request carries.
    fn validate_mesh_sizes(&self) -> Result<(), ConfigError> {
        let limits = &self.mesh.limits;
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
