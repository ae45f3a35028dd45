//! Staged CA rotation, as the large meshes do it (Linkerd's trust-anchor rotation,
//! Istio's multi-root transition, SPIRE's prepared and active CA slots):
//!
//! 1. `begin`: make a new CA; the bundle `ca.crt` holds the old and the new. Every
//!    worker must load this bundle before any leaf from the new CA appears.
//! 2. `reissue`: every leaf in the directory is issued again, from the new CA. Peers
//!    that still present old leaves are accepted (the bundle holds both CAs).
//! 3. `finish`: the bundle holds only the new CA, and the new CA's key becomes
//!    `ca.key`. Allowed only when no leaf from the old CA is left in the directory.
//!
//! The stage is recorded in `state.json`. Each stage can run twice (the second run
//! repairs what a crash may have left half done, and changes nothing otherwise); a stage
//! out of order is refused with the stage that comes next. Whether a command may run is
//! decided by [`plan`], a pure function of the recorded state.

use std::path::PathBuf;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use serde::Serialize;

use crate::inspect::{CaRole, inspect_dir, leaf_signed_by};
use crate::store::{
    CertDir, DirError, DirState, IssuedLeaf, RotationRecord, SigningCa, Stage, ca_common_name,
    now_rfc3339, write_bundle,
};
use crate::{CertError, generate_ca, write_pem_files};

/// A rotation command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotateStep {
    /// `rotate begin`.
    Begin,
    /// `rotate reissue`.
    Reissue,
    /// `rotate finish`.
    Finish,
}

impl RotateStep {
    /// The command's name.
    pub fn name(self) -> &'static str {
        match self {
            RotateStep::Begin => "begin",
            RotateStep::Reissue => "reissue",
            RotateStep::Finish => "finish",
        }
    }
}

/// What a rotation command will do in the recorded state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Move to the next stage.
    Advance,
    /// The stage was reached already: apply it again (repairs a half-done run, changes
    /// nothing otherwise).
    Repeat,
    /// `finish` after the rotation finished: nothing to do.
    AlreadyFinished,
}

/// Decides whether `step` may run in `state`, and how. Out of order is an error naming
/// the stage that comes next.
pub fn plan(step: RotateStep, state: &DirState, dir: &CertDir) -> Result<Plan, DirError> {
    let next = |step: RotateStep| {
        format!(
            "mcpgw certs rotate {} --dir {}",
            step.name(),
            dir.path().display()
        )
    };
    let refuse = |reason: &str, next_step: RotateStep| DirError::OutOfOrder {
        attempted: step.name(),
        reason: reason.to_owned(),
        next: next(next_step),
    };
    let finished_before = state
        .rotation
        .as_ref()
        .is_some_and(|r| r.finished_at.is_some());
    match (step, state.stage) {
        (RotateStep::Begin, Stage::Idle) => Ok(Plan::Advance),
        (RotateStep::Begin, Stage::Begun) => Ok(Plan::Repeat),
        (RotateStep::Begin, Stage::Reissued) => Err(refuse(
            "a rotation is in progress and its leaves are already reissued from the new CA",
            RotateStep::Finish,
        )),
        (RotateStep::Reissue, Stage::Idle) => Err(refuse(
            "no rotation is in progress (to renew one leaf, use `mcpgw certs issue`)",
            RotateStep::Begin,
        )),
        (RotateStep::Reissue, Stage::Begun) => Ok(Plan::Advance),
        (RotateStep::Reissue, Stage::Reissued) => Ok(Plan::Repeat),
        (RotateStep::Finish, Stage::Idle) if finished_before => Ok(Plan::AlreadyFinished),
        (RotateStep::Finish, Stage::Idle) => {
            Err(refuse("no rotation is in progress", RotateStep::Begin))
        }
        (RotateStep::Finish, Stage::Begun) => Err(refuse(
            "the leaves are still from the old CA; removing it from the bundle now would \
             cut every worker off",
            RotateStep::Reissue,
        )),
        (RotateStep::Finish, Stage::Reissued) => Ok(Plan::Advance),
    }
}

/// What `rotate begin` did.
#[derive(Debug, Clone, Serialize)]
pub struct BeginOutcome {
    /// True when the rotation had begun already (nothing new was made).
    pub already: bool,
    /// Fingerprint of the CA being replaced.
    pub old_ca: String,
    /// Fingerprint of the new CA.
    pub new_ca: String,
    /// The bundle, now holding both.
    pub bundle: PathBuf,
}

