//! The caller's side of forwarding, the [`Forwarder`] stage: a request for a session
//! held by another worker goes to that worker over the mesh, and its streamed answer
//! comes back as a reply. The forwarder owns its mesh pools, the peers' addresses, and
//! the owners it has proven dead. It carries out what the decision core's forward machine
//! ([`crate::decision::forward`]) asks for: directory lookups, the send, waits, probes
//! on a fresh connection, and burying an owner proven dead (reclaiming its sessions).
//! Every judgement is the machine's; while the request's answer may still come, each
//! lookup and probe races it, and the answer wins.

use rustc_hash::FxHashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::stream::unfold;
use http::StatusCode;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use mcpgw_mesh::directory::{Directory, DirectoryError};
use mcpgw_mesh::transport::{ForwardedResponse, MeshClient, MeshError};
use mcpgw_wire::RequestFrame;
use parking_lot::RwLock;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::body::{BoxError, ReplyBody};
use crate::config::Config;
use crate::decision::Situation;
use crate::decision::forward::{Action, Address, Caller, Event, Forwarding, Probed, Unanswered};
use crate::decision::proofs::{Failure, ProbeSign, describe};
use crate::lease::LeaseHolder;
use crate::mcp;
use crate::reply::Reply;
use crate::request::Call;
use crate::session;

/// A forward's outcome, as the mesh gives it.
type Forwarded = Result<ForwardedResponse, MeshError>;

/// Sessions remembered as adopted by another worker at most (see [`Fleet::moved`]).
const MAX_REMEMBERED_MOVES: usize = 65_536;

/// Dead workers remembered at most; a fleet that loses more within the memory's
/// lifetime falls back to asking the directory.
const MAX_REMEMBERED_DEAD: usize = 4096;

/// The forwarding stage: sends calls for other workers' sessions to their owners.
pub struct Forwarder {
    /// This worker's id.
    id: String,
    /// Where owners, their addresses and leases are looked up, and dead owners reclaimed.
    directory: Directory,
    /// This worker's lease: its generation and whether it was fenced.
    lease: Arc<LeaseHolder>,
    /// Forwards requests to the owners of other workers' sessions.
    pub(crate) mesh: MeshClient,
    /// A separate pool for liveness probes, so a probe always dials afresh instead of
    /// riding the connection whose health is in question.
    probe_mesh: MeshClient,
    /// Mesh addresses of peers by worker id, so steady-state forwarding needs no Redis.
    peers: RwLock<FxHashMap<String, String>>,
    /// Workers this worker proved dead, and when: once reclaimed, a dead worker leaves
    /// no trace in the directory, so later requests for its sessions are answered
    /// "gone" from here. Bounded (see [`Forwarder::remember_dead`]).
    buried: parking_lot::Mutex<FxHashMap<String, tokio::time::Instant>>,
    /// Sessions whose owner left them and that another worker adopted, by session id:
    /// their ids still hint the old owner, so without this every request for one
    /// would ask the directory who holds it now. Bounded; a stale entry is corrected
    /// by the owner's "not mine".
    moved: RwLock<FxHashMap<String, String>>,
    /// Ids of forwarded requests, unique per caller.
    request_ids: AtomicU64,
    config: Arc<Config>,
    /// The worker's metrics: proofs of death, reclaims.
    metrics: Arc<crate::metrics::Metrics>,
}

