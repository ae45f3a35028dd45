//! The owner's side of the Redis transport: the subscriber of this worker's request
//! channel, and the exchanges it runs (admission, deadline, keep-alives, `Cancel`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::pending;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use mcpgw_wire::{
    ErrorFrame, ErrorKind, Frame, MeshCodec, PROTOCOL_VERSION, RequestFrame, WireError,
};
use parking_lot::Mutex;
use redis::aio::ConnectionManager;
use redis::{Msg, RedisError};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::config::RedisTransportConfig;
use super::conn::{
    STOP_GRACE, Subscription, connect_publisher, keepalive_interval, open_client, publish, scrub,
};
use super::message::{
    MESSAGE_VERSION, decode_to_owner, encode_to_caller, readable, valid_worker_id, version_mismatch,
};
use crate::redis_conn::redact_url;
use crate::transport::config::TransportKind;
use crate::transport::error::MeshError;
use crate::transport::service::{PeerInfo, ResponsePart};
use crate::transport::serving::{
    FrameQueue, ResponseOrder, ServerShared, admit_request, head_deadline_of, queue_ready, refusal,
};

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
    // One listener per worker channel (docs/architecture.md, invariant 2). Counted after subscribing,
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
                scrub(&e.to_string(), &client)
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
        if !readable(m.version) {
            warn!(peer_worker = %m.caller, theirs = m.version, ours = PROTOCOL_VERSION,
                "mesh peer speaks another protocol version; refusing its request");
            self.answer(m.caller, m.exchange, version_mismatch(m.version));
            return;
        }
        match self.codec.decode_frame(m.frame) {
            Ok(Frame::Request(request)) => self.start(m.caller, m.exchange, *request),
            Ok(Frame::Cancel) => {
                let running = self.running.lock();
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
            queue: ReplyQueue::new(exchange, self.shared.limits.max_frame),
            last_sent: Instant::now(),
        }
    }

    /// Registers the exchange (for `Cancel`) and runs it in its own task.
    fn start(self: &Arc<Self>, caller: &str, exchange: u64, request: RequestFrame) {
        let key = (caller.to_owned(), exchange);
        let cancel = CancellationToken::new();
        match self.running.lock().entry(key.clone()) {
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
            owner.running.lock().remove(&key);
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
        let deadline = head_deadline_of(&request);
        // Over Redis, the trust boundary, a caller's budget is its declared worker id.
        let slot = match admit_request(shared, caller, &request) {
            Ok(slot) => slot,
            Err(refused) => return reply.finish(&refused).await,
        };
        let mut response = shared.service.serve(request, redis_peer(caller));
        let mut order = ResponseOrder::new(slot, request_id);
        let relayed = self
            .relay(
                caller,
                &mut reply,
                &mut response,
                &mut order,
                deadline,
                cancel,
            )
            .await;
        // The service stops before the last message goes out.
        drop(response);
        match relayed {
            Relayed::Last(frame) => reply.finish(&frame).await,
            Relayed::Unanswered => {}
            Relayed::Stopped => {
                let message = "the owner stopped while the response was running";
                let frame = refusal(ErrorKind::Internal, message);
                let _ = timeout(STOP_GRACE, reply.finish(&frame)).await;
            }
        }
    }

    /// Publishes the service's response as it is produced, with keep-alives while it
    /// is quiet, until it ends or something stops it.
    async fn relay(
        &self,
        caller: &str,
        reply: &mut Replier,
        response: &mut BoxStream<'static, ResponsePart>,
        order: &mut ResponseOrder,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Relayed {
        let shared = &self.shared;
        let request_id = order.request_id();
        let keepalive = keepalive_interval(&shared.limits);
        loop {
            let head_sent = order.head_sent();
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
                () = shared.stop.cancelled() => return Relayed::Stopped,
                () = cancel.cancelled() => {
                    // The caller dropped its exchange: nobody reads an answer.
                    debug!(request_id, peer = %caller, "mesh request cancelled by caller");
                    return Relayed::Unanswered;
                }
                () = head_deadline => {
                    debug!(request_id, peer = %caller, "mesh request deadline passed; stopped");
                    let message = "the request's deadline passed at the owner";
                    return Relayed::Last(refusal(ErrorKind::DeadlineExceeded, message));
                }
                () = quiet => reply.send(None).await,
                part = response.next() => match queue_ready(&mut reply.queue, order, part, response) {
                    // Goes out with what was queued before it, in `finish`.
                    Some(last) => return Relayed::Last(last),
                    None => reply.flush().await,
                },
            };
            if let Some(relayed) = sent.ends_relay(request_id, caller) {
                return relayed;
            }
        }
    }
}

