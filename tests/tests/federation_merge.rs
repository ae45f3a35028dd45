//! Merging is linear and bounded (issue #41): a virtual server's merged list of a
//! member listing 40,000 resources holds no runtime thread, a member past the
//! server's bound is cut and the list says so, and an unknown URI or name reads the
//! members' lists again at most once per interval. Real processes: the demo upstream
//! (`--resources N` lists N generated resources in pages) behind a gateway.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use mcpgw_testkit::http::{self, initialize, mcp_headers, rpc_body};
use mcpgw_testkit::{Gateway, Upstream};
use serde_json::{Value, json};

const ALL: &str = "/servers/all/mcp";

/// A configuration of the demo upstream at `demo` as the only member of `all`, with
/// `server_keys` (merge bounds) in the `[[server]]` table.
fn config(what: &str, demo: &Upstream, server_keys: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "mcpgw-federation-merge-{what}-{}-{}.toml",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    let text = format!(
        "[[upstream]]\nname = \"demo\"\nurl = {url}\n\n[[server]]\nname = \"all\"\n\
         {server_keys}\n[[server.member]]\nupstream = \"demo\"\n",
        url = Value::from(demo.url.as_str()),
    );
    std::fs::write(&path, text).expect("write the configuration");
    path
}

/// One JSON-RPC request in `session` on `ALL`: its result, or its error.
fn rpc(addr: &str, session: &str, id: u64, method: &str, params: Value) -> Value {
    let response = http::request(
        addr,
        "POST",
        ALL,
        &mcp_headers(Some(session)),
        &rpc_body(id, method, params),
    );
    assert_eq!(response.status, 200, "{method}: {}", response.text());
    response
        .messages()
        .into_iter()
        .find(|m| m.get("result").is_some() || m.get("error").is_some())
        .unwrap_or_else(|| panic!("no answer to {method}: {}", response.text()))
}

/// The URIs of a `resources/list` answer.
fn uris(answer: &Value) -> Vec<String> {
    answer["result"]["resources"]
        .as_array()
        .unwrap_or_else(|| panic!("no resources: {answer}"))
        .iter()
        .map(|r| r["uri"].as_str().expect("a URI").to_owned())
        .collect()
}

/// One runtime thread, a member listing 40,000 resources in pages of 2,000: while
/// the merged list is being built (after the member served its last page), a `ping`
/// of another session is answered before the list is; the list is whole, each URI
/// once. Before the merge was linear and off the runtime thread, the ping waited
/// behind a merge of minutes.
#[test]
fn a_merge_of_40000_resources_holds_no_runtime_thread() {
    const COUNT: u64 = 40_000;
    const PAGES: u64 = COUNT / 2_000;
    let demo = Upstream::start_with(&["--resources", "40000", "--resource-page", "2000"]);
    let config = config("large", &demo, "max_member_items = 50000");
    let gateway = Gateway::start(&["--config", &config.display().to_string(), "--threads", "1"]);
    let listing = initialize(&gateway.addr, ALL);
    let pinging = initialize(&gateway.addr, ALL);

    let listed = Arc::new(AtomicBool::new(false));
    let list = {
        let (addr, listed) = (gateway.addr.clone(), Arc::clone(&listed));
        std::thread::spawn(move || {
            let answer = rpc(&addr, &listing, 1, "resources/list", json!({}));
            listed.store(true, Ordering::SeqCst);
            answer
        })
    };
    // The member's last page asked for: what remains is the gateway's merge.
    while demo.counter("resource_lists") < PAGES {
        assert!(!list.is_finished(), "the list ended before its last page");
        std::thread::sleep(Duration::from_millis(2));
    }
    let pong = rpc(&gateway.addr, &pinging, 2, "ping", json!({}));
    let answered_first = !listed.load(Ordering::SeqCst);
    assert_eq!(pong["result"], json!({}), "{pong}");
    let answer = list.join().expect("the list thread");
    assert!(
        answered_first,
        "the other session's ping was answered only after the merged list: the merge \
         held the runtime thread"
    );
    let uris = uris(&answer);
    assert_eq!(
        uris.len() as u64,
        COUNT + 1,
        "every resource and the state's"
    );
    let unique: HashSet<&String> = uris.iter().collect();
    assert_eq!(unique.len(), uris.len(), "no URI twice");
    assert!(unique.contains(&"demo://item/39999".to_owned()));
    assert!(
        answer["result"].get("_meta").is_none(),
        "nothing cut: {}",
        answer["result"]["_meta"]
    );
    assert_eq!(demo.counter("resource_lists"), PAGES, "each page once");
}

