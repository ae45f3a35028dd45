//! The caller's side of forwarding: a request for a session held by another worker
//! goes to that worker over the mesh, and its streamed answer comes back as a reply.
//! When the forward fails, the caller finds out what the failure proves (the pure
//! verdicts live in [`crate::dispatch::table`]; this file gathers their facts) and
//! acts on proof of death by reclaiming the dead owner's sessions.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::stream::unfold;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use mcpgw_mesh::directory::{DirectoryError, Recorded};
use mcpgw_mesh::transport::{ForwardedResponse, MeshError, TransportKind};
use mcpgw_wire::RequestFrame;
use tracing::{debug, info, warn};

use crate::body::{BoxError, ReplyBody};
use crate::dispatch::table::{
    self, AfterNotOwner, LeaseProof, Liveness, Lookup, ProbeSign, Situation, Verdict,
};
use crate::fleet::Fleet;
use crate::mcp;
use crate::reply::Reply;
use crate::request::Call;
use crate::session;

/// How long a forwarded request waits for its head before the owner is probed, and
/// between probes while the owner's fate is unknown.
const SUSPECT_AFTER: Duration = Duration::from_secs(1);

/// How long probes are repeated after a connection broke under a sent request (about
/// a second for a killed owner's sockets to close), and the time between them.
const PROBING_AFTER_LOSS: Duration = Duration::from_secs(1);
const PROBE_AFTER_LOSS_SPACING: Duration = Duration::from_millis(300);

/// Why a forward produced no reply: the situation the client is answered from, the
/// cause in words fit for the client (no internal addresses), and the full detail for
/// the log line.
pub struct Unanswered {
    pub situation: Situation,
    pub why: String,
    pub detail: String,
}

/// What one attempt to forward to one owner ended in.
enum Attempt {
    Answered(Reply),
    Refused(Unanswered),
    /// The owner answered that it does not hold the session.
    NotOwner,
}

fn refused(situation: Situation, why: impl Into<String>, detail: impl Into<String>) -> Attempt {
    Attempt::Refused(Unanswered {
        situation,
        why: why.into(),
        detail: detail.into(),
    })
}

fn unanswered(situation: Situation, why: &str) -> Unanswered {
    Unanswered {
        situation,
        why: why.to_owned(),
        detail: String::new(),
    }
}

/// What a mesh error means, in words fit for a client: never an address.
fn describe(error: &MeshError) -> String {
    if let MeshError::WrongWorker { found, .. } = error {
        // Worker ids are not secret (every session id carries one); addresses are.
        return format!("its mesh address answers as worker {found}");
    }
    describe_kind(error).to_owned()
}

fn describe_kind(error: &MeshError) -> &'static str {
    use mcpgw_wire::ErrorKind as K;
    match error {
        MeshError::Refused { .. } => "its mesh address refused the connection",
        MeshError::ConnectTimeout { .. } => "it did not accept a mesh connection in time",
        MeshError::Connect { .. } => "the mesh connection to it failed",
        MeshError::Tls { .. } => "the mesh TLS handshake with it failed",
        MeshError::IdentityMismatch { .. } => {
            "its mesh address answers with another member's certificate"
        }
        MeshError::VersionMismatch { .. } => "it speaks another mesh protocol version",
        MeshError::RequestTooLarge(_) => "the request does not fit in one mesh frame",
        MeshError::BudgetExhausted { .. } => "the mesh budget to it is full",
        MeshError::Remote(frame) => match frame.kind {
            K::NotOwner => "it does not hold the session",
            K::Draining => "it is draining or cannot confirm its lease",
            K::Busy => "its mesh budget for this peer is full",
            K::DeadlineExceeded => "it did not answer within the deadline",
            K::Cancelled => "the request was cancelled",
            K::Internal => "it failed while answering",
            K::VersionMismatch | K::Malformed | K::TooLarge => "it refused the mesh frame",
        },
        MeshError::LostMidResponse(_) => {
            "the connection to it broke before the answer was complete"
        }
        MeshError::DeadlineExceeded => "it did not answer within the deadline",
        MeshError::Protocol(_) => "it broke the mesh protocol",
        _ => "the mesh could not carry the request",
    }
}

