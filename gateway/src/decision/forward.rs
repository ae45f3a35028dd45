//! The caller's forward of a request to its session's owner, as a state machine: the
//! caller feeds it [`Event`]s (directory answers, the mesh's outcome, a probe's result,
//! a head that did not come in time) and carries out the [`Action`] it returns (look
//! something up, send, wait, probe, relay the answer, or refuse with the truth and
//! perhaps bury a proven-dead owner). It keeps no clock: every event comes with the
//! time since the forward began, so the failure proofs are tested below on virtual
//! time, without a socket.
//!
//! The path, in order: the owner comes from the session id's hint, else the
//! directory's record; its address from the registry (no address: its lease decides);
//! the request is sent, and a head that does not come within [`SUSPECT_AFTER`] starts
//! a probe of the owner on a fresh connection while the answer may still come; a
//! failed forward is judged by its sign ([`proofs::after_failure`]); a request lost
//! after sending is followed by probes for about a second, and a dead owner's
//! departure is checked against the send time. An owner that says "not mine" sends
//! the forward to the directory's owner, once.

use std::time::Duration;

use mcpgw_mesh::directory::{Gone, GoneHow, LeaseState, Recorded};

use super::Situation;
use super::proofs::{
    self, AfterNotOwner, Failure, LeaseProof, Liveness, Lookup, Need, ProbeSign, Step, Verdict,
};
use super::shared::judge_record;

/// How long a forwarded request waits for its head before the owner is probed, and
/// between probes while the owner's fate is unknown.
pub const SUSPECT_AFTER: Duration = Duration::from_secs(1);

/// How long probes are repeated after a connection broke under a sent request (about
/// a second for a killed owner's sockets to close), and the time between them. A
/// silent owner's probe takes a whole connect timeout, past that second: it is not
/// repeated, so the client is not kept waiting for probes that cannot tell more.
pub const PROBING_AFTER_LOSS: Duration = Duration::from_secs(1);
pub const PROBE_AFTER_LOSS_SPACING: Duration = Duration::from_millis(300);

/// What the forwarding worker knows about itself and its fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub this_worker: String,
    /// The directory generation this worker registered under.
    pub generation: String,
    /// The fleet's lease time.
    pub lease: Duration,
    /// Whether the mesh transport's refusal proves its peer dead (not over the Redis
    /// baseline).
    pub refusal_proves: bool,
    /// This worker was declared dead and dropped its sessions unended.
    pub fenced: bool,
}

/// Why a forward produced no reply: the situation the client is answered from, the
/// cause in words fit for the client (no internal addresses), and the full detail for
/// the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unanswered {
    pub situation: Situation,
    pub why: String,
    pub detail: String,
}

impl Unanswered {
    pub fn new(situation: Situation, why: impl Into<String>) -> Unanswered {
        Unanswered {
            situation,
            why: why.into(),
            detail: String::new(),
        }
    }
}

/// What the caller does next. Lookups and probes concern [`Forwarding::target`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Read the directory's record of the session: answer [`Event::Record`].
    AskRecord,
    /// Whether the target is known dead here, else its mesh address: [`Event::Address`].
    AskAddress,
    /// The target's lease: [`Event::Lease`].
    AskLease,
    /// How the target left, if that is on record: [`Event::Gone`].
    AskGone,
    /// When this worker, found at the target's address, registered: [`Event::Registered`].
    AskRegistered(String),
    /// Send the request to the target, and report [`Event::HeadTimeout`] if no head
    /// came within `suspect_after`.
    Send { suspect_after: Duration },
    /// Keep waiting for the answer; report [`Event::HeadTimeout`] after
    /// `suspect_after` if set.
    Await { suspect_after: Option<Duration> },
    /// After `after`, probe the target on a fresh connection: [`Event::Probed`].
    Probe { after: Duration },
    /// The owner answered: relay its answer.
    Relay,
    /// Answer the client from `unanswered`. First, where `bury` names the proof of
    /// death (the label it is counted under), forget the target and reclaim its
    /// sessions.
    Refuse {
        unanswered: Unanswered,
        bury: Option<&'static str>,
    },
}

/// The registry's answer for the target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// This worker proved it dead before.
    KnownDead,
    /// Its mesh address is known (the caller keeps it).
    Found,
    /// The directory has no address for it.
    Missing,
    /// The directory did not answer.
    Failed(String),
}

/// What the caller found out or saw happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Record(Lookup<Recorded>),
    Address(Address),
    Lease(Lookup<LeaseState>),
    Gone(Lookup<Option<Gone>>),
    Registered(Lookup<Option<Duration>>),
    /// No head within the time the last `Send` or `Await` gave.
    HeadTimeout,
    /// A probe's result.
    Probed(Probed),
    /// The owner's answer began.
    Answered,
    /// The forward failed ([`Failure::of`] the mesh error).
    Failed(Failure),
}