impl Forwarder {
    pub fn new(
        id: String,
        directory: Directory,
        lease: Arc<LeaseHolder>,
        mesh: MeshClient,
        probe_mesh: MeshClient,
        config: Arc<Config>,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Forwarder {
        Forwarder {
            id,
            directory,
            lease,
            mesh,
            probe_mesh,
            peers: RwLock::default(),
            buried: parking_lot::Mutex::default(),
            moved: RwLock::default(),
            request_ids: AtomicU64::new(1),
            config,
            metrics,
        }
    }

    /// Remembers that `owner` was proven dead, for a while (ids are never reused, so
    /// the memory only needs to outlast the clients that still hold its sessions).
    pub(crate) fn remember_dead(&self, owner: &str) {
        let now = tokio::time::Instant::now();
        let keep = self.config.fleet.lease * 60;
        let mut buried = self.buried.lock();
        if buried.len() >= MAX_REMEMBERED_DEAD {
            buried.retain(|_, at| now.duration_since(*at) < keep);
            if buried.len() >= MAX_REMEMBERED_DEAD {
                buried.clear();
            }
        }
        buried.insert(owner.to_owned(), now);
    }

    /// Remembers that `owner` adopted session `sid`.
    pub(crate) fn remember_moved(&self, sid: &str, owner: &str) {
        let mut moved = self.moved.write();
        if moved.len() >= MAX_REMEMBERED_MOVES {
            moved.clear();
        }
        moved.insert(sid.to_owned(), owner.to_owned());
    }

    /// Who adopted session `sid`, as this worker last learnt.
    pub(crate) fn moved_to(&self, sid: &str) -> Option<String> {
        self.moved.read().get(sid).cloned()
    }

    pub(crate) fn forget_moved(&self, sid: &str) {
        self.moved.write().remove(sid);
    }

    /// Whether this worker proved `owner` dead recently.
    pub(crate) fn known_dead(&self, owner: &str) -> bool {
        let keep = self.config.fleet.lease * 60;
        self.buried
            .lock()
            .get(owner)
            .is_some_and(|at| at.elapsed() < keep)
    }

    /// The mesh transport's name as a metric label.
    pub fn transport_label(&self) -> &'static str {
        self.mesh.label()
    }

    /// Sends `call` (for a session this worker does not hold) to the session's owner
    /// and returns its answer, or the situation that answers instead.
    pub async fn forward_to_owner(&self, call: &Call) -> Result<Reply, Unanswered> {
        let Some(session_id) = call.session_id.as_deref() else {
            return Err(Unanswered::new(Situation::NoSuchSession, "no session id"));
        };
        let caller = self.caller();
        // A session adopted after its owner left still hints the old owner.
        let machine = match self.moved_to(session_id) {
            Some(adopter) => Forwarding::to(caller, &adopter),
            None => Forwarding::locating(caller, session::owner_hint(session_id)),
        };
        self.drive(machine, call, session_id).await
    }

    /// Sends `call` to `owner`, which the directory names as its session's owner (the
    /// caller read the record itself), as [`forward_to_owner`](Self::forward_to_owner)
    /// does once it knows the owner.
    pub async fn forward_to_recorded_owner(
        &self,
        owner: &str,
        call: &Call,
    ) -> Result<Reply, Unanswered> {
        let Some(session_id) = call.session_id.as_deref() else {
            return Err(Unanswered::new(Situation::NoSuchSession, "no session id"));
        };
        let machine = Forwarding::to(self.caller(), owner);
        self.drive(machine, call, session_id).await
    }

    /// What the forward machine needs to know about this worker and its fleet.
    fn caller(&self) -> Caller {
        Caller {
            this_worker: self.id.clone(),
            generation: self.lease.generation(),
            lease: self.config.fleet.lease,
            refusal_proves: self.refusal_proves(),
            fenced: self.lease.revoked(),
        }
    }

    fn refusal_proves(&self) -> bool {
        self.mesh.refusal_proves_death()
    }

