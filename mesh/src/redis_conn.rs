//! Redis connection plumbing shared by the directory and the Redis baseline transport:
//! opening a client from a URL, waiting for a Redis that is still starting, building
//! the self-reconnecting connection manager, and keeping passwords out of every text
//! that leaves this crate.
//!
//! Both users need the same guarantees: an unparsable URL is reported without quoting
//! it (the parse error may echo a password), every error text is scrubbed of the
//! password, and a first connection is bounded by a deadline.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::{ConnectionAddr, IntoConnectionInfo, ProtocolVersion, RedisConnectionInfo};
use tokio::time::{Instant, sleep, timeout_at};

/// The Redis URL schemes [`RedisEndpoint`] and the directory open: plain and TLS, one
/// server, Sentinel or Cluster.
pub const REDIS_SCHEMES: [&str; 6] = [
    "redis://",
    "rediss://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
];

/// Pause between attempts of a first connection to a Redis that is not answering yet.
const CONNECT_RETRY: Duration = Duration::from_millis(100);

/// URL schemes that name a Redis Sentinel deployment rather than one server.
const SENTINEL_SCHEME: &str = "redis+sentinel://";
const SENTINEL_TLS_SCHEME: &str = "rediss+sentinel://";
/// URL schemes that name a Redis Cluster by some of its nodes.
const CLUSTER_SCHEME: &str = "redis+cluster://";
const CLUSTER_TLS_SCHEME: &str = "rediss+cluster://";

/// What a Redis URL names: one server, or a primary found through Sentinel.
#[derive(Clone)]
pub(crate) enum RedisTarget {
    /// `redis://`, `rediss://`, `redis+unix://`: that server.
    Standalone(redis::Client),
    /// `redis+sentinel://`: whichever server the sentinels name as primary.
    Sentinel(SentinelSpec),
    /// `redis+cluster://`: whichever primary serves the slot of the caller's keys.
    Cluster(ClusterSpec),
}

/// A parsed `redis+cluster://[user:password@]host:port[,host:port...][/]` URL: seed
/// nodes to ask which node serves a slot, and the credentials of every node.
#[derive(Clone)]
pub(crate) struct ClusterSpec {
    pub(crate) seeds: Vec<(String, u16)>,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    /// `rediss+cluster://`: TLS to every node.
    pub(crate) tls: Option<Tls>,
}

impl ClusterSpec {
    pub(crate) fn secrets(&self) -> Vec<String> {
        self.password
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect()
    }
}

/// A parsed `redis+sentinel://[user:password@]host:port[,host:port...]/<primary
/// name>[/<db>][?sentinel_password=...]` URL. The user and password are the data
/// servers'; `sentinel_password` is the sentinels' own (`requirepass` in
/// sentinel.conf), when they have one.
#[derive(Clone)]
pub(crate) struct SentinelSpec {
    pub(crate) sentinels: Vec<(String, u16)>,
    pub(crate) name: String,
    pub(crate) db: i64,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) sentinel_password: Option<String>,
    /// `rediss+sentinel://`: TLS to the sentinels and to the data servers alike.
    pub(crate) tls: Option<Tls>,
}

/// TLS to Redis, for the `rediss` schemes. The URL's query names the files, with the
/// names redis-py uses: `ssl_ca_certs` (PEM roots trusted instead of the system's),
/// `ssl_certfile` and `ssl_keyfile` (a client certificate and its key, for servers
/// with `tls-auth-clients yes`). They are read once, when the URL is parsed: a worker
/// that must trust a new CA is restarted (rolled) after the file changed.
#[derive(Clone, Default)]
pub(crate) struct Tls {
    certificates: Option<redis::TlsCertificates>,
}

/// The TLS files a URL's query names.
#[derive(Default)]
struct TlsFiles {
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

impl TlsFiles {
    /// Takes `name=value` if it names a TLS file; `Ok(false)` if it is no TLS parameter.
    fn take(&mut self, name: &str, value: &str) -> Result<bool, String> {
        let slot = match name {
            "ssl_ca_certs" => &mut self.ca,
            "ssl_certfile" => &mut self.cert,
            "ssl_keyfile" => &mut self.key,
            _ => return Ok(false),
        };
        let path =
            percent_decode(value).ok_or_else(|| format!("bad percent-encoding in {name}"))?;
        if path.is_empty() {
            return Err(format!("{name} is empty"));
        }
        *slot = Some(path);
        Ok(true)
    }

    fn any(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }

