//! Resumable server-to-client streams of legacy sessions.
//!
//! Every SSE stream a session's client receives (the answer to a POST, or the session's
//! `GET` stream) is read from its upstream by the owner into a [`StreamLog`]: a bounded
//! buffer of the stream's last events, each given an id that names the owner, the
//! stream and the event's place in it (`<owner>:<stream>:<seq>`). The client's
//! connection only reads from the log. When that connection drops, the owner keeps
//! reading the upstream, and a `GET` with `Last-Event-ID` (sent to any worker: it is
//! forwarded to the owner by the session id like every request) resumes right after
//! the last event the client saw: nothing lost, nothing repeated, as long as the
//! events are still in the buffer. When they are not, the client is told so.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::body::{self, BoxError, ReplyBody};

/// Events one stream keeps for resumption; older ones are dropped.
pub const MAX_EVENTS_PER_STREAM: usize = 1024;
/// Bytes one stream keeps for resumption; older events are dropped past it.
pub const MAX_BYTES_PER_STREAM: usize = 1024 * 1024;
/// Streams one session keeps (the newest); an older finished one is forgotten first.
pub const MAX_STREAMS_PER_SESSION: usize = 16;

/// How long a reader waits for an event before it sends a keep-alive comment.
const KEEPALIVE_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// Where an event sits: the owner that numbered it, its stream, its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventId {
    pub owner: String,
    pub stream: u64,
    pub seq: u64,
}

impl EventId {
    /// Reads a `Last-Event-ID` the gateway issued; `None` for anything else.
    pub fn parse(text: &str) -> Option<EventId> {
        let mut parts = text.rsplitn(3, ':');
        let seq = parts.next()?.parse().ok()?;
        let stream = parts.next()?.parse().ok()?;
        let owner = parts.next()?;
        crate::config::valid_worker_id(owner).then(|| EventId {
            owner: owner.to_owned(),
            stream,
            seq,
        })
    }
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}", self.owner, self.stream, self.seq)
    }
}

/// Why a stream cannot be resumed where the client asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayGap {
    /// Events after the client's last one were dropped from the bounded buffer.
    #[error(
        "{lost} event(s) after the last one you saw were dropped from the replay buffer \
         (it keeps {MAX_EVENTS_PER_STREAM} events or {MAX_BYTES_PER_STREAM} bytes per stream)"
    )]
    Evicted { lost: u64 },
    /// The id names an event this stream never had.
    #[error("the stream never had that event")]
    Unknown,
}

/// One server-to-client stream: its last events, and who reads it now.
pub struct StreamLog {
    /// The owner's worker id, the first part of every event id.
    owner: Arc<str>,
    /// This stream's number within its session.
    number: u64,
    state: Mutex<LogState>,
    /// Woken on every new event, on the end, and when a new reader takes over.
    changed: Notify,
}

struct LogState {
    /// Kept events, each already carrying its `id:` line.
    events: VecDeque<Bytes>,
    /// Sequence number of `events[0]`; numbers start at 1.
    first_seq: u64,
    /// Number the next event gets.
    next_seq: u64,
    /// Bytes held in `events`.
    bytes: usize,
    /// The stream's source ended: readers stop once they have everything.
    finished: bool,
    /// Highest number handed to a reader, so a reader without `Last-Event-ID` starts
    /// with what nobody was handed yet.
    delivered: u64,
    /// Which reader may read: a newer one takes over from an older (a client sees
    /// each event on one connection only).
    reader: u64,
}

impl StreamLog {
    pub fn new(owner: Arc<str>, number: u64) -> Arc<StreamLog> {
        Arc::new(StreamLog {
            owner,
            number,
            state: Mutex::new(LogState {
                events: VecDeque::new(),
                first_seq: 1,
                next_seq: 1,
                bytes: 0,
                finished: false,
                delivered: 0,
                reader: 0,
            }),
            changed: Notify::new(),
        })
    }

    pub fn number(&self) -> u64 {
        self.number
    }

