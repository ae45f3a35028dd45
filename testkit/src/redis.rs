//! A real `redis-server` (Debian package `redis-server`) on a free loopback port,
//! without persistence, killed when dropped; and the few commands tests send it,
//! spoken in plain RESP so that no client library's own traffic is counted.

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::signal::Paused;

/// How long a fresh `redis-server` may take to answer PING.
const READY_WITHIN: Duration = Duration::from_secs(20);
/// Deadline of one test command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

pub struct RedisServer {
    /// Behind a lock so a test can restart the server through a shared reference
    /// while other threads (or tasks) use it.
    process: Mutex<std::process::Child>,
    pub port: u16,
    /// Its working directory, kept across restarts and attempts and removed on drop.
    dir: PathBuf,
    /// Arguments beyond the defaults (a cluster node's), kept for restarts.
    extra: Vec<String>,
    /// A TLS port beside the plain one (the tests' own commands keep using the plain
    /// port; the gateway is given the TLS one).
    pub tls: Option<TlsPort>,
}

/// What a TLS-serving test Redis presents and whom it lets in.
#[derive(Clone)]
pub struct RedisTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// `tls-auth-clients yes`: a client must present a certificate of `ca`.
    pub auth_clients: bool,
}

impl RedisTls {
    /// The `redis-server` arguments for `port` (also what replication and a sentinel's
    /// outgoing connections use: `tls-replication yes`).
    pub fn args(&self, port: u16) -> Vec<String> {
        let path = |p: &PathBuf| p.display().to_string();
        [
            "--tls-port".to_owned(),
            port.to_string(),
            "--tls-cert-file".into(),
            path(&self.cert),
            "--tls-key-file".into(),
            path(&self.key),
            "--tls-ca-cert-file".into(),
            path(&self.ca),
            "--tls-auth-clients".into(),
            if self.auth_clients { "yes" } else { "no" }.into(),
            "--tls-replication".into(),
            "yes".into(),
        ]
        .into()
    }

    /// The query naming the CA (and, when `client` is given, a client certificate
    /// and key) in a `rediss` URL.
    pub fn query(&self, client: Option<(&PathBuf, &PathBuf)>) -> String {
        let mut query = format!("ssl_ca_certs={}", self.ca.display());
        if let Some((cert, key)) = client {
            query.push_str(&format!(
                "&ssl_certfile={}&ssl_keyfile={}",
                cert.display(),
                key.display()
            ));
        }
        query
    }
}

/// A server's TLS port and how it is configured.
#[derive(Clone)]
pub struct TlsPort {
    pub port: u16,
    pub config: RedisTls,
}

impl RedisServer {
    /// Starts a server on a free port. A port can be taken between the probe and
    /// Redis's bind, so a few ports are tried.
    #[track_caller]
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Starts a server as [`start`](Self::start) does, with `extra` arguments.
    #[track_caller]
    pub fn start_with(extra: &[&str]) -> RedisServer {
        Self::start_serving(extra, None)
    }

    /// Starts a server as [`start`](Self::start) does that also serves TLS on a port
    /// of its own ([`RedisServer::tls_url`]).
    #[track_caller]
    pub fn start_tls(tls: &RedisTls) -> RedisServer {
        Self::start_serving(&[], Some(tls))
    }

