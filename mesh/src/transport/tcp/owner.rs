//! The owner's end of a multiplexed TCP connection: a reader that starts an exchange
//! task per `Request` and hands `Cancel` and `Credit` to the exchange they name, and
//! the link through which an exchange task sends its response against its credit.

use std::collections::hash_map::Entry;
use std::io;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use mcpgw_wire::{ErrorFrame, ErrorKind, Frame, RequestFrame, WireError};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::mux::{MuxRead, MuxReader, Outbox, PushError, write_loop};
use crate::transport::error::LinkError;
use crate::transport::framed::SendError;
use crate::transport::service::PeerInfo;
use crate::transport::serving::{
    CallerEvent, ExchangeEnd, ExchangeLink, FrameQueue, ServerShared, error_for, serve_request,
};

/// The exchange runs.
const RUNNING: u8 = 0;
/// The caller sent `Cancel` for it (or broke the protocol on it).
const CANCELLED: u8 = 1;
/// The connection is gone.
const GONE: u8 = 2;

/// What the connection's reader tells a running exchange.
#[derive(Debug)]
struct ExchangeCtl {
    /// Body bytes the caller will still take: the window, minus what was sent, plus
    /// what the caller credited back. Only the exchange's task subtracts.
    credit: AtomicUsize,
    /// [`RUNNING`], [`CANCELLED`] or [`GONE`].
    state: AtomicU8,
    /// Wakes the exchange task on credit, `Cancel`, or the connection's end.
    wake: Notify,
}

impl ExchangeCtl {
    fn set(&self, state: u8) {
        self.state.store(state, Ordering::Release);
        self.wake.notify_one();
    }

    fn add_credit(&self, bytes: u32) {
        self.credit.fetch_add(bytes as usize, Ordering::AcqRel);
        self.wake.notify_one();
    }
}

/// One greeted connection, owner side.
struct OwnerConn {
    /// Frames for the writer task.
    outbox: Arc<Outbox>,
    /// Running exchanges by the caller's id.
    exchanges: Mutex<rustc_hash::FxHashMap<u64, Arc<ExchangeCtl>>>,
    /// Credit every exchange starts with.
    window: usize,
}

/// Serves one greeted connection until the caller closes it, it breaks, or the server
/// stops. `reader` already holds any bytes that arrived behind `Hello`.
pub(super) async fn serve_connection<R, W>(
    shared: Arc<ServerShared>,
    peer: PeerInfo,
    mut reader: MuxReader<R>,
    write: W,
    close_at: tokio::time::Instant,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let limits = &shared.limits;
    let conn = Arc::new(OwnerConn {
        outbox: Outbox::new(limits.max_frame),
        exchanges: Mutex::default(),
        window: limits.stream_window.max(1),
    });
    let write_failed = spawn_writer(&shared, &conn, write, &peer);
    // Made once: each `cancelled()` future takes the token's lock when first polled.
    let (stopped, failed) = (shared.stop.cancelled(), write_failed.cancelled());
    let too_old = tokio::time::sleep_until(close_at);
    let draining = shared.drain_started.cancelled();
    // A caller of an older protocol cannot read `GoAway`: it learns of the drain from
    // each new request's `Error(Draining)` instead.
    let mut told_to_go = peer.protocol < Frame::GoAway.since();
    tokio::pin!(stopped, failed, too_old, draining);
    loop {
        let read = tokio::select! {
            biased;
            () = &mut stopped => break,
            () = &mut failed => break,
            () = &mut draining, if !told_to_go => {
                told_to_go = true;
                let _ = conn.outbox.push(0, &Frame::GoAway);
                continue;
            }
            () = &mut too_old => {
                // The caller should have moved on at the maximum age; one that did not,
                // or whose certificate just expired, is cut off here.
                warn!(peer = %peer.worker_id, identity = %peer.identity, addr = %peer.addr,
                    "mesh TCP connection closed: it outlived its maximum age or its peer's certificate");
                break;
            }
            read = reader.next() => read,
        };
        if on_read(&shared, &conn, &peer, read).is_break() {
            break;
        }
    }
    // Every exchange still running learns that its caller is gone; the writer sends
    // what is queued and closes the connection.
    for (_, ctl) in conn.exchanges.lock().drain() {
        ctl.set(GONE);
    }
    conn.outbox.close();
}

