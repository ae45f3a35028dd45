//! Virtual servers (`[[server]]`): one route whose client sessions each hold one
//! upstream session per member, opened together at `initialize` on the worker that
//! owns the client session.
//!
//! A federated session is an ordinary session whose link is [`FederatedLink`]: the
//! decision table, forwarding over the mesh, ownership, idle expiry and drain treat
//! it like any other, and only the last step (the exchange with "the upstream") is
//! different: `open.rs` opens and ends the members' sessions, this file answers the
//! client's messages from them (merged lists, calls routed by exposed name, `ping`
//! answered here), and `names.rs` decides which names are exposed.
//!
//! A member whose upstream session is lost (its process exited, its server forgot the
//! session) is marked lost and never reopened behind the client's session: calls to
//! its names are answered `member_lost`, its names leave the lists, the session's
//! `GET` stream gets `notifications/tools/list_changed`, and the other members go on.
//!
//! A session with HTTP members outlives its worker (`adopt.rs`): the worker that
//! adopts it rebuilds this link from the session's record, its stdio members lost.
//!
//! What members send outside a request reaches the session's `GET` stream
//! (`member_streams.rs`): an HTTP member's own `GET` stream, opened when the client
//! opens the session's, and what a stdio member writes outside a request.

mod adopt;
pub(crate) mod bounds;
mod ids;
mod member_streams;
pub(crate) mod modern;
pub(crate) mod names;
mod open;
mod resources;
pub(crate) mod uris;

use std::collections::HashMap;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tracing::warn;

use crate::config::PrefixRule;
use crate::execute::ACCEPT_BOTH;
use crate::execute::Executor;
use crate::execute::upstream::{UpstreamError, UpstreamReply, read_answer};
use crate::link::{FederatedLink, Kind, ListOf, Member, UpstreamLink};
use crate::mcp::{self, GatewayError};
use crate::reason::Reason;
use crate::reply::Reply;
use bounds::{CappedList, MemberCap, merge_off_thread};
use names::{Exposure, Listed, Owner};

/// JSON-RPC "invalid params": an unknown tool or prompt name, a cursor never issued.
const INVALID_PARAMS: i64 = -32602;
/// Pages of one member's list followed at most: a member whose cursors never end
/// would otherwise hold the list forever.
const MAX_LIST_PAGES: usize = 1000;
/// Largest member answer to a list or initialize read whole.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Why an HTTP member that answers 404 to its session id is lost.
const FORGOTTEN: &str = "the upstream no longer knows its session (it restarted or expired it)";

/// Why a stdio member of an adopted session is lost (after "its upstream process").
const PROCESS_LEFT_BEHIND: &str =
    "ended with the worker that held this session (a process cannot move to another worker)";

impl FederatedLink {
    /// The member that owns `name` of `kind`, from the catalog, refreshed once by a
    /// merged list when the name is not in it.
    async fn owner_of(&self, executor: &Executor<'_>, kind: Kind, name: &str) -> Option<Owner> {
        let known = |link: &FederatedLink| {
            link.catalog
                .lock()
                .get(&kind)
                .and_then(|names| names.get(name))
                .cloned()
        };
        if let Some(owner) = known(self) {
            return Some(owner);
        }
        {
            let mut refreshes = self.refreshes.lock().await;
            // A reading that ran while this waited may have found it.
            if let Some(owner) = known(self) {
                return Some(owner);
            }
            if self.may_refresh(&mut refreshes, kind.listing().method) {
                self.merged_list(executor, kind).await;
                if let Some(owner) = known(self) {
                    return Some(owner);
                }
            }
        }
        self.unlisted_owner_of(kind, name)
    }

    /// Whether an unknown name or URI may read `list` again now (at most once per
    /// the server's `unknown_refresh_ms` per session).
    fn may_refresh(&self, refreshes: &mut bounds::Refreshes, list: &'static str) -> bool {
        let now = tokio::time::Instant::now();
        refreshes.may_refresh(list, now, self.merge.unknown_refresh_interval)
    }

    /// The members the last merge of `list` cut.
    fn cut_members(&self, list: &'static str) -> Vec<usize> {
        self.cut.lock().get(list).cloned().unwrap_or_default()
    }