    /// Reads the files (for a `rediss` URL).
    fn load(self) -> Result<Tls, String> {
        let read = |name: &str, path: &str| {
            std::fs::read(path).map_err(|e| format!("cannot read {name} file {path}: {e}"))
        };
        let root_cert = self
            .ca
            .as_deref()
            .map(|p| read("ssl_ca_certs", p))
            .transpose()?;
        let client_tls = match (self.cert, self.key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read("ssl_certfile", &cert)?,
                client_key: read("ssl_keyfile", &key)?,
            }),
            _ => return Err("ssl_certfile and ssl_keyfile go together".into()),
        };
        let certificates =
            (root_cert.is_some() || client_tls.is_some()).then_some(redis::TlsCertificates {
                client_tls,
                root_cert,
            });
        Ok(Tls { certificates })
    }
}

impl SentinelSpec {
    /// The passwords in this URL, for scrubbing.
    pub(crate) fn secrets(&self) -> Vec<String> {
        self.password
            .iter()
            .chain(self.sentinel_password.iter())
            .filter(|p| !p.is_empty())
            .cloned()
            .collect()
    }
}

/// The primary a lookup through the sentinels reached, checked to call itself master.
pub(crate) struct Primary {
    /// A client for it, carrying the data servers' credentials and db.
    pub(crate) client: redis::Client,
    /// `host:port`, as the sentinels named it.
    pub(crate) addr: String,
    /// Its `master_replid`: a promoted replica takes a new one, so a change means a
    /// failover (and writes the old primary had not replicated may be gone).
    pub(crate) replid: String,
    /// Its replicas, `host:port`, from `INFO replication`.
    pub(crate) replicas: Vec<String>,
}

/// Parses any Redis URL the gateway accepts. Errors never quote the URL's secrets.
pub(crate) fn parse_target(url: &str, tcp: Option<TcpSettings>) -> Result<RedisTarget, String> {
    let under = |plain: &str, tls: &str| {
        url.strip_prefix(plain)
            .map(|rest| (rest, false))
            .or_else(|| url.strip_prefix(tls).map(|rest| (rest, true)))
    };
    if let Some((rest, tls)) = under(CLUSTER_SCHEME, CLUSTER_TLS_SCHEME) {
        return parse_cluster(rest, tls)
            .map(RedisTarget::Cluster)
            .map_err(|why| {
                format!(
                    "Redis URL {} does not parse: {why}; expected \
                     redis+cluster://[user:password@]host:port[,host:port...] (rediss+cluster:// \
                     for TLS, with ?ssl_ca_certs=...)",
                    redact_url(url)
                )
            });
    }
    if let Some((rest, tls)) = under(SENTINEL_SCHEME, SENTINEL_TLS_SCHEME) {
        return parse_sentinel(rest, tls)
            .map(RedisTarget::Sentinel)
            .map_err(|why| {
                format!(
                    "Redis URL {} does not parse: {why}; expected \
                     redis+sentinel://[user:password@]host:port[,host:port...]/<primary name>[/<db>]\
                     [?sentinel_password=...] (rediss+sentinel:// for TLS, with ?ssl_ca_certs=...)",
                    redact_url(url)
                )
            });
    }
    open_client(url, tcp).map(RedisTarget::Standalone)
}

/// Splits `rest` at its query, and takes the TLS files out of it (allowed only with
/// `tls`); the other parameters are given to `other`.
fn split_query(
    rest: &str,
    tls: bool,
    mut other: impl FnMut(&str, &str) -> Result<(), String>,
) -> Result<(&str, Option<Tls>), String> {
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, q),
        None => (rest, ""),
    };
    let mut files = TlsFiles::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if !files.take(name, value)? {
            other(name, value)?;
        }
    }
    if !tls && files.any() {
        return Err("ssl_ca_certs, ssl_certfile and ssl_keyfile need a rediss scheme".into());
    }
    let tls = if tls { Some(files.load()?) } else { None };
    Ok((rest, tls))
}

fn parse_cluster(rest: &str, tls: bool) -> Result<ClusterSpec, String> {
    let (rest, tls) = split_query(rest, tls, |_, _| {
        Err("unknown query parameter (only ssl_ca_certs, ssl_certfile, ssl_keyfile)".into())
    })?;
    let authority = match rest.split_once('/') {
        Some((authority, "")) => authority,
        Some(_) => return Err("a cluster has no database or primary name in its path".into()),
        None => rest,
    };
    let (username, password, hosts) = split_userinfo(authority)?;
    Ok(ClusterSpec {
        seeds: parse_hosts(hosts, "node")?,
        username,
        password,
        tls,
    })
}

