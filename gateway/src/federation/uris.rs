//! Which member a resource URI belongs to. URIs are identities, so a virtual server
//! never renames them: a URI is reached at the member that listed it, else at the
//! member whose resource template matches it. Pure, so every match and every conflict
//! is tested without a member.
//!
//! A URI matches a template when some expansion of it (RFC 6570, levels 1 to 4) could
//! produce the URI (`template.rs`); a template that is no valid RFC 6570 template
//! matches nothing, so its member is reached only for the URIs it lists.

mod template;

use std::collections::HashMap;

pub use template::template_matches;

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
    /// template matches it and whose filter (`passes`) lets the URI through. A URI
    /// longer than `max_template_uri` bytes is matched against no template: a match
    /// costs the URI's length per template, and templates are many.
    pub fn route(
        &self,
        uri: &str,
        max_template_uri: usize,
        passes: impl Fn(usize, &str) -> bool,
    ) -> Option<usize> {
        if let Some(member) = self.uris.get(uri) {
            return Some(*member);
        }
        if uri.len() > max_template_uri {
            return None;
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

    /// The member a request about `uri` goes to: with `as_template` (a completion's
    /// `ref/resource`, which may name a template or a URI), the member that listed
    /// that template exactly, else the one [`ResourceCatalog::route`] finds.
    pub fn serving(
        &self,
        uri: &str,
        as_template: bool,
        max_template_uri: usize,
        passes: impl Fn(usize, &str) -> bool,
    ) -> Option<usize> {
        as_template
            .then(|| self.template_owner(uri))
            .flatten()
            .or_else(|| self.route(uri, max_template_uri, passes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No bound on the URI's length.
    const ANY: usize = usize::MAX;

    #[test]
    fn a_uri_past_the_bound_is_routed_by_listed_uris_only() {
        let long = format!("mem://a/{}", "x".repeat(100));
        let catalog = ResourceCatalog {
            uris: HashMap::from([(long.clone(), 1)]),
            templates: vec![("mem://a/{x}".to_owned(), 0)],
        };
        let all = |_: usize, _: &str| true;
        let longer = format!("{long}y");
        assert_eq!(catalog.route(&longer, ANY, all), Some(0));
        assert_eq!(catalog.route(&longer, 100, all), None, "too long to match");
        assert_eq!(
            catalog.route(&long, 100, all),
            Some(1),
            "listed: no match needed"
        );
        assert_eq!(catalog.route("mem://a/short", 100, all), Some(0));
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
        assert_eq!(catalog.route("mem://b/notes/pinned", ANY, all), Some(1));
        assert_eq!(catalog.route("mem://b/notes/n1", ANY, all), Some(0));
        let no_b_for_zero = |member: usize, uri: &str| member != 0 || !uri.starts_with("mem://b");
        assert_eq!(
            catalog.route("mem://b/notes/n1", ANY, no_b_for_zero),
            Some(1)
        );
        assert_eq!(catalog.route("mem://a/readme", ANY, all), Some(0));
        assert_eq!(catalog.route("mem://c", ANY, all), None);
        assert_eq!(catalog.template_owner("mem://b/notes/{n}"), Some(1));
        assert_eq!(catalog.template_owner("mem://b/{n}"), None);
        assert_eq!(
            catalog.serving("mem://b/notes/{n}", true, ANY, all),
            Some(1)
        );
        assert_eq!(catalog.serving("mem://b/notes/{n}", false, ANY, all), None);
        assert_eq!(catalog.serving("mem://a/x", true, ANY, all), Some(0));
    }

    #[test]
    fn templates_beyond_level_one_route_their_uris() {
        let catalog = ResourceCatalog {
            uris: HashMap::new(),
            templates: vec![
                ("files://a{/path*}".to_owned(), 0),
                ("search://b/items{?q,limit}".to_owned(), 1),
                ("docs://b/{+rest}".to_owned(), 1),
            ],
        };
        let all = |_: usize, _: &str| true;
        assert_eq!(catalog.route("files://a/x/y/z", ANY, all), Some(0));
        assert_eq!(
            catalog.route("search://b/items?q=red&limit=2", ANY, all),
            Some(1)
        );
        assert_eq!(catalog.route("search://b/items", ANY, all), Some(1));
        assert_eq!(catalog.route("search://b/items?sort=up", ANY, all), None);
        assert_eq!(catalog.route("docs://b/guide/intro#top", ANY, all), Some(1));
    }
}