    /// A member that may own `name` though no catalog knows it: a lost member (the
    /// names of a member lost before this worker listed it, a stdio member of an
    /// adopted session, are in no catalog here, but its client listed them on the
    /// worker before, and is told the loss rather than "unknown"), or one the last
    /// list cut (the name may be beyond the cut: the member answers for itself). By
    /// its prefix, or, where names go unprefixed, by its filter.
    fn unlisted_owner_of(&self, kind: Kind, name: &str) -> Option<Owner> {
        let cut = self.cut_members(kind.listing().method);
        self.members.iter().enumerate().find_map(|(at, member)| {
            if member.lost().is_none() && !cut.contains(&at) {
                return None;
            }
            let prefixed = format!("{}{}", member.config.prefix, self.separator);
            let own = match (name.strip_prefix(&prefixed), self.rule) {
                (Some(own), PrefixRule::Always | PrefixRule::Conflicts) => own,
                (_, PrefixRule::Conflicts | PrefixRule::Never) => name,
                (None, PrefixRule::Always) => return None,
            };
            names::passes(kind.filter(&member.config), own).then(|| Owner {
                member: at,
                own: own.to_owned(),
            })
        })
    }

    /// Every live member's list of `kind`, followed page by page, merged and exposed
    /// by the server's rule; the catalog is renewed from it. Returns the list and the
    /// members missing from it or cut, with why.
    async fn merged_list(&self, executor: &Executor<'_>, kind: Kind) -> (Vec<Value>, Notes) {
        let Gathered {
            items,
            missing,
            unlisted,
            cut,
        } = self.gather(executor, kind.listing()).await;
        let filters: Vec<(String, crate::config::NameFilter)> = self
            .members
            .iter()
            .map(|member| {
                let filter = kind.filter(&member.config).clone();
                (member.config.prefix.clone(), filter)
            })
            .collect();
        let (rule, separator) = (self.rule, self.separator.clone());
        let count = items.iter().map(Vec::len).sum();
        let (exposure, merged) = merge_off_thread(count, move || {
            let mut items = items;
            merge_names(rule, &separator, &filters, &mut items)
        })
        .await;
        let Exposure {
            mut owners, hidden, ..
        } = exposure;
        for (name, loser, keeper) in &hidden {
            warn!(
                server = %self.server,
                "{} {name:?} of member {} is hidden: member {} (earlier in the configuration) exposes that name",
                kind.singular(),
                self.members[*loser].name(),
                self.members[*keeper].name()
            );
        }
        self.note_cut(kind.listing().method, &cut);
        let mut catalog = self.catalog.lock();
        let previous = catalog.remove(&kind).unwrap_or_default();
        // The names of a member missing from this list (lost, or failing now) stay
        // routable to it: their calls hear the loss, or the member's own answer.
        for (name, owner) in previous {
            if unlisted[owner.member] {
                owners.entry(name).or_insert(owner);
            }
        }
        catalog.insert(kind, owners);
        (merged, Notes { missing, cut })
    }

    /// Remembers which members the merge of `list` cut (from its notes).
    fn note_cut(&self, list: &'static str, cut: &[Value]) {
        let members = cut
            .iter()
            .filter_map(|note| {
                let name = note.get("member")?.as_str()?;
                self.members.iter().position(|m| m.name() == name)
            })
            .collect();
        self.cut.lock().insert(list, members);
    }

