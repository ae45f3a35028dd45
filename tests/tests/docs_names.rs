//! The docs name code that exists: every `file.rs` the README and docs/ name is a file
//! of the repository, and every `module::item` docs/architecture.md names is defined in
//! that module of the gateway (or of the wire crate, as `mcpgw_wire::item`). A rename
//! that leaves the design document behind fails here.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    mcpgw_testkit::workspace_root()
}

/// Every `` `…` `` span of `text`.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Every file under `dir` (recursively) whose name ends in `.rs`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() && !path.ends_with("target") && !path.ends_with(".git") {
            found.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    found
}

fn docs() -> Vec<(String, String)> {
    let mut docs = vec![("README.md".to_owned(), root().join("README.md"))];
    for entry in std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .flatten()
    {
        let name = format!("docs/{}", entry.file_name().to_string_lossy());
        docs.push((name, entry.path()));
    }
    docs.into_iter()
        .map(|(name, path)| (name, std::fs::read_to_string(path).expect("read a doc")))
        .collect()
}

#[test]
fn every_rust_file_the_docs_name_exists() {
    let files: Vec<String> = rust_files(&root())
        .iter()
        .filter_map(|p| p.strip_prefix(root()).ok())
        .map(|p| p.display().to_string())
        .collect();
    let mut missing = Vec::new();
    for (doc, text) in docs() {
        for span in code_spans(&text) {
            let named = span.trim_end_matches(['.', ',', ')']);
            let is_path = named.ends_with(".rs")
                && named
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_/.-".contains(c));
            if is_path
                && !files
                    .iter()
                    .any(|f| f == named || f.ends_with(&format!("/{named}")))
            {
                missing.push(format!("{doc}: {named}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "files the docs name that do not exist: {missing:?}"
    );
}

/// Whether `source` defines `item` (a function, type, constant, module, or a method
/// of an impl in it).
fn defines(source: &str, item: &str) -> bool {
    [
        "fn ", "struct ", "enum ", "const ", "static ", "type ", "trait ", "mod ", "impl ",
    ]
    .iter()
    .any(|keyword| {
        source
            .match_indices(&format!("{keyword}{item}"))
            .any(|(at, _)| {
                let after = source[at + keyword.len() + item.len()..].chars().next();
                after.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'))
            })
    })
}

/// Whether `word` occurs in `source` as a whole identifier.
fn has_word(source: &str, word: &str) -> bool {
    let ident = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    source.match_indices(word).any(|(at, _)| {
        !ident(source[..at].chars().next_back()) && !ident(source[at + word.len()..].chars().next())
    })
}

/// The sources module path `path` (`dispatch`, `commands::status`) names in the
/// crate rooted at `src`: its file, or every file of its folder.
fn module_sources(src: &Path, path: &[&str]) -> Vec<PathBuf> {
    let joined: PathBuf = path.iter().collect();
    let file = src.join(&joined).with_extension("rs");
    let folder = src.join(&joined);
    let mut found = Vec::new();
    if file.is_file() {
        found.push(file);
    }
    if folder.is_dir() {
        found.extend(rust_files(&folder));
    }
    found
}

#[test]
fn every_module_item_the_architecture_names_is_defined_there() {
    let text =
        std::fs::read_to_string(root().join("docs/architecture.md")).expect("architecture.md");
    let mut missing = Vec::new();
    for span in code_spans(&text) {
        let Some((module, item)) = span.rsplit_once("::") else {
            continue;
        };
        let simple = |s: &str| {
            !s.is_empty()
                && s.split("::").all(|p| {
                    !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
        };
        if !simple(module) || !simple(item) {
            continue;
        }
        let segments: Vec<&str> = module.split("::").collect();
        if segments.len() == 1 && segments[0].starts_with(|c: char| c.is_ascii_uppercase()) {
            // `Type::member`: a method, field or variant, in a file that defines or
            // implements the type.
            let (ty, member) = (segments[0], item);
            let found = rust_files(&root()).iter().any(|path| {
                std::fs::read_to_string(path)
                    .is_ok_and(|source| defines(&source, ty) && has_word(&source, member))
            });
            if !found {
                missing.push(span.to_owned());
            }
            continue;
        }
        let sources = match segments[0] {
            // Other crates' items are theirs to name.
            "tokio" | "std" | "quinn" | "rustls" | "hyper" | "serde_json" => continue,
            "mcpgw_wire" => module_sources(&root().join("wire/src"), &[])
                .into_iter()
                .chain(rust_files(&root().join("wire/src")))
                .collect(),
            "mcpgw_mesh" => module_sources(&root().join("mesh/src"), &segments[1..]),
            _ => module_sources(&root().join("gateway/src"), &segments),
        };
        let found = sources
            .iter()
            .any(|path| std::fs::read_to_string(path).is_ok_and(|source| defines(&source, item)));
        if !found {
            missing.push(span.to_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "docs/architecture.md names items not defined where it says: {missing:?}"
    );
}
