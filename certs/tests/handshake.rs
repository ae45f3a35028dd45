//! Real rustls handshakes, in memory, between configs built from PEM files on disk.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use mcpgw_certs::{
    CertError, MESH_SERVER_NAME, MeshClientCertVerifier, MeshServerCertVerifier, MeshTls,
    MeshTlsFiles, Pem, client_config, crypto_provider, explain_tls_error, generate_ca, issue_leaf,
    peer_identity, server_config, write_pem_files,
};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-certs-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `ca_bundle` as ca.crt plus the member's leaf and returns the file set.
fn files(dir: &TempDir, cas: &[&Pem], member: &str, leaf: &Pem) -> MeshTlsFiles {
    let sub = dir.0.join(member);
    std::fs::create_dir_all(&sub).expect("member dir");
    let bundle: String = cas.iter().map(|ca| ca.cert.as_str()).collect();
    std::fs::write(sub.join("ca.crt"), bundle).expect("write bundle");
    write_pem_files(&sub, member, leaf).expect("write leaf");
    MeshTlsFiles::in_dir(&sub, member)
}

/// A leaf signed by `ca` with chosen SANs, for certificates `issue_leaf` would never make.
fn custom_leaf(ca: &Pem, sans: Vec<rcgen::SanType>) -> Pem {
    let issuer =
        rcgen::Issuer::from_ca_cert_pem(&ca.cert, rcgen::KeyPair::from_pem(&ca.key).unwrap())
            .unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = sans;
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

fn der(pem: &Pem) -> CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.cert.as_bytes()).unwrap()
}

struct Outcome {
    client: ClientConnection,
    server: ServerConnection,
    client_err: Option<rustls::Error>,
    server_err: Option<rustls::Error>,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.client_err.is_none()
            && self.server_err.is_none()
            && !self.client.is_handshaking()
            && !self.server.is_handshaking()
    }
}

fn transfer(from: &mut Connection, to: &mut Connection) {
    let mut buf = Vec::new();
    while from.wants_write() {
        if from.write_tls(&mut buf).is_err() {
            break;
        }
    }
    let mut rest = &buf[..];
    while !rest.is_empty() {
        match to.read_tls(&mut rest) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// Runs a handshake in memory, delivering alerts after a failure, and reports each
/// side's first error.
fn handshake_named(client: Arc<ClientConfig>, server: Arc<ServerConfig>, name: &str) -> Outcome {
    let name = ServerName::try_from(name.to_owned()).unwrap();
    let mut c = Connection::Client(ClientConnection::new(client, name).unwrap());
    let mut s = Connection::Server(ServerConnection::new(server).unwrap());
    let (mut client_err, mut server_err) = (None, None);
    for _ in 0..10 {
        if server_err.is_none() {
            transfer(&mut c, &mut s);
            if let Err(e) = s.process_new_packets() {
                server_err = Some(e);
            }
        }
        if client_err.is_none() {
            transfer(&mut s, &mut c);
            if let Err(e) = c.process_new_packets() {
                client_err = Some(e);
            }
        }
    }
    let (Connection::Client(client), Connection::Server(server)) = (c, s) else {
        unreachable!()
    };
    Outcome {
        client,
        server,
        client_err,
        server_err,
    }
}

fn handshake(client: Arc<ClientConfig>, server: Arc<ServerConfig>) -> Outcome {
    handshake_named(client, server, MESH_SERVER_NAME)
}

#[test]
fn two_leaves_of_one_ca_handshake_and_see_each_others_identity() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let a = issue_leaf(&ca, "worker-a", DAY).unwrap();
    let b = issue_leaf(&ca, "worker-b", DAY).unwrap();
    let fa = files(&dir, &[&ca], "worker-a", &a);
    let fb = files(&dir, &[&ca], "worker-b", &b);

    let out = handshake(client_config(&fa).unwrap(), server_config(&fb).unwrap());
    assert!(
        out.ok(),
        "client {:?} server {:?}",
        out.client_err,
        out.server_err
    );
    assert_eq!(
        out.client.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );

    let server_seen = out.server.peer_certificates().unwrap();
    assert_eq!(peer_identity(&server_seen[0]).unwrap(), "worker-a");
    let client_seen = out.client.peer_certificates().unwrap();
    assert_eq!(peer_identity(&client_seen[0]).unwrap(), "worker-b");

    assert_eq!(MeshTls::load(&fa).unwrap().identity(), "worker-a");
}

#[test]
fn the_dialled_name_does_not_matter_only_the_mesh_name_is_checked() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let a = files(&dir, &[&ca], "a", &issue_leaf(&ca, "a", DAY).unwrap());
    let b = files(&dir, &[&ca], "b", &issue_leaf(&ca, "b", DAY).unwrap());
    let out = handshake_named(
        client_config(&a).unwrap(),
        server_config(&b).unwrap(),
        "10.1.2.3",
    );
    assert!(
        out.ok(),
        "client {:?} server {:?}",
        out.client_err,
        out.server_err
    );
}

