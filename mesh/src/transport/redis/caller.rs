//! The caller's side of the Redis transport: publishing requests and cancels, and
//! routing what arrives on this worker's reply channel to the exchange it belongs to.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use mcpgw_wire::{Frame, MeshCodec};
use parking_lot::Mutex;
use redis::Msg;
use redis::aio::ConnectionManager;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, timeout, timeout_at};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, warn};

use super::config::RedisTransportConfig;
use super::conn::{
    RESUBSCRIBE_MAX, RESUBSCRIBE_MIN, Subscription, connect_publisher, open_client, publish,
};
use super::message::{decode_to_caller, encode_to_owner, readable, version_mismatch};
use crate::redis_conn::redact_url;
use crate::transport::calling::ExState;
use crate::transport::config::MeshLimits;
use crate::transport::error::{LinkError, MeshError};

/// The caller's side: publishes requests, and routes what arrives on this worker's
/// reply channel to the exchange it belongs to.
pub(crate) struct RedisClient {
    shared: Arc<ClientShared>,
    /// Ends the reply subscription when the client goes.
    _stop: DropGuard,
}

struct ClientShared {
    /// Announced in every request: names our reply channel at the owner.
    worker_id: String,
    /// Names the owners' request channels.
    config: RedisTransportConfig,
    /// The Redis URL without credentials, for errors.
    url: String,
    /// Frame size, timeouts.
    limits: MeshLimits,
    /// Publishes requests and cancels; clones share one multiplexed connection.
    publisher: ConnectionManager,
    /// Next exchange id.
    next_exchange: AtomicU64,
    /// Exchanges waiting for replies.
    demux: Mutex<Demux>,
    /// Whether the reply subscription is up, for forwards to wait on while it is not.
    live: watch::Sender<bool>,
    /// Bytes of replies one exchange may have queued unread before it is given up: the
    /// subscriber cannot push back on Redis (Redis would drop the whole connection), so
    /// a caller that stops reading loses its own exchange instead.
    backlog_limit: usize,
}

#[derive(Default)]
struct Demux {
    /// False while the reply subscription is down: no exchange may start waiting.
    live: bool,
    /// Where each waiting exchange's replies go.
    waiting: HashMap<u64, Waiter>,
}

struct Waiter {
    tx: mpsc::UnboundedSender<Delivery>,
    /// Payload bytes routed to the exchange and not yet read.
    backlog: Arc<AtomicUsize>,
}

/// What the reply subscriber hands an exchange.
enum Delivery {
    /// A message for it, still undecoded: the exchange decodes on its own task.
    Message(Msg),
    /// Its replies are lost; the reason.
    Lost(String),
}

