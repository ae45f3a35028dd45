//! Multiplexed framing, for transports that carry many exchanges on one byte stream
//! (the TCP mesh): after the greeting, every frame names the exchange it belongs to.
//!
//! On the wire: a big-endian `u32` body length, then the body, which is the bincode
//! encoding of `(exchange: u64, frame: Frame)`: the exchange id as a little-endian
//! `u64`, then the frame exactly as [`MeshCodec`] encodes its body. The maximum frame
//! size bounds the whole body, id included.
//!
//! The greeting (`Hello` → `Welcome`, or a refusal) stays in [`MeshCodec`] framing, so
//! peers of every protocol version can read it and refuse each other clearly.
//!
//! Like [`MeshCodec`], the decoder stays in sync after every error it reports, and it
//! says which exchange a bad frame belonged to whenever the id could be read (an
//! oversized frame's id is read before its bytes are skipped), so a transport can fail
//! that one exchange and keep the connection for the others.

use bytes::{Buf, BytesMut};
use tokio_util::codec::Decoder;

use crate::codec::{Discard, MeshCodec, PREFIX_LEN, WireError};
use crate::frame::Frame;

/// Bytes of the exchange id in front of each multiplexed frame body.
const EXCHANGE_LEN: usize = 8;

/// The smallest maximum frame a [`MuxCodec`] accepts: room for an id and a small frame.
const MIN_MAX_FRAME: usize = 64;

/// A frame that could not be decoded, and the exchange it belonged to when known.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct MuxError {
    /// The exchange the bad frame named; `None` when not even its id could be read.
    pub exchange: Option<u64>,
    /// What was wrong with it.
    pub error: WireError,
}

impl From<std::io::Error> for MuxError {
    fn from(e: std::io::Error) -> Self {
        Self {
            exchange: None,
            error: WireError::Io(e),
        }
    }
}

/// The multiplexed frame codec: encodes and decodes `(exchange id, frame)` pairs.
///
/// A codec carries decode state (bytes still to skip); use one per byte stream.
#[derive(Debug, Clone)]
pub struct MuxCodec {
    /// Frame body encoding and decoding, and the maximum frame size.
    codec: MeshCodec,
    /// The rest of an oversized frame, skipped before the next prefix.
    discard: Discard,
}

impl MuxCodec {
    /// Bytes a multiplexed [`Frame::Chunk`] body adds to its payload: the exchange id,
    /// the enum tag and the length. A sender splits payloads to fit the maximum frame.
    pub const CHUNK_OVERHEAD: usize = EXCHANGE_LEN + Frame::CHUNK_OVERHEAD;

    /// A codec whose frame bodies (id included) are at most `max_frame` bytes
    /// (clamped to 64 bytes ..= [`MAX_FRAME_LIMIT`](crate::MAX_FRAME_LIMIT)).
    pub fn new(max_frame: usize) -> Self {
        Self {
            codec: MeshCodec::new(max_frame.max(MIN_MAX_FRAME)),
            discard: Discard::default(),
        }
    }

    /// The maximum frame body size in force, exchange id included.
    pub fn max_frame(&self) -> usize {
        self.codec.max_frame()
    }

    /// Whether the decoder is still skipping the rest of an oversized frame.
    pub fn is_skipping(&self) -> bool {
        self.discard.pending()
    }

    /// Appends `frame` of `exchange`, length prefix included, to `dst`. On error `dst`
    /// is unchanged. Takes `&self`: encoding keeps no state, so one codec may encode
    /// for many exchanges at once.
    pub fn encode(
        &self,
        exchange: u64,
        frame: &Frame,
        dst: &mut BytesMut,
    ) -> Result<(), WireError> {
        self.codec
            .encode_behind(&exchange.to_le_bytes(), frame, dst)
    }
}

impl Decoder for MuxCodec {
    type Item = (u64, Frame);
    type Error = MuxError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<(u64, Frame)>, MuxError> {
        if !self.discard.caught_up(src) {
            return Ok(None);
        }
        let Some(prefix) = src.first_chunk::<PREFIX_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*prefix) as usize;
        let max = self.codec.max_frame();
        if len > max {
            // Read the id first, so the exchange can be told; then skip the frame,
            // including bytes still in flight.
            let Some(id) = src
                .get(PREFIX_LEN..PREFIX_LEN + EXCHANGE_LEN)
                .and_then(|id| <[u8; EXCHANGE_LEN]>::try_from(id).ok())
            else {
                return Ok(None);
            };
            self.discard.start(len, src);
            return Err(MuxError {
                exchange: Some(u64::from_le_bytes(id)),
                error: WireError::FrameTooLarge { len, max },
            });
        }
        if src.len() < PREFIX_LEN + len {
            src.reserve(PREFIX_LEN + len - src.len());
            return Ok(None);
        }
        src.advance(PREFIX_LEN);
        let mut body = src.split_to(len);
        let Some(id) = body.first_chunk::<EXCHANGE_LEN>() else {
            return Err(MuxError {
                exchange: None,
                error: WireError::Malformed(format!(
                    "a {len}-byte multiplexed frame is shorter than its exchange id"
                )),
            });
        };
        let exchange = u64::from_le_bytes(*id);
        body.advance(EXCHANGE_LEN);
        match self.codec.decode_owned(body) {
            Ok(frame) => Ok(Some((exchange, frame))),
            Err(error) => Err(MuxError {
                exchange: Some(exchange),
                error,
            }),
        }
    }
}
