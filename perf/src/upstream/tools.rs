//! The demo tools: their catalog and what a call does, without I/O.
//!
//! Tools that take time (`sleep_ms`, `slow_stream`) are returned as a plan
//! for the server to carry out, so this module stays pure and the plans can
//! be checked without clocks or sockets.

use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::protocol::RpcError;
use super::session::{SessionState, lock};

/// Caps keep one call from pinning the server; they are far above what a
/// test or benchmark needs.
pub const MAX_STREAM_STEPS: u64 = 10_000;
pub const MAX_STREAM_INTERVAL_MS: u64 = 60_000;
pub const MAX_SLEEP_MS: u64 = 600_000;

const DEFAULT_STREAM_STEPS: u64 = 5;
const DEFAULT_STREAM_INTERVAL_MS: u64 = 50;

/// What the server must do to finish a `tools/call`.
#[derive(Debug, PartialEq)]
pub enum ToolRun {
    /// The call is done; this is its `CallToolResult`.
    Done(Value),
    /// Wait this long, then answer with [`slept_result`].
    Sleep(Duration),
    /// Stream progress events, then the final result.
    Stream(SlowStream),
}

/// A `slow_stream` call: `steps` notifications, `interval` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowStream {
    pub steps: u64,
    pub interval: Duration,
}

impl SlowStream {
    /// The notification announcing `step` (1-based, so the last one reads
    /// `progress == total`). Without a progress token the client has not
    /// asked for progress, so a log message keeps events streaming instead.
    pub fn step_notification(
        &self,
        step: u64,
        progress_token: Option<&Value>,
    ) -> (&'static str, Value) {
        let message = format!("step {step}");
        match progress_token {
            Some(token) => (
                "notifications/progress",
                json!({ "progressToken": token, "progress": step, "total": self.steps, "message": message }),
            ),
            None => (
                "notifications/message",
                json!({ "level": "info", "logger": "slow_stream", "data": message }),
            ),
        }
    }

    pub fn final_result(&self) -> Value {
        let mut result = text_result(format!("streamed {} steps", self.steps));
        result["structuredContent"] = json!({ "steps": self.steps });
        result
    }
}

/// `tools/list` for this server, built once: it never changes.
pub fn catalog() -> &'static Value {
    static CATALOG: LazyLock<Value> = LazyLock::new(build_catalog);
    &CATALOG
}

fn build_catalog() -> Value {
    let read_only = json!({ "readOnlyHint": true, "idempotentHint": true, "destructiveHint": false, "openWorldHint": false });
    let stateful = json!({ "readOnlyHint": false, "idempotentHint": false, "destructiveHint": false, "openWorldHint": false });
    let no_arguments = json!({ "type": "object", "properties": {} });
    json!({ "tools": [
        {
            "name": "echo",
            "description": "Returns its text argument unchanged.",
            "inputSchema": {
                "type": "object",
                "properties": { "text": { "type": "string", "description": "Text to return." } },
                "required": ["text"],
            },
            "annotations": read_only,
        },
        {
            "name": "counter_increment",
            "description": "Adds one to this session's counter and returns the new value (legacy sessions only).",
            "inputSchema": no_arguments,
            "annotations": stateful,
        },
        {
            "name": "session_append",
            "description": "Appends an item to this session's list (legacy sessions only).",
            "inputSchema": {
                "type": "object",
                "properties": { "item": { "type": "string", "description": "Item to append." } },
                "required": ["item"],
            },
            "annotations": stateful,
        },
        {
            "name": "session_read",
            "description": "Returns this session's list as a JSON array (legacy sessions only).",
            "inputSchema": no_arguments,
            "annotations": read_only,
        },
        {
            "name": "slow_stream",
            "description": "Streams `count` progress notifications `interval_ms` apart over SSE, then returns.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "count": { "type": "integer", "minimum": 0, "maximum": MAX_STREAM_STEPS, "default": DEFAULT_STREAM_STEPS },
                    "interval_ms": { "type": "integer", "minimum": 0, "maximum": MAX_STREAM_INTERVAL_MS, "default": DEFAULT_STREAM_INTERVAL_MS },
                },
            },
            "annotations": read_only,
        },
        {
            "name": "sleep_ms",
            "description": "Waits `ms` milliseconds, then returns.",
            "inputSchema": {
                "type": "object",
                "properties": { "ms": { "type": "integer", "minimum": 0, "maximum": MAX_SLEEP_MS } },
                "required": ["ms"],
            },
            "annotations": read_only,
        },
    ]})
}

