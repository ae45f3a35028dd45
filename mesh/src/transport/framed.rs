//! Frame reading and writing over any async byte stream (a TLS-over-TCP half, a QUIC
//! stream half).
//!
//! Not `tokio_util::codec::Framed`: after a decode error `Framed` ends its stream,
//! while the mesh keeps a connection across a bad frame (the codec resynchronises),
//! answering it with an error frame instead.

use std::io;

use bytes::BytesMut;
use mcpgw_wire::{Frame, MeshCodec, WireError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::{Decoder, Encoder};

use super::error::{LinkError, tls_cause};

/// Read buffer growth step: enough for a typical request or SSE event in one read.
const READ_RESERVE: usize = 16 * 1024;

/// Reads frames from `io`.
#[derive(Debug)]
pub(crate) struct FrameReader<R> {
    /// The byte stream.
    io: R,
    /// Bytes read but not yet decoded.
    buf: BytesMut,
    /// Decoder with its skip state.
    codec: MeshCodec,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(io: R, max_frame: usize) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
            codec: MeshCodec::new(max_frame),
        }
    }

    pub(crate) fn get_mut(&mut self) -> &mut R {
        &mut self.io
    }

    /// The next frame. `Ok(None)` is a clean end of stream between frames.
    /// `Err(BadFrame)` is a skipped frame (the stream stays usable);
    /// `Err(Broken)` means the stream is unusable.
    ///
    /// Cancel-safe: bytes read before a cancellation stay buffered for the next call.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        loop {
            match self.codec.decode(&mut self.buf) {
                Ok(Some(frame)) => return Ok(Some(frame)),
                Ok(None) => {}
                Err(WireError::Io(e)) => return Err(broken(&e)),
                Err(e) => return Err(LinkError::BadFrame(e)),
            }
            self.buf.reserve(READ_RESERVE);
            match self.io.read_buf(&mut self.buf).await {
                Ok(0) if self.buf.is_empty() && !self.codec.is_skipping() => return Ok(None),
                Ok(0) => {
                    return Err(LinkError::Broken {
                        reason: "stream ended inside a frame".into(),
                        tls: None,
                    });
                }
                Ok(_) => {}
                Err(e) => return Err(broken(&e)),
            }
        }
    }

    /// The stream and the bytes read past the last frame, for a protocol that goes
    /// on in another framing (the multiplexed TCP mesh after its greeting).
    pub(crate) fn into_parts(self) -> (R, BytesMut) {
        (self.io, self.buf)
    }
}

fn broken(e: &io::Error) -> LinkError {
    LinkError::Broken {
        reason: e.to_string(),
        tls: tls_cause(e),
    }
}

/// Why a frame could not be written.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The frame cannot be encoded (too large); nothing was written.
    Encode(WireError),
    /// The stream broke; part of the frame may have been written.
    Io(io::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Encode(e) => e.fmt(f),
            SendError::Io(e) => e.fmt(f),
        }
    }
}

/// Writes frames to `io`, flushing each one: a chunk is on its way as soon as it
/// is produced.
#[derive(Debug)]
pub(crate) struct FrameWriter<W> {
    /// The byte stream.
    io: W,
    /// Encode buffer, reused between frames.
    buf: BytesMut,
    /// Encoder.
    codec: MeshCodec,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(crate) fn new(io: W, max_frame: usize) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
            codec: MeshCodec::new(max_frame),
        }
    }

    pub(crate) fn get_mut(&mut self) -> &mut W {
        &mut self.io
    }

    /// The stream, for a protocol that goes on in another framing.
    pub(crate) fn into_inner(self) -> W {
        self.io
    }

    pub(crate) fn max_frame(&self) -> usize {
        self.codec.max_frame()
    }

    /// Encodes, writes and flushes one frame.
    pub(crate) async fn send(&mut self, frame: &Frame) -> Result<(), SendError> {
        self.buf.clear();
        self.codec
            .encode(frame, &mut self.buf)
            .map_err(SendError::Encode)?;
        self.write_buffered().await
    }

    /// Encodes `frame` after the frames already queued, without writing: parts of a
    /// response that are ready together then leave in one write (one TLS record, one
    /// syscall) instead of one each.
    pub(crate) fn queue(&mut self, frame: &Frame) -> Result<(), mcpgw_wire::WireError> {
        self.codec.encode(frame, &mut self.buf)
    }

    /// Bytes queued and not yet written.
    pub(crate) fn queued_len(&self) -> usize {
        self.buf.len()
    }

    /// Writes and flushes every queued frame at once.
    pub(crate) async fn flush_queued(&mut self) -> Result<(), SendError> {
        self.write_buffered().await
    }

    /// Writes and flushes bytes already encoded as one or more whole frames.
    pub(crate) async fn send_encoded(&mut self, frames: &[u8]) -> Result<(), SendError> {
        self.io.write_all(frames).await.map_err(SendError::Io)?;
        self.io.flush().await.map_err(SendError::Io)
    }

    /// Writes and flushes the buffer, leaving it empty for the next frames.
    async fn write_buffered(&mut self) -> Result<(), SendError> {
        let written = self.io.write_all(&self.buf).await;
        self.buf.clear();
        written.map_err(SendError::Io)?;
        self.io.flush().await.map_err(SendError::Io)
    }
}
