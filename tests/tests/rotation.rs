//! Mesh certificate rotation on a live fleet: `mcpgw certs rotate begin`, `reissue` and
//! `finish` while two supervisors of two workers each serve a continuous forwarded
//! load, on QUIC and on TCP. No request may fail and no session may be lost; afterwards
//! old-CA material is refused by every worker and `certs inspect` shows only leaves of
//! the new CA. And a bad file during a reload leaves the worker serving.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use mcpgw_testkit::fleet::{FLEET_CHANGE_WITHIN, LocalFleet, PREFIX, run_mcpgw};
use mcpgw_testkit::http::{self, initialize, try_call_tool};
use mcpgw_testkit::{RedisServer, eventually};
use serde_json::{Value, json};

/// Short enough that the test sees connections replaced, long enough that a request
/// never races it on a slow machine.
const MAX_AGE_MS: u64 = 2000;

/// Every worker's admin `/state`, by worker id.
fn states(redis: &RedisServer) -> HashMap<String, Value> {
    admins(redis)
        .into_iter()
        .filter_map(|(id, admin)| {
            let state = http::try_request(&admin, "GET", "/state", &[], b"").ok()?;
            Some((id, state.json()))
        })
        .collect()
}

/// Every worker's id and admin listener address, from its lease.
fn admins(redis: &RedisServer) -> Vec<(String, String)> {
    redis
        .keys(&format!("{PREFIX}worker:*"))
        .into_iter()
        .filter_map(|key| {
            let id = key.strip_prefix(&format!("{PREFIX}worker:"))?.to_owned();
            let lease: Value = serde_json::from_str(&redis.get(&key)?).ok()?;
            Some((id, lease["admin"].as_str()?.to_owned()))
        })
        .collect()
}

/// Waits until all four workers' mesh material satisfies `done`.
fn until_every_worker(redis: &RedisServer, what: &str, done: impl Fn(&Value) -> bool) {
    eventually(FLEET_CHANGE_WITHIN, || {
        let states = states(redis);
        let behind: Vec<&String> = states
            .iter()
            .filter(|(_, state)| !done(&state["mesh_cert"]))
            .map(|(id, _)| id)
            .collect();
        if states.len() == 4 && behind.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{what}: {} workers answer, not yet: {behind:?}",
                states.len()
            ))
        }
    });
}

/// Requests that failed, with what was answered.
type Failures = Arc<parking_lot::Mutex<Vec<String>>>;

/// Calls `echo` on each session through the supervisor that did not create it (so
/// most calls cross the mesh), in a loop, until stopped; `answered` counts the calls
/// answered correctly, by all threads.
fn start_load(
    sessions: Vec<(String, String)>,
    stop: Arc<AtomicBool>,
    failures: Failures,
    answered: Arc<AtomicU64>,
) -> Vec<thread::JoinHandle<u64>> {
    sessions
        .into_iter()
        .map(|(addr, session)| {
            let (stop, failures, answered) = (stop.clone(), failures.clone(), answered.clone());
            thread::spawn(move || {
                let mut calls = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    calls += 1;
                    let text = format!("call {calls}");
                    match try_call_tool(&addr, &session, calls, "echo", json!({"text": text})) {
                        Ok(r) if r.status == 200 && r.tool_text().as_deref() == Some(&text) => {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(r) => {
                            failures
                                .lock()
                                .push(format!("{session}: {} {}", r.status, r.text()))
                        }
                        Err(e) => failures.lock().push(format!("{session}: {e}")),
                    }
                }
                calls
            })
        })
        .collect()
}

/// One mesh request to every worker of the fleet with `tls`, saying in its `Hello`
/// that it is worker `as_worker`: the HTTP status each answered, or why it refused.
fn dial_every_worker(
    redis: &RedisServer,
    transport: &str,
    tls: Arc<rustls::ClientConfig>,
    as_worker: &str,
) -> Vec<Result<u16, String>> {
    let targets: Vec<(String, String)> = mcpgw_testkit::fleet::leases(redis)
        .into_iter()
        .map(|(id, lease)| (lease.addr, id))
        .collect();
    mcpgw_tests::forward_once(transport, tls, as_worker, &targets)
}

/// A worker whose lease registers the mesh identity of `member`.
fn worker_registered_as(redis: &RedisServer, member: &str) -> String {
    let suffix = format!("/{member}");
    mcpgw_testkit::fleet::leases(redis)
        .into_keys()
        .find(|id| {
            redis
                .get(&format!("{PREFIX}worker:{id}"))
                .and_then(|lease| serde_json::from_str::<Value>(&lease).ok())
                .and_then(|lease| lease["mesh_identity"].as_str().map(str::to_owned))
                .is_some_and(|identity| identity.ends_with(&suffix))
        })
        .unwrap_or_else(|| panic!("no worker registered as {member}"))
}

