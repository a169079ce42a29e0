//! The stake QoS policy document: parsed strictly, then compiled into
//! validated runtime values. The format is documented in
//! `policies/stake-qos.md`.

use super::fleet::{FleetDoc, FleetPolicy};
use crate::request::Cidr;
use crate::validate::{
    ensure, finite_range, header_name, max_len, non_empty, parse_json, range, PolicyError, Warning,
    Warnings,
};
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
    /// `None`: the mode's default (0.5 proactive, 0 reactive).
    #[serde(default)]
    identify_above: Option<f64>,
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
    decide_on_body: bool,
    #[serde(default = "default_websockets_per_identity")]
    websockets_per_identity: u32,
    #[serde(default)]
    reactive: ReactiveDoc,
    #[serde(default)]
    fleet: Option<FleetDoc>,
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
fn default_websockets_per_identity() -> u32 {
    16
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
    /// Below this fraction of capacity, by an upper bound of the load that
    /// needs no identity and no body read, requests are counted and not
    /// identified (`qos::light`); 0: every request is identified.
    pub identify_above: f64,
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
    /// Admit a request with a body once the body is whole, so that a 429
    /// answers each call by its `id`. Needs a filter after QoS that holds
    /// the headers until then (envoy-config/gateway.yaml).
    pub decide_on_body: bool,
    /// WebSockets one identity may hold open on each Envoy worker.
    pub websockets_per_identity: u32,
    pub reactive: Reactive,
    /// Fleet mode: `capacityRps` is shared by the replicas (`qos::fleet`).
    pub fleet: Option<FleetPolicy>,
}

/// `identifyAbove` when the policy leaves it out (proactive mode).
pub const DEFAULT_IDENTIFY_ABOVE: f64 = 0.5;
pub const TIER_UNSTAKED: usize = 0;
pub const TIER_STAKED: usize = 1;
pub const MAX_TIERS: usize = 16;
pub const MAX_IDENTITIES: u32 = 1_000_000;
pub const MAX_CAPACITY_RPS: f64 = 10_000_000.0;
/// A stake above this is a typo (Solana's whole stake is about 4e17 lamports).
pub const MAX_STAKE: u64 = 1_000_000_000_000_000_000;
pub const MAX_STAKE_ENTRIES: usize = 100_000;
/// The refill round's budget: identity slots visited per second. A round
/// visits at most every slot of the table (`maxIdentities`), `1000 /
/// refillIntervalMs` times a second; at the cost measured in Envoy (see
/// `policies/stake-qos.md`), 1,280,000 a second is about a fifth of a
/// core, and the default (10,000 identities every 20 ms) is 500,000.
pub const MAX_REFILL_VISITS_PER_S: u64 = 1_280_000;

/// The fields that are lists; an array anywhere else is refused.
const LISTS: &[&str] = &["stakes", "identity.order", "identity.trustedProxies"];