    /// Every member's whole list of `of`, at once: the items per member (none for a
    /// member that could not list), and which members are missing with why.
    async fn gather(&self, executor: &Executor<'_>, of: ListOf) -> Gathered {
        let count = |member: &Member, outcome| {
            let label = executor.worker.routes[member.config.index].label();
            executor
                .worker
                .metrics
                .member_request(&self.label, label, Some(of.method), outcome);
        };
        let listings = futures_util::future::join_all(self.members.iter().map(|member| async {
            if let Some(why) = member.lost() {
                count(member, "lost");
                return Err(format!("its upstream session was lost ({why})"));
            }
            let cap = MemberCap::of(&self.merge, of.method);
            if !member.has(of.capability) {
                return Ok(CappedList::new(cap));
            }
            let deadline = member.config.list_deadline(&executor.worker.config.limits);
            let listed =
                tokio::time::timeout(deadline, self.list_member(executor, member, of, cap))
                    .await
                    .unwrap_or_else(|_| Err(too_slow(of.method, deadline)));
            count(
                member,
                match (&listed, member.lost()) {
                    (Ok(_), _) => "answered",
                    (Err(_), Some(_)) => "lost",
                    (Err(_), None) => "failed",
                },
            );
            listed
        }))
        .await;
        let mut gathered = Gathered {
            items: Vec::with_capacity(listings.len()),
            missing: Vec::new(),
            unlisted: vec![false; listings.len()],
            cut: Vec::new(),
        };
        for (at, (member, listing)) in self.members.iter().zip(listings).enumerate() {
            match listing {
                Ok(list) => {
                    gathered.cut.extend(list.note(member.name()));
                    gathered.items.push(list.items);
                }
                Err(why) => {
                    gathered
                        .missing
                        .push(json!({ "member": member.name(), "why": why }));
                    gathered.unlisted[at] = true;
                    gathered.items.push(Vec::new());
                }
            }
        }
        gathered
    }

    /// One member's whole list of `of`, following its `nextCursor` to the end or to
    /// its `cap`.
    async fn list_member(
        &self,
        executor: &Executor<'_>,
        member: &Member,
        of: ListOf,
        cap: MemberCap,
    ) -> Result<CappedList, String> {
        let mut items = CappedList::new(cap);
        let mut cursor: Option<Value> = None;
        for _ in 0..MAX_LIST_PAGES {
            let mut request = json!({
                "jsonrpc": "2.0", "id": self.own_ids.next("list"),
                "method": of.method, "params": {},
            });
            if let Some(cursor) = cursor.take() {
                request["params"]["cursor"] = cursor;
            }
            let mut answer = self
                .exchange(executor, member, Bytes::from(request.to_string()))
                .await?;
            let Some(result) = answer.get_mut("result") else {
                return Err(format!("it answered {}: {answer}", of.method));
            };
            // Moved out of the answer, not copied: a merged list holds each member
            // item once.
            if let Some(Value::Array(list)) = result.get_mut(of.key).map(Value::take)
                && !items.take_page(of.method, list)
            {
                return Ok(items);
            }
            match result.get_mut("nextCursor").map(Value::take) {
                Some(next) if !next.is_null() => cursor = Some(next),
                _ => return Ok(items),
            }
        }
        Err(format!(
            "its {} did not end within {MAX_LIST_PAGES} pages",
            of.method
        ))
    }

    /// A request of the gateway's own to a member, answered whole: marks the member
    /// lost when its session turns out to be.
    async fn exchange(
        &self,
        executor: &Executor<'_>,
        member: &Member,
        body: Bytes,
    ) -> Result<Value, String> {
        let reply = executor
            .send_to_member(member, member_headers(&member.version, None), body)
            .await;
        match self.judge(member, reply) {
            Ok(reply) => {
                read_answer(
                    reply,
                    member.name(),
                    MAX_ANSWER_BYTES,
                    executor.worker.config.limits.upstream_request_timeout,
                )
                .await
            }
            Err(MemberFailure::Lost(why)) => Err(format!("its upstream session was lost ({why})")),
            Err(MemberFailure::LostWhileRunning(why)) => Err(format!(
                "its upstream session was lost while answering ({why})"
            )),
            Err(MemberFailure::Failed(e)) => Err(e.to_string()),
        }
    }

