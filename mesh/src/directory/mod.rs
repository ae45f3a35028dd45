//! The Redis directory: which workers are alive (leases), where their mesh endpoints
//! are, and which worker owns each legacy session.
//!
//! Keys, under a configurable prefix (default `mcpgw:`):
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `{p}worker:{id}` | lease JSON: pid, host, start time, version, random lease token | PX lease |
//! | `{p}worker_addr:{id}` | mesh address `host:port` | same PX |
//! | `{p}pool_owner:{sid}` | owner worker id | until released or reclaimed |
//! | `{p}worker_sessions:{id}` | SET of sids the worker owns | until released or reclaimed |
//! | `{p}workers` | ZSET of worker ids that hold a lease, scored by their last renewal (ms) | until reclaimed or deregistered |
//! | `{p}principal_sessions:{sha1}` | SET of sids one principal (or client address) holds (owned, or left adoptable), for the session quota | PX twice the idle timeout, from its last new session |
//! | `{p}sweeper` | worker id of the one worker sweeping dead workers' keys now | PX one sweep interval |
//! | `{p}worker_gone:{id}` | `reclaimed@ms` (proven dead and reclaimed) or `deregistered@ms` (ended cleanly), Redis time | PX four leases |
//! | `{p}generation` | random token `@` creation time (ms), created when absent | no TTL |
//! | `{p}worker_cert:{id}` | not-after of the worker's mesh leaf, unix ms (only workers with a leaf) | PX lease, rewritten by every renewal |
//! | `{p}drain:{id}` | an operator asked this worker to drain (`mcpgw drain`); its next renewal tells it | PX two to three leases; deleted when the worker registers or deregisters |
//! | `{p}session_state:{sid}` | `<state>\|<kind>\|<guard>\|<payload>`: what a session needs to continue on another worker ([`SessionState`]); state `live`, or `death`/`drain` once its owner left it for adoption | no TTL while owned; PX [`DirectoryConfig::adoptable_for`] once left |
//! | `{p}session_seen:{sid}` | a remembered session (a 2026-07-28 principal's shared one) existed; the first lookup after its end takes it | no TTL while it lives; PX [`REMEMBER_ENDED`] from its end |
//! | `{p}rebuilt` | a worker registered again after Redis lost its data, or saw a failover (a new primary, or a new replication id behind the same address) | PX two leases |
//! | `{p}failover_seen` | `master_replid` of the primary whose failover was marked (the generation was renewed once for it) | PX four leases |
//!
//! By concern: [`lease`] (registration, renewal, what a lease proves), [`sessions`]
//! (claims, releases, the memory of an end, reclaim) and [`fleet`] (workers, the
//! operator's snapshot, drain requests, the sweeper), each operation beside its script;
//! this file holds the connection, its deadlines and the keys.
//!
//! A worker that never held a lease leaves no trace: a forged owner hint costs no
//! write. A reclaimed or cleanly deregistered worker leaves only a short-lived record
//! of how and when it went (so a request sent to it later is known not to have run, and
//! its sessions are known to be gone, even in a young directory): its id leaves `workers`,
//! which is also what keeps it from resuming its lease (fencing), and its keys are
//! deleted in batches, by the worker that proved it dead or by the sweeper.
//!
//! Every multi-key change is one Lua script, so it is atomic against other workers.
//! The scripts touch keys they compute from the prefix (pool_owner keys of a reclaimed
//! worker), so every key must live on one server: behind a Redis Cluster endpoint
//! (`redis+cluster://`) the prefix carries a hash tag ([`hash_tagged`]) and the whole
//! directory is one slot on one primary, followed like a Sentinel primary.
//!
//! Every server the directory talks to is followed by its replication id
//! (`master_replid`), whatever the URL: behind Sentinel or a Cluster the primary is
//! looked up again, and behind a plain URL (a managed failover endpoint, one address
//! for whichever server is primary) the server reached after a reconnection is asked
//! again. A new id means a promoted replica, or a server restarted without its data:
//! writes it never received read as missing, so the failover is marked (see
//! [`FAILOVER_LUA`]) before a missing record is judged, and a lookup that finds no
//! record reports the id of the server that answered, so a server nobody checked yet
//! never proves an absence.
//!
//! Every call is bounded by [`DirectoryConfig::op_timeout`]. A timeout or a connection
//! failure is [`DirectoryError::Unavailable`]: the state is *unknown*, never "absent".
//! A write that timed out may still have been applied by Redis; callers treat its
//! outcome as unknown and ask again.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use serde::{Deserialize, Serialize};

pub use crate::redis_conn::redact_url;
use crate::redis_conn::{self, ClusterSpec, ConnectFailure, RedisTarget, SentinelSpec, scrub_all};

mod fleet;
mod lease;
mod sessions;

pub use fleet::{FleetSnapshot, LeaseView, WorkerEntry, WorkerSnapshot};
pub use lease::{Gone, GoneHow, Lease, LeaseRenewal, LeaseState, WorkerEndpoint, WorkerInfo};
pub use sessions::{
    AdoptCause, Adoption, Claim, REMEMBER_ENDED, Recorded, Remembered, SessionKind, SessionQuota,
    SessionState,
};