/// `rotate begin`: a new CA (`ca-next.crt`, `ca-next.key`, valid for `ca_validity`)
/// and a bundle holding the old and the new.
pub fn begin(dir: &CertDir, ca_validity: Duration) -> Result<BeginOutcome, DirError> {
    let mut state = dir.state()?;
    let plan = plan(RotateStep::Begin, &state, dir)?;
    let trust_domain = state.trust_domain()?;
    let old = dir.current_ca()?;
    let new = match plan {
        Plan::Repeat => dir.next_ca()?,
        // A begin that was interrupted after writing the new CA left a usable one: take
        // it rather than make a second, so no host ends up trusting a CA that vanished.
        _ => match dir.next_ca() {
            Ok(ca) if ca.fingerprint != old.fingerprint => ca,
            _ => {
                let pem = generate_ca(&ca_common_name(&trust_domain), ca_validity)?;
                write_pem_files(dir.path(), "ca-next", &pem)?;
                dir.next_ca()?
            }
        },
    };

    let mut bundle = dir.bundle()?;
    if !contains(&bundle, &new.fingerprint) {
        bundle.push(der_of(&new)?);
        write_bundle(dir, &bundle)?;
    }

    let already = plan == Plan::Repeat;
    if !already {
        state.stage = Stage::Begun;
        state.rotation = Some(RotationRecord {
            old_ca: old.fingerprint.clone(),
            new_ca: new.fingerprint.clone(),
            begun_at: now_rfc3339(),
            reissued_at: None,
            finished_at: None,
        });
        dir.write_state(&state)?;
    }
    Ok(BeginOutcome {
        already,
        old_ca: old.fingerprint,
        new_ca: new.fingerprint,
        bundle: dir.bundle_path(),
    })
}

/// What `rotate reissue` did.
#[derive(Debug, Clone)]
pub struct ReissueOutcome {
    /// True when every leaf was from the new CA already.
    pub already: bool,
    /// Leaves issued now, by member name.
    pub reissued: Vec<(String, IssuedLeaf)>,
    /// Members whose leaf was from the new CA already.
    pub unchanged: Vec<String>,
    /// Fingerprint of the new CA.
    pub new_ca: String,
}

/// `rotate reissue`: every leaf not yet from the new CA is issued again from it (new
/// key, `leaf_validity`). Leaves from the new CA are left alone, so running it again
/// only catches up what is missing.
pub fn reissue(dir: &CertDir, leaf_validity: Duration) -> Result<ReissueOutcome, DirError> {
    let mut state = dir.state()?;
    plan(RotateStep::Reissue, &state, dir)?;
    let trust_domain = state.trust_domain()?;
    let new = dir.next_ca()?;
    let new_der = der_of(&new)?;
    if !contains(&dir.bundle()?, &new.fingerprint) {
        return Err(DirError::NoSigningCa {
            dir: dir.path().to_path_buf(),
            reason: format!(
                "{} does not hold the new CA {}: restore the bundle `rotate begin` wrote \
                 before issuing leaves that workers would refuse",
                dir.bundle_path().display(),
                crate::inspect::short_fingerprint(&new.fingerprint)
            ),
        });
    }
    let mut reissued = Vec::new();
    let mut unchanged = Vec::new();
    for name in dir.leaf_names()? {
        if leaf_is_from(dir, &name, &new_der)? {
            unchanged.push(name);
        } else {
            let leaf = dir.issue_from(&new, &trust_domain, &name, leaf_validity)?;
            reissued.push((name, leaf));
        }
    }
    let already = state.stage == Stage::Reissued && reissued.is_empty();
    if !already {
        state.stage = Stage::Reissued;
        if let Some(rotation) = state.rotation.as_mut() {
            rotation.reissued_at = Some(now_rfc3339());
        }
        dir.write_state(&state)?;
    }
    Ok(ReissueOutcome {
        already,
        reissued,
        unchanged,
        new_ca: new.fingerprint,
    })
}

/// What `rotate finish` did.
#[derive(Debug, Clone, Serialize)]
pub struct FinishOutcome {
    /// True when the rotation had finished already.
    pub already: bool,
    /// Fingerprint of the CA that is now the only one in the bundle.
    pub ca: String,
    /// Fingerprint of the CA removed from the bundle.
    pub removed: String,
}

