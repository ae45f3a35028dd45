//! Resources, resource templates, subscriptions and completion on a virtual server.
//!
//! URIs are identities: they are never renamed. `resources/list` and
//! `resources/templates/list` merge every live member's list (each followed to its
//! end) through the member's `resources` filter; a URI (or template) two members list
//! is the earlier member's in the configuration, and the later one's is left out,
//! named in `_meta["mcpgw/federation"].hidden` and the log. `resources/read`,
//! `subscribe` and `unsubscribe` go to the member that listed the URI, else to the
//! member whose template matches it (`uris.rs`); `completion/complete` goes to the
//! member that owns the prompt (under its own name) or the resource template. The
//! merge, the completion reference and the messages are shared with 2026-07-28
//! clients (`modern/resources.rs`), so both eras follow one rule.

use http::HeaderMap;
use serde_json::{Value, json};
use tracing::warn;

use super::bounds::merge_off_thread;
use super::names::{self, Listed};
use super::uris::ResourceCatalog;
use super::{Gathered, INVALID_PARAMS, Notes, error, result_off_thread, take_items};
use crate::config::{NameFilter, PrefixRule};
use crate::execute::Executor;
use crate::execute::upstream::UpstreamReply;
use crate::link::{FederatedLink, Kind, ListOf};

/// The two resource lists a virtual server merges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ResourceList {
    Resources,
    Templates,
}

impl ResourceList {
    pub(super) fn listing(self) -> ListOf {
        match self {
            ResourceList::Resources => ListOf {
                method: "resources/list",
                key: "resources",
                capability: "resources",
            },
            ResourceList::Templates => ListOf {
                method: "resources/templates/list",
                key: "resourceTemplates",
                capability: "resources",
            },
        }
    }

    /// The field of an item that names it.
    pub(super) fn identity(self) -> &'static str {
        match self {
            ResourceList::Resources => "uri",
            ResourceList::Templates => "uriTemplate",
        }
    }
}

/// One member of a resource list's merge: its name (for the notes) and its filter.
#[derive(Debug, Clone)]
pub(super) struct MemberResources {
    pub name: String,
    pub filter: NameFilter,
}

/// A merged resource list: the items, and those left out because an earlier member
/// lists the same identity (`{uri, member, kept_by}`, or `uriTemplate`), and the owner
/// of every identity kept, in listing order.
pub(super) struct MergedResources {
    pub items: Vec<Value>,
    pub hidden: Vec<Value>,
    pub exposed: Vec<(String, names::Owner)>,
}

/// The members' resource lists (`items`, one per member) merged without renaming,
/// through each member's filter; a URI (or template) two members list is the earlier
/// member's, the later one's is left out. The kept items are moved out of `items`,
/// each found through a hash map: the merge is linear in the items. One rule for
/// sessions and 2026-07-28 clients.
pub(super) fn merge_resources(
    list: ResourceList,
    members: &[MemberResources],
    items: &mut [Vec<Value>],
) -> MergedResources {
    let listed: Vec<Listed<'_>> = members
        .iter()
        .zip(items.iter())
        .map(|(member, items)| Listed {
            prefix: "",
            filter: &member.filter,
            names: items
                .iter()
                .filter_map(|item| item.get(list.identity())?.as_str().map(str::to_owned))
                .collect(),
        })
        .collect();
    // Never renamed: the "never" rule keeps names as they are, the earlier member's.
    let exposure = names::expose(PrefixRule::Never, "", &listed);
    let hidden = exposure
        .hidden
        .iter()
        .map(|(identity, loser, keeper)| {
            let (loser, keeper) = (&members[*loser].name, &members[*keeper].name);
            json!({ list.identity(): identity, "member": loser, "kept_by": keeper })
        })
        .collect();
    let items = take_items(items, &exposure.exposed, list.identity())
        .into_iter()
        .flatten()
        .collect();
    MergedResources {
        items,
        hidden,
        exposed: exposure.exposed,
    }
}

