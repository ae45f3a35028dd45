//! Downstream sessions held by this worker, and the ids the gateway mints for them.
//!
//! A session id carries a hint of its owner (`<32 hex>.<worker id>`), so any worker
//! can find the owner without a directory round trip. The hint is only a hint: the
//! owner always checks its own registry, so a forged id reaches no other session.
//!
//! A session ends in one of two ways: the gateway ends it (client DELETE, drain, idle
//! expiry: [`crate::execute::Executor::end_session`]), or it ends under the gateway (its
//! stdio process exited, its upstream forgot it): then it is *retired* with the
//! reason, and its requests are answered "gone" with that reason for a while.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::digest::{SessionTag, hex, sha256, tag_of};
use crate::execute::streams::SessionStreams;
use crate::link::UpstreamLink;

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
    /// What the session counts against in the per-principal session quota (the
    /// principal within its auth mode, or the client's address in public mode).
    pub quota_key: String,
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
    /// Exchanges running in the session right now (requests being answered, held GET
    /// streams): a session in use never expires, and is never handed over.
    in_use: AtomicUsize,
    /// Woken when the last exchange running in the session ends, for a handover
    /// waiting until no call of the session runs here.
    released: tokio::sync::Notify,
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
            quota_key: String::new(),
            link,
            shared: false,
            upstream_init: None,
            streams,
            last_activity: parking_lot::Mutex::new(Instant::now()),
            in_use: AtomicUsize::new(0),
            released: tokio::sync::Notify::new(),
            ended: OnceLock::new(),
        }
    }

    /// Resolves once no exchange runs in the session (at once if none does). New
    /// exchanges may still enter unless the session is in transit
    /// ([`SessionRegistry::begin_transit`]).
    pub async fn unused(&self) {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if self.in_use.load(Ordering::Acquire) == 0 {
                return;
            }
            released.await;
        }
    }

    /// Sets what the session counts against in the session quota.
    pub fn with_quota_key(mut self, quota_key: String) -> Session {
        self.quota_key = quota_key;
        self
    }

    /// Marks the session as used now.
    pub fn touch(&self) {
        *self.last_activity.lock() = Instant::now();
    }

    /// How long no request has used the session.
    pub fn idle_for(&self) -> Duration {
        self.last_activity.lock().elapsed()
    }

    /// Why the session ended under the gateway, if it did.
    pub fn ended(&self) -> Option<&str> {
        self.ended.get().map(String::as_str)
    }
}

/// One exchange's hold on a session: while it lives the session cannot expire, and
/// dropping it (the answer fully sent, or the client gone) marks the session used now.
/// Keep it with the answer's body, so a long stream holds the session.
#[derive(Debug)]
pub struct SessionUse {
    session: Arc<Session>,
    /// False for a retired session: it is found (to tell why it ended) but not held.
    counted: bool,
}

impl SessionUse {
    pub fn session(&self) -> &Arc<Session> {
        &self.session
    }
}

impl Drop for SessionUse {
    fn drop(&mut self) {
        if self.counted {
            self.session.touch();
            if self.session.in_use.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.session.released.notify_waiters();
            }
        }
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
    format!("{SHARED_PREFIX}{}", hex(&digest[..SESSION_ENTROPY_BYTES]))
}

/// What every shared session id starts with; a minted one never does.
const SHARED_PREFIX: &str = "shared-";

/// Whether `sid` names a shared session (see [`shared_session_id`]).
pub fn is_shared_id(sid: &str) -> bool {
    sid.starts_with(SHARED_PREFIX)
}

/// The sessions this worker owns, and those that recently ended under it.
#[derive(Debug, Default)]
pub struct SessionRegistry {
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    /// Live sessions per quota key (see [`Session::quota_key`]).
    per_quota_key: parking_lot::Mutex<HashMap<String, usize>>,
    retired: parking_lot::Mutex<Retired>,
    /// One lock per shared session being opened, so concurrent first requests of one
    /// principal open one upstream session, not several.
    opening: parking_lot::Mutex<HashMap<String, std::sync::Weak<tokio::sync::Mutex<()>>>>,
    /// Sessions moving between this worker and another right now (being adopted here,
    /// or handed over by a drain), each with a channel that closes when the move ends.
    /// Written under the sessions' write lock and read under their read lock, so no
    /// exchange enters a session once its move began: two workers never act for it.
    transit: parking_lot::Mutex<HashMap<String, tokio::sync::watch::Receiver<()>>>,
    /// How many sessions `transit` holds: every request asks whether its session is in
    /// transit, and almost always none is, so it looks at this counter, not the map's
    /// lock. Changed under the sessions' write lock, read under their read lock.
    in_transit: AtomicUsize,
}

