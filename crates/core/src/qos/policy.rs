//! The stake QoS policy document: parsed strictly, then compiled into
//! validated runtime values. The format is documented in
//! `policies/stake-qos.md`.

use crate::gate::class::Cidr;
use crate::policy_error::{parse_json, PolicyError};
use serde::Deserialize;
use std::collections::HashMap;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Document {
    #[serde(default)]
    mode: Mode,
    capacity_rps: f64,
    #[serde(default = "default_threshold")]
    throttle_threshold: f64,
    #[serde(default = "default_refill_interval_ms")]
    refill_interval_ms: u64,
    #[serde(default = "default_load_smoothing")]
    load_smoothing: u32,
    #[serde(default)]
    identity: IdentityDoc,
    #[serde(default)]
    stakes: Vec<StakeDoc>,
    #[serde(default)]
    concurrency: ConcurrencyDoc,
    #[serde(default = "default_idle_ttl_ms")]
    idle_ttl_ms: u64,
    #[serde(default = "default_max_identities")]
    max_identities: u32,
    #[serde(default = "default_initial_tokens")]
    initial_tokens: u32,
    #[serde(default = "default_retry_after_max_s")]
    retry_after_max_s: u32,
    #[serde(default)]
    reactive: ReactiveDoc,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A configured capacity; throttle above `throttleThreshold` of it.
    #[default]
    Proactive,
    /// Capacity follows upstream back-pressure (see `qos::reactive`).
    Reactive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    ApiKey,
    PeerCertificate,
    Address,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct IdentityDoc {
    #[serde(default = "default_order")]
    order: Vec<Source>,
    #[serde(default = "default_api_key_header")]
    api_key_header: String,
    #[serde(default)]
    trusted_proxies: Vec<String>,
    #[serde(default = "default_unstaked_stake")]
    unstaked_stake: u64,
    #[serde(default = "default_ipv4_prefix")]
    group_ipv4_prefix: u8,
    #[serde(default = "default_ipv6_prefix")]
    group_ipv6_prefix: u8,
}

impl Default for IdentityDoc {
    fn default() -> Self {
        Self {
            order: default_order(),
            api_key_header: default_api_key_header(),
            trusted_proxies: Vec::new(),
            unstaked_stake: default_unstaked_stake(),
            group_ipv4_prefix: default_ipv4_prefix(),
            group_ipv6_prefix: default_ipv6_prefix(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct StakeDoc {
    #[serde(default)]
    api_key_sha256: Option<String>,
    #[serde(default)]
    peer: Option<String>,
    name: String,
    stake: u64,
    #[serde(default)]
    tier: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ConcurrencyDoc {
    #[serde(default = "default_concurrency_floor")]
    floor: u32,
    #[serde(default = "default_headroom")]
    headroom: f64,
    #[serde(default = "default_latency_smoothing")]
    latency_smoothing: f64,
}

impl Default for ConcurrencyDoc {
    fn default() -> Self {
        Self {
            floor: default_concurrency_floor(),
            headroom: default_headroom(),
            latency_smoothing: default_latency_smoothing(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ReactiveDoc {
    #[serde(default)]
    min_capacity_rps: Option<f64>,
    #[serde(default)]
    max_capacity_rps: Option<f64>,
    #[serde(default = "default_latency_tolerance")]
    latency_tolerance: f64,
    #[serde(default = "default_decrease")]
    decrease: f64,
    #[serde(default = "default_increase")]
    increase_per_second: f64,
    #[serde(default = "default_adjust_interval_ms")]
    adjust_interval_ms: u64,
}

impl Default for ReactiveDoc {
    fn default() -> Self {
        Self {
            min_capacity_rps: None,
            max_capacity_rps: None,
            latency_tolerance: default_latency_tolerance(),
            decrease: default_decrease(),
            increase_per_second: default_increase(),
            adjust_interval_ms: default_adjust_interval_ms(),
        }
    }
}

fn default_threshold() -> f64 {
    0.95
}
fn default_refill_interval_ms() -> u64 {
    20
}
fn default_load_smoothing() -> u32 {
    40
}
fn default_order() -> Vec<Source> {
    vec![Source::ApiKey, Source::PeerCertificate, Source::Address]
}
fn default_api_key_header() -> String {
    "x-api-key".into()
}
fn default_unstaked_stake() -> u64 {
    1000
}
fn default_ipv4_prefix() -> u8 {
    32
}
fn default_ipv6_prefix() -> u8 {
    64
}
fn default_concurrency_floor() -> u32 {
    4
}
fn default_headroom() -> f64 {
    0.5
}
fn default_latency_smoothing() -> f64 {
    0.2
}
fn default_idle_ttl_ms() -> u64 {
    60_000
}
fn default_max_identities() -> u32 {
    10_000
}
fn default_initial_tokens() -> u32 {
    8
}
fn default_retry_after_max_s() -> u32 {
    30
}
fn default_latency_tolerance() -> f64 {
    2.0
}
fn default_decrease() -> f64 {
    0.9
}
fn default_increase() -> f64 {
    0.1
}
fn default_adjust_interval_ms() -> u64 {
    200
}

/// Who an identity is and what it weighs.
#[derive(Debug, Clone, PartialEq)]
pub struct StakeEntry {
    pub name: String,
    pub stake: u64,
    /// Index into `QosPolicy::tiers`.
    pub tier: usize,
}

/// The reactive mode's AIMD constants (see `qos::reactive`).
#[derive(Debug, Clone, PartialEq)]
pub struct Reactive {
    pub min_capacity_rps: f64,
    pub max_capacity_rps: f64,
    /// Back off when the mean upstream latency passes this multiple of the
    /// baseline (the lowest mean seen).
    pub latency_tolerance: f64,
    /// On back-pressure, capacity becomes this fraction of what the
    /// upstream delivered (when demand pressed), or of itself.
    pub decrease: f64,
    /// Grow capacity by this fraction of itself per second while demand
    /// presses against it and the upstream is healthy.
    pub increase_per_second: f64,
    pub adjust_interval_ms: u64,
}

/// The compiled policy.
#[derive(Debug, Clone, PartialEq)]
pub struct QosPolicy {
    pub mode: Mode,
    pub capacity_rps: f64,
    pub throttle_threshold: f64,
    pub refill_interval_ms: u64,
    pub load_smoothing: u32,
    pub order: Vec<Source>,
    pub api_key_header: String,
    pub trusted_proxies: Vec<Cidr>,
    pub unstaked_stake: u64,
    pub group_ipv4_prefix: u8,
    pub group_ipv6_prefix: u8,
    /// `sha256(api key)` in lowercase hex → entry.
    pub by_api_key: HashMap<String, StakeEntry>,
    /// Peer certificate URI SAN or subject → entry.
    pub by_peer: HashMap<String, StakeEntry>,
    /// Metric labels: `unstaked`, `staked`, then the policy's tiers.
    pub tiers: Vec<String>,
    pub concurrency_floor: u32,
    pub headroom: f64,
    pub latency_smoothing: f64,
    pub idle_ttl_ms: u64,
    pub max_identities: u32,
    pub initial_tokens: u32,
    pub retry_after_max_s: u32,
    pub reactive: Reactive,
}

pub const TIER_UNSTAKED: usize = 0;
pub const TIER_STAKED: usize = 1;
pub const MAX_TIERS: usize = 16;
pub const MAX_IDENTITIES: u32 = 1_000_000;

fn err(field: &str, reason: impl Into<String>) -> PolicyError {
    PolicyError::new(field, reason.into())
}

fn check(ok: bool, field: &str, reason: impl FnOnce() -> String) -> Result<(), PolicyError> {
    if ok {
        Ok(())
    } else {
        Err(err(field, reason()))
    }
}

impl QosPolicy {
    /// Parses and validates a policy document. Errors name the field.
    pub fn parse(json: &[u8]) -> Result<Self, PolicyError> {
        let doc: Document = parse_json(json)?;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        check(positive(doc.capacity_rps), "capacityRps", || {
            format!("must be a number > 0; got {}", doc.capacity_rps)
        })?;
        check(
            doc.throttle_threshold > 0.0 && doc.throttle_threshold <= 1.0,
            "throttleThreshold",
            || format!("must be in (0, 1]; got {}", doc.throttle_threshold),
        )?;
        check(
            (5..=1000).contains(&doc.refill_interval_ms),
            "refillIntervalMs",
            || format!("must be 5..=1000; got {}", doc.refill_interval_ms),
        )?;
        check(
            (1..=1000).contains(&doc.load_smoothing),
            "loadSmoothing",
            || {
                format!(
                    "must be 1..=1000 refill intervals; got {}",
                    doc.load_smoothing
                )
            },
        )?;
        check(
            doc.idle_ttl_ms >= 10 * doc.refill_interval_ms,
            "idleTtlMs",
            || {
                format!(
                    "must be at least 10 refill intervals ({} ms); got {}",
                    10 * doc.refill_interval_ms,
                    doc.idle_ttl_ms
                )
            },
        )?;
        check(
            (1..=MAX_IDENTITIES).contains(&doc.max_identities),
            "maxIdentities",
            || format!("must be 1..={MAX_IDENTITIES}; got {}", doc.max_identities),
        )?;
        check(doc.retry_after_max_s > 0, "retryAfterMaxS", || {
            "must be at least 1".into()
        })?;
        let id = &doc.identity;
        check(!id.order.is_empty(), "identity.order", || {
            "must name at least one source".into()
        })?;
        for (i, source) in id.order.iter().enumerate() {
            check(
                !id.order[..i].contains(source),
                &format!("identity.order[{i}]"),
                || format!("{source:?} is listed twice"),
            )?;
        }
        check(
            is_header_name(&id.api_key_header),
            "identity.apiKeyHeader",
            || {
                format!(
                    "must be a lowercase header name; got {:?}",
                    id.api_key_header
                )
            },
        )?;
        check(id.unstaked_stake > 0, "identity.unstakedStake", || {
            "must be at least 1".into()
        })?;
        check(
            (1..=32).contains(&id.group_ipv4_prefix),
            "identity.groupIpv4Prefix",
            || format!("must be 1..=32; got {}", id.group_ipv4_prefix),
        )?;
        check(
            (1..=128).contains(&id.group_ipv6_prefix),
            "identity.groupIpv6Prefix",
            || format!("must be 1..=128; got {}", id.group_ipv6_prefix),
        )?;
        let trusted_proxies = id
            .trusted_proxies
            .iter()
            .enumerate()
            .map(|(i, text)| {
                Cidr::parse(text).map_err(|e| err(&format!("identity.trustedProxies[{i}]"), e))
            })
            .collect::<Result<Vec<_>, _>>()?;

        let mut tiers = vec!["unstaked".to_string(), "staked".to_string()];
        let mut by_api_key = HashMap::new();
        let mut by_peer = HashMap::new();
        for (i, s) in doc.stakes.iter().enumerate() {
            let field = |name: &str| format!("stakes[{i}].{name}");
            let tier = match &s.tier {
                None => TIER_STAKED,
                Some(t) => {
                    check(is_label(t), &field("tier"), || {
                        format!("must be 1-32 characters of a-z, 0-9, _ or -; got {t:?}")
                    })?;
                    match tiers.iter().position(|known| known == t) {
                        Some(index) => index,
                        None => {
                            check(tiers.len() < MAX_TIERS, &field("tier"), || {
                                format!("at most {} distinct tiers", MAX_TIERS - 2)
                            })?;
                            tiers.push(t.clone());
                            tiers.len() - 1
                        }
                    }
                }
            };
            let entry = StakeEntry {
                name: s.name.clone(),
                stake: s.stake,
                tier,
            };
            match (&s.api_key_sha256, &s.peer) {
                (Some(hash), None) => {
                    let hash = hash.to_ascii_lowercase();
                    check(
                        hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                        &field("apiKeySha256"),
                        || "must be 64 hex digits: the sha256 of the key, never the key".into(),
                    )?;
                    check(
                        by_api_key.insert(hash, entry).is_none(),
                        &field("apiKeySha256"),
                        || "is listed twice".into(),
                    )?;
                }
                (None, Some(peer)) => {
                    check(!peer.is_empty(), &field("peer"), || {
                        "must not be empty".into()
                    })?;
                    check(
                        by_peer.insert(peer.clone(), entry).is_none(),
                        &field("peer"),
                        || "is listed twice".into(),
                    )?;
                }
                _ => {
                    return Err(err(
                        &format!("stakes[{i}]"),
                        "needs exactly one of apiKeySha256 and peer",
                    ))
                }
            }
        }

        let c = &doc.concurrency;
        check(c.floor >= 1, "concurrency.floor", || {
            "must be at least 1".into()
        })?;
        check(
            c.headroom.is_finite() && (0.0..=10.0).contains(&c.headroom),
            "concurrency.headroom",
            || format!("must be in [0, 10]; got {}", c.headroom),
        )?;
        check(
            c.latency_smoothing > 0.0 && c.latency_smoothing <= 1.0,
            "concurrency.latencySmoothing",
            || format!("must be in (0, 1]; got {}", c.latency_smoothing),
        )?;

        let r = &doc.reactive;
        let min_capacity_rps = r.min_capacity_rps.unwrap_or(doc.capacity_rps / 20.0);
        let max_capacity_rps = r.max_capacity_rps.unwrap_or(doc.capacity_rps * 4.0);
        check(
            positive(min_capacity_rps),
            "reactive.minCapacityRps",
            || format!("must be > 0; got {min_capacity_rps}"),
        )?;
        check(
            max_capacity_rps >= doc.capacity_rps && doc.capacity_rps >= min_capacity_rps,
            "reactive.maxCapacityRps",
            || {
                format!(
                    "need minCapacityRps ({min_capacity_rps}) <= capacityRps ({}) <= maxCapacityRps ({max_capacity_rps})",
                    doc.capacity_rps
                )
            },
        )?;
        check(
            r.latency_tolerance > 1.0,
            "reactive.latencyTolerance",
            || format!("must be > 1; got {}", r.latency_tolerance),
        )?;
        check(
            r.decrease > 0.0 && r.decrease < 1.0,
            "reactive.decrease",
            || format!("must be in (0, 1); got {}", r.decrease),
        )?;
        check(
            r.increase_per_second > 0.0 && r.increase_per_second <= 10.0,
            "reactive.increasePerSecond",
            || format!("must be in (0, 10]; got {}", r.increase_per_second),
        )?;
        check(
            r.adjust_interval_ms >= doc.refill_interval_ms,
            "reactive.adjustIntervalMs",
            || {
                format!(
                    "must be at least refillIntervalMs ({}); got {}",
                    doc.refill_interval_ms, r.adjust_interval_ms
                )
            },
        )?;

        Ok(Self {
            mode: doc.mode,
            capacity_rps: doc.capacity_rps,
            throttle_threshold: doc.throttle_threshold,
            refill_interval_ms: doc.refill_interval_ms,
            load_smoothing: doc.load_smoothing,
            order: id.order.clone(),
            api_key_header: id.api_key_header.clone(),
            trusted_proxies,
            unstaked_stake: id.unstaked_stake,
            group_ipv4_prefix: id.group_ipv4_prefix,
            group_ipv6_prefix: id.group_ipv6_prefix,
            by_api_key,
            by_peer,
            tiers,
            concurrency_floor: c.floor,
            headroom: c.headroom,
            latency_smoothing: c.latency_smoothing,
            idle_ttl_ms: doc.idle_ttl_ms,
            max_identities: doc.max_identities,
            initial_tokens: doc.initial_tokens,
            retry_after_max_s: doc.retry_after_max_s,
            reactive: Reactive {
                min_capacity_rps,
                max_capacity_rps,
                latency_tolerance: r.latency_tolerance,
                decrease: r.decrease,
                increase_per_second: r.increase_per_second,
                adjust_interval_ms: r.adjust_interval_ms,
            },
        })
    }
}

fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_label(text: &str) -> bool {
    (1..=32).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_HASH: &str = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";

    fn parse(json: &str) -> Result<QosPolicy, String> {
        QosPolicy::parse(json.as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn minimal_policy_takes_the_defaults() {
        let p = parse(r#"{"capacityRps": 1000}"#).unwrap();
        assert_eq!(p.mode, Mode::Proactive);
        assert_eq!(p.throttle_threshold, 0.95);
        assert_eq!(p.refill_interval_ms, 20);
        assert_eq!(p.unstaked_stake, 1000);
        assert_eq!(p.api_key_header, "x-api-key");
        assert_eq!(p.tiers, ["unstaked", "staked"]);
        assert_eq!(p.reactive.min_capacity_rps, 50.0);
    }

    #[test]
    fn stakes_by_key_hash_and_peer_with_tiers() {
        let p = parse(&format!(
            r#"{{"capacityRps": 100, "stakes": [
                {{"apiKeySha256": "{}", "name": "acme", "stake": 40, "tier": "gold"}},
                {{"peer": "spiffe://x/y", "name": "y", "stake": 10}}]}}"#,
            KEY_HASH.to_uppercase()
        ))
        .unwrap();
        assert_eq!(p.by_api_key[KEY_HASH].tier, 2);
        assert_eq!(p.tiers[2], "gold");
        assert_eq!(p.by_peer["spiffe://x/y"].tier, TIER_STAKED);
    }

    #[test]
    fn errors_name_the_field_and_the_reason() {
        let cases = [
            (r#"{}"#, "missing field `capacityRps`"),
            (r#"{"capacityRps": 0}"#, "capacityRps: must be a number > 0"),
            (
                r#"{"capacityRps": 1, "throttleThreshold": 1.5}"#,
                "throttleThreshold: must be in (0, 1]",
            ),
            (r#"{"capacityRps": 1, "burst": 2}"#, "unknown field `burst`"),
            (
                r#"{"capacityRps": 1, "mode": "magic"}"#,
                "mode: unknown variant `magic`",
            ),
            (
                r#"{"capacityRps": 1, "stakes": [{"apiKeySha256": "secret", "name": "a", "stake": 1}]}"#,
                "stakes[0].apiKeySha256: must be 64 hex digits",
            ),
            (
                r#"{"capacityRps": 1, "stakes": [{"name": "a", "stake": 1}]}"#,
                "stakes[0]: needs exactly one of apiKeySha256 and peer",
            ),
            (
                r#"{"capacityRps": 1, "identity": {"trustedProxies": ["10.0.0.0/40"]}}"#,
                "identity.trustedProxies[0]:",
            ),
            (
                r#"{"capacityRps": 1, "identity": {"order": ["address", "address"]}}"#,
                "identity.order[1]: Address is listed twice",
            ),
            (
                r#"{"capacityRps": 1, "maxIdentities": 0}"#,
                "maxIdentities: must be 1..=1000000",
            ),
            (
                r#"{"capacityRps": 1, "reactive": {"decrease": 1.2}}"#,
                "reactive.decrease: must be in (0, 1)",
            ),
        ];
        for (json, expected) in cases {
            let e = parse(json).unwrap_err();
            assert!(e.contains(expected), "{json}: {e}");
        }
    }
}
