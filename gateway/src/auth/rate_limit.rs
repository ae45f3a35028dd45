//! The per-principal rate limit: a token bucket per principal in Redis, taken and
//! counted by one Lua script, so each client request costs one round trip, and only
//! when a limit is configured. The receiving worker asks once per client request; the
//! owner of a forwarded request never asks again (docs/architecture.md, invariant 2:
//! one client request moves a per-user counter by exactly one).
//!
//! When Redis does not answer in time the limiter fails in the configured direction:
//! open (the request passes, a warning is logged) or closed (503 + `Retry-After`).
//! After a failure it leaves Redis alone for a second, so an outage costs no request a
//! timeout.

use crate::reason::Reason;
use std::time::Duration;

use http::StatusCode;
use mcpgw_mesh::RedisEndpoint;
use parking_lot::Mutex;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;
use tracing::warn;

use super::config::{FailMode, RateLimitConfig};
use crate::mcp::GatewayError;

/// How long Redis is left alone after it failed to answer.
const BACKOFF: Duration = Duration::from_secs(1);

/// Takes one token from the bucket `KEYS[1]` (a hash: `tokens`, `ts` in ms, and
/// `requests`, the exact count of requests checked). Time is Redis's own, so the
/// workers' clocks do not matter. Returns `{allowed, retry_after_ms}`.
const TAKE_LUA: &str = r#"
local capacity = tonumber(ARGV[1])
local per_ms = tonumber(ARGV[2])
local ttl_ms = tonumber(ARGV[3])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
if now > ts then
  tokens = math.min(capacity, tokens + (now - ts) * per_ms)
end
local allowed = 0
local wait_ms = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait_ms = math.ceil((1 - tokens) / per_ms)
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return {allowed, wait_ms}
"#;

pub struct RateLimiter {
    /// Its Redis: one server, or the primary a Sentinel set or a Cluster names.
    endpoint: RedisEndpoint,
    /// Connected on first use to the primary of the moment; `None` again after any
    /// failure, so the next request looks the primary up again (a failover moves it).
    connection: tokio::sync::Mutex<Option<ConnectionManager>>,
    script: redis::Script,
    key_prefix: String,
    capacity: f64,
    per_ms: f64,
    /// Lifetime of an idle bucket: the time it takes to refill, plus a margin.
    ttl_ms: u64,
    fail: FailMode,
    timeout: Duration,
    /// Until when Redis is skipped after a failure.
    skip_until: Mutex<Option<Instant>>,
    /// Requests let through uncounted (Redis failed, on_redis_error = open), for the
    /// metrics: a limiter failing open limits nothing.
    passed_uncounted: std::sync::atomic::AtomicU64,
    /// Requests refused because Redis failed (on_redis_error = closed).
    refused_uncounted: std::sync::atomic::AtomicU64,
}

/// Why a token could not be taken.
enum TakeError {
    /// The primary could not be looked up (Sentinel, Cluster); the scrubbed reason.
    NoPrimary(String),
    Redis(redis::RedisError),
}

impl RateLimiter {
    /// `redis_url` is the configured one or the fleet's. The client only parses the
    /// URL here; it connects on the first request.
    pub fn new(
        config: &RateLimitConfig,
        redis_url: &str,
        key_prefix: &str,
    ) -> Result<RateLimiter, String> {
        let endpoint = RedisEndpoint::parse(redis_url)
            .map_err(|why| format!("the rate limiter's Redis: {why}"))?;
        // On a Cluster every bucket lives in the slot of one hash tag (the directory's
        // when the prefix is the fleet's), so one primary serves them all.
        let key_prefix = if endpoint.is_cluster() {
            mcpgw_mesh::directory::hash_tagged(key_prefix)
        } else {
            key_prefix.to_owned()
        };
        let capacity = f64::from(config.burst);
        let per_ms = config.per_second / 1000.0;
        let ttl_ms = ((capacity / per_ms).ceil() as u64).saturating_add(1000);
        Ok(RateLimiter {
            endpoint,
            connection: tokio::sync::Mutex::new(None),
            script: redis::Script::new(TAKE_LUA),
            key_prefix,
            capacity,
            per_ms,
            ttl_ms,
            fail: config.on_redis_error,
            timeout: config.timeout(),
            skip_until: Mutex::new(None),
            passed_uncounted: Default::default(),
            refused_uncounted: Default::default(),
        })
    }

