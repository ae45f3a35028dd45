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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

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
/// Streams one session keeps for resumption. To make room only a finished one is
/// forgotten (the oldest); while all of them are still running, a new answer is not
/// kept (it reaches its client, but cannot be resumed) rather than cutting one off.
pub const MAX_STREAMS_PER_SESSION: usize = 16;
/// Numbers of never-kept streams a session remembers, to tell a resume why it fails.
const NOT_KEPT_REMEMBERED: usize = 256;

/// How long a reader waits for an event before it sends a keep-alive comment.
const KEEPALIVE_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// Bytes that replay logs may keep, shared by every log it covers: one for all the
/// logs of a worker (`limits.replay_budget_bytes`), one for those of a session
/// (`limits.replay_session_bytes`). Each kept event holds its bytes until it is
/// evicted or its log is dropped; a push that does not fit is delivered, not kept.
#[derive(Debug)]
pub struct ReplayBudget {
    limit: usize,
    used: AtomicUsize,
    /// A reservation was refused and nothing was given back since: new streams are
    /// not kept (an almost full budget would refuse their first event anyway).
    exhausted: AtomicBool,
}

impl ReplayBudget {
    pub fn new(limit: usize) -> Arc<ReplayBudget> {
        Arc::new(ReplayBudget {
            limit,
            used: AtomicUsize::new(0),
            exhausted: AtomicBool::new(false),
        })
    }

    fn unlimited() -> Arc<ReplayBudget> {
        ReplayBudget::new(usize::MAX)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes kept now; never above [`ReplayBudget::limit`].
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Takes `bytes` when they fit under the limit; otherwise takes nothing.
    fn try_reserve(&self, bytes: usize) -> bool {
        let fits = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok();
        if !fits {
            self.exhausted.store(true, Ordering::Release);
        }
        fits
    }

    /// Gives back `bytes` taken by [`ReplayBudget::try_reserve`].
    fn release(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(bytes))
            })
            .unwrap_or(0);
        debug_assert!(before >= bytes, "released more replay bytes than reserved");
        self.exhausted.store(false, Ordering::Release);
    }

    /// Whether a new stream should not be kept: the budget refused an event and got
    /// nothing back since, or it is full.
    fn spent(&self) -> bool {
        self.exhausted.load(Ordering::Acquire) || self.used() >= self.limit
    }
}

/// The budgets a log's kept events count against: its worker's and its session's.
#[derive(Clone)]
struct Budgets {
    worker: Arc<ReplayBudget>,
    session: Arc<ReplayBudget>,
}

impl Budgets {
    fn unlimited() -> Budgets {
        Budgets {
            worker: ReplayBudget::unlimited(),
            session: ReplayBudget::unlimited(),
        }
    }

    fn try_reserve(&self, bytes: usize) -> bool {
        if !self.session.try_reserve(bytes) {
            return false;
        }
        if !self.worker.try_reserve(bytes) {
            self.session.release(bytes);
            return false;
        }
        true
    }

    fn release(&self, bytes: usize) {
        self.worker.release(bytes);
        self.session.release(bytes);
    }