/// What a probe of the target found. `sent`: whether the forwarded request had been
/// written by then; `replaced_by`: the worker that answered at the target's address
/// instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probed {
    pub sign: ProbeSign,
    pub sent: bool,
    pub replaced_by: Option<String>,
}

/// Where a dead owner's departure, checked against the send time, leads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum AfterLeft {
    /// Proven dead by a probe while the request was in flight.
    InFlight,
    /// Proven dead after the request was lost mid-answer.
    Lost(Failure),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// The owner comes from the directory (no hint).
    Locating,
    /// The target's address was asked for.
    Addressing,
    /// No address: the target's lease was asked for.
    WithoutAddress,
    /// Sent; the answer may come.
    InFlight,
    /// Sent, no head in time: a probe runs while the answer may still come.
    Suspecting {
        probe: Option<Probed>,
    },
    /// The target was proven dead: did it leave before the request went out?
    LeftCheck {
        dead_why: String,
        replaced_by: Option<String>,
        then: AfterLeft,
    },
    /// The forward failed: gathering what its sign needs.
    Failed {
        failure: Failure,
        lease: Option<Lookup<LeaseProof>>,
        record: Option<Lookup<Option<String>>>,
    },
    /// Sent, then lost: probing whether the target lives.
    Lost {
        failure: Failure,
        since: Duration,
        probe: Option<Probed>,
    },
    /// The target said "not mine": the directory's record was asked for.
    NotOwner,
    Done,
}

/// One forward, from locating the owner to the answer or the truthful refusal.
#[derive(Debug, Clone)]
pub struct Forwarding {
    caller: Caller,
    hint: Option<String>,
    target: String,
    /// The target was named by the directory after another worker said "not mine":
    /// a second "not mine" ends the forward.
    retargeted: bool,
    sent_at: Duration,
    phase: Phase,
}

impl Forwarding {
    /// A forward whose owner comes from the session id's `hint`, else the directory.
    pub fn locating(caller: Caller, hint: Option<&str>) -> Forwarding {
        Forwarding {
            caller,
            hint: hint.map(str::to_owned),
            target: String::new(),
            retargeted: false,
            sent_at: Duration::ZERO,
            phase: Phase::Locating,
        }
    }

    /// A forward to `owner`, which the caller already knows (the directory's record, or
    /// the worker that adopted the session).
    pub fn to(caller: Caller, owner: &str) -> Forwarding {
        Forwarding {
            target: owner.to_owned(),
            phase: Phase::Addressing,
            ..Forwarding::locating(caller, None)
        }
    }

    /// The worker the next lookup, send or probe concerns.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Whether the forwarded request's answer may still come: while it may, every
    /// lookup and probe races it, and the answer wins.
    pub fn in_flight(&self) -> bool {
        matches!(self.phase, Phase::InFlight | Phase::Suspecting { .. })
    }

    /// The first action.
    pub fn start(&mut self) -> Action {
        match self.phase {
            Phase::Locating => self.locate(None),
            _ => self.address(),
        }
    }

    /// Takes in what happened `at` (time since the forward began) and says what to do.
    pub fn on(&mut self, at: Duration, event: Event) -> Action {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        match (phase, event) {
            (Phase::Locating, Event::Record(recorded)) => {
                let recorded = self.judge_record(recorded);
                self.locate(Some(&recorded))
            }
            (Phase::Addressing, Event::Address(address)) => self.addressed(at, address),
            (Phase::WithoutAddress, Event::Lease(state)) => {
                let proof = self.judge_lease(state);
                let (why, detail) = proofs::without_address_why(&self.target, &proof);
                self.act(proofs::without_address(proof), why, detail, "lease_expired")
            }
            (Phase::InFlight | Phase::Suspecting { .. }, Event::Answered) => Action::Relay,
            (Phase::InFlight | Phase::Suspecting { .. }, Event::Failed(failure)) => {
                self.failed(at, failure, None, None)
            }
            (Phase::InFlight, Event::HeadTimeout) => {
                self.phase = Phase::Suspecting { probe: None };
                Action::Probe {
                    after: Duration::ZERO,
                }
            }
            (Phase::Suspecting { probe: None }, Event::Probed(probe)) => {
                self.suspected(probe, None)
            }
            (Phase::Suspecting { probe: Some(probe) }, Event::Lease(state)) => {
                let proof = self.judge_lease(state);
                self.suspected(probe, Some(proof))
            }
            (phase @ Phase::LeftCheck { .. }, event) => self.on_left_check(at, phase, event),
            (
                Phase::Failed {
                    failure, record, ..
                },
                Event::Lease(state),
            ) => {
                let proof = self.judge_lease(state);
                self.failed(at, failure, Some(proof), record)
            }
            (Phase::Failed { failure, lease, .. }, Event::Record(recorded)) => {
                let recorded = self.judge_record(recorded);
                self.failed(at, failure, lease, Some(recorded))
            }
            (
                Phase::Lost {
                    failure,
                    since,
                    probe: None,
                },
                Event::Probed(probe),
            ) => self.lost(at, failure, since, probe, None),
            (
                Phase::Lost {
                    failure,
                    since,
                    probe: Some(probe),
                },
                Event::Lease(state),
            ) => {
                let proof = self.judge_lease(state);
                self.lost(at, failure, since, probe, Some(proof))
            }
            (Phase::NotOwner, Event::Record(recorded)) => self.not_owner_located(recorded),
            (phase, event) => out_of_turn(&phase, &event),
        }
    }