/// Who sent a request over Redis: no socket and no certificate, as Redis stands
/// between the workers.
fn redis_peer(caller: &str) -> PeerInfo {
    PeerInfo {
        addr: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        identity: "".into(),
        worker_id: caller.into(),
        transport: TransportKind::Redis,
        protocol: MESSAGE_VERSION,
        connection: 0,
    }
}

/// How the relay of a response ended.
enum Relayed {
    /// The response ended, or stopped for a reason this frame tells the caller.
    Last(Frame),
    /// Nobody reads an answer: the caller cancelled or left.
    Unanswered,
    /// The server stops; the caller is told if Redis takes it in time.
    Stopped,
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

impl Sent {
    /// How the relay ends after this reply, or `None` when it goes on.
    fn ends_relay(self, request_id: u64, caller: &str) -> Option<Relayed> {
        match self {
            Sent::Delivered => None,
            Sent::CallerGone => {
                debug!(request_id, peer = %caller, "mesh caller's reply channel has no subscriber: caller gone; request stopped");
                Some(Relayed::Unanswered)
            }
            Sent::Unencodable(e) => {
                warn!(request_id, error = %e, "mesh response head cannot be encoded");
                let message = format!("owner cannot encode the response: {e}");
                Some(Relayed::Last(refusal(ErrorKind::Internal, message)))
            }
            Sent::Failed(reason) => {
                // The message may be lost, so the stream is broken either way; try to
                // say so (the publisher may have reconnected by now).
                warn!(request_id, peer = %caller, %reason, "publishing a mesh reply failed; request stopped");
                let message = format!("owner could not publish the response: {reason}");
                Some(Relayed::Last(refusal(ErrorKind::Internal, message)))
            }
        }
    }
}

/// One exchange's replies, encoded and not yet published, in order.
struct ReplyQueue {
    exchange: u64,
    codec: MeshCodec,
    messages: Vec<Bytes>,
    /// Their bytes, to bound how much of a fast response is gathered at once.
    bytes: usize,
}

impl ReplyQueue {
    fn new(exchange: u64, max_frame: usize) -> Self {
        Self {
            exchange,
            codec: MeshCodec::new(max_frame),
            messages: Vec::new(),
            bytes: 0,
        }
    }

    /// Queues `frame` (`None`: a keep-alive) behind the messages already queued.
    fn push(&mut self, frame: Option<&Frame>) -> Result<(), WireError> {
        let payload = encode_to_caller(&mut self.codec, self.exchange, frame)?;
        self.bytes += payload.len();
        self.messages.push(payload);
        Ok(())
    }

    fn clear(&mut self) {
        self.bytes = 0;
        self.messages.clear();
    }
}

impl FrameQueue for ReplyQueue {
    fn queue(&mut self, frame: Frame) -> Result<(), WireError> {
        self.push(Some(&frame))
    }

    fn queued_len(&self) -> usize {
        self.bytes
    }

    /// A frame's worth: published before more is gathered.
    fn gather_limit(&self) -> usize {
        self.codec.max_frame()
    }

