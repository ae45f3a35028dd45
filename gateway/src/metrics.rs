//! Prometheus metrics of one worker, served by the admin listener at `/metrics`.
//!
//! Naming follows Prometheus: one `mcpgw_` prefix, base units in the name (seconds),
//! `_total` counters. Label values are bounded: routes and upstreams are configured,
//! MCP methods come from a fixed list (anything else is `other`), tool names only
//! from the upstream's own tool list (anything else is `other`), outcomes are
//! classes. No session id, token or principal is ever a label.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry, Unit};

/// MCP methods counted by name; any other method is counted as `other`.
const KNOWN_METHODS: &[&str] = &[
    "initialize",
    "ping",
    "tools/list",
    "tools/call",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "prompts/list",
    "prompts/get",
    "completion/complete",
    "logging/setLevel",
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
];

/// The `method` label of a request: a known MCP method, `response` (a client's answer
/// to a server request), `stream` (GET), `delete` (DELETE), `none` (refused before the
/// body was read) or `other`.
pub fn method_label(method: Option<&str>, http_method: &http::Method) -> &'static str {
    if *http_method == http::Method::GET {
        return "stream";
    }
    if *http_method == http::Method::DELETE {
        return "delete";
    }
    match method {
        Some(m) => KNOWN_METHODS
            .iter()
            .find(|known| **known == m)
            .copied()
            .unwrap_or("other"),
        None => "none",
    }
}

