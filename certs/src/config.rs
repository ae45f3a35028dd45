//! rustls configs for the mesh, built from PEM files in one place.
//!
//! Building every config here (and only here) is what lets rotation and reloading be
//! added later without touching the transports: they ask [`MeshTls`] for configs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::{AlertDescription, CertificateError, ClientConfig, RootCertStore, ServerConfig};

use crate::verify::{MeshClientCertVerifier, MeshServerCertVerifier};
use crate::{CertError, MESH_SERVER_NAME, crypto_provider, peer_identity};

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

/// A member's loaded and checked mesh TLS material: its identity and the configs built
/// from its files.
#[derive(Debug, Clone)]
pub struct MeshTls {
    /// Files this was loaded from; kept so a reload can read them again.
    files: MeshTlsFiles,
    /// Our own member name, from our leaf's URI SAN.
    identity: String,
    /// Config for accepting mesh connections.
    server: Arc<ServerConfig>,
    /// Config for dialling mesh peers.
    client: Arc<ClientConfig>,
}

impl MeshTls {
    /// Loads the files and builds both configs. Our own leaf is checked first, the way a
    /// peer would check it (chain to the CA bundle, EKUs, DNS name, mesh identity), so a
    /// mismatched CA or leaf fails here with a clear error instead of at every handshake.
    pub fn load(files: &MeshTlsFiles) -> Result<Self, CertError> {
        let roots = Arc::new(load_ca_bundle(&files.ca)?);
        let chain = read_certs(&files.cert)?;
        let key = read_key(&files.key)?;
        let Some(leaf) = chain.first() else {
            return Err(CertError::NoCertificates {
                path: files.cert.clone(),
            });
        };

        let identity = peer_identity(leaf)?;

        let provider = crypto_provider();
        let bad_ca = |e: &dyn std::fmt::Display| CertError::BadCa {
            path: files.ca.clone(),
            reason: e.to_string(),
        };
        let client_verifier: Arc<dyn ClientCertVerifier> =
            Arc::new(MeshClientCertVerifier::with_roots(roots.clone()).map_err(|e| bad_ca(&e))?);
        let server_verifier: Arc<dyn ServerCertVerifier> =
            Arc::new(MeshServerCertVerifier::with_roots(roots).map_err(|e| bad_ca(&e))?);

        let now = UnixTime::now();
        let not_trusted = |e: rustls::Error| CertError::LeafNotTrusted {
            cert: files.cert.clone(),
            ca: files.ca.clone(),
            reason: explain_tls_error(&e),
        };
        let mesh_name = ServerName::try_from(MESH_SERVER_NAME)
            .map_err(|e| CertError::Parse(format!("mesh server name: {e}")))?;
        client_verifier
            .verify_client_cert(leaf, &chain[1..], now)
            .map_err(not_trusted)?;
        server_verifier
            .verify_server_cert(leaf, &chain[1..], &mesh_name, &[], now)
            .map_err(not_trusted)?;

        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(server_verifier)
            .with_client_auth_cert(chain, key)?;

        Ok(Self {
            files: files.clone(),
            identity,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }

    /// The files this was loaded from.
    pub fn files(&self) -> &MeshTlsFiles {
        &self.files
    }

    /// Our own mesh member name (from our leaf's URI SAN).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Config for accepting mesh connections: TLS 1.3 only, client certificate required.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// Config for dialling mesh peers: TLS 1.3 only, presents our leaf.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }
}

/// Server config for accepting mesh connections (see [`MeshTls::server_config`]).
///
/// TLS 1.3 only. A client must present a certificate that chains to a CA in `files.ca`
/// and carries a mesh URI SAN, or the handshake fails.
pub fn server_config(files: &MeshTlsFiles) -> Result<Arc<ServerConfig>, CertError> {
    Ok(MeshTls::load(files)?.server_config())
}

/// Client config for dialling mesh peers (see [`MeshTls::client_config`]).
///
/// TLS 1.3 only. Presents our leaf; the server must present a certificate that chains to
/// a CA in `files.ca`, is valid for [`MESH_SERVER_NAME`] (whatever name is dialled) and
/// carries a mesh URI SAN.
pub fn client_config(files: &MeshTlsFiles) -> Result<Arc<ClientConfig>, CertError> {
    Ok(MeshTls::load(files)?.client_config())
}

/// Explains a handshake error from a mesh connection in words that say what to do.
/// Transports should log this rather than the bare rustls error.
pub fn explain_tls_error(err: &rustls::Error) -> String {
    use rustls::Error as E;
    match err {
        E::InvalidCertificate(cert_err) => match cert_err {
            CertificateError::UnknownIssuer => "mesh peer presented a certificate not issued by \
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
                 mesh CA and carries a mesh identity (URI SAN spiffe://mcpgw/mesh/...)"
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

/// All certificates in a PEM file, in file order. Non-certificate blocks are skipped.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let bytes = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
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

/// The first private key in a PEM file. Parse errors are not echoed: they could quote
/// parts of the key.
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, CertError> {
    let bytes = read_file(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| CertError::NoPrivateKey {
        path: path.to_path_buf(),
    })
}

/// A root store holding every CA certificate in a PEM bundle (one or more CAs; during
/// rotation the old and the new).
pub fn load_ca_bundle(path: &Path) -> Result<RootCertStore, CertError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|e| CertError::BadCa {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}
