//! 2026-07-28 clients on a virtual server (issue #22 item 5): no session, no
//! initialize; each request is answered by whichever worker receives it, the
//! stateless HTTP member called from there, the stateful stdio members through the
//! principal's shared session of their own route (execute/shared.rs), wherever in the
//! fleet it lives. Real processes throughout: the demo upstream over HTTP, the
//! SDK-built stateful server and `mcp-server-time` over stdio, the SDK-built resource
//! and template servers over stdio, the official Python SDK client in 2026-07-28 mode,
//! Redis and a two-host fleet over the mesh.

#[path = "upstreams_support/mod.rs"]
mod support;

use std::path::PathBuf;

use mcpgw_testkit::http::{self, Response};
use mcpgw_testkit::signal::{Signal, send};
use mcpgw_testkit::{Gateway, Upstream, python, python_script, run_python};
use serde_json::{Value, json};
use support::Fleet;

const ALL: &str = "/servers/all/mcp";
const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";

fn quoted(text: &str) -> String {
    Value::from(text).to_string()
}

fn venv_bin(name: &str) -> String {
    python()
        .parent()
        .expect("venv bin dir")
        .join(name)
        .display()
        .to_string()
}

/// A configuration of the demo upstream (HTTP), the stateful SDK server (`st`, stdio)
/// and `mcp-server-time` (stdio), the virtual server `all` of the three, and API keys
/// for alice and bob on every route.
fn config(what: &str, demo: &Upstream) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-federation-modern-{what}-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("config dir");
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("alice:{ALICE}\nbob:{BOB}\n")).expect("tokens file");
    let text = format!(
        r#"
[auth]
tokens_file = {tokens}

[[upstream]]
name = "demo"
url = {demo}

[[upstream]]
name = "st"
command = [{python}, {stateful}, "stdio"]

[[upstream]]
name = "time"
command = [{time}, "--local-timezone", "UTC"]

[[server]]
name = "all"

[[server.member]]
upstream = "demo"
tools = {{ include = ["echo", "slow_stream"] }}

[[server.member]]
upstream = "st"
tools = {{ exclude = ["ask"] }}

[[server.member]]
upstream = "time"
tools = {{ include = ["get_*"] }}
"#,
        tokens = quoted(&tokens.display().to_string()),
        demo = quoted(&demo.url),
        python = quoted(&python().display().to_string()),
        stateful = quoted(&python_script("stateful_server.py").display().to_string()),
        time = quoted(&venv_bin("mcp-server-time")),
    );
    let path = dir.join("mcpgw.toml");
    std::fs::write(&path, text).expect("write the configuration");
    path
}

fn config_args(path: &std::path::Path) -> Vec<String> {
    vec!["--config".into(), path.display().to_string()]
}

/// One 2026-07-28 request of `token` on `path` through `addr`.
fn modern(addr: &str, path: &str, token: &str, method: &str, params: Value) -> Response {
    // The parameter a name-bearing method mirrors in `Mcp-Name`.
    let key = if method == "resources/read" {
        "uri"
    } else {
        "name"
    };
    let name = params.get(key).and_then(Value::as_str).map(str::to_owned);
    let bearer = format!("Bearer {token}");
    let mut headers = http::modern_headers(method, name.as_deref());
    headers.push(("Authorization", &bearer));
    http::request(
        addr,
        "POST",
        path,
        &headers,
        &http::modern_body(7, method, params),
    )
}

fn call(addr: &str, token: &str, tool: &str) -> Response {
    modern(
        addr,
        ALL,
        token,
        "tools/call",
        json!({"name": tool, "arguments": {}}),
    )
}

#[track_caller]
fn counted(response: &Response) -> String {
    assert_eq!(response.status, 200, "{}", response.text());
    response.expect_tool_text()
}

fn list(addr: &str, token: &str) -> Value {
    let response = modern(addr, ALL, token, "tools/list", json!({}));
    assert_eq!(response.status, 200, "{}", response.text());
    response
        .messages()
        .into_iter()
        .find(|m| m.get("result").is_some())
        .unwrap_or_else(|| panic!("no tools/list result: {}", response.text()))["result"]
        .clone()
}

