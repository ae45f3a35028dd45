//! This worker's membership in a fleet: the directory it records its sessions in
//! (claim, release, sweep) and its lease. A standalone worker has none.
//!
//! Forwarding is a stage of its own, [`crate::forward::caller::Forwarder`]; acting on
//! the lease's outcomes lives with the worker ([`crate::worker`]).

use std::sync::Arc;

use http::StatusCode;
use mcpgw_mesh::directory::{
    Claim, Directory, DirectoryError, SessionKind, SessionQuota, SessionState,
};
use tracing::{info, warn};

use crate::adoption::{self, AdoptionKeys};
use crate::config::Config;
use crate::lease::LeaseHolder;
use crate::link::UpstreamLink;
use crate::session::Session;

/// Why a session was not recorded as this worker's. Rendered for the client by the
/// worker ([`crate::worker`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError {
    /// Its quota key (`key`) holds its fleet-wide `limit` of sessions already.
    OverQuota { limit: usize, key: String },
    /// The freshly minted id is claimed already.
    Collision,
    /// The directory did not answer in time: no session was created.
    DirectoryUnavailable(String),
    /// This worker could not confirm its own lease: no session was created.
    LeaseInDoubt,
    /// What it needs to continue elsewhere could not be sealed.
    Unrecordable(String),
}

pub struct Fleet {
    /// This worker's id: the owner it records its sessions under.
    pub id: String,
    /// Workers, their mesh addresses, and who owns which session.
    pub directory: Directory,
    /// This worker's lease: whether it may act for its sessions now.
    pub lease: Arc<LeaseHolder>,
    /// Sessions of HTTP upstreams outlive their owner (`--adopt http`) with these keys
    /// sealing their upstream session ids; none: `--adopt never`.
    pub(crate) adoption: Option<AdoptionKeys>,
    pub(crate) config: Arc<Config>,
    /// The worker's metrics: reclaims and sweeps.
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
}

impl Fleet {
    pub fn new(
        id: String,
        directory: Directory,
        lease: Arc<LeaseHolder>,
        config: Arc<Config>,
        metrics: Arc<crate::metrics::Metrics>,
        adoption: Option<AdoptionKeys>,
    ) -> Fleet {
        Fleet {
            id,
            directory,
            lease,
            adoption,
            config,
            metrics,
        }
    }

    /// The status of "session gone: re-initialize" (404, or 409 when configured).
    pub fn gone_status(&self) -> StatusCode {
        StatusCode::from_u16(self.config.fleet.gone_status).unwrap_or(StatusCode::NOT_FOUND)
    }

    /// Records `session` as ours, within its quota key's fleet-wide session quota, and
    /// (unless `--adopt never`) what it needs to continue elsewhere; `initialize` is
    /// the client's request that opened it. A directory that does not answer means
    /// the session could not be routed by the fleet, so it is not created.
    pub async fn claim(
        &self,
        session: &Session,
        initialize: Option<&serde_json::Value>,
    ) -> Result<(), ClaimError> {
        let quota = self.session_quota(&session.quota_key);
        let (kind, guard, payload) = self.adoption_record(session, initialize)?;
        let state = kind.map(|kind| SessionState {
            kind,
            guard: &guard,
            payload: &payload,
        });
        match self
            .directory
            .claim_session_with_state(&session.id, &self.id, quota, state)
            .await
        {
            Ok(Claim::Claimed) => Ok(()),
            Ok(Claim::OverQuota) => Err(ClaimError::OverQuota {
                limit: self.config.limits.session_quota(&session.quota_key),
                key: session.quota_key.clone(),
            }),
            Ok(Claim::Taken) => Err(ClaimError::Collision),
            Err(e) => Err(ClaimError::DirectoryUnavailable(e.to_string())),
        }
    }

