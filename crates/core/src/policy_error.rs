//! Policy errors that name the field and the reason, for operators.

use serde::de::DeserializeOwned;
use std::fmt;

/// `field: reason`, e.g. `maxInflight: must be > 0, or -1 for pass-through; got 0`.
/// The field is a path (`classes.internal[0].sourceCidr`); `.` is the document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub field: String,
    pub reason: String,
}

impl PolicyError {
    pub fn new(field: &str, reason: String) -> Self {
        Self {
            field: field.to_string(),
            reason,
        }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for PolicyError {}

/// Deserializes `json`, reporting the path of whatever field failed.
pub fn parse_json<T: DeserializeOwned>(json: &[u8]) -> Result<T, PolicyError> {
    let mut deserializer = serde_json::Deserializer::from_slice(json);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() || inner.is_io() {
            PolicyError::new(".", format!("not valid JSON: {inner}"))
        } else {
            PolicyError::new(&field, inner.to_string())
        }
    })?;
    deserializer
        .end()
        .map_err(|e| PolicyError::new(".", format!("not valid JSON: {e}")))?;
    Ok(value)
}