fn names_of(result: &Value) -> Vec<String> {
    let mut names: Vec<String> = result["tools"]
        .as_array()
        .expect("a tool list")
        .iter()
        .map(|tool| tool["name"].as_str().expect("a tool name").to_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn the_modern_sdk_client_sees_every_member_and_each_principal_its_own_state() {
    let demo = Upstream::start();
    let path = config("sdk", &demo);
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let url = format!("http://{}{ALL}", gateway.addr);
    let out = run_python("federation_modern_client.py", &[&url, ALICE, BOB]);
    assert_eq!(out["version"], "2026-07-28", "{out}");
    assert_eq!(
        out["tools"],
        json!([
            "demo__echo",
            "demo__slow_stream",
            "st__counter_increment",
            "st__pid",
            "time__get_current_time",
        ]),
        "each member's tools under its prefix, filtered by include/exclude"
    );
    assert_eq!(out["echo"], "modern through all", "the HTTP member answers");
    assert_eq!(
        out["time"]["timezone"], "UTC",
        "mcp-server-time answers: {out}"
    );
    assert_eq!(
        out["first_counts"],
        json!(["1", "2", "3", "4"]),
        "alice's counter on the stdio member goes on across calls (her shared session)"
    );
    assert_eq!(
        out["second_counts"],
        json!(["1"]),
        "bob's counter is his own"
    );
    assert_ne!(
        out["pids"][0], out["pids"][1],
        "each principal has a process of the stdio member of its own"
    );
    let excluded = out["excluded"].as_str().unwrap_or_default();
    assert!(
        excluded.contains("unknown tool") && excluded.contains("demo__sleep_ms"),
        "an excluded tool is not callable: {excluded}"
    );

    // The merged list carries the smallest caching hint of its members (each says 0
    // here: the stdio members' shared sessions never let a list be reused), private
    // since a stateful member's list is the principal's.
    let merged = list(&gateway.addr, ALICE);
    assert_eq!(merged["ttlMs"], 0, "{merged}");
    assert_eq!(merged["cacheScope"], "private", "{merged}");
    assert_eq!(merged["resultType"], "complete", "{merged}");
    assert!(merged.get("_meta").is_none(), "no member missing: {merged}");

    // The shared session is the principal's on the member's route: the member's own
    // route continues the same counter.
    let direct = modern(
        &gateway.addr,
        "/servers/st/mcp",
        ALICE,
        "tools/call",
        json!({"name": "counter_increment", "arguments": {}}),
    );
    assert_eq!(
        counted(&direct),
        "5",
        "one session per (principal, upstream)"
    );

    // A name of no member, and a cursor the server never issued: told plainly.
    let unknown = call(&gateway.addr, ALICE, "nobody__tool");
    let error = unknown.error().expect("a JSON-RPC error");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("unknown tool \"nobody__tool\"")),
        "{error}"
    );
    let cursor = modern(
        &gateway.addr,
        ALL,
        ALICE,
        "tools/list",
        json!({"cursor": "x"}),
    );
    assert_eq!(cursor.error_code(), Some(-32602), "{}", cursor.text());
}