type UserInfo<'a> = (Option<String>, Option<String>, &'a str);

/// `[user[:password]@]hosts` with percent-decoded user and password.
fn split_userinfo(authority: &str) -> Result<UserInfo<'_>, &'static str> {
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let (username, password) = match userinfo {
        None => (None, None),
        Some(u) => {
            let (user, pass) = match u.split_once(':') {
                Some((user, pass)) => (user, Some(pass)),
                None => (u, None),
            };
            let user = percent_decode(user).ok_or("bad percent-encoding in the user")?;
            let pass = pass
                .map(|p| percent_decode(p).ok_or("bad percent-encoding in the password"))
                .transpose()?;
            ((!user.is_empty()).then_some(user), pass)
        }
    };
    Ok((username, password, hosts))
}

/// `host:port[,host:port...]`; `what` names a host in errors.
fn parse_hosts(hosts: &str, what: &'static str) -> Result<Vec<(String, u16)>, &'static str> {
    let mut out = Vec::new();
    for host in hosts.split(',') {
        let (h, port) = host.rsplit_once(':').ok_or(match what {
            "node" => "a node without a port",
            _ => "a sentinel without a port",
        })?;
        let port: u16 = port.parse().map_err(|_| match what {
            "node" => "a node port is not a number",
            _ => "a sentinel port is not a number",
        })?;
        let h = h.trim_start_matches('[').trim_end_matches(']');
        if h.is_empty() || port == 0 {
            return Err(match what {
                "node" => "an empty node address",
                _ => "an empty sentinel address",
            });
        }
        out.push((h.to_owned(), port));
    }
    Ok(out)
}

fn parse_sentinel(rest: &str, tls: bool) -> Result<SentinelSpec, String> {
    let mut sentinel_password = None;
    let (rest, tls) = split_query(rest, tls, |name, value| match name {
        "sentinel_password" => {
            sentinel_password =
                Some(percent_decode(value).ok_or("bad percent-encoding in sentinel_password")?);
            Ok(())
        }
        _ => Err(
            "unknown query parameter (only sentinel_password, ssl_ca_certs, \
                  ssl_certfile, ssl_keyfile)"
                .into(),
        ),
    })?;
    let (authority, path) = rest.split_once('/').ok_or("no primary name")?;
    let (username, password, hosts) = split_userinfo(authority)?;
    let sentinels = parse_hosts(hosts, "sentinel")?;
    let mut segments = path.split('/');
    let name = segments.next().unwrap_or("");
    if name.is_empty() {
        return Err("no primary name".into());
    }
    let name = percent_decode(name).ok_or("bad percent-encoding in the primary name")?;
    let db = match segments.next() {
        None | Some("") => 0,
        Some(db) => db.parse().map_err(|_| "the db is not a number")?,
    };
    if segments.next().is_some() {
        return Err("too many path segments".into());
    }
    Ok(SentinelSpec {
        sentinels,
        name,
        db,
        username,
        password,
        sentinel_password,
        tls,
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Asks the sentinels, in order, which server is primary for the spec's name, then
/// connects to it and checks that it calls itself master (a server the sentinels
/// still name while it is being demoted is refused). `op_timeout` bounds each step.
/// The error is scrubbed of both passwords.
pub(crate) async fn resolve_primary(
    spec: &SentinelSpec,
    op_timeout: Duration,
    tcp: Option<TcpSettings>,
) -> Result<Primary, String> {
    let secrets = spec.secrets();
    let clean = |text: String| scrub_all(&text, &secrets);
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout));
    let mut last_error = String::from("no sentinel answered");
    for (host, port) in &spec.sentinels {
        let mut settings = RedisConnectionInfo::default();
        if let Some(p) = &spec.sentinel_password {
            settings = settings.set_password(p);
        }
        let asked = async {
            let client = node_client(host, *port, settings, spec.tls.as_ref(), None)?;
            let mut c = client
                .get_multiplexed_async_connection_with_config(&cfg)
                .await?;
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&spec.name)
                .query_async::<Option<(String, u16)>>(&mut c)
                .await
        };
        let (phost, pport) = match tokio::time::timeout(op_timeout * 2, asked).await {
            Ok(Ok(Some(addr))) => addr,
            Ok(Ok(None)) => {
                last_error = format!(
                    "sentinel {host}:{port} knows no primary named {:?}",
                    spec.name
                );
                continue;
            }
            Ok(Err(e)) => {
                last_error = format!("sentinel {host}:{port}: {}", clean(e.to_string()));
                continue;
            }
            Err(_) => {
                last_error = format!("sentinel {host}:{port} did not answer in time");
                continue;
            }
        };
        let credentials = Credentials {
            db: spec.db,
            username: spec.username.as_deref(),
            password: spec.password.as_deref(),
        };
        match check_primary(
            &credentials,
            "the sentinels",
            (&phost, pport),
            spec.tls.as_ref(),
            &cfg,
            op_timeout,
            tcp.clone(),
        )
        .await
        {
            Ok(primary) => return Ok(primary),
            Err(e) => last_error = clean(e),
        }
    }
    Err(last_error)
}

/// How to log in to a data server.
struct Credentials<'a> {
    db: i64,
    username: Option<&'a str>,
    password: Option<&'a str>,
}

