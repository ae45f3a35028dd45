//! Hot reload of mesh TLS material from files: replaced files are picked up (by the
//! watcher, by the periodic check, through a Kubernetes-style link swap), bad files are
//! refused with one log line while the old material stays in use, and a fixed file is
//! then picked up.

mod common;

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{DAY, LeafSpec, LoopbackServer, TempDir, exchange, forge_client_config};
use mcpgw_certs::{
    CertError, MeshTlsFiles, MeshTlsSettings, MeshTlsSource, Pem, ReloadOptions, ReloadOutcome,
    TrustDomain, generate_ca, issue_leaf, sha256_fingerprint, write_file_atomically,
    write_pem_files,
};

/// Long enough that only the file watcher (or `reload_now`) triggers a reload; a hang
/// guard, not a speed expectation.
const NEVER: Duration = Duration::from_secs(3600);
const PATIENCE: Duration = Duration::from_secs(60);

fn options(poll_interval: Duration) -> ReloadOptions {
    ReloadOptions {
        poll_interval,
        ..ReloadOptions::default()
    }
}

/// A CA and the files of member `w` in `dir`.
fn setup(dir: &Path) -> (Pem, MeshTlsFiles) {
    let ca = generate_ca("mesh ca", 10 * DAY).unwrap();
    std::fs::write(dir.join("ca.crt"), &ca.cert).unwrap();
    write_pem_files(dir, "w", &issue_leaf(&ca, "w", DAY).unwrap()).unwrap();
    (ca, MeshTlsFiles::in_dir(dir, "w"))
}

fn fingerprint(pem: &Pem) -> String {
    sha256_fingerprint(&common::der(pem))
}

/// Checks the files now and expects new material in use: published by this check, or
/// by the file watcher just before it.
async fn expect_reloaded(source: &MeshTlsSource, expected_leaf: &str) {
    let outcome = source.reload_now().await;
    assert!(
        matches!(outcome, ReloadOutcome::Reloaded | ReloadOutcome::Unchanged),
        "{outcome:?}"
    );
    assert_eq!(source.current().leaf_fingerprint(), expected_leaf);
}

/// Waits for the next publication.
async fn next_publication(changes: &mut tokio::sync::watch::Receiver<Arc<mcpgw_certs::MeshTls>>) {
    tokio::time::timeout(PATIENCE, changes.changed())
        .await
        .expect("no reload happened")
        .expect("reloader alive");
}

#[tokio::test]
async fn an_atomically_replaced_leaf_is_picked_up_by_the_file_watcher() {
    let dir = TempDir::new();
    let (ca, files) = setup(dir.path());
    let source = MeshTlsSource::watch(&files, &MeshTlsSettings::default(), options(NEVER)).unwrap();
    let before = source.current();
    let mut changes = source.subscribe();

    let renewed = issue_leaf(&ca, "w", 2 * DAY).unwrap();
    write_pem_files(dir.path(), "w", &renewed).unwrap();
    next_publication(&mut changes).await;

    let after = source.current();
    assert_eq!(after.leaf_fingerprint(), fingerprint(&renewed));
    assert_ne!(after.leaf_fingerprint(), before.leaf_fingerprint());
    assert!(after.leaf_not_after() > before.leaf_not_after());
    assert_eq!(source.reload_now().await, ReloadOutcome::Unchanged);
    let stats = source.stats();
    assert_eq!((stats.reloaded, stats.refused), (1, 0));
}

