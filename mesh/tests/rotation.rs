//! Mesh TLS that changes while connections live: material reloaded from files reaches
//! new handshakes on both transports, connections are replaced at their maximum age
//! without failing a request and close once their exchanges end, an owner cuts off a
//! peer that never retires its connection at 1.5 maximum ages, with maximum age 0 only
//! a certificate's expiry ends a connection, a peer's expired leaf closes its
//! connection and is refused afterwards, and a `Welcome` (caller side) or a `Hello`
//! (owner side) is believed only from the identity registered for the worker it
//! speaks for.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use mcpgw_certs::{
    MeshTls, MeshTlsFiles, MeshTlsSource, Pem, ReloadOptions, ReloadOutcome, TrustDomain,
    generate_ca, issue_leaf, write_file_atomically, write_pem_files,
};
use mcpgw_mesh::transport::{
    ForwardedResponse, MeshClient, MeshError, MeshLimits, MeshServerHandle, MeshService,
    OpenConnectionInfo, PeerInfo, ResponsePart, ServerTls, TransportKind, mesh_tls_settings,
    open_connections,
};
use mcpgw_testkit::pki::{Pki, YEAR};
use mcpgw_wire::RequestFrame;

const KINDS: [TransportKind; 2] = [TransportKind::Quic, TransportKind::Tcp];

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `test` for both transports, each bounded by [`TEST_TIMEOUT`].
fn on_both<F, Fut>(test: F)
where
    F: Fn(TransportKind) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for kind in KINDS {
        runtime().block_on(async {
            tokio::time::timeout(TEST_TIMEOUT, test(kind))
                .await
                .unwrap_or_else(|_| panic!("{kind}: timed out"))
        });
    }
}

fn source(dir: &Path, member: &str) -> MeshTlsSource {
    MeshTlsSource::watch(
        &MeshTlsFiles::in_dir(dir, member),
        &mesh_tls_settings(TrustDomain::default()),
        ReloadOptions {
            poll_interval: Duration::from_secs(3600),
            settle: Duration::from_millis(20),
        },
    )
    .expect("load mesh material")
}

fn write_bundle(dir: &Path, cas: &[&Pem]) {
    let bundle: String = cas.iter().map(|ca| ca.cert.as_str()).collect();
    write_file_atomically(&dir.join("ca.crt"), bundle.as_bytes(), false).expect("bundle");
}

fn write_leaf(dir: &Path, ca: &Pem, member: &str, validity: Duration) {
    let leaf = issue_leaf(ca, member, validity).expect("leaf");
    write_pem_files(dir, member, &leaf).expect("write leaf");
}

/// A mesh server on a free loopback port, serving the test service as `worker`.
async fn serve(
    kind: TransportKind,
    tls: impl Into<ServerTls>,
    worker: &str,
    record: Arc<Record>,
    limits: MeshLimits,
) -> MeshServerHandle {
    serve_on_loopback(kind, tls, worker, Arc::new(TestService { record }), limits).await
}

async fn reload(source: &MeshTlsSource) {
    match source.reload_now().await {
        ReloadOutcome::Reloaded | ReloadOutcome::Unchanged => {}
        ReloadOutcome::Refused(reason) => panic!("reload refused: {reason}"),
    }
}

/// Echoes through `client`: the id the owner gave the connection that carried it.
/// Ids only grow, so a larger one is a connection made later.
async fn echo(client: &MeshClient, addr: &str, worker: &str) -> Result<u64, MeshError> {
    let response = client
        .forward(addr, worker, request("/echo", "ping"))
        .await?;
    let peer = connection_of(&response);
    let (body, _) = body_of(response).await?;
    assert_eq!(body, b"ping");
    Ok(peer)
}

fn connection_of(response: &ForwardedResponse) -> u64 {
    header(response.head(), "x-peer-connection")
        .and_then(|id| id.parse().ok())
        .expect("the test service names the connection")
}

/// Echoes until one is carried by a connection made after connection `after`, and
/// returns that connection's id; every echo must succeed.
async fn until_a_connection_after(client: &MeshClient, addr: &str, after: u64, what: &str) -> u64 {
    eventually_async(TEST_TIMEOUT / 2, || async {
        let id = echo(client, addr, OWNER)
            .await
            .unwrap_or_else(|e| panic!("{what}: a request failed: {e}"));
        if id > after {
            Ok(id)
        } else {
            Err(format!("{what}: still on connection {id}"))
        }
    })
    .await
}

