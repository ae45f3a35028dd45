//! Edge authentication with real processes: workers, Redis, the demo upstream (whose
//! `/stats` shows whether a refused request reached it), a JWKS served over HTTPS with
//! a test CA, tokens signed with keys made here, the official Python SDK as a client,
//! and the mesh spoken directly to prove what the owner checks.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use mcpgw_testkit::fleet::{MeshCerts, supervisor_flags};
use mcpgw_testkit::http::{self, Response};
use mcpgw_testkit::tls::TestCa;
use mcpgw_testkit::{Gateway, RedisServer, Upstream, python, python_script};
use serde_json::{Value, json};

const ISSUER: &str = "https://issuer.test";
const AUDIENCE: &str = "mcpgw-test";
const DEMO: &str = "/servers/demo/mcp";

// ---- keys and tokens ---------------------------------------------------------------

/// A signing key made for this test run, with its `kid` and algorithm.
struct SigningKey {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    /// The public key as PEM (for the HS256-with-the-public-key attack).
    public_pem: String,
    /// The raw Ed25519 public key (jsonwebtoken derives JWKs of RSA and EC keys only
    /// from PKCS#8 v1 Ed25519 keys, which aws-lc-rs does not sign with).
    ed_public: Option<Vec<u8>>,
}

impl SigningKey {
    fn generate(kid: &str, alg: Algorithm) -> SigningKey {
        let mut ed_public = None;
        let (encoding, public_pem) = match alg {
            Algorithm::RS256 | Algorithm::ES256 => {
                let rcgen_alg = if alg == Algorithm::RS256 {
                    &rcgen::PKCS_RSA_SHA256
                } else {
                    &rcgen::PKCS_ECDSA_P256_SHA256
                };
                let pair = rcgen::KeyPair::generate_for(rcgen_alg).expect("generate a key");
                let pem = pair.serialize_pem();
                let encoding = if alg == Algorithm::RS256 {
                    EncodingKey::from_rsa_pem(pem.as_bytes())
                } else {
                    EncodingKey::from_ec_pem(pem.as_bytes())
                };
                (encoding.expect("PEM private key"), pair.public_key_pem())
            }
            Algorithm::EdDSA => {
                // PKCS#8 v2 (with the public key), which aws-lc-rs signs with.
                let rng = aws_lc_rs::rand::SystemRandom::new();
                let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&rng)
                    .expect("generate an Ed25519 key");
                let pair = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
                    .expect("parse the Ed25519 key");
                ed_public = Some(
                    aws_lc_rs::signature::KeyPair::public_key(&pair)
                        .as_ref()
                        .to_vec(),
                );
                (EncodingKey::from_ed_der(pkcs8.as_ref()), String::new())
            }
            other => panic!("no key generation for {other:?}"),
        };
        SigningKey {
            kid: kid.into(),
            alg,
            encoding,
            public_pem,
            ed_public,
        }
    }

    fn jwk(&self) -> Jwk {
        if let Some(x) = &self.ed_public {
            let jwk = json!({"kty": "OKP", "crv": "Ed25519", "alg": "EdDSA",
                             "kid": self.kid, "x": base64url(x)});
            return serde_json::from_value(jwk).expect("Ed25519 JWK");
        }
        let mut jwk = Jwk::from_encoding_key(&self.encoding, self.alg).expect("JWK of a key");
        jwk.common.key_id = Some(self.kid.clone());
        jwk
    }

    fn sign(&self, claims: &Value) -> String {
        sign_with(&self.encoding, self.alg, Some(&self.kid), claims)
    }
}

fn sign_with(key: &EncodingKey, alg: Algorithm, kid: Option<&str>, claims: &Value) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_owned);
    jsonwebtoken::encode(&header, claims, key).expect("sign a token")
}

fn jwks_json(keys: &[&SigningKey]) -> String {
    serde_json::to_string(&JwkSet {
        keys: keys.iter().map(|k| k.jwk()).collect(),
    })
    .expect("JWKS JSON")
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

/// Claims for `sub` with `scope`, valid for `ttl` seconds from now.
fn claims(sub: &str, scope: &str, ttl: i64) -> Value {
    json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": sub, "scope": scope,
        "iat": now_secs(), "exp": now_secs() as i64 + ttl,
    })
}

fn b64(value: &Value) -> String {
    base64url(value.to_string().as_bytes())
}

/// base64url without padding, by hand: the test crate has no base64 dependency.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

// ---- a JWKS over HTTPS ---------------------------------------------------------------

/// A JWKS served over HTTPS by a certificate of a test CA, counting its hits.
struct JwksServer {
    url: String,
    /// Signs the server's certificate; its file is what the gateway's `jwks_ca` names.
    ca: TestCa,
    body: Arc<Mutex<String>>,
    /// While set, every fetch is answered 503: the issuer's endpoint is down.
    down: Arc<AtomicBool>,
    hits: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    addr: String,
}

impl JwksServer {
    fn start(body: String) -> JwksServer {
        let ca = TestCa::new("jwks");
        let (cert, key) = ca.issue("server");
        let tls = Arc::new(mcpgw_testkit::tls::server_config(&cert, &key, None));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind JWKS server");
        let addr = listener.local_addr().expect("addr").to_string();
        let body = Arc::new(Mutex::new(body));
        let down = Arc::new(AtomicBool::new(false));
        let hits = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (body, down, hits, stop) = (
                Arc::clone(&body),
                Arc::clone(&down),
                Arc::clone(&hits),
                Arc::clone(&stop),
            );
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let (tls, body, down, hits) = (
                        Arc::clone(&tls),
                        Arc::clone(&body),
                        Arc::clone(&down),
                        Arc::clone(&hits),
                    );
                    std::thread::spawn(move || serve_jwks(stream, tls, &body, &down, &hits));
                }
            });
        }
        JwksServer {
            url: format!("https://{addr}/jwks.json"),
            ca,
            body,
            down,
            hits,
            stop,
            addr,
        }
    }

    fn serve(&self, body: String) {
        *self.body.lock().expect("JWKS body") = body;
    }

    /// Answers every fetch 503 (`true`) or with the JWKS again (`false`).
    fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = std::net::TcpStream::connect(&self.addr);
    }
}

fn serve_jwks(
    stream: std::net::TcpStream,
    tls: Arc<rustls::ServerConfig>,
    body: &Mutex<String>,
    down: &AtomicBool,
    hits: &AtomicU64,
) {
    let Ok(connection) = rustls::ServerConnection::new(tls) else {
        return;
    };
    let mut tls = rustls::StreamOwned::new(connection, stream);
    let mut reader = BufReader::new(&mut tls);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) if line == "\r\n" => break,
            Ok(_) => {}
        }
    }
    hits.fetch_add(1, Ordering::SeqCst);
    let (status, body) = if down.load(Ordering::SeqCst) {
        ("503 Service Unavailable", String::new())
    } else {
        ("200 OK", body.lock().expect("JWKS body").clone())
    };
    let answer = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tls.write_all(answer.as_bytes());
    let _ = tls.flush();
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

// ---- processes and requests ----------------------------------------------------------

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mcpgw-auth-{name}-{}-{}",
        std::process::id(),
        mcpgw_testkit::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A shared HMAC secret of the suite (`kid = "hs-1"` where configured).
const HMAC_SECRET: &[u8] = b"a shared HMAC secret of 32+ bytes!!";

/// `dir/hs.secret`, holding [`HMAC_SECRET`].
fn hmac_secret_file(dir: &Path) -> PathBuf {
    let secret = dir.join("hs.secret");
    std::fs::write(&secret, HMAC_SECRET).expect("secret");
    secret
}

/// `dir/tokens`: the API key file naming alice's [`API_KEY_ALICE`].
fn tokens_file(dir: &Path) -> PathBuf {
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("alice:{API_KEY_ALICE}\n")).expect("tokens file");
    tokens
}

/// `dir/jwks.json`, a JWKS file of `keys`.
fn jwks_file(dir: &Path, keys: &[&SigningKey]) -> PathBuf {
    let file = dir.join("jwks.json");
    std::fs::write(&file, jwks_json(keys)).expect("JWKS file");
    file
}

/// `dir/mcpgw.toml`, holding `text`.
fn write_config(dir: &Path, text: &str) -> PathBuf {
    let config = dir.join("mcpgw.toml");
    std::fs::write(&config, text).expect("config");
    config
}

/// `mcpgw serve` whose stderr (every worker's log) goes to a file, so a test can
/// check that no token was logged.
struct LoggedGateway {
    process: std::process::Child,
    addr: String,
    log: PathBuf,
}