impl QosPolicy {
    /// Parses and validates a policy document. Errors name the field.
    pub fn parse(json: &[u8]) -> Result<Self, PolicyError> {
        let doc: Document = parse_json(json, LISTS)?;
        let capacity_rps = finite_range("capacityRps", doc.capacity_rps, 1.0, MAX_CAPACITY_RPS)?;
        let throttle_threshold =
            finite_range("throttleThreshold", doc.throttle_threshold, 0.01, 1.0)?;
        let refill_interval_ms = range("refillIntervalMs", doc.refill_interval_ms, 5, 1000)?;
        let load_smoothing = range("loadSmoothing", doc.load_smoothing, 1, 1000)?;
        let identify_above = match (doc.mode, doc.identify_above) {
            (Mode::Reactive, Some(above)) if above != 0.0 => {
                return Err(PolicyError::new(
                    "identifyAbove",
                    "reactive mode identifies every request (its capacity follows their latency): leave it out or set 0",
                ))
            }
            (Mode::Reactive, _) => 0.0,
            (Mode::Proactive, above) => finite_range(
                "identifyAbove",
                above.unwrap_or(DEFAULT_IDENTIFY_ABOVE),
                0.0,
                throttle_threshold,
            )?,
        };
        // refill_interval_ms is at most 1000, so this cannot overflow.
        let min_idle = 10 * refill_interval_ms;
        ensure(doc.idle_ttl_ms >= min_idle, "idleTtlMs", || {
            format!(
                "must be at least 10 refill intervals ({min_idle} ms); got {}",
                doc.idle_ttl_ms
            )
        })?;
        let idle_ttl_ms = range("idleTtlMs", doc.idle_ttl_ms, min_idle, 86_400_000)?;
        let max_identities = range("maxIdentities", doc.max_identities, 1, MAX_IDENTITIES)?;
        let websockets_per_identity = range(
            "websocketsPerIdentity",
            doc.websockets_per_identity,
            1,
            MAX_IDENTITIES,
        )?;
        let visits = u64::from(max_identities) * 1000 / refill_interval_ms;
        ensure(visits <= MAX_REFILL_VISITS_PER_S, "maxIdentities", || {
            format!(
                "{max_identities} identities refilled every {refill_interval_ms} ms \
                 is {visits} identity visits a second, over the budget of {MAX_REFILL_VISITS_PER_S} \
                 (about a fifth of a core): lower maxIdentities or raise refillIntervalMs"
            )
        })?;
        let initial_tokens = range("initialTokens", doc.initial_tokens, 0, 65_535)?;
        let retry_after_max_s = range("retryAfterMaxS", doc.retry_after_max_s, 1, 3600)?;

        let id = doc.identity;
        ensure(!id.order.is_empty(), "identity.order", || {
            "must name at least one source".into()
        })?;
        for (i, source) in id.order.iter().enumerate() {
            ensure(
                !id.order[..i].contains(source),
                &format!("identity.order[{i}]"),
                || format!("{source:?} is listed twice"),
            )?;
        }
        let api_key_header = header_name("identity.apiKeyHeader", id.api_key_header)?;
        let unstaked_stake = range("identity.unstakedStake", id.unstaked_stake, 1, MAX_STAKE)?;
        let group_ipv4_prefix = range("identity.groupIpv4Prefix", id.group_ipv4_prefix, 1, 32)?;
        let group_ipv6_prefix = range("identity.groupIpv6Prefix", id.group_ipv6_prefix, 1, 128)?;
        max_len("identity.trustedProxies", &id.trusted_proxies, 1024)?;
        let trusted_proxies = id
            .trusted_proxies
            .iter()
            .enumerate()
            .map(|(i, text)| {
                Cidr::parse(text)
                    .map_err(|e| PolicyError::new(&format!("identity.trustedProxies[{i}]"), e))
            })
            .collect::<Result<Vec<_>, _>>()?;

        max_len("stakes", &doc.stakes, MAX_STAKE_ENTRIES)?;
        let mut tiers = vec!["unstaked".to_string(), "staked".to_string()];
        let mut by_api_key = HashMap::new();
        let mut by_peer = HashMap::new();
        for (i, s) in doc.stakes.into_iter().enumerate() {
            let field = |name: &str| format!("stakes[{i}].{name}");
            let tier = match &s.tier {
                None => TIER_STAKED,
                Some(t) => {
                    ensure(is_label(t), &field("tier"), || {
                        format!("must be 1-32 characters of a-z, 0-9, _ or -; got {t:?}")
                    })?;
                    match tiers.iter().position(|known| known == t) {
                        Some(index) => index,
                        None => {
                            ensure(tiers.len() < MAX_TIERS, &field("tier"), || {
                                format!("at most {} distinct tiers", MAX_TIERS - 2)
                            })?;
                            tiers.push(t.clone());
                            tiers.len() - 1
                        }
                    }
                }
            };
            let entry = StakeEntry {
                name: non_empty(&field("name"), s.name)?,
                stake: range(&field("stake"), s.stake, 0, MAX_STAKE)?,
                tier,
            };
            match (s.api_key_sha256, s.peer) {
                (Some(hash), None) => {
                    let hash = hash.to_ascii_lowercase();
                    ensure(
                        hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                        &field("apiKeySha256"),
                        || "must be 64 hex digits: the sha256 of the key, never the key".into(),
                    )?;
                    ensure(
                        by_api_key.insert(hash, entry).is_none(),
                        &field("apiKeySha256"),
                        || "is listed twice".into(),
                    )?;
                }
                (None, Some(peer)) => {
                    let peer = non_empty(&field("peer"), peer)?;
                    ensure(
                        by_peer.insert(peer, entry).is_none(),
                        &field("peer"),
                        || "is listed twice".into(),
                    )?;
                }
                _ => {
                    return Err(PolicyError::new(
                        &format!("stakes[{i}]"),
                        "needs exactly one of apiKeySha256 and peer",
                    ))
                }
            }
        }

        let c = &doc.concurrency;
        let concurrency_floor = range("concurrency.floor", c.floor, 1, 100_000)?;
        let headroom = finite_range("concurrency.headroom", c.headroom, 0.0, 10.0)?;
        let latency_smoothing = finite_range(
            "concurrency.latencySmoothing",
            c.latency_smoothing,
            0.001,
            1.0,
        )?;

        let r = &doc.reactive;
        let min_capacity_rps = finite_range(
            "reactive.minCapacityRps",
            r.min_capacity_rps.unwrap_or((capacity_rps / 20.0).max(1.0)),
            1.0,
            capacity_rps,
        )?;
        let max_capacity_rps = finite_range(
            "reactive.maxCapacityRps",
            r.max_capacity_rps
                .unwrap_or((capacity_rps * 4.0).min(MAX_CAPACITY_RPS)),
            capacity_rps,
            MAX_CAPACITY_RPS,
        )?;
        let latency_tolerance = finite_range(
            "reactive.latencyTolerance",
            r.latency_tolerance,
            1.01,
            100.0,
        )?;
        let decrease = finite_range("reactive.decrease", r.decrease, 0.01, 0.99)?;
        let increase_per_second = finite_range(
            "reactive.increasePerSecond",
            r.increase_per_second,
            0.001,
            10.0,
        )?;
        let adjust_interval_ms = range(
            "reactive.adjustIntervalMs",
            r.adjust_interval_ms,
            refill_interval_ms,
            60_000,
        )?;

        let fleet = doc
            .fleet
            .map(|f| FleetPolicy::compile(f, refill_interval_ms))
            .transpose()?;
        ensure(
            fleet.is_none() || doc.mode == Mode::Proactive,
            "fleet",
            || "needs mode \"proactive\": the fleet shares one configured capacity".into(),
        )?;

        Ok(Self {
            mode: doc.mode,
            capacity_rps,
            throttle_threshold,
            refill_interval_ms,
            load_smoothing,
            identify_above,
            order: id.order,
            api_key_header,
            trusted_proxies,
            unstaked_stake,
            group_ipv4_prefix,
            group_ipv6_prefix,
            by_api_key,
            by_peer,
            tiers,
            concurrency_floor,
            headroom,
            latency_smoothing,
            idle_ttl_ms,
            max_identities,
            initial_tokens,
            retry_after_max_s,
            decide_on_body: doc.decide_on_body,
            websockets_per_identity,
            reactive: Reactive {
                min_capacity_rps,
                max_capacity_rps,
                latency_tolerance,
                decrease,
                increase_per_second,
                adjust_interval_ms,
            },
            fleet,
        })
    }

