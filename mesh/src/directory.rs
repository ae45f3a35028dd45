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
//! | `{p}principal_sessions:{sha1}` | SET of sids one principal (or client address) holds, for the session quota | PX twice the idle timeout, from its last new session |
//! | `{p}sweeper` | worker id of the one worker sweeping dead workers' keys now | PX one sweep interval |
//! | `{p}worker_gone:{id}` | `reclaimed@ms` (proven dead and reclaimed) or `deregistered@ms` (ended cleanly), Redis time | PX four leases |
//! | `{p}generation` | random token `@` creation time (ms), created when absent | no TTL |
//! | `{p}worker_cert:{id}` | not-after of the worker's mesh leaf, unix ms (only workers with a leaf) | PX lease, rewritten by every renewal |
//! | `{p}drain:{id}` | an operator asked this worker to drain (`mcpgw drain`); its next renewal tells it | PX two to three leases; deleted when the worker registers or deregisters |
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
//! worker), so the directory needs a single Redis, not Redis Cluster.
//!
//! Every call is bounded by [`DirectoryConfig::op_timeout`]. A timeout or a connection
//! failure is [`DirectoryError::Unavailable`]: the state is *unknown*, never "absent".
//! A write that timed out may still have been applied by Redis; callers treat its
//! outcome as unknown and ask again.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use serde::{Deserialize, Serialize};

pub use crate::redis_conn::redact_url;
use crate::redis_conn::{self, ConnectFailure, scrub};

/// Settings of the directory client.
#[derive(Clone, PartialEq, Eq)]
pub struct DirectoryConfig {
    /// `redis://[user:password@]host:port[/db]`. The password never appears in errors
    /// or logs.
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
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".into(),
            prefix: "mcpgw:".into(),
            lease: Duration::from_secs(10),
            op_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(5),
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

/// What a worker publishes about itself in its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// OS process id, for operators.
    pub pid: u32,
    /// Host (container) name, for operators.
    pub host: String,
    /// Process start time, unix milliseconds.
    pub started_unix_ms: u64,
    /// mcpgw version, to spot mixed fleets during upgrades.
    pub version: String,
    /// The worker's admin listener (`host:port`), for operators' tools; absent in
    /// leases written by versions without one.
    #[serde(default)]
    pub admin: Option<String>,
    /// The mesh identity (URI SAN) of the worker's leaf: a caller believes a `Welcome`
    /// for this worker only from a certificate with this identity. Absent over the
    /// Redis transport, and in leases written by versions without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_identity: Option<String>,
}

/// Where a live worker's mesh endpoint is and who answers there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// The mesh address `host:port` (or the Redis channel).
    pub addr: String,
    /// The mesh identity the worker registered, if it registered one.
    pub identity: Option<String>,
}

/// The JSON stored in `{p}worker:{id}`.
#[derive(Serialize, Deserialize)]
struct LeaseValue {
    /// What the worker told about itself.
    #[serde(flatten)]
    info: WorkerInfo,
    /// Random per registration: tells this registration apart from a later one of the
    /// same id, so only its holder can renew or delete it.
    token: String,
}

/// A held worker lease. Renew it with [`Directory::renew_lease`] well before
/// [`Lease::valid_until`].
#[derive(Debug, Clone)]
pub struct Lease {
    /// The worker id.
    id: String,
    /// Random token of this registration.
    token: String,
    /// Exact lease value written, compared by renew and deregister.
    value: String,
    /// Mesh address, re-set on every renewal.
    addr: String,
    /// Directory generation seen when registering; tells a lost lease from a lost Redis.
    generation: String,
    /// Lease end by our own clock, measured from before the request was sent.
    valid_until: Instant,
    /// Not-after of the worker's mesh leaf (unix ms), rewritten with every renewal so
    /// operators see a reloaded certificate; `None` without a leaf.
    cert_not_after_ms: Option<u64>,
}

impl Lease {
    /// The worker id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Random token of this registration.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The mesh address registered with the lease.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Directory generation seen when registering.
    pub fn generation(&self) -> &str {
        &self.generation
    }

    /// End of the lease by our own clock, counted from before the registration was
    /// sent, so it never lies later than Redis's expiry. A worker must not act for its
    /// sessions past this instant (minus a margin) without a successful renewal.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// Not-after of the mesh leaf published with this lease, if any.
    pub fn cert_not_after(&self) -> Option<SystemTime> {
        self.cert_not_after_ms
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
    }

    /// Publishes `not_after` as the mesh leaf's expiry from the next renewal on (after a
    /// certificate reload).
    pub fn set_cert_not_after(&mut self, not_after: Option<SystemTime>) {
        self.cert_not_after_ms = not_after.map(unix_ms);
    }
}

/// What [`Directory::remembered_session`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remembered {
    /// The session is recorded; the id of its owner.
    Owner(String),
    /// It existed and ended; this lookup is the one that learnt it.
    Ended,
    /// No record and no memory of one: it never existed, its end was already told, or
    /// the directory lost it (see the generation: a young or changed generation means
    /// the directory may have forgotten it, so absence is not proven).
    Absent {
        /// The directory generation now ('' when none exists yet).
        generation: String,
        /// How long that generation has existed.
        generation_age: Duration,
        /// A worker rebuilt the directory (it lost its data) within two leases.
        rebuilt: bool,
    },
}

/// How long the directory remembers that a remembered session ended, so its principal
/// is told the state is gone: long enough for a client that comes back within a day,
/// short enough that one key per principal and route does not stay forever.
pub const REMEMBER_ENDED: Duration = Duration::from_secs(24 * 3600);

/// What [`Directory::claim_session`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// The session is recorded as the caller's.
    Claimed,
    /// Another owner is recorded already (a session id collision).
    Taken,
    /// The quota key already holds its limit of sessions; nothing was recorded.
    OverQuota,
}

/// A fleet-wide limit on the sessions one principal (or client address) holds.
#[derive(Debug, Clone, Copy)]
pub struct SessionQuota<'a> {
    /// Whose sessions these are; hashed before it becomes part of a key.
    pub key: &'a str,
    /// Sessions the key may hold at once.
    pub limit: usize,
    /// How long the key's count lives after its last new session (sessions older than
    /// that have expired by then).
    pub ttl: Duration,
}

/// A worker's lease as the directory sees it, with what is needed to judge whether a
/// missing lease proves death.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    /// The lease key exists.
    pub alive: bool,
    /// The directory generation now (empty if none exists yet: Redis came back empty).
    pub generation: String,
    /// How long that generation has existed.
    pub generation_age: Duration,
    /// How the worker went, if it was reclaimed or deregistered recently.
    pub gone: Option<Gone>,
}

/// How a worker left the fleet, and how long ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone {
    pub how: GoneHow,
    /// Time since, by Redis's clock (whole milliseconds).
    pub ago: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoneHow {
    /// Proven dead by another worker, its sessions reclaimed.
    Reclaimed,
    /// Ended cleanly (drained): its sessions were ended before it deregistered.
    Deregistered,
}

