//! 2026-07-28 clients on a virtual server. Such a client has no session, so nothing
//! of the legacy path's [`super::FederatedLink`] exists for it: each request is
//! answered by whichever worker receives it, from member calls made for it.
//!
//! A member call is the request the client would have sent to the member's own route
//! (`/servers/{member}/mcp`), rewritten to the member's own name, and it runs through
//! [`crate::dispatch::Router::dispatch`] exactly as that request would: a stateless HTTP member is
//! called straight from here; a stateful member (stdio, `legacy_only`) runs in the
//! session its principal shares on that route (`execute/shared.rs`), wherever in the
//! fleet that session lives, with its loss told once like on the plain route. So the
//! principal's state on a stateful member is the same through the virtual server and
//! through the member's own route: one session per (principal, upstream).
//!
//! Lists are merged from every member (each followed page by page), exposed by the
//! same rule and filters as for legacy sessions (`names.rs`); a member that fails is
//! left out of the list, which says so in `_meta`, and its calls get its own error,
//! naming it. Calls find their member by prefix when the rule allows no doubt, else
//! from a merged list, or from what recent lists said while their `ttlMs` allows
//! (`catalog.rs`). Resources, templates and completion follow the sessions' rules
//! (`modern/resources.rs`); the revision has no `resources/subscribe`.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use serde_json::{Value, json};
use tracing::debug;

pub(crate) mod catalog;
mod resources;

use super::bounds::{CappedList, MemberCap, merge_off_thread};
use super::names;
use super::resources::ResourceList;
use super::{INVALID_PARAMS, MAX_ANSWER_BYTES, MAX_LIST_PAGES};
use crate::config::{MemberConfig, PrefixRule};
use crate::dispatch::Router;
use crate::execute::Executor;
use crate::execute::upstream::{Upstream, UpstreamReply, VirtualUpstream, read_answer};
use crate::link::{Kind, ListOf};
use crate::mcp::{self, Era, GatewayError};
use crate::reason::Reason;
use crate::reply::Reply;
use crate::request::{self, Call};

/// A member call's answer, boxed: a member call re-enters the dispatch that brought
/// the client's request here.
type Dispatched<'a> = Pin<Box<dyn Future<Output = Result<Reply, GatewayError>> + Send + 'a>>;

/// One member's whole list of a kind (within its cap), with the caching hints its
/// last page gave.
struct MemberList {
    items: CappedList,
    hints: CacheHints,
}

/// What members said about reusing their lists (2026-07-28 `ttlMs`, `cacheScope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CacheHints {
    /// The smallest `ttlMs` given; None: none was.
    ttl_ms: Option<u64>,
    /// Every list was `cacheScope: "public"`.
    public: bool,
}

impl CacheHints {
    /// Before any list: nothing binds yet.
    const NONE: CacheHints = CacheHints {
        ttl_ms: None,
        public: true,
    };

    fn and(self, other: CacheHints) -> CacheHints {
        CacheHints {
            ttl_ms: min_ttl(self.ttl_ms, other.ttl_ms),
            public: self.public && other.public,
        }
    }

    /// The hints of a merged list: 2026-07-28 list results carry both, so a list no
    /// member gave a `ttlMs` for (or missing a member: ask again soon) says 0, and it is
    /// public only when every member's was.
    fn of_answer(self, complete: bool, listed_any: bool) -> (u64, &'static str) {
        let ttl = if complete {
            self.ttl_ms.unwrap_or(0)
        } else {
            0
        };
        let public = self.public && listed_any;
        (ttl, if public { "public" } else { "private" })
    }
}

/// Every member's whole list of one method, as gathered for one client request.
struct MemberLists {
    /// Each member's items, in the server's member order (empty for one in `missing`).
    items: Vec<Vec<Value>>,
    /// `{member, why}` of each member that could not list.
    missing: Vec<Value>,
    /// Positions (in the server's members) of the members left out.
    unlisted: Vec<usize>,
    /// `{member, listed, why}` of each member whose list was cut at its bound.
    cut: Vec<Value>,
    /// Positions of the members cut: a name or URI no list has may be theirs.
    cut_members: Vec<usize>,
    hints: CacheHints,
}

