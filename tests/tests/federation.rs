//! Virtual servers (`[[server]]`, issue #22): one route whose client sessions hold one
//! upstream session per member. Real processes throughout: the demo upstream over
//! HTTP, the SDK-built stateful server and `mcp-server-time` over stdio, a paginating
//! SDK server, the official Python SDK client, and a two-worker fleet over the mesh.

#[path = "upstreams_support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers, rpc_body};
use mcpgw_testkit::signal::{Signal, send};
use mcpgw_testkit::{Gateway, Upstream, eventually, python, python_script, run_python};
use serde_json::{Value, json};
use support::{Fleet, Until, read_stream};

const ALL: &str = "/servers/all/mcp";

/// A TOML string literal.
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

/// `[[upstream]]` tables: the demo upstream at `demo_url`, the stateful SDK server
/// over stdio (`st`), and `mcp-server-time` (`time`).
fn three_upstreams(demo_url: &str) -> String {
    format!(
        r#"
[[upstream]]
name = "demo"
url = {demo}

[[upstream]]
name = "st"
command = [{python}, {stateful}, "stdio"]

[[upstream]]
name = "time"
command = [{time}, "--local-timezone", "UTC"]
"#,
        demo = quoted(demo_url),
        python = quoted(&python().display().to_string()),
        stateful = quoted(&python_script("stateful_server.py").display().to_string()),
        time = quoted(&venv_bin("mcp-server-time")),
    )
}

/// The virtual server `all` of the three: demo's echo, counters and slow_stream; the
/// stateful server without its `ask`; of time, `get_*` only.
const ALL_OF_THREE: &str = r#"
[[server]]
name = "all"

[[server.member]]
upstream = "demo"
tools = { include = ["echo", "counter_*", "slow_stream"] }

[[server.member]]
upstream = "st"
tools = { exclude = ["ask"] }

[[server.member]]
upstream = "time"
tools = { include = ["get_*"] }
"#;

/// Writes `text` to a configuration file of its own for this test.
fn config_file(what: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "mcpgw-federation-{what}-{}-{}.toml",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::write(&path, text).expect("write the configuration");
    path
}

/// A configuration file (`what` names it) of the three upstreams and `all` of them.
fn all_of_three(what: &str, demo: &Upstream) -> PathBuf {
    config_file(
        what,
        &format!("{}{ALL_OF_THREE}", three_upstreams(&demo.url)),
    )
}

fn start(config: &Path) -> Gateway {
    Gateway::start(&["--config", &config.display().to_string()])
}

/// The names of a `tools/list` answer.
fn tool_names(response: &http::Response) -> Vec<String> {
    let message = response
        .messages()
        .into_iter()
        .find(|m| m.get("result").is_some())
        .unwrap_or_else(|| panic!("no tools/list result: {}", response.text()));
    message["result"]["tools"]
        .as_array()
        .expect("a tool list")
        .iter()
        .map(|tool| tool["name"].as_str().expect("a tool name").to_owned())
        .collect()
}

fn list_tools(addr: &str, session: &str) -> Vec<String> {
    let response = http::request(
        addr,
        "POST",
        ALL,
        &mcp_headers(Some(session)),
        &rpc_body(90, "tools/list", json!({})),
    );
    assert_eq!(response.status, 200, "tools/list: {}", response.text());
    tool_names(&response)
}

fn text_of(response: &http::Response) -> String {
    response.expect_tool_text()
}

/// The text answer of `tool` (no arguments) called on `ALL` in `session` via `addr`.
#[track_caller]
fn call_text(addr: &str, session: &str, id: u64, tool: &str) -> String {
    text_of(&call_tool(addr, ALL, session, id, tool, json!({})))
}

#[test]
fn the_sdk_client_sees_three_members_under_their_names_with_their_own_state() {
    let demo = Upstream::start();
    let config = all_of_three("three", &demo);
    let gateway = start(&config);
    let url = format!("http://{}{ALL}", gateway.addr);
    let out = run_python("federation_client.py", &[&url, "merged"]);
    assert_eq!(out["server"], "all", "serverInfo names the virtual server");
    assert_eq!(
        out["tools"],
        json!([
            "demo__counter_increment",
            "demo__echo",
            "demo__slow_stream",
            "st__counter_increment",
            "st__pid",
            "time__get_current_time",
        ]),
        "each member's tools under its prefix, filtered by include/exclude"
    );
    assert_eq!(out["echo"], "through all", "the HTTP member answers");
    assert_eq!(
        out["time"]["timezone"], "UTC",
        "mcp-server-time answers: {out}"
    );
    assert_eq!(
        out["first_counts"],
        json!([["1", "1"], ["2", "2"], ["3", "3"]]),
        "the first session's counters go on, on the stdio and the HTTP member"
    );
    assert_eq!(
        out["second_counts"],
        json!(["1", "1"]),
        "a second session has counters of its own on both stateful members"
    );
    assert_ne!(
        out["pids"][0], out["pids"][1],
        "each client session has its own process of the stdio member"
    );
    let excluded = out["excluded"].as_str().unwrap_or_default();
    assert!(
        excluded.contains("unknown tool") && excluded.contains("demo__sleep_ms"),
        "an excluded tool is not callable: {excluded}"
    );
}