    /// Appends one SSE event as framed upstream (blank line included); its own `id`
    /// is replaced by the gateway's. Comment-only events (keep-alives) pass unnumbered.
    pub fn push(&self, event: &[u8]) {
        {
            let mut state = self.state.lock();
            if state.finished {
                return;
            }
            let id = EventId {
                owner: self.owner.to_string(),
                stream: self.number,
                seq: state.next_seq,
            };
            let event = with_id(event, &id.to_string());
            state.next_seq += 1;
            state.bytes += event.len();
            state.events.push_back(event);
            while state.events.len() > 1
                && (state.events.len() > MAX_EVENTS_PER_STREAM
                    || state.bytes > MAX_BYTES_PER_STREAM)
            {
                if let Some(dropped) = state.events.pop_front() {
                    state.bytes -= dropped.len();
                    state.first_seq += 1;
                }
            }
        }
        self.changed.notify_waiters();
    }

    /// Appends one JSON-RPC message as an SSE event.
    pub fn push_message(&self, json: &[u8]) {
        let mut event = BytesMut::with_capacity(json.len() + 24);
        event.put_slice(b"event: message\ndata: ");
        event.put_slice(json);
        event.put_slice(b"\n\n");
        self.push(&event);
    }

    /// The source ended: readers end once they have read everything.
    pub fn finish(&self) {
        self.state.lock().finished = true;
        self.changed.notify_waiters();
    }

    pub fn is_finished(&self) -> bool {
        self.state.lock().finished
    }

    /// A reader of this stream as a response body: after event `after` (a resume with
    /// `Last-Event-ID`), or from the first event no reader was handed yet. An earlier
    /// reader of the stream ends.
    pub fn subscribe(self: &Arc<Self>, after: Option<u64>) -> Result<ReplyBody, ReplayGap> {
        let (next, reader) = {
            let mut state = self.state.lock();
            let next = match after {
                Some(seen) if seen >= state.next_seq => return Err(ReplayGap::Unknown),
                Some(seen) if seen + 1 < state.first_seq => {
                    return Err(ReplayGap::Evicted {
                        lost: state.first_seq - (seen + 1),
                    });
                }
                Some(seen) => seen + 1,
                None => (state.delivered + 1).max(state.first_seq),
            };
            state.reader += 1;
            (next, state.reader)
        };
        self.changed.notify_waiters();
        let reading = Reading {
            log: Arc::clone(self),
            next,
            reader,
        };
        let events = futures_util::stream::unfold(reading, |mut reading| async move {
            let event = reading.next_event().await?;
            Some((Ok::<_, BoxError>(Frame::data(event)), reading))
        });
        Ok(StreamBody::new(events).boxed_unsync())
    }
}

/// One reader's place in a stream.
struct Reading {
    log: Arc<StreamLog>,
    next: u64,
    reader: u64,
}

impl Reading {
    /// The next event, waiting for it; `None` when the stream ended, another reader
    /// took over, or this reader fell behind the buffer (it then resumes and is told).
    async fn next_event(&mut self) -> Option<Bytes> {
        loop {
            let changed = self.log.changed.notified();
            {
                let mut state = self.log.state.lock();
                if state.reader != self.reader || self.next < state.first_seq {
                    return None;
                }
                if self.next < state.next_seq {
                    let index = usize::try_from(self.next - state.first_seq).ok()?;
                    let event = state.events.get(index)?.clone();
                    state.delivered = state.delivered.max(self.next);
                    self.next += 1;
                    return Some(event);
                }
                if state.finished {
                    return None;
                }
            }
            if tokio::time::timeout(KEEPALIVE_AFTER, changed)
                .await
                .is_err()
            {
                // Quiet for a while: a comment keeps proxies from closing the stream.
                return Some(Bytes::from_static(b": keepalive\n\n"));
            }
        }
    }
}

/// The streams of one session. Nothing is allocated until a stream exists: an idle
/// session pays a few words for this.
#[derive(Default)]
pub struct SessionStreams {
    next_number: AtomicU64,
    /// The session's `GET` stream, while its source lives.
    get: Mutex<Option<Arc<StreamLog>>>,
    /// Answers to POSTs, newest last, kept for resumption.
    posts: Mutex<VecDeque<Arc<StreamLog>>>,
}

