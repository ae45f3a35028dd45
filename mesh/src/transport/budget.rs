//! Stream budgets: how many exchanges one peer may have in flight, in two classes, so
//! that held streams never make a short request wait.
//!
//! - **Short**: an ordinary request (`POST`, `DELETE`) whose answer ends soon.
//! - **Long**: an exchange meant to stay open: a `GET` (a session's event stream) from
//!   the start, or a request whose answer turned out to be an SSE stream
//!   (`content-type: text/event-stream`), moved over when its head is seen.
//!
//! Both ends keep the same books: the caller per peer address, the owner per peer
//! mesh identity (its certificate's, not the worker id it declares; over Redis, which
//! has no mTLS, the worker id). A full budget refuses at once (the caller gets
//! [`MeshError::BudgetExhausted`](super::error::MeshError::BudgetExhausted), the owner answers
//! `Error(Busy)`); nothing ever waits for a slot, so a budget can never turn into a
//! hang.
//!
//! A request moved to the long class when its head arrives is already running, so it
//! moves even when the long budget is full: the long class may then exceed its limit by
//! at most the short limit (the requests that were short a moment before). Refusing
//! such a stream would lose an answer the owner already produced.

use std::sync::Arc;

use mcpgw_wire::ResponseHead;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// Which budget an exchange draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamClass {
    /// An ordinary request whose answer ends soon.
    Short,
    /// An exchange that may stay open: a GET stream or an SSE answer.
    Long,
}

impl StreamClass {
    /// The class a request starts in: `GET` opens a stream, anything else is short
    /// until its head says otherwise.
    pub(crate) fn of_request(method: &str) -> Self {
        if method.eq_ignore_ascii_case("GET") {
            StreamClass::Long
        } else {
            StreamClass::Short
        }
    }

    /// The class's name in errors and logs.
    pub(crate) fn name(self) -> &'static str {
        match self {
            StreamClass::Short => "short-request",
            StreamClass::Long => "long-lived-stream",
        }
    }
}

/// Whether a response head announces an SSE stream, which may stay open.
pub(crate) fn is_event_stream(head: &ResponseHead) -> bool {
    head.headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("content-type")
            && value
                .trim_start()
                .get(..17)
                .is_some_and(|v| v.eq_ignore_ascii_case("text/event-stream"))
    })
}

/// A refused admission: the class whose budget is full, and its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exhausted {
    pub(crate) class: StreamClass,
    pub(crate) limit: usize,
}

/// In-flight exchanges per peer in both classes, with their limits.
#[derive(Debug)]
pub(crate) struct Budgets {
    /// Short requests one peer may have in flight.
    short_limit: usize,
    /// Long-lived exchanges one peer may have in flight.
    long_limit: usize,
    /// Counts per peer; a peer with nothing in flight has no entry.
    books: Mutex<Books>,
    /// Woken whenever the total drops to zero, for shutdown.
    idle: Notify,
}

/// What one side of the mesh has in flight now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StreamCounts {
    /// Short requests in flight.
    pub short: usize,
    /// Long-lived exchanges (GET streams, SSE answers) in flight.
    pub long: usize,
    /// Peers with anything in flight.
    pub peers: usize,
}

/// Reads a mesh endpoint's in-flight counts whenever asked (for metrics).
#[derive(Clone)]
pub struct StreamCounter(pub(crate) Arc<Budgets>);

impl StreamCounter {
    pub fn counts(&self) -> StreamCounts {
        self.0.counts()
    }
}

#[derive(Debug, Default)]
struct Books {
    peers: rustc_hash::FxHashMap<Arc<str>, Counts>,
    total: usize,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    short: usize,
    long: usize,
}

impl Budgets {
    /// Budgets of `short_limit` and `long_limit` per peer (each at least one).
    pub(crate) fn new(short_limit: usize, long_limit: usize) -> Arc<Self> {
        Arc::new(Self {
            short_limit: short_limit.max(1),
            long_limit: long_limit.max(1),
            books: Mutex::new(Books::default()),
            idle: Notify::new(),
        })
    }

    /// Takes a slot of `class` for `peer`, or says which budget is full. Never waits.
    pub(crate) fn admit(
        self: &Arc<Self>,
        peer: &str,
        class: StreamClass,
    ) -> Result<Permit, Exhausted> {
        let mut books = self.books.lock();
        let key = match books.peers.get_key_value(peer) {
            Some((key, _)) => key.clone(),
            None => Arc::from(peer),
        };
        let counts = books.peers.entry(key.clone()).or_default();
        let (count, limit) = match class {
            StreamClass::Short => (&mut counts.short, self.short_limit),
            StreamClass::Long => (&mut counts.long, self.long_limit),
        };
        if *count >= limit {
            if counts.short == 0 && counts.long == 0 {
                books.peers.remove(peer);
            }
            return Err(Exhausted { class, limit });
        }
        *count += 1;
        books.total += 1;
        Ok(Permit {
            budgets: self.clone(),
            peer: key,
            class,
        })
    }

