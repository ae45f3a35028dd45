//! This worker's membership in the fleet: its lease in the directory, session
//! ownership records, and routing a request for another worker's session over the mesh.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use http::StatusCode;
use mcpgw_mesh::directory::{Directory, DirectoryError, Lease, LeaseRenewal};
use mcpgw_mesh::transport::{MeshClient, MeshError, TransportKind};
use mcpgw_wire::ErrorKind;
use tracing::{debug, error, info, warn};

use crate::affinity::{Decision, Situation, decide};
use crate::config::Config;
use crate::exec::Reply;
use crate::forward;
use crate::mcp::GatewayError;
use crate::request::Call;
use crate::session;
use crate::worker::Worker;

/// Exit code of a worker that lost its lease (fenced): the supervisor starts a
/// replacement under a new id.
pub const EXIT_FENCED: i32 = 75;

pub struct Fleet {
    pub directory: Directory,
    /// This worker's registration, replaced when the directory is rebuilt.
    lease: Mutex<Lease>,
    /// Until when this worker may act for its sessions, by its own clock: the last
    /// successful renewal + lease time − margin.
    acts_until: Mutex<Instant>,
    margin: Duration,
    mesh: MeshClient,
    /// A separate pool for liveness probes, so a probe always dials afresh instead of
    /// riding the connection whose health is in question.
    probe_mesh: MeshClient,
    /// Mesh addresses of peers by worker id, so steady-state forwarding needs no Redis.
    peers: RwLock<HashMap<String, String>>,
    request_ids: AtomicU64,
    /// Makes renewals single-flight (heartbeat and on-demand revalidation).
    renewing: tokio::sync::Mutex<()>,
    config: Arc<Config>,
}

impl Fleet {
    pub fn new(
        directory: Directory,
        lease: Lease,
        mesh: MeshClient,
        probe_mesh: MeshClient,
        config: Arc<Config>,
    ) -> Fleet {
        let lease_time = config.fleet.lease;
        // The margin covers clock drift between this host and Redis and the time a
        // renewal takes to be written.
        let margin = (lease_time / 5).max(Duration::from_millis(200));
        let acts_until = lease.valid_until() - margin;
        Fleet {
            directory,
            lease: Mutex::new(lease),
            acts_until: Mutex::new(acts_until),
            margin,
            mesh,
            probe_mesh,
            peers: RwLock::new(HashMap::new()),
            request_ids: AtomicU64::new(1),
            renewing: tokio::sync::Mutex::new(()),
            config,
        }
    }

    /// Whether this worker may act for its sessions right now.
    pub fn lease_valid(&self) -> bool {
        Instant::now() < *lock(&self.acts_until)
    }

    pub fn gone_status(&self) -> StatusCode {
        StatusCode::from_u16(self.config.fleet.gone_status).unwrap_or(StatusCode::NOT_FOUND)
    }

