//! The affinity decision table (docs/architecture.md, "Decision table"), as pure
//! logic: given what the receiving worker knows about a request's session, where does
//! the request go, or what true answer does the client get? And when a forward fails:
//! what does the failure prove?
//!
//! The rule behind every row: an owner acts for a session only while its lease is
//! valid by its own clock; others declare it dead only on proof (lease expired in
//! Redis, its mesh address refuses or answers as another worker). A lookup that failed
//! is *unknown*, never *absent*, so no session is ever silently replaced.
//!
//! Nothing here does I/O: the callers gather the facts (registry, lease clock,
//! directory answers, mesh errors) and act on the verdicts, so every row is tested
//! below without a socket.

use crate::reason::Reason;
use std::time::Duration;

use http::StatusCode;
use mcpgw_mesh::MeshError;
use mcpgw_mesh::directory::{Gone, GoneHow, LeaseState, Remembered};
use mcpgw_wire::ErrorKind;
use serde_json::json;

use crate::mcp::{self, GatewayError};

/// What the receiving worker knows when it must decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Situation {
    /// No `Mcp-Session-Id`, and the message is a legacy `initialize`.
    NewSession,
    /// No session header on a legacy request other than initialize.
    MissingSession,
    /// A 2026-07-28 request: no session; any worker may answer.
    Modern,
    /// The session is in this worker's registry, and this worker's lease is valid by
    /// its own clock.
    LocalOwned,
    /// The session is here, but this worker's lease is no longer valid by its own
    /// clock (Redis unreachable for too long): it must not act until it renews.
    LocalLeaseInDoubt,
    /// The directory (or the id's owner hint) names another worker whose address is
    /// known.
    RemoteOwner,
    /// The owner is provably gone: lease expired in Redis, its address refused or
    /// answered as another worker, it was reclaimed, or it said "not mine" and the
    /// directory agrees.
    OwnerGone,
    /// The directory confirms the session does not exist (never did, or ended).
    NoSuchSession,
    /// Ownership cannot be established, and the request did not reach the owner:
    /// directory unreachable, or the owner's lease is alive but it could not be
    /// reached (no connection within the connect timeout).
    Unknown,
    /// The request was forwarded and the owner died before the answer completed: it
    /// may or may not have run, and the session went with the owner.
    ForwardedThenLost,
    /// The request was forwarded and its answer lost (the connection broke, or the
    /// forward deadline passed), but the owner lives or cannot be shown dead: it may or
    /// may not have run, and the session may go on. Never "retry": a retry could run
    /// a non-idempotent call twice.
    AnswerLost,
    /// A mesh budget to the owner (short requests, or held streams) is full, here or
    /// at the owner: the owner lives, the request did not run.
    MeshBusy,
}

/// Where the request goes, or what the client is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run it on this worker (create the session here for `NewSession`).
    ExecuteHere,
    /// Send it to the owner over the mesh and stream the answer back.
    Forward,
    /// Answer with this error.
    Refuse(Refusal),
}

/// The truthful errors of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 400: a legacy request needs a session.
    MissingSession,
    /// 404 (or the configured status): the session is gone, re-initialize.
    SessionGone,
    /// 404: no such session.
    NoSuchSession,
    /// 503 + Retry-After, retryable: ownership unknown right now.
    OwnershipUnknown,
    /// 503 + Retry-After: this worker owns the session but cannot prove it right now.
    LeaseInDoubt,
    /// 502: the owner died mid-request; the outcome is unknown; not re-executed.
    OutcomeUnknown,
    /// 502: the answer was lost while the owner lives (or cannot be shown dead); the
    /// outcome is unknown, not re-executed, and the session may go on.
    AnswerLost,
    /// 503 + Retry-After: the mesh to the owner is full right now; retry.
    MeshBusy,
}

pub fn decide(situation: &Situation) -> Decision {
    match situation {
        Situation::NewSession | Situation::Modern | Situation::LocalOwned => Decision::ExecuteHere,
        Situation::RemoteOwner => Decision::Forward,
        Situation::MissingSession => Decision::Refuse(Refusal::MissingSession),
        Situation::LocalLeaseInDoubt => Decision::Refuse(Refusal::LeaseInDoubt),
        Situation::OwnerGone => Decision::Refuse(Refusal::SessionGone),
        Situation::NoSuchSession => Decision::Refuse(Refusal::NoSuchSession),
        Situation::Unknown => Decision::Refuse(Refusal::OwnershipUnknown),
        Situation::ForwardedThenLost => Decision::Refuse(Refusal::OutcomeUnknown),
        Situation::AnswerLost => Decision::Refuse(Refusal::AnswerLost),
        Situation::MeshBusy => Decision::Refuse(Refusal::MeshBusy),
    }
}

/// Whether `error` leaves the session's owner unconfirmed rather than proven gone:
/// ownership unknown, a lease in doubt, or an answer lost while the owner may live.
/// The only cases where a stateless answer may stand in for a method whose answer does
/// not depend on the session (running such a method twice is harmless).
pub fn owner_unconfirmed(error: &GatewayError) -> bool {
    let data = error.data.as_ref();
    let reason = error.reason;
    let may_continue = data
        .and_then(|d| d.get(SESSION_MAY_CONTINUE))
        .and_then(|flag| flag.as_bool())
        .unwrap_or(false);
    may_continue
        || matches!(
            reason,
            Some(Reason::OwnershipUnknown | Reason::LeaseInDoubt)
        )
}

/// `data` flag of an "outcome unknown" answer whose session may go on: its owner lives
/// or could not be shown dead.
pub const SESSION_MAY_CONTINUE: &str = "session_may_continue";

/// Seconds a client should wait before retrying an "unknown" answer.
pub const RETRY_AFTER_SECONDS: u32 = 1;

