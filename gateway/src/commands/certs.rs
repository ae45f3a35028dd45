//! `mcpgw certs`: the mesh CA, leaf certificates and staged CA rotation, as files in one
//! directory (see `mcpgw_certs::CertDir` for the layout). The decisions live in
//! `mcpgw-certs`; this module parses arguments and prints.
//!
//! Exit codes: 0 done; 1 refused or failed (the message says why and what to do);
//! `inspect` exits 1 when it found problems and 2 when it could not inspect.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Subcommand;
use mcpgw_certs::inspect::{CaRole, InspectReport, KeyStatus, rfc3339, short_fingerprint};
use mcpgw_certs::rotate::{self, RotationStatus};
use mcpgw_certs::{CertDir, Stage, TrustDomain};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Longest CA validity accepted (100 years); beyond, dates stop being meaningful.
const MAX_CA_DAYS: u64 = 36_500;
/// Longest leaf validity accepted (10 years). Leaves are meant to be short-lived.
const MAX_LEAF_DAYS: u64 = 3_650;

#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Creates a private mesh CA in DIR (ca.crt, ca.key, state.json). Refuses to
    /// overwrite one.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// Trust domain of every identity issued from DIR: leaves carry
        /// spiffe://DOMAIN/mesh/NAME, and workers accept only this domain.
        #[arg(long, default_value = mcpgw_certs::DEFAULT_TRUST_DOMAIN)]
        trust_domain: String,
        /// Validity of the CA in days.
        #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u64).range(1..=MAX_CA_DAYS))]
        days: u64,
    },
    /// Issues (or renews) the leaf of mesh member NAME (a host or container): DIR/NAME.crt
    /// and DIR/NAME.key (mode 0600). During a rotation, from the new CA once `rotate
    /// reissue` has run.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        name: String,
        /// Validity in days (capped at the CA's own expiry).
        #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=MAX_LEAF_DAYS))]
        days: u64,
    },
    /// Shows the CAs of a bundle and the leaves: subjects, identities, SHA-256
    /// fingerprints, issuers, days to expiry, and which CA of the bundle signed each
    /// leaf. Exits 1 when anything expires within --warn-days or a leaf is not signed
    /// by a CA of the bundle, 2 when it cannot inspect.
    Inspect {
        /// A certificate directory made by `mcpgw certs`.
        #[arg(long, conflicts_with = "files")]
        dir: Option<PathBuf>,
        /// Certificate files instead (a worker's ca.crt and NAME.crt): CA certificates
        /// among them form the bundle; a key NAME.key beside NAME.crt is checked too.
        #[arg(required_unless_present = "dir")]
        files: Vec<PathBuf>,
        /// Anything expiring within this many days is a problem.
        #[arg(long, default_value_t = 30)]
        warn_days: u32,
        /// Trust domain leaves must belong to (default: the directory's, or mcpgw).
        #[arg(long)]
        trust_domain: Option<String>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Staged CA rotation: begin → (workers reload) → reissue → (workers reload) → finish.
    #[command(subcommand)]
    Rotate(RotateCommand),
}

