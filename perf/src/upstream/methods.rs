//! JSON-RPC method dispatch, without I/O: a method and its params in, a
//! [`Reply`] out. Transport checks (sessions, headers) happen before this.

use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::protocol::{self, Era, RESOURCE_NOT_FOUND, RpcError};
use super::session::{SessionState, lock};
use super::tools::{self, SlowStream, ToolRun};

/// The one resource: the calling session's state.
pub const STATE_RESOURCE_URI: &str = "demo://session/state";

/// What a request's answer is, or what the server must do to produce it.
#[derive(Debug, PartialEq)]
pub enum Reply {
    Result(Value),
    /// A result that never changes, shared rather than rebuilt per request.
    Shared(&'static Value),
    Error(RpcError),
    /// `sleep_ms`: wait, then answer with [`tools::slept_result`].
    Sleep(Duration),
    /// `slow_stream`: progress events over SSE, then the result.
    Stream {
        plan: SlowStream,
        progress_token: Option<Value>,
    },
}

/// Answers `method`. `session` is the caller's state in the legacy era and
/// `None` in the sessionless one. Results of the 2026-07-28 era carry
/// `resultType`, including those the server finishes later (see
/// [`finish_result`]).
pub fn dispatch(
    era: Era,
    method: &str,
    params: Option<&Map<String, Value>>,
    session: Option<&Mutex<SessionState>>,
) -> Reply {
    let reply = match (method, era) {
        ("initialize", Era::Legacy) => Reply::Result(initialize_result(params)),
        ("server/discover", Era::Modern) => Reply::Shared(&DISCOVER),
        ("ping", _) => Reply::Result(json!({})),
        ("tools/list", Era::Legacy) => Reply::Shared(tools::catalog()),
        ("tools/list", Era::Modern) => Reply::Shared(&MODERN_TOOL_CATALOG),
        ("tools/call", _) => call_tool(params, session),
        ("resources/list", _) => Reply::Result(resource_list(session.is_some())),
        ("resources/read", _) => read_resource(params, session),
        ("resources/templates/list", _) => Reply::Result(json!({ "resourceTemplates": [] })),
        ("prompts/list", Era::Legacy) => Reply::Shared(&PROMPT_LIST),
        ("prompts/list", Era::Modern) => Reply::Shared(&MODERN_PROMPT_LIST),
        ("prompts/get", _) => get_prompt(params),
        ("initialize", Era::Modern) => Reply::Error(RpcError::new(
            protocol::METHOD_NOT_FOUND,
            "Method not found: initialize is not used at 2026-07-28; send requests directly \
             (server/discover describes this server)",
        )),
        _ => Reply::Error(RpcError::method_not_found(method)),
    };
    match (reply, era) {
        (Reply::Result(result), Era::Modern) => Reply::Result(modern_shape(method, result)),
        (reply, _) => reply,
    }
}

/// Shapes a result of `method` for the 2026-07-28 wire: the `resultType`
/// tag, and for cacheable methods the freshness hints that era's clients
/// require.
fn modern_shape(method: &str, result: Value) -> Value {
    let mut result = protocol::mark_complete(result);
    if let (Some(scope), Value::Object(object)) = (cache_scope(method), &mut result) {
        // A TTL of 0 keeps caching clients and gateways coming back, so every
        // request still reaches this server and its counters stay exact.
        object.insert("ttlMs".to_owned(), Value::from(0));
        object.insert("cacheScope".to_owned(), Value::from(scope));
    }
    result
}

/// Cacheable methods, and whether their result is the same for every caller.
fn cache_scope(method: &str) -> Option<&'static str> {
    match method {
        "server/discover" | "tools/list" | "prompts/list" | "resources/templates/list" => {
            Some("public")
        }
        "resources/list" | "resources/read" => Some("private"),
        _ => None,
    }
}

/// Shapes a result the server produced after dispatch for the given era.
pub fn finish_result(era: Era, result: Value) -> Value {
    match era {
        Era::Legacy => result,
        Era::Modern => protocol::mark_complete(result),
    }
}