/// Settings of the directory client.
#[derive(Clone, PartialEq, Eq)]
pub struct DirectoryConfig {
    /// `redis://[user:password@]host:port[/db]`, or
    /// `redis+sentinel://[user:password@]host:port[,host:port...]/<primary>[/<db>]
    /// [?sentinel_password=...]`. No password ever appears in errors or logs.
    pub redis_url: String,
    /// Prepended to every key, so several fleets can share one Redis.
    pub prefix: String,
    /// Lease time of a worker's registration. Shorter detects dead workers sooner;
    /// longer tolerates longer Redis hiccups before a live worker loses its lease.
    pub lease: Duration,
    /// Deadline of each directory call. Past it the answer is "unknown" (503 upstream
    /// of here), so keep it well under client timeouts.
    pub op_timeout: Duration,
    /// Deadline of the first connection in [`Directory::connect`]; a worker refuses to
    /// start if Redis is not reachable by then.
    pub connect_timeout: Duration,
    /// How long the record of a session whose owner died or drained stays adoptable
    /// (`session_state`): the gateway's idle timeout, since a session nobody used for
    /// that long would have ended anyway.
    pub adoptable_for: Duration,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".into(),
            prefix: "mcpgw:".into(),
            lease: Duration::from_secs(10),
            op_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(5),
            adoptable_for: Duration::from_secs(1800),
        }
    }
}

impl fmt::Debug for DirectoryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirectoryConfig")
            .field("redis_url", &redact_url(&self.redis_url))
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .field("op_timeout", &self.op_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("adoptable_for", &self.adoptable_for)
            .finish()
    }
}

/// Errors of directory calls.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// Redis did not answer in time or the connection failed: the answer is unknown.
    #[error("Redis at {url} {reason} ({op}): directory state unknown, retry")]
    Unavailable {
        /// Redis URL without credentials.
        url: String,
        /// The directory operation.
        op: &'static str,
        /// What happened, e.g. "did not answer within 500ms".
        reason: String,
    },
    /// Redis answered with an error that retrying will not fix (permissions, script error).
    #[error("Redis at {url} rejected {op}: {detail}")]
    Rejected {
        /// Redis URL without credentials.
        url: String,
        /// The directory operation.
        op: &'static str,
        /// Redis's error, with any password removed.
        detail: String,
    },
    /// The first connection failed, so this worker cannot join the fleet.
    #[error(
        "could not connect to Redis at {url}: {reason}; check the Redis URL and that Redis is \
         running and reachable"
    )]
    Connect {
        /// Redis URL without credentials.
        url: String,
        /// Why the connection failed.
        reason: String,
    },
    /// The configuration cannot work.
    #[error("invalid directory configuration: {0}")]
    InvalidConfig(String),
    /// Another live process holds the lease for this worker id.
    #[error(
        "worker id {id:?} is already held by a live worker: give this process its own \
         WORKER_ID, or wait for the old lease to expire"
    )]
    WorkerIdTaken {
        /// The contested worker id.
        id: String,
    },
    /// The worker holds no lease, so it may not claim sessions (it must re-register).
    #[error(
        "worker {id:?} holds no lease in the directory: it lost its registration; drop its \
         sessions and register again"
    )]
    NotRegistered {
        /// The worker id without a lease.
        id: String,
    },
    /// A worker id or session id that cannot be a directory key.
    #[error("invalid {what} {value:?}: use 1 to 256 visible ASCII characters")]
    InvalidName {
        /// "worker id" or "session id".
        what: &'static str,
        /// The rejected value (shortened).
        value: String,
    },
    /// The OS random source failed, so no lease token could be made.
    #[error("the operating system's random source failed: {0}")]
    NoEntropy(String),
}

/// Most sids re-claimed or reclaimed per script call, so one call never blocks Redis
/// for long (a worker may die holding 100,000 sessions).
const RECLAIM_BATCH: usize = 500;

/// Longest worker or session id accepted as a key part.
const MAX_NAME: usize = 256;

/// After this many timeouts in a row the connection is replaced. redis-rs reconnects on
/// connection errors, but a black-holed connection (Redis moved, network partition)
/// produces only timeouts until TCP gives up many minutes later.
const STALE_AFTER_TIMEOUTS: u32 = 3;

/// The directory client. Cheap to clone; clones share one reconnecting connection.
#[derive(Clone)]
pub struct Directory {
    inner: Arc<Inner>,
}

