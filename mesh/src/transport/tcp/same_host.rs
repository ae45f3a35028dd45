//! The same-host path: the TCP transport's multiplexed framing (`Hello` → `Welcome`,
//! exchanges, credit) over a Unix stream socket instead of TLS over loopback TCP, for
//! two workers on one kernel. Opt-in (the gateway's `--mesh-same-host unix`).
//!
//! Trust: the kernel authenticates the peer. Each end reads the other's credentials
//! (`SO_PEERCRED`) and talks only to a process of its own effective uid. A process of
//! that uid on that kernel can read the worker's mesh key and present its certificate
//! anyway, so the plain socket trusts no one whom mTLS would refuse. The owner keys a
//! peer's budgets by its uid and pid (see [`kernel_identity`]), never by the worker id
//! it greets with alone.
//!
//! Which workers use it: an owner advertises a [`SameHostRoute`] (its kernel's boot id
//! and its socket path) beside its address; a caller records it only when the boot id
//! is its own ([`SameHostBook::record`]), because containers on one host share a kernel
//! but not always a filesystem, and containers of one image share `/etc/machine-id`.
//! A recorded path is then proven by connecting to it:
//!
//! - connected, peer of our uid: the path is used;
//! - no such file, permission denied, a socket of another uid, or any other error: it
//!   cannot be used from here (another container's filesystem, say); TCP is used, now
//!   and from then on for that worker ([`ConnectOutcome::Unusable`]);
//! - a full listen backlog (`EAGAIN`): TCP this once;
//! - `ECONNREFUSED`: the socket file exists and nothing listens on it. The path is
//!   named by the worker id, only that worker binds it, and it listens for as long as
//!   it lives (a drain included), so this is proof that the worker is gone, like a
//!   refused TCP connect at its registered port ([`MeshError::Refused`]).

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mcpgw_certs::PeerIdentity;
use parking_lot::{Mutex, RwLock};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use super::Dialer;
use super::caller::CallerConn;
use crate::transport::calling::greet as client_greet;
use crate::transport::error::MeshError;
use crate::transport::framed::{FrameReader, FrameWriter};
use crate::transport::observe::{self, Link};
use crate::transport::serving::{ServerShared, greet as server_greet};

/// Where the kernel tells its boot id: random per boot, the same in every container
/// that shares the kernel.
pub const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// The longest socket path Linux takes (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Refused peers' uids remembered for their one log line; past this many the memory
/// starts again (the metric still counts every refusal).
const MAX_REMEMBERED_UIDS: usize = 1024;

/// How an owner on this host can be reached without TLS, as it advertises it with its
/// lease. Workers of a release without the same-host path ignore it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SameHostRoute {
    /// The owner's kernel boot id ([`BOOT_ID_FILE`]): only a caller on that kernel
    /// tries the path.
    pub boot_id: String,
    /// The owner's Unix socket.
    pub path: PathBuf,
}

impl SameHostRoute {
    /// Whether a caller whose kernel boot id is `ours` may try this route: the same
    /// kernel, and an absolute path (a relative one would name another file in every
    /// working directory).
    pub fn usable_from(&self, ours: &str) -> bool {
        !ours.is_empty() && self.boot_id == ours && self.path.is_absolute()
    }
}

/// This kernel's boot id, trimmed.
pub fn kernel_boot_id() -> Result<String, MeshError> {
    let id = std::fs::read_to_string(BOOT_ID_FILE)
        .map_err(|e| MeshError::Config(format!("cannot read {BOOT_ID_FILE}: {e}")))?;
    let id = id.trim();
    if id.is_empty() {
        return Err(MeshError::Config(format!("{BOOT_ID_FILE} is empty")));
    }
    Ok(id.to_owned())
}

