//! The admission gate's policy document: parsed strictly, then compiled into
//! validated runtime values. The format is documented in
//! `policies/admission-gate.md`.

use crate::cache::policy::{CacheDoc, CachePolicy};
use crate::dedup::policy::{DedupDoc, DedupPolicy};
use crate::gate::class::Matcher;
use crate::gate::node_time::{NodeTimeDoc, NodeTimePolicy};
use crate::gate::shards::{Limits, SlotKind};
use crate::request::{Cidr, MetadataScope};
use crate::validate::{
    ensure, header_name, max_len, non_empty, parse_json, range, FieldDoc, Fields, PolicyError,
    Warning, Warnings,
};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Document {
    max_inflight: i64,
    #[serde(default)]
    reserved: Option<u32>,
    #[serde(default)]
    max_websocket_connections: Option<i64>,
    #[serde(default)]
    max_inflight_per_websocket: Option<u32>,
    #[serde(default)]
    max_websocket_message_bytes: Option<u64>,
    #[serde(default)]
    max_subscriptions_per_websocket: Option<u32>,
    #[serde(default)]
    max_subscriptions_per_identity: Option<u32>,
    #[serde(default)]
    max_held: Option<u32>,
    #[serde(default)]
    max_held_per_identity: Option<u32>,
    #[serde(default)]
    heartbeat_ms: Option<u64>,
    #[serde(default)]
    stale_slot_ttl_ms: Option<u64>,
    #[serde(default)]
    retry_after_max_s: Option<u32>,
    #[serde(default)]
    decide_on_body: Option<bool>,
    #[serde(default)]
    classes: Classes,
    /// Retry-storm protection; absent means off.
    dedup: Option<DedupDoc>,
    /// Node-time measuring, cheap slots and waiting; absent means off.
    node_time: Option<NodeTimeDoc>,
    /// The answer cache; absent means off.
    cache: Option<CacheDoc>,
}

