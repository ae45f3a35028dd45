//! mcpgw's integration tests: real Redis, mcpgw workers, upstreams and the official
//! Python MCP SDK as processes, driven from `tests/*.rs`. The support they share
//! (processes, Redis, raw HTTP, signals, polling) lives in `mcpgw-testkit`; this crate
//! holds the tests, [`forward_once`], which speaks the mesh as a peer would, and
//! [`load`], the closed-loop load of counting sessions that the fault tests judge.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod load;

use std::sync::Arc;
use std::time::Duration;

/// Sends one modern `tools/list` over the mesh to each `(address, worker id)` with
/// `tls`, as a mesh peer would, saying in its `Hello` that it is worker `as_worker`:
/// the HTTP status each answered, or why the mesh refused.
pub fn forward_once(
    transport: &str,
    tls: Arc<rustls::ClientConfig>,
    as_worker: &str,
    targets: &[(String, String)],
) -> Vec<Result<u16, String>> {
    use mcpgw_mesh::transport::{MeshClient, MeshLimits, TransportKind};
    let Ok(kind) = transport.parse::<TransportKind>() else {
        return vec![Err(format!("unknown transport {transport}"))];
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return vec![Err(format!("runtime: {e}"))],
    };
    runtime.block_on(async {
        let client = match MeshClient::new(kind, tls, as_worker, MeshLimits::default(), None) {
            Ok(client) => client,
            Err(e) => return vec![Err(e.to_string())],
        };
        let mut outcomes = Vec::new();
        for (addr, worker) in targets {
            let forward = client.forward(addr, worker, tools_list_frame());
            let outcome = match tokio::time::timeout(Duration::from_secs(15), forward).await {
                Err(_) => Err("timed out".to_owned()),
                Ok(Err(e)) => Err(e.to_string()),
                Ok(Ok(response)) => Ok(response.head().status),
            };
            outcomes.push(outcome);
        }
        outcomes
    })
}

/// A modern (2026-07-28) `tools/list` for the demo route, as a public client's.
fn tools_list_frame() -> mcpgw_wire::RequestFrame {
    let body = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}}});
    mcpgw_wire::RequestFrame {
        request_id: 1,
        session_id: None,
        method: "POST".into(),
        path: "/mcp".into(),
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("mcp-protocol-version".into(), "2026-07-28".into()),
            ("mcp-method".into(), "tools/list".into()),
        ],
        body: body.to_string().into_bytes().into(),
        auth: mcpgw_wire::AuthContext {
            mode: mcpgw_wire::AuthMode::Public,
            subject: String::new(),
            scopes: Vec::new(),
            expires_at_ms: None,
            route: "demo".into(),
        },
        deadline_ms: 5000,
    }
}
