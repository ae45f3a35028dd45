//! rustls configs for the mesh, built from PEM files in one place.
//!
//! Every config is built here (and only here), after checking our own material the way
//! a peer will check it. Transports ask [`MeshTls`] (or a reloading
//! [`crate::MeshTlsSource`]) for configs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustls::client::Resumption;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::NoServerSessionStorage;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::CertifiedKey;
use rustls::{
    AlertDescription, CertificateError, ClientConfig, InconsistentKeys, RootCertStore, ServerConfig,
};

use crate::inspect::{sha256, sha256_fingerprint};
use crate::verify::{MeshClientCertVerifier, MeshServerCertVerifier};
use crate::{CertError, MESH_SERVER_NAME, PeerIdentity, TrustDomain, crypto_provider};

/// Where a mesh member's PEM files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshTlsFiles {
    /// CA bundle: one or more CA certificates. During rotation it holds the old and the
    /// new CA, so leaves from either are accepted.
    pub ca: PathBuf,
    /// This member's leaf certificate (optionally followed by intermediates).
    pub cert: PathBuf,
    /// This member's private key.
    pub key: PathBuf,
}

impl MeshTlsFiles {
    /// The layout `mcpgw certs` writes: `{dir}/ca.crt`, `{dir}/{member}.crt`,
    /// `{dir}/{member}.key`.
    pub fn in_dir(dir: &Path, member: &str) -> Self {
        Self {
            ca: dir.join("ca.crt"),
            cert: dir.join(format!("{member}.crt")),
            key: dir.join(format!("{member}.key")),
        }
    }
}

/// How mesh configs are built, besides the files: the same for every reload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshTlsSettings {
    /// The trust domain whose identities are accepted; our own leaf must carry one too.
    pub trust_domain: TrustDomain,
    /// ALPN protocols set on both configs, so that a transport can hand a config read
    /// at handshake time straight to rustls or quinn without copying it.
    pub alpn_protocols: Vec<Vec<u8>>,
}

/// The bytes of a member's three files, read once, so that what is checked and what is
/// built are the same bytes.
pub(crate) struct FileContents {
    pub(crate) ca: Vec<u8>,
    pub(crate) cert: Vec<u8>,
    pub(crate) key: Vec<u8>,
}

impl FileContents {
    pub(crate) fn read(files: &MeshTlsFiles) -> Result<Self, CertError> {
        Ok(Self {
            ca: read_file(&files.ca)?,
            cert: read_file(&files.cert)?,
            key: read_file(&files.key)?,
        })
    }

    /// A digest of all three files, to tell whether anything changed since the last
    /// read without keeping a copy of the key. Not a security boundary: the material
    /// is validated in full whenever the digest changes.
    pub(crate) fn digest(&self) -> [u8; 32] {
        let mut all = Vec::with_capacity(self.ca.len() + self.cert.len() + self.key.len() + 24);
        for part in [&self.ca, &self.cert, &self.key] {
            all.extend_from_slice(&(part.len() as u64).to_le_bytes());
            all.extend_from_slice(part);
        }
        sha256(&all)
    }
}

/// A member's loaded and checked mesh TLS material: its identity and the configs built
/// from its files. Immutable: a reload builds a new one (the verifiers are fixed when a
/// rustls config is built).
#[derive(Debug, Clone)]
pub struct MeshTls {
    /// Files this was loaded from; kept so a reload can read them again.
    files: MeshTlsFiles,
    /// Trust domain and ALPN this was built with.
    settings: MeshTlsSettings,
    /// Our own identity and leaf expiry, from our leaf.
    leaf: PeerIdentity,
    /// SHA-256 of our leaf, for logs and status views.
    leaf_fingerprint: String,
    /// SHA-256 of each CA in the bundle, in file order.
    ca_fingerprints: Vec<String>,
    /// Config for accepting mesh connections.
    server: Arc<ServerConfig>,
    /// Config for dialling mesh peers.
    client: Arc<ClientConfig>,
}

impl MeshTls {
    /// Loads the files and builds both configs for the default trust domain, without
    /// ALPN (see [`MeshTls::load_with`]).
    pub fn load(files: &MeshTlsFiles) -> Result<Self, CertError> {
        Self::load_with(files, &MeshTlsSettings::default())
    }