    #[track_caller]
    fn start_serving(extra: &[&str], tls: Option<&RedisTls>) -> RedisServer {
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let base = extra.len();
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-test-redis-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let mut last_error = String::new();
        for _ in 0..5 {
            // Each attempt ensures the directory exists: nothing an earlier attempt
            // did may make the next one fail.
            if let Err(e) = std::fs::create_dir_all(&dir) {
                panic!("cannot create {}: {e}", dir.display());
            }
            let port = crate::free_port();
            let tls = tls.map(|config| TlsPort {
                port: crate::free_port(),
                config: config.clone(),
            });
            extra.truncate(base);
            if let Some(tls) = &tls {
                extra.extend(tls.config.args(tls.port));
            }
            let mut process = match spawn_redis(port, &dir, &extra) {
                Ok(process) => process,
                Err(e) => panic!("cannot run redis-server (make deps installs it): {e}"),
            };
            match wait_ready(&mut process, port) {
                Ok(()) => {
                    return RedisServer {
                        process: Mutex::new(process),
                        port,
                        dir,
                        extra,
                        tls,
                    };
                }
                Err(e) => {
                    last_error = e;
                    crate::signal::kill_group(process.id());
                    let _ = process.wait();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        panic!("redis-server did not start: {last_error}");
    }

    /// Kills Redis and starts it again, empty, on the same port: a restart without
    /// persistence. Every connection to it breaks, every subscription is gone.
    #[track_caller]
    pub fn restart_empty(&self) {
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        crate::signal::kill_group(process.id());
        let _ = process.wait();
        // Redis binds with SO_REUSEADDR, so the port is free again at once; a retry
        // covers a slow kernel all the same.
        *process = crate::eventually(READY_WITHIN, || {
            let mut fresh =
                spawn_redis(self.port, &self.dir, &self.extra).map_err(|e| e.to_string())?;
            match wait_ready(&mut fresh, self.port) {
                Ok(()) => Ok(fresh),
                Err(e) => {
                    crate::signal::kill_group(fresh.id());
                    let _ = fresh.wait();
                    Err(e)
                }
            }
        });
    }

    /// Kills the server (SIGKILL) and reaps it: a Redis host that dies at once. When
    /// this returns its sockets are closed.
    pub fn kill(&self) {
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        crate::signal::kill_group(process.id());
        let _ = process.wait();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// `rediss://` to its TLS port, trusting its CA (and presenting `client`).
    #[track_caller]
    pub fn tls_url(&self, client: Option<(&PathBuf, &PathBuf)>) -> String {
        let tls = self.tls.as_ref().expect("a server started with start_tls");
        format!(
            "rediss://127.0.0.1:{}/?{}",
            tls.port,
            tls.config.query(client)
        )
    }

    pub fn pid(&self) -> u32 {
        self.process.lock().unwrap_or_else(|e| e.into_inner()).id()
    }

    /// Stops the server (SIGSTOP) until the guard is resumed or dropped: a Redis that
    /// hangs without closing anything.
    pub fn pause(&self) -> Paused {
        Paused::stop(self.pid())
    }

    /// Runs one command; simple and bulk replies come back as their text, integers as
    /// decimal, nil as "", arrays as their elements joined by newlines.
    #[track_caller]
    pub fn command(&self, args: &[&str]) -> String {
        match self.query(args) {
            Ok(Resp::Text(text)) => text,
            Ok(Resp::Nil) => String::new(),
            Ok(Resp::Array(items)) => texts(items).join("\n"),
            Err(e) => panic!("redis command {args:?} failed: {e}"),
        }
    }

    /// Keys matching `pattern` (KEYS: fine for a test Redis).
    #[track_caller]
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        match self.query(&["KEYS", pattern]) {
            Ok(Resp::Array(items)) => texts(items),
            other => panic!("KEYS {pattern}: unexpected reply {other:?}"),
        }
    }

    /// The value of a string key.
    #[track_caller]
    pub fn get(&self, key: &str) -> Option<String> {
        match self.query(&["GET", key]) {
            Ok(Resp::Text(text)) => Some(text),
            Ok(Resp::Nil) => None,
            other => panic!("GET {key}: unexpected reply {other:?}"),
        }
    }

    /// `PUBSUB NUMSUB channel`: how many subscribers the channel has.
    #[track_caller]
    pub fn numsub(&self, channel: &str) -> u64 {
        match self.query(&["PUBSUB", "NUMSUB", channel]) {
            Ok(Resp::Array(items)) => texts(items)
                .get(1)
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("PUBSUB NUMSUB {channel}: no count")),
            other => panic!("PUBSUB NUMSUB {channel}: unexpected reply {other:?}"),
        }
    }

    /// `INFO commandstats` as (command, calls) pairs.
    #[track_caller]
    pub fn command_calls(&self) -> Vec<(String, u64)> {
        let info = self.command(&["INFO", "commandstats"]);
        parse_commandstats(&info)
    }

    /// Total commands executed, leaving out the `info` calls used to measure.
    #[track_caller]
    pub fn total_calls(&self) -> u64 {
        self.command_calls()
            .into_iter()
            .filter(|(name, _)| name != "info")
            .map(|(_, calls)| calls)
            .sum()
    }

    /// Makes Redis log every command it runs from now on, the commands scripts run
    /// included (its slow log, with no threshold and room for a million entries), and
    /// returns the reader of that log. No MONITOR: nothing is streamed to the test.
    #[track_caller]
    pub fn record_commands(&self) -> CommandLog<'_> {
        for args in [
            &["CONFIG", "SET", "slowlog-max-len", "1000000"][..],
            &["CONFIG", "SET", "slowlog-log-slower-than", "0"],
            &["SLOWLOG", "RESET"],
        ] {
            let reply = self.command(args);
            assert_eq!(reply, "OK", "{args:?}");
        }
        CommandLog { redis: self }
    }

    /// Whether Redis flags the command `args` names as one that writes (`COMMAND
    /// INFO`: `write`); a container command (`CONFIG SET`) by its subcommand.
    #[track_caller]
    pub fn is_write(&self, args: &[String]) -> bool {
        is_write(args, |name| self.command_info(name))
    }

    /// `COMMAND INFO name`: its flags, and whether it has subcommands.
    #[track_caller]
    fn command_info(&self, name: &str) -> (BTreeSet<String>, bool) {
        match self.query(&["COMMAND", "INFO", name]) {
            Ok(Resp::Array(mut infos)) => match infos.pop() {
                Some(Resp::Array(info)) => {
                    let mut info = info.into_iter();
                    let flags = match info.nth(2) {
                        Some(Resp::Array(flags)) => texts(flags).into_iter().collect(),
                        other => panic!("COMMAND INFO {name}: flags {other:?}"),
                    };
                    let has_subcommands =
                        matches!(info.nth(6), Some(Resp::Array(subs)) if !subs.is_empty());
                    (flags, has_subcommands)
                }
                // Not a command this Redis knows.
                _ => (BTreeSet::new(), false),
            },
            other => panic!("COMMAND INFO {name}: unexpected reply {other:?}"),
        }
    }

    pub(crate) fn query(&self, args: &[&str]) -> Result<Resp, String> {
        query(self.port, args)
    }
}

/// What Redis ran since [`RedisServer::record_commands`], read from its slow log.
pub struct CommandLog<'a> {
    redis: &'a RedisServer,
}

