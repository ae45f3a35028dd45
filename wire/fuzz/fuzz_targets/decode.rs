//! Feeds arbitrary bytes to the mesh frame decoder: it must never panic, never loop,
//! and every frame it yields must re-encode to a frame that decodes to itself.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use mcpgw_wire::MeshCodec;
use tokio_util::codec::Decoder;

fuzz_target!(|data: &[u8]| {
    // The first byte picks a small maximum frame size, so oversized-frame skipping
    // is exercised as often as decoding.
    let Some((&max, rest)) = data.split_first() else {
        return;
    };
    let mut codec = MeshCodec::new(usize::from(max) * 16);
    // Feed in two pieces to exercise partial input and pending skips.
    let (a, b) = rest.split_at(rest.len() / 2);
    let mut buf = BytesMut::from(a);
    for piece in [None, Some(b)] {
        if let Some(piece) = piece {
            buf.extend_from_slice(piece);
        }
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => {
                    let wire = codec
                        .encode_frame(&frame)
                        .expect("a decoded frame re-encodes");
                    assert_eq!(codec.decode_frame(&wire).expect("re-decodes"), frame);
                }
                Ok(None) => break,
                Err(_) => {}
            }
        }
    }
    let _ = codec.decode_eof(&mut buf);
    let _ = codec.decode_frame(rest);
});
