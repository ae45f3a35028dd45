//! Real rustls handshakes over loopback TCP between mesh configs built from PEM files:
//! who is accepted, who is refused and why, no session resumption, and a staged CA
//! rotation during which members that reload at different moments always connect.

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{
    DAY, LeafSpec, LoopbackServer, TempDir, anonymous_client_config, exchange, forge_client_config,
    forge_client_config_in, forge_server_config, not_after,
};
use mcpgw_certs::rotate;
use mcpgw_certs::{
    CertDir, CertError, MESH_SERVER_NAME, MeshTls, MeshTlsFiles, MeshTlsSettings, MeshTlsSource,
    Pem, ReloadOptions, ReloadOutcome, TrustDomain, generate_ca, issue_leaf, issue_leaf_in,
    peer_identity, write_pem_files,
};
use rustls::HandshakeKind;

/// Writes a member's files (bundle of `cas`, its leaf) into their own directory.
fn member_files(dir: &TempDir, cas: &[&Pem], member: &str, leaf: &Pem) -> MeshTlsFiles {
    let sub = dir.path().join(member);
    std::fs::create_dir_all(&sub).unwrap();
    let bundle: String = cas.iter().map(|ca| ca.cert.as_str()).collect();
    std::fs::write(sub.join("ca.crt"), bundle).unwrap();
    write_pem_files(&sub, member, leaf).unwrap();
    MeshTlsFiles::in_dir(&sub, member)
}

/// A member trusting only `ca`, with a day-long leaf from it, loaded.
fn member(dir: &TempDir, ca: &Pem, name: &str) -> MeshTls {
    load(&member_files(
        dir,
        &[ca],
        name,
        &issue_leaf(ca, name, DAY).unwrap(),
    ))
}

fn load(files: &MeshTlsFiles) -> MeshTls {
    MeshTls::load(files).unwrap()
}

/// A loopback server presenting `tls`'s material.
async fn server_of(tls: &MeshTls) -> LoopbackServer {
    let config = tls.server_config();
    LoopbackServer::start(move || config.clone(), tls.trust_domain().clone()).await
}

fn domain() -> TrustDomain {
    TrustDomain::default()
}

#[tokio::test]
async fn two_leaves_of_one_ca_connect_and_see_each_others_identity() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let a = member(&dir, &ca, "worker-a");
    let b = member(&dir, &ca, "worker-b");
    assert_eq!(a.identity(), "worker-a");
    assert_eq!(a.leaf().uri, "spiffe://mcpgw/mesh/worker-a");

    let mut server = server_of(&b).await;
    let saw = exchange(a.client_config(), server.addr, &domain())
        .await
        .unwrap();
    assert_eq!(saw.server, "worker-b");
    assert_eq!(saw.kind, HandshakeKind::Full);
    assert_eq!(server.next_seen().await.unwrap(), "worker-a");
}

#[tokio::test]
async fn client_leaf_from_another_ca_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let other = generate_ca("rogue ca", DAY).unwrap();
    let server = member(&dir, &ca, "server");
    let mut server = server_of(&server).await;
    // The rogue trusts both CAs so that only the server's check can fail.
    let rogue = forge_client_config(&[&ca, &other], &issue_leaf(&other, "rogue", DAY).unwrap());

    let client_err = exchange(rogue, server.addr, &domain()).await.unwrap_err();
    let server_err = server.next_seen().await.unwrap_err();
    assert!(
        server_err.contains("not issued by the mesh CA"),
        "{server_err}"
    );
    assert!(client_err.contains("does not trust our CA"), "{client_err}");
}

#[tokio::test]
async fn server_leaf_from_another_ca_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let other = generate_ca("rogue ca", DAY).unwrap();
    let client = member(&dir, &ca, "client");
    let rogue = forge_server_config(&[&ca, &other], &issue_leaf(&other, "rogue", DAY).unwrap());
    let server = LoopbackServer::start(move || rogue.clone(), domain()).await;

    let err = exchange(client.client_config(), server.addr, &domain())
        .await
        .unwrap_err();
    assert!(err.contains("not issued by the mesh CA"), "{err}");
}