    /// Sorts a member's answer: a session the member no longer has (404 to its
    /// session id, or its process gone) marks it lost.
    fn judge(
        &self,
        member: &Member,
        reply: Result<UpstreamReply, UpstreamError>,
    ) -> Result<UpstreamReply, MemberFailure> {
        match reply {
            Ok(reply)
                if reply.status == StatusCode::NOT_FOUND
                    && matches!(
                        member.link,
                        Some(UpstreamLink::Http {
                            session_id: Some(_)
                        })
                    ) =>
            {
                self.mark_lost(member, FORGOTTEN);
                Err(MemberFailure::Lost(FORGOTTEN.to_owned()))
            }
            Ok(reply) => Ok(reply),
            Err(UpstreamError::Exited { detail, .. }) => {
                let why = format!("its upstream process {detail}");
                self.mark_lost(member, &why);
                Err(MemberFailure::Lost(why))
            }
            Err(UpstreamError::ExitedWhileRunning { detail, .. }) => {
                let why = format!("its upstream process {detail}");
                self.mark_lost(member, &why);
                Err(MemberFailure::LostWhileRunning(why))
            }
            Err(e) => Err(MemberFailure::Failed(e)),
        }
    }
}

/// Every member's list of one method, in the session's member order.
struct Gathered {
    /// Each member's items (empty for a member in `missing`).
    items: Vec<Vec<Value>>,
    /// `{member, why}` of each member that could not list.
    missing: Vec<Value>,
    /// Per member: it is in `missing`.
    unlisted: Vec<bool>,
    /// `{member, listed, why}` of each member whose list was cut at its bound.
    cut: Vec<Value>,
}

/// What a merged list's `_meta["mcpgw/federation"]` says of its members.
pub(super) struct Notes {
    /// `{member, why}` of each member that could not list.
    pub missing: Vec<Value>,
    /// `{member, listed, why}` of each member cut at its bound.
    pub cut: Vec<Value>,
}

impl Notes {
    /// Puts the notes (and `hidden`, when any) under `_meta["mcpgw/federation"]`.
    pub(super) fn into_meta(self, listed: &mut Value, hidden: Vec<Value>) {
        let mut federation = serde_json::Map::new();
        for (key, notes) in [
            ("missing", self.missing),
            ("hidden", hidden),
            ("cut", self.cut),
        ] {
            if !notes.is_empty() {
                federation.insert(key.into(), Value::from(notes));
            }
        }
        if !federation.is_empty() {
            listed["_meta"] = json!({ "mcpgw/federation": federation });
        }
    }
}

/// The members' lists of names merged by `rule`: the exposure, and the exposed items
/// moved out of `items` and renamed. Each item is looked at a bounded number of times
/// (hash maps, no search), so a merge is linear in the items.
pub(super) fn merge_names(
    rule: crate::config::PrefixRule,
    separator: &str,
    members: &[(String, crate::config::NameFilter)],
    items: &mut [Vec<Value>],
) -> (Exposure, Vec<Value>) {
    let listed: Vec<Listed<'_>> = members
        .iter()
        .zip(items.iter())
        .map(|((prefix, filter), list)| Listed {
            prefix,
            filter,
            names: list
                .iter()
                .filter_map(|item| item.get("name")?.as_str().map(str::to_owned))
                .collect(),
        })
        .collect();
    let mut exposure = names::expose(rule, separator, &listed);
    let exposed = std::mem::take(&mut exposure.exposed);
    let merged = take_exposed(items, exposed);
    (exposure, merged)
}

/// The merged list: each exposed item moved out of its member's list (not copied;
/// `Null` is left in its place) and renamed. A member that lists a name twice is
/// exposed with the first item.
pub(super) fn take_exposed(items: &mut [Vec<Value>], exposed: Vec<(String, Owner)>) -> Vec<Value> {
    let taken = take_items(items, &exposed, "name");
    let mut merged = Vec::with_capacity(exposed.len());
    for ((name, _), item) in exposed.into_iter().zip(taken) {
        if let Some(mut item) = item {
            item["name"] = Value::from(name);
            merged.push(item);
        }
    }
    merged
}

