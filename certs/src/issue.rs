//! Issuing the mesh CA and its leaves, and storing them as PEM files.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

use crate::{CertError, MESH_SERVER_NAME, TrustDomain};

/// Back-dating of `not_before`, so a peer whose clock is a little behind ours still
/// accepts a certificate issued a moment ago.
const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);

/// A certificate and its private key, both PEM. `Debug` never prints the key.
#[derive(Clone)]
pub struct Pem {
    /// The certificate, PEM (`-----BEGIN CERTIFICATE-----`).
    pub cert: String,
    /// The private key, PKCS#8 PEM. Secret: never log it.
    pub key: String,
}

impl fmt::Debug for Pem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pem")
            .field("cert", &self.cert)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// Validity window `[now - skew, now + validity]`, capped at `cap` (the issuer's own
/// `not_after`, so a leaf never outlives its CA).
fn window(
    validity: Duration,
    cap: Option<OffsetDateTime>,
) -> Result<(OffsetDateTime, OffsetDateTime), CertError> {
    let now = OffsetDateTime::now_utc();
    let bad = || CertError::InvalidValidity(validity);
    if validity.is_zero() {
        return Err(bad());
    }
    let span = time::Duration::try_from(validity).map_err(|_| bad())?;
    let not_after = now.checked_add(span).ok_or_else(bad)?;
    // Anything past 9999 cannot be encoded as an X.509 GeneralizedTime.
    if not_after.year() > 9999 {
        return Err(bad());
    }
    let skew = time::Duration::try_from(CLOCK_SKEW).map_err(|_| bad())?;
    let not_before = now.checked_sub(skew).ok_or_else(bad)?;
    let not_after = match cap {
        Some(cap) if cap < not_after => cap,
        _ => not_after,
    };
    Ok((not_before, not_after))
}

/// Generates a new self-signed mesh CA (ECDSA P-256). Its path length is 0: it signs
/// leaves only.
pub fn generate_ca(common_name: &str, validity: Duration) -> Result<Pem, CertError> {
    let (not_before, not_after) = window(validity, None)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "mcpgw mesh");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = not_before;
    params.not_after = not_after;
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Issues a leaf for mesh member `member_name` of the default trust domain, signed by
/// `ca` (see [`issue_leaf_in`]).
pub fn issue_leaf(ca: &Pem, member_name: &str, validity: Duration) -> Result<Pem, CertError> {
    issue_leaf_in(ca, &TrustDomain::default(), member_name, validity)
}

/// Issues a leaf for mesh member `member_name` of `trust_domain`, signed by `ca`.
///
/// The leaf carries DNS SAN [`MESH_SERVER_NAME`], URI SAN
/// `spiffe://{trust_domain}/mesh/{name}`, and both serverAuth and clientAuth EKUs,
/// because every member both dials and accepts mesh connections. Its validity is capped
/// at the CA's.
pub fn issue_leaf_in(
    ca: &Pem,
    trust_domain: &TrustDomain,
    member_name: &str,
    validity: Duration,
) -> Result<Pem, CertError> {
    let uri = trust_domain.member_uri(member_name)?;
    let ca_not_after = ca_not_after(&ca.cert)?;
    let (not_before, not_after) = window(validity, Some(ca_not_after))?;

    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;

    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, member_name);
    dn.push(DnType::OrganizationName, "mcpgw mesh");
    params.distinguished_name = dn;
    params.subject_alt_names = vec![
        SanType::DnsName(MESH_SERVER_NAME.try_into()?),
        SanType::URI(uri.as_str().try_into()?),
    ];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;

    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// The `not_after` of the first certificate in a PEM string.
fn ca_not_after(cert_pem: &str) -> Result<OffsetDateTime, CertError> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| CertError::Parse(format!("CA certificate PEM: {e}")))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| CertError::Parse(format!("CA certificate: {e}")))?;
    Ok(cert.validity().not_after.to_datetime())
}

/// Writes `{dir}/{name}.crt` and `{dir}/{name}.key` and returns their paths.
///
/// Both files are first written in full to temporary names in `dir` and synced, then
/// renamed into place one right after the other, so a process that reloads
/// certificates when files change never reads half a file, and sees a new key with an
/// old certificate (or the reverse) only for the instant between the two renames. The
/// key file is created readable by its owner only.
pub fn write_pem_files(dir: &Path, name: &str, pem: &Pem) -> Result<(PathBuf, PathBuf), CertError> {
    std::fs::create_dir_all(dir).map_err(io_error(dir))?;
    let cert_path = dir.join(format!("{name}.crt"));
    let key_path = dir.join(format!("{name}.key"));
    let key_tmp = write_temp(&key_path, pem.key.as_bytes(), true).map_err(io_error(&key_path))?;
    let cert_tmp =
        write_temp(&cert_path, pem.cert.as_bytes(), false).map_err(io_error(&cert_path))?;
    std::fs::rename(&key_tmp, &key_path).map_err(io_error(&key_path))?;
    std::fs::rename(&cert_tmp, &cert_path).map_err(io_error(&cert_path))?;
    sync_dir(dir).map_err(io_error(dir))?;
    Ok((cert_path, key_path))
}

/// Reads a certificate and key written by [`write_pem_files`] (or any PEM pair).
pub fn load_pem_files(cert: &Path, key: &Path) -> Result<Pem, CertError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| CertError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    Ok(Pem {
        cert: read(cert)?,
        key: read(key)?,
    })
}

/// Replaces `path` with `bytes` atomically: write a temporary file in the same
/// directory, sync it, rename it over `path`, sync the directory. A reader sees the old
/// content or the new, never a mix; after a crash, one of the two is on disk. `secret`
/// files are created mode 0600.
pub fn write_file_atomically(path: &Path, bytes: &[u8], secret: bool) -> Result<(), CertError> {
    let tmp = write_temp(path, bytes, secret).map_err(io_error(path))?;
    std::fs::rename(&tmp, path).map_err(io_error(path))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir).map_err(io_error(dir))?;
    }
    Ok(())
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CertError {
    let path = path.to_path_buf();
    move |source| CertError::Io { path, source }
}

/// Writes `bytes` to `{path}.tmp`, synced to disk, and returns that path.
fn write_temp(path: &Path, bytes: &[u8], secret: bool) -> std::io::Result<PathBuf> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    // A leftover temp file from a crash may have looser permissions; `mode` applies only
    // on creation, so start from scratch.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if secret { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut file = opts.open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    Ok(tmp)
}

/// Makes a rename in `dir` durable (the directory entry itself is synced).
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}