/// Spawns the task that writes what the connection's exchanges queue. The token it
/// returns is cancelled when writing fails: the connection is unusable both ways.
fn spawn_writer<W>(
    shared: &ServerShared,
    conn: &OwnerConn,
    write: W,
    peer: &PeerInfo,
) -> CancellationToken
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let write_failed = CancellationToken::new();
    let outbox = conn.outbox.clone();
    outbox.attach(Box::new(write));
    let failed = write_failed.clone();
    let stall = shared.limits.idle_timeout;
    let worker = peer.worker_id.clone();
    shared.tracker.spawn(async move {
        match write_loop(&outbox, stall).await {
            Ok(()) => outbox.shut_down().await,
            Err(e) => {
                debug!(peer = %worker, error = %e, "mesh TCP connection: writing failed");
                outbox.close();
                failed.cancel();
            }
        }
    });
    write_failed
}

/// Acts on what the reader read: starts, cancels or credits the exchange a frame
/// names, or answers a frame out of place. `Break` when the connection ended.
fn on_read(
    shared: &Arc<ServerShared>,
    conn: &Arc<OwnerConn>,
    peer: &PeerInfo,
    read: MuxRead,
) -> ControlFlow<()> {
    match read {
        MuxRead::Frame(id, Frame::Request(request)) => {
            start_exchange(shared, conn, peer, id, *request);
        }
        MuxRead::Frame(id, Frame::Cancel) => match conn.exchanges.lock().get(&id) {
            Some(ctl) => ctl.set(CANCELLED),
            // A Cancel that crossed the response's last frame.
            None => {
                debug!(peer = %peer.worker_id, exchange = id, "Cancel for an exchange that is not running")
            }
        },
        MuxRead::Frame(id, Frame::Credit(bytes)) => {
            if let Some(ctl) = conn.exchanges.lock().get(&id) {
                ctl.add_credit(bytes);
            }
        }
        MuxRead::Frame(id, other) => {
            warn!(peer = %peer.worker_id, exchange = id, frame = other.name(),
                "mesh peer sent an unexpected frame; answered with an error");
            let message = format!("expected Request, Cancel or Credit, got {}", other.name());
            refuse_exchange(conn, id, ErrorFrame::new(ErrorKind::Malformed, message));
        }
        MuxRead::Bad(exchange, error) => {
            warn!(peer = %peer.worker_id, ?exchange, %error, "mesh peer sent a bad frame; answered with an error");
            if let Frame::Error(frame) = error_for(&LinkError::BadFrame(error)) {
                // Without an id the answer goes to exchange 0, which no caller uses:
                // it is for logs and raw clients.
                refuse_exchange(conn, exchange.unwrap_or(0), frame);
            }
        }
        MuxRead::End => {
            debug!(peer = %peer.worker_id, "mesh TCP connection closed by the caller");
            return ControlFlow::Break(());
        }
        MuxRead::Broken(e) => {
            debug!(peer = %peer.worker_id, reason = %e.reason(), "mesh TCP connection broke");
            return ControlFlow::Break(());
        }
    }
    ControlFlow::Continue(())
}

/// Answers exchange `id` with an error, cancelling it if it runs.
fn refuse_exchange(conn: &OwnerConn, id: u64, frame: ErrorFrame) {
    if let Some(ctl) = conn.exchanges.lock().remove(&id) {
        ctl.set(CANCELLED);
    }
    let _ = conn.outbox.push(id, &Frame::Error(frame));
}

/// Registers exchange `id` and runs it in a task of its own.
fn start_exchange(
    shared: &Arc<ServerShared>,
    conn: &Arc<OwnerConn>,
    peer: &PeerInfo,
    id: u64,
    request: RequestFrame,
) {
    let ctl = Arc::new(ExchangeCtl {
        credit: AtomicUsize::new(conn.window),
        state: AtomicU8::new(RUNNING),
        wake: Notify::new(),
    });
    match conn.exchanges.lock().entry(id) {
        Entry::Occupied(_) => {
            // Ids are never reused on a connection; running it would answer twice.
            warn!(peer = %peer.worker_id, exchange = id, "mesh request repeats a running exchange id; refused");
            let _ = conn.outbox.push(
                id,
                &Frame::Error(ErrorFrame::new(
                    ErrorKind::Malformed,
                    "this exchange id is already running on this connection",
                )),
            );
            return;
        }
        Entry::Vacant(slot) => {
            slot.insert(ctl.clone());
        }
    }
    conn.outbox.exchange_started();
    let shared_for_task = shared.clone();
    let conn = conn.clone();
    let peer = peer.clone();
    let exchange = async move {
        let shared = shared_for_task;
        let mut link = MuxLink {
            id,
            outbox: conn.outbox.clone(),
            max_chunk: conn.outbox.max_chunk(),
            window: conn.window,
            ctl: ctl.clone(),
            pending: Vec::new(),
            pending_len: 0,
            ready: Vec::new(),
        };
        let end = serve_request(&shared, &peer, request, &mut link).await;
        conn.exchanges.lock().remove(&id);
        conn.outbox.exchange_ended();
        if end == ExchangeEnd::Broken
            && ctl.state.load(Ordering::Acquire) == RUNNING
            && !shared.stop.is_cancelled()
        {
            // The owner gave up on a caller that is still connected (it stopped
            // reading this exchange): say so, so the caller does not wait for more.
            let _ = conn.outbox.push(
                id,
                &Frame::Error(ErrorFrame::new(
                    ErrorKind::Cancelled,
                    "the owner stopped this exchange: the caller did not take its response in time",
                )),
            );
        }
    };
    // Boxed before it is spawned: the exchange's future is about 2 KB, and spawning
    // moves it through the tracker and into the task's cell (five copies, and one more
    // as it finishes); a box is copied once. 1,500 fewer instructions per forward at
    // the owner (scripts/instructions.py).
    shared.exchanges.spawn(Box::pin(exchange));
}