/// Runs tool `name`. `session` is `None` in the sessionless era, where the
/// stateful tools explain that they need a session instead of failing
/// mysteriously. Bad arguments come back as a tool result with `isError`,
/// as the MCP spec asks, so a model can read and correct them; only an
/// unknown tool is a protocol error.
pub fn call_tool(
    name: &str,
    arguments: &Map<String, Value>,
    session: Option<&Mutex<SessionState>>,
) -> Result<ToolRun, RpcError> {
    let run = match name {
        "echo" => match arguments.get("text") {
            Some(Value::String(text)) => ToolRun::Done(text_result(text.clone())),
            _ => ToolRun::Done(error_result("echo needs arguments.text, a string")),
        },
        "counter_increment" => match session {
            Some(state) => {
                let value = {
                    let mut state = lock(state);
                    state.counter += 1;
                    state.counter
                };
                let mut result = text_result(value.to_string());
                result["structuredContent"] = json!({ "value": value });
                ToolRun::Done(result)
            }
            None => ToolRun::Done(needs_session(name)),
        },
        "session_append" => match (session, arguments.get("item")) {
            (None, _) => ToolRun::Done(needs_session(name)),
            (Some(state), Some(Value::String(item))) => {
                let length = {
                    let mut state = lock(state);
                    state.items.push(item.clone());
                    state.items.len()
                };
                let mut result = text_result(format!("appended; the session holds {length} items"));
                result["structuredContent"] = json!({ "length": length });
                ToolRun::Done(result)
            }
            (Some(_), _) => ToolRun::Done(error_result(
                "session_append needs arguments.item, a string",
            )),
        },
        "session_read" => match session {
            Some(state) => {
                let items = Value::from(lock(state).items.clone());
                let mut result = text_result(items.to_string());
                result["structuredContent"] = json!({ "items": items });
                ToolRun::Done(result)
            }
            None => ToolRun::Done(needs_session(name)),
        },
        "slow_stream" => {
            let steps =
                integer_argument(arguments, "count", DEFAULT_STREAM_STEPS, MAX_STREAM_STEPS);
            let interval = integer_argument(
                arguments,
                "interval_ms",
                DEFAULT_STREAM_INTERVAL_MS,
                MAX_STREAM_INTERVAL_MS,
            );
            match (steps, interval) {
                (Ok(steps), Ok(interval_ms)) => ToolRun::Stream(SlowStream {
                    steps,
                    interval: Duration::from_millis(interval_ms),
                }),
                (Err(problem), _) | (_, Err(problem)) => {
                    ToolRun::Done(error_result(format!("slow_stream: {problem}")))
                }
            }
        }
        "sleep_ms" => match arguments
            .get("ms")
            .map(|_| integer_argument(arguments, "ms", 0, MAX_SLEEP_MS))
        {
            Some(Ok(ms)) => ToolRun::Sleep(Duration::from_millis(ms)),
            Some(Err(problem)) => ToolRun::Done(error_result(format!("sleep_ms: {problem}"))),
            None => ToolRun::Done(error_result("sleep_ms needs arguments.ms, an integer")),
        },
        _ => {
            return Err(RpcError::invalid_params(format!(
                "unknown tool: {name}; tools/list names the tools this server has"
            )));
        }
    };
    Ok(run)
}

/// The answer to a finished [`ToolRun::Sleep`].
pub fn slept_result(slept: Duration) -> Value {
    text_result(format!("slept {} ms", slept.as_millis()))
}

fn integer_argument(
    arguments: &Map<String, Value>,
    key: &str,
    default: u64,
    max: u64,
) -> Result<u64, String> {
    match arguments.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(value) => match value.as_u64() {
            Some(number) if number <= max => Ok(number),
            _ => Err(format!(
                "arguments.{key} must be an integer from 0 to {max}, got {value}"
            )),
        },
    }
}

fn needs_session(tool: &str) -> Value {
    error_result(format!(
        "{tool} keeps per-session state: call it in a legacy session"
    ))
}

fn text_result(text: String) -> Value {
    json!({ "content": [{ "type": "text", "text": text }], "isError": false })
}