#[test]
fn calls_and_progress_arrive_through_the_worker_that_does_not_own_the_session() {
    let demo = Upstream::start();
    let config = all_of_three("fleet", &demo);
    let fleet = Fleet::start(2, &["--config".into(), config.display().to_string()]);
    let (owner, edge) = (fleet.addr(0), fleet.addr(1));
    let session = initialize(owner, ALL);
    assert!(list_tools(edge, &session).contains(&"st__counter_increment".to_owned()));
    for expected in ["1", "2"] {
        let response = call_tool(edge, ALL, &session, 1, "st__counter_increment", json!({}));
        assert_ne!(
            response.header("mcpgw-owner-worker"),
            response.header("mcpgw-edge-worker"),
            "the call was forwarded to the owner"
        );
        assert_eq!(text_of(&response), expected, "the stdio member's state");
        assert_eq!(
            call_text(edge, &session, 2, "demo__counter_increment"),
            expected,
            "the HTTP member's state"
        );
    }
    let body = json!({
        "jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "demo__slow_stream", "arguments": {"count": 5, "interval_ms": 50},
                   "_meta": {"progressToken": "p1"}},
    })
    .to_string();
    let stream = read_stream(
        edge,
        "POST",
        ALL,
        &mcp_headers(Some(&session)),
        body.as_bytes(),
        Until::End,
    );
    assert_eq!(stream.status, 200);
    let methods: Vec<String> = stream
        .events
        .iter()
        .map(|e| {
            e.data["method"]
                .as_str()
                .map_or_else(|| "result".to_owned(), str::to_owned)
        })
        .collect();
    let mut expected = vec!["notifications/progress".to_owned(); 5];
    expected.push("result".into());
    assert_eq!(methods, expected, "every progress event, then the result");
    assert_eq!(
        stream.events[0].data["params"]["progressToken"], "p1",
        "the client's progress token"
    );
}

#[test]
fn a_killed_member_process_is_lost_alone_and_never_restarted() {
    let demo = Upstream::start();
    let config = all_of_three("kill", &demo);
    let gateway = start(&config);
    let addr = gateway.addr.clone();
    let session = initialize(&addr, ALL);
    assert_eq!(call_text(&addr, &session, 1, "st__counter_increment"), "1");
    assert_eq!(
        call_text(&addr, &session, 2, "demo__counter_increment"),
        "1"
    );
    let pid: u32 = call_text(&addr, &session, 3, "st__pid")
        .parse()
        .expect("a pid");

    send(pid, Signal::SIGKILL);

    let lost = eventually(Duration::from_secs(60), || {
        let response = call_tool(&addr, ALL, &session, 4, "st__counter_increment", json!({}));
        match response.reason().as_deref() {
            Some("member_lost") => Ok(response),
            _ => Err(response.text()),
        }
    });
    assert_eq!(lost.status, 200, "the client's session goes on");
    let error = lost.error().expect("a JSON-RPC error");
    assert_eq!(error["data"]["member"], "st");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("member st") && message.contains("state is lost"),
        "{message}"
    );
    let names = list_tools(&addr, &session);
    assert!(
        !names.iter().any(|n| n.starts_with("st__")),
        "the lost member's tools leave the list: {names:?}"
    );
    assert!(names.contains(&"demo__echo".to_owned()), "{names:?}");
    assert_eq!(
        call_text(&addr, &session, 5, "demo__counter_increment"),
        "2",
        "the other members keep their state"
    );
    let again = call_tool(&addr, ALL, &session, 6, "st__pid", json!({}));
    assert_eq!(
        again.reason().as_deref(),
        Some("member_lost"),
        "never a fresh process behind the session: {}",
        again.text()
    );
    // The session's GET stream hears that the lists changed (a GET stream's first
    // reader gets what the gateway pushed before it came).
    let (seen, heard) = std::sync::mpsc::channel();
    {
        let (addr, session) = (addr.clone(), session.clone());
        std::thread::spawn(move || {
            let headers = [
                ("Accept", "text/event-stream"),
                ("MCP-Protocol-Version", "2025-11-25"),
                ("Mcp-Session-Id", session.as_str()),
            ];
            let stream = read_stream(&addr, "GET", ALL, &headers, b"", Until::Events(1));
            let _ = seen.send(stream);
        });
    }
    let stream = heard
        .recv_timeout(Duration::from_secs(60))
        .expect("the GET stream heard something");
    assert_eq!(
        stream.events[0].data["method"], "notifications/tools/list_changed",
        "{stream:?}"
    );

    // The metrics say which member answered and which was lost, per virtual server.
    let admin = gateway
        .admin
        .as_deref()
        .expect("the gateway announces its admin listener");
    let metrics = mcpgw_testkit::admin::scrape(admin);
    let member = |member: &str, method: &str, outcome: &str| {
        let sample = format!(
            "mcpgw_member_requests_total{{server=\"all\",member=\"{member}\",method=\"{method}\",outcome=\"{outcome}\"}}"
        );
        metrics.get(&sample).copied().unwrap_or(0.0)
    };
    assert_eq!(member("st", "tools/call", "answered"), 2.0, "{metrics:?}");
    assert!(member("st", "tools/call", "lost") >= 2.0, "{metrics:?}");
    assert_eq!(member("demo", "tools/call", "answered"), 2.0, "{metrics:?}");
    assert!(
        member("demo", "tools/list", "answered") >= 1.0,
        "{metrics:?}"
    );

    // DELETE ends every member's session.
    assert_eq!(demo.counter("sessions_open"), 1);
    assert_eq!(http::delete_session(&addr, ALL, &session).status, 200);
    assert_eq!(
        demo.counter("sessions_open"),
        0,
        "the HTTP member's session ended"
    );
}

