//! A real `redis-server` on a free loopback port, without persistence, killed on drop.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    process: std::process::Child,
    pub port: u16,
    dir: PathBuf,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-test-redis-{}-{}",
            std::process::id(),
            crate::free_port()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir for redis");
        for _ in 0..5 {
            let port = crate::free_port();
            let process = Command::new("redis-server")
                .args(["--port", &port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed (make deps installs it)");
            let mut server = RedisServer {
                process,
                port,
                dir: dir.clone(),
            };
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            let _ = server.process.kill();
        }
        panic!("redis-server did not start");
    }

    /// Kills Redis and starts it again, empty, on the same port: a restart without
    /// persistence.
    pub fn restart_empty(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        for _ in 0..50 {
            let process = Command::new("redis-server")
                .args(["--port", &self.port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&self.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server");
            self.process = process;
            if self.wait_ready(Duration::from_secs(5)) {
                return;
            }
            let _ = self.process.kill();
            let _ = self.process.wait();
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not restart on port {}", self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn wait_ready(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.process.try_wait() {
                return false;
            }
            if self.try_command(&["PING"]).is_some_and(|r| r == "PONG") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Runs one command; simple and bulk replies come back as their text, integers as
    /// decimal, arrays as their elements joined by newlines.
    pub fn command(&self, args: &[&str]) -> String {
        match self.query(args) {
            Some(Resp::Text(text)) => text,
            Some(Resp::Nil) => String::new(),
            Some(Resp::Array(items)) => items
                .into_iter()
                .filter_map(|item| match item {
                    Resp::Text(text) => Some(text),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
            None => panic!("redis command {args:?} failed"),
        }
    }

    /// Keys matching `pattern` (KEYS: fine for a test Redis).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        match self.query(&["KEYS", pattern]) {
            Some(Resp::Array(items)) => items
                .into_iter()
                .filter_map(|item| match item {
                    Resp::Text(text) => Some(text),
                    _ => None,
                })
                .collect(),
            other => panic!("KEYS {pattern}: unexpected reply {other:?}"),
        }
    }

    /// The value of a string key.
    pub fn get(&self, key: &str) -> Option<String> {
        match self.query(&["GET", key]) {
            Some(Resp::Text(text)) => Some(text),
            _ => None,
        }
    }

    fn try_command(&self, args: &[&str]) -> Option<String> {
        match self.query(args)? {
            Resp::Text(text) => Some(text),
            _ => Some(String::new()),
        }
    }

    fn query(&self, args: &[&str]) -> Option<Resp> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        stream.write_all(request.as_bytes()).ok()?;
        read_resp(&mut BufReader::new(stream))
    }

    /// `INFO commandstats` as (command, calls) pairs.
    pub fn command_calls(&self) -> Vec<(String, u64)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("redis reachable");
        stream
            .write_all(b"*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n")
            .expect("write INFO");
        let mut reader = BufReader::new(stream);
        let mut header = String::new();
        reader.read_line(&mut header).expect("INFO header");
        let len: usize = header
            .trim_end()
            .trim_start_matches('$')
            .parse()
            .unwrap_or(0);
        let mut body = vec![0u8; len + 2];
        std::io::Read::read_exact(&mut reader, &mut body).expect("INFO body");
        String::from_utf8_lossy(&body)
            .lines()
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

    /// Total commands executed, excluding the `info` calls used to measure.
    pub fn total_calls(&self) -> u64 {
        self.command_calls()
            .into_iter()
            .filter(|(name, _)| name != "info")
            .map(|(_, calls)| calls)
            .sum()
    }

    pub fn pid(&self) -> u32 {
        self.process.id()
    }
}

/// A RESP reply, as much of it as tests need.
#[derive(Debug)]
enum Resp {
    Text(String),
    Nil,
    Array(Vec<Resp>),
}

fn read_resp(reader: &mut impl BufRead) -> Option<Resp> {
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let line = line.trim_end_matches(['\r', '\n']);
    let (kind, rest) = line.split_at_checked(1)?;
    match kind {
        "+" | ":" => Some(Resp::Text(rest.to_owned())),
        "-" => Some(Resp::Text(format!("-{rest}"))),
        "$" => {
            let len: i64 = rest.parse().ok()?;
            if len < 0 {
                return Some(Resp::Nil);
            }
            let mut data = vec![0u8; len as usize + 2];
            std::io::Read::read_exact(reader, &mut data).ok()?;
            data.truncate(len as usize);
            Some(Resp::Text(String::from_utf8_lossy(&data).into_owned()))
        }
        "*" => {
            let len: i64 = rest.parse().ok()?;
            if len < 0 {
                return Some(Resp::Nil);
            }
            (0..len)
                .map(|_| read_resp(reader))
                .collect::<Option<Vec<_>>>()
                .map(Resp::Array)
        }
        _ => None,
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
