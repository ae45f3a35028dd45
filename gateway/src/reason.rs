//! Every `data.reason` the gateway can send a client, as one type.
//!
//! A client branches on `data.reason` (re-initialize, retry, check state first), so
//! each reason is a contract: it exists once, here, and errors carry a [`Reason`],
//! never a string literal. `docs/clients.md` ("What clients see") documents each one;
//! a test below keeps the two lists equal, so a reason added here without its row
//! (or a row left behind after a reason is removed) fails `make test`.

use serde::{Serialize, Serializer};

/// Defines [`Reason`], its wire text and [`Reason::ALL`] from one list, so the three
/// cannot drift apart.
macro_rules! reasons {
    ($( $(#[$doc:meta])* $variant:ident => $text:literal, )*) => {
        /// Why the gateway answered a request itself, as `data.reason` says it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $( $(#[$doc])* $variant, )*
        }

        impl Reason {
            /// Every reason, in declaration order.
            #[cfg_attr(not(test), allow(dead_code))]
            pub const ALL: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The text clients see in `data.reason`.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => $text,)*
                }
            }
        }
    };
}

reasons! {
    /// The request body did not arrive within the body deadline.
    BodyTimeout => "body_timeout",
    /// The worker holds its maximum of client connections.
    ConnectionLimit => "connection_limit",
    /// The principal (or client address) holds its fleet-wide session quota.
    SessionQuota => "session_quota",
    /// The worker holds its maximum of sessions.
    SessionLimit => "session_limit",
    /// The worker is draining and opens no new sessions.
    Draining => "draining",
    /// An upstream SSE event exceeded the configured size; its stream ends.
    UpstreamEventTooLarge => "upstream_event_too_large",
    /// No bearer token was sent on a route that needs one.
    MissingToken => "missing_token",
    /// The bearer token was refused (`data.problem` says why).
    InvalidToken => "invalid_token",
    /// The edge authenticated a forwarded request for another route or mode than the
    /// owner has: the fleet's configurations differ.
    AuthContextMismatch => "auth_context_mismatch",
    /// The token lacks a scope the route or tool needs.
    InsufficientScope => "insufficient_scope",
    /// The principal's rate limit is spent for now.
    RateLimited => "rate_limited",
    /// The signing keys (JWKS) cannot be fetched.
    KeysUnavailable => "keys_unavailable",
    /// The rate limiter's Redis does not answer and the limiter fails closed.
    RateLimitUnavailable => "rate_limit_unavailable",
    /// A route without an authentication policy: a configuration bug.
    NoRoutePolicy => "no_route_policy",
    /// The session is unknown, ended, expired or another principal's.
    SessionNotFound => "session_not_found",
    /// The session's owner is provably gone, or its upstream state ended.
    SessionGone => "session_gone",
    /// The session's owner cannot be confirmed now; the request did not reach it.
    OwnershipUnknown => "ownership_unknown",
    /// The owner cannot confirm its own lease now.
    LeaseInDoubt => "lease_in_doubt",
    /// The request may have run, and its answer is lost.
    OutcomeUnknown => "outcome_unknown",
    /// A mesh budget between the edge and the owner is full.
    MeshBudgetExhausted => "mesh_budget_exhausted",
    /// The directory (Redis) does not answer, so no session can be opened.
    DirectoryUnavailable => "directory_unavailable",
    /// A freshly minted session id was already taken (never expected).
    SessionIdCollision => "session_id_collision",
    /// The operating system's random source failed.
    EntropyUnavailable => "entropy_unavailable",
    /// A session id this worker minted cannot be used as a header (never expected).
    BadSessionId => "bad_session_id",
    /// A `Last-Event-ID` whose stream or events are no longer kept.
    ReplayUnavailable => "replay_unavailable",
    /// The upstream cannot be reached.
    UpstreamUnreachable => "upstream_unreachable",
    /// The upstream did not start answering in time.
    UpstreamTimeout => "upstream_timeout",
    /// The upstream answered with an error or broke its answer.
    UpstreamFailed => "upstream_failed",
    /// TLS with the upstream failed.
    UpstreamTls => "upstream_tls",
    /// The worker runs its maximum of this stdio upstream's processes.
    ProcessLimit => "process_limit",
    /// The principal (or client address) runs its maximum of this stdio upstream's
    /// processes on the worker.
    ProcessQuota => "process_quota",
    /// The stdio upstream's command could not be started.
    UpstreamSpawnFailed => "upstream_spawn_failed",
    /// The session's stdio process exited.
    UpstreamExited => "upstream_exited",
    /// The upstream refused to open the shared session of a 2026-07-28 client.
    UpstreamInitializeFailed => "upstream_initialize_failed",
    /// A required member of a virtual server could not be opened at initialize.
    MemberUnavailable => "member_unavailable",
    /// A virtual server's member lost its upstream session during the client's session.
    MemberLost => "member_lost",
    /// A 2026-07-28 client on a virtual server, which serves 2025 clients only for now.
    VirtualServerProtocol => "virtual_server_protocol",
    /// The upstream's settings cannot be used: a configuration error.
    Config => "config",
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Serialized as its wire text, so `json!({ "reason": Reason::SessionGone })` is the
/// one way a reason reaches a body.
impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The reasons `docs/clients.md` documents: in each row of its table, every
    /// `data.reason: "a"` and the alternatives written after it (`"a"` / `"b"`,
    /// `"a"` or `"b"`).
    fn documented_reasons() -> BTreeSet<String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/clients.md");
        let text = std::fs::read_to_string(path).expect("docs/clients.md is readable");
        let mut found = BTreeSet::new();
        for row in text.lines().filter(|l| l.starts_with('|')) {
            for (at, _) in row.match_indices("data.reason: ") {
                let mut rest = &row[at + "data.reason: ".len()..];
                while let Some(quoted) = rest.strip_prefix('"') {
                    let Some(close) = quoted.find('"') else { break };
                    found.insert(quoted[..close].to_owned());
                    rest = quoted[close + 1..].trim_start_matches(['`', ' ', '/']);
                    rest = rest.strip_prefix("or ").unwrap_or(rest);
                    rest = rest.trim_start_matches('`');
                }
            }
        }
        found
    }

    #[test]
    fn every_reason_is_documented_and_every_documented_reason_exists() {
        let code: BTreeSet<String> = Reason::ALL.iter().map(|r| r.as_str().to_owned()).collect();
        let docs = documented_reasons();
        let undocumented: Vec<_> = code.difference(&docs).collect();
        let unknown: Vec<_> = docs.difference(&code).collect();
        assert!(
            undocumented.is_empty() && unknown.is_empty(),
            "docs/clients.md and gateway/src/reason.rs disagree: sent but not documented \
             {undocumented:?}; documented but never sent {unknown:?}"
        );
    }

    #[test]
    fn wire_texts_are_unique_and_serialize_as_themselves() {
        let texts: BTreeSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(texts.len(), Reason::ALL.len(), "two reasons share a text");
        for reason in Reason::ALL {
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.as_str());
        }
    }
}