    /// Records `session_id` as ours. A directory that does not answer means the
    /// session cannot be routed by the fleet, so it is not created.
    pub async fn claim(&self, session_id: &str, owner: &str) -> Result<(), GatewayError> {
        match self.directory.claim_session(session_id, owner).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                "session_id_collision",
                "a freshly minted session id is already claimed: retry initialize",
            )),
            Err(e) => Err(GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                "directory_unavailable",
                format!("the fleet directory did not record the new session ({e}); no session was created: retry initialize"),
            )
            .with_data(serde_json::json!({"reason": "directory_unavailable", "retryable": true}))
            .with_retry_after(crate::affinity::RETRY_AFTER_SECONDS)),
        }
    }

    /// Removes the ownership record of an ended session.
    pub async fn release(&self, session_id: &str, owner: &str) {
        if let Err(e) = self.directory.release_session(session_id, owner).await {
            warn!(session = session_id, error = %e, "could not remove the session's directory record");
        }
    }

    /// Routes a request for a session this worker does not hold.
    pub async fn route_remote(&self, worker: &Worker, call: Call) -> Result<Reply, GatewayError> {
        let Some(session_id) = call.session_id.clone() else {
            return Err(GatewayError::session_not_found().with_id(call.id()));
        };
        let id = call.id();
        let refuse = |situation: Situation, why: &str| -> GatewayError {
            match decide(&situation) {
                Decision::Refuse(refusal) => refusal
                    .to_error(self.gone_status(), why)
                    .with_id(id.clone()),
                other => {
                    error!(?situation, ?other, "decision table returned no refusal");
                    GatewayError::session_not_found().with_id(id.clone())
                }
            }
        };
        let owner = match session::owner_hint(&session_id) {
            Some(owner) => owner.to_owned(),
            None => match self.directory.session_owner(&session_id).await {
                Ok(Some(owner)) => owner,
                Ok(None) => return Err(refuse(Situation::NoSuchSession, "no owner recorded")),
                Err(e) => return Err(refuse(Situation::Unknown, &e.to_string())),
            },
        };
        if owner == worker.id {
            // Minted here, not held here: it ended.
            return Err(refuse(Situation::NoSuchSession, "ended on its owner"));
        }
        let forwarded = self.forward_to(&owner, &call).await;
        match forwarded {
            Ok(reply) => Ok(reply),
            Err(ForwardFailure::Refuse(situation, why)) => Err(refuse(situation, &why)),
            Err(ForwardFailure::Busy(why)) => Err(mesh_busy(&why).with_id(id.clone())),
            Err(ForwardFailure::NotOwner) => {
                // The hint named a worker that says "not mine": ask the directory.
                match self.directory.session_owner(&session_id).await {
                    Ok(Some(recorded)) if recorded != owner && recorded != worker.id => {
                        match self.forward_to(&recorded, &call).await {
                            Ok(reply) => Ok(reply),
                            Err(ForwardFailure::Refuse(situation, why)) => {
                                Err(refuse(situation, &why))
                            }
                            Err(ForwardFailure::Busy(why)) => {
                                Err(mesh_busy(&why).with_id(id.clone()))
                            }
                            Err(ForwardFailure::NotOwner) => Err(refuse(
                                Situation::OwnerGone,
                                "the recorded owner no longer holds it",
                            )),
                        }
                    }
                    Ok(Some(_)) => {
                        Err(refuse(Situation::OwnerGone, "its owner no longer holds it"))
                    }
                    Ok(None) => Err(refuse(Situation::NoSuchSession, "no owner recorded")),
                    Err(e) => Err(refuse(Situation::Unknown, &e.to_string())),
                }
            }
        }
    }

    async fn forward_to(&self, owner: &str, call: &Call) -> Result<Reply, ForwardFailure> {
        let session = call.session_id.as_deref().unwrap_or_default();
        let addr = match self.peer_addr(owner).await {
            Ok(Some(addr)) => addr,
            Ok(None) => return Err(self.owner_without_lease(owner).await),
            Err(e) => return Err(ForwardFailure::Refuse(Situation::Unknown, e.to_string())),
        };
        let request_id = self.request_ids.fetch_add(1, Ordering::Relaxed);
        let frame = forward::to_frame(call, request_id, self.config.mesh.forward_timeout);
        let forward = self.mesh.forward(&addr, owner, frame);
        tokio::pin!(forward);
        // A head normally comes within milliseconds. When it does not, find out in
        // parallel whether the owner still exists, and keep checking while the answer
        // is "unknown" (lease alive, owner silent): a dead owner is answered as soon as
        // that is proven (at the latest when its lease expires), never only after the
        // forward timeout. An owner that answers the probe is merely slow.
        let mut probing = true;
        let outcome = loop {
            if !probing {
                break (&mut forward).await;
            }
            tokio::select! {
                outcome = &mut forward => break outcome,
                () = tokio::time::sleep(SUSPECT_AFTER) => {
                    let probe = self.probe(owner, &addr);
                    tokio::pin!(probe);
                    tokio::select! {
                        outcome = &mut forward => break outcome,
                        liveness = &mut probe => match liveness {
                            Liveness::Dead(why) => {
                                return Err(self.lost_after_sending(owner, &addr, session, why).await);
                            }
                            Liveness::Alive => probing = false,
                            Liveness::Unknown => {}
                        },
                    }
                }
            }
        };
        match outcome {
            Ok(response) => Ok(forward::from_forwarded(response)),
            Err(e) => {
                debug!(owner, %addr, error = %e, "forward failed");
                Err(self.classify(owner, &addr, session, e).await)
            }
        }
    }

    /// What a failed forward proves.
    async fn classify(
        &self,
        owner: &str,
        addr: &str,
        session: &str,
        error: MeshError,
    ) -> ForwardFailure {
        if error.is_budget_exhausted() {
            // A full mesh budget, here or at the owner: the owner is alive and the
            // request did not run.
            return ForwardFailure::Busy(error.to_string());
        }
        if error.proves_peer_gone() {
            // Refused or answered as another worker before the request was sent. Over
            // the Redis baseline, "no subscriber" is also what a subscriber in the
            // middle of reconnecting looks like, so there only an expired lease proves.
            if self.mesh.kind() == TransportKind::Redis
                && !matches!(self.directory.worker(owner).await, Ok(None))
            {
                return ForwardFailure::Refuse(Situation::Unknown, error.to_string());
            }
            self.bury(owner, addr).await;
            return ForwardFailure::Refuse(Situation::OwnerGone, error.to_string());
        }
        if let Some(frame) = error.remote() {
            match frame.kind {
                ErrorKind::NotOwner => return ForwardFailure::NotOwner,
                // A draining owner ends its sessions once its requests finish: gone
                // when the directory no longer records the session, else unknown.
                ErrorKind::Draining => {
                    return match self.directory.session_owner(session).await {
                        Ok(None) => ForwardFailure::Refuse(
                            Situation::NoSuchSession,
                            "its worker drained and ended it".into(),
                        ),
                        _ => ForwardFailure::Refuse(Situation::Unknown, frame.message.clone()),
                    };
                }
                _ => {}
            }
        }
        if error.may_have_executed() {
            // Sent, then lost: dead owner (502, never re-run) or unreachable one (503).
            return match self.probe(owner, addr).await {
                Liveness::Dead(why) => {
                    self.lost_after_sending(owner, addr, session, format!("{error}; {why}"))
                        .await
                }
                Liveness::Alive | Liveness::Unknown => {
                    ForwardFailure::Refuse(Situation::Unknown, error.to_string())
                }
            };
        }
        ForwardFailure::Refuse(Situation::Unknown, error.to_string())
    }

    /// The owner died after the request was sent. If it had ended the session before
    /// (a drain releases the record first), the request cannot have run: the session
    /// is simply gone. Otherwise the outcome is unknown.
    async fn lost_after_sending(
        &self,
        owner: &str,
        addr: &str,
        session: &str,
        why: String,
    ) -> ForwardFailure {
        let ended_before = matches!(self.directory.session_owner(session).await, Ok(None));
        self.bury(owner, addr).await;
        if ended_before {
            ForwardFailure::Refuse(Situation::NoSuchSession, why)
        } else {
            ForwardFailure::Refuse(Situation::ForwardedThenLost, why)
        }
    }

    /// The directory has no mesh address for `owner`: its lease expired (proof of
    /// death), unless the directory itself was lost (then nothing is known).
    async fn owner_without_lease(&self, owner: &str) -> ForwardFailure {
        let ours = lock(&self.lease).generation().to_owned();
        match self.directory.generation().await {
            Ok(current) if current == ours => {
                self.bury(owner, "").await;
                ForwardFailure::Refuse(
                    Situation::OwnerGone,
                    format!("worker {owner}'s lease expired"),
                )
            }
            Ok(_) => ForwardFailure::Refuse(
                Situation::Unknown,
                "the directory was lost and is being rebuilt".into(),
            ),
            Err(e) => ForwardFailure::Refuse(Situation::Unknown, e.to_string()),
        }
    }

    /// Whether `owner` still lives at `addr`: a fresh connection (Refused or another
    /// worker's Welcome is proof of death), then its lease.
    async fn probe(&self, owner: &str, addr: &str) -> Liveness {
        self.probe_mesh.forget_peer(addr);
        let frame = probe_frame(self.config.mesh.connect_timeout);
        let refusal_proves = self.mesh.kind() != TransportKind::Redis;
        match self.probe_mesh.forward(addr, owner, frame).await {
            Ok(_) => return Liveness::Alive,
            Err(e) if e.proves_peer_gone() && refusal_proves => {
                return Liveness::Dead(e.to_string());
            }
            Err(MeshError::Remote(_)) => return Liveness::Alive,
            Err(_) => {}
        }
        match self.directory.worker(owner).await {
            Ok(Some(_)) => Liveness::Unknown,
            Ok(None) => Liveness::Dead(format!("worker {owner}'s lease expired")),
            Err(_) => Liveness::Unknown,
        }
    }

    async fn peer_addr(&self, owner: &str) -> Result<Option<String>, DirectoryError> {
        if let Some(addr) = read(&self.peers).get(owner) {
            return Ok(Some(addr.clone()));
        }
        let addr = self.directory.worker_addr(owner).await?;
        if let Some(addr) = &addr {
            write(&self.peers).insert(owner.to_owned(), addr.clone());
        }
        Ok(addr)
    }

    /// Acts on proof that `owner` is dead: forget it, and reclaim its sessions in the
    /// directory (exactly once fleet-wide; the directory arbitrates races).
    async fn bury(&self, owner: &str, addr: &str) {
        write(&self.peers).remove(owner);
        if !addr.is_empty() {
            self.mesh.forget_peer(addr);
            self.probe_mesh.forget_peer(addr);
        }
        let token = match self.directory.worker(owner).await {
            Ok(Some(entry)) if entry.addr.as_deref() == Some(addr) => Some(entry.lease_token),
            // A newer registration at another address is not what we proved dead.
            Ok(Some(_)) => return,
            Ok(None) => None,
            Err(e) => {
                warn!(owner, error = %e, "cannot reclaim a dead worker now; its sessions stay unknown until its lease expires");
                return;
            }
        };
        match self.directory.reclaim_worker(owner, token.as_deref()).await {
            Ok(Some(sids)) => info!(
                owner,
                sessions = sids.len(),
                "reclaimed a dead worker's sessions"
            ),
            Ok(None) => debug!(owner, "dead worker already reclaimed"),
            Err(e) => warn!(owner, error = %e, "reclaiming a dead worker failed"),
        }
    }

    /// Renews the lease every third of its time.
    pub async fn heartbeat(self: Arc<Self>, worker: Arc<Worker>) {
        let period = self.config.fleet.lease / 3;
        loop {
            tokio::time::sleep(period).await;
            self.renew(&worker, false).await;
        }
    }

    /// Called when this worker's own lease deadline has passed (Redis was slow or
    /// unreachable): tries to renew now, so a worker that can prove its lease goes on
    /// at once and one that lost it learns so before answering.
    pub async fn revalidate(&self, worker: &Worker) -> bool {
        self.renew(worker, true).await
    }

    /// One renewal (single-flight). Returns whether this worker may act for its
    /// sessions afterwards.
    async fn renew(&self, worker: &Worker, only_if_invalid: bool) -> bool {
        let _one_at_a_time = self.renewing.lock().await;
        if only_if_invalid && self.lease_valid() {
            return true;
        }
        let lease = lock(&self.lease).clone();
        match self.directory.renew_lease(&lease).await {
            Ok(LeaseRenewal::Renewed { valid_until }) => {
                *lock(&self.acts_until) = valid_until - self.margin;
                true
            }
            Ok(LeaseRenewal::Lost) => match self.directory.resume_lease(&lease).await {
                Ok(LeaseRenewal::Renewed { valid_until }) => {
                    // Redis stalled past the lease, but nobody acted on the expiry.
                    warn!(worker = %worker.id, "lease had expired in Redis and nobody reclaimed this worker; resumed it");
                    *lock(&self.acts_until) = valid_until - self.margin;
                    true
                }
                Ok(LeaseRenewal::DirectoryLost) => self.rebuild(worker, &lease).await,
                Ok(LeaseRenewal::Lost) => {
                    error!(worker = %worker.id, "lease lost: this worker was declared dead; dropping its sessions and exiting for a fresh id");
                    self.fence(worker);
                    false
                }
                Err(e) => {
                    warn!(worker = %worker.id, error = %e, "lease expired and cannot be resumed yet");
                    false
                }
            },
            Ok(LeaseRenewal::DirectoryLost) => {
                warn!(worker = %worker.id, "directory came back empty; registering again and re-claiming sessions");
                self.rebuild(worker, &lease).await
            }
            Err(e) => {
                warn!(worker = %worker.id, error = %e, "lease renewal failed; sessions stay valid until the lease runs out");
                self.lease_valid()
            }
        }
    }

    /// Fencing: this worker was declared dead, so it must never act for its sessions
    /// again. It drops them at once (answering "gone" for them from now on) and exits
    /// shortly after, so the supervisor starts a replacement under a new id.
    fn fence(&self, worker: &Worker) {
        worker.fence();
        *lock(&self.acts_until) = Instant::now();
        tokio::spawn(async {
            // Lets answers already being written go out.
            tokio::time::sleep(Duration::from_millis(500)).await;
            std::process::exit(EXIT_FENCED);
        });
    }

    /// Registers again under the same id after Redis lost its data, and re-claims the
    /// sessions this worker still holds.
    async fn rebuild(&self, worker: &Worker, old: &Lease) -> bool {
        let info = worker_info();
        match self
            .directory
            .register_worker(&worker.id, &info, old.addr())
            .await
        {
            Ok(lease) => {
                let valid_until = lease.valid_until();
                *lock(&self.lease) = lease;
                let ids = worker.sessions.ids();
                match self
                    .directory
                    .reclaim_sessions_after_loss(&worker.id, &ids)
                    .await
                {
                    Ok(taken) => {
                        for sid in taken {
                            warn!(session = %sid, "session now owned elsewhere; dropping it here");
                            worker.sessions.remove(&sid);
                        }
                        *lock(&self.acts_until) = valid_until - self.margin;
                        info!(worker = %worker.id, sessions = ids.len(), "directory rebuilt");
                        true
                    }
                    Err(e) => {
                        warn!(error = %e, "re-claiming sessions failed; will retry");
                        false
                    }
                }
            }
            Err(DirectoryError::WorkerIdTaken { .. }) => {
                error!(worker = %worker.id, "another process took this worker id; fencing");
                self.fence(worker);
                false
            }
            Err(e) => {
                warn!(error = %e, "registering again failed; will retry");
                false
            }
        }
    }

    /// Ends the registration on a clean shutdown.
    pub async fn deregister(&self) {
        let lease = lock(&self.lease).clone();
        if let Err(e) = self.directory.deregister(&lease).await {
            warn!(error = %e, "could not remove this worker's lease");
        }
    }
}