#[test]
fn an_optional_member_down_is_left_out_and_a_required_one_refuses_initialize() {
    let demo = Upstream::start();
    // Held refusing for the whole test: no other test can bind it meanwhile.
    let refusing = mcpgw_testkit::refusing_port();
    let down = format!("http://127.0.0.1:{}/mcp", refusing.port);
    let config = config_file(
        "down",
        &format!(
            r#"
[[upstream]]
name = "demo"
url = {demo}

[[upstream]]
name = "gone"
url = {down}

[[server]]
name = "lenient"
[[server.member]]
upstream = "demo"
tools = {{ include = ["echo"] }}
[[server.member]]
upstream = "gone"
required = false

[[server]]
name = "strict"
[[server.member]]
upstream = "demo"
[[server.member]]
upstream = "gone"
"#,
            demo = quoted(&demo.url),
            down = quoted(&down),
        ),
    );
    let gateway = start(&config);
    let refused = http::try_initialize(&gateway.addr, "/servers/strict/mcp").expect("an answer");
    assert_eq!(refused.status, 502, "{}", refused.text());
    assert!(refused.header("mcp-session-id").is_none(), "no session");
    assert_eq!(refused.reason().as_deref(), Some("member_unavailable"));
    let error = refused.error().expect("a JSON-RPC error");
    assert_eq!(error["data"]["members"], json!(["gone"]));
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains("required member gone"), "{message}");
    assert_eq!(
        (
            demo.counter("sessions_created"),
            demo.counter("sessions_open")
        ),
        (1, 0),
        "the required member that did open was closed with the refusal"
    );

    let url = format!("http://{}/servers/lenient/mcp", gateway.addr);
    let out = run_python("federation_client.py", &[&url, "open"]);
    assert_eq!(out["tools"], json!(["demo__echo"]), "{out}");
    let instructions = out["instructions"].as_str().unwrap_or_default();
    assert!(
        instructions.contains("optional member(s) gone"),
        "the result says which member is missing: {instructions:?}"
    );
}

#[test]
fn a_paginated_member_list_is_merged_whole_without_duplicates() {
    let demo = Upstream::start();
    let config = config_file(
        "paging",
        &format!(
            r#"
[[upstream]]
name = "demo"
url = {demo}

[[upstream]]
name = "paging"
command = [{python}, {paging}]

[[server]]
name = "all"
prefix = "conflicts"
[[server.member]]
upstream = "paging"
[[server.member]]
upstream = "demo"
tools = {{ include = ["echo"] }}
"#,
            demo = quoted(&demo.url),
            python = quoted(&python().display().to_string()),
            paging = quoted(&python_script("paging_server.py").display().to_string()),
        ),
    );
    let gateway = start(&config);
    let session = initialize(&gateway.addr, ALL);
    let names = list_tools(&gateway.addr, &session);
    let mut expected: Vec<String> = (0..7).map(|i| format!("page_{i}")).collect();
    expected.push("echo".into());
    assert_eq!(
        names, expected,
        "every page of the member, once each, names unprefixed where nothing conflicts"
    );
    assert_eq!(
        call_text(&gateway.addr, &session, 7, "page_6"),
        "ran page_6",
        "a tool of the last page runs"
    );

    // A 2026-07-28 client gets the same merged list, and a call found through it
    // (the `conflicts` rule: the owner is known only from the members' lists).
    let modern = http::request(
        &gateway.addr,
        "POST",
        ALL,
        &http::modern_headers("tools/list", None),
        &http::modern_body(1, "tools/list", json!({})),
    );
    assert_eq!(tool_names(&modern), expected, "{}", modern.text());
    let page = http::request(
        &gateway.addr,
        "POST",
        ALL,
        &http::modern_headers("tools/call", Some("page_6")),
        &http::modern_body(2, "tools/call", json!({"name": "page_6", "arguments": {}})),
    );
    assert_eq!(page.expect_tool_text(), "ran page_6", "{}", page.text());
}

#[test]
fn colliding_names_in_the_configuration_refuse_to_start_naming_both() {
    let config = config_file(
        "collide",
        r#"
[[upstream]]
name = "one"
url = "http://127.0.0.1:9/mcp"

[[upstream]]
name = "two"
url = "http://127.0.0.1:9/mcp"

[[server]]
name = "all"
[[server.member]]
upstream = "one"
prefix = "x"
[[server.member]]
upstream = "two"
prefix = "x"
"#,
    );
    let stderr = refused_at_start(&config);
    assert!(
        stderr.contains("\"one\"") && stderr.contains("\"two\"") && stderr.contains("collide"),
        "the refusal names both members: {stderr}"
    );
}

