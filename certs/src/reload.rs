//! Mesh TLS material that follows its files: a worker picks up a new CA bundle, leaf
//! or key without a restart, and never a bad one.
//!
//! [`MeshTlsSource::watch`] loads the files once (a bad file then stops the start, as
//! before), then a task on the caller's tokio runtime watches them: inotify on the
//! directories that hold them (so an atomic rename, or a Kubernetes volume swapping its
//! `..data` link, is seen at once) plus a periodic check as a fallback (other systems,
//! network file systems, a watch that was lost). On a change, the new material is
//! checked in full the way a peer would check it ([`MeshTls::load_with`]) and only then
//! published; a bad file is refused with one log line naming the file and the reason,
//! and the material in use stays. Refused content is logged once, and checked again on
//! every tick: a leaf that was not valid yet is taken once it is.
//!
//! Readers take the current [`MeshTls`] per handshake ([`MeshTlsSource::current`]: a
//! read lock and an `Arc` clone); a transport that has to push a config somewhere
//! (quinn's `Endpoint::set_server_config`) waits on [`MeshTlsSource::subscribe`].
//! Connections already established keep the material they were made with.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustls::{ClientConfig, ServerConfig};
use tokio::sync::{Mutex, watch};
use tracing::{debug, info, warn};

use crate::config::FileContents;
use crate::{CertError, MeshTls, MeshTlsFiles, MeshTlsSettings, PeerIdentity};

/// How often and how carefully the files are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadOptions {
    /// Period of the fallback check, which runs whether or not the watcher reported
    /// anything. Shorter finds changes sooner where inotify does not work (network file
    /// systems); each check reads three small files and hashes them.
    pub poll_interval: Duration,
    /// After a change is seen, how long the files must stay the same before they are
    /// read for good: a certificate and its key are replaced by two renames, and
    /// reading between them would see a key that does not match. A reload takes one or
    /// two of these (measured: 0.2 s from `mcpgw certs` writing a leaf to new handshakes
    /// using it, with the default 100 ms).
    pub settle: Duration,
}

impl Default for ReloadOptions {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(10),
            settle: Duration::from_millis(100),
        }
    }
}

/// What a check of the files found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// The files hold what is in use.
    Unchanged,
    /// New material was checked and published.
    Reloaded,
    /// The files changed but were refused; the material in use stays. The reason names
    /// the file, never key material.
    Refused(String),
}

/// Counters of reload outcomes, for metrics and status views.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadStats {
    /// New material published since start (the initial load not counted).
    pub reloaded: u64,
    /// Distinct refusals since start (the same bad content is counted once).
    pub refused: u64,
    /// Reason of the last refusal that is still in effect: the files hold content that
    /// was refused, so what is in use is older than the files. `None` when the files
    /// hold what is in use.
    pub pending_refusal: Option<String>,
}

/// The current mesh TLS material of a worker; cheap to clone and to read.
#[derive(Debug, Clone)]
pub struct MeshTlsSource {
    /// The published material; `borrow` is a read lock, never held across an await.
    current: watch::Receiver<Arc<MeshTls>>,
    /// The reloader's state; `None` for material that never changes.
    reloader: Option<Arc<Reloader>>,
}

impl MeshTlsSource {
    /// Material that never reloads (tests, tools).
    pub fn fixed(tls: MeshTls) -> Self {
        let (_sender, current) = watch::channel(Arc::new(tls));
        Self {
            current,
            reloader: None,
        }
    }

