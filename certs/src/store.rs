//! The certificate directory `mcpgw certs` manages, and its recorded state.
//!
//! | file | holds | who needs it |
//! |---|---|---|
//! | `ca.crt` | the trust bundle: one CA, or the old and the new during a rotation | every worker |
//! | `ca.key` | key of the CA that signs new leaves (outside a rotation) | only where `certs` runs |
//! | `ca-next.crt`, `ca-next.key` | the new CA, from `rotate begin` until `rotate finish` | only where `certs` runs |
//! | `NAME.crt`, `NAME.key` | the leaf of mesh member NAME | the worker(s) of NAME |
//! | `state.json` | trust domain and rotation stage | only where `certs` runs |
//!
//! A directory made before `state.json` existed reads as trust domain `mcpgw`, no
//! rotation in progress.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use serde::{Deserialize, Serialize};

use crate::config::read_certs;
use crate::inspect::{rfc3339, sha256_fingerprint};
use crate::issue::write_file_atomically;
use crate::{
    CertError, MeshTlsFiles, Pem, TrustDomain, generate_ca, issue_leaf_in, write_pem_files,
};

/// The trust bundle workers load.
pub const BUNDLE_FILE: &str = "ca.crt";
/// Key of the CA that signs leaves outside a rotation.
pub const CA_KEY_FILE: &str = "ca.key";
/// Certificate of the CA a rotation moves to.
pub const NEXT_CA_CERT_FILE: &str = "ca-next.crt";
/// Key of the CA a rotation moves to.
pub const NEXT_CA_KEY_FILE: &str = "ca-next.key";
/// Trust domain and rotation stage.
pub const STATE_FILE: &str = "state.json";

/// Member names whose files would overwrite the CA's.
const RESERVED_NAMES: &[&str] = &["ca", "ca-next"];

/// Version of the `state.json` layout.
const STATE_FORMAT: u32 = 1;

/// Where a CA rotation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// No rotation in progress: the bundle holds the one CA that signs leaves.
    Idle,
    /// `rotate begin` ran: the bundle holds the old and the new CA; leaves are still
    /// from the old one.
    Begun,
    /// `rotate reissue` ran: every leaf is from the new CA; the bundle still holds both.
    Reissued,
}

impl Stage {
    /// The stage's name as `rotate status` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Idle => "idle",
            Stage::Begun => "begun",
            Stage::Reissued => "reissued",
        }
    }
}

/// A rotation: started, in progress, or the last one finished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RotationRecord {
    /// Fingerprint of the CA being replaced.
    pub old_ca: String,
    /// Fingerprint of the CA replacing it.
    pub new_ca: String,
    /// When `rotate begin` ran (RFC 3339).
    pub begun_at: String,
    /// When `rotate reissue` last ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reissued_at: Option<String>,
    /// When `rotate finish` ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// What `state.json` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirState {
    /// Layout version.
    pub format: u32,
    /// The trust domain of every identity issued here.
    pub trust_domain: String,
    /// Where a rotation stands.
    pub stage: Stage,
    /// The rotation in progress, or the last one finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation: Option<RotationRecord>,
}

impl DirState {
    fn new(trust_domain: &TrustDomain) -> Self {
        Self {
            format: STATE_FORMAT,
            trust_domain: trust_domain.to_string(),
            stage: Stage::Idle,
            rotation: None,
        }
    }

    /// The recorded trust domain, checked.
    pub fn trust_domain(&self) -> Result<TrustDomain, CertError> {
        TrustDomain::new(&self.trust_domain)
    }
}