impl MemberLists {
    /// How long what these lists say may be reused: a complete set's smallest `ttlMs`.
    fn reusable_for(&self) -> Option<std::time::Duration> {
        let complete = self.missing.is_empty() && self.cut.is_empty();
        let ttl = self.hints.ttl_ms.filter(|_| complete)?;
        Some(std::time::Duration::from_millis(ttl))
    }

    /// A 2026-07-28 list result of these lists' `items` under `key`; `hidden` names
    /// what was left out for a name or URI an earlier member has.
    async fn answer(&self, id: &Value, key: &str, items: Vec<Value>, hidden: Vec<Value>) -> Reply {
        let listed_any = self.unlisted.len() < self.items.len();
        let complete = self.missing.is_empty() && self.cut.is_empty();
        let (ttl, scope) = self.hints.of_answer(complete, listed_any);
        let count = items.len();
        let mut result = json!({
            key: items, "resultType": "complete", "ttlMs": ttl, "cacheScope": scope,
        });
        let notes = super::Notes {
            missing: self.missing.clone(),
            cut: self.cut.clone(),
        };
        notes.into_meta(&mut result, hidden);
        let id = id.clone();
        let body = merge_off_thread(count, move || {
            let body = json!({ "jsonrpc": "2.0", "id": id, "result": result });
            Bytes::from(body.to_string())
        })
        .await;
        Reply::json(StatusCode::OK, body)
    }
}

/// Every member's list of a kind merged: the exposed items, and the owner of each
/// exposed name.
struct Merged {
    items: Vec<Value>,
    owners: std::collections::HashMap<String, names::Owner>,
    lists: MemberLists,
}