/// Waits until no worker has a mesh connection open (as caller or as owner) whose
/// peer presented one of `leaves`.
fn until_no_connection_rests_on(redis: &RedisServer, leaves: &HashSet<String>, what: &str) {
    eventually(FLEET_CHANGE_WITHIN, || {
        let states = states(redis);
        let mut listed = 0;
        let mut on_old = Vec::new();
        for (id, state) in &states {
            let Some(connections) = state["mesh_connections"].as_array() else {
                return Err(format!("{what}: {id} lists no mesh connections: {state}"));
            };
            listed += connections.len();
            on_old.extend(
                connections
                    .iter()
                    .filter(|c| {
                        c["peer_leaf_fingerprint"]
                            .as_str()
                            .is_some_and(|leaf| leaves.contains(leaf))
                    })
                    .map(|c| format!("{id}: {c}")),
            );
        }
        if states.len() == 4 && on_old.is_empty() {
            eprintln!("{what}: none of {listed} open connections rests on an old leaf");
            Ok(())
        } else {
            Err(format!(
                "{what}: {} workers answer; still open: {on_old:?}",
                states.len()
            ))
        }
    });
}

/// Successful dials each host's workers made (`mcpgw_mesh_handshakes_total`, caller
/// side), host a first.
fn dials_by_host(fleet: &LocalFleet) -> (f64, f64) {
    let admin = admins(&fleet.redis);
    let dials = |supervisor| -> f64 {
        let workers = fleet.workers_of(supervisor);
        admin
            .iter()
            .filter(|(id, _)| workers.contains_key(id))
            .map(|(_, admin)| {
                let metrics = http::request(admin, "GET", "/metrics", &[], b"").text();
                metric_sum(&metrics, |line| {
                    line.starts_with("mcpgw_mesh_handshakes_total{")
                        && line.contains("side=\"caller\"")
                        && line.contains("outcome=\"ok\"")
                })
            })
            .sum()
    };
    (dials(&fleet.a), dials(&fleet.b))
}