#[test]
fn client_leaf_from_another_ca_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let other = generate_ca("rogue ca", DAY).unwrap();
    let server = files(
        &dir,
        &[&ca],
        "server",
        &issue_leaf(&ca, "server", DAY).unwrap(),
    );
    // The rogue client trusts both CAs so that only the server's check can fail.
    let rogue = files(
        &dir,
        &[&ca, &other],
        "rogue",
        &issue_leaf(&other, "rogue", DAY).unwrap(),
    );

    let out = handshake(
        client_config(&rogue).unwrap(),
        server_config(&server).unwrap(),
    );
    assert!(!out.ok());
    let err = out.server_err.expect("server must refuse");
    assert!(
        matches!(
            err,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)
        ),
        "{err:?}"
    );
    assert!(explain_tls_error(&err).contains("not issued by the mesh CA"));
    let client_err = out.client_err.expect("client must see the alert");
    assert!(
        explain_tls_error(&client_err).contains("does not trust our CA"),
        "{client_err}"
    );
}

#[test]
fn server_leaf_from_another_ca_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let other = generate_ca("rogue ca", DAY).unwrap();
    let client = files(
        &dir,
        &[&ca],
        "client",
        &issue_leaf(&ca, "client", DAY).unwrap(),
    );
    let rogue = files(
        &dir,
        &[&other, &ca],
        "rogue",
        &issue_leaf(&other, "rogue", DAY).unwrap(),
    );
    let out = handshake(
        client_config(&client).unwrap(),
        server_config(&rogue).unwrap(),
    );
    let err = out.client_err.expect("client must refuse");
    assert!(
        explain_tls_error(&err).contains("not issued by the mesh CA"),
        "{err}"
    );
}

#[test]
fn client_without_a_certificate_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let server = files(
        &dir,
        &[&ca],
        "server",
        &issue_leaf(&ca, "server", DAY).unwrap(),
    );

    let anonymous = ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(server_verifier(&ca))
        .with_no_client_auth();

    let out = handshake(Arc::new(anonymous), server_config(&server).unwrap());
    let err = out.server_err.expect("server must refuse");
    assert!(
        matches!(err, rustls::Error::NoCertificatesPresented),
        "{err:?}"
    );
    assert!(explain_tls_error(&err).contains("no client certificate"));
    assert!(out.client_err.is_some());
}

#[test]
fn ca_valid_client_leaf_without_mesh_uri_san_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let server = files(
        &dir,
        &[&ca],
        "server",
        &issue_leaf(&ca, "server", DAY).unwrap(),
    );
    let server_cfg = server_config(&server).unwrap();

    let bad_leaves = [
        (
            "no-uri",
            custom_leaf(
                &ca,
                vec![rcgen::SanType::DnsName(
                    MESH_SERVER_NAME.try_into().unwrap(),
                )],
            ),
        ),
        (
            "foreign-uri",
            custom_leaf(
                &ca,
                vec![
                    rcgen::SanType::DnsName(MESH_SERVER_NAME.try_into().unwrap()),
                    rcgen::SanType::URI("spiffe://other/mesh/x".try_into().unwrap()),
                ],
            ),
        ),
    ];
    for (name, leaf) in bad_leaves {
        // The loader refuses such a leaf outright...
        let f = files(&dir, &[&ca], name, &leaf);
        assert!(
            matches!(MeshTls::load(&f), Err(CertError::NotMeshMember { .. })),
            "{name}"
        );

        // ...and so does a peer, even when the client is built around the check.
        let client = forge_client_config(&ca, &leaf);
        let out = handshake(client, server_cfg.clone());
        let err = out
            .server_err
            .unwrap_or_else(|| panic!("{name}: server must refuse"));
        let text = explain_tls_error(&err);
        assert!(
            text.contains("certificate has no mesh identity"),
            "{name}: {text}"
        );
        assert!(out.client_err.is_some(), "{name}");
    }
}

#[test]
fn ca_valid_server_leaf_without_mesh_uri_san_is_refused() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let client = files(
        &dir,
        &[&ca],
        "client",
        &issue_leaf(&ca, "client", DAY).unwrap(),
    );
    let leaf = custom_leaf(
        &ca,
        vec![rcgen::SanType::DnsName(
            MESH_SERVER_NAME.try_into().unwrap(),
        )],
    );
    let server = forge_server_config(&ca, &leaf);
    let out = handshake(client_config(&client).unwrap(), server);
    let err = out.client_err.expect("client must refuse");
    assert!(
        explain_tls_error(&err).contains("certificate has no mesh identity"),
        "{err}"
    );
}