    /// Loads `files` now (an error is returned as from [`MeshTls::load_with`]) and
    /// starts watching them on the current tokio runtime. The watcher stops when the
    /// last clone of the returned source is dropped.
    pub fn watch(
        files: &MeshTlsFiles,
        settings: &MeshTlsSettings,
        options: ReloadOptions,
    ) -> Result<Self, CertError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| CertError::NoRuntime)?;
        // Watch before the first read, so that no change after the read goes unseen.
        let watcher = FileWatcher::new(files);
        let contents = FileContents::read(files)?;
        let initial = MeshTls::build(files, settings, &contents)?;
        let (sender, current) = watch::channel(Arc::new(initial));
        let reloader = Arc::new(Reloader {
            files: files.clone(),
            settings: settings.clone(),
            options,
            sender,
            reloaded: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            pending_refusal: std::sync::Mutex::new(None),
            state: Mutex::new(CheckState {
                published: contents.digest(),
                refused: None,
            }),
        });
        runtime.spawn(watch_files(reloader.clone(), watcher));
        Ok(Self {
            current,
            reloader: Some(reloader),
        })
    }

    /// The material in use now. Take it once per handshake; do not keep it.
    pub fn current(&self) -> Arc<MeshTls> {
        self.current.borrow().clone()
    }

    /// The server config in use now: hand it to the next accepted handshake.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.current.borrow().server_config()
    }

    /// The client config in use now: hand it to the next dialled connection.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.current.borrow().client_config()
    }

    /// A receiver that wakes (`changed().await`) each time new material is published.
    /// For configs that are pushed rather than read per handshake, e.g. quinn's server
    /// config.
    pub fn subscribe(&self) -> watch::Receiver<Arc<MeshTls>> {
        let mut rx = self.current.clone();
        rx.mark_unchanged();
        rx
    }

    /// Identity and expiry of a verified peer, read with the configured trust domain.
    pub fn peer(
        &self,
        chain: &[rustls::pki_types::CertificateDer<'_>],
    ) -> Result<PeerIdentity, CertError> {
        self.current.borrow().peer(chain)
    }

    /// Checks the files now instead of waiting for the watcher (a SIGHUP, a test).
    /// Material that never reloads answers `Unchanged`.
    pub async fn reload_now(&self) -> ReloadOutcome {
        match &self.reloader {
            Some(reloader) => reloader.check().await,
            None => ReloadOutcome::Unchanged,
        }
    }

    /// Reload counters. Never waits for a check in progress, so a metrics collector
    /// can call it.
    pub fn stats(&self) -> ReloadStats {
        let Some(reloader) = &self.reloader else {
            return ReloadStats::default();
        };
        ReloadStats {
            reloaded: reloader.reloaded.load(Ordering::Relaxed),
            refused: reloader.refused.load(Ordering::Relaxed),
            pending_refusal: reloader
                .pending_refusal
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone(),
        }
    }
}

/// The reloading side: checks files and publishes.
#[derive(Debug)]
struct Reloader {
    /// The files to follow.
    files: MeshTlsFiles,
    /// Trust domain and ALPN every build uses.
    settings: MeshTlsSettings,
    /// Poll period and settle time.
    options: ReloadOptions,
    /// Where new material is published; closed when every source is dropped.
    sender: watch::Sender<Arc<MeshTls>>,
    /// Publications since start.
    reloaded: AtomicU64,
    /// Distinct refusals since start.
    refused: AtomicU64,
    /// Reason of the refusal in effect, for [`ReloadStats`]; a copy of what `state`
    /// holds, readable without waiting for a check.
    pending_refusal: std::sync::Mutex<Option<String>>,
    /// What the files held at the last check; the lock also makes checks one at a time.
    state: Mutex<CheckState>,
}

#[derive(Debug)]
struct CheckState {
    /// Digest of the files the published material was built from.
    published: [u8; 32],
    /// Digest of the refused content the files hold, so that a refusal is logged once
    /// per content.
    refused: Option<[u8; 32]>,
}

/// How many times a check waits for files that keep changing before it takes what
/// it read: a writer that never stops should not stall reloads forever.
const MAX_SETTLE_ROUNDS: usize = 8;