/// Errors of the certificate directory and its rotation stages. Each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// A certificate could not be made, read or written.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// The directory holds no CA yet.
    #[error("no mesh CA in {dir}: run `mcpgw certs init --dir {dir}` first")]
    NotInitialized {
        /// The directory.
        dir: PathBuf,
    },
    /// `init` would overwrite an existing CA.
    #[error(
        "{dir} already holds a mesh CA ({BUNDLE_FILE}/{CA_KEY_FILE}): remove it first or use \
         another --dir (to replace a CA in service, use `mcpgw certs rotate begin`)"
    )]
    AlreadyInitialized {
        /// The directory.
        dir: PathBuf,
    },
    /// The member name would overwrite a CA file.
    #[error(
        "member name {name:?} is reserved: its files would overwrite the CA's \
         ({BUNDLE_FILE}, {CA_KEY_FILE}, {NEXT_CA_CERT_FILE}, {NEXT_CA_KEY_FILE}); choose another name"
    )]
    ReservedName {
        /// The refused name.
        name: String,
    },
    /// `NAME.crt` already holds a CA certificate (a bundle copied in, say).
    #[error(
        "{path} holds a CA certificate, not a leaf: refusing to overwrite it; choose another \
         member name or move that file"
    )]
    WouldOverwriteCa {
        /// The file.
        path: PathBuf,
    },
    /// `state.json` cannot be read or understood.
    #[error(
        "the rotation state in {path} is unreadable: {reason}; restore it from a backup (it \
         records the trust domain and which rotation stage the directory is in)"
    )]
    BadState {
        /// The state file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The CA that should sign leaves is missing or does not match its key.
    #[error("cannot find the CA that signs leaves in {dir}: {reason}")]
    NoSigningCa {
        /// The directory.
        dir: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// A rotation stage was asked for out of order.
    #[error("cannot run `rotate {attempted}`: {reason}; the next stage is `{next}`")]
    OutOfOrder {
        /// The stage asked for.
        attempted: &'static str,
        /// Where the rotation stands.
        reason: String,
        /// The command that comes next.
        next: String,
    },
    /// `rotate finish` while leaves from the old CA remain.
    #[error(
        "leaves still signed by the old CA: {names}; they would be refused once the old CA \
         leaves the bundle. Run `mcpgw certs rotate reissue --dir {dir}` (it reissues only \
         those), install them, then `rotate finish`",
        names = names.join(", "),
        dir = dir.display()
    )]
    LeavesNotReissued {
        /// Members whose leaf is still from the old CA.
        names: Vec<String>,
        /// The directory.
        dir: PathBuf,
    },
}

/// The CA that signs leaves right now, with its fingerprint.
pub(crate) struct SigningCa {
    pub(crate) pem: Pem,
    pub(crate) fingerprint: String,
}

/// A leaf `issue` wrote.
#[derive(Debug, Clone)]
pub struct IssuedLeaf {
    /// `NAME.crt`.
    pub cert_path: PathBuf,
    /// `NAME.key` (mode 0600).
    pub key_path: PathBuf,
    /// End of validity (capped at the signing CA's).
    pub not_after: SystemTime,
    /// Fingerprint of the CA that signed it.
    pub signed_by: String,
}

/// A certificate directory managed by `mcpgw certs`.
#[derive(Debug, Clone)]
pub struct CertDir {
    /// The directory.
    dir: PathBuf,
}

impl CertDir {
    /// The directory at `dir` (nothing is read yet).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// `ca.crt`: the trust bundle workers load.
    pub fn bundle_path(&self) -> PathBuf {
        self.dir.join(BUNDLE_FILE)
    }

    pub(crate) fn ca_key_path(&self) -> PathBuf {
        self.dir.join(CA_KEY_FILE)
    }

    pub(crate) fn next_cert_path(&self) -> PathBuf {
        self.dir.join(NEXT_CA_CERT_FILE)
    }

    pub(crate) fn next_key_path(&self) -> PathBuf {
        self.dir.join(NEXT_CA_KEY_FILE)
    }

    fn state_path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// The files a worker of `member` loads: the bundle and its leaf.
    pub fn member_files(&self, member: &str) -> MeshTlsFiles {
        MeshTlsFiles::in_dir(&self.dir, member)
    }

    /// Creates a CA for `trust_domain` (`ca.crt`, `ca.key`, `state.json`). Refuses to
    /// overwrite an existing CA. Returns the CA's fingerprint.
    pub fn init(&self, trust_domain: &TrustDomain, validity: Duration) -> Result<String, DirError> {
        if self.bundle_path().exists() || self.ca_key_path().exists() {
            return Err(DirError::AlreadyInitialized {
                dir: self.dir.clone(),
            });
        }
        let ca = generate_ca(&ca_common_name(trust_domain), validity)?;
        let fingerprint = fingerprint_of_pem(&ca.cert, &self.bundle_path())?;
        write_pem_files(&self.dir, "ca", &ca)?;
        self.write_state(&DirState::new(trust_domain))?;
        Ok(fingerprint)
    }

