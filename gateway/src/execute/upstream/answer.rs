//! Reading one whole JSON-RPC answer from an upstream, for the gateway's own requests
//! to it (an `initialize` it opens a session with, a member's list page): never a
//! client's answer, which streams through as it comes.
//!
//! Bounded twice, since the upstream controls both: in bytes, and in time for the
//! whole answer (an upstream that sends its headers and then nothing would otherwise
//! hold the request, and the client's `initialize` behind it, forever).

use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::Value;

use super::UpstreamReply;
use crate::execute::is_sse;

/// The JSON-RPC response (a message with `result` or `error`) in `reply`, JSON or
/// among the events of a stream, read within `limit` bytes and `deadline`; or why
/// there is none. `upstream` names the upstream in the error.
pub(crate) async fn read_answer(
    reply: UpstreamReply,
    upstream: &str,
    limit: usize,
    deadline: Duration,
) -> Result<Value, String> {
    let status = reply.status;
    let sse = is_sse(&reply.headers);
    let bytes = tokio::time::timeout(deadline, read_bytes(reply, limit))
        .await
        .map_err(|_| {
            format!(
                "upstream {upstream} began its answer ({status}) but did not finish it within \
                 {deadline:?}"
            )
        })??;
    if !status.is_success() {
        return Err(format!(
            "it answered {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ));
    }
    let messages: Vec<Value> = if sse {
        crate::sse::data_payloads(&bytes)
            .filter_map(|data| serde_json::from_str(&data).ok())
            .collect()
    } else {
        serde_json::from_slice(&bytes).ok().into_iter().collect()
    };
    messages
        .into_iter()
        .find(|m| m.get("result").is_some() || m.get("error").is_some())
        .ok_or_else(|| "its answer held no JSON-RPC response".to_owned())
}

/// The body of `reply`, at most `limit` bytes of it. Frame by frame: `Limited`'s
/// collect future trips a rustc limitation on `Send` here ("implementation of Send is
/// not general enough").
async fn read_bytes(reply: UpstreamReply, limit: usize) -> Result<Vec<u8>, String> {
    let mut body = reply.body;
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("its answer could not be read: {e}"))?;
        if let Ok(data) = frame.into_data() {
            bytes.extend_from_slice(&data);
        }
        if bytes.len() > limit {
            return Err(format!("its answer exceeds {limit} bytes"));
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, StatusCode};
    use http_body_util::{BodyExt, StreamBody};

    fn reply(content_type: &str, body: crate::body::ReplyBody) -> UpstreamReply {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_str(content_type).expect("a header value"),
        );
        UpstreamReply {
            status: StatusCode::OK,
            headers,
            body,
        }
    }

    const LONG: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn the_response_is_found_in_json_and_among_stream_events() {
        let json = reply(
            "application/json",
            crate::body::full(Bytes::from_static(
                br#"{"jsonrpc":"2.0","id":0,"result":{}}"#,
            )),
        );
        let answer = read_answer(json, "demo", 1024, LONG).await.expect("found");
        assert_eq!(answer["id"], 0);
        let sse = reply(
            "text/event-stream",
            crate::body::full(Bytes::from_static(
                b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\"}\n\n\
                  data: {\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":1,\"message\":\"no\"}}\n\n",
            )),
        );
        let answer = read_answer(sse, "demo", 1024, LONG).await.expect("found");
        assert_eq!(answer["error"]["message"], "no");
    }

    #[tokio::test]
    async fn an_answer_past_the_limit_is_refused() {
        let big = reply(
            "application/json",
            crate::body::full(Bytes::from(vec![b' '; 2048])),
        );
        let error = read_answer(big, "demo", 1024, LONG)
            .await
            .expect_err("refused");
        assert!(error.contains("exceeds 1024 bytes"), "{error}");
    }

    #[tokio::test(start_paused = true)]
    async fn headers_then_silence_end_at_the_deadline_naming_the_upstream() {
        let silent = StreamBody::new(futures_util::stream::pending::<
            Result<http_body::Frame<Bytes>, crate::body::BoxError>,
        >());
        let silent = reply("text/event-stream", BodyExt::boxed_unsync(silent));
        let started = tokio::time::Instant::now();
        let error = read_answer(silent, "slowpoke", 1024, Duration::from_secs(5))
            .await
            .expect_err("a deadline");
        // The paused clock moves only to the next timer: exactly the deadline.
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(
            error.contains("upstream slowpoke") && error.contains("did not finish it within 5s"),
            "{error}"
        );
    }
}