/// The connections of this process open now whose peer presented one of `leaves`
/// (fingerprints are unique to a test, so other tests running meanwhile do not count).
fn open_with(leaves: &[&str]) -> Vec<OpenConnectionInfo> {
    open_connections()
        .into_iter()
        .filter(|c| leaves.contains(&c.peer_leaf_fingerprint.as_str()))
        .collect()
}

/// Waits (bounded) until no connection of this process rests on one of `leaves`.
async fn until_none_open(leaves: &[&str], what: &str) {
    eventually_async(TEST_TIMEOUT / 2, || async {
        let open = open_with(leaves);
        if open.is_empty() {
            Ok(())
        } else {
            Err(format!("{what}: still open: {open:?}"))
        }
    })
    .await;
}

/// Waits (bounded) until a held response ends, which only a closed connection does:
/// how it ended, and when (by both clocks).
async fn until_it_ends(held: ForwardedResponse, what: String) -> (MeshError, Ended) {
    let ended = tokio::time::timeout(TEST_TIMEOUT / 2, body_of(held))
        .await
        .unwrap_or_else(|_| panic!("{what}: the held response never ended"));
    let at = Ended {
        wall: std::time::SystemTime::now(),
        monotonic: tokio::time::Instant::now(),
    };
    let cut = ended.expect_err("a held response ends only with its connection");
    (cut, at)
}

/// When a held response ended.
struct Ended {
    wall: std::time::SystemTime,
    monotonic: tokio::time::Instant,
}

