//! What a session needs to continue on another worker, and the key that keeps its
//! secret part from the directory's readers (docs/architecture.md, "Adoption").
//!
//! A session whose state lives in its HTTP upstream (the upstream's own session) can
//! outlive its worker: the claim at `initialize` records a [`SessionRecord`] beside the
//! owner record, and when the owner dies or drains, the next request on any worker
//! adopts the session from it. The upstream's session id is a credential at the
//! upstream, so with an adoption key it is sealed (AES-256-GCM, bound to the client's
//! session id) and only workers holding the key can read it. Who may adopt is the
//! session's *guard*, a hash of its route and principal: another principal's request
//! adopts nothing and learns nothing.
//!
//! A virtual server's session (format 2) records one [`MemberRecord`] per member: an
//! HTTP member's session id and protocol version, sealed and bound to the client's
//! session id and that member; a stdio member only as such, since its process dies
//! with its worker (the adopter marks it lost).

use std::path::Path;

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

use crate::digest;

/// Bytes of an adoption key.
const KEY_BYTES: usize = 32;

/// What a session was opened with, as far as another worker needs it to go on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// Format of this record, so a later release can read an older one.
    pub v: u32,
    /// The route (upstream name) it was opened on.
    pub route: String,
    /// The upstream's session id: `sealed:<key id>:<base64>` or `clear:<id>`; none when
    /// the upstream issued no session id.
    pub upstream_session: Option<String>,
    /// The protocol version and capabilities the client asked for in `initialize`.
    pub client_protocol_version: Option<String>,
    pub client_capabilities: Option<serde_json::Value>,
    /// A shared session's (2026-07-28 clients): the upstream's `initialize` result,
    /// which the gateway itself received and answers `server/discover` from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_init: Option<serde_json::Value>,
    /// A virtual server's session (format 2 only): its members as opened at
    /// `initialize`, in configuration order. `upstream_session` is then none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub members: Option<Vec<MemberRecord>>,
}

/// The format of a plain session's record. Still written as 1, so that workers of the
/// previous release, in a fleet half way through a rolling upgrade, adopt them.
const PLAIN_RECORD_VERSION: u32 = 1;
/// The format of a virtual server's record: 2, so that a release that knows only
/// format 1 (and would take the record for a plain HTTP session without an upstream
/// session id) refuses it instead ("session gone").
const FEDERATED_RECORD_VERSION: u32 = 2;

/// One member of a virtual server's session, as another worker needs it to go on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// The member's upstream, by its configured name (a server has each upstream once).
    pub upstream: String,
    /// How the member was reached; only an HTTP member's session can go on.
    pub transport: MemberTransport,
    /// An HTTP member's [`MemberSession`], sealed like a plain session's upstream id
    /// (`sealed:<key id>:<base64>` or `clear:<json>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// What the member announced at initialize (which lists it serves); not secret.
    #[serde(default)]
    pub capabilities: serde_json::Value,
}

/// How a member was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberTransport {
    Http,
    Stdio,
}

/// The secret part of an HTTP member's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSession {
    /// The member's `Mcp-Session-Id`, if it issued one.
    pub session_id: Option<String>,
    /// The protocol version it negotiated, sent on every exchange with it.
    pub protocol_version: String,
}

impl SessionRecord {
    pub fn to_payload(&self) -> String {
        // A record of strings and JSON values always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_payload(payload: &str) -> Result<SessionRecord, String> {
        let record: SessionRecord = serde_json::from_str(payload)
            .map_err(|e| format!("the session's record does not parse: {e}"))?;
        match (record.v, &record.members) {
            (PLAIN_RECORD_VERSION, None) | (FEDERATED_RECORD_VERSION, Some(_)) => Ok(record),
            (PLAIN_RECORD_VERSION | FEDERATED_RECORD_VERSION, _) => Err(format!(
                "the session's record has format {} with{} members, which no release writes",
                record.v,
                if record.members.is_some() { "" } else { "out" }
            )),
            (v, _) => Err(format!(
                "the session's record has format {v}, which this release does not read"
            )),
        }
    }

    /// The record of a virtual server's session: this one (its route and client
    /// side) with `members`.
    pub fn with_members(mut self, members: Vec<MemberRecord>) -> SessionRecord {
        self.v = FEDERATED_RECORD_VERSION;
        self.upstream_session = None;
        self.members = Some(members);
        self
    }
}