impl Executor<'_> {
    /// A 2026-07-28 request on the virtual server `call` addresses, answered here.
    pub(crate) async fn serve_federated_modern(&self, call: Call) -> Result<Reply, GatewayError> {
        let Upstream::Virtual(server) = self.worker.routes[call.upstream].upstream() else {
            return Err(GatewayError::session_not_found().with_id(call.id()));
        };
        let id = call.id();
        let message = call.message.as_ref();
        let method = message.and_then(|m| m.method()).map(str::to_owned);
        let is_request = message.is_some_and(|m| m.json().get("id").is_some());
        let (Some(method), true) = (method, is_request) else {
            // Notifications and responses have no member to go to without a session
            // (a 2026-07-28 client's cancellation ends its own HTTP request).
            return Ok(accepted());
        };
        Ok(match method.as_str() {
            "server/discover" => discover(&id, &server.name),
            "ping" => Reply::json(
                StatusCode::OK,
                Bytes::from(json!({"jsonrpc": "2.0", "id": id, "result": {}}).to_string()),
            ),
            "tools/list" => self.answer_list(server, &call, Kind::Tools).await,
            "prompts/list" => self.answer_list(server, &call, Kind::Prompts).await,
            "tools/call" => return self.call_owner(server, &call, Kind::Tools).await,
            "prompts/get" => return self.call_owner(server, &call, Kind::Prompts).await,
            "resources/list" => {
                self.answer_resource_list(server, &call, ResourceList::Resources)
                    .await
            }
            "resources/templates/list" => {
                self.answer_resource_list(server, &call, ResourceList::Templates)
                    .await
            }
            "resources/read" => return self.read_resource(server, &call).await,
            "completion/complete" => return self.complete_modern(server, &call).await,
            other => not_served(&id, other, &server.name),
        })
    }

    /// `tools/list` or `prompts/list`: every member's list, merged whole.
    async fn answer_list(&self, server: &VirtualUpstream, call: &Call, kind: Kind) -> Reply {
        let id = call.id();
        if let Some(refused) = refuse_cursor(call, &server.name) {
            return refused;
        }
        let merged = self.merged_modern_list(server, call, kind).await;
        merged
            .lists
            .answer(&id, kind.key(), merged.items, Vec::new())
            .await
    }

    /// Every member's list of `kind`, merged and exposed by the server's rule.
    async fn merged_modern_list(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        kind: Kind,
    ) -> Merged {
        let members = &server.server.members;
        let mut lists = self.gather_modern(server, call, kind.listing()).await;
        let filters: Vec<(String, crate::config::NameFilter)> = members
            .iter()
            .map(|member| (member.prefix.clone(), kind.filter(member).clone()))
            .collect();
        let (rule, separator) = (server.server.prefix, server.server.separator.clone());
        let mut items = std::mem::take(&mut lists.items);
        let count = items.iter().map(Vec::len).sum();
        let (exposure, merged, items) = merge_off_thread(count, move || {
            let (exposure, merged) = super::merge_names(rule, &separator, &filters, &mut items);
            // The lists go back emptied: only their number is read after.
            items.iter_mut().for_each(Vec::clear);
            (exposure, merged, items)
        })
        .await;
        lists.items = items;
        for (name, loser, keeper) in &exposure.hidden {
            debug!(server = %server.name, "{} {name:?} of member {} is hidden by member {}",
                kind.singular(), members[*loser].upstream, members[*keeper].upstream);
        }
        let principal = &call.auth.subject;
        let ttl = lists.reusable_for();
        server
            .catalogs
            .keep_names(principal, kind, &exposure.owners, ttl);
        Merged {
            items: merged,
            owners: exposure.owners,
            lists,
        }
    }

    /// Every member's whole list of `of`, at once, each within its list deadline.
    async fn gather_modern(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        of: ListOf,
    ) -> MemberLists {
        let members = &server.server.members;
        let listings = futures_util::future::join_all(members.iter().map(|member| async move {
            let deadline = member.list_deadline(&self.worker.config.limits);
            let cap = MemberCap::of(&server.server.merge, of.method);
            let listed = self.list_member_modern(server, call, member, of, cap);
            tokio::time::timeout(deadline, listed)
                .await
                .unwrap_or_else(|_| Err(super::too_slow(of.method, deadline)))
        }))
        .await;
        let mut lists = MemberLists {
            items: Vec::with_capacity(members.len()),
            missing: Vec::new(),
            unlisted: Vec::new(),
            cut: Vec::new(),
            cut_members: Vec::new(),
            hints: CacheHints::NONE,
        };
        for (at, (member, listing)) in members.iter().zip(listings).enumerate() {
            match listing {
                Ok(list) => {
                    lists.hints = lists.hints.and(list.hints);
                    if let Some(note) = list.items.note(&member.upstream) {
                        lists.cut.push(note);
                        lists.cut_members.push(at);
                    }
                    lists.items.push(list.items.items);
                }
                Err(why) => {
                    lists
                        .missing
                        .push(json!({ "member": member.upstream, "why": why }));
                    lists.unlisted.push(at);
                    lists.items.push(Vec::new());
                }
            }
        }
        lists
    }

    /// One member's whole list of `of`, following its `nextCursor` to the end, or why
    /// it could not be had.
    async fn list_member_modern(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        member: &MemberConfig,
        of: ListOf,
        cap: MemberCap,
    ) -> Result<MemberList, String> {
        let mut list = MemberList {
            items: CappedList::new(cap),
            hints: CacheHints::NONE,
        };
        let mut cursor: Option<Value> = None;
        for _ in 0..MAX_LIST_PAGES {
            let mut page = list_request(call, of.method);
            if let Some(cursor) = cursor.take() {
                page["params"]["cursor"] = cursor;
            }
            let reply = self
                .member_call(server, call, member, &page, None)
                .await
                .map_err(|e| e.message)?;
            let reply = UpstreamReply {
                status: reply.status,
                headers: reply.headers,
                body: reply.body,
            };
            let timeout = self.worker.config.limits.upstream_request_timeout;
            let mut answer =
                read_answer(reply, &member.upstream, MAX_ANSWER_BYTES, timeout).await?;
            let Some(result) = answer.get_mut("result") else {
                return Err(format!("it answered {}: {answer}", of.method));
            };
            list.hints = list.hints.and(CacheHints {
                ttl_ms: result.get("ttlMs").and_then(Value::as_u64),
                public: result.get("cacheScope").and_then(Value::as_str) == Some("public"),
            });
            // Moved out of the answer, not copied, as for sessions.
            if let Some(Value::Array(items)) = result.get_mut(of.key).map(Value::take)
                && !list.items.take_page(of.method, items)
            {
                return Ok(list);
            }
            match result.get_mut("nextCursor").map(Value::take) {
                Some(next) if !next.is_null() => cursor = Some(next),
                _ => return Ok(list),
            }
        }
        Err(format!(
            "its {} did not end within {MAX_LIST_PAGES} pages",
            of.method
        ))
    }

    /// `tools/call` or `prompts/get`: sent to the member that owns the exposed name,
    /// under the member's own name; its answer (JSON, or a stream) relayed as it came.
    async fn call_owner(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        kind: Kind,
    ) -> Result<Reply, GatewayError> {
        let id = call.id();
        let mut message = call.message_copy();
        let name = message["params"]
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let Some((member, own)) = self.owner_of_modern(server, call, kind, &name).await else {
            return Ok(rpc_error(
                &id,
                INVALID_PARAMS,
                format!(
                    "unknown {} {name:?} on virtual server {}",
                    kind.singular(),
                    server.name
                ),
            ));
        };
        message["params"]["name"] = Value::from(own.as_str());
        self.member_call(server, call, member, &message, Some(&own))
            .await
    }

    /// The member that owns the exposed `name` and its own name for it. By prefix
    /// where the rule leaves one candidate; else from a merged list; a name no list
    /// has goes to a member left out of it that could own it, whose call then tells
    /// why it is missing.
    async fn owner_of_modern<'s>(
        &self,
        server: &'s VirtualUpstream,
        call: &Call,
        kind: Kind,
        name: &str,
    ) -> Option<(&'s MemberConfig, String)> {
        let members = &server.server.members;
        let separator = &server.server.separator;
        if server.server.prefix == PrefixRule::Always {
            let mut candidates = members.iter().filter_map(|member| {
                let own = name.strip_prefix(&format!("{}{separator}", member.prefix))?;
                names::passes(kind.filter(member), own).then(|| (member, own.to_owned()))
            });
            let first = candidates.next();
            if candidates.next().is_none() {
                return first;
            }
        }
        if let Some(owner) = server.catalogs.owner(&call.auth.subject, kind, name) {
            return Some((&members[owner.member], owner.own));
        }
        // Not known (or nothing kept): the lists, read now, decide and renew the catalog.
        let merged = self.merged_modern_list(server, call, kind).await;
        if let Some(owner) = merged.owners.get(name) {
            return Some((&members[owner.member], owner.own.clone()));
        }
        let unlisted = merged.lists.unlisted.iter();
        unlisted.chain(&merged.lists.cut_members).find_map(|&at| {
            let member = &members[at];
            let prefixed = format!("{}{separator}", member.prefix);
            let own = match (name.strip_prefix(&prefixed), server.server.prefix) {
                (Some(own), PrefixRule::Always | PrefixRule::Conflicts) => own,
                (_, PrefixRule::Conflicts | PrefixRule::Never) => name,
                (None, PrefixRule::Always) => return None,
            };
            names::passes(kind.filter(member), own).then(|| (member, own.to_owned()))
        })
    }

    /// `message` as a request of the member's own route, dispatched as that route's
    /// request would be (straight upstream, or in the principal's shared session of
    /// that route, wherever it lives). `name`: the member's own name of a tool or
    /// prompt, for the `Mcp-Name` header. A refusal names the member.
    fn member_call<'a>(
        &'a self,
        server: &'a VirtualUpstream,
        call: &'a Call,
        member: &'a MemberConfig,
        message: &'a Value,
        name: Option<&'a str>,
    ) -> Dispatched<'a> {
        // Boxed as a `Send` future by its type: the dispatch it runs may come back here.
        Box::pin(async move {
            let route = &self.worker.routes[member.index];
            if route.config().legacy_only
                && !self.worker.auth.same_policy(call.upstream, member.index)
            {
                return Err(policies_differ(route.name(), &server.name).with_id(call.id()));
            }
            let mut headers = call.headers.clone();
            let method = message.get("method").and_then(Value::as_str).unwrap_or("");
            if let Ok(method) = HeaderValue::from_str(method) {
                headers.insert(mcp::HEADER_METHOD, method);
            }
            match name.map(name_header) {
                Some(value) => headers.insert(mcp::HEADER_NAME, value),
                None => headers.remove(mcp::HEADER_NAME),
            };
            let mut auth = call.auth.clone();
            auth.route = route.name().to_owned();
            let path = format!("/servers/{}/mcp", route.name());
            let body = Bytes::from(message.to_string());
            let result = match request::parse_call(
                member.index,
                Era::Modern,
                Method::POST,
                &path,
                &headers,
                body,
                auth,
            ) {
                Ok(mut member_call) => {
                    member_call.client = call.client;
                    Router::of(self.worker).dispatch(member_call).await
                }
                Err(e) => Err(e),
            };
            let outcome = match &result {
                Ok(_) => "answered",
                Err(e) if e.reason == Some(Reason::SessionGone) => "lost",
                Err(e) if e.reason == Some(Reason::OutcomeUnknown) => "outcome_unknown",
                Err(_) => "failed",
            };
            self.worker.metrics.member_request(
                self.worker.routes[call.upstream].label(),
                route.label(),
                Some(method),
                outcome,
            );
            result.map_err(|error| of_member(error, route.name(), &server.name))
        })
    }
}

