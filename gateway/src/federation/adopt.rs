//! A virtual server's session taken on by another worker (its owner died or drained):
//! the link rebuilt from the session's record (`crate::adoption`), member by member.
//!
//! An HTTP member goes on in its recorded upstream session; a stdio member is lost
//! from the start (its process stayed with the old owner, and a fresh one would be a
//! different state behind the same session), answered `member_lost` like a member
//! whose process exited. Each HTTP member holding a session is asked a `ping` first,
//! so that one whose upstream forgot the session (404) is lost before the client's
//! call and not the session: only when no member is left does the adoption fail, and
//! the client hears `session_gone` as for a plain session. A `required` member is
//! lost like any other: `required` decides whether a session opens, and a member lost
//! later never ends the session (the same as a required member's process that exits
//! mid-session).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::HeaderValue;
use parking_lot::Mutex;
use serde_json::json;
use tracing::{info, warn};

use super::PROCESS_LEFT_BEHIND;
use crate::adoption::{AdoptionKeys, MemberRecord, MemberTransport};
use crate::config::MemberConfig;
use crate::execute::Executor;
use crate::execute::streams::SessionStreams;
use crate::execute::upstream::Upstream;
use crate::link::{FederatedLink, Member, MemberHealth, OwnIds, UpstreamLink};

/// Why an adopted virtual server's session cannot go on, and the refused adoption's
/// metric label.
#[derive(Debug)]
pub(crate) struct AdoptRefusal {
    pub why: String,
    pub label: &'static str,
}

fn refusal(label: &'static str, why: String) -> AdoptRefusal {
    AdoptRefusal { why, label }
}

impl Executor<'_> {
    /// The link of the virtual server session `session_id` on route `upstream`,
    /// rebuilt from its record's `members` (their sealed sessions opened with
    /// `keys`), its `GET` stream one of `streams`.
    pub(crate) async fn adopt_federation(
        &self,
        upstream: usize,
        session_id: &str,
        members: &[MemberRecord],
        keys: &AdoptionKeys,
        streams: &SessionStreams,
    ) -> Result<UpstreamLink, AdoptRefusal> {
        let route = &self.worker.routes[upstream];
        let Upstream::Virtual(server) = route.upstream() else {
            return Err(refusal(
                "record_unreadable",
                format!(
                    "its record is a virtual server's session, but route {} is not a virtual \
                     server here",
                    route.name()
                ),
            ));
        };
        let mut built = Vec::with_capacity(members.len());
        let mut lost = Vec::new();
        for record in members {
            let Some(config) = server
                .server
                .members
                .iter()
                .find(|m| m.upstream == record.upstream)
            else {
                warn!(server = %server.name, member = %record.upstream, "a member of an adopted session is no longer configured: it is left out");
                continue;
            };
            let (member, why_lost) = self.rebuild_member(config, record, session_id, keys)?;
            if let Some(why) = why_lost {
                lost.push((built.len(), why));
            }
            built.push(member);
        }
        let link = FederatedLink {
            server: server.name.clone(),
            label: Arc::new(server.name.clone()),
            rule: server.server.prefix,
            separator: server.server.separator.clone(),
            members: built,
            left_out: Vec::new(),
            get_stream: streams.new_get(&self.worker.id),
            // Opened again here on the client's next GET, in the recorded sessions.
            members_followed: AtomicBool::new(false),
            ending: Arc::new(AtomicBool::new(false)),
            catalog: Mutex::default(),
            resources: Mutex::default(),
            merge: server.server.merge,
            refreshes: tokio::sync::Mutex::default(),
            cut: Mutex::default(),
            own_ids: OwnIds::new(&self.worker.id),
        };
        for (at, why) in &lost {
            link.mark_lost(&link.members[*at], why);
        }
        self.ping_members(&link).await;
        if let Some(refused) = none_left(&link, &server.name) {
            return Err(refused);
        }
        let live = link.members.iter().filter(|m| m.lost().is_none()).count();
        info!(
            server = %server.name,
            members = link.members.len(),
            live,
            "rebuilt an adopted virtual server's session"
        );
        Ok(UpstreamLink::Federated(Arc::new(link)))
    }

    /// One member of an adopted session, from its record: an HTTP member reconnects
    /// to its upstream session (opened from its sealed record); any other is lost from
    /// the start, with why.
    fn rebuild_member(
        &self,
        config: &MemberConfig,
        record: &MemberRecord,
        session_id: &str,
        keys: &AdoptionKeys,
    ) -> Result<(Member, Option<String>), AdoptRefusal> {
        let http = self.worker.routes[config.index].is_http();
        let lost_link = || (None, HeaderValue::from_static(super::open::LATEST_LEGACY));
        let (link, version, why_lost) = match (record.transport, &record.session) {
            (MemberTransport::Http, Some(sealed)) if http => {
                let (link, version) = reconnect(record, sealed, session_id, keys)?;
                (Some(link), version, None)
            }
            (MemberTransport::Http, _) => {
                let (link, version) = lost_link();
                let why = "it was an HTTP upstream when the session opened and is not one now";
                (link, version, Some(why.to_owned()))
            }
            (MemberTransport::Stdio, _) => {
                let (link, version) = lost_link();
                let why = format!("its upstream process {PROCESS_LEFT_BEHIND}");
                (link, version, Some(why))
            }
        };
        let member = Member {
            config: config.clone(),
            link,
            version,
            capabilities: record.capabilities.clone(),
            health: Arc::new(MemberHealth {
                lost: Mutex::new(None),
            }),
        };
        Ok((member, why_lost))
    }

    /// Pings every member that holds an upstream session, so one whose upstream forgot
    /// it is lost before the client's call (only such a member can have forgotten).
    async fn ping_members(&self, link: &FederatedLink) {
        let probed = link.members.iter().filter(|m| {
            matches!(
                m.link,
                Some(UpstreamLink::Http {
                    session_id: Some(_)
                })
            )
        });
        futures_util::future::join_all(probed.map(|member| {
            let ping = json!({"jsonrpc": "2.0", "id": link.own_ids.next("ping"), "method": "ping"});
            link.exchange(self, member, Bytes::from(ping.to_string()))
        }))
        .await;
    }
}

