//! What members send outside a request, put on the client session's `GET` stream.
//!
//! Messages of a member that answer no request of the client (notifications such as
//! `notifications/resources/updated`, `*/list_changed` and logging, and requests of
//! its own to the client) come over HTTP on the member's own `GET` stream, and over
//! stdio as the lines it writes while no single request of the session runs. Both are
//! pumped into the session's one `GET` stream, each request among them under an id
//! that names its member ([`super::ids`]), so the client's answer reaches the member
//! that asked, and it alone, on whichever worker it lands.
//!
//! An HTTP member's `GET` is opened by the session's owner when the client first
//! opens the session's `GET` stream there (an adopter opens them again on the next
//! client `GET`), once per member however many `GET`s the client sends: a server
//! allows one such stream per session (the Python SDK answers a second with 409). A
//! member that answers 405 has none (noted at debug level); one that answers 404 no
//! longer knows the session and is lost, as after a 404 to a `POST`.
//!
//! A member's stream that ends or breaks while the session lives is reopened, as the
//! spec lets a client do: after a pause that doubles from [`FIRST_REOPEN_DELAY`] up
//! to [`MAX_REOPEN_DELAY`] while reopening fails (or the member's own `retry:`, within
//! the same bound), with `Last-Event-ID` when the member numbered its events, so a
//! member that keeps them loses nothing. A refusal that may pass (unreachable, 5xx,
//! 409 while the stream of a paused old owner is still open after an adoption, 429)
//! is retried the same way for as long as the session lives: the member comes back
//! by itself, and one attempt per half minute costs nothing. Any other 4xx is the
//! member's final word for the session (a warning says so). Every pump stops when
//! the session ends (its `GET` log is finished: DELETE, idle expiry, drain, a
//! handover, the sessions a fenced worker drops), when the session is ending, or
//! when the member is lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use http::header::ACCEPT;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use tracing::{debug, warn};

use super::{FORGOTTEN, ids};
use crate::body::{self, ReplyBody};
use crate::execute::Executor;
use crate::execute::streams::StreamLog;
use crate::link::{FederatedLink, MemberHealth, UpstreamLink, mark_lost};
use crate::mcp::{self, GatewayError};
use crate::reason::Reason;
use crate::worker::Worker;

/// The pause before the first reopening of a member's stream.
const FIRST_REOPEN_DELAY: Duration = Duration::from_millis(250);
/// The longest pause between two reopenings (the bound on the backoff).
const MAX_REOPEN_DELAY: Duration = Duration::from_secs(30);

impl Executor<'_> {
    /// The client opened the session's `GET` stream here: each live HTTP member's own
    /// `GET` stream is opened and followed into it, once per session on this worker.
    pub(crate) fn follow_member_streams(&self, link: &FederatedLink) {
        if link.members_followed.swap(true, Ordering::AcqRel) {
            return;
        }
        for member in &link.members {
            let session_id = match &member.link {
                Some(UpstreamLink::Http {
                    session_id: Some(session_id),
                }) => session_id.clone(),
                Some(UpstreamLink::Http { session_id: None }) => {
                    debug!(server = %link.server, member = %member.name(), "the member gave no session id: it has no stream of its own for this session");
                    continue;
                }
                _ => continue,
            };
            if member.lost().is_some() {
                continue;
            }
            let follower = Follower {
                worker: Arc::downgrade(self.worker),
                server: link.server.clone(),
                upstream: member.config.index,
                name: member.name().to_owned(),
                session_id,
                version: member.version.clone(),
                health: Arc::clone(&member.health),
                get_stream: Arc::clone(&link.get_stream),
                ending: Arc::clone(&link.ending),
            };
            tokio::spawn(follower.follow());
        }
    }
}

/// Passes what the stdio member `member` (its upstream name) writes outside a request
/// (into `outside`) on to the session's `GET` stream, its requests' ids tagged, until
/// the session ends.
pub(super) fn relay_stdio(member: String, outside: Arc<StreamLog>, get_stream: Arc<StreamLog>) {
    tokio::spawn(async move {
        // A fresh log has nothing to miss.
        let Ok(mut events) = outside.subscribe(None) else {
            return;
        };
        loop {
            let frame = tokio::select! {
                frame = events.frame() => frame,
                () = get_stream.ended() => break,
            };
            let Some(Ok(frame)) = frame else { break };
            if let Ok(event) = frame.into_data()
                && !comments_only(&event)
            {
                get_stream.push(&ids::tag_event(&member, event));
            }
        }
    });
}

