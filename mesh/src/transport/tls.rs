//! Where the mesh transports take their TLS material, how long a connection may live on
//! it, and whose identity a peer must present.
//!
//! Configs are read per handshake ([`ServerTls::config`], [`ClientTls::config`]), so a
//! worker following its certificate files (`mcpgw_certs::MeshTlsSource`) uses new
//! material for every new connection the moment it is published, while connections
//! already up keep theirs. Old material still leaves the fleet within a known time:
//!
//! - a caller stops opening exchanges on a connection older than
//!   [`MeshLimits::max_connection_age`](super::config::MeshLimits::max_connection_age) and
//!   lets it close once its exchanges end (a new connection takes the new requests), so
//!   no request fails because its connection was replaced;
//! - an owner closes a connection that is still open at
//!   [`hard_age`] (held streams then end; clients reconnect them);
//! - both ends close a connection when the peer's certificate expires.
//!
//! A caller that knows the identity registered for the worker it expects
//! ([`IdentityBook`]) believes a `Welcome` only from that identity: a valid leaf of
//! another mesh member can neither stand in for the worker nor, by answering as another
//! worker, prove it gone.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mcpgw_certs::{CertError, MeshTlsSource, PeerIdentity, TrustDomain};
use parking_lot::RwLock;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, ServerConfig};
use tokio::time::Instant;

use super::config::MESH_ALPN;
use super::error::MeshError;

/// The ALPN list every mesh config carries.
pub(crate) fn mesh_alpn() -> Vec<Vec<u8>> {
    vec![MESH_ALPN.to_vec()]
}

/// Settings to build a `MeshTlsSource` with, so that its configs carry the mesh ALPN
/// already and a transport hands them to rustls or quinn without a copy.
pub fn mesh_tls_settings(trust_domain: TrustDomain) -> mcpgw_certs::MeshTlsSettings {
    mcpgw_certs::MeshTlsSettings {
        trust_domain,
        alpn_protocols: mesh_alpn(),
    }
}

/// The material a mesh server accepts connections with.
#[derive(Clone, Debug)]
pub struct ServerTls(Material<ServerConfig>);

/// The material a mesh client dials with.
#[derive(Clone, Debug)]
pub struct ClientTls(Material<ClientConfig>);

#[derive(Clone, Debug)]
enum Material<C> {
    /// A config that never changes (tools, tests); identities of the default trust
    /// domain.
    Fixed(Arc<C>),
    /// Material that follows its files.
    Following(MeshTlsSource),
}

impl From<Arc<ServerConfig>> for ServerTls {
    fn from(config: Arc<ServerConfig>) -> Self {
        Self(Material::Fixed(server_with_alpn(config)))
    }
}

impl From<MeshTlsSource> for ServerTls {
    fn from(source: MeshTlsSource) -> Self {
        Self(Material::Following(source))
    }
}

impl From<Arc<ClientConfig>> for ClientTls {
    fn from(config: Arc<ClientConfig>) -> Self {
        Self(Material::Fixed(client_with_alpn(config)))
    }
}

impl From<MeshTlsSource> for ClientTls {
    fn from(source: MeshTlsSource) -> Self {
        Self(Material::Following(source))
    }
}

impl ServerTls {
    /// The config for the next accepted handshake.
    pub(crate) fn config(&self) -> Arc<ServerConfig> {
        match &self.0 {
            Material::Fixed(config) => config.clone(),
            Material::Following(source) => server_with_alpn(source.server_config()),
        }
    }

    /// Identity and expiry of a peer whose chain this material's verifier accepted.
    pub(crate) fn peer(&self, chain: &[CertificateDer<'_>]) -> Result<PeerIdentity, CertError> {
        self.0.peer(chain)
    }

    /// The source, for a transport that must push new material somewhere (quinn).
    pub(crate) fn source(&self) -> Option<&MeshTlsSource> {
        match &self.0 {
            Material::Fixed(_) => None,
            Material::Following(source) => Some(source),
        }
    }
}

impl ClientTls {
    /// The config for the next dial.
    pub(crate) fn config(&self) -> Arc<ClientConfig> {
        match &self.0 {
            Material::Fixed(config) => config.clone(),
            Material::Following(source) => client_with_alpn(source.client_config()),
        }
    }