struct Inner {
    /// The current primary's `master_replid` (a new one means a failover); `None` only
    /// behind a plain URL whose server refused `INFO` at connect.
    replid: RwLock<Option<String>>,
    /// Multiplexed connection that reconnects by itself after connection errors. It is
    /// replaced after repeated timeouts (see [`STALE_AFTER_TIMEOUTS`]), and, behind
    /// Sentinel, by one to the new primary after a failover.
    conn: RwLock<ConnectionManager>,
    /// Kept to build a replacement connection; behind Sentinel, the current primary's.
    client: RwLock<redis::Client>,
    /// How to find the primary again and learn its replication id; `None` only behind a
    /// plain URL whose server refused `INFO` at connect.
    follow: Option<Follow>,
    /// What the connection reached, for `mcpgw status`.
    topology: RwLock<Topology>,
    /// A lookup of the primary is running (one at a time).
    following: AtomicBool,
    /// The last lookup attempt failed (the server is unreachable or not a primary):
    /// calls behind a plain URL stop waiting for it.
    follow_failing: AtomicBool,
    /// Wakes calls waiting for a lookup behind a plain URL to end.
    followed: tokio::sync::Notify,
    /// Failovers this directory saw (the primary's replication id changed).
    failovers: AtomicU64,
    /// A failover was seen and the lease holder has not re-asserted its records yet.
    failover_pending: AtomicBool,
    /// Wakes the lease holder when a failover is seen.
    failover_notify: tokio::sync::Notify,
    /// Kept to build a replacement connection.
    manager_cfg: ConnectionManagerConfig,
    /// Timeouts in a row; reset by any answer from Redis.
    timeouts_in_a_row: AtomicU32,
    /// Settings, including the deadlines.
    cfg: DirectoryConfig,
    /// Redis URL without credentials, for errors and logs.
    url: String,
    /// Decoded passwords (the data servers' and the sentinels'), scrubbed from Redis
    /// error texts just in case one echoes them.
    secrets: Vec<String>,
    /// The Lua scripts, hashed once.
    scripts: Scripts,
    /// Told about every call (for metrics), once someone watches.
    observer: std::sync::OnceLock<Arc<dyn DirectoryObserver>>,
}

/// How a directory finds its primary again, and reads its replication id.
#[derive(Clone)]
enum Follow {
    /// A plain URL: whatever server answers at that address (behind a managed
    /// failover endpoint, a promoted replica after a failover).
    Standalone(redis::Client),
    Sentinel(SentinelSpec),
    /// A Redis Cluster, and a key in the directory's one slot (every key carries the
    /// prefix's hash tag).
    Cluster(ClusterSpec, String),
}

impl Follow {
    /// How to follow `target`'s primary. A cluster keeps every key in one slot: the
    /// prefix takes a hash tag.
    fn of(target: RedisTarget, cfg: &mut DirectoryConfig) -> Self {
        match target {
            RedisTarget::Standalone(client) => Follow::Standalone(client),
            RedisTarget::Sentinel(spec) => Follow::Sentinel(spec),
            RedisTarget::Cluster(spec) => {
                cfg.prefix = hash_tagged(&cfg.prefix);
                let key = format!("{}generation", cfg.prefix);
                Follow::Cluster(spec, key)
            }
        }
    }

    async fn resolve(&self, op_timeout: Duration) -> Result<redis_conn::Primary, String> {
        match self {
            Follow::Standalone(client) => redis_conn::standalone_primary(client, op_timeout).await,
            Follow::Sentinel(spec) => redis_conn::resolve_primary(spec, op_timeout, None).await,
            Follow::Cluster(spec, key) => {
                redis_conn::resolve_slot_primary(spec, key, op_timeout).await
            }
        }
    }

    fn topology(&self, primary: &redis_conn::Primary) -> Topology {
        match self {
            Follow::Standalone(_) => Topology::Standalone,
            Follow::Sentinel(spec) => Topology::Sentinel {
                name: spec.name.clone(),
                primary: primary.addr.clone(),
                replicas: primary.replicas.clone(),
            },
            Follow::Cluster(..) => Topology::Cluster {
                primary: primary.addr.clone(),
                replicas: primary.replicas.clone(),
            },
        }
    }

    /// Where the primary is looked up, for errors.
    fn source(&self) -> String {
        match self {
            Follow::Standalone(_) => "behind the Redis URL".into(),
            Follow::Sentinel(spec) => format!("named {:?} through Sentinel", spec.name),
            Follow::Cluster(..) => "of the directory's slot in the Redis Cluster".into(),
        }
    }

    fn secrets(&self) -> Vec<String> {
        match self {
            Follow::Standalone(client) => redis_conn::password(client).into_iter().collect(),
            Follow::Sentinel(spec) => spec.secrets(),
            Follow::Cluster(spec, _) => spec.secrets(),
        }
    }
}

/// A key prefix with a hash tag, so every key of the directory lives in one Redis
/// Cluster slot (its scripts touch many keys at once): the prefix as given when it
/// already has one (`{fleet1}:`), else the whole prefix (`{mcpgw:}`).
pub fn hash_tagged(prefix: &str) -> String {
    let tagged = prefix
        .find('{')
        .is_some_and(|open| prefix[open + 1..].find('}').is_some_and(|len| len > 0));
    if tagged {
        prefix.to_owned()
    } else {
        format!("{{{prefix}}}")
    }
}

