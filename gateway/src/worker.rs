//! One worker process: its identity, its upstream clients, the sessions it owns, and
//! the decision of where each call runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use http::StatusCode;

use crate::affinity::{Decision, Situation, decide};
use crate::config::Config;
use crate::exec::Reply;
use crate::fleet::Fleet;
use crate::mcp::{Era, GatewayError};
use crate::request::{Call, Routes};
use crate::session::SessionRegistry;
use crate::upstream::{HttpUpstream, Upstream};

pub struct Worker {
    /// This process's worker id: unique in the fleet, embedded in the session ids it mints.
    pub id: String,
    /// `id` as a header value, made once.
    pub id_header: http::HeaderValue,
    pub config: Arc<Config>,
    pub routes: Routes,
    /// One client per configured upstream, indexed like `config.upstreams`.
    pub upstreams: Vec<Upstream>,
    /// Sessions whose upstream connection lives in this process.
    pub sessions: SessionRegistry,
    /// Decides who each client is, at the edge.
    pub auth: crate::auth::Authenticator,
    /// Set once a drain begins: no new sessions are admitted.
    draining: AtomicBool,
    /// The fleet this worker belongs to; unset for a standalone worker.
    fleet: OnceLock<Arc<Fleet>>,
}

impl Worker {
    pub fn new(id: String, config: Arc<Config>) -> Result<Arc<Worker>, GatewayError> {
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| {
                HttpUpstream::new(&u.name, &u.url, config.limits.upstream_connect_timeout)
                    .map(Upstream::Http)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                GatewayError::gateway(StatusCode::INTERNAL_SERVER_ERROR, "config", e.to_string())
            })?;
        let id_header = http::HeaderValue::from_str(&id).map_err(|_| {
            GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                "config",
                format!("worker id {id:?} is not a valid header value"),
            )
        })?;
        let auth = match &config.auth_tokens_file {
            Some(path) => crate::auth::Authenticator::from_file(path).map_err(|e| {
                GatewayError::gateway(StatusCode::INTERNAL_SERVER_ERROR, "config", e)
            })?,
            None => crate::auth::Authenticator::default(),
        };
        Ok(Arc::new(Worker {
            id,
            id_header,
            auth,
            routes: Routes::new(&config),
            upstreams,
            config,
            sessions: SessionRegistry::default(),
            draining: AtomicBool::new(false),
            fleet: OnceLock::new(),
        }))
    }

    /// Joins a fleet: from now on sessions are recorded in its directory and
    /// requests for other workers' sessions are forwarded.
    pub fn join(&self, fleet: Arc<Fleet>) {
        let _ = self.fleet.set(fleet);
    }

    pub fn fleet(&self) -> Option<&Arc<Fleet>> {
        self.fleet.get()
    }

    /// Decides where a call runs (DESIGN.md's decision table) and runs it.
    pub async fn dispatch(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        // Kept only when a stateless answer could stand in for an "unknown" one.
        let fallback = self.stateless_candidate(&call).then(|| call.clone());
        let result = self.route(call).await;
        match (result, fallback) {
            (Err(error), Some(call)) if crate::affinity::is_unknown(&error) => {
                self.answer_statelessly(call, error).await
            }
            (result, _) => result,
        }
    }

    /// Opt-in (`--stateless-when-unknown`): session methods whose answer does not
    /// depend on the session.
    fn stateless_candidate(&self, call: &Call) -> bool {
        self.config.fleet.stateless_when_unknown
            && call.session_id.is_some()
            && call
                .message
                .as_ref()
                .and_then(|m| m.method())
                .is_some_and(|m| crate::affinity::STATELESS_METHODS.contains(&m))
    }

    async fn route(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        let lookup = |worker: &Worker| {
            call.session_id
                .as_deref()
                .and_then(|id| worker.sessions.get(id))
        };
        let mut local = lookup(self);
        if local.is_some()
            && !self.lease_valid()
            && let Some(fleet) = self.fleet.get()
            && !fleet.revalidate(self).await
        {
            // Fenced meanwhile? Then the session is gone, and is answered as such.
            local = lookup(self);
        }
        let situation = match (&call.session_id, &local) {
            _ if call.era == Era::Modern => Situation::Modern,
            (None, _) if call.is_initialize() => Situation::NewSession,
            (None, _) => Situation::MissingSession,
            (Some(_), Some(_)) if self.lease_valid() => Situation::LocalOwned,
            (Some(_), Some(_)) => Situation::LocalLeaseInDoubt,
            // Not here: the fleet finds the owner (or proves there is none).
            (Some(_), None) if self.fleet.get().is_some() => Situation::RemoteOwner,
            (Some(_), None) => Situation::NoSuchSession,
        };
        match (decide(&situation), self.fleet.get()) {
            (Decision::ExecuteHere, _) => self.execute_local(call, local).await,
            (Decision::Forward, Some(fleet)) => fleet.route_remote(self, call).await,
            (Decision::Forward, None) => Err(GatewayError::session_not_found().with_id(call.id())),
            (Decision::Refuse(refusal), fleet) => {
                let gone = fleet.map_or(StatusCode::NOT_FOUND, |f| f.gone_status());
                Err(refusal
                    .to_error(
                        gone,
                        "the worker holding it could not renew its lease in time",
                    )
                    .with_id(call.id()))
            }
        }
    }

    /// Whether this worker may act for its sessions now: always when standalone; in a
    /// fleet, only while its lease is valid by its own clock.
    pub fn lease_valid(&self) -> bool {
        self.fleet.get().is_none_or(|fleet| fleet.lease_valid())
    }

    /// Records a freshly minted session as ours in the fleet directory.
    pub async fn claim_session(&self, session_id: &str) -> Result<(), GatewayError> {
        match self.fleet.get() {
            Some(fleet) => fleet.claim(session_id, &self.id).await,
            None => Ok(()),
        }
    }

    /// Drops a session from this worker and from the directory.
    pub async fn forget_session(&self, session_id: &str) {
        if self.sessions.remove(session_id).is_some()
            && let Some(fleet) = self.fleet.get()
        {
            fleet.release(session_id, &self.id).await;
        }
    }

    /// This worker was declared dead: drop every session without touching the
    /// directory (the records belong to whoever reclaimed them).
    pub fn fence(&self) {
        self.start_draining();
        let dropped = self.sessions.take_all().len();
        tracing::warn!(worker = %self.id, dropped, "fenced: sessions dropped");
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
}