/// The catalog of two merged lists (their `exposed`), for routing one request.
pub(super) fn catalog_of(
    resources: &[(String, names::Owner)],
    templates: &[(String, names::Owner)],
) -> ResourceCatalog {
    ResourceCatalog {
        uris: resources
            .iter()
            .map(|(uri, owner)| (uri.clone(), owner.member))
            .collect(),
        templates: templates
            .iter()
            .map(|(template, owner)| (template.clone(), owner.member))
            .collect(),
    }
}

/// What a `completion/complete` asks about.
pub(super) enum CompletionRef {
    /// `ref/prompt`: an exposed prompt name.
    Prompt(String),
    /// `ref/resource`: a template, or a URI.
    Resource(String),
}

/// The reference of a `completion/complete`, or the -32602 message saying its shape.
pub(super) fn completion_ref(message: &Value) -> Result<CompletionRef, String> {
    let reference = &message["params"]["ref"];
    let text = |key: &str| {
        reference
            .get(key)
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    match (
        reference.get("type").and_then(Value::as_str),
        text("name"),
        text("uri"),
    ) {
        (Some("ref/prompt"), Some(name), _) => Ok(CompletionRef::Prompt(name)),
        (Some("ref/resource"), _, Some(uri)) => Ok(CompletionRef::Resource(uri)),
        _ => Err(
            "completion/complete needs params.ref: {\"type\": \"ref/prompt\", \"name\": \
                  ...} or {\"type\": \"ref/resource\", \"uri\": ...}"
                .to_owned(),
        ),
    }
}

/// The URI a `resources/*` request is about, or the -32602 message saying it needs one.
pub(super) fn requested_uri(message: &Value) -> Result<&str, String> {
    message["params"]
        .get("uri")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            let method = message["method"].as_str().unwrap_or("this request");
            format!("{method} needs params.uri, the resource's URI as a string")
        })
}

/// The -32602 message for a URI no member serves on `server`; `more` adds why a
/// member could not be asked.
pub(super) fn unknown_uri_message(server: &str, uri: &str, more: &str) -> String {
    format!(
        "unknown resource {uri:?} on virtual server {server}: no member listed it and no \
         member's resource template matches it (RFC 6570 templates, levels 1 to 4: a \
         simple {{var}} holds no '/', '?', '#' or other reserved character, {{+var}} \
         does), or its member's resources filter keeps it out; see resources/list and \
         resources/templates/list for what it serves{more}"
    )
}

impl FederatedLink {
    /// Every live member's `list`, merged without renaming; the resource catalog is
    /// renewed from it (a member missing from it keeps its previous entries, so a
    /// lost member's URIs are told the loss, not "unknown"). Returns the merged list
    /// and the members missing from it.
    async fn merged_resources(
        &self,
        executor: &Executor<'_>,
        list: ResourceList,
    ) -> (MergedResources, Notes) {
        let Gathered {
            items,
            missing,
            unlisted,
            cut,
        } = self.gather(executor, list.listing()).await;
        let members: Vec<MemberResources> = self
            .members
            .iter()
            .map(|member| MemberResources {
                name: member.name().to_owned(),
                filter: member.config.resources.clone(),
            })
            .collect();
        let count = items.iter().map(Vec::len).sum();
        let merged = merge_off_thread(count, move || {
            let mut items = items;
            merge_resources(list, &members, &mut items)
        })
        .await;
        self.note_cut(list.listing().method, &cut);
        for hidden in &merged.hidden {
            warn!(server = %self.server, "{} {} of member {} is left out: member {} (earlier in the configuration) lists it too",
                list.identity(), hidden[list.identity()], hidden["member"], hidden["kept_by"]);
        }
        self.renew_resources(list, &merged.exposed, &unlisted);
        (merged, Notes { missing, cut })
    }