/// A stateful member whose route authenticates by another policy than the virtual
/// server (another mode, issuer or keys): its shared session belongs to a principal of
/// the member's own route, and the virtual server's client is not one.
fn policies_differ(member: &str, server: &str) -> GatewayError {
    GatewayError::gateway(
        StatusCode::NOT_IMPLEMENTED,
        Reason::VirtualServerProtocol,
        format!(
            "member {member} of virtual server {server} keeps state in sessions and its route \
             authenticates clients by another policy (mode, issuer or keys) than the virtual \
             server, so a 2026-07-28 client of the virtual server is not a principal of that \
             route: use a 2025-* protocol version, or give both routes one auth policy"
        ),
    )
    .with_data(json!({ "member": member, "retryable": false }))
}

/// A member's refusal, said to be the member's: its name in the message and `data`.
fn of_member(mut error: GatewayError, member: &str, server: &str) -> GatewayError {
    error.message = format!(
        "member {member} of virtual server {server}: {}",
        error.message
    );
    let data = error.data.get_or_insert_with(|| Box::new(json!({})));
    if let Some(fields) = data.as_object_mut() {
        fields.insert("member".into(), Value::from(member));
    }
    error
}

/// A list request's `cursor`, refused: every merged list is returned whole.
fn refuse_cursor(call: &Call, server: &str) -> Option<Reply> {
    let asked_cursor = call
        .message
        .as_ref()
        .and_then(|m| m.json().get("params")?.get("cursor"))
        .is_some_and(|c| !c.is_null());
    asked_cursor.then(|| {
        rpc_error(
            &call.id(),
            INVALID_PARAMS,
            format!(
                "virtual server {server} returns its whole list in one page and issued no cursor"
            ),
        )
    })
}