#[tokio::test]
async fn the_periodic_check_picks_up_what_the_watcher_cannot_see() {
    // The certificate is a link into a directory the watcher does not watch; changing
    // the file behind it raises no event where the watcher looks.
    let dir = TempDir::new();
    let elsewhere = TempDir::new();
    let (ca, mut files) = setup(dir.path());
    write_pem_files(elsewhere.path(), "w", &issue_leaf(&ca, "w", DAY).unwrap()).unwrap();
    let link_cert = dir.path().join("linked.crt");
    let link_key = dir.path().join("linked.key");
    std::os::unix::fs::symlink(elsewhere.path().join("w.crt"), &link_cert).unwrap();
    std::os::unix::fs::symlink(elsewhere.path().join("w.key"), &link_key).unwrap();
    files.cert = link_cert;
    files.key = link_key;
    let source = MeshTlsSource::watch(
        &files,
        &MeshTlsSettings::default(),
        options(Duration::from_millis(200)),
    )
    .unwrap();
    let mut changes = source.subscribe();

    let renewed = issue_leaf(&ca, "w", 2 * DAY).unwrap();
    write_pem_files(elsewhere.path(), "w", &renewed).unwrap();
    next_publication(&mut changes).await;
    assert_eq!(source.current().leaf_fingerprint(), fingerprint(&renewed));
}

#[tokio::test]
async fn a_kubernetes_style_volume_swap_is_picked_up() {
    // A Secret volume: files are links through `..data`, which is swapped in one rename
    // to a new timestamped directory.
    let dir = TempDir::new();
    let ca = generate_ca("mesh ca", 10 * DAY).unwrap();
    let install = |version: &str, leaf: &Pem| {
        let target = dir.path().join(version);
        std::fs::create_dir_all(&target).unwrap();
        std::fs::write(target.join("ca.crt"), &ca.cert).unwrap();
        write_pem_files(&target, "w", leaf).unwrap();
        let tmp = dir.path().join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(version, &tmp).unwrap();
        std::fs::rename(&tmp, dir.path().join("..data")).unwrap();
    };
    install("..v1", &issue_leaf(&ca, "w", DAY).unwrap());
    for name in ["ca.crt", "w.crt", "w.key"] {
        std::os::unix::fs::symlink(format!("..data/{name}"), dir.path().join(name)).unwrap();
    }
    let files = MeshTlsFiles::in_dir(dir.path(), "w");
    let source = MeshTlsSource::watch(&files, &MeshTlsSettings::default(), options(NEVER)).unwrap();
    let mut changes = source.subscribe();

    let renewed = issue_leaf(&ca, "w", 2 * DAY).unwrap();
    install("..v2", &renewed);
    next_publication(&mut changes).await;
    assert_eq!(source.current().leaf_fingerprint(), fingerprint(&renewed));
}

/// Log lines written while a test runs, to count refusals and look for key material.
#[derive(Clone, Default)]
struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl CapturedLogs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLogs {
    type Writer = CapturedLogs;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Every log line of this test binary. A global subscriber, because tracing caches
/// per call site whether anyone listens, and a thread-local one would miss call sites
/// first reached by another test. Tests pick their own lines by their directory.
fn captured_logs() -> CapturedLogs {
    static LOGS: std::sync::OnceLock<CapturedLogs> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = CapturedLogs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        logs
    })
    .clone()
}