impl std::fmt::Debug for SessionStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStreams")
            .field("get", &self.get.lock().as_ref().map(|l| l.number()))
            .field("posts", &self.posts.lock().len())
            .finish()
    }
}

impl SessionStreams {
    /// A new log, numbered by `owner` (this worker's id).
    fn new_log(&self, owner: &str) -> Arc<StreamLog> {
        let number = self.next_number.fetch_add(1, Ordering::Relaxed) + 1;
        StreamLog::new(Arc::from(owner), number)
    }

    /// A new log for a POST's answer.
    pub fn new_post(&self, owner: &str) -> Arc<StreamLog> {
        let log = self.new_log(owner);
        let mut posts = self.posts.lock();
        if posts.len() >= MAX_STREAMS_PER_SESSION {
            let victim = posts.iter().position(|l| l.is_finished()).unwrap_or(0);
            if let Some(old) = posts.remove(victim) {
                old.finish();
            }
        }
        posts.push_back(Arc::clone(&log));
        log
    }

    /// A new log for the session's `GET` stream, replacing an ended one.
    pub fn new_get(&self, owner: &str) -> Arc<StreamLog> {
        let log = self.new_log(owner);
        if let Some(old) = self.get.lock().replace(Arc::clone(&log)) {
            old.finish();
        }
        log
    }

    /// The `GET` stream, while its source lives.
    pub fn live_get(&self) -> Option<Arc<StreamLog>> {
        self.get.lock().clone().filter(|log| !log.is_finished())
    }

    /// The stream with `number`, if the session still keeps it.
    pub fn find(&self, number: u64) -> Option<Arc<StreamLog>> {
        if let Some(get) = self.get.lock().as_ref()
            && get.number() == number
        {
            return Some(Arc::clone(get));
        }
        self.posts
            .lock()
            .iter()
            .find(|log| log.number() == number)
            .cloned()
    }

    /// The session ended: every stream ends, every pump stops.
    pub fn close(&self) {
        if let Some(get) = self.get.lock().take() {
            get.finish();
        }
        for log in self.posts.lock().drain(..) {
            log.finish();
        }
    }
}

impl Drop for SessionStreams {
    // A session dropped without an orderly end (a fenced worker) stops its pumps too.
    fn drop(&mut self) {
        self.close();
    }
}

/// Reads `source` (an upstream SSE body) into `log` in a task of its own, so the
/// upstream is read on while the client is away. Ends with the source, or when the
/// log is finished (the session ended).
pub fn pump(log: Arc<StreamLog>, source: ReplyBody) {
    tokio::spawn(async move {
        let mut events = body::sse_events(source);
        loop {
            let changed = log.changed.notified();
            if log.is_finished() {
                break;
            }
            tokio::select! {
                frame = events.frame() => match frame {
                    Some(Ok(frame)) => {
                        if let Ok(event) = frame.into_data() {
                            log.push(&event);
                        }
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, stream = log.number(), "upstream stream broke");
                        break;
                    }
                    None => break,
                },
                // New events, readers, or the end: the end is checked above.
                () = changed => {}
            }
        }
        log.finish();
    });
}

/// `event` with its `id` field set to `id` (any upstream id dropped). An event of
/// comments only is returned unchanged: keep-alives need no id.
fn with_id(event: &[u8], id: &str) -> Bytes {
    let lines = sse_lines(event);
    let has_field = lines.iter().any(|l| !l.is_empty() && !l.starts_with(b":"));
    if !has_field {
        return Bytes::copy_from_slice(event);
    }
    let mut out = BytesMut::with_capacity(event.len() + id.len() + 6);
    out.put_slice(b"id: ");
    out.put_slice(id.as_bytes());
    out.put_u8(b'\n');
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let field = line.split(|&b| b == b':').next().unwrap_or(line);
        if field == b"id" {
            continue;
        }
        out.put_slice(line);
        out.put_u8(b'\n');
    }
    out.put_u8(b'\n');
    out.freeze()
}

