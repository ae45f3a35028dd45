//! One worker process's state: its identity, its upstream clients, the sessions it
//! owns, its fleet membership, and what it does when its lease says it may no longer
//! act. The stages of a request act on this state: the router decides where a call
//! runs ([`crate::dispatch::Router`]), the executor runs it here
//! ([`crate::execute::Executor`]), the forwarder sends it to its owner
//! ([`crate::forward::caller::Forwarder`]). `Worker`'s own methods are all in this file.

use crate::reason::Reason;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use http::StatusCode;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::auth::Authenticator;
use crate::config::{Config, UpstreamConfig};
use crate::decision::{Known, SessionKind, Side};
use crate::dispatch::refuse::{self, RETRY_AFTER_SECONDS};
use crate::execute::streams::{ReplayBudget, SessionStreams};
use crate::execute::upstream::Upstream;
use crate::fleet::{ClaimError, Fleet};
use crate::forward::caller::Forwarder;
use crate::lease::LeaseCheck;
use crate::mcp::GatewayError;
use crate::metrics::Metrics;
use crate::request::Endpoints;
use crate::session::{Session, SessionRegistry};
use mcpgw_mesh::transport::StreamCounter;

pub struct Worker {
    /// This process's worker id: unique in the fleet, embedded in the session ids it
    /// mints (the owner hint), and the name of its lease.
    pub id: String,
    /// `id` as a header value, made once: every answer carries it.
    pub id_header: http::HeaderValue,
    /// The validated configuration, shared with every part of the worker.
    pub config: Arc<Config>,
    /// Which route each request path addresses.
    pub endpoints: Endpoints,
    /// Everything this worker keeps per configured route, indexed like
    /// `config.upstreams`: a route's index (in sessions, calls, members) finds it here.
    pub routes: Vec<Route>,
    /// Sessions whose upstream connection lives in this process.
    pub sessions: SessionRegistry,
    /// Decides who each client is, at the edge.
    pub auth: Authenticator,
    /// This worker's Prometheus metrics (served by the admin listener).
    pub metrics: Arc<Metrics>,
    /// The route label of a request for no configured route.
    pub unrouted_label: Arc<String>,
    /// What the mesh has in flight, as caller and as owner (set when joining a fleet).
    pub mesh_streams: OnceLock<(StreamCounter, StreamCounter)>,
    /// The mesh TLS material this worker follows (fleet workers on QUIC or TCP), for
    /// the certificate metrics and `/readyz`.
    pub mesh_tls: OnceLock<mcpgw_certs::MeshTlsSource>,
    /// Bytes all replay logs of this worker's sessions may keep, and keep now.
    pub replay_budget: Arc<ReplayBudget>,
    /// Makes and exports spans (`--otlp-endpoint`); none: the gateway makes no spans.
    pub tracer: Option<crate::trace::Tracer>,
    /// Set once a drain begins (or the worker is fenced): no new sessions.
    draining: AtomicBool,
    /// The fleet this worker belongs to; unset for a standalone worker.
    fleet: OnceLock<Arc<Fleet>>,
    /// The forwarding stage, set with the fleet.
    forwarder: OnceLock<Forwarder>,
    /// Turns true when this worker was fenced (declared dead by the fleet): the
    /// process must stop serving and exit so it is replaced under a new id. The
    /// worker's main loop ([`crate::serve`]) is the one place that acts on it.
    fenced: watch::Sender<bool>,
    /// Turns true when an operator asks this worker to drain (`mcpgw drain` through
    /// the directory, or `POST /drain` on the admin listener): the main loop drains
    /// exactly as on SIGTERM.
    drain_requested: watch::Sender<bool>,
}

/// One configured route as the running worker keeps it: its settings, the client
/// that reaches it, and its name as a metric label.
pub struct Route {
    config: UpstreamConfig,
    upstream: Upstream,
    label: Arc<String>,
}

impl Route {
    fn new(
        config: &UpstreamConfig,
        limits: &crate::config::Limits,
    ) -> Result<Route, crate::execute::upstream::UpstreamError> {
        Ok(Route {
            upstream: Upstream::new(config, limits)?,
            label: Arc::new(config.name.clone()),
            config: config.clone(),
        })
    }

    /// The route's name, as clients address it (`/servers/{name}/mcp`).
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The route's name as a metric label value, shared by every sample.
    pub fn label(&self) -> &Arc<String> {
        &self.label
    }

    /// The route's validated settings.
    pub fn config(&self) -> &UpstreamConfig {
        &self.config
    }

    /// The client that reaches the route's upstream (HTTP, stdio, or a virtual server).
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// Whether the route's upstream speaks Streamable HTTP (the only kind whose
    /// sessions can be adopted).
    pub fn is_http(&self) -> bool {
        matches!(self.upstream, Upstream::Http(_))
    }
}