#[test]
fn a_call_landing_on_the_worker_without_the_shared_session_is_forwarded_and_counts_on() {
    let demo = Upstream::start();
    let path = config("fleet", &demo);
    let fleet = Fleet::start(2, &config_args(&path));
    let (owner, edge) = (fleet.addr(0), fleet.addr(1));
    let first = call(owner, ALICE, "st__counter_increment");
    assert_eq!(counted(&first), "1");
    let owner_id = first
        .header("mcpgw-owner-worker")
        .expect("an owner header")
        .to_owned();
    for expected in ["2", "3"] {
        let response = call(edge, ALICE, "st__counter_increment");
        assert_eq!(counted(&response), expected, "the shared session's state");
        assert_eq!(
            response.header("mcpgw-owner-worker"),
            Some(owner_id.as_str()),
            "run by the worker holding alice's shared session"
        );
        assert_ne!(
            response.header("mcpgw-edge-worker"),
            Some(owner_id.as_str()),
            "received by the other worker, which forwarded it"
        );
    }
    // Bob's first call through the edge opens his own session there.
    assert_eq!(counted(&call(edge, BOB, "st__counter_increment")), "1");
    assert_eq!(counted(&call(owner, BOB, "st__counter_increment")), "2");
    // Stateless members answer from whichever worker got the request.
    let echo = modern(
        edge,
        ALL,
        ALICE,
        "tools/call",
        json!({"name": "demo__echo", "arguments": {"text": "here"}}),
    );
    assert_eq!(counted(&echo), "here");
    assert_eq!(
        echo.header("mcpgw-owner-worker"),
        echo.header("mcpgw-edge-worker"),
        "the HTTP member was called by the receiving worker"
    );
    let names = names_of(&list(edge, ALICE));
    assert!(
        names.contains(&"st__counter_increment".to_owned()),
        "{names:?}"
    );
    assert_eq!(
        counted(&call(edge, ALICE, "st__counter_increment")),
        "4",
        "listing through the shared session left its state alone"
    );
}

#[test]
fn a_killed_stateful_member_is_told_once_and_the_other_members_go_on() {
    let demo = Upstream::start();
    let path = config("kill", &demo);
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let addr = gateway.addr.clone();
    assert_eq!(counted(&call(&addr, ALICE, "st__counter_increment")), "1");
    assert_eq!(counted(&call(&addr, ALICE, "st__counter_increment")), "2");
    let pid: u32 = counted(&call(&addr, ALICE, "st__pid"))
        .parse()
        .expect("a pid");

    send(pid, Signal::SIGKILL);
    support::wait_stopped(pid, "the stateful member's process");

    let lost = call(&addr, ALICE, "st__counter_increment");
    assert_eq!(
        lost.reason().as_deref(),
        Some("session_gone"),
        "the loss is told: {}",
        lost.text()
    );
    let error = lost.error().expect("a JSON-RPC error");
    assert_eq!(error["data"]["member"], "st", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("member st of virtual server all")
            && message.contains("without that state"),
        "{message}"
    );
    let echo = modern(
        &addr,
        ALL,
        ALICE,
        "tools/call",
        json!({"name": "demo__echo", "arguments": {"text": "still here"}}),
    );
    assert_eq!(counted(&echo), "still here", "the HTTP member goes on");
    let time = modern(
        &addr,
        ALL,
        ALICE,
        "tools/call",
        json!({"name": "time__get_current_time", "arguments": {"timezone": "UTC"}}),
    );
    assert!(
        counted(&time).contains("UTC"),
        "the other stdio member goes on"
    );
    assert_eq!(
        counted(&call(&addr, ALICE, "st__counter_increment")),
        "1",
        "told once, the next call starts afresh (as on the member's own route)"
    );
}

#[test]
fn a_member_that_fails_is_left_out_of_the_list_and_its_calls_name_it() {
    let demo = Upstream::start();
    // Held refusing for the whole test: no other test can bind it meanwhile.
    let refusing = mcpgw_testkit::refusing_port();
    let down = format!("http://127.0.0.1:{}/mcp", refusing.port);
    let path = config("down", &demo);
    let text = std::fs::read_to_string(&path).expect("read the configuration");
    let text = text.replace(
        "[[server]]",
        &format!(
            "[[upstream]]\nname = \"gone\"\nurl = {}\n\n[[server]]",
            quoted(&down)
        ),
    ) + "\n[[server.member]]\nupstream = \"gone\"\n";
    std::fs::write(&path, text).expect("write the configuration");
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let merged = list(&gateway.addr, ALICE);
    assert!(
        names_of(&merged).contains(&"demo__echo".to_owned()),
        "the other members are listed: {merged}"
    );
    let missing = &merged["_meta"]["mcpgw/federation"]["missing"];
    assert_eq!(
        missing[0]["member"], "gone",
        "the list says who is missing: {merged}"
    );
    assert_eq!(
        merged["ttlMs"], 0,
        "an incomplete list is not kept: {merged}"
    );
    let failed = call(&gateway.addr, ALICE, "gone__anything");
    let error = failed.error().expect("a JSON-RPC error");
    assert_eq!(error["data"]["member"], "gone", "{}", failed.text());
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("member gone of virtual server all")),
        "{error}"
    );
    assert!(failed.status >= 500, "{}", failed.text());
    assert_eq!(
        counted(&call(&gateway.addr, ALICE, "st__counter_increment")),
        "1"
    );
}

