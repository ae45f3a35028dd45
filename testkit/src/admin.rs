//! A worker's admin listener: where the directory says it is, and its `/metrics`.

use std::collections::HashMap;

use crate::fleet::PREFIX;
use crate::http;
use crate::redis::RedisServer;

/// The admin listener's address of worker `id`, from its lease in the directory.
#[track_caller]
pub fn admin_of(redis: &RedisServer, id: &str) -> String {
    let lease = redis
        .get(&format!("{PREFIX}worker:{id}"))
        .unwrap_or_else(|| panic!("{id} holds no lease"));
    let lease: serde_json::Value = serde_json::from_str(&lease).expect("lease JSON");
    lease["admin"]
        .as_str()
        .unwrap_or_else(|| panic!("{id}'s lease names no admin listener: {lease}"))
        .to_owned()
}

/// One scrape of a worker's `/metrics`: sample line (name and labels) → value.
#[track_caller]
pub fn scrape(admin: &str) -> HashMap<String, f64> {
    let r = http::request(admin, "GET", "/metrics", &[], b"");
    assert_eq!(r.status, 200, "{}", r.text());
    r.text()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (sample, value) = l.rsplit_once(' ')?;
            Some((sample.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// How much `sample` moved between two scrapes (absent counts as 0).
pub fn moved(before: &HashMap<String, f64>, after: &HashMap<String, f64>, sample: &str) -> f64 {
    after.get(sample).copied().unwrap_or(0.0) - before.get(sample).copied().unwrap_or(0.0)
}

/// The mesh connections worker `admin` has open now, as its `/state` lists them:
/// (side, link) pairs, `link` being `"tls"` or `"unix"` (the same-host path).
#[track_caller]
pub fn mesh_links(admin: &str) -> Vec<(String, String)> {
    let r = http::request(admin, "GET", "/state", &[], b"");
    assert_eq!(r.status, 200, "{}", r.text());
    let state = r.json();
    state["mesh_connections"]
        .as_array()
        .unwrap_or_else(|| panic!("/state lists no mesh connections: {state}"))
        .iter()
        .map(|c| {
            let field = |name: &str| c[name].as_str().unwrap_or_default().to_owned();
            (field("side"), field("link"))
        })
        .collect()
}

/// How many of worker `admin`'s open mesh connections on `side` run over `link`.
pub fn links_on(admin: &str, side: &str, link: &str) -> usize {
    mesh_links(admin)
        .iter()
        .filter(|(s, l)| s == side && l == link)
        .count()
}