/// The record of one member of the session `session_id` (see [`MemberRecord`]);
/// `http`: its session, for an HTTP member (none: a stdio one).
pub fn member_record(
    session_id: &str,
    upstream: &str,
    http: Option<&MemberSession>,
    capabilities: &serde_json::Value,
    keys: &AdoptionKeys,
) -> Result<MemberRecord, String> {
    let (transport, session) = match http {
        Some(member) => {
            // Two strings always serialize.
            let secret = serde_json::to_string(member).unwrap_or_default();
            let sealed = keys.seal_with(&member_aad(session_id, upstream), &secret)?;
            (MemberTransport::Http, Some(sealed))
        }
        None => (MemberTransport::Stdio, None),
    };
    Ok(MemberRecord {
        upstream: upstream.to_owned(),
        transport,
        session,
        capabilities: capabilities.clone(),
    })
}

/// Builds the record of a session opened on `route` by an `initialize` whose params
/// are `params`, with the upstream session id `upstream_session` (sealed with `keys`).
pub fn record_for(
    route: &str,
    params: Option<&serde_json::Value>,
    upstream_session: Option<&str>,
    session_id: &str,
    keys: &AdoptionKeys,
) -> Result<SessionRecord, String> {
    let upstream_session = match upstream_session {
        Some(id) => Some(keys.seal(session_id, id)?),
        None => None,
    };
    Ok(SessionRecord {
        v: PLAIN_RECORD_VERSION,
        route: route.to_owned(),
        upstream_session,
        client_protocol_version: params
            .and_then(|p| p.get("protocolVersion"))
            .and_then(|v| v.as_str())
            .map(str::to_owned),
        client_capabilities: params.and_then(|p| p.get("capabilities")).cloned(),
        upstream_init: None,
        members: None,
    })
}

/// Who may adopt a session: a hash of its route and principal (the directory never
/// holds the principal itself; it may be a credential in some auth modes).
pub fn guard_of(route: &str, principal: &str) -> String {
    let digest = digest::sha256(&[
        b"mcpgw adoption guard v1",
        route.as_bytes(),
        principal.as_bytes(),
    ]);
    digest::hex(&digest[..16])
}

/// The fleet's adoption keys: the first seals, every one opens (so a key can be
/// rotated in before it seals, and out once no session it sealed is left). Without
/// any key, upstream session ids are recorded in the clear and the directory is
/// inside the trust boundary. With keys, a record in the clear is refused
/// ([`OpenError::NotSealed`]): it would let whoever can write to Redis hand this
/// worker an upstream session id of their choosing, past the seal.
#[derive(Default)]
pub struct AdoptionKeys {
    keys: Vec<(String, LessSafeKey)>,
}

impl std::fmt::Debug for AdoptionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|(id, _)| id.as_str()).collect();
        f.debug_struct("AdoptionKeys")
            .field("key_ids", &ids)
            .finish()
    }
}

