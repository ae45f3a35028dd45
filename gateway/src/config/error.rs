//! Why a configuration is refused: the one error type of configuration, shared by
//! every section's checks (including the auth section's, in `auth/config.rs`).

/// A configuration value that cannot be used, named by its field.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {field}: {problem}")]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

pub(crate) fn invalid(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_owned(),
        problem: problem.into(),
    }
}
