//! Child processes that die with the test: the gateway, the demo upstream, anything.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running child process, killed when dropped. Its stdout lines are collected so a
/// test can wait for a readiness line; stderr goes to the test's stderr.
pub struct Child {
    pub name: String,
    process: std::process::Child,
    lines: mpsc::Receiver<String>,
}

impl Child {
    pub fn spawn(name: &str, program: &Path, args: &[String]) -> Child {
        Self::spawn_with_env(name, program, args, &[])
    }

    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Child {
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut process = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({}): {e}", program.display()));
        let stdout = process.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        let label = name.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                eprintln!("[{label}] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Child {
            name: name.to_owned(),
            process,
            lines,
        }
    }

    /// Waits for a stdout line containing `needle` and returns it.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => {
                    let status = self.process.try_wait().ok().flatten();
                    panic!(
                        "{} printed no line containing {needle:?} within {timeout:?} (exit status: {status:?})",
                        self.name
                    );
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// Sends a signal by name (TERM, KILL, STOP, CONT).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill(1) is available");
        assert!(status.success(), "kill -{signal} {} failed", self.pid());
    }

    /// Waits for the process to exit and returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.process.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{} did not exit within {timeout:?}", self.name);
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// The demo upstream (`mcpgw-bench upstream`) on an ephemeral port.
pub struct Upstream {
    pub child: Child,
    /// Its MCP endpoint, e.g. `http://127.0.0.1:41234/mcp`.
    pub url: String,
}

impl Upstream {
    pub fn start() -> Upstream {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Upstream {
        let mut args = vec![
            "upstream".to_owned(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Child::spawn("upstream", &crate::bin("mcpgw-bench"), &args);
        let line = child.wait_for_line("listening on", Duration::from_secs(20));
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .expect("upstream prints its URL")
            .to_owned();
        Upstream { child, url }
    }

    /// `host:port` of the upstream.
    pub fn addr(&self) -> String {
        self.url
            .trim_start_matches("http://")
            .trim_end_matches("/mcp")
            .to_owned()
    }

    /// The upstream's execution counters (`GET /stats`).
    pub fn stats(&self) -> serde_json::Value {
        let response = crate::http::request(&self.addr(), "GET", "/stats", &[], b"");
        assert_eq!(response.status, 200, "upstream /stats");
        response.json()
    }
}

/// An `mcpgw serve` process (one worker, or a supervisor with its workers).
pub struct Gateway {
    pub child: Child,
    /// `host:port` of the public front.
    pub addr: String,
}

impl Gateway {
    /// Starts `mcpgw serve` with `args` (plus `--listen 127.0.0.1:0` unless given) and
    /// waits until it serves.
    pub fn start(args: &[&str]) -> Gateway {
        Self::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Gateway {
        let mut all: Vec<String> = vec!["serve".into()];
        if !args.contains(&"--listen") {
            all.extend(["--listen".into(), "127.0.0.1:0".into()]);
        }
        all.extend(args.iter().map(|s| s.to_string()));
        let mut child = Child::spawn_with_env("mcpgw", &crate::bin("mcpgw"), &all, env);
        let line = child.wait_for_line("mcpgw listening on", Duration::from_secs(30));
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http://"))
            .expect("mcpgw prints its address")
            .trim_end_matches('/')
            .to_owned();
        Gateway { child, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }
}