impl LoggedGateway {
    fn start(args: &[&str], log: PathBuf) -> LoggedGateway {
        let mut process = Command::new(mcpgw_testkit::bin("mcpgw"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "info,mcpgw=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start mcpgw");
        let stdout = process.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let addr = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| {
                    panic!(
                        "mcpgw did not start: {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    )
                });
            if let Some(url) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("http://"))
            {
                break url.trim_end_matches('/').to_owned();
            }
        };
        LoggedGateway { process, addr, log }
    }

    /// `mcpgw serve --config CONFIG`, logging to `dir/gateway.log`.
    fn with_config(config: &Path, dir: &Path) -> LoggedGateway {
        LoggedGateway::start(
            &["--config", &config.display().to_string()],
            dir.join("gateway.log"),
        )
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LoggedGateway {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

fn post(
    addr: &str,
    path: &str,
    token: Option<&str>,
    session: Option<&str>,
    body: &Value,
) -> Response {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let mut headers = http::mcp_headers(session);
    if session.is_none() {
        headers.retain(|(k, _)| *k != "MCP-Protocol-Version");
    }
    if let Some(bearer) = &bearer {
        headers.push(("Authorization", bearer));
    }
    http::request(addr, "POST", path, &headers, body.to_string().as_bytes())
}

fn initialize_body() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "mcpgw-auth-tests", "version": "0"}}})
}

/// Opens a legacy session with `token`; panics with the answer if refused.
fn open_session(addr: &str, path: &str, token: Option<&str>) -> String {
    let response = post(addr, path, token, None, &initialize_body());
    assert_eq!(response.status, 200, "initialize: {}", body_text(&response));
    let session = response
        .header("mcp-session-id")
        .expect("session id")
        .to_owned();
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let ack = post(addr, path, token, Some(&session), &note);
    assert_eq!(ack.status, 202, "initialized: {}", body_text(&ack));
    session
}

fn call(addr: &str, path: &str, token: Option<&str>, session: &str, tool: &str) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                      "params": {"name": tool, "arguments": {"text": "hi"}}});
    post(addr, path, token, Some(session), &body)
}

fn body_text(response: &Response) -> String {
    String::from_utf8_lossy(&response.body).into_owned()
}

/// Asserts a refusal: status, `data.reason` (and `data.problem`), and that the body
/// does not echo the token.
fn assert_refused(
    response: &Response,
    status: u16,
    reason: &str,
    problem: Option<&str>,
    token: &str,
    case: &str,
) {
    let text = body_text(response);
    assert_eq!(response.status, status, "{case}: {text}");
    let body = response.json();
    assert_eq!(body["jsonrpc"], "2.0", "{case}: a JSON-RPC error body");
    assert_eq!(body["error"]["data"]["reason"], reason, "{case}: {text}");
    if let Some(problem) = problem {
        assert_eq!(body["error"]["data"]["problem"], problem, "{case}: {text}");
    }
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.len() > 20),
        "{case}: the message says what to do: {text}"
    );
    if !token.is_empty() {
        assert!(!text.contains(token), "{case}: the body echoes the token");
        let signature = token.rsplit('.').next().unwrap_or_default();
        assert!(
            signature.len() < 8 || !text.contains(signature),
            "{case}: the body echoes the signature"
        );
    }
}

fn tool_calls(upstream: &Upstream) -> u64 {
    upstream.stats()["tool_calls"].as_u64().expect("tool_calls")
}

fn requests(upstream: &Upstream) -> u64 {
    upstream.stats()["requests"].as_u64().expect("requests")
}

// ---- tests -----------------------------------------------------------------------------

