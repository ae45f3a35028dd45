//! The two halves of a multiplexed connection, the same at both ends: the outbox and
//! its writer task, which gathers the frames of every exchange into one write, and
//! the reader, which yields `(exchange, frame)` pairs.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::BytesMut;
use mcpgw_wire::{Frame, MuxCodec, WireError};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio::time::timeout;
use tokio_util::codec::Decoder;

use crate::transport::error::{LinkError, tls_cause};

/// Read buffer growth step: enough for a typical request or SSE event in one read.
const READ_RESERVE: usize = 16 * 1024;

/// A write buffer larger than this after a burst is given back instead of kept.
const KEEP_CAPACITY: usize = 1 << 20;

/// The connection's write half, shared by its writer task and the exchanges' pushes.
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// Frames waiting for the connection's writer task. Exchanges push encoded frames
/// here without waiting (the owner only pushes body bytes it has credit for, so what
/// waits here is bounded by the credit windows); the writer takes everything that
/// gathered while it was busy and sends it in one write.
///
/// A lone exchange on an idle connection writes its frames itself, as far as the
/// socket takes them without waiting: handing them to the writer task would cost a
/// task wake-up (often another thread's) per frame, which at one request at a time is
/// most of what the hop costs. What the socket does not take at once stays queued,
/// first, for the writer task.
pub(crate) struct Outbox {
    /// Encodes frames with their exchange id; stateless when encoding.
    codec: MuxCodec,
    /// Encoded frames and whether the connection still takes any.
    state: Mutex<OutboxState>,
    /// Wakes the writer when frames arrive in an empty outbox, or on close.
    wake: Notify,
    /// Exchanges running on the connection: the writer gathers frames only when
    /// there is more than one to gather from, and a push writes itself only when
    /// there is at most one.
    running: AtomicUsize,
    /// The write half, once [`attach`](Self::attach)ed. Locked only while a write is
    /// polled, never across a wait; `OutboxState::writing` says who may write.
    io: Mutex<Option<WriteHalf>>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("state", &self.state)
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct OutboxState {
    /// Encoded frames, in the order they were pushed.
    buf: BytesMut,
    /// Set once the connection takes no more frames.
    closed: bool,
    /// Someone (the writer task, or a push writing itself) is writing bytes taken
    /// from `buf`; nobody else may write until it is done and has looked at `buf`
    /// again.
    writing: bool,
    /// A push's write left bytes inside the stream (a TLS record the socket did not
    /// take): the writer task must flush, even with `buf` empty.
    unflushed: bool,
}

/// Why frames could not be pushed.
#[derive(Debug)]
pub(crate) enum PushError {
    /// The connection is closed or closing; nothing was queued.
    Closed,
    /// A frame cannot be encoded (too large); nothing was queued.
    Encode(WireError),
}

impl Outbox {
    pub(crate) fn new(max_frame: usize) -> Arc<Self> {
        Arc::new(Self {
            codec: MuxCodec::new(max_frame),
            state: Mutex::new(OutboxState::default()),
            wake: Notify::new(),
            running: AtomicUsize::new(0),
            io: Mutex::new(None),
        })
    }

    /// Gives the outbox the connection's write half, before its writer task starts.
    pub(crate) fn attach(&self, io: WriteHalf) {
        *self.io.lock() = Some(io);
    }

    /// Takes the write half back.
    fn detach(&self) -> Option<WriteHalf> {
        self.io.lock().take()
    }

    /// Once the writer is done: shuts the write half down (a FIN, or TLS's
    /// close_notify), waiting at most a second for a peer that does not read.
    pub(crate) async fn shut_down(&self) {
        if let Some(mut io) = self.detach() {
            let _ = timeout(Duration::from_secs(1), io.shutdown()).await;
        }
    }