enum ForwardFailure {
    Refuse(Situation, String),
    NotOwner,
    /// A mesh budget to the owner is full (short requests or held streams): 503 at
    /// once, retryable; the request did not run.
    Busy(String),
}

/// `data.reason` when a mesh budget to the session's owner is full.
pub const REASON_MESH_BUDGET_EXHAUSTED: &str = "mesh_budget_exhausted";

/// The answer when the mesh refused at once because a budget to the owner is full.
fn mesh_busy(why: &str) -> GatewayError {
    GatewayError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        crate::mcp::code::GATEWAY_ERROR,
        format!(
            "too many requests and streams are in flight to this session's worker right now \
             ({why}); the request did not run: retry the same request shortly"
        ),
    )
    .with_data(serde_json::json!({
        "reason": REASON_MESH_BUDGET_EXHAUSTED,
        "detail": why,
        "retryable": true,
    }))
    .with_retry_after(crate::affinity::RETRY_AFTER_SECONDS)
}

/// What a probe found out about an owner.
enum Liveness {
    Alive,
    /// Proof: refused, another worker at its address, or its lease expired.
    Dead(String),
    /// Its lease is alive but it does not answer, or the directory cannot tell.
    Unknown,
}

/// How long a forwarded request waits for its head before the owner is probed, and
/// between probes while the owner's fate is unknown.
const SUSPECT_AFTER: Duration = Duration::from_secs(1);

/// A request that any worker answers at once without side effects (405 from the
/// request checks), used to test that an owner is alive on a fresh connection.
fn probe_frame(deadline: Duration) -> mcpgw_wire::RequestFrame {
    mcpgw_wire::RequestFrame {
        request_id: 0,
        session_id: None,
        method: "OPTIONS".into(),
        path: "/mcp".into(),
        headers: Vec::new(),
        body: bytes::Bytes::new(),
        auth: mcpgw_wire::AuthContext {
            scheme: mcpgw_wire::AuthScheme::Public,
            principal: String::new(),
            scopes: Vec::new(),
            claims_json: None,
        },
        deadline_ms: u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX),
    }
}

pub fn worker_info() -> mcpgw_mesh::directory::WorkerInfo {
    mcpgw_mesh::directory::WorkerInfo {
        pid: std::process::id(),
        host: crate::serve::hostname(),
        started_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    }
}

// The guarded values are plain data replaced whole, so a poisoned lock still holds a
// consistent value.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}