/// What `mcpgw serve` with `config` says on stderr as it refuses to start.
fn refused_at_start(config: &Path) -> String {
    let log = config.with_extension("log");
    let mut command = std::process::Command::new(mcpgw_testkit::bin("mcpgw"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(config);
    let stderr_file = std::fs::File::create(&log).expect("create the log file");
    let mut serve =
        mcpgw_testkit::Child::from_command_with_stderr("mcpgw", command, stderr_file.into())
            .expect("run mcpgw serve");
    let code = serve.wait_exit(Duration::from_secs(60));
    assert_ne!(code, Some(0), "the configuration was refused");
    std::fs::read_to_string(&log).expect("read the log")
}

/// `[[upstream]]` tables of two SDK-built resource servers over stdio (`alpha`,
/// `beta`: the same resources under their own names, plus `shared://` ones both list)
/// and the demo upstream, and the virtual server `all` of them with resource filters.
fn resource_servers(demo_url: &str) -> String {
    let server = |name: &str| {
        format!(
            "[{}, {}, {}]",
            quoted(&python().display().to_string()),
            quoted(&python_script("resource_server.py").display().to_string()),
            quoted(name)
        )
    };
    format!(
        r#"
[[upstream]]
name = "alpha"
command = {alpha}

[[upstream]]
name = "beta"
command = {beta}

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
upstream = "demo"
tools = {{ include = ["echo"] }}
"#,
        alpha = server("alpha"),
        beta = server("beta"),
        demo = quoted(demo_url),
    )
}

/// One JSON-RPC request in `session` on `ALL`, answered whole.
fn rpc(addr: &str, session: &str, id: u64, method: &str, params: Value) -> http::Response {
    let response = http::request(
        addr,
        "POST",
        ALL,
        &mcp_headers(Some(session)),
        &rpc_body(id, method, params),
    );
    assert_eq!(response.status, 200, "{method}: {}", response.text());
    response
}

/// The result (or the error) of a JSON-RPC answer.
fn answer_of(response: &http::Response, key: &str) -> Value {
    response
        .messages()
        .into_iter()
        .find_map(|m| m.get(key).cloned())
        .unwrap_or_else(|| panic!("no {key} in {}", response.text()))
}

/// The URIs (or templates: `field`) of a resource list answer under `list`.
fn identities(response: &http::Response, list: &str, field: &str) -> Vec<String> {
    answer_of(response, "result")[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list}: {}", response.text()))
        .iter()
        .map(|item| item[field].as_str().expect("an identity").to_owned())
        .collect()
}

/// A member slower than its `list_timeout_ms` delays a merged list by that much only:
/// the list comes without it and says so, and the other members' names are in it.
#[test]
fn a_member_slower_than_its_list_deadline_is_left_out_of_the_list_and_named() {
    let demo = Upstream::start();
    let config = config_file(
        "slow-list",
        &format!(
            r#"
[[upstream]]
name = "demo"
url = "{demo}"

[[upstream]]
name = "slow"
command = [{python}, {script}, "slow", "600"]

[[server]]
name = "all"
[[server.member]]
upstream = "demo"
[[server.member]]
upstream = "slow"
list_timeout_ms = 300
"#,
            demo = demo.url,
            python = quoted(&python().display().to_string()),
            script = quoted(&python_script("resource_server.py").display().to_string()),
        ),
    );
    let gateway = start(&config);
    let addr = gateway.addr.clone();
    let session = initialize(&addr, ALL);
    let listed = http::request(
        &addr,
        "POST",
        ALL,
        &mcp_headers(Some(&session)),
        &rpc_body(2, "tools/list", json!({})),
    );
    assert_eq!(listed.status, 200, "{}", listed.text());
    let names = tool_names(&listed);
    assert!(names.contains(&"demo__echo".to_owned()), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("slow__")), "{names:?}");
    let message = listed
        .messages()
        .into_iter()
        .find(|m| m.get("result").is_some())
        .expect("a result");
    let missing = &message["result"]["_meta"]["mcpgw/federation"]["missing"];
    assert_eq!(missing[0]["member"], "slow", "{message}");
    let why = missing[0]["why"].as_str().unwrap_or_default();
    assert!(
        why.contains("within 300 ms") && why.contains("list_timeout_ms"),
        "{why}"
    );
    assert_eq!(
        call_text(&addr, &session, 3, "demo__counter_increment"),
        "1"
    );
}

#[test]
fn a_zero_list_deadline_is_refused_at_start() {
    let config = config_file(
        "zero-list",
        "[[upstream]]\nname = \"demo\"\nurl = \"http://127.0.0.1:9/mcp\"\n\
         [[server]]\nname = \"all\"\n[[server.member]]\nupstream = \"demo\"\n\
         list_timeout_ms = 0\n",
    );
    let stderr = refused_at_start(&config);
    assert!(stderr.contains("list_timeout_ms"), "{stderr}");
}

#[test]
fn requests_two_members_send_the_client_at_once_get_their_own_answers() {
    let gateway = start(&two_asking_members());
    assert_each_member_got_its_own_answer(&format!("http://{}{ALL}", gateway.addr));
}

/// The same through a fleet: the calls land on a worker that does not own the session,
/// the client's answers on a third one, and each still reaches the member that asked.
#[test]
fn a_members_request_is_answered_through_another_worker_and_reaches_it() {
    let config = two_asking_members();
    let fleet = Fleet::start(3, &["--config".into(), config.display().to_string()]);
    let proxy = mcpgw_testkit::ScatterProxy::start_routed(fleet.addrs(), support::by_role);
    assert_each_member_got_its_own_answer(&format!("http://{}{ALL}", proxy.addr));
    let sent = proxy.sent_counts();
    assert!(
        sent[1] >= 2 && sent[2] >= 2,
        "the calls went to worker 1, the answers to worker 2: {sent:?}"
    );
}

/// A virtual server of two SDK servers (`a`, `b`, over stdio) whose tool asks the client.
fn two_asking_members() -> PathBuf {
    let asking = |name: &str| {
        format!(
            "[[upstream]]\nname = \"{name}\"\ncommand = [{}, {}, \"stdio\"]\n",
            quoted(&python().display().to_string()),
            quoted(&python_script("asking_server.py").display().to_string()),
        )
    };
    config_file(
        "asking",
        &format!(
            "{}{}\n[[server]]\nname = \"all\"\n[[server.member]]\nupstream = \"a\"\n\
             [[server.member]]\nupstream = \"b\"\n",
            asking("a"),
            asking("b")
        ),
    )
}

/// Two members that ask the client at once both number their request alike: the
/// client sees each under an id naming its member, and each member gets the answer
/// meant for it, not the other's.
fn assert_each_member_got_its_own_answer(url: &str) {
    let out = run_python("federation_client.py", &[url, "asking"]);
    let seen = out["seen"].as_array().expect("the requests the client saw");
    let ids: Vec<&str> = seen.iter().filter_map(|s| s["id"].as_str()).collect();
    assert_eq!(ids.len(), 2, "two requests under string ids: {out}");
    assert_ne!(ids[0], ids[1], "distinct ids: {out}");
    // Each member numbered its request alike: without the member in the id, the
    // client's two answers would carry one id.
    let own = |id: &str| id.rsplit('~').next().map(str::to_owned);
    assert_eq!(
        own(ids[0]),
        own(ids[1]),
        "the members' own ids collide: {out}"
    );
    for member in ["a", "b"] {
        // The tag names the member, not its place, so an adopter with the members in
        // another order still delivers each answer to the member that asked.
        let meant = seen
            .iter()
            .find(|s| {
                s["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with(&format!("mcpgw~@{member}~")))
            })
            .unwrap_or_else(|| panic!("member {member}'s request reached the client: {out}"));
        let report = out[member].as_str().unwrap_or_default();
        let answer = meant["answer"].as_str().expect("an answer");
        assert!(
            report.starts_with("answered:") && report.contains(answer),
            "member {member} got the answer meant for it ({answer:?}): {report}"
        );
    }
}

#[test]
fn the_sdk_client_reads_subscribes_and_completes_across_members() {
    let demo = Upstream::start();
    let config = config_file("resources", &resource_servers(&demo.url));
    let gateway = start(&config);
    let url = format!("http://{}{ALL}", gateway.addr);
    let out = run_python("federation_client.py", &[&url, "resources"]);
    let capabilities = &out["capabilities"];
    assert_eq!(
        capabilities["resources"],
        json!({"listChanged": true, "subscribe": true}),
        "{capabilities}"
    );
    assert!(capabilities.get("completions").is_some(), "{capabilities}");
    assert_eq!(
        out["resources"],
        json!([
            "mem://alpha/readme",
            "shared://common",
            "mem://beta/readme",
            "demo://session/state"
        ]),
        "each member's resources, unrenamed, filtered; a URI two members list is the \
         earlier one's"
    );
    assert_eq!(
        out["resources_meta"]["hidden"],
        json!([{"uri": "shared://common", "member": "beta", "kept_by": "alpha"}]),
        "the URI left out is named: {out}"
    );
    assert_eq!(
        out["templates"],
        json!([
            "mem://alpha/notes/{note}",
            "shared://any/{thing}",
            "mem://beta/notes/{note}"
        ])
    );
    let reads = &out["reads"];
    assert_eq!(reads["mem://alpha/readme"], "readme of alpha");
    assert_eq!(reads["shared://common"], "common of alpha");
    assert_eq!(
        reads["mem://beta/notes/n1"], "note n1 of beta",
        "a template-matched URI reaches the template's member"
    );
    assert_eq!(reads["shared://any/x"], "any x of alpha");
    assert!(
        reads["demo://session/state"]
            .as_str()
            .is_some_and(|s| s.contains("counter")),
        "the HTTP member's resource: {reads}"
    );
    assert_eq!(
        out["prompt_completion"],
        json!(["beta-al-prompt"]),
        "completion of beta__greet reached beta under its own name"
    );
    assert_eq!(
        out["template_completion"],
        json!(["alpha-n-for-mem://alpha/notes/{note}"])
    );
    assert_eq!(
        out["subscribed"],
        json!({"alpha": "[]", "beta": "[\"mem://beta/readme\"]"}),
        "the subscription reached the member that lists the URI, and only it"
    );
    assert_eq!(
        out["updated"], "mem://beta/readme",
        "the member's notification reached the client"
    );
    assert_eq!(out["after_unsubscribe"], "[]", "unsubscribe reached it too");
}

#[test]
fn unknown_or_filtered_uris_are_refused_and_a_lost_members_resources_leave() {
    let demo = Upstream::start();
    let config = config_file("resources-lost", &resource_servers(&demo.url));
    let gateway = start(&config);
    let addr = gateway.addr.clone();
    let session = initialize(&addr, ALL);
    // Not listed by anyone; kept out of alpha's list by its filter; matched by beta's
    // template but kept out by beta's filter.
    for (id, uri) in [
        (1, "mem://gamma/x"),
        (2, "mem://alpha/hidden"),
        (10, "mem://beta/notes/secret"),
    ] {
        let response = rpc(&addr, &session, id, "resources/read", json!({"uri": uri}));
        let error = answer_of(&response, "error");
        assert_eq!(error["code"], -32602, "{error}");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(uri) && message.contains("resources/templates/list"),
            "names the URI and what to do: {message}"
        );
    }
    let read = |id: u64, uri: &str| rpc(&addr, &session, id, "resources/read", json!({"uri": uri}));
    let text = answer_of(&read(3, "mem://beta/notes/z"), "result")["contents"][0]["text"].clone();
    assert_eq!(text, "note z of beta");
    let pid: u32 = call_text(&addr, &session, 4, "beta__pid")
        .parse()
        .expect("a pid");

    send(pid, Signal::SIGKILL);

    for (id, uri) in [(5, "mem://beta/readme"), (6, "mem://beta/notes/z")] {
        let lost = eventually(Duration::from_secs(60), || {
            let response = read(id, uri);
            match response.reason().as_deref() {
                Some("member_lost") => Ok(response),
                _ => Err(response.text()),
            }
        });
        assert_eq!(
            lost.error().expect("an error")["data"]["member"],
            "beta",
            "{uri}"
        );
    }
    let listed = rpc(&addr, &session, 7, "resources/list", json!({}));
    assert_eq!(
        identities(&listed, "resources", "uri"),
        [
            "mem://alpha/readme",
            "shared://common",
            "demo://session/state"
        ],
        "the lost member's resources leave the list"
    );
    let missing = &answer_of(&listed, "result")["_meta"]["mcpgw/federation"]["missing"];
    assert_eq!(missing[0]["member"], "beta", "{missing}");
    let templates = rpc(&addr, &session, 8, "resources/templates/list", json!({}));
    assert_eq!(
        identities(&templates, "resourceTemplates", "uriTemplate"),
        ["mem://alpha/notes/{note}", "shared://any/{thing}"]
    );
    assert_eq!(
        answer_of(&read(9, "mem://alpha/notes/y"), "result")["contents"][0]["text"],
        "note y of alpha",
        "the other members go on"
    );
    let (seen, heard) = std::sync::mpsc::channel();
    {
        let (addr, session) = (addr.clone(), session.clone());
        std::thread::spawn(move || {
            let headers = [
                ("Accept", "text/event-stream"),
                ("MCP-Protocol-Version", "2025-11-25"),
                ("Mcp-Session-Id", session.as_str()),
            ];
            let stream = read_stream(&addr, "GET", ALL, &headers, b"", Until::Events(3));
            let _ = seen.send(stream);
        });
    }
    let stream = heard
        .recv_timeout(Duration::from_secs(60))
        .expect("the GET stream heard the loss");
    let methods: Vec<&str> = stream
        .events
        .iter()
        .filter_map(|e| e.data["method"].as_str())
        .collect();
    assert!(
        methods.contains(&"notifications/resources/list_changed"),
        "{methods:?}"
    );
}

/// `notifications/cancelled`, POSTed to a worker that does not own the session,
/// reaches the member running the call, over HTTP and over stdio alike: the call
/// stops there, cancelled (not finished, not disconnected), and the session goes on.
#[test]
fn a_cancelled_call_through_the_other_worker_stops_at_the_member_running_it() {
    let port = mcpgw_testkit::free_port();
    let mut web = mcpgw_testkit::Child::spawn(
        "ticking_server",
        &python(),
        &[
            python_script("ticking_server.py").display().to_string(),
            "http".into(),
            port.to_string(),
        ],
    );
    web.wait_for_line("ticking_server listening", Duration::from_secs(30));
    mcpgw_testkit::wait_for_listener(&format!("127.0.0.1:{port}"), Duration::from_secs(30));
    let ticking = quoted(&python_script("ticking_server.py").display().to_string());
    let config = config_file(
        "cancel",
        &format!(
            r#"
[[upstream]]
name = "web"
url = "http://127.0.0.1:{port}/mcp"

[[upstream]]
name = "pipe"
command = [{python}, {ticking}, "stdio"]

[[server]]
name = "all"
[[server.member]]
upstream = "web"
[[server.member]]
upstream = "pipe"
"#,
            python = quoted(&python().display().to_string()),
        ),
    );
    let fleet = support::Fleet::start_with_env(
        2,
        &["--config".into(), config.display().to_string()],
        &[(
            "RUST_LOG",
            "debug,h2=info,hyper=info,quinn=info,rustls=info",
        )],
    );
    let (owner, edge) = (fleet.addr(0), fleet.addr(1));
    let session = initialize(owner, ALL);

    // Calls that each find the session's catalog empty merge the members' lists at
    // once: every one is answered (the gateway's own list requests never share an id
    // in a member's session, which would leave one waiting until its deadline).
    let shared = session.as_str();
    std::thread::scope(|scope| {
        let calls: Vec<_> = (0..6)
            .map(|n| scope.spawn(move || call_text(edge, shared, 100 + n, "web__ticks")))
            .collect();
        for call in calls {
            let text = call.join().expect("a concurrent call");
            assert!(text.contains("\"running\": 0"), "{text}");
        }
    });
    let progress = |member: &str| -> Value {
        let text = call_text(edge, &session, 9, &format!("{member}__ticks"));
        serde_json::from_str(&text).expect("ticks as JSON")
    };
    for (id, member) in [(30, "web"), (31, "pipe")] {
        let running = support::send_request(
            edge,
            "POST",
            ALL,
            &mcp_headers(Some(&session)),
            &http::tool_call_body(
                id,
                &format!("{member}__tick"),
                json!({"count": 100_000, "interval_ms": 10}),
            ),
        );
        eventually(Duration::from_secs(60), || {
            let now = progress(member);
            if now["running"] == 1 {
                Ok(())
            } else {
                Err(now)
            }
        });
        let cancel = json!({
            "jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": id, "reason": "the test cancels it"},
        })
        .to_string();
        let accepted = http::request(
            edge,
            "POST",
            ALL,
            &mcp_headers(Some(&session)),
            cancel.as_bytes(),
        );
        assert_eq!(accepted.status, 202, "{member}: {}", accepted.text());
        let after = eventually(Duration::from_secs(60), || {
            let now = progress(member);
            if now["running"] == 0 {
                Ok(now)
            } else {
                Err(now)
            }
        });
        assert_eq!(after["cancelled"], 1, "{member}: {after}");
        assert_eq!(after["finished"], 0, "{member}: {after}");
        assert_eq!(after["disconnected"], 0, "{member}: {after}");
        drop(running);
    }
    let short = call_tool(
        edge,
        ALL,
        &session,
        40,
        "pipe__tick",
        json!({"count": 1, "interval_ms": 0}),
    );
    assert_eq!(
        short.tool_text().as_deref(),
        Some("ticked 1 times"),
        "the session goes on after the cancellations"
    );
}