/// The outcome class of an HTTP status.
pub fn status_class(status: http::StatusCode) -> &'static str {
    match status.as_u16() {
        200..=299 => "2xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: Arc<String>,
    pub method: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: Arc<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabels {
    pub upstream: Arc<String>,
    pub tool: Arc<String>,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemberLabels {
    pub server: Arc<String>,
    pub member: Arc<String>,
    pub method: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardLabels {
    pub transport: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabels {
    pub transport: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabels {
    pub why: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabels {
    /// `caller` (this worker forwarding) or `owner` (serving forwarded requests).
    pub side: &'static str,
    /// `short` (requests) or `long` (held GET streams, SSE answers).
    pub budget: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SideLabels {
    pub side: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectoryLabels {
    pub op: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    pub side: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

/// Every metric of a worker, in four groups by what they watch. Cheap to update from
/// any task: counters and histograms are atomics behind `Arc`s.
pub struct Metrics {
    registry: Registry,
    path: PathMetrics,
    sessions: SessionMetrics,
    fleet: FleetMetrics,
    mesh: MeshMetrics,
}

/// The request path: what clients asked, what ran here, what was forwarded.
struct PathMetrics {
    requests: Family<RequestLabels, Counter>,
    request_seconds: Family<RouteLabels, Histogram>,
    tool_calls: Family<ToolLabels, Counter>,
    member_requests: Family<MemberLabels, Counter>,
    forwards: Family<ForwardLabels, Counter>,
    forward_seconds: Family<TransportLabels, Histogram>,
    /// Tool names each upstream lists, by upstream index: the only tool names that
    /// become label values.
    known_tools: RwLock<Vec<Vec<Arc<String>>>>,
    other: Arc<String>,
}

/// The sessions this worker holds, and the replay logs that keep their streams.
struct SessionMetrics {
    opened: Counter,
    ended: Family<ReasonLabels, Counter>,
    owned: Gauge,
    adopted: Family<CauseLabels, Counter>,
    adoptions_refused: Family<WhyLabels, Counter>,
    replay_bytes: Gauge,
    replay_budget_bytes: Gauge,
}

/// Membership: the lease, the directory, and the deaths this worker proved.
struct FleetMetrics {
    deaths_proven: Family<ReasonLabels, Counter>,
    workers_reclaimed: Counter,
    sessions_reclaimed: Counter,
    leases_in_doubt: Counter,
    directory_failovers: Counter,
    rate_limit_unavailable: Family<ActionLabels, Counter>,
    lease_valid: Gauge,
    draining: Gauge,
    runtime_threads: Gauge,
    directory_calls: Family<DirectoryLabels, Counter>,
    directory_seconds: Family<OpLabels, Histogram>,
}

/// The mesh: its exchanges, connections and certificates.
struct MeshMetrics {
    streams: Family<StreamLabels, Gauge>,
    peers: Family<SideLabels, Gauge>,
    handshakes: Family<HandshakeLabels, Counter>,
    connections: Family<SideLabels, Gauge>,
    cert_expiration: Gauge,
    cert_reloads: Family<ResultLabels, Counter>,
    cert_refused_pending: Gauge,
}

/// Registers `metric` as `name` and hands back the handle the worker updates.
fn add<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// [`add`] for a histogram of seconds.
fn add_seconds<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register_with_unit(name, help, Unit::Seconds, metric.clone());
    metric
}

/// A family of latency histograms.
fn latencies<S: Clone + std::hash::Hash + Eq>() -> Family<S, Histogram> {
    Family::new_with_constructor(latency as fn() -> Histogram)
}

/// Latency buckets from 100 µs, doubling, to about 52 s.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.000_1, 2.0, 20))
}

impl PathMetrics {
    fn register(r: &mut Registry, upstreams: usize) -> PathMetrics {
        PathMetrics {
            requests: add(
                r,
                "requests",
                "Client requests answered, by route, MCP method and status class",
                Family::default(),
            ),
            request_seconds: add_seconds(
                r,
                "request_duration",
                "Time from a request's arrival to its answer's head",
                latencies(),
            ),
            tool_calls: add(
                r,
                "tool_calls",
                "tools/call executed on this worker, by upstream, tool and status class",
                Family::default(),
            ),
            member_requests: add(
                r,
                "member_requests",
                "Client requests a virtual server sent to one of its members, by virtual server, member, MCP method and outcome (answered, lost, outcome_unknown, failed)",
                Family::default(),
            ),
            forwards: add(
                r,
                "forwards",
                "Requests forwarded to a session's owner, by transport and outcome",
                Family::default(),
            ),
            forward_seconds: add_seconds(
                r,
                "forward_duration",
                "Time from sending a forwarded request to the owner's answer head",
                latencies(),
            ),
            known_tools: RwLock::new(vec![Vec::new(); upstreams]),
            other: Arc::new("other".to_owned()),
        }
    }
}

impl SessionMetrics {
    fn register(r: &mut Registry) -> SessionMetrics {
        SessionMetrics {
            opened: add(
                r,
                "sessions_opened",
                "Sessions opened on this worker",
                Counter::default(),
            ),
            ended: add(
                r,
                "sessions_ended",
                "Sessions this worker ended, by reason (deleted, expired, drained, handed_over, fenced, lost)",
                Family::default(),
            ),
            owned: add(
                r,
                "sessions_owned",
                "Sessions this worker holds now",
                Gauge::default(),
            ),
            adopted: add(
                r,
                "sessions_adopted",
                "Sessions this worker took on after their owner left them, by cause (death, drain)",
                Family::default(),
            ),
            adoptions_refused: add(
                r,
                "adoptions_refused",
                "Sessions whose owner left them that could not continue here, by why (stdio, upstream_forgot, key_unknown, record_unreadable, record_not_sealed, quota)",
                Family::default(),
            ),
            replay_bytes: add(
                r,
                "replay_bytes",
                "Bytes of stream events this worker keeps now so clients can resume their streams",
                Gauge::default(),
            ),
            replay_budget_bytes: add(
                r,
                "replay_budget_bytes",
                "Bytes of stream events this worker may keep for resumption (limits.replay_budget_bytes)",
                Gauge::default(),
            ),
        }
    }
}

impl FleetMetrics {
    fn register(r: &mut Registry) -> FleetMetrics {
        FleetMetrics {
            deaths_proven: add(
                r,
                "owner_deaths_proven",
                "Owners this worker proved dead, by proof (refused, wrong_worker, lease_expired)",
                Family::default(),
            ),
            workers_reclaimed: add(
                r,
                "workers_reclaimed",
                "Dead workers whose sessions this worker reclaimed (it proved the death first, or swept)",
                Counter::default(),
            ),
            sessions_reclaimed: add(
                r,
                "sessions_reclaimed",
                "Sessions of dead workers this worker freed in the directory",
                Counter::default(),
            ),
            leases_in_doubt: add(
                r,
                "leases_in_doubt",
                "Renewals that could not confirm this worker's lease in time",
                Counter::default(),
            ),
            directory_failovers: add(
                r,
                "directory_failovers",
                "Redis failovers this worker saw (a new primary, or a new replication id behind a plain URL) and re-asserted its lease and sessions after",
                Counter::default(),
            ),
            rate_limit_unavailable: add(
                r,
                "rate_limit_unavailable",
                "Requests the rate limiter could not count (its Redis failed), by action: passed (on_redis_error = open) or refused (closed)",
                Family::default(),
            ),
            lease_valid: add(
                r,
                "lease_valid",
                "1 while this worker may act for its sessions (lease valid by its own clock)",
                Gauge::default(),
            ),
            draining: add(
                r,
                "draining",
                "1 once this worker drains (or was fenced)",
                Gauge::default(),
            ),
            runtime_threads: add(
                r,
                "runtime_threads",
                "Threads of this worker's async runtime (--threads; by default one per CPU it may use)",
                Gauge::default(),
            ),
            directory_calls: add(
                r,
                "directory_calls",
                "Fleet directory (Redis) calls, by operation and outcome (answered or failed: timed out, refused, unreachable)",
                Family::default(),
            ),
            directory_seconds: add_seconds(
                r,
                "directory_call_duration",
                "Time a fleet directory call took, answered or not",
                latencies(),
            ),
        }
    }
}

impl MeshMetrics {
    fn register(r: &mut Registry) -> MeshMetrics {
        MeshMetrics {
            streams: add(
                r,
                "mesh_streams",
                "Mesh exchanges in flight now, by side and budget",
                Family::default(),
            ),
            peers: add(
                r,
                "mesh_peers",
                "Peers with mesh exchanges in flight now, by side",
                Family::default(),
            ),
            handshakes: add(
                r,
                "mesh_handshakes",
                "Mesh connection handshakes by side (caller dialled, owner accepted) and outcome: ok, or the cause of the failure (tls, identity, timeout, refused, greeting, io)",
                Family::default(),
            ),
            connections: add(
                r,
                "mesh_connections",
                "Mesh connections open now, by side",
                Family::default(),
            ),
            cert_expiration: add(
                r,
                "mesh_cert_expiration_timestamp_seconds",
                "When the mesh leaf in use expires (unix seconds); 0 without mesh certificates",
                Gauge::default(),
            ),
            cert_reloads: add(
                r,
                "mesh_cert_reloads",
                "Changes of the mesh certificate files, by result: reloaded (new handshakes use them) or refused (the material in use stays)",
                Family::default(),
            ),
            cert_refused_pending: add(
                r,
                "mesh_cert_refused_pending",
                "1 while the mesh certificate files hold content that was refused, so the material in use is older than the files",
                Gauge::default(),
            ),
        }
    }
}

/// What the worker-state gauges show, read at scrape time.
pub struct WorkerState {
    pub sessions_owned: usize,
    pub draining: bool,
    pub lease_valid: bool,
    pub replay_bytes: usize,
    pub replay_budget_bytes: usize,
    pub runtime_threads: usize,
}

/// A gauge value from a count (saturating: a count never fits badly into a gauge).
fn gauge_value(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn new(upstreams: usize) -> Metrics {
        let mut registry = Registry::with_prefix("mcpgw");
        registry.register(
            "build",
            "mcpgw build information",
            prometheus_client::metrics::info::Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            }),
        );
        // Fields are evaluated in the order written: `registry` is moved last.
        Metrics {
            path: PathMetrics::register(&mut registry, upstreams),
            sessions: SessionMetrics::register(&mut registry),
            fleet: FleetMetrics::register(&mut registry),
            mesh: MeshMetrics::register(&mut registry),
            registry,
        }
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }

    /// Counts an answered client request.
    pub fn request(
        &self,
        route: &Arc<String>,
        method: &'static str,
        status: http::StatusCode,
        elapsed: Duration,
    ) {
        self.path
            .requests
            .get_or_create(&RequestLabels {
                route: Arc::clone(route),
                method,
                outcome: status_class(status),
            })
            .inc();
        self.path
            .request_seconds
            .get_or_create(&RouteLabels {
                route: Arc::clone(route),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Counts a `tools/call` run on this worker; unknown tool names count as `other`.
    pub fn tool_call(
        &self,
        upstream: usize,
        upstream_name: &Arc<String>,
        tool: &str,
        status: http::StatusCode,
    ) {
        let tool = self
            .path
            .known_tools
            .read()
            .get(upstream)
            .and_then(|names| names.iter().find(|known| known.as_str() == tool).cloned())
            .unwrap_or_else(|| Arc::clone(&self.path.other));
        self.path
            .tool_calls
            .get_or_create(&ToolLabels {
                upstream: Arc::clone(upstream_name),
                tool,
                outcome: status_class(status),
            })
            .inc();
    }

    /// Adds the tool names upstream `upstream` listed (bounded: a misbehaving upstream
    /// cannot make the label set grow past [`MAX_TOOLS_PER_UPSTREAM`]).
    pub fn learn_tools(&self, upstream: usize, names: Vec<String>) {
        let mut known = self.path.known_tools.write();
        let Some(slot) = known.get_mut(upstream) else {
            return;
        };
        for name in names {
            if slot.len() >= MAX_TOOLS_PER_UPSTREAM {
                break;
            }
            if !slot.iter().any(|known| **known == name) {
                slot.push(Arc::new(name));
            }
        }
    }

    /// Learns tool names from a `tools/list` answer, JSON or SSE, as it passed to the
    /// client: the only source of tool-name label values.
    pub fn learn_tools_from_answer(&self, upstream: usize, answer: &[u8]) {
        let mut names = Vec::new();
        match serde_json::from_slice::<ToolListAnswer>(answer) {
            Ok(message) => message.names_into(&mut names),
            Err(_) => {
                for data in crate::sse::data_payloads(answer) {
                    if let Ok(message) = serde_json::from_str::<ToolListAnswer>(&data) {
                        message.names_into(&mut names);
                    }
                }
            }
        }
        self.learn_tools(upstream, names);
    }

    /// Counts a client request a virtual server sent to its member `member`.
    pub fn member_request(
        &self,
        server: &Arc<String>,
        member: &Arc<String>,
        method: Option<&str>,
        outcome: &'static str,
    ) {
        self.path
            .member_requests
            .get_or_create(&MemberLabels {
                server: Arc::clone(server),
                member: Arc::clone(member),
                method: method_label(method, &http::Method::POST),
                outcome,
            })
            .inc();
    }

    /// Counts a forward and, when the owner answered, its time to the head.
    pub fn forward(&self, transport: &'static str, outcome: &'static str, elapsed: Duration) {
        self.path
            .forwards
            .get_or_create(&ForwardLabels { transport, outcome })
            .inc();
        if outcome == "answered" {
            self.path
                .forward_seconds
                .get_or_create(&TransportLabels { transport })
                .observe(elapsed.as_secs_f64());
        }
    }

    pub fn session_opened(&self) {
        self.sessions.opened.inc();
    }

    /// A dead worker's sessions freed in the directory by this worker.
    pub fn worker_reclaimed(&self, sessions: usize) {
        self.fleet.workers_reclaimed.inc();
        self.fleet.sessions_reclaimed.inc_by(sessions as u64);
    }

    pub fn lease_in_doubt(&self) {
        self.fleet.leases_in_doubt.inc();
    }

    pub fn directory_failover(&self) {
        self.fleet.directory_failovers.inc();
    }

    /// Sets the gauges that mirror the worker's state (at scrape time).
    pub fn set_worker_state(&self, state: WorkerState) {
        self.sessions.owned.set(gauge_value(state.sessions_owned));
        self.fleet.draining.set(i64::from(state.draining));
        self.fleet.lease_valid.set(i64::from(state.lease_valid));
        self.fleet
            .runtime_threads
            .set(gauge_value(state.runtime_threads));
        self.sessions
            .replay_bytes
            .set(gauge_value(state.replay_bytes));
        self.sessions
            .replay_budget_bytes
            .set(gauge_value(state.replay_budget_bytes));
    }

    pub fn session_ended(&self, reason: &'static str, count: u64) {
        self.sessions
            .ended
            .get_or_create(&ReasonLabels { reason })
            .inc_by(count);
    }

    pub fn session_adopted(&self, cause: &'static str) {
        self.sessions
            .adopted
            .get_or_create(&CauseLabels { cause })
            .inc();
    }

    pub fn adoption_refused(&self, why: &'static str) {
        self.sessions
            .adoptions_refused
            .get_or_create(&WhyLabels { why })
            .inc();
    }

    pub fn death_proven(&self, proof: &'static str) {
        self.fleet
            .deaths_proven
            .get_or_create(&ReasonLabels { reason: proof })
            .inc();
    }
}

impl mcpgw_mesh::directory::DirectoryObserver for Metrics {
    fn observe(&self, op: &'static str, elapsed: Duration, answered: bool) {
        let outcome = if answered { "answered" } else { "failed" };
        self.fleet
            .directory_calls
            .get_or_create(&DirectoryLabels { op, outcome })
            .inc();
        self.fleet
            .directory_seconds
            .get_or_create(&OpLabels { op })
            .observe(elapsed.as_secs_f64());
    }
}

impl mcpgw_mesh::transport::MeshObserver for Metrics {
    fn handshake(&self, side: &'static str, outcome: &'static str) {
        self.mesh
            .handshakes
            .get_or_create(&HandshakeLabels { side, outcome })
            .inc();
    }

    fn connections(&self, side: &'static str, delta: i64) {
        self.mesh
            .connections
            .get_or_create(&SideLabels { side })
            .inc_by(delta);
    }
}

impl Metrics {
    /// Sets the certificate metrics from the material in use and the reload counts (at
    /// scrape time; the counters only ever move up to the reloader's own counts).
    pub fn set_mesh_certs(&self, tls: &mcpgw_certs::MeshTlsSource) {
        let not_after = tls
            .current()
            .leaf_not_after()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.mesh
            .cert_expiration
            .set(i64::try_from(not_after).unwrap_or(i64::MAX));
        let stats = tls.stats();
        for (result, total) in [("reloaded", stats.reloaded), ("refused", stats.refused)] {
            let counter = self
                .mesh
                .cert_reloads
                .get_or_create(&ResultLabels { result });
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        self.mesh
            .cert_refused_pending
            .set(i64::from(stats.pending_refusal.is_some()));
    }

    /// Sets the rate limiter's uncounted requests from its own counts (at scrape time;
    /// the counters only ever move up to them).
    pub fn set_rate_limit_unavailable(&self, passed: u64, refused: u64) {
        for (action, total) in [("passed", passed), ("refused", refused)] {
            let counter = self
                .fleet
                .rate_limit_unavailable
                .get_or_create(&ActionLabels { action });
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// Sets the mesh gauges from one side's counts (at scrape time).
    pub fn set_mesh_streams(
        &self,
        side: &'static str,
        counts: mcpgw_mesh::transport::StreamCounts,
    ) {
        let gauge = |budget| {
            self.mesh
                .streams
                .get_or_create(&StreamLabels { side, budget })
        };
        gauge("short").set(gauge_value(counts.short));
        gauge("long").set(gauge_value(counts.long));
        self.mesh
            .peers
            .get_or_create(&SideLabels { side })
            .set(gauge_value(counts.peers));
    }
}

/// Tool names per upstream that may become label values.
pub const MAX_TOOLS_PER_UPSTREAM: usize = 256;

/// What tool-name labels are learned from in a `tools/list` answer: the tools' names,
/// every other member skipped without building it (a JSON tree of the demo upstream's
/// whole answer cost 72,000 instructions, a twentieth of them on every request of the
/// usual mix).
#[derive(serde::Deserialize)]
struct ToolListAnswer {
    #[serde(default)]
    result: Option<ToolList>,
}

#[derive(serde::Deserialize)]
struct ToolList {
    #[serde(default)]
    tools: Vec<ListedTool>,
}

/// A `tools` entry's name when it has a string one. Any other entry is skipped, not
/// refused, so that one malformed entry costs only its own name (one pass over the
/// answer: no entry is read twice).
struct ListedTool(Option<String>);

impl<'de> serde::Deserialize<'de> for ListedTool {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ListedToolVisitor { want_name: false })
    }
}

/// Visits a tool entry (`want_name: false`) or the value of its `name` member (`true`);
/// whatever is neither an object nor, for a name, a string is skipped whole.
struct ListedToolVisitor {
    want_name: bool,
}

impl<'de> serde::de::Visitor<'de> for ListedToolVisitor {
    type Value = ListedTool;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ListedTool, A::Error> {
        let mut name = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if !self.want_name && key == "name" {
                let visitor = ListedToolVisitor { want_name: true };
                name = map.next_value_seed(visitor)?.0;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(ListedTool(if self.want_name { None } else { name }))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<ListedTool, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(ListedTool(None))
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<ListedTool, E> {
        Ok(ListedTool(self.want_name.then(|| text.to_owned())))
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<ListedTool, E> {
        Ok(ListedTool(None))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<ListedTool, E> {
        Ok(ListedTool(None))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<ListedTool, E> {
        Ok(ListedTool(None))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<ListedTool, E> {
        Ok(ListedTool(None))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<ListedTool, E> {
        Ok(ListedTool(None))
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for ListedToolVisitor {
    type Value = ListedTool;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<ListedTool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl ToolListAnswer {
    fn names_into(self, names: &mut Vec<String>) {
        let tools = self.result.map(|list| list.tools).unwrap_or_default();
        names.extend(tools.into_iter().filter_map(|tool| tool.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_and_statuses_map_to_bounded_labels() {
        let post = http::Method::POST;
        assert_eq!(method_label(Some("tools/call"), &post), "tools/call");
        assert_eq!(method_label(Some("x/evil-unbounded-name"), &post), "other");
        assert_eq!(method_label(None, &post), "none");
        assert_eq!(method_label(None, &http::Method::GET), "stream");
        assert_eq!(status_class(http::StatusCode::NOT_FOUND), "4xx");
    }

    #[test]
    fn a_malformed_tool_entry_costs_only_its_own_name() {
        let metrics = Metrics::new(1);
        let route = Arc::new("demo".to_owned());
        metrics.learn_tools_from_answer(
            0,
            br#"{"jsonrpc":"2.0","id":1,"result":{"tools":[
                {"name":"echo","inputSchema":{"type":"object","properties":{"a":{"type":"string"}}}},
                {"name":7},"not a tool",{"title":"nameless"},
                {"name":"caf\u00e9","annotations":{"readOnlyHint":true}}
            ],"nextCursor":null}}"#,
        );
        // An answer whose result is not a list teaches nothing and breaks nothing.
        metrics.learn_tools_from_answer(0, br#"{"jsonrpc":"2.0","id":2,"result":"tools"}"#);
        metrics.learn_tools_from_answer(0, b"not json, not sse");
        for tool in ["echo", "caf\u{e9}", "7", "nameless"] {
            metrics.tool_call(0, &route, tool, http::StatusCode::OK);
        }
        let text = metrics.encode().unwrap();
        assert!(text.contains(r#"tool="echo",outcome="2xx"} 1"#), "{text}");
        assert!(
            text.contains("tool=\"caf\u{e9}\",outcome=\"2xx\"} 1"),
            "{text}"
        );
        assert!(text.contains(r#"tool="other",outcome="2xx"} 2"#), "{text}");
    }

    #[test]
    fn unknown_tool_names_never_become_labels() {
        let metrics = Metrics::new(1);
        let route = Arc::new("demo".to_owned());
        metrics.learn_tools_from_answer(
            0,
            br#"{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"echo"}]}}"#,
        );
        metrics.learn_tools_from_answer(
            0,
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{\"tools\":[{\"name\":\"echo\"},{\"name\":\"add\"}]}}\n\n",
        );
        metrics.tool_call(0, &route, "add", http::StatusCode::OK);
        metrics.tool_call(0, &route, "echo", http::StatusCode::OK);
        metrics.tool_call(0, &route, "made-up-1", http::StatusCode::OK);
        metrics.tool_call(0, &route, "made-up-2", http::StatusCode::OK);
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(r#"mcpgw_tool_calls_total{upstream="demo",tool="echo",outcome="2xx"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"mcpgw_tool_calls_total{upstream="demo",tool="other",outcome="2xx"} 2"#
            ),
            "{text}"
        );
        assert!(!text.contains("made-up"));
        assert!(
            text.contains(r#"tool="add""#),
            "learned from an SSE answer: {text}"
        );
        assert!(text.contains(r#"mcpgw_build_info{version="#), "{text}");
    }
}