    /// The recorded state; a directory from before `state.json` reads as the default
    /// trust domain with no rotation in progress.
    pub fn state(&self) -> Result<DirState, DirError> {
        if !self.bundle_path().exists() {
            return Err(DirError::NotInitialized {
                dir: self.dir.clone(),
            });
        }
        let path = self.state_path();
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(DirState::new(&TrustDomain::default()));
            }
            Err(source) => return Err(CertError::Io { path, source }.into()),
        };
        let state: DirState = serde_json::from_slice(&bytes).map_err(|e| DirError::BadState {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if state.format != STATE_FORMAT {
            return Err(DirError::BadState {
                path,
                reason: format!(
                    "format {} is not the {STATE_FORMAT} this mcpgw understands",
                    state.format
                ),
            });
        }
        state.trust_domain().map_err(|e| DirError::BadState {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(state)
    }

    pub(crate) fn write_state(&self, state: &DirState) -> Result<(), DirError> {
        let mut json = serde_json::to_vec_pretty(state).map_err(|e| DirError::BadState {
            path: self.state_path(),
            reason: e.to_string(),
        })?;
        json.push(b'\n');
        write_file_atomically(&self.state_path(), &json, false)?;
        Ok(())
    }

    /// Issues (or renews) the leaf of `name` from the CA that signs leaves at this
    /// stage: the current CA until `rotate reissue`, the new one from then on.
    pub fn issue(&self, name: &str, validity: Duration) -> Result<IssuedLeaf, DirError> {
        crate::validate_member_name(name)?;
        if RESERVED_NAMES.contains(&name.to_ascii_lowercase().as_str()) {
            return Err(DirError::ReservedName {
                name: name.to_owned(),
            });
        }
        let cert_path = self.dir.join(format!("{name}.crt"));
        if holds_a_ca(&cert_path)? {
            return Err(DirError::WouldOverwriteCa { path: cert_path });
        }
        let state = self.state()?;
        let ca = self.signing_ca(&state)?;
        self.issue_from(&ca, &state.trust_domain()?, name, validity)
    }

    pub(crate) fn issue_from(
        &self,
        ca: &SigningCa,
        trust_domain: &TrustDomain,
        name: &str,
        validity: Duration,
    ) -> Result<IssuedLeaf, DirError> {
        let leaf = issue_leaf_in(&ca.pem, trust_domain, name, validity)?;
        let (cert_path, key_path) = write_pem_files(&self.dir, name, &leaf)?;
        let not_after = pem_not_after(&leaf.cert, &cert_path)?;
        Ok(IssuedLeaf {
            cert_path,
            key_path,
            not_after,
            signed_by: ca.fingerprint.clone(),
        })
    }

    /// Names of the members with a leaf here (`NAME.crt` that is not a CA file and
    /// holds no CA certificate), sorted.
    pub fn leaf_names(&self) -> Result<Vec<String>, DirError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|source| CertError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| CertError::Io {
                path: self.dir.clone(),
                source,
            })?;
            let path = entry.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".crt"))
            else {
                continue;
            };
            if RESERVED_NAMES.contains(&name)
                || crate::validate_member_name(name).is_err()
                || holds_a_ca(&path)?
            {
                continue;
            }
            names.push(name.to_owned());
        }
        names.sort();
        Ok(names)
    }

    /// The certificates of the trust bundle.
    pub fn bundle(&self) -> Result<Vec<CertificateDer<'static>>, DirError> {
        Ok(read_certs(&self.bundle_path())?)
    }

    /// The CA that signs leaves at `state`'s stage.
    pub(crate) fn signing_ca(&self, state: &DirState) -> Result<SigningCa, DirError> {
        match state.stage {
            Stage::Idle | Stage::Begun => self.current_ca(),
            Stage::Reissued => self.next_ca(),
        }
    }

    /// The CA whose key is `ca.key`, found in the bundle by its public key.
    pub(crate) fn current_ca(&self) -> Result<SigningCa, DirError> {
        let key_path = self.ca_key_path();
        let key = read_secret(&key_path)?;
        let spki = public_key_of(&key, &key_path)?;
        for der in self.bundle()? {
            if spki_of(&der).as_deref() == Some(spki.as_slice()) {
                return Ok(SigningCa {
                    fingerprint: sha256_fingerprint(&der),
                    pem: Pem {
                        cert: to_pem(&der),
                        key,
                    },
                });
            }
        }
        Err(DirError::NoSigningCa {
            dir: self.dir.clone(),
            reason: format!(
                "no CA in {} belongs to the key in {}",
                self.bundle_path().display(),
                key_path.display()
            ),
        })
    }

    /// The rotation's new CA (`ca-next.crt`, `ca-next.key`), checked to belong together.
    pub(crate) fn next_ca(&self) -> Result<SigningCa, DirError> {
        let cert_path = self.next_cert_path();
        let key_path = self.next_key_path();
        let certs = read_certs(&cert_path)?;
        let key = read_secret(&key_path)?;
        let spki = public_key_of(&key, &key_path)?;
        let Some(der) = certs.first() else {
            return Err(CertError::NoCertificates { path: cert_path }.into());
        };
        if spki_of(der).as_deref() != Some(spki.as_slice()) {
            return Err(DirError::NoSigningCa {
                dir: self.dir.clone(),
                reason: format!(
                    "the key in {} does not belong to the CA in {}",
                    key_path.display(),
                    cert_path.display()
                ),
            });
        }
        Ok(SigningCa {
            fingerprint: sha256_fingerprint(der),
            pem: Pem {
                cert: to_pem(der),
                key,
            },
        })
    }
}