/// A list request of the gateway's own for `method`, in the client's 2026-07-28
/// envelope (its `params._meta` keys `io.modelcontextprotocol/*`: protocol version,
/// capabilities), whatever the client's request was.
fn list_request(call: &Call, method: &str) -> Value {
    let envelope: serde_json::Map<String, Value> = call
        .message
        .as_ref()
        .and_then(|m| m.json().get("params")?.get("_meta")?.as_object().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| key.starts_with(ENVELOPE_PREFIX))
        .collect();
    let mut request = json!({ "jsonrpc": "2.0", "id": call.id(), "method": method, "params": {} });
    if !envelope.is_empty() {
        request["params"]["_meta"] = Value::Object(envelope);
    }
    request
}

/// Prefix of the `_meta` keys of the 2026-07-28 request envelope.
const ENVELOPE_PREFIX: &str = "io.modelcontextprotocol/";

/// -32601 for a method a virtual server does not serve to 2026-07-28 clients, saying
/// what it serves, and for the subscription methods what the revision has instead.
fn not_served(id: &Value, method: &str, server: &str) -> Reply {
    let serves = "it serves tools/list, tools/call, prompts/list, prompts/get, \
                  resources/list, resources/templates/list, resources/read, \
                  completion/complete, server/discover and ping";
    let message = match method {
        "resources/subscribe" | "resources/unsubscribe" => format!(
            "{method} does not exist in MCP 2026-07-28 (subscriptions/listen with \
             notifications.resourceSubscriptions replaced it), and virtual server {server} \
             does not serve subscriptions/listen yet: read the resource again to see changes"
        ),
        "subscriptions/listen" => format!(
            "subscriptions/listen is not built for virtual servers yet, so virtual server \
             {server} sends 2026-07-28 clients no notifications: list and read again to see \
             changes ({serves})"
        ),
        other => format!(
            "{other} is not served by virtual server {server} to 2026-07-28 clients ({serves})"
        ),
    };
    rpc_error(id, mcp::code::METHOD_NOT_FOUND, message)
}

