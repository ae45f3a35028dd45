//! This worker's membership in a fleet: the directory it records its sessions in,
//! its lease, and the mesh clients it forwards with. A standalone worker has none.
//!
//! Forwarding itself lives in [`crate::forward::caller`]; acting on the lease's
//! outcomes lives with the worker ([`crate::worker`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use http::StatusCode;
use mcpgw_mesh::directory::Directory;
use mcpgw_mesh::transport::MeshClient;
use parking_lot::RwLock;
use tracing::warn;

use crate::config::Config;
use crate::dispatch::table::RETRY_AFTER_SECONDS;
use crate::lease::LeaseHolder;
use crate::mcp::GatewayError;

pub struct Fleet {
    /// Workers, their mesh addresses, and who owns which session.
    pub directory: Directory,
    /// This worker's lease: whether it may act for its sessions now.
    pub lease: LeaseHolder,
    /// Forwards requests to the owners of other workers' sessions.
    pub(crate) mesh: MeshClient,
    /// A separate pool for liveness probes, so a probe always dials afresh instead of
    /// riding the connection whose health is in question.
    pub(crate) probe_mesh: MeshClient,
    /// Mesh addresses of peers by worker id, so steady-state forwarding needs no Redis.
    pub(crate) peers: RwLock<HashMap<String, String>>,
    /// Ids of forwarded requests, unique per caller.
    pub(crate) request_ids: AtomicU64,
    pub(crate) config: Arc<Config>,
}

impl Fleet {
    pub fn new(
        directory: Directory,
        lease: LeaseHolder,
        mesh: MeshClient,
        probe_mesh: MeshClient,
        config: Arc<Config>,
    ) -> Fleet {
        Fleet {
            directory,
            lease,
            mesh,
            probe_mesh,
            peers: RwLock::new(HashMap::new()),
            request_ids: AtomicU64::new(1),
            config,
        }
    }

    /// The status of "session gone: re-initialize" (404, or 409 when configured).
    pub fn gone_status(&self) -> StatusCode {
        StatusCode::from_u16(self.config.fleet.gone_status).unwrap_or(StatusCode::NOT_FOUND)
    }

    /// Records `session_id` as ours. A directory that does not answer means the
    /// session could not be routed by the fleet, so it is not created.
    pub async fn claim(&self, session_id: &str, owner: &str) -> Result<(), GatewayError> {
        match self.directory.claim_session(session_id, owner).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(GatewayError::gateway(
                StatusCode::INTERNAL_SERVER_ERROR,
                "session_id_collision",
                "a freshly minted session id is already claimed: retry initialize",
            )),
            Err(e) => Err(GatewayError::gateway(
                StatusCode::SERVICE_UNAVAILABLE,
                "directory_unavailable",
                format!("the fleet directory did not record the new session ({e}); no session was created: retry initialize"),
            )
            .with_data(serde_json::json!({"reason": "directory_unavailable", "retryable": true}))
            .with_retry_after(RETRY_AFTER_SECONDS)),
        }
    }

    /// Removes the ownership record of an ended session.
    pub async fn release(&self, session_id: &str, owner: &str) {
        if let Err(e) = self.directory.release_session(session_id, owner).await {
            warn!(session = session_id, error = %e, "could not remove the session's directory record");
        }
    }
}
