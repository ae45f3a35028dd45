//! What one merge may cost: how much of one member's list a merged list takes (items
//! and bytes, templates), and how often an unknown name or URI reads the members'
//! lists again. Pure, so each bound is tested without a member, on a paused clock.
//!
//! A member's list is data from a peer: without a bound one member listing a million
//! items makes every list (and every read of an unknown URI) of every client of the
//! server cost that much. A member past its bound is cut: its pages are no longer
//! followed, the answer names it in `_meta["mcpgw/federation"].cut`, and a name or URI
//! no catalog knows may still go to it (it may be beyond the cut), so it answers for
//! itself.

use std::collections::HashMap;
use std::io::Write;

use serde_json::{Value, json};
use tokio::time::{Duration, Instant};

use crate::config::MergeLimits;

/// Merges of more items than this run off the runtime's threads (`spawn_blocking`):
/// a merge is linear, but 40,000 items still take milliseconds a `ping` of another
/// session would wait behind. Smaller ones are cheaper than the hand-off.
pub(super) const OFF_THREAD_ITEMS: usize = 2_000;

/// How much of one member's list a merged list takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemberCap {
    pub items: usize,
    pub bytes: usize,
    /// The setting `items` comes from, for the note.
    pub items_setting: &'static str,
}

impl MemberCap {
    /// The cap of a list of `method`: resource templates have their own item bound.
    pub(crate) fn of(limits: &MergeLimits, method: &str) -> MemberCap {
        let templates = method == "resources/templates/list"
            && limits.max_member_templates < limits.max_member_items;
        MemberCap {
            items: if templates {
                limits.max_member_templates
            } else {
                limits.max_member_items
            },
            bytes: limits.max_member_bytes,
            items_setting: if templates {
                "max_member_templates"
            } else {
                "max_member_items"
            },
        }
    }
}

/// One member's list as it is read page by page, within its cap.
#[derive(Debug)]
pub(crate) struct CappedList {
    cap: MemberCap,
    pub items: Vec<Value>,
    bytes: usize,
    /// Why the list was cut, once it was.
    pub cut: Option<String>,
}

impl CappedList {
    pub(crate) fn new(cap: MemberCap) -> CappedList {
        CappedList {
            cap,
            items: Vec::new(),
            bytes: 0,
            cut: None,
        }
    }

    /// Takes a page's items until the cap; false once the list is cut (follow no more
    /// pages).
    pub(crate) fn take_page(&mut self, method: &str, page: Vec<Value>) -> bool {
        for item in page {
            if self.items.len() >= self.cap.items {
                self.cut = Some(format!(
                    "its {method} has more than {} items (the server's {}); the first {} \
                     are listed",
                    self.cap.items,
                    self.cap.items_setting,
                    self.items.len()
                ));
                return false;
            }
            let size = json_size(&item);
            if self.bytes + size > self.cap.bytes {
                self.cut = Some(format!(
                    "its {method} holds more than {} bytes of items (the server's \
                     max_member_bytes); the first {} items are listed",
                    self.cap.bytes,
                    self.items.len()
                ));
                return false;
            }
            self.bytes += size;
            self.items.push(item);
        }
        true
    }

    /// The `_meta["mcpgw/federation"].cut` entry of `member`, when cut.
    pub(crate) fn note(&self, member: &str) -> Option<Value> {
        let why = self.cut.as_ref()?;
        Some(json!({ "member": member, "listed": self.items.len(), "why": why }))
    }
}

