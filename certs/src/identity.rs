//! Mesh identity: the URI SAN that names a mesh member, the trust domain it belongs to,
//! and how to read both back from a certificate.
//!
//! An identity is `spiffe://{trust domain}/mesh/{member}`. The trust domain separates
//! meshes that might share a CA (staging and production, two tenants); a peer is a
//! member only when its identity is in the configured trust domain.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

use crate::CertError;

/// DNS SAN that every mesh leaf carries, so a peer can dial any IP with this server name.
pub const MESH_SERVER_NAME: &str = "mesh.mcpgw.internal";

/// The trust domain used when none is configured.
pub const DEFAULT_TRUST_DOMAIN: &str = "mcpgw";

/// Prefix of the URI SAN that names a mesh member of the default trust domain:
/// `MESH_URI_PREFIX + member name`.
pub const MESH_URI_PREFIX: &str = "spiffe://mcpgw/mesh/";

/// Longest member name accepted; keeps identities readable in logs and Redis keys.
const MAX_MEMBER_NAME: usize = 128;

/// Longest trust domain accepted (a DNS name's limit, as SPIFFE has it).
const MAX_TRUST_DOMAIN: usize = 255;

/// The path segment between trust domain and member name.
const MESH_PATH: &str = "/mesh/";

/// A validated trust domain: lowercase letters, digits, `.`, `-` and `_`, as SPIFFE
/// allows, so that it needs no escaping in a URI and compares byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TrustDomain(String);

impl TrustDomain {
    /// Checks `name` and wraps it.
    pub fn new(name: &str) -> Result<Self, CertError> {
        let ok = !name.is_empty()
            && name.len() <= MAX_TRUST_DOMAIN
            && name.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
            });
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(CertError::InvalidTrustDomain {
                name: name.to_owned(),
            })
        }
    }

    /// The trust domain as written in identities.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The identity URI of `member` in this trust domain.
    pub fn member_uri(&self, member: &str) -> Result<String, CertError> {
        validate_member_name(member)?;
        Ok(format!("spiffe://{}{MESH_PATH}{member}", self.0))
    }

    /// Reads the mesh member name from a DER leaf certificate's URI SANs.
    ///
    /// Exactly one mesh identity must be present and it must be of this trust domain.
    /// No identity, two identities (the certificate could act as either), or an
    /// identity of another trust domain are errors that say which.
    pub fn member_of(&self, cert_der: &[u8]) -> Result<String, CertError> {
        let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
            .map_err(|e| CertError::Parse(e.to_string()))?;
        self.member_of_parsed(&cert)
    }

    pub(crate) fn member_of_parsed(
        &self,
        cert: &x509_parser::certificate::X509Certificate<'_>,
    ) -> Result<String, CertError> {
        let identities = spiffe_identities(cert)?;
        let mut found: Option<(String, String)> = None;
        for (domain, path, uri) in identities {
            if domain != self.0 {
                return Err(CertError::ForeignTrustDomain {
                    uri,
                    expected: self.0.clone(),
                });
            }
            let Some(member) = path.strip_prefix(MESH_PATH) else {
                continue;
            };
            if found.is_some() {
                return Err(CertError::NotMeshMember {
                    trust_domain: self.0.clone(),
                    detail: "the certificate carries more than one mesh identity".into(),
                });
            }
            found = Some((member.to_owned(), uri));
        }
        let Some((member, uri)) = found else {
            return Err(CertError::NotMeshMember {
                trust_domain: self.0.clone(),
                detail: "no URI SAN names a mesh member".into(),
            });
        };
        validate_member_name(&member).map_err(|_| CertError::NotMeshMember {
            trust_domain: self.0.clone(),
            detail: format!("the identity {uri} names an invalid member"),
        })?;
        Ok(member)
    }
}

