//! Opening a federated session at the client's `initialize` (one upstream session per
//! member, in parallel, each opened with the gateway's own `initialize` and
//! `notifications/initialized`), answering it with the gateway's own result, and
//! ending the members' sessions with the client's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tracing::warn;

use super::{MAX_ANSWER_BYTES, answer, from_gateway_error, member_headers, member_streams};
use crate::config::MemberConfig;
use crate::digest;
use crate::execute::Executor;
use crate::execute::streams::{SessionStreams, StreamLog};
use crate::execute::upstream::{
    StdioProcess, StdioUpstream, Upstream, UpstreamError, UpstreamReply, VirtualUpstream,
    read_answer,
};
use crate::link::{FederatedLink, Kind, Member, MemberHealth, OwnIds, UpstreamLink, mark_lost};
use crate::mcp::{self, GatewayError};
use crate::reason::Reason;

/// The version the gateway answers in when the client asks for one it does not speak.
pub(super) const LATEST_LEGACY: &str = "2025-11-25";

impl Executor<'_> {
    /// The client's `initialize` on a virtual server: every member's session opened
    /// at once. A required member that fails fails it (an error answer: the caller
    /// closes the link and so every member opened); an optional one is left out, and
    /// the result says so.
    pub(crate) async fn open_federation(
        &self,
        server: &VirtualUpstream,
        body: &Bytes,
        session_id: &str,
        streams: &SessionStreams,
        principal: Option<&str>,
    ) -> Result<(UpstreamLink, UpstreamReply), UpstreamError> {
        let request = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        let params = request.get("params").cloned().unwrap_or(Value::Null);
        let version = params
            .get("protocolVersion")
            .and_then(Value::as_str)
            .filter(|v| mcp::LEGACY_VERSIONS.contains(v))
            .unwrap_or(LATEST_LEGACY)
            .to_owned();
        let capabilities = params.get("capabilities").cloned().unwrap_or(json!({}));
        let get_stream = streams.new_get(&self.worker.id);
        let ending = Arc::new(AtomicBool::new(false));
        let opening = Opening {
            server: &server.name,
            version: &version,
            capabilities: &capabilities,
            session_id,
            principal,
            get_stream: &get_stream,
            ending: &ending,
        };
        let opened = futures_util::future::join_all(
            server
                .server
                .members
                .iter()
                .map(|member| self.open_member(&opening, member)),
        )
        .await;
        let Sorted {
            members,
            left_out,
            refused,
            outside,
        } = sort_opened(&server.name, &server.server.members, opened);
        let link = Arc::new(FederatedLink {
            server: server.name.clone(),
            label: Arc::new(server.name.clone()),
            rule: server.server.prefix,
            separator: server.server.separator.clone(),
            members,
            left_out,
            get_stream,
            members_followed: AtomicBool::new(false),
            ending,
            catalog: Mutex::default(),
            resources: Mutex::default(),
            merge: server.server.merge,
            refreshes: tokio::sync::Mutex::default(),
            cut: Mutex::default(),
            own_ids: OwnIds::new(&self.worker.id),
        });
        // Until the session ends: a refused initialize ends it too, its streams with it.
        for (at, written) in outside {
            let member = link.members[at].name().to_owned();
            member_streams::relay_stdio(member, written, Arc::clone(&link.get_stream));
        }
        if !refused.is_empty() {
            // The error answer is the truth for the client; whoever opened the link
            // closes it on a refused initialize, and with it the members opened.
            let error = required_missing(&server.name, &refused).with_id(id);
            return Ok((UpstreamLink::Federated(link), from_gateway_error(&error)));
        }
        let result = initialize_result(&link, &version);
        let reply = answer(json!({ "jsonrpc": "2.0", "id": id, "result": result }));
        Ok((UpstreamLink::Federated(link), reply))
    }

    /// Opens one member's session, with (for stdio) the log it writes what it sends
    /// outside a request to; on failure, why (its link, if any, is closed).
    async fn open_member(
        &self,
        opening: &Opening<'_>,
        config: &MemberConfig,
    ) -> Result<Opened, String> {
        let initialize = json!({
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {
                "protocolVersion": opening.version,
                "capabilities": opening.capabilities,
                "clientInfo": { "name": "mcpgw", "version": env!("CARGO_PKG_VERSION") },
            },
        });
        let requested = HeaderValue::from_str(opening.version)
            .unwrap_or(HeaderValue::from_static(LATEST_LEGACY));
        let headers = member_headers(&requested, None);
        let health = Arc::new(MemberHealth {
            lost: Mutex::new(None),
        });
        let body = Bytes::from(initialize.to_string());
        let timeout = self.worker.config.limits.upstream_request_timeout;
        let mut outside = None;
        let route = &self.worker.routes[config.index];
        let (link, reply) = match route.upstream() {
            Upstream::Http(_) => {
                let reply = self
                    .send_upstream(route, Method::POST, headers, body, None)
                    .await
                    .map_err(|e| e.to_string())?;
                let session_id = reply.headers.get(mcp::HEADER_SESSION_ID).cloned();
                (UpstreamLink::Http { session_id }, reply)
            }
            Upstream::Stdio(stdio) => {
                let written = StreamLog::unkept(&self.worker.id);
                let process = start_stdio_member(stdio, opening, config, &health, &written).await?;
                outside = Some(written);
                match process.exchange(&body, true, timeout).await {
                    Ok(reply) => (UpstreamLink::Stdio(process), reply),
                    Err(e) => {
                        process.stop().await;
                        return Err(e.to_string());
                    }
                }
            }
            Upstream::Virtual(_) => return Err("a virtual server cannot be a member".into()),
        };
        match self.initialized(config, &link, reply, requested).await {
            Ok((version, capabilities)) => Ok(Opened {
                member: Member {
                    config: config.clone(),
                    link: Some(link),
                    version,
                    capabilities,
                    health,
                },
                outside,
            }),
            Err(why) => {
                // Never a member of the session: its end is no loss to report.
                *health.lost.lock() = Some(why.clone());
                self.close_link(route, &link).await;
                Err(why)
            }
        }
    }

    /// Reads a member's answer to initialize and sends it `notifications/initialized`:
    /// the version it negotiated and the capabilities it announced, or why not.
    async fn initialized(
        &self,
        config: &MemberConfig,
        link: &UpstreamLink,
        reply: UpstreamReply,
        requested: HeaderValue,
    ) -> Result<(HeaderValue, Value), String> {
        let timeout = self.worker.config.limits.upstream_request_timeout;
        let status = reply.status;
        let answer = read_answer(reply, &config.upstream, MAX_ANSWER_BYTES, timeout).await?;
        let Some(result) = answer.get("result") else {
            return Err(format!("it refused initialize ({status}): {answer}"));
        };
        let negotiated = result
            .get("protocolVersion")
            .and_then(Value::as_str)
            .and_then(|v| HeaderValue::from_str(v).ok())
            .unwrap_or(requested);
        let initialized = self
            .send_on_link(
                &self.worker.routes[config.index],
                link,
                Method::POST,
                member_headers(&negotiated, None),
                Bytes::from_static(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            )
            .await
            .map_err(|e| e.to_string())?;
        let _ = initialized.body.collect().await;
        Ok((
            negotiated,
            result.get("capabilities").cloned().unwrap_or(json!({})),
        ))
    }

    /// Ends every member's session (DELETE over HTTP, the process for stdio), at once.
    pub(crate) async fn close_federation(&self, link: &FederatedLink) {
        link.ending.store(true, Ordering::Release);
        futures_util::future::join_all(
            link.members
                .iter()
                .filter_map(|member| Some((member.config.index, member.link.as_ref()?)))
                .map(|(upstream, link)| self.close_link(&self.worker.routes[upstream], link)),
        )
        .await;
    }
}