/// Every kind of bad token gets its own 401/403 and body; none reaches the upstream;
/// good tokens of every algorithm work; challenges point at the resource metadata,
/// which is served; no token is logged.
#[test]
fn tokens_are_verified_and_refused_ones_never_reach_the_upstream() {
    let dir = temp_dir("tokens");
    let upstream = Upstream::start();
    let rsa = SigningKey::generate("rsa-1", Algorithm::RS256);
    let ec = SigningKey::generate("ec-1", Algorithm::ES256);
    let ed = SigningKey::generate("ed-1", Algorithm::EdDSA);
    let jwks = JwksServer::start(jwks_json(&[&rsa, &ec, &ed]));
    let secret = hmac_secret_file(&dir);
    let config = write_config(
        &dir,
        &format!(
            r#"
[[upstream]]
name = "demo"
url = "{upstream}"

[auth]
mode = "jwt"

[auth.jwt]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
jwks = "{jwks}"
jwks_ca = "{ca}"
leeway_secs = 30

[[auth.jwt.keys]]
kid = "hs-1"
alg = "HS256"
secret_file = "{secret}"

[auth.routes.demo]
scopes = ["mcp"]
tool_scopes = {{ counter_increment = ["mcp:write"] }}
"#,
            upstream = upstream.url,
            jwks = jwks.url,
            ca = jwks.ca.ca_file().display(),
            secret = secret.display(),
        ),
    );
    let gateway = LoggedGateway::with_config(&config, &dir);
    let addr = gateway.addr.as_str();

    // Valid tokens of each algorithm open sessions and call tools.
    let hs = EncodingKey::from_secret(HMAC_SECRET).expect("HMAC key");
    let mut good_tokens = Vec::new();
    for key in [&rsa, &ec, &ed] {
        good_tokens.push((
            format!("{:?}", key.alg),
            key.sign(&claims("alice", "mcp", 300)),
        ));
    }
    good_tokens.push((
        "HS256".into(),
        sign_with(
            &hs,
            Algorithm::HS256,
            Some("hs-1"),
            &claims("alice", "mcp", 300),
        ),
    ));
    for (alg, token) in &good_tokens {
        let session = open_session(addr, DEMO, Some(token));
        let echoed = call(addr, DEMO, Some(token), &session, "echo");
        assert_eq!(echoed.status, 200, "{alg}: {}", body_text(&echoed));
        assert_eq!(echoed.tool_text().as_deref(), Some("hi"), "{alg}");
    }
    let session = open_session(addr, DEMO, Some(&good_tokens[0].1));

    // The refusals: none of them may reach the upstream.
    let (requests_before, calls_before) = (requests(&upstream), tool_calls(&upstream));
    let other_rsa = SigningKey::generate("rsa-1", Algorithm::RS256);
    let mut wrong_issuer = claims("alice", "mcp", 300);
    wrong_issuer["iss"] = json!("https://evil.test");
    let mut wrong_audience = claims("alice", "mcp", 300);
    wrong_audience["aud"] = json!("some-other-api");
    let mut not_yet = claims("alice", "mcp", 600);
    not_yet["nbf"] = json!(now_secs() + 300);
    let none_token = format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT"})),
        b64(&claims("alice", "mcp", 300))
    );
    let confused = sign_with(
        &EncodingKey::from_secret(rsa.public_pem.as_bytes()).expect("HMAC key"),
        Algorithm::HS256,
        Some("rsa-1"),
        &claims("alice", "mcp", 300),
    );
    let cases: Vec<(&str, String, u16, &str, Option<&str>)> = vec![
        (
            "expired",
            rsa.sign(&claims("alice", "mcp", -120)),
            401,
            "invalid_token",
            Some("expired"),
        ),
        (
            "not yet valid",
            rsa.sign(&not_yet),
            401,
            "invalid_token",
            Some("not_yet_valid"),
        ),
        (
            "wrong issuer",
            rsa.sign(&wrong_issuer),
            401,
            "invalid_token",
            Some("wrong_issuer"),
        ),
        (
            "wrong audience",
            ec.sign(&wrong_audience),
            401,
            "invalid_token",
            Some("wrong_audience"),
        ),
        (
            "wrong signature",
            other_rsa.sign(&claims("alice", "mcp", 300)),
            401,
            "invalid_token",
            Some("bad_signature"),
        ),
        (
            "alg none",
            none_token,
            401,
            "invalid_token",
            Some("algorithm_refused"),
        ),
        (
            "HS256 with the RSA public key",
            confused,
            401,
            "invalid_token",
            Some("algorithm_mismatch"),
        ),
        (
            "missing scope",
            ed.sign(&claims("alice", "other", 300)),
            403,
            "insufficient_scope",
            None,
        ),
        (
            "garbage",
            "not-a-jwt".into(),
            401,
            "invalid_token",
            Some("malformed"),
        ),
    ];
    for (case, token, status, reason, problem) in &cases {
        for (what, response) in [
            (
                "initialize",
                post(addr, DEMO, Some(token), None, &initialize_body()),
            ),
            (
                "tools/call",
                call(addr, DEMO, Some(token), &session, "echo"),
            ),
        ] {
            let case = format!("{case} ({what})");
            assert_refused(&response, *status, reason, *problem, token, &case);
            let challenge = response
                .header("www-authenticate")
                .unwrap_or_else(|| panic!("{case}: a challenge"));
            let error = if *status == 403 {
                "insufficient_scope"
            } else {
                "invalid_token"
            };
            assert!(challenge.starts_with("Bearer "), "{case}: {challenge}");
            assert!(
                challenge.contains(&format!("error=\"{error}\"")),
                "{case}: {challenge}"
            );
            assert!(challenge.contains("scope=\"mcp\""), "{case}: {challenge}");
            assert!(
                challenge.contains(&format!(
                    "resource_metadata=\"http://{addr}/.well-known/oauth-protected-resource{DEMO}\""
                )),
                "{case}: {challenge}"
            );
        }
    }
    // A tool that needs more scope than the route: refused in a session of a token
    // that has the route's scope.
    let scoped = call(
        addr,
        DEMO,
        Some(&good_tokens[0].1),
        &session,
        "counter_increment",
    );
    assert_refused(
        &scoped,
        403,
        "insufficient_scope",
        None,
        &good_tokens[0].1,
        "tool scope",
    );
    assert_eq!(
        scoped.json()["error"]["data"]["missing_scopes"],
        json!(["mcp:write"])
    );
    assert!(
        scoped
            .header("www-authenticate")
            .unwrap_or_default()
            .contains("scope=\"mcp mcp:write\"")
    );
    // No token at all: a challenge without an error code (RFC 6750 §3.1).
    let anonymous = post(addr, DEMO, None, None, &initialize_body());
    assert_refused(&anonymous, 401, "missing_token", None, "", "no token");
    let challenge = anonymous.header("www-authenticate").unwrap_or_default();
    assert!(!challenge.contains("error="), "{challenge}");
    assert!(challenge.contains("resource_metadata="), "{challenge}");
    assert_eq!(
        (requests(&upstream), tool_calls(&upstream)),
        (requests_before, calls_before),
        "no refused request reached the upstream"
    );
    // A token with the tool's scope runs it.
    let writer = rsa.sign(&claims("alice", "mcp mcp:write", 300));
    let writer_session = open_session(addr, DEMO, Some(&writer));
    let counted = call(
        addr,
        DEMO,
        Some(&writer),
        &writer_session,
        "counter_increment",
    );
    assert_eq!(counted.status, 200, "{}", body_text(&counted));

    // The protected resource metadata the challenges point at (RFC 9728).
    let metadata = http::request(
        addr,
        "GET",
        &format!("/.well-known/oauth-protected-resource{DEMO}"),
        &[],
        b"",
    );
    assert_eq!(metadata.status, 200, "{}", body_text(&metadata));
    let document = metadata.json();
    assert_eq!(document["resource"], format!("http://{addr}{DEMO}"));
    assert_eq!(document["authorization_servers"], json!([ISSUER]));
    assert_eq!(document["scopes_supported"], json!(["mcp", "mcp:write"]));
    assert_eq!(document["bearer_methods_supported"], json!(["header"]));
    let nowhere = http::request(
        addr,
        "GET",
        "/.well-known/oauth-protected-resource/servers/nope/mcp",
        &[],
        b"",
    );
    assert_eq!(nowhere.status, 404);

    // Tokens appear in no log line.
    let log = gateway.log();
    assert!(log.contains("JWKS loaded"), "the log is captured: {log}");
    for token in good_tokens
        .iter()
        .map(|(_, t)| t)
        .chain(cases.iter().map(|c| &c.1))
    {
        let signature = token.rsplit('.').next().unwrap_or_default();
        assert!(!log.contains(token.as_str()), "a token was logged");
        assert!(
            signature.len() < 8 || !log.contains(signature),
            "a token signature was logged"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A token signed with a new key works after one JWKS refresh; tokens naming unknown
/// keys do not make the gateway refetch again within the interval.
#[test]
fn jwks_rotation_refreshes_once_and_unknown_kids_do_not_hammer() {
    let dir = temp_dir("rotation");
    let upstream = Upstream::start();
    let old = SigningKey::generate("2026-old", Algorithm::ES256);
    let new = SigningKey::generate("2026-new", Algorithm::RS256);
    let jwks = JwksServer::start(jwks_json(&[&old]));
    let config = write_config(
        &dir,
        &format!(
            "[[upstream]]\nname = \"demo\"\nurl = \"{}\"\n[auth]\nmode = \"jwt\"\n[auth.jwt]\n\
             issuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\njwks = \"{}\"\njwks_ca = \"{}\"\n\
             jwks_refresh_interval_ms = 3600000\n",
            upstream.url,
            jwks.url,
            jwks.ca.ca_file().display()
        ),
    );
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    let addr = gateway.addr.as_str();

    let old_token = old.sign(&claims("alice", "", 300));
    open_session(addr, DEMO, Some(&old_token));
    assert_eq!(jwks.hits(), 1, "the JWKS is fetched on first use");

    // The issuer rotates: the new key appears, a token signed with it arrives.
    jwks.serve(jwks_json(&[&old, &new]));
    let new_token = new.sign(&claims("alice", "", 300));
    open_session(addr, DEMO, Some(&new_token));
    assert_eq!(jwks.hits(), 2, "one refresh for the new kid");

    // Unknown kids: refused, and no further fetch within the interval.
    for i in 0..25 {
        let stranger = SigningKey::generate(&format!("made-up-{i}"), Algorithm::EdDSA);
        let response = post(
            addr,
            DEMO,
            Some(&stranger.sign(&claims("mallory", "", 300))),
            None,
            &initialize_body(),
        );
        assert_refused(
            &response,
            401,
            "invalid_token",
            Some("unknown_key"),
            "",
            "unknown kid",
        );
    }
    assert_eq!(
        jwks.hits(),
        2,
        "unknown kids do not hammer the JWKS endpoint"
    );
    open_session(addr, DEMO, Some(&old_token));
    open_session(addr, DEMO, Some(&new_token));
    assert_eq!(jwks.hits(), 2, "known keys are served from the cache");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two supervisors of two workers, one Redis; three routes on the same upstream, one
/// per mode. Fields drop in order: the gateways stop before Redis does.
struct AuthFleet {
    a: Gateway,
    b: Gateway,
    upstream: Upstream,
    certs: MeshCerts,
    redis: RedisServer,
    key: SigningKey,
    dir: PathBuf,
}

const API_KEY_ALICE: &str = "alice-api-key-0123456789";

impl AuthFleet {
    fn start(name: &str, rate_limit: &str) -> AuthFleet {
        let dir = temp_dir(name);
        let redis = RedisServer::start();
        let upstream = Upstream::start();
        let certs = MeshCerts::create(&["host-a", "host-b"]);
        let key = SigningKey::generate("fleet-1", Algorithm::ES256);
        let jwks_file = jwks_file(&dir, &[&key]);
        let tokens = tokens_file(&dir);
        let config = write_config(
            &dir,
            &format!(
                r#"
[[upstream]]
name = "open"
url = "{url}"
[[upstream]]
name = "keyed"
url = "{url}"
[[upstream]]
name = "jwt"
url = "{url}"

[auth]
tokens_file = "{tokens}"

[auth.jwt]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
jwks = "{jwks}"
leeway_secs = 0

[auth.routes.open]
mode = "public"
[auth.routes.keyed]
mode = "api-key"
[auth.routes.jwt]
mode = "jwt"
scopes = ["mcp"]
{rate_limit}
"#,
                url = upstream.url,
                tokens = tokens.display(),
                jwks = jwks_file.display(),
            ),
        );
        let start = |member: &str| {
            let mut args = supervisor_flags(&redis.url(), 2, "quic", &certs, member);
            args.extend(["--config".into(), config.display().to_string()]);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            Gateway::start(&refs)
        };
        let a = start("host-a");
        let b = start("host-b");
        AuthFleet {
            redis,
            upstream,
            certs,
            a,
            b,
            key,
            dir,
        }
    }

    fn jwt(&self, sub: &str, ttl: i64) -> String {
        self.key.sign(&claims(sub, "mcp", ttl))
    }

    /// Sends a tools/call for `session` straight to its owner over the mesh, as a
    /// member of the mesh would, with `auth`; returns the status.
    fn to_owner(&self, session: &str, auth: mcpgw_wire::AuthContext) -> u16 {
        let body = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                          "params": {"name": "echo", "arguments": {"text": "direct"}}});
        self.to_owner_with(session, auth, body.to_string().as_bytes())
    }

    /// [`AuthFleet::to_owner`] with a body of the test's choosing, byte for byte.
    fn to_owner_with(&self, session: &str, auth: mcpgw_wire::AuthContext, body: &[u8]) -> u16 {
        use mcpgw_mesh::transport::{MeshClient, MeshLimits, TransportKind};
        let owner = session.split_once('.').expect("owner hint").1.to_owned();
        let addr = self
            .redis
            .get(&format!("mcpgw:worker_addr:{owner}"))
            .expect("owner address");
        mcpgw_certs::install_crypto_provider();
        let tls = mcpgw_certs::client_config(&mcpgw_certs::MeshTlsFiles::in_dir(
            &self.certs.dir(),
            "host-b",
        ))
        .expect("mesh client config");
        let frame = mcpgw_wire::RequestFrame {
            request_id: 1,
            session_id: Some(session.into()),
            method: "POST".into(),
            path: format!("/servers/{}/mcp", auth.route),
            headers: vec![
                ("content-type".into(), "application/json".into()),
                (
                    "accept".into(),
                    "application/json, text/event-stream".into(),
                ),
                ("mcp-protocol-version".into(), "2025-11-25".into()),
                ("mcp-session-id".into(), session.into()),
            ],
            body: body.to_vec().into(),
            auth,
            deadline_ms: 10_000,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let client = MeshClient::new(
                TransportKind::Quic,
                tls,
                "auth-test",
                MeshLimits::default(),
                None,
            )
            .expect("mesh client");
            let response = tokio::time::timeout(
                Duration::from_secs(15),
                client.forward(&addr, &owner, frame),
            )
            .await
            .expect("the owner answers in time")
            .expect("the owner answers");
            response.head().status
        })
    }
}

