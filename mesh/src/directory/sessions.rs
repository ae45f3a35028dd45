//! Session ownership: claims, releases, the memory of a shared session's end, and the
//! reclaim of a dead worker's sessions, each with its script.

use super::*;

/// What [`Directory::remembered_session`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remembered {
    /// The session is recorded; the id of its owner.
    Owner(String),
    /// It existed and ended; this lookup is the one that learnt it.
    Ended,
    /// Its owner left it for adoption (died or drained) and it can continue: adopt it
    /// ([`Directory::adopt_session`]); its memory is left in place.
    Adoptable,
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

/// What [`Directory::recorded_owner`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// The id of the worker recorded as the session's owner.
    Owner(String),
    /// An id that could never have been claimed (no round trip was made).
    Never,
    /// No owner recorded. Whether that proves the session absent depends on the
    /// directory's generation, as for [`Remembered::Absent`]: a young or changed one
    /// may have lost the record.
    Absent {
        generation: String,
        generation_age: Duration,
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

/// What kind of upstream link a session holds, which decides whether it can continue
/// on another worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionKind {
    /// Its state lives in an HTTP upstream's session: another worker can take it on.
    Http,
    /// A child process of its owner: it dies with the owner.
    Stdio,
}

impl SessionKind {
    fn as_str(self) -> &'static str {
        match self {
            SessionKind::Http => "http",
            SessionKind::Stdio => "stdio",
        }
    }
}

/// What a session needs to continue on another worker, recorded once when it opens
/// (`session_state:{sid}`, written by the claim itself, never per request).
#[derive(Debug, Clone, Copy)]
pub struct SessionState<'a> {
    pub kind: SessionKind,
    /// Who may adopt it: a worker asking with another guard (another principal or
    /// route) gets [`Adoption::NoRecord`] and learns nothing. Hex, no `|`.
    pub guard: &'a str,
    /// The caller's own description of the session (the directory never reads it).
    pub payload: &'a str,
}

/// Why a session was left for adoption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdoptCause {
    /// Its owner was proven dead and reclaimed.
    Death,
    /// Its owner drained and handed it over.
    Drain,
}

impl AdoptCause {
    pub fn as_str(self) -> &'static str {
        match self {
            AdoptCause::Death => "death",
            AdoptCause::Drain => "drain",
        }
    }
}

/// What [`Directory::adopt_session`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// The caller is now the session's owner (exactly one caller fleet-wide gets this
    /// for one loss); the payload recorded at its start.
    Adopted { payload: String, cause: AdoptCause },
    /// The caller owns it already (another of its requests adopted it a moment ago).
    AlreadyOwned { payload: String },
    /// Another worker owns it (it adopted it first, or its owner lives).
    OwnedBy(String),
    /// Its owner left it, but it cannot continue elsewhere (a stdio session); this
    /// caller is the one told (the record is taken).
    CannotContinue,
    /// Taking it would put its quota key over its session quota (the key opened new
    /// sessions since it stopped counting this one); nothing changed, and it stays
    /// adoptable.
    OverQuota,
    /// No record for this guard: never recorded, ended, or its adoption window passed.
    NoRecord,
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

impl Directory {
    /// Records `owner_id` as the owner of new session `sid` (`SET NX`) and adds it to the
    /// owner's session set, within `quota` if one is given. [`DirectoryError::NotRegistered`]
    /// if `owner_id` holds no lease.
    pub async fn claim_session(
        &self,
        sid: &str,
        owner_id: &str,
        quota: Option<SessionQuota<'_>>,
    ) -> Result<Claim, DirectoryError> {
        self.claim(sid, owner_id, quota, false, None).await
    }

    /// Claims `sid` as [`claim_session`](Self::claim_session) does and records `state`
    /// with it in the same script, so a session that can be found can be adopted.
    pub async fn claim_session_with_state(
        &self,
        sid: &str,
        owner_id: &str,
        quota: Option<SessionQuota<'_>>,
        state: Option<SessionState<'_>>,
    ) -> Result<Claim, DirectoryError> {
        self.claim(sid, owner_id, quota, false, state).await
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
        state: Option<SessionState<'_>>,
    ) -> Result<Claim, DirectoryError> {
        self.claim(sid, owner_id, None, true, state).await
    }