/// A member listing more than the server's `max_member_items` is cut: its pages are
/// followed no further, the list holds the first items and names the member in
/// `_meta["mcpgw/federation"].cut`, and a URI beyond the cut still reaches it.
#[test]
fn a_member_past_its_bound_is_cut_said_and_still_reached_beyond_the_cut() {
    let demo = Upstream::start_with(&["--resources", "25", "--resource-page", "10"]);
    let config = config("cut", &demo, "max_member_items = 12");
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    let session = initialize(&gateway.addr, ALL);

    let answer = rpc(&gateway.addr, &session, 1, "resources/list", json!({}));
    let listed = uris(&answer);
    assert_eq!(listed.len(), 12, "the first 12 of 26: {listed:?}");
    assert_eq!(listed[11], "demo://item/10");
    let cut = &answer["result"]["_meta"]["mcpgw/federation"]["cut"];
    assert_eq!(cut[0]["member"], "demo", "{answer}");
    assert_eq!(cut[0]["listed"], 12, "{cut}");
    let why = cut[0]["why"].as_str().unwrap_or_default();
    assert!(why.contains("max_member_items"), "{why}");
    assert_eq!(
        demo.counter("resource_lists"),
        2,
        "no page followed past the cut"
    );

    let read = rpc(
        &gateway.addr,
        &session,
        2,
        "resources/read",
        json!({"uri": "demo://item/20"}),
    );
    assert_eq!(
        read["result"]["contents"][0]["text"], "item 20",
        "a URI beyond the cut goes to the cut member: {read}"
    );
}

/// An unknown URI or tool name reads the members' lists again once; asked again
/// within `unknown_refresh_ms`, the catalog's answer stands and nothing is listed.
#[test]
fn an_unknown_uri_or_name_reads_the_lists_at_most_once_per_interval() {
    let demo = Upstream::start_with(&["--resources", "5"]);
    let config = config("refresh", &demo, "unknown_refresh_ms = 600000");
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    let session = initialize(&gateway.addr, ALL);
    let before = demo.counter("requests");

    for id in 1..=3 {
        let read = rpc(
            &gateway.addr,
            &session,
            id,
            "resources/read",
            json!({"uri": "demo://nothing/here"}),
        );
        assert_eq!(read["error"]["code"], -32602, "{read}");
    }
    assert_eq!(
        demo.counter("resource_lists"),
        1,
        "three unknown URIs within the interval: the lists read once"
    );
    let after_reads = demo.counter("requests");
    assert_eq!(
        after_reads - before,
        2,
        "resources/list and resources/templates/list"
    );

    for id in 4..=6 {
        let call = rpc(
            &gateway.addr,
            &session,
            id,
            "tools/call",
            json!({"name": "demo__nothing", "arguments": {}}),
        );
        assert_eq!(call["error"]["code"], -32602, "{call}");
    }
    assert_eq!(
        demo.counter("requests") - after_reads,
        1,
        "three unknown tool names within the interval: tools/list read once"
    );

    // The client's own list is never held back.
    let answer = rpc(&gateway.addr, &session, 7, "resources/list", json!({}));
    assert_eq!(uris(&answer).len(), 6);
    assert_eq!(demo.counter("resource_lists"), 2);
}