impl Worker {
    /// A worker for the validated `config`, with the authenticator built from it.
    pub fn new(
        id: String,
        config: Arc<Config>,
        auth: Authenticator,
    ) -> Result<Arc<Worker>, GatewayError> {
        let config_error =
            |e: String| GatewayError::gateway(StatusCode::INTERNAL_SERVER_ERROR, Reason::Config, e);
        let routes = config
            .upstreams
            .iter()
            .map(|u| Route::new(u, &config.limits))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| config_error(e.to_string()))?;
        let id_header = http::HeaderValue::from_str(&id)
            .map_err(|_| config_error(format!("worker id {id:?} is not a valid header value")))?;
        let tracer = crate::trace::Tracer::start(&config, &id).map_err(config_error)?;
        Ok(Arc::new(Worker {
            id,
            id_header,
            auth,
            endpoints: Endpoints::new(&config),
            metrics: Arc::new(Metrics::new(routes.len())),
            unrouted_label: Arc::new("none".to_owned()),
            mesh_streams: OnceLock::new(),
            mesh_tls: OnceLock::new(),
            tracer,
            replay_budget: ReplayBudget::new(config.limits.replay_budget_bytes),
            routes,
            config,
            sessions: SessionRegistry::default(),
            draining: AtomicBool::new(false),
            fleet: OnceLock::new(),
            forwarder: OnceLock::new(),
            fenced: watch::Sender::new(false),
            drain_requested: watch::Sender::new(false),
        }))
    }

    /// Joins a fleet: from now on sessions are recorded in its directory and
    /// requests for other workers' sessions are forwarded by `forwarder`.
    pub fn join(&self, fleet: Arc<Fleet>, forwarder: Forwarder) {
        if self.fleet.set(fleet).is_err() || self.forwarder.set(forwarder).is_err() {
            error!(worker = %self.id, "joined a fleet twice; keeping the first membership");
        }
    }

    /// The stream logs of a new session, within this worker's replay budget.
    pub fn new_streams(&self) -> SessionStreams {
        SessionStreams::new(&self.replay_budget, self.config.limits.replay_session_bytes)
    }

    pub fn fleet(&self) -> Option<&Arc<Fleet>> {
        self.fleet.get()
    }

    /// The status that says a session is gone for good: the fleet's setting (404 or
    /// 409); 404 on a standalone worker.
    pub fn gone_status(&self) -> http::StatusCode {
        self.fleet()
            .map_or(http::StatusCode::NOT_FOUND, |fleet| fleet.gone_status())
    }

    /// The forwarding stage; none for a standalone worker.
    pub fn forwarder(&self) -> Option<&Forwarder> {
        self.forwarder.get()
    }

    /// Whether this worker may act for its sessions now: always when standalone; in a
    /// fleet, only while its lease is valid by its own clock.
    pub fn lease_valid(&self) -> bool {
        self.fleet.get().is_none_or(|fleet| fleet.lease.valid())
    }

    /// Whether this worker may act now: its lease is valid, or one renewal (shared by
    /// every caller that waits for it) just confirmed it.
    pub async fn lease_confirmed(&self) -> bool {
        self.lease_valid() || self.renew_lease(true).await
    }

    /// Renews the lease and acts on what the renewal found. `only_if_invalid`: called
    /// by a request that found the lease past its deadline (see
    /// [`crate::lease::LeaseHolder::renew`]). Returns whether the worker may act now,
    /// which only its lease clock says: a renewal's outcome (perhaps another caller's,
    /// answered a while ago) never stands in for it.
    pub async fn renew_lease(&self, only_if_invalid: bool) -> bool {
        let Some(fleet) = self.fleet.get() else {
            return true;
        };
        let acts = match fleet
            .lease
            .renew(only_if_invalid, || self.sessions.ids())
            .await
        {
            LeaseCheck::Valid => true,
            LeaseCheck::DrainRequested => {
                self.request_drain("the fleet directory (mcpgw drain)");
                true
            }
            LeaseCheck::InDoubt => {
                self.metrics.lease_in_doubt();
                false
            }
            LeaseCheck::FailedOver { taken } => {
                self.metrics.directory_failover();
                for sid in taken {
                    warn!(session = %crate::digest::tag_of(&sid), "session now owned elsewhere; dropping it here");
                    self.sessions.remove(&sid);
                }
                true
            }
            LeaseCheck::Rebuilt { taken } => {
                for sid in taken {
                    warn!(session = %crate::digest::tag_of(&sid), "session now owned elsewhere; dropping it here");
                    self.sessions.remove(&sid);
                }
                true
            }
            LeaseCheck::Lost => {
                self.fence();
                false
            }
        };
        acts && fleet.lease.valid()
    }

    /// Records a freshly minted session as ours in the fleet directory, within its
    /// principal's fleet-wide session quota.
    pub async fn claim_session(
        &self,
        session: &Session,
        initialize: Option<&serde_json::Value>,
    ) -> Result<(), GatewayError> {
        let Some(fleet) = self.fleet.get() else {
            return Ok(());
        };
        // A worker that cannot confirm its lease opens no session: it may be declared
        // dead at any moment, and a request forwarded to it for the new session would
        // find its owner in doubt. One renewal decides, as for a held session.
        if !self.lease_confirmed().await {
            return Err(claim_refused(ClaimError::LeaseInDoubt));
        }
        fleet
            .claim(session, initialize)
            .await
            .map_err(claim_refused)
    }

    /// Drops a session from this worker and from the directory.
    pub async fn forget_session(&self, session_id: &str) {
        if let Some(session) = self.sessions.remove(session_id)
            && let Some(fleet) = self.fleet.get()
        {
            fleet.release(&session).await;
        }
    }

    /// This worker was declared dead: drop every session without touching the
    /// directory (the records belong to whoever reclaimed them), never act under the
    /// old lease again, and tell the main loop to exit for a fresh id.
    pub fn fence(&self) {
        self.start_draining();
        if let Some(fleet) = self.fleet.get() {
            fleet.lease.revoke();
        }
        let dropped = self.sessions.take_all().len();
        self.metrics.session_ended("fenced", dropped as u64);
        if !self.fenced.send_replace(true) {
            error!(worker = %self.id, dropped, "fenced: declared dead by the fleet; sessions dropped, exiting for a fresh id");
        }
    }

    /// Whether this worker was declared dead by the fleet: its lease is revoked, which
    /// `fence` does before it drops the sessions, so a session found missing here is
    /// never mistaken for one that ended.
    pub fn is_fenced(&self) -> bool {
        self.fleet.get().is_some_and(|fleet| fleet.lease.revoked())
    }

    /// Resolves once this worker is fenced.
    pub fn fenced(&self) -> watch::Receiver<bool> {
        self.fenced.subscribe()
    }

    /// Asks the main loop to drain this worker as SIGTERM does; `by` says who asked,
    /// for the log. Asking again changes nothing.
    pub fn request_drain(&self, by: &str) {
        if !self.drain_requested.send_replace(true) {
            info!(worker = %self.id, by, "drain requested: draining as on SIGTERM");
        }
    }

    /// Resolves once a drain was requested (see [`Worker::request_drain`]).
    pub fn drain_requests(&self) -> watch::Receiver<bool> {
        self.drain_requested.subscribe()
    }

    /// What this worker knows of itself, for the decision core: its lease, its fleet,
    /// whether it was fenced and whether its fleet adopts sessions. Every path that
    /// decides (the edge, a shared session, the owner of a forwarded call) starts here
    /// and adds what it knows of the call.
    pub fn knows(&self, side: Side, session: SessionKind) -> Known {
        Known {
            lease_valid: self.lease_valid(),
            in_fleet: self.fleet().is_some(),
            fenced: self.is_fenced(),
            adopts: self.adopts(),
            ..Known::of(side, session)
        }
    }

    /// Whether sessions of HTTP upstreams outlive their owner in this fleet (`--adopt
    /// http`, and a fleet).
    pub fn adopts(&self) -> bool {
        self.fleet().is_some_and(|fleet| fleet.adoption.is_some())
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
}

