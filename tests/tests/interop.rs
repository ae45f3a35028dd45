//! Interop with MCP software nobody here wrote: the official Python SDK's client,
//! in legacy session mode and in 2026-07-28 mode, through the gateway to the demo
//! upstream and to a server built with the same SDK.

use mcpgw_tests::{Child, Gateway, Upstream, python, python_script, run_python};
use std::time::Duration;

fn gateway_for(upstream_url: &str) -> Gateway {
    Gateway::start(&["--upstream", &format!("demo={upstream_url}")])
}

#[test]
fn sdk_client_lists_and_calls_in_both_modes() {
    let upstream = Upstream::start();
    let gateway = gateway_for(&upstream.url);
    for mode in ["legacy", "2026-07-28"] {
        let out = run_python("sdk_client.py", &[&gateway.url(), mode, "basic"]);
        assert_eq!(out["echo"], "hello through mcpgw", "{mode}");
        assert_eq!(out["is_error"], false, "{mode}");
        let tools: Vec<&str> = out["tools"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|t| t.as_str())
            .collect();
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
            .unwrap()
            .iter()
            .filter_map(|v| v.as_f64())
            .collect();
        let result_ms = out["result_ms"].as_f64().unwrap();
        eprintln!("{mode}: progress at {progress:?} ms, result at {result_ms} ms");
        assert_eq!(
            progress.len(),
            10,
            "{mode}: every progress notification arrives"
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
    let port = mcpgw_tests::free_port();
    let mut server = Child::spawn(
        "sdk_server",
        &python(),
        &[
            python_script("sdk_server.py").display().to_string(),
            port.to_string(),
        ],
    );
    server.wait_for_line("sdk_server listening", Duration::from_secs(30));
    mcpgw_tests::wait_for_listener(&format!("127.0.0.1:{port}"), Duration::from_secs(30));
    let gateway = gateway_for(&format!("http://127.0.0.1:{port}/mcp"));
    let out = run_python("sdk_client.py", &[&gateway.url(), "legacy", "notes"]);
    assert_eq!(out["mine"], "one,two");
    assert_eq!(
        out["theirs"], "",
        "a second session sees none of the first's notes"
    );
}