#[test]
fn a_stateful_member_in_another_auth_mode_is_refused_by_name_and_the_rest_served() {
    let demo = Upstream::start();
    let path = config("modes", &demo);
    let text = std::fs::read_to_string(&path).expect("read the configuration");
    let demo_table = "[[upstream]]\nname = \"demo\"";
    let text = text.replace(
        demo_table,
        &format!("[auth.routes.st]\nmode = \"public\"\n\n{demo_table}"),
    );
    std::fs::write(&path, text).expect("write the configuration");
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let refused = call(&gateway.addr, ALICE, "st__counter_increment");
    assert_eq!(refused.status, 501, "{}", refused.text());
    assert_eq!(refused.reason().as_deref(), Some("virtual_server_protocol"));
    let error = refused.error().expect("a JSON-RPC error");
    assert_eq!(error["data"]["member"], "st", "{error}");
    let merged = list(&gateway.addr, ALICE);
    let missing = &merged["_meta"]["mcpgw/federation"]["missing"];
    assert_eq!(missing[0]["member"], "st", "{merged}");
    assert!(
        names_of(&merged).contains(&"time__get_current_time".to_owned()),
        "the stateful member in the virtual server's mode is served: {merged}"
    );
}

/// A configuration of two SDK-built resource servers (`alpha`, `beta`: the same
/// resources under their own names, and `shared://` ones both list), a server of level
/// 3 and 4 templates (`tpl`), all over stdio, and the demo upstream (HTTP); the virtual
/// server `all` of them with resource filters, then `extra` (more tables), and API keys
/// for alice on every route.
fn resource_config(what: &str, demo: &Upstream, extra: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-federation-modern-{what}-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("config dir");
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("alice:{ALICE}\n")).expect("tokens file");
    let stdio = |script: &str, name: &str| {
        format!(
            "[{}, {}, {}]",
            quoted(&python().display().to_string()),
            quoted(&python_script(script).display().to_string()),
            quoted(name)
        )
    };
    let text = format!(
        r#"
[auth]
tokens_file = {tokens}

[[upstream]]
name = "alpha"
command = {alpha}

[[upstream]]
name = "beta"
command = {beta}

[[upstream]]
name = "tpl"
command = {tpl}

[[upstream]]
name = "demo"
url = {demo}

[[server]]
name = "all"

[[server.member]]
upstream = "alpha"
resources = {{ exclude = ["*/hidden"] }}

[[server.member]]
upstream = "beta"
resources = {{ include = ["mem://beta/*", "shared://*"], exclude = ["*/hidden", "*/secret"] }}

[[server.member]]
upstream = "tpl"

[[server.member]]
upstream = "demo"
tools = {{ include = ["echo"] }}
{extra}"#,
        tokens = quoted(&tokens.display().to_string()),
        alpha = stdio("resource_server.py", "alpha"),
        beta = stdio("resource_server.py", "beta"),
        tpl = stdio("template_server.py", "tpl"),
        demo = quoted(&demo.url),
    );
    let path = dir.join("mcpgw.toml");
    std::fs::write(&path, text).expect("write the configuration");
    path
}

/// The result of a 2026-07-28 request that must succeed.
#[track_caller]
fn result_of(response: &Response) -> Value {
    assert_eq!(response.status, 200, "{}", response.text());
    response
        .messages()
        .into_iter()
        .find_map(|m| m.get("result").cloned())
        .unwrap_or_else(|| panic!("no result: {}", response.text()))
}

/// The JSON-RPC error of an answer, with its code and message.
#[track_caller]
fn error_of(response: &Response) -> (i64, String, Value) {
    let error = response
        .messages()
        .into_iter()
        .find_map(|m| m.get("error").cloned())
        .unwrap_or_else(|| panic!("no error: {}", response.text()));
    let code = error["code"].as_i64().expect("an error code");
    let message = error["message"].as_str().unwrap_or_default().to_owned();
    (code, message, error)
}

