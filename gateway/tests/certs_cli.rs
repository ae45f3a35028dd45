//! `mcpgw certs` end to end: the built binary run on a real directory, as an operator
//! runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-certs-cli-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.file(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What one run of `mcpgw` did.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn ok(self) -> Run {
        assert_eq!(
            self.code, 0,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        self
    }

    fn fails(self, code: i32, says: &str) -> Run {
        assert_eq!(
            self.code, code,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        assert!(
            self.stderr.contains(says) || self.stdout.contains(says),
            "expected {says:?}\nstdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        self
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
    }
}

fn mcpgw(args: &[&str]) -> Run {
    let out: Output = Command::new(env!("CARGO_BIN_EXE_mcpgw"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn certs(args: &[&str]) -> Run {
    let mut all = vec!["certs"];
    all.extend_from_slice(args);
    mcpgw(&all)
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Every file of the directory with its content, to show a command changed nothing.
fn snapshot(dir: &TempDir) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

fn inspect_json(dir: &TempDir, extra: &[&str]) -> (i32, serde_json::Value) {
    let mut args = vec!["inspect", "--dir", dir.arg(), "--json"];
    args.extend_from_slice(extra);
    let run = certs(&args);
    let json = run.json();
    (run.code, json)
}

/// Member name → fingerprint of the CA that signed its leaf (null when none of the
/// bundle did).
fn signers(report: &serde_json::Value) -> Vec<(String, serde_json::Value)> {
    report["leaves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["member"].as_str().unwrap_or("?").to_owned(),
                l["signed_by"].clone(),
            )
        })
        .collect()
}

#[test]
fn init_and_issue_write_the_files_workers_load_and_refuse_what_would_break_them() {
    let dir = TempDir::new();
    certs(&["issue", "--dir", dir.arg(), "--name", "host-a"])
        .fails(1, "run `mcpgw certs init --dir");
    certs(&["init", "--dir", dir.arg(), "--trust-domain", "Not/Valid"])
        .fails(1, "invalid trust domain");

    certs(&["init", "--dir", dir.arg()]).ok();
    assert_eq!(mode(&dir.file("ca.key")), 0o600);
    let state: serde_json::Value = serde_json::from_slice(&dir.read("state.json")).unwrap();
    assert_eq!(state["trust_domain"], "mcpgw");
    assert_eq!(state["stage"], "idle");
    let ca_before = snapshot(&dir);
    certs(&["init", "--dir", dir.arg()]).fails(1, "already holds a mesh CA");
    assert_eq!(snapshot(&dir), ca_before);

    let run = certs(&["issue", "--dir", dir.arg(), "--name", "host-a"]).ok();
    assert!(run.stdout.contains("host-a.crt"), "{}", run.stdout);
    assert_eq!(mode(&dir.file("host-a.key")), 0o600);
    assert_eq!(mode(&dir.file("host-a.crt")), 0o644);

    // Names that would overwrite the CA, the bundle or the next CA.
    let before = snapshot(&dir);
    for name in ["ca", "CA", "ca-next"] {
        certs(&["issue", "--dir", dir.arg(), "--name", name]).fails(1, "is reserved");
    }
    std::fs::copy(dir.file("ca.crt"), dir.file("bundle.crt")).unwrap();
    certs(&["issue", "--dir", dir.arg(), "--name", "bundle"]).fails(1, "holds a CA certificate");
    std::fs::remove_file(dir.file("bundle.crt")).unwrap();
    certs(&["issue", "--dir", dir.arg(), "--name", "bad name"])
        .fails(1, "invalid mesh member name");
    // Validity: clap refuses with its usage exit code 2.
    for days in ["--days=0", "--days=3651", "--days=-1", "--days=many"] {
        certs(&["issue", "--dir", dir.arg(), "--name", "host-b", days]).fails(2, "invalid value");
    }
    certs(&[
        "init",
        "--dir",
        dir.file("other").to_str().unwrap(),
        "--days",
        "0",
    ])
    .fails(2, "--days");
    assert_eq!(snapshot(&dir), before);

    // Renewing a leaf replaces it.
    certs(&[
        "issue",
        "--dir",
        dir.arg(),
        "--name",
        "host-a",
        "--days",
        "30",
    ])
    .ok();
    assert_ne!(snapshot(&dir), before);
    let (code, report) = inspect_json(&dir, &["--warn-days", "7"]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(
        report["leaves"][0]["identities"][0],
        "spiffe://mcpgw/mesh/host-a"
    );
    assert_eq!(report["leaves"][0]["key"], "matches");
    assert!(report["leaves"][0]["days_left"].as_i64().unwrap() >= 29);
}

#[test]
fn a_directory_made_before_rotation_existed_still_works() {
    let dir = TempDir::new();
    certs(&["init", "--dir", dir.arg()]).ok();
    certs(&["issue", "--dir", dir.arg(), "--name", "old-host"]).ok();
    std::fs::remove_file(dir.file("state.json")).unwrap();
    certs(&["issue", "--dir", dir.arg(), "--name", "new-host"]).ok();
    let run = certs(&["rotate", "status", "--dir", dir.arg()]).ok();
    assert!(run.stdout.contains("stage: idle"), "{}", run.stdout);
    certs(&["rotate", "begin", "--dir", dir.arg()]).ok();
    certs(&["rotate", "reissue", "--dir", dir.arg()]).ok();
    certs(&["rotate", "finish", "--dir", dir.arg()]).ok();
    certs(&["inspect", "--dir", dir.arg()]).ok();
}

#[test]
fn a_configured_trust_domain_goes_into_every_leaf() {
    let dir = TempDir::new();
    certs(&["init", "--dir", dir.arg(), "--trust-domain", "prod.example"]).ok();
    certs(&["issue", "--dir", dir.arg(), "--name", "h"]).ok();
    let (code, report) = inspect_json(&dir, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["trust_domain"], "prod.example");
    assert_eq!(
        report["leaves"][0]["identities"][0],
        "spiffe://prod.example/mesh/h"
    );

    // Loose files are checked against the trust domain asked for.
    let bundle = dir.file("ca.crt");
    let leaf = dir.file("h.crt");
    let files = [bundle.to_str().unwrap(), leaf.to_str().unwrap()];
    certs(&[
        "inspect",
        files[0],
        files[1],
        "--trust-domain",
        "prod.example",
    ])
    .ok();
    certs(&["inspect", files[0], files[1]]).fails(1, "no mesh identity of trust domain \"mcpgw\"");
}

#[test]
fn rotation_stages_out_of_order_are_refused_naming_the_stage_that_comes_next() {
    let dir = TempDir::new();
    certs(&["init", "--dir", dir.arg()]).ok();
    certs(&["issue", "--dir", dir.arg(), "--name", "h"]).ok();
    let begin = format!(
        "the next stage is `mcpgw certs rotate begin --dir {}`",
        dir.arg()
    );
    let reissue = format!(
        "the next stage is `mcpgw certs rotate reissue --dir {}`",
        dir.arg()
    );
    let finish = format!(
        "the next stage is `mcpgw certs rotate finish --dir {}`",
        dir.arg()
    );

    let idle = snapshot(&dir);
    certs(&["rotate", "reissue", "--dir", dir.arg()]).fails(1, &begin);
    certs(&["rotate", "finish", "--dir", dir.arg()]).fails(1, &begin);
    assert_eq!(snapshot(&dir), idle);

    certs(&["rotate", "begin", "--dir", dir.arg()]).ok();
    let begun = snapshot(&dir);
    certs(&["rotate", "finish", "--dir", dir.arg()])
        .fails(1, &reissue)
        .fails(1, "the leaves are still from the old CA");
    assert_eq!(snapshot(&dir), begun);

    certs(&["rotate", "reissue", "--dir", dir.arg()]).ok();
    let reissued = snapshot(&dir);
    certs(&["rotate", "begin", "--dir", dir.arg()]).fails(1, &finish);
    assert_eq!(snapshot(&dir), reissued);

    certs(&["rotate", "finish", "--dir", dir.arg()]).ok();
    certs(&["rotate", "reissue", "--dir", dir.arg()]).fails(1, &begin);
}

#[test]
fn each_rotation_stage_can_run_twice_and_a_full_rotation_leaves_only_the_new_ca() {
    let dir = TempDir::new();
    certs(&["init", "--dir", dir.arg()]).ok();
    for host in ["host-a", "host-b"] {
        certs(&["issue", "--dir", dir.arg(), "--name", host]).ok();
    }
    let (_, before) = inspect_json(&dir, &[]);
    let old_ca = before["cas"][0]["fingerprint_sha256"].clone();
    let old_leaf = dir.read("host-a.crt");

    // begin, twice.
    let run = certs(&["rotate", "begin", "--dir", dir.arg()]).ok();
    assert!(
        run.stdout.contains("next: install the new ca.crt"),
        "{}",
        run.stdout
    );
    let begun = snapshot(&dir);
    let run = certs(&["rotate", "begin", "--dir", dir.arg()]).ok();
    assert!(run.stdout.contains("already begun"), "{}", run.stdout);
    assert_eq!(snapshot(&dir), begun);
    let status = certs(&["rotate", "status", "--dir", dir.arg(), "--json"])
        .ok()
        .json();
    assert_eq!(status["stage"], "begun");
    assert_eq!(status["bundle"].as_array().unwrap().len(), 2);
    let new_ca = status["rotation"]["new_ca"].clone();
    assert_eq!(status["rotation"]["old_ca"], old_ca);
    // The bundle workers load holds both; leaves are still from the old CA, including
    // one issued for a host that joins now.
    certs(&["issue", "--dir", dir.arg(), "--name", "host-c"]).ok();
    let (code, report) = inspect_json(&dir, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["cas"].as_array().unwrap().len(), 2);
    assert!(
        signers(&report).iter().all(|(_, ca)| *ca == old_ca),
        "{report}"
    );

    // reissue, twice.
    let run = certs(&["rotate", "reissue", "--dir", dir.arg()]).ok();
    assert!(run.stdout.contains("reissued 3 leaves"), "{}", run.stdout);
    let reissued = snapshot(&dir);
    let run = certs(&["rotate", "reissue", "--dir", dir.arg()]).ok();
    assert!(
        run.stdout.contains("nothing was reissued"),
        "{}",
        run.stdout
    );
    assert_eq!(snapshot(&dir), reissued);
    let (code, report) = inspect_json(&dir, &[]);
    assert_eq!(code, 0, "{report}");
    assert!(
        signers(&report).iter().all(|(_, ca)| *ca == new_ca),
        "{report}"
    );
    assert_eq!(mode(&dir.file("host-a.key")), 0o600);

    // A leaf of the old CA that turns up now holds finish back until it is reissued.
    std::fs::write(dir.file("late.crt"), &old_leaf).unwrap();
    certs(&["rotate", "finish", "--dir", dir.arg()])
        .fails(1, "leaves still signed by the old CA: late");
    let run = certs(&["rotate", "reissue", "--dir", dir.arg()]).ok();
    assert!(run.stdout.contains("reissued 1 leaves"), "{}", run.stdout);

    // finish, twice.
    let run = certs(&["rotate", "finish", "--dir", dir.arg()]).ok();
    assert!(run.stdout.contains("rotation finished"), "{}", run.stdout);
    let finished = snapshot(&dir);
    let run = certs(&["rotate", "finish", "--dir", dir.arg()]).ok();
    assert!(run.stdout.contains("already finished"), "{}", run.stdout);
    assert_eq!(snapshot(&dir), finished);
    assert!(!dir.file("ca-next.crt").exists() && !dir.file("ca-next.key").exists());
    assert_eq!(mode(&dir.file("ca.key")), 0o600);

    let (code, report) = inspect_json(&dir, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["cas"].as_array().unwrap().len(), 1);
    assert_eq!(report["cas"][0]["fingerprint_sha256"], new_ca);
    assert_eq!(report["cas"][0]["role"], "active");
    assert_eq!(report["stage"], "idle");
    assert!(
        signers(&report).iter().all(|(_, ca)| *ca == new_ca),
        "{report}"
    );
    // ca.key is now the new CA's: leaves issued from here on are trusted.
    certs(&["issue", "--dir", dir.arg(), "--name", "host-d"]).ok();
    let (code, report) = inspect_json(&dir, &[]);
    assert_eq!(code, 0, "{report}");

    let status = certs(&["rotate", "status", "--dir", dir.arg()]).ok();
    assert!(status.stdout.contains("stage: idle"), "{}", status.stdout);
    assert!(status.stdout.contains("last rotation"), "{}", status.stdout);

    // A leaf of the old CA is now refused by the bundle, and inspect says so.
    std::fs::write(dir.file("straggler.crt"), &old_leaf).unwrap();
    let run = certs(&["inspect", "--dir", dir.arg()]);
    run.fails(1, "is signed by a CA that is not in the bundle");
}

#[test]
fn inspect_warns_about_a_leaf_close_to_expiry() {
    let dir = TempDir::new();
    certs(&["init", "--dir", dir.arg()]).ok();
    certs(&[
        "issue",
        "--dir",
        dir.arg(),
        "--name",
        "long",
        "--days",
        "90",
    ])
    .ok();
    certs(&[
        "issue",
        "--dir",
        dir.arg(),
        "--name",
        "short",
        "--days",
        "5",
    ])
    .ok();

    let run = certs(&["inspect", "--dir", dir.arg(), "--warn-days", "10"]);
    let run = run.fails(1, "leaf of short expires in");
    assert!(
        !run.stdout.contains("leaf of long expires"),
        "{}",
        run.stdout
    );
    certs(&["inspect", "--dir", dir.arg(), "--warn-days", "3"]).ok();
    // The default window is 30 days.
    certs(&["inspect", "--dir", dir.arg()]).fails(1, "within --warn-days 30");

    let (code, report) = inspect_json(&dir, &["--warn-days", "10"]);
    assert_eq!(code, 1);
    assert_eq!(report["problems"].as_array().unwrap().len(), 1, "{report}");
    let short = report["leaves"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["member"] == "short")
        .unwrap();
    assert!(short["days_left"].as_i64().unwrap() <= 5);
    assert!(report["cas"][0]["days_left"].as_i64().unwrap() > 3000);
}

#[test]
fn inspect_flags_a_leaf_signed_by_a_ca_absent_from_the_bundle() {
    let ours = TempDir::new();
    let theirs = TempDir::new();
    for dir in [&ours, &theirs] {
        certs(&["init", "--dir", dir.arg()]).ok();
    }
    certs(&["issue", "--dir", ours.arg(), "--name", "member"]).ok();
    certs(&["issue", "--dir", theirs.arg(), "--name", "intruder"]).ok();

    // A worker's files: our bundle, and a leaf from elsewhere.
    let bundle = ours.file("ca.crt");
    let member = ours.file("member.crt");
    let intruder = theirs.file("intruder.crt");
    let args = [
        "inspect",
        bundle.to_str().unwrap(),
        member.to_str().unwrap(),
        intruder.to_str().unwrap(),
        "--json",
    ];
    let run = certs(&args);
    assert_eq!(run.code, 1, "{}", run.stdout);
    let report = run.json();
    let seen = signers(&report);
    assert_eq!(seen.len(), 2);
    assert!(seen.contains(&(
        "member".into(),
        report["cas"][0]["fingerprint_sha256"].clone()
    )));
    assert!(seen.contains(&("intruder".into(), serde_json::Value::Null)));
    let problems = report["problems"].to_string();
    assert!(problems.contains("intruder.crt"), "{problems}");
    assert!(problems.contains("not in the bundle"), "{problems}");

    // The same leaf dropped into our directory.
    std::fs::copy(&intruder, ours.file("intruder.crt")).unwrap();
    std::fs::copy(theirs.file("intruder.key"), ours.file("intruder.key")).unwrap();
    certs(&["inspect", "--dir", ours.arg()]).fails(1, "not in the bundle");

    // Inputs that cannot be inspected exit 2.
    certs(&["inspect", ours.file("missing.crt").to_str().unwrap()]).fails(2, "missing.crt");
    certs(&[
        "inspect",
        "--dir",
        theirs.file("nothing-here").to_str().unwrap(),
    ])
    .fails(2, "no mesh CA in");
}
