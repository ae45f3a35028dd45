//! What the load generator sends: the method mix and the request bodies, serialized
//! ahead of time so a request costs a copy and an integer, not a JSON encoder.

use std::fmt;
use std::io::Write;
use std::str::FromStr;

use bytes::Bytes;
use serde::Serialize;

/// The legacy protocol version the load speaks (the newest session-based one).
pub const LEGACY_VERSION: &str = "2025-11-25";
/// The sessionless protocol version.
pub const MODERN_VERSION: &str = "2026-07-28";

/// Which protocol era a load session speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Era {
    /// Sessions: `initialize`, then `Mcp-Session-Id` on every request; each session
    /// has one owner worker.
    Legacy,
    /// 2026-07-28: no sessions; every request carries its own routing headers and
    /// any worker may answer.
    Modern,
}

impl fmt::Display for Era {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Era::Legacy => "legacy",
            Era::Modern => "modern",
        })
    }
}

/// One kind of request in the mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `tools/call` of the demo upstream's `echo` tool: the typical small call.
    CallEcho,
    /// `tools/list`: a larger answer, read-only.
    ListTools,
}

impl Op {
    /// The `Mcp-Method` header value (2026-07-28).
    pub fn method(self) -> &'static str {
        match self {
            Op::CallEcho => "tools/call",
            Op::ListTools => "tools/list",
        }
    }

    /// The `Mcp-Name` header value, for methods that name a target.
    pub fn name(self) -> Option<&'static str> {
        match self {
            Op::CallEcho => Some("echo"),
            Op::ListTools => None,
        }
    }

    /// The request body with JSON-RPC id `id`. Ids stay unique within a session, as
    /// MCP asks, at the cost of formatting one integer.
    pub fn body(self, era: Era, id: u64) -> Bytes {
        let suffix = match (self, era) {
            (Op::CallEcho, Era::Legacy) => {
                r#","method":"tools/call","params":{"name":"echo","arguments":{"text":"hello"}}}"#
            }
            (Op::ListTools, Era::Legacy) => r#","method":"tools/list","params":{}}"#,
            (Op::CallEcho, Era::Modern) => concat!(
                r#","method":"tools/call","params":{"name":"echo","arguments":{"text":"hello"},"#,
                r#""_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","#,
                r#""io.modelcontextprotocol/clientCapabilities":{}}}}"#
            ),
            (Op::ListTools, Era::Modern) => concat!(
                r#","method":"tools/list","params":{"#,
                r#""_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","#,
                r#""io.modelcontextprotocol/clientCapabilities":{}}}}"#
            ),
        };
        const PREFIX: &str = r#"{"jsonrpc":"2.0","id":"#;
        let mut body = Vec::with_capacity(PREFIX.len() + 20 + suffix.len());
        body.extend_from_slice(PREFIX.as_bytes());
        // Writing to a Vec cannot fail.
        let _ = write!(body, "{id}");
        body.extend_from_slice(suffix.as_bytes());
        Bytes::from(body)
    }
}

/// The legacy `initialize` request that opens a load session.
pub const INITIALIZE_BODY: &str = concat!(
    r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","#,
    r#""capabilities":{},"clientInfo":{"name":"mcpgw-bench","version":"0"}}}"#
);
/// The notification that completes the legacy handshake.
pub const INITIALIZED_BODY: &str = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;

/// The ratio of `tools/call echo` to `tools/list` requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Mix {
    pub calls: u32,
    pub lists: u32,
}

impl Default for Mix {
    /// 20 : 1, the usual MCP gateway load test: mostly small tool calls.
    fn default() -> Self {
        Mix {
            calls: 20,
            lists: 1,
        }
    }
}

impl Mix {
    /// The operation of a session's `seq`-th request: a fixed, evenly repeating
    /// pattern, so every run of the same length sends the same requests.
    pub fn op(&self, seq: u64) -> Op {
        let period = u64::from(self.calls) + u64::from(self.lists);
        if seq % period < u64::from(self.calls) {
            Op::CallEcho
        } else {
            Op::ListTools
        }
    }
}

impl FromStr for Mix {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parse = |s: &str| s.trim().parse::<u32>().ok();
        let (calls, lists) = text
            .split_once(':')
            .and_then(|(a, b)| Some((parse(a)?, parse(b)?)))
            .ok_or_else(|| {
                format!("{text:?} is not a mix like 20:1 (tools/call echo : tools/list)")
            })?;
        if calls == 0 && lists == 0 {
            return Err("the mix needs at least one request kind above 0".into());
        }
        Ok(Mix { calls, lists })
    }
}

impl fmt::Display for Mix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.calls, self.lists)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_mix_sends_one_list_per_twenty_calls() {
        let mix = Mix::default();
        let ops: Vec<Op> = (0..42).map(|seq| mix.op(seq)).collect();
        assert_eq!(ops.iter().filter(|op| **op == Op::ListTools).count(), 2);
        assert_eq!(ops[20], Op::ListTools);
        assert_eq!(ops[41], Op::ListTools);
    }

    #[test]
    fn mixes_parse_and_refuse_nonsense() {
        assert_eq!("3:1".parse::<Mix>(), Ok(Mix { calls: 3, lists: 1 }));
        assert_eq!(
            "1:0".parse::<Mix>().map(|m| m.op(5)),
            Ok(Op::CallEcho),
            "calls only"
        );
        assert_eq!("0:1".parse::<Mix>().map(|m| m.op(5)), Ok(Op::ListTools));
        assert!("0:0".parse::<Mix>().is_err());
        assert!("20".parse::<Mix>().is_err());
    }

    #[test]
    fn bodies_are_valid_json_rpc_with_the_given_id() {
        for era in [Era::Legacy, Era::Modern] {
            for op in [Op::CallEcho, Op::ListTools] {
                let body = op.body(era, 4_294_967_296);
                let value: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
                assert_eq!(value["id"], 4_294_967_296_u64);
                assert_eq!(value["method"], op.method());
                let meta = &value["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"];
                assert_eq!(meta.as_str() == Some(MODERN_VERSION), era == Era::Modern);
                if let Some(name) = op.name() {
                    assert_eq!(value["params"]["name"], name);
                }
            }
        }
        for fixed in [INITIALIZE_BODY, INITIALIZED_BODY] {
            serde_json::from_str::<serde_json::Value>(fixed).expect("JSON");
        }
    }
}