/// A session's move between workers (see [`SessionRegistry::begin_transit`]): while
/// it lives, no exchange enters the session here, and requests for it wait
/// ([`SessionRegistry::wait_transit`]). Dropping it ends the move.
#[derive(Debug)]
pub struct Transit<'r> {
    registry: &'r SessionRegistry,
    id: String,
    /// Dropped with the move: its receivers learn that it ended.
    done: tokio::sync::watch::Sender<()>,
}

impl Drop for Transit<'_> {
    fn drop(&mut self) {
        let _sessions = self.registry.write();
        let mut transit = self.registry.transit.lock();
        if transit
            .get(&self.id)
            .is_some_and(|ended| ended.same_channel(&self.done.subscribe()))
        {
            transit.remove(&self.id);
            self.registry.in_transit.fetch_sub(1, Ordering::AcqRel);
        }
    }
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

    /// The session `id`, held for one exchange (see [`SessionUse`]): a live one is
    /// taken under the lock that expiry takes, so it never expires under a starting
    /// exchange; a retired one is found (its requests hear why it ended), not held.
    /// A session in transit is not entered (see [`Self::begin_transit`]).
    pub fn enter(&self, id: &str) -> Option<SessionUse> {
        let sessions = self.read();
        if self.in_transit.load(Ordering::Acquire) > 0 && self.transit.lock().contains_key(id) {
            return None;
        }
        if let Some(session) = sessions.get(id) {
            session.in_use.fetch_add(1, Ordering::AcqRel);
            return Some(SessionUse {
                session: Arc::clone(session),
                counted: true,
            });
        }
        let retired = self.retired.lock().by_id.get(id).cloned()?;
        Some(SessionUse {
            session: retired,
            counted: false,
        })
    }

    /// Marks session `id` as moving between this worker and another (adopted here, or
    /// handed over): until the returned [`Transit`] is dropped no exchange enters it
    /// here, and requests for it wait in [`Self::wait_transit`]. `None` when another
    /// move of it is under way here.
    pub fn begin_transit(&self, id: &str) -> Option<Transit<'_>> {
        let _sessions = self.write();
        let mut transit = self.transit.lock();
        if transit.contains_key(id) {
            return None;
        }
        let (done, ended) = tokio::sync::watch::channel(());
        transit.insert(id.to_owned(), ended);
        self.in_transit.fetch_add(1, Ordering::AcqRel);
        Some(Transit {
            registry: self,
            id: id.to_owned(),
            done,
        })
    }

    /// Waits, at most `bound`, for a move of session `id` to end; returns at once if
    /// none is under way. Whether one was.
    pub async fn wait_transit(&self, id: &str, bound: Duration) -> bool {
        if self.in_transit.load(Ordering::Acquire) == 0 {
            return false;
        }
        let ended = self.transit.lock().get(id).cloned();
        let Some(mut ended) = ended else {
            return false;
        };
        // The sender is only dropped, never used: `changed` resolves when it is.
        let _ = tokio::time::timeout(bound, ended.changed()).await;
        true
    }

    /// Adds a session unless one with its id is live already; returns the one held.
    pub fn insert(&self, session: Session) -> Arc<Session> {
        let session = Arc::new(session);
        let held = self
            .write()
            .entry(session.id.clone())
            .or_insert_with(|| Arc::clone(&session))
            .clone();
        if Arc::ptr_eq(&held, &session) {
            *self
                .per_quota_key
                .lock()
                .entry(session.quota_key.clone())
                .or_default() += 1;
        }
        held
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Session>> {
        let removed = self.write().remove(id)?;
        self.uncount(&removed);
        Some(removed)
    }

    /// Live sessions this worker holds for `quota_key`.
    pub fn count_for(&self, quota_key: &str) -> usize {
        self.per_quota_key
            .lock()
            .get(quota_key)
            .copied()
            .unwrap_or(0)
    }

    /// Removes and returns the live sessions no exchange has used for `idle`.
    pub fn take_idle(&self, idle: Duration) -> Vec<Arc<Session>> {
        let mut sessions = self.write();
        let expired: Vec<String> = sessions
            .values()
            .filter(|s| s.in_use.load(Ordering::Acquire) == 0 && s.idle_for() >= idle)
            .map(|s| s.id.clone())
            .collect();
        let taken: Vec<Arc<Session>> = expired
            .iter()
            .filter_map(|id| sessions.remove(id))
            .collect();
        drop(sessions);
        for session in &taken {
            self.uncount(session);
        }
        taken
    }

    fn uncount(&self, session: &Session) {
        let mut counts = self.per_quota_key.lock();
        if let Some(n) = counts.get_mut(&session.quota_key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&session.quota_key);
            }
        }
    }

    /// Moves a live session to the retired ones with the reason it ended; returns it
    /// if it was live.
    pub fn retire(&self, id: &str, why: &str) -> Option<Arc<Session>> {
        let session = self.write().remove(id)?;
        self.uncount(&session);
        self.keep_retired(Arc::clone(&session), why);
        Some(session)
    }

    /// Remembers a session already taken out of the live ones (idle expiry) as retired
    /// with `why`, so its clients hear it once.
    pub fn keep_retired(&self, session: Arc<Session>, why: &str) {
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
        retired.order.push_back((now, session.id.clone()));
        retired.by_id.insert(session.id.clone(), session);
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
        let taken: Vec<Arc<Session>> = self.write().drain().map(|(_, s)| s).collect();
        self.per_quota_key.lock().clear();
        taken
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

    #[tokio::test(start_paused = true)]
    async fn idle_sessions_expire_and_held_ones_do_not() {
        let registry = SessionRegistry::default();
        for id in ["idle", "held", "recent"] {
            registry.insert(session(id).with_quota_key("alice".into()));
        }
        assert_eq!(registry.count_for("alice"), 3);
        let held = registry.enter("held").unwrap();
        tokio::time::advance(Duration::from_secs(50)).await;
        drop(registry.enter("recent"));
        tokio::time::advance(Duration::from_secs(20)).await;
        let ids = |taken: Vec<Arc<Session>>| taken.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(registry.take_idle(Duration::from_secs(60))), ["idle"]);
        assert_eq!(registry.count_for("alice"), 2);
        // Held for 70 s, but in use: it stays, and its idle time counts from release.
        drop(held);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(ids(registry.take_idle(Duration::from_secs(60))), ["recent"]);
        assert!(registry.get("held").is_some());
        assert!(
            registry.enter("recent").is_none(),
            "an expired session is gone"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_in_transit_is_not_entered_and_its_waiters_go_on_when_it_ends() {
        let registry = SessionRegistry::default();
        registry.insert(session("s"));
        let transit = registry.begin_transit("s").expect("no move under way");
        assert!(registry.begin_transit("s").is_none(), "one move at a time");
        assert!(
            registry.enter("s").is_none(),
            "no exchange enters a moving session"
        );
        let waiting = registry.wait_transit("s", Duration::from_secs(10));
        tokio::pin!(waiting);
        assert!(futures_util::poll!(waiting.as_mut()).is_pending());
        drop(transit);
        assert!(waiting.await, "a move was under way");
        assert!(registry.enter("s").is_some(), "entered once the move ended");
        assert!(!registry.wait_transit("s", Duration::from_secs(10)).await);
        // A move that does not end in time: the waiter goes on after the bound.
        let _stuck = registry.begin_transit("s").expect("no move under way");
        let started = tokio::time::Instant::now();
        assert!(registry.wait_transit("s", Duration::from_secs(3)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn unused_resolves_once_the_last_exchange_in_the_session_ends() {
        let registry = SessionRegistry::default();
        let held = registry.insert(session("s"));
        let (first, second) = (registry.enter("s"), registry.enter("s"));
        let unused = held.unused();
        tokio::pin!(unused);
        assert!(futures_util::poll!(unused.as_mut()).is_pending());
        drop(first);
        assert!(futures_util::poll!(unused.as_mut()).is_pending());
        drop(second);
        unused.await;
    }

    #[test]
    fn a_second_insert_of_a_live_id_returns_the_first() {
        let registry = SessionRegistry::default();
        let first = registry.insert(session("s"));
        let second = registry.insert(session("s"));
        assert!(Arc::ptr_eq(&first, &second));
    }
}
