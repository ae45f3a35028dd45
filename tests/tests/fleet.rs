//! The fleet: two supervisors × two workers sharing one real Redis, requests scattered
//! over all workers, forwarded over mutually authenticated QUIC or TCP.

use std::collections::HashSet;
use std::time::Duration;

use mcpgw_testkit::fleet::{
    FLEET_CHANGE_WITHIN, LocalFleet, MeshCerts, SupervisorSpec, leases, start_supervisor,
};
use mcpgw_testkit::http::{self, call_tool, initialize, mcp_headers};
use mcpgw_testkit::signal::{self, Signal};
use mcpgw_testkit::{RedisServer, ScatterProxy, Upstream, eventually, run_python};
use serde_json::json;

fn tool_text(response: &http::Response) -> String {
    response.expect_tool_text()
}

fn progress_of(out: &serde_json::Value) -> Vec<f64> {
    out["progress_ms"]
        .as_array()
        .map(|v| v.iter().filter_map(|v| v.as_f64()).collect())
        .unwrap_or_default()
}

/// Returns the fleet, still running, for checks of its own.
fn forwarding_suite(transport: &str) -> LocalFleet {
    forwarding_suite_with(transport, &[])
}

/// [`forwarding_suite`] with more flags for every supervisor.
fn forwarding_suite_with(transport: &str, extra: &[&str]) -> LocalFleet {
    let fleet = LocalFleet::start(transport, 2, extra);
    let proxy = ScatterProxy::start(vec![fleet.a.addr.clone(), fleet.b.addr.clone()]);

    // The official SDK client, every request on a fresh connection to a random port.
    let out = run_python("sdk_client.py", &[&proxy.url(), "legacy", "fleet"]);
    let expected: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    assert_eq!(
        out["values"],
        json!(expected),
        "{transport}: one session's counter, in order"
    );
    let progress = progress_of(&out);
    assert_eq!(
        progress.len(),
        10,
        "{transport}: every progress event arrives"
    );
    let result_ms = out["result_ms"].as_f64().unwrap_or_default();
    eprintln!("{transport}: progress at {progress:?} ms, result at {result_ms} ms");
    assert!(
        result_ms - progress[0] >= 500.0,
        "{transport}: the stream is relayed incrementally"
    );
    let sent = proxy.sent_counts();
    assert!(
        sent.iter().all(|&n| n > 0),
        "both ports got requests: {sent:?}"
    );

    // A stream that provably crossed the mesh arrives event by event.
    let session = initialize(&fleet.a.addr, "/mcp");
    let body = json!({
        "jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "slow_stream", "arguments": {"count": 10, "interval_ms": 100},
                   "_meta": {"progressToken": "t"}},
    })
    .to_string();
    // host-b's workers never hold a session initialized on host-a: this crosses the mesh.
    let (response, arrivals) = http::request_timed(
        &fleet.b.addr,
        "POST",
        "/mcp",
        &mcp_headers(Some(&session)),
        body.as_bytes(),
    );
    assert_eq!(response.status, 200, "{}", response.text());
    let edge = response.header("mcpgw-edge-worker").unwrap_or_default();
    let owner = response.header("mcpgw-owner-worker").unwrap_or_default();
    assert!(
        !owner.is_empty() && owner != edge,
        "host-b's port never holds host-a's session"
    );
    assert_eq!(arrivals.len(), 11);
    assert!(
        arrivals[10] - arrivals[0] >= Duration::from_millis(500),
        "{transport}: forwarded events arrive as produced: {arrivals:?}"
    );
    fleet
}

#[test]
fn forwarding_over_quic() {
    forwarding_suite("quic");
}

#[test]
fn forwarding_over_tcp() {
    forwarding_suite("tcp");
}

/// The same suite with the same-host path on (in its default socket directory): all
/// four workers share this kernel, so every forward goes over a Unix socket, and no
/// worker dials its peers over TLS at all.
#[test]
fn forwarding_over_the_same_host_path() {
    let fleet = forwarding_suite_with("tcp", &["--mesh-same-host", "unix"]);
    let mut unix_calls = 0;
    for id in leases(&fleet.redis).keys() {
        let admin = mcpgw_testkit::admin::admin_of(&fleet.redis, id);
        let links = mcpgw_testkit::admin::mesh_links(&admin);
        assert!(
            !links.iter().any(|(_, link)| link == "tls"),
            "{id} holds mesh connections over TLS: {links:?}"
        );
        unix_calls += mcpgw_testkit::admin::links_on(&admin, "caller", "unix");
    }
    assert!(
        unix_calls > 0,
        "the forwards went over the same-host sockets"
    );
}