    /// Counts an exchange that started on the connection.
    pub(crate) fn exchange_started(&self) {
        self.running.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an exchange that ended on the connection.
    pub(crate) fn exchange_ended(&self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
    }

    /// The largest body chunk one frame may carry.
    pub(crate) fn max_chunk(&self) -> usize {
        self.codec
            .max_frame()
            .saturating_sub(MuxCodec::CHUNK_OVERHEAD)
            .max(1)
    }

    /// Queues one frame of `exchange`.
    pub(crate) fn push(&self, exchange: u64, frame: &Frame) -> Result<(), PushError> {
        self.push_all(exchange, std::slice::from_ref(frame))
    }

    /// Queues frames of `exchange`, all or none, so they leave together.
    pub(crate) fn push_all(&self, exchange: u64, frames: &[Frame]) -> Result<(), PushError> {
        let mut state = self.state.lock();
        if state.closed {
            return Err(PushError::Closed);
        }
        let was_empty = state.buf.is_empty();
        let start = state.buf.len();
        for frame in frames {
            if let Err(e) = self.codec.encode(exchange, frame, &mut state.buf) {
                state.buf.truncate(start);
                return Err(PushError::Encode(e));
            }
        }
        if state.writing {
            // Whoever writes looks at the buffer again when done.
            return Ok(());
        }
        if !state.unflushed && self.running.load(Ordering::Relaxed) <= 1 {
            let batch = std::mem::take(&mut state.buf);
            state.writing = true;
            drop(state);
            self.write_now(batch);
            return Ok(());
        }
        drop(state);
        if was_empty {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Writes `batch` (taken from the buffer, `writing` set) as far as the stream
    /// takes it without waiting; the rest goes back in front of the buffer for the
    /// writer task, which is woken only when something is left for it.
    fn write_now(&self, mut batch: BytesMut) {
        let mut written = 0;
        let sent = self.poll_send(
            &mut Context::from_waker(Waker::noop()),
            &batch,
            &mut written,
        );
        let mut state = self.state.lock();
        state.writing = false;
        if let Poll::Ready(Ok(())) = sent {
            if state.buf.is_empty() {
                if batch.capacity() <= KEEP_CAPACITY {
                    batch.clear();
                    state.buf = batch;
                }
                if !state.closed {
                    return;
                }
            }
        } else {
            // Not taken at once, or failed: the writer task goes on from here (and
            // meets a failure again, and fails the connection).
            let mut rest = batch.split_off(written);
            rest.extend_from_slice(&state.buf);
            state.buf = rest;
            state.unflushed = true;
        }
        drop(state);
        self.wake.notify_one();
    }

    /// Writes `batch` from `written` on, then flushes; `written` counts what the
    /// stream took, so a write that must wait can be polled again.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        batch: &[u8],
        written: &mut usize,
    ) -> Poll<io::Result<()>> {
        let mut io = self.io.lock();
        let Some(io) = io.as_mut() else {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the mesh connection's writer is not attached",
            )));
        };
        while *written < batch.len() {
            match Pin::new(&mut *io).poll_write(cx, &batch[*written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *written += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Pin::new(&mut *io).poll_flush(cx)
    }

    /// Takes no more frames; the writer sends what is queued, then ends.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.wake.notify_one();
    }
}

/// The writer task's loop: sends whatever gathered in `outbox` (through the write
/// half [`attach`](Outbox::attach)ed to it), one write per batch, until the outbox is
/// closed and empty (`Ok`) or the stream fails. A write that takes longer than
/// `stall` (a peer that stopped reading the whole connection) fails it; zero waits
/// forever.
pub(crate) async fn write_loop(outbox: &Outbox, stall: Duration) -> io::Result<()> {
    let mut batch = BytesMut::new();
    loop {
        let notified = outbox.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let took = {
            let mut state = outbox.state.lock();
            if state.writing {
                // A push is writing: it wakes us if it leaves anything.
                false
            } else if state.buf.is_empty() && !state.unflushed {
                if state.closed {
                    return Ok(());
                }
                false
            } else {
                std::mem::swap(&mut state.buf, &mut batch);
                state.writing = true;
                state.unflushed = false;
                true
            }
        };
        if !took {
            notified.await;
            if outbox.running.load(Ordering::Relaxed) > 1 {
                // Let the tasks that are ready to run go first: under load many of
                // them push a frame, and all those frames then leave in one write
                // instead of one write each. A lone exchange does not wait for this.
                tokio::task::yield_now().await;
            }
            continue;
        }
        let mut written = 0;
        let write = std::future::poll_fn(|cx| outbox.poll_send(cx, &batch, &mut written));
        tokio::pin!(write);
        // A write to a reading peer completes at once; only one that has to wait
        // pays for a timer.
        match futures_util::FutureExt::now_or_never(&mut write) {
            Some(written) => written?,
            None if stall.is_zero() => write.await?,
            None => timeout(stall, write).await.map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the mesh peer took no data for {stall:?}"),
                )
            })??,
        }
        outbox.state.lock().writing = false;
        batch.clear();
        if batch.capacity() > KEEP_CAPACITY {
            batch = BytesMut::new();
        }
    }
}

/// What the reader saw.
#[derive(Debug)]
pub(crate) enum MuxRead {
    /// A frame of an exchange.
    Frame(u64, Frame),
    /// A frame that did not decode or was too large, skipped (the stream stays in
    /// sync); the exchange it named, when its id could be read.
    Bad(Option<u64>, WireError),
    /// A clean end of stream between frames.
    End,
    /// The stream is unusable.
    Broken(LinkError),
}

/// Reads multiplexed frames from one half of a connection.
#[derive(Debug)]
pub(crate) struct MuxReader<R> {
    io: R,
    /// Bytes read but not yet decoded.
    buf: BytesMut,
    codec: MuxCodec,
}

impl<R: AsyncRead + Unpin> MuxReader<R> {
    /// A reader that starts with `buf`, the bytes that arrived behind the greeting.
    pub(crate) fn new(io: R, buf: BytesMut, max_frame: usize) -> Self {
        Self {
            io,
            buf,
            codec: MuxCodec::new(max_frame),
        }
    }