/// The smaller of two optional `ttlMs`; a member that gives none does not bind.
fn min_ttl(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// An `Mcp-Name` value: the name itself, or `=?base64?…?=` when it is no visible
/// ASCII (the form `mcp::decode_header_value` reads).
fn name_header(name: &str) -> HeaderValue {
    let visible = !name.is_empty() && name.bytes().all(|b| (0x21..0x7f).contains(&b));
    match visible.then(|| HeaderValue::from_str(name).ok()).flatten() {
        Some(value) => value,
        None => {
            let encoded = format!("=?base64?{}?=", base64_encode(name.as_bytes()));
            HeaderValue::from_str(&encoded).unwrap_or(HeaderValue::from_static(""))
        }
    }
}

/// Standard base64 with padding; small enough not to warrant a dependency.
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `server/discover` of a virtual server: what it serves, in the 2026-07-28 version.
fn discover(id: &Value, server: &str) -> Reply {
    let result = json!({
        "supportedVersions": mcp::MODERN_VERSIONS,
        "capabilities": { "tools": {}, "prompts": {}, "resources": {}, "completions": {} },
        "serverInfo": { "name": server, "version": env!("CARGO_PKG_VERSION") },
        "resultType": "complete",
        "ttlMs": 0,
        "cacheScope": "private",
    });
    let body = json!({ "jsonrpc": "2.0", "id": id, "result": result });
    Reply::json(StatusCode::OK, Bytes::from(body.to_string()))
}

fn rpc_error(id: &Value, code: i64, message: String) -> Reply {
    let body = json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } });
    Reply::json(StatusCode::OK, Bytes::from(body.to_string()))
}

/// The answer to a notification or response: taken, nothing to say.
fn accepted() -> Reply {
    Reply {
        status: StatusCode::ACCEPTED,
        headers: http::HeaderMap::new(),
        body: crate::body::full(Bytes::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_ttl_binds_and_a_member_without_one_does_not() {
        assert_eq!(min_ttl(None, None), None);
        assert_eq!(min_ttl(Some(5000), None), Some(5000));
        assert_eq!(min_ttl(None, Some(0)), Some(0));
        assert_eq!(min_ttl(Some(5000), Some(300)), Some(300));
    }

    #[test]
    fn names_that_are_no_visible_ascii_travel_base64_encoded() {
        assert_eq!(name_header("echo"), "echo");
        assert_eq!(name_header("héllo"), "=?base64?aMOpbGxv?=");
        let encoded = name_header("a b");
        assert_eq!(
            mcp::decode_header_value(encoded.as_bytes()).as_deref(),
            Some("a b")
        );
        assert_eq!(base64_encode(b"echo"), "ZWNobw==");
        assert_eq!(base64_encode(b"ab"), "YWI=");
        assert_eq!(base64_encode(b"abc"), "YWJj");
    }

    #[test]
    fn a_member_refusal_names_the_member_once() {
        let error = GatewayError::gateway(StatusCode::NOT_FOUND, Reason::SessionGone, "gone");
        let error = of_member(error, "st", "all");
        assert_eq!(error.message, "member st of virtual server all: gone");
        let data = error.data.as_deref().cloned().unwrap_or_default();
        assert_eq!(data["member"], "st");
        assert_eq!(data["reason"], "session_gone");
    }
}
