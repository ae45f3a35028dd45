//! Mesh identity: the URI SAN that names a mesh member, and how to read it back.

use crate::CertError;
use x509_parser::extensions::GeneralName;

/// DNS SAN that every mesh leaf carries, so a peer can dial any IP with this server name.
pub const MESH_SERVER_NAME: &str = "mesh.mcpgw.internal";

/// Prefix of the URI SAN that names a mesh member: `MESH_URI_PREFIX + member name`.
pub const MESH_URI_PREFIX: &str = "spiffe://mcpgw/mesh/";

/// Longest member name accepted; keeps identities readable in logs and Redis keys.
const MAX_MEMBER_NAME: usize = 128;

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

/// The identity URI for a member: `spiffe://mcpgw/mesh/{name}`.
pub fn mesh_uri(member_name: &str) -> Result<String, CertError> {
    validate_member_name(member_name)?;
    Ok(format!("{MESH_URI_PREFIX}{member_name}"))
}

/// Reads the mesh member name from a DER leaf certificate's URI SAN.
///
/// Exactly one URI SAN with the mesh prefix and a valid member name must be present;
/// anything else means the peer is not a mesh member (or is ambiguous), and is an error.
pub fn peer_identity(cert_der: &[u8]) -> Result<String, CertError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| CertError::Parse(e.to_string()))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CertError::Parse(format!("subjectAltName extension: {e}")))?;
    let Some(san) = san else {
        return Err(CertError::NotMeshMember {
            detail: "the certificate has no subjectAltName extension".into(),
        });
    };
    let mut found: Option<&str> = None;
    for name in &san.value.general_names {
        let GeneralName::URI(uri) = name else {
            continue;
        };
        let Some(member) = uri.strip_prefix(MESH_URI_PREFIX) else {
            continue;
        };
        if found.is_some() {
            // Two identities in one certificate would let it act as either; refuse.
            return Err(CertError::NotMeshMember {
                detail: "the certificate carries more than one mesh URI SAN".into(),
            });
        }
        found = Some(member);
    }
    let Some(member) = found else {
        return Err(CertError::NotMeshMember {
            detail: "no URI SAN starts with spiffe://mcpgw/mesh/".into(),
        });
    };
    validate_member_name(member).map_err(|_| CertError::NotMeshMember {
        detail: format!("the mesh URI SAN names an invalid member {member:?}"),
    })?;
    Ok(member.to_owned())
}