/// Commands the testkit itself sends to read the log and the command table: left
/// out of what [`CommandLog::commands`] returns.
const MEASURING: [&str; 3] = ["slowlog", "command", "config"];

impl CommandLog<'_> {
    /// Every command run since the recording started, oldest first, each script with
    /// the commands it ran; without the testkit's own `SLOWLOG`, `COMMAND` and `CONFIG`.
    #[track_caller]
    pub fn commands(&self) -> Vec<RanCommand> {
        let mut entries = match self.redis.query(&["SLOWLOG", "GET", "-1"]) {
            Ok(Resp::Array(entries)) => entries
                .into_iter()
                .map(slowlog_entry)
                .collect::<Result<Vec<_>, _>>()
                .unwrap_or_else(|e| panic!("SLOWLOG GET: {e}")),
            other => panic!("SLOWLOG GET: unexpected reply {other:?}"),
        };
        // Newest first in the log; a script's own calls are logged before it.
        entries.sort_by_key(|(id, _, _)| *id);
        let mut infos: HashMap<String, (BTreeSet<String>, bool)> = HashMap::new();
        let mut is_write = |args: &[String]| {
            is_write(args, |name| {
                infos
                    .entry(name.to_owned())
                    .or_insert_with(|| self.redis.command_info(name))
                    .clone()
            })
        };
        let mut commands = Vec::new();
        let mut script_calls = Vec::new();
        for (_, args, by_script) in entries {
            let command = RanCommand {
                writes: is_write(&args),
                args,
                script_calls: Vec::new(),
            };
            if by_script {
                script_calls.push(command);
            } else if !MEASURING.contains(&command.name().as_str()) {
                commands.push(RanCommand {
                    script_calls: std::mem::take(&mut script_calls),
                    ..command
                });
            }
        }
        assert!(
            script_calls.is_empty(),
            "script calls logged without their script: {script_calls:?}"
        );
        commands
    }
}

