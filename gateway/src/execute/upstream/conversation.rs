//! The JSON-RPC conversation with one stdio upstream, without I/O: which line goes to
//! the child for a client message, and where each line the child writes goes.
//!
//! Request ids are rewritten to ids of the gateway's own, so requests from several
//! clients of one process (the 2026-07-28 clients of one principal share a process)
//! can never collide; progress tokens likewise. A line from the child goes to:
//! - the request it answers (a response), which then ends;
//! - the request whose progress token it carries (`notifications/progress`);
//! - the only request in flight, for any other notification or server request (the
//!   server sends those while it works on that request: logging, elicitation,
//!   sampling, roots), so they reach the client on that request's stream;
//! - otherwise the session's `GET` stream.

use crate::reason::Reason;
use std::collections::HashMap;

use bytes::Bytes;
use serde_json::{Map, Value};
use tokio::sync::mpsc;

/// A message for the client of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Sent while the request runs (a notification, a server request).
    Interim(Bytes),
    /// The response: the request is done.
    Final(Bytes),
    /// The child stopped before it answered: `why`, and the JSON-RPC error that says
    /// so, for a request whose answer had already begun as a stream.
    Ended { why: String, error: Bytes },
}

/// Where a request's messages are delivered.
pub type AnswerSink = mpsc::UnboundedSender<Answer>;

/// Where a line from the child goes.
#[derive(Debug)]
pub enum Route {
    /// To the client of a request in flight.
    Request(AnswerSink, Answer),
    /// To the session's `GET` stream.
    Unsolicited(Bytes),
    /// Nowhere: not JSON-RPC, or a response to nothing. Logged, then dropped.
    Dropped(String),
}

/// A request the child has not answered yet.
struct Pending {
    /// The id the client gave it.
    client_id: Value,
    /// The client's progress token, when the request asked for progress.
    progress_token: Option<Value>,
    sink: AnswerSink,
}

/// What the gateway knows about one child's conversation.
#[derive(Default)]
pub struct Conversation {
    next_id: u64,
    pending: HashMap<u64, Pending>,
    /// Why the child stopped; once set, nothing more is sent.
    closed: Option<String>,
}

/// Prefix of the progress tokens the gateway substitutes.
const TOKEN_PREFIX: &str = "mcpgw-";

impl Conversation {
    /// Why the child stopped talking, if it did.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The line to write for a client request, and the id it goes by; its answers go
    /// to `sink`.
    pub fn request(&mut self, mut message: Map<String, Value>, sink: AnswerSink) -> (u64, Bytes) {
        self.next_id += 1;
        let id = self.next_id;
        let client_id = message
            .insert("id".into(), Value::from(id))
            .unwrap_or(Value::Null);
        let progress_token = message
            .get_mut("params")
            .and_then(|p| p.get_mut("_meta"))
            .and_then(Value::as_object_mut)
            .and_then(|meta| {
                let theirs = meta.get("progressToken")?.clone();
                meta.insert(
                    "progressToken".into(),
                    Value::from(format!("{TOKEN_PREFIX}{id}")),
                );
                Some(theirs)
            });
        self.pending.insert(
            id,
            Pending {
                client_id,
                progress_token,
                sink,
            },
        );
        (id, line(&Value::Object(message)))
    }

    /// Forgets a request nobody waits for any more (it timed out): a late answer is
    /// dropped, and it no longer counts as in flight.
    pub fn abandon(&mut self, id: u64) {
        self.pending.remove(&id);
    }

    /// The line to write for a client notification or response; `None` when it must
    /// not reach the child (a cancellation of a request that is no longer in flight).
    /// A cancelled request is no longer in flight: the server need not answer it, and
    /// its stream ends without a response.
    pub fn other(&mut self, mut message: Map<String, Value>) -> Option<Bytes> {
        if message.get("method").and_then(Value::as_str) == Some("notifications/cancelled") {
            let params = message.get_mut("params").and_then(Value::as_object_mut)?;
            let theirs = params.get("requestId")?;
            let ours = self
                .pending
                .iter()
                .find(|(_, p)| &p.client_id == theirs)
                .map(|(id, _)| *id)?;
            self.pending.remove(&ours);
            params.insert("requestId".into(), Value::from(ours));
        }
        Some(line(&Value::Object(message)))
    }

