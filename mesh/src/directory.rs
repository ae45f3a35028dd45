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
//! | `{p}worker_reclaimed:{id}` | tombstone: the dead worker was reclaimed | 24 h, or until the id registers again |
//! | `{p}generation` | random token, created when absent | no TTL |
//!
//! Every multi-key change is one Lua script, so it is atomic against other workers.
//! The scripts touch keys they compute from the prefix (pool_owner keys of a reclaimed
//! worker), so the directory needs a single Redis, not Redis Cluster.
//!
//! Every call is bounded by [`DirectoryConfig::op_timeout`]. A timeout or a connection
//! failure is [`DirectoryError::Unavailable`]: the state is *unknown*, never "absent".
//! A write that timed out may still have been applied by Redis; callers treat its
//! outcome as unknown and ask again.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

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

/// Tombstone lifetime: long enough that late reclaimers of a dead worker find it, short
/// enough that the keys of long-gone ids do not pile up.
const TOMBSTONE: Duration = Duration::from_secs(24 * 3600);

/// Most sids re-claimed per script call, so one call never blocks Redis for long.
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
    generation: Script,
    resume: Script,
}

/// Get-or-create of the generation token, shared by the scripts that need it.
const GEN_LUA: &str = r#"
local function generation(key, fresh)
  local g = redis.call('GET', key)
  if g then return g end
  redis.call('SET', key, fresh)
  return fresh
end
"#;