/// A client for the server (data node or sentinel) at `host:port`, logging in with
/// `settings`, over TLS when `tls` is given.
fn node_client(
    host: &str,
    port: u16,
    settings: RedisConnectionInfo,
    tls: Option<&Tls>,
    tcp: Option<TcpSettings>,
) -> Result<redis::Client, redis::RedisError> {
    let addr = match tls {
        Some(_) => ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: false,
            tls_params: None,
        },
        None => ConnectionAddr::Tcp(host.to_owned(), port),
    };
    let info = addr.into_connection_info()?.set_redis_settings(settings);
    let info = match tcp {
        Some(tcp) => info.set_tcp_settings(tcp),
        None => info,
    };
    match tls.and_then(|tls| tls.certificates.clone()) {
        Some(certificates) => redis::Client::build_with_tls(info, certificates),
        None => redis::Client::open(info),
    }
}

/// How a data server is logged in to.
fn data_settings(credentials: &Credentials<'_>) -> RedisConnectionInfo {
    let mut settings = RedisConnectionInfo::default().set_db(credentials.db);
    if let Some(u) = credentials.username {
        settings = settings.set_username(u);
    }
    if let Some(p) = credentials.password {
        settings = settings.set_password(p);
    }
    settings
}

/// Connects to the server `named_by` (the sentinels, the cluster) named primary and
/// checks that it calls itself master.
async fn check_primary(
    credentials: &Credentials<'_>,
    named_by: &str,
    (host, port): (&str, u16),
    tls: Option<&Tls>,
    cfg: &redis::AsyncConnectionConfig,
    op_timeout: Duration,
    tcp: Option<TcpSettings>,
) -> Result<Primary, String> {
    let addr = format!("{host}:{port}");
    let client =
        node_client(host, port, data_settings(credentials), tls, tcp).map_err(|e| e.to_string())?;
    read_primary(client, addr, named_by, cfg, op_timeout).await
}

/// The server behind a plain URL (`redis://`, `rediss://`), checked to call itself
/// master, with its replication id: behind a managed failover endpoint (one address, a
/// replica promoted behind it) the address stays and the replication id changes.
pub(crate) async fn standalone_primary(
    client: &redis::Client,
    op_timeout: Duration,
) -> Result<Primary, String> {
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout));
    let addr = client.get_connection_info().addr().to_string();
    read_primary(client.clone(), addr, "the Redis URL", &cfg, op_timeout)
        .await
        .map_err(|e| scrub(&e, password(client).as_deref()))
}

/// Asks `client`'s server for `INFO replication` and checks that it calls itself
/// master.
async fn read_primary(
    client: redis::Client,
    addr: String,
    named_by: &str,
    cfg: &redis::AsyncConnectionConfig,
    op_timeout: Duration,
) -> Result<Primary, String> {
    let asked = async {
        let mut c = client
            .get_multiplexed_async_connection_with_config(cfg)
            .await?;
        redis::cmd("INFO")
            .arg("replication")
            .query_async::<String>(&mut c)
            .await
    };
    let text = match tokio::time::timeout(op_timeout * 2, asked).await {
        Ok(Ok(text)) => text,
        Ok(Err(e)) => return Err(format!("primary {addr} named by {named_by}: {e}")),
        Err(_) => {
            return Err(format!("primary {addr} named by {named_by} did not answer"));
        }
    };
    let replication = parse_replication(&text);
    if replication.role != "master" {
        return Err(format!(
            "{addr}, named primary by {named_by}, says it is {:?}: a failover is under way",
            replication.role
        ));
    }
    Ok(Primary {
        client,
        addr,
        replid: replication.replid,
        replicas: replication.replicas,
    })
}

