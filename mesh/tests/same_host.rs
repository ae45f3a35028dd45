//! The same-host path: the TCP transport's framing over a Unix socket, used only for a
//! worker that advertised this kernel's boot id, proven by connecting, and falling back
//! to TLS over TCP wherever the socket cannot be used.

mod common;

use std::path::Path;

use common::{CALLER, Mesh, OWNER, TEST_TIMEOUT, body_of, header, request};
use mcpgw_mesh::transport::{MeshError, SameHostRoute, TransportKind, open_connections};

const BOOT: &str = "test-boot-id";

fn route(boot_id: &str, path: &Path) -> SameHostRoute {
    SameHostRoute {
        boot_id: boot_id.into(),
        path: path.to_owned(),
    }
}

/// Open caller connections of this process that lead to `path` over the socket.
fn unix_calls_to(path: &Path) -> usize {
    let named = format!("unix:{}", path.display());
    open_connections()
        .iter()
        .filter(|c| c.side == "caller" && c.link == "unix" && c.peer_identity == named)
        .count()
}

async fn tcp_mesh_with_socket(dir: &Path) -> (Mesh, std::path::PathBuf) {
    let mut mesh = Mesh::start(TransportKind::Tcp).await;
    let path = dir.join("owner.sock");
    mesh.server
        .serve_same_host(&path)
        .expect("serve the socket");
    mesh.client.use_same_host(BOOT).expect("same host on");
    (mesh, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_this_kernel_is_reached_over_its_socket_as_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mesh, path) = tcp_mesh_with_socket(dir.path()).await;
    mesh.client
        .expect_same_host(OWNER, Some(&route(BOOT, &path)));
    let response = tokio::time::timeout(TEST_TIMEOUT, mesh.forward("/echo", "ping"))
        .await
        .expect("in time")
        .expect("forwarded over the socket");
    let peer_identity = header(response.head(), "x-peer-identity").unwrap_or_default();
    assert!(
        peer_identity.starts_with("same-host uid "),
        "the owner keys the caller by its kernel credentials: {peer_identity}"
    );
    assert_eq!(header(response.head(), "x-peer-worker"), Some(CALLER));
    let (body, _) = body_of(response).await.expect("body");
    assert_eq!(body, b"ping");
    assert_eq!(unix_calls_to(&path), 1, "{:?}", open_connections());
    drop(mesh);
    assert!(!path.exists(), "the socket file goes with the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_of_another_kernel_is_never_used_though_the_socket_is_reachable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mesh, path) = tcp_mesh_with_socket(dir.path()).await;
    mesh.client
        .expect_same_host(OWNER, Some(&route("another-boot-id", &path)));
    let response = mesh.forward("/echo", "ping").await.expect("forwarded");
    assert_eq!(
        header(response.head(), "x-peer-identity"),
        Some("caller"),
        "the owner saw the caller's certificate: TLS over TCP"
    );
    assert_eq!(unix_calls_to(&path), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_socket_file_falls_back_to_tcp_and_a_socket_without_listener_proves_death() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mesh, _) = tcp_mesh_with_socket(dir.path()).await;
    // No such file (another container's filesystem): TCP, and the request is served.
    let missing = dir.path().join("elsewhere.sock");
    mesh.client
        .expect_same_host(OWNER, Some(&route(BOOT, &missing)));
    let response = mesh.forward("/echo", "ping").await.expect("fell back");
    assert_eq!(header(response.head(), "x-peer-identity"), Some("caller"));
    drop(response);

    // A socket file nobody listens on, at the path the worker advertised: it is gone.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let other = "owner-2";
    mesh.client
        .expect_same_host(other, Some(&route(BOOT, &stale)));
    let refused = mesh
        .client
        .forward(&mesh.addr(), other, request("/echo", "ping"))
        .await
        .expect_err("nobody listens");
    assert!(
        matches!(refused, MeshError::Refused { .. }),
        "refused, not a fallback: {refused:?}"
    );
    assert!(refused.proves_peer_gone() && mesh.client.refusal_proves_death());
}
