//! The response body type every path shares (local, forwarded, upstream), and the
//! adapter that re-chunks an SSE stream so each event is exactly one chunk.

use crate::reason::Reason;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

use crate::sse::SseSplitter;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streaming response body: the upstream's bytes pass through without buffering.
pub type ReplyBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: Bytes) -> ReplyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Re-chunks an upstream SSE body: each data frame it yields is one complete event,
/// yielded as soon as its last byte arrives. An event that outgrows `max_event` bytes
/// (`limits.max_sse_event_bytes`) ends the stream with an error event (the session is
/// untouched).
pub fn sse_events<B>(inner: B, max_event: usize) -> ReplyBody
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    sse_events_bounded(inner, max_event, overflow_event(max_event))
}

/// The event sent in place of an upstream event larger than `max` bytes. The request
/// it belonged to is not known this deep (the id is null, as JSON-RPC allows when it
/// cannot be determined); the stream ends after it.
fn overflow_event(max: usize) -> Bytes {
    let error = crate::mcp::GatewayError::gateway(
        http::StatusCode::BAD_GATEWAY,
        Reason::UpstreamEventTooLarge,
        format!(
            "the upstream sent an event larger than the gateway's {max}-byte limit; the \
             stream was ended (the session is intact): ask for less, or raise \
             limits.max_sse_event_bytes"
        ),
    );
    let mut event = b"event: message\ndata: ".to_vec();
    event.extend_from_slice(&error.body());
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

/// [`sse_events`] with an explicit limit and overflow event. An event that grows past
/// `max_event` bytes without ending ends the stream: `overflow` goes out instead, and
/// the rest of the upstream's stream is dropped.
pub fn sse_events_bounded<B>(inner: B, max_event: usize, overflow: Bytes) -> ReplyBody
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    SseEvents {
        inner,
        splitter: SseSplitter::new(),
        ready: std::collections::VecDeque::new(),
        done: false,
        max_event,
        overflow: Some(overflow),
    }
    .boxed_unsync()
}

/// [`sse_events`], with each event passed through `rewrite` on its way.
pub fn rewrite_events<B, F>(inner: B, max_event: usize, mut rewrite: F) -> ReplyBody
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
    F: FnMut(Bytes) -> Bytes + Send + 'static,
{
    sse_events(inner, max_event)
        .map_frame(move |frame| match frame.into_data() {
            Ok(event) => Frame::data(rewrite(event)),
            Err(frame) => frame,
        })
        .boxed_unsync()
}

/// Keeps `guard` alive exactly as long as `body`: until the answer is fully sent or
/// the client is gone.
pub fn hold<G: Send + Unpin + 'static>(body: ReplyBody, guard: G) -> ReplyBody {
    Held {
        inner: body,
        _guard: guard,
    }
    .boxed_unsync()
}

/// Passes `body` through until `deadline`, then sends `last` and ends (dropping `body`,
/// which cancels whatever feeds it). For a held stream whose credential expires.
pub fn end_at(body: ReplyBody, deadline: tokio::time::Instant, last: Bytes) -> ReplyBody {
    Ending {
        inner: body,
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        last: Some(last),
    }
    .boxed_unsync()
}

struct Ending {
    inner: ReplyBody,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// Sent once at the deadline; `None` afterwards (the stream has ended).
    last: Option<Bytes>,
}

impl Body for Ending {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let Some(last) = this.last.as_ref() else {
            return Poll::Ready(None);
        };
        if this.deadline.as_mut().poll(cx).is_ready() {
            let last = last.clone();
            this.last = None;
            this.inner = full(Bytes::new());
            return Poll::Ready(Some(Ok(Frame::data(last))));
        }
        Pin::new(&mut this.inner).poll_frame(cx)
    }
}

/// Passes `body` through unchanged and, when it has ended, hands `seen` its bytes,
/// if they fit in `limit` (a larger answer is not handed over at all).
pub fn observe_end<F>(body: ReplyBody, limit: usize, seen: F) -> ReplyBody
where
    F: FnOnce(Bytes) + Send + Unpin + 'static,
{
    Observed {
        inner: body,
        buffer: Some(Vec::new()),
        limit,
        seen: Some(seen),
    }
    .boxed_unsync()
}

struct Observed<F> {
    inner: ReplyBody,
    /// What passed so far; dropped once it outgrows `limit`.
    buffer: Option<Vec<u8>>,
    limit: usize,
    seen: Option<F>,
}