/// Asks the seed nodes, in order, which primary serves the slot of `key` (`CLUSTER
/// KEYSLOT`, `CLUSTER SLOTS`), then connects to it and checks that it calls itself
/// master. `op_timeout` bounds each step; the error is scrubbed of the password.
pub(crate) async fn resolve_slot_primary(
    spec: &ClusterSpec,
    key: &str,
    op_timeout: Duration,
) -> Result<Primary, String> {
    let secrets = spec.secrets();
    let clean = |text: String| scrub_all(&text, &secrets);
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout));
    let credentials = Credentials {
        db: 0,
        username: spec.username.as_deref(),
        password: spec.password.as_deref(),
    };
    let mut last_error = String::from("no cluster node answered");
    for (host, port) in &spec.seeds {
        let asked = async {
            let client = node_client(
                host,
                *port,
                data_settings(&credentials),
                spec.tls.as_ref(),
                None,
            )?;
            let mut c = client
                .get_multiplexed_async_connection_with_config(&cfg)
                .await?;
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut c)
                .await?;
            let slots: redis::Value = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut c)
                .await?;
            Ok::<_, redis::RedisError>((slot, slots))
        };
        let (slot, slots) = match tokio::time::timeout(op_timeout * 2, asked).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                last_error = format!("cluster node {host}:{port}: {}", clean(e.to_string()));
                continue;
            }
            Err(_) => {
                last_error = format!("cluster node {host}:{port} did not answer in time");
                continue;
            }
        };
        let Some((phost, pport)) = slot_primary(&slots, slot) else {
            last_error = format!("cluster node {host}:{port} names no primary for slot {slot}");
            continue;
        };
        // A node that announces no address means "the one you asked".
        let phost = if phost.is_empty() {
            host.clone()
        } else {
            phost
        };
        match check_primary(
            &credentials,
            "the cluster",
            (&phost, pport),
            spec.tls.as_ref(),
            &cfg,
            op_timeout,
            None,
        )
        .await
        {
            Ok(primary) => return Ok(primary),
            Err(e) => last_error = clean(e),
        }
    }
    Err(last_error)
}

/// The primary `CLUSTER SLOTS` names for `slot`: each entry is `[start, end,
/// [host, port, id, ...], replicas...]`.
fn slot_primary(slots: &redis::Value, slot: i64) -> Option<(String, u16)> {
    let redis::Value::Array(ranges) = slots else {
        return None;
    };
    ranges.iter().find_map(|range| {
        let redis::Value::Array(parts) = range else {
            return None;
        };
        let (Some(redis::Value::Int(start)), Some(redis::Value::Int(end))) =
            (parts.first(), parts.get(1))
        else {
            return None;
        };
        if !(*start..=*end).contains(&slot) {
            return None;
        }
        let redis::Value::Array(primary) = parts.get(2)? else {
            return None;
        };
        let host: String = redis::from_redis_value(primary.first()?.clone()).ok()?;
        let port = match primary.get(1)? {
            redis::Value::Int(port) => u16::try_from(*port).ok()?,
            _ => return None,
        };
        Some((host, port))
    })
}

/// The fields of `INFO replication` this crate reads.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Replication {
    pub(crate) role: String,
    pub(crate) replid: String,
    pub(crate) replicas: Vec<String>,
}

pub(crate) fn parse_replication(text: &str) -> Replication {
    let mut out = Replication::default();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once(':') else {
            continue;
        };
        match key {
            "role" => out.role = value.to_owned(),
            "master_replid" => out.replid = value.to_owned(),
            k if k.starts_with("slave") && k[5..].bytes().all(|b| b.is_ascii_digit()) => {
                // slave0:ip=127.0.0.1,port=6380,state=online,offset=..,lag=..
                let field = |name: &str| {
                    value
                        .split(',')
                        .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                        .unwrap_or("?")
                        .to_owned()
                };
                out.replicas
                    .push(format!("{}:{}", field("ip"), field("port")));
            }
            _ => {}
        }
    }
    out
}

/// Removes every one of `secrets` from a text.
pub(crate) fn scrub_all(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .fold(text.to_owned(), |t, s| scrub(&t, Some(s)))
}