/// The official SDK client in 2026-07-28 mode through a fleet of four workers: no
/// sessions, every request answered by whichever worker the balancer picked.
#[test]
fn sdk_client_in_2026_mode_through_a_fleet() {
    let fleet = LocalFleet::start("quic", 2, &[]);
    let proxy = ScatterProxy::start(vec![fleet.a.addr.clone(), fleet.b.addr.clone()]);
    let out = run_python("sdk_client.py", &[&proxy.url(), "2026-07-28", "echoes"]);
    let expected: Vec<String> = (0..20).map(|i| format!("echo {i}")).collect();
    assert_eq!(out["echoed"], json!(expected), "every call answered: {out}");
    assert!(out["tools"].as_u64().is_some_and(|n| n >= 4), "{out}");
    let progress = progress_of(&out);
    assert_eq!(progress.len(), 10, "every progress event arrives: {out}");
    let result_ms = out["result_ms"].as_f64().unwrap_or_default();
    assert!(
        result_ms - progress[0] >= 500.0,
        "the stream is relayed incrementally: {out}"
    );
    let sent = proxy.sent_counts();
    assert!(
        sent.iter().all(|&n| n > 0),
        "both ports got requests: {sent:?}"
    );
    assert_eq!(
        fleet.upstream.counter("sessions_created"),
        0,
        "2026-07-28 requests open no upstream session"
    );
    assert!(
        fleet.redis.keys("mcpgw:pool_owner:*").is_empty(),
        "and no session in the directory"
    );
}

/// The Redis pub/sub baseline passes the same suite, and keeps invariant 2 (docs/architecture.md):
/// every worker's request channel has exactly one subscriber.
#[test]
fn forwarding_over_redis() {
    let fleet = forwarding_suite("redis");
    let workers = leases(&fleet.redis);
    assert_eq!(
        workers.len(),
        4,
        "two supervisors of two workers: {workers:?}"
    );
    for (id, lease) in &workers {
        let channel = format!("mcpgw:pool_rpc:{id}");
        assert_eq!(lease.addr, channel, "a Redis worker advertises its channel");
        assert_eq!(
            fleet.redis.numsub(&channel),
            1,
            "{channel} must have exactly one subscriber"
        );
    }
}

#[test]
fn every_worker_id_is_unique_and_its_own_process() {
    let fleet = LocalFleet::start("quic", 2, &[]);
    let leases = leases(&fleet.redis);
    assert_eq!(leases.len(), 4, "four workers registered: {leases:?}");
    let pids: HashSet<u32> = leases.values().map(|lease| lease.pid).collect();
    assert_eq!(pids.len(), 4, "four distinct processes");
    let addrs: HashSet<&String> = leases.values().map(|lease| &lease.addr).collect();
    assert_eq!(addrs.len(), 4, "four distinct mesh endpoints");
    // The leases are held by exactly the supervisors' worker processes: a process
    // sharing another's id would be a worker without a lease of its own.
    let mut workers = signal::children_of(fleet.a.pid());
    workers.extend(signal::children_of(fleet.b.pid()));
    assert_eq!(
        workers.iter().copied().collect::<HashSet<u32>>(),
        pids,
        "every worker process holds one lease, and only they do"
    );
    for pid in pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(
            cmdline.contains("mcpgw worker"),
            "pid {pid} is a worker: {cmdline:?}"
        );
    }
}

#[test]
fn a_worker_id_already_leased_refuses_to_start() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let certs = MeshCerts::create(&["host-a"]);
    let redis_url = redis.url();
    let spec = SupervisorSpec {
        redis_url: &redis_url,
        upstream_url: &upstream.url,
        workers: 1,
        transport: "quic",
        certs: &certs,
        member: "host-a",
        extra: &["--worker-id", "fixed-1"],
    };
    let first = start_supervisor(&spec);
    let first_worker = leases(&redis)
        .get("fixed-1")
        .map(|lease| lease.pid)
        .expect("the first worker holds fixed-1");
    assert_eq!(signal::parent_of(first_worker), Some(first.pid()));
    let mut args = vec![
        "serve".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--redis".into(),
        redis_url.clone(),
        "--upstream".into(),
        format!("demo={}", upstream.url),
        "--worker-id".into(),
        "fixed-1".into(),
    ];
    args.extend(certs.flags("host-a"));
    let mut command = std::process::Command::new(mcpgw_testkit::bin("mcpgw"));
    command
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut second = mcpgw_testkit::process::spawn(command).expect("start a second mcpgw");
    let status = eventually(FLEET_CHANGE_WITHIN, || {
        second
            .try_wait()
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "the second process with a leased id still runs".to_owned())
    });
    let mut stderr = String::new();
    if let Some(pipe) = second.stderr.as_mut() {
        std::io::Read::read_to_string(pipe, &mut stderr).expect("read stderr");
    }
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("fixed-1") && stderr.contains("already held"),
        "clear error: {stderr}"
    );
    assert_eq!(
        leases(&redis).get("fixed-1").map(|lease| lease.pid),
        Some(first_worker),
        "the first worker keeps its lease"
    );
}

