//! Forwarding over the mesh: the caller's side (a request for a session held by
//! another worker, and what a failure proves) and the owner's side (serving a
//! forwarded request on the local path).

pub mod caller;
pub mod owner;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::mcp;
use crate::reply::{HEADER_EDGE_WORKER, HEADER_OWNER_WORKER};

/// The names the mesh carries on almost every request and answer that are not among
/// HTTP's standard ones: parsed from bytes, each would be allocated afresh, so these
/// are matched first and shared.
static CARRIED_NAMES: [HeaderName; 7] = [
    HeaderName::from_static(mcp::HEADER_SESSION_ID),
    HeaderName::from_static(mcp::HEADER_PROTOCOL_VERSION),
    HeaderName::from_static(mcp::HEADER_METHOD),
    HeaderName::from_static(mcp::HEADER_NAME),
    HeaderName::from_static(HEADER_OWNER_WORKER),
    HeaderName::from_static(HEADER_EDGE_WORKER),
    HeaderName::from_static("traceparent"),
];

/// A header the mesh carried that HTTP does not allow.
#[derive(Debug)]
pub(crate) enum BadHeader {
    Name(String),
    Value(HeaderName),
}

/// Headers as a mesh frame carries them, as a header map. Each value keeps the
/// frame's string (moved, not copied), so a forwarded head costs no allocation per
/// header beyond the frame's own. Bad headers go to `bad`, which may end the
/// conversion (`Err`) or skip them (`Ok`).
pub(crate) fn header_map<E>(
    pairs: Vec<(String, String)>,
    mut bad: impl FnMut(BadHeader) -> Result<(), E>,
) -> Result<HeaderMap, E> {
    let mut headers = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        let name = match CARRIED_NAMES.iter().find(|known| known.as_str() == name) {
            Some(known) => known.clone(),
            None => match HeaderName::from_bytes(name.as_bytes()) {
                Ok(name) => name,
                Err(_) => {
                    bad(BadHeader::Name(name))?;
                    continue;
                }
            },
        };
        match HeaderValue::from_maybe_shared(Bytes::from(value)) {
            Ok(value) => {
                headers.append(name, value);
            }
            Err(_) => bad(BadHeader::Value(name))?,
        }
    }
    Ok(headers)
}

/// A header map as a mesh frame carries it: name and value strings, in map order, with
/// room for `room` more. A value that is not visible ASCII has no string and is left
/// out, as the frame cannot carry it.
pub(crate) fn header_pairs(headers: &HeaderMap, room: usize) -> Vec<(String, String)> {
    let mut pairs = Vec::with_capacity(headers.len() + room);
    pairs.extend(headers.iter().filter_map(|(name, value)| {
        Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
    }));
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect()
    }

    #[test]
    fn carried_headers_keep_their_strings_and_their_order() {
        let carried = pairs(&[
            ("mcp-session-id", "s1"),
            ("content-type", "application/json"),
            ("mcp-param-region", "eu"),
            ("mcp-session-id", "s2"),
        ]);
        let value_at = carried[0].1.as_ptr();
        let Ok(headers) = header_map(carried, |bad| -> Result<(), Infallible> {
            panic!("no header is bad here, got {bad:?}")
        });
        let sessions: Vec<_> = headers.get_all("mcp-session-id").iter().collect();
        assert_eq!(sessions, ["s1", "s2"]);
        // Moved, not copied: the value still lives in the frame's string.
        assert_eq!(sessions[0].as_bytes().as_ptr(), value_at);
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(headers["mcp-param-region"], "eu");
        assert_eq!(headers.len(), 4);
    }

    #[test]
    fn a_header_map_goes_into_a_frame_and_back_unchanged() {
        let mut headers = HeaderMap::new();
        headers.append("mcp-session-id", HeaderValue::from_static("s1"));
        headers.append("accept", HeaderValue::from_static("application/json"));
        headers.append("accept", HeaderValue::from_static("text/event-stream"));
        headers.append("x-note", HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap());
        let pairs = header_pairs(&headers, 1);
        // The value that is not visible ASCII has no string to travel as.
        assert_eq!(pairs.len(), 3);
        assert!(pairs.capacity() >= 4);
        let Ok(back) = header_map(pairs, |bad| -> Result<(), Infallible> {
            panic!("no header is bad here, got {bad:?}")
        });
        headers.remove("x-note");
        assert_eq!(back, headers);
    }

    #[test]
    fn a_bad_header_ends_the_conversion_or_is_skipped_as_the_caller_says() {
        let carried = || pairs(&[("bad name", "x"), ("accept", "a\nb"), ("mcp-name", "echo")]);
        let refused = header_map(carried(), |bad| Err(format!("{bad:?}")));
        assert_eq!(refused.unwrap_err(), r#"Name("bad name")"#);
        let mut seen = Vec::new();
        let Ok(kept) = header_map(carried(), |bad| {
            seen.push(format!("{bad:?}"));
            Ok::<(), Infallible>(())
        });
        assert_eq!(seen, [r#"Name("bad name")"#, r#"Value("accept")"#]);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept["mcp-name"], "echo");
    }
}
