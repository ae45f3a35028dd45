//! The affinity decision table (DESIGN.md), as pure logic: given what the receiving
//! worker knows about a request's session, where does the request go, or what true
//! answer does the client get?
//!
//! The rule behind every row: an owner acts for a session only while its lease is
//! valid by its own clock; others declare it dead only on proof (lease expired in
//! Redis, its mesh address refuses or answers as another worker). A lookup that failed
//! is *unknown*, never *absent*, so no session is ever silently replaced.

use http::StatusCode;
use serde_json::json;

use crate::mcp::{self, GatewayError};

/// What the receiving worker knows when it must decide.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Ownership cannot be established: directory unreachable, or the owner's lease is
    /// alive but the owner did not answer within the deadline.
    Unknown,
    /// The request was forwarded and the owner died (or the link broke) before the
    /// answer completed: it may or may not have run.
    ForwardedThenLost,
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
    }
}

/// `data.reason` of the two "unknown" answers.
pub const REASON_OWNERSHIP_UNKNOWN: &str = "ownership_unknown";
pub const REASON_LEASE_IN_DOUBT: &str = "lease_in_doubt";

/// Whether `error` says that ownership could not be established right now (as
/// opposed to a proven answer): the only case where a stateless answer may stand in.
pub fn is_unknown(error: &GatewayError) -> bool {
    let reason = error
        .data
        .as_ref()
        .and_then(|d| d.get("reason"))
        .and_then(|r| r.as_str());
    matches!(
        reason,
        Some(REASON_OWNERSHIP_UNKNOWN | REASON_LEASE_IN_DOUBT)
    )
}

/// Methods whose answer does not depend on the session's state, so a worker may
/// answer them without the session when its owner cannot be reached (opt-in).
pub const STATELESS_METHODS: &[&str] = &[
    "ping",
    "tools/list",
    "resources/list",
    "resources/templates/list",
    "prompts/list",
];

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
            .with_data(json!({ "reason": "session_gone", "detail": why, "retryable": false })),
            Refusal::NoSuchSession => GatewayError::session_not_found()
                .with_data(json!({ "reason": "session_not_found", "retryable": false })),
            Refusal::OwnershipUnknown => GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "session owner cannot be confirmed right now ({why}); the session may \
                     still be alive: retry the same request with the same Mcp-Session-Id"
                ),
            )
            .with_data(
                json!({ "reason": REASON_OWNERSHIP_UNKNOWN, "detail": why, "retryable": true }),
            )
            .with_retry_after(RETRY_AFTER_SECONDS),
            Refusal::LeaseInDoubt => GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                mcp::code::GATEWAY_ERROR,
                format!(
                    "the worker holding this session cannot confirm its lease ({why}); \
                     retry the same request with the same Mcp-Session-Id"
                ),
            )
            .with_data(json!({ "reason": REASON_LEASE_IN_DOUBT, "detail": why, "retryable": true }))
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
            .with_data(json!({ "reason": "outcome_unknown", "detail": why, "retryable": false })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row per line of DESIGN.md's decision table.
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
        assert!(is_unknown(&unknown));
        assert!(is_unknown(
            &Refusal::LeaseInDoubt.to_error(StatusCode::NOT_FOUND, "x")
        ));
        assert!(
            !is_unknown(&gone),
            "a proven answer is never replaced statelessly"
        );
    }

    #[test]
    fn gone_status_is_configurable_to_409() {
        let gone = Refusal::SessionGone.to_error(StatusCode::CONFLICT, "reclaimed");
        assert_eq!(gone.status, StatusCode::CONFLICT);
    }
}