#[test]
fn scattered_requests_execute_exactly_once() {
    let fleet = LocalFleet::start("quic", 2, &[]);
    let proxy = ScatterProxy::start(vec![fleet.a.addr.clone(), fleet.b.addr.clone()]);
    let sessions: Vec<String> = (0..4).map(|_| initialize(&proxy.addr, "/mcp")).collect();
    let before = fleet.upstream.counter("tool_calls");
    let n = 200;
    let mut forwarded = 0;
    for i in 0..n {
        let session = &sessions[i % sessions.len()];
        let response = call_tool(
            &proxy.addr,
            "/mcp",
            session,
            i as u64 + 10,
            "echo",
            json!({"text": "x"}),
        );
        assert_eq!(response.status, 200, "request {i}");
        assert_eq!(tool_text(&response), "x");
        if response.header("mcpgw-edge-worker") != response.header("mcpgw-owner-worker") {
            forwarded += 1;
        }
    }
    let after = fleet.upstream.counter("tool_calls");
    eprintln!("{forwarded} of {n} requests were forwarded");
    assert!(
        forwarded > n / 4,
        "most scattered requests cross the mesh: {forwarded}"
    );
    assert_eq!(
        after - before,
        n as u64,
        "no amplification: each request ran once"
    );
}

#[test]
fn the_supervisor_replaces_a_dead_worker_under_a_new_id() {
    let fleet = LocalFleet::start("quic", 2, &[]);
    let before = fleet.workers_of(&fleet.a);
    assert_eq!(before.len(), 2, "{before:?}");
    let (victim, victim_pid) = before
        .iter()
        .map(|(id, pid)| (id.clone(), *pid))
        .next()
        .expect("a worker");
    signal::send(victim_pid, Signal::SIGKILL);
    signal::wait_until_gone(victim_pid, FLEET_CHANGE_WITHIN);
    // Two live children of host-a's supervisor hold leases again: the survivor and a
    // replacement, which must not reuse the dead worker's id.
    let after = eventually(FLEET_CHANGE_WITHIN, || {
        let now = fleet.workers_of(&fleet.a);
        if now.len() == 2 { Ok(now) } else { Err(now) }
    });
    assert!(
        !after.contains_key(&victim),
        "the dead worker's id is not reused: {after:?}"
    );
    let fresh: Vec<&String> = after
        .keys()
        .filter(|id| !before.contains_key(*id))
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one replacement: {after:?}");
    assert!(
        !after.values().any(|pid| *pid == victim_pid),
        "the replacement is a new process: {after:?}"
    );
}

/// Steady state puts no Redis round trip on a forwarded request: the owner is named
/// by the session id and peer addresses are cached.
#[test]
fn forwarded_requests_cost_no_redis_commands_in_steady_state() {
    // A lease of 10 minutes (renewed every 200 s) keeps heartbeats, which are
    // time-based, out of the count however slowly the machine runs the loop.
    let fleet = LocalFleet::start("quic", 2, &["--lease-ms", "600000"]);
    let session = initialize(&fleet.a.addr, "/mcp");
    // Warm up: every host-b worker learns the owner's address once.
    for i in 0..20 {
        let response = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            i,
            "echo",
            json!({"text": "w"}),
        );
        assert_eq!(response.status, 200);
    }
    let before = fleet.redis.total_calls();
    let n = 1000;
    for i in 0..n {
        let response = call_tool(
            &fleet.b.addr,
            "/mcp",
            &session,
            i + 100,
            "echo",
            json!({"text": "x"}),
        );
        assert_eq!(response.status, 200);
        assert_ne!(
            response.header("mcpgw-edge-worker"),
            response.header("mcpgw-owner-worker"),
            "host-b's workers never own host-a's session"
        );
    }
    let after = fleet.redis.total_calls();
    let per_request = (after - before) as f64 / n as f64;
    eprintln!(
        "Redis commands per forwarded request: {per_request:.4} ({} in total)",
        after - before
    );
    assert!(
        per_request < 0.01,
        "{per_request} Redis commands per forwarded request"
    );
}

