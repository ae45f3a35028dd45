//! `mcpgw certs`: the mesh CA and leaf certificates, as files in one directory
//! (`ca.crt`, `ca.key`, `{member}.crt`, `{member}.key`).
//!
//! `init` and `issue` exist; staged rotation (`rotate`) and `inspect` are not
//! implemented yet.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;

const DAY: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Creates a private mesh CA in DIR (ca.crt, ca.key). Refuses to overwrite one.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = 3650)]
        days: u64,
    },
    /// Issues a leaf for mesh member NAME (a host or container) from the CA in DIR.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        name: String,
        /// Validity in days.
        #[arg(long, default_value_t = 90)]
        days: u64,
    },
}

pub fn run(command: CertsCommand) -> ExitCode {
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
    match command {
        CertsCommand::Init { dir, days } => {
            if dir.join("ca.crt").exists() || dir.join("ca.key").exists() {
                return Err(format!(
                    "{} already holds a CA; remove it first or use another --dir",
                    dir.display()
                ));
            }
            let ca = mcpgw_certs::generate_ca("mcpgw mesh CA", DAY * days as u32)
                .map_err(|e| e.to_string())?;
            let (cert, _key) =
                mcpgw_certs::write_pem_files(&dir, "ca", &ca).map_err(|e| e.to_string())?;
            Ok(format!("mesh CA written to {}", cert.display()))
        }
        CertsCommand::Issue { dir, name, days } => {
            let ca = mcpgw_certs::load_pem_files(&dir.join("ca.crt"), &dir.join("ca.key"))
                .map_err(|e| {
                    format!("{e} (run `mcpgw certs init --dir {}` first)", dir.display())
                })?;
            let leaf = mcpgw_certs::issue_leaf(&ca, &name, DAY * days as u32)
                .map_err(|e| e.to_string())?;
            let (cert, key) =
                mcpgw_certs::write_pem_files(&dir, &name, &leaf).map_err(|e| e.to_string())?;
            Ok(format!(
                "leaf for {name} written to {} and {}",
                cert.display(),
                key.display()
            ))
        }
    }
}