/// One HTTP member's own `GET` stream, followed while the session lives.
struct Follower {
    /// Weak: a pump never keeps a stopping worker alive.
    worker: Weak<Worker>,
    server: String,
    /// The member's upstream (index into the worker's upstreams).
    upstream: usize,
    name: String,
    /// The member's upstream session.
    session_id: HeaderValue,
    /// The protocol version it negotiated, sent with every `GET`.
    version: HeaderValue,
    health: Arc<MemberHealth>,
    /// The session's `GET` stream: where the member's messages go, and whose end is
    /// the session's end.
    get_stream: Arc<StreamLog>,
    /// Set when the session ends: a member stopping then is not lost.
    ending: Arc<AtomicBool>,
}

/// How one opening of a member's stream ended.
#[derive(Debug, PartialEq, Eq)]
enum StreamEnd {
    /// 405: the member has no `GET` stream.
    NoStream,
    /// 404: the member no longer knows the session.
    Forgotten,
    /// It was open and ended or broke; whether anything came on it first.
    Ended {
        carried: bool,
        broke: Option<String>,
    },
    /// An event larger than the gateway's limit ended it.
    Overflow,
    /// It was not opened, for now: why (unreachable, 5xx, 409 while another stream
    /// of the session is open, 429).
    Refused(String),
    /// The member refuses the stream for good (another 4xx: it will not change its
    /// mind within the session).
    Rejected(StatusCode),
    /// The worker is stopping.
    WorkerGone,
}

impl Follower {
    async fn follow(self) {
        let mut reopen = Reopen::default();
        while self.wanted() {
            let end = tokio::select! {
                end = self.open_once(&mut reopen) => end,
                () = self.get_stream.ended() => return,
            };
            if !self.after(end, &mut reopen) {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(reopen.pause()) => {}
                () = self.get_stream.ended() => return,
            }
        }
    }

    /// Whether the stream is still wanted: the session lives and the member too.
    fn wanted(&self) -> bool {
        !self.ending.load(Ordering::Acquire)
            && self.health.lost.lock().is_none()
            && !self.get_stream.is_finished()
    }

    /// What one opening's end means; false when the member is not to be asked again.
    fn after(&self, end: StreamEnd, reopen: &mut Reopen) -> bool {
        let (server, member) = (&self.server, &self.name);
        match end {
            StreamEnd::NoStream => {
                debug!(server = %server, member = %member, "the member has no GET stream (405): what it sends outside a request cannot reach the client");
                false
            }
            StreamEnd::Forgotten => {
                // A session that ended deleted the member's: that is no loss.
                if !self.ending.load(Ordering::Acquire) && !self.get_stream.is_finished() {
                    mark_lost(server, member, &self.health, &self.get_stream, FORGOTTEN);
                }
                false
            }
            StreamEnd::WorkerGone => false,
            StreamEnd::Rejected(status) => {
                warn!(server = %server, member = %member, "the member refused its GET stream ({status}): what it sends outside a request cannot reach the client; it is not asked again in this session");
                false
            }
            StreamEnd::Ended { carried, broke } => {
                reopen.after_stream(carried);
                debug!(server = %server, member = %member, broke = ?broke, "the member's GET stream ended; it is reopened");
                true
            }
            StreamEnd::Overflow => {
                // A resume would replay the event that was too large.
                reopen.last_event_id = None;
                reopen.after_failure();
                true
            }
            StreamEnd::Refused(why) => {
                if reopen.after_failure() == 1 {
                    warn!(server = %server, member = %member, "the member's GET stream could not be opened ({why}); it is tried again, at most every {}s", MAX_REOPEN_DELAY.as_secs());
                } else {
                    debug!(server = %server, member = %member, "the member's GET stream still could not be opened ({why})");
                }
                true
            }
        }
    }

