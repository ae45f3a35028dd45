//! This worker's lease in the fleet directory: until when it may act for its
//! sessions by its own clock, and the renewals that extend that time.
//!
//! The lease knows nothing of sessions or of the worker: a renewal returns an outcome
//! ([`LeaseCheck`]) and the worker acts on it (drops sessions taken elsewhere, fences
//! itself). The arithmetic ([`LeaseClock`]) uses `tokio::time::Instant`, so it can be
//! tested on a paused clock.

use std::time::Duration;

use mcpgw_mesh::directory::{Directory, DirectoryError, Lease, LeaseRenewal, WorkerInfo};
use parking_lot::Mutex;
use tokio::time::Instant;
use tracing::{error, info, warn};

/// Until when a worker may act for its sessions: the moment its last successful
/// renewal was *sent* plus the lease time, minus a margin. Counting from the send
/// (not the answer) means this deadline never lies later than Redis's own expiry.
#[derive(Debug, Clone, Copy)]
pub struct LeaseClock {
    /// How long the directory keeps the lease without a renewal.
    lease: Duration,
    /// Subtracted from every deadline: covers clock drift between this host and Redis
    /// and the time a renewal takes to be written.
    margin: Duration,
    /// The deadline itself.
    acts_until: Instant,
}

impl LeaseClock {
    /// A clock for a lease registered by a request sent at `sent_at`.
    pub fn new(lease: Duration, sent_at: Instant) -> LeaseClock {
        let margin = (lease / 5).max(Duration::from_millis(200));
        LeaseClock {
            lease,
            margin,
            acts_until: (sent_at + lease).checked_sub(margin).unwrap_or(sent_at),
        }
    }

    /// A renewal sent at `sent_at` succeeded; returns whether the worker may act at
    /// `now`. A late answer to an older renewal never moves the deadline back, and an
    /// answer that arrives after the lease it renewed has run out (the process was
    /// paused while it was on its way) makes nothing valid: the fleet may have declared
    /// this worker dead since Redis wrote it.
    pub fn renewed(&mut self, sent_at: Instant, now: Instant) -> bool {
        let until = (sent_at + self.lease)
            .checked_sub(self.margin)
            .unwrap_or(sent_at);
        self.acts_until = self.acts_until.max(until);
        self.valid_at(now)
    }

    /// Whether the worker may act at `now`.
    pub fn valid_at(&self, now: Instant) -> bool {
        now < self.acts_until
    }

    /// Never act again under this lease (fenced).
    pub fn revoke(&mut self, now: Instant) {
        self.acts_until = now;
    }

    #[cfg(test)]
    pub fn acts_until(&self) -> Instant {
        self.acts_until
    }
}

/// What a renewal attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseCheck {
    /// The lease is valid: renewed, resumed, or still within its time.
    Valid,
    /// The lease could not be proven now (Redis slow or unreachable): sessions wait.
    InDoubt,
    /// Redis came back empty; the worker registered again under its id and re-claimed
    /// its sessions. The listed ones were claimed by another worker meanwhile: drop
    /// them here.
    Rebuilt { taken: Vec<String> },
    /// Redis failed over to a replica, which may lack the last writes: the worker
    /// re-asserted its lease and re-claimed its sessions. The listed ones were claimed
    /// by another worker meanwhile: drop them here.
    FailedOver { taken: Vec<String> },
    /// Another worker declared this one dead (or took its id): fence.
    Lost,
    /// Renewed, and an operator asked this worker to drain (`mcpgw drain`): stop as on
    /// SIGTERM.
    DrainRequested,
}

/// This worker's lease and the renewals that keep it.
pub struct LeaseHolder {
    directory: Directory,
    /// What this worker published with its lease; published again on a rebuild.
    info: WorkerInfo,
    /// The registration, replaced when the directory is rebuilt.
    lease: Mutex<Lease>,
    clock: Mutex<LeaseClock>,
    /// Renewals run one at a time (heartbeat and on-demand revalidation); a request
    /// that waited for a running attempt takes its result instead of starting another.
    renewing: tokio::sync::Mutex<()>,
    /// Count of finished renewal attempts and the last one's result.
    last_attempt: Mutex<(u64, LeaseCheck)>,
    /// Set for good when the lease was lost (the worker was declared dead).
    revoked: std::sync::atomic::AtomicBool,
}