    /// Where one line the child wrote goes.
    pub fn incoming(&mut self, raw: &[u8]) -> Route {
        let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(raw) else {
            return Route::Dropped("a line that is not a JSON-RPC object".into());
        };
        let method = message
            .get("method")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let Some(method) = method else {
            // A response: to one of our requests, by the id we gave it.
            let ours = message.get("id").and_then(Value::as_u64);
            let Some(pending) = ours.and_then(|id| self.pending.remove(&id)) else {
                return Route::Dropped("a response to no request in flight".into());
            };
            message.insert("id".into(), pending.client_id);
            return Route::Request(pending.sink, Answer::Final(line_bytes(&message)));
        };
        if method == "notifications/progress"
            && let Some(params) = message.get_mut("params").and_then(Value::as_object_mut)
            && let Some(ours) = params
                .get("progressToken")
                .and_then(Value::as_str)
                .and_then(|t| t.strip_prefix(TOKEN_PREFIX))
                .and_then(|n| n.parse::<u64>().ok())
            && let Some(pending) = self.pending.get(&ours)
        {
            if let Some(theirs) = &pending.progress_token {
                params.insert("progressToken".into(), theirs.clone());
            }
            let sink = pending.sink.clone();
            return Route::Request(sink, Answer::Interim(line_bytes(&message)));
        }
        let mut in_flight = self.pending.values();
        match (in_flight.next(), in_flight.next()) {
            (Some(only), None) => {
                Route::Request(only.sink.clone(), Answer::Interim(line_bytes(&message)))
            }
            _ => Route::Unsolicited(line_bytes(&message)),
        }
    }

    /// The child stopped: every request in flight gets an error response that says so.
    /// Each was written to the child, which may have run it before it stopped: the
    /// outcome is unknown, never "gone" (a client told "gone" re-runs the call).
    /// Returns their sinks, so the caller can wait until each answer was taken.
    pub fn close(&mut self, why: &str) -> Vec<AnswerSink> {
        if self.closed.is_none() {
            self.closed = Some(why.to_owned());
        }
        let mut told = Vec::with_capacity(self.pending.len());
        for (_, pending) in self.pending.drain() {
            let error = serde_json::json!({
                "jsonrpc": "2.0",
                "id": pending.client_id,
                "error": {
                    "code": crate::mcp::code::GATEWAY_ERROR,
                    "message": format!(
                        "outcome unknown: the upstream process {why} while running this \
                         request; it may have run, and it was not re-run. The session \
                         ended with the process: check the upstream's state before \
                         retrying a non-idempotent call, in a new session"
                    ),
                    "data": {
                        "reason": Reason::OutcomeUnknown,
                        "detail": why,
                        "session_ended": true,
                        "retryable": false,
                    },
                },
            });
            let _ = pending.sink.send(Answer::Ended {
                why: why.to_owned(),
                error: Bytes::from(error.to_string()),
            });
            told.push(pending.sink);
        }
        told
    }
}

fn line_bytes(message: &Map<String, Value>) -> Bytes {
    Bytes::from(serde_json::to_vec(message).unwrap_or_default())
}