/// The socket of worker `worker_id` in `dir`, with `dir` made ready: created (mode
/// 0700) when missing, and refused when it belongs to another user or others may write
/// in it (they could replace the socket), or when the path is too long for a socket.
pub fn prepare_socket_path(dir: &Path, worker_id: &str) -> Result<PathBuf, MeshError> {
    let config = |what: String| MeshError::Config(what);
    if !dir.is_absolute() {
        return Err(config(format!(
            "the mesh socket directory {} is not an absolute path",
            dir.display()
        )));
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| config(format!("cannot create {}: {e}", dir.display())))?;
    let meta = std::fs::metadata(dir)
        .map_err(|e| config(format!("cannot read {}: {e}", dir.display())))?;
    let ours = nix::unistd::geteuid().as_raw();
    if meta.uid() != ours {
        return Err(config(format!(
            "the mesh socket directory {} belongs to uid {}, not to this process's uid {ours}: \
             name a directory of your own with --mesh-socket-dir",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.permissions().mode() & 0o022 != 0 {
        return Err(config(format!(
            "others may write in the mesh socket directory {} (mode {:o}): make it 0700 or \
             0755, or name another with --mesh-socket-dir",
            dir.display(),
            meta.permissions().mode() & 0o777
        )));
    }
    let path = dir.join(format!("{worker_id}.sock"));
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(config(format!(
            "the mesh socket path {} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket \
             takes: choose a shorter --mesh-socket-dir",
            path.display()
        )));
    }
    Ok(path)
}

// ---------------------------------------------------------------- caller side

/// The same-host routes a caller may use, by worker id.
#[derive(Debug, Default)]
pub(crate) struct SameHostBook {
    /// Our kernel's boot id; `None` while the path is off (the default).
    ours: RwLock<Option<String>>,
    /// Routes recorded for workers on our kernel.
    routes: RwLock<HashMap<String, BookedRoute>>,
}

#[derive(Debug)]
struct BookedRoute {
    path: PathBuf,
    /// Set once the path proved unusable from here: TCP from then on.
    unusable: bool,
}

impl SameHostBook {
    pub(crate) fn enable(&self, boot_id: &str) {
        *self.ours.write() = Some(boot_id.to_owned());
    }

    /// Records what `worker_id` advertised: kept only when it names our kernel. A
    /// route already found unusable stays so while its path is the same.
    pub(crate) fn record(&self, worker_id: &str, advertised: Option<&SameHostRoute>) {
        let usable = {
            let ours = self.ours.read();
            advertised.filter(|route| ours.as_deref().is_some_and(|ours| route.usable_from(ours)))
        };
        let mut routes = self.routes.write();
        let Some(route) = usable else {
            routes.remove(worker_id);
            return;
        };
        if routes.get(worker_id).is_some_and(|r| r.path == route.path) {
            return;
        }
        routes.insert(
            worker_id.to_owned(),
            BookedRoute {
                path: route.path.clone(),
                unusable: false,
            },
        );
    }

    /// The socket to try for `worker_id`, if it has a usable route.
    pub(crate) fn path_for(&self, worker_id: &str) -> Option<PathBuf> {
        let routes = self.routes.read();
        let route = routes.get(worker_id)?;
        (!route.unusable).then(|| route.path.clone())
    }

    /// Remembers that `path` cannot be used to reach `worker_id`.
    fn give_up(&self, worker_id: &str, path: &Path, why: &str) {
        let mut routes = self.routes.write();
        if let Some(route) = routes.get_mut(worker_id)
            && route.path == path
            && !route.unusable
        {
            route.unusable = true;
            info!(peer = %worker_id, path = %path.display(), reason = %why,
                "the same-host mesh path cannot be used from here; forwarding over TCP");
        }
    }
}

/// What connecting to a same-host socket found.
#[derive(Debug)]
pub(crate) enum ConnectOutcome {
    /// Connected to a process of our uid.
    Connected(UnixStream),
    /// The path cannot be used now: TCP instead, and for good when `for_good`.
    Unusable { why: String, for_good: bool },
    /// A socket file with no listener: its worker is gone.
    Refused,
}

/// Judges a failed connect to a same-host socket (see the module's list).
pub(crate) fn judge_connect_error(error: &io::Error) -> ConnectOutcome {
    match error.kind() {
        io::ErrorKind::ConnectionRefused => ConnectOutcome::Refused,
        io::ErrorKind::WouldBlock => ConnectOutcome::Unusable {
            why: "its listen backlog is full".into(),
            for_good: false,
        },
        _ => ConnectOutcome::Unusable {
            why: error.to_string(),
            for_good: true,
        },
    }
}

/// Connects to `path` and checks that a process of our uid answers there.
async fn connect(path: &Path) -> ConnectOutcome {
    let stream = match UnixStream::connect(path).await {
        Ok(stream) => stream,
        Err(e) => return judge_connect_error(&e),
    };
    let ours = nix::unistd::geteuid().as_raw();
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == ours => ConnectOutcome::Connected(stream),
        Ok(cred) => ConnectOutcome::Unusable {
            why: format!(
                "the socket is served by uid {}, not ours ({ours})",
                cred.uid()
            ),
            for_good: true,
        },
        Err(e) => ConnectOutcome::Unusable {
            why: format!("cannot read the peer's credentials: {e}"),
            for_good: true,
        },
    }
}

/// The identity of a connection the kernel vouches for: no certificate, so no expiry
/// (the connection still retires at its maximum age) and no fingerprint.
fn kernel_identity(member: String, uri: String) -> PeerIdentity {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    PeerIdentity {
        member,
        uri,
        not_after: SystemTime::now() + CENTURY,
        leaf_fingerprint: String::new(),
    }
}

impl Dialer {
    /// Dials `expect`'s same-host socket when it has a usable one. `None`: use TCP
    /// (no route, or the path cannot be used from here); otherwise the dial's outcome,
    /// as a TCP dial's would be.
    pub(super) async fn dial_same_host(
        &self,
        peer_addr: &str,
        expect: &str,
    ) -> Option<Result<Arc<CallerConn>, MeshError>> {
        let path = self.same_host.path_for(expect)?;
        let shown = format!("unix:{}", path.display());
        let limits = &self.limits;
        let stream = match timeout(limits.connect_timeout, connect(&path)).await {
            Err(_) => {
                self.observer.handshake("caller", "timeout");
                return Some(Err(MeshError::ConnectTimeout { addr: shown }));
            }
            Ok(ConnectOutcome::Connected(stream)) => stream,
            Ok(ConnectOutcome::Refused) => {
                self.observer.handshake("caller", "refused");
                return Some(Err(MeshError::Refused { addr: shown }));
            }
            Ok(ConnectOutcome::Unusable { why, for_good }) => {
                if for_good {
                    self.same_host.give_up(expect, &path, &why);
                } else {
                    debug!(peer = %expect, %why, "same-host mesh path busy; TCP this once");
                }
                return None;
            }
        };
        let (read, write) = stream.into_split();
        let mut reader = FrameReader::new(read, limits.max_frame);
        let mut writer = FrameWriter::new(write, limits.max_frame);
        let greeting = client_greet(
            &shown,
            &self.worker_id,
            expect,
            limits.max_protocol_version,
            &mut reader,
            &mut writer,
        );
        let greeted = timeout(limits.connect_timeout, greeting)
            .await
            .unwrap_or_else(|_| {
                Err(MeshError::ConnectTimeout {
                    addr: shown.clone(),
                })
            });
        let (worker_id, _protocol) = match greeted {
            Ok(greeted) => greeted,
            Err(e) => {
                self.observer.handshake("caller", observe::dial_failure(&e));
                return Some(Err(e));
            }
        };
        self.observer.handshake("caller", "ok");
        debug!(peer = %worker_id, via = %peer_addr, path = %path.display(), "same-host mesh connection");
        let identity = kernel_identity(format!("same-host {worker_id}"), shown);
        Some(Ok(self.start(
            reader,
            writer,
            worker_id,
            identity,
            Link::Unix,
        )))
    }
}

// ---------------------------------------------------------------- owner side

/// A bound same-host socket; the file is removed when this is dropped (at the
/// worker's exit), unless another process has bound the path since.
#[derive(Debug)]
pub(crate) struct SameHostSocket {
    path: PathBuf,
    /// The socket file's inode, to remove only our own.
    inode: u64,
}

impl Drop for SameHostSocket {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode);
        if ours && let Err(e) = std::fs::remove_file(&self.path) {
            debug!(path = %self.path.display(), error = %e, "cannot remove the mesh socket");
        }
    }
}