    /// Loads the files and builds both configs.
    ///
    /// Our own material is checked first, the way a peer would check it: the key
    /// belongs to the leaf; the leaf chains to a CA in the bundle, is valid now, has
    /// both EKUs and the mesh DNS name, and carries a mesh identity of the trust
    /// domain. So a mismatched file fails here, with the file and the reason, instead
    /// of at every handshake.
    pub fn load_with(files: &MeshTlsFiles, settings: &MeshTlsSettings) -> Result<Self, CertError> {
        Self::build(files, settings, &FileContents::read(files)?)
    }

    pub(crate) fn build(
        files: &MeshTlsFiles,
        settings: &MeshTlsSettings,
        contents: &FileContents,
    ) -> Result<Self, CertError> {
        let bundle = parse_certs(&contents.ca, &files.ca)?;
        let roots = Arc::new(root_store(&bundle, &files.ca)?);
        let chain = parse_certs(&contents.cert, &files.cert)?;
        let key = parse_key(&contents.key, &files.key)?;
        let Some(leaf) = chain.first() else {
            return Err(CertError::NoCertificates {
                path: files.cert.clone(),
            });
        };

        let leaf_fingerprint = sha256_fingerprint(leaf);
        let provider = crypto_provider();
        check_key_matches(&provider, &chain, &key, files)?;

        let in_cert = |e: CertError| CertError::InFile {
            path: files.cert.clone(),
            source: Box::new(e),
        };
        let leaf_identity =
            PeerIdentity::from_chain(&chain, &settings.trust_domain).map_err(in_cert)?;

        let bad_ca = |e: &dyn std::fmt::Display| CertError::BadCa {
            path: files.ca.clone(),
            reason: e.to_string(),
        };
        let client_verifier: Arc<dyn ClientCertVerifier> = Arc::new(
            MeshClientCertVerifier::for_trust_domain(roots.clone(), settings.trust_domain.clone())
                .map_err(|e| bad_ca(&e))?,
        );
        let server_verifier: Arc<dyn ServerCertVerifier> = Arc::new(
            MeshServerCertVerifier::for_trust_domain(roots, settings.trust_domain.clone())
                .map_err(|e| bad_ca(&e))?,
        );

        let now = UnixTime::now();
        let not_trusted = |e: rustls::Error| CertError::LeafNotTrusted {
            cert: files.cert.clone(),
            ca: files.ca.clone(),
            reason: explain_own_leaf_error(&e),
        };
        let mesh_name = ServerName::try_from(MESH_SERVER_NAME)
            .map_err(|e| CertError::Parse(format!("mesh server name: {e}")))?;
        client_verifier
            .verify_client_cert(leaf, &chain[1..], now)
            .map_err(not_trusted)?;
        server_verifier
            .verify_server_cert(leaf, &chain[1..], &mesh_name, &[], now)
            .map_err(not_trusted)?;

        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| tls_error(e, files))?;
        // No resumption on the mesh: a resumed TLS 1.3 session skips certificate
        // verification, so a peer whose leaf expired, or whose CA left the bundle,
        // would keep getting in. No session cache, no tickets (stateful or not).
        server.session_storage = Arc::new(NoServerSessionStorage {});
        server.send_tls13_tickets = 0;
        server.max_early_data_size = 0;
        server.alpn_protocols = settings.alpn_protocols.clone();

        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(server_verifier)
            .with_client_auth_cert(chain, key)
            .map_err(|e| tls_error(e, files))?;
        client.resumption = Resumption::disabled();
        client.enable_early_data = false;
        client.alpn_protocols = settings.alpn_protocols.clone();