fn error_result(text: impl Into<String>) -> Value {
    json!({ "content": [{ "type": "text", "text": text.into() }], "isError": true })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    fn done(run: Result<ToolRun, RpcError>) -> Value {
        match run {
            Ok(ToolRun::Done(result)) => result,
            other => panic!("expected a finished call, got {other:?}"),
        }
    }

    fn text_of(result: &Value) -> &str {
        result["content"][0]["text"].as_str().unwrap_or_default()
    }

    #[test]
    fn catalog_lists_every_tool_with_schema_and_annotations() {
        let tools = catalog()["tools"].as_array().cloned().unwrap_or_default();
        let names: Vec<&str> = tools
            .iter()
            .filter_map(|tool| tool["name"].as_str())
            .collect();
        assert_eq!(
            names,
            [
                "echo",
                "counter_increment",
                "session_append",
                "session_read",
                "slow_stream",
                "sleep_ms"
            ]
        );
        for tool in &tools {
            assert_eq!(tool["inputSchema"]["type"], "object", "{tool}");
            assert!(tool["annotations"].is_object(), "{tool}");
            // Every listed tool must be callable: only unknown names are protocol errors.
            let name = tool["name"].as_str().unwrap_or_default();
            assert!(
                call_tool(name, &Map::new(), Some(&Mutex::default())).is_ok(),
                "{name}"
            );
        }
        let echo = &tools[0];
        assert_eq!(echo["annotations"]["readOnlyHint"], true);
        assert_eq!(echo["annotations"]["idempotentHint"], true);
    }

    #[test]
    fn echo_returns_its_text() {
        let result = done(call_tool("echo", &args(json!({"text": "hi there"})), None));
        assert_eq!(
            result,
            json!({"content": [{"type": "text", "text": "hi there"}], "isError": false})
        );
        let result = done(call_tool("echo", &args(json!({"text": 5})), None));
        assert_eq!(result["isError"], true);
    }

    #[test]
    fn counter_counts_per_session() {
        let first = Mutex::default();
        let second = Mutex::default();
        for expected in 1..=3u64 {
            let result = done(call_tool("counter_increment", &Map::new(), Some(&first)));
            assert_eq!(text_of(&result), expected.to_string());
            assert_eq!(result["structuredContent"], json!({"value": expected}));
        }
        let result = done(call_tool("counter_increment", &Map::new(), Some(&second)));
        assert_eq!(result["structuredContent"]["value"], 1);
    }

    #[test]
    fn stateful_tools_refuse_without_a_session() {
        for tool in ["counter_increment", "session_append", "session_read"] {
            let result = done(call_tool(tool, &args(json!({"item": "x"})), None));
            assert_eq!(result["isError"], true, "{tool}");
            assert_eq!(
                text_of(&result),
                format!("{tool} keeps per-session state: call it in a legacy session")
            );
        }
    }

    #[test]
    fn session_list_appends_and_reads_back() {
        let state = Mutex::default();
        let result = done(call_tool("session_read", &Map::new(), Some(&state)));
        assert_eq!(text_of(&result), "[]");
        for (item, length) in [("a", 1), ("b \"quoted\"", 2)] {
            let result = done(call_tool(
                "session_append",
                &args(json!({"item": item})),
                Some(&state),
            ));
            assert_eq!(result["structuredContent"]["length"], length);
        }
        let result = done(call_tool("session_read", &Map::new(), Some(&state)));
        let items: Value = serde_json::from_str(text_of(&result)).unwrap_or_default();
        assert_eq!(items, json!(["a", "b \"quoted\""]));
        assert_eq!(
            result["structuredContent"],
            json!({"items": ["a", "b \"quoted\""]})
        );
        let result = done(call_tool("session_append", &Map::new(), Some(&state)));
        assert_eq!(result["isError"], true);
    }

    #[test]
    fn slow_stream_plans_steps_with_defaults_and_limits() {
        let plan = call_tool("slow_stream", &Map::new(), None);
        assert_eq!(
            plan,
            Ok(ToolRun::Stream(SlowStream {
                steps: 5,
                interval: Duration::from_millis(50)
            }))
        );
        let plan = call_tool(
            "slow_stream",
            &args(json!({"count": 2, "interval_ms": 0})),
            None,
        );
        assert_eq!(
            plan,
            Ok(ToolRun::Stream(SlowStream {
                steps: 2,
                interval: Duration::ZERO
            }))
        );
        for bad in [
            json!({"count": -1}),
            json!({"count": "3"}),
            json!({"interval_ms": 60_001}),
            json!({"count": 1.5}),
        ] {
            let result = done(call_tool("slow_stream", &args(bad.clone()), None));
            assert_eq!(result["isError"], true, "{bad}");
        }
    }

    #[test]
    fn slow_stream_reports_progress_or_logs() {
        let plan = SlowStream {
            steps: 3,
            interval: Duration::ZERO,
        };
        let (method, params) = plan.step_notification(2, Some(&json!("tok")));
        assert_eq!(method, "notifications/progress");
        assert_eq!(
            params,
            json!({"progressToken": "tok", "progress": 2, "total": 3, "message": "step 2"})
        );
        let (method, params) = plan.step_notification(1, None);
        assert_eq!(method, "notifications/message");
        assert_eq!(params["level"], "info");
        assert_eq!(params["data"], "step 1");
        assert_eq!(plan.final_result()["structuredContent"]["steps"], 3);
    }

    #[test]
    fn sleep_needs_a_bounded_duration() {
        assert_eq!(
            call_tool("sleep_ms", &args(json!({"ms": 25})), None),
            Ok(ToolRun::Sleep(Duration::from_millis(25)))
        );
        for bad in [
            json!({}),
            json!({"ms": -5}),
            json!({"ms": MAX_SLEEP_MS + 1}),
        ] {
            let result = done(call_tool("sleep_ms", &args(bad.clone()), None));
            assert_eq!(result["isError"], true, "{bad}");
        }
        assert_eq!(
            text_of(&slept_result(Duration::from_millis(25))),
            "slept 25 ms"
        );
    }

    #[test]
    fn unknown_tool_is_invalid_params() {
        let error = call_tool("nope", &Map::new(), None).expect_err("unknown tool");
        assert_eq!(error.code, super::super::protocol::INVALID_PARAMS);
        assert!(error.message.starts_with("unknown tool"));
    }
}