    /// A dead owner: did it leave before the request was sent? `Gone` says when its
    /// end was recorded; `Registered`, when the worker now at its address registered.
    fn on_left_check(&mut self, at: Duration, phase: Phase, event: Event) -> Action {
        let since_send = at - self.sent_at;
        match (phase, event) {
            (
                Phase::LeftCheck {
                    dead_why,
                    replaced_by,
                    then,
                },
                Event::Gone(gone),
            ) => {
                let left = gone
                    .ok()
                    .and_then(|gone| proofs::left_before_sending(since_send, gone));
                match (left, replaced_by) {
                    // Nobody recorded its end yet, but another worker answers at its
                    // address: if that one registered before the request went out, the
                    // owner was dead by then (its address taken), so the request cannot
                    // have run there.
                    (None, Some(replacement)) => {
                        self.phase = Phase::LeftCheck {
                            dead_why,
                            replaced_by: None,
                            then,
                        };
                        Action::AskRegistered(replacement)
                    }
                    (left, _) => self.left_checked(dead_why, then, left),
                }
            }
            (
                Phase::LeftCheck {
                    dead_why,
                    replaced_by: None,
                    then,
                },
                Event::Registered(registered),
            ) => {
                let left = registered.ok().and_then(|registered| {
                    proofs::replaced_before_sending(since_send, registered)
                        .then_some(GoneHow::Reclaimed)
                });
                self.left_checked(dead_why, then, left)
            }
            (phase, event) => out_of_turn(&phase, &event),
        }
    }

    /// "Not mine": forward once to the owner the directory records, if it is another.
    fn not_owner_located(&mut self, recorded: Lookup<Recorded>) -> Action {
        let recorded = self.judge_record(recorded);
        match proofs::after_not_owner(&self.target, &self.caller.this_worker, &recorded) {
            AfterNotOwner::ForwardTo(owner) => {
                self.target = owner;
                self.retargeted = true;
                self.address()
            }
            AfterNotOwner::Answer(Situation::Unknown) => refuse(Unanswered::new(
                Situation::Unknown,
                "its recorded owner does not hold it yet (it is being adopted or handed over)",
            )),
            AfterNotOwner::Answer(situation) => {
                refuse(Unanswered::new(situation, "its owner no longer holds it"))
            }
        }
    }

    fn locate(&mut self, recorded: Option<&Lookup<Option<String>>>) -> Action {
        let step = proofs::owner_from(
            self.hint.as_deref(),
            &self.caller.this_worker,
            self.caller.fenced,
            recorded,
        );
        match step {
            Step::Need(_) => {
                self.phase = Phase::Locating;
                Action::AskRecord
            }
            Step::Done(Ok(owner)) => {
                self.target = owner;
                self.address()
            }
            Step::Done(Err(situation)) => refuse(Unanswered::new(
                situation,
                match situation {
                    Situation::Unknown => "the fleet directory did not answer in time",
                    Situation::OwnerGone => {
                        "the worker that held it was declared dead and dropped it"
                    }
                    _ => "no owner recorded",
                },
            )),
        }
    }

    fn address(&mut self) -> Action {
        self.phase = Phase::Addressing;
        Action::AskAddress
    }

    fn addressed(&mut self, at: Duration, address: Address) -> Action {
        match address {
            Address::KnownDead => refuse(Unanswered::new(
                Situation::OwnerGone,
                format!("worker {} was found dead", self.target),
            )),
            Address::Failed(error) => refuse(Unanswered {
                situation: Situation::Unknown,
                why: "the fleet directory did not answer in time".into(),
                detail: error,
            }),
            Address::Missing => {
                self.phase = Phase::WithoutAddress;
                Action::AskLease
            }
            Address::Found => {
                self.phase = Phase::InFlight;
                self.sent_at = at;
                Action::Send {
                    suspect_after: SUSPECT_AFTER,
                }
            }
        }
    }

