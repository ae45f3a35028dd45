//! A real `redis-server` (Debian package `redis-server`) on a free loopback port, with
//! persistence off, killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub struct RedisServer {
    /// Behind a lock so that a test can restart the server through a shared reference.
    child: Mutex<Child>,
    pub port: u16,
    dir: PathBuf,
}

impl RedisServer {
    pub fn start() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-mesh-redis-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create redis dir");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("find a free port")
            .port();
        let child = Self::spawn(port, &dir);
        let server = Self {
            child: Mutex::new(child),
            port,
            dir,
        };
        server.wait_ready();
        server
    }

    fn spawn(port: u16, dir: &PathBuf) -> Child {
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is needed for these tests: apt-get install -y redis-server")
    }

    fn wait_ready(&self) {
        use std::io::{Read, Write};
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                let mut buf = [0u8; 7];
                if s.write_all(b"PING\r\n").is_ok()
                    && s.read_exact(&mut buf).is_ok()
                    && &buf == b"+PONG\r\n"
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server and starts an empty one on the same port: every connection to
    /// it breaks, and every subscription is gone.
    pub fn restart(&self) {
        {
            let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
            let _ = child.kill();
            let _ = child.wait();
            *child = Self::spawn(self.port, &self.dir);
        }
        self.wait_ready();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain connection for test commands.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test redis")
    }

    /// Sends a signal (`-STOP`, `-CONT`, …) to the server process.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.lock().unwrap_or_else(|e| e.into_inner()).id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill {sig} failed");
    }

    /// `PUBSUB NUMSUB channel`: the channel's subscribers.
    pub async fn numsub(&self, channel: &str) -> i64 {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut self.conn().await)
            .await
            .expect("PUBSUB NUMSUB");
        n
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
