//! Redis pub/sub transport: the measured baseline (`--mesh-transport redis`), never the
//! default.
//!
//! The established way to reach the worker that owns a session is to pass the request
//! through Redis pub/sub. mcpgw implements it behind the same [`MeshServer`] /
//! [`MeshClient`] interface as QUIC and TCP, and as well as it can be built (no polling,
//! one Redis round trip per message, `Bytes` end to end), so that benchmarks compare
//! the designs rather than a weak implementation of one of them.
//!
//! # Trust
//!
//! There is no mTLS here: Redis is the trust boundary, as in the baseline design. Any
//! client that may `PUBLISH` on this Redis can send a worker a request with any auth
//! context, so the Redis must be private to the fleet (network policy, ACL user,
//! `rediss://`). [`PeerInfo::identity`] is empty and [`PeerInfo::addr`] unspecified
//! for requests that came this way.
//!
//! # Channels
//!
//! - `{prefix}pool_rpc:{worker_id}`: the worker's request channel. Its mesh server is
//!   the one subscriber, on a dedicated pub/sub connection (DESIGN invariant 2: a
//!   second subscriber would run each request twice, so binding refuses when the
//!   channel has another one). Callers publish `Request` and `Cancel` there.
//! - `{prefix}pool_reply:{worker_id}`: the worker's reply channel, one per caller
//!   worker rather than one per request: subscribing per request would add two Redis
//!   round trips to every request, and the request could only go out once the
//!   subscription was confirmed. The caller's mesh client is its one subscriber and
//!   routes each reply to its request by the exchange id in the message.
//!
//! The channel follows from the worker id, so the address the directory holds for a
//! Redis worker is informational, and "answers as another worker" cannot happen.
//!
//! # Messages
//!
//! Each payload is a short routing header and one `mcpgw-wire` frame, the bytes
//! [`MeshCodec`] produces (length prefix, bincode-format body); integers big-endian:
//!
//! ```text
//! to the owner:  version u32 | exchange u64 | caller id length u16 | caller id | frame
//! to the caller: version u32 | exchange u64 | frame, or nothing for a keep-alive
//! ```
//!
//! The version, exchange id and caller id keep their place in every protocol version,
//! so an owner of another version can still answer `Error(VersionMismatch)` to the
//! right caller. Exchange ids are the caller's (from a random start, so a reply meant
//! for an earlier process under the same id is not taken for a new request's).
//!
//! A response is `Head`, `Chunk`*, `End` | `Error`, one message each, published as the
//! service produces them, so SSE events arrive one by one. An exchange awaits each
//! `PUBLISH` before the next: that keeps the order, and the reply says how many
//! subscribers got the message.
//!
//! # Refused, unknown, alive
//!
//! - A request `PUBLISH` that reaches no subscriber proves that no process serves the
//!   owner's channel: [`MeshError::Refused`], and the request went nowhere. (During a
//!   Redis restart every worker is briefly unsubscribed, so this proof is only as good
//!   as Redis's uptime; that is inherent to the baseline design.)
//! - An owner whose reply reaches no subscriber knows its caller is gone and stops.
//! - While a response is quiet, the owner publishes a keep-alive every third of its
//!   [`MeshLimits::idle_timeout`]; a caller that hears nothing at all from the owner for
//!   its idle timeout presumes it dead ([`MeshError::LostMidResponse`]), as the QUIC
//!   idle timeout and TCP keepalive do for the other transports. A zero idle timeout
//!   turns both off. The request's deadline bounds the time to the head as usual;
//!   after the head the stream runs on.
//!
//! # Cancellation
//!
//! Dropping a [`ForwardedResponse`] (or the forward future) before the end publishes
//! `Cancel` for its exchange to the owner's channel, and the owner drops the service's
//! stream. A `Cancel` that reaches no subscriber (the owner is re-subscribing) is
//! published again for a while. Pub/sub keeps nothing, so best effort is all there is.
//!
//! # Reconnection
//!
//! Publishing goes over a [`ConnectionManager`], which reconnects by itself. Pub/sub
//! connections do not: each subscription runs in a task that re-subscribes, with
//! backoff, as soon as its stream ends. While the caller's reply subscription is down,
//! every exchange waiting on it fails ([`MeshError::LostMidResponse`]: its replies may
//! be lost) and new forwards wait for it up to the connect timeout.
//!
//! [`MeshServer`]: super::MeshServer
//! [`MeshClient`]: super::MeshClient
//! [`ForwardedResponse`]: super::ForwardedResponse

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::future::pending;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::StreamExt;
use mcpgw_wire::{
    ErrorFrame, ErrorKind, Frame, MeshCodec, PROTOCOL_VERSION, RequestFrame, WireError,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink, PubSubStream};
