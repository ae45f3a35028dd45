//! TLS towards `https://` upstreams (and an `https://` OTLP collector): which CAs to
//! trust (the platform's roots, or a bundle configured per upstream), the client
//! certificate for upstreams that require mutual TLS, and handshake failures explained
//! in words that say what to change.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::client::WantsClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{AlertDescription, CertificateError, ClientConfig, ConfigBuilder, RootCertStore};

use crate::config::UpstreamTls;

/// The rustls client configuration of one upstream. `name` only labels errors.
pub fn client_config(name: &str, tls: &UpstreamTls) -> Result<Arc<ClientConfig>, String> {
    let builder =
        trusting(tls.ca.as_deref(), "tls_ca").map_err(|e| format!("upstream {name}: {e}"))?;
    // ALPN is left to the connector (it offers HTTP/1.1), which insists on setting it.
    let config = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    format!(
                        "upstream {name}: tls_client_cert {}: no PEM certificate ({e})",
                        cert.display()
                    )
                })?;
            if chain.is_empty() {
                return Err(format!(
                    "upstream {name}: tls_client_cert {} holds no certificate",
                    cert.display()
                ));
            }
            // The parse error is not echoed: it could quote parts of the key.
            let key = PrivateKeyDer::from_pem_file(key).map_err(|_| {
                format!(
                    "upstream {name}: tls_client_key {} holds no PEM private key",
                    key.display()
                )
            })?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                format!("upstream {name}: the client certificate and key do not fit: {e}")
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// A TLS client configuration, up to its client certificate, that trusts the CAs of
/// the PEM bundle at `ca` (the setting `ca_setting` names it, for errors), else the
/// platform's root certificates.
pub(crate) fn trusting(
    ca: Option<&Path>,
    ca_setting: &str,
) -> Result<ConfigBuilder<ClientConfig, WantsClientCert>, String> {
    let roots = match ca {
        Some(path) => ca_bundle(path).map_err(|e| format!("{ca_setting}: {e}"))?,
        None => platform_roots()?.clone(),
    };
    with_roots(roots)
}

/// A TLS client configuration, up to its client certificate, that trusts `roots`.
pub(crate) fn with_roots(
    roots: RootCertStore,
) -> Result<ConfigBuilder<ClientConfig, WantsClientCert>, String> {
    Ok(
        ClientConfig::builder_with_provider(mcpgw_certs::crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?
            .with_root_certificates(roots),
    )
}

/// The CAs of a PEM bundle.
fn ca_bundle(path: &std::path::Path) -> Result<RootCertStore, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{} is not a PEM certificate bundle ({e})", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no certificate", path.display()));
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| format!("{} holds an unusable CA certificate ({e})", path.display()))?;
    }
    Ok(roots)
}

/// The platform's root certificates (`SSL_CERT_FILE` / `SSL_CERT_DIR` when set), read
/// once per process.
fn platform_roots() -> Result<&'static RootCertStore, String> {
    static ROOTS: OnceLock<Result<RootCertStore, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default();
                return Err(format!(
                    "no platform root certificates found{why}: install the ca-certificates \
                     package, set SSL_CERT_FILE, or give a CA bundle (an upstream's tls_ca, \
                     the OTLP collector's otlp_ca)"
                ));
            }
            Ok(roots)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The TLS error somewhere in an error's chain, if the failure was a handshake. An
/// `io::Error` hides what it wraps from `source()` (and connectors wrap it in another
/// `io::Error`), so each one is opened too.
pub fn find_tls_error<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        let mut wrapped = e.downcast_ref::<std::io::Error>();
        while let Some(inner) = wrapped.and_then(|io| io.get_ref()) {
            if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
                return Some(tls);
            }
            wrapped = inner.downcast_ref::<std::io::Error>();
        }
        current = e.source();
    }
    None
}

/// A handshake failure with an upstream, in words that say what to change.
pub fn explain(error: &rustls::Error) -> String {
    use rustls::Error as E;
    match error {
        E::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer => "its certificate is not signed by a CA this \
                gateway trusts: give the upstream a tls_ca bundle with the CA that issued it \
                (or add that CA to the platform's roots)"
                .into(),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                format!("its certificate has expired ({cert})")
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                format!("its certificate is not valid yet ({cert}): check the clocks")
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!(
                    "its certificate does not name the host in the upstream URL ({cert}): use \
                     the name the certificate was issued for"
                )
            }
            other => format!("it presented an invalid certificate ({other})"),
        },
        E::AlertReceived(AlertDescription::CertificateRequired)
        | E::AlertReceived(AlertDescription::HandshakeFailure) => "it refused the handshake \
            (it may require a client certificate: set tls_client_cert and tls_client_key)"
            .into(),
        E::AlertReceived(
            alert @ (AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::AccessDenied),
        ) => format!("it refused our client certificate ({alert:?})"),
        other => format!("the TLS handshake failed ({other})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Connect(std::io::Error);
    impl std::fmt::Display for Connect {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("client error (Connect)")
        }
    }
    impl std::error::Error for Connect {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_certificate_error_inside_an_io_error_is_found_and_explained() {
        let tls = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let inner = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        let wrapped = Connect(std::io::Error::other(inner));
        let found = find_tls_error(&wrapped).expect("the TLS error is in the chain");
        assert!(explain(found).contains("tls_ca"), "{}", explain(found));
        let refused = Connect(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(find_tls_error(&refused).is_none());
    }
}
