//! Leases: a worker's registration, its renewal, resumption and end, and what the
//! directory says of a worker's lease (alive, expired, gone), each with its script.

use super::*;

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
    /// The worker's same-host mesh socket and its kernel's boot id, when it serves one
    /// (`--mesh-same-host unix`). A new field of the lease, never a change of
    /// `worker_addr`: workers of a release without it ignore it and dial the address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_host: Option<crate::transport::SameHostRoute>,
}

/// Where a live worker's mesh endpoint is and who answers there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// The mesh address `host:port` (or the Redis channel).
    pub addr: String,
    /// The mesh identity the worker registered, if it registered one.
    pub identity: Option<String>,
    /// The same-host route the worker advertised, if it serves one.
    pub same_host: Option<crate::transport::SameHostRoute>,
}

/// The JSON stored in `{p}worker:{id}`.
#[derive(Serialize, Deserialize)]
pub(super) struct LeaseValue {
    /// What the worker told about itself.
    #[serde(flatten)]
    pub(super) info: WorkerInfo,
    /// Random per registration: tells this registration apart from a later one of the
    /// same id, so only its holder can renew or delete it.
    pub(super) token: String,
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

impl Directory {
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
                    .key(self.key_since(id))
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

    /// After a failover (see [`Directory::take_failover`]): writes this worker's lease
    /// again under its own token, whether or not the new primary had it, and takes the
    /// new generation. The new primary may lack the last renewal or the registration
    /// itself; what it cannot lack is a record that this worker was reclaimed or that
    /// another process took its id, which is `Lost`.
    pub async fn reassert_after_failover(
        &self,
        lease: &Lease,
    ) -> Result<Option<Lease>, DirectoryError> {
        let fresh_generation = random_token()?;
        let sent = Instant::now();
        let fresh_ref = &fresh_generation;
        let generation: Option<String> = self
            .run("reassert_after_failover", |mut c, s| async move {
                s.reassert
                    .key(self.key_worker(&lease.id))
                    .key(self.key_addr(&lease.id))
                    .key(self.key_workers())
                    .key(self.key_generation())
                    .key(self.key_cert(&lease.id))
                    .key(self.key_gone(&lease.id))
                    .arg(&lease.value)
                    .arg(&lease.addr)
                    .arg(self.lease_px())
                    .arg(fresh_ref)
                    .arg(&lease.id)
                    .arg(cert_arg(lease.cert_not_after_ms))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(generation.map(|generation| Lease {
            generation,
            valid_until: sent + self.inner.cfg.lease,
            ..lease.clone()
        }))
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
                    .key(self.key_primary(&lease.id))
                    .key(self.key_since(&lease.id))
                    .arg(&lease.value)
                    .arg(self.lease_px())
                    .arg(&lease.addr)
                    .arg(&lease.generation)
                    .arg(&lease.id)
                    .arg(cert_arg(lease.cert_not_after_ms))
                    .arg(self.followed_primary())
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
                    .key(self.key_since(&lease.id))
                    .key(self.key_primary(&lease.id))
                    .arg(&lease.value)
                    .arg(&lease.id)
                    .arg(duration_px(self.inner.cfg.lease * 4))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(n == 1)
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

    /// How long ago (by Redis's clock) worker `id` registered, while its lease lives;
    /// `None` when that is not known (no lease, or a registration by an older version,
    /// or one re-asserted after a failover).
    pub async fn registered_ago(&self, id: &str) -> Result<Option<Duration>, DirectoryError> {
        check_name("worker id", id)?;
        let ago: i64 = self
            .run("registered_ago", |mut c, s| async move {
                s.registered_ago
                    .key(self.key_since(id))
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(u64::try_from(ago).ok().map(Duration::from_millis))
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
}

/// KEYS: worker, addr, workers, generation, cert, drain, since. ARGV: value, addr,
/// px, fresh gen, id, leaf not-after ms or ''. Returns the generation, or false if
/// the id is held. A drain request left for an earlier holder of the id is
/// not this registration's.
pub(super) fn register() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[3]) then return false end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[7], string.format('%d', now_ms()), 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], now_ms(), ARGV[5])
if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[3]) end
redis.call('DEL', KEYS[6])
return generation(KEYS[4], ARGV[4])
"#
    ))
}

/// KEYS: worker, addr, workers, generation, cert, gone. ARGV: value, addr, px,
/// fresh gen, id, leaf not-after ms or ''. Returns the generation, or false if the
/// id is held by another registration or this worker was reclaimed.
pub(super) fn reassert() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return false end
if redis.call('EXISTS', KEYS[6]) == 1 then return false end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], now_ms(), ARGV[5])
if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[3]) end
return generation(KEYS[4], ARGV[4])
"#
    ))
}

/// KEYS: worker, addr, generation, workers, cert, drain, primary, since. ARGV: value, px,
/// addr, lease generation, id, leaf not-after ms or '', followed primary or ''. 1
/// renewed, 3 renewed and asked to drain, 0 lost, 2 directory lost.
pub(super) fn renew() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  redis.call('ZADD', KEYS[4], now_ms(), ARGV[5])
  if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'PX', ARGV[2]) end
  if ARGV[7] ~= '' then redis.call('SET', KEYS[7], ARGV[7], 'PX', ARGV[2]) end
  redis.call('PEXPIRE', KEYS[8], ARGV[2])
  if redis.call('EXISTS', KEYS[6]) == 1 then return 3 end
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('GET', KEYS[3]) ~= ARGV[4] then
  return 2
end
return 0
"#
    ))
}

/// KEYS: worker, addr, workers, generation, cert. ARGV: value, addr, px, lease
/// generation, id, leaf not-after ms or ''. 1 resumed, 0 lost (reclaimed or
/// taken), 2 directory lost. A reclaimed worker is no longer in `workers`: it
/// can never resume.
pub(super) fn resume() -> Script {
    Script::new(&format!(
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
    ))
}

/// KEYS: worker, addr, workers, cert, drain, gone, since, primary. ARGV: value, id,
/// gone px.
pub(super) fn deregister() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5], KEYS[7], KEYS[8])
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('SET', KEYS[6], 'deregistered@' .. string.format('%d', now_ms()), 'PX', ARGV[3])
  return 1
end
return 0
"#
    ))
}

/// KEYS: worker, generation, gone. Returns {lease alive 0/1, generation or
/// '', generation age ms, gone how or '', gone ms ago or -1}.
pub(super) fn lease_state() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
{GONE_LUA}
local alive = redis.call('EXISTS', KEYS[1])
local went = gone(KEYS[3])
local g = redis.call('GET', KEYS[2])
if not g then return {{alive, '', 0, went[1], went[2]}} end
return {{alive, g, generation_age(g), went[1], went[2]}}
"#
    ))
}

/// KEYS: gone. Returns {how or '', ms ago or -1}.
pub(super) fn gone() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
{GONE_LUA}
return gone(KEYS[1])
"#
    ))
}

/// KEYS: since. Returns ms since the registration, or -1 when unknown.
pub(super) fn registered_ago() -> Script {
    Script::new(&format!(
        r#"{GEN_LUA}
local since = tonumber(redis.call('GET', KEYS[1]))
if not since then return -1 end
return now_ms() - since
"#
    ))
}

/// KEYS: generation. ARGV: fresh token.
pub(super) fn generation() -> Script {
    Script::new(&format!("{GEN_LUA}\nreturn generation(KEYS[1], ARGV[1])\n"))
}