    /// The catalog's `list` part from a new listing; the entries of members that did
    /// not list (`unlisted`) stay as they were.
    fn renew_resources(
        &self,
        list: ResourceList,
        exposed: &[(String, names::Owner)],
        unlisted: &[bool],
    ) {
        let mut catalog = self.resources.lock();
        match list {
            ResourceList::Resources => {
                let mut uris: std::collections::HashMap<String, usize> = exposed
                    .iter()
                    .map(|(uri, owner)| (uri.clone(), owner.member))
                    .collect();
                for (uri, member) in catalog.uris.drain() {
                    if unlisted[member] {
                        uris.entry(uri).or_insert(member);
                    }
                }
                catalog.uris = uris;
            }
            ResourceList::Templates => {
                // Per member, in configuration order: each template looked at once.
                let mut per_member: Vec<Vec<(String, usize)>> = vec![Vec::new(); unlisted.len()];
                for (template, member) in std::mem::take(&mut catalog.templates) {
                    if unlisted.get(member).copied().unwrap_or(false) {
                        per_member[member].push((template, member));
                    }
                }
                for (template, owner) in exposed {
                    if let Some(kept) = per_member.get_mut(owner.member) {
                        kept.push((template.clone(), owner.member));
                    }
                }
                catalog.templates = per_member.into_iter().flatten().collect();
            }
        }
    }

    /// The member (its position) that serves `uri`: by the catalog, refreshed once by
    /// both lists when it does not know the URI. `as_template`: `uri` may also name a
    /// listed template exactly (a completion's `ref/resource`).
    async fn resource_owner(
        &self,
        executor: &Executor<'_>,
        uri: &str,
        as_template: bool,
    ) -> Option<usize> {
        let passes =
            |member: usize, uri: &str| names::passes(&self.members[member].config.resources, uri);
        let max_uri = self.merge.max_template_uri_bytes;
        let known = || {
            self.resources
                .lock()
                .serving(uri, as_template, max_uri, passes)
        };
        if let Some(member) = known() {
            return Some(member);
        }
        {
            let mut refreshes = self.refreshes.lock().await;
            // A reading that ran while this waited may have found it.
            if let Some(member) = known() {
                return Some(member);
            }
            // Both lists are read again together: one interval for the pair.
            let list = ResourceList::Resources.listing().method;
            if self.may_refresh(&mut refreshes, list) {
                futures_util::future::join(
                    self.merged_resources(executor, ResourceList::Resources),
                    self.merged_resources(executor, ResourceList::Templates),
                )
                .await;
                if let Some(member) = known() {
                    return Some(member);
                }
            }
        }
        // Beyond a cut list, the URI may be that member's: it answers for itself.
        let mut cut = self.cut_members(ResourceList::Resources.listing().method);
        cut.extend(self.cut_members(ResourceList::Templates.listing().method));
        (0..self.members.len())
            .find(|at| cut.contains(at) && self.members[*at].lost().is_none() && passes(*at, uri))
    }

    /// -32602 for a URI no member serves, saying what to do.
    fn unknown_uri(&self, id: &Value, uri: &str) -> UpstreamReply {
        let lost: Vec<&str> = self
            .members
            .iter()
            .filter(|m| m.lost().is_some())
            .map(|m| m.name())
            .collect();
        let lost = if lost.is_empty() {
            String::new()
        } else {
            format!(
                " (lost member(s) {} cannot be asked: if it was theirs, their state is lost)",
                lost.join(", ")
            )
        };
        error(
            id,
            INVALID_PARAMS,
            unknown_uri_message(&self.server, uri, &lost),
        )
    }
}

