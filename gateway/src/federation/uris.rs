//! Which member a resource URI belongs to. URIs are identities, so a virtual server
//! never renames them: a URI is reached at the member that listed it, else at the
//! member whose resource template matches it. Pure, so every match and every conflict
//! is tested without a member.
//!
//! Templates are matched at RFC 6570 level 1 only: `{var}` stands for a non-empty run
//! of characters without `/`, `?` or `#` (what a simple expansion can produce, read
//! loosely: percent-encoded text matches too); everything else matches itself. A
//! template with a level 2+ expression (`{+x}`, `{/x}`, `{?x}`, `{a,b}`, ...) matches
//! no URI: its member is reached only for the URIs it lists.

use std::collections::HashMap;

/// What a virtual server knows of its members' resources, from their last lists.
#[derive(Debug, Default)]
pub struct ResourceCatalog {
    /// Listed URI → the member (its position in the session) that keeps it.
    pub uris: HashMap<String, usize>,
    /// (template, member), members in configuration order, each in its own order:
    /// the first template that matches a URI decides.
    pub templates: Vec<(String, usize)>,
}

impl ResourceCatalog {
    /// The member that serves `uri`: the one that listed it, else the first whose
    /// template matches it and whose filter (`passes`) lets the URI through.
    pub fn route(&self, uri: &str, passes: impl Fn(usize, &str) -> bool) -> Option<usize> {
        if let Some(member) = self.uris.get(uri) {
            return Some(*member);
        }
        self.templates
            .iter()
            .find(|(template, member)| template_matches(template, uri) && passes(*member, uri))
            .map(|(_, member)| *member)
    }

    /// The member that listed exactly this template.
    pub fn template_owner(&self, template: &str) -> Option<usize> {
        self.templates
            .iter()
            .find(|(listed, _)| listed == template)
            .map(|(_, member)| *member)
    }
}

/// One piece of a parsed template.
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Literal(&'a [u8]),
    /// A level 1 expression, `{name}`.
    Variable,
}

/// A template's pieces, or None when it holds what level 1 does not (an operator, a
/// list of variables, an unclosed brace).
fn parse(template: &str) -> Option<Vec<Piece<'_>>> {
    let mut pieces = Vec::new();
    let mut rest = template.as_bytes();
    while !rest.is_empty() {
        match rest.iter().position(|b| *b == b'{') {
            Some(0) => {
                let close = rest.iter().position(|b| *b == b'}')?;
                let name = &rest[1..close];
                let level_one = !name.is_empty()
                    && name
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'%' | b'.'));
                if !level_one {
                    return None;
                }
                pieces.push(Piece::Variable);
                rest = &rest[close + 1..];
            }
            Some(at) => {
                pieces.push(Piece::Literal(&rest[..at]));
                rest = &rest[at..];
            }
            None => {
                pieces.push(Piece::Literal(rest));
                rest = &[];
            }
        }
    }
    Some(pieces)
}

/// Whether `uri` is an expansion of `template` (see the module's note on level 1).
/// Runs over the positions reachable after each piece, each piece in one pass over
/// the URI (a literal: times its length), so variables in a row stay cheap.
pub fn template_matches(template: &str, uri: &str) -> bool {
    let Some(pieces) = parse(template) else {
        return false;
    };
    let uri = uri.as_bytes();
    let mut reachable = vec![false; uri.len() + 1];
    reachable[0] = true;
    for piece in pieces {
        let mut next = vec![false; uri.len() + 1];
        match piece {
            Piece::Literal(literal) => {
                for start in (0..=uri.len()).filter(|at| reachable[*at]) {
                    if uri[start..].starts_with(literal) {
                        next[start + literal.len()] = true;
                    }
                }
            }
            Piece::Variable => {
                // A run that began at a reachable position goes on until a '/', '?'
                // or '#'; every position after its first character ends it.
                let mut in_run = false;
                for (at, byte) in uri.iter().enumerate() {
                    in_run |= reachable[at];
                    if matches!(byte, b'/' | b'?' | b'#') {
                        in_run = false;
                    } else if in_run {
                        next[at + 1] = true;
                    }
                }
            }
        }
        reachable = next;
    }
    reachable[uri.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_matches_one_run_without_slash_query_or_fragment() {
        assert!(template_matches("mem://a/notes/{note}", "mem://a/notes/x1"));
        assert!(template_matches(
            "mem://a/notes/{note}",
            "mem://a/notes/a%20b"
        ));
        assert!(!template_matches("mem://a/notes/{note}", "mem://a/notes/"));
        assert!(!template_matches(
            "mem://a/notes/{note}",
            "mem://a/notes/x/y"
        ));
        assert!(!template_matches(
            "mem://a/notes/{note}",
            "mem://a/notes/x?y"
        ));
        assert!(!template_matches("mem://a/notes/{note}", "mem://b/notes/x"));
        assert!(template_matches(
            "db://{table}/{row}.json",
            "db://users/7.json"
        ));
        assert!(!template_matches(
            "db://{table}/{row}.json",
            "db://users/7.xml"
        ));
        assert!(template_matches("x://{a}{b}", "x://ab"));
        assert!(!template_matches("x://{a}{b}", "x://a"));
        assert!(template_matches("plain://exact", "plain://exact"));
        assert!(!template_matches("plain://exact", "plain://exact2"));
    }

    #[test]
    fn expressions_beyond_level_one_match_nothing() {
        for template in [
            "mem://{+path}",
            "mem://a{/x}",
            "mem://a{?q}",
            "mem://{a,b}",
            "mem://{}",
            "mem://{open",
        ] {
            assert!(!template_matches(template, "mem://a"), "{template}");
            assert!(!template_matches(template, "mem://a/b"), "{template}");
        }
    }

    #[test]
    fn many_variables_in_a_row_stay_cheap() {
        let template = format!("x://{}!", "{v}".repeat(64));
        let uri = format!("x://{}", "a".repeat(4000));
        assert!(!template_matches(&template, &uri));
        assert!(template_matches(&template, &format!("{uri}!")));
    }

    #[test]
    fn a_listed_uri_wins_then_the_first_matching_template_the_filter_allows() {
        let catalog = ResourceCatalog {
            uris: HashMap::from([("mem://b/notes/pinned".to_owned(), 1)]),
            templates: vec![
                ("mem://a/{x}".to_owned(), 0),
                ("mem://{who}/notes/{n}".to_owned(), 0),
                ("mem://b/notes/{n}".to_owned(), 1),
            ],
        };
        let all = |_: usize, _: &str| true;
        assert_eq!(catalog.route("mem://b/notes/pinned", all), Some(1));
        assert_eq!(catalog.route("mem://b/notes/n1", all), Some(0));
        let no_b_for_zero = |member: usize, uri: &str| member != 0 || !uri.starts_with("mem://b");
        assert_eq!(catalog.route("mem://b/notes/n1", no_b_for_zero), Some(1));
        assert_eq!(catalog.route("mem://a/readme", all), Some(0));
        assert_eq!(catalog.route("mem://c", all), None);
        assert_eq!(catalog.template_owner("mem://b/notes/{n}"), Some(1));
        assert_eq!(catalog.template_owner("mem://b/{n}"), None);
    }
}