#[derive(Debug, Subcommand)]
pub enum RotateCommand {
    /// Stage 1: a new CA; the bundle ca.crt holds the old and the new. Install ca.crt on
    /// every host and wait until every worker has reloaded it before `reissue`.
    Begin {
        #[arg(long)]
        dir: PathBuf,
        /// Validity of the new CA in days.
        #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u64).range(1..=MAX_CA_DAYS))]
        days: u64,
    },
    /// Stage 2: every leaf in DIR is issued again from the new CA (new keys). Install
    /// them and wait until every worker has reloaded them, plus the maximum connection
    /// age, before `finish`.
    Reissue {
        #[arg(long)]
        dir: PathBuf,
        /// Validity of the new leaves in days.
        #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=MAX_LEAF_DAYS))]
        days: u64,
    },
    /// Stage 3: the bundle holds only the new CA, and its key becomes ca.key. Refused
    /// while a leaf from the old CA is left in DIR.
    Finish {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Where the rotation stands, which CA signed which leaf, and what to do next.
    Status {
        #[arg(long)]
        dir: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: CertsCommand) -> ExitCode {
    if let CertsCommand::Inspect {
        dir,
        files,
        warn_days,
        trust_domain,
        json,
    } = command
    {
        return inspect(dir, files, warn_days, trust_domain, json);
    }
    match execute(command) {
        Ok(message) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("mcpgw certs: {message}");
            ExitCode::FAILURE
        }
    }
}

fn execute(command: CertsCommand) -> Result<String, String> {
    let text = |e: &dyn std::fmt::Display| e.to_string();
    match command {
        CertsCommand::Init {
            dir,
            trust_domain,
            days,
        } => {
            let trust_domain = TrustDomain::new(&trust_domain).map_err(|e| text(&e))?;
            let certs = CertDir::new(&dir);
            let fingerprint = certs
                .init(&trust_domain, DAY * days as u32)
                .map_err(|e| text(&e))?;
            Ok(format!(
                "mesh CA of trust domain {trust_domain} written to {} (sha256 {fingerprint}); \
                 its key {} stays here, never on workers",
                certs.bundle_path().display(),
                dir.join(mcpgw_certs::CA_KEY_FILE).display()
            ))
        }
        CertsCommand::Issue { dir, name, days } => {
            let certs = CertDir::new(&dir);
            let leaf = certs
                .issue(&name, DAY * days as u32)
                .map_err(|e| text(&e))?;
            Ok(format!(
                "leaf for {name} written to {} and {} (expires {}, signed by CA {})",
                leaf.cert_path.display(),
                leaf.key_path.display(),
                date(leaf.not_after),
                short_fingerprint(&leaf.signed_by)
            ))
        }
        CertsCommand::Rotate(command) => rotate_command(command),
        CertsCommand::Inspect { .. } => Err("inspect is handled apart".into()),
    }
}

fn rotate_command(command: RotateCommand) -> Result<String, String> {
    match command {
        RotateCommand::Begin { dir, days } => rotate_begin(dir, days),
        RotateCommand::Reissue { dir, days } => rotate_reissue(dir, days),
        RotateCommand::Finish { dir } => rotate_finish(dir),
        RotateCommand::Status { dir, json } => rotate_status(dir, json),
    }
}

fn rotate_begin(dir: PathBuf, days: u64) -> Result<String, String> {
    let certs = CertDir::new(dir);
    let out = rotate::begin(&certs, DAY * days as u32).map_err(|e| e.to_string())?;
    let head = if out.already {
        "rotation already begun; nothing new was made".to_owned()
    } else {
        format!(
            "rotation begun: new CA {} (ca-next.crt, ca-next.key); {} now holds the old \
             CA {} and the new",
            short_fingerprint(&out.new_ca),
            out.bundle.display(),
            short_fingerprint(&out.old_ca)
        )
    };
    Ok(format!(
        "{head}\nnext: {}",
        rotate::next_step(Stage::Begun, &certs)
    ))
}

fn rotate_reissue(dir: PathBuf, days: u64) -> Result<String, String> {
    let certs = CertDir::new(dir);
    let out = rotate::reissue(&certs, DAY * days as u32).map_err(|e| e.to_string())?;
    let mut lines = Vec::new();
    if out.already {
        lines.push(format!(
            "every leaf is from the new CA {} already; nothing was reissued",
            short_fingerprint(&out.new_ca)
        ));
    } else {
        lines.push(format!(
            "reissued {} leaves from the new CA {}{}",
            out.reissued.len(),
            short_fingerprint(&out.new_ca),
            if out.unchanged.is_empty() {
                String::new()
            } else {
                format!(" ({} were from it already)", out.unchanged.len())
            }
        ));
        for (name, leaf) in &out.reissued {
            lines.push(format!(
                "  {name}: {} and {} (expires {})",
                leaf.cert_path.display(),
                leaf.key_path.display(),
                date(leaf.not_after)
            ));
        }
    }
    lines.push(format!(
        "next: {}",
        rotate::next_step(Stage::Reissued, &certs)
    ));
    Ok(lines.join("\n"))
}

fn rotate_finish(dir: PathBuf) -> Result<String, String> {
    let certs = CertDir::new(dir);
    let out = rotate::finish(&certs).map_err(|e| e.to_string())?;
    let head = if out.already {
        format!(
            "rotation already finished: {} holds only CA {}",
            certs.bundle_path().display(),
            short_fingerprint(&out.ca)
        )
    } else {
        format!(
            "rotation finished: {} holds only the new CA {}, whose key is now ca.key; the \
             old CA {} and its key are gone",
            certs.bundle_path().display(),
            short_fingerprint(&out.ca),
            short_fingerprint(&out.removed)
        )
    };
    Ok(format!(
        "{head}\nnext: install the new {} on every host; once workers have reloaded it \
         and connections older than --mesh-max-connection-age are replaced, a peer with \
         only old-CA material can no longer connect",
        mcpgw_certs::BUNDLE_FILE
    ))
}

fn rotate_status(dir: PathBuf, json: bool) -> Result<String, String> {
    let certs = CertDir::new(dir);
    let status = rotate::status(&certs).map_err(|e| e.to_string())?;
    if json {
        serde_json::to_string_pretty(&status).map_err(|e| e.to_string())
    } else {
        Ok(render_status(&status))
    }
}

fn inspect(
    dir: Option<PathBuf>,
    files: Vec<PathBuf>,
    warn_days: u32,
    trust_domain: Option<String>,
    json: bool,
) -> ExitCode {
    let now = SystemTime::now();
    let report = match (dir, trust_domain) {
        (Some(dir), None) => mcpgw_certs::inspect::inspect_dir(&CertDir::new(dir), warn_days, now)
            .map_err(|e| e.to_string()),
        (Some(_), Some(_)) => Err(
            "--trust-domain goes with FILES; a directory's trust domain is the one it was \
             initialised with"
                .to_owned(),
        ),
        (None, trust_domain) => TrustDomain::new(
            trust_domain
                .as_deref()
                .unwrap_or(mcpgw_certs::DEFAULT_TRUST_DOMAIN),
        )
        .map_err(|e| e.to_string())
        .and_then(|domain| {
            mcpgw_certs::inspect::inspect_files(&files, &domain, warn_days, now)
                .map_err(|e| e.to_string())
        }),
    };
    let report = match report {
        Ok(report) => report,
        Err(message) => {
            eprintln!("mcpgw certs inspect: {message}");
            return ExitCode::from(2);
        }
    };
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("mcpgw certs inspect: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", render_report(&report));
    }
    if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn date(at: SystemTime) -> String {
    let secs = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    rfc3339(secs)
}

fn days_text(days: i64) -> String {
    if days < 0 {
        format!("expired {} days ago", -days)
    } else {
        format!("{days} days left")
    }
}

fn role_text(role: Option<CaRole>) -> &'static str {
    match role {
        Some(CaRole::Active) => "active",
        Some(CaRole::Next) => "next",
        Some(CaRole::Old) => "old",
        None => "ca",
    }
}