/// The staged rollover of a CA, with owner and caller following their files, and a
/// caller that kept only old-CA material refused once the old CA is gone.
#[test]
fn a_staged_ca_rollover_reaches_new_connections_and_shuts_out_old_material() {
    init_tracing();
    on_both(|kind| async move {
        let old_ca = generate_ca("old CA", YEAR).expect("CA");
        let new_ca = generate_ca("new CA", YEAR).expect("CA");
        let owner_dir = tempfile::tempdir().expect("dir");
        let caller_dir = tempfile::tempdir().expect("dir");
        let stale_dir = tempfile::tempdir().expect("dir");
        for (dir, member) in [
            (&owner_dir, "owner"),
            (&caller_dir, "caller"),
            (&stale_dir, "stale"),
        ] {
            write_bundle(dir.path(), &[&old_ca]);
            write_leaf(dir.path(), &old_ca, member, YEAR);
        }
        let owner_tls = source(owner_dir.path(), "owner");
        let caller_tls = source(caller_dir.path(), "caller");
        let old_leaves = [
            owner_tls.current().leaf_fingerprint().to_owned(),
            caller_tls.current().leaf_fingerprint().to_owned(),
        ];
        let old_leaves: Vec<&str> = old_leaves.iter().map(String::as_str).collect();
        let record = Arc::new(Record::default());
        let max_age = Duration::from_millis(200);
        let limits = MeshLimits {
            max_connection_age: max_age,
            ..limits()
        };
        let server = serve(
            kind,
            owner_tls.clone(),
            OWNER,
            record.clone(),
            limits.clone(),
        )
        .await;
        let addr = server.local_addr().to_string();
        let client = MeshClient::new(kind, caller_tls.clone(), CALLER, limits.clone(), None)
            .expect("client");
        let stale_tls = MeshTls::load(&MeshTlsFiles::in_dir(stale_dir.path(), "stale"))
            .expect("stale material");
        // A peer that never retires its connection (maximum age 0: an old version, a
        // stolen key) and holds a response open on it, so that only the owner's hard
        // close at 1.5 maximum ages can end it.
        let stale = MeshClient::new(
            kind,
            stale_tls.client_config(),
            "stale-1",
            MeshLimits {
                max_connection_age: Duration::ZERO,
                ..limits.clone()
            },
            None,
        )
        .expect("client");
        echo(&client, &addr, OWNER).await.expect("before");
        let stale_dialled = tokio::time::Instant::now();
        let stale_connection = echo(&stale, &addr, OWNER).await.expect("stale before");
        let held = stale
            .forward(&addr, OWNER, request("/hang", ""))
            .await
            .expect("a held response on the stale connection");
        assert_eq!(connection_of(&held), stale_connection, "{kind}");
        let stale_cut = tokio::spawn(until_it_ends(held, format!("{kind}: the stale connection")));

        // begin: both CAs trusted everywhere.
        for (dir, tls) in [(&owner_dir, &owner_tls), (&caller_dir, &caller_tls)] {
            write_bundle(dir.path(), &[&old_ca, &new_ca]);
            reload(tls).await;
        }
        let last = echo(&client, &addr, OWNER).await.expect("after begin");
        // reissue: leaves from the new CA.
        for (dir, tls, member) in [
            (&owner_dir, &owner_tls, "owner"),
            (&caller_dir, &caller_tls, "caller"),
        ] {
            write_leaf(dir.path(), &new_ca, member, YEAR);
            reload(tls).await;
        }
        // Past its maximum age the caller moves to a new connection, made with the new
        // leaves, and the connections made with old leaves close (the stale peer's is
        // cut by the owner): at neither end is one left.
        until_a_connection_after(&client, &addr, last, "after reissue").await;
        eventually_async(TEST_TIMEOUT / 2, || async {
            echo(&client, &addr, OWNER)
                .await
                .expect("while old leaves retire");
            let old = open_with(&old_leaves);
            if old.is_empty() { Ok(()) } else { Err(old) }
        })
        .await;
        let last = echo(&client, &addr, OWNER).await.expect("before finish");
        // finish: only the new CA. A connection made now is checked against it alone.
        for (dir, tls) in [(&owner_dir, &owner_tls), (&caller_dir, &caller_tls)] {
            write_bundle(dir.path(), &[&new_ca]);
            reload(tls).await;
        }
        assert_eq!(owner_tls.current().ca_fingerprints().len(), 1);
        until_a_connection_after(&client, &addr, last, "after finish").await;

        // The stale caller's connection outlives nothing: the owner closed it at 1.5
        // maximum ages (not before), and a new handshake with old-CA material is
        // refused.
        let (cut, ended) = stale_cut.await.expect("waiting for the stale connection");
        let lived = ended.monotonic - stale_dialled;
        eprintln!("{kind}: the stale connection was closed by its owner after {lived:?}: {cut}");
        assert!(
            lived >= max_age * 3 / 2,
            "{kind}: closed after {lived:?}, before 1.5 maximum ages"
        );
        until_none_open(&[stale_tls.leaf_fingerprint()], "the stale connection").await;
        let refused = echo(&stale, &addr, OWNER)
            .await
            .expect_err("old-CA material after finish");
        assert!(
            matches!(refused, MeshError::Tls { .. } | MeshError::Connect { .. }),
            "{kind}: expected a TLS refusal, got {refused:?}"
        );
        assert!(!refused.proves_peer_gone(), "{kind}: {refused:?}");
        eprintln!("{kind}: old-CA material refused: {refused}");
    });
}

/// Connections are replaced at their maximum age while requests keep flowing: none
/// fails, and more than one connection carried them.
#[test]
fn connections_are_replaced_at_their_maximum_age_without_failing_a_request() {
    init_tracing();
    on_both(|kind| async move {
        let limits = MeshLimits {
            max_connection_age: Duration::from_millis(150),
            tcp_pool_size: 1,
            ..limits()
        };
        let mesh = Mesh::start_with(kind, limits.clone(), limits).await;
        let addr = mesh.addr();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let client = mesh.client.clone();
            let addr = addr.clone();
            tasks.push(tokio::spawn(async move {
                let mut peers = std::collections::BTreeSet::new();
                let until = tokio::time::Instant::now() + Duration::from_millis(1500);
                while tokio::time::Instant::now() < until {
                    peers.insert(echo(&client, &addr, OWNER).await?);
                }
                Ok::<_, MeshError>(peers)
            }));
        }
        let mut connections = std::collections::BTreeSet::new();
        for task in tasks {
            connections.extend(task.await.expect("task").expect("no request may fail"));
        }
        assert!(
            connections.len() >= 3,
            "{kind}: requests over 1.5 s with a 150 ms maximum age used only {connections:?}"
        );
    });
}

