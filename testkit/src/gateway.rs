//! An `mcpgw serve` process: one standalone worker, or a supervisor with its workers
//! (all in the supervisor's process group, so dropping the handle kills them all).

use std::time::Duration;

use crate::process::Child;

/// How long a gateway (and all its workers) may take to announce that it serves.
const READY_WITHIN: Duration = Duration::from_secs(60);

pub struct Gateway {
    pub child: Child,
    /// `host:port` of the public front.
    pub addr: String,
    /// `host:port` of a standalone gateway's admin listener, from its announcement
    /// (`None` for a supervisor: its workers' are in their leases).
    pub admin: Option<String>,
}

/// `serve` and `args`, with `--listen 127.0.0.1:0` unless `args` name one.
fn serve_args<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["serve"];
    if !args.contains(&"--listen") {
        all.extend(["--listen", "127.0.0.1:0"]);
    }
    all.extend_from_slice(args);
    all
}

impl Gateway {
    /// Starts `mcpgw serve` with `args` (plus `--listen 127.0.0.1:0` unless given) and
    /// waits until it serves.
    pub fn start(args: &[&str]) -> Gateway {
        Self::start_with_env(args, &[])
    }

    #[track_caller]
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Gateway {
        let mut command = std::process::Command::new(crate::bin("mcpgw"));
        command.args(serve_args(args));
        for (key, value) in env {
            command.env(key, value);
        }
        let child = Child::from_command("mcpgw", command)
            .unwrap_or_else(|e| panic!("cannot start mcpgw: {e}"));
        Self::when_ready(child)
    }

    /// Like [`start`](Self::start), with the gateway's (and its workers') log lines
    /// appended to `log` instead of the test's stderr.
    #[track_caller]
    pub fn start_logged(args: &[&str], log: &std::path::Path) -> Gateway {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("log file {}: {e}", log.display()));
        let mut command = std::process::Command::new(crate::bin("mcpgw"));
        command.args(serve_args(args));
        let child = Child::from_command_with_stderr("mcpgw", command, file.into())
            .unwrap_or_else(|e| panic!("cannot start mcpgw: {e}"));
        Self::when_ready(child)
    }

    /// Waits for the announcement and reads the public address from it.
    #[track_caller]
    fn when_ready(mut child: Child) -> Gateway {
        let line = child.wait_for_line("mcpgw listening on", READY_WITHIN);
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http://"))
            .unwrap_or_else(|| panic!("mcpgw's announcement names no address: {line:?}"))
            .trim_end_matches('/')
            .to_owned();
        let admin = line
            .split_once("(admin: http://")
            .and_then(|(_, rest)| rest.split(')').next())
            .map(str::to_owned);
        Gateway { child, addr, admin }
    }

    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// The pid of the `mcpgw serve` process (the supervisor, in a fleet).
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }
}

/// A standalone gateway whose one route (`/mcp`, the demo upstream at `upstream_url`)
/// takes the API key [`RateLimited::API_KEY`] (principal `alice`) and lets her make
/// `burst` requests with no refill within a test, counted in `redis_url` (any URL the
/// directory accepts); closed when Redis cannot count.
pub struct RateLimited {
    pub gateway: Gateway,
    _dir: tempfile::TempDir,
}

impl RateLimited {
    pub const API_KEY: &'static str = "alice-api-key-0123456789";

    #[track_caller]
    pub fn start(upstream_url: &str, redis_url: &str, burst: u32) -> RateLimited {
        let dir = tempfile::tempdir().expect("temp dir");
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, format!("alice:{}\n", Self::API_KEY)).expect("tokens file");
        let config = dir.path().join("mcpgw.toml");
        std::fs::write(
            &config,
            format!(
                "[[upstream]]\nname = \"demo\"\nurl = \"{upstream_url}\"\n[auth]\n\
                 tokens_file = \"{}\"\n[auth.rate_limit]\nper_second = 0.01\n\
                 burst = {burst}\non_redis_error = \"closed\"\ntimeout_ms = 250\n\
                 redis_url = \"{redis_url}\"\n",
                tokens.display(),
            ),
        )
        .expect("config");
        let gateway = Gateway::start(&["--config", &config.display().to_string()]);
        RateLimited { gateway, _dir: dir }
    }

    /// POSTs `body` to `/mcp` with alice's key (and `session`, when given).
    pub fn post(&self, session: Option<&str>, body: &[u8]) -> crate::http::Response {
        let bearer = format!("Bearer {}", Self::API_KEY);
        let mut headers = crate::http::mcp_headers(session);
        if session.is_none() {
            headers.retain(|(k, _)| *k != "MCP-Protocol-Version");
        }
        headers.push(("Authorization", &bearer));
        crate::http::request(&self.gateway.addr, "POST", "/mcp", &headers, body)
    }
}
