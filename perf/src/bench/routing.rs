//! Which URL each request goes to. The point of the routing modes is to make the
//! forwarding cost visible: `sticky` never crosses the mesh, `forward` always does,
//! `round-robin` does what a plain load balancer would (half the time, with two
//! workers).

use std::fmt;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Routing {
    /// Every request to its session's owner: what a perfect sticky load balancer does.
    Sticky,
    /// Requests alternate over the given URLs, whoever owns the session.
    RoundRobin,
    /// Every request to a URL that is not the owner, so every one is forwarded.
    Forward,
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Routing::Sticky => "sticky",
            Routing::RoundRobin => "round-robin",
            Routing::Forward => "forward",
        })
    }
}

/// The URL (index into `urls` of length `url_count`) for a session's `seq`-th request.
///
/// `home` is the URL the session was opened on; `owner` the URL of the worker that
/// owns it, when known (modern load has no owner, and a URL that fronts several
/// workers cannot be mapped). Without an owner, `home` stands in for it.
pub fn pick_url(
    routing: Routing,
    url_count: usize,
    home: usize,
    owner: Option<usize>,
    seq: u64,
) -> usize {
    if url_count <= 1 {
        return 0;
    }
    let anchor = owner.unwrap_or(home) % url_count;
    match routing {
        Routing::Sticky => anchor,
        Routing::RoundRobin => ((home as u64 + seq) % url_count as u64) as usize,
        Routing::Forward => {
            // Rotate over every URL but the owner's.
            let step = 1 + (seq % (url_count as u64 - 1)) as usize;
            (anchor + step) % url_count
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_always_reaches_the_owner() {
        for seq in 0..10 {
            assert_eq!(pick_url(Routing::Sticky, 3, 0, Some(2), seq), 2);
            assert_eq!(pick_url(Routing::Sticky, 3, 1, None, seq), 1);
        }
    }

    #[test]
    fn forward_never_reaches_the_owner_and_uses_every_other_url() {
        let picked: Vec<usize> = (0..6)
            .map(|seq| pick_url(Routing::Forward, 3, 0, Some(1), seq))
            .collect();
        assert!(!picked.contains(&1));
        assert!(picked.contains(&0) && picked.contains(&2));
        for seq in 0..4 {
            assert_eq!(pick_url(Routing::Forward, 2, 0, Some(0), seq), 1);
        }
    }

    #[test]
    fn round_robin_alternates_from_the_home_url() {
        let picked: Vec<usize> = (0..4)
            .map(|seq| pick_url(Routing::RoundRobin, 2, 1, Some(1), seq))
            .collect();
        assert_eq!(picked, vec![1, 0, 1, 0]);
    }

    #[test]
    fn one_url_leaves_no_choice() {
        for routing in [Routing::Sticky, Routing::RoundRobin, Routing::Forward] {
            assert_eq!(pick_url(routing, 1, 0, Some(0), 7), 0);
        }
    }
}
