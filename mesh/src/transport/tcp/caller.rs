//! The caller's end of a multiplexed TCP connection: a reader task that hands each
//! frame to the exchange it names, and the exchanges, which read their own frames and
//! grant the owner credit as they consume body bytes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use mcpgw_wire::{Frame, WireError};
use parking_lot::Mutex;
use tokio::io::AsyncRead;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::mux::{MuxRead, MuxReader, Outbox, PushError};
use crate::transport::calling::ExState;
use crate::transport::error::LinkError;
use crate::transport::tls::ConnectionLife;

/// One greeted connection, caller side.
pub(crate) struct CallerConn {
    /// Frames for the writer task.
    pub(super) outbox: Arc<Outbox>,
    /// Exchanges waiting for frames, and the next id.
    routes: Mutex<Routes>,
    /// Exchanges in flight on this connection, to pick the least loaded one.
    open: AtomicUsize,
    /// The worker id this connection's `Welcome` named.
    pub(super) worker_id: String,
    /// The mesh identity (URI) in the owner's certificate; `None` over the same-host
    /// path, where the kernel vouched for the owner (a process of our uid).
    pub(super) identity: Option<String>,
    /// When the pool stops using it, and when it closes.
    pub(super) life: ConnectionLife,
    /// Credit each exchange starts with; the caller credits back as it reads.
    window: usize,
    /// Cancelled when the connection is unusable (read or write failed, closed).
    pub(super) dead: CancellationToken,
    /// Set with `dead`, read on every pick without the token's lock.
    closed: AtomicBool,
    /// Set when the pool let go of this connection: it closes once its last exchange
    /// ends.
    retiring: AtomicBool,
}

#[derive(Default)]
struct Routes {
    /// Where each open exchange's frames go.
    map: rustc_hash::FxHashMap<u64, Arc<Inbox>>,
    /// The next exchange id; ids are never reused on a connection, so a late frame of
    /// a finished exchange can never be taken for another's.
    next_id: u64,
    /// Why the connection closed, once it did; no exchange opens after.
    closed: Option<LinkError>,
}

/// One exchange's frames, handed over by the reader task.
#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    /// Wakes the exchange when something arrives.
    wake: Notify,
}

#[derive(Default)]
struct InboxState {
    frames: VecDeque<Frame>,
    /// Body bytes delivered and not yet consumed: bounded by the credit window, so an
    /// owner that ignores credit is caught.
    outstanding: usize,
    /// Set when no more frames will come, with the reason.
    failed: Option<LinkError>,
}