/// `tests/python/outside_server.py http NAME PORT` once it listens, and its address.
fn outside_over_http(name: &str) -> (mcpgw_testkit::Child, String) {
    outside_on_port(name, mcpgw_testkit::free_port())
}

fn outside_on_port(name: &str, port: u16) -> (mcpgw_testkit::Child, String) {
    let mut server = mcpgw_testkit::Child::spawn(
        "outside_server",
        &python(),
        &[
            python_script("outside_server.py").display().to_string(),
            "http".into(),
            name.into(),
            port.to_string(),
        ],
    );
    server.wait_for_line("outside_server listening", Duration::from_secs(60));
    let addr = format!("127.0.0.1:{port}");
    mcpgw_testkit::wait_for_listener(&addr, Duration::from_secs(60));
    (server, addr)
}

/// What an `outside_server.py` over HTTP at `addr` counts: its open GET streams
/// (`get_streams`) and the GETs it received (`gets`).
fn outside_stats(addr: &str) -> Value {
    let stats = http::request(addr, "GET", "/stats", &[], b"");
    assert_eq!(stats.status, 200, "{}", stats.text());
    stats.json()
}

/// A virtual server `all` of `outside_server.py` members: `h` over HTTP at `h_addr`,
/// and, with `stdio`, `s` over stdio after it.
fn outside_members(h_addr: &str, stdio: bool) -> PathBuf {
    let mut text = format!(
        "[[upstream]]\nname = \"h\"\nurl = \"http://{h_addr}/mcp\"\n\n\
         [[server]]\nname = \"all\"\n[[server.member]]\nupstream = \"h\"\n"
    );
    if stdio {
        text = format!(
            "[[upstream]]\nname = \"s\"\ncommand = [{}, {}, \"stdio\", \"s\"]\n\n{text}\
             [[server.member]]\nupstream = \"s\"\n",
            quoted(&python().display().to_string()),
            quoted(&python_script("outside_server.py").display().to_string()),
        );
    }
    config_file("outside", &text)
}

