//! The response body type every path shares (local, forwarded, upstream), and the
//! adapter that re-chunks an SSE stream so each event is exactly one chunk.

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

/// Re-chunks an SSE body: each data frame it yields is one complete event, yielded
/// as soon as its last byte arrives.
pub fn sse_events<B>(inner: B) -> ReplyBody
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    SseEvents {
        inner,
        splitter: SseSplitter::new(),
        ready: std::collections::VecDeque::new(),
        done: false,
    }
    .boxed_unsync()
}

struct SseEvents<B> {
    inner: B,
    splitter: SseSplitter,
    /// Complete events not yet handed on (one upstream chunk may hold several).
    ready: std::collections::VecDeque<Bytes>,
    done: bool,
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
    use http_body_util::StreamBody;

    #[tokio::test]
    async fn sse_body_yields_one_frame_per_event() {
        let chunks: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"data: 1\n\ndata: "))),
            Ok(Frame::data(Bytes::from_static(b"2\n"))),
            Ok(Frame::data(Bytes::from_static(b"\ndata: 3\n\n"))),
        ];
        let mut body = sse_events(StreamBody::new(futures_util::stream::iter(chunks)));
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
}