impl Refusal {
    /// The client-facing error. `gone_status` is 404 by default (MCP: re-initialize),
    /// or 409 for clients that follow a "session reassigned" contract. `why` is the
    /// specific cause, included in the message and in `data.detail`.
    pub fn to_error(self, gone_status: StatusCode, why: &str) -> GatewayError {
        match self {
            Refusal::MissingSession => GatewayError::invalid_request(
                "missing Mcp-Session-Id header: send initialize first, then the returned id",
            ),
            Refusal::SessionGone => GatewayError::new(
                gone_status,
                mcp::code::SESSION_NOT_FOUND,
                format!(
                    "session gone: the worker that held it is gone ({why}); \
                     send initialize without Mcp-Session-Id to start a new session"
                ),
            )
            .with_reason(Reason::SessionGone)
            .with_data(json!({ "detail": why, "retryable": false })),
            Refusal::NoSuchSession => GatewayError::session_not_found(),
            Refusal::OwnershipUnknown => GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "session owner cannot be confirmed right now ({why}); the session may \
                     still be alive: retry the same request with the same Mcp-Session-Id"
                ),
            )
            .with_reason(Reason::OwnershipUnknown)
            .with_data(json!({ "detail": why, "retryable": true }))
            .with_retry_after(RETRY_AFTER_SECONDS),
            Refusal::LeaseInDoubt => GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "the worker holding this session cannot confirm its lease ({why}); \
                     retry the same request with the same Mcp-Session-Id"
                ),
            )
            .with_reason(Reason::LeaseInDoubt)
            .with_data(json!({ "detail": why, "retryable": true }))
            .with_retry_after(RETRY_AFTER_SECONDS),
            Refusal::OutcomeUnknown => GatewayError::new(
                StatusCode::BAD_GATEWAY,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "outcome unknown: the worker executing this request was lost before it \
                     answered ({why}); it was not re-executed elsewhere. Check the state \
                     before retrying a non-idempotent call"
                ),
            )
            .with_reason(Reason::OutcomeUnknown)
            .with_data(json!({ "detail": why, "retryable": false })),
            Refusal::AnswerLost => GatewayError::new(
                StatusCode::BAD_GATEWAY,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "outcome unknown: this request reached the worker holding the session, \
                     and its answer was lost ({why}); it may have run, and it was not \
                     re-executed. The session may go on: check its state before retrying a \
                     non-idempotent call, with the same Mcp-Session-Id"
                ),
            )
            .with_reason(Reason::OutcomeUnknown)
            .with_data(json!({ "detail": why, "retryable": false,
                SESSION_MAY_CONTINUE: true,
            })),
            Refusal::MeshBusy => GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "too many requests and streams are in flight to this session's worker \
                     right now ({why}); the request did not run: retry the same request \
                     shortly"
                ),
            )
            .with_reason(Reason::MeshBudgetExhausted)
            .with_data(json!({ "detail": why, "retryable": true }))
            .with_retry_after(RETRY_AFTER_SECONDS),
        }
    }
}

/// What the receiving worker knows about a call when it must decide, gathered by
/// [`crate::dispatch`] from the request, the session registry and the lease clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    /// The request speaks 2026-07-28 (no sessions).
    pub modern: bool,
    /// It carries `Mcp-Session-Id`.
    pub has_session_id: bool,
    /// It is a legacy `initialize`.
    pub is_initialize: bool,
    /// The session it names is in this worker's registry.
    pub held_here: bool,
    /// This worker's lease is valid by its own clock (always true when standalone).
    pub lease_valid: bool,
    /// This worker belongs to a fleet (another worker may hold the session).
    pub in_fleet: bool,
}

/// The situation a call is in, from what the receiving worker knows.
pub fn situation(known: &Known) -> Situation {
    match known {
        Known { modern: true, .. } => Situation::Modern,
        Known {
            has_session_id: false,
            is_initialize: true,
            ..
        } => Situation::NewSession,
        Known {
            has_session_id: false,
            ..
        } => Situation::MissingSession,
        Known {
            held_here: true,
            lease_valid: true,
            ..
        } => Situation::LocalOwned,
        Known {
            held_here: true, ..
        } => Situation::LocalLeaseInDoubt,
        // Not here: the fleet finds the owner (or proves there is none).
        Known { in_fleet: true, .. } => Situation::RemoteOwner,
        Known { .. } => Situation::NoSuchSession,
    }
}

/// A directory answer, or why the directory could not give one (then the answer is
/// *unknown*, never *absent*).
pub type Lookup<T> = Result<T, String>;

/// What an owner's lease in the directory proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseProof {
    /// Its lease is alive: it may be slow, not dead.
    Alive,
    /// Its lease expired in a directory that has been stable for longer than one
    /// lease (same generation this worker registered under): proof of death.
    Expired,
    /// It left recently, on record: reclaimed (proven dead) or deregistered (ended
    /// cleanly), `ago` (by Redis's clock). Proof whatever the directory's age.
    Left(Gone),
    /// Its lease is missing, but the directory was lost recently (Redis came back
    /// empty) and a live owner may still be registering again: nothing is proven.
    Unproven,
}

impl LeaseProof {
    /// Whether this proves the owner is gone.
    pub fn proves_gone(self) -> bool {
        matches!(self, LeaseProof::Expired | LeaseProof::Left(_))
    }
}

/// Judges a lease lookup. `ours`: the generation this worker registered under;
/// `lease`: the lease time, which is how long an owner may take to register again
/// after the directory was lost.
pub fn judge_lease(state: &LeaseState, ours: &str, lease: Duration) -> LeaseProof {
    if state.alive {
        LeaseProof::Alive
    } else if let Some(gone) = state.gone {
        LeaseProof::Left(gone)
    } else if state.generation == ours && state.generation_age > lease {
        LeaseProof::Expired
    } else {
        LeaseProof::Unproven
    }
}