impl CallerConn {
    pub(super) fn new(
        outbox: Arc<Outbox>,
        worker_id: String,
        identity: Option<String>,
        life: ConnectionLife,
        window: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            outbox,
            routes: Mutex::new(Routes {
                next_id: 1,
                ..Routes::default()
            }),
            open: AtomicUsize::new(0),
            worker_id,
            identity,
            life,
            window: window.max(1),
            dead: CancellationToken::new(),
            closed: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
        })
    }

    /// Exchanges in flight on this connection.
    pub(super) fn load(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Whether the connection can take a new exchange.
    pub(super) fn usable(&self) -> bool {
        !self.closed.load(Ordering::Relaxed) && !self.retiring.load(Ordering::Relaxed)
    }

    /// Lets the pool drop this connection: it closes as soon as nothing runs on it.
    /// Decided under the routes lock, as [`start`](Self::start) decides whether it may
    /// open an exchange: an exchange is either routed before the retirement (and the
    /// connection waits for it) or refused unsent, never cut off after it was queued.
    pub(super) fn retire(&self) {
        let idle = {
            let routes = self.routes.lock();
            self.retiring.store(true, Ordering::Relaxed);
            routes.map.is_empty()
        };
        if idle {
            self.fail_all(LinkError::Broken {
                reason: "the connection was retired".into(),
                tls: None,
            });
        }
    }

    /// Opens an exchange and queues its request. `Err(None)`: the connection closed
    /// before anything was queued, so the request cannot have reached the owner.
    pub(super) fn start(
        self: &Arc<Self>,
        request: &Frame,
    ) -> Result<TcpExchange, Option<WireError>> {
        let inbox = Arc::new(Inbox::default());
        let id = {
            let mut routes = self.routes.lock();
            // Retiring (a GoAway, an old connection, a forgotten peer): the pool dials
            // or picks another; nothing was queued here.
            if routes.closed.is_some() || self.retiring.load(Ordering::Relaxed) {
                return Err(None);
            }
            let id = routes.next_id;
            routes.next_id += 1;
            routes.map.insert(id, inbox.clone());
            self.open.fetch_add(1, Ordering::Relaxed);
            id
        };
        self.outbox.exchange_started();
        let exchange = TcpExchange {
            conn: self.clone(),
            id,
            inbox,
            unreported: 0,
            state: ExState::Open,
            released: false,
        };
        match self.outbox.push(id, request) {
            Ok(()) => Ok(exchange),
            Err(e) => {
                // Nothing was queued: there is nothing to cancel at the owner.
                let mut exchange = exchange;
                exchange.state = ExState::Clean;
                drop(exchange);
                Err(match e {
                    PushError::Closed => None,
                    PushError::Encode(e) => Some(e),
                })
            }
        }
    }

    /// Stops routing to `id`; true if it was still routed.
    fn close_exchange(&self, id: u64) -> bool {
        let removed = self.routes.lock().map.remove(&id).is_some();
        if removed {
            self.one_less();
        }
        removed
    }

    /// Counts an exchange whose route was removed; a retiring connection closes with
    /// its last one.
    fn one_less(&self) {
        self.outbox.exchange_ended();
        let _ = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        // The routes, not the counter, say whether anything still runs here: an exchange
        // being opened is routed (under the lock) before it is counted.
        if self.retiring.load(Ordering::Relaxed) && self.routes.lock().map.is_empty() {
            self.fail_all(LinkError::Broken {
                reason: "the connection was retired".into(),
                tls: None,
            });
        }
    }

    /// Hands a frame to its exchange. `End` and `Error` end the exchange's route.
    fn route(&self, id: u64, frame: Frame) {
        let mut routes = self.routes.lock();
        let Some(inbox) = routes.map.get(&id) else {
            // Its exchange was cancelled or dropped: nobody reads it any more.
            return;
        };
        let last = matches!(frame, Frame::End | Frame::Error(_));
        let body = match &frame {
            Frame::Chunk(bytes) => bytes.len(),
            _ => 0,
        };
        let overrun = {
            let mut state = inbox.state.lock();
            state.outstanding += body;
            if state.outstanding > self.window {
                state.failed = Some(LinkError::BadFrame(WireError::Malformed(format!(
                    "the owner sent {} body bytes beyond the {}-byte credit window",
                    state.outstanding - self.window,
                    self.window
                ))));
                true
            } else {
                state.frames.push_back(frame);
                false
            }
        };
        inbox.wake.notify_one();
        if last || overrun {
            routes.map.remove(&id);
            drop(routes);
            self.one_less();
            if overrun {
                warn!(exchange = id, peer = %self.worker_id, "mesh owner ignored the credit window; exchange cancelled");
                let _ = self.outbox.push(id, &Frame::Cancel);
            }
        }
    }

    /// Fails every exchange with `error` and closes the connection.
    pub(super) fn fail_all(&self, error: LinkError) {
        let inboxes: Vec<Arc<Inbox>> = {
            let mut routes = self.routes.lock();
            if routes.closed.is_none() {
                routes.closed = Some(clone_link_error(&error));
            }
            routes.map.drain().map(|(_, inbox)| inbox).collect()
        };
        self.open.store(0, Ordering::Relaxed);
        for inbox in inboxes {
            inbox.state.lock().failed = Some(clone_link_error(&error));
            inbox.wake.notify_one();
        }
        self.outbox.close();
        self.closed.store(true, Ordering::Relaxed);
        self.dead.cancel();
    }
}

fn clone_link_error(e: &LinkError) -> LinkError {
    match e {
        LinkError::Broken { reason, tls } => LinkError::Broken {
            reason: reason.clone(),
            tls: tls.clone(),
        },
        LinkError::BadFrame(w) => LinkError::BadFrame(WireError::Malformed(w.to_string())),
    }
}