use redis::io::tcp::{TcpSettings, socket2::TcpKeepalive};
use redis::{IntoConnectionInfo, Msg, ProtocolVersion, RedisError};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout, timeout_at};
use tokio_util::codec::Encoder;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, info, warn};

use super::client::ExState;
use super::error::LinkError;
use super::server::ServerShared;
use super::{MeshError, MeshLimits, PeerInfo, ResponsePart, TransportKind};
use crate::directory::redact_url;

/// First wait before subscribing again after a subscription broke; doubles per failure.
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two subscription attempts: a restarted Redis is found within it.
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(1);
/// How long a stopping server waits for Redis to confirm that it unsubscribed, and an
/// exchange cut off by a stop for its last error frame to go out.
const STOP_GRACE: Duration = Duration::from_secs(1);
/// Bytes before the frame in a message to the caller: version and exchange id.
const REPLY_HEADER: usize = 12;

/// Where the Redis transport finds Redis, and how it names its channels.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTransportConfig {
    /// `redis://[user:password@]host:port[/db]`, normally the fleet directory's Redis.
    /// The password never appears in errors or logs.
    pub redis_url: String,
    /// Prepended to every channel name (as to the directory's keys), so that several
    /// fleets can share one Redis.
    pub prefix: String,
}

impl Default for RedisTransportConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".into(),
            prefix: "mcpgw:".into(),
        }
    }
}

impl fmt::Debug for RedisTransportConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransportConfig")
            .field("redis_url", &redact_url(&self.redis_url))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisTransportConfig {
    /// The channel worker `worker_id` takes requests on: `{prefix}pool_rpc:{worker_id}`.
    pub fn request_channel(&self, worker_id: &str) -> String {
        format!("{}pool_rpc:{worker_id}", self.prefix)
    }

    /// The channel worker `worker_id` takes replies on: `{prefix}pool_reply:{worker_id}`.
    pub fn reply_channel(&self, worker_id: &str) -> String {
        format!("{}pool_reply:{worker_id}", self.prefix)
    }
}

// ---------------------------------------------------------------- messages

/// A message on a worker's request channel, borrowed from its payload.
#[derive(Debug)]
struct ToOwner<'a> {
    version: u32,
    exchange: u64,
    /// The caller's worker id: names its reply channel.
    caller: &'a str,
    /// One encoded frame.
    frame: &'a [u8],
}

/// A message on a worker's reply channel, borrowed from its payload.
#[derive(Debug)]
struct ToCaller<'a> {
    version: u32,
    exchange: u64,
    /// One encoded frame; empty for a keep-alive.
    frame: &'a [u8],
}

fn encode_to_owner(
    codec: &mut MeshCodec,
    exchange: u64,
    caller: &str,
    frame: &Frame,
) -> Result<Bytes, WireError> {
    let caller_len = u16::try_from(caller.len())
        .map_err(|_| WireError::Unencodable("the worker id is longer than 65535 bytes".into()))?;
    let mut buf = BytesMut::with_capacity(REPLY_HEADER + 2 + caller.len());
    buf.put_u32(PROTOCOL_VERSION);
    buf.put_u64(exchange);
    buf.put_u16(caller_len);
    buf.put_slice(caller.as_bytes());
    // Encoded in place behind the header: the same bytes `encode_frame` makes, without
    // copying them into a second buffer.
    codec.encode(frame, &mut buf)?;
    Ok(buf.freeze())
}

