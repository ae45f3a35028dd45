//! Resources, resource templates and completion for 2026-07-28 clients on a virtual
//! server, by the rules sessions have (`federation/resources.rs`, `uris.rs`): the
//! members' lists merged without renaming (a URI or template two members list is the
//! earlier member's, the later one's named in `_meta["mcpgw/federation"].hidden`), in
//! the 2026-07-28 list shape (one page, `resultType`, `ttlMs`, `cacheScope`, `missing`);
//! a read goes to the member that listed the URI, else to the first whose template
//! matches it and whose filter lets it through; a completion to the prompt's or the
//! template's member. Without a session nothing is kept between requests: a read
//! reads both lists for it.
//!
//! 2026-07-28 has no `resources/subscribe` or `resources/unsubscribe` (its
//! `subscriptions/listen` replaced them, and is not built here): those are -32601
//! saying so (`super::not_served`).

use serde_json::Value;
use tracing::debug;

use super::{Kind, MemberLists, refuse_cursor, rpc_error};
use crate::execute::Executor;
use crate::execute::upstream::VirtualUpstream;
use crate::federation::INVALID_PARAMS;
use crate::federation::bounds::merge_off_thread;
use crate::federation::names;
use crate::federation::resources::{
    CompletionRef, MemberResources, MergedResources, ResourceList, catalog_of, completion_ref,
    merge_resources, requested_uri, unknown_uri_message,
};
use crate::mcp::GatewayError;
use crate::reply::Reply;
use crate::request::Call;
use std::time::Duration;

impl Executor<'_> {
    /// `resources/list` or `resources/templates/list`: every member's list, merged.
    pub(super) async fn answer_resource_list(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        list: ResourceList,
    ) -> Reply {
        if let Some(refused) = refuse_cursor(call, &server.name) {
            return refused;
        }
        let (lists, merged) = self.merged_modern_resources(server, call, list).await;
        lists
            .answer(&call.id(), list.listing().key, merged.items, merged.hidden)
            .await
    }

    /// `resources/read`: to the member that serves `params.uri`, unchanged (its
    /// `Mcp-Name` is the URI, as the client sent it).
    pub(super) async fn read_resource(
        &self,
        server: &VirtualUpstream,
        call: &Call,
    ) -> Result<Reply, GatewayError> {
        let id = call.id();
        let message = call.message_copy();
        let uri = match requested_uri(&message) {
            Ok(uri) => uri.to_owned(),
            Err(why) => return Ok(rpc_error(&id, INVALID_PARAMS, why)),
        };
        let Some(at) = self.resource_member(server, call, &uri, false).await else {
            let why = unknown_uri_message(&server.name, &uri, "");
            return Ok(rpc_error(&id, INVALID_PARAMS, why));
        };
        let member = &server.server.members[at];
        self.member_call(server, call, member, &message, Some(&uri))
            .await
    }

    /// `completion/complete`: a `ref/prompt` to the member owning the exposed prompt,
    /// under its own name; a `ref/resource` to the member that listed the template (or
    /// that a read of the URI would reach).
    pub(super) async fn complete_modern(
        &self,
        server: &VirtualUpstream,
        call: &Call,
    ) -> Result<Reply, GatewayError> {
        let id = call.id();
        let mut message = call.message_copy();
        match completion_ref(&message) {
            Ok(CompletionRef::Prompt(name)) => {
                let owner = self
                    .owner_of_modern(server, call, Kind::Prompts, &name)
                    .await;
                let Some((member, own)) = owner else {
                    let why = format!("unknown prompt {name:?} on virtual server {}", server.name);
                    return Ok(rpc_error(&id, INVALID_PARAMS, why));
                };
                message["params"]["ref"]["name"] = Value::from(own);
                self.member_call(server, call, member, &message, None).await
            }
            Ok(CompletionRef::Resource(uri)) => {
                let Some(at) = self.resource_member(server, call, &uri, true).await else {
                    let why = unknown_uri_message(&server.name, &uri, "");
                    return Ok(rpc_error(&id, INVALID_PARAMS, why));
                };
                let member = &server.server.members[at];
                self.member_call(server, call, member, &message, None).await
            }
            Err(why) => Ok(rpc_error(&id, INVALID_PARAMS, why)),
        }
    }

    /// Every member's `list`, merged by the sessions' rule.
    async fn merged_modern_resources(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        list: ResourceList,
    ) -> (MemberLists, MergedResources) {
        let mut lists = self.gather_modern(server, call, list.listing()).await;
        let members: Vec<MemberResources> = server
            .server
            .members
            .iter()
            .map(|member| MemberResources {
                name: member.upstream.clone(),
                filter: member.resources.clone(),
            })
            .collect();
        let mut items = std::mem::take(&mut lists.items);
        let count = items.iter().map(Vec::len).sum();
        let (merged, items) = merge_off_thread(count, move || {
            let merged = merge_resources(list, &members, &mut items);
            // The lists go back emptied: only their number is read after.
            items.iter_mut().for_each(Vec::clear);
            (merged, items)
        })
        .await;
        lists.items = items;
        for hidden in &merged.hidden {
            debug!(server = %server.name, "{} {} of member {} is hidden by member {}",
                list.identity(), hidden[list.identity()], hidden["member"], hidden["kept_by"]);
        }
        (lists, merged)
    }

    /// The member (its position) that serves `uri`, from both lists read now
    /// (`as_template`: see [`super::super::uris::ResourceCatalog::serving`]). A URI no
    /// list has goes to the first member left out of a list whose filter lets it
    /// through, so the client hears that member's error rather than "unknown".
    async fn resource_member(
        &self,
        server: &VirtualUpstream,
        call: &Call,
        uri: &str,
        as_template: bool,
    ) -> Option<usize> {
        let members = &server.server.members;
        let passes = |member: usize, uri: &str| names::passes(&members[member].resources, uri);
        let principal = &call.auth.subject;
        let max_uri = server.server.merge.max_template_uri_bytes;
        let kept = server.catalogs.resources(principal);
        if let Some(member) = kept.and_then(|kept| kept.serving(uri, as_template, max_uri, passes))
        {
            return Some(member);
        }
        // Not known (or nothing kept): the lists, read now, decide and renew the catalog.
        let ((resource_lists, resources), (template_lists, templates)) =
            futures_util::future::join(
                self.merged_modern_resources(server, call, ResourceList::Resources),
                self.merged_modern_resources(server, call, ResourceList::Templates),
            )
            .await;
        let catalog = catalog_of(&resources.exposed, &templates.exposed);
        let found = catalog.serving(uri, as_template, max_uri, passes);
        let ttl = min_duration(resource_lists.reusable_for(), template_lists.reusable_for());
        server.catalogs.keep_resources(principal, || catalog, ttl);
        if let Some(member) = found {
            return Some(member);
        }
        // Left out, or cut (the URI may be beyond the cut): the member answers itself.
        let unlisted = |at: &usize| {
            [&resource_lists, &template_lists]
                .iter()
                .any(|lists| lists.unlisted.contains(at) || lists.cut_members.contains(at))
        };
        (0..members.len()).find(|at| unlisted(at) && passes(*at, uri))
    }
}

/// The shorter of two reuse periods; both lists must allow reuse.
fn min_duration(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    Some(a?.min(b?))
}
