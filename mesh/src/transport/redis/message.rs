//! The routing header around each frame on the Redis channels (see the module docs
//! of `transport::redis` for the layout). Pure: no I/O, tested without Redis.

use bytes::{BufMut, Bytes, BytesMut};
use mcpgw_wire::{
    ErrorFrame, ErrorKind, Frame, MeshCodec, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, WireError,
};

/// The version every message is stamped with: the baseline sends only frames that
/// every version this worker speaks reads (never a frame newer than the oldest), so
/// workers one release apart read each other's messages.
pub(super) const MESSAGE_VERSION: u32 = OLDEST_PROTOCOL_VERSION;

/// Whether a message of `version` is one this worker reads.
pub(super) fn readable(version: u32) -> bool {
    (OLDEST_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version)
}
use tokio_util::codec::Encoder;

/// Bytes before the frame in a message to the caller: version and exchange id.
const REPLY_HEADER: usize = 12;

/// A message on a worker's request channel, borrowed from its payload.
#[derive(Debug)]
pub(super) struct ToOwner<'a> {
    /// The caller's mesh protocol version.
    pub(super) version: u32,
    /// The caller's id for this exchange, echoed in every reply.
    pub(super) exchange: u64,
    /// The caller's worker id: names its reply channel.
    pub(super) caller: &'a str,
    /// One encoded frame.
    pub(super) frame: &'a [u8],
}

/// A message on a worker's reply channel, borrowed from its payload.
#[derive(Debug)]
pub(super) struct ToCaller<'a> {
    /// The owner's mesh protocol version.
    pub(super) version: u32,
    /// The exchange the reply belongs to.
    pub(super) exchange: u64,
    /// One encoded frame; empty for a keep-alive.
    pub(super) frame: &'a [u8],
}

pub(super) fn encode_to_owner(
    codec: &mut MeshCodec,
    exchange: u64,
    caller: &str,
    frame: &Frame,
) -> Result<Bytes, WireError> {
    let caller_len = u16::try_from(caller.len())
        .map_err(|_| WireError::Unencodable("the worker id is longer than 65535 bytes".into()))?;
    let mut buf = BytesMut::with_capacity(REPLY_HEADER + 2 + caller.len());
    buf.put_u32(MESSAGE_VERSION);
    buf.put_u64(exchange);
    buf.put_u16(caller_len);
    buf.put_slice(caller.as_bytes());
    // Encoded in place behind the header: the same bytes `encode_frame` makes, without
    // copying them into a second buffer.
    codec.encode(frame, &mut buf)?;
    Ok(buf.freeze())
}

pub(super) fn encode_to_caller(
    codec: &mut MeshCodec,
    exchange: u64,
    frame: Option<&Frame>,
) -> Result<Bytes, WireError> {
    let mut buf = BytesMut::with_capacity(REPLY_HEADER);
    buf.put_u32(MESSAGE_VERSION);
    buf.put_u64(exchange);
    if let Some(frame) = frame {
        codec.encode(frame, &mut buf)?;
    }
    Ok(buf.freeze())
}

/// Splits off the fixed header fields; never panics, whatever the bytes.
fn header(payload: &[u8]) -> Result<(u32, u64, &[u8]), String> {
    let short = || {
        format!(
            "a {}-byte message is shorter than its header",
            payload.len()
        )
    };
    let (version, rest) = payload.split_first_chunk::<4>().ok_or_else(short)?;
    let (exchange, rest) = rest.split_first_chunk::<8>().ok_or_else(short)?;
    Ok((
        u32::from_be_bytes(*version),
        u64::from_be_bytes(*exchange),
        rest,
    ))
}

pub(super) fn decode_to_owner(payload: &[u8]) -> Result<ToOwner<'_>, String> {
    let (version, exchange, rest) = header(payload)?;
    let (len, rest) = rest
        .split_first_chunk::<2>()
        .ok_or("the message ends before the caller id")?;
    let len = usize::from(u16::from_be_bytes(*len));
    if rest.len() < len {
        return Err(format!(
            "the caller id is said to be {len} bytes, the message holds {}",
            rest.len()
        ));
    }
    let (caller, frame) = rest.split_at(len);
    let caller = std::str::from_utf8(caller).map_err(|_| "the caller id is not UTF-8")?;
    Ok(ToOwner {
        version,
        exchange,
        caller,
        frame,
    })
}

pub(super) fn decode_to_caller(payload: &[u8]) -> Result<ToCaller<'_>, String> {
    let (version, exchange, frame) = header(payload)?;
    Ok(ToCaller {
        version,
        exchange,
        frame,
    })
}

/// Whether `id` can name a reply channel: 1 to 256 visible ASCII characters, as the
/// directory requires of worker ids.
pub(super) fn valid_worker_id(id: &str) -> bool {
    (1..=256).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

pub(super) fn version_mismatch(theirs: u32) -> Frame {
    Frame::Error(ErrorFrame::new(
        ErrorKind::VersionMismatch,
        format!(
            "this worker speaks mesh protocol versions {OLDEST_PROTOCOL_VERSION} to \
             {PROTOCOL_VERSION}, the peer {theirs}: workers one release apart forward to each \
             other, two apart do not; upgrade the older workers one release at a time"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_to_the_owner_round_trip() {
        let mut codec = MeshCodec::default();
        let payload = encode_to_owner(&mut codec, 42, "caller-1", &Frame::Cancel).unwrap();
        let m = decode_to_owner(&payload).unwrap();
        assert_eq!(m.version, MESSAGE_VERSION);
        assert_eq!(m.exchange, 42);
        assert_eq!(m.caller, "caller-1");
        assert_eq!(codec.decode_frame(m.frame).unwrap(), Frame::Cancel);
    }

    #[test]
    fn messages_to_the_caller_round_trip() {
        let mut codec = MeshCodec::default();
        let chunk = Frame::Chunk(Bytes::from_static(b"data: 1\n\n"));
        let payload = encode_to_caller(&mut codec, u64::MAX, Some(&chunk)).unwrap();
        let m = decode_to_caller(&payload).unwrap();
        assert_eq!((m.version, m.exchange), (MESSAGE_VERSION, u64::MAX));
        assert_eq!(codec.decode_frame(m.frame).unwrap(), chunk);
        let keepalive = encode_to_caller(&mut codec, 3, None).unwrap();
        assert!(decode_to_caller(&keepalive).unwrap().frame.is_empty());
    }

    #[test]
    fn garbage_never_panics() {
        for len in 0..40 {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let _ = decode_to_owner(&bytes);
            let _ = decode_to_caller(&bytes);
        }
        // A caller id longer than the message.
        let mut bytes = vec![0u8; 12];
        bytes.extend_from_slice(&[0xff, 0xff, b'x']);
        assert!(decode_to_owner(&bytes).is_err());
    }

    #[test]
    fn worker_ids_that_name_channels() {
        assert!(valid_worker_id("host-1-abc"));
        assert!(!valid_worker_id(""));
        assert!(!valid_worker_id("a b"));
        assert!(!valid_worker_id(&"x".repeat(257)));
    }
}