impl Gone {
    fn parse(how: &str, ago_ms: i64) -> Option<Gone> {
        let how = match how {
            "reclaimed" => GoneHow::Reclaimed,
            "deregistered" => GoneHow::Deregistered,
            _ => return None,
        };
        Some(Gone {
            how,
            ago: Duration::from_millis(u64::try_from(ago_ms).ok()?),
        })
    }
}

/// Result of a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRenewal {
    /// The lease is ours until `valid_until` (by our clock, from before the request).
    Renewed {
        /// New lease end.
        valid_until: Instant,
    },
    /// The lease key no longer holds our token (expired, reclaimed, or taken by another
    /// process). Fencing: drop every session and register again under a new id.
    Lost,
    /// Renewed like [`LeaseRenewal::Renewed`], and an operator asked this worker to drain
    /// (`{p}drain:{id}`, set by [`Directory::request_drain`]): it should stop exactly
    /// as on SIGTERM.
    DrainRequested {
        /// New lease end.
        valid_until: Instant,
    },
    /// The lease key is gone because the whole directory was lost (the generation token
    /// changed or vanished: Redis came back empty). Register again under the same id and
    /// re-claim sessions with [`Directory::reclaim_sessions_after_loss`]; if that
    /// registration fails with `WorkerIdTaken`, treat it as [`LeaseRenewal::Lost`].
    DirectoryLost,
}

/// One registered worker in the fleet view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEntry {
    /// Worker id.
    pub id: String,
    /// What the worker published.
    pub info: WorkerInfo,
    /// Token of its current registration (to reclaim it on proof it is dead).
    pub lease_token: String,
    /// Mesh address; `None` if the key vanished between reads.
    pub addr: Option<String>,
}

/// The fleet as the directory holds it, for operators' tools (`mcpgw status`): what
/// each key says, with no judgement of it. Read with SCAN and pipelined reads in
/// several round trips, so it is not one atomic view: a worker that starts or stops
/// while it is taken may be seen half.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetSnapshot {
    /// Redis's clock (unix ms) at the end of the reads; ages are measured against it,
    /// never against the clock of the machine reading.
    pub redis_now_unix_ms: u64,
    /// When the directory generation was created (unix ms, Redis's clock); `None` when
    /// there is none (nothing registered since Redis came up empty).
    pub generation_created_unix_ms: Option<u64>,
    /// Every worker id that holds a lease, is in `{p}workers`, or has a session set,
    /// each once, sorted by id.
    pub workers: Vec<WorkerSnapshot>,
    /// How many session records (`{p}pool_owner:{sid}`) name each owner id, including
    /// ids found nowhere else in the directory.
    pub session_records: BTreeMap<String, u64>,
}

/// What a worker's lease key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseView {
    /// A live lease and what the worker published with it.
    Live(WorkerInfo),
    /// A live lease whose value does not parse (written by another version?).
    Unreadable,
    /// No lease: expired, deregistered, or reclaimed.
    Absent,
}

/// One worker id in a [`FleetSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// The worker id.
    pub id: String,
    /// Its lease.
    pub lease: LeaseView,
    /// Its mesh address (`host:port`, or the request channel of the Redis transport).
    pub addr: Option<String>,
    /// Its last renewal (unix ms, Redis's clock): its score in `{p}workers`.
    pub last_renewal_unix_ms: Option<u64>,
    /// Members of its session set (`SCARD {p}worker_sessions:{id}`).
    pub sessions_owned: u64,
    /// Not-after of its mesh leaf (unix ms), from `{p}worker_cert:{id}`; `None` when
    /// unknown (no leaf, an older version, or the key expired with the lease).
    pub cert_not_after_unix_ms: Option<u64>,
    /// An operator asked it to drain and the request has not expired.
    pub drain_requested: bool,
    /// Subscribers of its request channel (`PUBSUB NUMSUB`), when its address is the
    /// channel of the Redis transport; `None` for QUIC and TCP workers.
    pub request_channel_subscribers: Option<u64>,
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
    /// Multiplexed connection that reconnects by itself after connection errors. It is
    /// replaced after repeated timeouts (see [`STALE_AFTER_TIMEOUTS`]).
    conn: RwLock<ConnectionManager>,
    /// Kept to build a replacement connection.
    client: redis::Client,
    /// Kept to build a replacement connection.
    manager_cfg: ConnectionManagerConfig,
    /// Timeouts in a row; reset by any answer from Redis.
    timeouts_in_a_row: AtomicU32,
    /// Settings, including the deadlines.
    cfg: DirectoryConfig,
    /// Redis URL without credentials, for errors and logs.
    url: String,
    /// Decoded password, scrubbed from Redis error texts just in case one echoes it.
    password: Option<String>,
    /// The Lua scripts, hashed once.
    scripts: Scripts,
    /// Told about every call (for metrics), once someone watches.
    observer: std::sync::OnceLock<Arc<dyn DirectoryObserver>>,
}

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
    remembered: Script,
    generation: Script,
    resume: Script,
    lease_state: Script,
    gone: Script,
    request_drain: Script,
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
    fn new() -> Self {
        Self {
            // KEYS: worker, addr, workers, generation, cert, drain. ARGV: value, addr, px,
            // fresh gen, id, leaf not-after ms or ''. Returns the generation, or false if
            // the id is held. A drain request left for an earlier holder of the id is
            // not this registration's.
            register: Script::new(&format!(
                r#"{GEN_LUA}
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[3]) then return false end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], now_ms(), ARGV[5])
if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[3]) end
redis.call('DEL', KEYS[6])
return generation(KEYS[4], ARGV[4])
"#
            )),
            // KEYS: worker, addr, generation, workers, cert, drain. ARGV: value, px, addr,
            // lease generation, id, leaf not-after ms or ''. 1 renewed, 3 renewed and
            // asked to drain, 0 lost, 2 directory lost.
            renew: Script::new(&format!(
                r#"{GEN_LUA}
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  redis.call('ZADD', KEYS[4], now_ms(), ARGV[5])
  if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[2]) end
  if redis.call('EXISTS', KEYS[6]) == 1 then return 3 end
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('GET', KEYS[3]) ~= ARGV[4] then
  return 2
end
return 0
"#
            )),
            // KEYS: worker, addr, workers, generation, cert. ARGV: value, addr, px, lease
            // generation, id, leaf not-after ms or ''. 1 resumed, 0 lost (reclaimed or
            // taken), 2 directory lost. A reclaimed worker is no longer in `workers`: it
            // can never resume.
            resume: Script::new(&format!(
                r#"{GEN_LUA}
if redis.call('GET', KEYS[4]) ~= ARGV[4] then return 2 end
if not redis.call('ZSCORE', KEYS[3], ARGV[5]) then return 0 end
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], now_ms(), ARGV[5])
if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[3]) end
return 1
"#
            )),
            // KEYS: worker, addr, workers, cert, drain, gone. ARGV: value, id, gone px.
            deregister: Script::new(&format!(
                r#"{GEN_LUA}
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('SET', KEYS[6], 'deregistered@' .. string.format('%d', now_ms()), 'PX', ARGV[3])
  return 1
end
return 0
"#
            )),
            // KEYS: worker, drain. Returns 1 if the worker holds a lease (the request is
            // recorded for two to three leases: long enough for several renewals to see
            // it, short enough not to outlive the worker by much), 0 if it holds none.
            request_drain: Script::new(
                r#"
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 then return 0 end
if ttl < 0 then ttl = 10000 end
redis.call('SET', KEYS[2], '1', 'PX', math.max(ttl * 3, 1000))
return 1
"#,
            ),
            // KEYS: pool_owner, worker_sessions, worker.
            // ARGV: owner, sid, quota limit ('0': none), quota key, quota ttl px,
            // key prefix, remember ('1': keep a session_seen marker while it lives).
            // 1 claimed (also when the record names this owner already: a claim
            // whose answer was lost is confirmed), 0 another owner's, -1 owner has no lease, -2 the
            // quota key holds its limit. Quota sets are cleaned lazily: a member whose
            // session record is gone (ended, reclaimed) no longer counts.
            claim: Script::new(
                r#"
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
local limit = tonumber(ARGV[3])
local quota_set = ARGV[6] .. 'principal_sessions:' .. redis.sha1hex(ARGV[4])
if limit > 0 and redis.call('SCARD', quota_set) >= limit then
  for _, sid in ipairs(redis.call('SMEMBERS', quota_set)) do
    if redis.call('EXISTS', ARGV[6] .. 'pool_owner:' .. sid) == 0 then
      redis.call('SREM', quota_set, sid)
    end
  end
  if redis.call('SCARD', quota_set) >= limit then return -2 end
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX') or redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SADD', KEYS[2], ARGV[2])
  if ARGV[7] == '1' then redis.call('SET', ARGV[6] .. 'session_seen:' .. ARGV[2], '1') end
  if limit > 0 then
    redis.call('SADD', quota_set, ARGV[2])
    redis.call('PEXPIRE', quota_set, ARGV[5])
  end
  return 1