fn render_report(report: &InspectReport) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    match report.stage {
        Some(stage) => line(format!(
            "trust domain {}, rotation stage {}",
            report.trust_domain,
            stage.name()
        )),
        None => line(format!("trust domain {}", report.trust_domain)),
    }
    line(format!("CA bundle ({}):", report.cas.len()));
    for ca in &report.cas {
        line(format!("  [{}] {}", role_text(ca.role), ca.cert.subject));
        line(format!("      file    {}", ca.cert.file.display()));
        line(format!("      sha256  {}", ca.cert.fingerprint_sha256));
        line(format!(
            "      expires {} ({})",
            ca.cert.not_after,
            days_text(ca.cert.days_left)
        ));
    }
    line(format!("leaves ({}):", report.leaves.len()));
    for leaf in &report.leaves {
        line(format!(
            "  {}  {}",
            leaf.member.as_deref().unwrap_or("(no mesh identity)"),
            if leaf.identities.is_empty() {
                "no URI SAN".to_owned()
            } else {
                leaf.identities.join(", ")
            }
        ));
        line(format!(
            "      file    {} (key: {})",
            leaf.cert.file.display(),
            match leaf.key {
                KeyStatus::Matches => "matches",
                KeyStatus::Mismatch => "DOES NOT MATCH",
                KeyStatus::Unreadable => "UNREADABLE",
                KeyStatus::Absent => "not here",
            }
        ));
        line(format!("      subject {}", leaf.cert.subject));
        line(format!("      sha256  {}", leaf.cert.fingerprint_sha256));
        line(format!("      issuer  {}", leaf.cert.issuer));
        match (&leaf.signed_by, &leaf.signed_by_subject) {
            (Some(fp), Some(subject)) => line(format!(
                "      signed by {} ({})",
                subject,
                short_fingerprint(fp)
            )),
            _ => line("      signed by NO CA IN THE BUNDLE".to_owned()),
        }
        line(format!(
            "      expires {} ({})",
            leaf.cert.not_after,
            days_text(leaf.cert.days_left)
        ));
    }
    if report.problems.is_empty() {
        line(format!(
            "ok: nothing expires within {} days, every leaf is signed by a CA of the bundle",
            report.warn_days
        ));
    } else {
        line(format!("problems ({}):", report.problems.len()));
        for problem in &report.problems {
            line(format!("  - {problem}"));
        }
    }
    out
}

