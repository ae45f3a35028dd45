//! The `mcpgw-bench upstream` command as scripts and tests use it: start it
//! on port 0, read the announced URL, talk to it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Kills the server even when an assertion fails first.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn upstream_announces_its_real_address_and_serves_it() {
    let child = Command::new(env!("CARGO_BIN_EXE_mcpgw-bench"))
        .args(["upstream", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start mcpgw-bench");
    let mut server = Server(child);
    let stdout = server.0.stdout.take().expect("stdout is piped");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the announcement");

    let url = line
        .strip_prefix("mcpgw-bench upstream listening on http://")
        .and_then(|rest| rest.strip_suffix("/mcp\n"))
        .unwrap_or_else(|| panic!("unexpected announcement: {line:?}"));
    let address: std::net::SocketAddr = url.parse().expect("announced address parses");
    assert_ne!(
        address.port(),
        0,
        "the announcement names the bound port, not the requested one"
    );

    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    let mut stream = TcpStream::connect(address).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "POST /mcp HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the answer");

    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    let lower = response.to_ascii_lowercase();
    let session_id = lower
        .lines()
        .find_map(|line| line.strip_prefix("mcp-session-id: "))
        .expect("initialize mints a session")
        .trim();
    assert_eq!(session_id.len(), 32);
    assert!(session_id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(
        response.contains(r#""serverInfo":{"name":"mcpgw-bench-upstream""#),
        "{response}"
    );
}
