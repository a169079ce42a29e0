//! The admission gate's policy document: parsed strictly, then compiled into
//! validated runtime values. The format is documented in
//! `policies/admission-gate.md`.

use crate::dedup::policy::{DedupDoc, DedupPolicy};
use crate::gate::class::{Cidr, Matcher, MetadataScope};
use crate::gate::shards::Limits;
use crate::policy_error::{parse_json, PolicyError};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Document {
    max_inflight: i64,
    #[serde(default)]
    reserved: u32,
    #[serde(default = "unlimited")]
    max_websocket_connections: i64,
    #[serde(default = "default_heartbeat_ms")]
    heartbeat_ms: u64,
    #[serde(default = "default_stale_slot_ttl_ms")]
    stale_slot_ttl_ms: u64,
    #[serde(default = "default_retry_after_max_s")]
    retry_after_max_s: u32,
    #[serde(default)]
    classes: Classes,
    /// Retry-storm protection; absent means off.
    dedup: Option<DedupDoc>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Classes {
    #[serde(default)]
    internal: Vec<MatcherDoc>,
    #[serde(default)]
    priority: Vec<MatcherDoc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
enum MatcherDoc {
    ListenerMetadata(String),
    RouteMetadata(String),
    SourceCidr(String),
    UriSan(String),
    UriSanPrefix(String),
    StrippedHeader(HeaderDoc),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderDoc {
    name: String,
    value: String,
}

fn unlimited() -> i64 {
    -1
}

fn default_heartbeat_ms() -> u64 {
    1000
}

fn default_stale_slot_ttl_ms() -> u64 {
    10_000
}

fn default_retry_after_max_s() -> u32 {
    30
}

pub const MIN_HEARTBEAT_MS: u64 = 100;

/// The compiled policy.
#[derive(Debug, Clone, PartialEq)]
pub struct GatePolicy {
    pub limits: Limits,
    /// How often each worker refreshes its shard (the tick period).
    pub heartbeat_ms: u64,
    /// A shard not refreshed for this long is dropped with its slots.
    pub stale_slot_ttl_ms: u64,
    pub retry_after_max_s: u32,
    pub internal: Vec<Matcher>,
    pub priority: Vec<Matcher>,
    pub dedup: Option<DedupPolicy>,
}

impl GatePolicy {
    /// Parses and validates a policy document. Errors name the field.
    pub fn parse(json: &[u8]) -> Result<Self, PolicyError> {
        let doc: Document = parse_json(json)?;
        let max_inflight = match doc.max_inflight {
            -1 => None,
            n if n > 0 && n <= i64::from(u32::MAX) => Some(n as u32),
            n => {
                return Err(PolicyError::new(
                    "maxInflight",
                    format!("must be > 0, or -1 for pass-through; got {n}"),
                ))
            }
        };
        if let Some(max) = max_inflight {
            if doc.reserved >= max {
                return Err(PolicyError::new(
                    "reserved",
                    format!(
                        "must be less than maxInflight ({max}); got {}",
                        doc.reserved
                    ),
                ));
            }
        }
        let max_websocket = match doc.max_websocket_connections {
            -1 => None,
            n if (0..=i64::from(u32::MAX)).contains(&n) => Some(n as u32),
            n => {
                return Err(PolicyError::new(
                    "maxWebsocketConnections",
                    format!("must be >= 0, or -1 for unlimited; got {n}"),
                ))
            }
        };
        if doc.heartbeat_ms < MIN_HEARTBEAT_MS {
            return Err(PolicyError::new(
                "heartbeatMs",
                format!(
                    "must be at least {MIN_HEARTBEAT_MS}; got {}",
                    doc.heartbeat_ms
                ),
            ));
        }
        if doc.stale_slot_ttl_ms < 3 * doc.heartbeat_ms {
            return Err(PolicyError::new(
                "staleSlotTtlMs",
                format!(
                    "must be at least 3 heartbeats ({} ms), or live workers would lose their slots; got {}",
                    3 * doc.heartbeat_ms,
                    doc.stale_slot_ttl_ms
                ),
            ));
        }
        if doc.retry_after_max_s == 0 {
            return Err(PolicyError::new(
                "retryAfterMaxS",
                "must be at least 1".to_string(),
            ));
        }
        Ok(Self {
            limits: Limits {
                max_inflight,
                reserved: doc.reserved,
                max_websocket,
            },
            heartbeat_ms: doc.heartbeat_ms,
            stale_slot_ttl_ms: doc.stale_slot_ttl_ms,
            retry_after_max_s: doc.retry_after_max_s,
            internal: compile_matchers("classes.internal", doc.classes.internal)?,
            priority: compile_matchers("classes.priority", doc.classes.priority)?,
            dedup: doc.dedup.map(DedupPolicy::compile).transpose()?,
        })
    }
}

fn compile_matchers(path: &str, docs: Vec<MatcherDoc>) -> Result<Vec<Matcher>, PolicyError> {
    docs.into_iter()
        .enumerate()
        .map(|(i, doc)| {
            let field = |name: &str| format!("{path}[{i}].{name}");
            let non_empty = |name: &str, value: String| {
                if value.is_empty() {
                    Err(PolicyError::new(
                        &field(name),
                        "must not be empty".to_string(),
                    ))
                } else {
                    Ok(value)
                }
            };
            Ok(match doc {
                MatcherDoc::ListenerMetadata(v) => {
                    Matcher::Metadata(MetadataScope::Listener, non_empty("listenerMetadata", v)?)
                }
                MatcherDoc::RouteMetadata(v) => {
                    Matcher::Metadata(MetadataScope::Route, non_empty("routeMetadata", v)?)
                }
                MatcherDoc::SourceCidr(v) => Matcher::SourceCidr(
                    Cidr::parse(&v)
                        .map_err(|reason| PolicyError::new(&field("sourceCidr"), reason))?,
                ),
                MatcherDoc::UriSan(v) => Matcher::UriSan(non_empty("uriSan", v)?),
                MatcherDoc::UriSanPrefix(v) => Matcher::UriSanPrefix(non_empty("uriSanPrefix", v)?),
                MatcherDoc::StrippedHeader(h) => {
                    let name = non_empty("strippedHeader.name", h.name)?;
                    if name
                        .bytes()
                        .any(|b| b.is_ascii_uppercase() || b == b' ' || b == b':')
                    {
                        return Err(PolicyError::new(
                            &field("strippedHeader.name"),
                            format!("must be a lower-case header name; got {name:?}"),
                        ));
                    }
                    Matcher::StrippedHeader {
                        name,
                        value: h.value,
                    }
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(json: &str) -> String {
        GatePolicy::parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn a_minimal_policy_gets_the_defaults() {
        let policy = GatePolicy::parse(br#"{"maxInflight": 8}"#).unwrap();
        assert_eq!(
            policy,
            GatePolicy {
                limits: Limits {
                    max_inflight: Some(8),
                    reserved: 0,
                    max_websocket: None
                },
                heartbeat_ms: 1000,
                stale_slot_ttl_ms: 10_000,
                retry_after_max_s: 30,
                internal: vec![],
                priority: vec![],
                dedup: None,
            }
        );
    }

    #[test]
    fn minus_one_is_pass_through() {
        let policy = GatePolicy::parse(br#"{"maxInflight": -1, "reserved": 5}"#).unwrap();
        assert_eq!(policy.limits.max_inflight, None);
    }

    #[test]
    fn the_shipped_example_parses() {
        let example = include_str!("../../../../policies/admission-gate.example.json");
        let policy = GatePolicy::parse(example.as_bytes()).unwrap();
        assert_eq!(policy.limits.max_inflight, Some(8));
        assert!(!policy.internal.is_empty());
    }

    #[test]
    fn errors_name_the_field_and_the_reason() {
        assert_eq!(
            error(r#"{"maxInflight": 0}"#),
            "maxInflight: must be > 0, or -1 for pass-through; got 0"
        );
        assert_eq!(
            error(r#"{"maxInflight": -2}"#),
            "maxInflight: must be > 0, or -1 for pass-through; got -2"
        );
        assert_eq!(
            error(r#"{"maxInflight": 4, "reserved": 4}"#),
            "reserved: must be less than maxInflight (4); got 4"
        );
        assert_eq!(
            error(r#"{"maxInflight": 4, "maxWebsocketConnections": -3}"#),
            "maxWebsocketConnections: must be >= 0, or -1 for unlimited; got -3"
        );
        assert_eq!(
            error(r#"{"maxInflight": 4, "heartbeatMs": 10}"#),
            "heartbeatMs: must be at least 100; got 10"
        );
        assert_eq!(
            error(r#"{"maxInflight": 4, "heartbeatMs": 1000, "staleSlotTtlMs": 2000}"#),
            "staleSlotTtlMs: must be at least 3 heartbeats (3000 ms), or live workers would lose their slots; got 2000"
        );
        assert_eq!(
            error(r#"{"maxInflight": 4, "classes": {"internal": [{"sourceCidr": "10.0.0/8"}]}}"#),
            "classes.internal[0].sourceCidr: invalid address \"10.0.0\""
        );
        assert_eq!(
            error(r#"{"maxInflight": 4, "classes": {"priority": [{"uriSan": "a"}, {"strippedHeader": {"name": "X-Tier", "value": "gold"}}]}}"#),
            "classes.priority[1].strippedHeader.name: must be a lower-case header name; got \"X-Tier\""
        );
    }

    #[test]
    fn unknown_fields_are_denied_with_their_path() {
        let err = error(r#"{"maxInflight": 4, "maxInfligth": 5}"#);
        assert!(
            err.starts_with("maxInfligth: unknown field `maxInfligth`"),
            "{err}"
        );
        let err =
            error(r#"{"maxInflight": 4, "classes": {"internal": [{"sourceIp": "1.2.3.4"}]}}"#);
        assert!(
            err.starts_with("classes.internal[0]: unknown variant `sourceIp`"),
            "{err}"
        );
        let err = error(r#"{"maxInflight": 4, "classes": {"vip": []}}"#);
        assert!(err.starts_with("classes.vip: unknown field `vip`"), "{err}");
    }

    #[test]
    fn type_errors_and_bad_json_are_reported() {
        assert_eq!(
            error(r#"{"maxInflight": "8"}"#),
            "maxInflight: invalid type: string \"8\", expected i64 at line 1 column 19"
        );
        assert_eq!(
            error(r#"{}"#),
            ".: missing field `maxInflight` at line 1 column 2"
        );
        assert_eq!(
            error("{"),
            ".: not valid JSON: EOF while parsing an object at line 1 column 1"
        );
    }
}