/// A peer without a certificate from the mesh CA cannot open a mesh stream: the
/// owner refuses it in the TLS handshake. Both callers trust the mesh CA, so the
/// refusal is the owner's, not the caller's distrust of the owner.
#[test]
fn mesh_refuses_peers_without_a_mesh_ca_certificate() {
    for transport in ["quic", "tcp"] {
        let fleet = LocalFleet::start(transport, 2, &[]);
        let (owner, lease) = leases(&fleet.redis).into_iter().next().expect("a worker");
        let addr = lease.addr;
        let foreign = MeshCerts::create(&["intruder"]);
        let mesh_ca = fleet.certs.dir().join("ca.crt");
        let refused = |why: &str| Err(format!("mesh TLS handshake with {addr} failed: {why}"));
        for (label, tls, expected) in [
            (
                "leaf of a foreign CA",
                foreign_leaf_config(&foreign, &mesh_ca),
                refused(
                    "mesh peer refused our certificate: it does not trust our CA (during CA \
                     rotation add the new CA to every bundle first)",
                ),
            ),
            (
                "no certificate",
                anonymous_client_config(&mesh_ca),
                refused("mesh peer requires a client certificate from the mesh CA"),
            ),
        ] {
            let outcome = try_forward(transport, tls, &addr, &owner);
            assert_eq!(outcome, expected, "{transport}/{label}");
        }
        // And a member of the mesh is served.
        let member = mcpgw_certs::client_config(&mcpgw_certs::MeshTlsFiles::in_dir(
            &fleet.certs.dir(),
            "host-b",
        ))
        .unwrap();
        let served = try_forward(transport, member, &addr, &owner);
        assert_eq!(served, Ok(200), "{transport}: member refused: {served:?}");
    }
}

/// The intruder's own leaf (from a CA the mesh does not trust), trusting the mesh CA
/// besides its own, so that it accepts the owner's certificate.
fn foreign_leaf_config(
    certs: &MeshCerts,
    mesh_ca: &std::path::Path,
) -> std::sync::Arc<rustls::ClientConfig> {
    mcpgw_certs::install_crypto_provider();
    let mut files = mcpgw_certs::MeshTlsFiles::in_dir(&certs.dir(), "intruder");
    let bundle = certs.dir().join("both-cas.crt");
    let both = [mesh_ca, files.ca.as_path()]
        .iter()
        .map(|path| std::fs::read_to_string(path).expect("a CA file"))
        .collect::<String>();
    std::fs::write(&bundle, both).expect("write the bundle");
    files.ca = bundle;
    mcpgw_certs::client_config(&files).unwrap()
}

fn anonymous_client_config(mesh_ca: &std::path::Path) -> std::sync::Arc<rustls::ClientConfig> {
    mcpgw_certs::install_crypto_provider();
    let roots = mcpgw_certs::load_ca_bundle(mesh_ca).unwrap();
    std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(mcpgw_certs::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Sends one modern `tools/list` over the mesh to `owner` at `addr`.
fn try_forward(
    transport: &str,
    tls: std::sync::Arc<rustls::ClientConfig>,
    addr: &str,
    owner: &str,
) -> Result<u16, String> {
    let targets = [(addr.to_owned(), owner.to_owned())];
    mcpgw_tests::forward_once(transport, tls, "probe", &targets)
        .pop()
        .unwrap_or_else(|| Err("no outcome".into()))
}

/// `--threads` sizes the runtime of every worker the supervisor starts (it reaches
/// them through the configuration the supervisor hands over); without it, a worker
/// runs one thread per CPU it may use.
#[test]
fn threads_sizes_the_runtime_of_every_worker_of_the_host_it_is_given_to() {
    let fleet = LocalFleet::start_hosts("tcp", (2, &["--threads", "1"]), (1, &[]));
    let host_a: HashSet<u32> = signal::children_of(fleet.a.pid()).into_iter().collect();
    let cpus = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let leases = fleet.leases();
    assert_eq!(leases.len(), 3, "three workers registered: {leases:?}");
    for (id, lease) in leases {
        let admin = mcpgw_testkit::admin::admin_of(&fleet.redis, &id);
        let threads = mcpgw_testkit::admin::scrape(&admin)
            .get("mcpgw_runtime_threads")
            .copied();
        let expected = if host_a.contains(&lease.pid) {
            1.0
        } else {
            cpus
        };
        assert_eq!(threads, Some(expected), "worker {id} (pid {})", lease.pid);
    }
}
