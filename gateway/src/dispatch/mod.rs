//! Where a checked call runs, read top to bottom: gather what this worker knows,
//! look the situation up in the decision table ([`table`]), then execute here
//! ([`crate::execute`]), forward to the owner ([`crate::forward::caller`]), or answer
//! with the truthful refusal. A refusal that only says "unknown" may be replaced by a
//! stateless answer when the operator opted in.

pub mod table;

use std::sync::Arc;

use http::StatusCode;

use crate::execute::stateless::STATELESS_METHODS;
use crate::fleet::Fleet;
use crate::forward::caller::Unanswered;
use crate::mcp::{Era, GatewayError};
use crate::reply::Reply;
use crate::request::Call;
use crate::session::SessionUse;
use crate::worker::Worker;
use table::{Decision, Known, Situation, decide};

/// What the client is told when a situation refuses and nothing more specific is known.
const LEASE_IN_DOUBT_WHY: &str = "the worker holding it could not renew its lease in time";

impl Worker {
    /// Decides where `call` runs and runs it.
    pub async fn dispatch(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        // A 2026-07-28 call to an upstream that keeps state in sessions runs in the
        // session its principal shares there (execute/shared.rs).
        let call = self.bind_shared_session(call);
        if crate::execute::shared::is_bound(&call) {
            return self.dispatch_shared(call).await;
        }
        // Kept only when a stateless answer could stand in for an "unknown" one.
        let fallback = self.stateless_candidate(&call).then(|| call.clone());
        match (self.decide_and_run(call).await, fallback) {
            (Err(error), Some(call)) if table::owner_unconfirmed(&error) => {
                self.answer_statelessly(call, error).await
            }
            (result, _) => result,
        }
    }

    async fn decide_and_run(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        let local = self.hold_session(&call).await;
        let situation = table::situation(&Known {
            modern: call.era == Era::Modern,
            has_session_id: call.session_id.is_some(),
            is_initialize: call.is_initialize(),
            held_here: local.is_some(),
            lease_valid: self.lease_valid(),
            in_fleet: self.fleet().is_some(),
        });
        match (decide(&situation), self.fleet()) {
            (Decision::ExecuteHere, _) => self.execute_held(call, local).await,
            (Decision::Forward, Some(fleet)) => self
                .forward_counted(fleet, &call, None)
                .await
                .map_err(|unanswered| {
                    let error = self.refuse(&unanswered.situation, &unanswered.why, call.id());
                    match unanswered.detail.is_empty() {
                        true => error,
                        false => error.with_log_detail(unanswered.detail),
                    }
                }),
            (Decision::Forward, None) => Err(GatewayError::session_not_found().with_id(call.id())),
            (Decision::Refuse(_), _) => Err(self.refuse(&situation, LEASE_IN_DOUBT_WHY, call.id())),
        }
    }

    /// Forwards `call` to its session's owner (`recorded`: as the caller read it from
    /// the directory; else found from the session id's hint or the directory),
    /// counting the forward by transport and outcome, and its time to the owner's
    /// answer head.
    pub(crate) async fn forward_counted(
        &self,
        fleet: &Fleet,
        call: &Call,
        recorded: Option<&str>,
    ) -> Result<Reply, Unanswered> {
        let started = tokio::time::Instant::now();
        let result = match recorded {
            Some(owner) => fleet.forward_to_recorded_owner(&self.id, owner, call).await,
            None => fleet.forward_to_owner(&self.id, call).await,
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
        self.metrics
            .forward(fleet.transport_label(), outcome, started.elapsed());
        result
    }

    /// The session `call` names, if this worker holds it, held for the exchange. A
    /// lease past its own deadline is revalidated first (one attempt shared by every
    /// request that waits for it); if that fenced the worker, the session is gone.
    pub(crate) async fn hold_session(&self, call: &Call) -> Option<SessionUse> {
        let held = || {
            call.session_id
                .as_deref()
                .and_then(|id| self.sessions.enter(id))
        };
        let local = held();
        if local.is_some() && !self.lease_valid() && !self.renew_lease(true).await {
            return held();
        }
        local
    }

    /// Runs `call` here, holding its session (if any) until the answer is fully sent.
    pub(crate) async fn execute_held(
        self: &Arc<Self>,
        call: Call,
        held: Option<SessionUse>,
    ) -> Result<Reply, GatewayError> {
        let session = held.as_ref().map(|held| Arc::clone(held.session()));
        let mut reply = self.execute_local(call, session).await?;
        if let Some(held) = held {
            reply.body = crate::body::hold(reply.body, held);
        }
        Ok(reply)
    }

    /// The client-facing error for a situation that refuses; `why` is its cause.
    pub(crate) fn refuse(
        &self,
        situation: &Situation,
        why: &str,
        id: serde_json::Value,
    ) -> GatewayError {
        let gone = self
            .fleet()
            .map_or(StatusCode::NOT_FOUND, |fleet| fleet.gone_status());
        match decide(situation) {
            Decision::Refuse(refusal) => refusal.to_error(gone, why).with_id(id),
            other => {
                tracing::error!(?situation, ?other, "decision table returned no refusal");
                GatewayError::session_not_found().with_id(id)
            }
        }
    }

    /// Opt-in (`--stateless-when-unknown`): session methods whose answer does not
    /// depend on the session.
    fn stateless_candidate(&self, call: &Call) -> bool {
        self.config.fleet.stateless_when_unknown
            && call.session_id.is_some()
            && call
                .message
                .as_ref()
                .and_then(|m| m.method())
                .is_some_and(|m| STATELESS_METHODS.contains(&m))
    }
}