        Ok(Self {
            files: files.clone(),
            settings: settings.clone(),
            leaf: leaf_identity,
            leaf_fingerprint,
            ca_fingerprints: bundle.iter().map(|ca| sha256_fingerprint(ca)).collect(),
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }

    /// The files this was loaded from.
    pub fn files(&self) -> &MeshTlsFiles {
        &self.files
    }

    /// The settings this was built with.
    pub fn settings(&self) -> &MeshTlsSettings {
        &self.settings
    }

    /// The trust domain whose identities this material accepts.
    pub fn trust_domain(&self) -> &TrustDomain {
        &self.settings.trust_domain
    }

    /// Our own mesh member name (from our leaf's URI SAN).
    pub fn identity(&self) -> &str {
        &self.leaf.member
    }

    /// Our own identity URI and our leaf's expiry.
    pub fn leaf(&self) -> &PeerIdentity {
        &self.leaf
    }

    /// When our leaf expires: for an expiry metric, and to know when a reissued leaf
    /// must have arrived.
    pub fn leaf_not_after(&self) -> SystemTime {
        self.leaf.not_after
    }

    /// SHA-256 fingerprint of our leaf (`AB:CD:...`), as `mcpgw certs inspect` prints it.
    pub fn leaf_fingerprint(&self) -> &str {
        &self.leaf_fingerprint
    }

    /// SHA-256 fingerprints of the CAs in our bundle, in file order.
    pub fn ca_fingerprints(&self) -> &[String] {
        &self.ca_fingerprints
    }

    /// Identity and expiry of a peer whose chain the mesh verifiers of this config
    /// accepted (`rustls::CommonState::peer_certificates`, or quinn's
    /// `Connection::peer_identity` downcast to `Vec<CertificateDer>`).
    pub fn peer(&self, chain: &[CertificateDer<'_>]) -> Result<PeerIdentity, CertError> {
        PeerIdentity::from_chain(chain, &self.settings.trust_domain)
    }

    /// Config for accepting mesh connections: TLS 1.3 only, client certificate required,
    /// no session resumption.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// Config for dialling mesh peers: TLS 1.3 only, presents our leaf, no session
    /// resumption.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }
}

/// Server config for accepting mesh connections (see [`MeshTls::server_config`]).
///
/// TLS 1.3 only. A client must present a certificate that chains to a CA in `files.ca`
/// and carries a mesh identity of the default trust domain, or the handshake fails.
pub fn server_config(files: &MeshTlsFiles) -> Result<Arc<ServerConfig>, CertError> {
    Ok(MeshTls::load(files)?.server_config())
}

/// Client config for dialling mesh peers (see [`MeshTls::client_config`]).
///
/// TLS 1.3 only. Presents our leaf; the server must present a certificate that chains to
/// a CA in `files.ca`, is valid for [`MESH_SERVER_NAME`] (whatever name is dialled) and
/// carries a mesh identity of the default trust domain.
pub fn client_config(files: &MeshTlsFiles) -> Result<Arc<ClientConfig>, CertError> {
    Ok(MeshTls::load(files)?.client_config())
}

/// The key must belong to the leaf. rustls checks this too when the config is built,
/// but its error does not name the files.
fn check_key_matches(
    provider: &CryptoProvider,
    chain: &[CertificateDer<'static>],
    key: &PrivateKeyDer<'static>,
    files: &MeshTlsFiles,
) -> Result<(), CertError> {
    let signing_key = provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|_| CertError::NoPrivateKey {
            path: files.key.clone(),
        })?;
    match CertifiedKey::new(chain.to_vec(), signing_key).keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => Ok(()),
        Err(rustls::Error::InconsistentKeys(_)) => Err(CertError::KeyMismatch {
            cert: files.cert.clone(),
            key: files.key.clone(),
        }),
        Err(e) => Err(CertError::InFile {
            path: files.cert.clone(),
            source: Box::new(CertError::Parse(e.to_string())),
        }),
    }
}

/// A rustls error while building a config, with the files named.
fn tls_error(err: rustls::Error, files: &MeshTlsFiles) -> CertError {
    match err {
        rustls::Error::InconsistentKeys(_) => CertError::KeyMismatch {
            cert: files.cert.clone(),
            key: files.key.clone(),
        },
        other => CertError::Tls(other),
    }
}

fn unix_time_text(at: UnixTime) -> String {
    crate::inspect::rfc3339(i64::try_from(at.as_secs()).unwrap_or(i64::MAX))
}

/// Why our own leaf fails the check a peer would make, and what to do about it.
fn explain_own_leaf_error(err: &rustls::Error) -> String {
    use rustls::Error as E;
    match err {
        E::InvalidCertificate(cert_err) => match cert_err {
            CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                "it was not issued by a CA in the bundle (not issued by the mesh CA): \
                 re-issue the leaf from a CA in the bundle, or add its CA to the bundle"
                    .into()
            }
            // The context's verification time is left out: the reason a file is refused
            // must read the same at every check.
            CertificateError::ExpiredContext { not_after, .. } => format!(
                "it has expired (not valid after {}): install a leaf from `mcpgw certs \
                 issue` or `mcpgw certs rotate reissue`",
                unix_time_text(*not_after)
            ),
            CertificateError::Expired => "it has expired: install a leaf from `mcpgw certs \
                issue` or `mcpgw certs rotate reissue`"
                .into(),
            CertificateError::NotValidYetContext { not_before, .. } => format!(
                "it is not valid yet (not before {}): check this host's clock",
                unix_time_text(*not_before)
            ),
            CertificateError::NotValidYet => "it is not valid yet: check this host's clock".into(),
            other => format!(
                "{} (issue mesh leaves with `mcpgw certs issue`)",
                explain_tls_error(&E::InvalidCertificate(other.clone()))
            ),
        },
        other => explain_tls_error(other),
    }
}

