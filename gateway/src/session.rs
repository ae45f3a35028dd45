//! Downstream sessions held by this worker, and the ids the gateway mints for them.
//!
//! A session id carries a hint of its owner (`<32 hex>.<worker id>`), so any worker
//! can find the owner without a directory round trip. The hint is only a hint: the
//! owner always checks its own registry, so a forged id reaches no other session.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::HeaderValue;
use parking_lot::RwLock;
use tokio::time::Instant;

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
    /// What the session counts against in the per-principal quota (the principal, or
    /// the client's address in public mode).
    pub quota_key: String,
    /// Exchanges running in the session right now (requests being answered, held GET
    /// streams): a session in use never expires.
    in_use: AtomicUsize,
    /// When the last exchange ended (or the session opened), in milliseconds since
    /// the registry's epoch: idle expiry counts from here.
    last_active_ms: AtomicU64,
}

impl Session {
    pub fn new(
        id: String,
        upstream: usize,
        upstream_session_id: Option<HeaderValue>,
        principal: String,
        quota_key: String,
    ) -> Session {
        Session {
            id,
            upstream,
            upstream_session_id,
            principal,
            quota_key,
            in_use: AtomicUsize::new(0),
            last_active_ms: AtomicU64::new(0),
        }
    }
}

/// One exchange's hold on a session: while it lives the session cannot expire, and
/// dropping it (the answer fully sent, or the client gone) marks the session active
/// now. Keep it with the answer's body so a long stream holds the session.
#[derive(Debug)]
pub struct SessionUse {
    session: Arc<Session>,
    epoch: Instant,
}

impl std::ops::Deref for SessionUse {
    type Target = Arc<Session>;

    fn deref(&self) -> &Arc<Session> {
        &self.session
    }
}

