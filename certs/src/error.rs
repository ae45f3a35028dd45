//! Errors of certificate issuance, loading and verification.

use std::path::PathBuf;

/// Everything that can go wrong issuing, loading or checking mesh certificates. Messages
/// name the file involved and what to do; none ever contains key material.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// A certificate or key file could not be read or written.
    #[error("could not access {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A file that should hold PEM certificates holds none (or is not PEM).
    #[error(
        "no PEM certificate found in {path}: expected one or more \"-----BEGIN CERTIFICATE-----\" \
         blocks (create them with `mcpgw certs init` / `mcpgw certs issue`)"
    )]
    NoCertificates {
        /// The file that was read.
        path: PathBuf,
    },
    /// A key file holds no usable private key. The file's content is never echoed.
    #[error(
        "no usable PEM private key found in {path}: expected a PKCS#8, SEC1 or PKCS#1 key \
         (re-issue it with `mcpgw certs issue`)"
    )]
    NoPrivateKey {
        /// The file that was read.
        path: PathBuf,
    },
    /// A member name cannot be used as a mesh identity.
    #[error(
        "invalid mesh member name {name:?}: use 1 to 128 characters from A-Z a-z 0-9 . _ - : \
         (a host or worker name)"
    )]
    InvalidMemberName {
        /// The rejected name.
        name: String,
    },
    /// A validity period of zero, or one too long to represent, was asked for.
    #[error("invalid certificate validity {0:?}: use a positive duration of at most a few decades")]
    InvalidValidity(std::time::Duration),
    /// rcgen refused to generate or sign a certificate (bad CA PEM, bad key, ...).
    #[error(
        "certificate generation failed: {0} (check that the CA certificate and key belong together)"
    )]
    Generate(#[from] rcgen::Error),
    /// Bytes that should be a DER X.509 certificate could not be parsed.
    #[error("could not parse certificate: {0}")]
    Parse(String),
    /// A trust domain that cannot be written into an identity URI.
    #[error(
        "invalid trust domain {name:?}: use 1 to 255 characters from a-z 0-9 . - _ \
         (for example \"mcpgw\" or \"prod.example.com\")"
    )]
    InvalidTrustDomain {
        /// The rejected name.
        name: String,
    },
    /// A certificate does not carry exactly one mesh identity of the trust domain.
    #[error(
        "certificate has no mesh identity (URI SAN spiffe://{trust_domain}/mesh/...): {detail}; \
         issue mesh leaves with `mcpgw certs issue`"
    )]
    NotMeshMember {
        /// The trust domain the identity was looked for in.
        trust_domain: String,
        /// What was found instead.
        detail: String,
    },
    /// A certificate's identity belongs to another trust domain than the configured one.
    #[error(
        "certificate identity {uri} is not of this mesh's trust domain {expected:?}: issue the \
         leaf from a certificate directory of trust domain {expected:?}, or configure the \
         trust domain the mesh really uses"
    )]
    ForeignTrustDomain {
        /// The identity URI found.
        uri: String,
        /// The configured trust domain.
        expected: String,
    },
    /// Our own leaf cannot be used with our own CA bundle, so no peer would accept it.
    #[error("the certificate in {cert} cannot be used with the CA bundle in {ca}: {reason}")]
    LeafNotTrusted {
        /// Leaf certificate file.
        cert: PathBuf,
        /// CA bundle file.
        ca: PathBuf,
        /// Why verification failed, and what to do.
        reason: String,
    },
    /// The private key does not belong to the certificate.
    #[error(
        "the private key in {key} does not belong to the certificate in {cert}: install the key \
         that was issued with this certificate (they are replaced together)"
    )]
    KeyMismatch {
        /// Certificate file.
        cert: PathBuf,
        /// Key file.
        key: PathBuf,
    },
    /// A certificate from a file was refused; `source` says why.
    #[error("{path}: {source}")]
    InFile {
        /// The file holding the refused certificate.
        path: PathBuf,
        /// Why it was refused.
        source: Box<CertError>,
    },
    /// A CA certificate could not be used as a trust anchor.
    #[error("the CA bundle in {path} holds an unusable CA certificate: {reason}")]
    BadCa {
        /// CA bundle file.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },
    /// A reloading source was started outside a tokio runtime.
    #[error("the mesh certificate reloader needs a tokio runtime: start it from inside one")]
    NoRuntime,
    /// rustls refused the assembled configuration (e.g. key does not match certificate).
    #[error("TLS configuration rejected: {0} (check that the key file belongs to the certificate)")]
    Tls(#[from] rustls::Error),
}
