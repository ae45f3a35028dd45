//! The two halves of a multiplexed connection, the same at both ends: the outbox and
//! its writer task, which gathers the frames of every exchange into one write, and
//! the reader, which yields `(exchange, frame)` pairs.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// Frames waiting for the connection's writer task. Exchanges push encoded frames
/// here without waiting (the owner only pushes body bytes it has credit for, so what
/// waits here is bounded by the credit windows); the writer takes everything that
/// gathered while it was busy and sends it in one write.
#[derive(Debug)]
pub(crate) struct Outbox {
    /// Encodes frames with their exchange id; stateless when encoding.
    codec: MuxCodec,
    /// Encoded frames and whether the connection still takes any.
    state: Mutex<OutboxState>,
    /// Wakes the writer when frames arrive in an empty outbox, or on close.
    wake: Notify,
    /// Exchanges running on the connection: the writer gathers frames only when
    /// there is more than one to gather from.
    running: AtomicUsize,
}

#[derive(Debug, Default)]
struct OutboxState {
    /// Encoded frames, in the order they were pushed.
    buf: BytesMut,
    /// Set once the connection takes no more frames.
    closed: bool,
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
        })
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
        drop(state);
        if was_empty {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Takes no more frames; the writer sends what is queued, then ends.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.wake.notify_one();
    }
}

/// The writer task's loop: sends whatever gathered in `outbox`, one write per batch,
/// until the outbox is closed and empty (`Ok`) or the stream fails. A write that
/// takes longer than `stall` (a peer that stopped reading the whole connection)
/// fails it; zero waits forever.
pub(crate) async fn write_loop<W: AsyncWrite + Unpin>(
    outbox: &Outbox,
    io: &mut W,
    stall: Duration,
) -> io::Result<()> {
    let mut batch = BytesMut::new();
    loop {
        let notified = outbox.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let took = {
            let mut state = outbox.state.lock();
            if state.buf.is_empty() {
                if state.closed {
                    return Ok(());
                }
                false
            } else {
                std::mem::swap(&mut state.buf, &mut batch);
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
        let write = async {
            io.write_all(&batch).await?;
            io.flush().await
        };
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
