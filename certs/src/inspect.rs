//! What a set of mesh certificates holds, and what is wrong with it: the logic behind
//! `mcpgw certs inspect` and `mcpgw certs rotate status`.
//!
//! A report lists each CA of the bundle and each leaf with subject, identities,
//! SHA-256 fingerprint, issuer, days to expiry, and which CA of the bundle signed the
//! leaf (checked cryptographically, not by name). Problems are listed separately; a
//! caller exits non-zero when there are any.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rustls::pki_types::{CertificateDer, UnixTime};
use serde::Serialize;
use x509_parser::certificate::X509Certificate;

use crate::config::{parse_key, read_certs};
use crate::store::{CertDir, DirError, Stage};
use crate::{CertError, TrustDomain, crypto_provider};

const DAY_SECS: i64 = 24 * 3600;

/// SHA-256 of `bytes`, from the workspace crypto provider (no hashing crate of our own).
pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    if let Some(suite) = rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256.tls13() {
        let digest = suite.common.hash_provider.hash(bytes);
        let digest = digest.as_ref();
        if digest.len() == out.len() {
            out.copy_from_slice(digest);
        }
    }
    out
}

/// The SHA-256 fingerprint of a DER certificate as `AB:CD:...`, the form
/// `openssl x509 -fingerprint -sha256` prints.
pub fn sha256_fingerprint(der: &[u8]) -> String {
    let digest = sha256(der);
    let mut out = String::with_capacity(digest.len() * 3);
    for (i, byte) in digest.iter().enumerate() {
        if i > 0 {
            out.push(':');
        }
        out.push_str(&format!("{byte:02X}"));
    }
    out
}

/// The first 8 bytes of a fingerprint, enough to tell CAs apart in a sentence.
pub fn short_fingerprint(fingerprint: &str) -> &str {
    fingerprint.get(..23).unwrap_or(fingerprint)
}

/// Facts about one certificate, common to CAs and leaves.
#[derive(Debug, Clone, Serialize)]
pub struct CertSummary {
    /// File the certificate was read from.
    pub file: PathBuf,
    /// Subject distinguished name.
    pub subject: String,
    /// Issuer distinguished name (as written in the certificate; see `signed_by` for
    /// the CA that really signed a leaf).
    pub issuer: String,
    /// SHA-256 of the DER certificate, `AB:CD:...`.
    pub fingerprint_sha256: String,
    /// Start of validity, RFC 3339.
    pub not_before: String,
    /// End of validity, RFC 3339.
    pub not_after: String,
    /// Whole days until `not_after`; negative once expired.
    pub days_left: i64,
    /// Unix time of `not_after`.
    #[serde(skip)]
    not_after_unix: i64,
}

/// What a CA is for in a certificate directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CaRole {
    /// Signs the leaves `certs issue` makes now.
    Active,
    /// The CA a rotation is moving to (signs leaves from `rotate reissue` on).
    Next,
    /// The CA a rotation is moving away from; leaves from it are still trusted until
    /// `rotate finish`.
    Old,
}

/// A CA of the trust bundle.
#[derive(Debug, Clone, Serialize)]
pub struct CaReport {
    /// The certificate.
    #[serde(flatten)]
    pub cert: CertSummary,
    /// Its role, when inspecting a certificate directory.
    pub role: Option<CaRole>,
}

/// Whether a leaf's private key (`NAME.key` beside `NAME.crt`) belongs to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyStatus {
    /// The key belongs to the certificate.
    Matches,
    /// The key belongs to another certificate.
    Mismatch,
    /// There is a key file, but it holds no usable key.
    Unreadable,
    /// There is no key file beside the certificate (normal for a peer's certificate).
    Absent,
}