#[tokio::test]
async fn expired_leaves_are_refused_on_both_sides() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", 10 * DAY).unwrap();
    let now = time::OffsetDateTime::now_utc();
    let expired = LeafSpec::mesh(&ca, "mcpgw", "stale")
        .valid(now - time::Duration::days(2), now - time::Duration::days(1))
        .build();

    // Our own loader refuses it outright...
    let files = member_files(&dir, &[&ca], "stale", &expired);
    let err = MeshTls::load(&files).unwrap_err();
    assert!(err.to_string().contains("has expired"), "{err}");

    // ...and a peer refuses it as a client...
    let good = member(&dir, &ca, "good");
    let mut server = server_of(&good).await;
    let client_err = exchange(
        forge_client_config(&[&ca], &expired),
        server.addr,
        &domain(),
    )
    .await
    .unwrap_err();
    let server_err = server.next_seen().await.unwrap_err();
    assert!(server_err.contains("has expired"), "{server_err}");
    assert!(client_err.contains("expired"), "{client_err}");

    // ...and as a server.
    let stale_server = forge_server_config(&[&ca], &expired);
    let stale = LoopbackServer::start(move || stale_server.clone(), domain()).await;
    let err = exchange(good.client_config(), stale.addr, &domain())
        .await
        .unwrap_err();
    assert!(err.contains("has expired"), "{err}");
}

#[tokio::test]
async fn client_without_a_certificate_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let server = member(&dir, &ca, "server");
    let mut server = server_of(&server).await;

    let client_err = exchange(anonymous_client_config(&[&ca]), server.addr, &domain())
        .await
        .unwrap_err();
    let server_err = server.next_seen().await.unwrap_err();
    assert!(server_err.contains("no client certificate"), "{server_err}");
    assert!(
        client_err.contains("requires a client certificate"),
        "{client_err}"
    );
}

/// Leaves that chain to the mesh CA but are not mesh identities of the trust domain.
fn non_member_leaves(ca: &Pem) -> Vec<(&'static str, Pem, &'static str)> {
    let dns = || rcgen::SanType::DnsName(MESH_SERVER_NAME.try_into().unwrap());
    vec![
        (
            "no identity",
            LeafSpec::mesh(ca, "mcpgw", "x").sans(vec![dns()]).build(),
            "certificate has no mesh identity",
        ),
        (
            "another trust domain",
            LeafSpec::mesh(ca, "other.example", "x").build(),
            "not of this mesh's trust domain",
        ),
        (
            "not a mesh path",
            LeafSpec::mesh(ca, "mcpgw", "x")
                .sans(vec![
                    dns(),
                    rcgen::SanType::URI("spiffe://mcpgw/admin/x".try_into().unwrap()),
                ])
                .build(),
            "certificate has no mesh identity",
        ),
        (
            "two identities",
            LeafSpec::mesh(ca, "mcpgw", "x")
                .sans(vec![
                    dns(),
                    rcgen::SanType::URI("spiffe://mcpgw/mesh/a".try_into().unwrap()),
                    rcgen::SanType::URI("spiffe://mcpgw/mesh/b".try_into().unwrap()),
                ])
                .build(),
            "more than one mesh identity",
        ),
    ]
}

#[tokio::test]
async fn client_leaf_without_a_mesh_identity_of_the_trust_domain_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let server = member(&dir, &ca, "server");
    let mut server = server_of(&server).await;

    for (case, leaf, reason) in non_member_leaves(&ca) {
        // The loader refuses such a leaf outright, naming the file...
        let files = member_files(&dir, &[&ca], "bad", &leaf);
        let err = MeshTls::load(&files).unwrap_err();
        assert!(err.to_string().contains(reason), "{case}: {err}");
        assert!(err.to_string().contains("bad.crt"), "{case}: {err}");

        // ...and so does a peer, even when the client skips its own check.
        let client_err = exchange(forge_client_config(&[&ca], &leaf), server.addr, &domain())
            .await
            .unwrap_err();
        let server_err = server.next_seen().await.unwrap_err();
        assert!(server_err.contains(reason), "{case}: {server_err}");
        assert!(client_err.contains("refused"), "{case}: {client_err}");
    }
}

#[tokio::test]
async fn server_leaf_without_a_mesh_identity_of_the_trust_domain_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let client = member(&dir, &ca, "client");
    for (case, leaf, reason) in non_member_leaves(&ca) {
        let config = forge_server_config(&[&ca], &leaf);
        let server = LoopbackServer::start(move || config.clone(), domain()).await;
        let err = exchange(client.client_config(), server.addr, &domain())
            .await
            .unwrap_err();
        assert!(err.contains(reason), "{case}: {err}");
    }
}