fn capabilities() -> Value {
    json!({
        "tools": { "listChanged": false },
        "resources": { "listChanged": false, "subscribe": false },
        "prompts": { "listChanged": false },
    })
}

fn server_info() -> Value {
    json!({ "name": "mcpgw-bench-upstream", "version": env!("CARGO_PKG_VERSION") })
}

fn initialize_result(params: Option<&Map<String, Value>>) -> Value {
    let requested = params
        .and_then(|params| params.get("protocolVersion"))
        .and_then(Value::as_str);
    json!({
        "protocolVersion": protocol::negotiate_legacy_version(requested),
        "capabilities": capabilities(),
        "serverInfo": server_info(),
    })
}

static DISCOVER: LazyLock<Value> = LazyLock::new(|| {
    let discover = json!({
        "supportedVersions": [protocol::MODERN_VERSION],
        "capabilities": capabilities(),
        "serverInfo": server_info(),
    });
    modern_shape("server/discover", discover)
});

static MODERN_TOOL_CATALOG: LazyLock<Value> =
    LazyLock::new(|| modern_shape("tools/list", tools::catalog().clone()));

static PROMPT_LIST: LazyLock<Value> = LazyLock::new(|| {
    json!({ "prompts": [{
        "name": "greet",
        "description": "A greeting for someone.",
        "arguments": [{ "name": "name", "description": "Who to greet.", "required": true }],
    }]})
});

static MODERN_PROMPT_LIST: LazyLock<Value> =
    LazyLock::new(|| modern_shape("prompts/list", PROMPT_LIST.clone()));

fn call_tool(params: Option<&Map<String, Value>>, session: Option<&Mutex<SessionState>>) -> Reply {
    let Some(name) = params
        .and_then(|params| params.get("name"))
        .and_then(Value::as_str)
    else {
        return Reply::Error(RpcError::invalid_params(
            "tools/call needs params.name, a string naming the tool",
        ));
    };
    let no_arguments = Map::new();
    let arguments = match params.and_then(|params| params.get("arguments")) {
        None | Some(Value::Null) => &no_arguments,
        Some(Value::Object(arguments)) => arguments,
        Some(_) => {
            return Reply::Error(RpcError::invalid_params(
                "tools/call params.arguments must be an object",
            ));
        }
    };
    match tools::call_tool(name, arguments, session) {
        Ok(ToolRun::Done(result)) => Reply::Result(result),
        Ok(ToolRun::Sleep(duration)) => Reply::Sleep(duration),
        Ok(ToolRun::Stream(plan)) => Reply::Stream {
            plan,
            progress_token: progress_token(params),
        },
        Err(error) => Reply::Error(error),
    }
}

/// `params._meta.progressToken`, when the client asked for progress.
fn progress_token(params: Option<&Map<String, Value>>) -> Option<Value> {
    let token = params?.get("_meta")?.get("progressToken")?;
    (token.is_string() || token.is_i64() || token.is_u64()).then(|| token.clone())
}

fn resource_list(has_session: bool) -> Value {
    // Without a session there is no state to show.
    let resources = if has_session {
        json!([{
            "uri": STATE_RESOURCE_URI,
            "name": "session-state",
            "description": "This session's counter and list.",
            "mimeType": "application/json",
        }])
    } else {
        json!([])
    };
    json!({ "resources": resources })
}

/// `--resources`: `count` generated resources after the session's state, listed
/// `page` at a time; a page's `nextCursor` is the position of the next item.
#[derive(Debug, Clone, Copy)]
pub struct GeneratedResources {
    pub count: usize,
    pub page: usize,
}