/// Subject name of a new CA: the trust domain and the moment to the nanosecond. Two
/// CAs must never share a name: a peer looks up a leaf's issuer by name, and with the
/// old CA's name on the new one it would check an old leaf against the wrong key
/// ("bad signature" instead of "unknown issuer"). It also lets the old and the new CA
/// of a rotation read differently in `inspect`.
pub(crate) fn ca_common_name(trust_domain: &TrustDomain) -> String {
    let now = time::OffsetDateTime::now_utc();
    let moment = now
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| now.unix_timestamp_nanos().to_string());
    format!("mcpgw mesh CA {trust_domain} {moment}")
}

pub(crate) fn now_rfc3339() -> String {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(0))
        .unwrap_or(0);
    rfc3339(now)
}

/// DER to PEM, the way rcgen and openssl write certificates.
pub(crate) fn to_pem(der: &[u8]) -> String {
    pem::encode_config(
        &pem::Pem::new("CERTIFICATE", der.to_vec()),
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    )
}

/// A bundle file's content: the certificates in order, PEM.
pub(crate) fn bundle_pem(certs: &[CertificateDer<'_>]) -> String {
    certs.iter().map(|c| to_pem(c)).collect()
}

fn read_secret(path: &Path) -> Result<String, CertError> {
    std::fs::read_to_string(path).map_err(|source| CertError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The SubjectPublicKeyInfo of a PEM private key. Parse errors are not echoed: they
/// could quote the key.
fn public_key_of(key_pem: &str, path: &Path) -> Result<Vec<u8>, CertError> {
    use rcgen::PublicKeyData;
    let key = rcgen::KeyPair::from_pem(key_pem).map_err(|_| CertError::NoPrivateKey {
        path: path.to_path_buf(),
    })?;
    Ok(key.subject_public_key_info())
}

/// The SubjectPublicKeyInfo of a DER certificate.
fn spki_of(der: &[u8]) -> Option<Vec<u8>> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.tbs_certificate.subject_pki.raw.to_vec())
}

pub(crate) fn fingerprint_of_pem(cert_pem: &str, path: &Path) -> Result<String, CertError> {
    let certs = crate::config::parse_certs(cert_pem.as_bytes(), path)?;
    certs
        .first()
        .map(|der| sha256_fingerprint(der))
        .ok_or_else(|| CertError::NoCertificates {
            path: path.to_path_buf(),
        })
}

fn pem_not_after(cert_pem: &str, path: &Path) -> Result<SystemTime, CertError> {
    let certs = crate::config::parse_certs(cert_pem.as_bytes(), path)?;
    let Some(der) = certs.first() else {
        return Err(CertError::NoCertificates {
            path: path.to_path_buf(),
        });
    };
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| CertError::Parse(e.to_string()))?;
    Ok(crate::identity::not_after(&cert))
}

/// Whether `path` exists and its first certificate is a CA.
fn holds_a_ca(path: &Path) -> Result<bool, CertError> {
    if !path.exists() {
        return Ok(false);
    }
    let Ok(certs) = read_certs(path) else {
        return Ok(false);
    };
    Ok(certs.first().is_some_and(|der| {
        x509_parser::parse_x509_certificate(der).is_ok_and(|(_, cert)| cert.is_ca())
    }))
}

/// Writes the bundle atomically.
pub(crate) fn write_bundle(dir: &CertDir, certs: &[CertificateDer<'_>]) -> Result<(), CertError> {
    write_file_atomically(&dir.bundle_path(), bundle_pem(certs).as_bytes(), false)
}