impl<F: FnOnce(Bytes) + Send + Unpin + 'static> Body for Observed<F> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                let limit = self.limit;
                if let (Some(data), Some(buffer)) = (frame.data_ref(), self.buffer.as_mut()) {
                    if buffer.len() + data.len() > limit {
                        self.buffer = None;
                    } else {
                        buffer.extend_from_slice(data);
                    }
                }
                // The server stops polling a body that says it has ended, so the last
                // frame may be the last call.
                if self.inner.is_end_stream()
                    && let (Some(buffer), Some(seen)) = (self.buffer.take(), self.seen.take())
                {
                    seen(Bytes::from(buffer));
                }
            }
            Poll::Ready(None) => {
                if let (Some(buffer), Some(seen)) = (self.buffer.take(), self.seen.take()) {
                    seen(Bytes::from(buffer));
                }
            }
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

struct Held<G> {
    inner: ReplyBody,
    _guard: G,
}

impl<G: Send + Unpin + 'static> Body for Held<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

struct SseEvents<B> {
    inner: B,
    splitter: SseSplitter,
    /// Complete events not yet handed on (one upstream chunk may hold several).
    ready: std::collections::VecDeque<Bytes>,
    done: bool,
    /// Largest event buffered while waiting for its end.
    max_event: usize,
    /// Sent instead of an event that outgrew `max_event`; taken once.
    overflow: Option<Bytes>,
}

impl<B> Body for SseEvents<B>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(event))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.done = true;
                    if let Some(tail) = self.splitter.finish() {
                        self.ready.push_back(tail);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        let events = self.splitter.push(&data);
                        self.ready.extend(events);
                        if self.splitter.pending_len() > self.max_event {
                            tracing::warn!(
                                max_event = self.max_event,
                                "upstream SSE event exceeds the limit; ending the stream"
                            );
                            self.done = true;
                            self.splitter.discard_pending();
                            if let Some(overflow) = self.overflow.take() {
                                self.ready.push_back(overflow);
                            }
                        }
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.ready.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use http_body_util::StreamBody;

    #[tokio::test(start_paused = true)]
    async fn a_body_ended_at_a_deadline_sends_its_last_words_then_ends() {
        let events = futures_util::stream::iter(vec![Ok::<_, std::convert::Infallible>(
            Frame::data(Bytes::from_static(b"data: 1\n\n")),
        )])
        .chain(futures_util::stream::pending::<
            Result<Frame<Bytes>, std::convert::Infallible>,
        >());
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut body = end_at(
            StreamBody::new(events)
                .map_err(|e| match e {})
                .boxed_unsync(),
            deadline,
            Bytes::from_static(b"data: bye\n\n"),
        );
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, Bytes::from_static(b"data: 1\n\n"));
        let last = tokio::time::timeout(std::time::Duration::from_secs(60), body.frame())
            .await
            .expect("the last words come at the deadline")
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap();
        assert_eq!(last, Bytes::from_static(b"data: bye\n\n"));
        assert_eq!(
            tokio::time::Instant::now(),
            deadline,
            "not before the deadline"
        );
        assert!(body.frame().await.is_none(), "and nothing after it");
    }

    #[tokio::test]
    async fn sse_body_yields_one_frame_per_event() {
        let chunks: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"data: 1\n\ndata: "))),
            Ok(Frame::data(Bytes::from_static(b"2\n"))),
            Ok(Frame::data(Bytes::from_static(b"\ndata: 3\n\n"))),
        ];
        let mut body = sse_events(
            StreamBody::new(futures_util::stream::iter(chunks)),
            crate::config::Config::default().limits.max_sse_event_bytes,
        );
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(
            frames,
            vec![
                Bytes::from_static(b"data: 1\n\n"),
                Bytes::from_static(b"data: 2\n\n"),
                Bytes::from_static(b"data: 3\n\n"),
            ]
        );
    }

    #[tokio::test]
    async fn an_event_past_the_limit_ends_the_stream_with_the_overflow_event() {
        let chunks: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"data: ok\n\n"))),
            Ok(Frame::data(Bytes::from_static(b"data: 0123456789"))),
            Ok(Frame::data(Bytes::from_static(b"0123456789 never ends"))),
            Ok(Frame::data(Bytes::from_static(b"\n\ndata: after\n\n"))),
        ];
        let mut body = sse_events_bounded(
            StreamBody::new(futures_util::stream::iter(chunks)),
            16,
            Bytes::from_static(b"data: too large\n\n"),
        );
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(
            frames,
            vec![
                Bytes::from_static(b"data: ok\n\n"),
                Bytes::from_static(b"data: too large\n\n"),
            ]
        );
    }
}
