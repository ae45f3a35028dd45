//! The TOML file's shape (every key optional) and how it applies over the defaults;
//! `[[upstream]]` and `[[server]]` tables are resolved into routes here.

use super::*;

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
    max_member_items: Option<usize>,
    max_member_bytes: Option<usize>,
    max_member_templates: Option<usize>,
    max_template_uri_bytes: Option<usize>,
    unknown_refresh_ms: Option<u64>,
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
    #[serde(default)]
    resources: NameFilter,
    required: Option<bool>,
    list_timeout_ms: Option<u64>,
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
        let merge = self.merge_limits(field)?;
        let separator = resolve_separator(field, self.separator)?;
        let members = resolve_members(field, self.members, upstreams)?;
        check_exposed_names(field, self.prefix, &members)?;
        Ok(UpstreamConfig {
            name: self.name,
            target: UpstreamTarget::Virtual(VirtualServer {
                prefix: self.prefix,
                separator,
                members,
                merge,
            }),
            legacy_only: false,
        })
    }
}

impl FileServer {
    /// The server's merge bounds over the defaults; a bound of 0 is refused (it would
    /// list nothing: leave the key out for the default).
    fn merge_limits(&self, field: &str) -> Result<MergeLimits, ConfigError> {
        let defaults = MergeLimits::default();
        let at_least_one = |key: &str, value: Option<usize>, default: usize| match value {
            Some(0) => Err(invalid(
                &format!("{field}.{key}"),
                format!("must be at least 1; leave it out for the default, {default}"),
            )),
            value => Ok(value.unwrap_or(default)),
        };
        Ok(MergeLimits {
            max_member_items: at_least_one(
                "max_member_items",
                self.max_member_items,
                defaults.max_member_items,
            )?,
            max_member_bytes: at_least_one(
                "max_member_bytes",
                self.max_member_bytes,
                defaults.max_member_bytes,
            )?,
            max_member_templates: at_least_one(
                "max_member_templates",
                self.max_member_templates,
                defaults.max_member_templates,
            )?,
            max_template_uri_bytes: at_least_one(
                "max_template_uri_bytes",
                self.max_template_uri_bytes,
                defaults.max_template_uri_bytes,
            )?,
            unknown_refresh_interval: self.unknown_refresh_ms.map_or(
                defaults.unknown_refresh_interval,
                std::time::Duration::from_millis,
            ),
        })
    }
}

/// The separator between a member's prefix and its names: `__` unless set, and it
/// must keep exposed names within a tool name's characters.
fn resolve_separator(field: &str, separator: Option<String>) -> Result<String, ConfigError> {
    let separator = separator.unwrap_or_else(|| "__".to_owned());
    if !is_tool_name_text(&separator) {
        return Err(invalid(
            &format!("{field}.separator"),
            format!(
                "{separator:?} must be letters, digits, '_', '-' or '.' (tool names allow no other)"
            ),
        ));
    }
    Ok(separator)
}

/// The `[[server.member]]` tables, each resolved to the upstream it names; a member
/// names an upstream once.
fn resolve_members(
    field: &str,
    members: Vec<FileMember>,
    upstreams: &[UpstreamConfig],
) -> Result<Vec<MemberConfig>, ConfigError> {
    if members.is_empty() {
        return Err(invalid(
            &format!("{field}.member"),
            "a virtual server needs at least one [[server.member]]",
        ));
    }
    let mut resolved: Vec<MemberConfig> = Vec::with_capacity(members.len());
    for (i, member) in members.into_iter().enumerate() {
        let member_field = format!("{field}.member[{i}]");
        let index = member_upstream(&member_field, &member.upstream, upstreams)?;
        if let Some(earlier) = resolved.iter().find(|m| m.index == index) {
            return Err(invalid(
                &format!("{member_field}.upstream"),
                format!("{:?} is a member twice", earlier.upstream),
            ));
        }
        resolved.push(member.resolve(field, &member_field, index)?);
    }
    Ok(resolved)
}

/// The index among `upstreams` of the one a member names.
fn member_upstream(
    member_field: &str,
    name: &str,
    upstreams: &[UpstreamConfig],
) -> Result<usize, ConfigError> {
    upstreams
        .iter()
        .position(|u| u.name == name)
        .ok_or_else(|| {
            let known: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
            invalid(
                &format!("{member_field}.upstream"),
                format!(
                    "{name:?} is not a configured upstream (configured: {})",
                    known.join(", ")
                ),
            )
        })
}

