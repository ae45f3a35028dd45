//! The decision core: what a worker knows about a request's session → execute here,
//! forward to the owner, or a truthful refusal (docs/architecture.md, "Decision
//! table"); and, when a forward fails, what the failure proves.
//!
//! The rule behind every row: an owner acts for a session only while its lease is
//! valid by its own clock; others declare it dead only on proof (lease expired in
//! Redis, its mesh address refuses or answers as another worker). A lookup that failed
//! is *unknown*, never *absent*, so no session is ever silently replaced.
//!
//! Nothing here does I/O, waits, or reads a clock: no tokio and no HTTP types. Callers
//! gather the facts (registry, lease clock, directory answers, mesh errors, the time
//! since a forward began) and carry out the actions. A decision that lacks a fact asks
//! for it ([`Decision::Ask`], [`forward::Action`]) instead of awaiting it, so every row
//! and every failure proof is tested below without a socket, on virtual time.
//!
//! - this module: the situation a call is in, for both sides (the edge that received
//!   it, the owner serving a forwarded frame) and both session kinds (a client's own
//!   `Mcp-Session-Id`, the shared session of a 2026-07-28 principal), and its decision;
//! - [`proofs`]: what a directory answer, a mesh error or a probe proves;
//! - [`forward`]: the caller's forward to an owner as a state machine (events in,
//!   actions out), from locating the owner to the answer or the refusal;
//! - [`shared`]: where a shared session stands when this worker does not hold it.

pub mod forward;
pub mod proofs;
pub mod shared;

/// What the receiving worker knows when it must decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Situation {
    /// No `Mcp-Session-Id`, and the message is a legacy `initialize` (or a shared
    /// session that no worker holds, on a worker without a fleet): create it here.
    NewSession,
    /// No session header on a legacy request other than initialize.
    MissingSession,
    /// A 2026-07-28 request: no session; any worker may answer.
    Modern,
    /// A forwarded request that names no session (a liveness probe, or a call the edge
    /// judged session-free): the owner answers it as any worker would.
    Sessionless,
    /// The session is in this worker's registry, and this worker's lease is valid by
    /// its own clock.
    LocalOwned,
    /// The session is here, but this worker's lease is no longer valid by its own
    /// clock (Redis unreachable for too long): it must not act until it renews.
    LocalLeaseInDoubt,
    /// The directory (or the id's owner hint) names another worker whose address is
    /// known.
    RemoteOwner,
    /// Owner side: a forwarded request for a session this worker does not hold. The
    /// caller is told "not mine" and asks the directory.
    NotHeldHere,
    /// Owner side: a shared session this worker does not hold; whether the directory
    /// records this worker as its owner is not known yet.
    OwnRecordUnasked,
    /// A shared session whose record names this worker, which holds nothing for it (a
    /// claim whose answer was lost landed late): open it here, which confirms the
    /// record, instead of answering "not mine" forever.
    StaleOwnRecord,
    /// The owner is provably gone: lease expired in Redis, its address refused or
    /// answered as another worker, or it was reclaimed.
    OwnerGone,
    /// The directory confirms the session does not exist (never did, or ended).
    NoSuchSession,
    /// Ownership cannot be established, and the request did not run: directory
    /// unreachable, the owner's lease is alive but it could not be reached (no
    /// connection within the connect timeout), or the worker the directory records
    /// said "not mine" (the session is moving there: adopted, or handed over).
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
    /// Send it to the owner over the mesh and stream the answer back (for a shared
    /// session: ask the directory where it stands, [`shared::judge_shared`]).
    Forward,
    /// Owner side: answer the caller "not mine" (a mesh error frame, not a client
    /// answer), so it asks the directory.
    NotMine,
    /// Find out `Fact`, then decide again with it.
    Ask(Fact),
    /// Answer with this error.
    Refuse(Refusal),
}

/// A fact a decision needs that the caller has not gathered yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fact {
    /// Whether the directory records this worker as the session's owner
    /// ([`Known::recorded_here`]).
    OwnRecord,
}

/// The truthful errors of the table. Rendered for clients, with status and JSON-RPC
/// body, by [`crate::dispatch::refuse`].
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
    /// 503 + Retry-After: this worker owns the session but cannot prove it right now
    /// (at an owner serving a forwarded frame: "draining", so the caller decides).
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
        Situation::NewSession
        | Situation::Modern
        | Situation::Sessionless
        | Situation::LocalOwned
        | Situation::StaleOwnRecord => Decision::ExecuteHere,
        Situation::RemoteOwner => Decision::Forward,
        Situation::NotHeldHere => Decision::NotMine,
        Situation::OwnRecordUnasked => Decision::Ask(Fact::OwnRecord),
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