impl Reloader {
    async fn check(&self) -> ReloadOutcome {
        let mut state = self.state.lock().await;
        let mut contents = match self.read().await {
            Ok(contents) => contents,
            Err(e) => return self.refuse(&mut state, [0; 32], e.to_string()),
        };
        let mut digest = contents.digest();
        if digest == state.published {
            self.set_refused(&mut state, None);
            return ReloadOutcome::Unchanged;
        }
        // Changed: wait until the files stop changing (a leaf and its key arrive by two
        // renames), then validate what they hold.
        for _ in 0..MAX_SETTLE_ROUNDS {
            tokio::time::sleep(self.options.settle).await;
            let again = match self.read().await {
                Ok(contents) => contents,
                Err(e) => return self.refuse(&mut state, [0; 32], e.to_string()),
            };
            let again_digest = again.digest();
            contents = again;
            if again_digest == digest {
                break;
            }
            digest = again_digest;
        }
        if digest == state.published {
            self.set_refused(&mut state, None);
            return ReloadOutcome::Unchanged;
        }
        let files = self.files.clone();
        let settings = self.settings.clone();
        let built =
            tokio::task::spawn_blocking(move || MeshTls::build(&files, &settings, &contents)).await;
        match built {
            Ok(Ok(tls)) if tls.leaf().uri != self.sender.borrow().leaf().uri => {
                // The identity is what peers check this worker against (it is
                // registered with its lease): it may not change under a running worker.
                let reason = format!(
                    "{}: the new leaf names {}, but this worker runs as {}; a leaf for \
                     another member needs a restart",
                    self.files.cert.display(),
                    tls.leaf().uri,
                    self.sender.borrow().leaf().uri
                );
                self.refuse(&mut state, digest, reason)
            }
            Ok(Ok(tls)) => {
                info!(
                    cert = %self.files.cert.display(),
                    member = %tls.identity(),
                    leaf = %tls.leaf_fingerprint(),
                    leaf_expires_in_days = tls.leaf().expires_in().as_secs() / 86_400,
                    cas_in_bundle = tls.ca_fingerprints().len(),
                    "mesh TLS material reloaded: new handshakes use it"
                );
                self.sender.send_replace(Arc::new(tls));
                state.published = digest;
                self.set_refused(&mut state, None);
                self.reloaded.fetch_add(1, Ordering::Relaxed);
                ReloadOutcome::Reloaded
            }
            Ok(Err(e)) => self.refuse(&mut state, digest, e.to_string()),
            Err(e) => self.refuse(&mut state, digest, format!("certificate check failed: {e}")),
        }
    }

    async fn read(&self) -> Result<FileContents, CertError> {
        let files = self.files.clone();
        match tokio::task::spawn_blocking(move || FileContents::read(&files)).await {
            Ok(result) => result,
            Err(e) => Err(CertError::Io {
                path: self.files.cert.clone(),
                source: std::io::Error::other(e.to_string()),
            }),
        }
    }