/// The fields that are lists; an array anywhere else is refused.
const LISTS: &[&str] = &[
    "classes.internal",
    "classes.priority",
    "dedup.methods",
    "dedup.exclude",
    "dedup.globalMethods",
    "dedup.reuseMethods",
];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Classes {
    #[serde(default)]
    internal: Option<Vec<MatcherDoc>>,
    #[serde(default)]
    priority: Option<Vec<MatcherDoc>>,
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
    Staked(bool),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderDoc {
    name: String,
    value: String,
}

pub const DEFAULT_MAX_WEBSOCKET_CONNECTIONS: u32 = 1024;
/// Envoy's default buffer limit per connection.
pub const DEFAULT_MAX_WEBSOCKET_MESSAGE_BYTES: u64 = 1024 * 1024;
pub const MAX_WEBSOCKET_MESSAGE_BYTES: u64 = 64 * 1024 * 1024;
pub const MAX_LIMIT: u32 = 1_000_000;
pub const MIN_HEARTBEAT_MS: u64 = 100;
pub const MAX_HEARTBEAT_MS: u64 = 60_000;
pub const MAX_STALE_SLOT_TTL_MS: u64 = 3_600_000;
pub const MAX_RETRY_AFTER_S: u32 = 3600;
/// Matchers per class.
pub const MAX_MATCHERS: usize = 64;

/// The compiled policy.
#[derive(Debug, Clone, PartialEq)]
pub struct GatePolicy {
    pub limits: Limits,
    /// How often each worker refreshes its shard (the tick period).
    pub heartbeat_ms: u64,
    /// A shard not refreshed for this long is dropped with its slots.
    pub stale_slot_ttl_ms: u64,
    pub retry_after_max_s: u32,
    /// The longest WebSocket message the gate reads (each way); a longer
    /// one closes its socket.
    pub max_websocket_message_bytes: usize,
    /// Subscriptions one socket, and one identity on each worker, may have
    /// open (`websocket::subscriptions`).
    pub max_subscriptions_per_websocket: u32,
    pub max_subscriptions_per_identity: u32,
    /// Requests one worker, and one identity on it, may have held at the
    /// gateway (`gate::holds`).
    pub max_held: u32,
    pub max_held_per_identity: u32,
    /// Admit a request with a body once the body is whole, so that a
    /// refusal answers each call by its `id`. Needs a filter after the
    /// gate that holds the headers until then (envoy-config/gateway.yaml).
    pub decide_on_body: bool,
    pub internal: Vec<Matcher>,
    pub priority: Vec<Matcher>,
    pub dedup: Option<DedupPolicy>,
    /// The node's time on each request (`gate::node_time`).
    pub node_time: Option<NodeTimePolicy>,
    /// Answers that cannot change, served again (`cache`).
    pub cache: Option<CachePolicy>,
}

impl GatePolicy {
    /// Parses and validates a policy document. Errors name the field.
    pub fn parse(json: &[u8]) -> Result<Self, PolicyError> {
        Self::read(json, &mut Fields::default())
    }

    /// Every field, with its default, as the docs' tables list them.
    pub fn fields() -> Vec<FieldDoc> {
        let mut fields = Fields::listing();
        let all = br#"{"maxInflight": 8, "decideOnBody": true, "dedup": {}, "nodeTime": {}, "cache": {}}"#;
        Self::read(all, &mut fields).map_or_else(|_| Vec::new(), |_| fields.listed())
    }

    fn read(json: &[u8], f: &mut Fields) -> Result<Self, PolicyError> {
        let doc: Document = parse_json(json, LISTS)?;
        let mut limits = limits(&doc, f)?;
        let max_websocket_message_bytes = f.range(
            "maxWebsocketMessageBytes",
            doc.max_websocket_message_bytes,
            DEFAULT_MAX_WEBSOCKET_MESSAGE_BYTES,
            1024,
            MAX_WEBSOCKET_MESSAGE_BYTES,
        )?;
        let max_subscriptions_per_websocket = f.range(
            "maxSubscriptionsPerWebsocket",
            doc.max_subscriptions_per_websocket,
            1000,
            1,
            MAX_LIMIT,
        )?;
        let max_subscriptions_per_identity = f.range(
            "maxSubscriptionsPerIdentity",
            doc.max_subscriptions_per_identity,
            2000,
            1,
            MAX_LIMIT,
        )?;
        let max_held = f.range("maxHeld", doc.max_held, 4096, 1, MAX_LIMIT)?;
        let max_held_per_identity = f.range(
            "maxHeldPerIdentity",
            doc.max_held_per_identity,
            256,
            1,
            MAX_LIMIT,
        )?;
        let heartbeat_ms = f.range(
            "heartbeatMs",
            doc.heartbeat_ms,
            1000,
            MIN_HEARTBEAT_MS,
            MAX_HEARTBEAT_MS,
        )?;
        // heartbeat_ms is bounded, so three of them cannot overflow.
        let min_ttl = 3 * heartbeat_ms;
        let stale_slot_ttl_ms = f.or("staleSlotTtlMs", doc.stale_slot_ttl_ms, 10_000);
        ensure(stale_slot_ttl_ms >= min_ttl, "staleSlotTtlMs", || {
            format!(
                "must be at least 3 heartbeats ({min_ttl} ms), or live workers would lose their slots; got {stale_slot_ttl_ms}"
            )
        })?;
        let stale_slot_ttl_ms = range(
            "staleSlotTtlMs",
            stale_slot_ttl_ms,
            min_ttl,
            MAX_STALE_SLOT_TTL_MS,
        )?;
        // Client libraries that honour `retry-after` retry a few times
        // (viem: three) and give up: a few seconds each keeps their whole
        // wait within their own timeout (docs/clients.md).
        let retry_after_max_s = f.range(
            "retryAfterMaxS",
            doc.retry_after_max_s,
            3,
            1,
            MAX_RETRY_AFTER_S,
        )?;
        let decide_on_body = f.or("decideOnBody", doc.decide_on_body, false);
        let internal = f.or_else("classes.internal", doc.classes.internal, "[]", Vec::new);
        let priority = f.or_else("classes.priority", doc.classes.priority, "[]", Vec::new);
        let node_time = doc
            .node_time
            .map(|d| {
                let slots = limits.most(SlotKind::Default);
                NodeTimePolicy::compile(d, slots, limits.max_inflight, decide_on_body, f)
            })
            .transpose()?;
        limits.cheap = node_time.as_ref().map_or(0, |n| n.cheap_slots);
        ensure(doc.cache.is_none() || doc.dedup.is_some(), "cache", || {
            "needs the dedup section: the cache follows the node's finalized block through dedup.upstream, and shares coalescing's keys and ids".into()
        })?;
        let cache = doc.cache.map(|d| CachePolicy::compile(d, f)).transpose()?;
        Ok(Self {
            limits,
            heartbeat_ms,
            stale_slot_ttl_ms,
            retry_after_max_s,
            max_websocket_message_bytes: usize::try_from(max_websocket_message_bytes)
                .unwrap_or(usize::MAX),
            max_subscriptions_per_websocket,
            max_subscriptions_per_identity,
            max_held,
            max_held_per_identity,
            decide_on_body,
            internal: compile_matchers("classes.internal", internal)?,
            priority: compile_matchers("classes.priority", priority)?,
            dedup: doc.dedup.map(|d| DedupPolicy::compile(d, f)).transpose()?,
            node_time,
            cache,
        })
    }

    /// Values that are valid but probably a mistake.
    pub fn warnings(&self) -> Vec<Warning> {
        let mut w = Warnings::default();
        let limited = self.limits.max_inflight.is_some();
        w.when(limited && self.internal.is_empty(), "classes.internal", || {
            "no matcher: the node's own callers (block sync, the engine API) are refused with everyone else when the node is busy".into()
        });
        w.when(
            limited && !self.priority.is_empty() && self.limits.reserved == 0,
            "reserved",
            || {
                "0 while classes.priority has matchers: priority traffic has no slots of its own"
                    .into()
            },
        );
        w.when(
            self.limits.max_websocket.is_none(),
            "maxWebsocketConnections",
            || "-1: any number of WebSocket connections may be opened".into(),
        );
        w.when(self.stale_slot_ttl_ms > 60_000, "staleSlotTtlMs", || {
            format!(
                "{} ms: slots held by a worker that vanished stay counted for over a minute",
                self.stale_slot_ttl_ms
            )
        });
        w.when(self.retry_after_max_s > 120, "retryAfterMaxS", || {
            format!(
                "{} s: rejected clients may be told to wait over two minutes",
                self.retry_after_max_s
            )
        });
        if let Some(dedup) = &self.dedup {
            w.0.extend(dedup.warnings());
        }
        if let Some(cache) = &self.cache {
            w.0.extend(cache.warnings());
        }
        w.0
    }
}

/// The in-flight and WebSocket limits: `-1` turns a limit off.
fn limits(doc: &Document, f: &mut Fields) -> Result<Limits, PolicyError> {
    let max_inflight = match f.required("maxInflight", doc.max_inflight) {
        -1 => None,
        n => Some(
            u32::try_from(n)
                .ok()
                .filter(|n| (1..=MAX_LIMIT).contains(n))
                .ok_or_else(|| {
                    PolicyError::new(
                        "maxInflight",
                        format!(
                            "must be between 1 and {MAX_LIMIT}, or -1 for pass-through; got {n}"
                        ),
                    )
                })?,
        ),
    };
    let reserved = f.or("reserved", doc.reserved, 0);
    match max_inflight {
        Some(max) => ensure(reserved < max, "reserved", || {
            format!("must be less than maxInflight ({max}); got {reserved}")
        })?,
        None => ensure(reserved == 0, "reserved", || {
            format!(
                "has no effect while maxInflight is -1 (pass-through): nothing is limited, so nothing is reserved; got {reserved}"
            )
        })?,
    }
    let max_websocket = match f.or(
        "maxWebsocketConnections",
        doc.max_websocket_connections,
        DEFAULT_MAX_WEBSOCKET_CONNECTIONS.into(),
    ) {
        -1 => None,
        n => Some(
            u32::try_from(n)
                .ok()
                .filter(|n| *n <= MAX_LIMIT)
                .ok_or_else(|| {
                    PolicyError::new(
                        "maxWebsocketConnections",
                        format!("must be between 0 and {MAX_LIMIT}, or -1 for unlimited; got {n}"),
                    )
                })?,
        ),
    };
    let per_websocket = f.range(
        "maxInflightPerWebsocket",
        doc.max_inflight_per_websocket,
        8,
        1,
        1000,
    )?;
    Ok(Limits {
        max_inflight,
        reserved,
        cheap: 0,
        max_websocket,
        per_websocket,
    })
}

fn compile_matchers(path: &str, docs: Vec<MatcherDoc>) -> Result<Vec<Matcher>, PolicyError> {
    max_len(path, &docs, MAX_MATCHERS)?;
    docs.into_iter()
        .enumerate()
        .map(|(i, doc)| {
            let field = |name: &str| format!("{path}[{i}].{name}");
            Ok(match doc {
                MatcherDoc::ListenerMetadata(v) => Matcher::Metadata(
                    MetadataScope::Listener,
                    non_empty(&field("listenerMetadata"), v)?,
                ),
                MatcherDoc::RouteMetadata(v) => {
                    Matcher::Metadata(MetadataScope::Route, non_empty(&field("routeMetadata"), v)?)
                }
                MatcherDoc::SourceCidr(v) => Matcher::SourceCidr(
                    Cidr::parse(&v)
                        .map_err(|reason| PolicyError::new(&field("sourceCidr"), reason))?,
                ),
                MatcherDoc::UriSan(v) => Matcher::UriSan(non_empty(&field("uriSan"), v)?),
                MatcherDoc::UriSanPrefix(v) => {
                    Matcher::UriSanPrefix(non_empty(&field("uriSanPrefix"), v)?)
                }
                MatcherDoc::StrippedHeader(h) => Matcher::StrippedHeader {
                    name: header_name(&field("strippedHeader.name"), h.name)?,
                    value: h.value,
                },
                MatcherDoc::Staked(true) if path.ends_with("priority") => Matcher::Staked,
                MatcherDoc::Staked(true) => {
                    return Err(PolicyError::new(
                        &field("staked"),
                        "a staked caller may be priority, never internal (internal traffic is never refused)",
                    ))
                }
                MatcherDoc::Staked(false) => {
                    return Err(PolicyError::new(
                        &field("staked"),
                        "only true: a caller stake QoS found in its stake table",
                    ))
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
                    cheap: 0,
                    max_websocket: Some(1024),
                    per_websocket: 8,
                },
                heartbeat_ms: 1000,
                stale_slot_ttl_ms: 10_000,
                retry_after_max_s: 3,
                max_websocket_message_bytes: 1024 * 1024,
                max_subscriptions_per_websocket: 1000,
                max_subscriptions_per_identity: 2000,
                max_held: 4096,
                max_held_per_identity: 256,
                decide_on_body: false,
                internal: vec![],
                priority: vec![],
                dedup: None,
                node_time: None,
                cache: None,
            }
        );
    }

    #[test]
    fn minus_one_is_pass_through() {
        let policy = GatePolicy::parse(br#"{"maxInflight": -1}"#).unwrap();
        assert_eq!(policy.limits.max_inflight, None);
    }

    #[test]
    fn the_shipped_example_parses() {
        let example = include_str!("../../../../policies/admission-gate.example.json");
        let policy = GatePolicy::parse(example.as_bytes()).unwrap();
        assert_eq!(policy.limits.max_inflight, Some(8));
        assert!(!policy.internal.is_empty());
        assert_eq!(policy.warnings(), vec![]);
    }

    #[test]
    fn errors_name_the_field_and_the_reason() {
        for (json, expected) in [
            (
                r#"{"maxInflight": 0}"#,
                "maxInflight: must be between 1 and 1000000, or -1 for pass-through; got 0",
            ),
            (
                r#"{"maxInflight": -2}"#,
                "maxInflight: must be between 1 and 1000000, or -1 for pass-through; got -2",
            ),
            (
                r#"{"maxInflight": 4294967296}"#,
                "maxInflight: must be between 1 and 1000000, or -1 for pass-through; got 4294967296",
            ),
            (
                r#"{"maxInflight": 4, "reserved": 4}"#,
                "reserved: must be less than maxInflight (4); got 4",
            ),
            (
                r#"{"maxInflight": -1, "reserved": 5}"#,
                "reserved: has no effect while maxInflight is -1 (pass-through): nothing is limited, so nothing is reserved; got 5",
            ),
            (
                r#"{"maxInflight": 4, "maxWebsocketConnections": -3}"#,
                "maxWebsocketConnections: must be between 0 and 1000000, or -1 for unlimited; got -3",
            ),
            (
                r#"{"maxInflight": 4, "maxInflightPerWebsocket": 0}"#,
                "maxInflightPerWebsocket: must be between 1 and 1000; got 0",
            ),
            (
                r#"{"maxInflight": 4, "heartbeatMs": 10}"#,
                "heartbeatMs: must be between 100 and 60000; got 10",
            ),
            (
                r#"{"maxInflight": 4, "heartbeatMs": 4294967296}"#,
                "heartbeatMs: must be between 100 and 60000; got 4294967296",
            ),
            (
                r#"{"maxInflight": 4, "heartbeatMs": 1000, "staleSlotTtlMs": 2000}"#,
                "staleSlotTtlMs: must be at least 3 heartbeats (3000 ms), or live workers would lose their slots; got 2000",
            ),
            (
                r#"{"maxInflight": 4, "staleSlotTtlMs": 18446744073709551615}"#,
                "staleSlotTtlMs: must be between 3000 and 3600000; got 18446744073709551615",
            ),
            (
                r#"{"maxInflight": 4, "retryAfterMaxS": 0}"#,
                "retryAfterMaxS: must be between 1 and 3600; got 0",
            ),
            (
                r#"{"maxInflight": 4, "classes": {"internal": [{"sourceCidr": "10.0.0/8"}]}}"#,
                "classes.internal[0].sourceCidr: invalid address \"10.0.0\"",
            ),
            (
                r#"{"maxInflight": 4, "classes": {"priority": [{"uriSan": "a"}, {"strippedHeader": {"name": "X-Tier", "value": "gold"}}]}}"#,
                "classes.priority[1].strippedHeader.name: must be a lower-case HTTP header name (letters, digits, -, _ and the like); got \"X-Tier\"",
            ),
            (
                r#"{"maxInflight": 4, "classes": {"priority": [{"strippedHeader": {"name": "x tier(", "value": "gold"}}]}}"#,
                "classes.priority[0].strippedHeader.name: must be a lower-case HTTP header name",
            ),
            (
                r#"{"maxInflight": 4, "classes": {"internal": [{"uriSan": ""}]}}"#,
                "classes.internal[0].uriSan: must not be empty",
            ),
            (
                r#"{"maxInflight": 4, "cache": {}}"#,
                "cache: needs the dedup section",
            ),
            (
                r#"{"maxInflight": 4, "dedup": {}, "cache": {"maxBytes": 4096, "maxAnswerBytes": 8192}}"#,
                "cache.maxAnswerBytes: must be at most cache.maxBytes (4096); got 8192",
            ),
            (
                r#"{"maxInflight": 4, "dedup": {}, "cache": {"maxEntries": 0}}"#,
                "cache.maxEntries: must be",
            ),
            (
                r#"{"maxInflight": 4, "dedup": {}, "cache": {"maxBytes": "1GB"}}"#,
                "cache.maxBytes: invalid type",
            ),
        ] {
            let e = error(json);
            assert!(e.starts_with(expected), "{json}:\n  got      {e}\n  expected {expected}");
        }
    }

    #[test]
    fn only_objects_and_the_documented_lists() {
        assert_eq!(
            error(r#"[8, 2]"#),
            ".: a policy is a JSON object; got an array"
        );
        assert_eq!(
            error(r#"{"maxInflight": 8, "classes": [[], []]}"#),
            "classes: is not a list; got an array (write the object or value itself)"
        );
        assert_eq!(
            error(r#"{"maxInflight": 8, "dedup": [1000]}"#),
            "dedup: is not a list; got an array (write the object or value itself)"
        );
        assert_eq!(
            error(r#"{"maxInflight": 8, "classes": {"internal": [{"strippedHeader": ["x-a", "b"]}]}}"#),
            "classes.internal[0].strippedHeader: is not a list; got an array (write the object or value itself)"
        );
        assert_eq!(
            error(r#"{"maxInflight": 8, "classes": {"internal": [{"staked": true}]}}"#),
            "classes.internal[0].staked: a staked caller may be priority, never internal (internal traffic is never refused)"
        );
        assert_eq!(
            error(r#"{"maxInflight": 8, "classes": {"priority": [{"staked": false}]}}"#),
            "classes.priority[0].staked: only true: a caller stake QoS found in its stake table"
        );
        assert!(GatePolicy::parse(
            br#"{"maxInflight": 8, "classes": {"priority": [{"staked": true}]}}"#
        )
        .is_ok());
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

    #[test]
    fn suspicious_values_are_warned_about() {
        let warnings = |json: &str| -> Vec<String> {
            GatePolicy::parse(json.as_bytes())
                .unwrap()
                .warnings()
                .iter()
                .map(|w| w.field.clone())
                .collect()
        };
        assert_eq!(warnings(r#"{"maxInflight": 8}"#), ["classes.internal"]);
        assert_eq!(
            warnings(
                r#"{"maxInflight": 8, "maxWebsocketConnections": -1, "retryAfterMaxS": 600,
                    "classes": {"internal": [{"listenerMetadata": "internal"}],
                                "priority": [{"uriSan": "a"}]}}"#
            ),
            ["reserved", "maxWebsocketConnections", "retryAfterMaxS"]
        );
        assert_eq!(warnings(r#"{"maxInflight": -1}"#), Vec::<String>::new());
    }
}