    /// A probe ran while the request was in flight: a dead owner ends the forward, a
    /// live one is merely slow (no more probes), an unknown one is probed again.
    fn suspected(&mut self, probe: Probed, lease: Option<Lookup<LeaseProof>>) -> Action {
        match proofs::liveness(&probe.sign, self.caller.refusal_proves, lease.as_ref()) {
            Step::Need(_) => {
                self.phase = Phase::Suspecting { probe: Some(probe) };
                Action::AskLease
            }
            Step::Done(Liveness::Dead(why)) if !probe.sent => {
                // Still connecting when the owner was proven dead: the request never
                // left, so it cannot have run.
                self.left_checked(why, AfterLeft::InFlight, Some(GoneHow::Reclaimed))
            }
            Step::Done(Liveness::Dead(why)) => {
                self.phase = Phase::LeftCheck {
                    dead_why: why,
                    replaced_by: probe.replaced_by,
                    then: AfterLeft::InFlight,
                };
                Action::AskGone
            }
            Step::Done(Liveness::Alive) => {
                self.phase = Phase::InFlight;
                Action::Await {
                    suspect_after: None,
                }
            }
            Step::Done(Liveness::Unknown) => {
                self.phase = Phase::InFlight;
                Action::Await {
                    suspect_after: Some(SUSPECT_AFTER),
                }
            }
        }
    }

    fn left_checked(&mut self, dead_why: String, then: AfterLeft, left: Option<GoneHow>) -> Action {
        let verdict = proofs::after_loss(&Liveness::Dead(dead_why.clone()), left);
        match then {
            AfterLeft::InFlight => self.act(verdict, dead_why, String::new(), "probe"),
            AfterLeft::Lost(failure) => {
                let why = format!("{}; {dead_why}", failure.why);
                self.act(verdict, why, failure.detail, "probe")
            }
        }
    }

    fn failed(
        &mut self,
        at: Duration,
        failure: Failure,
        lease: Option<Lookup<LeaseProof>>,
        record: Option<Lookup<Option<String>>>,
    ) -> Action {
        let step = proofs::after_failure(
            failure.sign,
            &self.target,
            self.caller.refusal_proves,
            lease.as_ref(),
            record.as_ref(),
        );
        match step {
            Step::Need(need) => {
                self.phase = Phase::Failed {
                    failure,
                    lease,
                    record,
                };
                match need {
                    Need::Lease => Action::AskLease,
                    Need::Record => Action::AskRecord,
                }
            }
            // Sent, then lost: the outcome is unknown whatever the probes find (502,
            // never re-run); they tell whether the session went with its owner.
            Step::Done(Verdict::Probe) => {
                self.phase = Phase::Lost {
                    failure,
                    since: at,
                    probe: None,
                };
                Action::Probe {
                    after: Duration::ZERO,
                }
            }
            Step::Done(verdict) => {
                let proof = failure.proof;
                self.act(verdict, failure.why, failure.detail, proof)
            }
        }
    }

    /// A probe after the request was lost mid-answer. An owner killed a moment ago may
    /// still be tearing down (its listener not yet closed), so a probe that proves
    /// nothing is repeated until [`PROBING_AFTER_LOSS`] has passed.
    fn lost(
        &mut self,
        at: Duration,
        failure: Failure,
        since: Duration,
        probe: Probed,
        lease: Option<Lookup<LeaseProof>>,
    ) -> Action {
        match proofs::liveness(&probe.sign, self.caller.refusal_proves, lease.as_ref()) {
            Step::Need(_) => {
                self.phase = Phase::Lost {
                    failure,
                    since,
                    probe: Some(probe),
                };
                Action::AskLease
            }
            Step::Done(Liveness::Unknown) if at.saturating_sub(since) < PROBING_AFTER_LOSS => {
                self.phase = Phase::Lost {
                    failure,
                    since,
                    probe: None,
                };
                Action::Probe {
                    after: PROBE_AFTER_LOSS_SPACING,
                }
            }
            Step::Done(Liveness::Dead(why)) => {
                self.phase = Phase::LeftCheck {
                    dead_why: why,
                    replaced_by: probe.replaced_by,
                    then: AfterLeft::Lost(failure),
                };
                Action::AskGone
            }
            Step::Done(liveness) => {
                let verdict = proofs::after_loss(&liveness, None);
                self.act(verdict, failure.why, failure.detail, "probe")
            }
        }
    }

    /// Carries out a verdict: the refusal (burying a proven-dead owner, counted by
    /// `proof`), or the directory's owner after a "not mine".
    fn act(
        &mut self,
        verdict: Verdict,
        why: String,
        detail: String,
        proof: &'static str,
    ) -> Action {
        match verdict {
            Verdict::Answer { situation, bury } => {
                let why = match situation {
                    Situation::NoSuchSession if why.is_empty() => "it ended".into(),
                    _ => why,
                };
                Action::Refuse {
                    unanswered: Unanswered {
                        situation,
                        why,
                        detail,
                    },
                    bury: bury.then_some(proof),
                }
            }
            // The worker the directory named a moment ago said "not mine" too: the
            // session is moving to or from it; the request did not run.
            Verdict::AskDirectory if self.retargeted => refuse(Unanswered::new(
                Situation::Unknown,
                "its recorded owner does not hold it yet (it is being adopted or handed over)",
            )),
            Verdict::AskDirectory => {
                self.phase = Phase::NotOwner;
                Action::AskRecord
            }
            // `failed` turns a probe verdict into probes; reaching here is a bug, and
            // the honest answer for it is "unknown".
            Verdict::Probe => refuse(Unanswered {
                situation: Situation::Unknown,
                why,
                detail,
            }),
        }
    }

