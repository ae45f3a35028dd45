//! The fleet as the directory holds it: workers and their endpoints, the operator's
//! snapshot (`mcpgw status`), drain requests, and the sweeper's turn and candidates.

use super::lease::LeaseValue;
use super::*;

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
    /// The primary (`host:port`) this read reached behind Sentinel or Cluster; `None`
    /// for a standalone Redis.
    pub primary: Option<String>,
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

/// What a lease key's value (`None`: no key) says.
fn lease_view(value: Option<String>) -> LeaseView {
    match value {
        None => LeaseView::Absent,
        Some(value) => match serde_json::from_str::<LeaseValue>(&value) {
            Ok(v) => LeaseView::Live(v.info),
            Err(_) => LeaseView::Unreadable,
        },
    }
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
    /// The primary (`host:port`) it followed at its last renewal, behind Sentinel or
    /// Cluster (`{p}worker_primary:{id}`); `None` for a standalone Redis, an older
    /// version, or before its first renewal.
    pub followed_primary: Option<String>,
    /// Subscribers of its request channel (`PUBSUB NUMSUB`), when its address is the
    /// channel of the Redis transport; `None` for QUIC and TCP workers.
    pub request_channel_subscribers: Option<u64>,
}

impl Directory {
    /// One worker's current registration, if its lease is alive.
    pub async fn worker(&self, id: &str) -> Result<Option<WorkerEntry>, DirectoryError> {
        check_name("worker id", id)?;
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(self.key_worker(id));
        pipe.cmd("GET").arg(self.key_addr(id));
        let (lease, addr): (Option<String>, Option<String>) =
            self.run_pipe("worker", &pipe).await?;
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
        let (addr, lease): (Option<String>, Option<String>) =
            self.run_pipe("worker_endpoint", &pipe).await?;
        let Some(addr) = addr else { return Ok(None) };
        let info = lease
            .and_then(|lease| serde_json::from_str::<LeaseValue>(&lease).ok())
            .map(|lease| lease.info);
        let (identity, same_host) = match info {
            Some(info) => (info.mesh_identity, info.same_host),
            None => (None, None),
        };
        Ok(Some(WorkerEndpoint {
            addr,
            identity,
            same_host,
        }))
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
            let values: Vec<Option<String>> = self.run_pipe("workers (GET)", &pipe).await?;
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
        let session_records = self.session_records_per_owner().await?;
        let mut ids = self
            .scan_suffixes("fleet_snapshot (SCAN sessions)", &self.key_sessions(""))
            .await?;
        ids.extend(
            self.scan_suffixes("fleet_snapshot (SCAN leases)", &self.key_worker(""))
                .await?,
        );
        let renewals = self.renewal_scores().await?;
        ids.extend(renewals.keys().cloned());
        let ids: Vec<String> = ids.into_iter().collect();
        let mut workers = self.worker_snapshots(&ids, &renewals).await?;
        self.count_request_channel_subscribers(&mut workers).await?;
        let mut pipe = redis::pipe();
        pipe.cmd("TIME");
        pipe.cmd("GET").arg(self.key_generation());
        let ((now_s, now_us), generation): ((u64, u64), Option<String>) =
            self.run_pipe("fleet_snapshot (TIME)", &pipe).await?;
        Ok(FleetSnapshot {
            redis_now_unix_ms: now_s * 1000 + now_us / 1000,
            generation_created_unix_ms: generation
                .as_deref()
                .and_then(|g| g.rsplit_once('@'))
                .and_then(|(_, ms)| ms.parse().ok()),
            workers,
            session_records,
            primary: Some(self.followed_primary()).filter(|p| !p.is_empty()),
        })
    }

    /// How many session records name each owner id.
    async fn session_records_per_owner(&self) -> Result<BTreeMap<String, u64>, DirectoryError> {
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
            let owners: Vec<Option<String>> =
                self.run_pipe("fleet_snapshot (GET records)", &pipe).await?;
            for owner in owners.into_iter().flatten() {
                *session_records.entry(owner).or_insert(0) += 1;
            }
        }
        Ok(session_records)
    }

    /// What the directory holds for each of `ids`, in their order; the subscribers of
    /// request channels are counted afterwards.
    async fn worker_snapshots(
        &self,
        ids: &[String],
        renewals: &BTreeMap<String, u64>,
    ) -> Result<Vec<WorkerSnapshot>, DirectoryError> {
        let mut workers = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(RECLAIM_BATCH) {
            let mut pipe = redis::pipe();
            for id in chunk {
                pipe.cmd("GET").arg(self.key_worker(id));
                pipe.cmd("GET").arg(self.key_addr(id));
                pipe.cmd("SCARD").arg(self.key_sessions(id));
                pipe.cmd("GET").arg(self.key_cert(id));
                pipe.cmd("EXISTS").arg(self.key_drain(id));
                pipe.cmd("GET").arg(self.key_primary(id));
            }
            let values: Vec<redis::Value> =
                self.run_pipe("fleet_snapshot (GET workers)", &pipe).await?;
            let mut values = values.into_iter();
            for id in chunk {
                let mut next = || values.next().unwrap_or(redis::Value::Nil);
                let lease: Option<String> = self.decode("fleet_snapshot", next())?;
                let addr: Option<String> = self.decode("fleet_snapshot", next())?;
                let sessions_owned: u64 = self.decode("fleet_snapshot", next())?;
                let cert: Option<String> = self.decode("fleet_snapshot", next())?;
                let drain: i64 = self.decode("fleet_snapshot", next())?;
                let followed_primary: Option<String> = self.decode("fleet_snapshot", next())?;
                workers.push(WorkerSnapshot {
                    id: id.clone(),
                    lease: lease_view(lease),
                    addr,
                    last_renewal_unix_ms: renewals.get(id).copied(),
                    sessions_owned,
                    cert_not_after_unix_ms: cert.and_then(|ms| ms.parse().ok()),
                    drain_requested: drain == 1,
                    followed_primary,
                    request_channel_subscribers: None,
                });
            }
        }
        Ok(workers)
    }

    /// Fills in the subscribers of the request channel of each worker whose address is
    /// one: the Redis transport records its request channel as the address, and how
    /// many listen on it is invariant 2's business.
    async fn count_request_channel_subscribers(
        &self,
        workers: &mut [WorkerSnapshot],
    ) -> Result<(), DirectoryError> {
        let channels = crate::transport::RedisTransportConfig {
            prefix: self.inner.cfg.prefix.clone(),
            ..Default::default()
        };
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
        Ok(())
    }

    /// Runs `pipe` as one Redis exchange (see `run`).
    async fn run_pipe<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        pipe: &redis::Pipeline,
    ) -> Result<T, DirectoryError> {
        self.run(op, |mut c, _| async move { pipe.query_async(&mut c).await })
            .await
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
}

/// KEYS: worker, drain. Returns 1 if the worker holds a lease (the request is
/// recorded for two to three leases: long enough for several renewals to see
/// it, short enough not to outlive the worker by much), 0 if it holds none.
pub(super) fn request_drain() -> Script {
    Script::new(
        r#"
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 then return 0 end
if ttl < 0 then ttl = 10000 end
redis.call('SET', KEYS[2], '1', 'PX', math.max(ttl * 3, 1000))
return 1
"#,
    )
}