/// A connection past its maximum age takes no new request, finishes the exchange it
/// carries, and then closes at both ends (the owner here never closes one by age, so
/// the caller does).
#[test]
fn a_retired_connection_finishes_its_exchange_and_then_closes() {
    init_tracing();
    on_both(|kind| async move {
        let pki = Pki::new("retirement CA");
        let (owner, caller) = (pki.member("owner"), pki.member("caller"));
        let record = Arc::new(Record::default());
        let never = MeshLimits {
            max_connection_age: Duration::ZERO,
            ..limits()
        };
        let server = serve(kind, owner.server_config(), OWNER, record.clone(), never).await;
        let addr = server.local_addr().to_string();
        let short = MeshLimits {
            max_connection_age: Duration::from_millis(200),
            tcp_pool_size: 1,
            ..limits()
        };
        let client =
            MeshClient::new(kind, caller.client_config(), CALLER, short, None).expect("client");
        let first = echo(&client, &addr, OWNER).await.expect("first");
        let gated = client
            .forward(&addr, OWNER, request("/gated", "2"))
            .await
            .expect("head");
        assert_eq!(connection_of(&gated), first, "{kind}");
        until_a_connection_after(&client, &addr, first, "past the maximum age").await;
        record.gate.add_permits(1);
        let (body, _) = body_of(gated)
            .await
            .expect("the exchange in flight finishes on the retired connection");
        assert_eq!(body, b"event 1\nevent 2\n", "{kind}");
        // Connections this caller made to this owner, as each end lists them: only the
        // one in use now stays open.
        eventually_async(TEST_TIMEOUT / 2, || async {
            let at_caller = open_with(&[owner.leaf_fingerprint()]).len();
            let at_owner = open_with(&[caller.leaf_fingerprint()]).len();
            if (at_caller, at_owner) == (1, 1) {
                Ok(())
            } else {
                Err(format!(
                    "{kind}: open at the caller: {at_caller}, at the owner: {at_owner}"
                ))
            }
        })
        .await;
    });
}

/// Maximum age 0 on both ends: a connection is never retired, and is closed when a
/// peer's certificate expires (by the end that was shown it), not before.
#[test]
fn with_maximum_age_zero_only_the_peers_certificate_expiry_ends_a_connection() {
    init_tracing();
    on_both(|kind| async move {
        let never = MeshLimits {
            max_connection_age: Duration::ZERO,
            ..limits()
        };
        for brief_member in ["caller", "owner"] {
            let case = format!("{kind}, the {brief_member}'s leaf expires");
            let pki = Pki::new("age zero CA");
            // x509 validity has whole seconds: a leaf valid for about 3 s.
            write_leaf(
                pki.dir.path(),
                &pki.ca,
                brief_member,
                Duration::from_secs(3),
            );
            let brief = MeshTls::load(&MeshTlsFiles::in_dir(pki.dir.path(), brief_member))
                .expect("brief leaf loads while valid");
            let (owner, caller) = if brief_member == "owner" {
                (brief.clone(), pki.member("caller"))
            } else {
                (pki.member("owner"), brief.clone())
            };
            let record = Arc::new(Record::default());
            let server = serve(
                kind,
                owner.server_config(),
                OWNER,
                record.clone(),
                never.clone(),
            )
            .await;
            let addr = server.local_addr().to_string();
            let client = MeshClient::new(kind, caller.client_config(), CALLER, never.clone(), None)
                .expect("client");
            let connection = echo(&client, &addr, OWNER).await.expect("while valid");
            let held = client
                .forward(&addr, OWNER, request("/hang", ""))
                .await
                .expect("head");
            assert_eq!(connection_of(&held), connection, "{case}");
            let again = echo(&client, &addr, OWNER).await.expect("while valid");
            assert_eq!(
                again, connection,
                "{case}: the caller moved to a new connection"
            );
            let (cut, ended) = until_it_ends(held, case.clone()).await;
            let at = ended.wall;
            let not_after = brief.leaf_not_after();
            eprintln!(
                "{case}: the connection closed {:?} after the leaf's end: {cut}",
                at.duration_since(not_after).unwrap_or_default()
            );
            // The transports count down on the monotonic clock, the leaf's end is wall
            // clock time: a little leeway for the two to drift apart.
            assert!(
                at + Duration::from_millis(100) >= not_after,
                "{case}: closed {:?} before the leaf expired",
                not_after.duration_since(at).unwrap_or_default()
            );
            until_none_open(
                &[owner.leaf_fingerprint(), caller.leaf_fingerprint()],
                &case,
            )
            .await;
        }
    });
}