    /// Values that are valid but probably a mistake.
    pub fn warnings(&self) -> Vec<Warning> {
        let mut w = Warnings::default();
        w.when(self.throttle_threshold < 0.5, "throttleThreshold", || {
            format!(
                "{}: clients are throttled while the upstream is less than half busy",
                self.throttle_threshold
            )
        });
        w.when(self.capacity_rps < 10.0, "capacityRps", || {
            format!(
                "{}: under 10 requests a second for the whole gateway",
                self.capacity_rps
            )
        });
        w.when(self.initial_tokens == 0, "initialTokens", || {
            "0: a new client cannot send anything until the next refill round".into()
        });
        w.when(
            self.by_api_key.is_empty() && self.by_peer.is_empty(),
            "stakes",
            || "empty: every client is unstaked and weighs the same".into(),
        );
        w.when(self.idle_ttl_ms < 1000, "idleTtlMs", || {
            format!(
                "{} ms: clients that pause for a second lose their place in the table",
                self.idle_ttl_ms
            )
        });
        w.0
    }
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
            (
                r#"{"capacityRps": 0}"#,
                "capacityRps: must be between 1 and 10000000; got 0",
            ),
            (
                r#"{"capacityRps": 1e-300}"#,
                "capacityRps: must be between 1 and 10000000; got 1e-300",
            ),
            (
                r#"{"capacityRps": 1e19}"#,
                "capacityRps: must be between 1 and 10000000; got 1e19",
            ),
            (
                r#"{"capacityRps": 1, "throttleThreshold": 1.5}"#,
                "throttleThreshold: must be between 0.01 and 1; got 1.5",
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
                "maxIdentities: must be between 1 and 1000000; got 0",
            ),
            (
                r#"{"capacityRps": 100, "maxIdentities": 1000000, "refillIntervalMs": 5}"#,
                "maxIdentities: 1000000 identities refilled every 5 ms is 200000000 identity visits a second, over the budget of 1280000",
            ),
            (
                r#"{"capacityRps": 1, "reactive": {"decrease": 1.2}}"#,
                "reactive.decrease: must be between 0.01 and 0.99; got 1.2",
            ),
            (
                r#"{"capacityRps": 1, "identity": {"apiKeyHeader": "x key"}}"#,
                "identity.apiKeyHeader: must be a lower-case HTTP header name",
            ),
            (
                r#"[1000]"#,
                ".: a policy is a JSON object; got an array",
            ),
            (
                r#"{"capacityRps": 1, "concurrency": [4, 0.5, 0.2]}"#,
                "concurrency: is not a list",
            ),
            (
                r#"{"capacityRps": 1, "stakes": [{"peer": "p", "name": "a", "stake": 1e30}]}"#,
                "stakes[0].stake: invalid type",
            ),
            (
                r#"{"capacityRps": 1, "stakes": [{"peer": "p", "name": "a", "stake": 2000000000000000000}]}"#,
                "stakes[0].stake: must be between 0 and 1000000000000000000",
            ),
        ];
        for (json, expected) in cases {
            let e = parse(json).unwrap_err();
            assert!(e.contains(expected), "{json}: {e}");
        }
    }
}