/// Initialize to worker 0, every other request to worker 1: each is forwarded to the
/// owner, the session's GET stream and the client's answers included.
fn past_the_owner(_method: &str, body: &[u8]) -> usize {
    let message: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    usize::from(message["method"] != "initialize")
}

/// What an HTTP and a stdio member send outside any request reaches the SDK client
/// through the worker that does not own the session: a resource update, and a
/// request under an id naming its member, whose answer reaches that member alone.
#[test]
fn what_members_send_outside_a_request_reaches_the_client_and_its_answer_the_asker_alone() {
    let (_h, h_addr) = outside_over_http("h");
    let config = outside_members(&h_addr, true);
    let fleet = Fleet::start(2, &["--config".into(), config.display().to_string()]);
    let proxy = mcpgw_testkit::ScatterProxy::start_routed(fleet.addrs(), past_the_owner);
    let out = run_python(
        "federation_client.py",
        &[&format!("http://{}{ALL}", proxy.addr), "outside"],
    );
    assert_eq!(
        out["updated"],
        json!(["mem://h/doc", "mem://s/doc"]),
        "each member's update outside a request reached the client's GET stream: {out}"
    );
    let seen = out["seen"].as_array().expect("the requests the client saw");
    let id_of = |member: &str| {
        seen.iter()
            .filter_map(|s| s["id"].as_str())
            .find(|id| id.starts_with(&format!("mcpgw~@{member}~")))
            .unwrap_or_else(|| panic!("member {member}'s request, under its tagged id: {out}"))
    };
    let own = |id: &str| id.rsplit('~').next().map(str::to_owned);
    assert_eq!(
        own(id_of("h")),
        own(id_of("s")),
        "the members' own ids collide, so only the tag tells them apart: {out}"
    );
    for member in ["h", "s"] {
        let report = &out["reports"][member];
        assert_eq!(
            report["answer"],
            json!([format!("answer to {}", id_of(member))]),
            "member {member} got the answer meant for it: {out}"
        );
        assert_eq!(
            report["stray"], 0,
            "member {member} got no answer meant for the other: {out}"
        );
    }
    assert_eq!(
        out["h_get_streams"], 1,
        "one GET stream of the member: {out}"
    );
    assert_eq!(
        proxy.sent_counts()[0],
        1,
        "only initialize reached the owner directly"
    );
    // The SDK client ended its session (DELETE) as it left. `h` refuses DELETE, so its
    // session and its GET stream go on unless the gateway ends the stream itself.
    eventually(Duration::from_secs(60), || {
        let stats = outside_stats(&h_addr);
        (stats["get_streams"] == 0).then_some(()).ok_or(stats)
    });
}