#[tokio::test]
async fn a_configured_trust_domain_admits_its_members_and_refuses_the_default_one() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let prod = TrustDomain::new("prod.example").unwrap();
    let settings = MeshTlsSettings {
        trust_domain: prod.clone(),
        alpn_protocols: vec![b"mcpgw-test".to_vec()],
    };
    let a_files = member_files(
        &dir,
        &[&ca],
        "a",
        &issue_leaf_in(&ca, &prod, "a", DAY).unwrap(),
    );
    let b_files = member_files(
        &dir,
        &[&ca],
        "b",
        &issue_leaf_in(&ca, &prod, "b", DAY).unwrap(),
    );
    let a = MeshTls::load_with(&a_files, &settings).unwrap();
    let b = MeshTls::load_with(&b_files, &settings).unwrap();
    assert_eq!(a.leaf().uri, "spiffe://prod.example/mesh/a");
    assert_eq!(
        a.client_config().alpn_protocols,
        vec![b"mcpgw-test".to_vec()]
    );

    let mut server = server_of(&b).await;
    let saw = exchange(a.client_config(), server.addr, &prod)
        .await
        .unwrap();
    assert_eq!(saw.server, "b");
    assert_eq!(server.next_seen().await.unwrap(), "a");

    // A leaf of the default domain, from the same CA, is not a member of this mesh.
    let outsider = issue_leaf(&ca, "outsider", DAY).unwrap();
    let err = MeshTls::load_with(
        &member_files(&dir, &[&ca], "outsider", &outsider),
        &settings,
    )
    .unwrap_err();
    assert!(
        matches!(&err, CertError::InFile { source, .. } if matches!(**source, CertError::ForeignTrustDomain { .. })),
        "{err:?}"
    );
    let client_err = exchange(
        forge_client_config_in(&[&ca], &outsider, &prod),
        server.addr,
        &prod,
    )
    .await
    .unwrap_err();
    let server_err = server.next_seen().await.unwrap_err();
    assert!(
        server_err.contains(
            "spiffe://mcpgw/mesh/outsider is not of this mesh's trust domain \"prod.example\""
        ),
        "{server_err}"
    );
    assert!(client_err.contains("refused"), "{client_err}");
}

#[tokio::test]
async fn the_mesh_server_issues_no_session_tickets_and_the_mesh_client_never_resumes() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let server = member(&dir, &ca, "server");
    let client = member(&dir, &ca, "client");
    let server_config = server.server_config();
    assert_eq!(server_config.send_tls13_tickets, 0);
    assert!(!server_config.ticketer.enabled());
    assert!(!server_config.session_storage.can_cache());

    // A peer that would resume if it could (rustls's default client) gets no ticket.
    let mut ours = server_of(&server).await;
    let eager = forge_client_config(&[&ca], &issue_leaf(&ca, "eager", DAY).unwrap());
    for _ in 0..2 {
        let saw = exchange(eager.clone(), ours.addr, &domain()).await.unwrap();
        assert_eq!(saw.kind, HandshakeKind::Full);
        ours.next_seen().await.unwrap();
    }

    // Our client offers no session to a server that hands out tickets.
    let mut ticketing = (*server_config).clone();
    ticketing.session_storage = rustls::server::ServerSessionMemoryCache::new(64);
    ticketing.send_tls13_tickets = 2;
    let ticketing = Arc::new(ticketing);
    let mut generous = LoopbackServer::start(move || ticketing.clone(), domain()).await;
    for _ in 0..2 {
        let saw = exchange(client.client_config(), generous.addr, &domain())
            .await
            .unwrap();
        assert_eq!(saw.kind, HandshakeKind::Full);
        generous.next_seen().await.unwrap();
    }
}