fn encode_to_caller(
    codec: &mut MeshCodec,
    exchange: u64,
    frame: Option<&Frame>,
) -> Result<Bytes, WireError> {
    let mut buf = BytesMut::with_capacity(REPLY_HEADER);
    buf.put_u32(PROTOCOL_VERSION);
    buf.put_u64(exchange);
    if let Some(frame) = frame {
        codec.encode(frame, &mut buf)?;
    }
    Ok(buf.freeze())
}

/// Splits off the fixed header fields; never panics, whatever the bytes.
fn header(payload: &[u8]) -> Result<(u32, u64, &[u8]), String> {
    let short = || {
        format!(
            "a {}-byte message is shorter than its header",
            payload.len()
        )
    };
    let (version, rest) = payload.split_first_chunk::<4>().ok_or_else(short)?;
    let (exchange, rest) = rest.split_first_chunk::<8>().ok_or_else(short)?;
    Ok((
        u32::from_be_bytes(*version),
        u64::from_be_bytes(*exchange),
        rest,
    ))
}

fn decode_to_owner(payload: &[u8]) -> Result<ToOwner<'_>, String> {
    let (version, exchange, rest) = header(payload)?;
    let (len, rest) = rest
        .split_first_chunk::<2>()
        .ok_or("the message ends before the caller id")?;
    let len = usize::from(u16::from_be_bytes(*len));
    if rest.len() < len {
        return Err(format!(
            "the caller id is said to be {len} bytes, the message holds {}",
            rest.len()
        ));
    }
    let (caller, frame) = rest.split_at(len);
    let caller = std::str::from_utf8(caller).map_err(|_| "the caller id is not UTF-8")?;
    Ok(ToOwner {
        version,
        exchange,
        caller,
        frame,
    })
}

fn decode_to_caller(payload: &[u8]) -> Result<ToCaller<'_>, String> {
    let (version, exchange, frame) = header(payload)?;
    Ok(ToCaller {
        version,
        exchange,
        frame,
    })
}

/// Whether `id` can name a reply channel: 1 to 256 visible ASCII characters, as the
/// directory requires of worker ids.
fn valid_worker_id(id: &str) -> bool {
    (1..=256).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

fn version_mismatch(theirs: u32) -> Frame {
    Frame::Error(ErrorFrame::new(
        ErrorKind::VersionMismatch,
        format!(
            "this worker speaks mesh protocol version {PROTOCOL_VERSION}, the peer {theirs}: \
             run the same mcpgw version on every worker"
        ),
    ))
}

// ---------------------------------------------------------------- Redis plumbing

/// A Redis client for `cfg` whose sockets suit the mesh: no Nagle delay on small
/// messages, and keepalive probes so that a vanished Redis host ends a quiet pub/sub
/// connection instead of leaving it open forever.
fn open_client(
    cfg: &RedisTransportConfig,
    limits: &MeshLimits,
) -> Result<redis::Client, MeshError> {
    // The parse error text may quote the URL, so it is not passed on.
    let unparsable = |_| {
        MeshError::Redis(format!(
            "Redis URL {} does not parse: expected redis://[user:password@]host:port[/db]",
            redact_url(&cfg.redis_url)
        ))
    };
    let info = cfg
        .redis_url
        .as_str()
        .into_connection_info()
        .map_err(unparsable)?;
    let idle = limits.idle_timeout.max(Duration::from_secs(1));
    let keepalive = TcpKeepalive::new()
        .with_time(idle)
        .with_interval((idle / 3).max(Duration::from_secs(1)));
    let tcp = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    redis::Client::open(info.set_tcp_settings(tcp)).map_err(unparsable)
}

/// Removes the Redis password from an error text, in case one echoes it.
fn scrub(text: String, client: &redis::Client) -> String {
    match client.get_connection_info().redis_settings().password() {
        Some(p) if !p.is_empty() => text.replace(p, "***"),
        _ => text,
    }
}

/// The multiplexed, self-reconnecting connection that publishes. Each command gets the
/// connect timeout: Redis answers a `PUBLISH` at once unless it is in trouble.
///
/// It speaks RESP3 (Redis 6 or later): over RESP3 the connection manager learns of a
/// closed connection the moment it happens and reconnects at once, while over RESP2 it
/// only learns when the next command fails, and a lost `PUBLISH` would cost a request
/// or a response. (Pub/sub connections stay on RESP2, which any Redis speaks.)
async fn connect_publisher(
    client: &redis::Client,
    limits: &MeshLimits,
    url: &str,
) -> Result<ConnectionManager, MeshError> {
    let info = client.get_connection_info().clone();
    let resp3 = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    let resp3_client = redis::Client::open(info.set_redis_settings(resp3)).map_err(|e| {
        MeshError::Redis(format!("Redis at {url}: {}", scrub(e.to_string(), client)))
    })?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(limits.connect_timeout))
        .set_response_timeout(Some(limits.connect_timeout))
        .set_min_delay(RESUBSCRIBE_MIN)
        .set_max_delay(RESUBSCRIBE_MAX);
    match timeout(
        limits.connect_timeout,
        ConnectionManager::new_with_config(resp3_client, config),
    )
    .await
    {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(MeshError::Redis(format!(
            "cannot connect to Redis at {url} (the Redis transport needs Redis 6 or later): {}",
            scrub(e.to_string(), client)
        ))),
        Err(_) => Err(MeshError::Redis(format!(
            "Redis at {url} did not answer within {:?}",
            limits.connect_timeout
        ))),
    }
}