/// The Redis deployment the directory reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server, named by the URL.
    Standalone,
    /// The primary of the directory's slot in a Redis Cluster.
    Cluster {
        /// The primary reached, `host:port`.
        primary: String,
        /// Its replicas as it reported them, `host:port`.
        replicas: Vec<String>,
    },
    /// A primary found through Sentinel.
    Sentinel {
        /// The primary's name in the sentinels' configuration.
        name: String,
        /// The primary reached, `host:port`.
        primary: String,
        /// Its replicas as it reported them, `host:port`.
        replicas: Vec<String>,
    },
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Standalone => f.write_str("standalone"),
            Topology::Cluster { primary, replicas } => write!(
                f,
                "cluster: slot primary {primary}, replicas [{}]",
                replicas.join(", ")
            ),
            Topology::Sentinel {
                name,
                primary,
                replicas,
            } => write!(
                f,
                "sentinel {name:?}: primary {primary}, replicas [{}]",
                replicas.join(", ")
            ),
        }
    }
}

/// How often the primary is looked up again while a lookup finds none.
const FOLLOW_RETRY: Duration = Duration::from_millis(200);

/// Marks a failover once per new primary: the directory counts as rebuilt (a missing
/// record is unknown for a lease) and the generation is renewed so every worker's
/// judgement treats it as young until its owner re-asserts. KEYS: rebuilt, generation,
/// failover_seen. ARGV: rebuilt px, new primary's replid, fresh token, seen px.
/// Returns 1 if this call renewed the generation, 0 if another worker did.
const FAILOVER_LUA: &str = r#"
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
if redis.call('GET', KEYS[3]) == ARGV[2] then return 0 end
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[3] .. '@' .. string.format('%d', now_ms()))
return 1
"#;

/// Watches the directory's calls: one report per call with its operation name (from
/// a fixed set), how long it took, and whether Redis answered.
pub trait DirectoryObserver: Send + Sync + 'static {
    fn observe(&self, op: &'static str, elapsed: Duration, answered: bool);
}

impl fmt::Debug for Directory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Directory")
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

struct Scripts {
    register: Script,
    renew: Script,
    deregister: Script,
    claim: Script,
    release: Script,
    reclaim: Script,
    reclaim_after_loss: Script,
    adopt: Script,
    hand_over: Script,
    remembered: Script,
    recorded_owner: Script,
    generation: Script,
    resume: Script,
    lease_state: Script,
    registered_ago: Script,
    gone: Script,
    request_drain: Script,
    failover: Script,
    reassert: Script,
}

/// Reads a `worker_gone` record: {how, ms ago}, or {'', -1} when there is none.
const GONE_LUA: &str = r#"
local function gone(key)
  local record = redis.call('GET', key)
  if not record then return {'', -1} end
  local how, at = string.match(record, '^(%a+)@(%d+)$')
  if not how then return {'', -1} end
  return {how, now_ms() - tonumber(at)}
end
"#;

/// Redis's clock in milliseconds, and get-or-create of the generation token (which
/// records when it was created), shared by the scripts that need them.
const GEN_LUA: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function generation(key, fresh)
  local g = redis.call('GET', key)
  if g then return g end
  g = fresh .. '@' .. string.format('%d', now_ms())
  redis.call('SET', key, g)
  return g
end
local function generation_age(g)
  local since = tonumber(string.match(g, '@(%d+)$') or '0')
  return now_ms() - since
end
"#;

impl Scripts {
    /// Each script is written beside the operation it serves.
    fn new() -> Self {
        Self {
            register: lease::register(),
            renew: lease::renew(),
            resume: lease::resume(),
            deregister: lease::deregister(),
            lease_state: lease::lease_state(),
            registered_ago: lease::registered_ago(),
            gone: lease::gone(),
            generation: lease::generation(),
            claim: sessions::claim(),
            release: sessions::release(),
            remembered: sessions::remembered(),
            recorded_owner: sessions::recorded_owner(),
            reclaim: sessions::reclaim(),
            reclaim_after_loss: sessions::reclaim_after_loss(),
            adopt: sessions::adopt(),
            hand_over: sessions::hand_over(),
            request_drain: fleet::request_drain(),
            failover: Script::new(&format!("{GEN_LUA}\n{FAILOVER_LUA}")),
            reassert: lease::reassert(),
        }
    }
}

