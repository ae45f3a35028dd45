//! One-way digests of ids: SHA-256 over length-prefixed parts, lowercase hex, and
//! the short tag that names a session in log lines without giving its id away.
//! It imports nothing of the gateway, so the session registry, the stdio client and
//! adoption records can all use it.

/// A short, stable, one-way label of a session id for logs (8 hex digits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTag([u8; 4]);

impl std::fmt::Display for SessionTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

pub fn tag_of(session_id: &str) -> SessionTag {
    let digest = sha256(&[session_id.as_bytes()]);
    SessionTag([digest[0], digest[1], digest[2], digest[3]])
}

pub(crate) fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut context = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    for part in parts {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        context.update(&(part.len() as u64).to_be_bytes());
        context.update(part);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(context.finish().as_ref());
    out
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