/// A leaf certificate.
#[derive(Debug, Clone, Serialize)]
pub struct LeafReport {
    /// The certificate.
    #[serde(flatten)]
    pub cert: CertSummary,
    /// Every URI SAN (the mesh identity is one of them).
    pub identities: Vec<String>,
    /// The member name, when the leaf carries exactly one mesh identity of the trust
    /// domain.
    pub member: Option<String>,
    /// Fingerprint of the CA of the bundle that signed this leaf; `None` when no CA of
    /// the bundle did (peers will refuse the leaf).
    pub signed_by: Option<String>,
    /// Subject of that CA.
    pub signed_by_subject: Option<String>,
    /// The key beside the certificate.
    pub key: KeyStatus,
}

/// Everything `certs inspect` found.
#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    /// Trust domain whose identities leaves must carry.
    pub trust_domain: String,
    /// Rotation stage of the directory (directory inspections only).
    pub stage: Option<Stage>,
    /// A certificate expiring within this many days is a problem.
    pub warn_days: u32,
    /// The CAs of the trust bundle.
    pub cas: Vec<CaReport>,
    /// The leaves.
    pub leaves: Vec<LeafReport>,
    /// What needs attention, one sentence each, saying what to do. Empty when all is
    /// well.
    pub problems: Vec<String>,
}

/// Inspects a certificate directory made by `mcpgw certs`: the bundle `ca.crt`, the
/// rotation's next CA if any, and every leaf `NAME.crt` with its key `NAME.key`.
pub fn inspect_dir(
    dir: &CertDir,
    warn_days: u32,
    now: SystemTime,
) -> Result<InspectReport, DirError> {
    let state = dir.state()?;
    let trust_domain = state.trust_domain()?;
    let bundle_path = dir.bundle_path();
    let bundle = read_certs(&bundle_path)?;
    let next_fp = state.rotation.as_ref().map(|r| r.new_ca.clone());
    let old_fp = state.rotation.as_ref().map(|r| r.old_ca.clone());
    let active_fp = match dir.signing_ca(&state) {
        Ok(ca) => Some(ca.fingerprint),
        Err(_) => None,
    };
    let mut cas = Vec::new();
    for der in &bundle {
        let cert = summarize(der, &bundle_path, now)?;
        let fp = &cert.fingerprint_sha256;
        let role = if Some(fp) == active_fp.as_ref() {
            Some(CaRole::Active)
        } else if state.stage != Stage::Idle && Some(fp) == next_fp.as_ref() {
            Some(CaRole::Next)
        } else if state.stage != Stage::Idle && Some(fp) == old_fp.as_ref() {
            Some(CaRole::Old)
        } else {
            None
        };
        cas.push(CaReport { cert, role });
    }
    let mut leaves = Vec::new();
    for name in dir.leaf_names()? {
        let path = dir.path().join(format!("{name}.crt"));
        let key_path = dir.path().join(format!("{name}.key"));
        for der in read_certs(&path)?.iter().take(1) {
            leaves.push(leaf_report(
                der,
                &path,
                &key_path,
                &bundle,
                &trust_domain,
                now,
            )?);
        }
    }
    Ok(InspectReport::judged(
        &trust_domain,
        Some(state.stage),
        warn_days,
        cas,
        leaves,
        now,
    ))
}

impl InspectReport {
    /// The report of `cas` and `leaves`, with the problems found in them at `now`.
    fn judged(
        trust_domain: &TrustDomain,
        stage: Option<Stage>,
        warn_days: u32,
        cas: Vec<CaReport>,
        leaves: Vec<LeafReport>,
        now: SystemTime,
    ) -> InspectReport {
        let mut report = InspectReport {
            trust_domain: trust_domain.to_string(),
            stage,
            warn_days,
            cas,
            leaves,
            problems: Vec::new(),
        };
        report.problems = problems(&report, now);
        report
    }
}