impl Drop for AuthFleet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn jwt_context(sub: &str, expires_at_ms: Option<u64>) -> mcpgw_wire::AuthContext {
    mcpgw_wire::AuthContext {
        mode: mcpgw_wire::AuthMode::Jwt,
        subject: sub.into(),
        scopes: vec!["mcp".into()],
        expires_at_ms,
        route: "jwt".into(),
    }
}

/// Requests through the worker that does not own the session are forwarded and work
/// in every mode; a token expiring mid-session then stops working on every edge and
/// at the owner; another subject cannot use the session through any worker.
#[test]
fn forwarded_requests_carry_the_edge_decision_in_every_mode() {
    let fleet = AuthFleet::start("forwarding", "");
    let (a, b) = (fleet.a.addr.as_str(), fleet.b.addr.as_str());

    // Each mode: a session opened through host-a, used through host-b (never its owner).
    let alice_jwt = fleet.jwt("alice", 3600);
    for (route, token) in [
        ("open", None),
        ("keyed", Some(API_KEY_ALICE)),
        ("jwt", Some(alice_jwt.as_str())),
    ] {
        let path = format!("/servers/{route}/mcp");
        let session = open_session(a, &path, token);
        for _ in 0..3 {
            let response = call(b, &path, token, &session, "echo");
            assert_eq!(response.status, 200, "{route}: {}", body_text(&response));
            let (edge, owner) = (
                response.header("mcpgw-edge-worker").unwrap_or_default(),
                response.header("mcpgw-owner-worker").unwrap_or_default(),
            );
            assert!(
                !owner.is_empty() && edge != owner,
                "{route}: forwarded ({edge} → {owner})"
            );
        }
        if let Some(token) = token {
            // Without the credential the edge refuses; the owner never sees it.
            let refused = call(b, &path, None, &session, "echo");
            assert_eq!(refused.status, 401, "{route}: {}", body_text(&refused));
            let wrong = call(
                b,
                &path,
                Some("wrong-key-wrong-key-wrong-key"),
                &session,
                "echo",
            );
            assert_eq!(wrong.status, 401, "{route}: {}", body_text(&wrong));
            assert!(!body_text(&wrong).contains(token));
        }
    }

    // Another subject cannot use alice's session, through any worker, nor straight at
    // the owner over the mesh.
    let session = open_session(a, "/servers/jwt/mcp", Some(&alice_jwt));
    let bob = fleet.jwt("bob", 3600);
    let calls_before = tool_calls(&fleet.upstream);
    for edge in [a, b, a, b, a, b, a, b] {
        let response = call(edge, "/servers/jwt/mcp", Some(&bob), &session, "echo");
        assert_eq!(response.status, 404, "{}", body_text(&response));
        assert_eq!(
            response.json()["error"]["code"],
            -32001,
            "session not found"
        );
    }
    let far = now_secs() * 1000 + 3_600_000;
    assert_eq!(
        fleet.to_owner(&session, jwt_context("bob", Some(far))),
        404,
        "the owner checks the subject"
    );
    assert_eq!(
        tool_calls(&fleet.upstream),
        calls_before,
        "bob's calls never ran"
    );
    assert_eq!(
        fleet.to_owner(&session, jwt_context("alice", Some(far))),
        200,
        "alice's context is served"
    );
    // The owner parses as the edge does: a repeated key is refused there too, so a
    // mesh peer cannot slip past the edge's reading either.
    let calls_before = tool_calls(&fleet.upstream);
    let repeated = br#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"echo","name":"counter_increment","arguments":{}}}"#;
    assert_eq!(
        fleet.to_owner_with(&session, jwt_context("alice", Some(far)), repeated),
        400,
        "a repeated key at the owner"
    );
    assert_eq!(tool_calls(&fleet.upstream), calls_before, "it never ran");

    // The owner re-checks expiry: an expired context is refused even when an edge
    // forwarded it; a context for another route or mode is refused too.
    let past = now_secs() * 1000 - 1;
    assert_eq!(
        fleet.to_owner(&session, jwt_context("alice", Some(past))),
        401,
        "expired at the owner"
    );
    let mut public = jwt_context("alice", None);
    public.mode = mcpgw_wire::AuthMode::Public;
    assert_eq!(
        fleet.to_owner(&session, public),
        401,
        "a public context on a jwt route"
    );

    // A token that expires mid-session: works on every edge until its exp, then stops
    // on every edge (leeway 0 in this fleet).
    let ttl = 8;
    let short = fleet.jwt("carol", ttl);
    let exp = now_secs() + ttl as u64;
    let session = open_session(a, "/servers/jwt/mcp", Some(&short));
    for edge in [a, b] {
        let response = call(edge, "/servers/jwt/mcp", Some(&short), &session, "echo");
        assert_eq!(response.status, 200, "before exp: {}", body_text(&response));
    }
    while now_secs() <= exp {
        std::thread::sleep(Duration::from_millis(200));
    }
    let calls_before = tool_calls(&fleet.upstream);
    for edge in [a, b, a, b, a, b] {
        let response = call(edge, "/servers/jwt/mcp", Some(&short), &session, "echo");
        assert_refused(
            &response,
            401,
            "invalid_token",
            Some("expired"),
            &short,
            "after exp",
        );
    }
    assert_eq!(
        tool_calls(&fleet.upstream),
        calls_before,
        "expired calls never ran"
    );
}

/// The scope check reads the tool the upstream will run: a body naming the tool twice
/// (a parser that keeps the first and one that keeps the last would disagree) is
/// refused with 400 in both eras, as is a tools/call whose name cannot be read; none
/// of them reaches the upstream.
#[test]
fn a_repeated_key_cannot_talk_a_scope_check_around() {
    let dir = temp_dir("repeated-key");
    let upstream = Upstream::start();
    let key = SigningKey::generate("ec-1", Algorithm::ES256);
    let config = write_config(
        &dir,
        &format!(
            r#"
[[upstream]]
name = "demo"
url = "{upstream}"

[auth]
mode = "jwt"

[auth.jwt]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
jwks = "{jwks}"

[auth.routes.demo]
scopes = ["mcp"]
tool_scopes = {{ counter_increment = ["mcp:write"] }}
"#,
            upstream = upstream.url,
            jwks = jwks_file(&dir, &[&key]).display(),
        ),
    );
    let gateway = LoggedGateway::with_config(&config, &dir);
    let addr = gateway.addr.as_str();
    let token = key.sign(&claims("alice", "mcp", 300));
    let bearer = format!("Bearer {token}");
    let session = open_session(addr, DEMO, Some(&token));
    let plain = call(addr, DEMO, Some(&token), &session, "counter_increment");
    assert_refused(&plain, 403, "insufficient_scope", None, &token, "plain");

    let calls_before = tool_calls(&upstream);
    let bodies: [&[u8]; 4] = [
        br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"echo","name":"counter_increment","arguments":{}}}"#,
        br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"counter_increment","name":"echo","arguments":{}}}"#,
        br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"echo","arguments":{},"_meta":{"progressToken":1,"progressToken":2}}}"#,
        br#"{"jsonrpc":"2.0","id":7,"method":"ping","method":"tools/call","params":{"name":"counter_increment"}}"#,
    ];
    let mut legacy = http::mcp_headers(Some(&session));
    legacy.push(("Authorization", &bearer));
    let mut modern = http::modern_headers("tools/call", Some("counter_increment"));
    modern.push(("Authorization", &bearer));
    for (era, headers) in [("legacy", &legacy), ("2026-07-28", &modern)] {
        for body in bodies {
            let case = format!("{era}: {}", String::from_utf8_lossy(body));
            let response = http::request(addr, "POST", DEMO, headers, body);
            assert_eq!(response.status, 400, "{case}: {}", body_text(&response));
            let error = response.error().expect("a JSON-RPC error");
            assert_eq!(error["code"], -32600, "{case}");
            assert!(error["data"]["repeated_key"].is_string(), "{case}: {error}");
            assert!(!body_text(&response).contains(&token), "{case}");
        }
        let nameless = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":["counter_increment"]}}"#;
        let response = http::request(addr, "POST", DEMO, headers, nameless);
        assert_eq!(response.status, 400, "{era}: {}", body_text(&response));
        assert_eq!(response.error_code(), Some(-32602), "{era}");
    }
    assert_eq!(
        tool_calls(&upstream),
        calls_before,
        "no refused call reached the upstream"
    );
    assert!(!gateway.log().contains(&token), "the token is never logged");
}