/// One member opened at initialize.
struct Opened {
    member: Member,
    /// A stdio member's log of what it sends outside a request.
    outside: Option<Arc<StreamLog>>,
}

/// The members' openings at initialize, sorted.
struct Sorted {
    /// Those opened, in configuration order: a member's place here is its place in
    /// the session (the tag of its requests' ids).
    members: Vec<Member>,
    /// Optional members that could not be opened: (upstream name, why).
    left_out: Vec<(String, String)>,
    /// Required members that could not be opened: (upstream name, why).
    refused: Vec<(String, String)>,
    /// Each stdio member's log of what it sends outside a request, by its place.
    outside: Vec<(usize, Arc<StreamLog>)>,
}

fn sort_opened(
    server: &str,
    configs: &[MemberConfig],
    opened: Vec<Result<Opened, String>>,
) -> Sorted {
    let mut sorted = Sorted {
        members: Vec::new(),
        left_out: Vec::new(),
        refused: Vec::new(),
        outside: Vec::new(),
    };
    for (config, outcome) in configs.iter().zip(opened) {
        match outcome {
            Ok(Opened { member, outside }) => {
                if let Some(written) = outside {
                    sorted.outside.push((sorted.members.len(), written));
                }
                sorted.members.push(member);
            }
            Err(why) if config.required => sorted.refused.push((config.upstream.clone(), why)),
            Err(why) => {
                warn!(server = %server, member = %config.upstream, "optional member left out of a new session: {why}");
                sorted.left_out.push((config.upstream.clone(), why));
            }
        }
    }
    sorted
}

