//! Multiplexed framing: round trips with exchange ids, partial input, and errors that
//! name the exchange they belong to while the stream stays in sync.

use bytes::{BufMut, Bytes, BytesMut};
use mcpgw_wire::{ErrorFrame, ErrorKind, Frame, MuxCodec, ResponseHead, WireError};
use proptest::prelude::*;
use tokio_util::codec::Decoder;

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(|b| Frame::Chunk(Bytes::from(b))),
        Just(Frame::End),
        Just(Frame::Cancel),
        any::<u32>().prop_map(Frame::Credit),
        (any::<u16>(), any::<String>()).prop_map(|(status, v)| Frame::Head(ResponseHead {
            status,
            headers: vec![("content-type".into(), v)],
        })),
        any::<String>().prop_map(|m| Frame::Error(ErrorFrame::new(ErrorKind::Internal, m))),
    ]
}

/// A decoded frame, or the exchange and text of a decode error.
type Decoded = Result<(u64, Frame), (Option<u64>, String)>;

fn drain(codec: &mut MuxCodec, buf: &mut BytesMut) -> Vec<Decoded> {
    let mut out = Vec::new();
    loop {
        match codec.decode(buf) {
            Ok(Some(f)) => out.push(Ok(f)),
            Ok(None) => return out,
            Err(e) => out.push(Err((e.exchange, e.error.to_string()))),
        }
    }
}

proptest! {
    #[test]
    fn frames_of_many_exchanges_split_anywhere_decode(
        frames in proptest::collection::vec((any::<u64>(), frame()), 1..5),
        split in any::<prop::sample::Index>(),
    ) {
        let codec = MuxCodec::new(1 << 20);
        let mut wire = BytesMut::new();
        for (id, f) in &frames {
            codec.encode(*id, f, &mut wire).expect("fits");
        }
        let at = split.index(wire.len() + 1);
        let mut decoder = MuxCodec::new(1 << 20);
        let mut buf = BytesMut::from(&wire[..at]);
        let mut got = drain(&mut decoder, &mut buf);
        buf.extend_from_slice(&wire[at..]);
        got.extend(drain(&mut decoder, &mut buf));
        let want: Vec<_> = frames.into_iter().map(Ok).collect();
        prop_assert_eq!(got, want);
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..2048), max in 1usize..4096) {
        let mut codec = MuxCodec::new(max);
        let mut buf = BytesMut::from(&data[..]);
        let _ = drain(&mut codec, &mut buf);
        let _ = codec.decode_eof(&mut buf);
    }
}

#[test]
fn the_body_is_bincode_of_the_id_then_the_frame() {
    let mut wire = BytesMut::new();
    MuxCodec::new(1024)
        .encode(7, &Frame::End, &mut wire)
        .expect("fits");
    let mut want = vec![0, 0, 0, 12];
    want.extend_from_slice(&7u64.to_le_bytes());
    want.extend_from_slice(&5u32.to_le_bytes());
    assert_eq!(&wire[..], &want[..]);
}

#[test]
fn an_oversized_frame_names_its_exchange_and_the_next_frame_decodes() {
    let sender = MuxCodec::new(4096);
    let mut wire = BytesMut::new();
    sender
        .encode(41, &Frame::Chunk(Bytes::from(vec![1u8; 1000])), &mut wire)
        .expect("fits the sender");
    sender.encode(42, &Frame::End, &mut wire).expect("fits");
    // Byte by byte: the error waits for the id, then the rest is skipped.
    let mut receiver = MuxCodec::new(256);
    let mut buf = BytesMut::new();
    let mut got = Vec::new();
    for b in wire.iter() {
        buf.put_u8(*b);
        got.extend(drain(&mut receiver, &mut buf));
    }
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        matches!(&got[0], Err((Some(41), e)) if e.contains("exceeds")),
        "{got:?}"
    );
    assert_eq!(got[1], Ok((42, Frame::End)));
}

#[test]
fn a_malformed_frame_names_its_exchange_and_the_next_frame_decodes() {
    let codec = MuxCodec::new(1024);
    let mut wire = BytesMut::new();
    wire.put_u32(12);
    wire.extend_from_slice(&9u64.to_le_bytes());
    wire.extend_from_slice(&200u32.to_le_bytes());
    // Too short to hold an id at all.
    wire.put_u32(3);
    wire.extend_from_slice(&[1, 2, 3]);
    codec.encode(10, &Frame::Cancel, &mut wire).expect("fits");
    let got = drain(&mut MuxCodec::new(1024), &mut wire);
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(matches!(&got[0], Err((Some(9), _))), "{got:?}");
    assert!(matches!(&got[1], Err((None, _))), "{got:?}");
    assert_eq!(got[2], Ok((10, Frame::Cancel)));
}

#[test]
fn the_encoder_counts_the_id_against_the_limit() {
    let codec = MuxCodec::new(100);
    let fits = 100 - MuxCodec::CHUNK_OVERHEAD;
    let mut buf = BytesMut::new();
    codec
        .encode(1, &Frame::Chunk(Bytes::from(vec![0u8; fits])), &mut buf)
        .expect("exactly the limit");
    let err = codec
        .encode(1, &Frame::Chunk(Bytes::from(vec![0u8; fits + 1])), &mut buf)
        .expect_err("one byte over");
    assert!(
        matches!(err, WireError::FrameTooLarge { max: 100, .. }),
        "{err}"
    );
}