    fn max_chunk(&self) -> usize {
        Frame::max_chunk(self.codec.max_frame())
    }
}

/// Publishes one exchange's replies, in order, to the caller's reply channel.
struct Replier {
    publisher: ConnectionManager,
    channel: String,
    queue: ReplyQueue,
    /// When a message last went out, for keep-alives.
    last_sent: Instant,
}

impl Replier {
    /// Publishes what is queued: one `PUBLISH`, or a pipeline of them (one write and
    /// one round trip to Redis, in order).
    async fn flush(&mut self) -> Sent {
        let published = match self.queue.messages.as_slice() {
            [] => return Sent::Delivered,
            [one] => publish(&mut self.publisher, &self.channel, one)
                .await
                .map(|receivers| receivers > 0),
            many => {
                let mut pipeline = redis::pipe();
                for payload in many {
                    pipeline
                        .cmd("PUBLISH")
                        .arg(&self.channel)
                        .arg(payload.as_ref());
                }
                pipeline
                    .query_async::<Vec<i64>>(&mut self.publisher)
                    .await
                    .map(|receivers| receivers.iter().all(|&n| n > 0))
            }
        };
        self.queue.clear();
        match published {
            Ok(false) => Sent::CallerGone,
            Ok(true) => {
                self.last_sent = Instant::now();
                Sent::Delivered
            }
            Err(e) => Sent::Failed(e.to_string()),
        }
    }

    /// Publishes `frame` (`None`: a keep-alive) after whatever is queued.
    async fn send(&mut self, frame: Option<&Frame>) -> Sent {
        match self.queue.push(frame) {
            Ok(()) => self.flush().await,
            Err(e) => Sent::Unencodable(e),
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

#[cfg(test)]
mod tests {
    use futures_util::stream;

    use super::*;
    use crate::transport::budget::{Budgets, StreamClass};
    use mcpgw_wire::ResponseHead;

    fn json_head() -> ResponsePart {
        ResponsePart::Head(ResponseHead {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
        })
    }

    fn order() -> (ResponseOrder, Arc<Budgets>) {
        let budgets = Budgets::new(4, 4);
        let slot = budgets.admit("peer", StreamClass::Short).expect("room");
        (ResponseOrder::new(slot, 7), budgets)
    }

    #[test]
    fn a_response_ready_at_once_is_queued_whole_for_one_pipeline() {
        let (mut order, _budgets) = order();
        let mut queue = ReplyQueue::new(3, 64 * 1024);
        let mut response: BoxStream<'static, ResponsePart> =
            stream::iter([ResponsePart::Chunk("{}".into()), ResponsePart::End]).boxed();
        let last = queue_ready(&mut queue, &mut order, Some(json_head()), &mut response);
        assert!(matches!(last, Some(Frame::End)));
        assert_eq!(queue.messages.len(), 2, "head and chunk wait for the end");
    }

    #[test]
    fn a_stream_publishes_what_is_ready_and_waits_for_the_rest() {
        let (mut order, _budgets) = order();
        let mut queue = ReplyQueue::new(3, 64 * 1024);
        let later = stream::once(async {
            tokio::task::yield_now().await;
            ResponsePart::Chunk("event".into())
        });
        let mut response: BoxStream<'static, ResponsePart> =
            stream::iter([ResponsePart::Chunk("first".into())])
                .chain(later)
                .boxed();
        let last = queue_ready(&mut queue, &mut order, Some(json_head()), &mut response);
        assert!(last.is_none(), "the response goes on");
        assert_eq!(
            queue.messages.len(),
            2,
            "head and the ready chunk, not the later one"
        );
    }

    #[test]
    fn a_fast_response_is_published_a_frame_at_a_time() {
        let (mut order, _budgets) = order();
        let max_frame = 1024;
        let mut queue = ReplyQueue::new(3, max_frame);
        let big = Bytes::from(vec![b'x'; 3 * max_frame]);
        let mut response: BoxStream<'static, ResponsePart> =
            stream::iter([ResponsePart::Chunk(big), ResponsePart::End]).boxed();
        let last = queue_ready(&mut queue, &mut order, Some(json_head()), &mut response);
        assert!(last.is_none(), "the end waits for the next round");
        let messages = &queue.messages;
        assert!(messages.len() > 3, "the chunk was split to fit frames");
        assert!(messages.iter().all(|m| m.len() <= max_frame + 64));
    }
}
