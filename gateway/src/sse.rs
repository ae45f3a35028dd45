//! Server-Sent Events framing for relaying upstream streams.
//!
//! The gateway does not interpret events; it only finds their boundaries so that each
//! event travels as one chunk (over HTTP and over the mesh) the moment it is complete,
//! never buffered with later events and never split across two chunks.

use bytes::{Bytes, BytesMut};

/// Splits an SSE byte stream into complete events, whatever the chunking upstream.
///
/// An event ends at a blank line; lines may end in `\n`, `\r\n` or `\r` (the SSE
/// grammar allows all three, and a CRLF may be split across two chunks).
#[derive(Debug, Default)]
pub struct SseSplitter {
    /// Bytes received but not yet part of a complete event.
    pending: BytesMut,
    /// Where to resume scanning for a blank line, so a long event is scanned once.
    scanned: usize,
}

impl SseSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one chunk and returns every event it completes, each including its
    /// terminating blank line, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Bytes> {
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = self.find_event_end() {
            events.push(self.pending.split_to(end).freeze());
            self.scanned = 0;
        }
        events
    }

    /// Bytes held for an event not yet complete.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Drops the incomplete event (it outgrew its limit).
    pub fn discard_pending(&mut self) {
        self.scanned = 0;
        self.pending.clear();
    }

    /// Whatever is left when the stream ends: an event the upstream never terminated.
    /// Relayed as is, because dropping it would lose a message.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.scanned = 0;
        if self.pending.is_empty() {
            None
        } else {
            Some(self.pending.split().freeze())
        }
    }

    /// Returns the length of the first complete event in `pending`, if any.
    fn find_event_end(&mut self) -> Option<usize> {
        let buf = &self.pending[..];
        let mut i = self.scanned;
        while i < buf.len() {
            if let Some(after_first) = line_end(buf, i) {
                if after_first >= buf.len() {
                    // Undecidable until more bytes come: resume exactly here.
                    self.scanned = i;
                    return None;
                }
                if let Some(after_second) = line_end(buf, after_first) {
                    if buf[after_second - 1] == b'\r' && after_second == buf.len() {
                        // A final "\r" might still grow into "\r\n".
                        self.scanned = i;
                        return None;
                    }
                    return Some(after_second);
                }
            }
            i += 1;
        }
        self.scanned = buf.len();
        None
    }
}

/// The `data` of each event in an SSE text (its `data:` lines joined by newlines).
pub fn data_payloads(text: &[u8]) -> impl Iterator<Item = String> + '_ {
    let text = String::from_utf8_lossy(text).replace("\r\n", "\n");
    text.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|rest| rest.strip_prefix(' ').unwrap_or(rest))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect::<Vec<_>>()
        .into_iter()
}

/// If a line terminator starts at `i`, returns the index just past it. A lone `\r`
/// at the end of the buffer counts as a terminator only once more bytes show it is
/// not followed by `\n`; callers handle that case.
fn line_end(buf: &[u8], i: usize) -> Option<usize> {
    match buf.get(i)? {
        b'\n' => Some(i + 1),
        b'\r' => match buf.get(i + 1) {
            Some(b'\n') => Some(i + 2),
            _ => Some(i + 1),
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(events: Vec<Bytes>) -> Vec<String> {
        events
            .into_iter()
            .map(|e| String::from_utf8_lossy(&e).into_owned())
            .collect()
    }

    #[test]
    fn one_event_in_one_chunk() {
        let mut s = SseSplitter::new();
        assert_eq!(
            texts(s.push(b"event: message\ndata: {}\n\n")),
            vec!["event: message\ndata: {}\n\n"]
        );
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn event_split_across_chunks_is_emitted_once_complete() {
        let mut s = SseSplitter::new();
        assert!(s.push(b"event: mess").is_empty());
        assert!(s.push(b"age\ndata: {\"a\"").is_empty());
        assert!(s.push(b":1}\n").is_empty());
        assert_eq!(
            texts(s.push(b"\n")),
            vec!["event: message\ndata: {\"a\":1}\n\n"]
        );
    }

    #[test]
    fn several_events_in_one_chunk_come_out_separately() {
        let mut s = SseSplitter::new();
        let out = texts(s.push(b"data: 1\n\ndata: 2\n\ndata: 3"));
        assert_eq!(out, vec!["data: 1\n\n", "data: 2\n\n"]);
        assert_eq!(texts(s.push(b"\n\n")), vec!["data: 3\n\n"]);
    }

    #[test]
    fn blank_line_after_a_split_point_is_found() {
        let mut s = SseSplitter::new();
        assert!(s.push(b"data: x\n\r").is_empty());
        assert_eq!(texts(s.push(b"\n")), vec!["data: x\n\r\n"]);
    }

    #[test]
    fn crlf_terminators_including_a_split_crlf() {
        let mut s = SseSplitter::new();
        assert!(s.push(b"data: x\r\n\r").is_empty());
        assert_eq!(texts(s.push(b"\ndata: y")), vec!["data: x\r\n\r\n"]);
        assert_eq!(texts(s.push(b"\r\n\r\n")), vec!["data: y\r\n\r\n"]);
    }

    #[test]
    fn every_split_point_yields_the_same_events() {
        let stream = b"event: message\r\ndata: {\"id\":1}\r\n\r\n: comment\n\ndata: a\ndata: b\n\n";
        let mut whole = SseSplitter::new();
        let expected = texts(whole.push(stream));
        assert_eq!(expected.len(), 3);
        for cut in 0..stream.len() {
            let mut s = SseSplitter::new();
            let mut got = texts(s.push(&stream[..cut]));
            got.extend(texts(s.push(&stream[cut..])));
            assert_eq!(got, expected, "cut at {cut}");
        }
    }

    #[test]
    fn unterminated_tail_is_returned_at_finish() {
        let mut s = SseSplitter::new();
        assert!(s.push(b"data: partial").is_empty());
        assert_eq!(s.finish().as_deref(), Some(&b"data: partial"[..]));
    }
}
