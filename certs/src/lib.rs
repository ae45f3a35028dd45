//! Mesh certificates for mcpgw: a private CA, leaf issuance, and the rustls configs
//! that make every mesh connection mutually authenticated.
//!
//! Every mesh member (a host or a worker) holds a leaf certificate signed by the mesh
//! CA. The leaf carries two names:
//!
//! - the DNS SAN [`MESH_SERVER_NAME`], the same for every leaf, so a peer can dial any
//!   IP address and still verify the server chain with ordinary webpki name checks;
//! - a URI SAN `spiffe://{trust domain}/mesh/{member}` ([`MESH_URI_PREFIX`]`{member}`
//!   in the default trust domain): the member's identity. webpki ignores URI SANs, so
//!   this crate checks it itself inside the rustls verifiers: a handshake with a
//!   certificate that chains to the mesh CA but carries no mesh identity fails.
//!
//! The identity's trust domain is configurable ([`TrustDomain`], default `mcpgw`); a
//! peer of another trust domain is refused like one without an identity.
//!
//! - [`MeshTls`]: configs built from PEM files after checking them the way a peer will
//!   (no TLS session resumption: a resumed session would skip those checks).
//! - [`MeshTlsSource`]: the same, following the files: a worker reloads a new bundle,
//!   leaf or key without a restart, and refuses a bad one while keeping the old.
//! - [`CertDir`] and [`rotate`]: the directory `mcpgw certs` manages, and staged CA
//!   rotation (`begin`, `reissue`, `finish`).
//! - [`inspect`]: what a set of certificates holds and what is wrong with it.
//!
//! All TLS here uses one crypto provider, aws-lc-rs ([`crypto_provider`]).
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod config;
mod error;
mod identity;
pub mod inspect;
mod issue;
mod reload;
pub mod rotate;
mod store;
mod verify;

pub use config::{
    MeshTls, MeshTlsFiles, MeshTlsSettings, client_config, explain_tls_error, load_ca_bundle,
    server_config,
};
pub use error::CertError;
pub use identity::{
    DEFAULT_TRUST_DOMAIN, MESH_SERVER_NAME, MESH_URI_PREFIX, PeerIdentity, TrustDomain, mesh_uri,
    peer_identity, validate_member_name,
};
pub use inspect::sha256_fingerprint;
pub use issue::{
    Pem, generate_ca, issue_leaf, issue_leaf_in, load_pem_files, write_file_atomically,
    write_pem_files,
};
pub use reload::{MeshTlsSource, ReloadOptions, ReloadOutcome, ReloadStats};
pub use store::{
    BUNDLE_FILE, CA_KEY_FILE, CertDir, DirError, DirState, IssuedLeaf, NEXT_CA_CERT_FILE,
    NEXT_CA_KEY_FILE, RotationRecord, STATE_FILE, Stage,
};
pub use verify::{MeshClientCertVerifier, MeshServerCertVerifier};

use std::sync::{Arc, OnceLock};

/// The one crypto provider of the workspace (aws-lc-rs), shared by every config this
/// crate builds. Configs name it explicitly so they never depend on which provider a
/// process happened to install as its default.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    static PROVIDER: OnceLock<Arc<rustls::crypto::CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .clone()
}

/// Installs aws-lc-rs as the process-wide default rustls provider, for libraries (quinn,
/// hyper clients) that build configs without naming a provider. Idempotent: if a default
/// is already installed, it is left alone.
pub fn install_crypto_provider() {
    // `install_default` fails only when a provider is already installed; that is the
    // idempotent case, so the error is ignored on purpose.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}
