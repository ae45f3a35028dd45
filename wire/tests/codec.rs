//! Codec behaviour: round trips, partial input, garbage, and resynchronisation after
//! oversized or malformed frames.

use bytes::{BufMut, Bytes, BytesMut};
use mcpgw_wire::{
    AuthContext, AuthMode, ErrorFrame, ErrorKind, Frame, MeshCodec, PROTOCOL_VERSION, RequestFrame,
    ResponseHead, WireError,
};
use proptest::prelude::*;
use tokio_util::codec::{Decoder, Encoder};

fn bytes() -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from)
}

fn headers() -> impl Strategy<Value = Vec<(String, String)>> {
    proptest::collection::vec((any::<String>(), any::<String>()), 0..6)
}

fn auth() -> impl Strategy<Value = AuthContext> {
    (
        prop_oneof![
            Just(AuthMode::Public),
            Just(AuthMode::ApiKey),
            Just(AuthMode::Jwt)
        ],
        any::<String>(),
        proptest::collection::vec(any::<String>(), 0..4),
        proptest::option::of(any::<u64>()),
        any::<String>(),
    )
        .prop_map(
            |(mode, subject, scopes, expires_at_ms, route)| AuthContext {
                mode,
                subject,
                scopes,
                expires_at_ms,
                route,
            },
        )
}

fn error_kind() -> impl Strategy<Value = ErrorKind> {
    prop_oneof![
        Just(ErrorKind::VersionMismatch),
        Just(ErrorKind::Malformed),
        Just(ErrorKind::TooLarge),
        Just(ErrorKind::Busy),
        Just(ErrorKind::NotOwner),
        Just(ErrorKind::Draining),
        Just(ErrorKind::DeadlineExceeded),
        Just(ErrorKind::Cancelled),
        Just(ErrorKind::Internal),
    ]
}

fn request() -> impl Strategy<Value = RequestFrame> {
    (
        any::<u64>(),
        proptest::option::of(any::<String>()),
        any::<String>(),
        any::<String>(),
        headers(),
        bytes(),
        auth(),
        any::<u32>(),
    )
        .prop_map(
            |(request_id, session_id, method, path, headers, body, auth, deadline_ms)| {
                RequestFrame {
                    request_id,
                    session_id,
                    method,
                    path,
                    headers,
                    body,
                    auth,
                    deadline_ms,
                }
            },
        )
}

/// Every variant of [`Frame`], with arbitrary contents.
fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u32>(), any::<String>(), any::<String>()).prop_map(
            |(version, worker_id, expect_worker_id)| Frame::Hello {
                version,
                worker_id,
                expect_worker_id
            }
        ),
        (any::<u32>(), any::<String>())
            .prop_map(|(version, worker_id)| Frame::Welcome { version, worker_id }),
        request().prop_map(|r| Frame::Request(Box::new(r))),
        (any::<u16>(), headers())
            .prop_map(|(status, headers)| Frame::Head(ResponseHead { status, headers })),
        bytes().prop_map(Frame::Chunk),
        Just(Frame::End),
        (error_kind(), any::<String>())
            .prop_map(|(kind, message)| Frame::Error(ErrorFrame { kind, message })),
        Just(Frame::Cancel),
        any::<u32>().prop_map(Frame::Credit),
        Just(Frame::GoAway),
    ]
}

fn encode_all(codec: &mut MeshCodec, frames: &[Frame]) -> BytesMut {
    let mut buf = BytesMut::new();
    for f in frames {
        codec.encode(f, &mut buf).expect("test frames fit");
    }
    buf
}

/// Decodes everything `buf` holds now, collecting frames and errors.
fn drain(codec: &mut MeshCodec, buf: &mut BytesMut) -> Vec<Result<Frame, String>> {
    let mut out = Vec::new();
    loop {
        match codec.decode(buf) {
            Ok(Some(f)) => out.push(Ok(f)),
            Ok(None) => return out,
            Err(e) => out.push(Err(e.to_string())),
        }
    }
}

/// A frame prefix claiming `len` body bytes.
fn prefix(len: u32) -> [u8; 4] {
    len.to_be_bytes()
}

