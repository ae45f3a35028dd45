//! An in-process mesh PKI for transport tests: a CA made with `mcpgw-certs` and
//! leaves for any member name, in a temporary directory.

use std::sync::Arc;
use std::time::Duration;

use mcpgw_certs::{MeshTls, MeshTlsFiles, Pem, generate_ca, issue_leaf, write_pem_files};

/// Validity of test certificates: long enough never to matter.
pub const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// A mesh CA and a directory for its members' files.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: Pem,
}

impl Pki {
    #[track_caller]
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let ca = generate_ca(name, YEAR).unwrap_or_else(|e| panic!("CA {name}: {e}"));
        std::fs::write(dir.path().join("ca.crt"), &ca.cert)
            .unwrap_or_else(|e| panic!("write CA: {e}"));
        Self { dir, ca }
    }

    /// A leaf for `name`, written beside the CA and loaded.
    #[track_caller]
    pub fn member(&self, name: &str) -> MeshTls {
        let leaf = issue_leaf(&self.ca, name, YEAR).unwrap_or_else(|e| panic!("leaf: {e}"));
        write_pem_files(self.dir.path(), name, &leaf).unwrap_or_else(|e| panic!("write: {e}"));
        MeshTls::load(&MeshTlsFiles::in_dir(self.dir.path(), name))
            .unwrap_or_else(|e| panic!("load member {name}: {e}"))
    }

    /// A client config that trusts the mesh CA but presents no certificate.
    #[track_caller]
    pub fn anonymous_client(&self) -> Arc<rustls::ClientConfig> {
        let roots = mcpgw_certs::load_ca_bundle(&self.dir.path().join("ca.crt"))
            .unwrap_or_else(|e| panic!("bundle: {e}"));
        let verifier = mcpgw_certs::MeshServerCertVerifier::with_roots(Arc::new(roots))
            .unwrap_or_else(|e| panic!("verifier: {e}"));
        let config = rustls::ClientConfig::builder_with_provider(mcpgw_certs::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap_or_else(|e| panic!("TLS 1.3: {e}"))
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        Arc::new(config)
    }
}