impl Executor<'_> {
    /// `resources/list` or `resources/templates/list` of a virtual server.
    pub(super) async fn list_resources(
        &self,
        link: &FederatedLink,
        list: ResourceList,
        id: &Value,
    ) -> UpstreamReply {
        let (merged, notes) = link.merged_resources(self, list).await;
        let count = merged.items.len();
        let mut listed = json!({ list.listing().key: merged.items });
        notes.into_meta(&mut listed, merged.hidden);
        result_off_thread(id, listed, count).await
    }

    /// `resources/read`, `resources/subscribe`, `resources/unsubscribe`: to the member
    /// that serves `params.uri`, unchanged.
    pub(super) async fn resource_request(
        &self,
        link: &FederatedLink,
        id: &Value,
        message: Value,
        headers: HeaderMap,
    ) -> UpstreamReply {
        let uri = match requested_uri(&message) {
            Ok(uri) => uri.to_owned(),
            Err(why) => return error(id, INVALID_PARAMS, why),
        };
        match link.resource_owner(self, &uri, false).await {
            Some(member) => self.relay(link, member, id, message, headers).await,
            None => link.unknown_uri(id, &uri),
        }
    }

    /// `completion/complete`: a `ref/prompt` to the member that owns the exposed
    /// prompt, under its own name; a `ref/resource` to the member whose template it is
    /// (or that serves the URI).
    pub(super) async fn complete(
        &self,
        link: &FederatedLink,
        id: &Value,
        mut message: Value,
        headers: HeaderMap,
    ) -> UpstreamReply {
        match completion_ref(&message) {
            Ok(CompletionRef::Prompt(name)) => {
                let Some(owner) = link.owner_of(self, Kind::Prompts, &name).await else {
                    return error(
                        id,
                        INVALID_PARAMS,
                        format!("unknown prompt {name:?} on virtual server {}", link.server),
                    );
                };
                message["params"]["ref"]["name"] = Value::from(owner.own);
                self.relay(link, owner.member, id, message, headers).await
            }
            Ok(CompletionRef::Resource(uri)) => match link.resource_owner(self, &uri, true).await {
                Some(member) => self.relay(link, member, id, message, headers).await,
                None => link.unknown_uri(id, &uri),
            },
            Err(why) => error(id, INVALID_PARAMS, why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, exclude: &[&str]) -> MemberResources {
        MemberResources {
            name: name.to_owned(),
            filter: NameFilter {
                include: Vec::new(),
                exclude: exclude.iter().map(|p| (*p).to_owned()).collect(),
            },
        }
    }

    fn resource(uri: &str, from: &str) -> Value {
        json!({ "uri": uri, "name": from })
    }

    #[test]
    fn the_earlier_member_keeps_a_uri_both_list_and_the_later_one_is_named() {
        let members = [member("a", &["mem://a/secret"]), member("b", &[])];
        let mut items = vec![
            vec![
                resource("mem://shared", "a"),
                resource("mem://a/secret", "a"),
                resource("mem://shared", "a again"),
            ],
            vec![resource("mem://b/1", "b"), resource("mem://shared", "b")],
        ];
        let merged = merge_resources(ResourceList::Resources, &members, &mut items);
        assert_eq!(
            merged.items,
            vec![resource("mem://shared", "a"), resource("mem://b/1", "b")]
        );
        assert_eq!(
            merged.hidden,
            vec![json!({"uri": "mem://shared", "member": "b", "kept_by": "a"})]
        );
        let owners: Vec<(&str, usize)> = merged
            .exposed
            .iter()
            .map(|(uri, owner)| (uri.as_str(), owner.member))
            .collect();
        assert_eq!(owners, [("mem://shared", 0), ("mem://b/1", 1)]);
    }

    /// Correctness at a size where a search per item would not end in a test's time:
    /// 200,000 resources of two members, half of them listed by both.
    #[test]
    fn two_hundred_thousand_resources_merge_each_once_in_member_order() {
        const EACH: usize = 100_000;
        let members = [member("a", &[]), member("b", &[])];
        let a: Vec<Value> = (0..EACH)
            .map(|n| resource(&format!("mem://{n}"), "a"))
            .collect();
        let b: Vec<Value> = (EACH / 2..EACH + EACH / 2)
            .map(|n| resource(&format!("mem://{n}"), "b"))
            .collect();
        let mut items = vec![a, b];
        let merged = merge_resources(ResourceList::Resources, &members, &mut items);
        assert_eq!(merged.items.len(), EACH + EACH / 2);
        assert_eq!(merged.hidden.len(), EACH / 2);
        for (n, item) in merged.items.iter().enumerate() {
            assert_eq!(item["uri"], format!("mem://{n}"));
            assert_eq!(item["name"], if n < EACH { "a" } else { "b" });
        }
    }

    #[test]
    fn the_catalog_of_two_lists_knows_each_templates_owner() {
        let owner = |member| names::Owner {
            member,
            own: String::new(),
        };
        let exposed = vec![
            ("mem://a/{x}".to_owned(), owner(0)),
            ("mem://c/{x}".to_owned(), owner(2)),
        ];
        let catalog = catalog_of(&[], &exposed);
        assert_eq!(catalog.template_owner("mem://c/{x}"), Some(2));
        assert_eq!(catalog.templates.len(), 2);
    }
}