/// The reader task: routes frames until the connection ends, then fails whatever is
/// still open on it.
pub(super) async fn read_loop<R: AsyncRead + Unpin>(
    conn: Arc<CallerConn>,
    mut reader: MuxReader<R>,
    stop: CancellationToken,
) {
    // Made once: each `cancelled()` future takes the token's lock when first polled.
    let (dropped, dead) = (stop.cancelled(), conn.dead.cancelled());
    tokio::pin!(dropped, dead);
    let error = loop {
        let read = tokio::select! {
            biased;
            () = &mut dropped => break LinkError::Broken {
                reason: "the mesh client was dropped".into(),
                tls: None,
            },
            () = &mut dead => break LinkError::Broken {
                reason: "the connection closed".into(),
                tls: None,
            },
            read = reader.next() => read,
        };
        match read {
            // The owner drains: no new exchange here; those in flight finish.
            MuxRead::Frame(_, Frame::GoAway) => conn.retire(),
            MuxRead::Frame(id, frame) => conn.route(id, frame),
            MuxRead::Bad(Some(id), error) => {
                debug!(exchange = id, %error, "mesh owner sent a bad frame");
                let inbox = conn.routes.lock().map.get(&id).cloned();
                if let Some(inbox) = inbox {
                    inbox.state.lock().failed = Some(LinkError::BadFrame(error));
                    inbox.wake.notify_one();
                    if conn.close_exchange(id) {
                        let _ = conn.outbox.push(id, &Frame::Cancel);
                    }
                }
            }
            MuxRead::Bad(None, error) => {
                warn!(peer = %conn.worker_id, %error, "mesh owner sent a frame without a readable exchange id; ignored");
            }
            MuxRead::End => {
                break LinkError::Broken {
                    reason: "the owner closed the connection".into(),
                    tls: None,
                };
            }
            MuxRead::Broken(e) => break e,
        }
    };
    conn.fail_all(error);
}

/// One request's exchange on a multiplexed connection, caller side.
pub(crate) struct TcpExchange {
    conn: Arc<CallerConn>,
    /// The exchange id on the connection.
    id: u64,
    /// Frames the reader routed here.
    inbox: Arc<Inbox>,
    /// Body bytes consumed and not yet credited back to the owner.
    unreported: usize,
    pub(crate) state: ExState,
    /// Set once the route was closed (and the exchange cancelled, if it had to be).
    released: bool,
}

impl TcpExchange {
    /// The owner's next frame; consuming body bytes grants credit back.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        let frame = loop {
            let notified = self.inbox.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let taken = {
                let mut state = self.inbox.state.lock();
                match state.frames.pop_front() {
                    Some(frame) => {
                        if let Frame::Chunk(bytes) = &frame {
                            state.outstanding = state.outstanding.saturating_sub(bytes.len());
                        }
                        Some(Ok(frame))
                    }
                    None => state.failed.take().map(Err),
                }
            };
            match taken {
                Some(Ok(frame)) => break frame,
                Some(Err(e)) => return Err(e),
                None => notified.await,
            }
        };
        if let Frame::Chunk(bytes) = &frame {
            self.consumed(bytes.len());
        }
        Ok(Some(frame))
    }

    /// Credits consumed bytes back once half a window has gathered: fewer updates
    /// than one per chunk, and the owner never runs dry while the caller keeps up.
    fn consumed(&mut self, bytes: usize) {
        self.unreported += bytes;
        if self.unreported >= (self.conn.window / 2).max(1) {
            let grant = u32::try_from(self.unreported).unwrap_or(u32::MAX);
            self.unreported -= grant as usize;
            let _ = self.conn.outbox.push(self.id, &Frame::Credit(grant));
        }
    }

    /// Stops routing to the exchange; one that did not end cleanly is cancelled at
    /// the owner (only this exchange: the connection serves on).
    pub(crate) fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let was_routed = self.conn.close_exchange(self.id);
        if was_routed && self.state != ExState::Clean {
            let _ = self.conn.outbox.push(self.id, &Frame::Cancel);
        }
    }
}

impl Drop for TcpExchange {
    fn drop(&mut self) {
        self.release();
    }
}