proptest! {
    #[test]
    fn every_variant_round_trips(f in frame()) {
        let mut codec = MeshCodec::new(1 << 20);
        let mut buf = encode_all(&mut codec, std::slice::from_ref(&f));
        let whole = codec.encode_frame(&f).expect("fits");
        prop_assert_eq!(&whole[..], &buf[..]);
        prop_assert_eq!(codec.decode_frame(&whole).expect("decodes"), f.clone());
        prop_assert_eq!(codec.decode(&mut buf).expect("decodes"), Some(f));
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn frames_split_at_every_byte_decode(frames in proptest::collection::vec(frame(), 1..4)) {
        let mut enc = MeshCodec::new(1 << 20);
        let wire = encode_all(&mut enc, &frames);
        for split in 0..=wire.len() {
            let mut codec = MeshCodec::new(1 << 20);
            let mut buf = BytesMut::from(&wire[..split]);
            let mut got = drain(&mut codec, &mut buf);
            buf.extend_from_slice(&wire[split..]);
            got.extend(drain(&mut codec, &mut buf));
            let want: Vec<_> = frames.iter().cloned().map(Ok).collect();
            prop_assert_eq!(got, want);
            prop_assert!(codec.decode_eof(&mut buf).expect("clean end").is_none());
        }
    }

    #[test]
    fn byte_at_a_time_decodes(frames in proptest::collection::vec(frame(), 1..4)) {
        let mut enc = MeshCodec::new(1 << 20);
        let wire = encode_all(&mut enc, &frames);
        let mut codec = MeshCodec::new(1 << 20);
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in wire.iter() {
            buf.put_u8(*b);
            got.extend(drain(&mut codec, &mut buf));
        }
        let want: Vec<_> = frames.into_iter().map(Ok).collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..2048), max in 1usize..4096) {
        let mut codec = MeshCodec::new(max);
        let mut buf = BytesMut::from(&data[..]);
        let _ = drain(&mut codec, &mut buf);
        let _ = codec.decode_eof(&mut buf);
        let _ = MeshCodec::new(max).decode_frame(&data);
    }

    #[test]
    fn garbage_body_with_valid_prefix_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut wire = BytesMut::new();
        wire.put_u32(body.len() as u32);
        wire.extend_from_slice(&body);
        let mut codec = MeshCodec::new(1024);
        let _ = drain(&mut codec, &mut wire);
        prop_assert!(wire.is_empty(), "a well-sized frame is always consumed whole");
    }
}

#[test]
fn oversized_frame_is_skipped_then_next_frame_decodes() {
    let good = Frame::Chunk(Bytes::from_static(b"after"));
    let mut codec = MeshCodec::new(64);
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&prefix(100));
    wire.extend_from_slice(&[0xAB; 100]);
    codec.encode(&good, &mut wire).expect("fits");

    // All at once.
    let mut buf = wire.clone();
    let got = drain(&mut MeshCodec::new(64), &mut buf);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].as_ref().is_err_and(|e| e.contains("100 bytes")));
    assert_eq!(got[1], Ok(good.clone()));

    // Byte by byte: the error comes as soon as the prefix is in, the skipped bytes
    // arrive later, and the next frame still decodes.
    let mut buf = BytesMut::new();
    let mut got = Vec::new();
    for b in wire.iter() {
        buf.put_u8(*b);
        got.extend(drain(&mut codec, &mut buf));
    }
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].is_err());
    assert_eq!(got[1], Ok(good));
}