end
return 0
"#,
            ),
            // KEYS: pool_owner, worker_sessions. ARGV: owner, sid, quota key or '', key
            // prefix, px a remembered session's end is kept.
            release: Script::new(
                r#"
redis.call('SREM', KEYS[2], ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SREM', ARGV[4] .. 'principal_sessions:' .. redis.sha1hex(ARGV[3]), ARGV[2])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  local seen = ARGV[4] .. 'session_seen:' .. ARGV[2]
  if redis.call('EXISTS', seen) == 1 then redis.call('PEXPIRE', seen, ARGV[5]) end
  return 1
end
return 0
"#,
            ),
            // KEYS: pool_owner, session_seen, generation, rebuilt. {'owner', id, 0, 0}
            // while recorded; {'ended', '', 0, 0} when it ended and this call is the
            // first to learn it (the marker is taken, so only one caller fleet-wide is
            // told); else {'absent', generation or '', generation age ms, rebuilt 0/1}.
            remembered: Script::new(&format!(
                r#"{GEN_LUA}
local owner = redis.call('GET', KEYS[1])
if owner then return {{'owner', owner, 0, 0}} end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[2])
  return {{'ended', '', 0, 0}}
end
local rebuilt = redis.call('EXISTS', KEYS[4])
local g = redis.call('GET', KEYS[3])
if not g then return {{'absent', '', 0, rebuilt}} end
return {{'absent', g, generation_age(g), rebuilt}}
"#
            )),
            // KEYS: worker, addr, worker_sessions, workers, gone, cert, drain.
            // ARGV: dead id, stale token or '', pool_owner key prefix, batch size,
            // reclaimed-record px, session_seen key prefix, px a remembered session's
            // end is kept.
            // false: nothing may be done (lease alive, or nothing known of this id: a
            // forged id costs no write). Else {won, remaining, freed sids...}: `won` is
            // 1 for the one call that proved the death first; later calls (the sweeper,
            // a reclaimer's next batches) free the rest, `remaining` at a time.
            reclaim: Script::new(&format!(
                r#"{GEN_LUA}
local lease = redis.call('GET', KEYS[1])
if lease then
  if ARGV[2] == '' then return false end
  local ok, decoded = pcall(cjson.decode, lease)
  if not ok or type(decoded) ~= 'table' or decoded.token ~= ARGV[2] then return false end
  redis.call('DEL', KEYS[1])
end
-- Asked first, so that an id the registry never held costs no write command.
local won = 0
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then won = redis.call('ZREM', KEYS[4], ARGV[1]) end
if won == 0 and redis.call('EXISTS', KEYS[3]) == 0 then return false end
redis.call('DEL', KEYS[2], KEYS[6], KEYS[7])
if won == 1 then
  redis.call('SET', KEYS[5], 'reclaimed@' .. string.format('%d', now_ms()), 'PX', ARGV[5])
end
local out = {{won, 0}}
for _, sid in ipairs(redis.call('SPOP', KEYS[3], tonumber(ARGV[4]))) do
  local k = ARGV[3] .. sid
  if redis.call('GET', k) == ARGV[1] then
    redis.call('DEL', k)
    local seen = ARGV[6] .. sid
    if redis.call('EXISTS', seen) == 1 then redis.call('PEXPIRE', seen, ARGV[7]) end
    out[#out + 1] = sid
  end
end
out[2] = redis.call('SCARD', KEYS[3])
return out
"#
            )),
            // KEYS: gone. Returns {how or '', ms ago or -1}.
            gone: Script::new(&format!(
                r#"{GEN_LUA}
{GONE_LUA}
return gone(KEYS[1])
"#
            )),
            // KEYS: worker, generation, gone. Returns {lease alive 0/1, generation or
            // '', generation age ms, gone how or '', gone ms ago or -1}.
            lease_state: Script::new(&format!(
                r#"{GEN_LUA}
{GONE_LUA}
local alive = redis.call('EXISTS', KEYS[1])
local went = gone(KEYS[3])
local g = redis.call('GET', KEYS[2])
if not g then return {{alive, '', 0, went[1], went[2]}} end
return {{alive, g, generation_age(g), went[1], went[2]}}
"#
            )),
            // KEYS: worker, worker_sessions. ARGV: owner, pool_owner key prefix, sids...
            // Returns the sids another worker owns now, or -1 if the owner has no lease.
            reclaim_after_loss: Script::new(
                r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local taken = {}
for i = 3, #ARGV do
  local sid = ARGV[i]
  local k = ARGV[2] .. sid
  local cur = redis.call('GET', k)
  if not cur then
    redis.call('SET', k, ARGV[1])
    cur = ARGV[1]
  end
  if cur == ARGV[1] then
    redis.call('SADD', KEYS[2], sid)
  else
    taken[#taken + 1] = sid
  end
end
return taken
"#,
            ),
            // KEYS: generation. ARGV: fresh token.
            generation: Script::new(&format!("{GEN_LUA}\nreturn generation(KEYS[1], ARGV[1])\n")),
        }
    }
}