fn roots(ca: &Pem) -> Arc<RootCertStore> {
    let mut roots = RootCertStore::empty();
    roots.add(der(ca)).unwrap();
    Arc::new(roots)
}

fn server_verifier(ca: &Pem) -> Arc<MeshServerCertVerifier> {
    Arc::new(MeshServerCertVerifier::with_roots(roots(ca)).unwrap())
}

fn key(pem: &Pem) -> rustls::pki_types::PrivateKeyDer<'static> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(pem.key.as_bytes()).unwrap()
}

/// A client config presenting `leaf`, skipping the loader's own-leaf check (a peer
/// trying to join without a mesh identity would not run it).
fn forge_client_config(ca: &Pem, leaf: &Pem) -> Arc<ClientConfig> {
    let cfg = ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(server_verifier(ca))
        .with_client_auth_cert(vec![der(leaf)], key(leaf))
        .unwrap();
    Arc::new(cfg)
}

/// A server config presenting `leaf`, with the mesh client check in place.
fn forge_server_config(ca: &Pem, leaf: &Pem) -> Arc<ServerConfig> {
    let cfg = ServerConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(Arc::new(
            MeshClientCertVerifier::with_roots(roots(ca)).unwrap(),
        ))
        .with_single_cert(vec![der(leaf)], key(leaf))
        .unwrap();
    Arc::new(cfg)
}

#[test]
fn bundle_with_two_cas_accepts_leaves_from_both() {
    let dir = TempDir::new();
    let old = generate_ca("mesh ca old", DAY).unwrap();
    let new = generate_ca("mesh ca new", DAY).unwrap();
    let server = files(
        &dir,
        &[&old, &new],
        "server",
        &issue_leaf(&old, "server", DAY).unwrap(),
    );
    let server_cfg = server_config(&server).unwrap();
    for (name, ca) in [("from-old", &old), ("from-new", &new)] {
        let f = files(
            &dir,
            &[&new, &old],
            name,
            &issue_leaf(ca, name, DAY).unwrap(),
        );
        let out = handshake(client_config(&f).unwrap(), server_cfg.clone());
        assert!(
            out.ok(),
            "{name}: client {:?} server {:?}",
            out.client_err,
            out.server_err
        );
        let seen = out.server.peer_certificates().unwrap();
        assert_eq!(peer_identity(&seen[0]).unwrap(), name);
    }
}

#[test]
fn loader_refuses_a_leaf_its_own_bundle_does_not_trust() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let other = generate_ca("other ca", DAY).unwrap();
    let f = files(&dir, &[&ca], "w", &issue_leaf(&other, "w", DAY).unwrap());
    let err = MeshTls::load(&f).unwrap_err();
    assert!(matches!(err, CertError::LeafNotTrusted { .. }), "{err:?}");
    assert!(
        err.to_string().contains("not issued by the mesh CA"),
        "{err}"
    );
}

#[test]
fn loader_reports_missing_files_and_garbage() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let f = files(&dir, &[&ca], "w", &issue_leaf(&ca, "w", DAY).unwrap());

    let missing = MeshTlsFiles {
        key: dir.0.join("nope.key"),
        ..f.clone()
    };
    assert!(matches!(MeshTls::load(&missing), Err(CertError::Io { .. })));

    std::fs::write(&f.key, "not a key").unwrap();
    let err = MeshTls::load(&f).unwrap_err();
    assert!(matches!(err, CertError::NoPrivateKey { .. }), "{err:?}");

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

    let leaf = issue_leaf(&ca, "host-1:w3", 365 * DAY).unwrap();
    let not_after = |pem: &Pem| {
        let d = der(pem);
        let (_, c) = x509_parser::parse_x509_certificate(&d).unwrap();
        c.validity().not_after.timestamp()
    };
    assert!(not_after(&leaf) <= not_after(&ca));
    assert_eq!(peer_identity(&der(&leaf)).unwrap(), "host-1:w3");
    assert!(matches!(
        peer_identity(&der(&ca)),
        Err(CertError::NotMeshMember { .. })
    ));
}

#[test]
fn keys_stay_out_of_debug_output_and_key_files_are_private() {
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", DAY).unwrap();
    let dbg = format!("{ca:?}");
    assert!(!dbg.contains("PRIVATE KEY"), "{dbg}");

    let (_, key_path) = write_pem_files(&dir.0, "ca", &ca).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let loaded = mcpgw_certs::load_pem_files(&dir.0.join("ca.crt"), &key_path).unwrap();
    assert_eq!(loaded.key, ca.key);
}

#[test]
fn installing_the_provider_twice_is_fine() {
    mcpgw_certs::install_crypto_provider();
    mcpgw_certs::install_crypto_provider();
    assert!(rustls::crypto::CryptoProvider::get_default().is_some());
}