impl FileMember {
    /// The member as configured, its upstream at `index`; `field` is the server's.
    fn resolve(
        self,
        field: &str,
        member_field: &str,
        index: usize,
    ) -> Result<MemberConfig, ConfigError> {
        let prefix = self.prefix.unwrap_or_else(|| self.upstream.clone());
        if !is_tool_name_text(&prefix) {
            return Err(invalid(
                &format!("{member_field}.prefix"),
                format!("{prefix:?} must be letters, digits, '_', '-' or '.'"),
            ));
        }
        let list_timeout = match self.list_timeout_ms {
            Some(0) => {
                return Err(invalid(
                    &format!("{field}.member.list_timeout_ms"),
                    "must be at least 1 (milliseconds); leave it out to wait the \
                     upstream request timeout",
                ));
            }
            ms => ms.map(std::time::Duration::from_millis),
        };
        Ok(MemberConfig {
            upstream: self.upstream,
            index,
            prefix,
            tools: self.tools,
            prompts: self.prompts,
            resources: self.resources,
            required: self.required.unwrap_or(true),
            list_timeout,
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
    threads: Option<usize>,
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
    same_host: Option<MeshSameHost>,
    socket_dir: Option<PathBuf>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    forward_timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    max_frame_bytes: Option<usize>,
    max_in_flight_per_peer: Option<usize>,
    max_streams_per_peer: Option<usize>,
    max_handshakes_per_address: Option<usize>,
    max_handshakes: Option<usize>,
    tcp_connections_per_peer: Option<usize>,
    stream_window_bytes: Option<usize>,
    protocol_version: Option<u32>,
    trust_domain: Option<String>,
    max_connection_age_ms: Option<u64>,
    cert_reload_interval_ms: Option<u64>,
}

impl Config {
    /// The configuration the file, environment and flags describe, over the defaults
    /// (flags win over environment, environment over the file); not yet validated.
    pub(super) fn from_sources(args: &ServeArgs) -> Result<Config, ConfigError> {
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
        self.apply_file_limits(file.limits);
        set(&mut self.trust_forwarded_for, file.trust_forwarded_for);
        self.apply_file_telemetry(file.telemetry);
        if let Some(listen) = file.admin.listen {
            self.admin_listen = parse_addr("admin.listen", &listen)?;
        }
        self.apply_file_fleet(file.fleet);
        self.apply_file_mesh(file.mesh)?;
        self.auth = file.auth;
        Ok(())
    }

    /// `[limits]`.
    fn apply_file_limits(&mut self, l: FileLimits) {
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
    }

    /// `[telemetry]`.
    fn apply_file_telemetry(&mut self, telemetry: FileTelemetry) {
        set(&mut self.otlp_endpoint, telemetry.otlp_endpoint.map(Some));
        set(&mut self.otlp_ca, telemetry.otlp_ca.map(Some));
        set(&mut self.otlp_sample_ratio, telemetry.otlp_sample_ratio);
        set(
            &mut self.otlp_headers,
            telemetry.otlp_headers.map(OtlpHeaders),
        );
    }

    /// `[fleet]`.
    fn apply_file_fleet(&mut self, f: FileFleet) {
        set(&mut self.fleet.workers, f.workers);
        set(&mut self.fleet.threads, f.threads.map(Some));
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
    }

    /// `[mesh]`: where workers meet, with which certificates, and the limits of a
    /// peer's connections.
    fn apply_file_mesh(&mut self, m: FileMesh) -> Result<(), ConfigError> {
        if let Some(listen) = m.listen {
            self.mesh.listen = parse_addr("mesh.listen", &listen)?;
        }
        if m.advertise.is_some() {
            self.mesh.advertise = m.advertise;
        }
        set(&mut self.mesh.transport, m.transport);
        set(&mut self.mesh.same_host, m.same_host);
        if m.socket_dir.is_some() {
            self.mesh.socket_dir = m.socket_dir;
        }
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
        let limits = &mut self.mesh.limits;
        set_ms(&mut limits.connect_timeout, m.connect_timeout_ms);
        set(&mut limits.max_frame, m.max_frame_bytes);
        set(&mut limits.max_in_flight_per_peer, m.max_in_flight_per_peer);
        set(&mut limits.max_streams_per_peer, m.max_streams_per_peer);
        set(
            &mut limits.max_handshakes_per_addr,
            m.max_handshakes_per_address,
        );
        set(&mut limits.max_handshakes, m.max_handshakes);
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

    /// Appends the `[[server]]` tables as routes after the upstreams they join.
    fn add_virtual_servers(&mut self, servers: Vec<FileServer>) -> Result<(), ConfigError> {
        let real = self.upstreams.len();
        for (i, server) in servers.into_iter().enumerate() {
            let route = server.resolve(&format!("server[{i}]"), &self.upstreams[..real])?;
            self.upstreams.push(route);
        }
        Ok(())
    }
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

/// Splits a command line into words as a POSIX shell would (quotes, backslashes),
/// without running a shell: no variables, globs or pipes.
pub(super) fn split_command(field: &str, line: &str) -> Result<Vec<String>, ConfigError> {
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
    fn resolve(mut self, field: &str) -> Result<UpstreamConfig, ConfigError> {
        let words = match (self.url.take(), self.command.take()) {
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
                None => return self.into_http(field, url.trim()),
            },
        };
        self.into_stdio(field, words)
    }

    /// An http(s) upstream: the stdio settings would be silently ignored, so they are
    /// refused.
    fn into_http(self, field: &str, url: &str) -> Result<UpstreamConfig, ConfigError> {
        for (what, set) in [
            ("args", !self.args.is_empty()),
            ("env", !self.env.is_empty()),
            ("cwd", self.cwd.is_some()),
            ("max_processes", self.max_processes.is_some()),
            (
                "max_processes_per_principal",
                self.max_processes_per_principal.is_some(),
            ),
            (
                "max_session_lifetime_ms",
                self.max_session_lifetime_ms.is_some(),
            ),
        ] {
            if set {
                return Err(invalid(
                    &format!("{field}.{what}"),
                    "applies to stdio upstreams only (command = ..., or url = \"stdio:...\")",
                ));
            }
        }
        Ok(UpstreamConfig {
            name: self.name,
            target: UpstreamTarget::Http {
                url: url.to_owned(),
                tls: UpstreamTls {
                    ca: self.tls_ca,
                    client_cert: self.tls_client_cert,
                    client_key: self.tls_client_key,
                },
            },
            legacy_only: self.legacy_only,
        })
    }

    /// A stdio upstream running `words` then `args`: the TLS settings would be
    /// silently ignored, so they are refused.
    fn into_stdio(
        self,
        field: &str,
        mut words: Vec<String>,
    ) -> Result<UpstreamConfig, ConfigError> {
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
