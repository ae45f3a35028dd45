//! Framing: a big-endian `u32` length prefix, then a bincode-format body.
//!
//! The decoder keeps the byte stream in sync after every error it reports: an
//! oversized frame's bytes are skipped (even those that have not arrived yet) and a
//! malformed body is dropped whole, so the next frame decodes normally. That lets a
//! transport answer one bad frame with an error frame and keep the connection.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};
use wincode::config::Configuration;

use crate::frame::Frame;

/// Maximum frame body size used by [`MeshCodec::default`] and by default mesh
/// endpoints (`MeshLimits::default`, the gateway's `[mesh] max_frame_bytes`): 8 MiB. A
/// request body must fit in one frame; a response body may be any size (it travels as
/// chunks).
pub const DEFAULT_MAX_FRAME: usize = 8 << 20;

/// The largest maximum frame size a codec accepts: 1 GiB. Larger settings are
/// clamped to it (the length prefix could say 4 GiB; nothing legitimate needs that).
pub const MAX_FRAME_LIMIT: usize = 1 << 30;

/// The smallest preallocation limit handed to wincode, as a power of two (64 KiB).
const MIN_PREALLOC_SHIFT: u32 = 16;

/// The bincode enum tag of [`Frame::Chunk`]: its index in the enum.
const CHUNK_TAG: u32 = 4;

/// Bytes in the length prefix.
pub(crate) const PREFIX_LEN: usize = 4;

/// What went wrong while encoding or decoding a frame.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A frame's declared length exceeds the maximum frame size; its bytes are skipped.
    #[error(
        "mesh frame of {len} bytes exceeds the {max}-byte limit: send less in one request, \
         or raise the mesh max frame size on every worker"
    )]
    FrameTooLarge {
        /// The frame's body length, as declared by its prefix (decode) or computed (encode).
        len: usize,
        /// The maximum frame size in force.
        max: usize,
    },
    /// A frame's body is not a valid frame; its bytes are skipped.
    #[error(
        "malformed mesh frame ({0}): the peer sent bytes that are not a mesh frame of this protocol version"
    )]
    Malformed(String),
    /// A frame could not be encoded (for example, a header list too long to preallocate).
    #[error("cannot encode mesh frame: {0}")]
    Unencodable(String),
    /// Reading or writing the underlying byte stream failed.
    #[error("mesh stream I/O failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Runs `$body` with `$cfg` bound to a wincode configuration whose preallocation limit
/// is `1 << $shift` bytes (clamped to the supported range).
///
/// wincode takes that limit as a const generic, while the mesh's maximum frame size is
/// runtime configuration; one monomorphization per power of two bridges the two.
macro_rules! with_prealloc_config {
    ($shift:expr, $cfg:ident => $body:expr) => {
        with_prealloc_config!(@arms $shift, $cfg => $body; 16 17 18 19 20 21 22 23 24 25 26 27 28 29; 30)
    };
    (@arms $shift:expr, $cfg:ident => $body:expr; $($s:literal)*; $last:literal) => {
        match $shift {
            $(
                $s => {
                    let $cfg = Configuration::default()
                        .with_preallocation_size_limit::<{ 1usize << $s }>();
                    $body
                }
            )*
            _ => {
                let $cfg = Configuration::default()
                    .with_preallocation_size_limit::<{ 1usize << $last }>();
                $body
            }
        }
    };
}

/// The mesh frame codec for `tokio_util::codec`, and whole-frame helpers.
///
/// `max_frame` bounds the *body* of every frame in both directions. It also sets
/// wincode's preallocation limit, the most one sequence in a frame may reserve before
/// its bytes are read: `max_frame` rounded up to a power of two (at least 64 KiB).
/// So a peer cannot make the decoder reserve much more than `max_frame` for one
/// sequence, and every byte string or text field that fits in a frame also fits that
/// limit. Header and scope lists are bounded by it too (a header pair reserves 48
/// bytes, so a 16 MiB limit allows 349,525 headers); the encoder refuses a longer list
/// with [`WireError::Unencodable`] instead of sending what the peer would refuse.
///
/// A codec carries decode state (bytes still to skip); use one per byte stream.
#[derive(Debug, Clone)]
pub struct MeshCodec {
    /// Largest frame body accepted or produced, in bytes.
    max_frame: usize,
    /// log2 of wincode's preallocation limit, derived from `max_frame`.
    prealloc_shift: u32,
    /// The rest of an oversized frame, skipped before the next prefix.
    discard: Discard,
}