/// Inspects loose files (a worker's `ca.crt`, `host.crt`, ...): CA certificates among
/// them form the bundle, every other certificate is a leaf, checked against that
/// bundle and the trust domain. A leaf's key is checked when `NAME.key` sits beside
/// `NAME.crt`.
pub fn inspect_files(
    files: &[PathBuf],
    trust_domain: &TrustDomain,
    warn_days: u32,
    now: SystemTime,
) -> Result<InspectReport, CertError> {
    let mut bundle = Vec::new();
    let mut ca_files = Vec::new();
    let mut leaf_certs = Vec::new();
    for path in files {
        for der in read_certs(path)? {
            if is_ca(&der, path)? {
                bundle.push(der.clone());
                ca_files.push((der, path.clone()));
            } else {
                leaf_certs.push((der, path.clone()));
            }
        }
    }
    let mut cas = Vec::new();
    for (der, path) in &ca_files {
        cas.push(CaReport {
            cert: summarize(der, path, now)?,
            role: None,
        });
    }
    let mut leaves = Vec::new();
    for (der, path) in &leaf_certs {
        let key_path = path.with_extension("key");
        leaves.push(leaf_report(
            der,
            path,
            &key_path,
            &bundle,
            trust_domain,
            now,
        )?);
    }
    Ok(InspectReport::judged(
        trust_domain,
        None,
        warn_days,
        cas,
        leaves,
        now,
    ))
}

fn parse<'a>(der: &'a [u8], path: &Path) -> Result<X509Certificate<'a>, CertError> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, cert)| cert)
        .map_err(|e| CertError::InFile {
            path: path.to_path_buf(),
            source: Box::new(CertError::Parse(e.to_string())),
        })
}

fn is_ca(der: &[u8], path: &Path) -> Result<bool, CertError> {
    Ok(parse(der, path)?.is_ca())
}

fn unix(now: SystemTime) -> i64 {
    match now.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// Unix seconds as RFC 3339 (UTC).
pub fn rfc3339(unix_secs: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix_secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| unix_secs.to_string())
}

fn summarize(der: &[u8], path: &Path, now: SystemTime) -> Result<CertSummary, CertError> {
    let cert = parse(der, path)?;
    let not_after = cert.validity().not_after.timestamp();
    let not_before = cert.validity().not_before.timestamp();
    Ok(CertSummary {
        file: path.to_path_buf(),
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        fingerprint_sha256: sha256_fingerprint(der),
        not_before: rfc3339(not_before),
        not_after: rfc3339(not_after),
        days_left: (not_after - unix(now)).div_euclid(DAY_SECS),
        not_after_unix: not_after,
    })
}