/// N client requests scattered over four workers move the principal's rate-limit
/// counter by exactly N: the edge counts, the owner does not count again. Past the
/// burst, 429 with a `Retry-After` that is `data.retry_after_ms` in whole seconds.
/// Public requests have no principal: a public route serves more than the burst.
#[test]
fn rate_limit_counts_each_client_request_once_and_spares_public_routes() {
    // 0.01/s: no token comes back while the test runs, so the burst is all there is.
    let burst: u32 = 20;
    let fleet = AuthFleet::start(
        "ratelimit",
        &format!(
            "[auth.rate_limit]\nper_second = 0.01\nburst = {burst}\non_redis_error = \"closed\"\n"
        ),
    );
    let (a, b) = (fleet.a.addr.as_str(), fleet.b.addr.as_str());
    let token = fleet.jwt("dave", 3600);
    let session = open_session(a, "/servers/jwt/mcp", Some(&token));
    let key = &format!("mcpgw:ratelimit:jwt:{ISSUER:?}:dave");
    let counted = |fleet: &AuthFleet| -> u64 {
        fleet
            .redis
            .command(&["HGET", key, "requests"])
            .parse()
            .unwrap_or(0)
    };
    assert_eq!(
        counted(&fleet),
        2,
        "initialize and initialized counted once each"
    );
    let calls_before = tool_calls(&fleet.upstream);
    let n = 30;
    let (mut passed, mut limited) = (0u64, 0u64);
    for i in 0..n {
        let edge = if i % 2 == 0 { a } else { b };
        let response = call(edge, "/servers/jwt/mcp", Some(&token), &session, "echo");
        match response.status {
            200 => passed += 1,
            429 => {
                limited += 1;
                let text = body_text(&response);
                let data = &response.json()["error"]["data"];
                assert_eq!(data["reason"], "rate_limited", "{text}");
                let retry_after_ms = data["retry_after_ms"]
                    .as_u64()
                    .filter(|ms| *ms > 0)
                    .unwrap_or_else(|| panic!("data.retry_after_ms is a positive integer: {text}"));
                // One token takes 1 / 0.01 s = 100 s to come back; no wait is longer.
                assert!(
                    retry_after_ms <= 100_000,
                    "at most one token's refill time: {text}"
                );
                let retry_after: Option<u64> =
                    response.header("retry-after").and_then(|s| s.parse().ok());
                assert_eq!(
                    retry_after,
                    Some(retry_after_ms.div_ceil(1000).max(1)),
                    "Retry-After is data.retry_after_ms rounded up to seconds: {text}"
                );
            }
            other => panic!("unexpected {other}: {}", body_text(&response)),
        }
    }
    assert_eq!(counted(&fleet), 2 + n, "the counter moved by exactly N");
    assert_eq!(
        tool_calls(&fleet.upstream) - calls_before,
        passed,
        "what passed ran once"
    );
    // The burst of 20, less initialize and initialized; a token takes 100 s to come
    // back, far longer than the test.
    assert_eq!(
        (passed, limited),
        (u64::from(burst) - 2, n - (u64::from(burst) - 2)),
        "the burst of {burst} ran out: {passed} passed, {limited} limited"
    );
    // Another principal has its own bucket.
    let api = open_session(b, "/servers/keyed/mcp", Some(API_KEY_ALICE));
    assert_eq!(
        call(a, "/servers/keyed/mcp", Some(API_KEY_ALICE), &api, "echo").status,
        200
    );
    assert_eq!(
        fleet
            .redis
            .command(&["HGET", "mcpgw:ratelimit:api-key:alice", "requests"]),
        "3"
    );
    // The public route, under the same limit: more requests than the burst all run,
    // and no bucket is kept for them.
    let open = open_session(a, "/servers/open/mcp", None);
    let calls_before = tool_calls(&fleet.upstream);
    for i in 0..burst + 10 {
        let edge = if i % 2 == 0 { a } else { b };
        let response = call(edge, "/servers/open/mcp", None, &open, "echo");
        assert_eq!(
            response.status,
            200,
            "public request {i} of {}: {}",
            burst + 10,
            body_text(&response)
        );
    }
    assert_eq!(
        tool_calls(&fleet.upstream) - calls_before,
        u64::from(burst + 10),
        "every public call ran"
    );
    assert_eq!(
        fleet.redis.keys("mcpgw:ratelimit:public*"),
        Vec::<String>::new(),
        "no bucket for public requests"
    );
}

