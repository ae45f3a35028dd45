//! Downstream sessions held by this worker, and the ids the gateway mints for them.
//!
//! A session id carries a hint of its owner (`<32 hex>.<worker id>`), so any worker
//! can find the owner without a directory round trip. The hint is only a hint: the
//! owner always checks its own registry, so a forged id reaches no other session.
//!
//! A session ends in one of two ways: the gateway ends it (client DELETE, drain, idle
//! expiry: [`crate::worker::Worker::end_session`]), or it ends under the gateway (its
//! stdio process exited, its upstream forgot it): then it is *retired* with the
//! reason, and its requests are answered "gone" with that reason for a while.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::execute::streams::SessionStreams;
use crate::execute::upstream::UpstreamLink;

/// Random bytes in a session id: 128 bits, as the MCP security guidance asks.
const SESSION_ENTROPY_BYTES: usize = 16;
/// Retired sessions remembered at most, so their requests hear why they ended.
const MAX_RETIRED: usize = 4096;
/// How long a retired session is remembered.
const RETIRED_FOR: Duration = Duration::from_secs(600);

/// One client session and the upstream session that serves it, one to one, so no
/// state leaks between client sessions. A *shared* session instead serves every
/// 2026-07-28 client of one principal on one route (they have no session of their
/// own, but the upstream keeps state in one).
#[derive(Debug)]
pub struct Session {
    pub id: String,
    /// A short hash of the id for log lines: the id itself lets its holder act in the
    /// session, so it is never logged whole.
    pub tag: SessionTag,
    /// Index of the upstream (route) the session was opened on.
    pub upstream: usize,
    /// Who created the session; only the same principal may use it.
    pub principal: String,
    /// The upstream side: an upstream session id, or a child process.
    pub link: UpstreamLink,
    /// Held for the 2026-07-28 clients of (principal, route), not one legacy client.
    pub shared: bool,
    /// The upstream's `initialize` result (protocol version, capabilities, server
    /// info), when the gateway itself opened the session (shared sessions).
    pub upstream_init: Option<serde_json::Value>,
    /// The session's server-to-client streams, kept for resumption.
    pub streams: SessionStreams,
    /// When a request last used the session (idle expiry).
    last_activity: parking_lot::Mutex<Instant>,
    /// Why the session ended under the gateway, once it has.
    ended: OnceLock<String>,
}

impl Session {
    pub fn new(
        id: String,
        upstream: usize,
        principal: String,
        link: UpstreamLink,
        streams: SessionStreams,
    ) -> Session {
        Session {
            tag: tag_of(&id),
            id,
            upstream,
            principal,
            link,
            shared: false,
            upstream_init: None,
            streams,
            last_activity: parking_lot::Mutex::new(Instant::now()),
            ended: OnceLock::new(),
        }
    }

    /// Marks the session as used now.
    pub fn touch(&self) {
        *self.last_activity.lock() = Instant::now();
    }

    /// How long no request has used the session.
    // Read by idle expiry, which is being built beside this (issue: gateway hardening).
    #[allow(dead_code)]
    pub fn idle_for(&self) -> Duration {
        self.last_activity.lock().elapsed()
    }

    /// Why the session ended under the gateway, if it did.
    pub fn ended(&self) -> Option<&str> {
        self.ended.get().map(String::as_str)
    }
}

/// Mints a session id owned by `worker_id`: 128 random bits, then the owner hint.
pub fn mint_session_id(worker_id: &str) -> std::io::Result<String> {
    let mut random = [0u8; SESSION_ENTROPY_BYTES];
    getrandom::fill(&mut random).map_err(std::io::Error::other)?;
    let mut id = String::with_capacity(SESSION_ENTROPY_BYTES * 2 + 1 + worker_id.len());
    id.push_str(&hex(&random));
    id.push('.');
    id.push_str(worker_id);
    Ok(id)
}

/// The owner a session id claims, if it has the gateway's shape.
pub fn owner_hint(session_id: &str) -> Option<&str> {
    let (random, owner) = session_id.split_at_checked(SESSION_ENTROPY_BYTES * 2)?;
    let owner = owner.strip_prefix('.')?;
    let well_formed =
        random.bytes().all(|b| b.is_ascii_hexdigit()) && crate::config::valid_worker_id(owner);
    well_formed.then_some(owner)
}

/// The id of the session the 2026-07-28 clients of `principal` share on `route`:
/// derived, so every worker finds the same one, and hashed, so neither the directory
/// nor the logs ever hold the principal (it may be a credential in some auth modes).
pub fn shared_session_id(route: &str, principal: &str) -> String {
    let digest = sha256(&[
        b"mcpgw shared session v1",
        route.as_bytes(),
        principal.as_bytes(),
    ]);
    format!("shared-{}", hex(&digest[..SESSION_ENTROPY_BYTES]))
}

/// A short, stable, one-way label of a session id for logs (8 hex digits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTag([u8; 4]);

impl std::fmt::Display for SessionTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

pub fn tag_of(session_id: &str) -> SessionTag {
    let digest = sha256(&[session_id.as_bytes()]);
    SessionTag([digest[0], digest[1], digest[2], digest[3]])
}

fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut context = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    for part in parts {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        context.update(&(part.len() as u64).to_be_bytes());
        context.update(part);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(context.finish().as_ref());
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sessions this worker owns, and those that recently ended under it.
#[derive(Debug, Default)]
pub struct SessionRegistry {
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    retired: parking_lot::Mutex<Retired>,
    /// One lock per shared session being opened, so concurrent first requests of one
    /// principal open one upstream session, not several.
    opening: parking_lot::Mutex<HashMap<String, std::sync::Weak<tokio::sync::Mutex<()>>>>,
}

#[derive(Debug, Default)]
struct Retired {
    by_id: HashMap<String, Arc<Session>>,
    order: VecDeque<(Instant, String)>,
}

impl SessionRegistry {
    /// The live session `id`, or a retired one (check [`Session::ended`]).
    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        if let Some(session) = self.read().get(id) {
            return Some(Arc::clone(session));
        }
        self.retired.lock().by_id.get(id).cloned()
    }

    /// Adds a session unless one with its id is live already; returns the one held.
    pub fn insert(&self, session: Session) -> Arc<Session> {
        let session = Arc::new(session);
        self.write()
            .entry(session.id.clone())
            .or_insert_with(|| Arc::clone(&session))
            .clone()
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Session>> {
        self.write().remove(id)
    }

    /// Moves a live session to the retired ones with the reason it ended; returns it
    /// if it was live.
    pub fn retire(&self, id: &str, why: &str) -> Option<Arc<Session>> {
        let session = self.write().remove(id)?;
        let _ = session.ended.set(why.to_owned());
        let mut retired = self.retired.lock();
        let now = Instant::now();
        while let Some((at, _)) = retired.order.front()
            && (retired.order.len() >= MAX_RETIRED || now.duration_since(*at) > RETIRED_FOR)
        {
            if let Some((_, old)) = retired.order.pop_front() {
                retired.by_id.remove(&old);
            }
        }
        retired.order.push_back((now, id.to_owned()));
        retired.by_id.insert(id.to_owned(), Arc::clone(&session));
        Some(session)
    }

    /// Forgets a retired session (its end was reported, and a new one may take its id).
    pub fn forget_retired(&self, id: &str) {
        self.retired.lock().by_id.remove(id);
    }

    /// Live sessions.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Every live session id, for a drain or a directory rebuild.
    pub fn ids(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Removes and returns every live session (fencing, drain).
    pub fn take_all(&self) -> Vec<Arc<Session>> {
        self.write().drain().map(|(_, s)| s).collect()
    }

    /// The lock that serializes opening the shared session `id` in this worker.
    pub fn opening(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut opening = self.opening.lock();
        if let Some(lock) = opening.get(id).and_then(std::sync::Weak::upgrade) {
            return lock;
        }
        opening.retain(|_, lock| lock.strong_count() > 0);
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        opening.insert(id.to_owned(), Arc::downgrade(&lock));
        lock
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<Session>>> {
        // A panic while holding the lock cannot leave the map half-updated (each
        // operation is one map call), so a poisoned lock is still consistent.
        self.sessions.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(id: &str) -> Session {
        Session::new(
            id.to_owned(),
            0,
            String::new(),
            UpstreamLink::Http { session_id: None },
            SessionStreams::default(),
        )
    }

    #[test]
    fn minted_ids_are_visible_ascii_unique_and_carry_the_owner() {
        let a = mint_session_id("host-1.w3").unwrap();
        let b = mint_session_id("host-1.w3").unwrap();
        assert_ne!(a, b);
        assert!(crate::mcp::validate_session_id(a.as_bytes()).is_ok());
        assert_eq!(owner_hint(&a), Some("host-1.w3"));
    }

    #[test]
    fn foreign_or_malformed_ids_have_no_hint() {
        assert_eq!(owner_hint("5b4d827754f2407bb4539d08c0196d8d"), None);
        assert_eq!(owner_hint("zz4d827754f2407bb4539d08c0196d8d.w1"), None);
        assert_eq!(owner_hint("5b4d827754f2407bb4539d08c0196d8d.bad/id"), None);
        assert_eq!(owner_hint("short.w1"), None);
        assert_eq!(owner_hint("\u{e9}\u{e9}\u{e9}"), None);
    }

    #[test]
    fn shared_ids_are_stable_per_principal_and_route_and_hide_both() {
        let alice = shared_session_id("demo", "alice");
        assert_eq!(alice, shared_session_id("demo", "alice"));
        assert_ne!(alice, shared_session_id("demo", "bob"));
        assert_ne!(alice, shared_session_id("other", "alice"));
        assert_ne!(
            shared_session_id("ab", "c"),
            shared_session_id("a", "bc"),
            "the parts are delimited"
        );
        assert!(!alice.contains("alice"));
        assert_eq!(owner_hint(&alice), None);
        assert!(crate::mcp::validate_session_id(alice.as_bytes()).is_ok());
        assert_eq!(tag_of(&alice).to_string().len(), 8);
        assert_eq!(tag_of(&alice), tag_of(&alice));
    }

    #[test]
    fn registry_round_trip() {
        let registry = SessionRegistry::default();
        let id = mint_session_id("w").unwrap();
        registry.insert(session(&id));
        assert_eq!(registry.len(), 1);
        assert!(registry.get(&id).is_some());
        assert!(registry.remove(&id).is_some());
        assert!(registry.get(&id).is_none());
    }

    #[test]
    fn a_retired_session_is_found_with_its_reason_but_not_counted() {
        let registry = SessionRegistry::default();
        registry.insert(session("s1"));
        assert!(registry.retire("s1", "its process exited").is_some());
        assert_eq!(registry.len(), 0);
        assert!(registry.ids().is_empty());
        let found = registry
            .get("s1")
            .expect("retired sessions are still found");
        assert_eq!(found.ended(), Some("its process exited"));
        assert!(registry.retire("s1", "again").is_none(), "retired once");
        registry.forget_retired("s1");
        assert!(registry.get("s1").is_none());
    }

    #[test]
    fn a_second_insert_of_a_live_id_returns_the_first() {
        let registry = SessionRegistry::default();
        let first = registry.insert(session("s"));
        let second = registry.insert(session("s"));
        assert!(Arc::ptr_eq(&first, &second));
    }
}