/// Binds `path` (mode 0600: only our uid may connect; the credential check stands
/// behind it) and spawns its accept loop on `shared`. A socket file left by a process
/// that died with this id is replaced; one that a live process serves is refused.
pub(crate) fn serve(path: &Path, shared: Arc<ServerShared>) -> Result<SameHostSocket, MeshError> {
    let listener = match UnixListener::bind(path) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            use std::os::unix::fs::FileTypeExt;
            let socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
            if !socket || std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(MeshError::Config(format!(
                    "{} is in use (another process serves it, or it is not a socket): \
                     every worker id needs its own mesh socket",
                    path.display()
                )));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path)?
        }
        bound => bound?,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let inode = std::fs::symlink_metadata(path)?.ino();
    shared.tracker.spawn(accept_loop(listener, shared.clone()));
    Ok(SameHostSocket {
        path: path.to_owned(),
        inode,
    })
}

async fn accept_loop(listener: UnixListener, shared: Arc<ServerShared>) {
    let refused = Arc::new(Mutex::new(HashSet::new()));
    loop {
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let (shared, refused) = (shared.clone(), refused.clone());
                shared
                    .tracker
                    .clone()
                    .spawn(connection(stream, shared, refused));
            }
            Err(e) => {
                warn!(error = %e, "mesh same-host accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Where the owner's log lines and `PeerInfo` say a same-host peer comes from: it has
/// no IP address.
fn no_address() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))
}