/// What a failed forward shows on its face, read off the mesh error alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureSign {
    /// Refused, or another worker answered at the owner's address; not sent.
    PeerGone,
    /// The owner answered that it does not hold the session.
    NotOwner,
    /// The owner is draining: it hands its sessions over, or ends them, once its
    /// requests finish.
    OwnerDraining,
    /// A mesh budget to the owner is full (here, or the owner said so): the owner
    /// lives and the request did not run.
    BudgetFull,
    /// Sent, then the connection or the owner was lost: it may have run.
    MayHaveRun,
    /// Not sent, and nothing proven (connect timeout, TLS, saturated, ...).
    NotSent,
}

/// Reads what a mesh error shows on its face.
pub fn sign_of(error: &MeshError) -> FailureSign {
    if error.is_budget_exhausted() {
        return FailureSign::BudgetFull;
    }
    if error.proves_peer_gone() {
        return FailureSign::PeerGone;
    }
    match error.remote().map(|frame| frame.kind) {
        Some(ErrorKind::NotOwner) => return FailureSign::NotOwner,
        Some(ErrorKind::Draining) => return FailureSign::OwnerDraining,
        _ => {}
    }
    if error.may_have_executed() {
        FailureSign::MayHaveRun
    } else {
        FailureSign::NotSent
    }
}

/// What the caller does next after a failed forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Answer from this situation (always a refusal). `bury`: the owner is proven
    /// dead, so forget it and reclaim its sessions.
    Answer { situation: Situation, bury: bool },
    /// Ask the directory who owns the session now (the hint was wrong).
    AskDirectory,
    /// Probe the owner on a fresh connection, then decide with [`after_loss`].
    Probe,
}

impl Verdict {
    fn answer(situation: Situation) -> Verdict {
        Verdict::Answer {
            situation,
            bury: false,
        }
    }
}

/// First verdict on a failed forward. `via_pubsub`: over the Redis baseline, "no
/// subscriber" is also what a subscriber in the middle of reconnecting looks like, so
/// a refusal proves death there only together with an expired lease (`lease`).
/// `session_record`: the directory's owner of the session (asked only for a draining
/// owner: gone once the drain ended it); `Ok(None)` only where the directory proves
/// the absence ([`absence_proven`]), an error otherwise.
pub async fn after_failure(
    sign: FailureSign,
    owner: &str,
    via_pubsub: bool,
    lease: impl AsyncFnOnce() -> Lookup<LeaseProof>,
    session_record: impl AsyncFnOnce() -> Lookup<Option<String>>,
) -> Verdict {
    match sign {
        FailureSign::PeerGone => {
            if via_pubsub && !lease().await.is_ok_and(LeaseProof::proves_gone) {
                Verdict::answer(Situation::Unknown)
            } else {
                Verdict::Answer {
                    situation: Situation::OwnerGone,
                    bury: true,
                }
            }
        }
        FailureSign::NotOwner => Verdict::AskDirectory,
        // "Draining" is also what an owner answers while it cannot confirm its lease
        // (Redis failing over, or it was declared dead and does not know yet).
        FailureSign::OwnerDraining => match session_record().await {
            // No record (and the directory proves the absence): a draining owner ended
            // the session, unless the owner was declared dead, in which case its
            // sessions went with the reclaim.
            Ok(None) => match lease().await {
                Ok(
                    LeaseProof::Expired
                    | LeaseProof::Left(Gone {
                        how: GoneHow::Reclaimed,
                        ..
                    }),
                ) => Verdict::answer(Situation::OwnerGone),
                _ => Verdict::answer(Situation::NoSuchSession),
            },
            // It left the session for another worker (handed over and adopted, or
            // reclaimed and adopted): the directory says where it is now.
            Ok(Some(recorded)) if recorded != owner => Verdict::AskDirectory,
            _ => Verdict::answer(Situation::Unknown),
        },
        FailureSign::BudgetFull => Verdict::answer(Situation::MeshBusy),
        // Never sent: ask where if the session has moved on (its owner, draining or
        // replaced, left it and another worker adopted it); else the owner's lease
        // decides, as when it has no address (an owner whose container is gone may
        // not even resolve): dead is proven only by the lease, unknown otherwise.
        FailureSign::NotSent => match session_record().await {
            Ok(Some(recorded)) if recorded != owner => Verdict::AskDirectory,
            _ => without_address(lease().await),
        },
        FailureSign::MayHaveRun => Verdict::Probe,
    }
}

/// What a liveness probe of an owner found out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Proof: refused, another worker at its address, or its lease expired.
    Dead(String),
    /// Its lease is alive but it does not answer, or the directory cannot tell.
    Unknown,
}

/// What a probe's fresh connection to an owner showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeSign {
    /// The owner answered (even with an error frame): it lives.
    Answered,
    /// Refused, or another worker answered: proof of death where refusals prove
    /// (not over the Redis baseline).
    Refused(String),
    /// No answer and no proof (timeout, connect error).
    Silent,
}

/// Liveness from a probe and, when the probe proved nothing, the owner's lease.
pub async fn liveness(
    probe: ProbeSign,
    refusal_proves: bool,
    lease: impl AsyncFnOnce() -> Lookup<LeaseProof>,
) -> Liveness {
    match probe {
        ProbeSign::Answered => Liveness::Alive,
        ProbeSign::Refused(why) if refusal_proves => Liveness::Dead(why),
        ProbeSign::Refused(_) | ProbeSign::Silent => match lease().await {
            Ok(LeaseProof::Expired) => Liveness::Dead("its lease expired".into()),
            Ok(LeaseProof::Left(gone)) => Liveness::Dead(left_why(gone.how).into()),
            Ok(LeaseProof::Alive | LeaseProof::Unproven) | Err(_) => Liveness::Unknown,
        },
    }
}