/// Publishes `payload`; the number of subscribers that received it.
async fn publish(
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
struct Subscription {
    /// Kept to unsubscribe explicitly on stop, so that Redis counts no subscriber as
    /// soon as the worker is gone, not when it notices the closed socket.
    sink: PubSubSink,
    /// The channel's messages; ends when the connection does.
    messages: PubSubStream,
}

impl Subscription {
    async fn open(
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
            Ok(Err(e)) => Err(scrub(e.to_string(), client)),
            Err(_) => Err(format!(
                "Redis did not confirm the subscription within {within:?}"
            )),
        }
    }

    /// Subscribes again after the connection broke, with backoff, until it works or
    /// `stop` is cancelled (`None`).
    async fn reopen(
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

    async fn close(mut self, channel: &str) {
        let _ = timeout(STOP_GRACE, self.sink.unsubscribe(channel)).await;
    }
}

/// Locks a mutex whose data stays consistent even if a holder panicked (plain maps
/// changed by single inserts and removals).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How often a quiet exchange says it is still alive; `None` when idle timeouts are off.
fn keepalive_interval(limits: &MeshLimits) -> Option<Duration> {
    (!limits.idle_timeout.is_zero()).then(|| limits.idle_timeout / 3)
}

// ---------------------------------------------------------------- server side

/// The owner's side: the request channel's subscriber and the exchanges it runs.
struct Owner {
    /// Service, limits, draining and stop state shared with the handle.
    shared: Arc<ServerShared>,
    /// Opens the pub/sub connection again after it broke.
    client: redis::Client,
    /// Publishes replies; clones share one multiplexed connection.
    publisher: ConnectionManager,
    /// Names the callers' reply channels.
    config: RedisTransportConfig,
    /// This worker's request channel.
    channel: String,
    /// Decodes incoming frames with this server's frame limit.
    codec: MeshCodec,
    /// Running exchanges by caller and exchange id, so a `Cancel` finds its request.
    running: Mutex<HashMap<(String, u64), CancellationToken>>,
}

/// Connects, subscribes to the worker's request channel and starts serving it. Returns
/// the channel. Fails if Redis is unreachable or the channel has another subscriber.
pub(crate) async fn serve(
    config: &RedisTransportConfig,
    shared: Arc<ServerShared>,
) -> Result<String, MeshError> {
    let url = redact_url(&config.redis_url);
    let limits = &shared.limits;
    let client = open_client(config, limits)?;
    let mut publisher = connect_publisher(&client, limits, &url).await?;
    let channel = config.request_channel(&shared.worker_id);
    let subscription = Subscription::open(&client, &channel, limits.connect_timeout)
        .await
        .map_err(|reason| {
            MeshError::Redis(format!("cannot subscribe to {channel} at {url}: {reason}"))
        })?;
    // One listener per worker channel (DESIGN invariant 2). Counted after subscribing,
    // so two processes that start at once cannot both miss each other; the messages
    // that arrived meanwhile are dropped unread when the check fails.
    let counted: Result<(String, i64), RedisError> = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(&channel)
        .query_async(&mut publisher)
        .await;
    match counted {
        Ok((_, 1)) => {}
        Ok((_, n)) => {
            subscription.close(&channel).await;
            return Err(MeshError::Redis(format!(
                "{channel} has {} other subscriber(s): another process serves worker id {:?}; \
                 give every process its own WORKER_ID",
                n - 1,
                shared.worker_id
            )));
        }
        Err(e) => {
            subscription.close(&channel).await;
            return Err(MeshError::Redis(format!(
                "cannot count the subscribers of {channel} at {url}: {}",
                scrub(e.to_string(), &client)
            )));
        }
    }
    let owner = Arc::new(Owner {
        shared: shared.clone(),
        client,
        publisher,
        config: config.clone(),
        channel: channel.clone(),
        codec: MeshCodec::new(limits.max_frame),
        running: Mutex::new(HashMap::new()),
    });
    shared.tracker.spawn(owner.request_loop(subscription));
    Ok(channel)
}

impl Owner {
    /// Reads the request channel until the server stops, subscribing again whenever
    /// the pub/sub connection breaks.
    async fn request_loop(self: Arc<Self>, mut subscription: Subscription) {
        loop {
            loop {
                let message = tokio::select! {
                    biased;
                    () = self.shared.stop.cancelled() => {
                        subscription.close(&self.channel).await;
                        return;
                    }
                    message = subscription.messages.next() => message,
                };
                match message {
                    Some(message) => self.on_message(&message),
                    None => break,
                }
            }
            // Requests published until the subscription is back reach no subscriber, so
            // their callers get Refused. Running exchanges go on: they publish through
            // the publisher, which reconnects by itself.
            warn!(channel = %self.channel, "the Redis connection of this worker's mesh channel broke; subscribing again");
            let within = self.shared.limits.connect_timeout;
            match Subscription::reopen(&self.client, &self.channel, within, &self.shared.stop).await
            {
                Some(again) => subscription = again,
                None => return,
            }
        }
    }

    fn on_message(self: &Arc<Self>, message: &Msg) {
        let m = match decode_to_owner(message.get_payload_bytes()) {
            Ok(m) => m,
            Err(reason) => {
                // Without a whole header there is no caller to answer.
                warn!(channel = %self.channel, %reason, "dropped a malformed message on the mesh channel");
                return;
            }
        };
        if !valid_worker_id(m.caller) {
            warn!(channel = %self.channel, caller = ?m.caller, "dropped a mesh message whose caller id names no reply channel");
            return;
        }
        if m.version != PROTOCOL_VERSION {
            warn!(peer_worker = %m.caller, theirs = m.version, ours = PROTOCOL_VERSION,
                "mesh peer speaks another protocol version; refusing its request");
            self.answer(m.caller, m.exchange, version_mismatch(m.version));
            return;
        }
        match self.codec.decode_frame(m.frame) {
            Ok(Frame::Request(request)) => self.start(m.caller, m.exchange, *request),
            Ok(Frame::Cancel) => {
                let running = lock(&self.running);
                match running.get(&(m.caller.to_owned(), m.exchange)) {
                    Some(cancel) => cancel.cancel(),
                    // A Cancel that crossed the response's last message.
                    None => {
                        debug!(peer_worker = %m.caller, exchange = m.exchange, "Cancel for an exchange that is not running")
                    }
                }
            }
            Ok(other) => {
                warn!(peer_worker = %m.caller, frame = other.name(), "mesh peer sent an unexpected frame; answered with an error");
                let frame = Frame::Error(ErrorFrame::new(
                    ErrorKind::Malformed,
                    format!("expected Request or Cancel, got {}", other.name()),
                ));
                self.answer(m.caller, m.exchange, frame);
            }
            Err(e) => {
                warn!(peer_worker = %m.caller, error = %e, "mesh peer sent a bad frame; answered with an error");
                let kind = match e {
                    WireError::FrameTooLarge { .. } => ErrorKind::TooLarge,
                    _ => ErrorKind::Malformed,
                };
                self.answer(
                    m.caller,
                    m.exchange,
                    Frame::Error(ErrorFrame::new(kind, e.to_string())),
                );
            }
        }
    }

    /// Publishes one answer in the background (the subscriber never waits on Redis).
    fn answer(self: &Arc<Self>, caller: &str, exchange: u64, frame: Frame) {
        let mut reply = self.replier(caller, exchange);
        self.shared.tracker.spawn(async move {
            reply.finish(&frame).await;
        });
    }

    fn replier(&self, caller: &str, exchange: u64) -> Replier {
        Replier {
            publisher: self.publisher.clone(),
            channel: self.config.reply_channel(caller),
            exchange,
            codec: MeshCodec::new(self.shared.limits.max_frame),
            last_sent: Instant::now(),
        }
    }

    /// Registers the exchange (for `Cancel`) and runs it in its own task.
    fn start(self: &Arc<Self>, caller: &str, exchange: u64, request: RequestFrame) {
        let key = (caller.to_owned(), exchange);
        let cancel = CancellationToken::new();
        match lock(&self.running).entry(key.clone()) {
            Entry::Occupied(_) => {
                // Redis delivers a message once; a repeat is a caller bug, and running it
                // twice would break "executes exactly once".
                warn!(peer_worker = %caller, exchange, "mesh request repeats a running exchange id; ignored");
                return;
            }
            Entry::Vacant(slot) => {
                slot.insert(cancel.clone());
            }
        }
        let owner = self.clone();
        self.shared.tracker.spawn(async move {
            owner.exchange(&key.0, key.1, request, &cancel).await;
            lock(&owner.running).remove(&key);
        });
    }

    /// Serves one request: admission, the deadline to the head, streaming the service's
    /// response, keep-alives, and stopping on `Cancel`, a gone caller, or shutdown.
    async fn exchange(
        &self,
        caller: &str,
        exchange: u64,
        request: RequestFrame,
        cancel: &CancellationToken,
    ) {
        let shared = &self.shared;
        let mut reply = self.replier(caller, exchange);
        let request_id = request.request_id;
        let deadline = Instant::now() + Duration::from_millis(u64::from(request.deadline_ms));
        let refuse = |kind, message: String| Frame::Error(ErrorFrame::new(kind, message));
        if shared.draining.load(Ordering::SeqCst) {
            let message = format!("worker {} is shutting down", shared.worker_id);
            return reply.finish(&refuse(ErrorKind::Draining, message)).await;
        }
        if request.deadline_ms == 0 {
            let message = "request arrived with no time left".into();
            return reply
                .finish(&refuse(ErrorKind::DeadlineExceeded, message))
                .await;
        }
        let Some(_slot) = shared.admit(caller) else {
            let message = format!(
                "worker {} already runs {} requests for worker {caller}",
                shared.worker_id, shared.limits.max_in_flight_per_peer
            );
            return reply.finish(&refuse(ErrorKind::Busy, message)).await;
        };
        let peer = PeerInfo {
            // No socket and no certificate: Redis stands between the workers.
            addr: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            identity: String::new(),
            worker_id: caller.to_owned(),
            transport: TransportKind::Redis,
        };
        let mut response = shared.service.serve(request, peer);
        let keepalive = keepalive_interval(&shared.limits);
        let mut head_sent = false;
        let last = loop {
            let head_deadline = async {
                if head_sent {
                    pending::<()>().await
                } else {
                    sleep_until(deadline).await
                }
            };
            let quiet = async {
                match keepalive {
                    Some(every) => sleep_until(reply.last_sent + every).await,
                    None => pending::<()>().await,
                }
            };
            let sent = tokio::select! {
                biased;
                () = shared.stop.cancelled() => {
                    drop(response);
                    let frame = refuse(ErrorKind::Internal, "the owner stopped while the response was running".into());
                    let _ = timeout(STOP_GRACE, reply.finish(&frame)).await;
                    return;
                }
                () = cancel.cancelled() => {
                    // The caller dropped its exchange: nobody reads an answer.
                    debug!(request_id, peer = %caller, "mesh request cancelled by caller");
                    break None;
                }
                () = head_deadline => {
                    debug!(request_id, peer = %caller, "mesh request deadline passed; stopped");
                    break Some(refuse(ErrorKind::DeadlineExceeded, "the request's deadline passed at the owner".into()));
                }
                () = quiet => reply.send(None).await,
                part = response.next() => match part {
                    Some(ResponsePart::Head(head)) if !head_sent => {
                        head_sent = true;
                        reply.send(Some(&Frame::Head(head))).await
                    }
                    Some(ResponsePart::Chunk(bytes)) if head_sent => reply.send_chunk(bytes).await,
                    Some(ResponsePart::End) if head_sent => break Some(Frame::End),
                    Some(ResponsePart::Error(e)) => break Some(Frame::Error(e)),
                    Some(other) => {
                        warn!(request_id, part = other.name(), head_sent,
                            "mesh service produced a response out of order (Head, Chunk*, End)");
                        break Some(refuse(ErrorKind::Internal, "owner produced a malformed response".into()));
                    }
                    None => {
                        warn!(request_id, "mesh service ended a response without End");
                        break Some(refuse(ErrorKind::Internal, "owner ended the response without End".into()));
                    }
                },
            };
            match sent {
                Sent::Delivered => {}
                Sent::CallerGone => {
                    debug!(request_id, peer = %caller, "mesh caller's reply channel has no subscriber: caller gone; request stopped");
                    break None;
                }
                Sent::Unencodable(e) => {
                    warn!(request_id, error = %e, "mesh response head cannot be encoded");
                    break Some(refuse(
                        ErrorKind::Internal,
                        format!("owner cannot encode the response: {e}"),
                    ));
                }
                Sent::Failed(reason) => {
                    // The message may be lost, so the stream is broken either way; try to
                    // say so (the publisher may have reconnected by now).
                    warn!(request_id, peer = %caller, %reason, "publishing a mesh reply failed; request stopped");
                    break Some(refuse(
                        ErrorKind::Internal,
                        format!("owner could not publish the response: {reason}"),
                    ));
                }
            }
        };
        // The service stops before the last message goes out.
        drop(response);
        if let Some(frame) = last {
            reply.finish(&frame).await;
        }
    }
}

/// What became of one published reply.
enum Sent {
    /// At least one subscriber received it.
    Delivered,
    /// No subscriber on the caller's reply channel: the caller is gone.
    CallerGone,
    /// The frame cannot be encoded; nothing was published.
    Unencodable(WireError),
    /// Redis did not take it (connection lost, timeout).
    Failed(String),
}

/// Publishes one exchange's replies, in order, to the caller's reply channel.
struct Replier {
    publisher: ConnectionManager,
    channel: String,
    exchange: u64,
    codec: MeshCodec,
    /// When a message last went out, for keep-alives.
    last_sent: Instant,
}

impl Replier {
    /// Publishes `frame` (`None`: a keep-alive).
    async fn send(&mut self, frame: Option<&Frame>) -> Sent {
        let payload = match encode_to_caller(&mut self.codec, self.exchange, frame) {
            Ok(payload) => payload,
            Err(e) => return Sent::Unencodable(e),
        };
        match publish(&mut self.publisher, &self.channel, &payload).await {
            Ok(0) => Sent::CallerGone,
            Ok(_) => {
                self.last_sent = Instant::now();
                Sent::Delivered
            }
            Err(e) => Sent::Failed(e.to_string()),
        }
    }

    /// Publishes a body chunk, split so that each frame fits the maximum frame size.
    async fn send_chunk(&mut self, mut bytes: Bytes) -> Sent {
        let piece = self
            .codec
            .max_frame()
            .saturating_sub(Frame::CHUNK_OVERHEAD)
            .max(1);
        loop {
            let rest = if bytes.len() > piece {
                bytes.split_off(piece)
            } else {
                Bytes::new()
            };
            match self.send(Some(&Frame::Chunk(bytes))).await {
                Sent::Delivered if !rest.is_empty() => bytes = rest,
                sent => return sent,
            }
        }
    }

    /// Publishes the exchange's last message; its fate changes nothing any more.
    async fn finish(&mut self, frame: &Frame) {
        match self.send(Some(frame)).await {
            Sent::Delivered | Sent::CallerGone => {}
            Sent::Unencodable(e) => warn!(error = %e, "mesh answer cannot be encoded"),
            Sent::Failed(reason) => debug!(%reason, "publishing a mesh answer failed"),
        }
    }
}

// ---------------------------------------------------------------- client side

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
        let mut demux = lock(&self.demux);
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
        lock(&self.demux).waiting.remove(&exchange);
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
        let mut demux = lock(&self.demux);
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
        let mut demux = lock(&self.demux);
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
            if reply.version != PROTOCOL_VERSION {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_to_the_owner_round_trip() {
        let mut codec = MeshCodec::default();
        let payload = encode_to_owner(&mut codec, 42, "caller-1", &Frame::Cancel).unwrap();
        let m = decode_to_owner(&payload).unwrap();
        assert_eq!(m.version, PROTOCOL_VERSION);
        assert_eq!(m.exchange, 42);
        assert_eq!(m.caller, "caller-1");
        assert_eq!(codec.decode_frame(m.frame).unwrap(), Frame::Cancel);
    }

    #[test]
    fn messages_to_the_caller_round_trip() {
        let mut codec = MeshCodec::default();
        let chunk = Frame::Chunk(Bytes::from_static(b"data: 1\n\n"));
        let payload = encode_to_caller(&mut codec, u64::MAX, Some(&chunk)).unwrap();
        let m = decode_to_caller(&payload).unwrap();
        assert_eq!((m.version, m.exchange), (PROTOCOL_VERSION, u64::MAX));
        assert_eq!(codec.decode_frame(m.frame).unwrap(), chunk);
        let keepalive = encode_to_caller(&mut codec, 3, None).unwrap();
        assert!(decode_to_caller(&keepalive).unwrap().frame.is_empty());
    }

    #[test]
    fn garbage_never_panics() {
        for len in 0..40 {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let _ = decode_to_owner(&bytes);
            let _ = decode_to_caller(&bytes);
        }
        // A caller id longer than the message.
        let mut bytes = vec![0u8; 12];
        bytes.extend_from_slice(&[0xff, 0xff, b'x']);
        assert!(decode_to_owner(&bytes).is_err());
    }

    #[test]
    fn worker_ids_that_name_channels() {
        assert!(valid_worker_id("host-1-abc"));
        assert!(!valid_worker_id(""));
        assert!(!valid_worker_id("a b"));
        assert!(!valid_worker_id(&"x".repeat(257)));
    }

    #[test]
    fn channel_names_follow_the_prefix() {
        let config = RedisTransportConfig {
            prefix: "t:".into(),
            ..RedisTransportConfig::default()
        };
        assert_eq!(config.request_channel("w1"), "t:pool_rpc:w1");
        assert_eq!(config.reply_channel("w1"), "t:pool_reply:w1");
        let secret = RedisTransportConfig {
            redis_url: "redis://u:s3cret@h:1".into(),
            ..RedisTransportConfig::default()
        };
        assert!(!format!("{secret:?}").contains("s3cret"));
    }
}