/// A Redis client for `url`, with `tcp` socket settings when given.
///
/// The error says that the URL does not parse, with the URL redacted: redis-rs's own
/// parse error may quote it, password included, so it is not passed on.
pub(crate) fn open_client(url: &str, tcp: Option<TcpSettings>) -> Result<redis::Client, String> {
    let unparsable = |_| {
        format!(
            "Redis URL {} does not parse: expected redis://[user:password@]host:port[/db] \
             (rediss:// for TLS, with ?ssl_ca_certs=...)",
            redact_url(url)
        )
    };
    // The TLS files are this gateway's parameters; the rest of the query is redis-rs's.
    let tls_scheme = url.starts_with("rediss://");
    let (base, fragment) = match url.split_once('#') {
        Some((base, fragment)) => (base, Some(fragment)),
        None => (url, None),
    };
    let mut kept = Vec::new();
    let (rest, tls) = split_query(base, tls_scheme, |name, value| {
        kept.push(format!("{name}={value}"));
        Ok(())
    })
    .map_err(|why| format!("Redis URL {}: {why}", redact_url(url)))?;
    let mut plain = rest.to_owned();
    if !kept.is_empty() {
        plain = format!("{plain}?{}", kept.join("&"));
    }
    if let Some(fragment) = fragment {
        plain = format!("{plain}#{fragment}");
    }
    let info = plain.as_str().into_connection_info().map_err(unparsable)?;
    let info = match tcp {
        Some(tcp) => info.set_tcp_settings(tcp),
        None => info,
    };
    match tls.and_then(|tls| tls.certificates) {
        Some(certificates) => redis::Client::build_with_tls(info, certificates).map_err(unparsable),
        None => redis::Client::open(info).map_err(unparsable),
    }
}

/// A Redis URL for something smaller than the directory (the rate limiter): a client
/// for the primary it names now, looked up again whenever the caller asks (after a
/// failure), so it follows a Sentinel failover or a Cluster slot's move.
#[derive(Clone)]
pub struct RedisEndpoint {
    target: RedisTarget,
}

impl RedisEndpoint {
    /// Parses any URL the directory accepts. The error never quotes its secrets.
    pub fn parse(url: &str) -> Result<RedisEndpoint, String> {
        Ok(RedisEndpoint {
            target: parse_target(url, None)?,
        })
    }

    /// Whether keys must share one hash tag (a Cluster: one slot, one primary).
    pub fn is_cluster(&self) -> bool {
        matches!(self.target, RedisTarget::Cluster(_))
    }

    /// A client for the primary now: the server itself, the one the sentinels name
    /// (checked to call itself master), or the primary of `key`'s slot. `op_timeout`
    /// bounds each step of the lookup.
    pub async fn primary(&self, key: &str, op_timeout: Duration) -> Result<redis::Client, String> {
        match &self.target {
            RedisTarget::Standalone(client) => Ok(client.clone()),
            RedisTarget::Sentinel(spec) => resolve_primary(spec, op_timeout, None)
                .await
                .map(|primary| primary.client),
            RedisTarget::Cluster(spec) => resolve_slot_primary(spec, key, op_timeout)
                .await
                .map(|primary| primary.client),
        }
    }
}

/// The same client speaking `protocol` (RESP2 or RESP3).
pub(crate) fn with_protocol(
    client: &redis::Client,
    protocol: ProtocolVersion,
) -> Result<redis::Client, String> {
    let info = client.get_connection_info().clone();
    let settings = info.redis_settings().clone().set_protocol(protocol);
    redis::Client::open(info.set_redis_settings(settings))
        .map_err(|e| scrub(&e.to_string(), password(client).as_deref()))
}

/// The client's decoded password, to scrub from error texts; `None` without one.
pub(crate) fn password(client: &redis::Client) -> Option<String> {
    client
        .get_connection_info()
        .redis_settings()
        .password()
        .map(str::to_owned)
}

/// Tries direct connections and a `PING` until one answers or `deadline` passes, so a
/// Redis that is still starting is waited for, and a failure reports its real cause
/// (refused, wrong password) rather than a generic retry exhaustion. `op_timeout`
/// bounds each attempt's connect and answer. A failure that waiting cannot fix (bad
/// credentials, a refused command) ends the wait at once. The error is scrubbed.
pub(crate) async fn wait_until_answering(
    client: &redis::Client,
    op_timeout: Duration,
    deadline: Instant,
    no_answer: &str,
) -> Result<(), String> {
    let probe_cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout));
    let secret = password(client);
    let mut last_error = no_answer.to_owned();
    loop {
        let probe = async {
            let mut c = client
                .get_multiplexed_async_connection_with_config(&probe_cfg)
                .await?;
            redis::cmd("PING").query_async::<String>(&mut c).await
        };
        match timeout_at(deadline, probe).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => {
                last_error = scrub(&e.to_string(), secret.as_deref());
                // Waiting does not fix credentials or a refused command.
                let permanent = e.kind() == redis::ErrorKind::AuthenticationFailed
                    || matches!(e.kind(), redis::ErrorKind::Server(_))
                        && matches!(e.retry_method(), redis::RetryMethod::NoRetry);
                if permanent {
                    return Err(last_error);
                }
            }
            Err(_) => return Err(last_error),
        }
        if Instant::now() + CONNECT_RETRY >= deadline {
            return Err(last_error);
        }
        sleep(CONNECT_RETRY).await;
    }
}