/// Explains a handshake error from a mesh connection in words that say what to do.
/// Transports should log this rather than the bare rustls error.
pub fn explain_tls_error(err: &rustls::Error) -> String {
    use rustls::Error as E;
    match err {
        E::InvalidCertificate(cert_err) => match cert_err {
            // BadSignature: a CA of the same name as one of ours signed it (every CA of an
            // older `mcpgw certs init` had the same name).
            CertificateError::UnknownIssuer | CertificateError::BadSignature => "mesh peer \
                presented a certificate not issued by \
                the mesh CA (during CA rotation both CAs must be in every member's bundle)"
                .into(),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => format!(
                "mesh peer's certificate has expired ({cert_err}): re-issue it with \
                 `mcpgw certs issue`"
            ),
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                format!("mesh peer's certificate is not valid yet ({cert_err}): check the clocks")
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!(
                    "mesh peer's certificate is not a mesh leaf ({cert_err}): every mesh leaf \
                     carries DNS SAN {MESH_SERVER_NAME}; issue it with `mcpgw certs issue`"
                )
            }
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                format!(
                    "mesh peer's certificate lacks the serverAuth/clientAuth extended key usage \
                     ({cert_err}); issue it with `mcpgw certs issue`"
                )
            }
            other => format!("mesh peer presented an invalid certificate: {other}"),
        },
        E::NoCertificatesPresented => "mesh peer presented no client certificate: every mesh \
            member must present a leaf from the mesh CA"
            .into(),
        E::AlertReceived(alert) => match alert {
            AlertDescription::UnknownCA => "mesh peer refused our certificate: it does not \
                trust our CA (during CA rotation add the new CA to every bundle first)"
                .into(),
            AlertDescription::CertificateRequired => {
                "mesh peer requires a client certificate from the mesh CA".into()
            }
            AlertDescription::CertificateExpired => {
                "mesh peer refused our certificate as expired or not yet valid: re-issue it \
                 or check the clocks"
                    .into()
            }
            AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::AccessDenied
            | AlertDescription::HandshakeFailure => format!(
                "mesh peer refused the handshake ({alert:?}): check that our leaf is from the \
                 mesh CA and carries a mesh identity of our trust domain \
                 (URI SAN spiffe://<trust domain>/mesh/...)"
            ),
            other => format!("mesh peer aborted the handshake ({other:?})"),
        },
        // Our own identity check puts a CertError here; its text already says what to do.
        E::Other(other) => other.to_string(),
        other => other.to_string(),
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, CertError> {
    std::fs::read(path).map_err(|source| CertError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// All certificates in PEM bytes, in order. Non-certificate blocks are skipped.
pub(crate) fn parse_certs(
    bytes: &[u8],
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| CertError::NoCertificates {
            path: path.to_path_buf(),
        })?;
    if certs.is_empty() {
        return Err(CertError::NoCertificates {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// All certificates in a PEM file, in file order.
pub(crate) fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    parse_certs(&read_file(path)?, path)
}

/// The first private key in PEM bytes. Parse errors are not echoed: they could quote
/// parts of the key.
pub(crate) fn parse_key(bytes: &[u8], path: &Path) -> Result<PrivateKeyDer<'static>, CertError> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|_| CertError::NoPrivateKey {
        path: path.to_path_buf(),
    })
}

fn root_store(bundle: &[CertificateDer<'static>], path: &Path) -> Result<RootCertStore, CertError> {
    let mut roots = RootCertStore::empty();
    for cert in bundle {
        roots.add(cert.clone()).map_err(|e| CertError::BadCa {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// A root store holding every CA certificate in a PEM bundle (one or more CAs; during
/// rotation the old and the new).
pub fn load_ca_bundle(path: &Path) -> Result<RootCertStore, CertError> {
    root_store(&read_certs(path)?, path)
}