/// The client's answer for a session the fleet did not record.
pub(crate) fn claim_refused(error: ClaimError) -> GatewayError {
    match error {
        ClaimError::OverQuota { limit, key } => refuse::quota_exceeded(limit, &key),
        ClaimError::Collision => GatewayError::gateway(
            StatusCode::INTERNAL_SERVER_ERROR,
            Reason::SessionIdCollision,
            "a freshly minted session id is already claimed: retry initialize",
        ),
        ClaimError::DirectoryUnavailable(detail) => GatewayError::gateway(
            StatusCode::SERVICE_UNAVAILABLE,
            Reason::DirectoryUnavailable,
            "the fleet directory did not record the new session in time; no session was \
             created: retry initialize",
        )
        .with_data(serde_json::json!({ "retryable": true}))
        .with_retry_after(RETRY_AFTER_SECONDS)
        .with_log_detail(detail),
        // The directory's fault as the client sees it: it did not answer the renewal.
        ClaimError::LeaseInDoubt => GatewayError::gateway(
            StatusCode::SERVICE_UNAVAILABLE,
            Reason::DirectoryUnavailable,
            "the fleet directory did not confirm this worker's lease in time; no session \
             was created: retry initialize",
        )
        .with_data(serde_json::json!({ "retryable": true }))
        .with_retry_after(RETRY_AFTER_SECONDS),
        ClaimError::Unrecordable(why) => GatewayError::gateway(
            StatusCode::INTERNAL_SERVER_ERROR,
            Reason::EntropyUnavailable,
            format!("could not record the new session for adoption: {why}"),
        ),
    }
}