fn read(addr: &str, uri: &str) -> Response {
    modern(addr, ALL, ALICE, "resources/read", json!({ "uri": uri }))
}

#[test]
fn the_modern_sdk_client_lists_reads_and_completes_resources_across_members() {
    let demo = Upstream::start();
    let path = resource_config("resources", &demo, "");
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let url = format!("http://{}{ALL}", gateway.addr);
    let uris = [
        "mem://alpha/readme",
        "shared://common",
        "mem://beta/notes/n1",
        "shared://any/x",
        "files://tpl/a/b/c",
        "search://tpl/items?q=red&limit=2",
        "search://tpl/items",
    ];
    let mut args = vec![url.as_str(), ALICE];
    args.extend(uris);
    let out = run_python("federation_modern_resources_client.py", &args);
    assert_eq!(out["version"], "2026-07-28", "{out}");
    assert_eq!(
        out["resources"],
        json!(["mem://alpha/readme", "shared://common", "mem://beta/readme"]),
        "each member's resources, unrenamed, filtered; a URI two members list is the \
         earlier one's"
    );
    assert_eq!(
        out["templates"],
        json!([
            "mem://alpha/notes/{note}",
            "shared://any/{thing}",
            "mem://beta/notes/{note}",
            "files://tpl{/path*}",
            "search://tpl/items{?q,limit}"
        ])
    );
    assert_eq!(
        out["hints"],
        json!([0, "private"]),
        "the stateful members' lists are the principal's and never reused"
    );
    let reads = &out["reads"];
    assert_eq!(reads["mem://alpha/readme"], "readme of alpha");
    assert_eq!(
        reads["shared://common"], "common of alpha",
        "the earlier member's"
    );
    assert_eq!(
        reads["mem://beta/notes/n1"], "note n1 of beta",
        "a template-matched URI reaches the template's member"
    );
    assert_eq!(reads["shared://any/x"], "any x of alpha");
    assert_eq!(
        reads["files://tpl/a/b/c"], "file a/b/c of tpl",
        "matched by the level 4 template {{/path*}}"
    );
    assert_eq!(
        reads["search://tpl/items?q=red&limit=2"], "search q=red limit=2 of tpl",
        "matched by the level 3 template {{?q,limit}}"
    );
    assert_eq!(
        reads["search://tpl/items"], "search  of tpl",
        "query parameters may be absent"
    );
    assert_eq!(
        out["prompt_completion"],
        json!(["beta-al-prompt"]),
        "completion of beta__greet reached beta under its own name"
    );
    assert_eq!(
        out["template_completion"],
        json!(["tpl-d-for-files://tpl{/path*}"]),
        "completion of a template reached the member that lists it"
    );

    // What the SDK's types leave out: which members' items were hidden, and by whom.
    let listed = result_of(&modern(
        &gateway.addr,
        ALL,
        ALICE,
        "resources/list",
        json!({}),
    ));
    assert_eq!(listed["resultType"], "complete", "{listed}");
    assert_eq!(
        listed["_meta"]["mcpgw/federation"]["hidden"],
        json!([{"uri": "shared://common", "member": "beta", "kept_by": "alpha"}]),
        "{listed}"
    );
    assert!(
        listed["_meta"]["mcpgw/federation"].get("missing").is_none(),
        "{listed}"
    );
    let templates = result_of(&modern(
        &gateway.addr,
        ALL,
        ALICE,
        "resources/templates/list",
        json!({}),
    ));
    assert_eq!(
        templates["_meta"]["mcpgw/federation"]["hidden"],
        json!([{"uriTemplate": "shared://any/{thing}", "member": "beta", "kept_by": "alpha"}]),
        "{templates}"
    );
}