/// A peer leaf that expires closes the connection it authenticated, and a new
/// handshake with it is refused (no session resumption could carry it further).
#[test]
fn an_expired_leaf_closes_its_connection_and_is_refused() {
    init_tracing();
    on_both(|kind| async move {
        let pki = Pki::new("expiry CA");
        let owner = pki.member("owner");
        let record = Arc::new(Record::default());
        let server = serve(kind, owner.server_config(), OWNER, record.clone(), limits()).await;
        let addr = server.local_addr().to_string();
        // x509 validity has whole seconds: a leaf valid for about 3 s.
        write_leaf(pki.dir.path(), &pki.ca, "brief", Duration::from_secs(3));
        let brief = MeshTls::load(&MeshTlsFiles::in_dir(pki.dir.path(), "brief"))
            .expect("brief leaf loads while valid");
        let client = MeshClient::new(kind, brief.client_config(), "brief-1", limits(), None)
            .expect("client");
        let first = echo(&client, &addr, OWNER).await.expect("while valid");
        let wait = brief
            .leaf_not_after()
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        tokio::time::sleep(wait + Duration::from_millis(1500)).await;
        let refused = echo(&client, &addr, OWNER)
            .await
            .expect_err("an expired leaf");
        assert!(
            matches!(refused, MeshError::Tls { .. } | MeshError::Connect { .. }),
            "{kind}: expected a TLS refusal, got {refused:?} (first request came from {first})"
        );
        assert!(!refused.proves_peer_gone());
    });
}

/// A mesh member's valid leaf does not make it the worker that registered another
/// identity: it cannot stand in for it, nor prove it gone by answering as another.
#[test]
fn a_welcome_counts_only_from_the_identity_registered_for_the_worker() {
    init_tracing();
    on_both(|kind| async move {
        let mesh = Mesh::start(kind).await;
        let rogue = mesh.pki.member("host-c");
        let owner_uri = TrustDomain::default().member_uri("owner").expect("uri");
        let rogue_uri = TrustDomain::default().member_uri("host-c").expect("uri");
        for claims in [OWNER, "successor-9"] {
            let record = Arc::new(Record::default());
            let rogue_server = serve(
                kind,
                rogue.server_config(),
                claims,
                record.clone(),
                limits(),
            )
            .await;
            let client = MeshClient::new(
                kind,
                mesh.pki.member("caller").client_config(),
                CALLER,
                limits(),
                None,
            )
            .expect("client");
            let rogue_addr = rogue_server.local_addr().to_string();
            client.expect_identity(OWNER, Some(&owner_uri));
            let err = client
                .forward(&rogue_addr, OWNER, request("/echo", "x"))
                .await
                .expect_err("an identity other than the registered one");
            match &err {
                MeshError::IdentityMismatch {
                    registered,
                    presented,
                    ..
                } => {
                    assert_eq!(registered, &owner_uri);
                    assert_eq!(presented, &rogue_uri);
                }
                other => panic!("{kind}/{claims}: expected IdentityMismatch, got {other:?}"),
            }
            assert!(!err.proves_peer_gone(), "{kind}/{claims}: {err:?}");
            assert_eq!(record.started.load(std::sync::atomic::Ordering::SeqCst), 0);
            // The registered member may say its worker left (a successor answers).
            client.expect_identity(OWNER, Some(&rogue_uri));
            let answer = client
                .forward(&rogue_addr, OWNER, request("/echo", "x"))
                .await;
            if claims == OWNER {
                answer.expect("the registered identity is served");
            } else {
                let err = answer.expect_err("another worker answers");
                assert!(
                    matches!(err, MeshError::WrongWorker { .. }) && err.proves_peer_gone(),
                    "{kind}: {err:?}"
                );
            }
        }
    });
}

/// The test service, with the identities a directory would hold for callers.
struct RegisteredCallers {
    inner: TestService,
    identities: std::collections::HashMap<String, String>,
}

impl MeshService for RegisteredCallers {
    fn serve(&self, request: RequestFrame, peer: PeerInfo) -> BoxStream<'static, ResponsePart> {
        self.inner.serve(request, peer)
    }

    fn registered_identity(&self, worker_id: &str) -> BoxFuture<'static, Option<String>> {
        Box::pin(std::future::ready(self.identities.get(worker_id).cloned()))
    }
}