/// A member's GET stream is opened once, however many GETs the client sends, and
/// ends with the session even though the member would keep it open.
#[test]
fn a_members_get_stream_is_opened_once_and_ends_with_the_session() {
    let (_h, h_addr) = outside_over_http("h");
    let gateway = start(&outside_members(&h_addr, false));
    let addr = gateway.addr.clone();
    let session = initialize(&addr, ALL);
    assert_eq!(
        outside_stats(&h_addr)["get_streams"],
        0,
        "none before a GET"
    );
    let headers = [
        ("Accept", "text/event-stream"),
        ("MCP-Protocol-Version", "2025-11-25"),
        ("Mcp-Session-Id", session.as_str()),
    ];
    let first = support::send_request(&addr, "GET", ALL, &headers, b"");
    eventually(Duration::from_secs(60), || {
        let stats = outside_stats(&h_addr);
        (stats["get_streams"] == 1).then_some(()).ok_or(stats)
    });
    // A second GET takes the session's stream over; the member's stays as it is.
    let second = support::send_request(&addr, "GET", ALL, &headers, b"");
    let mut status = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&second), &mut status)
        .expect("the second GET's status line");
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(http::delete_session(&addr, ALL, &session).status, 200);
    eventually(Duration::from_secs(60), || {
        let stats = outside_stats(&h_addr);
        (stats["get_streams"] == 0).then_some(()).ok_or(stats)
    });
    assert_eq!(
        outside_stats(&h_addr)["gets"],
        1,
        "the member was asked for one GET stream"
    );
    drop((first, second));
}