/// Why a worker that left on record is gone, in words for the client.
fn left_why(how: GoneHow) -> &'static str {
    match how {
        GoneHow::Reclaimed => "it was proven dead and its sessions reclaimed",
        GoneHow::Deregistered => "it drained and ended its sessions",
    }
}

/// The request was sent and then lost; `liveness` is what a probe found. A dead owner
/// means the outcome is unknown (502, never re-run), unless the owner had already left
/// before the request was sent (`left_before`: reclaimed by another worker, or drained,
/// and this worker still held a connection to it): then the request cannot have run,
/// and the session is gone (reclaimed) or ended (drained). A missing session record
/// alone proves neither way (a reclaim removes it as well as the owner's own end). A
/// live or silent owner does not make the outcome known either: it may have run, so
/// the answer is "outcome unknown" too (502, never "retry"), with the session kept.
pub fn after_loss(liveness: &Liveness, left_before: Option<GoneHow>) -> Verdict {
    match (liveness, left_before) {
        (Liveness::Dead(_), Some(GoneHow::Reclaimed)) => Verdict::Answer {
            situation: Situation::OwnerGone,
            bury: true,
        },
        (Liveness::Dead(_), Some(GoneHow::Deregistered)) => Verdict::Answer {
            situation: Situation::NoSuchSession,
            bury: false,
        },
        (Liveness::Dead(_), None) => Verdict::Answer {
            situation: Situation::ForwardedThenLost,
            bury: true,
        },
        (Liveness::Alive | Liveness::Unknown, _) => Verdict::answer(Situation::AnswerLost),
    }
}

/// How the owner left, if it left before a request sent `sent_ago` ago went out
/// (`gone` read just now; the local time includes the read's round trip, which only
/// makes this answer more cautious).
pub fn left_before_sending(sent_ago: Duration, gone: Option<Gone>) -> Option<GoneHow> {
    // Redis reports whole milliseconds: a millisecond of margin covers the rounding.
    gone.filter(|gone| gone.ago > sent_ago + Duration::from_millis(1))
        .map(|gone| gone.how)
}

/// Whether the worker now at a dead owner's address registered (`registered_ago`, by
/// Redis's clock, read just now) before a request sent `sent_ago` ago went out: then
/// the owner had lost its address before the send and the request cannot have run
/// there. Unknown counts as no.
pub fn replaced_before_sending(sent_ago: Duration, registered_ago: Option<Duration>) -> bool {
    // Redis reports whole milliseconds: a millisecond of margin covers the rounding.
    registered_ago.is_some_and(|ago| ago > sent_ago + Duration::from_millis(1))
}

/// The directory has no mesh address for the owner: its lease expired (proof of
/// death), unless the directory itself was lost recently and is being rebuilt (then
/// nothing is known), or the directory cannot be read. A lease that is alive again
/// (the address key lapsed a moment before a renewal) is not proof either.
pub fn without_address(lease: Lookup<LeaseProof>) -> Verdict {
    match lease {
        Ok(
            LeaseProof::Expired
            | LeaseProof::Left(Gone {
                how: GoneHow::Reclaimed,
                ..
            }),
        ) => Verdict::Answer {
            situation: Situation::OwnerGone,
            bury: true,
        },
        // Drained: it ended its sessions before it left.
        Ok(LeaseProof::Left(Gone {
            how: GoneHow::Deregistered,
            ..
        })) => Verdict::answer(Situation::NoSuchSession),
        Ok(LeaseProof::Alive | LeaseProof::Unproven) | Err(_) => {
            Verdict::answer(Situation::Unknown)
        }
    }
}

/// Where to go after the hinted owner said "not mine", from the directory's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterNotOwner {
    /// The directory names another worker: forward there (once).
    ForwardTo(String),
    Answer(Situation),
}

/// `hinted`: the worker that said "not mine"; `this_worker`: the receiving worker
/// (which does not hold the session either).
pub fn after_not_owner(
    hinted: &str,
    this_worker: &str,
    recorded: Lookup<Option<String>>,
) -> AfterNotOwner {
    match recorded {
        Ok(Some(owner)) if owner != hinted && owner != this_worker => {
            AfterNotOwner::ForwardTo(owner)
        }
        Ok(Some(_)) => AfterNotOwner::Answer(Situation::OwnerGone),
        Ok(None) => AfterNotOwner::Answer(Situation::NoSuchSession),
        Err(_) => AfterNotOwner::Answer(Situation::Unknown),
    }
}

/// Where a session's owner comes from: the hint in its id, else the directory.
/// `fenced`: this worker was declared dead, and dropped its sessions unended.
pub async fn owner_from(
    hint: Option<&str>,
    this_worker: &str,
    fenced: bool,
    recorded: impl AsyncFnOnce() -> Lookup<Option<String>>,
) -> Result<String, Situation> {
    let owner = match hint {
        Some(owner) => owner.to_owned(),
        None => match recorded().await {
            Ok(Some(owner)) => owner,
            Ok(None) => return Err(Situation::NoSuchSession),
            Err(_) => return Err(Situation::Unknown),
        },
    };
    if owner == this_worker {
        // Minted here, not held here: it ended, unless this worker was fenced (then it
        // dropped the session when the fleet declared it dead: gone, not ended).
        return Err(if fenced {
            Situation::OwnerGone
        } else {
            Situation::NoSuchSession
        });
    }
    Ok(owner)
}