impl Drop for CommandLog<'_> {
    fn drop(&mut self) {
        // Redis's default threshold: only slow commands are logged again.
        let _ = self
            .redis
            .query(&["CONFIG", "SET", "slowlog-log-slower-than", "10000"]);
    }
}

/// One command Redis ran, as its slow log keeps it.
#[derive(Debug, Clone)]
pub struct RanCommand {
    /// Name and arguments; Redis shortens arguments longer than 128 bytes and keeps
    /// the first 32.
    pub args: Vec<String>,
    /// Redis flags the command as one that writes ([`RedisServer::is_write`]).
    pub writes: bool,
    /// For a script (EVAL, EVALSHA, FCALL): the commands it ran, in order.
    pub script_calls: Vec<RanCommand>,
}

impl RanCommand {
    /// The command's name, lower-cased.
    pub fn name(&self) -> String {
        self.args
            .first()
            .map(|n| n.to_lowercase())
            .unwrap_or_default()
    }

    /// The writing commands among this one and those its script ran.
    pub fn writes(&self) -> Vec<&RanCommand> {
        std::iter::once(self)
            .chain(&self.script_calls)
            .filter(|c| c.writes)
            .collect()
    }

    /// Whether an argument of this command, or of a command its script ran,
    /// contains `text`.
    pub fn mentions(&self, text: &str) -> bool {
        std::iter::once(self)
            .chain(&self.script_calls)
            .any(|c| c.args.iter().any(|a| a.contains(text)))
    }
}

/// Whether `args` name a writing command, given `info` (`COMMAND INFO`: flags, and
/// whether it has subcommands).
fn is_write(args: &[String], mut info: impl FnMut(&str) -> (BTreeSet<String>, bool)) -> bool {
    let Some(name) = args.first().map(|n| n.to_lowercase()) else {
        return false;
    };
    let (flags, has_subcommands) = info(&name);
    match args.get(1) {
        Some(sub) if has_subcommands => info(&format!("{name}|{}", sub.to_lowercase()))
            .0
            .contains("write"),
        _ => flags.contains("write"),
    }
}