    /// Records a refusal; logs it (once) unless this content was refused before. The
    /// reason may change while the content does not (time passes); it is kept up to
    /// date for [`ReloadStats`] but not logged again.
    fn refuse(&self, state: &mut CheckState, digest: [u8; 32], reason: String) -> ReloadOutcome {
        let repeated = state.refused == Some(digest);
        if !repeated {
            warn!(
                reason = %reason,
                "mesh TLS material refused; the material in use stays until the files are fixed"
            );
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        self.set_refused(state, Some((digest, reason.clone())));
        ReloadOutcome::Refused(reason)
    }

    fn set_refused(&self, state: &mut CheckState, refused: Option<([u8; 32], String)>) {
        let (digest, reason) = refused.unzip();
        state.refused = digest;
        *self
            .pending_refusal
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = reason;
    }
}

/// The watcher task: a check on every file event and every poll tick, until every
/// source is gone.
async fn watch_files(reloader: Arc<Reloader>, mut watcher: Option<FileWatcher>) {
    let mut poll = tokio::time::interval(reloader.options.poll_interval);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.tick().await;
    loop {
        tokio::select! {
            _ = reloader.sender.closed() => break,
            _ = poll.tick() => {
                if watcher.is_none() {
                    watcher = FileWatcher::new(&reloader.files);
                }
            }
            lost = next_event(&mut watcher) => {
                if lost {
                    // The watched directory went away (or the watch failed): poll until a
                    // new watch can be placed.
                    watcher = None;
                }
            }
        }
        // Events that arrive during the check wake the loop again; a check of
        // unchanged files is one read and a hash, so bursts cost little.
        reloader.check().await;
    }
    debug!("mesh TLS reloader stopped: no source left");
}

/// Waits for the next file event; never returns without a watcher. True when the
/// watch is lost.
async fn next_event(watcher: &mut Option<FileWatcher>) -> bool {
    match watcher {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// The directories to watch: the parents of the three files, each once.
fn watched_dirs(files: &MeshTlsFiles) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for file in [&files.ca, &files.cert, &files.key] {
        let dir = match file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

#[cfg(target_os = "linux")]
use linux::FileWatcher;

#[cfg(target_os = "linux")]
mod linux {
    use std::os::fd::AsFd;

    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    use tokio::sync::mpsc;
    use tracing::debug;

    use super::{MeshTlsFiles, watched_dirs};

    /// How often the watching thread looks up from `poll` to see whether anyone still
    /// listens. It costs one wake-up per interval.
    const LISTENER_CHECK_MS: u16 = 1000;

    /// inotify watches on the directories of the files, read by a small thread that
    /// sleeps in `poll` (tokio's `AsyncFd` would need `unsafe` to register the fd, and
    /// this crate forbids it). Directories, not files: an atomic replace renames a new
    /// file over the old, and a watch on the old inode would never fire again.
    pub(super) struct FileWatcher {
        /// One message per burst of events; `true` when the watch is lost.
        events: mpsc::Receiver<bool>,
    }

    impl FileWatcher {
        /// `None` when inotify is unavailable (no instances left, a directory
        /// missing); the periodic check then does the work and a later tick tries again.
        pub(super) fn new(files: &MeshTlsFiles) -> Option<Self> {
            let inotify = match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
                Ok(inotify) => inotify,
                Err(e) => {
                    debug!(error = %e, "no inotify for mesh TLS files; relying on the periodic check");
                    return None;
                }
            };
            let mask = AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_ATTRIB
                | AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_MOVE_SELF;
            for dir in watched_dirs(files) {
                if let Err(e) = inotify.add_watch(&dir, mask) {
                    debug!(dir = %dir.display(), error = %e, "cannot watch a mesh TLS directory; relying on the periodic check");
                    return None;
                }
            }
            let (sender, events) = mpsc::channel(1);
            let spawned = std::thread::Builder::new()
                .name("mcpgw-certs-watch".into())
                .spawn(move || watch_thread(inotify, sender));
            if let Err(e) = spawned {
                debug!(error = %e, "cannot start the mesh TLS file watcher; relying on the periodic check");
                return None;
            }
            Some(Self { events })
        }

        /// Waits for events. True when the watch is lost (a watched directory was
        /// deleted or moved, or reading failed).
        pub(super) async fn changed(&mut self) -> bool {
            self.events.recv().await.unwrap_or(true)
        }
    }

    /// Reads inotify until the watch is lost or nobody listens any more.
    fn watch_thread(inotify: Inotify, sender: mpsc::Sender<bool>) {
        let timeout = PollTimeout::from(LISTENER_CHECK_MS);
        loop {
            if sender.is_closed() {
                return;
            }
            let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => {
                    let _ = sender.try_send(true);
                    return;
                }
            }
            let lost = match inotify.read_events() {
                Ok(events) => events.iter().any(|e| {
                    e.mask.intersects(
                        AddWatchFlags::IN_IGNORED
                            | AddWatchFlags::IN_DELETE_SELF
                            | AddWatchFlags::IN_MOVE_SELF,
                    )
                }),
                Err(nix::errno::Errno::EAGAIN) => continue,
                Err(_) => true,
            };
            // A full channel already holds a wake-up that covers these events.
            let _ = sender.try_send(lost);
            if lost {
                return;
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
use portable::FileWatcher;

#[cfg(not(target_os = "linux"))]
mod portable {
    use super::MeshTlsFiles;

    /// No file notification here: the periodic check does all the work.
    pub(super) struct FileWatcher;

    impl FileWatcher {
        pub(super) fn new(_files: &MeshTlsFiles) -> Option<Self> {
            None
        }

        pub(super) async fn changed(&mut self) -> bool {
            std::future::pending().await
        }
    }
}