/// Each exposed item moved out of its member's list (`Null` left in its place), found
/// by its `key` through one hash map per member (the first item of a repeated key):
/// each item is looked at once. `None` where the member has no such item (or gave it
/// already).
pub(super) fn take_items(
    items: &mut [Vec<Value>],
    exposed: &[(String, Owner)],
    key: &str,
) -> Vec<Option<Value>> {
    let picks: Vec<Option<(usize, usize)>> = {
        let positions: Vec<HashMap<&str, usize>> = items
            .iter()
            .map(|list| {
                let mut at = HashMap::with_capacity(list.len());
                for (index, item) in list.iter().enumerate() {
                    if let Some(identity) = item.get(key).and_then(Value::as_str) {
                        at.entry(identity).or_insert(index);
                    }
                }
                at
            })
            .collect();
        exposed
            .iter()
            .map(|(_, owner)| {
                let index = positions.get(owner.member)?.get(owner.own.as_str())?;
                Some((owner.member, *index))
            })
            .collect()
    };
    picks
        .into_iter()
        .map(|pick| {
            let (member, index) = pick?;
            let item = items[member][index].take();
            (!item.is_null()).then_some(item)
        })
        .collect()
}

/// Why a member did not answer.
enum MemberFailure {
    /// Its session is gone; the request never ran there.
    Lost(String),
    /// Its session went while it ran the request: it may have run.
    LostWhileRunning(String),
    /// Any other failure (unreachable, timeout): its session may still live.
    Failed(UpstreamError),
}

/// Headers of an exchange with a member, in the version it negotiated.
fn member_headers(version: &HeaderValue, client: Option<&HeaderMap>) -> HeaderMap {
    let mut headers = client.cloned().unwrap_or_default();
    headers.remove(mcp::HEADER_SESSION_ID);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if !headers.contains_key(http::header::ACCEPT) {
        headers.insert(http::header::ACCEPT, ACCEPT_BOTH);
    }
    headers.insert(mcp::HEADER_PROTOCOL_VERSION, version.clone());
    headers
}

/// A complete JSON answer to the client, as the session's "upstream" gives it.
fn answer(message: Value) -> UpstreamReply {
    answer_body(Bytes::from(message.to_string()))
}

/// A complete JSON answer of `body`, a JSON-RPC message's text.
fn answer_body(body: Bytes) -> UpstreamReply {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    UpstreamReply {
        status: StatusCode::OK,
        headers,
        body: crate::body::full(body),
    }
}

fn result(id: &Value, result: Value) -> UpstreamReply {
    answer(json!({ "jsonrpc": "2.0", "id": id, "result": result }))
}

fn error(id: &Value, code: i64, message: String) -> UpstreamReply {
    answer(json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } }))
}

/// A gateway error as the session's "upstream" answer.
fn from_gateway_error(error: &GatewayError) -> UpstreamReply {
    let reply = Reply::from_error(error);
    UpstreamReply {
        status: reply.status,
        headers: reply.headers,
        body: reply.body,
    }
}

