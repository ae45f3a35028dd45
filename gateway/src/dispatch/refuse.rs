//! Renders the decision core's refusals for clients: the HTTP status, the JSON-RPC
//! error body with its `data.reason`, and `Retry-After` where a retry is safe. The one
//! place a [`Refusal`] becomes an answer.

use http::StatusCode;
use serde_json::json;

use crate::decision::{Decision, Refusal, Situation, decide};
use crate::mcp::{self, GatewayError};
use crate::reason::Reason;

/// What the client is told when a situation refuses and nothing more specific is known.
pub(crate) const LEASE_IN_DOUBT_WHY: &str =
    "the worker holding it could not renew its lease in time";

/// The client-facing error for a `situation` that refuses; `why` is its cause, `gone`
/// the status that says a session is gone for good. Here rather than on the router so
/// that the executor, which the router drives, refuses through the same table without
/// depending back on the router.
pub(crate) fn situation(
    gone: StatusCode,
    situation: &Situation,
    why: &str,
    id: serde_json::Value,
) -> GatewayError {
    match decide(situation) {
        Decision::Refuse(refusal) => refusal.to_error(gone, why).with_id(id),
        other => {
            tracing::error!(?situation, ?other, "decision table returned no refusal");
            GatewayError::session_not_found().with_id(id)
        }
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

/// 429 for a principal (or client address) at its session quota.
pub(crate) fn quota_exceeded(quota: usize, quota_key: &str) -> GatewayError {
    let scope = if quota_key.starts_with("addr:") {
        "client_address"
    } else {
        "principal"
    };
    GatewayError::gateway(
        StatusCode::TOO_MANY_REQUESTS,
        Reason::SessionQuota,
        format!(
            "this {} already holds its maximum of {quota} sessions: end sessions you no \
             longer use (DELETE), or wait for idle ones to expire",
            scope.replace('_', " ")
        ),
    )
    .with_data(json!({ "scope": scope, "limit": quota, "retryable": true }))
    .with_retry_after(QUOTA_RETRY_AFTER_SECONDS)
}

/// Seconds a client at its session quota should wait: sessions free up as clients end
/// them or as idle ones expire, not within a second.
pub(crate) const QUOTA_RETRY_AFTER_SECONDS: u32 = 30;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{Decision, Situation, decide};

    /// Every refusing row of the table answers with its status.
    #[test]
    fn every_refusal_has_its_status() {
        let rows: &[(Situation, u16)] = &[
            (Situation::OwnerGone, 404),
            (Situation::NoSuchSession, 404),
            (Situation::Unknown, 503),
            (Situation::AnswerLost, 502),
            (Situation::LocalLeaseInDoubt, 503),
            (Situation::ForwardedThenLost, 502),
            (Situation::MissingSession, 400),
            (Situation::MeshBusy, 503),
        ];
        for (situation, status) in rows {
            let Decision::Refuse(refusal) = decide(situation) else {
                panic!("{situation:?} does not refuse");
            };
            let error = refusal.to_error(StatusCode::NOT_FOUND, "test");
            assert_eq!(error.status.as_u16(), *status, "{situation:?}");
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
}