    /// Runs `machine` to its end: carries out each action and feeds back what it found.
    async fn drive(
        &self,
        mut machine: Forwarding,
        call: &Call,
        session: &str,
    ) -> Result<Reply, Unanswered> {
        let started = Instant::now();
        // The target's mesh address, once the registry named it.
        let mut addr = String::new();
        // Whether the last send's frame left; none before the first send.
        let mut sent: Option<Arc<AtomicBool>> = None;
        let mut in_flight = None;
        let mut answer = None;
        let mut action = machine.start();
        // Every step but the send and its wait is boxed: a forward that is answered
        // (almost every one) then does not carry a future sized for probes and
        // directory calls (see `Router::dispatch`).
        loop {
            let event = match action {
                Action::Relay => return answer.take().map(from_forwarded).ok_or_else(lost_track),
                Action::Refuse { unanswered, bury } => {
                    if let Some(proof) = bury {
                        Box::pin(self.bury_proven(proof, machine.target(), &addr)).await;
                    }
                    return Err(unanswered);
                }
                Action::Send { suspect_after } => {
                    // A fresh flag per send: a probe reads whether this request left.
                    let left = Arc::new(AtomicBool::new(false));
                    sent = Some(Arc::clone(&left));
                    let owner = machine.target().to_owned();
                    let frame = self.frame_of(call);
                    in_flight = Some(Box::pin(self.send(addr.clone(), owner, frame, left)));
                    self.await_answer(&mut in_flight, &mut answer, Some(suspect_after))
                        .await
                }
                Action::Await { suspect_after } => {
                    self.await_answer(&mut in_flight, &mut answer, suspect_after)
                        .await
                }
                Action::Probe { after } => {
                    let probe = self.probe_after(after, machine.target(), &addr, sent.as_deref());
                    Box::pin(self.raced(&mut in_flight, &mut answer, probe)).await
                }
                Action::AskRecord => {
                    let record = async {
                        let record = self.directory.recorded_owner(session).await;
                        Event::Record(record.map_err(|e| e.to_string()))
                    };
                    Box::pin(self.raced(&mut in_flight, &mut answer, record)).await
                }
                Action::AskLease => {
                    let lease = async {
                        let state = self.directory.lease_state(machine.target()).await;
                        Event::Lease(state.map_err(|e| e.to_string()))
                    };
                    Box::pin(self.raced(&mut in_flight, &mut answer, lease)).await
                }
                Action::AskAddress => Box::pin(self.ask_address(machine.target(), &mut addr)).await,
                Action::AskGone => {
                    let gone = Box::pin(self.directory.gone_record(machine.target())).await;
                    Event::Gone(gone.map_err(|e| e.to_string()))
                }
                Action::AskRegistered(worker) => {
                    let registered = Box::pin(self.directory.registered_ago(&worker)).await;
                    Event::Registered(registered.map_err(|e| e.to_string()))
                }
            };
            if let Event::Failed(failure) = &event {
                debug!(owner = machine.target(), %addr, error = %failure.detail, "forward failed");
            }
            action = machine.on(started.elapsed(), event);
            if !machine.in_flight() {
                // Proven dead, or answered: nothing more can come from it.
                in_flight = None;
            }
        }
    }

    /// Counts the proof of `owner`'s death, then forgets it and reclaims its sessions.
    async fn bury_proven(&self, proof: &'static str, owner: &str, addr: &str) {
        self.metrics.death_proven(proof);
        self.bury(owner, addr).await;
    }

    /// `call` as a mesh frame under this worker's next request id.
    fn frame_of(&self, call: &Call) -> RequestFrame {
        let request_id = self.request_ids.fetch_add(1, Ordering::Relaxed);
        to_frame(call, request_id, self.config.mesh.forward_timeout)
    }

    /// Probes `owner` at `addr` once `after` has passed; `sent` says whether the
    /// forwarded request had been written by then (`None`: it was never sent).
    async fn probe_after(
        &self,
        after: Duration,
        owner: &str,
        addr: &str,
        sent: Option<&AtomicBool>,
    ) -> Event {
        if !after.is_zero() {
            tokio::time::sleep(after).await;
        }
        let (sign, replaced_by) = self.probe(owner, addr).await;
        Event::Probed(Probed {
            sign,
            sent: sent.is_some_and(|sent| sent.load(Ordering::Acquire)),
            replaced_by,
        })
    }