impl Executor<'_> {
    /// One exchange with the member in its session. A member without a link answers
    /// as a process that ended (the reason it was lost with).
    async fn send_to_member(
        &self,
        member: &Member,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<UpstreamReply, UpstreamError> {
        match &member.link {
            Some(link) => {
                let route = &self.worker.routes[member.config.index];
                self.send_on_link(route, link, Method::POST, headers, body)
                    .await
            }
            None => Err(UpstreamError::Exited {
                name: member.name().to_owned(),
                detail: PROCESS_LEFT_BEHIND.to_owned(),
            }),
        }
    }

    /// One client message in a federated session, answered as the session's upstream
    /// would answer it. Never `Exited`: a member's end is that member's, not the
    /// session's.
    pub(crate) async fn send_federated(
        &self,
        link: &FederatedLink,
        method: Method,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<UpstreamReply, UpstreamError> {
        if method != Method::POST {
            return Err(UpstreamError::Failed {
                name: link.server.clone(),
                detail: format!(
                    "{method} has no meaning for a virtual server (its GET stream lives as long as the session)"
                ),
            });
        }
        let Ok(message) = serde_json::from_slice::<Value>(&body) else {
            return Ok(error(
                &Value::Null,
                mcp::code::PARSE_ERROR,
                "the message is not JSON".into(),
            ));
        };
        Ok(self.answer_federated(link, headers, body, message).await)
    }

    /// One client message in a federated session, `message` being `body` parsed (the
    /// front door parsed it already: a call costs no second parse).
    pub(crate) async fn answer_federated(
        &self,
        link: &FederatedLink,
        headers: HeaderMap,
        body: Bytes,
        message: Value,
    ) -> UpstreamReply {
        let id = message.get("id").cloned();
        let method = message.get("method").and_then(Value::as_str);
        let (Some(id), Some(method)) = (id, method) else {
            return self.pass_to_members(link, &headers, body).await;
        };
        if let Some(refused) = refuse_cursor(link, &id, &message) {
            return refused;
        }
        match method {
            "ping" => result(&id, json!({})),
            "tools/list" => list_names(self, link, Kind::Tools, &id).await,
            "prompts/list" => list_names(self, link, Kind::Prompts, &id).await,
            "tools/call" => {
                self.call_member(link, Kind::Tools, &id, message, headers)
                    .await
            }
            "prompts/get" => {
                self.call_member(link, Kind::Prompts, &id, message, headers)
                    .await
            }
            "resources/list" => {
                self.list_resources(link, resources::ResourceList::Resources, &id)
                    .await
            }
            "resources/templates/list" => {
                self.list_resources(link, resources::ResourceList::Templates, &id)
                    .await
            }
            "resources/read" | "resources/subscribe" | "resources/unsubscribe" => {
                self.resource_request(link, &id, message, headers).await
            }
            "completion/complete" => self.complete(link, &id, message, headers).await,
            "logging/setLevel" => {
                self.pass_to_members(link, &headers, body).await;
                result(&id, json!({}))
            }
            other => error(
                &id,
                mcp::code::METHOD_NOT_FOUND,
                format!(
                    "{other} is not served by virtual server {} (it serves tools, prompts, \
                     resources, resource templates, completion, ping and logging/setLevel)",
                    link.server
                ),
            ),
        }
    }

    /// A call for an exposed name: sent to the member that owns it under its own
    /// name; its answer (JSON, or a stream with progress) is relayed as it came.
    async fn call_member(
        &self,
        link: &FederatedLink,
        kind: Kind,
        id: &Value,
        mut message: Value,
        headers: HeaderMap,
    ) -> UpstreamReply {
        let name = message["params"]
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let Some(owner) = link.owner_of(self, kind, &name).await else {
            return error(
                id,
                INVALID_PARAMS,
                format!(
                    "unknown {} {name:?} on virtual server {}",
                    kind.singular(),
                    link.server
                ),
            );
        };
        message["params"]["name"] = Value::from(owner.own);
        self.relay(link, owner.member, id, message, headers).await
    }

    /// A client request for the member at `at`, its answer (JSON, or a stream with
    /// progress) relayed as it came; a lost member's loss told instead.
    async fn relay(
        &self,
        link: &FederatedLink,
        at: usize,
        id: &Value,
        message: Value,
        headers: HeaderMap,
    ) -> UpstreamReply {
        let member = &link.members[at];
        let method = message
            .get("method")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let count = |outcome| {
            let label = self.worker.routes[member.config.index].label();
            self.worker
                .metrics
                .member_request(&link.label, label, method.as_deref(), outcome);
        };
        if let Some(why) = member.lost() {
            count("lost");
            return from_gateway_error(&member_lost(link, member, &why, id));
        }
        let reply = self
            .send_to_member(
                member,
                member_headers(&member.version, Some(&headers)),
                Bytes::from(message.to_string()),
            )
            .await;
        let judged = link.judge(member, reply);
        count(match &judged {
            Ok(_) => "answered",
            Err(MemberFailure::Lost(_)) => "lost",
            Err(MemberFailure::LostWhileRunning(_)) => "outcome_unknown",
            Err(MemberFailure::Failed(_)) => "failed",
        });
        match judged {
            Ok(reply) => self.tag_member_requests(member.name(), reply),
            Err(MemberFailure::Lost(why)) => {
                from_gateway_error(&member_lost(link, member, &why, id))
            }
            Err(MemberFailure::LostWhileRunning(why)) => {
                let error = GatewayError::gateway(
                    StatusCode::OK,
                    Reason::OutcomeUnknown,
                    format!(
                        "outcome unknown: member {} of virtual server {} lost its upstream \
                         session ({why}) while running this call; it may have run, and it was \
                         not re-run. Its state is lost and it is not reopened; the other \
                         members go on",
                        member.name(),
                        link.server
                    ),
                )
                .with_data(
                    json!({ "member": member.name(), "member_lost": true, "retryable": false }),
                )
                .with_id(id.clone());
                from_gateway_error(&error)
            }
            Err(MemberFailure::Failed(e)) => {
                from_gateway_error(&crate::execute::upstream_error(e, id.clone()))
            }
        }
    }

    /// A member's answer stream, with the requests it sends the client on it under
    /// ids that name the member ([`ids`]).
    fn tag_member_requests(&self, member: &str, mut reply: UpstreamReply) -> UpstreamReply {
        if crate::execute::is_sse(&reply.headers) {
            let max_event = self.worker.config.limits.max_sse_event_bytes;
            let body = std::mem::replace(&mut reply.body, crate::body::full(Bytes::new()));
            let member = member.to_owned();
            reply.body =
                crate::body::rewrite_events(body, max_event, move |e| ids::tag_event(&member, e));
        }
        reply
    }

    /// Sends a client's notification or response to `member`; its answer (an ack) is
    /// read and dropped, a lost session marked.
    async fn deliver(
        &self,
        link: &FederatedLink,
        member: &Member,
        headers: &HeaderMap,
        body: Bytes,
    ) {
        let reply = self
            .send_to_member(member, member_headers(&member.version, Some(headers)), body)
            .await;
        if let Ok(reply) = link.judge(member, reply) {
            let _ = reply.body.collect().await;
        }
    }

    /// A notification or response of the client: an answer to a member's request to
    /// the member that asked, under its own id ([`ids`]); anything else to every live
    /// member (the client's `notifications/initialized` was sent to each at
    /// initialize already).
    async fn pass_to_members(
        &self,
        link: &FederatedLink,
        headers: &HeaderMap,
        body: Bytes,
    ) -> UpstreamReply {
        let mut message = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
        let initialized = message
            .get("method")
            .and_then(Value::as_str)
            .is_some_and(|m| m == "notifications/initialized");
        let live = |member: &&Member| member.lost().is_none();
        if let Some(tagged) = ids::untag(&mut message) {
            let member = match tagged {
                ids::TaggedFor::Named(name) => link.members.iter().find(|m| m.name() == name),
                ids::TaggedFor::Place(at) => link.members.get(at),
            };
            if let Some(member) = member.filter(live) {
                let body = Bytes::from(message.to_string());
                self.deliver(link, member, headers, body).await;
            }
        } else if !initialized {
            let members = link.members.iter().filter(live);
            futures_util::future::join_all(
                members.map(|member| self.deliver(link, member, headers, body.clone())),
            )
            .await;
        }
        UpstreamReply {
            status: StatusCode::ACCEPTED,
            headers: HeaderMap::new(),
            body: crate::body::full(Bytes::new()),
        }
    }
}

/// Why a member is missing from a merged list it did not answer in time.
fn too_slow(method: &str, deadline: std::time::Duration) -> String {
    format!(
        "it did not answer {method} within {} ms (its list_timeout_ms); the list was \
         returned without it",
        deadline.as_millis()
    )
}

/// A list method's `cursor`: refused, since every merged list is returned whole.
fn refuse_cursor(link: &FederatedLink, id: &Value, message: &Value) -> Option<UpstreamReply> {
    let method = message.get("method").and_then(Value::as_str)?;
    let listing = matches!(
        method,
        "tools/list" | "prompts/list" | "resources/list" | "resources/templates/list"
    );
    let cursor = message["params"]
        .get("cursor")
        .is_some_and(|c| !c.is_null());
    (listing && cursor).then(|| {
        error(
            id,
            INVALID_PARAMS,
            format!(
                "virtual server {} returns its whole list in one page and issued no cursor",
                link.server
            ),
        )
    })
}

/// `tools/list` or `prompts/list`: the merged list, with the members missing from it.
async fn list_names(
    executor: &Executor<'_>,
    link: &FederatedLink,
    kind: Kind,
    id: &Value,
) -> UpstreamReply {
    let (list, notes) = link.merged_list(executor, kind).await;
    let count = list.len();
    let mut listed = json!({ kind.key(): list });
    notes.into_meta(&mut listed, Vec::new());
    result_off_thread(id, listed, count).await
}

/// `result`, its text written off the runtime's threads when it holds many items.
async fn result_off_thread(id: &Value, result: Value, items: usize) -> UpstreamReply {
    let id = id.clone();
    let body = merge_off_thread(items, move || {
        let message = json!({ "jsonrpc": "2.0", "id": id, "result": result });
        Bytes::from(message.to_string())
    })
    .await;
    answer_body(body)
}

/// A call for a lost member's name: 200 with a JSON-RPC error, since the client's
/// session itself goes on (a 404 would tell an SDK client its whole session ended).
fn member_lost(link: &FederatedLink, member: &Member, why: &str, id: &Value) -> GatewayError {
    GatewayError::gateway(
        StatusCode::OK,
        Reason::MemberLost,
        format!(
            "member {} of virtual server {} is lost: its upstream session ended ({why}) and \
             its state is lost; it is not reopened in this session (initialize a new session \
             for a fresh one); the other members go on",
            member.name(),
            link.server
        ),
    )
    .with_data(json!({ "member": member.name(), "detail": why, "retryable": false }))
    .with_id(id.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_items_are_moved_out_renamed_in_exposure_order_and_a_repeated_name_once() {
        let items = vec![
            vec![
                json!({"name": "echo", "description": "first"}),
                json!({"name": "echo", "description": "repeated"}),
                json!({"description": "nameless"}),
            ],
            vec![json!({"name": "now"})],
        ];
        let owner = |member, own: &str| Owner {
            member,
            own: own.to_owned(),
        };
        let exposed = vec![
            ("time__now".to_owned(), owner(1, "now")),
            ("demo__echo".to_owned(), owner(0, "echo")),
            ("demo__gone".to_owned(), owner(0, "gone")),
        ];
        assert_eq!(
            take_exposed(&mut items.clone(), exposed),
            vec![
                json!({"name": "time__now"}),
                json!({"name": "demo__echo", "description": "first"}),
            ]
        );
    }

    #[test]
    fn the_notes_name_missing_hidden_and_cut_members_under_the_federation_key() {
        let mut listed = json!({ "resources": [] });
        let notes = Notes {
            missing: vec![json!({"member": "a", "why": "down"})],
            cut: vec![json!({"member": "b", "listed": 10, "why": "too many"})],
        };
        notes.into_meta(
            &mut listed,
            vec![json!({"uri": "u", "member": "b", "kept_by": "a"})],
        );
        let federation = &listed["_meta"]["mcpgw/federation"];
        assert_eq!(federation["missing"][0]["member"], "a");
        assert_eq!(federation["hidden"][0]["kept_by"], "a");
        assert_eq!(federation["cut"][0]["listed"], 10);

        let mut quiet = json!({ "tools": [] });
        let none = Notes {
            missing: Vec::new(),
            cut: Vec::new(),
        };
        none.into_meta(&mut quiet, Vec::new());
        assert!(quiet.get("_meta").is_none(), "no notes, no _meta");
    }

    /// 200,000 tools of two members, prefixed: a correctness test at a size a search
    /// per item could not finish.
    #[test]
    fn two_hundred_thousand_names_merge_each_once() {
        const EACH: usize = 100_000;
        let all = crate::config::NameFilter::default();
        let members = [("a".to_owned(), all.clone()), ("b".to_owned(), all)];
        let list = |from: &str| -> Vec<Value> {
            (0..EACH)
                .map(|n| json!({ "name": format!("t{n}"), "from": from }))
                .collect()
        };
        let mut items = vec![list("a"), list("b")];
        let (exposure, merged) = merge_names(
            crate::config::PrefixRule::Conflicts,
            "__",
            &members,
            &mut items,
        );
        assert_eq!(merged.len(), 2 * EACH);
        assert_eq!(exposure.owners.len(), 2 * EACH);
        assert_eq!(merged[0], json!({"name": "a__t0", "from": "a"}));
        assert_eq!(merged[EACH], json!({"name": "b__t0", "from": "b"}));
        assert!(exposure.hidden.is_empty());
    }
}