#[tokio::test]
async fn an_expired_leaf_is_refused_even_by_a_peer_holding_a_session_ticket_from_before() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let now = time::OffsetDateTime::now_utc();
    let short_lived = LeafSpec::mesh(&ca, "mcpgw", "short")
        .valid(
            now - time::Duration::hours(1),
            now + time::Duration::seconds(2),
        )
        .build();
    // rustls's default client keeps tickets and offers them.
    let client = forge_client_config(&[&ca], &short_lived);

    let server = member(&dir, &ca, "server");
    let mut ours = server_of(&server).await;
    // The control: the same verifier, but with rustls's default session handling.
    let mut resuming = (*server.server_config()).clone();
    resuming.session_storage = rustls::server::ServerSessionMemoryCache::new(64);
    resuming.send_tls13_tickets = 2;
    let resuming = Arc::new(resuming);
    let mut control = LoopbackServer::start(move || resuming.clone(), domain()).await;

    // While the leaf is valid, both accept it; the control hands out a ticket, which
    // the client then holds.
    assert_eq!(
        exchange(client.clone(), ours.addr, &domain())
            .await
            .unwrap()
            .kind,
        HandshakeKind::Full
    );
    ours.next_seen().await.unwrap();
    assert_eq!(
        exchange(client.clone(), control.addr, &domain())
            .await
            .unwrap()
            .kind,
        HandshakeKind::Full
    );
    control.next_seen().await.unwrap();

    // Wait until the leaf has expired (X.509 times have one-second resolution).
    let expiry = not_after(&short_lived) + Duration::from_millis(1500);
    while SystemTime::now() < expiry {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The hazard: with resumption, the expired leaf gets in without any check.
    let resumed = exchange(client.clone(), control.addr, &domain())
        .await
        .unwrap();
    assert_eq!(resumed.kind, HandshakeKind::Resumed);
    control.next_seen().await.unwrap();

    // The mesh server does a full handshake and refuses it, ticket or not.
    let client_err = exchange(client.clone(), ours.addr, &domain())
        .await
        .unwrap_err();
    let server_err = ours.next_seen().await.unwrap_err();
    assert!(server_err.contains("has expired"), "{server_err}");
    assert!(client_err.contains("expired"), "{client_err}");
}

#[tokio::test]
async fn loader_refuses_a_leaf_its_own_bundle_does_not_trust_and_a_key_of_another_leaf() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let other = generate_ca("other ca", DAY).unwrap();
    let files = member_files(&dir, &[&ca], "w", &issue_leaf(&other, "w", DAY).unwrap());
    let err = MeshTls::load(&files).unwrap_err();
    assert!(matches!(err, CertError::LeafNotTrusted { .. }), "{err:?}");
    assert!(
        err.to_string().contains("not issued by a CA in the bundle"),
        "{err}"
    );

    let files = member_files(&dir, &[&ca], "v", &issue_leaf(&ca, "v", DAY).unwrap());
    let foreign_key = issue_leaf(&ca, "u", DAY).unwrap().key;
    std::fs::write(&files.key, foreign_key).unwrap();
    let err = MeshTls::load(&files).unwrap_err();
    assert!(matches!(err, CertError::KeyMismatch { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("v.key does not belong to the certificate"),
        "{err}"
    );
}

#[test]
fn loader_reports_missing_files_and_garbage_without_echoing_them() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let f = member_files(&dir, &[&ca], "w", &issue_leaf(&ca, "w", DAY).unwrap());

    let missing = MeshTlsFiles {
        key: dir.path().join("nope.key"),
        ..f.clone()
    };
    assert!(matches!(MeshTls::load(&missing), Err(CertError::Io { .. })));

    std::fs::write(&f.key, "not a key SECRET-LOOKING-BYTES").unwrap();
    let err = MeshTls::load(&f).unwrap_err();
    assert!(matches!(err, CertError::NoPrivateKey { .. }), "{err:?}");
    assert!(!err.to_string().contains("SECRET-LOOKING-BYTES"), "{err}");

    std::fs::write(&f.ca, "").unwrap();
    assert!(matches!(
        MeshTls::load(&f),
        Err(CertError::NoCertificates { .. })
    ));
}