impl RedisClient {
    /// Connects the publisher, subscribes to the reply channel and starts routing.
    pub(crate) async fn new(
        config: RedisTransportConfig,
        worker_id: String,
        limits: MeshLimits,
    ) -> Result<Self, MeshError> {
        let url = redact_url(&config.redis_url);
        let client = open_client(&config, &limits)?;
        let publisher = connect_publisher(&client, &limits, &url).await?;
        let reply_channel = config.reply_channel(&worker_id);
        let subscription = Subscription::open(&client, &reply_channel, limits.connect_timeout)
            .await
            .map_err(|reason| {
                MeshError::Redis(format!(
                    "cannot subscribe to {reply_channel} at {url}: {reason}"
                ))
            })?;
        // Replies of an earlier process under this worker id must not match ours.
        let first_exchange = getrandom::u64().unwrap_or_else(|_| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or_default()
        });
        let shared = Arc::new(ClientShared {
            worker_id,
            config,
            url,
            backlog_limit: limits.max_frame.saturating_mul(4),
            limits,
            publisher,
            next_exchange: AtomicU64::new(first_exchange),
            demux: Mutex::new(Demux {
                live: true,
                waiting: HashMap::new(),
            }),
            live: watch::channel(true).0,
        });
        let stop = CancellationToken::new();
        tokio::spawn(reply_loop(
            shared.clone(),
            client,
            reply_channel,
            subscription,
            stop.clone(),
        ));
        Ok(Self {
            shared,
            _stop: stop.drop_guard(),
        })
    }

    /// Publishes `frame` (a request) to worker `expect`'s channel, waiting for the
    /// reply subscription first if it is being restored.
    pub(crate) async fn send_request(
        &self,
        expect: &str,
        frame: &Frame,
        deadline: Instant,
    ) -> Result<RedisExchange, MeshError> {
        let shared = &self.shared;
        let owner_channel = shared.config.request_channel(expect);
        let down = || {
            MeshError::Redis(format!(
                "this worker's reply subscription on Redis at {} is down: the request was not \
                 sent; retry later",
                shared.url
            ))
        };
        let exchange_id = shared.next_exchange.fetch_add(1, Ordering::Relaxed);
        let mut codec = MeshCodec::new(shared.limits.max_frame);
        let payload = encode_to_owner(&mut codec, exchange_id, &shared.worker_id, frame)
            .map_err(|e| MeshError::RequestTooLarge(e.to_string()))?;
        let mut live = shared.live.subscribe();
        let wait_until = deadline.min(Instant::now() + shared.limits.connect_timeout);
        match timeout_at(wait_until, live.wait_for(|up| *up)).await {
            Ok(Ok(_)) => {}
            _ => return Err(down()),
        }
        let (rx, backlog) = shared.register(exchange_id).ok_or_else(down)?;
        let mut exchange = RedisExchange {
            shared: shared.clone(),
            exchange: exchange_id,
            owner_channel,
            rx,
            backlog,
            codec,
            state: ExState::Open,
            released: false,
        };
        let mut publisher = shared.publisher.clone();
        let published = timeout_at(
            deadline,
            publish(&mut publisher, &exchange.owner_channel, &payload),
        )
        .await;
        match published {
            // Still Open: dropping the exchange cancels whatever reached the owner.
            Err(_) => Err(MeshError::DeadlineExceeded),
            Ok(Ok(0)) => {
                // Nobody received it, so there is nothing to cancel.
                exchange.state = ExState::Clean;
                Err(MeshError::Refused {
                    addr: exchange.owner_channel.clone(),
                })
            }
            Ok(Ok(n)) => {
                if n > 1 {
                    warn!(channel = %exchange.owner_channel, subscribers = n,
                        "a mesh request channel has several subscribers: the request may run more than once");
                }
                Ok(exchange)
            }
            Ok(Err(e))
                if e.is_connection_refusal() || matches!(e.kind(), redis::ErrorKind::Server(_)) =>
            {
                // Redis was unreachable or refused the command: nothing went out.
                exchange.state = ExState::Clean;
                Err(MeshError::Redis(format!(
                    "Redis at {} did not take the request ({}): it was not sent",
                    shared.url, e
                )))
            }
            Ok(Err(e)) => Err(MeshError::LostMidResponse(format!(
                "publishing the request to Redis at {} failed ({e}): it may have been delivered",
                shared.url
            ))),
        }
    }
}