    /// Exchanges in flight now, by budget, and the peers they go to (or come from).
    pub(crate) fn counts(&self) -> StreamCounts {
        let books = self.books.lock();
        let (short, long) = books
            .peers
            .values()
            .fold((0, 0), |(s, l), c| (s + c.short, l + c.long));
        StreamCounts {
            short,
            long,
            peers: books.peers.len(),
        }
    }

    /// Exchanges in flight over all peers.
    pub(crate) fn total(&self) -> usize {
        self.books.lock().total
    }

    /// Resolves once nothing is in flight.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.total() == 0 {
                return;
            }
            notified.await;
        }
    }

    fn release(&self, peer: &str, class: StreamClass) {
        let mut books = self.books.lock();
        let Some(counts) = books.peers.get_mut(peer) else {
            return;
        };
        match class {
            StreamClass::Short => counts.short = counts.short.saturating_sub(1),
            StreamClass::Long => counts.long = counts.long.saturating_sub(1),
        }
        if counts.short == 0 && counts.long == 0 {
            books.peers.remove(peer);
        }
        books.total = books.total.saturating_sub(1);
        if books.total == 0 {
            drop(books);
            self.idle.notify_waiters();
        }
    }

    fn promote(&self, peer: &str) {
        let mut books = self.books.lock();
        if let Some(counts) = books.peers.get_mut(peer) {
            counts.short = counts.short.saturating_sub(1);
            counts.long += 1;
        }
    }
}

/// One admitted exchange's slot; freed when dropped.
#[derive(Debug)]
pub(crate) struct Permit {
    budgets: Arc<Budgets>,
    peer: Arc<str>,
    class: StreamClass,
}

impl Permit {
    /// Moves a short exchange whose answer turned out to be a stream to the long
    /// budget (see the module docs: this never fails).
    pub(crate) fn promote(&mut self) {
        if self.class == StreamClass::Short {
            self.budgets.promote(&self.peer);
            self.class = StreamClass::Long;
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.budgets.release(&self.peer, self.class);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_have_separate_limits() {
        let budgets = Budgets::new(2, 1);
        let s1 = budgets.admit("a", StreamClass::Short).expect("short 1");
        let _s2 = budgets.admit("a", StreamClass::Short).expect("short 2");
        let l1 = budgets.admit("a", StreamClass::Long).expect("long 1");
        assert_eq!(
            budgets.admit("a", StreamClass::Long).err(),
            Some(Exhausted {
                class: StreamClass::Long,
                limit: 1
            })
        );
        assert!(
            budgets.admit("a", StreamClass::Short).is_err(),
            "short is full too"
        );
        // Another peer has budgets of its own.
        let _b = budgets.admit("b", StreamClass::Long).expect("peer b");
        drop(l1);
        let _l2 = budgets
            .admit("a", StreamClass::Long)
            .expect("a freed long slot");
        drop(s1);
        let _s3 = budgets
            .admit("a", StreamClass::Short)
            .expect("a freed short slot");
        assert_eq!(budgets.total(), 4);
    }

    #[test]
    fn a_promoted_stream_frees_its_short_slot() {
        let budgets = Budgets::new(1, 1);
        let _held = budgets.admit("a", StreamClass::Long).expect("long");
        let mut sse = budgets.admit("a", StreamClass::Short).expect("short");
        sse.promote();
        // The long budget is over its limit by the promoted stream, the short one free.
        let short = budgets.admit("a", StreamClass::Short).expect("short again");
        drop((sse, short, _held));
        assert_eq!(budgets.total(), 0);
        assert!(
            budgets.books.lock().peers.is_empty(),
            "no entry is left behind"
        );
    }

    #[test]
    fn event_streams_are_recognised() {
        let head = |v: &str| ResponseHead {
            status: 200,
            headers: vec![("Content-Type".into(), v.into())],
        };
        assert!(is_event_stream(&head("text/event-stream")));
        assert!(is_event_stream(&head(" Text/Event-Stream; charset=utf-8")));
        assert!(!is_event_stream(&head("application/json")));
        assert!(!is_event_stream(&head("text/event")));
        assert_eq!(StreamClass::of_request("GET"), StreamClass::Long);
        assert_eq!(StreamClass::of_request("POST"), StreamClass::Short);
    }

    #[tokio::test]
    async fn idle_is_signalled_when_the_last_exchange_ends() {
        let budgets = Budgets::new(4, 4);
        let permit = budgets.admit("a", StreamClass::Short).expect("short");
        let waiter = tokio::spawn({
            let budgets = budgets.clone();
            async move { budgets.wait_idle().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(permit);
        waiter.await.expect("idle");
    }
}