/// Where the shared session of a 2026-07-28 principal stands, for a worker that does not
/// hold it live. Such a client has no session id of its own, so the absence of a record
/// cannot tell it "gone": the directory remembers that the session existed, and the
/// first call after its end (on any worker) is told; only after that, or when the
/// directory proves it never existed, does a call open a fresh one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedStanding {
    /// Another worker holds it: forward there.
    Forward(String),
    /// It ended, and this call is the one to tell (the directory's memory is taken).
    TellEnded,
    /// Its owner left it for adoption and it can continue: adopt it here.
    Adopt,
    /// Proven absent (settled directory, no memory of it): open it here.
    Open,
    /// The record names this worker, which does not hold it: a claim whose answer was
    /// lost landed late. Open it here, which confirms the record.
    StaleOwnRecord,
    /// Nothing proven: the directory did not answer, or it was rebuilt less than a
    /// lease ago (it may have lost the record and the memory; the owner re-asserts
    /// them within a lease), or this worker was fenced.
    Unknown,
}

/// Judges the directory's answer for a shared session. `ours`: the generation this
/// worker registered under; `lease`: how long owners take to re-assert their records
/// after the directory was lost.
pub fn judge_shared(
    record: Lookup<Remembered>,
    this_worker: &str,
    fenced: bool,
    ours: &str,
    lease: Duration,
) -> SharedStanding {
    match record {
        Err(_) => SharedStanding::Unknown,
        Ok(_) if fenced => SharedStanding::Unknown,
        Ok(Remembered::Owner(owner)) if owner == this_worker => SharedStanding::StaleOwnRecord,
        Ok(Remembered::Owner(owner)) => SharedStanding::Forward(owner),
        Ok(Remembered::Ended) => SharedStanding::TellEnded,
        Ok(Remembered::Adoptable) => SharedStanding::Adopt,
        Ok(Remembered::Absent {
            generation,
            generation_age,
            rebuilt,
        }) => {
            if absence_proven(&generation, generation_age, rebuilt, ours, lease) {
                SharedStanding::Open
            } else {
                SharedStanding::Unknown
            }
        }
    }
}

