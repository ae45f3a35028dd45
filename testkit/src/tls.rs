//! TLS for tests that need an `https://` peer: a CA made for one test with the leaves
//! it issues (for 127.0.0.1), and a TLS terminator in front of any plain TCP server
//! (the demo upstream, a stand-in collector), optionally requiring client certificates.

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A CA made for one test, and the certificates it issues, as PEM files.
pub struct TestCa {
    pub dir: PathBuf,
    name: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-test-ca-{name}-{}-{}",
            std::process::id(),
            crate::free_port()
        ));
        std::fs::create_dir_all(&dir).expect("CA dir");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} test CA"));
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        std::fs::write(dir.join("ca.crt"), cert.pem()).expect("write CA");
        TestCa {
            dir,
            name: name.to_owned(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// A leaf for 127.0.0.1 (server and client use): its certificate and key files.
    pub fn issue(&self, leaf: &str) -> (PathBuf, PathBuf) {
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("leaf params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{} {leaf}", self.name));
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf");
        let (cert_file, key_file) = (
            self.dir.join(format!("{leaf}.crt")),
            self.dir.join(format!("{leaf}.key")),
        );
        std::fs::write(&cert_file, cert.pem()).expect("write leaf");
        std::fs::write(&key_file, key.serialize_pem()).expect("write key");
        (cert_file, key_file)
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// TLS in front of a plain TCP backend (the demo upstream), on its own runtime.
pub struct TlsTerminator {
    pub addr: String,
    _runtime: tokio::runtime::Runtime,
}

impl TlsTerminator {
    /// Serves `cert`/`key`; with `client_ca`, only clients with a leaf of that CA.
    pub fn start(backend: &str, cert: &Path, key: &Path, client_ca: Option<&Path>) -> Self {
        let config = server_config(cert, key, client_ca);
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind TLS terminator");
        let addr = listener.local_addr().expect("addr").to_string();
        let backend = backend.to_owned();
        runtime.spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let backend = backend.clone();
                tokio::spawn(async move {
                    // A refused handshake is what some tests are about: nothing to do.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut plain) = tokio::net::TcpStream::connect(&backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsTerminator {
            addr,
            _runtime: runtime,
        }
    }
}

/// A TLS server configuration serving `cert`/`key` (PEM files); with `client_ca`, only
/// clients with a leaf of that CA are let in.
pub fn server_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> rustls::ServerConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    mcpgw_certs::install_crypto_provider();
    let chain = CertificateDer::pem_file_iter(cert)
        .expect("server cert")
        .collect::<Result<Vec<_>, _>>()
        .expect("server cert PEM");
    let key = PrivateKeyDer::from_pem_file(key).expect("server key");
    let builder = rustls::ServerConfig::builder();
    let builder = match client_ca {
        Some(ca) => {
            let roots = mcpgw_certs::load_ca_bundle(ca).expect("client CA");
            let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    builder.with_single_cert(chain, key).expect("server config")
}
