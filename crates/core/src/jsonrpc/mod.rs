//! JSON-RPC as the filters read it: one streaming reader (`scan`) for HTTP
//! bodies and WebSocket messages alike, and what follows from a summary:
//! how many calls a body holds, which calls expect an answer, where each
//! call's `id` is, and a request's calls (`Request`: what the gate's
//! refusals answer and dedup keys). `canonical` writes a request in the one
//! form dedup compares.
//!
//! **What a node answers.** A call whose object has an `id` member (any
//! value, `null` included) is answered; one without is a notification,
//! executed and not answered. Which key is an `id` member depends on the
//! node (serde decodes escapes; Go also ignores case), so a call whose id
//! key is not written plainly (`"ID"`, `"\u0069d"`) is one the gateway
//! cannot be sure of: see `Call::id`. An object with `result` or `error`
//! and no `method` is a response; Go nodes ignore one, others answer it
//! with an error.

pub mod canonical;
pub mod scan;

pub use scan::{Entry, Name, Shape, Summary};

/// How many calls a body holds: a batch's entries, else 1 (an empty batch
/// is one invalid request, answered with one error; a body that is not
/// JSON is one call). A body that does not start with `[` is not scanned.
pub fn calls(body: &[u8]) -> u32 {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'[') {
        return 1;
    }
    let summary = Summary::of(body);
    u32::try_from(summary.entries.len())
        .unwrap_or(u32::MAX)
        .max(1)
}

/// How a call's `id` is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Id {
    /// No member any node reads as the id: a notification.
    Absent,
    /// Exactly one `"id"` member, written plainly: every node reads it.
    Plain(std::ops::Range<usize>),
    /// Id members some node reads and another may not (`"ID"`,
    /// `"\u0069d"`, or more than one): the last one's value.
    Unsure(std::ops::Range<usize>),
}

/// What one entry is, as a node treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An object with a method: a call or a notification.
    Call,
    /// An object with `result` or `error` and no method: a response to
    /// nothing the node asked.
    Response,
    /// Anything else (not an object, or an object with neither): the node
    /// answers it with an error.
    Invalid,
}

impl Entry {
    pub fn kind(&self) -> Kind {
        if !self.object {
            Kind::Invalid
        } else if self.has(Name::Method) {
            Kind::Call
        } else if self.has(Name::Result) || self.has(Name::Error) {
            Kind::Response
        } else {
            Kind::Invalid
        }
    }

    /// Its id, as the nodes would read it.
    pub fn id(&self) -> Id {
        let mut ids = self.named(Name::Id);
        match (ids.next(), ids.next()) {
            (None, _) => Id::Absent,
            (Some(only), None) if only.plain => Id::Plain(only.value.clone()),
            _ => match self.last(Name::Id) {
                Some(last) => Id::Unsure(last.value.clone()),
                None => Id::Absent,
            },
        }
    }
}

/// One call of a `Request`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call<'a> {
    /// Its method, a string written without escapes.
    pub method: &'a str,
    pub id: Id,
}

/// A request body every node reads the same way: one call, or a batch of
/// calls, each an object with exactly one `method` member, written plainly,
/// whose value is a string without escapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    pub body: &'a [u8],
    pub batch: bool,
    pub calls: Vec<Call<'a>>,
}

impl<'a> Request<'a> {
    /// Reads `body`; `None` if it is not such a request (not JSON, an empty
    /// batch, an entry that is not such a call).
    pub fn read(body: &'a [u8]) -> Option<Self> {
        let summary = Summary::of(body);
        let batch = match summary.shape {
            _ if !summary.valid => return None,
            Shape::Object => false,
            Shape::Array if !summary.entries.is_empty() => true,
            _ => return None,
        };
        let calls = summary
            .entries
            .iter()
            .map(|entry| {
                let mut methods = entry.named(Name::Method);
                let method = match (methods.next(), methods.next()) {
                    (Some(only), None) if only.plain && entry.object => only,
                    _ => return None,
                };
                let raw = body.get(method.value.clone())?;
                let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
                if inner.contains(&b'\\') {
                    return None;
                }
                Some(Call {
                    method: std::str::from_utf8(inner).ok()?,
                    id: entry.id(),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { body, batch, calls })
    }

    /// A call's id as written (the last one some node reads), if it has
    /// one.
    pub fn id(&self, call: &Call<'_>) -> Option<&'a [u8]> {
        match &call.id {
            Id::Plain(range) | Id::Unsure(range) => self.body.get(range.clone()),
            Id::Absent => None,
        }
    }
}

/// Whether every node writes this id (raw JSON) back byte for byte: an
/// integer of at most 15 digits (`-0` aside), or a string of printable
/// ASCII with no escape and none of `<`, `>`, `&` (which Go's encoder
/// escapes). A node that re-serialises ids turns `1e0` into `1.0`, a
/// 30-digit number into a float, `"\u0041"` into `"A"`; `null` is
/// echoed, but two calls with it cannot be told apart.
pub fn echoed_as_written(raw: &[u8]) -> bool {
    match raw {
        [b'"', inner @ .., b'"'] => inner
            .iter()
            .all(|&b| (0x20..0x7f).contains(&b) && !b"\\\"<>&".contains(&b)),
        [b'-', digits @ ..] => integer(digits) && digits != b"0",
        digits => integer(digits),
    }
}

/// Digits without a leading zero (but `0`), at most 15 of them.
fn integer(digits: &[u8]) -> bool {
    (1..=15).contains(&digits.len())
        && digits.iter().all(u8::is_ascii_digit)
        && (digits[0] != b'0' || digits.len() == 1)
}

/// Whether two ids, as raw JSON, are the same value: numbers compare as
/// numbers (`1`, `1.0` and `1e0` are one id, as a node that re-serialises
/// ids writes them), strings after their escapes are decoded. Ids no JSON
/// reader takes (`1e999`) compare byte for byte.
pub fn same_id(a: &[u8], b: &[u8]) -> bool {
    use serde_json::Value;
    let read = |raw: &[u8]| serde_json::from_slice::<Value>(raw).ok();
    match (read(a), read(b)) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x.as_f64() == y.as_f64(),
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
pub mod testing {
    use proptest::prelude::*;

    /// An id as a client could write it: `null`, numbers in several
    /// spellings, strings with escapes.
    pub fn id_spelling() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("null".to_string()),
            (0u32..1000).prop_map(|n| n.to_string()),
            (0u32..1000).prop_map(|n| format!("{n}e0")),
            (0u32..1000).prop_map(|n| format!("{n}.0")),
            (0u32..1000).prop_map(|n| format!("-{n}.5E-1")),
            Just("-0".to_string()),
            "[a-z]{0,4}".prop_map(|s| format!("\"{s}\"")),
            "[a-z]{1,3}".prop_map(|s| format!("\"\\u0041{s}\\\"\\n\"")),
            Just("123456789012345678901234567890".to_string()),
        ]
    }
}

#[cfg(test)]
mod tests;