    fn judge_lease(&self, state: Lookup<LeaseState>) -> Lookup<LeaseProof> {
        state.map(|state| proofs::judge_lease(&state, &self.caller.generation, self.caller.lease))
    }

    fn judge_record(&self, recorded: Lookup<Recorded>) -> Lookup<Option<String>> {
        judge_record(recorded, &self.caller.generation, self.caller.lease)
    }
}

/// A caller that feeds an event its phase never asked for has a bug; the honest answer
/// for it is "unknown" (nothing was proven).
fn out_of_turn(phase: &Phase, event: &Event) -> Action {
    refuse(Unanswered {
        situation: Situation::Unknown,
        why: "the gateway lost track of this forward".into(),
        detail: format!("forward machine got {event:?} in {phase:?}"),
    })
}

fn refuse(unanswered: Unanswered) -> Action {
    Action::Refuse {
        unanswered,
        bury: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mcpgw_mesh::MeshError;
    use mcpgw_wire::{ErrorFrame, ErrorKind};

    const LEASE: Duration = Duration::from_secs(10);

    fn caller() -> Caller {
        Caller {
            this_worker: "w0".into(),
            generation: "g1".into(),
            lease: LEASE,
            refusal_proves: true,
            fenced: false,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn failed(error: MeshError) -> Event {
        Event::Failed(Failure::of(&error, true))
    }

    fn lost() -> Event {
        failed(MeshError::LostMidResponse("reset".into()))
    }

    fn remote(kind: ErrorKind) -> Event {
        failed(MeshError::Remote(ErrorFrame::new(kind, "x")))
    }

    fn lease(alive: bool, generation: &str, age_s: u64, gone: Option<Gone>) -> Event {
        Event::Lease(Ok(LeaseState {
            alive,
            generation: generation.into(),
            generation_age: Duration::from_secs(age_s),
            gone,
        }))
    }

    fn alive() -> Event {
        lease(true, "g1", 100, None)
    }

    fn probed(sign: ProbeSign, sent: bool, replaced_by: Option<&str>) -> Event {
        Event::Probed(Probed {
            sign,
            sent,
            replaced_by: replaced_by.map(str::to_owned),
        })
    }

    fn refused() -> ProbeSign {
        ProbeSign::Refused("its mesh address refused the connection".into())
    }

    fn left(how: GoneHow, ago: Duration) -> Event {
        Event::Gone(Ok(Some(Gone { how, ago })))
    }

    /// The refusal an action carries: (situation, bury proof).
    fn refusal(action: &Action) -> (Situation, Option<&'static str>) {
        match action {
            Action::Refuse { unanswered, bury } => (unanswered.situation, *bury),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn why(action: &Action) -> &str {
        match action {
            Action::Refuse { unanswered, .. } => &unanswered.why,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// A forward to w1 (hinted), sent at 0.
    fn sent() -> Forwarding {
        let mut machine = Forwarding::locating(caller(), Some("w1"));
        assert_eq!(machine.start(), Action::AskAddress);
        assert_eq!(machine.target(), "w1");
        assert_eq!(
            machine.on(ms(0), Event::Address(Address::Found)),
            Action::Send {
                suspect_after: SUSPECT_AFTER
            }
        );
        assert!(machine.in_flight());
        machine
    }

    #[test]
    fn an_answer_is_relayed() {
        let mut machine = sent();
        assert_eq!(machine.on(ms(3), Event::Answered), Action::Relay);
        assert!(!machine.in_flight());
    }

    #[test]
    fn the_owner_comes_from_the_directory_without_a_hint() {
        let start = || {
            let mut machine = Forwarding::locating(caller(), None);
            assert_eq!(machine.start(), Action::AskRecord);
            machine
        };
        let mut machine = start();
        let owner = Event::Record(Ok(Recorded::Owner("w2".into())));
        assert_eq!(machine.on(ms(1), owner), Action::AskAddress);
        assert_eq!(machine.target(), "w2");
        // Recorded for this worker, which does not hold it: it ended here.
        let mut machine = start();
        let here = Event::Record(Ok(Recorded::Owner("w0".into())));
        assert_eq!(
            refusal(&machine.on(ms(1), here)).0,
            Situation::NoSuchSession
        );
        let mut machine = start();
        let never = Event::Record(Ok(Recorded::Never));
        assert_eq!(
            refusal(&machine.on(ms(1), never)).0,
            Situation::NoSuchSession
        );
        // A missing record in a directory rebuilt less than a lease ago proves nothing.
        let mut machine = start();
        let young = Event::Record(Ok(Recorded::Absent {
            generation: "g1".into(),
            generation_age: Duration::from_secs(3),
            rebuilt: true,
        }));
        assert_eq!(refusal(&machine.on(ms(1), young)).0, Situation::Unknown);
        // The directory unavailable: unknown, never absent.
        let mut machine = start();
        let down = Event::Record(Err("timed out".into()));
        assert_eq!(refusal(&machine.on(ms(1), down)).0, Situation::Unknown);
        // A fenced worker's own session was dropped, not ended.
        let mut machine = Forwarding::locating(
            Caller {
                fenced: true,
                ..caller()
            },
            Some("w0"),
        );
        assert_eq!(refusal(&machine.start()), (Situation::OwnerGone, None));
    }

    #[test]
    fn a_slow_owner_that_answers_its_probe_is_waited_for() {
        let mut machine = sent();
        assert_eq!(
            machine.on(SUSPECT_AFTER, Event::HeadTimeout),
            Action::Probe {
                after: Duration::ZERO
            }
        );
        assert!(machine.in_flight(), "the answer may still come");
        let answered = probed(ProbeSign::Answered, true, None);
        assert_eq!(
            machine.on(ms(1_010), answered),
            Action::Await {
                suspect_after: None
            },
            "alive: no more probes"
        );
        assert_eq!(machine.on(ms(4_000), Event::Answered), Action::Relay);
    }

    #[test]
    fn the_answer_wins_over_a_probe_in_progress() {
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        assert_eq!(machine.on(ms(1_001), Event::Answered), Action::Relay);
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        machine.on(ms(1_002), probed(ProbeSign::Silent, true, None));
        // The lease lookup was under way when the forward failed: the failure decides.
        let action = machine.on(ms(1_003), remote(ErrorKind::Busy));
        assert_eq!(refusal(&action), (Situation::MeshBusy, None));
    }

    #[test]
    fn a_silent_owner_with_a_live_lease_is_probed_again_until_proven() {
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        assert_eq!(
            machine.on(ms(3_000), probed(ProbeSign::Silent, true, None)),
            Action::AskLease
        );
        assert_eq!(
            machine.on(ms(3_001), alive()),
            Action::Await {
                suspect_after: Some(SUSPECT_AFTER)
            }
        );
        assert_eq!(
            machine.on(ms(4_001), Event::HeadTimeout),
            Action::Probe {
                after: Duration::ZERO
            }
        );
        // Then refused: dead while the request was out; nothing on record of it leaving
        // before the send, so the outcome is unknown and the owner is buried.
        assert_eq!(
            machine.on(ms(4_002), probed(refused(), true, None)),
            Action::AskGone
        );
        assert!(!machine.in_flight());
        let action = machine.on(ms(4_003), Event::Gone(Ok(None)));
        assert_eq!(
            refusal(&action),
            (Situation::ForwardedThenLost, Some("probe"))
        );
    }

    #[test]
    fn a_silent_owner_whose_lease_expired_is_dead() {
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        machine.on(ms(3_000), probed(ProbeSign::Silent, true, None));
        assert_eq!(
            machine.on(ms(3_001), lease(false, "g1", 100, None)),
            Action::AskGone
        );
        let action = machine.on(ms(3_002), Event::Gone(Ok(None)));
        assert_eq!(
            refusal(&action),
            (Situation::ForwardedThenLost, Some("probe"))
        );
        assert_eq!(why(&action), "its lease expired");
        // The same in a directory rebuilt a moment ago proves nothing: probe on.
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        machine.on(ms(3_000), probed(ProbeSign::Silent, true, None));
        let young = lease(false, "g1", 3, None);
        assert_eq!(
            machine.on(ms(3_001), young),
            Action::Await {
                suspect_after: Some(SUSPECT_AFTER)
            }
        );
    }

    #[test]
    fn an_owner_refused_before_the_request_left_cannot_have_run_it() {
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        // Still connecting when the probe was refused: never sent, no lookup needed.
        let action = machine.on(ms(1_005), probed(refused(), false, None));
        assert_eq!(refusal(&action), (Situation::OwnerGone, Some("probe")));
    }

    #[test]
    fn a_probe_answered_by_another_worker_is_judged_by_when_it_registered() {
        let replaced = |registered: Duration| {
            let mut machine = sent();
            machine.on(SUSPECT_AFTER, Event::HeadTimeout);
            let wrong = probed(ProbeSign::Refused("another".into()), true, Some("w9"));
            assert_eq!(machine.on(ms(1_200), wrong), Action::AskGone);
            assert_eq!(
                machine.on(ms(1_201), Event::Gone(Ok(None))),
                Action::AskRegistered("w9".into())
            );
            machine.on(ms(1_202), Event::Registered(Ok(Some(registered))))
        };
        // w9 registered 5 s ago, before the send 1.2 s ago: the owner was dead already.
        let before = replaced(Duration::from_secs(5));
        assert_eq!(refusal(&before), (Situation::OwnerGone, Some("probe")));
        // Registered 100 ms ago, after the send: the owner may have run it.
        let after = replaced(ms(100));
        assert_eq!(
            refusal(&after),
            (Situation::ForwardedThenLost, Some("probe"))
        );
        // When it registered is unknown: no proof either way.
        let mut machine = sent();
        machine.on(SUSPECT_AFTER, Event::HeadTimeout);
        machine.on(
            ms(1_200),
            probed(ProbeSign::Refused("x".into()), true, Some("w9")),
        );
        machine.on(ms(1_201), Event::Gone(Ok(None)));
        let unknown = machine.on(ms(1_202), Event::Registered(Err("timeout".into())));
        assert_eq!(refusal(&unknown).0, Situation::ForwardedThenLost);
    }

    #[test]
    fn an_owner_without_an_address_is_judged_by_its_lease() {
        let missing = |lease_event: Event| {
            let mut machine = Forwarding::to(caller(), "w1");
            assert_eq!(machine.start(), Action::AskAddress);
            assert_eq!(
                machine.on(ms(1), Event::Address(Address::Missing)),
                Action::AskLease
            );
            machine.on(ms(2), lease_event)
        };
        // Expired in a settled directory: proof of death.
        let expired = missing(lease(false, "g1", 100, None));
        assert_eq!(
            refusal(&expired),
            (Situation::OwnerGone, Some("lease_expired"))
        );
        assert_eq!(why(&expired), "worker w1's lease expired");
        // The same in a young rebuilt directory, or another generation: unknown.
        for young in [lease(false, "g1", 3, None), lease(false, "g2", 100, None)] {
            assert_eq!(refusal(&missing(young)), (Situation::Unknown, None));
        }
        // The directory unavailable: unknown, with its error for the log.
        let down = missing(Event::Lease(Err("timed out".into())));
        assert_eq!(refusal(&down), (Situation::Unknown, None));
        // Drained on record: it ended its sessions.
        let drained = missing(lease(
            false,
            "g1",
            100,
            Some(Gone {
                how: GoneHow::Deregistered,
                ago: ms(500),
            }),
        ));
        assert_eq!(refusal(&drained), (Situation::NoSuchSession, None));
    }

    #[test]
    fn an_unreadable_registry_or_a_known_dead_owner_ends_at_once() {
        let mut machine = Forwarding::to(caller(), "w1");
        machine.start();
        let down = machine.on(ms(1), Event::Address(Address::Failed("timeout".into())));
        assert_eq!(refusal(&down), (Situation::Unknown, None));
        let mut machine = Forwarding::to(caller(), "w1");
        machine.start();
        let dead = machine.on(ms(1), Event::Address(Address::KnownDead));
        assert_eq!(refusal(&dead), (Situation::OwnerGone, None));
    }

    #[test]
    fn a_refused_forward_proves_death_except_over_pubsub() {
        let refusal_of = |refusal_proves: bool, lease_event: Option<Event>| {
            let mut machine = Forwarding::to(
                Caller {
                    refusal_proves,
                    ..caller()
                },
                "w1",
            );
            machine.start();
            machine.on(ms(0), Event::Address(Address::Found));
            let error = MeshError::Refused { addr: "a".into() };
            let action = machine.on(ms(2), Event::Failed(Failure::of(&error, refusal_proves)));
            match lease_event {
                None => action,
                Some(lease_event) => {
                    assert_eq!(action, Action::AskLease);
                    machine.on(ms(3), lease_event)
                }
            }
        };
        assert_eq!(
            refusal(&refusal_of(true, None)),
            (Situation::OwnerGone, Some("refused"))
        );
        assert_eq!(
            refusal(&refusal_of(false, Some(alive()))),
            (Situation::Unknown, None)
        );
        assert_eq!(
            refusal(&refusal_of(false, Some(lease(false, "g1", 100, None)))),
            (Situation::OwnerGone, Some("lease_expired"))
        );
    }

    #[test]
    fn an_answer_lost_after_sending_is_never_retry() {
        // A silent owner with a live lease, probed until the second has passed: the
        // answer was lost, the session may go on.
        let mut machine = sent();
        assert_eq!(
            machine.on(ms(50), lost()),
            Action::Probe {
                after: Duration::ZERO
            }
        );
        assert!(!machine.in_flight());
        let mut at = 50;
        loop {
            at += 100;
            assert_eq!(
                machine.on(ms(at), probed(ProbeSign::Silent, true, None)),
                Action::AskLease
            );
            at += 1;
            match machine.on(ms(at), alive()) {
                Action::Probe { after } => {
                    assert_eq!(after, PROBE_AFTER_LOSS_SPACING);
                    at += 300;
                }
                action => {
                    assert_eq!(refusal(&action), (Situation::AnswerLost, None));
                    assert!(at >= 1_050, "gave up at {at} ms");
                    break;
                }
            }
        }
        // A live owner: the same answer at once.
        let mut machine = sent();
        machine.on(ms(50), lost());
        let answered = machine.on(ms(60), probed(ProbeSign::Answered, true, None));
        assert_eq!(refusal(&answered), (Situation::AnswerLost, None));
        // A dead one: the outcome is unknown and the session went with it...
        let mut machine = sent();
        machine.on(ms(50), lost());
        assert_eq!(
            machine.on(ms(60), probed(refused(), true, None)),
            Action::AskGone
        );
        let dead = machine.on(ms(61), Event::Gone(Ok(None)));
        assert_eq!(
            refusal(&dead),
            (Situation::ForwardedThenLost, Some("probe"))
        );
        assert_eq!(
            why(&dead),
            "the connection to it broke before the answer was complete; \
             its mesh address refused the connection"
        );
        // ...unless it had left before the request went out (reclaimed 5 s ago).
        let mut machine = sent();
        machine.on(ms(50), lost());
        machine.on(ms(60), probed(refused(), true, None));
        let reclaimed = machine.on(ms(61), left(GoneHow::Reclaimed, Duration::from_secs(5)));
        assert_eq!(refusal(&reclaimed), (Situation::OwnerGone, Some("probe")));
        // Left after it went out: it may have run.
        let mut machine = sent();
        machine.on(ms(50), lost());
        machine.on(ms(60), probed(refused(), true, None));
        let after = machine.on(ms(61), left(GoneHow::Reclaimed, ms(20)));
        assert_eq!(refusal(&after).0, Situation::ForwardedThenLost);
    }

    #[test]
    fn not_mine_sends_the_forward_to_the_recorded_owner_once() {
        let mut machine = sent();
        assert_eq!(
            machine.on(ms(2), remote(ErrorKind::NotOwner)),
            Action::AskRecord
        );
        let record = Event::Record(Ok(Recorded::Owner("w2".into())));
        assert_eq!(machine.on(ms(3), record), Action::AskAddress);
        assert_eq!(machine.target(), "w2");
        machine.on(ms(4), Event::Address(Address::Found));
        // The recorded owner says "not mine" too: the session is moving there
        // (adopted, or handed over); unknown, retryable, never gone.
        let again = machine.on(ms(5), remote(ErrorKind::NotOwner));
        assert_eq!(refusal(&again), (Situation::Unknown, None));
        assert_eq!(
            why(&again),
            "its recorded owner does not hold it yet (it is being adopted or handed over)"
        );
        // The directory still names the worker that said "not mine": unknown too.
        let mut machine = sent();
        machine.on(ms(2), remote(ErrorKind::NotOwner));
        let same = machine.on(ms(3), Event::Record(Ok(Recorded::Owner("w1".into()))));
        assert_eq!(refusal(&same), (Situation::Unknown, None));
        let mut machine = sent();
        machine.on(ms(2), remote(ErrorKind::NotOwner));
        let down = machine.on(ms(3), Event::Record(Err("timeout".into())));
        assert_eq!(refusal(&down), (Situation::Unknown, None));
    }

    #[test]
    fn a_draining_owner_is_judged_by_the_session_record_then_its_lease() {
        // The record gone, the owner alive: the drain ended the session.
        let mut machine = sent();
        assert_eq!(
            machine.on(ms(2), remote(ErrorKind::Draining)),
            Action::AskRecord
        );
        assert_eq!(
            machine.on(ms(3), Event::Record(Ok(Recorded::Never))),
            Action::AskLease
        );
        let ended = machine.on(ms(4), alive());
        assert_eq!(refusal(&ended), (Situation::NoSuchSession, None));
        // Handed over: the directory names the adopter, which gets the request.
        let mut machine = sent();
        machine.on(ms(2), remote(ErrorKind::Draining));
        let handed = machine.on(ms(3), Event::Record(Ok(Recorded::Owner("w3".into()))));
        assert_eq!(handed, Action::AskRecord);
        machine.on(ms(4), Event::Record(Ok(Recorded::Owner("w3".into()))));
        assert_eq!(machine.target(), "w3");
        // Still its own, or the record unreadable: unknown (503).
        let mut machine = sent();
        machine.on(ms(2), remote(ErrorKind::Draining));
        let own = machine.on(ms(3), Event::Record(Ok(Recorded::Owner("w1".into()))));
        assert_eq!(refusal(&own), (Situation::Unknown, None));
    }

    #[test]
    fn a_request_never_sent_is_judged_by_the_owners_lease() {
        let mut machine = sent();
        let timeout = failed(MeshError::ConnectTimeout { addr: "a".into() });
        assert_eq!(machine.on(ms(2_000), timeout), Action::AskRecord);
        let own = Event::Record(Ok(Recorded::Owner("w1".into())));
        assert_eq!(machine.on(ms(2_001), own), Action::AskLease);
        let action = machine.on(ms(2_002), alive());
        assert_eq!(refusal(&action), (Situation::Unknown, None));
    }

    #[test]
    fn an_event_out_of_turn_is_answered_unknown() {
        let mut machine = Forwarding::to(caller(), "w1");
        machine.start();
        let action = machine.on(ms(1), Event::Answered);
        assert_eq!(refusal(&action), (Situation::Unknown, None));
    }
}