    /// Identity and expiry of a peer whose chain this material's verifier accepted.
    pub(crate) fn peer(&self, chain: &[CertificateDer<'_>]) -> Result<PeerIdentity, CertError> {
        self.0.peer(chain)
    }
}

impl<C> Material<C> {
    fn peer(&self, chain: &[CertificateDer<'_>]) -> Result<PeerIdentity, CertError> {
        match self {
            Material::Fixed(_) => PeerIdentity::from_chain(chain, &TrustDomain::default()),
            Material::Following(source) => source.peer(chain),
        }
    }
}

/// Whether a config offers exactly the mesh ALPN (checked per handshake: no allocation).
fn has_mesh_alpn(alpn: &[Vec<u8>]) -> bool {
    matches!(alpn, [only] if only == MESH_ALPN)
}

fn server_with_alpn(config: Arc<ServerConfig>) -> Arc<ServerConfig> {
    if has_mesh_alpn(&config.alpn_protocols) {
        return config;
    }
    let mut config = (*config).clone();
    config.alpn_protocols = mesh_alpn();
    Arc::new(config)
}

fn client_with_alpn(config: Arc<ClientConfig>) -> Arc<ClientConfig> {
    if has_mesh_alpn(&config.alpn_protocols) {
        return config;
    }
    let mut config = (*config).clone();
    config.alpn_protocols = mesh_alpn();
    Arc::new(config)
}

/// The mesh identity (URI) registered for each worker id this caller forwards to, as
/// the directory published it with the worker's lease. A worker with no entry is
/// checked by mTLS alone (any member of the mesh).
#[derive(Debug, Default)]
pub(crate) struct IdentityBook {
    by_worker: RwLock<rustc_hash::FxHashMap<String, String>>,
}

impl IdentityBook {
    pub(crate) fn record(&self, worker_id: &str, identity: &str) {
        let mut book = self.by_worker.write();
        if book.get(worker_id).map(String::as_str) != Some(identity) {
            book.insert(worker_id.to_owned(), identity.to_owned());
        }
    }

    pub(crate) fn forget(&self, worker_id: &str) {
        self.by_worker.write().remove(worker_id);
    }

    /// Whether a connection to `peer_addr` whose `Welcome` named `welcomed` and whose
    /// certificate says `presented` leads to `expect_worker_id`. The identity comes
    /// first: it must be the one registered for the expected worker (when one is), so
    /// only that member can tell that the expected worker left its address (its host
    /// restarted it under a new id, [`MeshError::WrongWorker`]); any other member gets
    /// [`MeshError::IdentityMismatch`], which proves nothing.
    ///
    /// `presented` is `None` on a same-host connection: no certificate, the kernel
    /// vouched for a process of our own uid, which could read the owner's key anyway.
    pub(crate) fn check_answer(
        &self,
        peer_addr: &str,
        expect_worker_id: &str,
        welcomed: &str,
        presented: Option<&str>,
    ) -> Result<(), MeshError> {
        if let Some(presented) = presented
            && let Some(registered) = self.by_worker.read().get(expect_worker_id)
            && registered != presented
        {
            return Err(MeshError::IdentityMismatch {
                addr: peer_addr.to_owned(),
                expected: expect_worker_id.to_owned(),
                registered: registered.clone(),
                presented: presented.to_owned(),
            });
        }
        if welcomed != expect_worker_id {
            return Err(MeshError::WrongWorker {
                addr: peer_addr.to_owned(),
                expected: expect_worker_id.to_owned(),
                found: welcomed.to_owned(),
            });
        }
        Ok(())
    }
}

/// When a connection made now should have its replacement dialled, when it should
/// stop taking new exchanges (its age reached `max_age`, or the peer's certificate
/// expires) and when it must close (the peer's certificate expired). `max_age` zero:
/// no age limit.
///
/// A caller replaces a connection make-before-break: from `renew_at` it dials the
/// replacement in the background and keeps giving this connection new exchanges until
/// the replacement is up or `retire_at` comes. So a handshake that is slow, or fails
/// once, costs no request: the replacement has the lead ([`renewal_lead`]) to succeed,
/// retries included. `retire_at` is unchanged by it: the owner's bound of one and a
/// half ages ([`hard_age`]) leaves exchanges begun before `retire_at` the same half
/// age to end as before.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionLife {
    /// From then on a replacement is dialled in the background.
    pub(crate) renew_at: Instant,
    /// No new exchange from then on; the connection closes when its last one ends.
    pub(crate) retire_at: Instant,
    /// Closed then, exchanges or not.
    pub(crate) close_at: Instant,
}

/// Far enough to mean "never" and still add to an `Instant` without overflow.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How long before a connection's retirement its replacement is dialled: two connect
/// timeouts (a handshake that times out, and its retry), at most half the maximum age.
/// Without a maximum age a connection is never replaced (only closed when the peer's
/// certificate expires), so there is no lead.
pub(crate) fn renewal_lead(max_age: Duration, connect_timeout: Duration) -> Duration {
    connect_timeout.saturating_mul(2).min(max_age / 2)
}

impl ConnectionLife {
    /// The life of a connection made now; `lead`: see [`renewal_lead`].
    pub(crate) fn starting_now(
        max_age: Duration,
        peer_not_after: SystemTime,
        lead: Duration,
    ) -> Self {
        let now = Instant::now();
        let cert_left = peer_not_after
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
            .min(FOREVER);
        let close_at = now + cert_left;
        let retire_at = if max_age.is_zero() {
            close_at
        } else {
            close_at.min(now + max_age)
        };
        let renew_at = retire_at.checked_sub(lead).unwrap_or(now).max(now);
        Self {
            renew_at,
            retire_at,
            close_at,
        }
    }