#[test]
fn a_uri_no_member_serves_and_the_removed_subscription_methods_are_told_plainly() {
    let demo = Upstream::start();
    let path = resource_config("unknown", &demo, "");
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let addr = gateway.addr.clone();
    // Listed by no one; kept out of alpha's list by its filter; matched by beta's
    // template but kept out by beta's filter; a query parameter tpl's template does
    // not name; a path where tpl's {/path*} allows none.
    for uri in [
        "mem://gamma/x",
        "mem://alpha/hidden",
        "mem://beta/notes/secret",
        "search://tpl/items?sort=up",
        "files://tplx",
    ] {
        let (code, message, _) = error_of(&read(&addr, uri));
        assert_eq!(code, -32602, "{uri}: {message}");
        assert!(
            message.contains(uri) && message.contains("resources/templates/list"),
            "names the URI and what to do: {message}"
        );
    }
    let reference = json!({"ref": {"type": "ref/resource", "uri": "mem://gamma/{x}"},
        "argument": {"name": "x", "value": "a"}});
    let (code, message, _) = error_of(&modern(&addr, ALL, ALICE, "completion/complete", reference));
    assert_eq!(code, -32602, "{message}");
    let shapeless =
        json!({"ref": {"type": "ref/nothing"}, "argument": {"name": "x", "value": "a"}});
    let (code, message, _) = error_of(&modern(&addr, ALL, ALICE, "completion/complete", shapeless));
    assert_eq!(code, -32602, "{message}");
    assert!(message.contains("ref/prompt"), "{message}");
    for method in ["resources/subscribe", "resources/unsubscribe"] {
        let (code, message, _) = error_of(&modern(
            &addr,
            ALL,
            ALICE,
            method,
            json!({"uri": "mem://alpha/readme"}),
        ));
        assert_eq!(code, -32601, "{message}");
        assert!(
            message.contains("2026-07-28") && message.contains("subscriptions/listen"),
            "says what replaced it: {message}"
        );
    }
    let cursor = modern(&addr, ALL, ALICE, "resources/list", json!({"cursor": "x"}));
    assert_eq!(error_of(&cursor).0, -32602, "{}", cursor.text());
}

#[test]
fn a_failing_member_is_named_in_the_resource_lists_and_the_others_are_read() {
    let demo = Upstream::start();
    // Held refusing for the whole test: no other test can bind it meanwhile.
    let refusing = mcpgw_testkit::refusing_port();
    let down = format!("http://127.0.0.1:{}/mcp", refusing.port);
    let extra = format!(
        "\n[[server.member]]\nupstream = \"gone\"\nresources = {{ include = [\"gone://*\"] }}\n\n\
         [[upstream]]\nname = \"gone\"\nurl = {}\n",
        quoted(&down)
    );
    let path = resource_config("gone", &demo, &extra);
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let addr = gateway.addr.clone();
    for method in ["resources/list", "resources/templates/list"] {
        let listed = result_of(&modern(&addr, ALL, ALICE, method, json!({})));
        let missing = &listed["_meta"]["mcpgw/federation"]["missing"];
        assert_eq!(missing[0]["member"], "gone", "{method}: {listed}");
        assert_eq!(
            listed["ttlMs"], 0,
            "an incomplete list is not kept: {listed}"
        );
    }
    let readme = result_of(&read(&addr, "mem://alpha/readme"));
    assert_eq!(readme["contents"][0]["text"], "readme of alpha");
    // A URI only the missing member could serve goes to it: its error, by name.
    let failed = read(&addr, "gone://thing");
    let (_, message, error) = error_of(&failed);
    assert_eq!(error["data"]["member"], "gone", "{}", failed.text());
    assert!(
        message.contains("member gone of virtual server all"),
        "{message}"
    );
    assert!(failed.status >= 500, "{}", failed.text());
}