/// Which worker decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The worker the client's request reached.
    Edge,
    /// The worker serving a frame forwarded to it over the mesh.
    Owner,
}

/// Whose session a call runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionKind {
    /// The client's own: a legacy client's `Mcp-Session-Id` (or none yet).
    Own,
    /// The session a 2026-07-28 principal shares on a stateful route (bound by
    /// [`crate::execute::shared`]). Its client has no id of its own, so its absence
    /// tells it nothing; the directory remembers its end instead.
    Shared,
}

/// What the deciding worker knows about a call, gathered by [`crate::dispatch`] (edge)
/// or [`crate::forward::owner`] (owner) from the request, the session registry, the
/// lease clock and, when asked for, the directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    pub side: Side,
    pub session: SessionKind,
    /// The request speaks 2026-07-28 (no sessions of its own).
    pub modern: bool,
    /// It carries a session id (a client's, or a bound shared session's).
    pub has_session_id: bool,
    /// It is a legacy `initialize`.
    pub is_initialize: bool,
    /// The session it names is in this worker's registry.
    pub held_here: bool,
    /// This worker's lease is valid by its own clock (always true when standalone).
    pub lease_valid: bool,
    /// This worker belongs to a fleet (another worker may hold the session).
    pub in_fleet: bool,
    /// This worker was declared dead by the fleet and dropped its sessions unended.
    pub fenced: bool,
    /// Sessions here can outlive their worker (adoption is on).
    pub adopts: bool,
    /// Whether the directory records this worker as the session's owner; `None`
    /// until asked for ([`Fact::OwnRecord`]).
    pub recorded_here: Option<bool>,
}

impl Known {
    /// What a worker knows before it looks anything up: nothing held, lease valid, not
    /// in a fleet; the caller sets what it found.
    pub fn of(side: Side, session: SessionKind) -> Known {
        Known {
            side,
            session,
            modern: false,
            has_session_id: false,
            is_initialize: false,
            held_here: false,
            lease_valid: true,
            in_fleet: false,
            fenced: false,
            adopts: false,
            recorded_here: None,
        }
    }
}

/// The situation a call is in, from what the deciding worker knows.
pub fn situation(known: &Known) -> Situation {
    match known.side {
        Side::Edge => at_edge(known),
        Side::Owner => at_owner(known),
    }
}

