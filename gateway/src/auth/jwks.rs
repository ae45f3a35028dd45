//! Signing keys for JWT verification: read from the configuration or from a JWKS (a
//! file, or a URL fetched over HTTPS), and the cache of a JWKS. The cache refetches a
//! JWKS in the background when it grows old, and when a token names a key it does not
//! hold, at most once per interval, so tokens with made-up `kid`s cannot hammer the
//! issuer's endpoint through the gateway.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, HOST, USER_AGENT};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};
use parking_lot::RwLock;
use rustls::pki_types::ServerName;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::config::StaticKey;

/// Largest JWKS document accepted; real ones are a few KiB.
const MAX_JWKS_BYTES: usize = 1024 * 1024;
/// Deadline of one JWKS fetch (connect, TLS, answer).
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// While a JWKS has never loaded, requests try again at most this often.
const LOAD_RETRY: Duration = Duration::from_secs(1);
/// Shortest HMAC secret accepted (RFC 7518: a key as long as the hash output).
const MIN_HMAC_SECRET_BYTES: usize = 32;

/// One key and the one algorithm it verifies. Pinning the algorithm to the key is what
/// refuses algorithm confusion: a token's `alg` must equal its key's.
pub struct VerifyingKey {
    pub kid: Option<String>,
    pub alg: Algorithm,
    pub key: DecodingKey,
}

/// Keys to verify tokens with.
#[derive(Default)]
pub struct KeySet {
    pub keys: Vec<VerifyingKey>,
}

impl KeySet {
    /// Parses a JWKS document. Keys that are not for signatures, of an unsupported
    /// type, or (when `allow_secrets` is false, i.e. fetched over the network)
    /// symmetric, are skipped; their count is returned for the log.
    pub fn parse_jwks(json: &[u8], allow_secrets: bool) -> Result<(KeySet, usize), String> {
        #[derive(serde::Deserialize)]
        struct Document {
            keys: Vec<serde_json::Value>,
        }
        let document: Document = serde_json::from_slice(json)
            .map_err(|e| format!("not a JWKS document ({{\"keys\": [...]}}): {e}"))?;
        let mut set = KeySet::default();
        let mut skipped = 0;
        for value in document.keys {
            match serde_json::from_value::<Jwk>(value)
                .map_err(|e| e.to_string())
                .and_then(|jwk| key_from_jwk(&jwk, allow_secrets))
            {
                Ok(key) => set.keys.push(key),
                Err(why) => {
                    debug!(%why, "JWKS key skipped");
                    skipped += 1;
                }
            }
        }
        Ok((set, skipped))
    }

    pub fn has_kid(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| k.kid.as_deref() == Some(kid))
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The secrets of its HMAC keys with their index and `kid`, for the start-time
    /// check that no secret serves two issuers.
    pub fn hmac_secrets(&self) -> impl Iterator<Item = (usize, Option<&str>, &[u8])> {
        self.keys
            .iter()
            .enumerate()
            .filter(|(_, k)| k.alg.family() == AlgorithmFamily::Hmac)
            .filter_map(|(i, k)| Some((i, k.kid.as_deref(), k.key.try_get_as_bytes().ok()?)))
    }
}

fn key_from_jwk(jwk: &Jwk, allow_secrets: bool) -> Result<VerifyingKey, String> {
    if let Some(usage) = &jwk.common.public_key_use
        && *usage != PublicKeyUse::Signature
    {
        return Err("not a signature key (use)".into());
    }
    let inferred = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Algorithm::ES256,
            EllipticCurve::P384 => Algorithm::ES384,
            _ => return Err("unsupported EC curve".into()),
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => {
            Algorithm::EdDSA
        }
        AlgorithmParameters::OctetKeyPair(_) => return Err("unsupported OKP curve".into()),
        AlgorithmParameters::OctetKey(_) if !allow_secrets => {
            return Err("a symmetric key fetched over the network is refused".into());
        }
        AlgorithmParameters::OctetKey(_) => Algorithm::HS256,
        _ => return Err("unsupported key type".into()),
    };
    let alg = match jwk.common.key_algorithm {
        None => inferred,
        Some(declared) => signing_algorithm(declared).ok_or("not a signing algorithm")?,
    };
    if alg.family() != inferred.family() {
        return Err(format!(
            "declared algorithm {alg:?} does not fit the key type"
        ));
    }
    let key = DecodingKey::from_jwk(jwk).map_err(|e| e.to_string())?;
    if alg.family() == AlgorithmFamily::Hmac
        && key.try_get_as_bytes().map_or(0, <[u8]>::len) < MIN_HMAC_SECRET_BYTES
    {
        return Err(format!(
            "HMAC secret shorter than {MIN_HMAC_SECRET_BYTES} bytes"
        ));
    }
    Ok(VerifyingKey {
        kid: jwk.common.key_id.clone(),
        alg,
        key,
    })
}

