//! Which JSON-RPC request ids ran in which session, served at `GET /executed`.
//!
//! Counters say how many calls ran; the gateway's fault tests must also know which:
//! an answer that told the client "retry, it did not run" must name an id that never
//! ran, and no id may run twice. The log outlives its session (a session ended by
//! its gateway still shows what ran in it) and is bounded: once it holds
//! [`EXECUTED_KEPT`] ids it keeps no more and counts what it left out, so a test that
//! finds `dropped` above zero knows its picture is incomplete instead of trusting it.

use std::collections::HashMap;

use serde_json::{Value, json};

/// At most this many ids are kept over all sessions (a fault test's load sends tens
/// of thousands of requests at most; a benchmark's overflow costs nothing but `dropped`).
pub const EXECUTED_KEPT: usize = 100_000;

#[derive(Debug, Default)]
pub struct Executed {
    log: parking_lot::Mutex<Log>,
}

#[derive(Debug, Default)]
struct Log {
    /// Session id → the ids of the requests that ran in it, in the order they ran.
    sessions: HashMap<String, Vec<Value>>,
    kept: usize,
    dropped: u64,
}

impl Executed {
    /// Notes that request `id` runs now in `session`.
    pub fn record(&self, session: &str, id: &Value) {
        self.record_within(session, id, EXECUTED_KEPT);
    }

    fn record_within(&self, session: &str, id: &Value, limit: usize) {
        let mut log = self.log.lock();
        if log.kept >= limit {
            log.dropped += 1;
            return;
        }
        log.kept += 1;
        match log.sessions.get_mut(session) {
            Some(ids) => ids.push(id.clone()),
            None => {
                log.sessions.insert(session.to_owned(), vec![id.clone()]);
            }
        }
    }

    /// `{"sessions": {"<session id>": [ids in the order they ran]}, "dropped": n}`.
    pub fn to_json(&self) -> Value {
        let log = self.log.lock();
        json!({ "sessions": log.sessions, "dropped": log.dropped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_per_session_in_order_and_the_overflow_is_counted() {
        let executed = Executed::default();
        executed.record_within("a", &json!(1), 3);
        executed.record_within("b", &json!("x"), 3);
        executed.record_within("a", &json!(1), 3);
        executed.record_within("a", &json!(2), 3);
        assert_eq!(
            executed.to_json(),
            json!({"sessions": {"a": [1, 1], "b": ["x"]}, "dropped": 1})
        );
    }
}