impl Fleet {
    /// Sends `call` (for a session this worker, `this_worker`, does not hold) to the
    /// session's owner and returns its answer, or the situation that answers instead.
    pub async fn forward_to_owner(
        &self,
        this_worker: &str,
        call: &Call,
    ) -> Result<Reply, Unanswered> {
        let Some(session_id) = call.session_id.as_deref() else {
            return Err(unanswered(Situation::NoSuchSession, "no session id"));
        };
        // A session adopted after its owner left still hints the old owner.
        if let Some(adopter) = self.moved_to(session_id) {
            return self
                .forward_from(&adopter, this_worker, call, session_id)
                .await;
        }
        let hint = session::owner_hint(session_id);
        let fenced = self.lease.revoked();
        let owner = table::owner_from(hint, this_worker, fenced, async || {
            self.session_record(session_id).await
        })
        .await
        .map_err(|situation| match situation {
            Situation::Unknown => {
                unanswered(situation, "the fleet directory did not answer in time")
            }
            Situation::OwnerGone => unanswered(
                situation,
                "the worker that held it was declared dead and dropped it",
            ),
            _ => unanswered(situation, "no owner recorded"),
        })?;
        self.forward_from(&owner, this_worker, call, session_id)
            .await
    }

    /// Sends `call` to `owner`, which the directory names as its session's owner (the
    /// caller read the record itself), as [`forward_to_owner`](Self::forward_to_owner)
    /// does once it knows the owner.
    pub async fn forward_to_recorded_owner(
        &self,
        this_worker: &str,
        owner: &str,
        call: &Call,
    ) -> Result<Reply, Unanswered> {
        let Some(session_id) = call.session_id.as_deref() else {
            return Err(unanswered(Situation::NoSuchSession, "no session id"));
        };
        self.forward_from(owner, this_worker, call, session_id)
            .await
    }

    async fn forward_from(
        &self,
        owner: &str,
        this_worker: &str,
        call: &Call,
        session_id: &str,
    ) -> Result<Reply, Unanswered> {
        let owner = owner.to_owned();
        match self.forward_to(&owner, call, session_id).await {
            Attempt::Answered(reply) => Ok(reply),
            Attempt::Refused(unanswered) => Err(unanswered),
            Attempt::NotOwner => {
                // The hint named a worker that says "not mine": ask the directory.
                let recorded = self.session_record(session_id).await;
                match table::after_not_owner(&owner, this_worker, recorded) {
                    AfterNotOwner::ForwardTo(recorded) => {
                        match self.forward_to(&recorded, call, session_id).await {
                            Attempt::Answered(reply) => Ok(reply),
                            Attempt::Refused(unanswered) => Err(unanswered),
                            Attempt::NotOwner => Err(unanswered(
                                Situation::OwnerGone,
                                "the recorded owner no longer holds it",
                            )),
                        }
                    }
                    AfterNotOwner::Answer(situation) => {
                        Err(unanswered(situation, "its owner no longer holds it"))
                    }
                }
            }
        }
    }