impl AdoptionKeys {
    /// Reads a key file: one key per line, 64 hex digits; blank lines and `#` comments
    /// are skipped. The error names the line, never its content.
    pub fn load(path: &Path) -> Result<AdoptionKeys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the adoption key file {}: {e}", path.display()))?;
        let mut keys = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bytes = parse_hex_key(line).ok_or_else(|| {
                format!(
                    "adoption key file {} line {}: a key is {} hex digits (make one with \
                     `openssl rand -hex {KEY_BYTES}`)",
                    path.display(),
                    number + 1,
                    KEY_BYTES * 2
                )
            })?;
            keys.push(Self::key_of(&bytes)?);
        }
        if keys.is_empty() {
            return Err(format!("adoption key file {} holds no key", path.display()));
        }
        Ok(AdoptionKeys { keys })
    }

    fn key_of(bytes: &[u8; KEY_BYTES]) -> Result<(String, LessSafeKey), String> {
        let id = digest::hex(&digest::sha256(&[b"mcpgw adoption key id", bytes])[..4]);
        let key = UnboundKey::new(&AES_256_GCM, bytes)
            .map_err(|_| "the adoption key was refused by the cipher".to_owned())?;
        Ok((id, LessSafeKey::new(key)))
    }

    /// `secret` sealed for the session `session_id` with the first key.
    fn seal(&self, session_id: &str, secret: &str) -> Result<String, String> {
        self.seal_with(&aad(session_id), secret)
    }

    /// `secret` sealed with the first key, bound to `aad`.
    fn seal_with(&self, aad: &[u8], secret: &str) -> Result<String, String> {
        let Some((id, key)) = self.keys.first() else {
            return Ok(format!("clear:{secret}"));
        };
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| format!("no random bytes for a nonce: {e}"))?;
        let mut sealed = secret.as_bytes().to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad),
            &mut sealed,
        )
        .map_err(|_| "sealing the upstream session id failed".to_owned())?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        Ok(format!("sealed:{id}:{}", URL_SAFE_NO_PAD.encode(out)))
    }

    /// The upstream session id inside `recorded`, for the session `session_id`.
    pub fn open(&self, session_id: &str, recorded: &str) -> Result<String, OpenError> {
        self.open_with(&aad(session_id), recorded)
    }

    /// The session of member `upstream` of the session `session_id`, from its record.
    pub fn open_member(
        &self,
        session_id: &str,
        upstream: &str,
        recorded: &str,
    ) -> Result<MemberSession, OpenError> {
        let secret = self.open_with(&member_aad(session_id, upstream), recorded)?;
        serde_json::from_str(&secret).map_err(|_| OpenError::Malformed)
    }

    fn open_with(&self, aad: &[u8], recorded: &str) -> Result<String, OpenError> {
        if let Some(clear) = recorded.strip_prefix("clear:") {
            if !self.keys.is_empty() {
                return Err(OpenError::NotSealed);
            }
            return Ok(clear.to_owned());
        }
        let Some((id, sealed)) = recorded
            .strip_prefix("sealed:")
            .and_then(|rest| rest.split_once(':'))
        else {
            return Err(OpenError::Malformed);
        };
        let Some((_, key)) = self.keys.iter().find(|(known, _)| known == id) else {
            return Err(OpenError::UnknownKey(id.to_owned()));
        };
        let bytes = URL_SAFE_NO_PAD
            .decode(sealed)
            .map_err(|_| OpenError::Malformed)?;
        if bytes.len() < NONCE_LEN {
            return Err(OpenError::Malformed);
        }
        let (nonce, sealed) = bytes.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| OpenError::Malformed)?;
        let mut buffer = sealed.to_vec();
        let opened = key
            .open_in_place(nonce, Aad::from(aad), &mut buffer)
            .map_err(|_| OpenError::Malformed)?;
        String::from_utf8(opened.to_vec()).map_err(|_| OpenError::Malformed)
    }
}

/// Why a recorded upstream session id could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum OpenError {
    /// Sealed under a key this worker does not hold (rotated out too early, or the
    /// workers were given different key files).
    UnknownKey(String),
    /// Not a value a worker wrote for this session (or tampered with).
    Malformed,
    /// In the clear, while this worker holds keys: written by a worker without the key
    /// file, or by someone who can write to Redis.
    NotSealed,
}

impl OpenError {
    /// The `why` label of `mcpgw_adoptions_refused_total`.
    pub fn label(&self) -> &'static str {
        match self {
            OpenError::UnknownKey(_) => "key_unknown",
            OpenError::Malformed => "record_unreadable",
            OpenError::NotSealed => "record_not_sealed",
        }
    }
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::UnknownKey(id) => write!(
                f,
                "its upstream session id is sealed under adoption key {id}, which this \
                 worker does not hold"
            ),
            OpenError::Malformed => {
                f.write_str("its recorded upstream session id does not open for this session")
            }
            OpenError::NotSealed => f.write_str(
                "its recorded upstream session id is in the clear, but this worker has \
                 adoption keys and records are sealed wherever keys are configured: it was \
                 written by a worker without the key file or by someone who can write to \
                 Redis, so it is not trusted and the session is not adopted (give every \
                 worker the same --adoption-key-file)",
            ),
        }
    }
}

/// The sealed id is bound to its session: a record copied to another session's key
/// does not open there.
fn aad(session_id: &str) -> Vec<u8> {
    let mut aad = b"mcpgw upstream session v1\0".to_vec();
    aad.extend_from_slice(session_id.as_bytes());
    aad
}

