//! Where a checked call runs, read top to bottom: gather what this worker knows,
//! look the situation up in the decision core ([`crate::decision`]), then execute here
//! ([`crate::execute`]), forward to the owner ([`crate::forward::caller`]), or answer
//! with the truthful refusal. A refusal that only says "unknown" may be replaced by a
//! stateless answer when the operator opted in.

pub mod refuse;
mod shared;

use std::sync::Arc;

use http::HeaderValue;
use mcpgw_mesh::directory::{AdoptCause, Adoption, DirectoryError};
use tracing::{debug, info, warn};

use crate::adoption::SessionRecord;
use crate::decision::forward::Unanswered;
use crate::decision::{
    self, AfterForward, Decision, Known, SessionKind, Side, Situation, Standing, decide,
};
use crate::execute::Executor;
use crate::execute::stateless::STATELESS_METHODS;
use crate::fleet::Fleet;
use crate::link::UpstreamLink;
use crate::mcp::{Era, GatewayError};
use crate::reply::{HEADER_ADOPTED, Reply};
use crate::request::Call;
use crate::session::{Session, SessionUse, Transit};
use crate::worker::Worker;

/// How often, and how long apart, an adoption asks again while the session is still
/// recorded for an owner proven dead (its reclaim is running).
const RECLAIM_WAITS: usize = 20;
const RECLAIM_WAIT: std::time::Duration = std::time::Duration::from_millis(25);

/// What [`Router::try_adopt`] did with a call whose session's owner left it.
pub(crate) enum AdoptionOutcome {
    /// The session was adopted here (or could not continue): the call's answer.
    Ran(Result<Reply, GatewayError>),
    /// Another worker adopted it: forward there.
    OwnedBy(String, Call),
    /// Nothing to adopt: answer as without adoption.
    NotAdoptable(Call),
}

/// The routing stage: decides where a checked call runs (here, at its owner over the
/// mesh, or nowhere, with the truthful refusal) and hands it on. It keeps nothing of
/// its own: it reads the worker's sessions, lease and fleet, and borrows the worker
/// for one call.
#[derive(Clone, Copy)]
pub struct Router<'w> {
    worker: &'w Arc<Worker>,
}

impl<'w> Router<'w> {
    pub fn of(worker: &'w Arc<Worker>) -> Self {
        Router { worker }
    }