impl LeaseHolder {
    /// `sent_at`: when the registration that produced `lease` was sent.
    pub fn new(
        directory: Directory,
        info: WorkerInfo,
        lease: Lease,
        lease_time: Duration,
        sent_at: Instant,
    ) -> Self {
        LeaseHolder {
            directory,
            info,
            lease: Mutex::new(lease),
            clock: Mutex::new(LeaseClock::new(lease_time, sent_at)),
            renewing: tokio::sync::Mutex::new(()),
            last_attempt: Mutex::new((0, LeaseCheck::Valid)),
            revoked: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Publishes a reloaded mesh leaf's expiry with the next renewal.
    pub fn publish_cert_not_after(&self, not_after: std::time::SystemTime) {
        self.lease.lock().set_cert_not_after(Some(not_after));
    }

    /// A renewal sent at `sent_at` that Redis answered "renewed": valid, unless the
    /// answer came too late to prove it.
    fn renewed_check(&self, sent_at: Instant) -> LeaseCheck {
        match self.renewed(sent_at) {
            true => LeaseCheck::Valid,
            false => LeaseCheck::InDoubt,
        }
    }

    /// Records a renewal sent at `sent_at` that succeeded; returns whether this worker
    /// may act now, which a renewal answered too late does not prove.
    fn renewed(&self, sent_at: Instant) -> bool {
        let in_time = self.clock.lock().renewed(sent_at, Instant::now());
        if !in_time {
            warn!(
                worker = self.lease.lock().id(),
                waited_ms = sent_at.elapsed().as_millis() as u64,
                "a lease renewal was answered after the lease it renewed had run out (was \
                 this process paused?); acting for no session until one is answered in time"
            );
        }
        in_time
    }

    /// Whether this worker may act for its sessions right now.
    pub fn valid(&self) -> bool {
        self.clock.lock().valid_at(Instant::now())
    }

    /// The directory generation this worker registered under.
    pub fn generation(&self) -> String {
        self.lease.lock().generation().to_owned()
    }

    /// Never act under this lease again.
    pub fn revoke(&self) {
        self.revoked
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.clock.lock().revoke(Instant::now());
    }

    /// Whether the lease was lost for good (fenced).
    pub fn revoked(&self) -> bool {
        self.revoked.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Renews the lease (single-flight). With `only_if_invalid`, a lease that is still
    /// valid is left alone, and a caller that waited while another attempt ran takes
    /// that attempt's result: while Redis is slow, a crowd of requests costs one
    /// attempt at a time, not one each. `held_sessions` lists the sessions to
    /// re-claim should the directory turn out to have been lost.
    pub async fn renew(
        &self,
        only_if_invalid: bool,
        held_sessions: impl FnOnce() -> Vec<String>,
    ) -> LeaseCheck {
        let attempts_before = self.last_attempt.lock().0;
        let _one_at_a_time = self.renewing.lock().await;
        if only_if_invalid {
            if self.valid() {
                return LeaseCheck::Valid;
            }
            let last = self.last_attempt.lock();
            if last.0 != attempts_before {
                return last.1.clone();
            }
        }
        let check = self.attempt(held_sessions).await;
        let mut last = self.last_attempt.lock();
        *last = (last.0 + 1, check.clone());
        check
    }

    async fn attempt(&self, held_sessions: impl FnOnce() -> Vec<String>) -> LeaseCheck {
        let lease = self.lease.lock().clone();
        if self.directory.take_failover() {
            return self.reassert(&lease, held_sessions()).await;
        }
        let sent_at = Instant::now();
        match self.directory.renew_lease(&lease).await {
            Ok(LeaseRenewal::Renewed { .. }) => self.renewed_check(sent_at),
            Ok(LeaseRenewal::DrainRequested { .. }) => {
                // Asked for whether or not the answer came in time; the worker acts on
                // its clock either way.
                self.renewed(sent_at);
                LeaseCheck::DrainRequested
            }
            Ok(LeaseRenewal::DirectoryLost) => {
                warn!(
                    worker = lease.id(),
                    "directory came back empty; registering again and re-claiming sessions"
                );
                self.rebuild(&lease, held_sessions()).await
            }
            Ok(LeaseRenewal::Lost) => self.resume(&lease, held_sessions).await,
            Err(e) => {
                warn!(worker = lease.id(), error = %e, "lease renewal failed; sessions stay valid until the lease runs out");
                self.in_doubt()
            }
        }
    }

    /// The lease expired in Redis (Redis stalled past it): take it back unless another
    /// worker acted on the expiry.
    async fn resume(
        &self,
        lease: &Lease,
        held_sessions: impl FnOnce() -> Vec<String>,
    ) -> LeaseCheck {
        let sent_at = Instant::now();
        match self.directory.resume_lease(lease).await {
            // A drain request is seen by the next renewal; resuming does not look.
            Ok(LeaseRenewal::Renewed { .. } | LeaseRenewal::DrainRequested { .. }) => {
                warn!(
                    worker = lease.id(),
                    "lease had expired in Redis and nobody reclaimed this worker; resumed it"
                );
                self.renewed_check(sent_at)
            }
            Ok(LeaseRenewal::DirectoryLost) => self.rebuild(lease, held_sessions()).await,
            Ok(LeaseRenewal::Lost) => {
                error!(
                    worker = lease.id(),
                    "lease lost: this worker was declared dead"
                );
                self.revoke();
                LeaseCheck::Lost
            }
            Err(e) => {
                warn!(worker = lease.id(), error = %e, "lease expired and cannot be resumed yet");
                LeaseCheck::InDoubt
            }
        }
    }

    /// Registers again under the same id after Redis lost its data, and re-claims the
    /// sessions this worker still holds.
    async fn rebuild(&self, old: &Lease, held: Vec<String>) -> LeaseCheck {
        let sent_at = Instant::now();
        if let Err(e) = self.directory.mark_rebuilt().await {
            warn!(error = %e, "marking the directory rebuilt failed; will retry");
            return self.in_doubt();
        }
        match self
            .directory
            .register_worker_with_cert(old.id(), &self.info, old.addr(), old.cert_not_after())
            .await
        {
            Ok(lease) => {
                *self.lease.lock() = lease;
                match self.claim_held_again(old.id(), &held).await {
                    Ok(taken) => {
                        // The worker drops the taken sessions either way, and acts
                        // only if this came in time.
                        self.renewed(sent_at);
                        info!(
                            worker = old.id(),
                            sessions = held.len(),
                            "directory rebuilt"
                        );
                        LeaseCheck::Rebuilt { taken }
                    }
                    Err(e) => {
                        warn!(error = %e, "re-claiming sessions failed; will retry");
                        self.in_doubt()
                    }
                }
            }
            Err(DirectoryError::WorkerIdTaken { .. }) => {
                error!(worker = old.id(), "another process took this worker id");
                self.revoke();
                LeaseCheck::Lost
            }
            Err(e) => {
                warn!(error = %e, "registering again failed; will retry");
                self.in_doubt()
            }
        }
    }

    /// Records this worker again as the owner of the sessions it holds, in a directory
    /// that may have lost them (rebuilt empty, or failed over). Returns those another
    /// worker owns by now, which the caller must drop.
    async fn claim_held_again(
        &self,
        id: &str,
        held: &[String],
    ) -> Result<Vec<String>, DirectoryError> {
        let taken = self.directory.reclaim_sessions_after_loss(id, held).await?;
        // Shared sessions are remembered past their end (see `execute::shared`); the
        // directory must remember them again, or their end would read as "never
        // existed".
        let shared: Vec<String> = held
            .iter()
            .filter(|sid| crate::session::is_shared_id(sid) && !taken.contains(sid))
            .cloned()
            .collect();
        if let Err(e) = self.directory.remember_sessions(&shared).await {
            // They still work; only an end after this could go untold.
            warn!(error = %e, sessions = shared.len(), "re-marking shared sessions in the directory failed");
        }
        Ok(taken)
    }

    /// After a failover: writes the lease and the session records again at once, as
    /// after a Redis that came back empty, since the new primary may lack any of them.
    async fn reassert(&self, old: &Lease, held: Vec<String>) -> LeaseCheck {
        let sent_at = Instant::now();
        match self.directory.reassert_after_failover(old).await {
            Ok(Some(lease)) => {
                *self.lease.lock() = lease;
                match self.claim_held_again(old.id(), &held).await {
                    Ok(taken) => {
                        // The worker drops the taken sessions either way, and acts
                        // only if this came in time.
                        self.renewed(sent_at);
                        info!(
                            worker = old.id(),
                            sessions = held.len(),
                            "lease and sessions re-asserted after a Redis failover"
                        );
                        LeaseCheck::FailedOver { taken }
                    }
                    Err(e) => {
                        warn!(error = %e, "re-claiming sessions after a failover failed; will retry");
                        self.directory.failover_unhandled();
                        self.in_doubt()
                    }
                }
            }
            Ok(None) => {
                error!(
                    worker = old.id(),
                    "after the failover, this worker's id is held by another process or it was reclaimed"
                );
                self.revoke();
                LeaseCheck::Lost
            }
            Err(e) => {
                warn!(error = %e, "re-asserting the lease after a failover failed; will retry");
                self.directory.failover_unhandled();
                self.in_doubt()
            }
        }
    }

    /// Resolves when the directory saw a Redis failover, so the heartbeat re-asserts
    /// at once rather than at its next turn.
    pub async fn failover_seen(&self) {
        self.directory.failover_seen().await;
    }

    fn in_doubt(&self) -> LeaseCheck {
        if self.valid() {
            LeaseCheck::Valid
        } else {
            LeaseCheck::InDoubt
        }
    }

    /// Ends the registration on a clean shutdown (only if it is still ours).
    pub async fn deregister(&self) {
        let lease = self.lease.lock().clone();
        if let Err(e) = self.directory.deregister(&lease).await {
            warn!(error = %e, "could not remove this worker's lease");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_worker_acts_until_lease_minus_margin_from_the_send() {
        let lease = Duration::from_secs(10);
        let sent = Instant::now();
        let mut clock = LeaseClock::new(lease, sent);
        // Margin is a fifth of the lease: valid for 8 s after the send.
        assert!(clock.valid_at(Instant::now()));
        tokio::time::advance(Duration::from_millis(7_999)).await;
        assert!(clock.valid_at(Instant::now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(
            !clock.valid_at(Instant::now()),
            "at lease − margin it stops"
        );
        // A renewal sent now extends from now.
        assert!(clock.renewed(Instant::now(), Instant::now()));
        assert_eq!(clock.acts_until(), Instant::now() + Duration::from_secs(8));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_to_an_old_renewal_never_shortens_the_lease() {
        let lease = Duration::from_secs(10);
        let first = Instant::now();
        let mut clock = LeaseClock::new(lease, first);
        tokio::time::advance(Duration::from_secs(3)).await;
        clock.renewed(Instant::now(), Instant::now());
        let extended = clock.acts_until();
        clock.renewed(first, Instant::now());
        assert_eq!(clock.acts_until(), extended);
    }

    /// A renewal Redis wrote, whose answer reached the worker only after the lease it
    /// renewed had run out (the process was paused with the answer on its way): the
    /// fleet may have declared the worker dead meanwhile, so the answer proves nothing.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_answered_after_its_lease_ran_out_makes_nothing_valid() {
        let lease = Duration::from_secs(3);
        let mut clock = LeaseClock::new(lease, Instant::now());
        tokio::time::advance(Duration::from_secs(1)).await;
        let sent = Instant::now();
        // Paused for 7 s between the send and the answer.
        tokio::time::advance(Duration::from_secs(7)).await;
        assert!(!clock.renewed(sent, Instant::now()), "answered too late");
        assert!(!clock.valid_at(Instant::now()));
        // Answered in time, a renewal proves the lease again.
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(50)).await;
        assert!(clock.renewed(sent, Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn short_leases_keep_a_minimum_margin() {
        let clock = LeaseClock::new(Duration::from_millis(500), Instant::now());
        assert_eq!(
            clock.acts_until(),
            Instant::now() + Duration::from_millis(300),
            "the margin is at least 200 ms"
        );
        let tiny = LeaseClock::new(Duration::from_millis(100), Instant::now());
        assert!(
            !tiny.valid_at(Instant::now()),
            "a lease shorter than the margin never lets the worker act"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_revoked_lease_is_invalid_at_once() {
        let mut clock = LeaseClock::new(Duration::from_secs(10), Instant::now());
        clock.revoke(Instant::now());
        assert!(!clock.valid_at(Instant::now()));
    }
}
