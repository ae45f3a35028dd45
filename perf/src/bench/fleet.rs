//! The processes `compare` and `sessions` run: Redis, the demo upstream, mesh
//! certificates, and mcpgw supervisors, all on loopback ports. Each process logs to
//! its own file in the report directory; readiness is the line the process prints
//! on stdout. Every process is stopped by its own pid (SIGTERM, then SIGKILL), and
//! killed when dropped, so a failed run leaves nothing behind.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

use super::redis::RedisClient;

/// How long a process may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a process may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Where the binaries under test are.
#[derive(Debug, Clone)]
pub struct Bins {
    pub mcpgw: PathBuf,
    pub bench: PathBuf,
}

impl Bins {
    /// `--bin-dir` when given; otherwise the directory of this very binary (so a
    /// release `mcpgw-bench` uses the release `mcpgw` beside it), then the
    /// workspace's `target/release` and `target/debug`.
    pub fn locate(bin_dir: Option<&Path>) -> Result<Bins, String> {
        if let Some(dir) = bin_dir {
            let bins = Bins {
                mcpgw: dir.join("mcpgw"),
                bench: dir.join("mcpgw-bench"),
            };
            for path in [&bins.mcpgw, &bins.bench] {
                if !path.is_file() {
                    return Err(format!(
                        "{} is missing: build with `cargo build --release --workspace --bins`",
                        path.display()
                    ));
                }
            }
            return Ok(bins);
        }
        let own = std::env::current_exe()
            .map_err(|e| format!("cannot find this executable's path: {e}"))?;
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let candidates = own.parent().map(Path::to_path_buf).into_iter().chain([
            workspace.join("target/release"),
            workspace.join("target/debug"),
        ]);
        for dir in candidates {
            if dir.join("mcpgw").is_file() {
                return Ok(Bins {
                    mcpgw: dir.join("mcpgw"),
                    bench: own,
                });
            }
        }
        Err("cannot find the mcpgw binary: run `make build-release` or pass --bin-dir".into())
    }
}