#[test]
fn without_prefixes_a_call_finds_its_member_in_the_lists() {
    let demo = Upstream::start();
    let path = config("never", &demo);
    let text = std::fs::read_to_string(&path).expect("read the configuration");
    let text = text.replace(
        "[[server]]\nname = \"all\"\n",
        "[[server]]\nname = \"all\"\nprefix = \"never\"\n",
    );
    std::fs::write(&path, text).expect("write the configuration");
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let addr = gateway.addr.clone();
    let names = names_of(&list(&addr, ALICE));
    assert!(names.contains(&"get_current_time".to_owned()), "{names:?}");
    // The third member's tool: the second member's filter lets the name through, so
    // only the members' lists tell whose it is.
    let time = modern(
        &addr,
        ALL,
        ALICE,
        "tools/call",
        json!({"name": "get_current_time", "arguments": {"timezone": "UTC"}}),
    );
    assert!(counted(&time).contains("UTC"), "{}", time.text());
    assert_eq!(counted(&call(&addr, ALICE, "counter_increment")), "1");
    assert_eq!(counted(&call(&addr, ALICE, "counter_increment")), "2");
    let unknown = call(&addr, ALICE, "no_such_tool");
    let (code, message, _) = error_of(&unknown);
    assert_eq!(code, -32602, "{message}");
    assert!(
        message.contains("unknown tool \"no_such_tool\""),
        "{message}"
    );
}

/// An SDK-built HTTP server (`cached_list_server.py`) named `name` whose tools/list
/// says it may be reused for `ttl_ms`, and its `/mcp` URL.
fn cached_list_server(name: &str, ttl_ms: u64) -> (mcpgw_testkit::Child, String) {
    let port = mcpgw_testkit::free_port();
    let script = python_script("cached_list_server.py").display().to_string();
    let args = [
        script,
        "http".into(),
        port.to_string(),
        name.into(),
        ttl_ms.to_string(),
    ];
    let mut server = mcpgw_testkit::Child::spawn(name, &python(), &args);
    let within = std::time::Duration::from_secs(30);
    server.wait_for_line("cached_list_server listening", within);
    mcpgw_testkit::wait_for_listener(&format!("127.0.0.1:{port}"), within);
    (server, format!("http://127.0.0.1:{port}/mcp"))
}

#[test]
fn calls_reuse_what_the_lists_said_while_their_ttl_allows_and_list_again_for_a_name_not_in_it() {
    let (_a, a) = cached_list_server("a", 60_000);
    let (_b, b) = cached_list_server("b", 60_000);
    let (_z, z) = cached_list_server("z", 0);
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-federation-modern-kept-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("config dir");
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("alice:{ALICE}\n")).expect("tokens file");
    let mut text = format!(
        "[auth]\ntokens_file = {}\n",
        quoted(&tokens.display().to_string())
    );
    for (name, url) in [("a", &a), ("b", &b), ("z", &z)] {
        text += &format!("\n[[upstream]]\nname = \"{name}\"\nurl = {}\n", quoted(url));
    }
    text += "\n[[server]]\nname = \"kept\"\nprefix = \"never\"\n\
             [[server.member]]\nupstream = \"a\"\n[[server.member]]\nupstream = \"b\"\n\
             \n[[server]]\nname = \"fresh\"\nprefix = \"never\"\n\
             [[server.member]]\nupstream = \"z\"\n";
    let path = dir.join("mcpgw.toml");
    std::fs::write(&path, text).expect("write the configuration");
    let gateway = Gateway::start(&["--config", &path.display().to_string()]);
    let on = |server: &str, tool: &str| {
        let path = format!("/servers/{server}/mcp");
        let params = json!({"name": tool, "arguments": {}});
        modern(&gateway.addr, &path, ALICE, "tools/call", params)
    };

    assert_eq!(counted(&on("kept", "b_hello")), "hello from b");
    assert_eq!(
        counted(&on("kept", "b_lists")),
        "1",
        "the second call found its member in what the first call's lists said"
    );
    assert_eq!(counted(&on("kept", "a_lists")), "1");
    let (code, message, _) = error_of(&on("kept", "nope"));
    assert_eq!(code, -32602, "{message}");
    assert_eq!(
        counted(&on("kept", "b_lists")),
        "2",
        "a name the catalog did not know was looked for once in fresh lists"
    );

    assert_eq!(counted(&on("fresh", "z_hello")), "hello from z");
    assert_eq!(counted(&on("fresh", "z_hello")), "hello from z");
    assert_eq!(
        counted(&on("fresh", "z_lists")),
        "3",
        "a list that says ttlMs 0 is read for every call"
    );
}
