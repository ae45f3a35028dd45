//! What a directory answer, a mesh error or a liveness probe proves about a session's
//! owner. Each judgement is a plain function of the facts it is given; one that needs
//! a fact it was not given answers [`Step::Need`] instead of looking it up, and is
//! called again once the fact is in ([`super::forward`] drives them).

use std::time::Duration;

use mcpgw_mesh::MeshError;
use mcpgw_mesh::directory::{Gone, GoneHow, LeaseState};
use mcpgw_wire::ErrorKind;

use super::Situation;

/// A directory answer, or why the directory could not give one (then the answer is
/// *unknown*, never *absent*).
pub type Lookup<T> = Result<T, String>;

/// A judgement's result, or the fact it still needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<T> {
    Done(T),
    Need(Need),
}

/// A directory fact a judgement needs about the owner it judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The owner's lease ([`judge_lease`]).
    Lease,
    /// The directory's owner of the session ([`super::shared::judge_record`]).
    Record,
}

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

/// A failed forward as the decision core reads it: its sign, its cause in words fit
/// for a client (never an address), the full error for the log line, and the proof
/// label a death it proves is counted under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub sign: FailureSign,
    pub why: String,
    pub detail: String,
    pub proof: &'static str,
}

impl Failure {
    /// `refusal_proves`: whether the transport's refusal proves death (not over the
    /// Redis baseline, where "no subscriber" is also a subscriber reconnecting).
    pub fn of(error: &MeshError, refusal_proves: bool) -> Failure {
        let proof = match error {
            MeshError::WrongWorker { .. } => "wrong_worker",
            MeshError::Refused { .. } if refusal_proves => "refused",
            _ => "lease_expired",
        };
        Failure {
            sign: sign_of(error),
            why: describe(error),
            detail: error.to_string(),
            proof,
        }
    }
}

/// What a mesh error means, in words fit for a client: never an address.
pub fn describe(error: &MeshError) -> String {
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
    pub(crate) fn answer(situation: Situation) -> Verdict {
        Verdict::Answer {
            situation,
            bury: false,
        }
    }
}