    /// Where `owner` is reached: `addr` is set when the registry names its address.
    async fn ask_address(&self, owner: &str, addr: &mut String) -> Event {
        addr.clear();
        if self.known_dead(owner) {
            return Event::Address(Address::KnownDead);
        }
        Event::Address(match self.peer_addr(owner).await {
            Ok(Some(found)) => {
                *addr = found;
                Address::Found
            }
            Ok(None) => Address::Missing,
            Err(e) => Address::Failed(e.to_string()),
        })
    }

    /// The forward itself, owning what it needs, so the caller can hold it across the
    /// lookups and probes it races.
    async fn send(
        &self,
        addr: String,
        owner: String,
        frame: RequestFrame,
        sent: Arc<AtomicBool>,
    ) -> Forwarded {
        self.mesh.forward_tracked(&addr, &owner, frame, &sent).await
    }

    /// Waits for the request's answer; for at most `suspect_after` when set.
    async fn await_answer<F: Future<Output = Forwarded>>(
        &self,
        in_flight: &mut Option<Pin<Box<F>>>,
        answer: &mut Option<ForwardedResponse>,
        suspect_after: Option<Duration>,
    ) -> Event {
        if in_flight.is_none() {
            // Nothing was sent: the machine answers a timeout it did not expect with
            // "unknown".
            return Event::HeadTimeout;
        }
        let timer = async {
            match suspect_after {
                Some(limit) => tokio::time::sleep(limit).await,
                None => std::future::pending().await,
            }
            Event::HeadTimeout
        };
        self.raced(in_flight, answer, timer).await
    }

    /// Runs `work` while the request's answer may still come: the answer (or the
    /// forward's failure) wins, and becomes the event instead.
    async fn raced<F: Future<Output = Forwarded>>(
        &self,
        in_flight: &mut Option<Pin<Box<F>>>,
        answer: &mut Option<ForwardedResponse>,
        work: impl Future<Output = Event>,
    ) -> Event {
        let Some(forward) = in_flight.as_mut() else {
            return work.await;
        };
        let outcome = tokio::select! {
            outcome = forward => outcome,
            event = work => return event,
        };
        *in_flight = None;
        match outcome {
            Ok(response) => {
                *answer = Some(response);
                Event::Answered
            }
            Err(error) => Event::Failed(Failure::of(&error, self.refusal_proves())),
        }
    }

    /// Whether `owner` still lives at `addr`, on a fresh connection: answered, refused
    /// (or another worker's Welcome, whose id comes back), or silent.
    async fn probe(&self, owner: &str, addr: &str) -> (ProbeSign, Option<String>) {
        self.probe_mesh.forget_peer(addr);
        let frame = probe_frame(self.config.mesh.limits.connect_timeout);
        match self.probe_mesh.forward(addr, owner, frame).await {
            Ok(_) | Err(MeshError::Remote(_)) => (ProbeSign::Answered, None),
            Err(e) if e.proves_peer_gone() => {
                let replaced_by = match &e {
                    MeshError::WrongWorker { found, .. } => Some(found.clone()),
                    _ => None,
                };
                (ProbeSign::Refused(describe(&e)), replaced_by)
            }
            Err(_) => (ProbeSign::Silent, None),
        }
    }

    async fn peer_addr(&self, owner: &str) -> Result<Option<String>, DirectoryError> {
        if let Some(addr) = self.peers.read().get(owner) {
            return Ok(Some(addr.clone()));
        }
        let Some(endpoint) = self.directory.worker_endpoint(owner).await? else {
            return Ok(None);
        };
        // Before the address is used: every connection that claims to lead to `owner`
        // must carry the identity it registered.
        // And the same-host route it advertised, which each client keeps only when it
        // names this kernel.
        for mesh in [&self.mesh, &self.probe_mesh] {
            mesh.expect_identity(owner, endpoint.identity.as_deref());
            mesh.expect_same_host(owner, endpoint.same_host.as_ref());
        }
        self.peers
            .write()
            .insert(owner.to_owned(), endpoint.addr.clone());
        Ok(Some(endpoint.addr))
    }

