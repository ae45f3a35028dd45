//! Where a 2026-07-28 call on a stateful route runs (see [`crate::execute::shared`]
//! for the shared sessions themselves): held here, the decision core decides as for a
//! legacy session; held nowhere here, what the directory remembers of the session
//! decides ([`judged::judge_shared`]): forward to its owner, adopt it, tell its end
//! once, or open it.

use std::sync::Arc;

use serde_json::json;

use super::{AdoptionOutcome, Router};
use crate::decision::shared::{self as judged, SharedStanding};
use crate::decision::{self, Decision, Known, Refusal, SessionKind, Side, Situation};
use crate::fleet::Fleet;
use crate::mcp::{self, Era, GatewayError};
use crate::reason::Reason;
use crate::reply::Reply;
use crate::request::Call;
use crate::session::shared_session_id;

/// What one look at the directory led to, in [`Router::find_shared`].
// Lives for one step of one request, moved and never stored: boxing the call would
// cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
enum SharedStep {
    /// The call is answered (or refused).
    Answered(Result<Reply, GatewayError>),
    /// The directory changed under the call (a stale record taken back, an owner
    /// proven gone): look again.
    LookAgain(Call),
}

impl Router<'_> {
    /// Binds a 2026-07-28 call on a route whose upstream keeps state in sessions to the
    /// session its principal shares there. The edge and the owner both bind, from the
    /// authenticated principal, so a client can never name another's session.
    pub fn bind_shared_session(&self, mut call: Call) -> Call {
        let route = self.worker.routes[call.upstream].config();
        if call.era == Era::Modern && route.legacy_only {
            call.session_id = Some(shared_session_id(&route.name, &call.auth.subject));
        }
        call
    }

    /// Where a bound call runs: the decision core, as for a legacy session, where this
    /// worker holds the session; elsewhere what the directory remembers of it
    /// ([`judged::judge_shared`]): forward to its owner, tell its end once, or open it.
    pub async fn dispatch_shared(&self, call: Call) -> Result<Reply, GatewayError> {
        let local = self.executor().hold_session(&call).await;
        let situation = decision::situation(&Known {
            modern: true,
            has_session_id: true,
            held_here: local.is_some(),
            ..self.worker.knows(Side::Edge, SessionKind::Shared)
        });
        match (decision::decide(&situation), self.worker.fleet()) {
            (Decision::ExecuteHere, _) => self.executor().execute_held(call, local).await,
            (Decision::Forward, Some(fleet)) => self.find_shared(fleet, call).await,
            // Not held, and no fleet that could hold it: open it here.
            (Decision::Forward, None) => self.executor().execute_local(call, None).await,
            (Decision::Refuse(_) | Decision::Ask(_) | Decision::NotMine, _) => Err(self
                .refuse_shared(
                    &situation,
                    "the worker holding it could not renew its lease in time",
                    &call,
                )),
        }
    }

    /// A shared session this worker does not hold live: asks the directory where it
    /// stands and acts on it. Loops only after a step that changed what the directory
    /// holds (a stale record taken back, an owner proven gone), so at most a few times.
    pub(crate) async fn find_shared(
        &self,
        fleet: &Arc<crate::fleet::Fleet>,
        mut call: Call,
    ) -> Result<Reply, GatewayError> {
        let Some(key) = call.session_id.clone() else {
            return Err(GatewayError::session_not_found().with_id(call.id()));
        };
        for _ in 0..3 {
            let standing = self.shared_standing(fleet, &key).await;
            match self.act_on_standing(fleet, &key, standing, call).await {
                SharedStep::Answered(result) => return result,
                SharedStep::LookAgain(back) => call = back,
            }
        }
        Err(self.refuse_shared(
            &Situation::Unknown,
            "its owner changed while this request looked for it",
            &call,
        ))
    }

    /// Where the directory says the shared session `key` stands, for this worker.
    async fn shared_standing(&self, fleet: &Fleet, key: &str) -> SharedStanding {
        let record = fleet
            .directory
            .remembered_session(key)
            .await
            .map_err(|e| e.to_string());
        judged::judge_shared(
            record,
            &self.worker.id,
            fleet.lease.revoked(),
            &fleet.lease.generation(),
            self.worker.config.fleet.lease,
        )
    }

    /// Acts on where the directory says the session stands: runs, adopts, forwards
    /// or refuses the call, or hands it back to look again.
    async fn act_on_standing(
        &self,
        fleet: &Arc<Fleet>,
        key: &str,
        standing: SharedStanding,
        call: Call,
    ) -> SharedStep {
        match standing {
            SharedStanding::Open => {
                SharedStep::Answered(self.executor().execute_local(call, None).await)
            }
            // Taken by another worker first, or not adoptable after all: the
            // directory's next answer says where it stands.
            SharedStanding::Adopt => self.adopt_shared(fleet, call).await,
            SharedStanding::TellEnded => SharedStep::Answered(Err(self
                .shared_lost(call.upstream, "it ended")
                .with_id(call.id()))),
            SharedStanding::Unknown => SharedStep::Answered(Err(self.refuse_shared(
                &Situation::Unknown,
                "the fleet directory cannot confirm where it is (it did not answer, \
                 or it was rebuilt less than a lease ago)",
                &call,
            ))),
            // A late claim of ours: opening confirms it (the recorded owner's claim
            // succeeds), so the record and the session agree again.
            SharedStanding::StaleOwnRecord => {
                SharedStep::Answered(self.executor().execute_local(call, None).await)
            }
            SharedStanding::Forward(owner) => self.forward_shared(fleet, key, &owner, call).await,
        }
    }

    async fn adopt_shared(&self, fleet: &Fleet, call: Call) -> SharedStep {
        match self.try_adopt(fleet, call).await {
            AdoptionOutcome::Ran(result) => SharedStep::Answered(result),
            AdoptionOutcome::OwnedBy(_, back) | AdoptionOutcome::NotAdoptable(back) => {
                SharedStep::LookAgain(back)
            }
        }
    }

    /// Forwards to the recorded owner; when it no longer holds the session, the
    /// directory is asked again.
    async fn forward_shared(
        &self,
        fleet: &Arc<Fleet>,
        key: &str,
        owner: &str,
        call: Call,
    ) -> SharedStep {
        match self.forward_counted(&call, Some(owner)).await {
            Ok(reply) => SharedStep::Answered(Ok(reply)),
            // The owner no longer holds it, or was proven gone (and its sessions
            // reclaimed): the directory now says how it ended.
            Err(unanswered)
                if decision::may_adopt(unanswered.situation, &self.standing(fleet, &call)) =>
            {
                // Where it went, or how it ended: the directory says.
                self.adopt_shared(fleet, call).await
            }
            Err(unanswered)
                if matches!(
                    unanswered.situation,
                    Situation::NoSuchSession | Situation::OwnerGone
                ) =>
            {
                SharedStep::LookAgain(call)
            }
            Err(unanswered) => {
                if unanswered.situation == Situation::ForwardedThenLost {
                    // This answer tells the loss; take the directory's memory of it so
                    // no other call is told again.
                    let _ = fleet.directory.remembered_session(key).await;
                }
                SharedStep::Answered(Err(self.refuse_shared(
                    &unanswered.situation,
                    &unanswered.why,
                    &call,
                )))
            }
        }
    }

    /// Whether the directory records this worker as the owner of `sid` (a read only:
    /// the memory of an ended session is left for the call that tells it).
    pub(crate) async fn records_as_own(&self, sid: &str) -> bool {
        let Some(fleet) = self.worker.fleet() else {
            return false;
        };
        matches!(fleet.directory.session_owner(sid).await, Ok(Some(owner)) if owner == self.worker.id)
    }

    /// The table's refusal, with "gone" told the way a 2026-07-28 client needs it.
    pub(crate) fn refuse_shared(
        &self,
        situation: &Situation,
        why: &str,
        call: &Call,
    ) -> GatewayError {
        let route = self.worker.routes[call.upstream].name();
        let message = match decision::decide(situation) {
            Decision::Refuse(Refusal::SessionGone) => {
                return self.shared_lost(call.upstream, why).with_id(call.id());
            }
            Decision::Refuse(Refusal::OutcomeUnknown) if self.adopts_on(call.upstream) => format!(
                "the worker holding your upstream session on route {route} died while \
                 running this request ({why}): its outcome is unknown and it was not \
                 re-run; that session's state lives in the upstream, and your next request \
                 goes on in it on another worker, so check its state before retrying a \
                 non-idempotent call"
            ),
            Decision::Refuse(Refusal::OutcomeUnknown) => format!(
                "the worker holding your upstream session on route {route} died while \
                 running this request ({why}): its outcome is unknown, it was not re-run, \
                 and the state of that session is lost; your next request starts a new one"
            ),
            Decision::Refuse(Refusal::AnswerLost) => format!(
                "the answer to this request was lost on its way from the worker holding \
                 your upstream session on route {route} ({why}): it may have run, and it \
                 was not re-run; that session goes on, so check its state before retrying \
                 a non-idempotent call"
            ),
            _ => return self.refuse(situation, why, call.id()),
        };
        let mut error = self.refuse(situation, why, call.id());
        error.message = message;
        error
    }

    /// Whether sessions on `upstream` outlive their worker (`--adopt http`, and an HTTP
    /// upstream).
    fn adopts_on(&self, upstream: usize) -> bool {
        self.worker.adopts() && self.worker.routes[upstream].is_http()
    }

    /// The shared session's state is lost; the next call starts afresh.
    pub(crate) fn shared_lost(&self, upstream: usize, why: &str) -> GatewayError {
        let status = self.worker.gone_status();
        let route = self.worker.routes[upstream].name();
        GatewayError::new(
            status,
            mcp::code::SESSION_NOT_FOUND,
            format!(
                "the upstream session that held your state on route {route} is gone ({why}); \
                 your next request starts a new one, without that state"
            ),
        )
        .with_reason(Reason::SessionGone)
        .with_data(json!({ "detail": why, "retryable": false }))
    }
}
