//! Legacy-era sessions: minted by `initialize`, ended by DELETE.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::{Value, json};
use tokio::sync::watch;

/// What the stateful demo tools remember for one session.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SessionState {
    /// `counter_increment`'s running value; proves requests reach the session they name.
    pub counter: u64,
    /// `session_append`'s list, in call order.
    pub items: Vec<String>,
}

impl SessionState {
    /// The state as `resources/read` shows it.
    pub fn to_json(&self) -> Value {
        json!({ "counter": self.counter, "items": self.items })
    }
}

/// One live session.
#[derive(Debug)]
pub struct Session {
    /// Behind a mutex because requests of one session may run on several
    /// connections at once; it is never held across an await.
    state: Mutex<SessionState>,
    /// Flips to `true` when the session ends, so its open GET streams close.
    ended: watch::Sender<bool>,
    /// `sleep_ms` calls running in the session: tests learn whether another request
    /// of the session ran meanwhile (two gateway workers acting for it at once).
    sleeping: AtomicUsize,
}

/// A `sleep_ms` call running in a session; dropping it ends it.
pub struct Sleeping<'s>(&'s Session);

impl Drop for Sleeping<'_> {
    fn drop(&mut self) {
        self.0.sleeping.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Session {
    fn new() -> Self {
        Self {
            state: Mutex::new(SessionState::default()),
            ended: watch::Sender::new(false),
            sleeping: AtomicUsize::new(0),
        }
    }

    /// Marks a `sleep_ms` call as running in the session until the guard drops.
    pub fn begin_sleep(&self) -> Sleeping<'_> {
        self.sleeping.fetch_add(1, Ordering::AcqRel);
        Sleeping(self)
    }

    /// Whether a `sleep_ms` call runs in the session now.
    pub fn is_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::Acquire) > 0
    }

    pub fn state(&self) -> &Mutex<SessionState> {
        &self.state
    }

    /// Resolves once the session has ended (at once if it already has).
    pub async fn ended(&self) {
        let mut ended = self.ended.subscribe();
        // An error means the sender is gone, which also means the session is.
        let _ = ended.wait_for(|ended| *ended).await;
    }
}

/// Locks session state; a poisoned lock still holds usable plain data.
pub fn lock(state: &Mutex<SessionState>) -> MutexGuard<'_, SessionState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// All live sessions, by id.
#[derive(Debug, Default)]
pub struct SessionStore {
    /// Keyed by the id string so a lookup borrows the header value as is.
    sessions: Mutex<HashMap<Box<str>, Arc<Session>>>,
    /// Every session ever minted, for `/stats`.
    created: AtomicU64,
}

impl SessionStore {
    /// Mints a session with a fresh random id.
    pub fn create(&self) -> Result<(String, Arc<Session>), getrandom::Error> {
        let id = mint_session_id()?;
        let session = Arc::new(Session::new());
        self.map().insert(id.as_str().into(), Arc::clone(&session));
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok((id, session))
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.map().get(id).cloned()
    }

    /// Ends a session: it is forgotten and its GET streams close.
    pub fn end(&self, id: &str) -> bool {
        let removed = self.map().remove(id);
        match removed {
            Some(session) => {
                session.ended.send_replace(true);
                true
            }
            None => false,
        }
    }

    pub fn open_count(&self) -> usize {
        self.map().len()
    }

    pub fn created_count(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    fn map(&self) -> MutexGuard<'_, HashMap<Box<str>, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// 128 random bits as 32 lowercase hex digits: unguessable, and plain
/// enough to travel in a header untouched.
fn mint_session_id() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = String::with_capacity(32);
    for byte in bytes {
        id.push(HEX[usize::from(byte >> 4)] as char);
        id.push(HEX[usize::from(byte & 0x0f)] as char);
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_32_hex_digits_and_distinct() {
        let first = mint_session_id().expect("randomness");
        let second = mint_session_id().expect("randomness");
        assert_eq!(first.len(), 32);
        assert!(
            first
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_ne!(first, second);
    }

    #[test]
    fn store_counts_open_and_created_sessions() {
        let store = SessionStore::default();
        let (first, _) = store.create().expect("randomness");
        let (second, _) = store.create().expect("randomness");
        assert_eq!((store.open_count(), store.created_count()), (2, 2));
        assert!(store.get(&first).is_some());
        assert!(store.end(&first));
        assert!(!store.end(&first), "a session ends once");
        assert!(store.get(&first).is_none());
        assert!(store.get(&second).is_some());
        assert_eq!((store.open_count(), store.created_count()), (1, 2));
    }

    #[test]
    fn sessions_do_not_share_state() {
        let store = SessionStore::default();
        let (_, first) = store.create().expect("randomness");
        let (_, second) = store.create().expect("randomness");
        lock(first.state()).counter += 1;
        assert_eq!(lock(first.state()).counter, 1);
        assert_eq!(lock(second.state()).counter, 0);
    }

    #[tokio::test]
    async fn ending_a_session_wakes_its_streams_even_late_ones() {
        let store = SessionStore::default();
        let (id, session) = store.create().expect("randomness");
        let waiter = tokio::spawn({
            let session = Arc::clone(&session);
            async move { session.ended().await }
        });
        store.end(&id);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("stream woke")
            .expect("task ran");
        // A stream that subscribes after the end must not wait forever.
        tokio::time::timeout(std::time::Duration::from_secs(5), session.ended())
            .await
            .expect("late stream woke");
    }
}