/// A member that restarts (its stream breaks, and it no longer knows the session) is
/// found out by the gateway reopening its stream: the 404 makes it lost, and the
/// client's GET stream hears that the lists changed without sending anything.
#[test]
fn a_member_that_forgets_the_session_is_lost_when_its_get_stream_is_reopened() {
    let (h, h_addr) = outside_over_http("h");
    let port: u16 = h_addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port");
    let gateway = start(&outside_members(&h_addr, false));
    let addr = gateway.addr.clone();
    let session = initialize(&addr, ALL);
    let (seen, heard) = std::sync::mpsc::channel();
    {
        let (addr, session) = (addr.clone(), session.clone());
        std::thread::spawn(move || {
            let headers = [
                ("Accept", "text/event-stream"),
                ("MCP-Protocol-Version", "2025-11-25"),
                ("Mcp-Session-Id", session.as_str()),
            ];
            let stream = read_stream(&addr, "GET", ALL, &headers, b"", Until::Events(1));
            let _ = seen.send(stream);
        });
    }
    eventually(Duration::from_secs(60), || {
        let stats = outside_stats(&h_addr);
        (stats["get_streams"] == 1).then_some(()).ok_or(stats)
    });

    drop(h);
    let (_h, _) = outside_on_port("h", port);

    let stream = heard
        .recv_timeout(Duration::from_secs(120))
        .expect("the client's GET stream heard the loss");
    assert_eq!(
        stream.events[0].data["method"], "notifications/tools/list_changed",
        "{stream:?}"
    );
    let lost = call_tool(&addr, ALL, &session, 2, "h__get_streams", json!({}));
    assert_eq!(
        lost.reason().as_deref(),
        Some("member_lost"),
        "{}",
        lost.text()
    );
    let detail = lost.error().expect("an error")["data"]["detail"].clone();
    assert!(
        detail
            .as_str()
            .is_some_and(|d| d.contains("no longer knows")),
        "{detail}"
    );
}

/// The worker that adopts a virtual server's session (its owner was killed) opens the
/// HTTP member's GET stream in the member's own session on the client's next GET, and
/// what the member sends outside a request reaches the client through it.
#[test]
fn after_an_adoption_the_new_owner_opens_the_members_get_stream_on_the_next_get() {
    let (_h, h_addr) = outside_over_http("h");
    let config = outside_members(&h_addr, false);
    let fleet = Fleet::start(2, &["--config".into(), config.display().to_string()]);
    let session = initialize(fleet.addr(0), ALL);
    let (owner_pid, owner_id) = support::worker_at(&fleet, 0);
    assert_eq!(mcpgw_testkit::fleet::owner_of(&session), owner_id);
    let headers = [
        ("Accept", "text/event-stream"),
        ("MCP-Protocol-Version", "2025-11-25"),
        ("Mcp-Session-Id", session.as_str()),
    ];
    let _before = support::send_request(fleet.addr(1), "GET", ALL, &headers, b"");
    let streams = |expected: u64| {
        eventually(Duration::from_secs(60), || {
            let stats = outside_stats(&h_addr);
            (stats["get_streams"] == expected)
                .then_some(())
                .ok_or(stats)
        })
    };
    streams(1);

    send(owner_pid, Signal::SIGKILL);
    support::wait_stopped(owner_pid, "the session's owner");
    streams(0);

    // A request on a pooled connection to the dead owner may get 502 outcome_unknown
    // once; the tool only reads a count.
    let adopted = eventually(Duration::from_secs(60), || {
        let response = call_tool(fleet.addr(1), ALL, &session, 2, "h__get_streams", json!({}));
        if response.status == 200 {
            Ok(response)
        } else {
            Err(response.text())
        }
    });
    assert_eq!(
        adopted.header("mcpgw-adopted"),
        Some("death"),
        "{:?}",
        adopted.headers
    );
    assert_eq!(
        adopted.expect_tool_text(),
        "0",
        "no GET stream yet at the adopter"
    );
    assert_ne!(
        adopted.header("mcpgw-owner-worker"),
        Some(owner_id.as_str()),
        "another worker owns the session now"
    );
    let (seen, heard) = std::sync::mpsc::channel();
    {
        let (addr, headers) = (
            fleet.addr(1).to_owned(),
            headers.map(|(k, v)| (k, v.to_owned())),
        );
        std::thread::spawn(move || {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let stream = read_stream(&addr, "GET", ALL, &headers, b"", Until::Events(1));
            let _ = seen.send(stream);
        });
    }
    streams(1);
    let note = br#"{"jsonrpc":"2.0","method":"notifications/roots/list_changed"}"#;
    let ack = http::request(
        fleet.addr(0),
        "POST",
        ALL,
        &mcp_headers(Some(&session)),
        note,
    );
    assert_eq!(ack.status, 202, "{}", ack.text());
    let stream = heard
        .recv_timeout(Duration::from_secs(120))
        .expect("the client's GET stream heard the member");
    assert_eq!(
        stream.events[0].data["method"], "notifications/resources/updated",
        "{stream:?}"
    );
    assert_eq!(stream.events[0].data["params"]["uri"], "mem://h/doc");
}