/// `rotate finish`: the bundle holds only the new CA, whose key becomes `ca.key`; the
/// old CA's key is gone. Refused while any leaf in the directory is not from the new CA.
pub fn finish(dir: &CertDir) -> Result<FinishOutcome, DirError> {
    let mut state = dir.state()?;
    let plan = plan(RotateStep::Finish, &state, dir)?;
    let Some(mut rotation) = state.rotation.clone() else {
        return Err(missing_record(dir));
    };
    if plan == Plan::AlreadyFinished {
        return Ok(FinishOutcome {
            already: true,
            ca: rotation.new_ca,
            removed: rotation.old_ca,
        });
    }
    // The new CA is in ca-next.* until this stage removes them; a finish interrupted
    // after that finds it as the CA of ca.key.
    let new = if dir.next_cert_path().exists() {
        dir.next_ca()?
    } else {
        dir.current_ca()?
    };
    if new.fingerprint != rotation.new_ca {
        return Err(DirError::NoSigningCa {
            dir: dir.path().to_path_buf(),
            reason: format!(
                "the new CA on disk ({}) is not the one `rotate begin` recorded ({}); \
                 restore {} and {}",
                crate::inspect::short_fingerprint(&new.fingerprint),
                crate::inspect::short_fingerprint(&rotation.new_ca),
                dir.next_cert_path().display(),
                dir.next_key_path().display()
            ),
        });
    }
    let new_der = der_of(&new)?;
    let mut stale = Vec::new();
    for name in dir.leaf_names()? {
        if !leaf_is_from(dir, &name, &new_der)? {
            stale.push(name);
        }
    }
    if !stale.is_empty() {
        return Err(DirError::LeavesNotReissued {
            names: stale,
            dir: dir.path().to_path_buf(),
        });
    }

    // Order matters for a crash halfway: each write can be repeated, and the state
    // says "finished" only after all of them.
    write_bundle(dir, std::slice::from_ref(&new_der))?;
    crate::issue::write_file_atomically(&dir.ca_key_path(), new.pem.key.as_bytes(), true)?;
    for path in [dir.next_cert_path(), dir.next_key_path()] {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(CertError::Io { path, source: e }.into());
            }
            _ => {}
        }
    }
    rotation.finished_at = Some(now_rfc3339());
    state.stage = Stage::Idle;
    state.rotation = Some(rotation.clone());
    dir.write_state(&state)?;
    Ok(FinishOutcome {
        already: false,
        ca: rotation.new_ca,
        removed: rotation.old_ca,
    })
}

/// Where a rotation stands, for `rotate status`.
#[derive(Debug, Clone, Serialize)]
pub struct RotationStatus {
    /// The stage.
    pub stage: Stage,
    /// Trust domain of the directory.
    pub trust_domain: String,
    /// The rotation in progress, or the last one finished.
    pub rotation: Option<RotationRecord>,
    /// CAs of the bundle: fingerprint, subject, role.
    pub bundle: Vec<BundleEntry>,
    /// Members whose leaf is from the old CA (during a rotation) or from the active CA.
    pub leaves_by_ca: Vec<LeavesOfCa>,
    /// Members whose leaf no CA of the bundle signed.
    pub leaves_untrusted: Vec<String>,
    /// What to do next, in a sentence.
    pub next: String,
}

/// One CA of the bundle in a status.
#[derive(Debug, Clone, Serialize)]
pub struct BundleEntry {
    /// SHA-256 fingerprint.
    pub fingerprint_sha256: String,
    /// Subject.
    pub subject: String,
    /// Role in the rotation.
    pub role: Option<CaRole>,
    /// Days until it expires.
    pub days_left: i64,
}

/// The members whose leaf one CA signed.
#[derive(Debug, Clone, Serialize)]
pub struct LeavesOfCa {
    /// The CA's fingerprint.
    pub ca: String,
    /// Member names.
    pub members: Vec<String>,
}

/// Where the rotation of `dir` stands and what comes next.
pub fn status(dir: &CertDir) -> Result<RotationStatus, DirError> {
    let state = dir.state()?;
    let report = inspect_dir(dir, 0, std::time::SystemTime::now())?;
    let bundle = report
        .cas
        .iter()
        .map(|ca| BundleEntry {
            fingerprint_sha256: ca.cert.fingerprint_sha256.clone(),
            subject: ca.cert.subject.clone(),
            role: ca.role,
            days_left: ca.cert.days_left,
        })
        .collect();
    let mut leaves_by_ca: Vec<LeavesOfCa> = report
        .cas
        .iter()
        .map(|ca| LeavesOfCa {
            ca: ca.cert.fingerprint_sha256.clone(),
            members: Vec::new(),
        })
        .collect();
    let mut leaves_untrusted = Vec::new();
    for leaf in &report.leaves {
        let name = leaf
            .cert
            .file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        match leaf
            .signed_by
            .as_ref()
            .and_then(|fp| leaves_by_ca.iter_mut().find(|l| &l.ca == fp))
        {
            Some(group) => group.members.push(name),
            None => leaves_untrusted.push(name),
        }
    }
    Ok(RotationStatus {
        stage: state.stage,
        trust_domain: state.trust_domain.clone(),
        rotation: state.rotation.clone(),
        bundle,
        leaves_by_ca,
        leaves_untrusted,
        next: next_step(state.stage, dir),
    })
}

