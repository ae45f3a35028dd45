//! The demo upstream (`mcpgw-bench upstream`): a fast, stateful MCP server with exact
//! execution counters at `GET /stats` and the ids of the requests run in each session
//! at `GET /executed`.

use std::path::Path;
use std::time::Duration;

use crate::process::Child;

/// How long the demo upstream may take to announce its address.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The demo upstream on an ephemeral port, killed when dropped.
pub struct Upstream {
    pub child: Child,
    /// Its MCP endpoint, e.g. `http://127.0.0.1:41234/mcp`.
    pub url: String,
}

impl Upstream {
    /// Starts the workspace's `mcpgw-bench upstream`.
    pub fn start() -> Upstream {
        Self::start_with(&[])
    }

    /// Starts it with extra flags.
    pub fn start_with(extra: &[&str]) -> Upstream {
        Self::start_binary(&crate::bin("mcpgw-bench"), extra)
    }

    /// Starts `binary upstream` (perf's own tests pass the binary cargo built for
    /// them) and waits for the line that announces the bound address.
    #[track_caller]
    pub fn start_binary(binary: &Path, extra: &[&str]) -> Upstream {
        let mut args = vec!["upstream", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut child = Child::spawn("upstream", binary, &args);
        let line = child.wait_for_line("listening on", READY_WITHIN);
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("the upstream's announcement names no URL: {line:?}"))
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

    /// The upstream's execution counters (`GET /stats`): `requests`, `tool_calls`,
    /// `sessions_open`, `sessions_created`.
    #[track_caller]
    pub fn stats(&self) -> serde_json::Value {
        let response = crate::http::request(&self.addr(), "GET", "/stats", &[], b"");
        assert_eq!(response.status, 200, "upstream /stats: {}", response.text());
        response.json()
    }

    /// One counter of [`stats`](Self::stats).
    #[track_caller]
    pub fn counter(&self, name: &str) -> u64 {
        let stats = self.stats();
        stats[name]
            .as_u64()
            .unwrap_or_else(|| panic!("upstream /stats has no counter {name:?}: {stats}"))
    }

    /// The ids of the requests run in each upstream session (`GET /executed`): upstream
    /// session id → ids in the order they ran, and how many runs the bounded log left
    /// out.
    #[track_caller]
    pub fn executed(&self) -> Executed {
        let response = crate::http::request(&self.addr(), "GET", "/executed", &[], b"");
        assert_eq!(
            response.status,
            200,
            "upstream /executed: {}",
            response.text()
        );
        let body = response.json();
        let sessions = body["sessions"]
            .as_object()
            .unwrap_or_else(|| panic!("upstream /executed names no sessions: {body}"))
            .iter()
            .map(|(session, ids)| {
                let ids = ids.as_array().cloned().unwrap_or_default();
                (session.clone(), ids)
            })
            .collect();
        let dropped = body["dropped"]
            .as_u64()
            .unwrap_or_else(|| panic!("upstream /executed has no dropped count: {body}"));
        Executed { sessions, dropped }
    }
}

/// What [`Upstream::executed`] read.
#[derive(Debug, Clone, Default)]
pub struct Executed {
    /// Upstream session id → the JSON-RPC ids of the requests run in it, in order.
    pub sessions: std::collections::BTreeMap<String, Vec<serde_json::Value>>,
    /// Runs the upstream's bounded log did not keep: above zero, the picture is partial.
    pub dropped: u64,
}