    /// The stage that runs a call here.
    fn executor(&self) -> Executor<'w> {
        Executor::of(self.worker)
    }

    /// Decides where `call` runs and runs it.
    pub async fn dispatch(&self, call: Call) -> Result<Reply, GatewayError> {
        // A 2026-07-28 call to an upstream that keeps state in sessions runs in the
        // session its principal shares there (execute/shared.rs).
        let call = self.bind_shared_session(call);
        // The paths off the common one are boxed: an async fn's future is as large as
        // its largest path, and every request's future is moved (copied) several times
        // on its way to being polled. Inlined, these rare paths doubled its size.
        if call.is_shared_bound() {
            return Box::pin(self.dispatch_shared(call)).await;
        }
        // Kept only when a stateless answer could stand in for an "unknown" one.
        let fallback = self.stateless_candidate(&call).then(|| call.clone());
        match (self.decide_and_run(call).await, fallback) {
            (Err(error), Some(call)) if refuse::owner_unconfirmed(&error) => {
                Box::pin(self.executor().answer_statelessly(call, error)).await
            }
            (result, _) => result,
        }
    }

    async fn decide_and_run(&self, call: Call) -> Result<Reply, GatewayError> {
        let local = self.executor().hold_session(&call).await;
        let situation = decision::situation(&Known {
            modern: call.era == Era::Modern,
            has_session_id: call.session_id.is_some(),
            is_initialize: call.is_initialize(),
            held_here: local.is_some(),
            ..self.worker.knows(Side::Edge, SessionKind::Own)
        });
        match (decide(&situation), self.worker.fleet()) {
            (Decision::ExecuteHere, _) => self.executor().execute_held(call, local).await,
            (Decision::Forward, Some(fleet)) => match self.forward_counted(&call, None).await {
                Ok(reply) => Ok(reply),
                Err(unanswered) => match decision::after_forward(
                    unanswered.situation,
                    &self.standing(fleet, &call),
                ) {
                    AfterForward::Adopt => {
                        Box::pin(self.adopt_or_refuse(fleet, call, unanswered)).await
                    }
                    AfterForward::Refuse(situation, Some(why)) => {
                        Err(self.refuse(&situation, why, call.id()))
                    }
                    AfterForward::Refuse(_, None) => {
                        Err(self.refuse_unanswered(unanswered, call.id()))
                    }
                },
            },
            (Decision::Forward, None) => Err(GatewayError::session_not_found().with_id(call.id())),
            // The edge never asks for facts or answers "not mine": those are the owner's.
            (Decision::Refuse(_) | Decision::Ask(_) | Decision::NotMine, _) => {
                Err(self.refuse(&situation, refuse::LEASE_IN_DOUBT_WHY, call.id()))
            }
        }
    }

    fn refuse_unanswered(&self, unanswered: Unanswered, id: serde_json::Value) -> GatewayError {
        let error = self.refuse(&unanswered.situation, &unanswered.why, id);
        match unanswered.detail.is_empty() {
            true => error,
            false => error.with_log_detail(unanswered.detail),
        }
    }

    /// What this worker is, for the decisions after an unanswered forward.
    pub(crate) fn standing(&self, fleet: &Fleet, call: &Call) -> Standing {
        Standing {
            adopts: fleet.adoption.is_some(),
            has_session_id: call.session_id.is_some(),
            draining: self.worker.draining(),
            fenced: self.worker.is_fenced(),
        }
    }

    /// Adopts `call`'s session if its owner left it for adoption and it can continue
    /// here, and runs `call` in it; forwards to the worker that adopted it first; or
    /// answers what the forward found (`unanswered`).
    async fn adopt_or_refuse(
        &self,
        fleet: &Fleet,
        call: Call,
        unanswered: Unanswered,
    ) -> Result<Reply, GatewayError> {
        match self.try_adopt(fleet, call).await {
            AdoptionOutcome::Ran(result) => result,
            AdoptionOutcome::OwnedBy(owner, call) => self
                .forward_counted(&call, Some(&owner))
                .await
                .map_err(|unanswered| self.refuse_unanswered(unanswered, call.id())),
            AdoptionOutcome::NotAdoptable(call) => {
                Err(self.refuse_unanswered(unanswered, call.id()))
            }
        }
    }

    /// Takes `call`'s session on here if its owner left it for adoption (died, or
    /// drained) and it can continue, and runs `call` in it. Legacy sessions and the
    /// shared sessions of 2026-07-28 clients alike.
    pub(crate) async fn try_adopt(&self, fleet: &Fleet, call: Call) -> AdoptionOutcome {
        let Some(sid) = call.session_id.clone() else {
            return AdoptionOutcome::NotAdoptable(call);
        };
        let forwarder = self.worker.forwarder();
        if let Some(forwarder) = forwarder {
            forwarder.forget_moved(&sid);
        }
        let known_dead = |owner: &str| forwarder.is_some_and(|f| f.known_dead(owner));
        let route = self.worker.routes[call.upstream].name();
        let guard = crate::adoption::guard_of(route, &call.auth.subject);
        let tag = crate::digest::tag_of(&sid);
        // An adopted session is one more here, as a new one is: within this worker's
        // maximum (else a retry, which may reach another worker, adopts it; it stays
        // adoptable meanwhile), and counted for its principal (the directory counts it
        // fleet-wide as it hands it over, the registry here).
        if self.worker.sessions.get(&sid).is_none()
            && let Err(full) = self.executor().admit_new_session()
        {
            return AdoptionOutcome::Ran(Err(full.with_id(call.id())));
        }
        let quota_key = self.worker.auth.quota_key(&call);
        // The adoption is recorded here as under way before the directory is asked, and
        // stays so until the session is registered here with its link built: requests
        // for it reaching this worker meanwhile (forwarded by workers that find this one
        // recorded as its owner) wait for it instead of hearing "not mine".
        let transit = match self.begin_adoption(&sid).await {
            Ok(transit) => transit,
            Err(Some(held)) => {
                return AdoptionOutcome::Ran(self.executor().execute_held(call, Some(held)).await);
            }
            // The other adoption failed, or outlasted the wait: nothing ran.
            Err(None) => {
                return AdoptionOutcome::Ran(Err(self.refuse(
                    &Situation::Unknown,
                    "another request on this worker was adopting it and did not finish",
                    call.id(),
                )));
            }
        };
        match self
            .ask_adoption(fleet, &sid, &guard, &quota_key, known_dead)
            .await
        {
            Ok(Adoption::OwnedBy(owner)) if known_dead(&owner) => AdoptionOutcome::Ran(Err(self
                .refuse(
                    &Situation::Unknown,
                    "its owner was found dead and its sessions are still being freed",
                    call.id(),
                ))),
            Ok(Adoption::Adopted { payload, cause }) => AdoptionOutcome::Ran(
                self.run_adopted(fleet, call, &payload, Some(cause), transit)
                    .await,
            ),
            Ok(Adoption::AlreadyOwned { payload }) => {
                AdoptionOutcome::Ran(self.run_adopted(fleet, call, &payload, None, transit).await)
            }
            Ok(Adoption::OwnedBy(owner)) if owner != self.worker.id => {
                if let Some(forwarder) = forwarder {
                    forwarder.remember_moved(&sid, &owner);
                }
                AdoptionOutcome::OwnedBy(owner, call)
            }
            // Its principal opened new sessions since this one stopped counting: the
            // quota's answer, as for a new session; it stays adoptable until then.
            Ok(Adoption::OverQuota) => {
                self.worker.metrics.adoption_refused("quota");
                let limit = self.worker.config.limits.session_quota(&quota_key);
                AdoptionOutcome::Ran(Err(
                    refuse::quota_exceeded(limit, &quota_key).with_id(call.id())
                ))
            }
            Ok(Adoption::CannotContinue) => {
                self.worker.metrics.adoption_refused("stdio");
                let why = "its upstream process ended with the worker that held it";
                info!(session = %tag, "session not adopted: {why}");
                if call.is_shared_bound() {
                    // Its clients are told once, by whichever call takes the
                    // directory's memory of it.
                    return AdoptionOutcome::NotAdoptable(call);
                }
                AdoptionOutcome::Ran(Err(self.executor().session_gone(why).with_id(call.id())))
            }
            Ok(_) => AdoptionOutcome::NotAdoptable(call),
            // Left for adoption, but this worker holds no lease: it was declared dead
            // and does not know yet (it was paused, say). Another worker adopts it; this
            // one must not call it gone or not found.
            Err(DirectoryError::NotRegistered { .. }) => AdoptionOutcome::Ran(Err(self.refuse(
                &Situation::Unknown,
                "this worker holds no lease in the fleet directory (it may have been \
                 declared dead), so it cannot adopt the session; another worker can",
                call.id(),
            ))),
            // Whether it can be adopted is unknown: so is the session's fate.
            Err(e) => {
                debug!(session = %tag, error = %e, "adoption not possible now");
                AdoptionOutcome::Ran(Err(self.refuse(
                    &Situation::Unknown,
                    "the fleet directory did not answer whether it can be adopted",
                    call.id(),
                )))
            }
        }
    }

    /// Records an adoption of `sid` as under way here ([`SessionRegistry::begin_transit`]).
    /// When another request is adopting it here already, waits for that one instead:
    /// `Err` with the session held, to run the call in (`None`: that adoption failed,
    /// or is still under way after the wait).
    ///
    /// [`SessionRegistry::begin_transit`]: crate::session::SessionRegistry::begin_transit
    async fn begin_adoption(&self, sid: &str) -> Result<Transit<'w>, Option<SessionUse>> {
        let sessions = &self.worker.sessions;
        if let Some(transit) = sessions.begin_transit(sid) {
            return Ok(transit);
        }
        sessions
            .wait_transit(sid, self.executor().transit_wait())
            .await;
        if let Some(held) = sessions.enter(sid) {
            return Err(Some(held));
        }
        sessions.begin_transit(sid).ok_or(None)
    }

    /// Asks the directory to hand `sid` to this worker. While it is still recorded for
    /// an owner this worker proved dead, its reclaim (by another request, here or
    /// elsewhere) is under way and takes milliseconds: ask again shortly rather than
    /// forward to the dead.
    async fn ask_adoption(
        &self,
        fleet: &Fleet,
        sid: &str,
        guard: &str,
        quota_key: &str,
        known_dead: impl Fn(&str) -> bool,
    ) -> Result<Adoption, DirectoryError> {
        let quota = fleet.session_quota(quota_key);
        let ask = || {
            fleet
                .directory
                .adopt_session_within(sid, &self.worker.id, guard, quota)
        };
        let mut asked = ask().await;
        for _ in 0..RECLAIM_WAITS {
            match &asked {
                Ok(Adoption::OwnedBy(owner)) if known_dead(owner) => {
                    tokio::time::sleep(RECLAIM_WAIT).await;
                    asked = ask().await;
                }
                _ => break,
            }
        }
        asked
    }

    /// Runs `call` in its session, which this worker now owns in the directory, from
    /// the record its first owner wrote (`payload`). `cause`: why that owner left it,
    /// when this request is the one that adopted it.
    async fn run_adopted(
        &self,
        fleet: &Fleet,
        call: Call,
        payload: &str,
        cause: Option<AdoptCause>,
        transit: Transit<'_>,
    ) -> Result<Reply, GatewayError> {
        let Some(sid) = call.session_id.clone() else {
            return Err(GatewayError::session_not_found().with_id(call.id()));
        };
        let tag = crate::digest::tag_of(&sid);
        if cause.is_none() && self.worker.sessions.get(&sid).is_some() {
            // Another request adopted it here a moment ago: its link is built.
            drop(transit);
            let held = self.worker.sessions.enter(&sid);
            return self.executor().execute_held(call, held).await;
        }
        let streams = self.worker.new_streams();
        let mut upstream_init = None;
        let link = match SessionRecord::from_payload(payload) {
            Err(why) => Err(why),
            Ok(record) => {
                upstream_init = record.upstream_init.clone();
                self.adopted_link(fleet, &call, &sid, record, &streams)
                    .await
            }
        };
        let link = match link {
            Ok(link) => link,
            Err(why) => {
                // Taken, but it cannot go on: let it go, so no record names this worker
                // for a session it does not hold.
                warn!(session = %tag, "adopted session cannot continue: {why}");
                if let Err(e) = fleet
                    .directory
                    .release_session(&sid, &self.worker.id, None)
                    .await
                {
                    warn!(session = %tag, error = %e, "could not remove the session's record");
                }
                return Err(self.executor().session_gone(&why).with_id(call.id()));
            }
        };
        let mut session = Session::new(
            sid.clone(),
            call.upstream,
            call.auth.subject.clone(),
            link,
            streams,
        )
        .with_quota_key(self.worker.auth.quota_key(&call));
        session.shared = call.is_shared_bound();
        session.upstream_init = upstream_init;
        let session = self.worker.sessions.insert(session);
        // Registered with its link: requests that waited for the adoption go on.
        drop(transit);
        let held = self.worker.sessions.enter(&sid);
        let result = self.executor().execute_held(call, held).await;
        if let Some(cause) = cause {
            self.count_adoption(cause, &session);
        }
        let mut reply = result?;
        if let Some(cause) = cause {
            reply
                .headers
                .insert(HEADER_ADOPTED, HeaderValue::from_static(cause.as_str()));
        }
        Ok(reply)
    }

    /// Counts an adoption once the upstream took the session on: one that no longer
    /// knows it (its answer ended the session: the client hears "gone" as it would have
    /// from the first owner) is a refused adoption, not an adopted session.
    fn count_adoption(&self, cause: AdoptCause, session: &Session) {
        let metrics = &self.worker.metrics;
        match session.ended() {
            Some(why) => {
                metrics.adoption_refused("upstream_forgot");
                info!(session = %session.tag, "session not adopted: {why}");
            }
            None => {
                metrics.session_adopted(cause.as_str());
                metrics.session_opened();
                info!(
                    session = %session.tag,
                    cause = cause.as_str(),
                    // The worker that minted the id: after an earlier adoption it is
                    // not the owner that left the session (a nemesis run read it so).
                    minted_by = crate::session::owner_hint(&session.id).unwrap_or("unknown"),
                    "adopted a session its owner left"
                );
            }
        }
    }

    /// The upstream link of an adopted session, from its `record`: the upstream's
    /// session for a plain one, every member's for a virtual server's (`streams`: the
    /// session's, which that link's `GET` stream is one of). Why not, counted as a
    /// refused adoption.
    async fn adopted_link(
        &self,
        fleet: &Fleet,
        call: &Call,
        sid: &str,
        record: SessionRecord,
        streams: &crate::execute::streams::SessionStreams,
    ) -> Result<UpstreamLink, String> {
        let keys = fleet.adoption.as_ref().ok_or("adoption is off here")?;
        if let Some(members) = &record.members {
            return self
                .executor()
                .adopt_federation(call.upstream, sid, members, keys, streams)
                .await
                .map_err(|refused| {
                    self.worker.metrics.adoption_refused(refused.label);
                    refused.why
                });
        }
        let Some(recorded) = record.upstream_session else {
            return Ok(UpstreamLink::Http { session_id: None });
        };
        let opened = keys.open(sid, &recorded).map_err(|e| {
            self.worker.metrics.adoption_refused(e.label());
            e.to_string()
        })?;
        let session_id = HeaderValue::from_str(&opened)
            .map_err(|_| "its recorded upstream session id is not a header value".to_owned())?;
        Ok(UpstreamLink::Http {
            session_id: Some(session_id),
        })
    }

    /// Forwards `call` to its session's owner (`recorded`: as the caller read it from
    /// the directory; else found from the session id's hint or the directory),
    /// counting the forward by transport and outcome, and its time to the owner's
    /// answer head.
    pub(crate) async fn forward_counted(
        &self,
        call: &Call,
        recorded: Option<&str>,
    ) -> Result<Reply, Unanswered> {
        let Some(forwarder) = self.worker.forwarder() else {
            return Err(Unanswered::new(
                Situation::NoSuchSession,
                "this worker belongs to no fleet",
            ));
        };
        let started = tokio::time::Instant::now();
        let result = match recorded {
            Some(owner) => forwarder.forward_to_recorded_owner(owner, call).await,
            None => forwarder.forward_to_owner(call).await,
        };
        let outcome = match &result {
            Ok(_) => "answered",
            Err(unanswered) => match unanswered.situation {
                Situation::OwnerGone => "owner_gone",
                Situation::NoSuchSession => "no_such_session",
                Situation::ForwardedThenLost | Situation::AnswerLost => "outcome_unknown",
                Situation::MeshBusy => "mesh_busy",
                _ => "ownership_unknown",
            },
        };
        self.worker
            .metrics
            .forward(forwarder.transport_label(), outcome, started.elapsed());
        result
    }

    /// The client-facing error for a situation that refuses; `why` is its cause.
    pub(crate) fn refuse(
        &self,
        situation: &Situation,
        why: &str,
        id: serde_json::Value,
    ) -> GatewayError {
        refuse::situation(self.worker.gone_status(), situation, why, id)
    }

    /// Opt-in (`--stateless-when-unknown`): session methods whose answer does not
    /// depend on the session.
    fn stateless_candidate(&self, call: &Call) -> bool {
        self.worker.config.fleet.stateless_when_unknown
            && call.session_id.is_some()
            && call
                .message
                .as_ref()
                .and_then(|m| m.method())
                .is_some_and(|m| STATELESS_METHODS.contains(&m))
    }
}