    /// The Redis key of `principal`'s bucket ([`super::Authenticator::principal`]).
    pub fn bucket_key(&self, principal: &str) -> String {
        format!("{}ratelimit:{principal}", self.key_prefix)
    }

    /// Counts one request of `principal` ([`super::Authenticator::principal`]; public
    /// requests have none and are not counted): Ok when it may run, 429 when its
    /// bucket is empty, and the configured answer when Redis does not give one.
    pub async fn admit(&self, principal: &str) -> Result<(), GatewayError> {
        if self
            .skip_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
        {
            return self.unavailable("Redis failed a moment ago");
        }
        let key = self.bucket_key(principal);
        match tokio::time::timeout(self.timeout, self.take(&key)).await {
            Ok(Ok((1, _))) => Ok(()),
            Ok(Ok((_, retry_after_ms))) => {
                let seconds =
                    u32::try_from(retry_after_ms.div_ceil(1000).max(1)).unwrap_or(u32::MAX);
                Err(GatewayError::gateway(
                    StatusCode::TOO_MANY_REQUESTS,
                    Reason::RateLimited,
                    format!(
                        "rate limit exceeded for this principal ({} requests/s, bursts of {}): \
                         retry after {seconds} s",
                        self.per_ms * 1000.0,
                        self.capacity
                    ),
                )
                .with_reason(Reason::RateLimited)
                .with_data(serde_json::json!({ "retry_after_ms": retry_after_ms,
                }))
                .with_retry_after(seconds))
            }
            Ok(Err(TakeError::Redis(e))) => {
                self.back_off();
                // The kind only: the error's text may quote the URL.
                self.unavailable(&format!("Redis error: {:?}", e.kind()))
            }
            Ok(Err(TakeError::NoPrimary(why))) => {
                self.back_off();
                // Scrubbed of the URL's passwords by the lookup.
                self.unavailable(&format!("no Redis primary: {why}"))
            }
            Err(_) => {
                self.back_off();
                self.unavailable(&format!("no answer from Redis within {:?}", self.timeout))
            }
        }
    }

    async fn take(&self, key: &str) -> Result<(i64, u64), TakeError> {
        let mut connection = {
            let mut slot = self.connection.lock().await;
            match slot.as_ref() {
                Some(connection) => connection.clone(),
                None => {
                    let client = self
                        .endpoint
                        .primary(key, self.timeout)
                        .await
                        .map_err(TakeError::NoPrimary)?;
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout))
                        .set_max_delay(BACKOFF);
                    let connection = client
                        .get_connection_manager_with_config(config)
                        .await
                        .map_err(TakeError::Redis)?;
                    *slot = Some(connection.clone());
                    connection
                }
            }
        };
        let taken: Result<(i64, i64), _> = self
            .script
            .key(key)
            .arg(self.capacity)
            .arg(self.per_ms)
            .arg(self.ttl_ms)
            .invoke_async(&mut connection)
            .await;
        match taken {
            Ok((allowed, retry_after_ms)) => {
                Ok((allowed, u64::try_from(retry_after_ms).unwrap_or(0)))
            }
            Err(e) => {
                // A demoted primary (READONLY), a moved slot or a dead server: look the
                // primary up again next time.
                *self.connection.lock().await = None;
                Err(TakeError::Redis(e))
            }
        }
    }

    fn back_off(&self) {
        *self.skip_until.lock() = Some(Instant::now() + BACKOFF);
    }

    /// Requests it could not count (Redis failed): let through, and refused.
    pub fn unavailable_counts(&self) -> (u64, u64) {
        (
            self.passed_uncounted
                .load(std::sync::atomic::Ordering::Relaxed),
            self.refused_uncounted
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    fn unavailable(&self, why: &str) -> Result<(), GatewayError> {
        let uncounted = match self.fail {
            FailMode::Open => &self.passed_uncounted,
            FailMode::Closed => &self.refused_uncounted,
        };
        uncounted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.fail {
            FailMode::Open => {
                warn!(
                    why,
                    "rate limiter unavailable; letting the request through (on_redis_error = open)"
                );
                Ok(())
            }
            FailMode::Closed => {
                warn!(
                    why,
                    "rate limiter unavailable; refusing the request (on_redis_error = closed)"
                );
                Err(GatewayError::gateway(
                    StatusCode::SERVICE_UNAVAILABLE,
                    Reason::RateLimitUnavailable,
                    "the rate limiter cannot be reached, and this gateway refuses requests it \
                     cannot count: retry shortly",
                )
                .with_retry_after(1))
            }
        }
    }
}