impl Default for TrustDomain {
    fn default() -> Self {
        Self(DEFAULT_TRUST_DOMAIN.to_owned())
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for TrustDomain {
    type Err = CertError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// Every `spiffe://` URI SAN of a certificate as (trust domain, path, whole URI).
fn spiffe_identities(
    cert: &x509_parser::certificate::X509Certificate<'_>,
) -> Result<Vec<(String, String, String)>, CertError> {
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CertError::Parse(format!("subjectAltName extension: {e}")))?;
    let Some(san) = san else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for name in &san.value.general_names {
        let GeneralName::URI(uri) = name else {
            continue;
        };
        let Some(rest) = uri.strip_prefix("spiffe://") else {
            continue;
        };
        let (domain, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        out.push((domain.to_owned(), path.to_owned(), (*uri).to_owned()));
    }
    Ok(out)
}

/// Every URI SAN of a certificate, for display.
pub(crate) fn uri_sans(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some((*uri).to_owned()),
            _ => None,
        })
        .collect()
}

/// Checks that `name` can be a mesh identity. The alphabet is kept small so that the URI
/// SAN needs no escaping and the name reads the same in a certificate, a log line and a
/// Redis key.
pub fn validate_member_name(name: &str) -> Result<(), CertError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_MEMBER_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(CertError::InvalidMemberName {
            name: name.to_owned(),
        })
    }
}

/// The identity URI for a member of the default trust domain: `spiffe://mcpgw/mesh/{name}`.
pub fn mesh_uri(member_name: &str) -> Result<String, CertError> {
    TrustDomain::default().member_uri(member_name)
}

/// Reads the mesh member name from a DER leaf certificate of the default trust domain.
///
/// A mesh configured with another trust domain reads identities with
/// [`TrustDomain::member_of`] or [`crate::MeshTls::peer`].
pub fn peer_identity(cert_der: &[u8]) -> Result<String, CertError> {
    TrustDomain::default().member_of(cert_der)
}

/// Who a verified mesh peer is, and until when its certificate is valid: what a
/// transport records after a handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The member name from the identity URI (`host-a`, `host-a:w3`).
    pub member: String,
    /// The whole identity URI, `spiffe://{trust domain}/mesh/{member}`.
    pub uri: String,
    /// End of the peer leaf's validity. A connection should not outlive it: the peer
    /// would be refused by a new handshake from then on.
    pub not_after: SystemTime,
    /// SHA-256 of the peer's leaf, as `mcpgw certs inspect` prints it: tells which
    /// certificate a connection was made with (before or after a rotation).
    pub leaf_fingerprint: String,
}

impl PeerIdentity {
    /// Reads identity and expiry from a peer's certificate chain as rustls or quinn
    /// hand it over (leaf first). Use it only on a chain that the mesh verifiers
    /// accepted: it checks the identity, not the signature.
    pub fn from_chain(
        chain: &[CertificateDer<'_>],
        trust_domain: &TrustDomain,
    ) -> Result<Self, CertError> {
        let Some(leaf) = chain.first() else {
            return Err(CertError::NotMeshMember {
                trust_domain: trust_domain.to_string(),
                detail: "the peer presented no certificate".into(),
            });
        };
        let (_, cert) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| CertError::Parse(e.to_string()))?;
        let member = trust_domain.member_of_parsed(&cert)?;
        let uri = trust_domain.member_uri(&member)?;
        Ok(Self {
            member,
            uri,
            not_after: not_after(&cert),
            leaf_fingerprint: crate::inspect::sha256_fingerprint(leaf),
        })
    }

    /// Time left until the peer's certificate expires (zero once it has).
    pub fn expires_in(&self) -> Duration {
        self.not_after
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
    }
}

/// A certificate's `not_after` as a `SystemTime` (dates before 1970 clamp to the epoch).
pub(crate) fn not_after(cert: &x509_parser::certificate::X509Certificate<'_>) -> SystemTime {
    let secs = cert.validity().not_after.timestamp();
    SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trust_domains_are_lowercase_dns_like_names() {
        for good in ["mcpgw", "prod.example.com", "a-b_c.9"] {
            assert_eq!(TrustDomain::new(good).unwrap().as_str(), good);
        }
        for bad in ["", "Prod", "a/b", "a b", "spiffe://x", "é"] {
            assert!(TrustDomain::new(bad).is_err(), "{bad:?}");
        }
        assert!(TrustDomain::new(&"d".repeat(255)).is_ok());
        assert!(TrustDomain::new(&"d".repeat(256)).is_err());
        assert_eq!(
            TrustDomain::new("prod")
                .unwrap()
                .member_uri("host-a:w1")
                .unwrap(),
            "spiffe://prod/mesh/host-a:w1"
        );
        assert_eq!(mesh_uri("x").unwrap(), format!("{MESH_URI_PREFIX}x"));
    }
}
