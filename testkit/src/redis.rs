//! A real `redis-server` (Debian package `redis-server`) on a free loopback port,
//! without persistence, killed when dropped; and the few commands tests send it,
//! spoken in plain RESP so that no client library's own traffic is counted.

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
}

impl RedisServer {
    /// Starts a server on a free port. A port can be taken between the probe and
    /// Redis's bind, so a few ports are tried.
    #[track_caller]
    pub fn start() -> RedisServer {
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
            let mut process = match spawn_redis(port, &dir) {
                Ok(process) => process,
                Err(e) => panic!("cannot run redis-server (make deps installs it): {e}"),
            };
            match wait_ready(&mut process, port) {
                Ok(()) => {
                    return RedisServer {
                        process: Mutex::new(process),
                        port,
                        dir,
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
            let mut fresh = spawn_redis(self.port, &self.dir).map_err(|e| e.to_string())?;
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

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
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

    fn query(&self, args: &[&str]) -> Result<Resp, String> {
        query(self.port, args)
    }
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

fn spawn_redis(port: u16, dir: &std::path::Path) -> std::io::Result<std::process::Child> {
    let mut command = Command::new("redis-server");
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
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

fn query(port: u16, args: &[&str]) -> Result<Resp, String> {
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
enum Resp {
    Text(String),
    Nil,
    Array(Vec<Resp>),
}

fn texts(items: Vec<Resp>) -> Vec<String> {
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
    fn commandstats_lines_give_calls() {
        let info = "# Commandstats\r\ncmdstat_get:calls=7,usec=10,usec_per_call=1.4\r\ncmdstat_set:calls=2,usec=3\r\n";
        assert_eq!(
            parse_commandstats(info),
            [("get".to_owned(), 7), ("set".to_owned(), 2)]
        );
    }
}