/// First verdict on a failed forward to `owner`, from its `sign`, the owner's `lease`
/// and the directory's `record` of the session where the sign needs them (`None`: not
/// looked up yet). `refusal_proves`: over the Redis baseline, "no subscriber" is also
/// what a subscriber in the middle of reconnecting looks like, so a refusal proves
/// death there only together with an expired lease. `record` is `Ok(None)` only where
/// the directory proves the absence ([`super::shared::judge_record`]).
pub fn after_failure(
    sign: FailureSign,
    owner: &str,
    refusal_proves: bool,
    lease: Option<&Lookup<LeaseProof>>,
    record: Option<&Lookup<Option<String>>>,
) -> Step<Verdict> {
    let done = Step::Done;
    match sign {
        FailureSign::PeerGone if refusal_proves => done(Verdict::Answer {
            situation: Situation::OwnerGone,
            bury: true,
        }),
        FailureSign::PeerGone => match lease {
            None => Step::Need(Need::Lease),
            Some(Ok(proof)) if proof.proves_gone() => done(Verdict::Answer {
                situation: Situation::OwnerGone,
                bury: true,
            }),
            Some(_) => done(Verdict::answer(Situation::Unknown)),
        },
        FailureSign::NotOwner => done(Verdict::AskDirectory),
        // "Draining" is also what an owner answers while it cannot confirm its lease
        // (Redis failing over, or it was declared dead and does not know yet).
        FailureSign::OwnerDraining => match (record, lease) {
            (None, _) => Step::Need(Need::Record),
            // No record (and the directory proves the absence): a draining owner ended
            // the session, unless the owner was declared dead, in which case its
            // sessions went with the reclaim.
            (Some(Ok(None)), None) => Step::Need(Need::Lease),
            (Some(Ok(None)), Some(lease)) => done(match lease {
                Ok(
                    LeaseProof::Expired
                    | LeaseProof::Left(Gone {
                        how: GoneHow::Reclaimed,
                        ..
                    }),
                ) => Verdict::answer(Situation::OwnerGone),
                _ => Verdict::answer(Situation::NoSuchSession),
            }),
            // It left the session for another worker (handed over and adopted, or
            // reclaimed and adopted): the directory says where it is now.
            (Some(Ok(Some(recorded))), _) if recorded != owner => done(Verdict::AskDirectory),
            (Some(_), _) => done(Verdict::answer(Situation::Unknown)),
        },
        FailureSign::BudgetFull => done(Verdict::answer(Situation::MeshBusy)),
        // Never sent: ask where if the session has moved on (its owner, draining or
        // replaced, left it and another worker adopted it); else the owner's lease
        // decides, as when it has no address (an owner whose container is gone may
        // not even resolve): dead is proven only by the lease, unknown otherwise.
        FailureSign::NotSent => match (record, lease) {
            (None, _) => Step::Need(Need::Record),
            (Some(Ok(Some(recorded))), _) if recorded != owner => done(Verdict::AskDirectory),
            (Some(_), None) => Step::Need(Need::Lease),
            (Some(_), Some(lease)) => done(without_address(lease.clone())),
        },
        FailureSign::MayHaveRun => done(Verdict::Probe),
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

/// Liveness from a probe and, when the probe proved nothing, the owner's `lease`
/// (`None`: not looked up yet).
pub fn liveness(
    probe: &ProbeSign,
    refusal_proves: bool,
    lease: Option<&Lookup<LeaseProof>>,
) -> Step<Liveness> {
    match (probe, lease) {
        (ProbeSign::Answered, _) => Step::Done(Liveness::Alive),
        (ProbeSign::Refused(why), _) if refusal_proves => Step::Done(Liveness::Dead(why.clone())),
        (ProbeSign::Refused(_) | ProbeSign::Silent, None) => Step::Need(Need::Lease),
        (ProbeSign::Refused(_) | ProbeSign::Silent, Some(lease)) => Step::Done(match lease {
            Ok(LeaseProof::Expired) => Liveness::Dead("its lease expired".into()),
            Ok(LeaseProof::Left(gone)) => Liveness::Dead(left_why(gone.how).into()),
            Ok(LeaseProof::Alive | LeaseProof::Unproven) | Err(_) => Liveness::Unknown,
        }),
    }
}

/// Why a worker that left on record is gone, in words for the client.
pub(crate) fn left_why(how: GoneHow) -> &'static str {
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

/// Why an owner without an address is where it is, in words for the client (and the
/// directory's error for the log).
pub fn without_address_why(owner: &str, lease: &Lookup<LeaseProof>) -> (String, String) {
    match lease {
        Ok(LeaseProof::Expired) => (format!("worker {owner}'s lease expired"), String::new()),
        Ok(LeaseProof::Left(gone)) => (
            match gone.how {
                GoneHow::Reclaimed => {
                    format!("worker {owner} was proven dead and its sessions reclaimed")
                }
                GoneHow::Deregistered => format!("worker {owner} drained and ended its sessions"),
            },
            String::new(),
        ),
        Ok(LeaseProof::Alive) => ("its mesh address is being renewed".into(), String::new()),
        Ok(LeaseProof::Unproven) => (
            "the directory was lost and is being rebuilt".into(),
            String::new(),
        ),
        Err(e) => (
            "the fleet directory did not answer in time".into(),
            e.clone(),
        ),
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
///
/// "Not mine" from the worker the directory still records as the owner proves no
/// absence: the session is between its record and its registry there (being adopted
/// by it, or handed over by its drain), so whether it goes on is unknown, and the
/// request did not run: retryable, never "gone".
pub fn after_not_owner(
    hinted: &str,
    this_worker: &str,
    recorded: &Lookup<Option<String>>,
) -> AfterNotOwner {
    match recorded {
        Ok(Some(owner)) if owner != hinted && owner != this_worker => {
            AfterNotOwner::ForwardTo(owner.clone())
        }
        Ok(Some(owner)) if owner == hinted => AfterNotOwner::Answer(Situation::Unknown),
        Ok(Some(_)) => AfterNotOwner::Answer(Situation::OwnerGone),
        Ok(None) => AfterNotOwner::Answer(Situation::NoSuchSession),
        Err(_) => AfterNotOwner::Answer(Situation::Unknown),
    }
}

/// Where a session's owner comes from: the hint in its id, else the directory's
/// `recorded` owner (`None`: not looked up yet). `fenced`: this worker was declared
/// dead, and dropped its sessions unended.
pub fn owner_from(
    hint: Option<&str>,
    this_worker: &str,
    fenced: bool,
    recorded: Option<&Lookup<Option<String>>>,
) -> Step<Result<String, Situation>> {
    let owner = match (hint, recorded) {
        (Some(owner), _) => owner.to_owned(),
        (None, None) => return Step::Need(Need::Record),
        (None, Some(Ok(Some(owner)))) => owner.clone(),
        (None, Some(Ok(None))) => return Step::Done(Err(Situation::NoSuchSession)),
        (None, Some(Err(_))) => return Step::Done(Err(Situation::Unknown)),
    };
    if owner == this_worker {
        // Minted here, not held here: it ended, unless this worker was fenced (then it
        // dropped the session when the fleet declared it dead: gone, not ended).
        return Step::Done(Err(if fenced {
            Situation::OwnerGone
        } else {
            Situation::NoSuchSession
        }));
    }
    Step::Done(Ok(owner))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gone(bury: bool) -> Verdict {
        Verdict::Answer {
            situation: Situation::OwnerGone,
            bury,
        }
    }

    fn unknown() -> Verdict {
        Verdict::answer(Situation::Unknown)
    }

    /// Runs a judgement to its end, answering each fact it asks for from `lease` and
    /// `record`; returns its result and the facts it asked for, in order.
    fn settle<T>(
        lease: &Lookup<LeaseProof>,
        record: &Lookup<Option<String>>,
        mut judge: impl FnMut(Option<&Lookup<LeaseProof>>, Option<&Lookup<Option<String>>>) -> Step<T>,
    ) -> (T, Vec<Need>) {
        let mut asked = Vec::new();
        loop {
            let has = |need| asked.contains(&need);
            let step = judge(
                has(Need::Lease).then_some(lease),
                has(Need::Record).then_some(record),
            );
            match step {
                Step::Done(result) => return (result, asked),
                Step::Need(need) => {
                    assert!(!asked.contains(&need), "asked for {need:?} twice");
                    asked.push(need);
                }
            }
        }
    }

    #[test]
    fn what_a_failed_forward_proves() {
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
            let (verdict, _) = settle(&lease, &record, |lease, record| {
                after_failure(sign, "w0", !pubsub, lease, record)
            });
            assert_eq!(
                verdict, expected,
                "{sign:?} pubsub={pubsub} {lease:?} {record:?}"
            );
        }
        // Signs that decide alone never touch the directory.
        for sign in [PeerGone, NotOwner, BudgetFull, MayHaveRun] {
            let step = after_failure(sign, "w0", true, None, None);
            assert!(matches!(step, Step::Done(_)), "{sign:?} asked {step:?}");
        }
        // A draining owner's record is read first; its lease only when the record is
        // gone.
        let (_, asked) = settle(&Ok(Alive), &Ok(Some("w0".into())), |lease, record| {
            after_failure(OwnerDraining, "w0", true, lease, record)
        });
        assert_eq!(asked, [Need::Record]);
    }

    #[test]
    fn liveness_from_a_probe_and_the_lease() {
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
            let (found, _) = settle(&lease, &Ok(None), |lease, _| {
                liveness(&probe, refusal_proves, lease)
            });
            assert_eq!(found, expected, "{probe:?} {refusal_proves} {lease:?}");
        }
        // An answer, or a refusal where refusals prove, needs no lease.
        for (probe, proves) in [
            (ProbeSign::Answered, false),
            (ProbeSign::Refused("refused".into()), true),
        ] {
            assert!(matches!(liveness(&probe, proves, None), Step::Done(_)));
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
            after_not_owner("w1", "w0", &Ok(Some("w2".into()))),
            AfterNotOwner::ForwardTo("w2".into())
        );
        // The recorded owner itself said "not mine": the session is moving there.
        assert_eq!(
            after_not_owner("w1", "w0", &Ok(Some("w1".into()))),
            AfterNotOwner::Answer(Situation::Unknown)
        );
        // Recorded for the asking worker, which holds nothing for it: gone.
        assert_eq!(
            after_not_owner("w1", "w0", &Ok(Some("w0".into()))),
            AfterNotOwner::Answer(Situation::OwnerGone)
        );
        assert_eq!(
            after_not_owner("w1", "w0", &Ok(None)),
            AfterNotOwner::Answer(Situation::NoSuchSession)
        );
        assert_eq!(
            after_not_owner("w1", "w0", &Err("timeout".into())),
            AfterNotOwner::Answer(Situation::Unknown)
        );
    }

    #[test]
    fn the_owner_comes_from_the_hint_else_the_directory() {
        let done = |owner: Result<&str, Situation>| Step::Done(owner.map(str::to_owned));
        assert_eq!(owner_from(Some("w1"), "w0", false, None), done(Ok("w1")));
        assert_eq!(
            owner_from(Some("w0"), "w0", false, None),
            done(Err(Situation::NoSuchSession))
        );
        // A fenced worker dropped its sessions unended: they are gone.
        assert_eq!(
            owner_from(Some("w0"), "w0", true, None),
            done(Err(Situation::OwnerGone))
        );
        assert_eq!(
            owner_from(None, "w0", false, None),
            Step::Need(Need::Record)
        );
        assert_eq!(
            owner_from(None, "w0", false, Some(&Ok(Some("w2".into())))),
            done(Ok("w2"))
        );
        assert_eq!(
            owner_from(None, "w0", false, Some(&Ok(None))),
            done(Err(Situation::NoSuchSession))
        );
        assert_eq!(
            owner_from(None, "w0", false, Some(&Err("timeout".into()))),
            done(Err(Situation::Unknown))
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