    /// The fleet-wide session quota of `quota_key` (see
    /// [`crate::request::Call::quota_key`]), counted in the directory as a session is
    /// claimed or adopted; `None` when it has none.
    pub fn session_quota<'k>(&self, quota_key: &'k str) -> Option<SessionQuota<'k>> {
        let limit = self.config.limits.session_quota(quota_key);
        (limit > 0).then_some(SessionQuota {
            key: quota_key,
            limit,
            ttl: self.config.limits.session_idle_timeout * 2,
        })
    }

    /// What the directory records for `session` so another worker can adopt it (see
    /// [`crate::adoption`]): its kind, guard and record, or no kind under `--adopt
    /// never`. `initialize`: the client's request that opened it (legacy sessions).
    pub(crate) fn adoption_record(
        &self,
        session: &Session,
        initialize: Option<&serde_json::Value>,
    ) -> Result<(Option<SessionKind>, String, String), ClaimError> {
        let route = &self.config.upstreams[session.upstream].name;
        let guard = adoption::guard_of(route, &session.principal);
        let unrecorded = ClaimError::Unrecordable;
        let params = initialize.and_then(|message| message.get("params"));
        let (kind, payload) = match (&self.adoption, &session.link) {
            (None, _) => (None, String::new()),
            // A virtual server's session with an HTTP member: kind http (it can go on),
            // its members in a format 2 record; its stdio members are lost on the way.
            (Some(keys), UpstreamLink::Federated(federated)) if federated.has_http_member() => {
                let members = federated
                    .record_members(&session.id, keys)
                    .map_err(unrecorded)?;
                let record = adoption::record_for(route, params, None, &session.id, keys)
                    .map_err(unrecorded)?
                    .with_members(members);
                (Some(SessionKind::Http), record.to_payload())
            }
            (Some(keys), UpstreamLink::Http { session_id }) => {
                let upstream_session = session_id.as_ref().and_then(|v| v.to_str().ok());
                let mut record =
                    adoption::record_for(route, params, upstream_session, &session.id, keys)
                        .map_err(unrecorded)?;
                record.upstream_init = session.upstream_init.clone();
                (Some(SessionKind::Http), record.to_payload())
            }
            // A stdio session, or a virtual server's of stdio members only: its
            // processes end with this worker, so it cannot go on elsewhere.
            (Some(_), UpstreamLink::Stdio(_) | UpstreamLink::Federated(_)) => {
                (Some(SessionKind::Stdio), "{}".to_owned())
            }
        };
        Ok((kind, guard, payload))
    }

    /// One sweep, if this worker gets the fleet-wide turn: reclaims the sessions of
    /// workers whose leases expired and that no request touched since, in batches, so
    /// Redis holds nothing of a dead worker after a bounded time. Only in a directory
    /// that has been stable for longer than a lease (after Redis came back empty, live
    /// owners need that long to register again). Returns the sessions freed.
    pub async fn sweep(&self) -> Result<usize, DirectoryError> {
        let this_worker = self.id.as_str();
        let interval = self.config.fleet.sweep_interval();
        if !self
            .directory
            .take_sweeper_turn(this_worker, interval)
            .await?
        {
            return Ok(0);
        }
        let lease = self.config.fleet.lease;
        let state = self.directory.lease_state(this_worker).await?;
        if state.generation != self.lease.generation() || state.generation_age <= lease {
            return Ok(0);
        }
        let mut freed = 0;
        for id in self.directory.reclaim_candidates(lease * 2).await? {
            if id == this_worker {
                continue;
            }
            if let Some(sids) = self.directory.reclaim_worker(&id, None).await? {
                info!(worker = %id, sessions = sids.len(), "swept a dead worker's keys");
                self.metrics.worker_reclaimed(sids.len());
                freed += sids.len();
            }
        }
        Ok(freed)
    }

    /// After a claim whose outcome is unknown (Redis did not answer in time): keeps
    /// releasing the session's record in the background until one release removes it
    /// or two leases have passed, so a claim that lands late leaves nothing behind.
    pub fn release_unclaimed(self: &Arc<Self>, session: Arc<Session>) {
        let fleet = Arc::clone(self);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + fleet.config.fleet.lease * 2;
            while tokio::time::Instant::now() < deadline {
                if let Ok(true) = fleet
                    .directory
                    .release_session(&session.id, &fleet.id, Some(&session.quota_key))
                    .await
                {
                    info!(session = %session.tag, "took back the record of a session whose claim had timed out");
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
    }

    /// Removes the ownership record of an ended session.
    pub async fn release(&self, session: &Session) {
        let session_id = session.id.as_str();
        if let Err(e) = self
            .directory
            .release_session(session_id, &self.id, Some(&session.quota_key))
            .await
        {
            warn!(session = %crate::digest::tag_of(session_id), error = %e, "could not remove the session's directory record");
        }
    }
}