/// An HTTP member's upstream session, opened from its sealed record.
fn reconnect(
    record: &MemberRecord,
    sealed: &str,
    session_id: &str,
    keys: &AdoptionKeys,
) -> Result<(UpstreamLink, HeaderValue), AdoptRefusal> {
    let opened = keys
        .open_member(session_id, &record.upstream, sealed)
        .map_err(|e| refusal(e.label(), format!("member {}: {e}", record.upstream)))?;
    let unreadable = || {
        refusal(
            "record_unreadable",
            format!(
                "member {}: its recorded session is not a header value",
                record.upstream
            ),
        )
    };
    let member_session = opened
        .session_id
        .map(|id| HeaderValue::from_str(&id))
        .transpose()
        .map_err(|_| unreadable())?;
    let version = HeaderValue::from_str(&opened.protocol_version).map_err(|_| unreadable())?;
    let link = UpstreamLink::Http {
        session_id: member_session,
    };
    Ok((link, version))
}

/// The refusal when no member of the adopted session can go on (each lost, or none
/// configured any more); `None` while one can. The session's ending is marked, so
/// members stopping now are not reported lost.
fn none_left(link: &FederatedLink, server: &str) -> Option<AdoptRefusal> {
    if !link.members.iter().all(|m| m.lost().is_some()) {
        return None;
    }
    link.ending.store(true, Ordering::Release);
    // A member holding an upstream session that is lost now was forgotten upstream.
    let forgotten = link.members.iter().any(|m| {
        m.lost().is_some()
            && matches!(
                m.link,
                Some(UpstreamLink::Http {
                    session_id: Some(_)
                })
            )
    });
    let named: Vec<String> = link
        .members
        .iter()
        .map(|m| format!("{} ({})", m.name(), m.lost().unwrap_or_default()))
        .collect();
    Some(refusal(
        if forgotten {
            "upstream_forgot"
        } else {
            "stdio"
        },
        format!(
            "no member of virtual server {server} could go on: {}",
            if named.is_empty() {
                "none is configured any more".to_owned()
            } else {
                named.join(", ")
            }
        ),
    ))
}