/// The lines of one SSE event, without their terminators (`\n`, `\r\n` or `\r`).
fn sse_lines(event: &[u8]) -> Vec<&[u8]> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < event.len() {
        match event[i] {
            b'\n' => {
                lines.push(&event[start..i]);
                start = i + 1;
            }
            b'\r' => {
                lines.push(&event[start..i]);
                if event.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    if start < event.len() {
        lines.push(&event[start..]);
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log() -> Arc<StreamLog> {
        StreamLog::new(Arc::from("host-1.w2"), 7)
    }

    async fn read_all(body: ReplyBody) -> Vec<String> {
        let mut body = body;
        let mut out = Vec::new();
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                out.push(String::from_utf8_lossy(&data).into_owned());
            }
        }
        out
    }

    #[test]
    fn event_ids_round_trip_and_reject_foreign_ids() {
        let id = EventId {
            owner: "host-1.w2".into(),
            stream: 7,
            seq: 42,
        };
        assert_eq!(EventId::parse(&id.to_string()), Some(id));
        assert_eq!(EventId::parse("42"), None);
        assert_eq!(EventId::parse("a/b:1:2"), None);
        assert_eq!(EventId::parse("w:x:2"), None);
    }

    #[test]
    fn the_gateway_id_replaces_the_upstream_id_and_keep_alives_stay_bare() {
        let event = with_id(
            b"id: upstream-9\r\nevent: message\r\ndata: {}\r\n\r\n",
            "w:1:3",
        );
        assert_eq!(&event[..], b"id: w:1:3\nevent: message\ndata: {}\n\n");
        assert_eq!(
            &with_id(b": keepalive\n\n", "w:1:4")[..],
            b": keepalive\n\n"
        );
    }

    #[tokio::test]
    async fn a_resume_gets_exactly_the_events_after_the_last_one_seen() {
        let log = log();
        for n in 1..=5 {
            log.push_message(format!("{{\"n\":{n}}}").as_bytes());
        }
        log.finish();
        let events = read_all(log.subscribe(Some(2)).unwrap()).await;
        assert_eq!(events.len(), 3);
        assert!(
            events[0].starts_with("id: host-1.w2:7:3\n"),
            "{}",
            events[0]
        );
        assert!(events[2].contains("{\"n\":5}"));
    }

    #[tokio::test]
    async fn a_new_reader_takes_over_and_starts_with_what_nobody_was_handed() {
        let log = log();
        log.push_message(b"1");
        let mut first = log.subscribe(None).unwrap();
        let got = first.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(String::from_utf8_lossy(&got).contains("data: 1"));
        log.push_message(b"2");
        let second = log.subscribe(None).unwrap();
        assert!(first.frame().await.is_none(), "the older reader ends");
        log.finish();
        let rest = read_all(second).await;
        assert_eq!(rest.len(), 1);
        assert!(rest[0].contains("data: 2"));
    }

    #[test]
    fn evicted_events_are_reported_not_skipped() {
        let log = log();
        for _ in 0..MAX_EVENTS_PER_STREAM + 10 {
            log.push_message(b"{}");
        }
        assert_eq!(
            log.subscribe(Some(3)).err(),
            Some(ReplayGap::Evicted { lost: 7 })
        );
        assert!(log.subscribe(Some(10)).is_ok());
        assert_eq!(
            log.subscribe(Some(MAX_EVENTS_PER_STREAM as u64 + 11)).err(),
            Some(ReplayGap::Unknown)
        );
    }

    #[tokio::test]
    async fn a_waiting_reader_wakes_for_new_events_and_the_end() {
        let log = log();
        let reader = log.subscribe(None).unwrap();
        let reading = tokio::spawn(read_all(reader));
        tokio::task::yield_now().await;
        log.push_message(b"late");
        log.finish();
        let events = reading.await.unwrap();
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn a_session_keeps_a_bounded_number_of_streams() {
        let streams = SessionStreams::default();
        let first = streams.new_post("w");
        for _ in 0..MAX_STREAMS_PER_SESSION {
            streams.new_post("w");
        }
        assert!(streams.find(first.number()).is_none());
        assert!(first.is_finished());
        let get = streams.new_get("w");
        assert!(streams.live_get().is_some());
        streams.close();
        assert!(get.is_finished());
        assert!(streams.live_get().is_none());
    }
}