impl Scripts {
    fn new() -> Self {
        Self {
            // KEYS: worker, addr, tombstone, generation. ARGV: value, addr, px, fresh gen.
            // Returns the generation, or false if the id is held.
            register: Script::new(&format!(
                r#"{GEN_LUA}
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[3]) then return false end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[3])
return generation(KEYS[4], ARGV[4])
"#
            )),
            // KEYS: worker, addr, generation. ARGV: value, px, addr, lease generation.
            // 1 renewed, 0 lost, 2 directory lost.
            renew: Script::new(
                r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('GET', KEYS[3]) ~= ARGV[4] then
  return 2
end
return 0
"#,
            ),
            // KEYS: worker, addr, tombstone, generation. ARGV: value, addr, px, lease
            // generation. 1 resumed, 0 lost (reclaimed or taken), 2 directory lost.
            resume: Script::new(
                r#"
if redis.call('GET', KEYS[4]) ~= ARGV[4] then return 2 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"#,
            ),
            // KEYS: worker, addr. ARGV: value.
            deregister: Script::new(
                r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"#,
            ),
            // KEYS: pool_owner, worker_sessions, worker. ARGV: owner, sid.
            // 1 claimed, 0 owned already, -1 owner has no lease.
            claim: Script::new(
                r#"
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('SADD', KEYS[2], ARGV[2])
  return 1
end
return 0
"#,
            ),
            // KEYS: pool_owner, worker_sessions. ARGV: owner, sid.
            release: Script::new(
                r#"
redis.call('SREM', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#,
            ),
            // KEYS: worker, addr, worker_sessions, tombstone.
            // ARGV: dead id, stale token or '', pool_owner key prefix, tombstone px.
            // Returns the freed sids, or false (lease alive / already reclaimed).
            reclaim: Script::new(
                r#"
local lease = redis.call('GET', KEYS[1])
if lease then
  if ARGV[2] == '' then return false end
  local ok, decoded = pcall(cjson.decode, lease)
  if not ok or type(decoded) ~= 'table' or decoded.token ~= ARGV[2] then return false end
  redis.call('DEL', KEYS[1])
end
if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[4]) then return false end
redis.call('DEL', KEYS[2])
local freed = {}
for _, sid in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local k = ARGV[3] .. sid
  if redis.call('GET', k) == ARGV[1] then
    redis.call('DEL', k)
    freed[#freed + 1] = sid
  end
end
redis.call('DEL', KEYS[3])
return freed
"#,
            ),
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
            }),
        })
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
        check_name("worker id", id)?;
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
                    .key(self.key_tombstone(id))
                    .key(self.key_generation())
                    .arg(value_ref)
                    .arg(mesh_addr)
                    .arg(self.lease_px())
                    .arg(fresh_ref)
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
                    .arg(&lease.value)
                    .arg(self.lease_px())
                    .arg(&lease.addr)
                    .arg(&lease.generation)
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

    /// Takes the lease back after it expired in Redis while nobody declared this worker
    /// dead: no reclaim tombstone, no other holder, same directory generation. A lease
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
                    .key(self.key_tombstone(&lease.id))
                    .key(self.key_generation())
                    .arg(&lease.value)
                    .arg(&lease.addr)
                    .arg(self.lease_px())
                    .arg(&lease.generation)
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
                    .arg(&lease.value)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(n == 1)
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
        let pattern = format!("{}*", glob_escape(&worker_prefix));
        let mut ids = std::collections::BTreeSet::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = self
                .run("workers (SCAN)", |mut c, _| {
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
            // SCAN may return a key more than once; the set keeps each id once.
            ids.extend(
                keys.iter()
                    .filter_map(|k| k.strip_prefix(&worker_prefix))
                    .map(str::to_owned),
            );
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
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

    /// Records `owner_id` as the owner of new session `sid` (`SET NX`) and adds it to the
    /// owner's session set. `Ok(false)` if the session already has an owner;
    /// [`DirectoryError::NotRegistered`] if `owner_id` holds no lease.
    pub async fn claim_session(&self, sid: &str, owner_id: &str) -> Result<bool, DirectoryError> {
        check_name("session id", sid)?;
        check_name("worker id", owner_id)?;
        let n: i64 = self
            .run("claim_session", |mut c, s| async move {
                s.claim
                    .key(self.key_pool_owner(sid))
                    .key(self.key_sessions(owner_id))
                    .key(self.key_worker(owner_id))
                    .arg(owner_id)
                    .arg(sid)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match n {
            1 => Ok(true),
            -1 => Err(DirectoryError::NotRegistered {
                id: owner_id.to_owned(),
            }),
            _ => Ok(false),
        }
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
    /// `owner_id`. Returns whether it did.
    pub async fn release_session(&self, sid: &str, owner_id: &str) -> Result<bool, DirectoryError> {
        check_name("session id", sid)?;
        check_name("worker id", owner_id)?;
        let n: i64 = self
            .run("release_session", |mut c, s| async move {
                s.release
                    .key(self.key_pool_owner(sid))
                    .key(self.key_sessions(owner_id))
                    .arg(owner_id)
                    .arg(sid)
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
    /// its session set, and returns the freed sids.
    ///
    /// Acts only on proof of death: the worker's lease key is absent (expired), or still
    /// holds `stale_token` (the caller proved by other means, e.g. its mesh address
    /// answers as another worker, that this registration is dead; the lease is then
    /// deleted too, so the old holder finds it lost at its next renewal). Exactly one of
    /// many racing reclaimers gets `Some`; the rest, and any call while the lease is
    /// alive, get `None`.
    pub async fn reclaim_worker(
        &self,
        dead_id: &str,
        stale_token: Option<&str>,
    ) -> Result<Option<Vec<String>>, DirectoryError> {
        check_name("worker id", dead_id)?;
        let pool_owner_prefix = self.key_pool_owner("");
        let freed: Option<Vec<String>> = self
            .run("reclaim_worker", |mut c, s| {
                let pool_owner_prefix = pool_owner_prefix.clone();
                async move {
                    s.reclaim
                        .key(self.key_worker(dead_id))
                        .key(self.key_addr(dead_id))
                        .key(self.key_sessions(dead_id))
                        .key(self.key_tombstone(dead_id))
                        .arg(dead_id)
                        .arg(stale_token.unwrap_or(""))
                        .arg(pool_owner_prefix)
                        .arg(duration_px(TOMBSTONE))
                        .invoke_async(&mut c)
                        .await
                }
            })
            .await?;
        Ok(freed.map(|mut sids| {
            sids.sort();
            sids
        }))
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
        let fut = f(self.connection(), &self.inner.scripts);
        let result = tokio::time::timeout(timeout, fut).await;
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

    fn key_tombstone(&self, id: &str) -> String {
        format!("{}worker_reclaimed:{id}", self.inner.cfg.prefix)
    }

    fn key_pool_owner(&self, sid: &str) -> String {
        format!("{}pool_owner:{sid}", self.inner.cfg.prefix)
    }

    fn key_generation(&self) -> String {
        format!("{}generation", self.inner.cfg.prefix)
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