    async fn claim(
        &self,
        sid: &str,
        owner_id: &str,
        quota: Option<SessionQuota<'_>>,
        remember: bool,
        state: Option<SessionState<'_>>,
    ) -> Result<Claim, DirectoryError> {
        check_name("session id", sid)?;
        check_name("worker id", owner_id)?;
        let state = match state {
            Some(state) => {
                check_name("session guard", state.guard)?;
                format!(
                    "live|{}|{}|{}",
                    state.kind.as_str(),
                    state.guard,
                    state.payload
                )
            }
            None => String::new(),
        };
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
                    .arg(&state)
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
        let (kind, value, age, rebuilt, answered_by): (String, String, i64, i64, String) = self
            .run("remembered_session", |mut c, s| async move {
                s.remembered
                    .key(self.key_pool_owner(sid))
                    .key(self.key_seen(sid))
                    .key(self.key_generation())
                    .key(self.key_rebuilt())
                    .key(self.key_state(sid))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match kind.as_str() {
            "owner" => Remembered::Owner(value),
            "ended" => Remembered::Ended,
            "adoptable" => Remembered::Adoptable,
            _ => {
                self.check_absence("remembered_session", &answered_by)?;
                Remembered::Absent {
                    generation: value,
                    generation_age: Duration::from_millis(u64::try_from(age).unwrap_or(0)),
                    rebuilt: rebuilt == 1,
                }
            }
        })
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

    /// The worker recorded as owner of `sid`, or, when none is, what the directory's
    /// generation says of that absence (one round trip, so the two cannot disagree).
    pub async fn recorded_owner(&self, sid: &str) -> Result<Recorded, DirectoryError> {
        if check_name("session id", sid).is_err() {
            return Ok(Recorded::Never);
        }
        let (kind, value, age, rebuilt, answered_by): (String, String, i64, i64, String) = self
            .run("recorded_owner", |mut c, s| async move {
                s.recorded_owner
                    .key(self.key_pool_owner(sid))
                    .key(self.key_generation())
                    .key(self.key_rebuilt())
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match kind.as_str() {
            "owner" => Recorded::Owner(value),
            _ => {
                self.check_absence("recorded_owner", &answered_by)?;
                Recorded::Absent {
                    generation: value,
                    generation_age: Duration::from_millis(u64::try_from(age).unwrap_or(0)),
                    rebuilt: rebuilt == 1,
                }
            }
        })
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

    /// Takes over `sid`, whose owner died or drained, as `adopter`: exactly one of
    /// many racing callers becomes its owner ([`Adoption::Adopted`]); the others learn
    /// who did. `guard` must be the one recorded at the claim. Only a session whose
    /// owner left it (reclaim, handover) is adoptable; a live owner keeps it.
    /// [`DirectoryError::NotRegistered`] if `adopter` holds no lease.
    pub async fn adopt_session(
        &self,
        sid: &str,
        adopter: &str,
        guard: &str,
    ) -> Result<Adoption, DirectoryError> {
        self.adopt_session_within(sid, adopter, guard, None).await
    }

    /// [`adopt_session`](Self::adopt_session), the session counted in `quota`'s key
    /// again as it is taken: [`Adoption::OverQuota`] (and nothing changed) when the key
    /// holds its limit without it. A session its owner left still counts while it is
    /// adoptable, so this refuses only when the key's count expired meanwhile and it
    /// opened new sessions since.
    pub async fn adopt_session_within(
        &self,
        sid: &str,
        adopter: &str,
        guard: &str,
        quota: Option<SessionQuota<'_>>,
    ) -> Result<Adoption, DirectoryError> {
        if check_name("session id", sid).is_err() || check_name("session guard", guard).is_err() {
            return Ok(Adoption::NoRecord);
        }
        check_name("worker id", adopter)?;
        let (limit, key, ttl) = match &quota {
            Some(q) => (q.limit, q.key, duration_px(q.ttl)),
            None => (0, "", 0),
        };
        let (kind, value, cause): (String, String, String) = self
            .run("adopt_session", |mut c, s| async move {
                s.adopt
                    .key(self.key_state(sid))
                    .key(self.key_pool_owner(sid))
                    .key(self.key_sessions(adopter))
                    .key(self.key_worker(adopter))
                    .key(self.key_seen(sid))
                    .arg(adopter)
                    .arg(guard)
                    .arg(sid)
                    .arg(limit)
                    .arg(key)
                    .arg(ttl)
                    .arg(&self.inner.cfg.prefix)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match kind.as_str() {
            "adopted" => Adoption::Adopted {
                payload: value,
                cause: match cause.as_str() {
                    "drain" => AdoptCause::Drain,
                    _ => AdoptCause::Death,
                },
            },
            "mine" => Adoption::AlreadyOwned { payload: value },
            "owned" => Adoption::OwnedBy(value),
            "stdio" => Adoption::CannotContinue,
            "over_quota" => Adoption::OverQuota,
            "unregistered" => {
                return Err(DirectoryError::NotRegistered {
                    id: adopter.to_owned(),
                });
            }
            _ => Adoption::NoRecord,
        })
    }

    /// A draining `owner_id` leaves `sid` for adoption instead of ending it: its owner
    /// record goes, its state stays for [`DirectoryConfig::adoptable_for`], and it
    /// still counts in its quota key's sessions meanwhile (it is a live session of
    /// the key, only without a worker). Returns false (and changes nothing) unless
    /// `owner_id` owns it and it can continue elsewhere; the caller then ends it as
    /// before.
    pub async fn hand_over_session(
        &self,
        sid: &str,
        owner_id: &str,
    ) -> Result<bool, DirectoryError> {
        check_name("session id", sid)?;
        check_name("worker id", owner_id)?;
        let n: i64 = self
            .run("hand_over_session", |mut c, s| async move {
                s.hand_over
                    .key(self.key_pool_owner(sid))
                    .key(self.key_sessions(owner_id))
                    .key(self.key_state(sid))
                    .arg(owner_id)
                    .arg(sid)
                    .arg(duration_px(self.inner.cfg.adoptable_for))
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
                            .key(self.key_since(dead_id))
                            .key(self.key_primary(dead_id))
                            .arg(dead_id)
                            .arg(stale_token.unwrap_or(""))
                            .arg(pool_owner_prefix)
                            .arg(RECLAIM_BATCH)
                            .arg(duration_px(self.inner.cfg.lease * 4))
                            .arg(self.key_seen(""))
                            .arg(duration_px(REMEMBER_ENDED))
                            .arg(self.key_state(""))
                            .arg(duration_px(self.inner.cfg.adoptable_for))
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
}

/// `counts(prefix, sid)`: whether `sid` still counts in its quota key's sessions: it
/// has an owner, or its owner left it adoptable (it goes on once adopted). Quota sets
/// are cleaned lazily with it.
const COUNTS_LUA: &str = r#"
local function counts(prefix, sid)
  if redis.call('EXISTS', prefix .. 'pool_owner:' .. sid) == 1 then return true end
  local state = redis.call('GET', prefix .. 'session_state:' .. sid)
  return state ~= false and string.match(state, '^%a+|http|') ~= nil
    and string.sub(state, 1, 5) ~= 'live|'
end
"#;

/// KEYS: pool_owner, worker_sessions, worker.
/// ARGV: owner, sid, quota limit ('0': none), quota key, quota ttl px,
/// key prefix, remember ('1': keep a session_seen marker while it lives), the
/// session's state record or ''.
/// 1 claimed (also when the record names this owner already: a claim
/// whose answer was lost is confirmed), 0 another owner's, -1 owner has no lease, -2 the
/// quota key holds its limit. Quota sets are cleaned lazily: a member that no
/// longer counts (see `COUNTS_LUA`: ended, or reclaimed and no longer adoptable) goes.
pub(super) fn claim() -> Script {
    Script::new(&format!(
        r#"{COUNTS_LUA}
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
local limit = tonumber(ARGV[3])
local quota_set = ARGV[6] .. 'principal_sessions:' .. redis.sha1hex(ARGV[4])
if limit > 0 and redis.call('SCARD', quota_set) >= limit then
  for _, sid in ipairs(redis.call('SMEMBERS', quota_set)) do
    if not counts(ARGV[6], sid) then
      redis.call('SREM', quota_set, sid)
    end
  end
  if redis.call('SCARD', quota_set) >= limit then return -2 end
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX') or redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SADD', KEYS[2], ARGV[2])
  if ARGV[7] == '1' then redis.call('SET', ARGV[6] .. 'session_seen:' .. ARGV[2], '1') end
  if ARGV[8] ~= '' then redis.call('SET', ARGV[6] .. 'session_state:' .. ARGV[2], ARGV[8]) end
  if limit > 0 then
    redis.call('SADD', quota_set, ARGV[2])
    redis.call('PEXPIRE', quota_set, ARGV[5])
  end
  return 1
end
return 0
"#
    ))
}

/// KEYS: pool_owner, worker_sessions. ARGV: owner, sid, quota key or '', key
/// prefix, px a remembered session's end is kept.
pub(super) fn release() -> Script {
    Script::new(
        r#"
redis.call('SREM', KEYS[2], ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SREM', ARGV[4] .. 'principal_sessions:' .. redis.sha1hex(ARGV[3]), ARGV[2])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], ARGV[4] .. 'session_state:' .. ARGV[2])
  local seen = ARGV[4] .. 'session_seen:' .. ARGV[2]
  if redis.call('EXISTS', seen) == 1 then redis.call('PEXPIRE', seen, ARGV[5]) end
  return 1
end
return 0
"#,
    )
}

/// KEYS: pool_owner, session_seen, generation, rebuilt, session_state.
/// {'owner', id, 0, 0, ''} while recorded; {'adoptable', '', 0, 0, ''} when its
/// owner left it for adoption and it can continue; {'ended', '', 0, 0, ''} when it
/// ended and this call is the first to learn it (the marker is taken, so only one
/// caller fleet-wide is told); else {'absent', generation or '', generation age ms,
/// rebuilt 0/1, replication id}.
/// `absent(generation key, rebuilt key)`: the answer of a lookup that found no record,
/// with what the directory's generation says of that absence and the replication id of
/// the server that answered ('' if it refuses `INFO`), so that a promoted replica not
/// yet marked as a failover is not taken for the primary that held the record.
const ABSENT_LUA: &str = r#"
local function absent(generation_key, rebuilt_key)
  local rebuilt = redis.call('EXISTS', rebuilt_key)
  local info = redis.pcall('INFO', 'replication')
  local replid = ''
  if type(info) == 'string' then replid = string.match(info, 'master_replid:(%w+)') or '' end
  local g = redis.call('GET', generation_key)
  if not g then return {'absent', '', 0, rebuilt, replid} end
  return {'absent', g, generation_age(g), rebuilt, replid}
end
"#;

/// KEYS: pool_owner, generation, rebuilt. Returns {'owner', id, 0, 0, ''} or
/// {'absent', generation or '', its age in ms, rebuilt 0|1, replication id}.
pub(super) fn recorded_owner() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
{ABSENT_LUA}
local owner = redis.call('GET', KEYS[1])
if owner then return {{'owner', owner, 0, 0, ''}} end
return absent(KEYS[2], KEYS[3])
"#
    ))
}

pub(super) fn remembered() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
{ABSENT_LUA}
local owner = redis.call('GET', KEYS[1])
if owner then return {{'owner', owner, 0, 0, ''}} end
local state = redis.call('GET', KEYS[5])
if state and string.match(state, '^%a+|http|') and string.sub(state, 1, 5) ~= 'live|' then
  return {{'adoptable', '', 0, 0, ''}}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[2])
  return {{'ended', '', 0, 0, ''}}
end
return absent(KEYS[3], KEYS[4])
"#
    ))
}

/// KEYS: worker, addr, worker_sessions, workers, gone, cert, drain, since, primary.
/// ARGV: dead id, stale token or '', pool_owner key prefix, batch size,
/// reclaimed-record px, session_seen key prefix, px a remembered session's
/// end is kept, session_state key prefix, px a left session stays adoptable.
/// false: nothing may be done (lease alive, or nothing known of this id: a
/// forged id costs no write). Else {won, remaining, freed sids...}: `won` is
/// 1 for the one call that proved the death first; later calls (the sweeper,
/// a reclaimer's next batches) free the rest, `remaining` at a time.
pub(super) fn reclaim() -> Script {
    Script::new(&format!(
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
redis.call('DEL', KEYS[2], KEYS[6], KEYS[7], KEYS[8], KEYS[9])
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
    local state = ARGV[8] .. sid
    local recorded = redis.call('GET', state)
    if recorded and string.sub(recorded, 1, 5) == 'live|' then
      redis.call('SET', state, 'death|' .. string.sub(recorded, 6), 'PX', ARGV[9])
    end
    out[#out + 1] = sid
  end
end
out[2] = redis.call('SCARD', KEYS[3])
return out
"#
    ))
}

/// KEYS: worker, worker_sessions. ARGV: owner, pool_owner key prefix, sids...
/// Returns the sids another worker owns now, or -1 if the owner has no lease.
pub(super) fn reclaim_after_loss() -> Script {
    Script::new(
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
    )
}

/// KEYS: session_state, pool_owner, adopter's worker_sessions, adopter's lease,
/// session_seen (a remembered session lives again: its memory no longer expires).
/// ARGV: adopter, guard, sid, quota limit ('0': none), quota key, quota ttl px, key
/// prefix. {'adopted', payload, 'death'|'drain'} for the one caller that takes it
/// (counted in its quota key's sessions); {'mine', payload, ''} when the adopter
/// owns it already; {'owned', owner, ''} when another worker does; {'stdio', '', ''}
/// (the record is taken) when its owner left a session that cannot continue;
/// {'unregistered', '', ''} when the adopter holds no lease; {'over_quota', '', ''}
/// (nothing changed) when its quota key holds its limit without it; else
/// {'none', '', ''}.
pub(super) fn adopt() -> Script {
    Script::new(&format!(
        r#"{COUNTS_LUA}
local recorded = redis.call('GET', KEYS[1])
if not recorded then return {{'none', '', ''}} end
local state, kind, guard, payload = string.match(recorded, '^(%a+)|(%a+)|([^|]*)|(.*)$')
if not state or guard ~= ARGV[2] then return {{'none', '', ''}} end
local owner = redis.call('GET', KEYS[2])
if owner == ARGV[1] then return {{'mine', payload, ''}} end
if owner then return {{'owned', owner, ''}} end
if state == 'live' then return {{'none', '', ''}} end
if kind ~= 'http' then
  redis.call('DEL', KEYS[1])
  return {{'stdio', '', ''}}
end
if redis.call('EXISTS', KEYS[4]) == 0 then return {{'unregistered', '', ''}} end
local limit = tonumber(ARGV[4])
if limit > 0 then
  local quota_set = ARGV[7] .. 'principal_sessions:' .. redis.sha1hex(ARGV[5])
  if redis.call('SISMEMBER', quota_set, ARGV[3]) == 0
    and redis.call('SCARD', quota_set) >= limit then
    for _, sid in ipairs(redis.call('SMEMBERS', quota_set)) do
      if not counts(ARGV[7], sid) then redis.call('SREM', quota_set, sid) end
    end
    if redis.call('SCARD', quota_set) >= limit then return {{'over_quota', '', ''}} end
  end
  redis.call('SADD', quota_set, ARGV[3])
  redis.call('PEXPIRE', quota_set, ARGV[6])
end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SET', KEYS[1], 'live|' .. kind .. '|' .. guard .. '|' .. payload)
redis.call('PERSIST', KEYS[5])
return {{'adopted', payload, state}}
"#
    ))
}

/// KEYS: pool_owner, worker_sessions, session_state. ARGV: owner, sid, px the
/// record stays adoptable, key prefix, px a remembered session's end is kept (if
/// nobody adopts it). 1 handed over, else 0. It stays in its quota key's set: it
/// counts while adoptable (see `COUNTS_LUA`).
pub(super) fn hand_over() -> Script {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local recorded = redis.call('GET', KEYS[3])
if not recorded or string.sub(recorded, 1, 10) ~= 'live|http|' then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], 'drain|' .. string.sub(recorded, 6), 'PX', ARGV[3])
local seen = ARGV[4] .. 'session_seen:' .. ARGV[2]
if redis.call('EXISTS', seen) == 1 then redis.call('PEXPIRE', seen, ARGV[5]) end
return 1
"#,
    )
}