impl GeneratedResources {
    /// The `resources/list` page `params.cursor` asks for.
    pub fn page(&self, era: Era, params: Option<&Map<String, Value>>, has_session: bool) -> Reply {
        let cursor = params.and_then(|params| params.get("cursor"));
        let from = match cursor {
            None | Some(Value::Null) => 0,
            Some(cursor) => match cursor.as_str().and_then(|c| c.parse::<usize>().ok()) {
                Some(from) if from <= self.count => from,
                _ => {
                    return Reply::Error(RpcError::invalid_params(format!(
                        "resources/list cursor {cursor} was never issued"
                    )));
                }
            },
        };
        let to = (from + self.page).min(self.count);
        let mut resources = match (from, resource_list(has_session)) {
            (0, Value::Object(mut list)) => match list.remove("resources") {
                Some(Value::Array(first)) => first,
                _ => Vec::new(),
            },
            _ => Vec::new(),
        };
        resources.extend((from..to).map(|n| {
            json!({
                "uri": format!("demo://item/{n}"),
                "name": format!("item-{n}"),
                "mimeType": "text/plain",
            })
        }));
        let mut result = json!({ "resources": resources });
        if to < self.count {
            result["nextCursor"] = Value::from(to.to_string());
        }
        match era {
            Era::Legacy => Reply::Result(result),
            Era::Modern => Reply::Result(modern_shape("resources/list", result)),
        }
    }

    /// `resources/read` of a generated resource (its text names it); None for any
    /// other URI.
    pub fn read(&self, era: Era, params: Option<&Map<String, Value>>) -> Option<Reply> {
        let uri = params?.get("uri")?.as_str()?;
        let n: usize = uri.strip_prefix("demo://item/")?.parse().ok()?;
        (n < self.count).then(|| {
            let result = json!({
                "contents": [{ "uri": uri, "mimeType": "text/plain", "text": format!("item {n}") }]
            });
            Reply::Result(match era {
                Era::Legacy => result,
                Era::Modern => modern_shape("resources/read", result),
            })
        })
    }
}

fn read_resource(
    params: Option<&Map<String, Value>>,
    session: Option<&Mutex<SessionState>>,
) -> Reply {
    let Some(uri) = params
        .and_then(|params| params.get("uri"))
        .and_then(Value::as_str)
    else {
        return Reply::Error(RpcError::invalid_params(
            "resources/read needs params.uri, a string",
        ));
    };
    if uri != STATE_RESOURCE_URI {
        return Reply::Error(RpcError::new(
            RESOURCE_NOT_FOUND,
            format!("Resource not found: {uri}; resources/list names the resources"),
        ));
    }
    let Some(state) = session else {
        return Reply::Error(RpcError::new(
            RESOURCE_NOT_FOUND,
            format!("{STATE_RESOURCE_URI} holds per-session state: read it in a legacy session"),
        ));
    };
    let text = lock(state).to_json().to_string();
    Reply::Result(
        json!({ "contents": [{ "uri": STATE_RESOURCE_URI, "mimeType": "application/json", "text": text }] }),
    )
}

