//! The fleet directory over TLS (issue #24): real `redis-server`s serving TLS with a CA
//! made for the test, `rediss://` URLs naming the CA (and a client certificate) the way
//! redis-py's do. The servers also keep a plain port, which only the tests' own
//! commands use: a worker given the TLS port can only have spoken TLS to it.

use std::process::Command;

use mcpgw_testkit::fleet::{Directory, LocalFleet, workers_of};
use mcpgw_testkit::http::{call_tool, initialize};
use mcpgw_testkit::redis::RedisTls;
use mcpgw_testkit::tls::TestCa;
use mcpgw_testkit::{RedisServer, bin};
use serde_json::json;

/// A Redis whose directory URL is its TLS port, trusting the test CA.
struct TlsRedis(RedisServer);

impl Directory for TlsRedis {
    fn url(&self) -> String {
        self.0.tls_url(None)
    }
}

fn tls_of(ca: &TestCa, auth_clients: bool) -> RedisTls {
    let (cert, key) = ca.issue("redis");
    RedisTls {
        ca: ca.ca_file(),
        cert,
        key,
        auth_clients,
    }
}

/// `mcpgw status --redis <url> --json`: its exit status (2: the directory could not be
/// read; 1: it was read and shows problems, such as no live worker), stdout and stderr.
fn status(url: &str) -> (Option<i32>, String, String) {
    let out = Command::new(bin("mcpgw"))
        .args(["status", "--redis", url, "--json"])
        .output()
        .expect("run mcpgw status");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_fleet_on_a_tls_redis_registers_forwards_and_is_read_by_status() {
    let ca = TestCa::new("redis-tls");
    let redis = TlsRedis(RedisServer::start_tls(&tls_of(&ca, false)));
    let fleet = LocalFleet::on(redis, "tcp", (1, &[]), (1, &[]));
    // Both hosts registered in this Redis, through its TLS port.
    for host in [&fleet.a, &fleet.b] {
        assert_eq!(workers_of(&fleet.redis.0, host.pid()).len(), 1);
    }
    let session = initialize(&fleet.a.addr, "/mcp");
    let other = fleet.host_not_owning(&session);
    let first = call_tool(&other, "/mcp", &session, 1, "counter_increment", json!({}));
    assert_eq!(first.expect_tool_text(), "1", "forwarded to its owner");
    let (code, out, err) = status(&fleet.redis.url());
    assert_eq!(code, Some(0), "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
    assert_eq!(status["redis"]["topology"], "standalone", "{status}");
    assert_eq!(
        status["workers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
}

#[test]
fn a_redis_certificate_of_another_ca_is_refused_naming_the_failure() {
    let ca = TestCa::new("redis-tls-server");
    let redis = RedisServer::start_tls(&tls_of(&ca, false));
    let stranger = TestCa::new("redis-tls-stranger");
    let tls = redis.tls.as_ref().expect("TLS port");
    let url = format!(
        "rediss://:s3cret@127.0.0.1:{}/?ssl_ca_certs={}",
        tls.port,
        stranger.ca_file().display()
    );
    let (code, out, err) = status(&url);
    assert_eq!(code, Some(2), "a server of another CA was trusted: {out}");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
    // The same server is read with its own CA (an empty directory: no live worker).
    assert_read(&redis.tls_url(None));
}

#[test]
fn a_redis_that_requires_client_certificates_gets_the_configured_one() {
    let ca = TestCa::new("redis-tls-clients");
    let redis = RedisServer::start_tls(&tls_of(&ca, true));
    let (code, out, err) = status(&redis.tls_url(None));
    assert_eq!(code, Some(2), "no client certificate, yet let in: {out}");
    assert!(err.contains("CertificateRequired"), "{err}");
    let (cert, key) = ca.issue("gateway");
    assert_read(&redis.tls_url(Some((&cert, &key))));
}

/// `mcpgw status` read the (empty) directory at `url`.
#[track_caller]
fn assert_read(url: &str) {
    let (code, out, err) = status(url);
    assert_eq!(code, Some(1), "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
    assert_eq!(status["problems"][0]["kind"], "no_live_worker", "{status}");
}
