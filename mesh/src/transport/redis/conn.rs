//! The Redis transport's connections: a client whose sockets suit the mesh, the
//! publisher, and pub/sub subscriptions that come back by themselves after Redis
//! breaks. URL parsing and password scrubbing are the crate's shared
//! [`redis_conn`](crate::redis_conn) helpers, as for the directory.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink, PubSubStream};
use redis::io::tcp::{TcpSettings, socket2::TcpKeepalive};
use redis::{ProtocolVersion, RedisError};
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::config::RedisTransportConfig;
use crate::redis_conn::{self, ConnectFailure};
use crate::transport::config::MeshLimits;
use crate::transport::error::MeshError;

/// First wait before subscribing again after a subscription broke; doubles per failure.
pub(super) const RESUBSCRIBE_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two subscription attempts: a restarted Redis is found within it.
pub(super) const RESUBSCRIBE_MAX: Duration = Duration::from_secs(1);
/// How long a stopping server waits for Redis to confirm that it unsubscribed, and an
/// exchange cut off by a stop for its last error frame to go out.
pub(super) const STOP_GRACE: Duration = Duration::from_secs(1);

/// A Redis client for `cfg` whose sockets suit the mesh: no Nagle delay on small
/// messages, and keepalive probes so that a vanished Redis host ends a quiet pub/sub
/// connection instead of leaving it open forever.
pub(super) fn open_client(
    cfg: &RedisTransportConfig,
    limits: &MeshLimits,
) -> Result<redis::Client, MeshError> {
    let idle = limits.idle_timeout.max(Duration::from_secs(1));
    let keepalive = TcpKeepalive::new()
        .with_time(idle)
        .with_interval((idle / 3).max(Duration::from_secs(1)));
    let tcp = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    redis_conn::open_client(&cfg.redis_url, Some(tcp)).map_err(MeshError::Redis)
}

/// Removes the Redis password from an error text, in case one echoes it.
pub(super) fn scrub(text: &str, client: &redis::Client) -> String {
    redis_conn::scrub(text, redis_conn::password(client).as_deref())
}

/// The multiplexed, self-reconnecting connection that publishes. Each command gets the
/// connect timeout: Redis answers a `PUBLISH` at once unless it is in trouble.
///
/// It speaks RESP3 (Redis 6 or later): over RESP3 the connection manager learns of a
/// closed connection the moment it happens and reconnects at once, while over RESP2 it
/// only learns when the next command fails, and a lost `PUBLISH` would cost a request
/// or a response. (Pub/sub connections stay on RESP2, which any Redis speaks.)
pub(super) async fn connect_publisher(
    client: &redis::Client,
    limits: &MeshLimits,
    url: &str,
) -> Result<ConnectionManager, MeshError> {
    let resp3_client = redis_conn::with_protocol(client, ProtocolVersion::RESP3)
        .map_err(|reason| MeshError::Redis(format!("Redis at {url}: {reason}")))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(limits.connect_timeout))
        .set_response_timeout(Some(limits.connect_timeout))
        .set_min_delay(RESUBSCRIBE_MIN)
        .set_max_delay(RESUBSCRIBE_MAX);
    let deadline = Instant::now() + limits.connect_timeout;
    match redis_conn::connect_manager(&resp3_client, config, deadline).await {
        Ok(conn) => Ok(conn),
        Err(ConnectFailure::Failed(reason)) => Err(MeshError::Redis(format!(
            "cannot connect to Redis at {url} (the Redis transport needs Redis 6 or later): {reason}"
        ))),
        Err(ConnectFailure::TimedOut) => Err(MeshError::Redis(format!(
            "Redis at {url} did not answer within {:?}",
            limits.connect_timeout
        ))),
    }
}

/// Publishes `payload`; the number of subscribers that received it.
pub(super) async fn publish(
    publisher: &mut ConnectionManager,
    channel: &str,
    payload: &[u8],
) -> Result<i64, RedisError> {
    redis::cmd("PUBLISH")
        .arg(channel)
        .arg(payload)
        .query_async(publisher)
        .await
}

/// One channel's pub/sub connection.
pub(super) struct Subscription {
    /// Kept to unsubscribe explicitly on stop, so that Redis counts no subscriber as
    /// soon as the worker is gone, not when it notices the closed socket.
    sink: PubSubSink,
    /// The channel's messages; ends when the connection does.
    pub(super) messages: PubSubStream,
}

impl Subscription {
    pub(super) async fn open(
        client: &redis::Client,
        channel: &str,
        within: Duration,
    ) -> Result<Subscription, String> {
        let attempt = async {
            let (mut sink, messages) = client.get_async_pubsub().await?.split();
            sink.subscribe(channel).await?;
            Ok::<_, RedisError>(Subscription { sink, messages })
        };
        match timeout(within, attempt).await {
            Ok(Ok(subscription)) => Ok(subscription),
            Ok(Err(e)) => Err(scrub(&e.to_string(), client)),
            Err(_) => Err(format!(
                "Redis did not confirm the subscription within {within:?}"
            )),
        }
    }

    /// Subscribes again after the connection broke, with backoff, until it works or
    /// `stop` is cancelled (`None`).
    pub(super) async fn reopen(
        client: &redis::Client,
        channel: &str,
        within: Duration,
        stop: &CancellationToken,
    ) -> Option<Subscription> {
        let mut backoff = RESUBSCRIBE_MIN;
        loop {
            let attempt = tokio::select! {
                biased;
                () = stop.cancelled() => return None,
                attempt = Self::open(client, channel, within) => attempt,
            };
            match attempt {
                Ok(subscription) => {
                    info!(%channel, "Redis subscription restored");
                    return Some(subscription);
                }
                Err(reason) => debug!(%channel, %reason, ?backoff, "subscribing again failed"),
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return None,
                () = sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(RESUBSCRIBE_MAX);
        }
    }

    pub(super) async fn close(mut self, channel: &str) {
        let _ = timeout(STOP_GRACE, self.sink.unsubscribe(channel)).await;
    }
}

/// How often a quiet exchange says it is still alive; `None` when idle timeouts are off.
pub(super) fn keepalive_interval(limits: &MeshLimits) -> Option<Duration> {
    (!limits.idle_timeout.is_zero()).then(|| limits.idle_timeout / 3)
}