    async fn forward_to(&self, owner: &str, call: &Call, session: &str) -> Attempt {
        if self.known_dead(owner) {
            return refused(
                Situation::OwnerGone,
                format!("worker {owner} was found dead"),
                String::new(),
            );
        }
        let addr = match self.peer_addr(owner).await {
            Ok(Some(addr)) => addr,
            Ok(None) => {
                let lease = self.lease_proof(owner).await;
                let (why, detail) = match &lease {
                    Ok(LeaseProof::Expired) => {
                        (format!("worker {owner}'s lease expired"), String::new())
                    }
                    Ok(LeaseProof::Left(gone)) => (
                        match gone.how {
                            mcpgw_mesh::directory::GoneHow::Reclaimed => {
                                format!("worker {owner} was proven dead and its sessions reclaimed")
                            }
                            mcpgw_mesh::directory::GoneHow::Deregistered => {
                                format!("worker {owner} drained and ended its sessions")
                            }
                        },
                        String::new(),
                    ),
                    Ok(LeaseProof::Alive) => {
                        ("its mesh address is being renewed".into(), String::new())
                    }
                    Ok(LeaseProof::Unproven) => (
                        "the directory was lost and is being rebuilt".into(),
                        String::new(),
                    ),
                    Err(e) => (
                        "the fleet directory did not answer in time".into(),
                        e.clone(),
                    ),
                };
                let verdict = table::without_address(lease);
                return self
                    .act(verdict, owner, "", why, detail, "lease_expired")
                    .await;
            }
            Err(e) => {
                return refused(
                    Situation::Unknown,
                    "the fleet directory did not answer in time",
                    e.to_string(),
                );
            }
        };
        let request_id = self.request_ids.fetch_add(1, Ordering::Relaxed);
        let frame = to_frame(call, request_id, self.config.mesh.forward_timeout);
        let sent_at = tokio::time::Instant::now();
        let sent = std::sync::atomic::AtomicBool::new(false);
        let forward = self.mesh.forward_tracked(&addr, owner, frame, &sent);
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
                        probed = &mut probe => match probed.liveness {
                            Liveness::Dead(why) => {
                                // Still connecting when the owner was proven dead: the
                                // request never left, so it cannot have run.
                                let left = if sent.load(std::sync::atomic::Ordering::Acquire) {
                                    self.left_before_sending(owner, probed.replaced_by.as_deref(), sent_at).await
                                } else {
                                    Some(mcpgw_mesh::directory::GoneHow::Reclaimed)
                                };
                                let verdict = table::after_loss(&Liveness::Dead(why.clone()), left);
                                return self
                                    .act(verdict, owner, &addr, why, String::new(), "probe")
                                    .await;
                            }
                            Liveness::Alive => probing = false,
                            Liveness::Unknown => {}
                        },
                    }
                }
            }
        };
        match outcome {
            Ok(response) => Attempt::Answered(from_forwarded(response)),
            Err(error) => {
                debug!(owner, %addr, %error, "forward failed");
                self.classify(owner, &addr, session, error, sent_at).await
            }
        }
    }

    /// What a failed forward proves, and acting on it.
    async fn classify(
        &self,
        owner: &str,
        addr: &str,
        session: &str,
        error: MeshError,
        sent_at: tokio::time::Instant,
    ) -> Attempt {
        let via_pubsub = self.mesh.kind() == TransportKind::Redis;
        let verdict = table::after_failure(
            table::sign_of(&error),
            owner,
            via_pubsub,
            async || self.lease_proof(owner).await,
            async || self.session_record(session).await,
        )
        .await;
        let verdict = match verdict {
            Verdict::Probe => {
                // Sent, then lost: the outcome is unknown whatever the probe finds (502,
                // never re-run); it tells whether the session went with its owner.
                let Probed {
                    liveness,
                    replaced_by,
                } = self.probe_after_loss(owner, addr).await;
                let why = match &liveness {
                    Liveness::Dead(why) => format!("{}; {why}", describe(&error)),
                    _ => describe(&error),
                };
                let left = match liveness {
                    Liveness::Dead(_) => {
                        self.left_before_sending(owner, replaced_by.as_deref(), sent_at)
                            .await
                    }
                    _ => None,
                };
                let verdict = table::after_loss(&liveness, left);
                return self
                    .act(verdict, owner, addr, why, error.to_string(), "probe")
                    .await;
            }
            verdict => verdict,
        };
        let proof = match &error {
            MeshError::WrongWorker { .. } => "wrong_worker",
            MeshError::Refused { .. } if self.mesh.kind() != TransportKind::Redis => "refused",
            _ => "lease_expired",
        };
        self.act(
            verdict,
            owner,
            addr,
            describe(&error),
            error.to_string(),
            proof,
        )
        .await
    }

    /// Carries out a verdict: buries a proven-dead owner (counted by `proof`), and turns
    /// the situation into the attempt's result.
    async fn act(
        &self,
        verdict: Verdict,
        owner: &str,
        addr: &str,
        why: String,
        detail: String,
        proof: &'static str,
    ) -> Attempt {
        match verdict {
            Verdict::Answer { situation, bury } => {
                if bury {
                    self.metrics.death_proven(proof);
                    self.bury(owner, addr).await;
                }
                let why = match situation {
                    Situation::NoSuchSession if why.is_empty() => "it ended".into(),
                    _ => why,
                };
                refused(situation, why, detail)
            }
            Verdict::AskDirectory => Attempt::NotOwner,
            // Probing is resolved by the callers above; reaching here is a bug, and the
            // honest answer for it is "unknown".
            Verdict::Probe => refused(Situation::Unknown, why, detail),
        }
    }

    /// How `owner` left (reclaimed by any worker, or drained), if it had left before
    /// a request sent at `sent_at` went out. Unknown counts as no.
    async fn left_before_sending(
        &self,
        owner: &str,
        replaced_by: Option<&str>,
        sent_at: tokio::time::Instant,
    ) -> Option<mcpgw_mesh::directory::GoneHow> {
        let left = match self.directory.gone_record(owner).await {
            Ok(gone) => table::left_before_sending(sent_at.elapsed(), gone),
            Err(_) => None,
        };
        // Nobody recorded its end yet, but another worker answers at its address: if
        // that one registered before the request went out, the owner was dead by then
        // (its address taken), so the request cannot have run there.
        match (left, replaced_by) {
            (None, Some(replacement)) => {
                let registered = self.directory.registered_ago(replacement).await.ok()?;
                table::replaced_before_sending(sent_at.elapsed(), registered)
                    .then_some(mcpgw_mesh::directory::GoneHow::Reclaimed)
            }
            (left, _) => left,
        }
    }

    /// A connection broke under a sent request. An owner killed a moment ago may still
    /// be tearing down (its listener not yet closed), so a probe that proves nothing is
    /// repeated for about a second before the answer settles on "unknown". A silent
    /// owner's probe takes a whole connect timeout, past that second: it is not
    /// repeated, so the client is not kept waiting for probes that cannot tell more.
    async fn probe_after_loss(&self, owner: &str, addr: &str) -> Probed {
        let started = tokio::time::Instant::now();
        loop {
            let probed = self.probe(owner, addr).await;
            if probed.liveness != Liveness::Unknown || started.elapsed() >= PROBING_AFTER_LOSS {
                return probed;
            }
            tokio::time::sleep(PROBE_AFTER_LOSS_SPACING).await;
        }
    }

    /// Whether `owner` still lives at `addr`: a fresh connection (refused or another
    /// worker's Welcome is proof of death), then its lease.
    async fn probe(&self, owner: &str, addr: &str) -> Probed {
        self.probe_mesh.forget_peer(addr);
        let frame = probe_frame(self.config.mesh.limits.connect_timeout);
        let mut replaced_by = None;
        let sign = match self.probe_mesh.forward(addr, owner, frame).await {
            Ok(_) | Err(MeshError::Remote(_)) => ProbeSign::Answered,
            Err(e) if e.proves_peer_gone() => {
                if let MeshError::WrongWorker { found, .. } = &e {
                    replaced_by = Some(found.clone());
                }
                ProbeSign::Refused(describe(&e))
            }
            Err(_) => ProbeSign::Silent,
        };
        let refusal_proves = self.mesh.kind() != TransportKind::Redis;
        let liveness =
            table::liveness(sign, refusal_proves, async || self.lease_proof(owner).await).await;
        Probed {
            liveness,
            replaced_by,
        }
    }

    /// What `owner`'s lease in the directory proves (see [`table::judge_lease`]).
    async fn lease_proof(&self, owner: &str) -> Lookup<LeaseProof> {
        let state = self
            .directory
            .lease_state(owner)
            .await
            .map_err(|e| e.to_string())?;
        Ok(table::judge_lease(
            &state,
            &self.lease.generation(),
            self.config.fleet.lease,
        ))
    }

    /// The directory's owner of `session`: `None` only where its absence is proven, so
    /// a directory that failed over or came back empty less than a lease ago (and may
    /// have lost the record) never tells a live session "not found".
    async fn session_record(&self, session: &str) -> Lookup<Option<String>> {
        match self
            .directory
            .recorded_owner(session)
            .await
            .map_err(|e| e.to_string())?
        {
            Recorded::Owner(owner) => Ok(Some(owner)),
            Recorded::Never => Ok(None),
            Recorded::Absent {
                generation,
                generation_age,
                rebuilt,
            } if table::absence_proven(
                &generation,
                generation_age,
                rebuilt,
                &self.lease.generation(),
                self.config.fleet.lease,
            ) =>
            {
                Ok(None)
            }
            Recorded::Absent { .. } => Err(
                "the directory was rebuilt or failed over less than a lease ago: a missing \
                 record proves nothing yet"
                    .into(),
            ),
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
        for mesh in [&self.mesh, &self.probe_mesh] {
            mesh.expect_identity(owner, endpoint.identity.as_deref());
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
                self.metrics.workers_reclaimed.inc();
                self.metrics.sessions_reclaimed.inc_by(sids.len() as u64);
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

/// What a liveness probe found, and who answered at the owner's address instead (the
/// worker that took it over), if anyone.
struct Probed {
    liveness: Liveness,
    replaced_by: Option<String>,
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
    let mut headers: Vec<(String, String)> = call
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect();
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

/// The owner's answer as a reply for the client: head as sent, body chunks relayed
/// one by one as they arrive. Dropping the reply (client gone) drops the forwarded
/// response, which cancels the request at the owner.
pub fn from_forwarded(response: ForwardedResponse) -> Reply {
    let head = response.head();
    let mut headers = HeaderMap::new();
    for (name, value) in &head.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    let status = StatusCode::from_u16(head.status).unwrap_or(StatusCode::BAD_GATEWAY);
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
