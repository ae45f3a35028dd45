//! The mesh port before authentication: how many handshakes may be in progress, and
//! how often their failures are logged.
//!
//! Anyone who reaches the mesh port can open connections and never finish the TLS
//! handshake. Each such connection holds a descriptor and a task until the handshake
//! deadline ([`MeshLimits::connect_timeout`](super::config::MeshLimits::connect_timeout)), and
//! each failure used to write a warning. So:
//!
//! - [`HandshakeGate`] caps the handshakes in progress, per source address
//!   ([`MeshLimits::max_handshakes_per_addr`](super::config::MeshLimits::max_handshakes_per_addr))
//!   and in all ([`MeshLimits::max_handshakes`](super::config::MeshLimits::max_handshakes)); a
//!   connection over either cap is closed at once, before any TLS work. Mesh members
//!   that are already connected are not affected, and one noisy address cannot use up
//!   the whole cap.
//! - [`FailureLog`] writes at most one line per [`FAILURE_LOG_INTERVAL`], carrying the
//!   number of failures since the previous line; the metrics
//!   (`MeshObserver::handshake`) still count every one.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
use tracing::warn;

/// Shortest time between two log lines about failed mesh handshakes.
pub(crate) const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Handshakes in progress, per source address and in all, with their caps.
#[derive(Debug)]
pub(crate) struct HandshakeGate {
    /// Handshakes one source address may have in progress.
    per_addr: usize,
    /// Handshakes all addresses together may have in progress.
    total: usize,
    /// Counts now; an address with none in progress has no entry.
    books: Mutex<GateBooks>,
}

#[derive(Debug, Default)]
struct GateBooks {
    by_addr: HashMap<IpAddr, usize>,
    total: usize,
}

/// Why a connection was not let into the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GateFull {
    /// Its source address already has this many handshakes in progress.
    Address(usize),
    /// The server already has this many handshakes in progress.
    Total(usize),
}

impl GateFull {
    /// What the log line says about it.
    pub(crate) fn reason(self) -> String {
        match self {
            GateFull::Address(n) => {
                format!("its address already has {n} mesh handshakes in progress")
            }
            GateFull::Total(n) => format!("{n} mesh handshakes are already in progress"),
        }
    }
}

impl HandshakeGate {
    /// A gate with these caps (each at least one).
    pub(crate) fn new(per_addr: usize, total: usize) -> Arc<Self> {
        Arc::new(Self {
            per_addr: per_addr.max(1),
            total: total.max(1),
            books: Mutex::new(GateBooks::default()),
        })
    }

    /// A place for one handshake from `addr`, held until the permit drops, or which
    /// cap is full. Never waits.
    pub(crate) fn enter(self: &Arc<Self>, addr: IpAddr) -> Result<HandshakePermit, GateFull> {
        let mut books = self.books.lock();
        if books.total >= self.total {
            return Err(GateFull::Total(self.total));
        }
        let here = books.by_addr.entry(addr).or_default();
        if *here >= self.per_addr {
            return Err(GateFull::Address(self.per_addr));
        }
        *here += 1;
        books.total += 1;
        Ok(HandshakePermit {
            gate: Arc::clone(self),
            addr,
        })
    }

    /// Handshakes in progress now.
    pub(crate) fn in_progress(&self) -> usize {
        self.books.lock().total
    }
}

/// One handshake's place in the [`HandshakeGate`].
#[derive(Debug)]
pub(crate) struct HandshakePermit {
    gate: Arc<HandshakeGate>,
    addr: IpAddr,
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        let mut books = self.gate.books.lock();
        books.total = books.total.saturating_sub(1);
        if let Some(here) = books.by_addr.get_mut(&self.addr) {
            *here = here.saturating_sub(1);
            if *here == 0 {
                books.by_addr.remove(&self.addr);
            }
        }
    }
}

/// Rate-limits the log lines about failed handshakes: the first failure is logged,
/// later ones only once [`FAILURE_LOG_INTERVAL`] has passed since the last line, and
/// each line says how many failures went unlogged before it.
#[derive(Debug)]
pub(crate) struct FailureLog {
    interval: Duration,
    state: Mutex<LogState>,
}

#[derive(Debug, Default)]
struct LogState {
    /// When the last line was written.
    last_line: Option<Instant>,
    /// Failures since the last line that it did not report.
    unlogged: u64,
}

impl FailureLog {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new(LogState::default()),
        }
    }

    /// Counts one failure at `now`; when a line is due, the number of failures it
    /// reports (this one included), else `None`.
    pub(crate) fn due(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock();
        state.unlogged += 1;
        let due = state
            .last_line
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if !due {
            return None;
        }
        state.last_line = Some(now);
        Some(std::mem::take(&mut state.unlogged))
    }

    /// Counts one failed (or refused) handshake from `remote` and logs it if a line
    /// is due. `transport` and `cause` name it (`"tcp"`, `"tls"`); `reason` says what
    /// happened to this one.
    pub(crate) fn failed(
        &self,
        transport: &'static str,
        remote: SocketAddr,
        cause: &'static str,
        reason: &str,
    ) {
        if let Some(failures) = self.due(Instant::now()) {
            let interval_s = self.interval.as_secs();
            warn!(%remote, transport, cause, %reason, failures, interval_s,
                "mesh handshakes failed or refused before authentication \
                 (`failures` counts them since the last such line; at most one line per interval)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn one_address_is_capped_and_others_still_enter() {
        let gate = HandshakeGate::new(2, 3);
        let a1 = gate.enter(A).expect("a1");
        let _a2 = gate.enter(A).expect("a2");
        assert_eq!(gate.enter(A).err(), Some(GateFull::Address(2)));
        let _b1 = gate.enter(B).expect("b has its own places");
        assert_eq!(gate.enter(B).err(), Some(GateFull::Total(3)));
        drop(a1);
        assert_eq!(gate.in_progress(), 2);
        let _a3 = gate
            .enter(A)
            .expect("a place freed by a finished handshake");
    }

    #[test]
    fn a_finished_handshake_leaves_no_entry() {
        let gate = HandshakeGate::new(1, 1);
        drop(gate.enter(A).expect("a"));
        assert!(gate.books.lock().by_addr.is_empty());
        assert_eq!(gate.in_progress(), 0);
    }

    #[test]
    fn failures_are_logged_once_per_interval_with_their_count() {
        let log = FailureLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.due(t0), Some(1), "the first failure is logged");
        for i in 1..=99 {
            assert_eq!(log.due(t0 + Duration::from_millis(i * 10)), None);
        }
        assert_eq!(
            log.due(t0 + Duration::from_secs(10)),
            Some(100),
            "the next line counts the 99 unlogged failures and itself"
        );
        assert_eq!(log.due(t0 + Duration::from_secs(11)), None);
    }
}