fn signing_algorithm(declared: KeyAlgorithm) -> Option<Algorithm> {
    Some(match declared {
        KeyAlgorithm::HS256 => Algorithm::HS256,
        KeyAlgorithm::HS384 => Algorithm::HS384,
        KeyAlgorithm::HS512 => Algorithm::HS512,
        KeyAlgorithm::ES256 => Algorithm::ES256,
        KeyAlgorithm::ES384 => Algorithm::ES384,
        KeyAlgorithm::RS256 => Algorithm::RS256,
        KeyAlgorithm::RS384 => Algorithm::RS384,
        KeyAlgorithm::RS512 => Algorithm::RS512,
        KeyAlgorithm::PS256 => Algorithm::PS256,
        KeyAlgorithm::PS384 => Algorithm::PS384,
        KeyAlgorithm::PS512 => Algorithm::PS512,
        KeyAlgorithm::EdDSA => Algorithm::EdDSA,
        _ => return None,
    })
}

/// Reads a key given in the configuration. Errors name the file, never its content.
pub fn load_static_key(spec: &StaticKey) -> Result<VerifyingKey, String> {
    let alg = Algorithm::from_str(&spec.alg).map_err(|_| {
        format!(
            "alg {:?} is not one of HS256, HS384, HS512, RS256, RS384, RS512, PS256, PS384, \
             PS512, ES256, ES384, EdDSA",
            spec.alg
        )
    })?;
    let read = |path: &Path| {
        std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let key = match (alg.family(), &spec.pem_file, &spec.secret_file) {
        (AlgorithmFamily::Hmac, None, Some(path)) => {
            let secret = read(path)?;
            if secret.len() < MIN_HMAC_SECRET_BYTES {
                return Err(format!(
                    "{}: an HMAC secret needs at least {MIN_HMAC_SECRET_BYTES} bytes",
                    path.display()
                ));
            }
            DecodingKey::from_secret(&secret).map_err(|e| e.to_string())?
        }
        (AlgorithmFamily::Hmac, _, _) => {
            return Err(format!("{alg:?} needs secret_file (and no pem_file)"));
        }
        (family, Some(path), None) => {
            let pem = read(path)?;
            let parsed = match family {
                AlgorithmFamily::Rsa => DecodingKey::from_rsa_pem(&pem),
                AlgorithmFamily::Ec => DecodingKey::from_ec_pem(&pem),
                _ => DecodingKey::from_ed_pem(&pem),
            };
            parsed.map_err(|e| {
                format!("{}: not a PEM public key for {alg:?} ({e})", path.display())
            })?
        }
        (_, _, _) => return Err(format!("{alg:?} needs pem_file (and no secret_file)")),
    };
    Ok(VerifyingKey {
        kid: spec.kid.clone(),
        alg,
        key,
    })
}

/// Where a JWKS comes from.
pub enum JwksSource {
    File(PathBuf),
    Url(JwksUrl),
}

/// A JWKS URL, ready to fetch.
pub struct JwksUrl {
    /// The URL, for logs and errors (it carries no credentials: refused at parse).
    pub display: String,
    host: String,
    port: u16,
    /// `host[:port]` for the Host header.
    authority: String,
    path: String,
    /// TLS settings; `None` for `http://` (loopback only).
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
}

impl JwksSource {
    /// A path, or an `https://` URL (trusting `ca` instead of the platform's roots when
    /// given), or an `http://` URL to a loopback address.
    pub fn parse(text: &str, ca: Option<&Path>) -> Result<JwksSource, String> {
        if !text.contains("://") {
            return Ok(JwksSource::File(PathBuf::from(text)));
        }
        let uri: http::Uri = text.parse().map_err(|_| format!("{text:?} is not a URL"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("{text:?}: use https:// (or a file path)")),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{text:?} has no host"))?;
        if authority.as_str().contains('@') {
            return Err("a JWKS URL must not carry credentials".into());
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        if !https && !is_loopback(&host) {
            return Err(format!(
                "{text:?}: keys fetched over plain http could be replaced on the way; use \
                 https:// (http:// is accepted only for a loopback address)"
            ));
        }
        let tls = if https {
            let name = ServerName::try_from(host.clone())
                .map_err(|_| format!("{host:?} is not a valid TLS server name"))?;
            Some((tls_config(ca)?, name))
        } else {
            None
        };
        Ok(JwksSource::Url(JwksUrl {
            display: text.to_owned(),
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            authority: authority.as_str().to_owned(),
            host,
            path: uri
                .path_and_query()
                .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
            tls,
        }))
    }

    pub fn describe(&self) -> String {
        match self {
            JwksSource::File(path) => path.display().to_string(),
            JwksSource::Url(url) => url.display.clone(),
        }
    }

    /// Reads or fetches the JWKS and parses it.
    async fn load(&self) -> Result<KeySet, String> {
        let (bytes, allow_secrets) = match self {
            JwksSource::File(path) => (
                tokio::fs::read(path)
                    .await
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
                true,
            ),
            JwksSource::Url(url) => (fetch(url).await?, false),
        };
        let (set, skipped) = KeySet::parse_jwks(&bytes, allow_secrets)?;
        if set.keys.is_empty() {
            return Err(format!(
                "the JWKS holds no usable signing key ({skipped} skipped)"
            ));
        }
        info!(
            jwks = %self.describe(),
            keys = set.len(),
            skipped,
            "JWKS loaded"
        );
        Ok(set)
    }
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The rustls client config for JWKS URLs: the given CA bundle, or the platform's
/// trust roots (read once per process).
fn tls_config(ca: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = match ca {
        Some(path) => Arc::new(mcpgw_certs::load_ca_bundle(path).map_err(|e| e.to_string())?),
        None => platform_roots()?,
    };
    let mut config = rustls::ClientConfig::builder_with_provider(mcpgw_certs::crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn platform_roots() -> Result<Arc<rustls::RootCertStore>, String> {
    static ROOTS: std::sync::OnceLock<Arc<rustls::RootCertStore>> = std::sync::OnceLock::new();
    if let Some(roots) = ROOTS.get() {
        return Ok(Arc::clone(roots));
    }
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(
            "no platform trust roots were found (install ca-certificates), or set jwks_ca to \
             the CA bundle that signed the JWKS server's certificate"
                .into(),
        );
    }
    Ok(Arc::clone(ROOTS.get_or_init(|| Arc::new(roots))))
}

/// One GET of the JWKS URL: connect, TLS, HTTP/1.1, a 200 with a bounded body.
async fn fetch(url: &JwksUrl) -> Result<Vec<u8>, String> {
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect((url.host.as_str(), url.port))
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        match &url.tls {
            Some((config, name)) => {
                let tls = tokio_rustls::TlsConnector::from(Arc::clone(config))
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS handshake failed: {e}"))?;
                get(TokioIo::new(tls), url).await
            }
            None => get(TokioIo::new(tcp), url).await,
        }
    };
    let result = tokio::time::timeout(FETCH_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {FETCH_TIMEOUT:?}"))?;
    result.map_err(|e| format!("fetching {}: {e}", url.display))
}

async fn get<T>(io: T, url: &JwksUrl) -> Result<Vec<u8>, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let request = http::Request::get(url.path.as_str())
        .header(HOST, url.authority.as_str())
        .header(ACCEPT, "application/json, application/jwk-set+json")
        .header(USER_AGENT, concat!("mcpgw/", env!("CARGO_PKG_VERSION")))
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    if response.status() != http::StatusCode::OK {
        return Err(format!("the server answered {}", response.status()));
    }
    let body = Limited::new(response.into_body(), MAX_JWKS_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the body: {e}"))?;
    Ok(body.to_bytes().to_vec())
}

/// A JWKS could not be loaded, so none of its keys can verify a token now. Its
/// location and the cause go to the log, never to a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeysUnavailable;

/// A JWKS and when to fetch it again.
pub struct Jwks {
    source: JwksSource,
    current: RwLock<Current>,
    /// Held while a load runs: one fetch at a time per JWKS (single flight).
    refresh: tokio::sync::Mutex<RefreshState>,
    /// A background refresh (for age) is running.
    refreshing: AtomicBool,
    /// An unknown `kid` refetches at most once per this interval.
    refresh_interval: Duration,
    /// Keys older than this are refetched in the background.
    max_age: Duration,
}

struct Current {
    keys: Arc<KeySet>,
    loaded: bool,
    /// When a background refresh is due (age, or a retry after a failed one).
    refresh_due: Instant,
}

#[derive(Default)]
struct RefreshState {
    last_unknown_kid_refresh: Option<Instant>,
    last_failed_load: Option<Instant>,
}

impl Jwks {
    pub fn new(source: JwksSource, refresh_interval: Duration, max_age: Duration) -> Arc<Jwks> {
        Arc::new(Jwks {
            source,
            current: RwLock::new(Current {
                keys: Arc::new(KeySet::default()),
                loaded: false,
                refresh_due: Instant::now(),
            }),
            refresh: tokio::sync::Mutex::new(RefreshState::default()),
            refreshing: AtomicBool::new(false),
            refresh_interval,
            max_age,
        })
    }

    pub fn describe(&self) -> String {
        self.source.describe()
    }

    /// The keys to verify with now: loaded on first use (a failed first load is tried
    /// again at most once per second, and logged with the JWKS's location and cause),
    /// refreshed in the background when old.
    pub async fn keys(self: &Arc<Self>) -> Result<Arc<KeySet>, KeysUnavailable> {
        let (keys, loaded, due) = {
            let current = self.current.read();
            (
                Arc::clone(&current.keys),
                current.loaded,
                current.refresh_due,
            )
        };
        if loaded {
            if Instant::now() >= due {
                self.refresh_in_background();
            }
            return Ok(keys);
        }
        let mut state = self.refresh.lock().await;
        if let Some(keys) = self.loaded_keys() {
            return Ok(keys);
        }
        if state
            .last_failed_load
            .is_some_and(|at| at.elapsed() < LOAD_RETRY)
        {
            return Err(KeysUnavailable);
        }
        match self.source.load().await {
            Ok(set) => Ok(self.store(set)),
            Err(why) => {
                warn!(jwks = %self.describe(), %why, "JWKS could not be loaded");
                state.last_failed_load = Some(Instant::now());
                Err(KeysUnavailable)
            }
        }
    }

    /// After a token named a key the set lacks: refetches, unless an unknown `kid`
    /// already did within the interval. Returns the new keys when they were fetched
    /// (or another request fetched the named key meanwhile).
    pub async fn refresh_for_unknown(self: &Arc<Self>, kid: Option<&str>) -> Option<Arc<KeySet>> {
        let mut state = self.refresh.lock().await;
        if let (Some(kid), Some(keys)) = (kid, self.loaded_keys())
            && keys.has_kid(kid)
        {
            return Some(keys);
        }
        if state
            .last_unknown_kid_refresh
            .is_some_and(|at| at.elapsed() < self.refresh_interval)
        {
            debug!(jwks = %self.describe(), "unknown kid; JWKS refreshed recently, not again");
            return None;
        }
        state.last_unknown_kid_refresh = Some(Instant::now());
        info!(jwks = %self.describe(), "a token names an unknown key; refetching the JWKS");
        match self.source.load().await {
            Ok(set) => Some(self.store(set)),
            Err(why) => {
                warn!(jwks = %self.describe(), %why, "JWKS refresh failed; keeping the keys we have");
                None
            }
        }
    }

    fn loaded_keys(&self) -> Option<Arc<KeySet>> {
        let current = self.current.read();
        current.loaded.then(|| Arc::clone(&current.keys))
    }

    fn store(&self, set: KeySet) -> Arc<KeySet> {
        let keys = Arc::new(set);
        let mut current = self.current.write();
        current.keys = Arc::clone(&keys);
        current.loaded = true;
        current.refresh_due = Instant::now() + self.max_age;
        keys
    }

    fn refresh_in_background(self: &Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let jwks = Arc::clone(self);
        tokio::spawn(async move {
            {
                let _single_flight = jwks.refresh.lock().await;
                if Instant::now() >= jwks.current.read().refresh_due {
                    match jwks.source.load().await {
                        Ok(set) => {
                            jwks.store(set);
                        }
                        Err(why) => {
                            warn!(jwks = %jwks.describe(), %why, "JWKS refresh failed; keeping the keys we have");
                            jwks.current.write().refresh_due =
                                Instant::now() + jwks.refresh_interval;
                        }
                    }
                }
            }
            jwks.refreshing.store(false, Ordering::Release);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwks_keys_get_their_algorithm_pinned_and_odd_ones_are_skipped() {
        let json = br#"{"keys":[
            {"kty":"EC","crv":"P-256","kid":"ec","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"},
            {"kty":"OKP","crv":"Ed25519","kid":"ed","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty":"RSA","kid":"enc","use":"enc","n":"AQAB","e":"AQAB"},
            {"kty":"oct","kid":"secret","k":"c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0"},
            {"kty":"EC","crv":"P-256","kid":"confused","alg":"HS256","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"},
            {"kty":"XYZ"}
        ]}"#;
        let (set, skipped) = KeySet::parse_jwks(json, false).unwrap();
        let algs: Vec<(Option<&str>, Algorithm)> =
            set.keys.iter().map(|k| (k.kid.as_deref(), k.alg)).collect();
        assert_eq!(
            algs,
            [
                (Some("ec"), Algorithm::ES256),
                (Some("ed"), Algorithm::EdDSA)
            ]
        );
        assert_eq!(
            skipped, 4,
            "encryption, network secret, confused alg, unknown type"
        );
        let (from_file, _) = KeySet::parse_jwks(json, true).unwrap();
        assert!(from_file.has_kid("secret"));
        assert!(KeySet::parse_jwks(b"[]", true).is_err());
    }

    #[test]
    fn jwks_urls_must_be_https_unless_loopback() {
        assert!(matches!(
            JwksSource::parse("/etc/keys.json", None),
            Ok(JwksSource::File(_))
        ));
        assert!(matches!(
            JwksSource::parse("http://127.0.0.1:9/jwks", None),
            Ok(JwksSource::Url(_))
        ));
        for refused in [
            "http://idp.example.com/jwks",
            "ftp://127.0.0.1/jwks",
            "https://user:pw@idp.example.com/jwks",
        ] {
            let err = JwksSource::parse(refused, None).err().unwrap_or_default();
            assert!(!err.is_empty(), "{refused}");
            assert!(!err.contains("pw"), "{err}");
        }
    }

    #[tokio::test]
    async fn unknown_kids_refetch_at_most_once_per_interval() {
        let dir = std::env::temp_dir().join(format!("mcpgw-jwks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("jwks.json");
        let key = |kid: &str| {
            format!(
                r#"{{"kty":"OKP","crv":"Ed25519","kid":"{kid}","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}}"#
            )
        };
        std::fs::write(&path, format!(r#"{{"keys":[{}]}}"#, key("one"))).unwrap();
        let jwks = Jwks::new(
            JwksSource::File(path.clone()),
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        );
        assert!(jwks.keys().await.unwrap().has_kid("one"));
        std::fs::write(
            &path,
            format!(r#"{{"keys":[{},{}]}}"#, key("one"), key("two")),
        )
        .unwrap();
        let refreshed = jwks.refresh_for_unknown(Some("two")).await.unwrap();
        assert!(refreshed.has_kid("two"));
        std::fs::write(
            &path,
            format!(r#"{{"keys":[{},{}]}}"#, key("two"), key("three")),
        )
        .unwrap();
        assert!(
            jwks.refresh_for_unknown(Some("three")).await.is_none(),
            "a second unknown kid within the interval does not refetch"
        );
        assert!(jwks.keys().await.unwrap().has_kid("one"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