    /// Opens the member's stream once and relays it until it ends.
    async fn open_once(&self, reopen: &mut Reopen) -> StreamEnd {
        let Some(worker) = self.worker.upgrade() else {
            return StreamEnd::WorkerGone;
        };
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        headers.insert(mcp::HEADER_PROTOCOL_VERSION, self.version.clone());
        if let Some(last) = &reopen.last_event_id {
            headers.insert(mcp::HEADER_LAST_EVENT_ID, last.clone());
        }
        let max_event = worker.config.limits.max_sse_event_bytes;
        let reply = Executor::of(&worker)
            .send_upstream(
                &worker.routes[self.upstream],
                Method::GET,
                headers,
                Bytes::new(),
                Some(self.session_id.clone()),
            )
            .await;
        drop(worker);
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => return StreamEnd::Refused(e.to_string()),
        };
        match reply.status {
            StatusCode::METHOD_NOT_ALLOWED => StreamEnd::NoStream,
            StatusCode::NOT_FOUND => StreamEnd::Forgotten,
            status if status.is_success() && crate::execute::is_sse(&reply.headers) => {
                self.relay(reply.body, max_event, reopen).await
            }
            status if status.is_success() => {
                StreamEnd::Refused(format!("it answered {status} without an event stream"))
            }
            status if status.is_client_error() && !passing(status) => StreamEnd::Rejected(status),
            status => StreamEnd::Refused(format!("it answered {status}")),
        }
    }

    /// Puts the member's events on the session's `GET` stream, its requests tagged,
    /// until its stream ends; notes its event ids and `retry:` for a reopening.
    async fn relay(&self, source: ReplyBody, max_event: usize, reopen: &mut Reopen) -> StreamEnd {
        let overflow = self.overflow_event(max_event);
        let mut events = body::sse_events_bounded(source, max_event, overflow.clone());
        let mut carried = false;
        loop {
            let event = match events.frame().await {
                None => {
                    return StreamEnd::Ended {
                        carried,
                        broke: None,
                    };
                }
                Some(Err(e)) => {
                    let broke = Some(e.to_string());
                    return StreamEnd::Ended { carried, broke };
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(event) => event,
                    Err(_) => continue,
                },
            };
            if event == overflow {
                warn!(server = %self.server, member = %self.name, "the member sent an event on its GET stream larger than limits.max_sse_event_bytes ({max_event}); it was dropped and the stream reopened");
                self.get_stream.push(&overflow);
                return StreamEnd::Overflow;
            }
            carried = true;
            reopen.note(&event);
            if !comments_only(&event) {
                self.get_stream.push(&ids::tag_event(&self.name, event));
            }
        }
    }

    /// What the client's `GET` stream gets in place of an event that was too large.
    fn overflow_event(&self, max_event: usize) -> Bytes {
        let error = GatewayError::gateway(
            StatusCode::BAD_GATEWAY,
            Reason::UpstreamEventTooLarge,
            format!(
                "member {} of virtual server {} sent an event outside a request larger than \
                 the gateway's {max_event}-byte limit: it was dropped, and the member's stream \
                 was opened again (the session is intact; what the member sent meanwhile may \
                 be lost): raise limits.max_sse_event_bytes if its messages are that large",
                self.name, self.server
            ),
        );
        let mut event = b"event: message\ndata: ".to_vec();
        event.extend_from_slice(&error.body());
        event.extend_from_slice(b"\n\n");
        Bytes::from(event)
    }
}

/// When and how a member's stream is opened again.
#[derive(Debug, Default)]
struct Reopen {
    /// Openings in a row that failed or carried nothing.
    failures: u32,
    /// The id of the member's last event, sent as `Last-Event-ID`.
    last_event_id: Option<HeaderValue>,
    /// The member's own reconnection time (`retry:`), if it gave one.
    retry: Option<Duration>,
}

impl Reopen {
    /// A stream that was open has ended: one that carried something (an event, a
    /// keep-alive) starts the backoff again.
    fn after_stream(&mut self, carried: bool) {
        if carried {
            self.failures = 0;
        } else {
            self.failures += 1;
        }
    }

    /// An opening failed; returns how many did in a row.
    fn after_failure(&mut self) -> u32 {
        self.failures += 1;
        self.failures
    }

    /// The pause before the next opening: doubling with each failure, never below the
    /// member's `retry:`, never above [`MAX_REOPEN_DELAY`].
    fn pause(&self) -> Duration {
        let doubled = FIRST_REOPEN_DELAY.saturating_mul(1 << self.failures.min(16));
        doubled
            .max(self.retry.unwrap_or_default())
            .min(MAX_REOPEN_DELAY)
    }

    /// Notes an event's `id:` and `retry:` fields.
    fn note(&mut self, event: &[u8]) {
        let Ok(text) = std::str::from_utf8(event) else {
            return;
        };
        for line in text.lines() {
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "id" if value.is_empty() => self.last_event_id = None,
                "id" => self.last_event_id = HeaderValue::from_str(value).ok(),
                "retry" => {
                    if let Ok(ms) = value.parse::<u64>() {
                        self.retry = Some(Duration::from_millis(ms));
                    }
                }
                _ => {}
            }
        }
    }
}