    /// Which budget is spent, for the client, if one is.
    fn spent(&self) -> Option<&'static str> {
        if self.worker.spent() {
            Some("this worker's replay budget (limits.replay_budget_bytes)")
        } else if self.session.spent() {
            Some("this session's replay budget (limits.replay_session_bytes)")
        } else {
            None
        }
    }
}

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
    /// The replay budget was spent while the stream ran: from then on it kept no
    /// event past the one its reader had.
    #[error(
        "{lost} event(s) after the last one you saw were not kept: the replay budget was \
         spent (a worker keeps limits.replay_budget_bytes, a session \
         limits.replay_session_bytes of events for resumption), so this stream keeps \
         nothing its reader already had"
    )]
    BudgetSpent { lost: u64 },
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
    /// Kept for resumption: it holds its last events even once they were delivered.
    /// A stream that is not drops each event once its reader has it.
    kept: bool,
    /// What its kept events count against.
    budgets: Budgets,
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
    /// How many of the oldest `events` count against the budgets, and their bytes:
    /// every event pushed before the budget ran out (the rest were only passed on).
    counted_events: usize,
    counted_bytes: usize,
    /// A push did not fit the budget: from then on the stream keeps nothing its
    /// reader already has, like a stream that is not kept.
    spent: bool,
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
    #[cfg(test)]
    pub fn new(owner: Arc<str>, number: u64) -> Arc<StreamLog> {
        StreamLog::with_keeping(owner, number, true, Budgets::unlimited())
    }

    fn with_keeping(owner: Arc<str>, number: u64, kept: bool, budgets: Budgets) -> Arc<StreamLog> {
        Arc::new(StreamLog {
            owner,
            number,
            kept,
            budgets,
            state: Mutex::new(LogState {
                events: VecDeque::new(),
                first_seq: 1,
                next_seq: 1,
                bytes: 0,
                counted_events: 0,
                counted_bytes: 0,
                spent: false,
                finished: false,
                delivered: 0,
                reader: 0,
            }),
            changed: Notify::new(),
        })
    }

    /// A log of its own, in no session's streams: not kept for resumption and
    /// counted against no budget (what it holds waiting for its reader is bounded by
    /// the per-stream limits). For a source whose events a pump passes on to another
    /// log: a virtual server's stdio member writes here what it sends outside a
    /// request, and the pump puts it on the session's `GET` stream, its requests'
    /// ids tagged with the member (`federation/member_streams.rs`).
    pub fn unkept(owner: &str) -> Arc<StreamLog> {
        StreamLog::with_keeping(Arc::from(owner), 0, false, Budgets::unlimited())
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
            if self.kept && !state.spent {
                if self.budgets.try_reserve(event.len()) {
                    state.counted_events += 1;
                    state.counted_bytes += event.len();
                } else {
                    // Delivered all the same: only its replay is given up.
                    state.spent = true;
                    tracing::debug!(
                        stream = self.number,
                        event_bytes = event.len(),
                        "replay budget spent: the stream is no longer kept for resumption"
                    );
                }
            }
            state.bytes += event.len();
            state.events.push_back(event);
            self.drop_delivered(&mut state);
            while state.events.len() > 1
                && (state.events.len() > MAX_EVENTS_PER_STREAM
                    || state.bytes > MAX_BYTES_PER_STREAM)
            {
                self.drop_oldest(&mut state);
            }
        }
        self.changed.notify_waiters();
    }

    /// Whether this stream holds events its reader already has, for a resume.
    fn keeps(&self, state: &LogState) -> bool {
        self.kept && !state.spent
    }

    /// Nobody can resume a stream that does not keep: what its reader has, it needs
    /// no more.
    fn drop_delivered(&self, state: &mut LogState) {
        while !self.keeps(state) && state.first_seq <= state.delivered && !state.events.is_empty() {
            self.drop_oldest(state);
        }
    }

    fn drop_oldest(&self, state: &mut LogState) {
        let Some(dropped) = state.events.pop_front() else {
            return;
        };
        state.bytes -= dropped.len();
        state.first_seq += 1;
        if state.counted_events > 0 {
            state.counted_events -= 1;
            state.counted_bytes -= dropped.len();
            self.budgets.release(dropped.len());
        }
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

    /// Returns once the stream is finished (for a session's stream: the session
    /// ended), so a task feeding it can stop with it.
    pub async fn ended(&self) {
        loop {
            let changed = self.changed.notified();
            if self.is_finished() {
                return;
            }
            changed.await;
        }
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
                    let lost = state.first_seq - (seen + 1);
                    return Err(if state.spent {
                        ReplayGap::BudgetSpent { lost }
                    } else {
                        ReplayGap::Evicted { lost }
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

impl Drop for StreamLog {
    // The last holder is gone (its session forgot it, its pump and readers ended).
    fn drop(&mut self) {
        let counted = self.state.get_mut().counted_bytes;
        self.budgets.release(counted);
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
                    self.log.drop_delivered(&mut state);
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

/// Why a stream was never kept for resumption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotKept {
    /// The session had [`MAX_STREAMS_PER_SESSION`] answers running.
    SessionFull,
    /// A replay budget was spent; which one, in words.
    BudgetSpent(&'static str),
}

/// The streams of one session. Nothing is allocated until a stream exists: an idle
/// session pays a few words for this.
pub struct SessionStreams {
    next_number: AtomicU64,
    /// What kept events count against: the worker's budget and this session's.
    budgets: Budgets,
    /// The session's `GET` stream, while its source lives.
    get: Mutex<Option<Arc<StreamLog>>>,
    /// Answers to POSTs, newest last, kept for resumption.
    posts: Mutex<VecDeque<Arc<StreamLog>>>,
    /// Answers to POSTs that are not kept (the session had [`MAX_STREAMS_PER_SESSION`]
    /// running when they began), while they run: they end with the session.
    unkept: Mutex<Vec<Arc<StreamLog>>>,
    /// The numbers of the newest streams that were not kept, and why.
    not_kept: Mutex<VecDeque<(u64, NotKept)>>,
}

impl Default for SessionStreams {
    /// Streams without a replay budget (tests, and logs no client resumes).
    fn default() -> SessionStreams {
        SessionStreams::with_budgets(Budgets::unlimited())
    }
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
    /// The streams of a new session: kept events count against `worker` (the
    /// worker's budget) and a budget of `session_bytes` of the session's own.
    pub fn new(worker: &Arc<ReplayBudget>, session_bytes: usize) -> SessionStreams {
        SessionStreams::with_budgets(Budgets {
            worker: Arc::clone(worker),
            session: ReplayBudget::new(session_bytes),
        })
    }

    fn with_budgets(budgets: Budgets) -> SessionStreams {
        SessionStreams {
            next_number: AtomicU64::new(0),
            budgets,
            get: Mutex::new(None),
            posts: Mutex::new(VecDeque::new()),
            unkept: Mutex::new(Vec::new()),
            not_kept: Mutex::new(VecDeque::new()),
        }
    }

    /// A new log, numbered by `owner` (this worker's id).
    fn new_log(&self, owner: &str) -> Arc<StreamLog> {
        let number = self.next_number.fetch_add(1, Ordering::Relaxed) + 1;
        StreamLog::with_keeping(Arc::from(owner), number, true, self.budgets.clone())
    }

    /// A new log for a POST's answer: kept for resumption in place of the oldest
    /// finished one when the session keeps its maximum; not kept when every kept one
    /// is still running (a running answer is never cut off to make room).
    /// Not kept either while a replay budget is spent once this session's finished
    /// answers are forgotten to make room (running ones never are).
    pub fn new_post(&self, owner: &str) -> Arc<StreamLog> {
        let mut posts = self.posts.lock();
        if posts.len() >= MAX_STREAMS_PER_SESSION {
            match posts.iter().position(|l| l.is_finished()) {
                Some(oldest_finished) => {
                    posts.remove(oldest_finished);
                }
                None => {
                    drop(posts);
                    return self.new_unkept(owner, NotKept::SessionFull);
                }
            }
        }
        while self.budgets.spent().is_some() {
            // A finished log's bytes come back when its last reader lets go of it.
            let Some(oldest_finished) = posts.iter().position(|l| l.is_finished()) else {
                break;
            };
            posts.remove(oldest_finished);
        }
        if let Some(which) = self.budgets.spent() {
            drop(posts);
            return self.new_unkept(owner, NotKept::BudgetSpent(which));
        }
        let log = self.new_log(owner);
        posts.push_back(Arc::clone(&log));
        log
    }

    fn new_unkept(&self, owner: &str, why: NotKept) -> Arc<StreamLog> {
        let number = self.next_number.fetch_add(1, Ordering::Relaxed) + 1;
        let log = StreamLog::with_keeping(Arc::from(owner), number, false, self.budgets.clone());
        let mut unkept = self.unkept.lock();
        unkept.retain(|l| !l.is_finished());
        unkept.push(Arc::clone(&log));
        let mut not_kept = self.not_kept.lock();
        if not_kept.len() >= NOT_KEPT_REMEMBERED {
            not_kept.pop_front();
        }
        not_kept.push_back((number, why));
        log
    }

    /// Why stream `number` cannot be found (see [`SessionStreams::find`]), in words
    /// for the client.
    pub fn why_not_found(&self, number: u64) -> String {
        let why = self
            .not_kept
            .lock()
            .iter()
            .find(|(n, _)| *n == number)
            .map(|(_, why)| *why);
        if let Some(NotKept::SessionFull) = why {
            format!(
                "stream {number} was never kept for resumption: it began while the session \
                 had {MAX_STREAMS_PER_SESSION} answers running, and a running answer is never \
                 cut off to make room"
            )
        } else if let Some(NotKept::BudgetSpent(which)) = why {
            format!(
                "stream {number} was never kept for resumption: the replay budget was spent \
                 when it began ({which} was used up by streams still kept)"
            )
        } else {
            format!(
                "stream {number} is no longer kept (a session keeps its newest \
                 {MAX_STREAMS_PER_SESSION} streams)"
            )
        }
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
        for log in self.unkept.lock().drain(..) {
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
/// log is finished (the session ended). No event may be larger than `max_event` bytes.
pub fn pump(log: Arc<StreamLog>, source: ReplyBody, max_event: usize) {
    tokio::spawn(async move {
        let mut events = body::sse_events(source, max_event);
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
    async fn a_stream_that_is_not_kept_drops_what_its_reader_has() {
        let log = StreamLog::with_keeping(Arc::from("w"), 3, false, Budgets::unlimited());
        let mut reader = log.subscribe(None).unwrap();
        log.push_message(b"1");
        assert!(reader.frame().await.is_some());
        log.push_message(b"2");
        assert_eq!(log.state.lock().events.len(), 1, "event 1 was delivered");
        log.finish();
        let rest = read_all(reader).await;
        assert_eq!(rest.len(), 1);
        assert!(rest[0].contains("data: 2"), "{rest:?}");
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
    fn a_session_keeps_a_bounded_number_of_streams_and_never_cuts_a_running_one() {
        let streams = SessionStreams::default();
        let first = streams.new_post("w");
        for _ in 1..MAX_STREAMS_PER_SESSION {
            streams.new_post("w");
        }
        // All kept streams run: the next one is not kept, and none is cut off.
        let unkept = streams.new_post("w");
        assert!(streams.find(unkept.number()).is_none());
        assert!(
            streams
                .why_not_found(unkept.number())
                .contains("was never kept"),
            "{}",
            streams.why_not_found(unkept.number())
        );
        assert!(!first.is_finished(), "a running answer is never cut off");
        assert!(streams.find(first.number()).is_some());
        // Once one has finished, it makes room for the next.
        first.finish();
        let next = streams.new_post("w");
        assert!(streams.find(next.number()).is_some());
        assert!(streams.find(first.number()).is_none());
        assert!(
            streams
                .why_not_found(first.number())
                .contains("no longer kept")
        );
        streams.close();
        assert!(
            unkept.is_finished(),
            "an unkept stream ends with the session"
        );
        let streams = SessionStreams::default();
        let get = streams.new_get("w");
        assert!(streams.live_get().is_some());
        streams.close();
        assert!(get.is_finished());
        assert!(streams.live_get().is_none());
    }

    #[test]
    fn a_budget_takes_only_what_fits_and_gets_it_back() {
        let budget = ReplayBudget::new(100);
        assert!(budget.try_reserve(60));
        assert!(!budget.try_reserve(41), "60 + 41 is past the limit");
        assert_eq!(budget.used(), 60, "a refused reservation takes nothing");
        assert!(budget.spent(), "a refusal marks the budget spent");
        assert!(budget.try_reserve(40), "what still fits is taken");
        assert_eq!(budget.used(), 100);
        assert!(!budget.try_reserve(1));
        budget.release(100);
        assert_eq!(budget.used(), 0);
        assert!(!budget.spent(), "giving back ends the spent state");
    }

    /// A session's streams against a worker budget of `worker_bytes`.
    fn budgeted(worker_bytes: usize, session_bytes: usize) -> (Arc<ReplayBudget>, SessionStreams) {
        let worker = ReplayBudget::new(worker_bytes);
        let streams = SessionStreams::new(&worker, session_bytes);
        (worker, streams)
    }

    /// A message whose event (with its gateway id) is some 100 bytes.
    fn message(n: usize) -> Vec<u8> {
        format!("{{\"n\":{n},\"pad\":\"{}\"}}", "x".repeat(50)).into_bytes()
    }

    #[tokio::test]
    async fn past_the_worker_budget_every_event_is_delivered_and_a_resume_is_told_why() {
        let (worker, streams) = budgeted(1_000, usize::MAX);
        let log = streams.new_post("w");
        let mut reader = log.subscribe(None).unwrap();
        for n in 1..=30 {
            log.push_message(&message(n));
            assert!(
                worker.used() <= 1_000,
                "used {} past the budget",
                worker.used()
            );
            let event = reader.frame().await.unwrap().unwrap().into_data().unwrap();
            let event = String::from_utf8_lossy(&event).into_owned();
            assert!(event.contains(&format!("\"n\":{n},")), "event {n}: {event}");
        }
        assert!(
            log.state.lock().spent,
            "30 events of ~100 bytes exceed 1000"
        );
        assert_eq!(
            worker.used(),
            0,
            "past its budget a stream gives back what its reader has"
        );
        match log.subscribe(Some(1)).err() {
            Some(gap @ ReplayGap::BudgetSpent { .. }) => {
                assert!(gap.to_string().contains("replay budget was spent"), "{gap}");
            }
            other => panic!("a resume past a dropped event: {other:?}"),
        }
        log.push_message(&message(31));
        assert_eq!(
            worker.used(),
            0,
            "a stream past its budget keeps nothing more, even unread"
        );
        assert!(reader.frame().await.is_some(), "yet its reader gets it");
    }

    #[tokio::test]
    async fn a_new_stream_while_the_budget_is_spent_is_never_kept_and_a_resume_says_so() {
        let (worker, streams) = budgeted(usize::MAX, 500);
        let running = streams.new_post("w");
        for n in 1..=10 {
            running.push_message(&message(n));
        }
        let used = worker.used();
        assert!(used > 0 && used <= 500, "the session keeps {used} bytes");
        // The running answer holds the session budget and is never cut for the next.
        let next = streams.new_post("w");
        assert!(streams.find(next.number()).is_none());
        let why = streams.why_not_found(next.number());
        assert!(
            why.contains("never kept") && why.contains("replay budget was spent"),
            "{why}"
        );
        assert!(why.contains("replay_session_bytes"), "{why}");
        assert_eq!(worker.used(), used, "the running answer is not cut");
        let mut reader = next.subscribe(None).unwrap();
        next.push_message(b"1");
        assert!(
            reader.frame().await.is_some(),
            "a stream not kept is still delivered"
        );
        // Once it has finished, the old answer is forgotten to make room.
        running.finish();
        drop(running);
        let kept = streams.new_post("w");
        assert!(
            streams.find(kept.number()).is_some(),
            "{}",
            streams.why_not_found(kept.number())
        );
        assert_eq!(worker.used(), 0, "the finished answer gave its bytes back");
        kept.push_message(b"2");
        assert!(worker.used() > 0);
    }
}
