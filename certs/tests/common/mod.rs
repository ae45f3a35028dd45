//! Test support: temporary directories, certificates `mcpgw certs` would never make,
//! and real TLS over loopback TCP (tokio-rustls) between mesh configs.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use mcpgw_certs::{
    MESH_SERVER_NAME, MeshClientCertVerifier, MeshServerCertVerifier, Pem, TrustDomain,
    crypto_provider, explain_tls_error,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, HandshakeKind, RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

pub const DAY: Duration = Duration::from_secs(24 * 3600);

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-certs-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a custom leaf looks like.
pub struct LeafSpec<'a> {
    pub sans: Vec<rcgen::SanType>,
    pub not_before: time::OffsetDateTime,
    pub not_after: time::OffsetDateTime,
    pub signer: &'a Pem,
}

impl<'a> LeafSpec<'a> {
    /// A mesh-shaped leaf of `member` in `domain`, valid for a day.
    pub fn mesh(signer: &'a Pem, domain: &str, member: &str) -> Self {
        let now = time::OffsetDateTime::now_utc();
        Self {
            sans: vec![
                rcgen::SanType::DnsName(MESH_SERVER_NAME.try_into().unwrap()),
                rcgen::SanType::URI(
                    format!("spiffe://{domain}/mesh/{member}")
                        .as_str()
                        .try_into()
                        .unwrap(),
                ),
            ],
            not_before: now - time::Duration::hours(1),
            not_after: now + time::Duration::days(1),
            signer,
        }
    }

    pub fn valid(mut self, from: time::OffsetDateTime, to: time::OffsetDateTime) -> Self {
        self.not_before = from;
        self.not_after = to;
        self
    }

    pub fn sans(mut self, sans: Vec<rcgen::SanType>) -> Self {
        self.sans = sans;
        self
    }

    pub fn build(self) -> Pem {
        let issuer = rcgen::Issuer::from_ca_cert_pem(
            &self.signer.cert,
            rcgen::KeyPair::from_pem(&self.signer.key).unwrap(),
        )
        .unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = self.sans;
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = self.not_before;
        params.not_after = self.not_after;
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// The `not_after` of a PEM certificate.
pub fn not_after(pem: &Pem) -> SystemTime {
    let der = der(pem);
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    SystemTime::UNIX_EPOCH
        + Duration::from_secs(cert.validity().not_after.timestamp().try_into().unwrap())
}

pub fn der(pem: &Pem) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.cert.as_bytes()).unwrap()
}

pub fn key(pem: &Pem) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_slice(pem.key.as_bytes()).unwrap()
}

pub fn roots(cas: &[&Pem]) -> Arc<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for ca in cas {
        roots.add(der(ca)).unwrap();
    }
    Arc::new(roots)
}

/// A client config presenting `leaf` without the loader's own-leaf check (a peer
/// trying to join with a bad leaf would not run it). Resumption stays at rustls's
/// default (on), as an arbitrary peer's would.
pub fn forge_client_config(cas: &[&Pem], leaf: &Pem) -> Arc<ClientConfig> {
    forge_client_config_in(cas, leaf, &TrustDomain::default())
}

pub fn forge_client_config_in(cas: &[&Pem], leaf: &Pem, domain: &TrustDomain) -> Arc<ClientConfig> {
    let verifier = MeshServerCertVerifier::for_trust_domain(roots(cas), domain.clone()).unwrap();
    Arc::new(
        ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(vec![der(leaf)], key(leaf))
            .unwrap(),
    )
}

/// A client config that presents no certificate.
pub fn anonymous_client_config(cas: &[&Pem]) -> Arc<ClientConfig> {
    let verifier = MeshServerCertVerifier::with_roots(roots(cas)).unwrap();
    Arc::new(
        ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth(),
    )
}

/// A server config presenting `leaf`, with the mesh client check in place.
pub fn forge_server_config(cas: &[&Pem], leaf: &Pem) -> Arc<ServerConfig> {
    let verifier = MeshClientCertVerifier::with_roots(roots(cas)).unwrap();
    Arc::new(
        ServerConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_client_cert_verifier(Arc::new(verifier))
            .with_single_cert(vec![der(leaf)], key(leaf))
            .unwrap(),
    )
}

/// What a server saw of one connection: the peer's member name, or why the handshake
/// failed (explained as the transports would log it).
pub type ServerSaw = Result<String, String>;

/// A TLS server on loopback that reads a config per connection (as a transport reads
/// the current config per handshake), answers one byte with the same byte, and reports
/// each connection.
pub struct LoopbackServer {
    pub addr: SocketAddr,
    seen: mpsc::UnboundedReceiver<ServerSaw>,
    task: tokio::task::JoinHandle<()>,
}

impl LoopbackServer {
    pub async fn start(
        config: impl Fn() -> Arc<ServerConfig> + Send + Sync + 'static,
        domain: TrustDomain,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (report, seen) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = TlsAcceptor::from(config());
                let report = report.clone();
                let domain = domain.clone();
                tokio::spawn(async move {
                    let saw = match acceptor.accept(tcp).await {
                        Ok(mut tls) => {
                            let member = tls
                                .get_ref()
                                .1
                                .peer_certificates()
                                .ok_or_else(|| "no peer certificate".to_owned())
                                .and_then(|chain| {
                                    mcpgw_certs::PeerIdentity::from_chain(chain, &domain)
                                        .map_err(|e| e.to_string())
                                })
                                .map(|peer| peer.member);
                            let mut byte = [0u8; 1];
                            if tls.read_exact(&mut byte).await.is_ok() {
                                let _ = tls.write_all(&byte).await;
                                let _ = tls.flush().await;
                            }
                            let _ = tls.shutdown().await;
                            member
                        }
                        Err(e) => Err(explain_io(&e)),
                    };
                    let _ = report.send(saw);
                });
            }
        });
        Self { addr, seen, task }
    }

    /// What the server saw of the next connection.
    pub async fn next_seen(&mut self) -> ServerSaw {
        self.seen.recv().await.expect("server task alive")
    }
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a client saw of one exchange.
#[derive(Debug)]
pub struct ClientSaw {
    /// The server's member name.
    pub server: String,
    /// Full handshake, or a resumed session.
    pub kind: HandshakeKind,
}

/// Connects, hands over one byte and reads it back: in TLS 1.3 a client learns that
/// the server refused its certificate only when it reads.
pub async fn exchange(
    config: Arc<ClientConfig>,
    addr: SocketAddr,
    domain: &TrustDomain,
) -> Result<ClientSaw, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(MESH_SERVER_NAME).unwrap();
    let mut tls = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| explain_io(&e))?;
    let (server, kind) = {
        let conn = tls.get_ref().1;
        let chain = conn.peer_certificates().ok_or("no server certificate")?;
        let server = mcpgw_certs::PeerIdentity::from_chain(chain, domain)
            .map_err(|e| e.to_string())?
            .member;
        (
            server,
            conn.handshake_kind().ok_or("handshake kind unknown")?,
        )
    };
    tls.write_all(b"x").await.map_err(|e| explain_io(&e))?;
    tls.flush().await.map_err(|e| explain_io(&e))?;
    let mut byte = [0u8; 1];
    tls.read_exact(&mut byte)
        .await
        .map_err(|e| explain_io(&e))?;
    let _ = tls.shutdown().await;
    Ok(ClientSaw { server, kind })
}

/// The TLS cause of an I/O error in the words a transport would log.
pub fn explain_io(err: &std::io::Error) -> String {
    match err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => explain_tls_error(tls),
        None => err.to_string(),
    }
}