/// The sum of the samples on the lines `pick` keeps.
fn metric_sum(metrics: &str, pick: impl Fn(&str) -> bool) -> f64 {
    metrics
        .lines()
        .filter(|l| pick(l))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

fn copy_material(from: &Path, to: &Path, member: &str) {
    for name in [
        "ca.crt".to_owned(),
        format!("{member}.crt"),
        format!("{member}.key"),
    ] {
        std::fs::copy(from.join(&name), to.join(&name))
            .unwrap_or_else(|e| panic!("copy {name}: {e}"));
    }
}

fn full_rotation_under_load(transport: &str) {
    let age = MAX_AGE_MS.to_string();
    let fleet = LocalFleet::start(
        transport,
        2,
        &[
            "--mesh-max-connection-age-ms",
            &age,
            "--mesh-cert-reload-interval-ms",
            "500",
        ],
    );
    let dir = fleet.certs.dir();
    let dir_arg = dir.display().to_string();
    let stale = tempfile::tempdir().expect("dir");
    copy_material(&dir, stale.path(), "host-a");
    until_every_worker(&fleet.redis, "material loaded", |cert| {
        cert["ca_fingerprints"].as_array().map(Vec::len) == Some(1)
    });
    let first_leaves: HashMap<String, Value> = states(&fleet.redis)
        .into_iter()
        .map(|(id, state)| (id, state["mesh_cert"]["leaf_fingerprint"].clone()))
        .collect();

    // Sessions made on one host, called through the other: the mesh carries them.
    let mut sessions = Vec::new();
    for _ in 0..4 {
        sessions.push((fleet.b.addr.clone(), initialize(&fleet.a.addr, "/mcp")));
        sessions.push((fleet.a.addr.clone(), initialize(&fleet.b.addr, "/mcp")));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Failures::default();
    let answered = Arc::new(AtomicU64::new(0));
    let load = start_load(
        sessions.clone(),
        stop.clone(),
        failures.clone(),
        answered.clone(),
    );
    eventually(FLEET_CHANGE_WITHIN, || {
        let n = answered.load(Ordering::Relaxed);
        if n >= 16 {
            Ok(())
        } else {
            Err(format!("{n} calls answered before the rotation"))
        }
    });

    run_mcpgw(&["certs", "rotate", "begin", "--dir", &dir_arg]);
    until_every_worker(&fleet.redis, "both CAs trusted", |cert| {
        cert["ca_fingerprints"].as_array().map(Vec::len) == Some(2)
    });
    run_mcpgw(&["certs", "rotate", "reissue", "--dir", &dir_arg]);
    eventually(FLEET_CHANGE_WITHIN, || {
        let states = states(&fleet.redis);
        let old: Vec<&String> = states
            .iter()
            .filter(|(id, state)| {
                first_leaves.get(*id) == Some(&state["mesh_cert"]["leaf_fingerprint"])
            })
            .map(|(id, _)| id)
            .collect();
        if states.len() == 4 && old.is_empty() {
            Ok(())
        } else {
            Err(format!("workers still on their first leaf: {old:?}"))
        }
    });
    // What the wait of one maximum age between `reissue` and `finish` is for: while
    // the load goes on, callers move to connections made with the new leaves, and
    // those made with old ones close, at both ends.
    let old_leaves: HashSet<String> = first_leaves
        .values()
        .filter_map(|leaf| leaf.as_str().map(str::to_owned))
        .collect();
    // The workers of one host share its leaf.
    assert_eq!(old_leaves.len(), 2, "{first_leaves:?}");
    until_no_connection_rests_on(&fleet.redis, &old_leaves, transport);
    run_mcpgw(&["certs", "rotate", "finish", "--dir", &dir_arg]);
    until_every_worker(&fleet.redis, "only the new CA trusted", |cert| {
        cert["ca_fingerprints"].as_array().map(Vec::len) == Some(1)
    });
    // The load goes on while both hosts' workers dial new connections, checked against
    // the new CA alone.
    let (a_dials, b_dials) = dials_by_host(&fleet);
    eventually(FLEET_CHANGE_WITHIN, || {
        let (a, b) = dials_by_host(&fleet);
        if a > a_dials && b > b_dials {
            Ok(())
        } else {
            Err(format!(
                "dials since finish: host a {}, host b {}",
                a - a_dials,
                b - b_dials
            ))
        }
    });
    stop.store(true, Ordering::Relaxed);
    let calls: u64 = load
        .into_iter()
        .map(|t| t.join().expect("load thread"))
        .sum();
    let failed = failures.lock().clone();
    eprintln!(
        "{transport}: {calls} calls during the rotation, {} failed",
        failed.len()
    );
    assert!(calls > 50, "{transport}: the load ran ({calls} calls)");
    assert!(
        failed.is_empty(),
        "{transport}: requests failed: {failed:?}"
    );
    // No session lost: each still answers, through the other host.
    for (addr, session) in &sessions {
        let r =
            try_call_tool(addr, session, 1, "echo", json!({"text": "after"})).expect("answered");
        assert_eq!(r.status, 200, "{transport}: {session}: {}", r.text());
    }

    // A peer holding only old-CA material can no longer connect to any worker.
    let old =
        mcpgw_certs::MeshTls::load(&mcpgw_certs::MeshTlsFiles::in_dir(stale.path(), "host-a"))
            .expect("old material still loads by itself");
    let outcomes = dial_every_worker(&fleet.redis, transport, old.client_config(), "probe");
    assert_eq!(outcomes.len(), 4);
    for outcome in &outcomes {
        let refusal = outcome
            .as_ref()
            .expect_err("old-CA material must be refused");
        eprintln!("{transport}: old material refused: {refusal}");
    }
    // The refusals show in the workers' metrics.
    let owner_refusals: f64 = admins(&fleet.redis)
        .iter()
        .map(|(_, admin)| {
            let metrics = http::request(admin, "GET", "/metrics", &[], b"").text();
            metric_sum(&metrics, |line| {
                line.starts_with("mcpgw_mesh_handshakes_total{")
                    && line.contains("side=\"owner\"")
                    && !line.contains("outcome=\"ok\"")
            })
        })
        .sum();
    let (a, b) = dials_by_host(&fleet);
    eprintln!(
        "{transport}: {} successful dials, {owner_refusals} refused handshakes",
        a + b
    );
    assert!(
        owner_refusals >= 1.0,
        "{transport}: no refused handshake counted"
    );

    // Current material is served (any HTTP answer: the mesh let the request in).
    let current = mcpgw_certs::MeshTls::load(&mcpgw_certs::MeshTlsFiles::in_dir(&dir, "host-b"))
        .expect("current material");
    let served = dial_every_worker(&fleet.redis, transport, current.client_config(), "probe");
    assert_eq!(served.len(), 4, "{transport}: every worker dialled");
    for outcome in served {
        assert!(
            outcome.is_ok(),
            "{transport}: current material: {outcome:?}"
        );
    }
    // Identity is authorization at the owner too: host-b's valid leaf cannot speak as
    // a worker registered under host-a, at any worker.
    let host_a_worker = worker_registered_as(&fleet.redis, "host-a");
    let impostor = dial_every_worker(
        &fleet.redis,
        transport,
        current.client_config(),
        &host_a_worker,
    );
    assert_eq!(impostor.len(), 4, "{transport}: every worker dialled");
    for outcome in impostor {
        let refusal = outcome.expect_err("a Hello from the wrong identity is refused");
        assert!(
            refusal.contains("refused the greeting"),
            "{transport}: {refusal}"
        );
    }
    let host_b_worker = worker_registered_as(&fleet.redis, "host-b");
    let own = dial_every_worker(
        &fleet.redis,
        transport,
        current.client_config(),
        &host_b_worker,
    );
    assert_eq!(own.len(), 4, "{transport}: every worker dialled");
    for outcome in own {
        assert!(
            outcome.is_ok(),
            "{transport}: its own worker id: {outcome:?}"
        );
    }

    // `certs inspect`: only new-CA leaves, signed by the one CA in the bundle.
    let report: Value = serde_json::from_str(&run_mcpgw(&[
        "certs", "inspect", "--dir", &dir_arg, "--json",
    ]))
    .expect("inspect JSON");
    let cas = report["cas"].as_array().expect("cas");
    assert_eq!(cas.len(), 1, "{report}");
    let ca = cas[0]["fingerprint_sha256"].clone();
    assert!(ca.is_string(), "{report}");
    let leaves = report["leaves"].as_array().expect("leaves");
    assert!(leaves.len() >= 2, "{report}");
    for leaf in leaves {
        assert_eq!(leaf["signed_by"], ca, "{transport}: {leaf}");
    }
}

#[test]
fn a_full_rotation_under_forwarded_load_over_quic_fails_no_request() {
    full_rotation_under_load("quic");
}

#[test]
fn a_full_rotation_under_forwarded_load_over_tcp_fails_no_request() {
    full_rotation_under_load("tcp");
}

/// A leaf file that does not parse is refused with the old material kept: the
/// worker keeps forwarding, its metrics say so, and the fixed file is then taken.
#[test]
fn a_bad_certificate_file_keeps_the_worker_serving_until_it_is_fixed() {
    let fleet = LocalFleet::start("tcp", 1, &["--mesh-cert-reload-interval-ms", "300"]);
    let dir = fleet.certs.dir();
    let session = initialize(&fleet.a.addr, "/mcp");
    let leaf = dir.join("host-a.crt");
    let good = std::fs::read(&leaf).expect("leaf");
    let admin_of_a = fleet
        .redis
        .keys(&format!("{PREFIX}worker:*"))
        .into_iter()
        .filter_map(|key| {
            let lease: Value = serde_json::from_str(&fleet.redis.get(&key)?).ok()?;
            (lease["mesh_identity"].as_str()?.ends_with("/host-a"))
                .then(|| lease["admin"].as_str().map(str::to_owned))?
        })
        .next()
        .expect("host-a's worker");
    mcpgw_certs::write_file_atomically(&leaf, b"-----BEGIN CERTIFICATE-----\nbroken\n", false)
        .expect("write");
    eventually(FLEET_CHANGE_WITHIN, || {
        let metrics = http::try_request(&admin_of_a, "GET", "/metrics", &[], b"")?.text();
        if metrics.contains("mcpgw_mesh_cert_refused_pending 1") {
            Ok(())
        } else {
            Err("the bad file is not refused yet".to_owned())
        }
    });
    // Still serving, across the mesh, with the old material.
    let r = try_call_tool(&fleet.b.addr, &session, 1, "echo", json!({"text": "still"}))
        .expect("answered");
    assert_eq!(r.status, 200, "{}", r.text());
    let ready = http::try_request(&admin_of_a, "GET", "/readyz", &[], b"").expect("readyz");
    assert_eq!(ready.status, 200, "{}", ready.text());

    // A new leaf is picked up.
    run_mcpgw(&[
        "certs",
        "issue",
        "--dir",
        &dir.display().to_string(),
        "--name",
        "host-a",
    ]);
    let fresh = std::fs::read(&leaf).expect("leaf");
    assert_ne!(fresh, good);
    eventually(FLEET_CHANGE_WITHIN, || {
        let metrics = http::try_request(&admin_of_a, "GET", "/metrics", &[], b"")?.text();
        if metrics.contains("mcpgw_mesh_cert_refused_pending 0")
            && metrics.contains("mcpgw_mesh_cert_reloads_total{result=\"reloaded\"} 1")
        {
            Ok(())
        } else {
            Err(format!(
                "not reloaded yet: {}",
                metrics
                    .lines()
                    .filter(|l| l.contains("mesh_cert"))
                    .collect::<Vec<_>>()
                    .join(" | ")
            ))
        }
    });
    let r = try_call_tool(&fleet.b.addr, &session, 2, "echo", json!({"text": "fixed"}))
        .expect("answered");
    assert_eq!(r.status, 200, "{}", r.text());
}
