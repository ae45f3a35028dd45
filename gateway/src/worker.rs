//! One worker process: its identity, its upstream clients, the sessions it owns, and
//! the decision of where each call runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::StatusCode;

use crate::config::Config;
use crate::exec::Reply;
use crate::mcp::GatewayError;
use crate::request::{Call, Routes};
use crate::session::SessionRegistry;
use crate::upstream::{HttpUpstream, Upstream};

pub struct Worker {
    /// This process's worker id: unique in the fleet, embedded in the session ids it mints.
    pub id: String,
    pub config: Arc<Config>,
    pub routes: Routes,
    /// One client per configured upstream, indexed like `config.upstreams`.
    pub upstreams: Vec<Upstream>,
    /// Sessions whose upstream connection lives in this process.
    pub sessions: SessionRegistry,
    /// Set once a drain begins: no new sessions are admitted.
    draining: AtomicBool,
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
        Ok(Arc::new(Worker {
            id,
            routes: Routes::new(&config),
            upstreams,
            config,
            sessions: SessionRegistry::default(),
            draining: AtomicBool::new(false),
        }))
    }

    /// Decides where a call runs and runs it.
    pub async fn dispatch(self: &Arc<Self>, call: Call) -> Result<Reply, GatewayError> {
        let Some(session_id) = call.session_id.as_deref() else {
            return self.execute_local(call, None).await;
        };
        match self.sessions.get(session_id) {
            Some(session) => self.execute_local(call, Some(session)).await,
            None => Err(GatewayError::session_not_found().with_id(call.id())),
        }
    }

    /// Registers a freshly minted session as ours. Without a fleet there is nobody to
    /// tell.
    pub async fn claim_session(&self, _session_id: &str) -> Result<(), GatewayError> {
        Ok(())
    }

    /// Drops a session from this worker's registry.
    pub async fn forget_session(&self, session_id: &str) {
        self.sessions.remove(session_id);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
}