#[test]
fn oversized_error_reports_length_and_limit() {
    let mut codec = MeshCodec::new(10);
    let mut buf = BytesMut::from(&prefix(11)[..]);
    match codec.decode(&mut buf) {
        Err(WireError::FrameTooLarge { len: 11, max: 10 }) => {}
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
}

#[test]
fn malformed_frame_is_skipped_then_next_frame_decodes() {
    let good = Frame::End;
    let mut codec = MeshCodec::new(1024);
    let mut wire = BytesMut::new();
    // Tag 200 is no Frame variant.
    wire.extend_from_slice(&prefix(4));
    wire.extend_from_slice(&200u32.to_le_bytes());
    // A valid tag with trailing bytes is malformed too.
    wire.extend_from_slice(&prefix(5));
    wire.extend_from_slice(&5u32.to_le_bytes());
    wire.put_u8(0);
    // An empty body.
    wire.extend_from_slice(&prefix(0));
    codec.encode(&good, &mut wire).expect("fits");
    let got = drain(&mut codec, &mut wire);
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(got[..3].iter().all(|r| r.is_err()), "{got:?}");
    assert_eq!(got[3], Ok(good));
}

#[test]
fn a_length_claim_beyond_the_frame_is_malformed_not_an_allocation() {
    // A Chunk whose byte-string length says 2^62: must fail cleanly.
    let mut body = Vec::new();
    body.extend_from_slice(&4u32.to_le_bytes());
    body.extend_from_slice(&(1u64 << 62).to_le_bytes());
    let mut wire = BytesMut::new();
    wire.put_u32(body.len() as u32);
    wire.extend_from_slice(&body);
    let got = drain(&mut MeshCodec::new(1024), &mut wire);
    assert!(
        matches!(got.as_slice(), [Err(e)] if e.contains("malformed")),
        "{got:?}"
    );
}

#[test]
fn wire_format_is_bincode_1() {
    // Enum tag: u32 little-endian; string: u64 little-endian length then bytes.
    let codec = MeshCodec::default();
    let hello = Frame::Hello {
        version: PROTOCOL_VERSION,
        worker_id: "a".into(),
        expect_worker_id: "bc".into(),
    };
    let mut want = vec![0, 0, 0, 27]; // 4 + 4 + (8 + 1) + (8 + 2)
    want.extend_from_slice(&0u32.to_le_bytes());
    want.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    want.extend_from_slice(&1u64.to_le_bytes());
    want.extend_from_slice(b"a");
    want.extend_from_slice(&2u64.to_le_bytes());
    want.extend_from_slice(b"bc");
    assert_eq!(&codec.encode_frame(&hello).expect("fits")[..], &want[..]);
    assert_eq!(
        &codec.encode_frame(&Frame::End).expect("fits")[..],
        &[0, 0, 0, 4, 5, 0, 0, 0]
    );
}

#[test]
fn frames_larger_than_wincode_default_limit_round_trip() {
    // wincode's default preallocation limit is 4 MiB; the codec's follows max_frame.
    let codec = MeshCodec::new(8 << 20);
    let f = Frame::Chunk(Bytes::from(vec![7u8; 5 << 20]));
    let wire = codec.encode_frame(&f).expect("fits the 8 MiB limit");
    assert_eq!(codec.decode_frame(&wire).expect("decodes"), f);
}

#[test]
fn encoder_refuses_oversized_frame_and_leaves_buffer_unchanged() {
    let mut codec = MeshCodec::new(16);
    let mut buf = BytesMut::from(&b"xy"[..]);
    let err = codec
        .encode(&Frame::Chunk(Bytes::from(vec![0u8; 64])), &mut buf)
        .expect_err("too large");
    assert!(
        matches!(err, WireError::FrameTooLarge { max: 16, .. }),
        "{err}"
    );
    assert_eq!(&buf[..], b"xy");
}

#[test]
fn decode_frame_requires_exactly_one_frame() {
    let codec = MeshCodec::default();
    let mut wire = codec.encode_frame(&Frame::Cancel).expect("fits").to_vec();
    assert!(codec.decode_frame(&wire[..wire.len() - 1]).is_err());
    wire.push(0);
    assert!(codec.decode_frame(&wire).is_err());
    assert!(codec.decode_frame(&[0, 0]).is_err());
}

#[test]
fn truncated_stream_at_eof_is_an_error() {
    let mut codec = MeshCodec::default();
    let wire = codec.encode_frame(&Frame::End).expect("fits");
    let mut buf = BytesMut::from(&wire[..wire.len() - 1]);
    assert!(codec.decode_eof(&mut buf).is_err());
}

#[test]
fn chunk_overhead_is_exact() {
    let codec = MeshCodec::default();
    for n in [0usize, 1, 1000] {
        let wire = codec
            .encode_frame(&Frame::Chunk(Bytes::from(vec![1u8; n])))
            .expect("fits");
        assert_eq!(wire.len(), 4 + n + Frame::CHUNK_OVERHEAD);
    }
}
