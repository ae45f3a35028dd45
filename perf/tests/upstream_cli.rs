//! The `mcpgw-bench upstream` command as scripts and tests use it: start it
//! on port 0, read the announced URL, talk to it.

use std::path::Path;
use std::time::Duration;

use mcpgw_testkit::Child;
use mcpgw_testkit::http::{self, request};

#[test]
fn upstream_announces_its_real_address_and_serves_it() {
    let mut server = Child::spawn(
        "upstream",
        Path::new(env!("CARGO_BIN_EXE_mcpgw-bench")),
        &["upstream", "--listen", "127.0.0.1:0"],
    );
    let line = server.wait_for_line("listening on", Duration::from_secs(30));
    let url = line
        .strip_prefix("mcpgw-bench upstream listening on http://")
        .and_then(|rest| rest.strip_suffix("/mcp"))
        .unwrap_or_else(|| panic!("unexpected announcement: {line:?}"));
    let address: std::net::SocketAddr = url.parse().expect("announced address parses");
    assert_ne!(
        address.port(),
        0,
        "the announcement names the bound port, not the requested one"
    );

    let response = http::try_initialize(&address.to_string(), "/mcp").expect("an answer");
    assert_eq!(response.status, 200, "{}", response.text());
    let session_id = response
        .header("mcp-session-id")
        .expect("initialize mints a session");
    assert_eq!(session_id.len(), 32);
    assert!(session_id.bytes().all(|b| b.is_ascii_hexdigit()));
    let text = response.text();
    assert!(
        text.contains(r#""serverInfo":{"name":"mcpgw-bench-upstream""#),
        "{text}"
    );
    // And it serves its counters where the announcement said.
    let stats = request(&address.to_string(), "GET", "/stats", &[], b"");
    assert_eq!(stats.json()["sessions_created"], 1);
}