/// The base64 body lines of a PEM key: none of them may ever appear in a log.
fn key_lines(pem: &Pem) -> Vec<String> {
    pem.key
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() > 16)
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn bad_files_are_refused_with_one_log_line_each_and_the_old_material_keeps_serving() {
    let logs = captured_logs();
    let dir = TempDir::new();
    let ours = |line: &&str| line.contains(dir.path().to_str().unwrap());
    // The files are links into a directory the watcher does not see, so that only
    // `reload_now` checks them and each bad file is met exactly once, whole (the
    // watcher is tested above).
    let behind = TempDir::new();
    let (ca, mut files) = setup(behind.path());
    for (name, file) in [
        ("ca.crt", &mut files.ca),
        ("w.crt", &mut files.cert),
        ("w.key", &mut files.key),
    ] {
        let link = dir.path().join(name);
        std::os::unix::fs::symlink(behind.path().join(name), &link).unwrap();
        *file = link;
    }
    let good = mcpgw_certs::load_pem_files(&files.cert, &files.key).unwrap();
    let source = MeshTlsSource::watch(&files, &MeshTlsSettings::default(), options(NEVER)).unwrap();
    let in_use = source.current().leaf_fingerprint().to_owned();
    let serving = source.clone();
    let mut server =
        LoopbackServer::start(move || serving.server_config(), TrustDomain::default()).await;
    let client = forge_client_config(&[&ca], &issue_leaf(&ca, "client", DAY).unwrap());

    let other_ca = generate_ca("other ca", DAY).unwrap();
    let now = time::OffsetDateTime::now_utc();
    let expired = LeafSpec::mesh(&ca, "mcpgw", "w")
        .valid(now - time::Duration::days(2), now - time::Duration::days(1))
        .build();
    let other_key = issue_leaf(&ca, "w", DAY).unwrap().key;
    let mut secrets = key_lines(&good);
    secrets.extend(key_lines(&expired));
    let cases: Vec<(&str, Pem, &str)> = vec![
        (
            "garbage certificate",
            Pem {
                cert: "garbage".into(),
                key: good.key.clone(),
            },
            "no PEM certificate found in",
        ),
        (
            "garbage key",
            Pem {
                cert: good.cert.clone(),
                key: "garbage".into(),
            },
            "no usable PEM private key found in",
        ),
        (
            "key of another certificate",
            Pem {
                cert: good.cert.clone(),
                key: other_key,
            },
            "does not belong to the certificate",
        ),
        (
            "leaf from another CA",
            issue_leaf(&other_ca, "w", DAY).unwrap(),
            "not issued by a CA in the bundle",
        ),
        ("expired leaf", expired, "has expired"),
        (
            "leaf of another trust domain",
            LeafSpec::mesh(&ca, "elsewhere", "w").build(),
            "not of this mesh's trust domain",
        ),
    ];
    let count = cases.len();
    for (i, (case, pem, reason)) in cases.into_iter().enumerate() {
        write_pem_files(behind.path(), "w", &pem).unwrap();
        let ReloadOutcome::Refused(refusal) = source.reload_now().await else {
            panic!("{case}: not refused");
        };
        assert!(refusal.contains(reason), "{case}: {refusal}");
        assert!(
            refusal.contains(dir.path().to_str().unwrap()),
            "{case}: no path in {refusal}"
        );
        // Asking again changes nothing and logs nothing more.
        assert_eq!(
            source.reload_now().await,
            ReloadOutcome::Refused(refusal.clone())
        );
        let stats = source.stats();
        assert_eq!(stats.refused, i as u64 + 1, "{case}");
        assert_eq!(
            stats.pending_refusal.as_deref(),
            Some(refusal.as_str()),
            "{case}"
        );

        // The old material stays in use, and the worker keeps serving with it.
        assert_eq!(source.current().leaf_fingerprint(), in_use, "{case}");
        let saw = exchange(client.clone(), server.addr, &TrustDomain::default()).await;
        assert_eq!(saw.unwrap().server, "w", "{case}");
        assert_eq!(server.next_seen().await.unwrap(), "client");
    }

    let log = logs.text();
    let refusals = log
        .lines()
        .filter(ours)
        .filter(|l| l.contains("mesh TLS material refused"))
        .count();
    assert_eq!(refusals, count, "{log}");
    for secret in &secrets {
        assert!(
            !log.contains(secret.as_str()),
            "key material in the log:\n{log}"
        );
    }

    // A fixed file is picked up.
    let fixed = issue_leaf(&ca, "w", DAY).unwrap();
    write_pem_files(behind.path(), "w", &fixed).unwrap();
    assert_eq!(source.reload_now().await, ReloadOutcome::Reloaded);
    assert_eq!(source.current().leaf_fingerprint(), fingerprint(&fixed));
    let stats = source.stats();
    assert_eq!(
        (stats.reloaded, stats.refused, stats.pending_refusal),
        (1, count as u64, None)
    );
    let log = logs.text();
    let reloads: Vec<&str> = log
        .lines()
        .filter(ours)
        .filter(|l| l.contains("mesh TLS material reloaded"))
        .collect();
    assert_eq!(reloads.len(), 1, "{log}");
}

