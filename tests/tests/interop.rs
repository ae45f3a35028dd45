//! Interop with MCP software nobody here wrote: the official Python SDK's client,
//! in legacy session mode and in 2026-07-28 mode, through the gateway to the demo
//! upstream and to a server built with the same SDK.

use mcpgw_testkit::python::SdkServer;
use mcpgw_testkit::{Gateway, Upstream, run_python};

fn gateway_for(upstream_url: &str) -> Gateway {
    Gateway::start(&["--upstream", &format!("demo={upstream_url}")])
}

fn strings(value: &serde_json::Value) -> Vec<&str> {
    value
        .as_array()
        .map(|items| items.iter().filter_map(|t| t.as_str()).collect())
        .unwrap_or_default()
}

#[test]
fn sdk_client_lists_and_calls_in_both_modes() {
    let upstream = Upstream::start();
    let gateway = gateway_for(&upstream.url);
    for mode in ["legacy", "2026-07-28"] {
        let out = run_python("sdk_client.py", &[&gateway.url(), mode, "basic"]);
        assert_eq!(out["echo"], "hello through mcpgw", "{mode}");
        assert_eq!(out["is_error"], false, "{mode}");
        let tools = strings(&out["tools"]);
        for tool in ["echo", "counter_increment", "slow_stream", "sleep_ms"] {
            assert!(tools.contains(&tool), "{mode}: {tool} in {tools:?}");
        }
    }
}

#[test]
fn sdk_client_sessions_keep_their_own_counter() {
    let upstream = Upstream::start();
    let gateway = gateway_for(&upstream.url);
    let out = run_python("sdk_client.py", &[&gateway.url(), "legacy", "counter"]);
    assert_eq!(out["first_session"], serde_json::json!(["1", "2", "3"]));
    assert_eq!(out["second_session"], "1");
}

#[test]
fn sdk_client_sees_progress_before_the_result() {
    let upstream = Upstream::start();
    let gateway = gateway_for(&upstream.url);
    for mode in ["legacy", "2026-07-28"] {
        let out = run_python("sdk_client.py", &[&gateway.url(), mode, "stream"]);
        let progress: Vec<f64> = out["progress_ms"]
            .as_array()
            .map(|v| v.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default();
        let result_ms = out["result_ms"].as_f64().unwrap_or_default();
        eprintln!("{mode}: progress at {progress:?} ms, result at {result_ms} ms");
        assert_eq!(
            progress.len(),
            10,
            "{mode}: every progress notification arrives: {out}"
        );
        // The upstream spaces 10 events 100 ms apart: the first must reach the client
        // long before the result, or the gateway buffered the stream.
        assert!(
            result_ms - progress[0] >= 500.0,
            "{mode}: first progress at {} ms, result at {result_ms} ms",
            progress[0]
        );
    }
}

#[test]
fn sdk_built_upstream_keeps_state_per_session_through_the_gateway() {
    let server = SdkServer::start();
    let gateway = gateway_for(&server.url);
    let out = run_python("sdk_client.py", &[&gateway.url(), "legacy", "notes"]);
    assert_eq!(out["mine"], "one,two");
    assert_eq!(
        out["theirs"], "",
        "a second session sees none of the first's notes"
    );
}

/// The SDK-built upstream behind the gateway, driven by the SDK client in both eras:
/// a 2026-07-28 client is passed through statelessly to a server nobody here wrote.
#[test]
fn sdk_built_upstream_serves_both_modes_through_the_gateway() {
    let server = SdkServer::start();
    let gateway = gateway_for(&server.url);
    for mode in ["legacy", "2026-07-28"] {
        let out = run_python("sdk_client.py", &[&gateway.url(), mode, "basic"]);
        assert_eq!(
            strings(&out["tools"]),
            ["add_note", "echo", "list_notes"],
            "{mode}: the SDK server's own tools: {out}"
        );
        assert_eq!(out["echo"], "hello through mcpgw", "{mode}: {out}");
        assert_eq!(out["is_error"], false, "{mode}: {out}");
    }
}