impl Directory {
    /// Connects to Redis and checks it answers. Fails within
    /// [`DirectoryConfig::connect_timeout`] if Redis is unreachable.
    pub async fn connect(mut cfg: DirectoryConfig) -> Result<Self, DirectoryError> {
        let url = redact_url(&cfg.redis_url);
        check_timing(&cfg)?;
        let target = redis_conn::parse_target(&cfg.redis_url, None)
            .map_err(DirectoryError::InvalidConfig)?;
        let manager_cfg = ConnectionManagerConfig::new()
            // Each (re)connection attempt and each response is bounded inside redis-rs
            // too, so a reconnect never hangs on a frozen server; our own timeout below
            // is still what bounds every call.
            .set_connection_timeout(Some(cfg.op_timeout))
            .set_response_timeout(Some(cfg.op_timeout))
            .set_max_delay(Duration::from_secs(1));
        let connect_error = |reason| DirectoryError::Connect {
            url: url.clone(),
            reason,
        };
        let follow = Follow::of(target, &mut cfg);
        let secrets = follow.secrets();
        let (client, topology, replid) = match &follow {
            // A plain URL: first waited for as it is, then asked for its replication id.
            Follow::Standalone(client) => (client.clone(), Topology::Standalone, None),
            _ => {
                let primary = first_primary(&follow, &cfg).await.map_err(connect_error)?;
                let topology = follow.topology(&primary);
                (primary.client, topology, Some(primary.replid))
            }
        };
        let conn = connect_first(&client, &manager_cfg, &cfg)
            .await
            .map_err(|reason| connect_error(scrub_all(&reason, &secrets)))?;
        let (follow, replid) = match follow {
            Follow::Standalone(_) => {
                match redis_conn::standalone_primary(&client, cfg.op_timeout).await {
                    Ok(primary) => (Some(follow), Some(primary.replid)),
                    Err(why) => {
                        tracing::warn!(
                            redis = %url,
                            error = %why,
                            "cannot read the Redis server's replication id (INFO replication): \
                             a replica promoted behind this URL would not be noticed, and a \
                             record it lost would read as absent"
                        );
                        (None, None)
                    }
                }
            }
            _ => (Some(follow), replid),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                replid: RwLock::new(replid),
                conn: RwLock::new(conn),
                client: RwLock::new(client),
                follow,
                topology: RwLock::new(topology),
                following: AtomicBool::new(false),
                follow_failing: AtomicBool::new(false),
                followed: tokio::sync::Notify::new(),
                failovers: AtomicU64::new(0),
                failover_pending: AtomicBool::new(false),
                failover_notify: tokio::sync::Notify::new(),
                manager_cfg,
                timeouts_in_a_row: AtomicU32::new(0),
                cfg,
                url,
                secrets,
                scripts: Scripts::new(),
                observer: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Reports every later call to `observer` (the first one set stays).
    pub fn observe_with(&self, observer: Arc<dyn DirectoryObserver>) {
        let _ = self.inner.observer.set(observer);
    }

    /// The settings this directory was made with.
    pub fn config(&self) -> &DirectoryConfig {
        &self.inner.cfg
    }

    /// The deployment reached: standalone, or the Sentinel primary and its replicas.
    pub fn topology(&self) -> Topology {
        self.inner.topology.read().clone()
    }

    /// How many failovers this directory saw: a new primary (behind Sentinel or a
    /// Cluster), or a new replication id behind the same address (a replica promoted
    /// behind a plain URL's failover endpoint, or a server restarted without its data).
    pub fn failovers_seen(&self) -> u64 {
        self.inner.failovers.load(Ordering::Relaxed)
    }

    /// Whether a failover was seen since the last call; the caller must re-assert its
    /// lease and session records ([`Directory::reassert_after_failover`],
    /// [`Directory::reclaim_sessions_after_loss`]) and call
    /// [`Directory::failover_unhandled`] if that fails.
    pub fn take_failover(&self) -> bool {
        self.inner.failover_pending.swap(false, Ordering::AcqRel)
    }

    /// Puts a failover taken with [`Directory::take_failover`] back: its re-assertion
    /// failed and must be tried again.
    pub fn failover_unhandled(&self) {
        self.inner.failover_pending.store(true, Ordering::Release);
    }

    /// Resolves when a failover is seen (at once if one is pending).
    pub async fn failover_seen(&self) {
        loop {
            let notified = self.inner.failover_notify.notified();
            if self.inner.failover_pending.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Looks the primary up again in the background (one lookup at a time), after a
    /// call found the connection broken, the server read-only or answering under
    /// another replication id. A new primary is marked as a failover (see
    /// [`FAILOVER_LUA`]) before any call is sent to it (behind a plain URL, calls wait
    /// for the lookup: see [`Directory::wait_for_lookup`]), so no worker judges a
    /// record it may have lost as absent.
    fn follow_primary(&self) {
        if self.inner.follow.is_none() || self.inner.following.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.follow_failing.store(false, Ordering::Release);
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let dir = Directory { inner };
                match dir.try_follow().await {
                    Ok(()) => {
                        dir.inner.follow_failing.store(false, Ordering::Release);
                        dir.inner.following.store(false, Ordering::Release);
                        dir.inner.followed.notify_waiters();
                        return;
                    }
                    Err(why) => {
                        dir.inner.follow_failing.store(true, Ordering::Release);
                        dir.inner.followed.notify_waiters();
                        tracing::warn!(redis = %dir.inner.url, error = %why, "looking up the Redis primary again failed; retrying");
                    }
                }
                drop(dir);
                tokio::time::sleep(FOLLOW_RETRY).await;
            }
        });
    }

    /// One lookup: if the sentinels (the cluster, the plain URL) name a different
    /// primary, or the same one with a new replication id, mark the failover there and
    /// switch to it.
    async fn try_follow(&self) -> Result<(), String> {
        let Some(follow) = &self.inner.follow else {
            return Ok(());
        };
        let cfg = &self.inner.cfg;
        let primary = follow.resolve(cfg.op_timeout).await?;
        let current = self
            .inner
            .client
            .read()
            .get_connection_info()
            .addr()
            .to_string();
        let same_server =
            self.known_replid().is_some_and(|r| r == primary.replid) && current == primary.addr;
        if same_server {
            // The same primary: the manager reconnects by itself.
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
        let conn =
            redis_conn::connect_manager(&primary.client, self.inner.manager_cfg.clone(), deadline)
                .await
                .map_err(|f| match f {
                    ConnectFailure::Failed(why) => why,
                    ConnectFailure::TimedOut => "the new primary did not answer".into(),
                })?;
        let fresh = random_token().map_err(|e| e.to_string())?;
        let mut marking = conn.clone();
        let renewed: i64 = tokio::time::timeout(
            cfg.op_timeout,
            self.inner
                .scripts
                .failover
                .key(self.key_rebuilt())
                .key(self.key_generation())
                .key(self.key_failover_seen())
                .arg(duration_px(cfg.lease * 2))
                .arg(&primary.replid)
                .arg(&fresh)
                .arg(duration_px(cfg.lease * 4))
                .invoke_async(&mut marking),
        )
        .await
        .map_err(|_| "marking the failover timed out".to_owned())?
        .map_err(|e| scrub_all(&e.to_string(), &self.inner.secrets))?;
        let topology = follow.topology(&primary);
        {
            let mut client = self.inner.client.write();
            *self.inner.conn.write() = conn;
            *self.inner.replid.write() = Some(primary.replid);
            *client = primary.client;
        }
        *self.inner.topology.write() = topology;
        self.inner.failovers.fetch_add(1, Ordering::Relaxed);
        self.inner.failover_pending.store(true, Ordering::Release);
        self.inner.failover_notify.notify_waiters();
        tracing::warn!(
            redis = %self.inner.url,
            primary = %primary.addr,
            first_to_mark = renewed == 1,
            "Redis failover: following the new primary; records it lacks count as unknown for a lease"
        );
        Ok(())
    }

    fn known_replid(&self) -> Option<String> {
        self.inner.replid.read().clone()
    }

    /// Runs one Redis exchange under the deadline and classifies its failure.
    async fn run<'s, T, F, Fut>(&'s self, op: &'static str, f: F) -> Result<T, DirectoryError>
    where
        F: FnOnce(ConnectionManager, &'s Scripts) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let timeout = self.inner.cfg.op_timeout;
        let started = tokio::time::Instant::now();
        let deadline = started + timeout;
        if !self.wait_for_lookup(deadline).await {
            if let Some(observer) = self.inner.observer.get() {
                observer.observe(op, started.elapsed(), false);
            }
            return Err(DirectoryError::Unavailable {
                url: self.inner.url.clone(),
                op,
                reason: format!(
                    "did not answer within {timeout:?}: the server behind the URL was still \
                     being asked for its replication id after a reconnection"
                ),
            });
        }
        let fut = f(self.connection(), &self.inner.scripts);
        let result = tokio::time::timeout_at(deadline, fut).await;
        if let Some(observer) = self.inner.observer.get() {
            observer.observe(op, started.elapsed(), matches!(result, Ok(Ok(_))));
        }
        let timed_out = match &result {
            Err(_) => true,
            Ok(Err(e)) => e.is_timeout(),
            Ok(Ok(_)) => false,
        };
        if let Ok(Err(e)) = &result
            && (e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || is_read_only(e))
        {
            self.follow_primary();
        } else if timed_out {
            self.follow_primary();
        }
        if timed_out {
            self.note_timeout();
        } else {
            self.inner.timeouts_in_a_row.store(0, Ordering::Relaxed);
        }
        match result {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if !e.is_timeout() => Err(self.classify(op, &e)),
            // redis-rs's own response timeout and ours are the same event for callers.
            Ok(Err(_)) | Err(_) => Err(DirectoryError::Unavailable {
                url: self.inner.url.clone(),
                op,
                reason: format!("did not answer within {timeout:?}"),
            }),
        }
    }

    /// Behind a plain URL, waits (until `deadline`) while the server is asked for its
    /// replication id after a broken connection: the connection manager reconnects to
    /// whatever answers at the address, and a promoted replica must be marked as a
    /// failover before a call reads it. A lookup whose last attempt failed (the server
    /// is unreachable, frozen or not a primary) is not waited for: the call meets the
    /// same failure, or answers from a server whose missing records
    /// [`Directory::check_absence`] does not take as proof. False if the deadline came
    /// first.
    async fn wait_for_lookup(&self, deadline: tokio::time::Instant) -> bool {
        if !matches!(self.inner.follow, Some(Follow::Standalone(_))) {
            return true;
        }
        let ended = async {
            loop {
                let woken = self.inner.followed.notified();
                if !self.inner.following.load(Ordering::Acquire)
                    || self.inner.follow_failing.load(Ordering::Acquire)
                {
                    return;
                }
                woken.await;
            }
        };
        tokio::time::timeout_at(deadline, ended).await.is_ok()
    }

    /// Checks that a lookup which found no record was answered by the primary this
    /// directory follows (`answered_by`: the replication id the script read, '' if the
    /// server refused `INFO`). Another id is a failover not marked yet (the connection
    /// reached a promoted replica before the lookup of the primary did): the absence
    /// proves nothing, the lookup is started, and the answer is unknown.
    fn check_absence(&self, op: &'static str, answered_by: &str) -> Result<(), DirectoryError> {
        let known = self.known_replid();
        let unmarked = !answered_by.is_empty() && known.is_some_and(|k| k != answered_by);
        if !unmarked {
            return Ok(());
        }
        self.follow_primary();
        Err(DirectoryError::Unavailable {
            url: self.inner.url.clone(),
            op,
            reason: "answered by a Redis server with another replication id than the \
                     primary followed (a failover not marked yet): a missing record \
                     proves nothing"
                .into(),
        })
    }

    fn connection(&self) -> ConnectionManager {
        self.inner.conn.read().clone()
    }

    /// Counts a timeout and swaps in a fresh (lazily connecting) manager once they
    /// repeat, so a silently dead connection does not keep every call waiting.
    fn note_timeout(&self) {
        let n = self.inner.timeouts_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        if n < STALE_AFTER_TIMEOUTS {
            return;
        }
        self.inner.timeouts_in_a_row.store(0, Ordering::Relaxed);
        // Held until the new manager is in place, so a failover switching both at
        // once is never undone by a manager built for the old primary.
        let client = self.inner.client.read();
        match ConnectionManager::new_lazy_with_config(
            client.clone(),
            self.inner.manager_cfg.clone(),
        ) {
            Ok(fresh) => {
                *self.inner.conn.write() = fresh;
                tracing::warn!(
                    redis = %self.inner.url,
                    "Redis timed out {STALE_AFTER_TIMEOUTS} times in a row; opening a new connection"
                );
            }
            Err(e) => tracing::warn!(
                redis = %self.inner.url,
                error = %scrub_all(&e.to_string(), &self.inner.secrets),
                "could not set up a new Redis connection after repeated timeouts"
            ),
        }
    }

    /// Transient failures (connection, timeouts, LOADING, BUSY...) are "unknown"; the
    /// rest are definite rejections.
    fn classify(&self, op: &'static str, e: &RedisError) -> DirectoryError {
        use redis::RetryMethod as R;
        let detail = scrub_all(&e.to_string(), &self.inner.secrets);
        // READONLY: a primary demoted to replica in a failover; the next call goes to
        // the new primary.
        let transient = is_read_only(e)
            || e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || (e.kind() != redis::ErrorKind::AuthenticationFailed
                && matches!(
                    e.retry_method(),
                    R::Reconnect | R::RetryImmediately | R::WaitAndRetry
                ));
        if transient {
            DirectoryError::Unavailable {
                url: self.inner.url.clone(),
                op,
                reason: format!("failed: {detail}"),
            }
        } else {
            DirectoryError::Rejected {
                url: self.inner.url.clone(),
                op,
                detail,
            }
        }
    }

    fn lease_px(&self) -> u64 {
        duration_px(self.inner.cfg.lease)
    }

    fn key_worker(&self, id: &str) -> String {
        format!("{}worker:{id}", self.inner.cfg.prefix)
    }

    fn key_addr(&self, id: &str) -> String {
        format!("{}worker_addr:{id}", self.inner.cfg.prefix)
    }

    fn key_sessions(&self, id: &str) -> String {
        format!("{}worker_sessions:{id}", self.inner.cfg.prefix)
    }

    fn key_gone(&self, id: &str) -> String {
        format!("{}worker_gone:{id}", self.inner.cfg.prefix)
    }

    fn key_workers(&self) -> String {
        format!("{}workers", self.inner.cfg.prefix)
    }

    fn key_sweeper(&self) -> String {
        format!("{}sweeper", self.inner.cfg.prefix)
    }

    fn key_pool_owner(&self, sid: &str) -> String {
        format!("{}pool_owner:{sid}", self.inner.cfg.prefix)
    }

    fn key_rebuilt(&self) -> String {
        format!("{}rebuilt", self.inner.cfg.prefix)
    }

    fn key_state(&self, sid: &str) -> String {
        format!("{}session_state:{sid}", self.inner.cfg.prefix)
    }

    fn key_seen(&self, sid: &str) -> String {
        format!("{}session_seen:{sid}", self.inner.cfg.prefix)
    }

    fn key_generation(&self) -> String {
        format!("{}generation", self.inner.cfg.prefix)
    }

    /// When worker `id` registered (unix ms, Redis's clock), kept with its lease.
    fn key_since(&self, id: &str) -> String {
        format!("{}worker_since:{id}", self.inner.cfg.prefix)
    }

    /// The primary (`host:port`) worker `id` followed at its last renewal, behind
    /// Sentinel or Cluster.
    fn key_primary(&self, id: &str) -> String {
        format!("{}worker_primary:{id}", self.inner.cfg.prefix)
    }

    /// The primary this directory follows (`host:port`), or '' for a standalone Redis
    /// (nothing to disagree about).
    fn followed_primary(&self) -> String {
        if !matches!(
            self.inner.follow,
            Some(Follow::Sentinel(_) | Follow::Cluster(..))
        ) {
            return String::new();
        }
        self.inner
            .client
            .read()
            .get_connection_info()
            .addr()
            .to_string()
    }

    fn key_cert(&self, id: &str) -> String {
        format!("{}worker_cert:{id}", self.inner.cfg.prefix)
    }

    fn key_failover_seen(&self) -> String {
        format!("{}failover_seen", self.inner.cfg.prefix)
    }

    fn key_drain(&self, id: &str) -> String {
        format!("{}drain:{id}", self.inner.cfg.prefix)
    }
}

/// The first connection: direct attempts until `connect_timeout`, so a Redis that is
/// still starting is waited for, and a failure reports its real cause (refused, wrong
/// password) rather than the manager's generic retry exhaustion. Only then is the
/// self-reconnecting manager built. The error is already scrubbed of the password.
/// Refuses timings that could never work: no lease, or Redis calls with no time.
fn check_timing(cfg: &DirectoryConfig) -> Result<(), DirectoryError> {
    if cfg.lease < Duration::from_millis(1) {
        return Err(DirectoryError::InvalidConfig(
            "the lease time must be at least 1ms".into(),
        ));
    }
    if cfg.op_timeout.is_zero() || cfg.connect_timeout.is_zero() {
        return Err(DirectoryError::InvalidConfig(
            "op_timeout and connect_timeout must be positive".into(),
        ));
    }
    Ok(())
}

async fn connect_first(
    client: &redis::Client,
    manager_cfg: &ConnectionManagerConfig,
    cfg: &DirectoryConfig,
) -> Result<ConnectionManager, String> {
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    let no_answer = format!("no answer within {:?}", cfg.connect_timeout);
    redis_conn::wait_until_answering(client, cfg.op_timeout, deadline, &no_answer).await?;
    redis_conn::connect_manager(client, manager_cfg.clone(), deadline)
        .await
        .map_err(|failure| match failure {
            ConnectFailure::Failed(reason) => reason,
            ConnectFailure::TimedOut => no_answer,
        })
}

/// Looks the primary up through the sentinels until `connect_timeout`, so sentinels
/// or a primary that are still starting are waited for.
async fn first_primary(
    follow: &Follow,
    cfg: &DirectoryConfig,
) -> Result<redis_conn::Primary, String> {
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    loop {
        match follow.resolve(cfg.op_timeout).await {
            Ok(primary) => return Ok(primary),
            Err(why) if tokio::time::Instant::now() + FOLLOW_RETRY >= deadline => {
                return Err(format!(
                    "no primary {} found within {:?}: {why}",
                    follow.source(),
                    cfg.connect_timeout
                ));
            }
            Err(_) => tokio::time::sleep(FOLLOW_RETRY).await,
        }
    }
}

/// A server that no longer takes the directory's writes: a primary demoted in a
/// failover (READONLY), or a Cluster node that no longer serves the directory's slot
/// or cannot right now (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, MASTERDOWN).
fn is_read_only(e: &RedisError) -> bool {
    use redis::ServerErrorKind as K;
    matches!(
        e.kind(),
        redis::ErrorKind::Server(
            K::ReadOnly | K::Moved | K::Ask | K::TryAgain | K::ClusterDown | K::MasterDown
        )
    )
}

/// Milliseconds since the unix epoch (0 for times before it).
fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A leaf's not-after as a script argument: '' when the worker has no leaf.
fn cert_arg(not_after_ms: Option<u64>) -> String {
    not_after_ms.map(|ms| ms.to_string()).unwrap_or_default()
}

fn duration_px(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Ids become key suffixes and log fields: visible ASCII only (what MCP allows in a
/// session id), bounded in length.
fn check_name(what: &'static str, value: &str) -> Result<(), DirectoryError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_NAME
        && value.bytes().all(|b| (0x21..=0x7e).contains(&b));
    if ok {
        Ok(())
    } else {
        Err(DirectoryError::InvalidName {
            what,
            value: value.chars().take(64).collect(),
        })
    }
}

/// 128 random bits, hex.
fn random_token() -> Result<String, DirectoryError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| DirectoryError::NoEntropy(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Escapes SCAN glob metacharacters so a prefix matches itself literally.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_never_shows_the_password() {
        let cfg = DirectoryConfig {
            redis_url: "redis://u:s3cret@h:1".into(),
            ..Default::default()
        };
        assert!(!format!("{cfg:?}").contains("s3cret"));
    }

    #[test]
    fn a_cluster_prefix_puts_every_key_in_one_slot() {
        assert_eq!(hash_tagged("mcpgw:"), "{mcpgw:}");
        assert_eq!(hash_tagged("{fleet1}:"), "{fleet1}:");
        // An empty tag hashes the whole key: not a tag.
        assert_eq!(hash_tagged("a{}b:"), "{a{}b:}");
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("session id", "abc-123").is_ok());
        assert!(check_name("session id", "").is_err());
        assert!(check_name("session id", "a b").is_err());
        assert!(check_name("session id", &"x".repeat(257)).is_err());
    }

    #[test]
    fn glob_metacharacters_are_escaped() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