/// The length of `value` as JSON, counted without building the text.
fn json_size(value: &Value) -> usize {
    struct Count(usize);
    impl Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` to a counter cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// When an unknown name or URI may read a session's lists again: at most once per
/// interval per list. A client asking again and again for what no member has (a typo,
/// a stale URI) would otherwise make every such request a full merge.
#[derive(Debug, Default)]
pub(crate) struct Refreshes {
    /// List (its method) → when an unknown name last read it.
    last: HashMap<&'static str, Instant>,
}

impl Refreshes {
    /// Whether `list` may be read again now, and if so, counts this read.
    pub(crate) fn may_refresh(
        &mut self,
        list: &'static str,
        now: Instant,
        interval: Duration,
    ) -> bool {
        match self.last.get(list) {
            Some(at) if now.saturating_duration_since(*at) < interval => false,
            _ => {
                self.last.insert(list, now);
                true
            }
        }
    }
}

/// Runs `merge` where it holds no runtime thread when it is large (`items` above
/// [`OFF_THREAD_ITEMS`]), else here.
pub(super) async fn merge_off_thread<T: Send + 'static>(
    items: usize,
    merge: impl FnOnce() -> T + Send + 'static,
) -> T {
    if items <= OFF_THREAD_ITEMS {
        return merge();
    }
    match tokio::task::spawn_blocking(merge).await {
        Ok(merged) => merged,
        // The merge panicked: as it would have here.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(items: usize, bytes: usize, templates: usize) -> MergeLimits {
        MergeLimits {
            max_member_items: items,
            max_member_bytes: bytes,
            max_member_templates: templates,
            ..MergeLimits::default()
        }
    }

    fn page(from: usize, count: usize) -> Vec<Value> {
        (from..from + count)
            .map(|n| json!({ "uri": format!("demo://item/{n}") }))
            .collect()
    }

    #[test]
    fn a_member_past_its_item_cap_is_cut_and_the_note_says_how_many_are_listed() {
        let cap = MemberCap::of(&limits(5, usize::MAX, 1000), "resources/list");
        let mut list = CappedList::new(cap);
        assert!(list.take_page("resources/list", page(0, 3)));
        assert_eq!(list.note("demo"), None);
        assert!(!list.take_page("resources/list", page(3, 3)), "cut");
        assert_eq!(list.items, page(0, 5));
        let note = list.note("demo").expect("a note");
        assert_eq!(note["member"], "demo");
        assert_eq!(note["listed"], 5);
        let why = note["why"].as_str().unwrap();
        assert!(why.contains("more than 5 items"), "{why}");
        assert!(why.contains("max_member_items"), "{why}");
    }

    #[test]
    fn exactly_the_cap_is_no_cut() {
        let cap = MemberCap::of(&limits(4, usize::MAX, 1000), "tools/list");
        let mut list = CappedList::new(cap);
        assert!(list.take_page("tools/list", page(0, 4)));
        assert!(list.cut.is_none());
    }

    #[test]
    fn a_member_past_its_byte_cap_is_cut_before_the_item_that_crosses_it() {
        let item_size = json_size(&page(0, 1)[0]);
        assert_eq!(item_size, r#"{"uri":"demo://item/0"}"#.len());
        let cap = MemberCap::of(&limits(1000, item_size * 2 + 1, 1000), "resources/list");
        let mut list = CappedList::new(cap);
        assert!(!list.take_page("resources/list", page(0, 5)));
        assert_eq!(list.items.len(), 2);
        let why = list.note("demo").unwrap()["why"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(why.contains("max_member_bytes"), "{why}");
    }

    #[test]
    fn templates_have_their_own_cap() {
        let limits = limits(10_000, usize::MAX, 2);
        let cap = MemberCap::of(&limits, "resources/templates/list");
        assert_eq!((cap.items, cap.items_setting), (2, "max_member_templates"));
        assert_eq!(MemberCap::of(&limits, "resources/list").items, 10_000);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_name_reads_a_list_again_at_most_once_per_interval() {
        let interval = Duration::from_secs(2);
        let mut refreshes = Refreshes::default();
        let now = Instant::now;
        assert!(refreshes.may_refresh("tools/list", now(), interval));
        assert!(!refreshes.may_refresh("tools/list", now(), interval));
        assert!(
            refreshes.may_refresh("prompts/list", now(), interval),
            "each list on its own"
        );
        tokio::time::advance(Duration::from_millis(1_999)).await;
        assert!(!refreshes.may_refresh("tools/list", now(), interval));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(refreshes.may_refresh("tools/list", now(), interval));
        assert!(!refreshes.may_refresh("tools/list", now(), interval));
        let mut always = Refreshes::default();
        assert!(always.may_refresh("tools/list", now(), Duration::ZERO));
        assert!(always.may_refresh("tools/list", now(), Duration::ZERO));
    }
}
