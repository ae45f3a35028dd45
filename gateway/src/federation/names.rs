//! The names a virtual server exposes: each member's names, filtered by its include and
//! exclude patterns and prefixed by the server's rule. Pure, so every rule and every
//! collision is tested without a member.

use std::collections::HashMap;

use crate::config::{NameFilter, PrefixRule};

/// Whether `name` matches `pattern`, where `*` matches any run of characters
/// (including none) and everything else matches itself.
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return pattern == name;
    };
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let pieces: Vec<&str> = parts.collect();
    let Some((last, middle)) = pieces.split_last() else {
        // No `*`: the whole name had to be the pattern.
        return rest.is_empty();
    };
    for piece in middle {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Whether a member's filter lets `name` through.
pub fn passes(filter: &NameFilter, name: &str) -> bool {
    let included =
        filter.include.is_empty() || filter.include.iter().any(|p| glob_matches(p, name));
    included && !filter.exclude.iter().any(|p| glob_matches(p, name))
}

/// One member's names as it listed them, with what the server needs to expose them.
pub struct Listed<'a> {
    pub prefix: &'a str,
    pub filter: &'a NameFilter,
    pub names: Vec<String>,
}

/// A name the server exposes: which member (its position in the listing) owns it, and
/// the member's own name for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub member: usize,
    pub own: String,
}

/// What a listing exposes, and the names it had to hide.
#[derive(Debug, Default)]
pub struct Exposure {
    /// Exposed name → owner, for routing calls.
    pub owners: HashMap<String, Owner>,
    /// In listing order (members in configuration order, each in its own order).
    pub exposed: Vec<(String, Owner)>,
    /// (exposed name, the member that lost it, the member that keeps it): a later
    /// member's name that an earlier one already exposes under the same name.
    pub hidden: Vec<(String, usize, usize)>,
}

/// Exposes the members' names by `rule`. A collision that remains (always: prefixes
/// that run into each other; conflicts: a prefixed name equal to another member's
/// bare one; never: two members with one name) is resolved the same way every time:
/// the member earlier in the configuration keeps the name, the later one's is hidden.
pub fn expose(rule: PrefixRule, separator: &str, members: &[Listed<'_>]) -> Exposure {
    let passing = |listed: &Listed<'_>| -> Vec<String> {
        let mut seen = std::collections::HashSet::new();
        listed
            .names
            .iter()
            .filter(|name| passes(listed.filter, name) && seen.insert(name.as_str()))
            .cloned()
            .collect()
    };
    let passed: Vec<Vec<String>> = members.iter().map(passing).collect();
    let mut holders: HashMap<&str, usize> = HashMap::new();
    for names in &passed {
        for name in names {
            *holders.entry(name.as_str()).or_default() += 1;
        }
    }
    let mut exposure = Exposure::default();
    for (member, names) in passed.iter().enumerate() {
        for own in names {
            let prefixed = match rule {
                PrefixRule::Always => true,
                PrefixRule::Conflicts => holders.get(own.as_str()).copied().unwrap_or(0) > 1,
                PrefixRule::Never => false,
            };
            let name = if prefixed {
                format!("{}{separator}{own}", members[member].prefix)
            } else {
                own.clone()
            };
            let owner = Owner {
                member,
                own: own.clone(),
            };
            if let Some(keeper) = exposure.owners.get(&name) {
                exposure.hidden.push((name, member, keeper.member));
                continue;
            }
            exposure.owners.insert(name.clone(), owner.clone());
            exposure.exposed.push((name, owner));
        }
    }
    exposure
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(include: &[&str], exclude: &[&str]) -> NameFilter {
        NameFilter {
            include: include.iter().map(|s| s.to_string()).collect(),
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn globs_match_runs_anywhere_and_nothing_else() {
        assert!(glob_matches("echo", "echo"));
        assert!(!glob_matches("echo", "echo2"));
        assert!(glob_matches("counter_*", "counter_increment"));
        assert!(glob_matches("counter_*", "counter_"));
        assert!(!glob_matches("counter_*", "count"));
        assert!(glob_matches("*_time", "get_current_time"));
        assert!(glob_matches("a*b*c", "a-x-b-y-c"));
        assert!(!glob_matches("a*b*c", "a-x-c-y-b"));
        assert!(glob_matches("*", ""));
        assert!(!glob_matches("ab*ba", "aba"));
    }

    #[test]
    fn include_then_exclude() {
        let f = filter(&["echo", "counter_*"], &["counter_reset"]);
        assert!(passes(&f, "echo"));
        assert!(passes(&f, "counter_increment"));
        assert!(!passes(&f, "counter_reset"));
        assert!(!passes(&f, "slow_stream"));
        assert!(passes(&filter(&[], &["x"]), "anything"));
    }

    #[test]
    fn each_rule_names_and_resolves_collisions_by_configuration_order() {
        let all = filter(&[], &[]);
        let members = [
            Listed {
                prefix: "a",
                filter: &all,
                names: names(&["echo", "only_a", "echo"]),
            },
            Listed {
                prefix: "b",
                filter: &all,
                names: names(&["echo", "a__only_a"]),
            },
        ];
        let always = expose(PrefixRule::Always, "__", &members);
        let exposed: Vec<&str> = always.exposed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(exposed, ["a__echo", "a__only_a", "b__echo", "b__a__only_a"]);
        assert_eq!(
            always.owners["b__echo"],
            Owner {
                member: 1,
                own: "echo".into()
            }
        );

        // Only echo is held twice, so only echo is prefixed.
        let conflicts = expose(PrefixRule::Conflicts, "__", &members);
        let exposed: Vec<&str> = conflicts.exposed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(exposed, ["a__echo", "only_a", "b__echo", "a__only_a"]);
        assert!(conflicts.hidden.is_empty());

        let never = expose(PrefixRule::Never, "__", &members);
        let exposed: Vec<&str> = never.exposed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(exposed, ["echo", "only_a", "a__only_a"]);
        assert_eq!(never.hidden, vec![("echo".to_owned(), 1, 0)]);
        assert_eq!(never.owners["echo"].member, 0);
    }

    #[test]
    fn a_prefixed_name_equal_to_a_bare_one_is_kept_by_the_earlier_member() {
        let all = filter(&[], &[]);
        let members = [
            Listed {
                prefix: "x",
                filter: &all,
                names: names(&["b__echo"]),
            },
            Listed {
                prefix: "b",
                filter: &all,
                names: names(&["echo"]),
            },
            Listed {
                prefix: "c",
                filter: &all,
                names: names(&["echo"]),
            },
        ];
        let conflicts = expose(PrefixRule::Conflicts, "__", &members);
        assert_eq!(conflicts.owners["b__echo"].member, 0);
        assert_eq!(conflicts.hidden, vec![("b__echo".to_owned(), 1, 0)]);
        assert_eq!(conflicts.owners["c__echo"].member, 2);
    }
}