impl Drop for SessionUse {
    fn drop(&mut self) {
        self.session
            .last_active_ms
            .store(millis_since(self.epoch), Ordering::Relaxed);
        self.session.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

fn millis_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
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

/// A short, stable stand-in for a session id in logs: the id itself is a bearer
/// credential for the session and never goes to a log line.
pub fn short(session_id: &str) -> String {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same id gives the same tag in every worker's logs.
    let mut hasher = std::hash::DefaultHasher::new();
    session_id.hash(&mut hasher);
    format!("{:08x}", hasher.finish() as u32)
}

/// The owner a session id claims, if it has the gateway's shape.
pub fn owner_hint(session_id: &str) -> Option<&str> {
    let (random, owner) = session_id.split_at_checked(SESSION_ENTROPY_BYTES * 2)?;
    let owner = owner.strip_prefix('.')?;
    let well_formed =
        random.bytes().all(|b| b.is_ascii_hexdigit()) && crate::config::valid_worker_id(owner);
    well_formed.then_some(owner)
}

/// The sessions this worker owns, and how many each quota key holds.
#[derive(Debug)]
pub struct SessionRegistry {
    inner: RwLock<Registry>,
    /// Zero point of the sessions' activity clocks.
    epoch: Instant,
}

#[derive(Debug, Default)]
struct Registry {
    sessions: HashMap<String, Arc<Session>>,
    per_quota_key: HashMap<String, usize>,
}

impl Default for SessionRegistry {
    fn default() -> Self {
        SessionRegistry {
            inner: RwLock::new(Registry::default()),
            epoch: Instant::now(),
        }
    }
}

impl SessionRegistry {
    /// The session, without holding it (bookkeeping, drains).
    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.inner.read().sessions.get(id).cloned()
    }

    /// The session, held for one exchange (see [`SessionUse`]). Taken under the same
    /// lock that expiry takes, so a session is never expired under a starting exchange.
    pub fn enter(&self, id: &str) -> Option<SessionUse> {
        let inner = self.inner.read();
        let session = inner.sessions.get(id)?;
        session.in_use.fetch_add(1, Ordering::AcqRel);
        Some(SessionUse {
            session: Arc::clone(session),
            epoch: self.epoch,
        })
    }

    pub fn insert(&self, session: Session) -> Arc<Session> {
        session
            .last_active_ms
            .store(millis_since(self.epoch), Ordering::Relaxed);
        let session = Arc::new(session);
        let mut inner = self.inner.write();
        *inner
            .per_quota_key
            .entry(session.quota_key.clone())
            .or_default() += 1;
        if let Some(replaced) = inner
            .sessions
            .insert(session.id.clone(), Arc::clone(&session))
        {
            inner.uncount(&replaced.quota_key);
        }
        session
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Session>> {
        let mut inner = self.inner.write();
        let removed = inner.sessions.remove(id)?;
        inner.uncount(&removed.quota_key);
        Some(removed)
    }

    pub fn len(&self) -> usize {
        self.inner.read().sessions.len()
    }

    /// Sessions this worker holds for `quota_key`.
    pub fn count_for(&self, quota_key: &str) -> usize {
        self.inner
            .read()
            .per_quota_key
            .get(quota_key)
            .copied()
            .unwrap_or(0)
    }

    /// Every session id, for a drain or a directory rebuild.
    pub fn ids(&self) -> Vec<String> {
        self.inner.read().sessions.keys().cloned().collect()
    }

    /// Removes and returns every session (fencing).
    pub fn take_all(&self) -> Vec<Arc<Session>> {
        let mut inner = self.inner.write();
        inner.per_quota_key.clear();
        inner.sessions.drain().map(|(_, s)| s).collect()
    }

    /// Removes and returns the sessions no exchange has used for `idle`.
    pub fn take_idle(&self, idle: Duration) -> Vec<Arc<Session>> {
        let now = millis_since(self.epoch);
        let idle = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let mut inner = self.inner.write();
        let expired: Vec<String> = inner
            .sessions
            .values()
            .filter(|s| {
                s.in_use.load(Ordering::Acquire) == 0
                    && now.saturating_sub(s.last_active_ms.load(Ordering::Relaxed)) >= idle
            })
            .map(|s| s.id.clone())
            .collect();
        expired
            .iter()
            .filter_map(|id| {
                let removed = inner.sessions.remove(id)?;
                inner.uncount(&removed.quota_key);
                Some(removed)
            })
            .collect()
    }
}

impl Registry {
    fn uncount(&mut self, quota_key: &str) {
        if let Some(n) = self.per_quota_key.get_mut(quota_key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_quota_key.remove(quota_key);
            }
        }
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

    fn session(id: &str, quota_key: &str) -> Session {
        Session::new(id.to_owned(), 0, None, String::new(), quota_key.to_owned())
    }

    #[test]
    fn registry_round_trip() {
        let registry = SessionRegistry::default();
        let id = mint_session_id("w").unwrap();
        registry.insert(session(&id, "alice"));
        assert_eq!(registry.len(), 1);
        assert_eq!(registry.count_for("alice"), 1);
        assert!(registry.get(&id).is_some());
        assert!(registry.remove(&id).is_some());
        assert!(registry.get(&id).is_none());
        assert_eq!(registry.count_for("alice"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_sessions_expire_and_held_ones_do_not() {
        let registry = SessionRegistry::default();
        registry.insert(session("idle", "a"));
        registry.insert(session("held", "a"));
        registry.insert(session("recent", "b"));
        let held = registry.enter("held").unwrap();
        tokio::time::advance(Duration::from_secs(50)).await;
        drop(registry.enter("recent"));
        tokio::time::advance(Duration::from_secs(20)).await;
        let expired: Vec<String> = registry
            .take_idle(Duration::from_secs(60))
            .iter()
            .map(|s| s.id.clone())
            .collect();
        assert_eq!(expired, ["idle"]);
        assert_eq!(registry.count_for("a"), 1);
        // Held for 70 s, but in use: it stays, and its idle time counts from release.
        drop(held);
        tokio::time::advance(Duration::from_secs(59)).await;
        let expired: Vec<String> = registry
            .take_idle(Duration::from_secs(60))
            .iter()
            .map(|s| s.id.clone())
            .collect();
        assert_eq!(expired, ["recent"]);
        assert!(registry.get("held").is_some());
    }
}
