//! rustls verifiers that add the mesh identity check to webpki's chain check.
//!
//! webpki verifies the chain, validity, EKU and (for servers) the DNS name, but it does
//! not look at URI SANs. These wrappers delegate everything to webpki and then require
//! a mesh identity of the configured trust domain on the end-entity certificate, so a
//! certificate that merely chains to the mesh CA is not enough to join the mesh.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use rustls::{
    DigitallySignedStruct, DistinguishedName, OtherError, RootCertStore, SignatureScheme,
};

use crate::{MESH_SERVER_NAME, TrustDomain, crypto_provider};

/// Turns a failed identity check into a rustls error whose text says what to do.
fn identity_error(err: crate::CertError) -> rustls::Error {
    rustls::Error::Other(OtherError(Arc::new(err)))
}

/// Server-side verifier of client certificates: webpki chain check against the mesh CA
/// bundle, then a mesh identity of the trust domain. Client authentication is mandatory.
#[derive(Debug)]
pub struct MeshClientCertVerifier {
    /// webpki's verifier over the mesh CA bundle; does everything but the identity check.
    inner: Arc<dyn ClientCertVerifier>,
    /// The only trust domain whose identities are accepted.
    trust_domain: TrustDomain,
}

impl MeshClientCertVerifier {
    /// Wraps a webpki client verifier (built with client auth mandatory); identities of
    /// the default trust domain.
    pub fn new(inner: Arc<dyn ClientCertVerifier>) -> Self {
        Self {
            inner,
            trust_domain: TrustDomain::default(),
        }
    }

    /// The mesh verifier over a CA bundle for the default trust domain.
    pub fn with_roots(roots: Arc<RootCertStore>) -> Result<Self, VerifierBuilderError> {
        Self::for_trust_domain(roots, TrustDomain::default())
    }

    /// The mesh verifier over a CA bundle, accepting identities of `trust_domain` only.
    pub fn for_trust_domain(
        roots: Arc<RootCertStore>,
        trust_domain: TrustDomain,
    ) -> Result<Self, VerifierBuilderError> {
        let inner =
            WebPkiClientVerifier::builder_with_provider(roots, crypto_provider()).build()?;
        Ok(Self {
            inner,
            trust_domain,
        })
    }
}

impl ClientCertVerifier for MeshClientCertVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        // Mesh peers must prove membership; an anonymous client is never a mesh worker.
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        self.trust_domain
            .member_of(end_entity)
            .map_err(identity_error)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        self.inner.requires_raw_public_keys()
    }
}

/// Client-side verifier of server certificates: webpki chain check against the mesh CA
/// bundle with the DNS name [`MESH_SERVER_NAME`], then a mesh identity of the trust
/// domain.
///
/// The name the caller dials is ignored on purpose: peers are dialled by IP address,
/// every mesh leaf carries the same DNS SAN, and a member is told apart by its URI SAN
/// (read it after the handshake with [`crate::MeshTls::peer`] to check it is the worker
/// you meant to reach).
#[derive(Debug)]
pub struct MeshServerCertVerifier {
    /// webpki's verifier over the mesh CA bundle; does everything but the identity check.
    inner: Arc<dyn ServerCertVerifier>,
    /// The only trust domain whose identities are accepted.
    trust_domain: TrustDomain,
}

impl MeshServerCertVerifier {
    /// Wraps a webpki server verifier; identities of the default trust domain.
    pub fn new(inner: Arc<dyn ServerCertVerifier>) -> Self {
        Self {
            inner,
            trust_domain: TrustDomain::default(),
        }
    }

    /// The mesh verifier over a CA bundle for the default trust domain.
    pub fn with_roots(roots: Arc<RootCertStore>) -> Result<Self, VerifierBuilderError> {
        Self::for_trust_domain(roots, TrustDomain::default())
    }

    /// The mesh verifier over a CA bundle, accepting identities of `trust_domain` only.
    pub fn for_trust_domain(
        roots: Arc<RootCertStore>,
        trust_domain: TrustDomain,
    ) -> Result<Self, VerifierBuilderError> {
        let inner =
            WebPkiServerVerifier::builder_with_provider(roots, crypto_provider()).build()?;
        Ok(Self {
            inner,
            trust_domain,
        })
    }
}

impl ServerCertVerifier for MeshServerCertVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let mesh_name = ServerName::try_from(MESH_SERVER_NAME)
            .map_err(|e| rustls::Error::General(format!("mesh server name: {e}")))?;
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            &mesh_name,
            ocsp_response,
            now,
        )?;
        self.trust_domain
            .member_of(end_entity)
            .map_err(identity_error)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        self.inner.requires_raw_public_keys()
    }

    fn root_hint_subjects(&self) -> Option<&[DistinguishedName]> {
        self.inner.root_hint_subjects()
    }
}