/// What the operator does next at `stage`.
pub fn next_step(stage: Stage, dir: &CertDir) -> String {
    let d = dir.path().display();
    match stage {
        Stage::Idle => format!(
            "no rotation in progress; to replace the CA, run `mcpgw certs rotate begin --dir {d}`"
        ),
        Stage::Begun => format!(
            "install the new {bundle} (old and new CA) on every host and wait until every \
             worker has reloaded it (its log says \"mesh TLS material reloaded\"; `mcpgw certs \
             inspect` on each host shows both CAs); then run `mcpgw certs rotate reissue --dir {d}`",
            bundle = crate::store::BUNDLE_FILE
        ),
        Stage::Reissued => format!(
            "install each host's new NAME.crt and NAME.key and wait until every worker has \
             reloaded them (`mcpgw certs inspect` on each host shows its leaf signed by the \
             new CA); then run `mcpgw certs rotate finish --dir {d}`"
        ),
    }
}

fn missing_record(dir: &CertDir) -> DirError {
    DirError::BadState {
        path: dir.path().join(crate::store::STATE_FILE),
        reason: "a rotation stage is recorded without the rotation (old and new CA)".into(),
    }
}

fn contains(bundle: &[CertificateDer<'_>], fingerprint: &str) -> bool {
    bundle
        .iter()
        .any(|der| crate::sha256_fingerprint(der) == fingerprint)
}

fn der_of(ca: &SigningCa) -> Result<CertificateDer<'static>, CertError> {
    let path = PathBuf::from(crate::store::NEXT_CA_CERT_FILE);
    crate::config::parse_certs(ca.pem.cert.as_bytes(), &path)?
        .into_iter()
        .next()
        .ok_or(CertError::NoCertificates { path })
}

/// Whether the leaf of `name` in `dir` was signed by `ca`.
fn leaf_is_from(dir: &CertDir, name: &str, ca: &CertificateDer<'_>) -> Result<bool, DirError> {
    let path = dir.path().join(format!("{name}.crt"));
    let certs = crate::config::read_certs(&path)?;
    Ok(certs.first().is_some_and(|leaf| leaf_signed_by(leaf, ca)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(stage: Stage, finished_before: bool) -> DirState {
        DirState {
            format: 1,
            trust_domain: "mcpgw".into(),
            stage,
            rotation: Some(RotationRecord {
                old_ca: "old".into(),
                new_ca: "new".into(),
                begun_at: "t0".into(),
                reissued_at: None,
                finished_at: finished_before.then(|| "t2".to_owned()),
            })
            .filter(|_| stage != Stage::Idle || finished_before),
        }
    }

    /// The whole decision table: every command in every recorded state.
    #[test]
    fn each_command_runs_repeats_or_names_the_stage_that_comes_next() {
        use RotateStep::*;
        let dir = CertDir::new("/certs");
        let ok = |plan: Plan| Ok::<Plan, &'static str>(plan);
        let next = |step: &'static str| Err::<Plan, &'static str>(step);
        let table = [
            (Stage::Idle, false, Begin, ok(Plan::Advance)),
            (Stage::Idle, false, Reissue, next("begin")),
            (Stage::Idle, false, Finish, next("begin")),
            (Stage::Idle, true, Begin, ok(Plan::Advance)),
            (Stage::Idle, true, Reissue, next("begin")),
            (Stage::Idle, true, Finish, ok(Plan::AlreadyFinished)),
            (Stage::Begun, false, Begin, ok(Plan::Repeat)),
            (Stage::Begun, false, Reissue, ok(Plan::Advance)),
            (Stage::Begun, false, Finish, next("reissue")),
            (Stage::Reissued, false, Begin, next("finish")),
            (Stage::Reissued, false, Reissue, ok(Plan::Repeat)),
            (Stage::Reissued, false, Finish, ok(Plan::Advance)),
        ];
        for (stage, finished_before, step, expected) in table {
            let got = plan(step, &state(stage, finished_before), &dir);
            match (got, expected) {
                (Ok(got), Ok(expected)) => assert_eq!(got, expected, "{stage:?} {step:?}"),
                (
                    Err(DirError::OutOfOrder {
                        attempted, next, ..
                    }),
                    Err(expected_next),
                ) => {
                    assert_eq!(attempted, step.name());
                    assert_eq!(
                        next,
                        format!("mcpgw certs rotate {expected_next} --dir /certs"),
                        "{stage:?} {step:?}"
                    );
                }
                (got, expected) => panic!("{stage:?} {step:?}: got {got:?}, expected {expected:?}"),
            }
        }
    }
}