#[test]
fn issuance_validates_names_and_caps_leaf_validity_at_the_ca() {
    let ca = generate_ca("mesh ca", DAY).unwrap();
    for bad in ["", "a/b", "spaces no", "é", &"x".repeat(129)] {
        assert!(
            matches!(
                issue_leaf(&ca, bad, DAY),
                Err(CertError::InvalidMemberName { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        issue_leaf(&ca, "w", Duration::ZERO),
        Err(CertError::InvalidValidity(_))
    ));
    for bad in ["", "UPPER", "a/b", "spiffe://x", &"d".repeat(256)] {
        assert!(
            matches!(
                TrustDomain::new(bad),
                Err(CertError::InvalidTrustDomain { .. })
            ),
            "{bad:?}"
        );
    }

    let leaf = issue_leaf(&ca, "host-1:w3", 365 * DAY).unwrap();
    assert!(not_after(&leaf) <= not_after(&ca));
    assert_eq!(peer_identity(&common::der(&leaf)).unwrap(), "host-1:w3");
    assert!(matches!(
        peer_identity(&common::der(&ca)),
        Err(CertError::NotMeshMember { .. })
    ));
}

#[test]
fn keys_stay_out_of_debug_output_and_key_files_are_private() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let dbg = format!("{ca:?}");
    assert!(!dbg.contains("PRIVATE KEY"), "{dbg}");

    let (_, key_path) = write_pem_files(dir.path(), "ca", &ca).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let loaded = mcpgw_certs::load_pem_files(&dir.path().join("ca.crt"), &key_path).unwrap();
    assert_eq!(loaded.key, ca.key);
}

#[test]
fn installing_the_provider_twice_is_fine() {
    mcpgw_certs::install_crypto_provider();
    mcpgw_certs::install_crypto_provider();
    assert!(rustls::crypto::CryptoProvider::get_default().is_some());
}

// ------------------------------------------------------------------ staged rotation

/// One host of the mesh: its own copy of the files it is given, a reloading source
/// over them, and a server that reads the source per handshake.
struct Host {
    name: &'static str,
    dir: TempDir,
    files: MeshTlsFiles,
    source: MeshTlsSource,
    server: LoopbackServer,
}

impl Host {
    /// Installs the bundle and `name`'s leaf from the certificate directory, as an
    /// operator copies them to a host, and starts reloading from them.
    async fn start(certs: &CertDir, name: &'static str) -> Host {
        let dir = TempDir::new();
        let files = MeshTlsFiles::in_dir(dir.path(), name);
        copy_file(&certs.bundle_path(), &files.ca);
        copy_file(&certs.path().join(format!("{name}.crt")), &files.cert);
        copy_file(&certs.path().join(format!("{name}.key")), &files.key);
        let options = ReloadOptions {
            // Reloads in this test happen when the test says so (reload_now); the
            // watcher may get there first, which changes nothing.
            poll_interval: Duration::from_secs(3600),
            ..ReloadOptions::default()
        };
        let source = MeshTlsSource::watch(&files, &MeshTlsSettings::default(), options).unwrap();
        let for_server = source.clone();
        let server =
            LoopbackServer::start(move || for_server.server_config(), TrustDomain::default()).await;
        Host {
            name,
            dir,
            files,
            source,
            server,
        }
    }

    /// Installs the current bundle from the certificate directory and reloads.
    async fn take_bundle(&self, certs: &CertDir) {
        copy_file(&certs.bundle_path(), &self.files.ca);
        self.reload_until_current().await;
    }

    /// Installs this host's current leaf and key and reloads.
    async fn take_leaf(&self, certs: &CertDir) {
        let pem = mcpgw_certs::load_pem_files(
            &certs.path().join(format!("{}.crt", self.name)),
            &certs.path().join(format!("{}.key", self.name)),
        )
        .unwrap();
        // Key and certificate land by two renames, as `mcpgw certs` writes them.
        write_pem_files(self.dir.path(), self.name, &pem).unwrap();
        self.reload_until_current().await;
    }

    async fn reload_until_current(&self) {
        let outcome = self.source.reload_now().await;
        assert!(
            matches!(outcome, ReloadOutcome::Reloaded | ReloadOutcome::Unchanged),
            "{}: {outcome:?}",
            self.name
        );
        let current = self.source.current();
        let on_disk = std::fs::read(&self.files.cert).unwrap();
        let der = common::der(&Pem {
            cert: String::from_utf8(on_disk).unwrap(),
            key: String::new(),
        });
        assert_eq!(
            current.leaf_fingerprint(),
            mcpgw_certs::sha256_fingerprint(&der)
        );
    }

    fn cas(&self) -> usize {
        self.source.current().ca_fingerprints().len()
    }
}

fn copy_file(from: &std::path::Path, to: &std::path::Path) {
    let bytes = std::fs::read(from).unwrap();
    let secret = to.extension().is_some_and(|e| e == "key");
    mcpgw_certs::write_file_atomically(to, &bytes, secret).unwrap();
}

/// Both directions between two hosts work.
async fn assert_connect(a: &mut Host, b: &mut Host, when: &str) {
    one_way(a, b, when).await;
    one_way(b, a, when).await;
}

async fn one_way(from: &Host, to: &mut Host, when: &str) {
    let saw = exchange(from.source.client_config(), to.server.addr, &domain())
        .await
        .unwrap_or_else(|e| panic!("{when}: {} → {} failed: {e}", from.name, to.name));
    assert_eq!(saw.server, to.name, "{when}");
    assert_eq!(to.server.next_seen().await.unwrap(), from.name, "{when}");
}

#[tokio::test]
async fn during_a_staged_rotation_hosts_that_reload_at_different_moments_always_connect() {
    let certs_dir = TempDir::new();
    let certs = CertDir::new(certs_dir.path());
    certs.init(&TrustDomain::default(), 3650 * DAY).unwrap();
    certs.issue("a", 90 * DAY).unwrap();
    certs.issue("b", 90 * DAY).unwrap();
    let mut a = Host::start(&certs, "a").await;
    let mut b = Host::start(&certs, "b").await;
    // A host that never reloads: old CA only, old leaf.
    let stale_dir = TempDir::new();
    let stale_files = MeshTlsFiles::in_dir(stale_dir.path(), "a");
    for (from, to) in [
        (certs.bundle_path(), &stale_files.ca),
        (certs.path().join("a.crt"), &stale_files.cert),
        (certs.path().join("a.key"), &stale_files.key),
    ] {
        copy_file(&from, to);
    }
    let stale = MeshTls::load(&stale_files).unwrap();
    assert_connect(&mut a, &mut b, "before the rotation").await;

    // Stage 1: the bundle holds both CAs. a reloads it first, b later.
    rotate::begin(&certs, 3650 * DAY).unwrap();
    // A host that reloads the bundle but never gets its new leaf.
    let half_stale_dir = TempDir::new();
    let half_stale_files = MeshTlsFiles::in_dir(half_stale_dir.path(), "b");
    for (from, to) in [
        (certs.bundle_path(), &half_stale_files.ca),
        (certs.path().join("b.crt"), &half_stale_files.cert),
        (certs.path().join("b.key"), &half_stale_files.key),
    ] {
        copy_file(&from, to);
    }
    let half_stale = MeshTls::load(&half_stale_files).unwrap();
    a.take_bundle(&certs).await;
    assert_eq!(a.cas(), 2);
    assert_connect(&mut a, &mut b, "after begin, only a reloaded").await;
    b.take_bundle(&certs).await;
    assert_connect(&mut a, &mut b, "after begin, both reloaded").await;

    // Stage 2: new leaves from the new CA. a gets its own first.
    rotate::reissue(&certs, 90 * DAY).unwrap();
    a.take_leaf(&certs).await;
    assert_connect(&mut a, &mut b, "after reissue, only a reloaded").await;
    b.take_leaf(&certs).await;
    assert_connect(&mut a, &mut b, "after reissue, both reloaded").await;

    // Stage 3: the bundle holds only the new CA. a reloads it first.
    rotate::finish(&certs).unwrap();
    a.take_bundle(&certs).await;
    assert_eq!(a.cas(), 1);
    assert_connect(&mut a, &mut b, "after finish, only a reloaded").await;
    b.take_bundle(&certs).await;
    assert_connect(&mut a, &mut b, "after finish, both reloaded").await;

    // A peer still presenting an old leaf is refused, even one that trusts both CAs...
    let client_err = exchange(half_stale.client_config(), a.server.addr, &domain())
        .await
        .unwrap_err();
    let server_err = a.server.next_seen().await.unwrap_err();
    assert!(
        server_err.contains("not issued by the mesh CA"),
        "{server_err}"
    );
    assert!(client_err.contains("does not trust our CA"), "{client_err}");
    // ...one that trusts only the old CA cannot connect either...
    let client_err = exchange(stale.client_config(), a.server.addr, &domain())
        .await
        .unwrap_err();
    assert!(
        client_err.contains("not issued by the mesh CA"),
        "{client_err}"
    );
    a.server.next_seen().await.unwrap_err();
    // ...and it is refused as a server.
    let stale_config = stale.server_config();
    let stale_server = LoopbackServer::start(move || stale_config.clone(), domain()).await;
    let err = exchange(a.source.client_config(), stale_server.addr, &domain())
        .await
        .unwrap_err();
    assert!(err.contains("not issued by the mesh CA"), "{err}");

    let stats = a.source.stats();
    assert!(stats.reloaded >= 3, "{stats:?}");
    assert_eq!(stats.pending_refusal, None);
}