/// A child process with its log file.
pub struct Proc {
    pub name: String,
    pub pid: u32,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `program` and waits until a stdout line contains `ready`; returns the
    /// process and that line. On failure the error quotes the end of the log.
    pub async fn start(
        name: &str,
        program: &Path,
        args: &[String],
        log_dir: &Path,
        ready: &str,
    ) -> Result<(Proc, String), String> {
        let log = log_dir.join(format!("{name}.log"));
        // Both streams append to one file, so neither overwrites the other's lines.
        let stderr = std::fs::File::create(&log)
            .and_then(|_| std::fs::OpenOptions::new().append(true).open(&log))
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {name} ({}): {e}", program.display()))?;
        let pid = child.id().ok_or_else(|| format!("{name} exited at once"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| format!("{name}: no stdout pipe"))?;
        let (found_tx, found_rx) = oneshot::channel();
        let needle = ready.to_owned();
        let log_copy = log.clone();
        tokio::spawn(async move {
            // Copies stdout into the log (after stderr's lines so far) and reports the
            // ready line; keeps draining so the child never blocks on a full pipe.
            let mut file = tokio::fs::OpenOptions::new()
                .append(true)
                .open(&log_copy)
                .await
                .ok();
            let mut lines = BufReader::new(stdout).lines();
            let mut found_tx = Some(found_tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(file) = file.as_mut() {
                    let _ = file.write_all(format!("{line}\n").as_bytes()).await;
                }
                if line.contains(&needle)
                    && let Some(tx) = found_tx.take()
                {
                    let _ = tx.send(line);
                }
            }
        });
        let mut proc = Proc {
            name: name.to_owned(),
            pid,
            child,
            log,
        };
        match tokio::time::timeout(READY_TIMEOUT, found_rx).await {
            Ok(Ok(line)) => Ok((proc, line)),
            Ok(Err(_)) => {
                let status = proc.child.wait().await.ok();
                Err(format!(
                    "{name} exited before it was ready ({}): {}",
                    status.map_or("unknown status".into(), |s| s.to_string()),
                    proc.log_tail()
                ))
            }
            Err(_) => {
                let tail = proc.log_tail();
                proc.stop().await;
                Err(format!(
                    "{name} printed no {ready:?} line within {READY_TIMEOUT:?}: {tail}"
                ))
            }
        }
    }

    /// The last lines of the log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
        if tail.is_empty() {
            format!("(no output; log {})", self.log.display())
        } else {
            format!("{tail} (log {})", self.log.display())
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited in time.
    pub async fn stop(mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if tokio::time::timeout(STOP_TIMEOUT, self.child.wait())
            .await
            .is_err()
        {
            eprintln!(
                "mcpgw-bench: {} did not stop within {STOP_TIMEOUT:?}; killing it",
                self.name
            );
            let _ = self.child.kill().await;
        }
    }
}

/// A `redis-server` of our own, without persistence.
pub struct RedisServer {
    pub proc: Proc,
    pub url: String,
}

impl RedisServer {
    pub async fn start(name: &str, log_dir: &Path) -> Result<RedisServer, String> {
        let data_dir = log_dir.join(format!("{name}-data"));
        std::fs::create_dir_all(&data_dir)
            .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
        let mut last_error = String::new();
        // A free port can be taken between our probe and Redis's bind: try a few.
        for _ in 0..5 {
            let port = free_port()?;
            let args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &data_dir.display().to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let started = Proc::start(
                name,
                Path::new("redis-server"),
                &args,
                log_dir,
                "Ready to accept connections",
            )
            .await;
            let proc = match started {
                Ok((proc, _)) => proc,
                Err(e) => {
                    last_error = e;
                    continue;
                }
            };
            let url = format!("redis://127.0.0.1:{port}/");
            match wait_for_redis(&url).await {
                Ok(()) => return Ok(RedisServer { proc, url }),
                Err(e) => {
                    last_error = e;
                    proc.stop().await;
                }
            }
        }
        Err(format!(
            "redis-server did not start (is it installed? `make deps` installs it): {last_error}"
        ))
    }
}

async fn wait_for_redis(url: &str) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let attempt = async { RedisClient::connect(url).await?.command(&["PING"]).await };
        match attempt.await {
            Ok(_) => return Ok(()),
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

/// The demo upstream (`mcpgw-bench upstream`) on a free port.
pub struct UpstreamServer {
    pub proc: Proc,
    /// Its MCP endpoint.
    pub url: String,
}

impl UpstreamServer {
    pub async fn start(bins: &Bins, log_dir: &Path) -> Result<UpstreamServer, String> {
        let args = vec!["upstream".into(), "--listen".into(), "127.0.0.1:0".into()];
        let (proc, line) = Proc::start(
            "upstream",
            &bins.bench,
            &args,
            log_dir,
            "listening on http://",
        )
        .await?;
        let url = url_in(&line).ok_or_else(|| format!("upstream: no URL in {line:?}"))?;
        Ok(UpstreamServer { proc, url })
    }
}

/// The first `http://…` word of a line.
pub fn url_in(line: &str) -> Option<String> {
    line.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(|w| w.trim_end_matches(['/', ',', ')']).to_owned())
}

/// Mesh certificates made with the real `mcpgw certs`.
pub struct MeshCerts {
    pub dir: PathBuf,
}

impl MeshCerts {
    pub async fn create(bins: &Bins, dir: &Path, members: &[&str]) -> Result<MeshCerts, String> {
        let _ = std::fs::remove_dir_all(dir);
        let dir_arg = dir.display().to_string();
        let mut commands = vec![vec!["certs", "init", "--dir", &dir_arg]];
        for member in members {
            commands.push(vec!["certs", "issue", "--dir", &dir_arg, "--name", member]);
        }
        for args in commands {
            let output = Command::new(&bins.mcpgw)
                .args(&args)
                .output()
                .await
                .map_err(|e| format!("cannot run mcpgw {args:?}: {e}"))?;
            if !output.status.success() {
                return Err(format!(
                    "mcpgw {args:?} failed: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
            }
        }
        Ok(MeshCerts {
            dir: dir.to_path_buf(),
        })
    }

    fn flags(&self, member: &str) -> Vec<String> {
        let path = |name: String| self.dir.join(name).display().to_string();
        vec![
            "--mesh-ca".into(),
            path("ca.crt".into()),
            "--mesh-cert".into(),
            path(format!("{member}.crt")),
            "--mesh-key".into(),
            path(format!("{member}.key")),
        ]
    }
}

/// What a fleet of supervisors is started with.
pub struct FleetSpec<'a> {
    /// Log and process name prefix, e.g. `quic`.
    pub name: &'a str,
    /// `--mesh-transport` value, or `unix`: `tcp` with `--mesh-same-host unix`.
    pub transport: &'a str,
    pub redis_url: &'a str,
    pub upstream_url: &'a str,
    /// One supervisor per member, each with `--workers 1`, so one URL is one worker.
    pub members: &'a [&'a str],
    /// Redis key prefix, so fleets sharing one Redis never meet.
    pub key_prefix: &'a str,
}

/// The virtual server every fleet serves beside the plain route `demo`: three
/// members, each a route of its own to the same upstream, with filters that share
/// its tools out so no name collides and names stay unprefixed. The load's `echo`
/// call is then the same request on both routes; a session's call finds its member
/// by the same catalog lookup under every prefix rule.
pub const VIRTUAL_SERVER: &str = "all";

/// The members of [`VIRTUAL_SERVER`]: (route name, the tools it exposes).
const VIRTUAL_MEMBERS: [(&str, &str); 3] = [
    ("member-a", "echo"),
    ("member-b", "counter_*"),
    ("member-c", "session_*"),
];

/// The configuration file of a fleet member: the plain route and the virtual server.
fn config_file(upstream_url: &str) -> String {
    let mut toml = format!("[[upstream]]\nname = \"demo\"\nurl = {upstream_url:?}\n");
    for (member, _) in VIRTUAL_MEMBERS {
        toml.push_str(&format!(
            "\n[[upstream]]\nname = {member:?}\nurl = {upstream_url:?}\n"
        ));
    }
    toml.push_str(&format!(
        "\n[[server]]\nname = {VIRTUAL_SERVER:?}\nprefix = \"never\"\n"
    ));
    for (member, tools) in VIRTUAL_MEMBERS {
        toml.push_str(&format!(
            "\n[[server.member]]\nupstream = {member:?}\ntools = {{ include = [{tools:?}] }}\n"
        ));
    }
    toml
}

/// Supervisors sharing one Redis: one URL (one worker) each.
pub struct Fleet {
    pub supervisors: Vec<Proc>,
    /// The plain route `demo` of each supervisor.
    pub urls: Vec<String>,
    /// The virtual server [`VIRTUAL_SERVER`] of each supervisor, in the same order.
    pub virtual_urls: Vec<String>,
}

impl Fleet {
    pub async fn start(
        bins: &Bins,
        certs: &MeshCerts,
        spec: &FleetSpec<'_>,
        log_dir: &Path,
    ) -> Result<Fleet, String> {
        let mut fleet = Fleet {
            supervisors: Vec::new(),
            urls: Vec::new(),
            virtual_urls: Vec::new(),
        };
        let config = log_dir.join(format!("{}-mcpgw.toml", spec.name));
        std::fs::write(&config, config_file(spec.upstream_url))
            .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        let config = config.display().to_string();
        // `unix` is the TCP mesh with the same-host path on: both workers share this
        // kernel, so every forward takes the Unix socket.
        let (transport, same_host) = match spec.transport {
            "unix" => ("tcp", true),
            other => (other, false),
        };
        for member in spec.members {
            let mut args: Vec<String> = [
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--workers",
                "1",
                "--redis",
                spec.redis_url,
                "--key-prefix",
                spec.key_prefix,
                "--config",
                &config,
                "--mesh-transport",
                transport,
                "--mesh-listen",
                "127.0.0.1:0",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            if same_host {
                args.extend(["--mesh-same-host".into(), "unix".into()]);
            }
            args.extend(certs.flags(member));
            let name = format!("{}-{member}", spec.name);
            let started =
                Proc::start(&name, &bins.mcpgw, &args, log_dir, "mcpgw listening on").await;
            let (proc, line) = match started {
                Ok(started) => started,
                Err(e) => {
                    fleet.stop().await;
                    return Err(e);
                }
            };
            let Some(base) = url_in(&line) else {
                proc.stop().await;
                fleet.stop().await;
                return Err(format!("{name}: no address in {line:?}"));
            };
            fleet.urls.push(format!("{base}/servers/demo/mcp"));
            fleet
                .virtual_urls
                .push(format!("{base}/servers/{VIRTUAL_SERVER}/mcp"));
            fleet.supervisors.push(proc);
        }
        Ok(fleet)
    }

    pub fn pids(&self) -> Vec<u32> {
        self.supervisors.iter().map(|p| p.pid).collect()
    }

    pub async fn stop(self) {
        for proc in self.supervisors {
            proc.stop().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_lines_yield_their_url() {
        assert_eq!(
            url_in("mcpgw listening on http://127.0.0.1:8080 (2 workers)").as_deref(),
            Some("http://127.0.0.1:8080")
        );
        assert_eq!(
            url_in("mcpgw-bench upstream listening on http://127.0.0.1:9/mcp").as_deref(),
            Some("http://127.0.0.1:9/mcp")
        );
        assert_eq!(url_in("no address here"), None);
    }

    #[test]
    fn the_fleet_configuration_names_every_member_once_and_filters_their_tools_apart() {
        let toml = config_file("http://127.0.0.1:9/mcp");
        let parsed: toml::Value = toml::from_str(&toml).expect("valid TOML");
        let upstreams = parsed["upstream"].as_array().expect("upstreams");
        assert_eq!(upstreams.len(), 1 + VIRTUAL_MEMBERS.len());
        let server = &parsed["server"].as_array().expect("servers")[0];
        assert_eq!(server["name"].as_str(), Some(VIRTUAL_SERVER));
        let includes: Vec<&str> = server["member"]
            .as_array()
            .expect("members")
            .iter()
            .map(|m| m["tools"]["include"][0].as_str().expect("a pattern"))
            .collect();
        assert_eq!(includes, ["echo", "counter_*", "session_*"]);
    }
}
