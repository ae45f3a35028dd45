//! Static API keys: bearer tokens listed in a file, each naming its principal.

use std::path::Path;

/// The keys of a tokens file.
#[derive(Debug, Clone)]
pub struct ApiKeys {
    /// (principal, token) pairs; never empty.
    keys: Vec<(String, Vec<u8>)>,
}

impl ApiKeys {
    /// Reads `principal:token` lines (blank lines and `#` comments skipped). Errors
    /// name the line, never the token.
    pub fn from_file(path: &Path) -> Result<ApiKeys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((principal, token)) = line.split_once(':') else {
                return Err(format!(
                    "{} line {}: expected principal:token",
                    path.display(),
                    n + 1
                ));
            };
            let (principal, token) = (principal.trim(), token.trim());
            if principal.is_empty() || token.len() < 16 {
                return Err(format!(
                    "{} line {}: needs a principal and a token of at least 16 characters",
                    path.display(),
                    n + 1
                ));
            }
            keys.push((principal.to_owned(), token.as_bytes().to_vec()));
        }
        if keys.is_empty() {
            return Err(format!("{} lists no tokens", path.display()));
        }
        Ok(ApiKeys { keys })
    }

    /// The principal whose key was presented.
    pub fn principal_of(&self, presented: &str) -> Option<&str> {
        // Every key is compared in full, so timing does not reveal which one (or how
        // much of one) matched.
        let mut found: Option<&str> = None;
        for (principal, token) in &self.keys {
            if constant_time_eq(token, presented.as_bytes()) {
                found = Some(principal);
            }
        }
        found
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_keys_map_to_principals_and_refuse_the_rest() {
        let dir = std::env::temp_dir().join(format!("mcpgw-apikeys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokens");
        std::fs::write(
            &file,
            "# keys\nalice: aaaaaaaaaaaaaaaaaaaa\nbob:bbbbbbbbbbbbbbbbbbbb\n",
        )
        .unwrap();
        let keys = ApiKeys::from_file(&file).unwrap();
        assert_eq!(keys.principal_of("aaaaaaaaaaaaaaaaaaaa"), Some("alice"));
        assert_eq!(keys.principal_of("bbbbbbbbbbbbbbbbbbbb"), Some("bob"));
        assert_eq!(keys.principal_of("aaaaaaaaaaaaaaaaaaab"), None);
        assert_eq!(keys.principal_of(""), None);
        std::fs::write(&file, "alice:short\n").unwrap();
        let err = ApiKeys::from_file(&file).unwrap_err();
        assert!(err.contains("line 1") && !err.contains("short"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