fn render_status(status: &RotationStatus) -> String {
    let mut out = vec![format!(
        "stage: {} (trust domain {})",
        status.stage.name(),
        status.trust_domain
    )];
    if let Some(rotation) = &status.rotation {
        let mut when = vec![format!("begun {}", rotation.begun_at)];
        if let Some(at) = &rotation.reissued_at {
            when.push(format!("reissued {at}"));
        }
        if let Some(at) = &rotation.finished_at {
            when.push(format!("finished {at}"));
        }
        let which = if status.stage == Stage::Idle {
            "last rotation"
        } else {
            "rotation"
        };
        out.push(format!(
            "{which}: {} → {}; {}",
            short_fingerprint(&rotation.old_ca),
            short_fingerprint(&rotation.new_ca),
            when.join(", ")
        ));
    }
    out.push(format!("bundle {}:", mcpgw_certs::BUNDLE_FILE));
    for ca in &status.bundle {
        out.push(format!(
            "  [{}] {} {} ({})",
            role_text(ca.role),
            short_fingerprint(&ca.fingerprint_sha256),
            ca.subject,
            days_text(ca.days_left)
        ));
    }
    out.push("leaves:".to_owned());
    for group in &status.leaves_by_ca {
        let role = status
            .bundle
            .iter()
            .find(|ca| ca.fingerprint_sha256 == group.ca)
            .map(|ca| role_text(ca.role))
            .unwrap_or("ca");
        out.push(format!(
            "  from the {role} CA {}: {}",
            short_fingerprint(&group.ca),
            if group.members.is_empty() {
                "none".to_owned()
            } else {
                group.members.join(", ")
            }
        ));
    }
    if !status.leaves_untrusted.is_empty() {
        out.push(format!(
            "  from NO CA of the bundle (peers refuse them): {}",
            status.leaves_untrusted.join(", ")
        ));
    }
    out.push(format!("next: {}", status.next));
    out.join("\n")
}