fn at_edge(known: &Known) -> Situation {
    match known {
        // A shared session is bound for every call of its principal; it is judged by
        // where it is held, never by the era.
        Known {
            session: SessionKind::Shared,
            ..
        } => match known {
            Known {
                held_here: true,
                lease_valid: true,
                ..
            } => Situation::LocalOwned,
            Known {
                held_here: true, ..
            } => Situation::LocalLeaseInDoubt,
            // Not here: the directory says where it stands.
            Known { in_fleet: true, .. } => Situation::RemoteOwner,
            Known { .. } => Situation::NewSession,
        },
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

fn at_owner(known: &Known) -> Situation {
    match known {
        Known {
            has_session_id: false,
            ..
        } => Situation::Sessionless,
        Known {
            held_here: true,
            lease_valid: true,
            ..
        } => Situation::LocalOwned,
        Known {
            held_here: true, ..
        } => Situation::LocalLeaseInDoubt,
        // Declared dead, it dropped its sessions unended. Without adoption the session
        // is gone, which only this worker can say for sure (its record went with the
        // reclaim, so "not mine" would read as "ended"). One that can continue
        // elsewhere was left for adoption (or adopted already): "not mine" sends the
        // caller to the directory, which knows.
        Known {
            fenced: true,
            adopts: false,
            ..
        } => Situation::OwnerGone,
        Known {
            session: SessionKind::Shared,
            recorded_here: None,
            ..
        } => Situation::OwnRecordUnasked,
        Known {
            session: SessionKind::Shared,
            recorded_here: Some(true),
            ..
        } => Situation::StaleOwnRecord,
        Known { .. } => Situation::NotHeldHere,
    }
}

/// What the edge knows about itself when a forward came back unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Adoption is on in this fleet.
    pub adopts: bool,
    /// The call names a session (a client's own, or a shared one).
    pub has_session_id: bool,
    /// This worker is draining: it takes on no session.
    pub draining: bool,
    /// This worker was declared dead: it takes on no session, and the sessions it
    /// held may go on elsewhere.
    pub fenced: bool,
}

/// What the edge does with a forward that came back unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterForward {
    /// The owner left the session: adopt it here if its record lets it continue.
    Adopt,
    /// Answer from this situation; `why` replaces the forward's cause when set.
    Refuse(Situation, Option<&'static str>),
}

/// Whether a session whose forward found its owner gone may be taken on here
/// (docs/architecture.md, "Adoption"): only where the owner left it (proven dead, or
/// drained and no longer holding it), never on "unknown", and never by a worker that
/// is leaving itself.
pub fn may_adopt(situation: Situation, me: &Standing) -> bool {
    me.adopts
        && me.has_session_id
        && matches!(situation, Situation::OwnerGone | Situation::NoSuchSession)
        && !me.draining
        && !me.fenced
}

/// The edge's next step after an unanswered forward in `situation`.
pub fn after_forward(situation: Situation, me: &Standing) -> AfterForward {
    if may_adopt(situation, me) {
        return AfterForward::Adopt;
    }
    // A worker declared dead cannot adopt, and the session (its own, or another fenced
    // worker's) may go on elsewhere, left for adoption: neither "gone" nor "not found",
    // but not here. The request did not run.
    if me.fenced
        && me.adopts
        && matches!(situation, Situation::OwnerGone | Situation::NoSuchSession)
    {
        return AfterForward::Refuse(
            Situation::Unknown,
            Some("this worker was just replaced; the session may go on on another"),
        );
    }
    AfterForward::Refuse(situation, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row per line of the decision table in docs/architecture.md.
    #[test]
    fn every_row_of_the_table() {
        let rows: &[(Situation, Decision)] = &[
            (Situation::LocalOwned, Decision::ExecuteHere),
            (Situation::RemoteOwner, Decision::Forward),
            (Situation::OwnerGone, Decision::Refuse(Refusal::SessionGone)),
            (
                Situation::NoSuchSession,
                Decision::Refuse(Refusal::NoSuchSession),
            ),
            (
                Situation::Unknown,
                Decision::Refuse(Refusal::OwnershipUnknown),
            ),
            (Situation::AnswerLost, Decision::Refuse(Refusal::AnswerLost)),
            (
                Situation::LocalLeaseInDoubt,
                Decision::Refuse(Refusal::LeaseInDoubt),
            ),
            (
                Situation::ForwardedThenLost,
                Decision::Refuse(Refusal::OutcomeUnknown),
            ),
            (Situation::NewSession, Decision::ExecuteHere),
            (
                Situation::MissingSession,
                Decision::Refuse(Refusal::MissingSession),
            ),
            (Situation::Modern, Decision::ExecuteHere),
            (Situation::Sessionless, Decision::ExecuteHere),
            (Situation::MeshBusy, Decision::Refuse(Refusal::MeshBusy)),
            (Situation::NotHeldHere, Decision::NotMine),
            (Situation::OwnRecordUnasked, Decision::Ask(Fact::OwnRecord)),
            (Situation::StaleOwnRecord, Decision::ExecuteHere),
        ];
        for (situation, expected) in rows {
            assert_eq!(&decide(situation), expected, "{situation:?}");
        }
    }

    fn edge() -> Known {
        Known {
            has_session_id: true,
            in_fleet: true,
            ..Known::of(Side::Edge, SessionKind::Own)
        }
    }

    /// One row per combination that matters at the edge, for a client's own session.
    #[test]
    fn an_own_session_at_the_edge() {
        let rows: &[(Known, Situation)] = &[
            (
                Known {
                    modern: true,
                    held_here: true,
                    ..edge()
                },
                Situation::Modern,
            ),
            (
                Known {
                    has_session_id: false,
                    is_initialize: true,
                    ..edge()
                },
                Situation::NewSession,
            ),
            (
                Known {
                    has_session_id: false,
                    ..edge()
                },
                Situation::MissingSession,
            ),
            (
                Known {
                    held_here: true,
                    ..edge()
                },
                Situation::LocalOwned,
            ),
            (
                Known {
                    held_here: true,
                    lease_valid: false,
                    ..edge()
                },
                Situation::LocalLeaseInDoubt,
            ),
            (edge(), Situation::RemoteOwner),
            // Fenced or not, the edge finds the owner; what a fenced worker may say
            // after the forward is `after_forward`'s.
            (
                Known {
                    fenced: true,
                    ..edge()
                },
                Situation::RemoteOwner,
            ),
            (
                Known {
                    in_fleet: false,
                    ..edge()
                },
                Situation::NoSuchSession,
            ),
            // An initialize that carries a session id is judged by its session.
            (
                Known {
                    is_initialize: true,
                    held_here: true,
                    ..edge()
                },
                Situation::LocalOwned,
            ),
        ];
        for (known, expected) in rows {
            assert_eq!(&situation(known), expected, "{known:?}");
        }
    }

    /// A shared session is judged by where it is held, whatever the era.
    #[test]
    fn a_shared_session_at_the_edge() {
        let shared = Known {
            session: SessionKind::Shared,
            modern: true,
            ..edge()
        };
        let rows: &[(Known, Situation)] = &[
            (
                Known {
                    held_here: true,
                    ..shared
                },
                Situation::LocalOwned,
            ),
            (
                Known {
                    held_here: true,
                    lease_valid: false,
                    ..shared
                },
                Situation::LocalLeaseInDoubt,
            ),
            (shared, Situation::RemoteOwner),
            (
                Known {
                    in_fleet: false,
                    ..shared
                },
                Situation::NewSession,
            ),
        ];
        for (known, expected) in rows {
            assert_eq!(&situation(known), expected, "{known:?}");
        }
    }

    /// The owner serving a forwarded frame, both session kinds.
    #[test]
    fn at_the_owner() {
        let owner = Known {
            side: Side::Owner,
            ..edge()
        };
        let shared = Known {
            session: SessionKind::Shared,
            modern: true,
            ..owner
        };
        let rows: &[(Known, Situation)] = &[
            (
                Known {
                    has_session_id: false,
                    ..owner
                },
                Situation::Sessionless,
            ),
            (
                Known {
                    held_here: true,
                    ..owner
                },
                Situation::LocalOwned,
            ),
            (
                Known {
                    held_here: true,
                    lease_valid: false,
                    ..owner
                },
                Situation::LocalLeaseInDoubt,
            ),
            (owner, Situation::NotHeldHere),
            // Fenced without adoption: only this worker can say it is gone.
            (
                Known {
                    fenced: true,
                    ..owner
                },
                Situation::OwnerGone,
            ),
            // Fenced with adoption: the directory knows where it went.
            (
                Known {
                    fenced: true,
                    adopts: true,
                    ..owner
                },
                Situation::NotHeldHere,
            ),
            // A fenced owner that still holds it (not dropped yet) is judged by its lease.
            (
                Known {
                    fenced: true,
                    held_here: true,
                    lease_valid: false,
                    ..owner
                },
                Situation::LocalLeaseInDoubt,
            ),
            (shared, Situation::OwnRecordUnasked),
            (
                Known {
                    recorded_here: Some(true),
                    ..shared
                },
                Situation::StaleOwnRecord,
            ),
            (
                Known {
                    recorded_here: Some(false),
                    ..shared
                },
                Situation::NotHeldHere,
            ),
            (
                Known {
                    held_here: true,
                    ..shared
                },
                Situation::LocalOwned,
            ),
        ];
        for (known, expected) in rows {
            assert_eq!(&situation(known), expected, "{known:?}");
        }
    }

    #[test]
    fn after_an_unanswered_forward() {
        let me = Standing {
            adopts: true,
            has_session_id: true,
            draining: false,
            fenced: false,
        };
        for left in [Situation::OwnerGone, Situation::NoSuchSession] {
            assert_eq!(after_forward(left, &me), AfterForward::Adopt);
            assert_eq!(
                after_forward(
                    left,
                    &Standing {
                        adopts: false,
                        ..me
                    }
                ),
                AfterForward::Refuse(left, None)
            );
            assert_eq!(
                after_forward(
                    left,
                    &Standing {
                        draining: true,
                        ..me
                    }
                ),
                AfterForward::Refuse(left, None),
                "a draining worker takes on nothing"
            );
            assert!(matches!(
                after_forward(left, &Standing { fenced: true, ..me }),
                AfterForward::Refuse(Situation::Unknown, Some(_))
            ));
        }
        for unproven in [
            Situation::Unknown,
            Situation::AnswerLost,
            Situation::ForwardedThenLost,
            Situation::MeshBusy,
        ] {
            assert_eq!(
                after_forward(unproven, &me),
                AfterForward::Refuse(unproven, None),
                "never adopted on {unproven:?}"
            );
        }
    }
}