fn leaf_report(
    der: &CertificateDer<'static>,
    path: &Path,
    key_path: &Path,
    bundle: &[CertificateDer<'static>],
    trust_domain: &TrustDomain,
    now: SystemTime,
) -> Result<LeafReport, CertError> {
    let summary = summarize(der, path, now)?;
    let cert = parse(der, path)?;
    let signer = bundle
        .iter()
        .find(|ca| leaf_signed_by(der, ca))
        .map(|ca| -> Result<(String, String), CertError> {
            Ok((
                sha256_fingerprint(ca),
                parse(ca, path)?.subject().to_string(),
            ))
        })
        .transpose()?;
    Ok(LeafReport {
        identities: crate::identity::uri_sans(&cert),
        member: trust_domain.member_of_parsed(&cert).ok(),
        signed_by: signer.as_ref().map(|(fp, _)| fp.clone()),
        signed_by_subject: signer.map(|(_, subject)| subject),
        key: key_status(der, key_path),
        cert: summary,
    })
}

/// Whether `ca` signed `leaf`: webpki's chain check with `ca` as the only anchor, at a
/// moment inside the leaf's validity, so that an expired leaf is still attributed to
/// its CA (expiry is reported on its own).
pub(crate) fn leaf_signed_by(leaf: &CertificateDer<'_>, ca: &CertificateDer<'_>) -> bool {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(leaf) else {
        return false;
    };
    let not_before = parsed.validity().not_before.timestamp();
    let not_after = parsed.validity().not_after.timestamp();
    let middle = not_before + (not_after - not_before).max(0) / 2;
    let Ok(anchor) = webpki::anchor_from_trusted_cert(ca) else {
        return false;
    };
    let Ok(end_entity) = webpki::EndEntityCert::try_from(leaf) else {
        return false;
    };
    let at = UnixTime::since_unix_epoch(Duration::from_secs(u64::try_from(middle).unwrap_or(0)));
    end_entity
        .verify_for_usage(
            crypto_provider().signature_verification_algorithms.all,
            &[anchor],
            &[],
            at,
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .is_ok()
}

fn key_status(cert: &CertificateDer<'static>, key_path: &Path) -> KeyStatus {
    let bytes = match std::fs::read(key_path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return KeyStatus::Absent,
        Err(_) => return KeyStatus::Unreadable,
    };
    let Ok(key) = parse_key(&bytes, key_path) else {
        return KeyStatus::Unreadable;
    };
    let Ok(signing_key) = crypto_provider().key_provider.load_private_key(key) else {
        return KeyStatus::Unreadable;
    };
    match rustls::sign::CertifiedKey::new(vec![cert.clone()], signing_key).keys_match() {
        Ok(()) => KeyStatus::Matches,
        Err(_) => KeyStatus::Mismatch,
    }
}

/// Every problem in a report, one sentence each with what to do.
fn problems(report: &InspectReport, now: SystemTime) -> Vec<String> {
    let now = unix(now);
    let warn = i64::from(report.warn_days) * DAY_SECS;
    let mut out = Vec::new();
    let expiry = |c: &CertSummary| -> Option<String> {
        let left = c.not_after_unix - now;
        if left <= 0 {
            Some(format!("has expired ({})", c.not_after))
        } else if left < warn {
            Some(format!(
                "expires in {} days ({}), within --warn-days {}",
                c.days_left, c.not_after, report.warn_days
            ))
        } else {
            None
        }
    };
    if report.cas.is_empty() {
        out.push(
            "no CA certificate was given: the trust bundle is empty, so no leaf can be \
             checked against it (inspect the bundle file too, e.g. ca.crt)"
                .to_owned(),
        );
    }
    for ca in &report.cas {
        if let Some(when) = expiry(&ca.cert) {
            out.push(format!(
                "CA {} ({}) in {} {when}: rotate to a new CA with `mcpgw certs rotate begin`",
                ca.cert.subject,
                short_fingerprint(&ca.cert.fingerprint_sha256),
                ca.cert.file.display()
            ));
        }
    }
    for leaf in &report.leaves {
        let who = leaf
            .member
            .as_deref()
            .map(|m| format!("leaf of {m}"))
            .unwrap_or_else(|| "leaf".to_owned());
        let file = leaf.cert.file.display();
        if let Some(when) = expiry(&leaf.cert) {
            out.push(format!(
                "{file}: {who} {when}: issue a new one with `mcpgw certs issue`"
            ));
        }
        if leaf.signed_by.is_none() && !report.cas.is_empty() {
            out.push(format!(
                "{file}: {who} is signed by a CA that is not in the bundle (issuer {}): \
                 peers will refuse it; issue it again from a CA in the bundle",
                leaf.cert.issuer
            ));
        }
        if leaf.member.is_none() {
            out.push(format!(
                "{file}: {who} carries no mesh identity of trust domain {:?} (URI SANs: {}): \
                 peers will refuse it; issue mesh leaves with `mcpgw certs issue`",
                report.trust_domain,
                if leaf.identities.is_empty() {
                    "none".to_owned()
                } else {
                    leaf.identities.join(", ")
                }
            ));
        }
        match leaf.key {
            KeyStatus::Mismatch => out.push(format!(
                "{file}: the key beside it does not belong to it: install the key issued \
                 with this certificate"
            )),
            KeyStatus::Unreadable => out.push(format!(
                "{file}: the key beside it holds no usable private key"
            )),
            KeyStatus::Matches | KeyStatus::Absent => {}
        }
    }
    out
}
