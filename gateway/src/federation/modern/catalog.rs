//! What 2026-07-28 requests on a virtual server learn from merged lists, kept while the
//! members allow it: a call needs to know which member owns an exposed name (with
//! `prefix = "conflicts"` or `"never"`), a read which member serves a URI, and without
//! a catalog each of them reads every member's whole list first.
//!
//! An entry lives until the smallest `ttlMs` its lists gave runs out; a list with no
//! `ttlMs`, a `ttlMs` of 0 (stateful members always say 0) or a member missing from it
//! is not kept. Entries are per principal: a member's list may be the principal's own
//! (`cacheScope: "private"`), so another principal's could differ. A name (or URI) the
//! entry does not know is no proof: the caller lists again once before it answers
//! "unknown", and that list renews the entry.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::{Duration, Instant};

use crate::federation::names::Owner;
use crate::federation::uris::ResourceCatalog;
use crate::link::Kind;

/// Entries kept per map at most: principals are unbounded, memory is not. A full map
/// drops its expired entries, then (still full) all of them; they are only a shortcut.
const MAX_ENTRIES: usize = 4096;

/// The catalogs of one virtual server on this worker.
#[derive(Default)]
pub struct ModernCatalogs {
    /// principal → exposed tool name → owner; looked up by `&str`, so a call's
    /// lookup allocates nothing.
    tools: Expiring<String, HashMap<String, Owner>>,
    /// The same for prompts.
    prompts: Expiring<String, HashMap<String, Owner>>,
    /// principal → the resources' and templates' members.
    resources: Expiring<String, ResourceCatalog>,
}

impl ModernCatalogs {
    /// The owner of `name`, if a live entry knows it.
    pub(super) fn owner(&self, principal: &str, kind: Kind, name: &str) -> Option<Owner> {
        self.names(kind).get(principal)?.get(name).cloned()
    }

    fn names(&self, kind: Kind) -> &Expiring<String, HashMap<String, Owner>> {
        match kind {
            Kind::Tools => &self.tools,
            Kind::Prompts => &self.prompts,
        }
    }

    pub(super) fn keep_names(
        &self,
        principal: &str,
        kind: Kind,
        owners: &HashMap<String, Owner>,
        ttl: Option<Duration>,
    ) {
        self.names(kind)
            .keep(principal.to_owned(), || owners.clone(), ttl);
    }

    /// The principal's live resource catalog.
    pub(super) fn resources(&self, principal: &str) -> Option<Arc<ResourceCatalog>> {
        self.resources.get(principal)
    }

    pub(super) fn keep_resources(
        &self,
        principal: &str,
        catalog: impl FnOnce() -> ResourceCatalog,
        ttl: Option<Duration>,
    ) {
        self.resources.keep(principal.to_owned(), catalog, ttl);
    }
}

/// A map whose entries end at their own deadline.
struct Expiring<K, V> {
    entries: Mutex<HashMap<K, (Arc<V>, Instant)>>,
}

impl<K, V> Default for Expiring<K, V> {
    fn default() -> Self {
        Expiring {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash, V> Expiring<K, V> {
    fn get<Q>(&self, key: &Q) -> Option<Arc<V>>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        let mut entries = self.entries.lock();
        match entries.get(key) {
            Some((value, until)) if Instant::now() < *until => Some(Arc::clone(value)),
            Some(_) => {
                entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Keeps `value()` for `ttl`; without one (or zero), drops what was kept instead.
    fn keep(&self, key: K, value: impl FnOnce() -> V, ttl: Option<Duration>) {
        let mut entries = self.entries.lock();
        let Some(ttl) = ttl.filter(|ttl| !ttl.is_zero()) else {
            entries.remove(&key);
            return;
        };
        let now = Instant::now();
        if entries.len() >= MAX_ENTRIES && !entries.contains_key(&key) {
            entries.retain(|_, (_, until)| now < *until);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(key, (Arc::new(value()), now + ttl));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_entry_lives_for_its_ttl_and_none_without_one() {
        let kept: Expiring<&str, u32> = Expiring::default();
        kept.keep("a", || 1, Some(Duration::from_millis(500)));
        kept.keep("b", || 2, Some(Duration::ZERO));
        kept.keep("c", || 3, None);
        assert_eq!(kept.get(&"a").as_deref(), Some(&1));
        assert_eq!(kept.get(&"b"), None, "0: not kept");
        assert_eq!(kept.get(&"c"), None, "no ttlMs: not kept");
        tokio::time::advance(Duration::from_millis(499)).await;
        assert_eq!(kept.get(&"a").as_deref(), Some(&1));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(kept.get(&"a"), None, "ran out");
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_without_a_ttl_drops_what_was_kept() {
        let kept: Expiring<&str, u32> = Expiring::default();
        kept.keep("a", || 1, Some(Duration::from_secs(60)));
        kept.keep("a", || 2, Some(Duration::ZERO));
        assert_eq!(kept.get(&"a"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_map_makes_room() {
        let kept: Expiring<usize, usize> = Expiring::default();
        for at in 0..MAX_ENTRIES {
            kept.keep(at, || at, Some(Duration::from_secs(60)));
        }
        kept.keep(MAX_ENTRIES, || 0, Some(Duration::from_secs(60)));
        assert_eq!(kept.get(&MAX_ENTRIES).as_deref(), Some(&0));
        assert!(kept.entries.lock().len() <= MAX_ENTRIES);
    }

    #[tokio::test(start_paused = true)]
    async fn owners_are_kept_per_principal_and_kind() {
        let catalogs = ModernCatalogs::default();
        let owners = HashMap::from([(
            "echo".to_owned(),
            Owner {
                member: 1,
                own: "echo".to_owned(),
            },
        )]);
        catalogs.keep_names("alice", Kind::Tools, &owners, Some(Duration::from_secs(5)));
        assert_eq!(
            catalogs
                .owner("alice", Kind::Tools, "echo")
                .map(|o| o.member),
            Some(1)
        );
        assert_eq!(catalogs.owner("bob", Kind::Tools, "echo"), None);
        assert_eq!(catalogs.owner("alice", Kind::Prompts, "echo"), None);
        assert_eq!(catalogs.owner("alice", Kind::Tools, "other"), None);
    }
}
