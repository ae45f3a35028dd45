//! Downstream sessions held by this worker, and the ids the gateway mints for them.
//!
//! A session id carries a hint of its owner (`<32 hex>.<worker id>`), so any worker
//! can find the owner without a directory round trip. The hint is only a hint: the
//! owner always checks its own registry, so a forged id reaches no other session.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use http::HeaderValue;

/// Random bytes in a session id: 128 bits, as the MCP security guidance asks.
const SESSION_ENTROPY_BYTES: usize = 16;

/// One client session and the upstream session that serves it, one to one, so no
/// state leaks between client sessions.
#[derive(Debug)]
pub struct Session {
    pub id: String,
    /// Index of the upstream (route) the session was opened on.
    pub upstream: usize,
    /// The upstream's own `Mcp-Session-Id`, if it issued one.
    pub upstream_session_id: Option<HeaderValue>,
    /// Who created the session; only the same principal may use it.
    pub principal: String,
}

/// Mints a session id owned by `worker_id`: 128 random bits, then the owner hint.
pub fn mint_session_id(worker_id: &str) -> std::io::Result<String> {
    let mut random = [0u8; SESSION_ENTROPY_BYTES];
    getrandom::fill(&mut random).map_err(std::io::Error::other)?;
    let mut id = String::with_capacity(SESSION_ENTROPY_BYTES * 2 + 1 + worker_id.len());
    for byte in random {
        id.push_str(&format!("{byte:02x}"));
    }
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

/// The sessions this worker owns.
#[derive(Debug, Default)]
pub struct SessionRegistry {
    sessions: RwLock<HashMap<String, Arc<Session>>>,
}

impl SessionRegistry {
    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.read().get(id).cloned()
    }

    pub fn insert(&self, session: Session) -> Arc<Session> {
        let session = Arc::new(session);
        self.write()
            .insert(session.id.clone(), Arc::clone(&session));
        session
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Session>> {
        self.write().remove(id)
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Every session id, for a drain or a directory rebuild.
    pub fn ids(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Removes and returns every session (fencing, drain).
    pub fn take_all(&self) -> Vec<Arc<Session>> {
        self.write().drain().map(|(_, s)| s).collect()
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
    fn registry_round_trip() {
        let registry = SessionRegistry::default();
        let id = mint_session_id("w").unwrap();
        registry.insert(Session {
            id: id.clone(),
            upstream: 0,
            upstream_session_id: None,
            principal: String::new(),
        });
        assert_eq!(registry.len(), 1);
        assert!(registry.get(&id).is_some());
        assert!(registry.remove(&id).is_some());
        assert!(registry.get(&id).is_none());
    }
}
