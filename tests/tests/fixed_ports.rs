//! Fixed mesh ports (issue #25 item 5), as Kubernetes pods and compose containers
//! with fixed addresses have them: a worker killed while a peer forwards to it is
//! replaced by its supervisor on the same address under a new id. The peer's pooled
//! connection leads to a dead process, and the address now answers as another worker:
//! that is proof of the old owner's death, never a reason to send its sessions to the
//! replacement, and the replacement's own sessions are served through the same peer.

use std::time::Duration;

use mcpgw_testkit::fleet::{LocalFleet, owner_of, recorded_owner};
use mcpgw_testkit::http::{call_tool, initialize};
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{eventually, free_port, free_udp_port};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(60);

/// Host-a's one worker listens on a fixed mesh address; host-b forwards to it. Returns
/// the fleet, the session opened before the kill, the dead worker's id and the
/// replacement's.
fn kill_and_replace_on_the_same_address(
    transport: &str,
    extra: &[&str],
) -> (LocalFleet, String, String, String) {
    let port = match transport {
        "quic" => free_udp_port(),
        _ => free_port(),
    };
    let mesh = format!("127.0.0.1:{port}");
    let mut flags_a: Vec<&str> = vec!["--mesh-listen", &mesh];
    flags_a.extend(extra);
    let fleet = LocalFleet::start_hosts(transport, (1, &flags_a), (1, extra));
    let session = initialize(&fleet.a.addr, "/mcp");
    let dead = owner_of(&session);
    // Forwarded through host-b, which keeps its connection to the owner's address.
    for (id, expected) in [(1, "1"), (2, "2")] {
        let r = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            id,
            "counter_increment",
            json!({}),
        );
        assert_eq!(r.expect_tool_text(), expected, "forwarded before the kill");
    }
    let dead_pid = fleet.pid_of(&dead);
    signal::send(dead_pid, Signal::SIGKILL);
    signal::wait_until_gone(dead_pid, WITHIN);
    let replacement = fleet.replacement_at(&dead, &mesh);
    (fleet, session, dead, replacement)
}

/// The replacement's own new session, opened on host-a, is served through host-b.
fn assert_replacement_serves_through_the_peer(fleet: &LocalFleet, replacement: &str) {
    let fresh = initialize(&fleet.a.addr, "/mcp");
    assert_eq!(owner_of(&fresh), replacement);
    for (id, expected) in [(10, "1"), (11, "2")] {
        let r = call_tool(
            &fleet.b.addr,
            "/mcp",
            &fresh,
            id,
            "counter_increment",
            json!({}),
        );
        assert_eq!(
            r.expect_tool_text(),
            expected,
            "the replacement's session, forwarded to the same address"
        );
    }
}

/// `counter_increment` on `session` through host-b, the peer that forwarded before.
fn increment_via_peer(fleet: &LocalFleet, session: &str, id: u64) -> mcpgw_testkit::http::Response {
    call_tool(
        &fleet.b.addr,
        "/mcp",
        session,
        id,
        "counter_increment",
        json!({}),
    )
}

fn dead_workers_sessions_are_gone(transport: &str) {
    // Adoption off: what the issue asks of a dead worker's sessions without it.
    let (fleet, session, dead, replacement) =
        kill_and_replace_on_the_same_address(transport, &["--adopt", "never"]);
    let r = increment_via_peer(&fleet, &session, 3);
    assert_eq!(r.outcome(), "404 session_gone", "{}", r.text());
    assert!(
        !fleet.leases().contains_key(&dead),
        "the proven-dead worker was reclaimed"
    );
    assert_eq!(recorded_owner(&fleet.redis, &session), None);
    assert_replacement_serves_through_the_peer(&fleet, &replacement);
}

#[test]
fn a_worker_replaced_on_its_fixed_quic_address_its_old_sessions_are_gone() {
    dead_workers_sessions_are_gone("quic");
}

#[test]
fn a_worker_replaced_on_its_fixed_tcp_address_its_old_sessions_are_gone() {
    dead_workers_sessions_are_gone("tcp");
}

/// With adoption on (the default), the dead worker's HTTP session goes on elsewhere,
/// with its counter, and is never handed to the process now at its address by mistake
/// for the old one.
#[test]
fn a_worker_replaced_on_its_fixed_address_has_its_http_sessions_adopted() {
    let (fleet, session, _dead, replacement) = kill_and_replace_on_the_same_address("tcp", &[]);
    let r = eventually(WITHIN, || {
        let r = increment_via_peer(&fleet, &session, 3);
        match r.status {
            200 => Ok(r),
            503 if r.header("retry-after").is_some() => Err(r.outcome()),
            _ => panic!("the dead worker's session goes on: {}", r.text()),
        }
    });
    assert_eq!(r.expect_tool_text(), "3", "its counter went on");
    assert_eq!(r.header("mcpgw-adopted"), Some("death"));
    assert_replacement_serves_through_the_peer(&fleet, &replacement);
}
