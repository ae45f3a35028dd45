//! Response bodies: a whole buffer, or SSE events as a task produces them.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};
use tokio::sync::mpsc;

/// How many SSE events may wait for a slow client before the producer waits too.
pub const EVENT_QUEUE: usize = 8;

/// One response body type for every answer, so the service has one
/// concrete type and no boxing.
#[derive(Debug)]
pub enum Body {
    /// Known in full: sent with `Content-Length`, so keep-alive costs nothing.
    Whole(Option<Bytes>),
    /// Events sent as they arrive; ends when the producer drops its sender.
    /// When the client goes away hyper drops this, which tells the producer
    /// (its `send` fails) to stop.
    Events(mpsc::Receiver<Bytes>),
}

impl Body {
    pub fn empty() -> Self {
        Body::Whole(None)
    }

    pub fn whole(bytes: impl Into<Bytes>) -> Self {
        Body::Whole(Some(bytes.into()))
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Whole(bytes) => Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes)))),
            Body::Events(events) => events
                .poll_recv(cx)
                .map(|event| event.map(|bytes| Ok(Frame::data(bytes)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Whole(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Whole(Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            Body::Whole(None) => SizeHint::with_exact(0),
            Body::Events(_) => SizeHint::default(),
        }
    }
}

/// Frames one JSON-RPC message as an SSE `message` event.
pub fn sse_event(json: &[u8]) -> Bytes {
    const PREFIX: &[u8] = b"event: message\ndata: ";
    const SUFFIX: &[u8] = b"\n\n";
    let mut event = Vec::with_capacity(PREFIX.len() + json.len() + SUFFIX.len());
    event.extend_from_slice(PREFIX);
    event.extend_from_slice(json);
    event.extend_from_slice(SUFFIX);
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn sse_event_is_one_message_event() {
        assert_eq!(
            &sse_event(br#"{"a":1}"#)[..],
            b"event: message\ndata: {\"a\":1}\n\n"
        );
    }

    #[tokio::test]
    async fn whole_body_announces_its_length_and_ends() {
        let body = Body::whole(&b"hello"[..]);
        assert_eq!(hyper::body::Body::size_hint(&body).exact(), Some(5));
        let collected = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        assert_eq!(&collected[..], b"hello");
        assert!(hyper::body::Body::is_end_stream(&Body::empty()));
    }

    #[tokio::test]
    async fn event_body_ends_when_the_producer_is_done() {
        let (sender, receiver) = mpsc::channel(EVENT_QUEUE);
        let producer = tokio::spawn(async move {
            for event in ["one", "two"] {
                if sender.send(Bytes::from(event)).await.is_err() {
                    return;
                }
            }
        });
        let collected = Body::Events(receiver)
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        assert_eq!(&collected[..], b"onetwo");
        assert!(producer.await.is_ok());
    }
}