/// The bytes of an oversized frame still to be skipped, including those not yet
/// received, so that decoding resumes at the next length prefix. Shared by both codecs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Discard(usize);

impl Discard {
    /// Skips what arrived of the frame being discarded; `false` while more is to come.
    pub(crate) fn caught_up(&mut self, src: &mut BytesMut) -> bool {
        let n = self.0.min(src.len());
        src.advance(n);
        self.0 -= n;
        self.0 == 0
    }

    /// Starts skipping the frame whose prefix (announcing `len` bytes) begins `src`.
    pub(crate) fn start(&mut self, len: usize, src: &mut BytesMut) {
        src.advance(PREFIX_LEN);
        let n = len.min(src.len());
        src.advance(n);
        self.0 = len - n;
    }

    pub(crate) fn pending(&self) -> bool {
        self.0 > 0
    }
}

impl Default for MeshCodec {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME)
    }
}

impl MeshCodec {
    /// A codec that accepts and produces frame bodies of at most `max_frame` bytes
    /// (clamped to `1..=`[`MAX_FRAME_LIMIT`]).
    pub fn new(max_frame: usize) -> Self {
        let max_frame = max_frame.clamp(1, MAX_FRAME_LIMIT);
        let prealloc_shift = max_frame
            .next_power_of_two()
            .trailing_zeros()
            .max(MIN_PREALLOC_SHIFT);
        Self {
            max_frame,
            prealloc_shift,
            discard: Discard::default(),
        }
    }

    /// The maximum frame body size in force.
    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Whether the decoder is still skipping the rest of an oversized frame. A stream
    /// that ends now ends inside a frame, not cleanly between two.
    pub fn is_skipping(&self) -> bool {
        self.discard.pending()
    }

    /// Encodes one frame, length prefix included, for transports that move whole
    /// messages (the Redis baseline). Same bytes as the [`Encoder`] produces.
    pub fn encode_frame(&self, frame: &Frame) -> Result<Bytes, WireError> {
        let mut buf = BytesMut::new();
        self.encode_into(frame, &mut buf)?;
        Ok(buf.freeze())
    }

    /// Decodes one whole frame, length prefix included, as produced by
    /// [`encode_frame`](Self::encode_frame). The input must hold exactly one frame.
    pub fn decode_frame(&self, bytes: &[u8]) -> Result<Frame, WireError> {
        let (prefix, body) = bytes
            .split_first_chunk::<PREFIX_LEN>()
            .ok_or_else(|| WireError::Malformed("shorter than the length prefix".into()))?;
        let len = u32::from_be_bytes(*prefix) as usize;
        if len > self.max_frame {
            return Err(WireError::FrameTooLarge {
                len,
                max: self.max_frame,
            });
        }
        if len != body.len() {
            return Err(WireError::Malformed(format!(
                "length prefix says {len} bytes, message holds {}",
                body.len()
            )));
        }
        self.decode_body(body)
    }

    /// Parses one frame body that the caller owns. A `Chunk` (the frame that carries
    /// response bodies, by far the most bytes) keeps its payload in `body`'s memory
    /// instead of copying it out; every other frame is parsed by [`decode_body`].
    /// Never panics, whatever the bytes.
    ///
    /// [`decode_body`]: Self::decode_body
    pub(crate) fn decode_owned(&self, body: BytesMut) -> Result<Frame, WireError> {
        if let Some((tag, rest)) = body.split_first_chunk::<4>()
            && u32::from_le_bytes(*tag) == CHUNK_TAG
            && let Some((len, payload)) = rest.split_first_chunk::<8>()
            && u64::from_le_bytes(*len) == payload.len() as u64
        {
            return Ok(Frame::Chunk(body.freeze().slice(Frame::CHUNK_OVERHEAD..)));
        }
        self.decode_body(&body)
    }

