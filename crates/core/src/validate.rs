//! The toolkit every policy document is validated with: strict parsing
//! that names the failing field, bounds, header names, and warnings.
//!
//! A policy is parsed in two steps (`STYLE`: parse, then compile): serde
//! reads the document into plain structs with `deny_unknown_fields`, then
//! each policy compiles those into runtime values with the checks below.
//! Every number that flows into arithmetic is bounded here, so the
//! arithmetic downstream cannot overflow whatever the input.

use serde::de::DeserializeOwned;
use std::fmt;

/// `field: reason`, e.g. `heartbeatMs: must be between 100 and 60000; got 10`.
/// The field is a path (`classes.internal[0].sourceCidr`); `.` is the document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub field: String,
    pub reason: String,
}

impl PolicyError {
    pub fn new(field: &str, reason: impl Into<String>) -> Self {
        Self {
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for PolicyError {}

/// A value that is valid but probably not what the operator meant;
/// `stakegate check` and `deploy` print these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub field: String,
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Collects warnings while a policy compiles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Warnings(pub Vec<Warning>);

impl Warnings {
    pub fn when(&mut self, suspicious: bool, field: &str, message: impl FnOnce() -> String) {
        if suspicious {
            self.0.push(Warning {
                field: field.to_string(),
                message: message(),
            });
        }
    }
}

/// Deserializes `json`, reporting the path of whatever field failed.
///
/// The document must be an object, and arrays are accepted only at the
/// paths in `lists` (`stakes`, `classes.internal`; indices do not count):
/// serde would otherwise read `[8, 2]` as a struct, field by field in
/// declaration order, which nobody writes on purpose.
pub fn parse_json<T: DeserializeOwned>(json: &[u8], lists: &[&str]) -> Result<T, PolicyError> {
    let syntax = |e: serde_json::Error| PolicyError::new(".", format!("not valid JSON: {e}"));
    let value: serde_json::Value = serde_json::from_slice(json).map_err(syntax)?;
    if !value.is_object() {
        return Err(PolicyError::new(
            ".",
            format!("a policy is a JSON object; got {}", kind(&value)),
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(json);
    let typed = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let field = e.path().to_string();
        PolicyError::new(&field, e.into_inner().to_string())
    });
    // A misspelt field says most; then an array where an object belongs
    // (serde would call it a struct of the wrong length); then the rest.
    let stray = no_stray_lists(&value, &mut String::new(), &mut String::new(), lists);
    let parsed = match (typed, stray) {
        (Err(e), _) if e.reason.starts_with("unknown ") => return Err(e),
        (_, Err(e)) | (Err(e), Ok(())) => return Err(e),
        (Ok(parsed), Ok(())) => parsed,
    };
    Ok(parsed)
}

fn kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `path` is the field as errors name it, `shape` the same without indices.
fn no_stray_lists(
    value: &serde_json::Value,
    path: &mut String,
    shape: &mut String,
    lists: &[&str],
) -> Result<(), PolicyError> {
    match value {
        serde_json::Value::Object(members) => {
            for (name, member) in members {
                let (path_len, shape_len) = (path.len(), shape.len());
                for s in [&mut *path, &mut *shape] {
                    if !s.is_empty() {
                        s.push('.');
                    }
                    s.push_str(name);
                }
                no_stray_lists(member, path, shape, lists)?;
                path.truncate(path_len);
                shape.truncate(shape_len);
            }
        }
        serde_json::Value::Array(items) => {
            if !lists.contains(&shape.as_str()) {
                return Err(PolicyError::new(
                    path,
                    "is not a list; got an array (write the object or value itself)",
                ));
            }
            let shape_len = shape.len();
            shape.push_str("[]");
            for (i, item) in items.iter().enumerate() {
                let path_len = path.len();
                path.push_str(&format!("[{i}]"));
                no_stray_lists(item, path, shape, lists)?;
                path.truncate(path_len);
            }
            shape.truncate(shape_len);
        }
        _ => {}
    }
    Ok(())
}

/// A field of a policy document as the docs' tables list it: its name
/// (a path: `dedup.windowMs`) and its default, as JSON or as words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDoc {
    pub name: String,
    pub default: String,
}

/// Reads a policy's fields: each field's default and its check are given
/// in the one call that reads it, and while describing (`Fields::listing`)
/// every field read is listed with its default, which is how the docs
/// check (`stakegate docs --check`) knows the fields without a second list.
#[derive(Debug, Default)]
pub struct Fields {
    listed: Option<Vec<FieldDoc>>,
}

impl Fields {
    /// Fields that list what they read.
    pub fn listing() -> Self {
        Self {
            listed: Some(Vec::new()),
        }
    }

    /// What was read, in order (empty unless `listing`).
    pub fn listed(self) -> Vec<FieldDoc> {
        self.listed.unwrap_or_default()
    }

    fn list(&mut self, name: &str, default: impl FnOnce() -> String) {
        if let Some(listed) = &mut self.listed {
            if !listed.iter().any(|f| f.name == name) {
                listed.push(FieldDoc {
                    name: name.to_string(),
                    default: default(),
                });
            }
        }
    }

    /// A field with no default (serde has already required it).
    pub fn required<T>(&mut self, name: &str, value: T) -> T {
        self.list(name, || "required".into());
        value
    }

    /// `value`, or `default` when the document leaves it out.
    pub fn or<T: serde::Serialize>(&mut self, name: &str, value: Option<T>, default: T) -> T {
        self.list(name, || serde_json::to_string(&default).unwrap_or_default());
        value.unwrap_or(default)
    }

    /// `value`, or a default computed from other fields, which the docs
    /// give as `said`.
    pub fn or_else<T>(
        &mut self,
        name: &str,
        value: Option<T>,
        said: &str,
        default: impl FnOnce() -> T,
    ) -> T {
        self.list(name, || said.to_string());
        value.unwrap_or_else(default)
    }

    /// A number, `default` when left out, within `[min, max]`.
    pub fn range<T>(
        &mut self,
        name: &str,
        value: Option<T>,
        default: T,
        min: T,
        max: T,
    ) -> Result<T, PolicyError>
    where
        T: serde::Serialize + PartialOrd + fmt::Display + Copy,
    {
        let value = self.or(name, value, default);
        range(name, value, min, max)
    }

    /// A finite number, `default` when left out, within `[min, max]`.
    pub fn finite(
        &mut self,
        name: &str,
        value: Option<f64>,
        default: f64,
        min: f64,
        max: f64,
    ) -> Result<f64, PolicyError> {
        let value = self.or(name, value, default);
        finite_range(name, value, min, max)
    }
}

/// `Ok(())` when `ok`, else the error for `field`.
pub fn ensure(ok: bool, field: &str, reason: impl FnOnce() -> String) -> Result<(), PolicyError> {
    if ok {
        Ok(())
    } else {
        Err(PolicyError::new(field, reason()))
    }
}

/// `value` if it is in `[min, max]`.
pub fn range<T: PartialOrd + fmt::Display + Copy>(
    field: &str,
    value: T,
    min: T,
    max: T,
) -> Result<T, PolicyError> {
    ensure(min <= value && value <= max, field, || {
        format!("must be between {min} and {max}; got {value}")
    })?;
    Ok(value)
}

/// A finite `value` in `[min, max]` (NaN and infinities are refused).
pub fn finite_range(field: &str, value: f64, min: f64, max: f64) -> Result<f64, PolicyError> {
    ensure(
        value.is_finite() && min <= value && value <= max,
        field,
        || {
            format!(
                "must be between {} and {}; got {}",
                show(min),
                show(max),
                show(value)
            )
        },
    )?;
    Ok(value)
}

/// A float as an operator wrote it: `1e-300`, not three hundred zeros.
fn show(value: f64) -> String {
    if value != 0.0 && value.is_finite() && !(1e-4..1e15).contains(&value.abs()) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

/// `value` unless it is empty.
pub fn non_empty(field: &str, value: String) -> Result<String, PolicyError> {
    ensure(!value.is_empty(), field, || "must not be empty".to_string())?;
    Ok(value)
}

/// A header name as Envoy matches it: lower case, and an HTTP token
/// (RFC 9110 `tchar`), with no pseudo-header colon.
pub fn header_name(field: &str, name: String) -> Result<String, PolicyError> {
    let tchar =
        |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b);
    ensure(
        !name.is_empty() && name.len() <= 128 && name.bytes().all(tchar),
        field,
        || {
            format!("must be a lower-case HTTP header name (letters, digits, -, _ and the like); got {name:?}")
        },
    )?;
    Ok(name)
}

/// At most `max` entries in a list.
pub fn max_len<T>(field: &str, list: &[T], max: usize) -> Result<(), PolicyError> {
    ensure(list.len() <= max, field, || {
        format!("at most {max} entries; got {}", list.len())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[allow(dead_code)]
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        a: u32,
        #[serde(default)]
        inner: Option<Inner>,
        #[serde(default)]
        list: Vec<Inner>,
    }

    #[allow(dead_code)]
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        b: u32,
    }

    fn parse(json: &str) -> Result<Doc, String> {
        parse_json::<Doc>(json.as_bytes(), &["list"]).map_err(|e| e.to_string())
    }

    #[test]
    fn only_objects_where_structs_are_expected() {
        assert!(parse(r#"{"a": 1, "list": [{"b": 2}]}"#).is_ok());
        assert_eq!(
            parse("[1]").unwrap_err(),
            ".: a policy is a JSON object; got an array"
        );
        assert_eq!(
            parse(r#"{"a": 1, "inner": [2]}"#).unwrap_err(),
            "inner: is not a list; got an array (write the object or value itself)"
        );
        assert_eq!(
            parse(r#"{"a": 1, "list": [[2]]}"#).unwrap_err(),
            "list[0]: is not a list; got an array (write the object or value itself)"
        );
        assert_eq!(
            parse(r#"{"a": 1, "list": [{"b": 2}], "list2": 1}"#).unwrap_err(),
            "list2: unknown field `list2`, expected one of `a`, `inner`, `list` at line 1 column 36"
        );
        assert_eq!(
            parse("{").unwrap_err(),
            ".: not valid JSON: EOF while parsing an object at line 1 column 1"
        );
    }

    #[test]
    fn header_names_are_lower_case_tokens() {
        assert!(header_name("h", "x-api-key".into()).is_ok());
        for bad in ["", "X-Key", "x key", ":path", "x\u{e9}", "a\"b", "a,b"] {
            assert!(header_name("h", bad.into()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn ranges_name_their_bounds() {
        assert_eq!(
            range("n", 5u64, 1, 4).unwrap_err().to_string(),
            "n: must be between 1 and 4; got 5"
        );
        assert_eq!(
            finite_range("f", f64::NAN, 0.0, 1.0)
                .unwrap_err()
                .to_string(),
            "f: must be between 0 and 1; got NaN"
        );
        assert_eq!(finite_range("f", 0.5, 0.0, 1.0), Ok(0.5));
        assert_eq!(
            finite_range("f", 1e-300, 1.0, 1e7).unwrap_err().to_string(),
            "f: must be between 1 and 10000000; got 1e-300"
        );
    }
}