    /// The next frame or event. Cancel-safe: bytes read before a cancellation stay
    /// buffered for the next call.
    pub(crate) async fn next(&mut self) -> MuxRead {
        loop {
            match self.codec.decode(&mut self.buf) {
                Ok(Some((exchange, frame))) => return MuxRead::Frame(exchange, frame),
                Ok(None) => {}
                Err(e) => match e.error {
                    WireError::Io(io) => return MuxRead::Broken(broken(&io)),
                    error => return MuxRead::Bad(e.exchange, error),
                },
            }
            self.buf.reserve(READ_RESERVE);
            match self.io.read_buf(&mut self.buf).await {
                Ok(0) if self.buf.is_empty() && !self.codec.is_skipping() => return MuxRead::End,
                Ok(0) => {
                    return MuxRead::Broken(LinkError::Broken {
                        reason: "stream ended inside a frame".into(),
                        tls: None,
                    });
                }
                Ok(_) => {}
                Err(e) => return MuxRead::Broken(broken(&e)),
            }
        }
    }
}

fn broken(e: &io::Error) -> LinkError {
    LinkError::Broken {
        reason: e.to_string(),
        tls: tls_cause(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    /// Reads `count` frames from `reader`, panicking on anything else.
    async fn frames<R: AsyncRead + Unpin>(
        reader: &mut MuxReader<R>,
        count: usize,
    ) -> Vec<(u64, Frame)> {
        let mut got = Vec::with_capacity(count);
        while got.len() < count {
            match reader.next().await {
                MuxRead::Frame(id, frame) => got.push((id, frame)),
                other => panic!("expected a frame, got {other:?}"),
            }
        }
        got
    }

    /// An outbox attached to one end of an in-memory pipe of `capacity` bytes, and
    /// the pipe's other end.
    fn connected(capacity: usize) -> (Arc<Outbox>, tokio::io::DuplexStream) {
        let (near, far) = tokio::io::duplex(capacity);
        let outbox = Outbox::new(1 << 20);
        outbox.attach(Box::new(near));
        (outbox, far)
    }

    fn chunk(at: usize, len: usize) -> Frame {
        Frame::Chunk(Bytes::from(vec![u8::try_from(at % 251).unwrap_or(0); len]))
    }

    #[tokio::test]
    async fn a_lone_exchange_writes_itself_and_what_the_stream_does_not_take_follows_in_order() {
        // A pipe far smaller than the frames: every push writes part of its batch
        // at once and leaves the rest to the writer task.
        let (outbox, far) = connected(512);
        outbox.exchange_started();
        let writer = {
            let outbox = outbox.clone();
            tokio::spawn(async move { write_loop(&outbox, Duration::ZERO).await })
        };
        let pushed: Vec<Frame> = (0..40).map(|at| chunk(at, 100 + at * 37)).collect();
        for frame in &pushed {
            outbox.push(7, frame).expect("pushed");
        }
        let mut reader = MuxReader::new(far, BytesMut::new(), 1 << 20);
        let got = frames(&mut reader, pushed.len()).await;
        for (at, (id, frame)) in got.into_iter().enumerate() {
            assert_eq!(id, 7);
            assert_eq!(frame, pushed[at], "frame {at} arrived whole and in order");
        }
        outbox.close();
        writer
            .await
            .expect("the writer task")
            .expect("the writer ends cleanly");
        assert!(
            outbox.detach().is_some(),
            "the write half comes back for shutdown"
        );
    }

    #[tokio::test]
    async fn concurrent_exchanges_hand_their_frames_to_the_writer_task() {
        let (outbox, far) = connected(1 << 16);
        outbox.exchange_started();
        outbox.exchange_started();
        outbox.push(1, &chunk(1, 10)).expect("pushed");
        assert!(
            !outbox.state.lock().buf.is_empty(),
            "with two exchanges running the frame waits to be gathered"
        );
        let writer = {
            let outbox = outbox.clone();
            tokio::spawn(async move { write_loop(&outbox, Duration::ZERO).await })
        };
        outbox.push(2, &chunk(2, 10)).expect("pushed");
        let mut reader = MuxReader::new(far, BytesMut::new(), 1 << 20);
        let got = frames(&mut reader, 2).await;
        assert_eq!(got, vec![(1, chunk(1, 10)), (2, chunk(2, 10))]);
        outbox.close();
        writer
            .await
            .expect("the writer task")
            .expect("the writer ends cleanly");
    }

    #[tokio::test]
    async fn a_push_that_writes_itself_leaves_nothing_for_the_writer() {
        let (outbox, far) = connected(1 << 16);
        outbox.exchange_started();
        // No writer task runs: the frame can only have left through the push.
        outbox.push(3, &chunk(3, 64)).expect("pushed");
        assert!(outbox.state.lock().buf.is_empty());
        let mut reader = MuxReader::new(far, BytesMut::new(), 1 << 20);
        assert_eq!(frames(&mut reader, 1).await, vec![(3, chunk(3, 64))]);
    }
}