/// A member's sealed session is bound to its client session and to the member: moved
/// to another session, or to another member of the same one, it does not open.
fn member_aad(session_id: &str, upstream: &str) -> Vec<u8> {
    let mut aad = b"mcpgw member session v1\0".to_vec();
    aad.extend_from_slice(session_id.as_bytes());
    aad.push(0);
    aad.extend_from_slice(upstream.as_bytes());
    aad
}

fn parse_hex_key(text: &str) -> Option<[u8; KEY_BYTES]> {
    if text.len() != KEY_BYTES * 2 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; KEY_BYTES];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[i * 2..i * 2 + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(lines: &str) -> AdoptionKeys {
        let dir = std::env::temp_dir().join(format!(
            "mcpgw-adoption-keys-{}-{}",
            std::process::id(),
            digest::hex(&digest::sha256(&[lines.as_bytes()])[..4])
        ));
        std::fs::write(&dir, lines).expect("write key file");
        let loaded = AdoptionKeys::load(&dir);
        let _ = std::fs::remove_file(&dir);
        loaded.expect("key file loads")
    }

    const K1: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const K2: &str = "ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn a_sealed_upstream_id_opens_only_for_its_session_and_never_shows() {
        let keys = keys(&format!("# fleet key\n{K1}\n"));
        let sealed = keys.seal("sid-1", "upstream-secret-id").expect("seals");
        assert!(!sealed.contains("upstream-secret-id"), "{sealed}");
        assert_eq!(
            keys.open("sid-1", &sealed).as_deref(),
            Ok("upstream-secret-id")
        );
        assert_eq!(keys.open("sid-2", &sealed), Err(OpenError::Malformed));
        let mut tampered = sealed.clone();
        tampered.pop();
        tampered.push(if sealed.ends_with('A') { 'B' } else { 'A' });
        assert_eq!(keys.open("sid-1", &tampered), Err(OpenError::Malformed));
    }

    #[test]
    fn a_rotated_in_key_opens_what_the_old_one_sealed_and_a_missing_key_is_named() {
        let old = keys(K1);
        let sealed = old.seal("sid", "u").expect("seals");
        let rotating = keys(&format!("{K2}\n{K1}\n"));
        assert_eq!(rotating.open("sid", &sealed).as_deref(), Ok("u"));
        let resealed = rotating.seal("sid", "u").expect("seals");
        match old.open("sid", &resealed) {
            Err(OpenError::UnknownKey(id)) => assert!(resealed.contains(&id)),
            other => panic!("expected an unknown key, got {other:?}"),
        }
    }

    #[test]
    fn without_a_key_the_id_is_kept_in_the_clear() {
        let none = AdoptionKeys::default();
        let recorded = none.seal("sid", "u-1").expect("clear");
        assert_eq!(recorded, "clear:u-1");
        assert_eq!(none.open("sid", &recorded).as_deref(), Ok("u-1"));
    }

    #[test]
    fn with_keys_a_record_in_the_clear_is_refused_and_says_why() {
        let keyed = keys(K1);
        let clear = AdoptionKeys::default()
            .seal("sid", "forged-upstream-id")
            .expect("clear");
        let refused = keyed.open("sid", &clear).expect_err("refused");
        assert_eq!(refused, OpenError::NotSealed);
        assert_eq!(refused.label(), "record_not_sealed");
        let why = refused.to_string();
        assert!(
            why.contains("in the clear") && why.contains("write to Redis"),
            "{why}"
        );
        assert!(!why.contains("forged-upstream-id"), "{why}");
        // A virtual server's member, likewise.
        let member = MemberSession {
            session_id: Some("forged".into()),
            protocol_version: "2025-06-18".into(),
        };
        let clear_member = member_record(
            "sid",
            "demo",
            Some(&member),
            &serde_json::json!({}),
            &AdoptionKeys::default(),
        )
        .expect("clear")
        .session
        .expect("an http member's session");
        assert_eq!(
            keyed.open_member("sid", "demo", &clear_member),
            Err(OpenError::NotSealed)
        );
        // What the keys sealed still opens.
        let sealed = keyed.seal("sid", "u").expect("seals");
        assert_eq!(keyed.open("sid", &sealed).as_deref(), Ok("u"));
    }

    #[test]
    fn a_bad_key_file_names_the_line_and_not_the_key() {
        let path = std::env::temp_dir().join(format!("mcpgw-bad-key-{}", std::process::id()));
        std::fs::write(&path, "# comment\nnot-a-key-secret\n").expect("write");
        let error = AdoptionKeys::load(&path).expect_err("refused");
        let _ = std::fs::remove_file(&path);
        assert!(error.contains("line 2"), "{error}");
        assert!(!error.contains("not-a-key-secret"), "{error}");
    }

    /// A record exactly as the release before virtual-server adoption wrote it.
    const V1_RECORD: &str = r#"{"v":1,"route":"demo","upstream_session":"clear:u-7","client_protocol_version":"2025-06-18","client_capabilities":{}}"#;

    #[test]
    fn a_format_1_record_still_reads_and_plain_records_are_still_written_as_1() {
        let old = SessionRecord::from_payload(V1_RECORD).expect("a v1 record reads");
        assert_eq!(old.upstream_session.as_deref(), Some("clear:u-7"));
        assert_eq!(old.members, None);
        let written =
            record_for("demo", None, Some("u"), "sid", &AdoptionKeys::default()).expect("record");
        assert_eq!(written.v, 1, "{}", written.to_payload());
        assert!(!written.to_payload().contains("members"));
    }

    #[test]
    fn a_virtual_servers_record_is_format_2_and_seals_each_member_for_its_session() {
        let keys = keys(K1);
        let demo = MemberSession {
            session_id: Some("demo-secret".into()),
            protocol_version: "2025-06-18".into(),
        };
        let caps = serde_json::json!({"tools": {}});
        let members = vec![
            member_record("sid", "demo", Some(&demo), &caps, &keys).expect("seals"),
            member_record("sid", "st", None, &caps, &keys).expect("stdio"),
        ];
        let record = record_for("all", None, None, "sid", &keys)
            .expect("record")
            .with_members(members);
        let payload = record.to_payload();
        assert!(!payload.contains("demo-secret"), "{payload}");
        let back = SessionRecord::from_payload(&payload).expect("a v2 record reads");
        assert_eq!(back.v, 2);
        let members = back.members.expect("members");
        assert_eq!(members[1].transport, MemberTransport::Stdio);
        assert_eq!(members[1].session, None);
        let sealed = members[0].session.as_deref().expect("sealed");
        assert_eq!(keys.open_member("sid", "demo", sealed), Ok(demo));
        assert_eq!(
            keys.open_member("sid", "st", sealed),
            Err(OpenError::Malformed),
            "bound to its member"
        );
        assert_eq!(
            keys.open_member("sid-2", "demo", sealed),
            Err(OpenError::Malformed),
            "bound to its session"
        );
        assert_eq!(keys.open("sid", sealed), Err(OpenError::Malformed));
    }

    #[test]
    fn records_of_unknown_or_mixed_formats_are_refused() {
        let v2_without_members = V1_RECORD.replace("\"v\":1", "\"v\":2");
        assert!(SessionRecord::from_payload(&v2_without_members).is_err());
        let v1_with_members = V1_RECORD.replace("}}", "},\"members\":[]}");
        assert!(SessionRecord::from_payload(&v1_with_members).is_err());
        let v3 = V1_RECORD.replace("\"v\":1", "\"v\":3");
        let error = SessionRecord::from_payload(&v3).expect_err("refused");
        assert!(error.contains("format 3"), "{error}");
    }

    #[test]
    fn records_round_trip_and_guards_differ_per_principal_and_route() {
        let record = record_for(
            "r",
            Some(&serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {"roots": {}}})),
            Some("u"),
            "sid",
            &AdoptionKeys::default(),
        )
        .expect("record");
        let back = SessionRecord::from_payload(&record.to_payload()).expect("parses");
        assert_eq!(back, record);
        assert_eq!(back.client_protocol_version.as_deref(), Some("2025-06-18"));
        assert_ne!(guard_of("r", "alice"), guard_of("r", "bob"));
        assert_ne!(guard_of("r", "alice"), guard_of("s", "alice"));
        assert_eq!(guard_of("r", "alice"), guard_of("r", "alice"));
    }
}