/// One exchange's end of the connection, owner side.
struct MuxLink {
    /// The caller's id for the exchange.
    id: u64,
    /// The connection's outbox.
    outbox: Arc<Outbox>,
    /// Largest body chunk per frame.
    max_chunk: usize,
    /// The exchange's credit window.
    window: usize,
    /// Credit, `Cancel` and connection state from the reader.
    ctl: Arc<ExchangeCtl>,
    /// Frames queued by the response and not yet pushed.
    pending: Vec<Frame>,
    /// Approximate bytes in `pending`.
    pending_len: usize,
    /// Frames cleared for sending (body bytes within credit), reused between flushes.
    ready: Vec<Frame>,
}

impl MuxLink {
    /// Pushes the frames in `ready` to the outbox.
    fn push_ready(&mut self) -> Result<(), SendError> {
        if self.ready.is_empty() {
            return Ok(());
        }
        let pushed = self.outbox.push_all(self.id, &self.ready);
        self.ready.clear();
        pushed.map_err(|e| match e {
            PushError::Closed => SendError::Io(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the mesh connection is closed",
            )),
            PushError::Encode(e) => SendError::Encode(e),
        })
    }

    /// Waits until the caller grants credit, cancels, or `by` passes.
    async fn wait_for_credit(&self, by: Instant) -> Result<(), SendError> {
        loop {
            let notified = self.ctl.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.ctl.credit.load(Ordering::Acquire) > 0 {
                return Ok(());
            }
            if self.ctl.state.load(Ordering::Acquire) != RUNNING {
                return Err(SendError::Io(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the caller cancelled the exchange or left",
                )));
            }
            if timeout_at(by, notified).await.is_err() {
                return Err(SendError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "caller did not take the response before the deadline",
                )));
            }
        }
    }
}

impl FrameQueue for MuxLink {
    fn queue(&mut self, frame: Frame) -> Result<(), WireError> {
        self.pending_len += match &frame {
            Frame::Chunk(bytes) => bytes.len(),
            _ => 64,
        };
        self.pending.push(frame);
        Ok(())
    }

    fn queued_len(&self) -> usize {
        self.pending_len
    }

    fn gather_limit(&self) -> usize {
        // No further ahead of the caller than one credit window.
        self.window
    }

    fn max_chunk(&self) -> usize {
        self.max_chunk
    }
}

impl ExchangeLink for MuxLink {
    async fn flush(&mut self, by: Instant) -> Result<(), SendError> {
        self.pending_len = 0;
        let frames = std::mem::take(&mut self.pending);
        for frame in frames {
            let Frame::Chunk(mut bytes) = frame else {
                self.ready.push(frame);
                continue;
            };
            if bytes.is_empty() {
                self.ready.push(Frame::Chunk(bytes));
                continue;
            }
            while !bytes.is_empty() {
                let credit = self.ctl.credit.load(Ordering::Acquire);
                if credit == 0 {
                    // What is cleared leaves now; the rest waits for the caller.
                    self.push_ready()?;
                    self.wait_for_credit(by).await?;
                    continue;
                }
                let n = credit.min(bytes.len());
                self.ctl.credit.fetch_sub(n, Ordering::AcqRel);
                self.ready.push(Frame::Chunk(bytes.split_to(n)));
            }
        }
        self.push_ready()
    }

    async fn caller_event(&mut self) -> CallerEvent {
        loop {
            let notified = self.ctl.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.ctl.state.load(Ordering::Acquire) {
                CANCELLED => return CallerEvent::Cancelled,
                GONE => return CallerEvent::Gone,
                _ => notified.await,
            }
        }
    }
}
