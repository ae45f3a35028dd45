//! The ids of requests members send the client. Each member numbers its own requests
//! (the SDKs start at 0), so two members asking the client at once would send the
//! same id, and the client's answer could not say which member it is for: sent to
//! every member, it would answer both. So a member's request reaches the client under
//! an id that names the member, `mcpgw~@{member's upstream name}~{its own id as JSON}`,
//! and the client's answer, which echoes it, goes back to that member alone under its
//! own id. That holds on a request's stream and outside one (the session's `GET`
//! stream, `member_streams.rs`) alike. The tag is the whole state: any worker that
//! receives the answer can route it.
//!
//! The tag names the member, not its place in the virtual server: an adopter whose
//! configuration lists the members in another order (or one fewer) still delivers an
//! answer to the member that asked, or to none. Upstream names hold no `~` or `@`
//! (config validation), so the name ends at the first `~`. Earlier versions tagged by
//! place (`mcpgw~{index}~...`); such a tag, minted by an older worker of a fleet
//! mid-upgrade, is still read by place.

use bytes::Bytes;
use serde_json::Value;

const TAG: &str = "mcpgw~";
/// Marks a tag that names the member (after [`TAG`]).
const NAMED: char = '@';

/// Which member a tagged answer is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaggedFor {
    /// The member of this upstream name.
    Named(String),
    /// The member at this place: a tag of an older worker.
    Place(usize),
}

/// Tags the id of `message` for the member `member` (its upstream name) if it is a
/// request; false for notifications and answers, which pass unchanged.
fn tag(member: &str, message: &mut Value) -> bool {
    let Some(object) = message.as_object_mut() else {
        return false;
    };
    if !object.contains_key("method") {
        return false;
    }
    let Some(id) = object.get_mut("id") else {
        return false;
    };
    *id = Value::String(format!("{TAG}{NAMED}{member}~{id}"));
    true
}

/// For an answer of the client to a tagged request: the member it is for, with the
/// member's own id put back. `None` for anything else.
pub fn untag(message: &mut Value) -> Option<TaggedFor> {
    let object = message.as_object_mut()?;
    if object.contains_key("method") {
        return None;
    }
    let tagged = object.get("id")?.as_str()?.strip_prefix(TAG)?;
    let (member, own) = tagged.split_once('~')?;
    let member = match member.strip_prefix(NAMED) {
        Some(name) if !name.is_empty() => TaggedFor::Named(name.to_owned()),
        Some(_) => return None,
        None => TaggedFor::Place(member.parse().ok()?),
    };
    let own: Value = serde_json::from_str(own).ok()?;
    object.insert("id".into(), own);
    Some(member)
}

/// One SSE event of the member `member` (its upstream name; on a request's stream, or
/// sent outside one), with the id of a request it carries tagged. Events that carry no
/// request pass untouched, byte for byte.
pub fn tag_event(member: &str, event: Bytes) -> Bytes {
    // Most events are progress, logging and results: no need to parse them.
    if !contains(&event, b"\"method\"") || !contains(&event, b"\"id\"") {
        return event;
    }
    let Ok(text) = std::str::from_utf8(&event) else {
        return event;
    };
    let data: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|data| data.strip_prefix(' ').unwrap_or(data))
        .collect();
    let Ok(mut message) = serde_json::from_str::<Value>(&data.join("\n")) else {
        return event;
    };
    if !tag(member, &mut message) {
        return event;
    }
    let mut out = String::with_capacity(event.len() + 16);
    let mut data_written = false;
    for line in text.lines() {
        if line.starts_with("data:") {
            if !data_written {
                out.push_str("data: ");
                out.push_str(&message.to_string());
                out.push('\n');
                data_written = true;
            }
        } else if !line.is_empty() {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push('\n');
    Bytes::from(out)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_members_request_is_tagged_and_the_clients_answer_finds_it() {
        let event = Bytes::from(
            "event: message\nid: 7\ndata: {\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"sampling/createMessage\",\"params\":{}}\n\n",
        );
        let tagged = tag_event("demo", event);
        let text = std::str::from_utf8(&tagged).expect("utf-8");
        assert!(text.starts_with("event: message\nid: 7\ndata: "), "{text}");
        assert!(text.ends_with("\n\n"), "{text}");
        let data = text
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .expect("data");
        let sent: Value = serde_json::from_str(data).expect("JSON");
        assert_eq!(sent["id"], "mcpgw~@demo~0");
        assert_eq!(sent["method"], "sampling/createMessage");

        let mut answer = json!({"jsonrpc": "2.0", "id": sent["id"], "result": {"x": 1}});
        assert_eq!(untag(&mut answer), Some(TaggedFor::Named("demo".into())));
        assert_eq!(answer["id"], 0, "the member gets its own id back");
        // A string id of the member's own survives the round trip too.
        let mut request = json!({"jsonrpc": "2.0", "id": "a~b", "method": "roots/list"});
        assert!(tag("st.v2", &mut request));
        let mut answer = json!({"jsonrpc": "2.0", "id": request["id"], "result": {}});
        assert_eq!(untag(&mut answer), Some(TaggedFor::Named("st.v2".into())));
        assert_eq!(answer["id"], "a~b");
        // An older worker's tag, by place, is still read.
        let mut older = json!({"jsonrpc": "2.0", "id": "mcpgw~2~5", "result": {}});
        assert_eq!(untag(&mut older), Some(TaggedFor::Place(2)));
        assert_eq!(older["id"], 5);
    }

    #[test]
    fn notifications_results_and_untagged_answers_pass_unchanged() {
        for event in [
            "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n",
            "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"method\":\"x\"}}\n\n",
            "event: message\ndata: not json with \"method\" and \"id\"\n\n",
        ] {
            let bytes = Bytes::from(event);
            assert_eq!(tag_event("demo", bytes.clone()), bytes, "{event}");
        }
        let mut answer = json!({"jsonrpc": "2.0", "id": 4, "result": {}});
        assert_eq!(untag(&mut answer), None);
        let mut forged = json!({"jsonrpc": "2.0", "id": "mcpgw~x~4", "result": {}});
        assert_eq!(
            untag(&mut forged),
            None,
            "a tag that names no member is no tag"
        );
        assert_eq!(forged["id"], "mcpgw~x~4");
        let mut nameless = json!({"jsonrpc": "2.0", "id": "mcpgw~@~4", "result": {}});
        assert_eq!(untag(&mut nameless), None, "a tag naming no one is no tag");
    }
}