#[tokio::test]
async fn a_bad_bundle_is_refused_and_a_fixed_one_picked_up() {
    let dir = TempDir::new();
    let (ca, files) = setup(dir.path());
    let source = MeshTlsSource::watch(&files, &MeshTlsSettings::default(), options(NEVER)).unwrap();

    write_file_atomically(
        &files.ca,
        b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        false,
    )
    .unwrap();
    assert!(matches!(source.reload_now().await, ReloadOutcome::Refused(r) if r.contains("ca.crt")));
    assert_eq!(source.current().ca_fingerprints().len(), 1);

    // The bundle of a rotation: old and new CA.
    let next = generate_ca("next ca", DAY).unwrap();
    write_file_atomically(
        &files.ca,
        format!("{}{}", ca.cert, next.cert).as_bytes(),
        false,
    )
    .unwrap();
    let leaf = source.current().leaf_fingerprint().to_owned();
    expect_reloaded(&source, &leaf).await;
    assert_eq!(
        source.current().ca_fingerprints(),
        [fingerprint(&ca), fingerprint(&next)]
    );
}

#[tokio::test]
async fn a_leaf_that_is_not_valid_yet_is_refused_and_taken_once_it_is() {
    let dir = TempDir::new();
    let (ca, files) = setup(dir.path());
    let source = MeshTlsSource::watch(&files, &MeshTlsSettings::default(), options(NEVER)).unwrap();
    // x509 times have whole seconds, so the leaf may be valid from the second its start
    // falls in. A check says "refused" only if it ended before that second; on a
    // machine slow enough to reach it first, the test tries again with a later start.
    let mut lead = Duration::from_secs(2);
    let (early, valid_from) = loop {
        assert!(
            lead <= 4 * PATIENCE,
            "never checked a leaf before its start"
        );
        let now = time::OffsetDateTime::now_utc();
        let start = now + lead;
        let early = LeafSpec::mesh(&ca, "mcpgw", "w")
            .valid(start, now + time::Duration::days(1))
            .build();
        let valid_from = SystemTime::UNIX_EPOCH
            + Duration::from_secs(u64::try_from(start.unix_timestamp()).unwrap());
        write_pem_files(dir.path(), "w", &early).unwrap();
        let outcome = source.reload_now().await;
        if SystemTime::now() < valid_from {
            let ReloadOutcome::Refused(reason) = outcome else {
                panic!("a leaf from the future was taken: {outcome:?}");
            };
            assert!(reason.contains("not valid yet"), "{reason}");
            break (early, valid_from);
        }
        eprintln!("checked only once the leaf was valid ({outcome:?}); again, starting later");
        lead *= 2;
    };

    // The files stay as they are: the refused content is checked again, and taken
    // once its start has passed (a second more, for the rounding of x509 times).
    while SystemTime::now() < valid_from + Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    expect_reloaded(&source, &fingerprint(&early)).await;
}

#[test]
fn a_reloading_source_needs_a_runtime_and_the_first_load_must_succeed() {
    let dir = TempDir::new();
    let (_, files) = setup(dir.path());
    let err = MeshTlsSource::watch(
        &files,
        &MeshTlsSettings::default(),
        ReloadOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, CertError::NoRuntime), "{err:?}");

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        std::fs::write(&files.key, "garbage").unwrap();
        let err = MeshTlsSource::watch(
            &files,
            &MeshTlsSettings::default(),
            ReloadOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(err, CertError::NoPrivateKey { .. }), "{err:?}");
    });
}