/// The kernel's credentials of a same-host peer, if it may be served: a process of our
/// effective uid. Another uid is refused, counted, and logged once per uid.
fn admitted_peer(
    stream: &UnixStream,
    shared: &ServerShared,
    refused: &Mutex<HashSet<u32>>,
) -> Option<(u32, i32)> {
    let ours = nix::unistd::geteuid().as_raw();
    let cred = match stream.peer_cred() {
        Ok(cred) => cred,
        Err(e) => {
            shared.observer.handshake("owner", "identity");
            warn!(error = %e, "mesh same-host peer: cannot read its credentials; closing");
            return None;
        }
    };
    if cred.uid() == ours {
        return Some((cred.uid(), cred.pid().unwrap_or(0)));
    }
    shared.observer.handshake("owner", "identity");
    let mut seen = refused.lock();
    if seen.len() >= MAX_REMEMBERED_UIDS {
        seen.clear();
    }
    if seen.insert(cred.uid()) {
        warn!(
            peer_uid = cred.uid(),
            peer_pid = cred.pid().unwrap_or(0),
            our_uid = ours,
            "mesh same-host peer refused: it runs as another user (logged once per uid)"
        );
    }
    None
}

async fn connection(
    stream: UnixStream,
    shared: Arc<ServerShared>,
    refused: Arc<Mutex<HashSet<u32>>>,
) {
    let Some((uid, pid)) = admitted_peer(&stream, &shared, &refused) else {
        return;
    };
    let remote = no_address();
    let permit = match shared.handshakes.enter(remote.ip()) {
        Ok(permit) => permit,
        Err(full) => {
            shared.observer.handshake("owner", "over_cap");
            let why = format!("connection closed: {}", full.reason());
            shared
                .handshake_failures
                .failed("unix", remote, "over_cap", &why);
            return;
        }
    };
    let limits = &shared.limits;
    let (read, write) = stream.into_split();
    let mut reader = FrameReader::new(read, limits.max_frame);
    let mut writer = FrameWriter::new(write, limits.max_frame);
    let Some(greeted) = server_greet(&shared, remote, None, &mut reader, &mut writer).await else {
        shared.observer.handshake("owner", "greeting");
        let _ = writer.get_mut().shutdown().await;
        return;
    };
    // The budget key: the process the kernel names. A pid of 0 is a process outside
    // our pid namespace (another container on this kernel): its greeted id tells those
    // apart, and it could present that worker's certificate as well.
    let member = if pid > 0 {
        format!("same-host uid {uid} pid {pid}")
    } else {
        format!("same-host uid {uid} worker {}", greeted.0)
    };
    let identity = kernel_identity(member, format!("unix:uid={uid},pid={pid}"));
    super::serve_greeted(
        shared,
        remote,
        identity,
        greeted,
        permit,
        Link::Unix,
        reader,
        writer,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(boot_id: &str, path: &str) -> SameHostRoute {
        SameHostRoute {
            boot_id: boot_id.into(),
            path: path.into(),
        }
    }

    #[test]
    fn only_a_route_on_our_kernel_is_kept() {
        let book = SameHostBook::default();
        let here = route("boot-a", "/run/m/w1.sock");
        // Off: nothing is kept, whatever the boot id.
        book.record("w1", Some(&here));
        assert_eq!(book.path_for("w1"), None);
        book.enable("boot-a");
        book.record("w1", Some(&here));
        assert_eq!(book.path_for("w1"), Some(PathBuf::from("/run/m/w1.sock")));
        // Another kernel (another host, or a VM) never gets the path, even if the
        // file were reachable.
        book.record("w2", Some(&route("boot-b", "/run/m/w2.sock")));
        assert_eq!(book.path_for("w2"), None);
        // A relative path, or an empty boot id, is no route.
        book.record("w3", Some(&route("boot-a", "w3.sock")));
        assert_eq!(book.path_for("w3"), None);
        assert!(!route("", "/x").usable_from(""));
        // A later entry without a route (an older release) forgets it.
        book.record("w1", None);
        assert_eq!(book.path_for("w1"), None);
    }

    #[test]
    fn an_unusable_path_stays_unusable_until_the_worker_advertises_another() {
        let book = SameHostBook::default();
        book.enable("boot-a");
        let first = route("boot-a", "/run/m/w1.sock");
        book.record("w1", Some(&first));
        book.give_up("w1", &first.path, "no such file");
        assert_eq!(book.path_for("w1"), None);
        book.record("w1", Some(&first));
        assert_eq!(book.path_for("w1"), None, "the same path is not retried");
        book.record("w1", Some(&route("boot-a", "/run/n/w1.sock")));
        assert_eq!(book.path_for("w1"), Some(PathBuf::from("/run/n/w1.sock")));
    }

    #[test]
    fn only_a_refused_connect_proves_the_worker_gone() {
        let judge = |kind| judge_connect_error(&io::Error::from(kind));
        assert!(matches!(
            judge(io::ErrorKind::ConnectionRefused),
            ConnectOutcome::Refused
        ));
        assert!(matches!(
            judge(io::ErrorKind::NotFound),
            ConnectOutcome::Unusable { for_good: true, .. }
        ));
        assert!(matches!(
            judge(io::ErrorKind::PermissionDenied),
            ConnectOutcome::Unusable { for_good: true, .. }
        ));
        assert!(matches!(
            judge(io::ErrorKind::WouldBlock),
            ConnectOutcome::Unusable {
                for_good: false,
                ..
            }
        ));
    }

    #[test]
    fn a_socket_directory_others_may_write_in_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let error = prepare_socket_path(&open, "w1").expect_err("world-writable");
        assert!(error.to_string().contains("others may write"), "{error}");
        let made = dir.path().join("made");
        let path = prepare_socket_path(&made, "w1").expect("created");
        assert_eq!(path, made.join("w1.sock"));
        let mode = std::fs::metadata(&made).expect("made").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let long = dir.path().join("x".repeat(120));
        assert!(prepare_socket_path(&long, "w1").is_err());
        assert!(prepare_socket_path(Path::new("relative"), "w1").is_err());
    }
}
