//! Frames of every mesh protocol version this code speaks, kept as bytes that
//! version's code encoded (`tests/golden/v3/`, `tests/golden/v4/`), decode with the
//! current code to the same values; and every frame a current worker may send to a
//! peer of that version encodes to exactly those bytes, so an older worker reads it.
//! This is what lets old and new workers forward to each other for the length of a
//! rolling upgrade.
//!
//! The files of version 3 were written by the code of version 3 (commit "golden frames
//! of mesh protocol 3"), those of version 4 by the code of version 4. They are never
//! rewritten: a missing or changed file fails, and the writer refuses to replace a file
//! that exists. To add the files of a new version when the protocol moves on, run once
//! with `MCPGW_WRITE_GOLDEN=<version>` and commit what it writes.

use std::path::PathBuf;

use bytes::{Bytes, BytesMut};
use mcpgw_wire::{
    AuthContext, AuthMode, ErrorFrame, ErrorKind, Frame, MeshCodec, MuxCodec, RequestFrame,
    ResponseHead,
};

/// One value of every frame (and every error kind and auth mode) of version 3.
fn v3_frames() -> Vec<(&'static str, Frame)> {
    let request = |name, mode, session: Option<&str>| {
        (
            name,
            Frame::Request(Box::new(RequestFrame {
                request_id: 0x0102_0304_0506_0708,
                session_id: session.map(str::to_owned),
                method: "POST".into(),
                path: "/servers/demo/mcp".into(),
                headers: vec![
                    ("content-type".into(), "application/json".into()),
                    ("mcp-session-id".into(), "5f0c.w1".into()),
                ],
                body: Bytes::from_static(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#),
                auth: AuthContext {
                    mode,
                    subject: "alice".into(),
                    scopes: vec!["mcp".into(), "mcp:write".into()],
                    expires_at_ms: Some(1_790_000_000_000),
                    route: "demo".into(),
                },
                deadline_ms: 30_000,
            })),
        )
    };
    let error = |name, kind| {
        (
            name,
            Frame::Error(ErrorFrame {
                kind,
                message: format!("{kind:?} happened"),
            }),
        )
    };
    vec![
        (
            "hello",
            Frame::Hello {
                version: 3,
                worker_id: "host-a.w0".into(),
                expect_worker_id: "host-b.w1".into(),
            },
        ),
        (
            "welcome",
            Frame::Welcome {
                version: 3,
                worker_id: "host-b.w1".into(),
            },
        ),
        request("request_public", AuthMode::Public, None),
        request("request_api_key", AuthMode::ApiKey, Some("5f0c.w1")),
        request("request_jwt", AuthMode::Jwt, Some("5f0c.w1")),
        (
            "head",
            Frame::Head(ResponseHead {
                status: 200,
                headers: vec![("content-type".into(), "text/event-stream".into())],
            }),
        ),
        (
            "chunk",
            Frame::Chunk(Bytes::from_static(b"event: message\ndata: {}\n\n")),
        ),
        ("end", Frame::End),
        error("error_version_mismatch", ErrorKind::VersionMismatch),
        error("error_malformed", ErrorKind::Malformed),
        error("error_too_large", ErrorKind::TooLarge),
        error("error_busy", ErrorKind::Busy),
        error("error_not_owner", ErrorKind::NotOwner),
        error("error_draining", ErrorKind::Draining),
        error("error_deadline_exceeded", ErrorKind::DeadlineExceeded),
        error("error_cancelled", ErrorKind::Cancelled),
        error("error_internal", ErrorKind::Internal),
        ("cancel", Frame::Cancel),
        ("credit", Frame::Credit(256 * 1024)),
    ]
}

/// Version 4: every frame of version 3, and `GoAway`.
fn v4_frames() -> Vec<(&'static str, Frame)> {
    let mut frames = v3_frames();
    frames.push(("goaway", Frame::GoAway));
    frames
}

fn golden_dir(version: u32) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/v{version}"))
}

/// The bytes of `frame` as a whole message and as exchange 7 of a multiplexed (TCP)
/// connection, one after the other.
fn encode(frame: &Frame) -> Vec<u8> {
    let codec = MeshCodec::new(mcpgw_wire::DEFAULT_MAX_FRAME);
    let mut bytes = codec.encode_frame(frame).expect("encode").to_vec();
    let mut mux = BytesMut::new();
    MuxCodec::new(mcpgw_wire::DEFAULT_MAX_FRAME)
        .encode(7, frame, &mut mux)
        .expect("mux encode");
    bytes.extend_from_slice(&mux);
    bytes
}

/// Writes the files of `version` (only when asked to, never in a normal run).
fn write_golden_if_asked(version: u32, frames: &[(&str, Frame)]) {
    if std::env::var("MCPGW_WRITE_GOLDEN").ok().as_deref() != Some(&version.to_string()) {
        return;
    }
    let dir = golden_dir(version);
    std::fs::create_dir_all(&dir).expect("golden dir");
    for (name, frame) in frames {
        let path = dir.join(format!("{name}.bin"));
        // A golden file records what a released version encoded: never replaced.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e}: golden files are never rewritten; a frame that encodes \
                     differently needs a new protocol version",
                    path.display()
                )
            });
        std::io::Write::write_all(&mut file, &encode(frame)).expect("write golden");
    }
}

#[test]
fn frames_of_protocol_3_decode_and_current_frames_for_it_are_byte_identical() {
    assert_eq!(Frame::GoAway.since(), 4, "GoAway is new in version 4");
    check_golden(3, &v3_frames());
}

#[test]
fn frames_of_protocol_4_decode_and_current_frames_for_it_are_byte_identical() {
    assert_eq!(
        mcpgw_wire::PROTOCOL_VERSION,
        4,
        "add the golden files of the new version"
    );
    check_golden(4, &v4_frames());
}

/// Every frame of `version` decodes from its golden bytes and encodes to them.
fn check_golden(version: u32, frames: &[(&'static str, Frame)]) {
    write_golden_if_asked(version, frames);
    let codec = MeshCodec::new(mcpgw_wire::DEFAULT_MAX_FRAME);
    for (name, frame) in frames {
        assert!(
            frame.since() <= version,
            "{name} is a frame of version {version}"
        );
        let path = golden_dir(version).join(format!("{name}.bin"));
        let golden = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (golden files are committed)", path.display()));
        // The whole message first, then the multiplexed one.
        let len = u32::from_be_bytes(golden[..4].try_into().expect("length prefix")) as usize;
        let (whole, muxed) = golden.split_at(4 + len);
        let decoded = codec
            .decode_frame(whole)
            .unwrap_or_else(|e| panic!("{name}: version {version}'s bytes no longer decode: {e}"));
        assert_eq!(
            &decoded, frame,
            "{name}: version {version}'s bytes decode to another frame"
        );
        let mut src = BytesMut::from(muxed);
        let (exchange, decoded) = tokio_util::codec::Decoder::decode(
            &mut MuxCodec::new(mcpgw_wire::DEFAULT_MAX_FRAME),
            &mut src,
        )
        .unwrap_or_else(|e| panic!("{name}: multiplexed bytes of version {version}: {e:?}"))
        .unwrap_or_else(|| panic!("{name}: a whole multiplexed frame is incomplete"));
        assert_eq!((exchange, &decoded), (7, frame), "{name}: multiplexed");
        assert_eq!(
            encode(frame),
            golden,
            "{name}: the current code encodes this frame differently from version {version}, \
             so a worker of version {version} cannot read it"
        );
    }
}