/// One message as a line for the child: compact JSON (which never holds a raw newline)
/// and `\n`.
fn line(message: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(message).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    fn json_of(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn ids_are_rewritten_out_and_restored_in() {
        let mut c = Conversation::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (_, sent) = c.request(
            object(json!({"jsonrpc":"2.0","id":"abc","method":"tools/list"})),
            tx,
        );
        assert!(sent.ends_with(b"\n"));
        let ours = json_of(&sent)["id"].clone();
        assert_eq!(ours, json!(1));
        let route = c.incoming(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
        let Route::Request(sink, answer) = route else {
            panic!("a response goes to its request")
        };
        sink.send(answer).unwrap();
        let Some(Answer::Final(bytes)) = rx.try_recv().ok() else {
            panic!("final answer")
        };
        assert_eq!(json_of(&bytes)["id"], "abc");
        assert_eq!(c.in_flight(), 0);
    }

    #[test]
    fn two_clients_using_the_same_id_do_not_collide() {
        let mut c = Conversation::default();
        let (a, _ra) = mpsc::unbounded_channel();
        let (b, _rb) = mpsc::unbounded_channel();
        let (_, first) = c.request(object(json!({"jsonrpc":"2.0","id":1,"method":"x"})), a);
        let (_, second) = c.request(object(json!({"jsonrpc":"2.0","id":1,"method":"x"})), b);
        assert_ne!(json_of(&first)["id"], json_of(&second)["id"]);
        assert_eq!(c.in_flight(), 2);
    }

    #[test]
    fn progress_follows_its_token_and_other_messages_the_only_request() {
        let mut c = Conversation::default();
        let (tx, _rx) = mpsc::unbounded_channel();
        let (_, sent) = c.request(
            object(json!({"jsonrpc":"2.0","id":9,"method":"tools/call",
                          "params":{"name":"slow","_meta":{"progressToken":"p1"}}})),
            tx,
        );
        let token = json_of(&sent)["params"]["_meta"]["progressToken"].clone();
        assert_eq!(token, "mcpgw-1");
        let progress = format!(
            r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":{token},"progress":1}}}}"#
        );
        let Route::Request(_, Answer::Interim(bytes)) = c.incoming(progress.as_bytes()) else {
            panic!("progress goes to its request")
        };
        assert_eq!(json_of(&bytes)["params"]["progressToken"], "p1");
        let elicit = br#"{"jsonrpc":"2.0","id":0,"method":"elicitation/create","params":{}}"#;
        assert!(matches!(
            c.incoming(elicit),
            Route::Request(_, Answer::Interim(_))
        ));
        let (other, _ro) = mpsc::unbounded_channel();
        let (second, _) = c.request(object(json!({"jsonrpc":"2.0","id":10,"method":"x"})), other);
        assert!(matches!(c.incoming(elicit), Route::Unsolicited(_)));
        c.abandon(second);
        assert_eq!(
            c.in_flight(),
            1,
            "an abandoned request is no longer in flight"
        );
    }

    #[test]
    fn cancellations_name_our_id_and_garbage_is_dropped() {
        let mut c = Conversation::default();
        let (tx, _rx) = mpsc::unbounded_channel();
        c.request(object(json!({"jsonrpc":"2.0","id":"r","method":"x"})), tx);
        let cancel = c
            .other(object(
                json!({"jsonrpc":"2.0","method":"notifications/cancelled",
                                 "params":{"requestId":"r"}}),
            ))
            .unwrap();
        assert_eq!(json_of(&cancel)["params"]["requestId"], 1);
        assert_eq!(
            c.in_flight(),
            0,
            "a cancelled request is no longer in flight"
        );
        assert!(
            c.other(object(
                json!({"jsonrpc":"2.0","method":"notifications/cancelled",
                                  "params":{"requestId":"gone"}})
            ))
            .is_none()
        );
        assert!(matches!(c.incoming(b"not json"), Route::Dropped(_)));
        assert!(matches!(
            c.incoming(br#"{"jsonrpc":"2.0","id":77,"result":{}}"#),
            Route::Dropped(_)
        ));
    }

    #[test]
    fn closing_tells_every_request_in_flight_its_outcome_is_unknown_and_the_session_ended() {
        let mut c = Conversation::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        c.request(object(json!({"jsonrpc":"2.0","id":5,"method":"x"})), tx);
        c.close("exited with status 1");
        let Some(Answer::Ended { error: bytes, .. }) = rx.try_recv().ok() else {
            panic!("an error answer")
        };
        let error = json_of(&bytes);
        assert_eq!(error["id"], 5);
        assert_eq!(error["error"]["data"]["reason"], "outcome_unknown");
        assert_eq!(error["error"]["data"]["session_ended"], true);
        assert_eq!(error["error"]["data"]["retryable"], false);
        assert_eq!(error["error"]["data"]["detail"], "exited with status 1");
        assert_eq!(c.closed(), Some("exited with status 1"));
    }
}