/// A refusal that may pass within the session: a request timeout, another stream of
/// the session still open (409), too many requests.
fn passing(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::REQUEST_TIMEOUT
            | StatusCode::CONFLICT
            | StatusCode::TOO_EARLY
            | StatusCode::TOO_MANY_REQUESTS
    )
}

/// Whether an event is only comments (a keep-alive): the client's own reader sends
/// those, so they are not passed on.
fn comments_only(event: &[u8]) -> bool {
    event
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .all(|line| line.is_empty() || line.starts_with(b":"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reopening_backs_off_while_it_fails_and_starts_again_after_a_stream() {
        let mut reopen = Reopen::default();
        assert_eq!(reopen.pause(), FIRST_REOPEN_DELAY);
        let pauses: Vec<Duration> = (0..10)
            .map(|_| {
                reopen.after_failure();
                reopen.pause()
            })
            .collect();
        assert_eq!(pauses[0], FIRST_REOPEN_DELAY * 2);
        assert_eq!(pauses[1], FIRST_REOPEN_DELAY * 4);
        assert!(pauses.windows(2).all(|p| p[0] <= p[1]), "{pauses:?}");
        assert_eq!(pauses[9], MAX_REOPEN_DELAY, "bounded");
        reopen.after_stream(false);
        assert_eq!(
            reopen.pause(),
            MAX_REOPEN_DELAY,
            "an empty stream is a failure"
        );
        reopen.after_stream(true);
        assert_eq!(
            reopen.pause(),
            FIRST_REOPEN_DELAY,
            "a stream that carried resets"
        );
        reopen.note(b"retry: 5000\n\n");
        assert_eq!(reopen.pause(), Duration::from_secs(5), "the member's retry");
        reopen.note(b"retry: 600000\n\n");
        assert_eq!(reopen.pause(), MAX_REOPEN_DELAY, "within the same bound");
    }

    #[test]
    fn the_members_last_event_id_is_kept_for_a_reopening() {
        let mut reopen = Reopen::default();
        reopen.note(b"event: message\nid: s1-7\ndata: {}\n\n");
        assert_eq!(
            reopen.last_event_id.as_ref().map(|v| v.as_bytes()),
            Some(&b"s1-7"[..])
        );
        reopen.note(b": keepalive\n\n");
        assert!(reopen.last_event_id.is_some(), "a comment keeps it");
        reopen.note(b"id:\ndata: {}\n\n");
        assert_eq!(
            reopen.last_event_id, None,
            "an empty id resets it, as in SSE"
        );
    }

    async fn next_event(body: &mut ReplyBody) -> String {
        let frame = body.frame().await.expect("an event").expect("no error");
        String::from_utf8_lossy(&frame.into_data().expect("data")).into_owned()
    }

    #[tokio::test]
    async fn a_stdio_members_messages_reach_the_get_stream_tagged_until_the_session_ends() {
        let outside = StreamLog::unkept("w");
        let get_stream = StreamLog::new(Arc::from("w"), 1);
        relay_stdio("st".into(), Arc::clone(&outside), Arc::clone(&get_stream));
        outside.push_message(br#"{"jsonrpc":"2.0","id":0,"method":"roots/list"}"#);
        outside.push(b": keepalive\n\n");
        outside.push_message(br#"{"jsonrpc":"2.0","method":"notifications/resources/updated"}"#);
        let mut reader = get_stream.subscribe(None).expect("a fresh log");
        let request = next_event(&mut reader).await;
        assert!(request.contains(r#""id":"mcpgw~@st~0""#), "{request}");
        assert!(
            request.starts_with("id: w:1:1\n"),
            "numbered by the session: {request}"
        );
        let update = next_event(&mut reader).await;
        assert!(
            update.contains("resources/updated"),
            "no keep-alive between: {update}"
        );

        get_stream.finish();
        // The pump lets go of the member's log once it has ended.
        tokio::time::timeout(Duration::from_secs(10), async {
            while Arc::strong_count(&outside) > 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the pump ended with the session's stream");
    }

    #[test]
    fn keep_alives_are_told_from_events() {
        assert!(comments_only(b": keepalive\n\n"));
        assert!(comments_only(b": ping\r\n\r\n"));
        assert!(!comments_only(b"event: message\ndata: {}\n\n"));
        assert!(!comments_only(b": hi\ndata: {}\n\n"));
    }
}
