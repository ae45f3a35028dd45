//! Exact execution counters, served at `GET /stats`.
//!
//! The gateway's tests use them to prove that one client request runs
//! exactly once upstream, whatever the number of workers in between.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

use super::session::SessionStore;

#[derive(Debug, Default)]
pub struct Stats {
    /// JSON-RPC requests that reached method dispatch (including
    /// `initialize`, unknown methods and unknown tools); requests refused
    /// before dispatch (bad headers, unknown session) and notifications do
    /// not count.
    requests: AtomicU64,
    /// The subset of `requests` whose method was `tools/call`.
    tool_calls: AtomicU64,
    /// Requests that began in a session while a `sleep_ms` call of the same session
    /// was running (tests check that no second worker acts for a session whose slow
    /// call still runs at its owner).
    during_sleep: AtomicU64,
    /// The subset of `requests` whose method was `resources/list` (each page), so
    /// tests see how often and how far a gateway followed a list.
    resource_lists: AtomicU64,
    /// The W3C `traceparent` header of the last POST that carried one, so tests can
    /// check that trace context reaches the upstream through the gateway.
    last_traceparent: parking_lot::Mutex<Option<String>>,
}

impl Stats {
    /// Counts one request about to be executed.
    pub fn record_request(&self, method: &str) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if method == "tools/call" {
            self.tool_calls.fetch_add(1, Ordering::Relaxed);
        }
        if method == "resources/list" {
            self.resource_lists.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a request that begins while a `sleep_ms` of its session runs.
    pub fn record_during_sleep(&self) {
        self.during_sleep.fetch_add(1, Ordering::Relaxed);
    }

    /// Remembers the trace context a request came with.
    pub fn record_traceparent(&self, traceparent: &str) {
        *self.last_traceparent.lock() = Some(traceparent.to_owned());
    }

    pub fn to_json(&self, sessions: &SessionStore) -> Value {
        json!({
            "requests": self.requests.load(Ordering::Relaxed),
            "tool_calls": self.tool_calls.load(Ordering::Relaxed),
            "during_sleep": self.during_sleep.load(Ordering::Relaxed),
            "resource_lists": self.resource_lists.load(Ordering::Relaxed),
            "sessions_open": sessions.open_count(),
            "sessions_created": sessions.created_count(),
            "last_traceparent": *self.last_traceparent.lock(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_counted_apart_from_requests() {
        let stats = Stats::default();
        let sessions = SessionStore::default();
        for method in ["initialize", "tools/list", "tools/call", "tools/call"] {
            stats.record_request(method);
        }
        assert_eq!(
            stats.to_json(&sessions),
            json!({"requests": 4, "tool_calls": 2, "during_sleep": 0, "resource_lists": 0, "sessions_open": 0, "sessions_created": 0, "last_traceparent": null})
        );
    }
}