/// An owner serves a caller only as the worker the caller's certificate was registered
/// for: another mesh member's valid leaf cannot speak as that worker (and use its
/// budgets). A worker the directory does not know is let in: any member may forward.
#[test]
fn a_hello_counts_only_from_the_identity_registered_for_the_caller() {
    init_tracing();
    on_both(|kind| async move {
        let pki = Pki::new("mesh");
        let caller_uri = TrustDomain::default().member_uri("caller").expect("uri");
        let record = Arc::new(Record::default());
        let service = Arc::new(RegisteredCallers {
            inner: TestService {
                record: record.clone(),
            },
            identities: [(CALLER.to_owned(), caller_uri)].into(),
        });
        let server = serve_on_loopback(
            kind,
            pki.member("owner").server_config(),
            OWNER,
            service,
            limits(),
        )
        .await;
        let addr = server.local_addr().to_string();
        let client = |member: &str, worker: &str| {
            MeshClient::new(
                kind,
                pki.member(member).client_config(),
                worker,
                limits(),
                None,
            )
            .expect("client")
        };
        echo(&client("caller", CALLER), &addr, OWNER)
            .await
            .expect("the registered identity is served");
        let served = record.started.load(std::sync::atomic::Ordering::SeqCst);
        let err = echo(&client("host-c", CALLER), &addr, OWNER)
            .await
            .expect_err("another member speaking as the registered caller");
        assert!(
            matches!(&err, MeshError::Connect { reason, .. } if reason.contains("refused the greeting")),
            "{kind}: {err:?}"
        );
        assert!(
            !err.proves_peer_gone() && !err.may_have_executed(),
            "{kind}: {err:?}"
        );
        assert_eq!(
            record.started.load(std::sync::atomic::Ordering::SeqCst),
            served,
            "{kind}: nothing ran for the impostor"
        );
        echo(&client("host-c", "newcomer-7"), &addr, OWNER)
            .await
            .expect("a worker the directory does not know is let in");
    });
}

/// A bad file is refused while the material in use keeps serving; the fixed file is
/// then taken.
#[test]
fn a_bad_file_keeps_the_old_material_and_a_fixed_one_is_taken() {
    init_tracing();
    on_both(|kind| async move {
        let ca = generate_ca("reload CA", YEAR).expect("CA");
        let dir = tempfile::tempdir().expect("dir");
        write_bundle(dir.path(), &[&ca]);
        write_leaf(dir.path(), &ca, "owner", YEAR);
        let owner_tls = source(dir.path(), "owner");
        let server = serve(
            kind,
            owner_tls.clone(),
            OWNER,
            Arc::new(Record::default()),
            limits(),
        )
        .await;
        let addr = server.local_addr().to_string();
        write_leaf(dir.path(), &ca, "caller", YEAR);
        let caller = MeshTls::load(&MeshTlsFiles::in_dir(dir.path(), "caller")).expect("caller");
        let fingerprint = owner_tls.current().leaf_fingerprint().to_owned();

        write_file_atomically(&dir.path().join("owner.crt"), b"not a certificate", false)
            .expect("write");
        assert!(matches!(
            owner_tls.reload_now().await,
            ReloadOutcome::Refused(_)
        ));
        assert_eq!(owner_tls.current().leaf_fingerprint(), fingerprint);
        // New connections still get the old material.
        let client =
            MeshClient::new(kind, caller.client_config(), CALLER, limits(), None).expect("client");
        echo(&client, &addr, OWNER)
            .await
            .expect("served with the old material");

        write_leaf(dir.path(), &ca, "owner", YEAR);
        // Taken by this check, or already by the watcher.
        let outcome = owner_tls.reload_now().await;
        assert!(
            matches!(outcome, ReloadOutcome::Reloaded | ReloadOutcome::Unchanged),
            "{kind}: {outcome:?}"
        );
        assert!(matches!(
            owner_tls.reload_now().await,
            ReloadOutcome::Unchanged
        ));
        assert_ne!(owner_tls.current().leaf_fingerprint(), fingerprint);
        let fresh =
            MeshClient::new(kind, caller.client_config(), CALLER, limits(), None).expect("client");
        echo(&fresh, &addr, OWNER)
            .await
            .expect("served with the new material");
        assert_eq!(owner_tls.stats().refused, 1);
    });
}