    /// Acts on proof that `owner` is dead: forget it, and reclaim its sessions in the
    /// directory (exactly once fleet-wide; the directory arbitrates races).
    async fn bury(&self, owner: &str, addr: &str) {
        self.peers.write().remove(owner);
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
                self.remember_dead(owner);
                warn!(owner, error = %e, "cannot reclaim a dead worker now; its sessions stay unknown until its lease expires");
                return;
            }
        };
        self.remember_dead(owner);
        match self.directory.reclaim_worker(owner, token.as_deref()).await {
            Ok(Some(sids)) => {
                self.metrics.worker_reclaimed(sids.len());
                info!(
                    owner,
                    sessions = sids.len(),
                    "reclaimed a dead worker's sessions"
                );
            }
            Ok(None) => debug!(owner, "dead worker already reclaimed"),
            Err(e) => warn!(owner, error = %e, "reclaiming a dead worker failed"),
        }
    }
}

/// A request that any worker answers at once without side effects (405 from the
/// request checks), used to test that an owner is alive on a fresh connection.
fn probe_frame(deadline: Duration) -> RequestFrame {
    RequestFrame {
        request_id: 0,
        session_id: None,
        method: "OPTIONS".into(),
        path: "/mcp".into(),
        headers: Vec::new(),
        body: bytes::Bytes::new(),
        auth: mcpgw_wire::AuthContext {
            mode: mcpgw_wire::AuthMode::Public,
            subject: String::new(),
            scopes: Vec::new(),
            expires_at_ms: None,
            route: String::new(),
        },
        deadline_ms: u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX),
    }
}

/// Builds the mesh request for `call`. The session id travels as a header too, so
/// the owner parses the request exactly as the edge did.
pub fn to_frame(call: &Call, request_id: u64, deadline: Duration) -> RequestFrame {
    let mut headers = super::header_pairs(&call.headers, 1);
    if let Some(session) = &call.session_id {
        headers.push((mcp::HEADER_SESSION_ID.to_owned(), session.clone()));
    }
    RequestFrame {
        request_id,
        session_id: call.session_id.clone(),
        method: call.method.as_str().to_owned(),
        path: call.path.clone(),
        headers,
        body: call.body.clone(),
        auth: call.auth.clone(),
        deadline_ms: u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX),
    }
}

/// The machine relayed an answer that never came: it has a bug, and nothing was
/// proven.
fn lost_track() -> Unanswered {
    Unanswered::new(Situation::Unknown, "the gateway lost track of this forward")
}

/// The owner's answer as a reply for the client: head as sent, body chunks relayed
/// one by one as they arrive. Dropping the reply (client gone) drops the forwarded
/// response, which cancels the request at the owner.
pub fn from_forwarded(mut response: ForwardedResponse) -> Reply {
    let status = StatusCode::from_u16(response.head().status).unwrap_or(StatusCode::BAD_GATEWAY);
    // A header HTTP does not allow is left out; the rest of the answer stands.
    let Ok(headers) = super::header_map(response.take_headers(), |_| Ok::<(), Infallible>(()));
    let chunks = unfold(response, |mut response| async move {
        match response.next_chunk().await {
            Some(Ok(chunk)) => Some((Ok(Frame::data(chunk)), response)),
            Some(Err(e)) => {
                // The client gets a truncated stream: the truth, since the owner's
                // answer broke mid-way. Nothing is retried elsewhere.
                warn!(error = %e, "forwarded response broke mid-stream");
                Some((Err(BoxError::from(e)), response))
            }
            None => None,
        }
    });
    let body: ReplyBody = StreamBody::new(chunks).boxed_unsync();
    Reply {
        status,
        headers,
        body,
    }
}