    /// The owner's bound: the peer's certificate, and [`hard_age`] after it connected.
    pub(crate) fn owner_close_at(max_age: Duration, peer_not_after: SystemTime) -> Instant {
        let life = Self::starting_now(hard_age(max_age), peer_not_after, Duration::ZERO);
        life.retire_at
    }

    pub(crate) fn retire_due(&self) -> bool {
        Instant::now() >= self.retire_at
    }

    /// Whether its replacement should be under way.
    pub(crate) fn renew_due(&self) -> bool {
        Instant::now() >= self.renew_at
    }
}

/// How long an owner lets a connection live: one and a half maximum ages, so a caller
/// that retired it at the maximum age had half an age for its exchanges to end, and a
/// peer that never retires its connections (an old version, a stolen key) is cut off
/// anyway. Zero: no limit.
pub fn hard_age(max_age: Duration) -> Duration {
    max_age + max_age / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_is_dialled_ahead_and_retirement_stays_at_the_maximum_age() {
        let year = SystemTime::now() + Duration::from_secs(365 * 24 * 3600);
        let (age, connect) = (Duration::from_secs(600), Duration::from_secs(2));
        let lead = renewal_lead(age, connect);
        assert_eq!(lead, Duration::from_secs(4), "two connect timeouts");
        let before = Instant::now();
        let life = ConnectionLife::starting_now(age, year, lead);
        assert_eq!(life.retire_at - life.renew_at, lead);
        assert!(
            life.retire_at >= before + age,
            "retired at the maximum age, as before"
        );
        assert!(!life.renew_due() && !life.retire_due());
        // Short ages: at most half an age ahead; no age: never replaced.
        assert_eq!(
            renewal_lead(Duration::from_secs(3), connect),
            Duration::from_millis(1500)
        );
        assert_eq!(renewal_lead(Duration::ZERO, connect), Duration::ZERO);
        let forever = ConnectionLife::starting_now(Duration::ZERO, year, Duration::ZERO);
        assert_eq!(forever.renew_at, forever.retire_at);
        // A certificate ending before the age: replaced ahead of its end.
        let soon = SystemTime::now() + Duration::from_secs(60);
        let life = ConnectionLife::starting_now(age, soon, lead);
        assert!(life.retire_at <= life.close_at);
        assert_eq!(life.retire_at - life.renew_at, lead);
    }
}
