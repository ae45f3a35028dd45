//! How a session reaches its upstream ([`UpstreamLink`]), and for a virtual server's
//! session the data of its members' links ([`FederatedLink`]). The types hold each
//! other (a member's link is an `UpstreamLink`; a federated `UpstreamLink` holds its
//! `FederatedLink`), so they live in one file, below both the upstream clients
//! (`execute/upstream`) and federation, which exchange over them: sessions, the
//! directory's records and adoption can name a link without reaching either.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http::HeaderValue;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tracing::warn;

use crate::adoption::{self, AdoptionKeys, MemberRecord, MemberSession};
use crate::config::{MemberConfig, MergeLimits, NameFilter, PrefixRule};
use crate::execute::streams::StreamLog;
use crate::execute::upstream::stdio::StdioProcess;
use crate::federation::bounds::Refreshes;
use crate::federation::names::Owner;
use crate::federation::uris::ResourceCatalog;

/// How one session reaches its upstream: the upstream's own session over HTTP, or a
/// child process of its own. It lives as long as the session.
pub enum UpstreamLink {
    /// Streamable HTTP: the upstream's `Mcp-Session-Id`, if it issued one.
    Http { session_id: Option<HeaderValue> },
    /// A child process started for this session alone.
    Stdio(Arc<StdioProcess>),
    /// A virtual server's session: one link per member (`crate::federation`).
    Federated(Arc<FederatedLink>),
}

impl std::fmt::Debug for UpstreamLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamLink::Http { session_id } => f
                .debug_struct("Http")
                .field("has_session", &session_id.is_some())
                .finish(),
            UpstreamLink::Stdio(process) => f
                .debug_struct("Stdio")
                .field("pid", &process.pid())
                .finish(),
            UpstreamLink::Federated(link) => f
                .debug_struct("Federated")
                .field("members", &link.member_count())
                .finish(),
        }
    }
}

impl UpstreamLink {
    /// Whether a session on this link can go on on another worker: an HTTP upstream's
    /// session, or a virtual server's with at least one HTTP member (its stdio members
    /// are lost on the way). A draining worker hands these over instead of ending them.
    pub fn continues_elsewhere(&self) -> bool {
        match self {
            UpstreamLink::Http { .. } => true,
            UpstreamLink::Stdio(_) => false,
            UpstreamLink::Federated(federated) => federated.has_http_member(),
        }
    }
}

/// The kinds of named things a virtual server merges and routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Tools,
    Prompts,
}

/// One list method of a member: how it is asked for and read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListOf {
    pub(crate) method: &'static str,
    /// The key of the list in the result.
    pub(crate) key: &'static str,
    /// The capability a member announces it with.
    pub(crate) capability: &'static str,
}

impl Kind {
    pub(crate) fn listing(self) -> ListOf {
        match self {
            Kind::Tools => ListOf {
                method: "tools/list",
                key: "tools",
                capability: "tools",
            },
            Kind::Prompts => ListOf {
                method: "prompts/list",
                key: "prompts",
                capability: "prompts",
            },
        }
    }

    /// The key of the list in a list result, and the capability that announces it.
    pub(crate) fn key(self) -> &'static str {
        self.listing().key
    }

    pub(crate) fn filter(self, member: &MemberConfig) -> &NameFilter {
        match self {
            Kind::Tools => &member.tools,
            Kind::Prompts => &member.prompts,
        }
    }

    pub(crate) fn singular(self) -> &'static str {
        match self {
            Kind::Tools => "tool",
            Kind::Prompts => "prompt",
        }
    }
}

/// One client session of a virtual server: its members' upstream sessions.
pub struct FederatedLink {
    /// The virtual server's route name, for messages and logs.
    pub(crate) server: String,
    /// `server` as a metric label value.
    pub(crate) label: Arc<String>,
    pub(crate) rule: PrefixRule,
    pub(crate) separator: String,
    /// The members opened at initialize, in configuration order.
    pub(crate) members: Vec<Member>,
    /// Optional members that could not be opened: (upstream name, why).
    pub(crate) left_out: Vec<(String, String)>,
    /// The session's `GET` stream: what members send outside a request (their own
    /// `GET` streams over HTTP, what they write outside a request over stdio), and the
    /// gateway's `list_changed` when a member is lost.
    pub(crate) get_stream: Arc<StreamLog>,
    /// Set once the HTTP members' own `GET` streams are followed (at the client's
    /// first `GET` on this worker): a member allows one per session.
    pub(crate) members_followed: AtomicBool,
    /// Set when the session ends: members stopping then are not "lost".
    pub(crate) ending: Arc<AtomicBool>,
    /// Exposed name → owning member, per kind, from the last merged list; names of
    /// members lost since stay, so their calls are told the loss, not "unknown".
    pub(crate) catalog: Mutex<HashMap<Kind, HashMap<String, Owner>>>,
    /// The URIs and templates of the last merged resource lists, kept the same way.
    pub(crate) resources: Mutex<ResourceCatalog>,
    /// The server's merge bounds.
    pub(crate) merge: MergeLimits,
    /// When an unknown name or URI last read each list again (at most once per
    /// `merge.unknown_refresh_interval`); held while it does, so requests that find
    /// a name unknown meanwhile wait for that reading rather than answer "unknown"
    /// from the catalog it is renewing.
    pub(crate) refreshes: tokio::sync::Mutex<Refreshes>,
    /// List (its method) → the members its last merge cut: a name or URI no catalog
    /// knows may be theirs, beyond the cut.
    pub(crate) cut: Mutex<HashMap<&'static str, Vec<usize>>>,
    /// Ids for the gateway's own requests in the members' sessions.
    pub(crate) own_ids: OwnIds,
}