/// The gateway's own initialize result: the members' capabilities merged (of what a
/// virtual server serves), the virtual server's name, and which members are missing.
fn initialize_result(link: &FederatedLink, version: &str) -> Value {
    let mut capabilities = json!({});
    for kind in [Kind::Tools, Kind::Prompts] {
        if link.members.iter().any(|m| m.has(kind.key())) {
            capabilities[kind.key()] = json!({ "listChanged": true });
        }
    }
    // listChanged always, as for tools: the gateway itself says the list changed when
    // a member is lost. Subscriptions only where a member takes them.
    if link.members.iter().any(|m| m.has("resources")) {
        let subscribe = link
            .members
            .iter()
            .any(|m| m.capabilities["resources"]["subscribe"] == json!(true));
        capabilities["resources"] = json!({ "listChanged": true, "subscribe": subscribe });
    }
    if link.members.iter().any(|m| m.has("completions")) {
        capabilities["completions"] = json!({});
    }
    if link
        .members
        .iter()
        .any(|m| m.capabilities.get("logging").is_some())
    {
        capabilities["logging"] = json!({});
    }
    let mut result = json!({
        "protocolVersion": version,
        "capabilities": capabilities,
        "serverInfo": { "name": link.server, "version": env!("CARGO_PKG_VERSION") },
        "_meta": { "mcpgw/federation": {
            "members": link.members.iter().map(|m| m.name()).collect::<Vec<_>>(),
            "left_out": link.left_out.iter()
                .map(|(member, why)| json!({ "member": member, "why": why }))
                .collect::<Vec<_>>(),
        }},
    });
    if !link.left_out.is_empty() {
        let missing: Vec<String> = link
            .left_out
            .iter()
            .map(|(member, why)| format!("{member} ({why})"))
            .collect();
        result["instructions"] = Value::from(format!(
            "This session of virtual server {} opened without its optional member(s) {}: \
             their tools, prompts and resources are not in it.",
            link.server,
            missing.join(", ")
        ));
    }
    result
}

/// What every member's opening shares: the client session being opened and what the
/// client asked for.
struct Opening<'a> {
    server: &'a str,
    version: &'a str,
    capabilities: &'a Value,
    session_id: &'a str,
    principal: Option<&'a str>,
    /// The session's `GET` stream, where a member's loss is told.
    get_stream: &'a Arc<StreamLog>,
    /// Set when the session ends: members stopping then are not "lost".
    ending: &'a Arc<AtomicBool>,
}

/// Starts a stdio member's process for the session, writing what it sends outside a
/// request to `outside`; its exit marks the member lost, unless the session is ending.
async fn start_stdio_member(
    stdio: &StdioUpstream,
    opening: &Opening<'_>,
    config: &MemberConfig,
    health: &Arc<MemberHealth>,
    outside: &Arc<StreamLog>,
) -> Result<Arc<StdioProcess>, String> {
    let on_exit = {
        let (server, member) = (opening.server.to_owned(), config.upstream.clone());
        let (health, get_stream, ending) = (
            Arc::clone(health),
            Arc::clone(opening.get_stream),
            Arc::clone(opening.ending),
        );
        Box::new(move |why: String| {
            if !ending.load(Ordering::Acquire) {
                let why = format!("its upstream process {why}");
                mark_lost(&server, &member, &health, &get_stream, &why);
            }
        })
    };
    stdio
        .start(
            digest::tag_of(opening.session_id),
            opening.principal,
            Arc::clone(outside),
            on_exit,
        )
        .await
        .map_err(|e| e.to_string())
}

/// Initialize refused: the `required` members that could not be opened, with why.
fn required_missing(server: &str, refused: &[(String, String)]) -> GatewayError {
    let named: Vec<String> = refused
        .iter()
        .map(|(member, why)| format!("{member} ({why})"))
        .collect();
    GatewayError::gateway(
        StatusCode::BAD_GATEWAY,
        Reason::MemberUnavailable,
        format!(
            "virtual server {server} cannot open a session: its required member {} could not \
             be opened; retry later or check that upstream",
            named.join(", ")
        ),
    )
    .with_data(json!({
        "members": refused.iter().map(|(member, _)| member).collect::<Vec<_>>(),
        "retryable": true,
    }))
}