/// Why [`connect_manager`] failed.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// Redis refused or the connection broke; the scrubbed reason.
    Failed(String),
    /// No connection by the deadline.
    TimedOut,
}

/// Builds the self-reconnecting, multiplexed connection manager, giving up at
/// `deadline`.
pub(crate) async fn connect_manager(
    client: &redis::Client,
    config: ConnectionManagerConfig,
    deadline: Instant,
) -> Result<ConnectionManager, ConnectFailure> {
    let manager = ConnectionManager::new_with_config(client.clone(), config);
    match timeout_at(deadline, manager).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(ConnectFailure::Failed(scrub(
            &e.to_string(),
            password(client).as_deref(),
        ))),
        Err(_) => Err(ConnectFailure::TimedOut),
    }
}

/// Removes a password from a text, in case an error echoes it.
pub(crate) fn scrub(text: &str, password: Option<&str>) -> String {
    match password {
        Some(p) if !p.is_empty() => text.replace(p, "***"),
        _ => text.to_owned(),
    }
}

/// The URL without credentials: userinfo becomes `***`, and the query (which may carry
/// a password for unix-socket URLs) is dropped.
pub fn redact_url(url: &str) -> String {
    let url = url.split(['?', '#']).next().unwrap_or("");
    let Some((scheme, rest)) = url.split_once("://") else {
        // Not a URL we understand; do not risk echoing a secret.
        return "<redis url>".into();
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => format!("{scheme}://{authority}{path}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(
            redact_url("redis://user:s3cret@redis.internal:6380/2"),
            "redis://***@redis.internal:6380/2"
        );
        assert_eq!(redact_url("redis://:p@ss@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?pass=s3cret"),
            "redis+unix:///run/redis.sock"
        );
        assert_eq!(redact_url("s3cret"), "<redis url>");
    }

    #[test]
    fn passwords_are_scrubbed() {
        assert_eq!(
            scrub("auth s3cret failed", Some("s3cret")),
            "auth *** failed"
        );
        assert_eq!(scrub("no secret here", Some("")), "no secret here");
        assert_eq!(scrub("no secret here", None), "no secret here");
    }

    #[test]
    fn an_unparsable_url_is_not_quoted() {
        let err = open_client("redis://u:s3cret@[bad", None).expect_err("does not parse");
        assert!(!err.contains("s3cret"), "{err}");
        assert!(err.contains("does not parse"), "{err}");
    }

    #[test]
    fn sentinel_urls_parse_with_both_passwords() {
        let Ok(RedisTarget::Sentinel(spec)) = parse_target(
            "redis+sentinel://app:p%40ss@10.0.0.1:26379,[::1]:26380/mymaster/3?sentinel_password=s%26p",
            None,
        ) else {
            panic!("a Sentinel URL")
        };
        assert_eq!(
            spec.sentinels,
            [("10.0.0.1".to_owned(), 26379), ("::1".to_owned(), 26380)]
        );
        assert_eq!(spec.name, "mymaster");
        assert_eq!(spec.db, 3);
        assert_eq!(spec.username.as_deref(), Some("app"));
        assert_eq!(spec.password.as_deref(), Some("p@ss"));
        assert_eq!(spec.sentinel_password.as_deref(), Some("s&p"));
    }

    #[test]
    fn bad_sentinel_urls_say_why_without_their_secrets() {
        for (url, why) in [
            ("redis+sentinel://:s3cret@h:1", "no primary name"),
            ("redis+sentinel://:s3cret@h:1/", "no primary name"),
            ("redis+sentinel://:s3cret@h/m", "without a port"),
            ("redis+sentinel://:s3cret@h:x/m", "not a number"),
            ("redis+sentinel://:s3cret@h:1/m/x", "db is not a number"),
            (
                "redis+sentinel://:s3cret@h:1/m?pw=s3cret",
                "unknown query parameter",
            ),
        ] {
            let Err(err) = parse_target(url, None) else {
                panic!("{url} parsed")
            };
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{url}: {err}");
        }
    }

    #[test]
    fn tls_urls_read_their_files_and_say_which_one_is_missing() {
        let dir = std::env::temp_dir().join(format!("mcpgw-redis-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, "not read until a connection is made").expect("write");
        let ca = ca.display().to_string();
        for url in [
            format!("rediss+sentinel://:s3cret@h:1/m?ssl_ca_certs={ca}&sentinel_password=x"),
            format!("rediss+cluster://:s3cret@h:1/?ssl_ca_certs={ca}"),
        ] {
            let tls = match parse_target(&url, None) {
                Ok(RedisTarget::Sentinel(spec)) => spec.tls,
                Ok(RedisTarget::Cluster(spec)) => spec.tls,
                Ok(RedisTarget::Standalone(_)) => panic!("{url}: standalone"),
                Err(e) => panic!("{url}: {e}"),
            };
            let root = tls.and_then(|t| t.certificates).and_then(|c| c.root_cert);
            assert_eq!(
                root.as_deref(),
                Some(b"not read until a connection is made".as_slice()),
                "{url}"
            );
        }
        // Without files, TLS trusts the system's roots.
        let Ok(RedisTarget::Sentinel(spec)) = parse_target("rediss+sentinel://h:1/m", None) else {
            panic!("TLS Sentinel without files")
        };
        assert!(spec.tls.is_some_and(|t| t.certificates.is_none()));
        for (url, why) in [
            (
                "rediss+sentinel://:s3cret@h:1/m?ssl_ca_certs=/nonexistent/ca.pem".to_owned(),
                "cannot read ssl_ca_certs file /nonexistent/ca.pem",
            ),
            (
                "rediss://:s3cret@h:1/?ssl_ca_certs=/nonexistent/ca.pem".to_owned(),
                "cannot read ssl_ca_certs file /nonexistent/ca.pem",
            ),
            (
                format!("rediss+cluster://:s3cret@h:1/?ssl_certfile={ca}"),
                "go together",
            ),
            (
                format!("redis+sentinel://:s3cret@h:1/m?ssl_ca_certs={ca}"),
                "need a rediss scheme",
            ),
            (
                format!("redis://:s3cret@h:1/?ssl_ca_certs={ca}"),
                "need a rediss scheme",
            ),
        ] {
            let Err(err) = parse_target(&url, None) else {
                panic!("{url} parsed")
            };
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{url}: {err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cluster_urls_parse_and_bad_ones_say_why_without_their_secrets() {
        let Ok(RedisTarget::Cluster(spec)) =
            parse_target("redis+cluster://app:p%40ss@h1:7000,[::1]:7001/", None)
        else {
            panic!("a Cluster URL")
        };
        assert_eq!(
            spec.seeds,
            [("h1".to_owned(), 7000), ("::1".to_owned(), 7001)]
        );
        assert_eq!(spec.username.as_deref(), Some("app"));
        assert_eq!(spec.password.as_deref(), Some("p@ss"));
        for (url, why) in [
            ("redis+cluster://:s3cret@h", "without a port"),
            ("redis+cluster://:s3cret@h:x", "not a number"),
            ("redis+cluster://:s3cret@h:1/0", "no database"),
            (
                "redis+cluster://:s3cret@h:1/?db=0",
                "unknown query parameter",
            ),
        ] {
            let Err(err) = parse_target(url, None) else {
                panic!("{url} parsed")
            };
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{url}: {err}");
        }
    }

    #[test]
    fn the_slot_primary_is_read_from_cluster_slots() {
        use redis::Value as V;
        let node = |host: &str, port| V::Array(vec![V::BulkString(host.into()), V::Int(port)]);
        let slots = V::Array(vec![
            V::Array(vec![
                V::Int(0),
                V::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            V::Array(vec![V::Int(5461), V::Int(16383), node("", 7001)]),
        ]);
        assert_eq!(slot_primary(&slots, 17), Some(("10.0.0.1".into(), 7000)));
        assert_eq!(slot_primary(&slots, 15372), Some((String::new(), 7001)));
        assert_eq!(slot_primary(&V::Array(vec![]), 1), None);
    }

    #[test]
    fn replication_info_names_role_replid_and_replicas() {
        let text = "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n\
                    slave0:ip=127.0.0.1,port=6380,state=online,offset=1,lag=0\r\n\
                    master_replid:abc123\r\nmaster_replid2:0000\r\n";
        assert_eq!(
            parse_replication(text),
            Replication {
                role: "master".into(),
                replid: "abc123".into(),
                replicas: vec!["127.0.0.1:6380".into()],
            }
        );
    }

    #[test]
    fn the_password_is_found_for_scrubbing() {
        let client = open_client("redis://u:s3cret@127.0.0.1:1", None).expect("parses");
        assert_eq!(password(&client).as_deref(), Some("s3cret"));
    }
}