/// Ids of the gateway's own requests to members (list pages, the adoption ping),
/// unique per worker and link. A server answers each id of its session once: two
/// merged lists asked at once under one id would leave one of them waiting until its
/// deadline (seen with the Python SDK's HTTP server).
pub(crate) struct OwnIds {
    pub(crate) worker: String,
    pub(crate) next: AtomicU64,
}

impl OwnIds {
    pub(crate) fn new(worker: &str) -> Self {
        Self {
            worker: worker.to_owned(),
            next: AtomicU64::new(0),
        }
    }

    /// A fresh id for a request of the gateway's own, `what` naming it.
    pub(crate) fn next(&self, what: &str) -> Value {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Value::from(format!("mcpgw-{what}-{}-{n}", self.worker))
    }
}

/// One member's upstream session inside a federated session.
pub(crate) struct Member {
    pub(crate) config: MemberConfig,
    /// None: a stdio member of an adopted session, whose process stayed with the
    /// worker that held the session (it is lost from the start).
    pub(crate) link: Option<UpstreamLink>,
    /// The protocol version the member negotiated; sent on every exchange with it.
    pub(crate) version: HeaderValue,
    /// What the member announced at initialize.
    pub(crate) capabilities: Value,
    pub(crate) health: Arc<MemberHealth>,
}

/// Whether a member's session still lives; shared with its process's exit handler.
pub(crate) struct MemberHealth {
    pub(crate) lost: Mutex<Option<String>>,
}

impl Member {
    pub(crate) fn name(&self) -> &str {
        &self.config.upstream
    }

    pub(crate) fn lost(&self) -> Option<String> {
        self.health.lost.lock().clone()
    }

    pub(crate) fn has(&self, capability: &str) -> bool {
        self.capabilities.get(capability).is_some()
    }
}

impl FederatedLink {
    pub fn member_count(&self) -> usize {
        self.members.len()
    }

    /// Whether a member is reached over HTTP: then the session can go on elsewhere.
    pub fn has_http_member(&self) -> bool {
        self.members
            .iter()
            .any(|m| matches!(m.link, Some(UpstreamLink::Http { .. })))
    }

    /// What the session's record holds of each member, for the session `session_id`
    /// (see [`crate::adoption::MemberRecord`]).
    pub(crate) fn record_members(
        &self,
        session_id: &str,
        keys: &AdoptionKeys,
    ) -> Result<Vec<MemberRecord>, String> {
        self.members
            .iter()
            .map(|member| {
                let http = match &member.link {
                    Some(UpstreamLink::Http { session_id }) => Some(MemberSession {
                        session_id: session_id
                            .as_ref()
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned),
                        protocol_version: member.version.to_str().unwrap_or_default().to_owned(),
                    }),
                    _ => None,
                };
                adoption::member_record(
                    session_id,
                    member.name(),
                    http.as_ref(),
                    &member.capabilities,
                    keys,
                )
            })
            .collect()
    }

    /// Marks `member` lost with `why` (once), logs it and tells the client's `GET`
    /// stream that the lists changed.
    pub(crate) fn mark_lost(&self, member: &Member, why: &str) {
        mark_lost(
            &self.server,
            member.name(),
            &member.health,
            &self.get_stream,
            why,
        );
    }
}

/// Marks a member lost with `why` (once), logs it and tells the session's `GET` stream
/// that the lists changed.
pub(crate) fn mark_lost(
    server: &str,
    member: &str,
    health: &MemberHealth,
    get_stream: &StreamLog,
    why: &str,
) {
    {
        let mut lost = health.lost.lock();
        if lost.is_some() {
            return;
        }
        *lost = Some(why.to_owned());
    }
    warn!(server = %server, member = %member, "member of a virtual server's session lost: {why}; its names leave the lists, it is not reopened");
    for kind in ["tools", "prompts", "resources"] {
        get_stream.push_message(
            json!({"jsonrpc": "2.0", "method": format!("notifications/{kind}/list_changed")})
                .to_string()
                .as_bytes(),
        );
    }
}