/// Whether a record the directory does not hold is really absent: only in the
/// generation this worker registered under (`ours`), and only once that generation is
/// older than a lease if a worker rebuilt it (after Redis came back empty or failed
/// over, owners take up to a lease to write their records again). A young directory
/// that no worker rebuilt is a new fleet's: nothing was lost.
pub fn absence_proven(
    generation: &str,
    generation_age: Duration,
    rebuilt: bool,
    ours: &str,
    lease: Duration,
) -> bool {
    let settled = generation_age > lease || !rebuilt;
    !generation.is_empty() && generation == ours && settled
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_session_opens_only_where_its_absence_is_proven() {
        let lease = Duration::from_secs(10);
        let settled = || Remembered::Absent {
            generation: "g1".into(),
            generation_age: Duration::from_secs(11),
            rebuilt: true,
        };
        let judge = |record, fenced| judge_shared(record, "me", fenced, "g1", lease);
        assert_eq!(
            judge(Ok(Remembered::Owner("peer".into())), false),
            SharedStanding::Forward("peer".into())
        );
        assert_eq!(
            judge(Ok(Remembered::Owner("me".into())), false),
            SharedStanding::StaleOwnRecord
        );
        assert_eq!(
            judge(Ok(Remembered::Ended), false),
            SharedStanding::TellEnded
        );
        assert_eq!(judge(Ok(settled()), false), SharedStanding::Open);
        // A directory rebuilt less than a lease ago, one of another generation (rebuilt
        // since this worker registered), or none yet: the record and its memory may be
        // lost, so absence is unknown, never proven.
        for (generation, age) in [("g1", 10), ("g1", 3), ("g2", 60), ("", 60)] {
            let young = Remembered::Absent {
                generation: generation.into(),
                generation_age: Duration::from_secs(age),
                rebuilt: true,
            };
            assert_eq!(
                judge(Ok(young), false),
                SharedStanding::Unknown,
                "{generation} {age}s"
            );
        }
        // A young directory nobody rebuilt is a new fleet's: absence is proven at once.
        let new_fleet = Remembered::Absent {
            generation: "g1".into(),
            generation_age: Duration::from_secs(1),
            rebuilt: false,
        };
        assert_eq!(judge(Ok(new_fleet), false), SharedStanding::Open);
        assert_eq!(
            judge(Err("timed out".into()), false),
            SharedStanding::Unknown
        );
        assert_eq!(judge(Ok(settled()), true), SharedStanding::Unknown);
        assert_eq!(judge(Ok(Remembered::Ended), true), SharedStanding::Unknown);
        assert_eq!(
            judge(Ok(Remembered::Adoptable), false),
            SharedStanding::Adopt
        );
        assert_eq!(
            judge(Ok(Remembered::Adoptable), true),
            SharedStanding::Unknown,
            "a fenced worker adopts nothing"
        );
    }

    /// One row per line of the decision table in docs/architecture.md.
    #[test]
    fn every_row_of_the_table() {
        let rows: &[(Situation, Decision, Option<u16>)] = &[
            (Situation::LocalOwned, Decision::ExecuteHere, None),
            (Situation::RemoteOwner, Decision::Forward, None),
            (
                Situation::OwnerGone,
                Decision::Refuse(Refusal::SessionGone),
                Some(404),
            ),
            (
                Situation::NoSuchSession,
                Decision::Refuse(Refusal::NoSuchSession),
                Some(404),
            ),
            (
                Situation::Unknown,
                Decision::Refuse(Refusal::OwnershipUnknown),
                Some(503),
            ),
            (
                Situation::AnswerLost,
                Decision::Refuse(Refusal::AnswerLost),
                Some(502),
            ),
            (
                Situation::LocalLeaseInDoubt,
                Decision::Refuse(Refusal::LeaseInDoubt),
                Some(503),
            ),
            (
                Situation::ForwardedThenLost,
                Decision::Refuse(Refusal::OutcomeUnknown),
                Some(502),
            ),
            (Situation::NewSession, Decision::ExecuteHere, None),
            (
                Situation::MissingSession,
                Decision::Refuse(Refusal::MissingSession),
                Some(400),
            ),
            (Situation::Modern, Decision::ExecuteHere, None),
            (
                Situation::MeshBusy,
                Decision::Refuse(Refusal::MeshBusy),
                Some(503),
            ),
        ];
        for (situation, expected, status) in rows {
            let decision = decide(situation);
            assert_eq!(&decision, expected, "{situation:?}");
            if let (Decision::Refuse(refusal), Some(status)) = (&decision, status) {
                let error = refusal.to_error(StatusCode::NOT_FOUND, "test");
                assert_eq!(error.status.as_u16(), *status, "{situation:?}");
            }
        }
    }

    #[test]
    fn unknown_answers_are_retryable_and_gone_ones_are_not() {
        let unknown = Refusal::OwnershipUnknown.to_error(StatusCode::NOT_FOUND, "redis timeout");
        assert_eq!(unknown.retry_after, Some(RETRY_AFTER_SECONDS));
        assert_eq!(unknown.data.as_ref().unwrap()["retryable"], true);
        let gone = Refusal::SessionGone.to_error(StatusCode::NOT_FOUND, "refused");
        assert_eq!(gone.data.as_ref().unwrap()["retryable"], false);
        assert!(gone.message.contains("initialize"));
        assert!(owner_unconfirmed(&unknown));
        assert!(owner_unconfirmed(
            &Refusal::LeaseInDoubt.to_error(StatusCode::NOT_FOUND, "x")
        ));
        assert!(
            !owner_unconfirmed(&gone),
            "a proven answer is never replaced statelessly"
        );
    }

    #[test]
    fn a_lost_answer_is_never_retryable() {
        // The owner died: the outcome is unknown and the session went with it.
        let died = Refusal::OutcomeUnknown.to_error(StatusCode::NOT_FOUND, "refused");
        // The owner lives: still unknown (it may have run), but the session goes on.
        let lost = Refusal::AnswerLost.to_error(StatusCode::NOT_FOUND, "connection closed");
        for error in [&died, &lost] {
            assert_eq!(error.status, StatusCode::BAD_GATEWAY);
            let data = error.data.as_ref().unwrap();
            assert_eq!(data["reason"], "outcome_unknown");
            assert_eq!(data["retryable"], false, "a retry could run it twice");
            assert_eq!(error.retry_after, None);
        }
        assert_eq!(lost.data.as_ref().unwrap()[SESSION_MAY_CONTINUE], true);
        assert!(!owner_unconfirmed(&died), "the owner is proven dead");
        assert!(
            owner_unconfirmed(&lost),
            "a session-independent method may still be answered statelessly"
        );
    }

    #[test]
    fn gone_status_is_configurable_to_409() {
        let gone = Refusal::SessionGone.to_error(StatusCode::CONFLICT, "reclaimed");
        assert_eq!(gone.status, StatusCode::CONFLICT);
    }
    fn known() -> Known {
        Known {
            modern: false,
            has_session_id: true,
            is_initialize: false,
            held_here: false,
            lease_valid: true,
            in_fleet: true,
        }
    }

    /// One row per combination that matters: what the worker knows → the situation.
    #[test]
    fn situation_from_what_the_worker_knows() {
        let rows: &[(Known, Situation)] = &[
            (
                Known {
                    modern: true,
                    held_here: true,
                    ..known()
                },
                Situation::Modern,
            ),
            (
                Known {
                    has_session_id: false,
                    is_initialize: true,
                    ..known()
                },
                Situation::NewSession,
            ),
            (
                Known {
                    has_session_id: false,
                    ..known()
                },
                Situation::MissingSession,
            ),
            (
                Known {
                    held_here: true,
                    ..known()
                },
                Situation::LocalOwned,
            ),
            (
                Known {
                    held_here: true,
                    lease_valid: false,
                    ..known()
                },
                Situation::LocalLeaseInDoubt,
            ),
            (known(), Situation::RemoteOwner),
            (
                Known {
                    in_fleet: false,
                    ..known()
                },
                Situation::NoSuchSession,
            ),
            // An initialize that carries a session id is judged by its session.
            (
                Known {
                    is_initialize: true,
                    held_here: true,
                    ..known()
                },
                Situation::LocalOwned,
            ),
        ];
        for (known, expected) in rows {
            assert_eq!(&situation(known), expected, "{known:?}");
        }
    }

    fn gone(bury: bool) -> Verdict {
        Verdict::Answer {
            situation: Situation::OwnerGone,
            bury,
        }
    }

    fn unknown() -> Verdict {
        Verdict::answer(Situation::Unknown)
    }

    async fn unasked<T>() -> Lookup<T> {
        panic!("this row must decide without asking the directory")
    }

    #[tokio::test]
    async fn what_a_failed_forward_proves() {
        use FailureSign::*;
        use LeaseProof::{Alive, Expired, Unproven};
        // (sign, via pub/sub, owner w0's lease, session record) → verdict
        type Row = (
            FailureSign,
            bool,
            Lookup<LeaseProof>,
            Lookup<Option<String>>,
            Verdict,
        );
        let rows: Vec<Row> = vec![
            (PeerGone, false, Ok(Alive), Ok(None), gone(true)),
            // Over pub/sub a refusal proves death only with the lease provably gone.
            (PeerGone, true, Ok(Expired), Ok(None), gone(true)),
            (PeerGone, true, Ok(Alive), Ok(None), unknown()),
            (PeerGone, true, Ok(Unproven), Ok(None), unknown()),
            (PeerGone, true, Err("timeout".into()), Ok(None), unknown()),
            (NotOwner, false, Ok(Alive), Ok(None), Verdict::AskDirectory),
            (
                OwnerDraining,
                false,
                Ok(Alive),
                Ok(None),
                Verdict::answer(Situation::NoSuchSession),
            ),
            // Still its own: whether it will be served is unknown.
            (
                OwnerDraining,
                false,
                Ok(Alive),
                Ok(Some("w0".into())),
                unknown(),
            ),
            // Another worker took it on: ask where.
            (
                OwnerDraining,
                false,
                Ok(Alive),
                Ok(Some("w1".into())),
                Verdict::AskDirectory,
            ),
            // "Draining" from an owner that lost its lease because it was declared
            // dead: its sessions went with the reclaim.
            (
                OwnerDraining,
                false,
                Ok(LeaseProof::Left(Gone {
                    how: GoneHow::Reclaimed,
                    ago: Duration::from_secs(1),
                })),
                Ok(None),
                Verdict::answer(Situation::OwnerGone),
            ),
            (
                OwnerDraining,
                false,
                Ok(Expired),
                Ok(None),
                Verdict::answer(Situation::OwnerGone),
            ),
            (
                OwnerDraining,
                false,
                Ok(Alive),
                Err("timeout".into()),
                unknown(),
            ),
            (
                BudgetFull,
                false,
                Ok(Alive),
                Ok(None),
                Verdict::answer(Situation::MeshBusy),
            ),
            (MayHaveRun, false, Ok(Alive), Ok(None), Verdict::Probe),
            // Never sent to an owner whose lease proves it dead: gone (and buried).
            (NotSent, false, Ok(Expired), Ok(None), gone(true)),
            (NotSent, false, Ok(Alive), Ok(None), unknown()),
            (NotSent, false, Ok(Unproven), Ok(None), unknown()),
            (NotSent, false, Err("timeout".into()), Ok(None), unknown()),
            (NotSent, false, Ok(Alive), Ok(Some("w0".into())), unknown()),
            (
                NotSent,
                false,
                Ok(Alive),
                Ok(Some("w1".into())),
                Verdict::AskDirectory,
            ),
        ];
        for (sign, pubsub, lease, record, expected) in rows {
            let verdict = after_failure(
                sign,
                "w0",
                pubsub,
                async || lease.clone(),
                async || record.clone(),
            )
            .await;
            assert_eq!(
                verdict, expected,
                "{sign:?} pubsub={pubsub} {lease:?} {record:?}"
            );
        }
        // Signs that decide alone never touch the directory.
        for sign in [PeerGone, NotOwner, BudgetFull, MayHaveRun] {
            after_failure(sign, "w0", false, unasked, unasked).await;
        }
    }

    #[tokio::test]
    async fn liveness_from_a_probe_and_the_lease() {
        use LeaseProof::{Alive, Expired, Unproven};
        let rows: Vec<(ProbeSign, bool, Lookup<LeaseProof>, Liveness)> = vec![
            (ProbeSign::Answered, true, Ok(Expired), Liveness::Alive),
            (
                ProbeSign::Refused("refused".into()),
                true,
                Ok(Alive),
                Liveness::Dead("refused".into()),
            ),
            // Over pub/sub a refusal is not proof; the lease decides.
            (
                ProbeSign::Refused("no subscriber".into()),
                false,
                Ok(Alive),
                Liveness::Unknown,
            ),
            (
                ProbeSign::Refused("no subscriber".into()),
                false,
                Ok(Expired),
                Liveness::Dead("its lease expired".into()),
            ),
            (ProbeSign::Silent, true, Ok(Alive), Liveness::Unknown),
            (
                ProbeSign::Silent,
                true,
                Err("timeout".into()),
                Liveness::Unknown,
            ),
            // A directory just rebuilt proves nothing by a missing lease.
            (ProbeSign::Silent, true, Ok(Unproven), Liveness::Unknown),
            (
                ProbeSign::Silent,
                true,
                Ok(Expired),
                Liveness::Dead("its lease expired".into()),
            ),
        ];
        for (probe, refusal_proves, lease, expected) in rows {
            let found = liveness(probe.clone(), refusal_proves, async || lease.clone()).await;
            assert_eq!(found, expected, "{probe:?} {refusal_proves} {lease:?}");
        }
    }

    fn left(how: GoneHow, ago_ms: u64) -> Gone {
        Gone {
            how,
            ago: Duration::from_millis(ago_ms),
        }
    }

    #[test]
    fn a_request_lost_after_sending() {
        let dead = Liveness::Dead("refused".into());
        // Dead: 502 whatever the directory says, and never re-run...
        assert_eq!(
            after_loss(&dead, None),
            Verdict::Answer {
                situation: Situation::ForwardedThenLost,
                bury: true,
            }
        );
        // ...unless the owner had left before the request went out.
        assert_eq!(after_loss(&dead, Some(GoneHow::Reclaimed)), gone(true));
        assert_eq!(
            after_loss(&dead, Some(GoneHow::Deregistered)),
            Verdict::answer(Situation::NoSuchSession)
        );
        // A live or silent owner: the request may have run all the same, so it is never
        // "retry" (a retry could run it twice), and the session is kept.
        let answer_lost = Verdict::answer(Situation::AnswerLost);
        assert_eq!(
            after_loss(&Liveness::Alive, Some(GoneHow::Reclaimed)),
            answer_lost
        );
        assert_eq!(after_loss(&Liveness::Unknown, None), answer_lost);
    }

    #[test]
    fn a_request_sent_after_another_worker_took_the_owners_address_cannot_have_run() {
        let ms = Duration::from_millis;
        // The replacement registered 500 ms ago; the request went out 100 ms ago.
        assert!(replaced_before_sending(ms(100), Some(ms(500))));
        // Registered after the send (or within the rounding): the owner may have run it.
        assert!(!replaced_before_sending(ms(500), Some(ms(100))));
        assert!(!replaced_before_sending(ms(100), Some(ms(101))));
        // When it registered is unknown: no proof.
        assert!(!replaced_before_sending(ms(100), None));
    }

    #[test]
    fn a_request_sent_after_the_owner_left_cannot_have_run() {
        let ms = Duration::from_millis;
        let reclaimed = |ago| Some(left(GoneHow::Reclaimed, ago));
        assert_eq!(
            left_before_sending(ms(100), reclaimed(500)),
            Some(GoneHow::Reclaimed)
        );
        assert_eq!(
            left_before_sending(ms(500), reclaimed(100)),
            None,
            "left after the send"
        );
        assert_eq!(
            left_before_sending(ms(100), reclaimed(101)),
            None,
            "too close to tell"
        );
        assert_eq!(
            left_before_sending(ms(100), None),
            None,
            "nothing on record"
        );
        assert_eq!(
            left_before_sending(ms(10), Some(left(GoneHow::Deregistered, 900))),
            Some(GoneHow::Deregistered)
        );
    }

    #[test]
    fn an_owner_without_an_address() {
        assert_eq!(without_address(Ok(LeaseProof::Expired)), gone(true));
        assert_eq!(
            without_address(Ok(LeaseProof::Left(left(GoneHow::Reclaimed, 5)))),
            gone(true)
        );
        assert_eq!(
            without_address(Ok(LeaseProof::Left(left(GoneHow::Deregistered, 5)))),
            Verdict::answer(Situation::NoSuchSession),
            "a drained owner ended its sessions"
        );
        // Redis came back empty: the owner may be re-registering.
        assert_eq!(without_address(Ok(LeaseProof::Unproven)), unknown());
        assert_eq!(without_address(Ok(LeaseProof::Alive)), unknown());
        assert_eq!(without_address(Err("timeout".into())), unknown());
    }

    #[test]
    fn a_missing_lease_proves_death_only_in_a_stable_directory() {
        let lease = Duration::from_secs(10);
        let state = |alive, generation: &str, age_s| LeaseState {
            alive,
            generation: generation.into(),
            generation_age: Duration::from_secs(age_s),
            gone: None,
        };
        let rows = [
            (state(true, "g1", 100), LeaseProof::Alive),
            (state(false, "g1", 100), LeaseProof::Expired),
            // Same generation, but younger than one lease: owners may be re-registering.
            (state(false, "g1", 5), LeaseProof::Unproven),
            // Redis came back empty after this worker registered.
            (state(false, "g2", 100), LeaseProof::Unproven),
            (state(false, "", 0), LeaseProof::Unproven),
            // A record of how it left is proof even in a young directory.
            (
                LeaseState {
                    gone: Some(left(GoneHow::Deregistered, 3)),
                    ..state(false, "g1", 5)
                },
                LeaseProof::Left(left(GoneHow::Deregistered, 3)),
            ),
        ];
        for (state, proof) in rows {
            assert_eq!(judge_lease(&state, "g1", lease), proof, "{state:?}");
        }
    }

    #[test]
    fn after_the_hinted_owner_says_not_mine() {
        assert_eq!(
            after_not_owner("w1", "w0", Ok(Some("w2".into()))),
            AfterNotOwner::ForwardTo("w2".into())
        );
        for recorded in ["w1", "w0"] {
            assert_eq!(
                after_not_owner("w1", "w0", Ok(Some(recorded.into()))),
                AfterNotOwner::Answer(Situation::OwnerGone)
            );
        }
        assert_eq!(
            after_not_owner("w1", "w0", Ok(None)),
            AfterNotOwner::Answer(Situation::NoSuchSession)
        );
        assert_eq!(
            after_not_owner("w1", "w0", Err("timeout".into())),
            AfterNotOwner::Answer(Situation::Unknown)
        );
    }

    #[tokio::test]
    async fn the_owner_comes_from_the_hint_else_the_directory() {
        assert_eq!(
            owner_from(Some("w1"), "w0", false, unasked).await,
            Ok("w1".into())
        );
        assert_eq!(
            owner_from(Some("w0"), "w0", false, unasked).await,
            Err(Situation::NoSuchSession)
        );
        // A fenced worker dropped its sessions unended: they are gone.
        assert_eq!(
            owner_from(Some("w0"), "w0", true, unasked).await,
            Err(Situation::OwnerGone)
        );
        assert_eq!(
            owner_from(None, "w0", false, async || Ok(Some("w2".into()))).await,
            Ok("w2".into())
        );
        assert_eq!(
            owner_from(None, "w0", false, async || Ok(None)).await,
            Err(Situation::NoSuchSession)
        );
        assert_eq!(
            owner_from(None, "w0", false, async || Err("timeout".into())).await,
            Err(Situation::Unknown)
        );
    }

    #[test]
    fn mesh_errors_read_as_signs() {
        use mcpgw_wire::ErrorFrame;
        let remote = |kind| MeshError::Remote(ErrorFrame::new(kind, "x"));
        let rows = [
            (
                MeshError::Refused { addr: "a".into() },
                FailureSign::PeerGone,
            ),
            (remote(ErrorKind::NotOwner), FailureSign::NotOwner),
            (remote(ErrorKind::Draining), FailureSign::OwnerDraining),
            (remote(ErrorKind::Busy), FailureSign::BudgetFull),
            (remote(ErrorKind::Internal), FailureSign::MayHaveRun),
            (
                MeshError::LostMidResponse("reset".into()),
                FailureSign::MayHaveRun,
            ),
            (MeshError::DeadlineExceeded, FailureSign::MayHaveRun),
            (
                MeshError::ConnectTimeout { addr: "a".into() },
                FailureSign::NotSent,
            ),
        ];
        for (error, sign) in rows {
            assert_eq!(sign_of(&error), sign, "{error}");
        }
    }
}
