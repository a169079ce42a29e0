//! The stake QoS policy document: parsed strictly, then compiled into
//! validated runtime values. The format is documented in
//! `policies/stake-qos.md`.

use super::fleet::{FleetDoc, FleetPolicy};
use crate::cost::{method_key, Costs, Unit, MAX_METHODS};
use crate::request::Cidr;
use crate::validate::{
    ensure, finite_range, header_name, max_len, non_empty, parse_json, range, FieldDoc, Fields,
    PolicyError, Warning, Warnings,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Document {
    mode: Option<Mode>,
    capacity_rps: Option<f64>,
    capacity_node_ms: Option<f64>,
    capacity_cost: Option<f64>,
    costs: Option<BTreeMap<String, f64>>,
    default_cost: Option<f64>,
    throttle_threshold: Option<f64>,
    refill_interval_ms: Option<u64>,
    load_smoothing: Option<u32>,
    identify_above: Option<f64>,
    #[serde(default)]
    identity: IdentityDoc,
    stakes: Option<Vec<StakeDoc>>,
    #[serde(default)]
    concurrency: ConcurrencyDoc,
    idle_ttl_ms: Option<u64>,
    max_identities: Option<u32>,
    initial_tokens: Option<u32>,
    retry_after_max_s: Option<u32>,
    decide_on_body: Option<bool>,
    websockets_per_identity: Option<u32>,
    #[serde(default)]
    reactive: ReactiveDoc,
    fleet: Option<FleetDoc>,
    #[serde(default)]
    usage: UsageDoc,
    shadow: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct UsageDoc {
    series: Option<u32>,
    address_series: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A configured capacity; throttle above `throttleThreshold` of it.
    #[default]
    Proactive,
    /// Capacity follows upstream back-pressure (see `qos::reactive`).
    Reactive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    ApiKey,
    PeerCertificate,
    Address,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct IdentityDoc {
    order: Option<Vec<Source>>,
    api_key_header: Option<String>,
    trusted_proxies: Option<Vec<String>>,
    unstaked_stake: Option<u64>,
    group_ipv4_prefix: Option<u8>,
    group_ipv6_prefix: Option<u8>,
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ConcurrencyDoc {
    floor: Option<u32>,
    headroom: Option<f64>,
    latency_smoothing: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ReactiveDoc {
    min_capacity_rps: Option<f64>,
    max_capacity_rps: Option<f64>,
    latency_tolerance: Option<f64>,
    decrease: Option<f64>,
    increase_per_second: Option<f64>,
    adjust_interval_ms: Option<u64>,
}

/// Who an identity is and what it weighs.
#[derive(Debug, Clone, PartialEq)]
pub struct StakeEntry {
    /// Shown in refusals and the usage ledger (shared, not copied, per
    /// request).
    pub name: Arc<str>,
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
    /// The capacity, per second, in the unit of `costs` (calls for
    /// `capacityRps`, node ms for `capacityNodeMs`, cost units for
    /// `capacityCost`).
    pub capacity_rps: f64,
    /// The unit shares are cut in, and what a call costs in it.
    pub costs: Costs,
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
    /// The usage ledger's labels for names and for address groups
    /// (`qos::ledger`); both 0 turn it off.
    pub usage_series: u32,
    pub usage_address_series: u32,
    /// A shadow candidate (`stakegate deploy --shadow`): it decides every
    /// request and refuses none; its stats are `stakegate.qos_shadow.*`.
    pub shadow: bool,
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
/// The most node time or cost units per second a policy may give out.
pub const MAX_CAPACITY_UNITS: f64 = 1_000_000_000.0;
/// A method's cost in `costs`, at most (node ms or cost units).
pub const MAX_METHOD_COST: f64 = 1_000_000.0;
/// `defaultCost` in the node-time unit when the policy leaves it out: an
/// unknown method may be a heavy one, and it is learned within a round.
pub const DEFAULT_NODE_MS: f64 = 10.0;
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
        Self::read(json, &mut Fields::default())
    }

    /// Every field, with its default, as the docs' tables list them.
    pub fn fields() -> Vec<FieldDoc> {
        let mut fields = Fields::listing();
        let all = br#"{"capacityRps": 100, "fleet": {}}"#;
        Self::read(all, &mut fields).map_or_else(|_| Vec::new(), |_| fields.listed())
    }

    fn read(json: &[u8], f: &mut Fields) -> Result<Self, PolicyError> {
        let doc: Document = parse_json(json, LISTS)?;
        let mode = f.or("mode", doc.mode, Mode::Proactive);
        let rates = rates(&doc, mode, f)?;
        let costs = costs(&doc, rates.unit, f)?;
        let table = table(&doc, rates.refill_interval_ms, f)?;
        let identity = identity(doc.identity, f)?;
        let stakes = stakes(doc.stakes, f)?;
        let concurrency = concurrency(&doc.concurrency, f)?;
        let reactive = reactive(&doc.reactive, &rates, f)?;
        let fleet = doc
            .fleet
            .map(|doc| FleetPolicy::compile(doc, rates.refill_interval_ms, f))
            .transpose()?;
        ensure(fleet.is_none() || mode == Mode::Proactive, "fleet", || {
            "needs mode \"proactive\": the fleet shares one configured capacity".into()
        })?;
        f.or_else("fleet", None, "off", || ());
        ensure(
            fleet.is_none() || doc.shadow != Some(true),
            "shadow",
            || {
                "a fleet policy cannot run as a shadow: it would report its demand to the fleet a second time".into()
            },
        )?;
        let usage_series = f.range("usage.series", doc.usage.series, 64, 0, 10_000)?;
        let usage_address_series = f.range(
            "usage.addressSeries",
            doc.usage.address_series,
            16,
            0,
            10_000,
        )?;
        Ok(Self {
            mode,
            capacity_rps: rates.capacity_rps,
            costs,
            throttle_threshold: rates.throttle_threshold,
            refill_interval_ms: rates.refill_interval_ms,
            load_smoothing: rates.load_smoothing,
            identify_above: rates.identify_above,
            order: identity.order,
            api_key_header: identity.api_key_header,
            trusted_proxies: identity.trusted_proxies,
            unstaked_stake: identity.unstaked_stake,
            group_ipv4_prefix: identity.group_ipv4_prefix,
            group_ipv6_prefix: identity.group_ipv6_prefix,
            by_api_key: stakes.by_api_key,
            by_peer: stakes.by_peer,
            tiers: stakes.tiers,
            concurrency_floor: concurrency.0,
            headroom: concurrency.1,
            latency_smoothing: concurrency.2,
            idle_ttl_ms: table.idle_ttl_ms,
            max_identities: table.max_identities,
            initial_tokens: table.initial_tokens,
            retry_after_max_s: table.retry_after_max_s,
            decide_on_body: f.or("decideOnBody", doc.decide_on_body, false),
            websockets_per_identity: table.websockets_per_identity,
            usage_series,
            usage_address_series,
            shadow: f.or("shadow", doc.shadow, false),
            reactive,
            fleet,
        })
    }

    /// The prefix of its stats: a shadow's are apart from the live one's.
    pub fn stats_prefix(&self) -> &'static str {
        if self.shadow {
            "stakegate.qos_shadow"
        } else {
            "stakegate.qos"
        }
    }

    /// The usage ledger is kept.
    pub fn usage_on(&self) -> bool {
        self.usage_series > 0 || self.usage_address_series > 0
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
        w.when(
            self.costs.unit == Unit::Calls && self.capacity_rps < 10.0,
            "capacityRps",
            || {
                format!(
                    "{}: under 10 requests a second for the whole gateway",
                    self.capacity_rps
                )
            },
        );
        w.when(
            self.costs.unit == Unit::NodeTime && self.capacity_rps < 100.0,
            "capacityNodeMs",
            || {
                format!(
                    "{}: under a tenth of one read slot's time for the whole gateway",
                    self.capacity_rps
                )
            },
        );
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

/// The rate fields: what is shared, in which unit, how often, and when.
struct Rates {
    unit: Unit,
    capacity_rps: f64,
    /// The most a capacity in the unit may be (reactive mode's bound).
    max_capacity: f64,
    throttle_threshold: f64,
    refill_interval_ms: u64,
    load_smoothing: u32,
    identify_above: f64,
}

/// The capacity fields: each names a unit, and a policy gives one.
const CAPACITIES: [(&str, Unit, f64); 3] = [
    ("capacityRps", Unit::Calls, MAX_CAPACITY_RPS),
    ("capacityNodeMs", Unit::NodeTime, MAX_CAPACITY_UNITS),
    ("capacityCost", Unit::Cost, MAX_CAPACITY_UNITS),
];

/// The capacity, the unit it names and the most that unit allows.
fn capacity(doc: &Document, f: &mut Fields) -> Result<(Unit, f64, f64), PolicyError> {
    let values = [doc.capacity_rps, doc.capacity_node_ms, doc.capacity_cost];
    let mut given = None;
    for ((name, unit, max), value) in CAPACITIES.iter().zip(values) {
        let value = f.or_else(name, value.map(Some), "one capacity is required", || None);
        let Some(value) = value else { continue };
        if let Some((other, _, _, _)) = given {
            return Err(PolicyError::new(
                name,
                format!("give one capacity: {other} is given, and each names the unit shares are cut in"),
            ));
        }
        given = Some((*name, *unit, finite_range(name, value, 1.0, *max)?, *max));
    }
    given.map(|(_, unit, value, max)| (unit, value, max)).ok_or_else(|| {
        PolicyError::new(
            "capacityRps",
            "missing: give the capacity in the unit shares are cut in: capacityRps (calls per second), capacityNodeMs (node milliseconds per second) or capacityCost (cost units per second)",
        )
    })
}

/// What a call costs in the unit: the table and the default.
fn costs(doc: &Document, unit: Unit, f: &mut Fields) -> Result<Costs, PolicyError> {
    let table = f.or_else("costs", doc.costs.clone(), "{}", BTreeMap::new);
    if unit == Unit::Calls {
        ensure(
            table.is_empty() && doc.default_cost.is_none(),
            if table.is_empty() {
                "defaultCost"
            } else {
                "costs"
            },
            || {
                "capacityRps shares calls, each costing 1: give capacityNodeMs or capacityCost to charge methods by cost".into()
            },
        )?;
    }
    ensure(table.len() <= MAX_METHODS, "costs", || {
        format!("{} methods: at most {MAX_METHODS}", table.len())
    })?;
    let mut by_key = HashMap::new();
    for (method, cost) in &table {
        let field = format!("costs.{method}");
        ensure(!method.is_empty() && method.len() <= 128, &field, || {
            "a method name is 1 to 128 bytes".into()
        })?;
        by_key.insert(
            method_key(method),
            finite_range(&field, *cost, 0.001, MAX_METHOD_COST)?,
        );
    }
    let largest = table.values().copied().fold(1.0, f64::max);
    let default = match unit {
        Unit::Calls => 1.0,
        Unit::NodeTime => DEFAULT_NODE_MS,
        Unit::Cost => largest,
    };
    let default = f.or_else(
        "defaultCost",
        doc.default_cost,
        "10 (ms, capacityNodeMs); the largest of costs (capacityCost)",
        || default,
    );
    let default = finite_range("defaultCost", default, 0.001, MAX_METHOD_COST)?;
    Ok(Costs {
        unit,
        table: by_key,
        default,
    })
}

fn rates(doc: &Document, mode: Mode, f: &mut Fields) -> Result<Rates, PolicyError> {
    let (unit, capacity_rps, max_capacity) = capacity(doc, f)?;
    let throttle_threshold =
        f.finite("throttleThreshold", doc.throttle_threshold, 0.95, 0.01, 1.0)?;
    let refill_interval_ms = f.range("refillIntervalMs", doc.refill_interval_ms, 20, 5, 1000)?;
    let load_smoothing = f.range("loadSmoothing", doc.load_smoothing, 40, 1, 1000)?;
    let identify_above = match (mode, doc.identify_above) {
        (Mode::Reactive, Some(above)) if above != 0.0 => {
            return Err(PolicyError::new(
                "identifyAbove",
                "reactive mode identifies every request (its capacity follows their latency): leave it out or set 0",
            ))
        }
        (Mode::Reactive, _) => 0.0,
        (Mode::Proactive, Some(above)) if unit == Unit::Cost && above != 0.0 => {
            return Err(PolicyError::new(
                "identifyAbove",
                "a call's cost is known only from its method, so with capacityCost every request is identified: leave it out or set 0",
            ))
        }
        (Mode::Proactive, _) if unit == Unit::Cost => 0.0,
        (Mode::Proactive, above) => f.finite(
            "identifyAbove",
            above,
            DEFAULT_IDENTIFY_ABOVE,
            0.0,
            throttle_threshold,
        )?,
    };
    Ok(Rates {
        unit,
        capacity_rps,
        max_capacity,
        throttle_threshold,
        refill_interval_ms,
        load_smoothing,
        identify_above,
    })
}

/// The identity table's fields, and the new identity's and the refused
/// one's.
struct Table {
    idle_ttl_ms: u64,
    max_identities: u32,
    initial_tokens: u32,
    retry_after_max_s: u32,
    websockets_per_identity: u32,
}

fn table(doc: &Document, refill_interval_ms: u64, f: &mut Fields) -> Result<Table, PolicyError> {
    // refill_interval_ms is at most 1000, so this cannot overflow.
    let min_idle = 10 * refill_interval_ms;
    let idle_ttl_ms = f.or("idleTtlMs", doc.idle_ttl_ms, 60_000);
    ensure(idle_ttl_ms >= min_idle, "idleTtlMs", || {
        format!("must be at least 10 refill intervals ({min_idle} ms); got {idle_ttl_ms}")
    })?;
    let idle_ttl_ms = range("idleTtlMs", idle_ttl_ms, min_idle, 86_400_000)?;
    let max_identities = f.range(
        "maxIdentities",
        doc.max_identities,
        10_000,
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
    Ok(Table {
        idle_ttl_ms,
        max_identities,
        initial_tokens: f.range("initialTokens", doc.initial_tokens, 8, 0, 65_535)?,
        retry_after_max_s: f.range("retryAfterMaxS", doc.retry_after_max_s, 30, 1, 3600)?,
        websockets_per_identity: f.range(
            "websocketsPerIdentity",
            doc.websockets_per_identity,
            16,
            1,
            MAX_IDENTITIES,
        )?,
    })
}

/// How a client is told apart.
struct Identity {
    order: Vec<Source>,
    api_key_header: String,
    trusted_proxies: Vec<Cidr>,
    unstaked_stake: u64,
    group_ipv4_prefix: u8,
    group_ipv6_prefix: u8,
}

fn identity(id: IdentityDoc, f: &mut Fields) -> Result<Identity, PolicyError> {
    let order = f.or(
        "identity.order",
        id.order,
        vec![Source::ApiKey, Source::PeerCertificate, Source::Address],
    );
    ensure(!order.is_empty(), "identity.order", || {
        "must name at least one source".into()
    })?;
    for (i, source) in order.iter().enumerate() {
        ensure(
            !order[..i].contains(source),
            &format!("identity.order[{i}]"),
            || format!("{source:?} is listed twice"),
        )?;
    }
    let api_key_header = f.or(
        "identity.apiKeyHeader",
        id.api_key_header,
        "x-api-key".into(),
    );
    let api_key_header = header_name("identity.apiKeyHeader", api_key_header)?;
    let trusted = f.or_else(
        "identity.trustedProxies",
        id.trusted_proxies,
        "[]",
        Vec::new,
    );
    max_len("identity.trustedProxies", &trusted, 1024)?;
    let trusted_proxies = trusted
        .iter()
        .enumerate()
        .map(|(i, text)| {
            Cidr::parse(text)
                .map_err(|e| PolicyError::new(&format!("identity.trustedProxies[{i}]"), e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Identity {
        order,
        api_key_header,
        trusted_proxies,
        unstaked_stake: f.range(
            "identity.unstakedStake",
            id.unstaked_stake,
            1000,
            1,
            MAX_STAKE,
        )?,
        group_ipv4_prefix: f.range("identity.groupIpv4Prefix", id.group_ipv4_prefix, 32, 1, 32)?,
        group_ipv6_prefix: f.range("identity.groupIpv6Prefix", id.group_ipv6_prefix, 64, 1, 128)?,
    })
}

/// The stake table, by key hash and by peer, and the tiers it names.
struct Stakes {
    by_api_key: HashMap<String, StakeEntry>,
    by_peer: HashMap<String, StakeEntry>,
    tiers: Vec<String>,
}

fn stakes(docs: Option<Vec<StakeDoc>>, f: &mut Fields) -> Result<Stakes, PolicyError> {
    let docs = f.or_else("stakes", docs, "[]", Vec::new);
    max_len("stakes", &docs, MAX_STAKE_ENTRIES)?;
    let mut stakes = Stakes {
        by_api_key: HashMap::new(),
        by_peer: HashMap::new(),
        tiers: vec!["unstaked".to_string(), "staked".to_string()],
    };
    for (i, s) in docs.into_iter().enumerate() {
        let field = |name: &str| format!("stakes[{i}].{name}");
        let entry = StakeEntry {
            name: non_empty(&field("name"), s.name)?.into(),
            stake: range(&field("stake"), s.stake, 0, MAX_STAKE)?,
            tier: match &s.tier {
                None => TIER_STAKED,
                Some(tier) => stakes.tier(&field("tier"), tier)?,
            },
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
                    stakes.by_api_key.insert(hash, entry).is_none(),
                    &field("apiKeySha256"),
                    || "is listed twice".into(),
                )?;
            }
            (None, Some(peer)) => {
                let peer = non_empty(&field("peer"), peer)?;
                ensure(
                    stakes.by_peer.insert(peer, entry).is_none(),
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
    Ok(stakes)
}

impl Stakes {
    /// The index of tier `name`, a new one if it is not known yet.
    fn tier(&mut self, field: &str, name: &str) -> Result<usize, PolicyError> {
        ensure(is_label(name), field, || {
            format!("must be 1-32 characters of a-z, 0-9, _ or -; got {name:?}")
        })?;
        if let Some(index) = self.tiers.iter().position(|known| known == name) {
            return Ok(index);
        }
        ensure(self.tiers.len() < MAX_TIERS, field, || {
            format!("at most {} distinct tiers", MAX_TIERS - 2)
        })?;
        self.tiers.push(name.to_string());
        Ok(self.tiers.len() - 1)
    }
}

/// The concurrency allowance: floor, headroom, latency smoothing.
fn concurrency(c: &ConcurrencyDoc, f: &mut Fields) -> Result<(u32, f64, f64), PolicyError> {
    Ok((
        f.range("concurrency.floor", c.floor, 4, 1, 100_000)?,
        f.finite("concurrency.headroom", c.headroom, 0.5, 0.0, 10.0)?,
        f.finite(
            "concurrency.latencySmoothing",
            c.latency_smoothing,
            0.2,
            0.001,
            1.0,
        )?,
    ))
}

/// Reactive mode's constants (read in either mode).
fn reactive(r: &ReactiveDoc, rates: &Rates, f: &mut Fields) -> Result<Reactive, PolicyError> {
    let capacity_rps = rates.capacity_rps;
    let min_capacity_rps = f.or_else(
        "reactive.minCapacityRps",
        r.min_capacity_rps,
        "capacityRps ÷ 20",
        || (capacity_rps / 20.0).max(1.0),
    );
    let max_capacity_rps = f.or_else(
        "reactive.maxCapacityRps",
        r.max_capacity_rps,
        "capacityRps × 4",
        || (capacity_rps * 4.0).min(rates.max_capacity),
    );
    Ok(Reactive {
        min_capacity_rps: finite_range(
            "reactive.minCapacityRps",
            min_capacity_rps,
            1.0,
            capacity_rps,
        )?,
        max_capacity_rps: finite_range(
            "reactive.maxCapacityRps",
            max_capacity_rps,
            capacity_rps,
            rates.max_capacity,
        )?,
        latency_tolerance: f.finite(
            "reactive.latencyTolerance",
            r.latency_tolerance,
            2.0,
            1.01,
            100.0,
        )?,
        decrease: f.finite("reactive.decrease", r.decrease, 0.9, 0.01, 0.99)?,
        increase_per_second: f.finite(
            "reactive.increasePerSecond",
            r.increase_per_second,
            0.1,
            0.001,
            10.0,
        )?,
        adjust_interval_ms: f.range(
            "reactive.adjustIntervalMs",
            r.adjust_interval_ms,
            200,
            rates.refill_interval_ms,
            60_000,
        )?,
    })
}

fn is_label(text: &str) -> bool {
    (1..=32).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests;