fn get_prompt(params: Option<&Map<String, Value>>) -> Reply {
    match params
        .and_then(|params| params.get("name"))
        .and_then(Value::as_str)
    {
        Some("greet") => {}
        Some(other) => {
            return Reply::Error(RpcError::invalid_params(format!(
                "unknown prompt: {other}; prompts/list names the prompts"
            )));
        }
        None => {
            return Reply::Error(RpcError::invalid_params(
                "prompts/get needs params.name, a string",
            ));
        }
    }
    let who = params
        .and_then(|params| params.get("arguments"))
        .and_then(|arguments| arguments.get("name"));
    let Some(who) = who.and_then(Value::as_str) else {
        return Reply::Error(RpcError::invalid_params(
            "prompt greet needs arguments.name, a string",
        ));
    };
    Reply::Result(json!({
        "description": "A greeting.",
        "messages": [{ "role": "user", "content": { "type": "text", "text": format!("Hello, {who}") } }],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::protocol::{INVALID_PARAMS, METHOD_NOT_FOUND};

    fn params(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    fn result(reply: Reply) -> Value {
        match reply {
            Reply::Result(value) => value,
            Reply::Shared(value) => value.clone(),
            other => panic!("expected a result, got {other:?}"),
        }
    }

    fn error_code(reply: Reply) -> i64 {
        match reply {
            Reply::Error(error) => error.code,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn generated_resources_come_in_pages_that_end() {
        let generated = GeneratedResources { count: 5, page: 2 };
        let mut uris = Vec::new();
        let mut cursor: Option<Value> = None;
        for _ in 0..10 {
            let params = cursor.take().map(|c| params(json!({ "cursor": c })));
            let page = result(generated.page(Era::Legacy, params.as_ref(), true));
            for item in page["resources"].as_array().unwrap() {
                uris.push(item["uri"].as_str().unwrap().to_owned());
            }
            match page.get("nextCursor") {
                Some(next) => cursor = Some(next.clone()),
                None => break,
            }
        }
        assert_eq!(uris.len(), 6, "{uris:?}");
        assert_eq!(uris[0], STATE_RESOURCE_URI);
        assert_eq!(uris[5], "demo://item/4");
        let bad = params(json!({ "cursor": "99" }));
        assert!(matches!(
            generated.page(Era::Legacy, Some(&bad), true),
            Reply::Error(_)
        ));
    }

    #[test]
    fn initialize_agrees_on_a_legacy_version() {
        let reply = dispatch(
            Era::Legacy,
            "initialize",
            Some(&params(json!({"protocolVersion": "2025-06-18"}))),
            None,
        );
        let value = result(reply);
        assert_eq!(value["protocolVersion"], "2025-06-18");
        assert_eq!(value["serverInfo"]["name"], "mcpgw-bench-upstream");
        assert_eq!(
            value["capabilities"]["resources"],
            json!({"listChanged": false, "subscribe": false})
        );
        assert!(
            value.get("resultType").is_none(),
            "legacy results stay untagged"
        );

        let value = result(dispatch(
            Era::Legacy,
            "initialize",
            Some(&params(json!({"protocolVersion": "9"}))),
            None,
        ));
        assert_eq!(value["protocolVersion"], protocol::LATEST_LEGACY_VERSION);
    }

    #[test]
    fn each_era_has_its_own_entry_point() {
        let discover = result(dispatch(Era::Modern, "server/discover", None, None));
        assert_eq!(discover["supportedVersions"], json!(["2026-07-28"]));
        assert_eq!(discover["resultType"], "complete");
        assert_eq!(discover["capabilities"], capabilities());
        assert_eq!(
            error_code(dispatch(Era::Legacy, "server/discover", None, None)),
            METHOD_NOT_FOUND
        );
        assert_eq!(
            error_code(dispatch(Era::Modern, "initialize", None, None)),
            METHOD_NOT_FOUND
        );
    }

    #[test]
    fn modern_results_are_tagged_complete() {
        for method in [
            "ping",
            "tools/list",
            "prompts/list",
            "resources/list",
            "resources/templates/list",
        ] {
            let value = result(dispatch(Era::Modern, method, None, None));
            assert_eq!(value["resultType"], "complete", "{method}");
            let value = result(dispatch(Era::Legacy, method, None, Some(&Mutex::default())));
            assert!(value.get("resultType").is_none(), "{method}");
            assert!(value.get("ttlMs").is_none(), "{method}");
        }
        let echo = params(json!({"name": "echo", "arguments": {"text": "hi"}}));
        let value = result(dispatch(Era::Modern, "tools/call", Some(&echo), None));
        assert_eq!(value["resultType"], "complete");
        assert_eq!(value["content"][0]["text"], "hi");
        assert_eq!(
            finish_result(Era::Modern, json!({}))["resultType"],
            "complete"
        );
        assert_eq!(finish_result(Era::Legacy, json!({})), json!({}));
    }

    #[test]
    fn modern_listings_carry_cache_hints() {
        for method in [
            "server/discover",
            "tools/list",
            "prompts/list",
            "resources/list",
            "resources/templates/list",
        ] {
            let value = result(dispatch(Era::Modern, method, None, None));
            assert_eq!(value["ttlMs"], 0, "{method}");
            assert!(
                matches!(value["cacheScope"].as_str(), Some("public" | "private")),
                "{method}"
            );
        }
        let value = result(dispatch(Era::Modern, "ping", None, None));
        assert!(value.get("ttlMs").is_none());
    }

    #[test]
    fn unknown_method_and_bad_tool_calls_are_errors() {
        assert_eq!(
            error_code(dispatch(Era::Legacy, "nope/nope", None, None)),
            METHOD_NOT_FOUND
        );
        assert_eq!(
            error_code(dispatch(Era::Legacy, "tools/call", None, None)),
            INVALID_PARAMS
        );
        let bad_arguments = params(json!({"name": "echo", "arguments": [1]}));
        assert_eq!(
            error_code(dispatch(
                Era::Legacy,
                "tools/call",
                Some(&bad_arguments),
                None
            )),
            INVALID_PARAMS
        );
        let unknown = params(json!({"name": "nope"}));
        assert_eq!(
            error_code(dispatch(Era::Modern, "tools/call", Some(&unknown), None)),
            INVALID_PARAMS
        );
    }

    #[test]
    fn slow_stream_carries_the_progress_token() {
        let call = params(
            json!({"name": "slow_stream", "arguments": {"count": 2}, "_meta": {"progressToken": 4}}),
        );
        match dispatch(Era::Legacy, "tools/call", Some(&call), None) {
            Reply::Stream {
                plan,
                progress_token,
            } => {
                assert_eq!(plan.steps, 2);
                assert_eq!(progress_token, Some(json!(4)));
            }
            other => panic!("expected a stream, got {other:?}"),
        }
        let call = params(json!({"name": "slow_stream"}));
        assert!(matches!(
            dispatch(Era::Modern, "tools/call", Some(&call), None),
            Reply::Stream {
                progress_token: None,
                ..
            }
        ));
        let call = params(json!({"name": "sleep_ms", "arguments": {"ms": 3}}));
        assert_eq!(
            dispatch(Era::Legacy, "tools/call", Some(&call), None),
            Reply::Sleep(Duration::from_millis(3))
        );
    }

    #[test]
    fn state_resource_shows_the_session() {
        let state = Mutex::new(SessionState {
            counter: 2,
            items: vec!["x".to_owned()],
        });
        let listed = result(dispatch(Era::Legacy, "resources/list", None, Some(&state)));
        assert_eq!(listed["resources"][0]["uri"], STATE_RESOURCE_URI);
        assert_eq!(listed["resources"][0]["name"], "session-state");
        assert_eq!(listed["resources"][0]["mimeType"], "application/json");

        let read = params(json!({"uri": STATE_RESOURCE_URI}));
        let value = result(dispatch(
            Era::Legacy,
            "resources/read",
            Some(&read),
            Some(&state),
        ));
        let text: Value =
            serde_json::from_str(value["contents"][0]["text"].as_str().unwrap_or_default())
                .unwrap_or_default();
        assert_eq!(text, json!({"counter": 2, "items": ["x"]}));

        assert_eq!(
            error_code(dispatch(Era::Modern, "resources/read", Some(&read), None)),
            RESOURCE_NOT_FOUND
        );
        let other = params(json!({"uri": "demo://nope"}));
        assert_eq!(
            error_code(dispatch(
                Era::Legacy,
                "resources/read",
                Some(&other),
                Some(&state)
            )),
            RESOURCE_NOT_FOUND
        );
        assert_eq!(
            result(dispatch(Era::Modern, "resources/list", None, None))["resources"],
            json!([])
        );
    }

    #[test]
    fn greet_prompt_greets() {
        let get = params(json!({"name": "greet", "arguments": {"name": "Ada"}}));
        let value = result(dispatch(Era::Legacy, "prompts/get", Some(&get), None));
        assert_eq!(value["messages"][0]["content"]["text"], "Hello, Ada");
        assert_eq!(value["messages"][0]["role"], "user");
        let listed = result(dispatch(Era::Legacy, "prompts/list", None, None));
        assert_eq!(listed["prompts"][0]["arguments"][0]["name"], "name");
        let missing = params(json!({"name": "greet"}));
        assert_eq!(
            error_code(dispatch(Era::Legacy, "prompts/get", Some(&missing), None)),
            INVALID_PARAMS
        );
        let unknown = params(json!({"name": "farewell", "arguments": {"name": "Ada"}}));
        assert_eq!(
            error_code(dispatch(Era::Legacy, "prompts/get", Some(&unknown), None)),
            INVALID_PARAMS
        );
    }
}