/// The official Python SDK client with a bearer token, in legacy and 2026-07-28 mode,
/// through a gateway started with the quick-start JWT flags; without a token, or with
/// one of a key the gateway does not trust, its first request gets the 401 that says
/// why, and nothing reaches the upstream.
#[test]
fn sdk_client_with_a_bearer_token_in_both_modes_and_refused_without_one() {
    let dir = temp_dir("sdk");
    let upstream = Upstream::start();
    let key = SigningKey::generate("sdk-1", Algorithm::RS256);
    let jwks_file = jwks_file(&dir, &[&key]);
    let gateway = Gateway::start(&[
        "--upstream",
        &format!("demo={}", upstream.url),
        "--jwt-jwks",
        &jwks_file.display().to_string(),
        "--jwt-issuer",
        ISSUER,
        "--jwt-audience",
        AUDIENCE,
    ]);
    let token = key.sign(&claims("sdk-user", "", 600));
    for mode in ["legacy", "2026-07-28"] {
        let output = Command::new(mcpgw_testkit::python())
            .arg(mcpgw_testkit::python_script("sdk_client.py"))
            .args([&gateway.url(), mode, "basic"])
            .env("MCPGW_BEARER_TOKEN", &token)
            .output()
            .expect("run sdk_client.py");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{mode}: {}\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let last: Value =
            serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("JSON line");
        assert_eq!(last["echo"], "hello through mcpgw", "{mode}");
    }
    // The same kid, another key: what a forged token looks like.
    let forger = SigningKey::generate("sdk-1", Algorithm::RS256);
    let forged = forger.sign(&claims("sdk-user", "", 600));
    let requests_before = requests(&upstream);
    for mode in ["legacy", "2026-07-28"] {
        for (case, token, reason, problem) in [
            ("no token", None, "missing_token", None),
            (
                "a forged token",
                Some(forged.as_str()),
                "invalid_token",
                Some("bad_signature"),
            ),
        ] {
            let case = format!("{mode}, {case}");
            let seen = sdk_refused_client(&gateway.url(), mode, token);
            assert_eq!(seen["completed"], false, "{case}: {seen}");
            let responses = seen["responses"].as_array().cloned().unwrap_or_default();
            assert!(
                !responses.is_empty() && responses.iter().all(|r| r["status"] == 401),
                "{case}: every answer the client got is 401: {seen}"
            );
            let challenge = responses[0]["www_authenticate"].as_str().unwrap_or("");
            assert!(
                challenge.starts_with("Bearer ") && challenge.contains("resource_metadata="),
                "{case}: {challenge}"
            );
            let error = &seen["error"];
            assert_eq!(error["type"], "MCPError", "{case}: {seen}");
            assert_eq!(error["data"]["reason"], reason, "{case}: {seen}");
            if let Some(problem) = problem {
                assert_eq!(error["data"]["problem"], problem, "{case}: {seen}");
                assert!(
                    !seen.to_string().contains(&forged),
                    "{case}: the token echoed"
                );
            }
        }
    }
    assert_eq!(
        requests(&upstream),
        requests_before,
        "no refused request reached the upstream"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `sdk_refused_client.py` (the SDK client, expected to be refused) and returns
/// what it saw: `completed`, every HTTP `responses` status, and the SDK's `error`.
fn sdk_refused_client(url: &str, mode: &str, token: Option<&str>) -> Value {
    let mut command = Command::new(mcpgw_testkit::python());
    command
        .arg(mcpgw_testkit::python_script("sdk_refused_client.py"))
        .args([url, mode]);
    match token {
        Some(token) => command.env("MCPGW_BEARER_TOKEN", token),
        None => command.env_remove("MCPGW_BEARER_TOKEN"),
    };
    let output = command.output().expect("run sdk_refused_client.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "sdk_refused_client.py {mode}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("sdk_refused_client.py printed no JSON line ({e}): {stdout}"))
}

/// A JWKS that cannot be loaded (its URL answers 503; its file is gone) makes every
/// token that needs it a 503 `keys_unavailable` with `Retry-After: 1`, not a 401: the
/// client is not told its token is bad. Nothing reaches the upstream. Once the keys
/// can be loaded again, the same token works.
#[test]
fn signing_keys_that_cannot_be_loaded_get_503_keys_unavailable() {
    let dir = temp_dir("keys-unavailable");
    let upstream = Upstream::start();
    let key = SigningKey::generate("kid-1", Algorithm::ES256);
    let jwks = JwksServer::start(jwks_json(&[&key]));
    jwks.set_down(true);
    let jwks_file = jwks_file(&dir, &[&key]);
    let config = write_config(
        &dir,
        &format!(
            r#"
[[upstream]]
name = "fetched"
url = "{url}"
[[upstream]]
name = "fromfile"
url = "{url}"

[auth]
mode = "jwt"

[auth.jwt]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
jwks = "{jwks}"
jwks_ca = "{ca}"

[auth.routes.fromfile]
jwks = "{file}"
"#,
            url = upstream.url,
            jwks = jwks.url,
            ca = jwks.ca.ca_file().display(),
            file = jwks_file.display(),
        ),
    );
    // The file is read at start (a bad one stops it); gone afterwards, it cannot be
    // loaded on first use.
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    let away = dir.join("jwks.json.away");
    std::fs::rename(&jwks_file, &away).expect("move the JWKS file away");
    let addr = gateway.addr.as_str();
    let token = key.sign(&claims("alice", "", 600));
    let requests_before = requests(&upstream);

    for (route, location) in [
        ("fetched", jwks.url.clone()),
        ("fromfile", jwks_file.display().to_string()),
    ] {
        let path = format!("/servers/{route}/mcp");
        let response = post(addr, &path, Some(&token), None, &initialize_body());
        assert_refused(&response, 503, "keys_unavailable", None, &token, route);
        assert_eq!(
            response.header("retry-after"),
            Some("1"),
            "{route}: {}",
            body_text(&response)
        );
        let message = response.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        println!(
            "{route}: the client is told {message:?} (names the key location: {})",
            message.contains(&location)
        );
    }
    assert!(jwks.hits() >= 1, "the gateway tried to fetch the JWKS URL");
    assert_eq!(
        requests(&upstream),
        requests_before,
        "no request reached the upstream"
    );

    // The issuer's endpoint and the file come back: a failed first load is tried again
    // (at most once a second), and the same token is served.
    jwks.set_down(false);
    std::fs::rename(&away, &jwks_file).expect("put the JWKS file back");
    for route in ["fetched", "fromfile"] {
        let path = format!("/servers/{route}/mcp");
        let started = std::time::Instant::now();
        mcpgw_testkit::eventually(Duration::from_secs(30), || {
            let response = post(addr, &path, Some(&token), None, &initialize_body());
            match response.status {
                200 => Ok(()),
                503 => Err(body_text(&response)),
                other => panic!(
                    "{route}: {other} while the keys load: {}",
                    body_text(&response)
                ),
            }
        });
        println!(
            "{route}: served {:?} after the keys came back",
            started.elapsed()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The rate limiter's Redis stops answering (paused, so connections hang instead of
/// closing): with `on_redis_error = "open"` (the default) requests pass and a warning
/// is logged; with `"closed"` they get 503 `rate_limit_unavailable` with
/// `Retry-After: 1` and never run. Either way, once Redis answers again, every request
/// is counted again.
#[test]
fn rate_limiter_without_redis_fails_open_or_closed_as_configured() {
    let upstream = Upstream::start();
    for setting in [None, Some("open"), Some("closed")] {
        let case = setting.unwrap_or("default");
        let closed = setting == Some("closed");
        let dir = temp_dir(&format!("limiter-{case}"));
        // The limiter's own Redis: pausing it leaves nothing else without Redis.
        let redis = RedisServer::start();
        let tokens = tokens_file(&dir);
        let config = write_config(
            &dir,
            &format!(
                "[[upstream]]\nname = \"demo\"\nurl = \"{}\"\n[auth]\ntokens_file = \"{}\"\n\
                 [auth.rate_limit]\nper_second = 1000.0\nburst = 1000\nredis_url = \"{}\"\n\
                 timeout_ms = 250\n{}",
                upstream.url,
                tokens.display(),
                redis.url(),
                setting.map_or(String::new(), |s| format!("on_redis_error = \"{s}\"\n")),
            ),
        );
        let gateway = LoggedGateway::with_config(&config, &dir);
        let addr = gateway.addr.as_str();
        let counted = || -> u64 {
            redis
                .command(&["HGET", "mcpgw:ratelimit:api-key:alice", "requests"])
                .parse()
                .unwrap_or(0)
        };
        let session = open_session(addr, DEMO, Some(API_KEY_ALICE));
        assert_eq!(
            counted(),
            2,
            "{case}: the limiter counts while Redis answers"
        );

        let paused = redis.pause();
        let calls_before = tool_calls(&upstream);
        // The first request waits for Redis until timeout_ms; the second comes while
        // the limiter leaves Redis alone. Both get the configured answer.
        for attempt in ["first", "second"] {
            let started = std::time::Instant::now();
            let response = call(addr, DEMO, Some(API_KEY_ALICE), &session, "echo");
            println!(
                "{case}, {attempt} request without Redis: {} after {:?}",
                response.status,
                started.elapsed()
            );
            let what = format!("{case}, {attempt} request without Redis");
            if closed {
                assert_refused(
                    &response,
                    503,
                    "rate_limit_unavailable",
                    None,
                    API_KEY_ALICE,
                    &what,
                );
                assert_eq!(response.header("retry-after"), Some("1"), "{what}");
                assert!(
                    !body_text(&response).contains(&redis.port.to_string()),
                    "{what}: the body names the limiter's Redis: {}",
                    body_text(&response)
                );
            } else {
                assert_eq!(response.status, 200, "{what}: {}", body_text(&response));
                assert_eq!(response.tool_text().as_deref(), Some("hi"), "{what}");
            }
        }
        let ran = tool_calls(&upstream) - calls_before;
        assert_eq!(ran, if closed { 0 } else { 2 }, "{case}: calls that ran");
        let warning = if closed {
            "rate limiter unavailable; refusing the request (on_redis_error = closed)"
        } else {
            "rate limiter unavailable; letting the request through (on_redis_error = open)"
        };
        mcpgw_testkit::eventually(Duration::from_secs(10), || {
            if gateway.log().contains(warning) {
                Ok(())
            } else {
                Err(format!("no {warning:?} in the log yet"))
            }
        });

        // The metrics count what went uncounted, for the alert on a limiter failing open.
        let log = gateway.log();
        let admin = log
            .split("admin=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .expect("the worker's admin address in its log");
        let metrics = http::request(admin, "GET", "/metrics", &[], b"").text();
        let action = if closed { "refused" } else { "passed" };
        assert!(
            metrics.lines().any(
                |l| l == format!("mcpgw_rate_limit_unavailable_total{{action=\"{action}\"}} 2")
            ),
            "{case}: two requests {action} uncounted in the metrics"
        );

        // Redis answers again: after its back-off the limiter counts every request.
        paused.resume();
        mcpgw_testkit::eventually(Duration::from_secs(30), || {
            let before = counted();
            let response = call(addr, DEMO, Some(API_KEY_ALICE), &session, "echo");
            match (response.status, counted()) {
                (200, after) if after == before + 1 => Ok(()),
                (status, after) => Err(format!("{status}, counter {before} -> {after}")),
            }
        });
        let before = counted();
        let response = call(addr, DEMO, Some(API_KEY_ALICE), &session, "echo");
        assert_eq!(response.status, 200, "{case}: {}", body_text(&response));
        assert_eq!(counted(), before + 1, "{case}: counted once again");
        drop(gateway);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

// ---- keys belong to their route; nothing of the configuration to strangers -------------

/// Claims for `iss` and `aud` other than the suite's defaults.
fn claims_for(iss: &str, aud: &str, sub: &str, scope: &str) -> Value {
    json!({
        "iss": iss, "aud": aud, "sub": sub, "scope": scope,
        "iat": now_secs(), "exp": now_secs() + 300,
    })
}

/// A 2026-07-28 request of `token` for `tool` on `path`, with its `Mcp-Name`.
fn modern_call(addr: &str, path: &str, token: &str, tool: &str) -> Response {
    let bearer = format!("Bearer {token}");
    let mut headers = http::modern_headers("tools/call", Some(tool));
    headers.push(("Authorization", &bearer));
    let body = http::modern_body(7, "tools/call", json!({"name": tool, "arguments": {}}));
    http::request(addr, "POST", path, &headers, &body)
}

/// alice of one issuer is not alice of another. The virtual server `all` trusts
/// issuer A, its stateful member `st` (a stdio server keeping a counter per process,
/// so per session) trusts issuer B: alice@A may not reach alice@B's shared session of
/// `st` through `all` (501, named), and alice@B's counter starts at 1; the session
/// quota counts each alice apart.
#[test]
fn a_subject_is_a_principal_only_within_its_issuer() {
    let dir = temp_dir("issuers");
    let upstream = Upstream::start();
    let (a_secret, b_secret) = (
        b"issuer A's HMAC secret, 32 bytes or more".as_slice(),
        b"issuer B's HMAC secret, 32 bytes or more".as_slice(),
    );
    std::fs::write(dir.join("a.secret"), a_secret).expect("secret");
    std::fs::write(dir.join("b.secret"), b_secret).expect("secret");
    let b_iss = "https://issuer-b.test";
    let config = write_config(
        &dir,
        &format!(
            r#"
[limits]
max_sessions_per_principal = 2

[[upstream]]
name = "demo"
url = "{url}"

[[upstream]]
name = "st"
command = [{python:?}, {stateful:?}, "stdio"]

[[server]]
name = "all"
[[server.member]]
upstream = "st"

[auth]
mode = "jwt"

[auth.jwt]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
[[auth.jwt.keys]]
kid = "hs-a"
alg = "HS256"
secret_file = "{dir}/a.secret"

[auth.routes.st]
issuer = "{b_iss}"
audience = "{AUDIENCE}"
[[auth.routes.st.keys]]
kid = "hs-b"
alg = "HS256"
secret_file = "{dir}/b.secret"
"#,
            url = upstream.url,
            python = python().display().to_string(),
            stateful = python_script("stateful_server.py").display().to_string(),
            dir = dir.display(),
        ),
    );
    let gateway = LoggedGateway::with_config(&config, &dir);
    let addr = gateway.addr.as_str();
    let sign = |secret: &[u8], kid: &str, iss: &str| {
        let key = EncodingKey::from_secret(secret).expect("HMAC key");
        sign_with(
            &key,
            Algorithm::HS256,
            Some(kid),
            &claims_for(iss, AUDIENCE, "alice", "mcp"),
        )
    };
    let alice_a = sign(a_secret, "hs-a", ISSUER);
    let alice_b = sign(b_secret, "hs-b", b_iss);

    for _ in 0..2 {
        let through = modern_call(addr, "/servers/all/mcp", &alice_a, "st__counter_increment");
        assert_eq!(
            through.status,
            501,
            "alice@A through all: {}",
            through.text()
        );
        assert_eq!(through.reason().as_deref(), Some("virtual_server_protocol"));
        assert_eq!(through.error().expect("an error")["data"]["member"], "st");
    }
    let direct = modern_call(addr, "/servers/st/mcp", &alice_b, "counter_increment");
    assert_eq!(direct.status, 200, "alice@B on st: {}", direct.text());
    assert_eq!(
        direct.tool_text().as_deref(),
        Some("1"),
        "alice@B's shared session is her own, untouched by alice@A"
    );

    // The quota (2 per principal) counts alice@A's two sessions, and alice@B's shared
    // session and legacy session, apart.
    for _ in 0..2 {
        open_session(addr, DEMO, Some(&alice_a));
    }
    let third = post(addr, DEMO, Some(&alice_a), None, &initialize_body());
    assert_eq!(third.status, 429, "alice@A's third: {}", body_text(&third));
    open_session(addr, "/servers/st/mcp", Some(&alice_b));
}

/// Three jwt routes: `alpha` uses `[auth.jwt]` (its issuer and the HMAC key in
/// `[[auth.jwt.keys]]`), `beta` names its own issuer and JWKS, `gamma` its own issuer
/// and HMAC key. Whoever holds alpha's secret mints tokens with beta's and gamma's
/// `iss` and `aud` (and every scope): both refuse them, as they refuse gamma's kid with
/// alpha's secret, and none reaches the upstream; each route's own tokens work.
#[test]
fn a_static_key_is_trusted_only_by_the_routes_of_its_issuer() {
    let dir = temp_dir("bound-keys");
    let upstream = Upstream::start();
    let (alpha_secret, gamma_secret) = (
        b"alpha's HMAC secret, 32 bytes or more".as_slice(),
        b"gamma's HMAC secret, 32 bytes or more".as_slice(),
    );
    std::fs::write(dir.join("alpha.secret"), alpha_secret).expect("secret");
    std::fs::write(dir.join("gamma.secret"), gamma_secret).expect("secret");
    let beta_key = SigningKey::generate("beta-ec", Algorithm::ES256);
    std::fs::write(dir.join("beta-jwks.json"), jwks_json(&[&beta_key])).expect("JWKS");
    let (beta_iss, gamma_iss) = ("https://beta-issuer.test", "https://gamma-issuer.test");
    let config = write_config(
        &dir,
        &format!(
            r#"
[[upstream]]
name = "alpha"
url = "{url}"
[[upstream]]
name = "beta"
url = "{url}"
[[upstream]]
name = "gamma"
url = "{url}"

[auth]
mode = "jwt"

[auth.jwt]
issuer = "{ISSUER}"
audience = "aud-alpha"
[[auth.jwt.keys]]
kid = "hs-alpha"
alg = "HS256"
secret_file = "{dir}/alpha.secret"

[auth.routes.beta]
issuer = "{beta_iss}"
audience = "aud-beta"
jwks = "{dir}/beta-jwks.json"
tool_scopes = {{ counter_increment = ["mcp:write"] }}

[auth.routes.gamma]
issuer = "{gamma_iss}"
audience = "aud-gamma"
[[auth.routes.gamma.keys]]
kid = "hs-gamma"
alg = "HS256"
secret_file = "{dir}/gamma.secret"
"#,
            url = upstream.url,
            dir = dir.display(),
        ),
    );
    let gateway = LoggedGateway::with_config(&config, &dir);
    let addr = gateway.addr.as_str();
    let alpha_key = EncodingKey::from_secret(alpha_secret).expect("HMAC key");
    let gamma_key = EncodingKey::from_secret(gamma_secret).expect("HMAC key");
    let hs = |key: &EncodingKey, kid: &str, claims: &Value| {
        sign_with(key, Algorithm::HS256, Some(kid), claims)
    };

    let requests_before = requests(&upstream);
    let forged = [
        (
            "alpha's key, beta's iss and aud",
            "beta",
            hs(
                &alpha_key,
                "hs-alpha",
                &claims_for(beta_iss, "aud-beta", "mallory", "mcp:write"),
            ),
            "unknown_key",
        ),
        (
            "alpha's key, gamma's iss and aud",
            "gamma",
            hs(
                &alpha_key,
                "hs-alpha",
                &claims_for(gamma_iss, "aud-gamma", "mallory", "mcp:write"),
            ),
            "unknown_key",
        ),
        (
            "alpha's secret under gamma's kid",
            "gamma",
            hs(
                &alpha_key,
                "hs-gamma",
                &claims_for(gamma_iss, "aud-gamma", "mallory", "mcp:write"),
            ),
            "bad_signature",
        ),
    ];
    for (case, route, token, problem) in &forged {
        let path = format!("/servers/{route}/mcp");
        let response = post(addr, &path, Some(token), None, &initialize_body());
        assert_refused(&response, 401, "invalid_token", Some(problem), token, case);
    }
    assert_eq!(
        requests(&upstream),
        requests_before,
        "no forged token reached the upstream"
    );

    let own_tokens = [
        (
            "alpha",
            hs(
                &alpha_key,
                "hs-alpha",
                &claims_for(ISSUER, "aud-alpha", "alice", "mcp"),
            ),
        ),
        (
            "beta",
            beta_key.sign(&claims_for(beta_iss, "aud-beta", "alice", "mcp:write")),
        ),
        (
            "gamma",
            hs(
                &gamma_key,
                "hs-gamma",
                &claims_for(gamma_iss, "aud-gamma", "alice", "mcp"),
            ),
        ),
    ];
    for (route, token) in &own_tokens {
        let path = format!("/servers/{route}/mcp");
        let session = open_session(addr, &path, Some(token));
        let tool = if *route == "beta" {
            "counter_increment"
        } else {
            "echo"
        };
        let answer = call(addr, &path, Some(token), &session, tool);
        assert_eq!(answer.status, 200, "{route}: {}", body_text(&answer));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The 404 for an unknown path lists the routes only when every route is public: on
/// a gateway where some route needs a credential, a stranger learns no route name.
#[test]
fn the_not_found_of_an_auth_enabled_gateway_names_no_route() {
    let dir = temp_dir("not-found");
    let upstream = Upstream::start();
    let tokens = tokens_file(&dir);
    let config = write_config(
        &dir,
        &format!(
            "[[upstream]]\nname = \"open-route-x\"\nurl = \"{url}\"\n\
             [[upstream]]\nname = \"private-route-y\"\nurl = \"{url}\"\n\
             [auth]\ntokens_file = \"{tokens}\"\n\
             [auth.routes.open-route-x]\nmode = \"public\"\n",
            url = upstream.url,
            tokens = tokens.display(),
        ),
    );
    let gateway = Gateway::start(&["--config", &config.display().to_string()]);
    for path in ["/nope", "/servers/unknown/mcp", "/mcp"] {
        let response = post(&gateway.addr, path, None, None, &initialize_body());
        let text = body_text(&response);
        assert_eq!(response.status, 404, "{path}: {text}");
        assert_eq!(response.json()["error"]["code"], -32601, "{path}: {text}");
        for name in ["open-route-x", "private-route-y"] {
            assert!(!text.contains(name), "{path}: the 404 names {name}: {text}");
        }
        println!("{path}: {text}");
    }
    // The route the stranger was not told of still answers its own client.
    open_session(
        &gateway.addr,
        "/servers/private-route-y/mcp",
        Some(API_KEY_ALICE),
    );

    // Where every route is public, the 404 helps by naming them.
    let public = Gateway::start(&[
        "--upstream",
        &format!("open-route-x={}", upstream.url),
        "--upstream",
        &format!("open-route-z={}", upstream.url),
    ]);
    let response = post(&public.addr, "/nope", None, None, &initialize_body());
    let text = body_text(&response);
    assert_eq!(response.status, 404, "{text}");
    assert!(text.contains("open-route-x, open-route-z"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `keys_unavailable` (a JWKS URL that answers 503, a JWKS file gone after the start)
/// and `unknown_key` (a kid neither JWKS holds) tell the client that the keys could
/// not be loaded or the key is unknown, never where the keys live; the request's log
/// line names the location.
#[test]
fn key_problems_name_the_key_location_in_the_log_and_never_to_the_client() {
    let dir = temp_dir("key-location");
    let upstream = Upstream::start();
    let key = SigningKey::generate("kid-1", Algorithm::ES256);
    let down = JwksServer::start(jwks_json(&[&key]));
    down.set_down(true);
    let up = JwksServer::start(jwks_json(&[&key]));
    let gone_file = dir.join("gone-jwks.json");
    let kept_file = dir.join("kept-jwks.json");
    for file in [&gone_file, &kept_file] {
        std::fs::write(file, jwks_json(&[&key])).expect("JWKS file");
    }
    let mut config = format!(
        "[auth]\nmode = \"jwt\"\n[auth.jwt]\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\n\
         jwks_ca = \"{}\"\n",
        up.ca.ca_file().display()
    );
    let routes = [
        ("down", down.url.clone(), "keys_unavailable", 503),
        (
            "gone",
            gone_file.display().to_string(),
            "keys_unavailable",
            503,
        ),
        ("up", up.url.clone(), "invalid_token", 401),
        (
            "kept",
            kept_file.display().to_string(),
            "invalid_token",
            401,
        ),
    ];
    for (name, jwks, _, _) in &routes {
        config = format!(
            "[[upstream]]\nname = \"{name}\"\nurl = \"{}\"\n{config}\
             [auth.routes.{name}]\njwks = \"{jwks}\"\n",
            upstream.url
        );
    }
    // The down server has its own CA.
    config = config.replace(
        &format!("[auth.routes.down]\njwks = \"{}\"\n", down.url),
        &format!(
            "[auth.routes.down]\njwks = \"{}\"\njwks_ca = \"{}\"\n",
            down.url,
            down.ca.ca_file().display()
        ),
    );
    let config_file = write_config(&dir, &config);
    let gateway = LoggedGateway::with_config(&config_file, &dir);
    std::fs::remove_file(&gone_file).expect("remove the JWKS file after the start");
    let addr = gateway.addr.as_str();
    let known = key.sign(&claims("alice", "", 300));
    let unknown =
        SigningKey::generate("kid-nobody-has", Algorithm::ES256).sign(&claims("alice", "", 300));

    for (route, location, reason, status) in &routes {
        let (token, problem) = if *status == 503 {
            (&known, None)
        } else {
            (&unknown, Some("unknown_key"))
        };
        let path = format!("/servers/{route}/mcp");
        let response = post(addr, &path, Some(token), None, &initialize_body());
        assert_refused(&response, *status, reason, problem, token, route);
        let text = body_text(&response);
        println!("{route}: {text}");
        let host_port = location
            .strip_prefix("https://")
            .and_then(|rest| rest.split('/').next());
        for secret in [Some(location.as_str()), host_port]
            .into_iter()
            .flatten()
            .chain([dir.display().to_string().as_str()])
        {
            assert!(
                !text.contains(secret),
                "{route}: the client is told {secret:?}: {text}"
            );
        }
        mcpgw_testkit::eventually(Duration::from_secs(10), || {
            let log = gateway.log();
            let route_field = format!("route=\"{route}\"");
            match log
                .lines()
                .find(|l| l.contains(&route_field) && l.contains(reason) && l.contains(location))
            {
                Some(line) => {
                    println!("{route}: logged {line}");
                    Ok(())
                }
                None => Err(format!("no log line of route {route} names {location}")),
            }
        });
    }
    assert!(
        down.hits() >= 1,
        "the gateway tried the JWKS URL that is down"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An HMAC secret signs as well as it verifies: configured for two issuers (here the
/// same bytes in two files), either could mint the other's tokens, so the gateway
/// refuses to start and names both keys, never the secret. One secret per issuer
/// starts.
#[test]
fn an_hmac_secret_shared_between_issuers_refuses_to_start() {
    let dir = temp_dir("shared-secret");
    let secret = b"one HMAC secret for two issuers, 32+ bytes";
    std::fs::write(dir.join("alpha.secret"), secret).expect("secret");
    std::fs::write(dir.join("copy.secret"), secret).expect("secret");
    std::fs::write(
        dir.join("own.secret"),
        b"beta's own HMAC secret, 32 bytes or more",
    )
    .expect("secret");
    let config = |beta_secret: &str| {
        let path = dir.join(format!("mcpgw-{beta_secret}.toml"));
        std::fs::write(
            &path,
            format!(
                r#"
[[upstream]]
name = "alpha"
url = "http://127.0.0.1:1/mcp"
[[upstream]]
name = "beta"
url = "http://127.0.0.1:1/mcp"
[auth]
mode = "jwt"
[auth.jwt]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
[[auth.jwt.keys]]
alg = "HS256"
secret_file = "{dir}/alpha.secret"
[auth.routes.beta]
issuer = "https://beta-issuer.test"
[[auth.routes.beta.keys]]
alg = "HS256"
secret_file = "{dir}/{beta_secret}"
"#,
                dir = dir.display()
            ),
        )
        .expect("config");
        path.display().to_string()
    };
    // Spawned, not run to completion: a gateway that wrongly starts is killed at the
    // end of the wait instead of hanging the test.
    let refused_log = dir.join("refused.log");
    let mut command = Command::new(mcpgw_testkit::bin("mcpgw"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(config("copy.secret"));
    let mut refused = mcpgw_testkit::Child::from_command_with_stderr(
        "mcpgw (shared secret)",
        command,
        Stdio::from(std::fs::File::create(&refused_log).expect("log file")),
    )
    .expect("start mcpgw");
    let code = refused.wait_exit(Duration::from_secs(30));
    let stderr = std::fs::read_to_string(&refused_log).unwrap_or_default();
    assert_eq!(code, Some(2), "{stderr}");
    for named in [
        "auth.routes.beta.keys[0]",
        "auth.jwt.keys[0]",
        ISSUER,
        "https://beta-issuer.test",
    ] {
        assert!(
            stderr.contains(named),
            "the refusal names {named}: {stderr}"
        );
    }
    assert!(
        !stderr.contains("one HMAC secret"),
        "the refusal shows the secret: {stderr}"
    );
    println!("refused: {}", stderr.trim());
    let gateway = LoggedGateway::start(
        &["--config", &config("own.secret")],
        dir.join("gateway.log"),
    );
    let anonymous = post(
        &gateway.addr,
        "/servers/beta/mcp",
        None,
        None,
        &initialize_body(),
    );
    assert_refused(&anonymous, 401, "missing_token", None, "", "beta serves");
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `GET` stream held with a bearer token ends when the token expires, with an SSE
/// error event that says why: the credential is checked per request, and a held stream
/// is one request that would otherwise outlive it.
#[test]
fn a_held_stream_ends_at_its_tokens_expiry_with_an_error_event() {
    let dir = temp_dir("stream-expiry");
    let upstream = Upstream::start();
    let secret = hmac_secret_file(&dir);
    let config = write_config(
        &dir,
        &format!(
            "[[upstream]]\nname = \"demo\"\nurl = \"{}\"\n[auth]\nmode = \"jwt\"\n\
             [auth.jwt]\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\nleeway_secs = 0\n\
             [[auth.jwt.keys]]\nkid = \"hs-1\"\nalg = \"HS256\"\nsecret_file = \"{}\"\n",
            upstream.url,
            secret.display()
        ),
    );
    let gateway = LoggedGateway::with_config(&config, &dir);
    let addr = gateway.addr.as_str();
    let key = EncodingKey::from_secret(HMAC_SECRET).expect("HMAC key");
    let ttl = 4;
    let token_claims = claims("alice", "", ttl);
    let expires = token_claims["exp"].as_u64().expect("exp");
    let token = sign_with(&key, Algorithm::HS256, Some("hs-1"), &token_claims);
    let session = open_session(addr, DEMO, Some(&token));
    let bearer = format!("Bearer {token}");
    let started = std::time::Instant::now();
    let stream = http::request(
        addr,
        "GET",
        DEMO,
        &[
            ("Accept", "text/event-stream"),
            ("Mcp-Session-Id", &session),
            ("MCP-Protocol-Version", "2025-11-25"),
            ("Authorization", &bearer),
        ],
        b"",
    );
    println!("the stream ended after {:?}", started.elapsed());
    assert_eq!(stream.status, 200, "{}", body_text(&stream));
    let last = http::sse_data(&body_text(&stream))
        .last()
        .expect("an event before the end");
    let error: Value = serde_json::from_str(&last).expect("the last event is JSON-RPC");
    assert_eq!(error["error"]["data"]["reason"], "invalid_token", "{last}");
    assert_eq!(error["error"]["data"]["problem"], "expired", "{last}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("expired") && m.contains("open the stream again")),
        "{last}"
    );
    assert!(
        !body_text(&stream).contains(&token),
        "the token is never echoed"
    );
    // It ended because the token did, not before: the token was honoured until then.
    assert!(now_secs() + 1 >= expires, "ended before the token expired");
    let _ = std::fs::remove_dir_all(&dir);
}
