//! Operating the fleet with real processes: `mcpgw status` reads a live 2 × 2 fleet
//! from its Redis and flags what an operator must see (a duplicated identity, an
//! orphaned session record, a certificate close to expiry, a second listener on a
//! Redis-transport channel); `mcpgw drain` and `POST /drain` drain exactly one worker,
//! which its supervisor replaces under a new id while the others keep serving.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};

use mcpgw_testkit::fleet::{
    FLEET_CHANGE_WITHIN, LocalFleet, MeshCerts, PREFIX, SupervisorSpec, leases, owner_of,
    start_supervisor,
};
use mcpgw_testkit::http::{self, call_tool, initialize};
use mcpgw_testkit::signal;
use mcpgw_testkit::{Child, Gateway, RedisServer, Upstream, eventually};
use serde_json::{Value, json};

/// The version every worker of this build publishes.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Runs `mcpgw ARGS` to its end.
#[track_caller]
fn mcpgw(args: &[&str]) -> Output {
    Command::new(mcpgw_testkit::bin("mcpgw"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run mcpgw {args:?}: {e}"))
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `mcpgw status` against `redis` with `extra` flags: (exit code, stdout).
#[track_caller]
fn status(redis: &RedisServer, extra: &[&str]) -> (Option<i32>, String) {
    let url = redis.url();
    let mut args = vec!["status", "--redis", url.as_str()];
    args.extend_from_slice(extra);
    let output = mcpgw(&args);
    eprintln!(
        "mcpgw {args:?} (exit {:?}):\n{}{}",
        output.status.code(),
        stdout(&output),
        stderr(&output)
    );
    (output.status.code(), stdout(&output))
}

/// `mcpgw status --json`: (exit code, the parsed document).
#[track_caller]
fn status_json(redis: &RedisServer, extra: &[&str]) -> (Option<i32>, Value) {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let (code, out) = status(redis, &args);
    let parsed = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {out}"));
    (code, parsed)
}

/// The problems of a `--json` document, by kind.
fn problem_kinds(doc: &Value) -> Vec<String> {
    doc["problems"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter_map(|p| p["kind"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The rows of the status table: worker id → (column → cell), cut at the header's
/// column positions (cells such as "1.2s ago" hold spaces).
fn table_rows(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    // The topology line (`redis: standalone`, or the Sentinel primary) comes first.
    let mut lines = text.lines().skip_while(|line| !line.starts_with("WORKER"));
    let header = lines.next().unwrap_or_default();
    let names = [
        "WORKER",
        "STATE",
        "HOST",
        "PID",
        "MESH",
        "ADMIN",
        "RENEWED",
        "SESSIONS",
        "VERSION",
        "CERT EXPIRES",
    ];
    let starts: Vec<usize> = names
        .iter()
        .map(|name| {
            header
                .find(name)
                .unwrap_or_else(|| panic!("no {name} column in {header:?}"))
        })
        .collect();
    let mut rows = BTreeMap::new();
    for line in lines.take_while(|line| !line.is_empty()) {
        let cell = |i: usize| {
            let end = starts
                .get(i + 1)
                .copied()
                .unwrap_or(line.len())
                .min(line.len());
            line.get(starts[i]..end)
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        let row: BTreeMap<String, String> = (0..names.len())
            .map(|i| (names[i].to_owned(), cell(i)))
            .collect();
        let id = row["WORKER"].clone();
        assert!(
            rows.insert(id.clone(), row).is_none(),
            "worker {id} listed twice:\n{text}"
        );
    }
    rows
}

/// Opens sessions through both supervisors until every worker owns at least one;
/// returns them by owner.
fn sessions_on_every_worker(fleet: &LocalFleet) -> BTreeMap<String, Vec<String>> {
    let workers: BTreeSet<String> = fleet.leases().into_keys().collect();
    let mut by_owner: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in 0..200 {
        let via = if n % 2 == 0 { &fleet.a } else { &fleet.b };
        let session = initialize(&via.addr, "/mcp");
        by_owner
            .entry(owner_of(&session))
            .or_default()
            .push(session);
        if workers.iter().all(|w| by_owner.contains_key(w)) && n >= 6 {
            return by_owner;
        }
    }
    panic!("200 sessions did not reach every worker: {by_owner:?}");
}

#[test]
fn status_shows_a_two_by_two_fleet_and_flags_a_duplicate_identity_and_orphaned_records() {
    let fleet = LocalFleet::start("quic", 2, &[]);
    let sessions = sessions_on_every_worker(&fleet);
    let leased = fleet.leases();
    assert_eq!(leased.len(), 4);

    let (code, doc) = status_json(&fleet.redis, &[]);
    assert_eq!(code, Some(0), "a healthy fleet: {doc:#}");
    assert_eq!(doc["problems"], json!([]));
    let workers = doc["workers"].as_array().cloned().unwrap_or_default();
    let ids: Vec<&str> = workers.iter().filter_map(|w| w["id"].as_str()).collect();
    let listed: BTreeSet<&str> = ids.iter().copied().collect();
    assert_eq!(ids.len(), 4, "every worker once: {ids:?}");
    assert_eq!(
        listed,
        leased.keys().map(String::as_str).collect(),
        "exactly the leased workers"
    );
    let supervisor_of = |pid: u64| signal::parent_of(pid as u32);
    for worker in &workers {
        let id = worker["id"].as_str().unwrap_or_default();
        let lease = &leased[id];
        assert_eq!(worker["state"], "live");
        assert_eq!(worker["pid"], json!(lease.pid));
        assert_eq!(worker["mesh_address"], json!(lease.addr));
        assert_eq!(worker["version"], VERSION);
        assert_eq!(
            worker["sessions"],
            json!(sessions[id].len()),
            "{id}'s sessions"
        );
        assert!(worker["admin_address"].is_string(), "{worker}");
        assert!(worker["last_renewal_ms_ago"].is_u64(), "{worker}");
        // The leaves from `mcpgw certs issue` live 90 days.
        let now = doc["redis_time_unix_ms"].as_u64().unwrap_or_default();
        let not_after = worker["cert_not_after_unix_ms"]
            .as_u64()
            .unwrap_or_default();
        let days_left = (not_after.saturating_sub(now)) / (24 * 3600 * 1000);
        assert!((88..=90).contains(&days_left), "{worker}");
        assert!(
            [Some(fleet.a.pid()), Some(fleet.b.pid())]
                .contains(&supervisor_of(worker["pid"].as_u64().unwrap_or_default())),
            "a child of one of the two supervisors: {worker}"
        );
    }
    let total: usize = sessions.values().map(Vec::len).sum();
    assert_eq!(
        doc["session_records"]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).sum::<u64>()),
        Some(total as u64)
    );

    // The table holds the same data.
    let (code, text) = status(&fleet.redis, &[]);
    assert_eq!(code, Some(0));
    assert_eq!(
        text.lines().next(),
        Some("redis: standalone"),
        "the topology it reached comes first"
    );
    let rows = table_rows(&text);
    assert_eq!(
        rows.keys().collect::<BTreeSet<_>>(),
        leased.keys().collect()
    );
    for (id, row) in &rows {
        assert_eq!(row["STATE"], "live");
        assert_eq!(row["PID"], leased[id].pid.to_string());
        assert_eq!(row["MESH"], leased[id].addr);
        assert_eq!(row["SESSIONS"], sessions[id].len().to_string(), "{text}");
        assert_eq!(row["VERSION"], VERSION);
        assert!(row["RENEWED"].ends_with("s ago"), "{text}");
    }
    assert!(
        text.contains(&format!("4 live workers, {total} sessions owned")),
        "{text}"
    );
    assert!(text.contains("no problems found"), "{text}");

    // A made-up worker claims a live worker's mesh address.
    let (victim, victim_lease) = leased.iter().next().expect("a worker");
    let fake_lease = json!({
        "pid": 4_000_000, "host": "made-up-host", "started_unix_ms": 1,
        "version": VERSION, "token": "0123456789abcdef",
    })
    .to_string();
    fleet.redis.command(&[
        "SET",
        &format!("{PREFIX}worker:made-up-twin"),
        &fake_lease,
        "PX",
        "600000",
    ]);
    fleet.redis.command(&[
        "SET",
        &format!("{PREFIX}worker_addr:made-up-twin"),
        &victim_lease.addr,
        "PX",
        "600000",
    ]);
    let (code, text) = status(&fleet.redis, &[]);
    assert_eq!(code, Some(1), "a duplicate identity is a problem");
    let line = text
        .lines()
        .find(|l| l.contains("duplicate identity"))
        .unwrap_or_else(|| panic!("no duplicate identity line:\n{text}"));
    assert!(
        line.contains(victim.as_str())
            && line.contains("made-up-twin")
            && line.contains(&victim_lease.addr),
        "{line}"
    );
    let (code, doc) = status_json(&fleet.redis, &[]);
    assert_eq!(code, Some(1));
    assert_eq!(problem_kinds(&doc), ["duplicate_mesh_address"]);
    let mut twins = vec![victim.clone(), "made-up-twin".to_owned()];
    twins.sort();
    assert_eq!(doc["problems"][0]["workers"], json!(twins));
    assert_eq!(doc["problems"][0]["addr"], json!(victim_lease.addr));
    fleet.redis.command(&[
        "DEL",
        &format!("{PREFIX}worker:made-up-twin"),
        &format!("{PREFIX}worker_addr:made-up-twin"),
    ]);
    assert_eq!(status(&fleet.redis, &[]).0, Some(0), "healthy again");

    // A session record naming a worker that never existed.
    let orphan = format!("{:032x}.made-up-owner", 7);
    fleet.redis.command(&[
        "SET",
        &format!("{PREFIX}pool_owner:{orphan}"),
        "made-up-owner",
    ]);
    let (code, text) = status(&fleet.redis, &[]);
    assert_eq!(code, Some(1), "an orphaned record is a problem");
    assert!(
        text.lines()
            .any(|l| l.contains("orphaned session records") && l.contains("made-up-owner")),
        "{text}"
    );
    assert!(
        !text.contains(&orphan),
        "status never prints a whole session id:\n{text}"
    );
    let (code, doc) = status_json(&fleet.redis, &[]);
    assert_eq!(code, Some(1));
    assert_eq!(problem_kinds(&doc), ["orphaned_session_records"]);
    assert_eq!(doc["problems"][0]["worker"], "made-up-owner");
    assert_eq!(doc["problems"][0]["records"], 1);
}

#[test]
fn status_flags_a_certificate_close_to_expiry() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let certs = MeshCerts::create(&["host-a"]);
    let dir = certs.dir().display().to_string();
    let issued = mcpgw(&[
        "certs", "issue", "--dir", &dir, "--name", "host-b", "--days", "2",
    ]);
    assert!(issued.status.success(), "{}", stderr(&issued));
    let redis_url = redis.url();
    let spec = |member| SupervisorSpec {
        redis_url: &redis_url,
        upstream_url: &upstream.url,
        workers: 1,
        transport: "quic",
        certs: &certs,
        member,
        extra: &[],
    };
    let a = start_supervisor(&spec("host-a"));
    let b = start_supervisor(&spec("host-b"));
    let short_lived: Vec<String> = leases(&redis)
        .into_iter()
        .filter(|(_, lease)| signal::parent_of(lease.pid) == Some(b.pid()))
        .map(|(id, _)| id)
        .collect();
    assert_eq!(short_lived.len(), 1, "host-b runs one worker");

    let (code, text) = status(&redis, &["--warn-days", "7"]);
    assert_eq!(code, Some(1), "a leaf expiring in 2 days is a problem");
    let flagged: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("certificate close to expiry"))
        .collect();
    assert_eq!(flagged.len(), 1, "only host-b's worker:\n{text}");
    assert!(
        flagged[0].contains(&short_lived[0]) && flagged[0].contains("expires in 2.0 days"),
        "{}",
        flagged[0]
    );
    let (code, doc) = status_json(&redis, &["--warn-days", "7"]);
    assert_eq!(code, Some(1));
    assert_eq!(problem_kinds(&doc), ["certificate_expiring"]);
    assert_eq!(doc["problems"][0]["worker"], json!(short_lived[0]));
    // Within a one-day warning the same fleet is fine.
    assert_eq!(status(&redis, &["--warn-days", "1"]).0, Some(0));
    drop((a, b));
}

#[test]
fn status_flags_a_second_listener_on_a_redis_transport_channel() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let certs = MeshCerts::create(&["host-a"]);
    let redis_url = redis.url();
    let _gateway = start_supervisor(&SupervisorSpec {
        redis_url: &redis_url,
        upstream_url: &upstream.url,
        workers: 2,
        transport: "redis",
        certs: &certs,
        member: "host-a",
        extra: &[],
    });
    let (code, doc) = status_json(&redis, &[]);
    assert_eq!(code, Some(0), "{doc:#}");
    let workers = doc["workers"].as_array().cloned().unwrap_or_default();
    assert_eq!(workers.len(), 2);
    for worker in &workers {
        assert_eq!(worker["request_channel_subscribers"], 1, "{worker}");
        assert_eq!(worker["cert_not_after_unix_ms"], Value::Null, "no leaf");
    }
    let id = workers[0]["id"].as_str().unwrap_or_default().to_owned();
    let channel = format!("{PREFIX}pool_rpc:{id}");
    let port = redis.port.to_string();
    let mut listener = Child::spawn(
        "redis-cli",
        std::path::Path::new("redis-cli"),
        &["-p", port.as_str(), "SUBSCRIBE", channel.as_str()],
    );
    listener.wait_for_line(&channel, FLEET_CHANGE_WITHIN);
    let (code, doc) = status_json(&redis, &[]);
    assert_eq!(code, Some(1), "{doc:#}");
    assert_eq!(problem_kinds(&doc), ["request_channel_subscribers"]);
    assert_eq!(doc["problems"][0]["worker"], json!(id));
    assert_eq!(doc["problems"][0]["subscribers"], 2);
}

#[test]
fn status_and_drain_without_a_reachable_redis_exit_2_without_the_password() {
    let refusing = mcpgw_testkit::refusing_port();
    let port = refusing.port;
    let url = format!("redis://:hunter2-secret@127.0.0.1:{port}/0");
    for args in [
        vec!["status", "--redis", url.as_str()],
        vec!["drain", "--redis", url.as_str(), "--worker", "w1"],
    ] {
        let output = mcpgw(&args);
        let (out, err) = (stdout(&output), stderr(&output));
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("Redis") && err.contains(&port.to_string()),
            "{err}"
        );
        assert!(
            !out.contains("hunter2") && !err.contains("hunter2"),
            "the password leaked: {out}{err}"
        );
    }
}

#[test]
fn draining_a_worker_that_holds_no_lease_is_refused_clearly() {
    let redis = RedisServer::start();
    let url = redis.url();
    let output = mcpgw(&["drain", "--redis", &url, "--worker", "no-such-worker"]);
    assert_eq!(output.status.code(), Some(1));
    let err = stderr(&output);
    assert!(
        err.contains("no-such-worker") && err.contains("holds no lease"),
        "{err}"
    );
    assert!(redis.keys("*").is_empty(), "nothing was written");
    let output = mcpgw(&["drain", "--redis", &url, "--host", "no-such-host"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("no-such-host"),
        "{}",
        stderr(&output)
    );
}

/// The worker `id`'s admin address, from its lease.
fn admin_of(redis: &RedisServer, id: &str) -> String {
    let lease: Value = serde_json::from_str(
        &redis
            .get(&format!("{PREFIX}worker:{id}"))
            .unwrap_or_else(|| panic!("{id} has no lease")),
    )
    .unwrap_or_else(|e| panic!("{id}'s lease: {e}"));
    lease["admin"]
        .as_str()
        .unwrap_or_else(|| panic!("{id}'s lease names no admin address: {lease}"))
        .to_owned()
}

/// Waits until `victim` has drained: its process exited, and since a clean drain
/// deletes the lease before the process exits, no key of it remains at that moment
/// (a crash would leave its lease for a whole lease time). Then its supervisor has
/// started a replacement under a new id.
fn await_drained(fleet: &LocalFleet, supervisor: &Gateway, victim: &str, victim_pid: u32) {
    signal::wait_until_gone(victim_pid, FLEET_CHANGE_WITHIN);
    for key in [
        "worker",
        "worker_addr",
        "worker_sessions",
        "drain",
        "worker_cert",
    ] {
        assert_eq!(
            fleet.redis.get(&format!("{PREFIX}{key}:{victim}")),
            None,
            "{key} of the drained worker is gone"
        );
    }
    let records_naming_it = fleet
        .redis
        .keys(&format!("{PREFIX}pool_owner:*"))
        .into_iter()
        .filter(|key| fleet.redis.get(key).as_deref() == Some(victim))
        .count();
    assert_eq!(records_naming_it, 0, "its sessions ended in the directory");
    let replaced = eventually(FLEET_CHANGE_WITHIN, || {
        let now = fleet.workers_of(supervisor);
        if now.len() == 2 { Ok(now) } else { Err(now) }
    });
    assert!(
        !replaced.contains_key(victim),
        "the replacement has a new id: {replaced:?}"
    );
}

/// Waits until the directory is older than one lease: before that, a missing lease or
/// record proves nothing (Redis may have come back empty), and requests for a
/// vanished worker's sessions are answered 503, not 404.
fn await_settled_directory(redis: &RedisServer, lease_ms: u64) {
    eventually(FLEET_CHANGE_WITHIN, || {
        let time = redis.command(&["TIME"]);
        let now_ms = time
            .lines()
            .next()
            .and_then(|secs| secs.parse::<u64>().ok())
            .map(|secs| secs * 1000)
            .ok_or_else(|| format!("TIME: {time:?}"))?;
        let generation = redis
            .get(&format!("{PREFIX}generation"))
            .unwrap_or_default();
        let created: u64 = generation
            .rsplit_once('@')
            .and_then(|(_, ms)| ms.parse().ok())
            .ok_or_else(|| format!("generation: {generation:?}"))?;
        // Whole seconds from TIME: one more second of margin.
        let age = now_ms.saturating_sub(created);
        if age > lease_ms + 1000 {
            Ok(())
        } else {
            Err(format!("directory {age} ms old"))
        }
    });
}

/// Every session of `sessions` answers through both supervisors.
fn all_serve(fleet: &LocalFleet, sessions: &[String]) {
    for (n, session) in sessions.iter().enumerate() {
        for via in [&fleet.a, &fleet.b] {
            let response = call_tool(
                &via.addr,
                "/mcp",
                session,
                n as u64 + 100,
                "echo",
                json!({"text": "still here"}),
            );
            assert_eq!(response.status, 200, "{session}: {}", response.text());
            assert_eq!(response.expect_tool_text(), "still here");
        }
    }
}

/// Every session of `sessions`, held by `drained` until it drained, was handed over:
/// its next request adopts it (saying so, once), and it answers through both
/// supervisors from another worker.
fn all_taken_over(fleet: &LocalFleet, sessions: &[String], drained: &str) {
    for session in sessions {
        for (n, via) in [&fleet.a, &fleet.b].into_iter().enumerate() {
            let response = call_tool(&via.addr, "/mcp", session, 7, "echo", json!({"text": "x"}));
            assert_eq!(
                response.status,
                200,
                "{session} via {}: {}",
                via.addr,
                response.text()
            );
            let adopted = response.header("mcpgw-adopted");
            assert_eq!(
                adopted,
                (n == 0).then_some("drain"),
                "{session}: the first answer after the drain adopted it, and only that one"
            );
            assert_ne!(response.header("mcpgw-owner-worker"), Some(drained));
        }
    }
}

#[test]
fn drain_by_id_and_by_admin_request_drain_exactly_one_worker_each() {
    // Short leases: a drain request is read at the next renewal (a third of the lease).
    let fleet = LocalFleet::start("quic", 2, &["--lease-ms", "3000"]);
    let mut sessions = sessions_on_every_worker(&fleet);
    let pids: BTreeMap<String, u32> = fleet
        .leases()
        .into_iter()
        .map(|(id, lease)| (id, lease.pid))
        .collect();
    let supervisor_of = |id: &str| {
        if fleet.workers_of(&fleet.a).contains_key(id) {
            &fleet.a
        } else {
            &fleet.b
        }
    };

    await_settled_directory(&fleet.redis, 3000);

    // Through the directory.
    let first = pids.keys().next().cloned().expect("a worker");
    let first_supervisor = supervisor_of(&first);
    let url = fleet.redis.url();
    let output = mcpgw(&["drain", "--redis", &url, "--worker", &first]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stdout(&output).contains(&format!("drain requested for worker {first}")),
        "{}",
        stdout(&output)
    );
    await_drained(&fleet, first_supervisor, &first, pids[&first]);
    let first_sessions = sessions.remove(&first).unwrap_or_default();
    all_taken_over(&fleet, &first_sessions, &first);
    let others: Vec<String> = sessions.values().flatten().cloned().collect();
    all_serve(&fleet, &others);
    for (id, pid) in &pids {
        if *id != first {
            assert!(signal::exists(*pid), "{id} was not drained");
        }
    }
    // It is gone now: asking again says so.
    let again = mcpgw(&["drain", "--redis", &url, "--worker", &first]);
    assert_eq!(again.status.code(), Some(1), "{}", stderr(&again));

    // Through the admin listener of another worker.
    let second = sessions.keys().next().cloned().expect("another worker");
    let second_supervisor = supervisor_of(&second);
    let admin = admin_of(&fleet.redis, &second);
    let refused = http::request(&admin, "GET", "/drain", &[], b"");
    assert_eq!(
        refused.status,
        405,
        "a drain needs POST: {}",
        refused.text()
    );
    let response = http::request(&admin, "POST", "/drain", &[], b"");
    assert_eq!(response.status, 202, "{}", response.text());
    assert_eq!(response.json()["worker_id"], json!(second));
    await_drained(&fleet, second_supervisor, &second, pids[&second]);
    let second_sessions = sessions.remove(&second).unwrap_or_default();
    all_taken_over(&fleet, &second_sessions, &second);
    let others: Vec<String> = sessions.values().flatten().cloned().collect();
    all_serve(&fleet, &others);
    for (id, pid) in &pids {
        if *id != first && *id != second {
            assert!(signal::exists(*pid), "{id} was not drained");
        }
    }
    // The fleet is whole again: four live workers, no problem.
    let (code, doc) = status_json(&fleet.redis, &["--lease-ms", "3000"]);
    assert_eq!(code, Some(0), "{doc:#}");
    assert_eq!(doc["workers"].as_array().map(Vec::len), Some(4));
}

#[test]
fn drain_by_host_drains_every_worker_of_that_host() {
    let fleet = LocalFleet::start("quic", 1, &["--lease-ms", "3000"]);
    let before = fleet.leases();
    assert_eq!(before.len(), 2);
    let id = before.keys().next().cloned().expect("a worker");
    let lease: Value = serde_json::from_str(
        &fleet
            .redis
            .get(&format!("{PREFIX}worker:{id}"))
            .expect("a lease"),
    )
    .expect("lease JSON");
    // Both supervisors run on this machine: one host name for every worker.
    let host = lease["host"].as_str().expect("a host").to_owned();
    let url = fleet.redis.url();
    let output = mcpgw(&["drain", "--redis", &url, "--host", &host]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    for id in before.keys() {
        assert!(
            stdout(&output).contains(&format!("drain requested for worker {id}")),
            "{}",
            stdout(&output)
        );
    }
    for (id, lease) in &before {
        let supervisor = if signal::parent_of(lease.pid) == Some(fleet.a.pid()) {
            &fleet.a
        } else {
            &fleet.b
        };
        signal::wait_until_gone(lease.pid, FLEET_CHANGE_WITHIN);
        let replaced = eventually(FLEET_CHANGE_WITHIN, || {
            let now = fleet.workers_of(supervisor);
            if now.len() == 1 { Ok(now) } else { Err(now) }
        });
        assert!(!replaced.contains_key(id), "{replaced:?}");
    }
}