impl Directory {
    /// Connects to Redis and checks it answers. Fails within
    /// [`DirectoryConfig::connect_timeout`] if Redis is unreachable.
    pub async fn connect(cfg: DirectoryConfig) -> Result<Self, DirectoryError> {
        let url = redact_url(&cfg.redis_url);
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
        let client =
            redis_conn::open_client(&cfg.redis_url, None).map_err(DirectoryError::InvalidConfig)?;
        let password = redis_conn::password(&client);
        let manager_cfg = ConnectionManagerConfig::new()
            // Each (re)connection attempt and each response is bounded inside redis-rs
            // too, so a reconnect never hangs on a frozen server; our own timeout below
            // is still what bounds every call.
            .set_connection_timeout(Some(cfg.op_timeout))
            .set_response_timeout(Some(cfg.op_timeout))
            .set_max_delay(Duration::from_secs(1));
        let conn = connect_first(&client, &manager_cfg, &cfg)
            .await
            .map_err(|reason| DirectoryError::Connect {
                url: url.clone(),
                reason,
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                conn: RwLock::new(conn),
                client,
                manager_cfg,
                timeouts_in_a_row: AtomicU32::new(0),
                cfg,
                url,
                password,
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

    /// Registers worker `id` with a fresh lease (`SET NX PX`) and its mesh address.
    /// Fails with [`DirectoryError::WorkerIdTaken`] while another process holds the id.
    pub async fn register_worker(
        &self,
        id: &str,
        info: &WorkerInfo,
        mesh_addr: &str,
    ) -> Result<Lease, DirectoryError> {
        self.register_worker_with_cert(id, info, mesh_addr, None)
            .await
    }

    /// [`register_worker`](Self::register_worker), publishing the not-after of the
    /// worker's mesh leaf too (`{p}worker_cert:{id}`, kept fresh by every renewal).
    pub async fn register_worker_with_cert(
        &self,
        id: &str,
        info: &WorkerInfo,
        mesh_addr: &str,
        cert_not_after: Option<SystemTime>,
    ) -> Result<Lease, DirectoryError> {
        check_name("worker id", id)?;
        let cert_ms = cert_arg(cert_not_after.map(unix_ms));
        let token = random_token()?;
        let value = serde_json::to_string(&LeaseValue {
            info: info.clone(),
            token: token.clone(),
        })
        .map_err(|e| DirectoryError::InvalidConfig(format!("worker info: {e}")))?;
        let fresh_generation = random_token()?;
        let sent = Instant::now();
        // The script call borrows these; `value` is kept for the lease.
        let (value_ref, fresh_ref) = (&value, &fresh_generation);
        let generation: Option<String> = self
            .run("register_worker", |mut c, s| async move {
                s.register
                    .key(self.key_worker(id))
                    .key(self.key_addr(id))
                    .key(self.key_workers())
                    .key(self.key_generation())
                    .key(self.key_cert(id))
                    .key(self.key_drain(id))
                    .arg(value_ref)
                    .arg(mesh_addr)
                    .arg(self.lease_px())
                    .arg(fresh_ref)
                    .arg(id)
                    .arg(&cert_ms)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        let Some(generation) = generation else {
            return Err(DirectoryError::WorkerIdTaken { id: id.to_owned() });
        };
        Ok(Lease {
            id: id.to_owned(),
            token,
            value,
            addr: mesh_addr.to_owned(),
            generation,
            valid_until: sent + self.inner.cfg.lease,
            cert_not_after_ms: cert_not_after.map(unix_ms),
        })
    }

    /// Extends the lease if Redis still holds our token; see [`LeaseRenewal`] for what
    /// the caller must do otherwise.
    pub async fn renew_lease(&self, lease: &Lease) -> Result<LeaseRenewal, DirectoryError> {
        let sent = Instant::now();
        let outcome: i64 = self
            .run("renew_lease", |mut c, s| async move {
                s.renew
                    .key(self.key_worker(&lease.id))
                    .key(self.key_addr(&lease.id))
                    .key(self.key_generation())
                    .key(self.key_workers())
                    .key(self.key_cert(&lease.id))
                    .key(self.key_drain(&lease.id))
                    .arg(&lease.value)
                    .arg(self.lease_px())
                    .arg(&lease.addr)
                    .arg(&lease.generation)
                    .arg(&lease.id)
                    .arg(cert_arg(lease.cert_not_after_ms))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match outcome {
            1 => LeaseRenewal::Renewed {
                valid_until: sent + self.inner.cfg.lease,
            },
            3 => LeaseRenewal::DrainRequested {
                valid_until: sent + self.inner.cfg.lease,
            },
            2 => LeaseRenewal::DirectoryLost,
            _ => LeaseRenewal::Lost,
        })
    }

    /// Takes the lease back after it expired in Redis while nobody declared this worker
    /// dead: still in the registry of lease holders (a reclaim removes it), no other
    /// holder, same directory generation. A lease
    /// expires in Redis when Redis stalls longer than the lease (paused, overloaded);
    /// the owner stopped acting at its own deadline meanwhile, so resuming is safe as
    /// long as no other worker acted on the expiry. `Lost` means one did: fence.
    pub async fn resume_lease(&self, lease: &Lease) -> Result<LeaseRenewal, DirectoryError> {
        let sent = Instant::now();
        let outcome: i64 = self
            .run("resume_lease", |mut c, s| async move {
                s.resume
                    .key(self.key_worker(&lease.id))
                    .key(self.key_addr(&lease.id))
                    .key(self.key_workers())
                    .key(self.key_generation())
                    .key(self.key_cert(&lease.id))
                    .arg(&lease.value)
                    .arg(&lease.addr)
                    .arg(self.lease_px())
                    .arg(&lease.generation)
                    .arg(&lease.id)
                    .arg(cert_arg(lease.cert_not_after_ms))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match outcome {
            1 => LeaseRenewal::Renewed {
                valid_until: sent + self.inner.cfg.lease,
            },
            2 => LeaseRenewal::DirectoryLost,
            _ => LeaseRenewal::Lost,
        })
    }

    /// One worker's current registration, if its lease is alive.
    pub async fn worker(&self, id: &str) -> Result<Option<WorkerEntry>, DirectoryError> {
        check_name("worker id", id)?;
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(self.key_worker(id));
        pipe.cmd("GET").arg(self.key_addr(id));
        let (lease, addr): (Option<String>, Option<String>) = self
            .run("worker", |mut c, _| {
                let pipe = pipe.clone();
                async move { pipe.query_async(&mut c).await }
            })
            .await?;
        let Some(lease) = lease else { return Ok(None) };
        Ok(serde_json::from_str::<LeaseValue>(&lease)
            .ok()
            .map(|v| WorkerEntry {
                id: id.to_owned(),
                info: v.info,
                lease_token: v.token,
                addr,
            }))
    }

    /// Deletes the lease and address if they are still ours. Returns whether they were.
    /// Sessions stay recorded; release or hand them off before deregistering.
    pub async fn deregister(&self, lease: &Lease) -> Result<bool, DirectoryError> {
        let n: i64 = self
            .run("deregister", |mut c, s| async move {
                s.deregister
                    .key(self.key_worker(&lease.id))
                    .key(self.key_addr(&lease.id))
                    .key(self.key_workers())
                    .key(self.key_cert(&lease.id))
                    .key(self.key_drain(&lease.id))
                    .key(self.key_gone(&lease.id))
                    .arg(&lease.value)
                    .arg(&lease.id)
                    .arg(duration_px(self.inner.cfg.lease * 4))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(n == 1)
    }

    /// The mesh address of a live worker and the identity it registered (one round
    /// trip), or `None` if it has no registration.
    pub async fn worker_endpoint(
        &self,
        id: &str,
    ) -> Result<Option<WorkerEndpoint>, DirectoryError> {
        if check_name("worker id", id).is_err() {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(self.key_addr(id));
        pipe.cmd("GET").arg(self.key_worker(id));
        let (addr, lease): (Option<String>, Option<String>) = self
            .run("worker_endpoint", |mut c, _| {
                let pipe = pipe.clone();
                async move { pipe.query_async(&mut c).await }
            })
            .await?;
        let Some(addr) = addr else { return Ok(None) };
        let identity = lease
            .and_then(|lease| serde_json::from_str::<LeaseValue>(&lease).ok())
            .and_then(|lease| lease.info.mesh_identity);
        Ok(Some(WorkerEndpoint { addr, identity }))
    }

    /// The mesh address of a live worker, or `None` if it has no registration.
    pub async fn worker_addr(&self, id: &str) -> Result<Option<String>, DirectoryError> {
        if check_name("worker id", id).is_err() {
            return Ok(None);
        }
        self.run("worker_addr", |mut c, _| async move {
            redis::cmd("GET")
                .arg(self.key_addr(id))
                .query_async(&mut c)
                .await
        })
        .await
    }

    /// Every registered worker, each id once, sorted by id. Uses SCAN, never KEYS, so a
    /// large directory does not block Redis; each round trip is bounded by `op_timeout`.
    /// Lease values that do not parse are skipped with a warning.
    pub async fn workers(&self) -> Result<Vec<WorkerEntry>, DirectoryError> {
        let worker_prefix = self.key_worker("");
        // SCAN may return a key more than once; the set keeps each id once.
        let ids = self.scan_suffixes("workers (SCAN)", &worker_prefix).await?;
        let mut out = Vec::with_capacity(ids.len());
        let ids: Vec<String> = ids.into_iter().collect();
        for chunk in ids.chunks(RECLAIM_BATCH) {
            let mut pipe = redis::pipe();
            for id in chunk {
                pipe.cmd("GET").arg(self.key_worker(id));
                pipe.cmd("GET").arg(self.key_addr(id));
            }
            let values: Vec<Option<String>> = self
                .run("workers (GET)", |mut c, _| {
                    let pipe = pipe.clone();
                    async move { pipe.query_async(&mut c).await }
                })
                .await?;
            let mut values = values.into_iter();
            for id in chunk {
                let (lease, addr) = (values.next().flatten(), values.next().flatten());
                // Expired between SCAN and GET: no longer a live worker.
                let Some(lease) = lease else { continue };
                match serde_json::from_str::<LeaseValue>(&lease) {
                    Ok(v) => out.push(WorkerEntry {
                        id: id.clone(),
                        info: v.info,
                        lease_token: v.token,
                        addr,
                    }),
                    Err(e) => tracing::warn!(
                        worker = %id,
                        error = %e,
                        "skipping a worker lease that does not parse (written by another version?)"
                    ),
                }
            }
        }
        Ok(out)
    }

    /// The fleet as the directory holds it now (see [`FleetSnapshot`]). Uses SCAN,
    /// never KEYS, and pipelines reads in batches, so a large directory neither blocks
    /// Redis nor costs a round trip per key; each round trip is bounded by
    /// `op_timeout`.
    pub async fn fleet_snapshot(&self) -> Result<FleetSnapshot, DirectoryError> {
        // Records first, leases after: a record is only written while its owner holds a
        // lease, so a worker that registers during the reads is never seen as a
        // record's lease-less owner.
        let record_prefix = self.key_pool_owner("");
        let sids: Vec<String> = self
            .scan_suffixes("fleet_snapshot (SCAN records)", &record_prefix)
            .await?
            .into_iter()
            .collect();
        let mut session_records = BTreeMap::new();
        for chunk in sids.chunks(RECLAIM_BATCH) {
            let mut pipe = redis::pipe();
            for sid in chunk {
                pipe.cmd("GET").arg(self.key_pool_owner(sid));
            }
            let owners: Vec<Option<String>> = self
                .run("fleet_snapshot (GET records)", |mut c, _| {
                    let pipe = pipe.clone();
                    async move { pipe.query_async(&mut c).await }
                })
                .await?;
            for owner in owners.into_iter().flatten() {
                *session_records.entry(owner).or_insert(0) += 1;
            }
        }
        let mut ids = self
            .scan_suffixes("fleet_snapshot (SCAN sessions)", &self.key_sessions(""))
            .await?;
        ids.extend(
            self.scan_suffixes("fleet_snapshot (SCAN leases)", &self.key_worker(""))
                .await?,
        );
        let renewals = self.renewal_scores().await?;
        ids.extend(renewals.keys().cloned());

        let channels = crate::transport::RedisTransportConfig {
            prefix: self.inner.cfg.prefix.clone(),
            ..Default::default()
        };
        let ids: Vec<String> = ids.into_iter().collect();
        let mut workers = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(RECLAIM_BATCH) {
            let mut pipe = redis::pipe();
            for id in chunk {
                pipe.cmd("GET").arg(self.key_worker(id));
                pipe.cmd("GET").arg(self.key_addr(id));
                pipe.cmd("SCARD").arg(self.key_sessions(id));
                pipe.cmd("GET").arg(self.key_cert(id));
                pipe.cmd("EXISTS").arg(self.key_drain(id));
            }
            let values: Vec<redis::Value> = self
                .run("fleet_snapshot (GET workers)", |mut c, _| {
                    let pipe = pipe.clone();
                    async move { pipe.query_async(&mut c).await }
                })
                .await?;
            let mut values = values.into_iter();
            for id in chunk {
                let mut next = || values.next().unwrap_or(redis::Value::Nil);
                let lease: Option<String> = self.decode("fleet_snapshot", next())?;
                let addr: Option<String> = self.decode("fleet_snapshot", next())?;
                let sessions_owned: u64 = self.decode("fleet_snapshot", next())?;
                let cert: Option<String> = self.decode("fleet_snapshot", next())?;
                let drain: i64 = self.decode("fleet_snapshot", next())?;
                let lease = match lease {
                    None => LeaseView::Absent,
                    Some(value) => match serde_json::from_str::<LeaseValue>(&value) {
                        Ok(v) => LeaseView::Live(v.info),
                        Err(_) => LeaseView::Unreadable,
                    },
                };
                workers.push(WorkerSnapshot {
                    id: id.clone(),
                    lease,
                    addr,
                    last_renewal_unix_ms: renewals.get(id).copied(),
                    sessions_owned,
                    cert_not_after_unix_ms: cert.and_then(|ms| ms.parse().ok()),
                    drain_requested: drain == 1,
                    request_channel_subscribers: None,
                });
            }
        }
        // The Redis transport records its request channel as the address: how many
        // listen on it is invariant 2's business.
        let on_channels: Vec<usize> = workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.addr.as_deref() == Some(channels.request_channel(&w.id).as_str()))
            .map(|(i, _)| i)
            .collect();
        for chunk in on_channels.chunks(RECLAIM_BATCH) {
            let mut cmd = redis::cmd("PUBSUB");
            cmd.arg("NUMSUB");
            for &i in chunk {
                cmd.arg(channels.request_channel(&workers[i].id));
            }
            let counts: Vec<redis::Value> = self
                .run("fleet_snapshot (PUBSUB NUMSUB)", |mut c, _| {
                    let cmd = cmd.clone();
                    async move { cmd.query_async(&mut c).await }
                })
                .await?;
            // Channel, count, channel, count...: in the order asked.
            for (&i, count) in chunk.iter().zip(counts.into_iter().skip(1).step_by(2)) {
                workers[i].request_channel_subscribers =
                    Some(self.decode("fleet_snapshot (PUBSUB NUMSUB)", count)?);
            }
        }
        let mut pipe = redis::pipe();
        pipe.cmd("TIME");
        pipe.cmd("GET").arg(self.key_generation());
        let ((now_s, now_us), generation): ((u64, u64), Option<String>) = self
            .run("fleet_snapshot (TIME)", |mut c, _| {
                let pipe = pipe.clone();
                async move { pipe.query_async(&mut c).await }
            })
            .await?;
        Ok(FleetSnapshot {
            redis_now_unix_ms: now_s * 1000 + now_us / 1000,
            generation_created_unix_ms: generation
                .as_deref()
                .and_then(|g| g.rsplit_once('@'))
                .and_then(|(_, ms)| ms.parse().ok()),
            workers,
            session_records,
        })
    }

    /// Asks worker `id` to drain, as SIGTERM would: its next lease renewal (within a
    /// third of the lease) reports [`LeaseRenewal::DrainRequested`]. `false` when the
    /// id holds no lease (nothing was recorded).
    pub async fn request_drain(&self, id: &str) -> Result<bool, DirectoryError> {
        check_name("worker id", id)?;
        let recorded: i64 = self
            .run("request_drain", |mut c, s| async move {
                s.request_drain
                    .key(self.key_worker(id))
                    .key(self.key_drain(id))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(recorded == 1)
    }

    /// Every key suffix after `prefix` (SCAN in batches; each suffix once).
    async fn scan_suffixes(
        &self,
        op: &'static str,
        prefix: &str,
    ) -> Result<BTreeSet<String>, DirectoryError> {
        let pattern = format!("{}*", glob_escape(prefix));
        let mut found = BTreeSet::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = self
                .run(op, |mut c, _| {
                    let pattern = pattern.clone();
                    async move {
                        redis::cmd("SCAN")
                            .arg(cursor)
                            .arg("MATCH")
                            .arg(pattern)
                            .arg("COUNT")
                            .arg(1000)
                            .query_async(&mut c)
                            .await
                    }
                })
                .await?;
            found.extend(
                keys.iter()
                    .filter_map(|k| k.strip_prefix(prefix))
                    .map(str::to_owned),
            );
            cursor = next;
            if cursor == 0 {
                return Ok(found);
            }
        }
    }

    /// `{p}workers`: id → last renewal (unix ms), read with ZSCAN.
    async fn renewal_scores(&self) -> Result<BTreeMap<String, u64>, DirectoryError> {
        let mut scores = BTreeMap::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, pairs): (u64, Vec<String>) = self
                .run("fleet_snapshot (ZSCAN)", |mut c, _| async move {
                    redis::cmd("ZSCAN")
                        .arg(self.key_workers())
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut c)
                        .await
                })
                .await?;
            for pair in pairs.chunks(2) {
                if let [id, score] = pair
                    && let Ok(score) = score.parse::<f64>()
                {
                    // Scores are whole milliseconds, well inside f64's exact range.
                    scores.insert(id.clone(), score.max(0.0) as u64);
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(scores);
            }
        }
    }

    /// Decodes one reply of a pipeline, naming the operation if Redis answered with
    /// something else than expected.
    fn decode<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        value: redis::Value,
    ) -> Result<T, DirectoryError> {
        redis::from_redis_value(value).map_err(|e| DirectoryError::Rejected {
            url: self.inner.url.clone(),
            op,
            detail: e.to_string(),
        })
    }

    /// Records `owner_id` as the owner of new session `sid` (`SET NX`) and adds it to the
    /// owner's session set, within `quota` if one is given. [`DirectoryError::NotRegistered`]
    /// if `owner_id` holds no lease.
    pub async fn claim_session(
        &self,
        sid: &str,
        owner_id: &str,
        quota: Option<SessionQuota<'_>>,
    ) -> Result<Claim, DirectoryError> {
        self.claim(sid, owner_id, quota, false).await
    }

    /// Claims `sid` as [`claim_session`](Self::claim_session) does, and remembers that
    /// it existed: once its record goes (released, or reclaimed with a dead owner), the
    /// first [`remembered_session`](Self::remembered_session) lookup learns that it
    /// ended, for [`REMEMBER_ENDED`]. For sessions whose id a client does not hold and
    /// so cannot be told "gone" by its absence alone (the shared sessions of 2026-07-28
    /// clients).
    pub async fn claim_remembered_session(
        &self,
        sid: &str,
        owner_id: &str,
    ) -> Result<Claim, DirectoryError> {
        self.claim(sid, owner_id, None, true).await
    }

    async fn claim(
        &self,
        sid: &str,
        owner_id: &str,
        quota: Option<SessionQuota<'_>>,
        remember: bool,
    ) -> Result<Claim, DirectoryError> {
        check_name("session id", sid)?;
        check_name("worker id", owner_id)?;
        let (limit, key, ttl) = match &quota {
            Some(q) => (q.limit, q.key, duration_px(q.ttl)),
            None => (0, "", 0),
        };
        let n: i64 = self
            .run("claim_session", |mut c, s| async move {
                s.claim
                    .key(self.key_pool_owner(sid))
                    .key(self.key_sessions(owner_id))
                    .key(self.key_worker(owner_id))
                    .arg(owner_id)
                    .arg(sid)
                    .arg(limit)
                    .arg(key)
                    .arg(ttl)
                    .arg(&self.inner.cfg.prefix)
                    .arg(if remember { "1" } else { "0" })
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match n {
            1 => Ok(Claim::Claimed),
            -1 => Err(DirectoryError::NotRegistered {
                id: owner_id.to_owned(),
            }),
            -2 => Ok(Claim::OverQuota),
            _ => Ok(Claim::Taken),
        }
    }

    /// What the directory knows of a session claimed with
    /// [`claim_remembered_session`](Self::claim_remembered_session): its owner, that it
    /// ended (told to this caller alone: the marker is taken), or nothing.
    pub async fn remembered_session(&self, sid: &str) -> Result<Remembered, DirectoryError> {
        check_name("session id", sid)?;
        let (kind, value, age, rebuilt): (String, String, i64, i64) = self
            .run("remembered_session", |mut c, s| async move {
                s.remembered
                    .key(self.key_pool_owner(sid))
                    .key(self.key_seen(sid))
                    .key(self.key_generation())
                    .key(self.key_rebuilt())
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match kind.as_str() {
            "owner" => Remembered::Owner(value),
            "ended" => Remembered::Ended,
            _ => Remembered::Absent {
                generation: value,
                generation_age: Duration::from_millis(u64::try_from(age).unwrap_or(0)),
                rebuilt: rebuilt == 1,
            },
        })
    }

    /// Records that the directory is being rebuilt (Redis lost its data and a worker
    /// registers again), for two leases: while it is younger than a lease, a missing
    /// record may be one an owner has not re-asserted yet. Set before the worker
    /// registers, so the new generation never exists without it.
    pub async fn mark_rebuilt(&self) -> Result<(), DirectoryError> {
        self.run("mark_rebuilt", |mut c, _| async move {
            redis::cmd("SET")
                .arg(self.key_rebuilt())
                .arg("1")
                .arg("PX")
                .arg(duration_px(self.inner.cfg.lease * 2))
                .query_async::<()>(&mut c)
                .await
        })
        .await
    }

    /// Marks `sids` as remembered again (after the directory was rebuilt and their
    /// owner claimed them back), so their end is learnt as for a fresh claim.
    pub async fn remember_sessions(&self, sids: &[String]) -> Result<(), DirectoryError> {
        let sids: Vec<&String> = sids
            .iter()
            .filter(|sid| check_name("session id", sid).is_ok())
            .collect();
        if sids.is_empty() {
            return Ok(());
        }
        self.run("remember_sessions", |mut c, _| {
            let sids = sids.clone();
            async move {
                let mut pipe = redis::pipe();
                for sid in sids {
                    pipe.cmd("SET").arg(self.key_seen(sid)).arg("1").ignore();
                }
                pipe.query_async::<()>(&mut c).await
            }
        })
        .await
    }

    /// The worker recorded as owner of `sid`, or `None` if the directory holds no owner.
    /// `None` means "absent" only while the directory generation is unchanged.
    pub async fn session_owner(&self, sid: &str) -> Result<Option<String>, DirectoryError> {
        // An id that could never have been claimed has no owner; no round trip needed.
        if check_name("session id", sid).is_err() {
            return Ok(None);
        }
        self.run("session_owner", |mut c, _| async move {
            redis::cmd("GET")
                .arg(self.key_pool_owner(sid))
                .query_async(&mut c)
                .await
        })
        .await
    }

    /// Ends `owner_id`'s ownership of `sid`: deletes the owner key only if it still names
    /// `owner_id`, and takes the session off its quota key's count. Returns whether it
    /// did delete the owner key.
    pub async fn release_session(
        &self,
        sid: &str,
        owner_id: &str,
        quota_key: Option<&str>,
    ) -> Result<bool, DirectoryError> {
        check_name("session id", sid)?;
        check_name("worker id", owner_id)?;
        let n: i64 = self
            .run("release_session", |mut c, s| async move {
                s.release
                    .key(self.key_pool_owner(sid))
                    .key(self.key_sessions(owner_id))
                    .arg(owner_id)
                    .arg(sid)
                    .arg(quota_key.unwrap_or(""))
                    .arg(&self.inner.cfg.prefix)
                    .arg(duration_px(REMEMBER_ENDED))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(n == 1)
    }

    /// The sids recorded for a worker.
    pub async fn worker_sessions(&self, id: &str) -> Result<Vec<String>, DirectoryError> {
        check_name("worker id", id)?;
        let mut sids: Vec<String> = self
            .run("worker_sessions", |mut c, _| async move {
                redis::cmd("SMEMBERS")
                    .arg(self.key_sessions(id))
                    .query_async(&mut c)
                    .await
            })
            .await?;
        sids.sort();
        Ok(sids)
    }

    /// Frees the sessions of a dead worker: deletes the owner keys that still name it and
    /// its session set, and returns the freed sids. Runs in batches of
    /// [`RECLAIM_BATCH`] sessions, one script call each, so Redis never blocks for long.
    ///
    /// Acts only on proof of death: the worker's lease key is absent (expired), or still
    /// holds `stale_token` (the caller proved by other means, e.g. its mesh address
    /// answers as another worker, that this registration is dead; the lease is then
    /// deleted too, so the old holder finds it lost at its next renewal). Exactly one of
    /// many racing reclaimers gets `Some`; the rest, and any call while the lease is
    /// alive, get `None` (a later caller still finishes what an interrupted one left).
    /// An id that never held a lease costs no write.
    pub async fn reclaim_worker(
        &self,
        dead_id: &str,
        stale_token: Option<&str>,
    ) -> Result<Option<Vec<String>>, DirectoryError> {
        check_name("worker id", dead_id)?;
        let pool_owner_prefix = self.key_pool_owner("");
        let mut won = None;
        let mut freed = Vec::new();
        loop {
            let batch: Option<Vec<redis::Value>> = self
                .run("reclaim_worker", |mut c, s| {
                    let pool_owner_prefix = pool_owner_prefix.clone();
                    async move {
                        s.reclaim
                            .key(self.key_worker(dead_id))
                            .key(self.key_addr(dead_id))
                            .key(self.key_sessions(dead_id))
                            .key(self.key_workers())
                            .key(self.key_gone(dead_id))
                            .key(self.key_cert(dead_id))
                            .key(self.key_drain(dead_id))
                            .arg(dead_id)
                            .arg(stale_token.unwrap_or(""))
                            .arg(pool_owner_prefix)
                            .arg(RECLAIM_BATCH)
                            .arg(duration_px(self.inner.cfg.lease * 4))
                            .arg(self.key_seen(""))
                            .arg(duration_px(REMEMBER_ENDED))
                            .invoke_async(&mut c)
                            .await
                    }
                })
                .await?;
            let Some(batch) = batch else { break };
            let mut values = batch.into_iter();
            let mut int = |what| match values.next() {
                Some(redis::Value::Int(n)) => Ok(n),
                other => Err(DirectoryError::Rejected {
                    url: self.inner.url.clone(),
                    op: "reclaim_worker",
                    detail: format!("unexpected {what} in the script's answer: {other:?}"),
                }),
            };
            let first = int("won flag")?;
            let remaining = int("remaining count")?;
            won.get_or_insert(first == 1);
            for value in values {
                if let Ok(sid) = redis::from_redis_value::<String>(value) {
                    freed.push(sid);
                }
            }
            if remaining == 0 {
                break;
            }
        }
        Ok(match won {
            Some(true) => {
                freed.sort();
                Some(freed)
            }
            _ => None,
        })
    }

    /// Whether `id`'s lease is alive, and the directory generation with its age: a
    /// missing lease proves death only in a directory that has been stable for longer
    /// than one lease (after Redis came back empty, a live worker needs that long to
    /// register again).
    pub async fn lease_state(&self, id: &str) -> Result<LeaseState, DirectoryError> {
        check_name("worker id", id)?;
        let (alive, generation, age_ms, how, ago): (i64, String, i64, String, i64) = self
            .run("lease_state", |mut c, s| async move {
                s.lease_state
                    .key(self.key_worker(id))
                    .key(self.key_generation())
                    .key(self.key_gone(id))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(LeaseState {
            alive: alive == 1,
            generation,
            generation_age: Duration::from_millis(u64::try_from(age_ms).unwrap_or(0)),
            gone: Gone::parse(&how, ago),
        })
    }

    /// How worker `id` went and how long ago (by Redis's clock), if it was reclaimed or
    /// deregistered within the last four leases.
    pub async fn gone_record(&self, id: &str) -> Result<Option<Gone>, DirectoryError> {
        check_name("worker id", id)?;
        let (how, ago): (String, i64) = self
            .run("gone_record", |mut c, s| async move {
                s.gone.key(self.key_gone(id)).invoke_async(&mut c).await
            })
            .await?;
        Ok(Gone::parse(&how, ago))
    }

    /// Takes the fleet-wide sweeper turn for `period` if nobody holds it: one worker
    /// sweeps at a time.
    pub async fn take_sweeper_turn(
        &self,
        worker_id: &str,
        period: Duration,
    ) -> Result<bool, DirectoryError> {
        let taken: Option<String> = self
            .run("take_sweeper_turn", |mut c, _| async move {
                redis::cmd("SET")
                    .arg(self.key_sweeper())
                    .arg(worker_id)
                    .arg("NX")
                    .arg("PX")
                    .arg(duration_px(period))
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(taken.is_some())
    }

    /// Ids that may belong to dead workers: those with a session set (found with SCAN,
    /// in batches) and those registered as lease holders whose last renewal is older
    /// than `stale_after`. Whether each is dead is [`reclaim_worker`](Self::reclaim_worker)'s
    /// to decide, atomically.
    pub async fn reclaim_candidates(
        &self,
        stale_after: Duration,
    ) -> Result<Vec<String>, DirectoryError> {
        let sessions_prefix = self.key_sessions("");
        let mut ids = self
            .scan_suffixes("reclaim_candidates (SCAN)", &sessions_prefix)
            .await?;
        let (now_s, now_us): (u64, u64) = self
            .run("reclaim_candidates (TIME)", |mut c, _| async move {
                redis::cmd("TIME").query_async(&mut c).await
            })
            .await?;
        let now_ms = now_s * 1000 + now_us / 1000;
        let stale_before = now_ms.saturating_sub(duration_px(stale_after));
        let stale: Vec<String> = self
            .run("reclaim_candidates (ZRANGE)", |mut c, _| async move {
                redis::cmd("ZRANGEBYSCORE")
                    .arg(self.key_workers())
                    .arg("-inf")
                    .arg(format!("({stale_before}"))
                    .arg("LIMIT")
                    .arg(0)
                    .arg(RECLAIM_BATCH)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        ids.extend(stale);
        Ok(ids.into_iter().collect())
    }

    /// The directory generation token, created if absent. A worker remembers it; if a
    /// later read differs, Redis lost its data and owners must re-register and re-claim.
    pub async fn generation(&self) -> Result<String, DirectoryError> {
        let fresh = random_token()?;
        self.run("generation", |mut c, s| async move {
            s.generation
                .key(self.key_generation())
                .arg(&fresh)
                .invoke_async(&mut c)
                .await
        })
        .await
    }

    /// After the directory was lost and `owner_id` registered again, records it as owner
    /// of `sids` again. Returns the sids that another worker owns by now; the caller must
    /// drop those. Large lists go in batches, each bounded by `op_timeout`.
    pub async fn reclaim_sessions_after_loss(
        &self,
        owner_id: &str,
        sids: &[String],
    ) -> Result<Vec<String>, DirectoryError> {
        check_name("worker id", owner_id)?;
        let mut taken = Vec::new();
        let pool_owner_prefix = self.key_pool_owner("");
        for chunk in sids.chunks(RECLAIM_BATCH) {
            // Ids that could not have been claimed are skipped rather than failing the
            // whole rebuild; they are not in the directory and never will be.
            let chunk: Vec<&String> = chunk
                .iter()
                .filter(|sid| check_name("session id", sid).is_ok())
                .collect();
            if chunk.is_empty() {
                continue;
            }
            let result: redis::Value = self
                .run("reclaim_sessions_after_loss", |mut c, s| {
                    let pool_owner_prefix = pool_owner_prefix.clone();
                    let chunk = chunk.clone();
                    async move {
                        let mut inv = s.reclaim_after_loss.prepare_invoke();
                        inv.key(self.key_worker(owner_id))
                            .key(self.key_sessions(owner_id))
                            .arg(owner_id)
                            .arg(pool_owner_prefix);
                        for sid in chunk {
                            inv.arg(sid.as_str());
                        }
                        inv.invoke_async(&mut c).await
                    }
                })
                .await?;
            if let redis::Value::Int(-1) = result {
                return Err(DirectoryError::NotRegistered {
                    id: owner_id.to_owned(),
                });
            }
            let batch: Vec<String> =
                redis::from_redis_value(result).map_err(|e| DirectoryError::Rejected {
                    url: self.inner.url.clone(),
                    op: "reclaim_sessions_after_loss",
                    detail: e.to_string(),
                })?;
            taken.extend(batch);
        }
        Ok(taken)
    }

    /// Runs one Redis exchange under the deadline and classifies its failure.
    async fn run<'s, T, F, Fut>(&'s self, op: &'static str, f: F) -> Result<T, DirectoryError>
    where
        F: FnOnce(ConnectionManager, &'s Scripts) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let timeout = self.inner.cfg.op_timeout;
        let started = tokio::time::Instant::now();
        let fut = f(self.connection(), &self.inner.scripts);
        let result = tokio::time::timeout(timeout, fut).await;
        if let Some(observer) = self.inner.observer.get() {
            observer.observe(op, started.elapsed(), matches!(result, Ok(Ok(_))));
        }
        let timed_out = match &result {
            Err(_) => true,
            Ok(Err(e)) => e.is_timeout(),
            Ok(Ok(_)) => false,
        };
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
        match ConnectionManager::new_lazy_with_config(
            self.inner.client.clone(),
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
                error = %scrub(&e.to_string(), self.inner.password.as_deref()),
                "could not set up a new Redis connection after repeated timeouts"
            ),
        }
    }

    /// Transient failures (connection, timeouts, LOADING, BUSY...) are "unknown"; the
    /// rest are definite rejections.
    fn classify(&self, op: &'static str, e: &RedisError) -> DirectoryError {
        use redis::RetryMethod as R;
        let detail = scrub(&e.to_string(), self.inner.password.as_deref());
        let transient = e.is_io_error()
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

    fn key_seen(&self, sid: &str) -> String {
        format!("{}session_seen:{sid}", self.inner.cfg.prefix)
    }

    fn key_generation(&self) -> String {
        format!("{}generation", self.inner.cfg.prefix)
    }

    fn key_cert(&self, id: &str) -> String {
        format!("{}worker_cert:{id}", self.inner.cfg.prefix)
    }

    fn key_drain(&self, id: &str) -> String {
        format!("{}drain:{id}", self.inner.cfg.prefix)
    }
}

/// The first connection: direct attempts until `connect_timeout`, so a Redis that is
/// still starting is waited for, and a failure reports its real cause (refused, wrong
/// password) rather than the manager's generic retry exhaustion. Only then is the
/// self-reconnecting manager built. The error is already scrubbed of the password.
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