/// One slow log entry: its id, the command's arguments, and whether a script ran it
/// (Redis names the client of a script's calls `?:0`).
fn slowlog_entry(entry: Resp) -> Result<(i64, Vec<String>, bool), String> {
    let Resp::Array(fields) = entry else {
        return Err(format!("entry {entry:?}"));
    };
    let mut fields = fields.into_iter();
    let id = match fields.next() {
        Some(Resp::Text(id)) => id.parse().map_err(|_| format!("entry id {id:?}"))?,
        other => return Err(format!("entry id {other:?}")),
    };
    let args = match fields.nth(2) {
        Some(Resp::Array(args)) => texts(args),
        other => return Err(format!("entry arguments {other:?}")),
    };
    let by_script = matches!(fields.next(), Some(Resp::Text(client)) if client == "?:0");
    Ok((id, args, by_script))
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let process = self.process.get_mut().unwrap_or_else(|e| e.into_inner());
        crate::signal::kill_group(process.id());
        let _ = process.kill();
        let _ = process.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn_redis(
    port: u16,
    dir: &std::path::Path,
    extra: &[String],
) -> std::io::Result<std::process::Child> {
    let mut command = Command::new("redis-server");
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    crate::process::spawn(command)
}

/// Waits until the server at `port` answers PING; an exit (port taken, bad
/// directory) ends the wait at once.
fn wait_ready(process: &mut std::process::Child, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        if let Ok(Some(status)) = process.try_wait() {
            return Err(format!("redis-server on port {port} exited: {status}"));
        }
        if matches!(query(port, &["PING"]), Ok(Resp::Text(ref pong)) if pong == "PONG") {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "redis-server on port {port} did not answer PING within {READY_WITHIN:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn query(port: u16, args: &[&str]) -> Result<Resp, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(COMMAND_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream
        .write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    read_resp(&mut BufReader::new(stream))
}

/// A RESP reply, as much of it as tests need. Errors are text starting with `-`.
#[derive(Debug)]
pub(crate) enum Resp {
    Text(String),
    Nil,
    Array(Vec<Resp>),
}

pub(crate) fn texts(items: Vec<Resp>) -> Vec<String> {
    items
        .into_iter()
        .filter_map(|item| match item {
            Resp::Text(text) => Some(text),
            _ => None,
        })
        .collect()
}

fn read_resp(reader: &mut impl BufRead) -> Result<Resp, String> {
    let mut line = String::new();
    reader.read_line(&mut line).map_err(|e| e.to_string())?;
    let line = line.trim_end_matches(['\r', '\n']);
    let (kind, rest) = line
        .split_at_checked(1)
        .ok_or_else(|| "connection closed without a reply".to_owned())?;
    let length = || -> Result<i64, String> {
        rest.parse()
            .map_err(|_| format!("bad RESP length in {line:?}"))
    };
    match kind {
        "+" | ":" => Ok(Resp::Text(rest.to_owned())),
        "-" => Ok(Resp::Text(format!("-{rest}"))),
        "$" => {
            let Ok(len) = usize::try_from(length()?) else {
                return Ok(Resp::Nil);
            };
            let mut data = vec![0u8; len + 2];
            reader.read_exact(&mut data).map_err(|e| e.to_string())?;
            data.truncate(len);
            Ok(Resp::Text(String::from_utf8_lossy(&data).into_owned()))
        }
        "*" => {
            let Ok(len) = usize::try_from(length()?) else {
                return Ok(Resp::Nil);
            };
            (0..len)
                .map(|_| read_resp(reader))
                .collect::<Result<Vec<_>, _>>()
                .map(Resp::Array)
        }
        _ => Err(format!("not a RESP reply: {line:?}")),
    }
}

/// The `cmdstat_<name>:calls=N,...` lines of `INFO commandstats`.
fn parse_commandstats(info: &str) -> Vec<(String, u64)> {
    info.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("cmdstat_")?;
            let (name, stats) = rest.split_once(':')?;
            let calls = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_whole() {
        let mut input: &[u8] = b"*3\r\n$5\r\nhello\r\n:42\r\n$-1\r\n";
        match read_resp(&mut input) {
            Ok(Resp::Array(items)) => {
                assert!(matches!(&items[0], Resp::Text(t) if t == "hello"));
                assert!(matches!(&items[1], Resp::Text(t) if t == "42"));
                assert!(matches!(items[2], Resp::Nil));
            }
            other => panic!("{other:?}"),
        }
        assert!(read_resp(&mut &b""[..]).is_err());
    }

    #[test]
    fn slowlog_entries_give_id_arguments_and_the_script_client() {
        let entry = |client: &str| {
            let text = format!(
                "*6\r\n:7\r\n:1796117527\r\n:5\r\n*2\r\n$3\r\nDEL\r\n$1\r\nk\r\n${}\r\n{client}\r\n$0\r\n\r\n",
                client.len()
            );
            slowlog_entry(read_resp(&mut text.as_bytes()).unwrap()).unwrap()
        };
        let args = vec!["DEL".to_owned(), "k".to_owned()];
        assert_eq!(entry("127.0.0.1:5000"), (7, args.clone(), false));
        assert_eq!(entry("?:0"), (7, args, true));
    }

    #[test]
    fn a_container_command_writes_by_its_subcommand() {
        let info = |name: &str| -> (BTreeSet<String>, bool) {
            let flags: &[&str] = match name {
                "zrem" => &["write", "fast"],
                "object" => &[],
                "object|freq" => &["readonly"],
                _ => &[],
            };
            let flags = flags.iter().map(|f| f.to_string()).collect();
            (flags, name == "object")
        };
        let args = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        assert!(is_write(&args(&["ZREM", "z", "m"]), info));
        assert!(!is_write(&args(&["OBJECT", "FREQ", "k"]), info));
        assert!(!is_write(&args(&["GET", "k"]), info));
    }

    #[test]
    fn commandstats_lines_give_calls() {
        let info = "# Commandstats\r\ncmdstat_get:calls=7,usec=10,usec_per_call=1.4\r\ncmdstat_set:calls=2,usec=3\r\n";
        assert_eq!(
            parse_commandstats(info),
            [("get".to_owned(), 7), ("set".to_owned(), 2)]
        );
    }
}