    /// Parses one frame body. Never panics, whatever the bytes.
    pub(crate) fn decode_body(&self, body: &[u8]) -> Result<Frame, WireError> {
        with_prealloc_config!(self.prealloc_shift, cfg => {
            wincode::config::deserialize_exact::<Frame, _>(body, cfg)
        })
        .map_err(|e| WireError::Malformed(e.to_string()))
    }

    /// Appends `frame`, length prefix included, to `dst`. On error `dst` is unchanged.
    fn encode_into(&self, frame: &Frame, dst: &mut BytesMut) -> Result<(), WireError> {
        self.encode_behind(&[], frame, dst)
    }

    /// Appends a length prefix, `header`, then `frame`'s body to `dst`; the prefix
    /// counts the header, and the maximum frame size bounds header and body together.
    /// On error `dst` is unchanged.
    pub(crate) fn encode_behind(
        &self,
        header: &[u8],
        frame: &Frame,
        dst: &mut BytesMut,
    ) -> Result<(), WireError> {
        let unencodable = |e: wincode::WriteError| WireError::Unencodable(e.to_string());
        let size = with_prealloc_config!(self.prealloc_shift, cfg => {
            wincode::config::serialized_size(frame, cfg)
        })
        .map_err(unencodable)?;
        let body_len = usize::try_from(size).unwrap_or(usize::MAX);
        let len = body_len
            .checked_add(header.len())
            .filter(|len| *len <= self.max_frame)
            .ok_or(WireError::FrameTooLarge {
                len: body_len.saturating_add(header.len()),
                max: self.max_frame,
            })?;
        // `max_frame <= MAX_FRAME_LIMIT < u32::MAX`, so the prefix cannot overflow.
        let prefix = u32::try_from(len).map_err(|_| WireError::FrameTooLarge {
            len,
            max: self.max_frame,
        })?;
        let start = dst.len();
        dst.reserve(PREFIX_LEN + len);
        dst.put_u32(prefix);
        dst.put_slice(header);
        let body_start = dst.len();
        dst.resize(body_start + body_len, 0);
        let written = with_prealloc_config!(self.prealloc_shift, cfg => {
            wincode::config::serialize_into(&mut dst[body_start..], frame, cfg)
        });
        if let Err(e) = written {
            dst.truncate(start);
            return Err(unencodable(e));
        }
        Ok(())
    }
}

impl Decoder for MeshCodec {
    type Item = Frame;
    type Error = WireError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        if !self.discard.caught_up(src) {
            return Ok(None);
        }
        let Some(prefix) = src.first_chunk::<PREFIX_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*prefix) as usize;
        if len > self.max_frame {
            // Skip the oversized frame, including bytes still in flight, so that the
            // next frame starts at a prefix again.
            self.discard.start(len, src);
            return Err(WireError::FrameTooLarge {
                len,
                max: self.max_frame,
            });
        }
        if src.len() < PREFIX_LEN + len {
            src.reserve(PREFIX_LEN + len - src.len());
            return Ok(None);
        }
        src.advance(PREFIX_LEN);
        let body = src.split_to(len);
        self.decode_owned(body).map(Some)
    }
}

impl Encoder<&Frame> for MeshCodec {
    type Error = WireError;

    fn encode(&mut self, frame: &Frame, dst: &mut BytesMut) -> Result<(), WireError> {
        self.encode_into(frame, dst)
    }
}

impl Encoder<Frame> for MeshCodec {
    type Error = WireError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), WireError> {
        self.encode_into(&frame, dst)
    }
}