impl ClientShared {
    /// Starts routing replies for `exchange`, unless the reply subscription is down.
    fn register(
        &self,
        exchange: u64,
    ) -> Option<(mpsc::UnboundedReceiver<Delivery>, Arc<AtomicUsize>)> {
        let mut demux = self.demux.lock();
        if !demux.live {
            return None;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let backlog = Arc::new(AtomicUsize::new(0));
        demux.waiting.insert(
            exchange,
            Waiter {
                tx,
                backlog: backlog.clone(),
            },
        );
        Some((rx, backlog))
    }

    fn forget(&self, exchange: u64) {
        self.demux.lock().waiting.remove(&exchange);
    }

    /// Hands a reply to its exchange.
    fn route(&self, message: Msg) {
        let payload = message.get_payload_bytes();
        let size = payload.len();
        let exchange = match decode_to_caller(payload) {
            Ok(m) => m.exchange,
            Err(reason) => {
                warn!(%reason, "dropped a malformed message on this worker's reply channel");
                return;
            }
        };
        let mut demux = self.demux.lock();
        let Some(waiter) = demux.waiting.get(&exchange) else {
            debug!(
                exchange,
                "reply for an exchange that no longer waits; dropped"
            );
            return;
        };
        let backlog = waiter.backlog.fetch_add(size, Ordering::Relaxed) + size;
        if backlog > self.backlog_limit {
            if let Some(waiter) = demux.waiting.remove(&exchange) {
                let _ = waiter.tx.send(Delivery::Lost(format!(
                    "the response was not read: more than {} bytes of it were waiting",
                    self.backlog_limit
                )));
            }
            return;
        }
        let _ = waiter.tx.send(Delivery::Message(message));
    }

    /// Marks the reply subscription up or down; going down fails every waiting exchange.
    fn set_live(&self, live: bool, reason: &str) {
        let mut demux = self.demux.lock();
        demux.live = live;
        if !live {
            for (_, waiter) in demux.waiting.drain() {
                let _ = waiter.tx.send(Delivery::Lost(reason.to_owned()));
            }
        }
        self.live.send_replace(live);
    }
}

/// Reads this worker's reply channel until the client is dropped, subscribing again
/// whenever the pub/sub connection breaks.
async fn reply_loop(
    shared: Arc<ClientShared>,
    client: redis::Client,
    channel: String,
    mut subscription: Subscription,
    stop: CancellationToken,
) {
    loop {
        loop {
            let message = tokio::select! {
                biased;
                () = stop.cancelled() => {
                    shared.set_live(false, "the mesh client was dropped");
                    subscription.close(&channel).await;
                    return;
                }
                message = subscription.messages.next() => message,
            };
            match message {
                Some(message) => shared.route(message),
                None => break,
            }
        }
        warn!(%channel, "the Redis connection of this worker's reply channel broke; failing the forwards waiting on it and subscribing again");
        shared.set_live(
            false,
            "this worker's Redis reply subscription broke: replies may be lost",
        );
        let within = shared.limits.connect_timeout;
        match Subscription::reopen(&client, &channel, within, &stop).await {
            Some(again) => {
                subscription = again;
                shared.set_live(true, "");
            }
            None => {
                shared.set_live(false, "the mesh client was dropped");
                return;
            }
        }
    }
}

/// One request's replies, caller side.
pub(crate) struct RedisExchange {
    /// Publisher, demux and limits.
    shared: Arc<ClientShared>,
    /// This exchange's id in every message.
    exchange: u64,
    /// The owner's request channel, for `Cancel`.
    owner_channel: String,
    /// Replies routed here by the subscriber.
    rx: mpsc::UnboundedReceiver<Delivery>,
    /// Shared with the subscriber's waiter entry.
    backlog: Arc<AtomicUsize>,
    /// Decodes replies with this client's frame limit.
    codec: MeshCodec,
    pub(crate) state: ExState,
    /// Set once the exchange stopped waiting (and cancelled, if it had to).
    released: bool,
}

impl RedisExchange {
    /// The owner's next frame. Keep-alives are consumed here; silence for the idle
    /// timeout is a broken link.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        let idle = self.shared.limits.idle_timeout;
        loop {
            let delivery = if idle.is_zero() {
                self.rx.recv().await
            } else {
                match timeout(idle, self.rx.recv()).await {
                    Ok(delivery) => delivery,
                    Err(_) => {
                        return Err(LinkError::Broken {
                            reason: format!(
                                "the owner sent nothing, not even a keep-alive, for {idle:?}: presumed dead"
                            ),
                            tls: None,
                        });
                    }
                }
            };
            let message = match delivery {
                Some(Delivery::Message(message)) => message,
                Some(Delivery::Lost(reason)) => {
                    return Err(LinkError::Broken { reason, tls: None });
                }
                None => {
                    return Err(LinkError::Broken {
                        reason: "the mesh client stopped routing replies".into(),
                        tls: None,
                    });
                }
            };
            let payload = message.get_payload_bytes();
            self.backlog.fetch_sub(payload.len(), Ordering::Relaxed);
            // The subscriber routed it by this header, so it parses.
            let Ok(reply) = decode_to_caller(payload) else {
                continue;
            };
            if !readable(reply.version) {
                // Its frame may be laid out differently; the version says enough.
                return Ok(Some(version_mismatch(reply.version)));
            }
            if reply.frame.is_empty() {
                continue;
            }
            return self
                .codec
                .decode_frame(reply.frame)
                .map(Some)
                .map_err(LinkError::BadFrame);
        }
    }

    /// Stops waiting; an exchange that did not end cleanly is cancelled at the owner.
    pub(crate) fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        self.shared.forget(self.exchange);
        if self.state == ExState::Clean {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(payload) = encode_to_owner(
            &mut self.codec,
            self.exchange,
            &self.shared.worker_id,
            &Frame::Cancel,
        ) else {
            return;
        };
        let publisher = self.shared.publisher.clone();
        let channel = std::mem::take(&mut self.owner_channel);
        let limits = &self.shared.limits;
        let give_up_after = limits.idle_timeout.max(limits.connect_timeout);
        runtime.spawn(publish_cancel(publisher, channel, payload, give_up_after));
    }
}

impl Drop for RedisExchange {
    fn drop(&mut self) {
        self.release();
    }
}

/// Publishes a `Cancel` until the owner's channel has a subscriber to take it (it may
/// be re-subscribing after a Redis hiccup), for at most `give_up_after`.
async fn publish_cancel(
    mut publisher: ConnectionManager,
    channel: String,
    payload: Bytes,
    give_up_after: Duration,
) {
    let until = Instant::now() + give_up_after;
    let mut backoff = RESUBSCRIBE_MIN;
    loop {
        match publish(&mut publisher, &channel, &payload).await {
            Ok(n) if n > 0 => return,
            Ok(_) => debug!(%channel, "Cancel reached no subscriber"),
            Err(e) => debug!(%channel, error = %e, "publishing Cancel failed"),
        }
        if Instant::now() + backoff > until {
            debug!(%channel, "gave up cancelling at the owner");
            return;
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(RESUBSCRIBE_MAX);
    }
}
