//! Scenario files: one TOML format for simulated runs (`stakegate sim`) and
//! real ones (`stakegate scenario run`, in [`run`]). Documented in
//! `scenarios/README.md`.

pub mod fleet;
pub mod plot;
pub mod run;
pub mod stack;

use anyhow::{bail, Context};
use rpc_node::costs::{CostTable, Flavour};
use serde::Deserialize;
use stakegate_core::qos::policy::QosPolicy;
use stakegate_loadgen::{Phase, Schedule};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioDoc {
    name: String,
    #[serde(default)]
    description: String,
    duration: String,
    #[serde(default)]
    gateway: GatewayDoc,
    node: NodeDoc,
    clients: Vec<ClientDoc>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GatewayDoc {
    workers: Option<usize>,
    /// What the policies give out, when less than what the node serves.
    capacity_rps: Option<f64>,
    /// The node time the policies give out (ms per second), when less than
    /// the node's read slots hold.
    capacity_node_ms: Option<f64>,
    #[serde(default)]
    filters: Vec<FilterDoc>,
    /// Policies swapped in during the run.
    #[serde(default)]
    swaps: Vec<SwapDoc>,
    /// Gateway replicas (Envoys) side by side in front of the node; with
    /// more than one, stake QoS in fleet mode shares one capacity among
    /// them through Redis.
    replicas: Option<usize>,
    /// When Redis (fleet mode's engine) is stopped, and for how long.
    #[serde(default)]
    redis_outages: Vec<OutageDoc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutageDoc {
    at: String,
    duration: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SwapDoc {
    at: String,
    /// Which filter of the chain: `admission-gate` or `stake-qos`.
    filter: String,
    policy: Option<String>,
    policy_inline: Option<toml::Table>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterDoc {
    /// `admission-gate` or `stake-qos`.
    filter: String,
    /// A policy file, relative to the scenario file.
    policy: Option<String>,
    /// Or the policy inline, as a TOML table.
    policy_inline: Option<toml::Table>,
    /// Top-level fields set over the policy file's.
    policy_overrides: Option<toml::Table>,
    /// A module other than the built one.
    module: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeDoc {
    read_slots: u32,
    /// `ethereum` (default) or `solana`: the node's methods and their costs.
    #[serde(default)]
    chain: Option<String>,
    #[serde(default)]
    costs: BTreeMap<String, String>,
    #[serde(default = "default_block_interval")]
    block_interval: String,
    #[serde(default = "default_block_exec")]
    block_exec: String,
    #[serde(default = "default_sync_slots")]
    sync_slots: u32,
    #[serde(default = "default_tip_lost_after")]
    tip_lost_after: f64,
    /// Changes of the node's read slots during the run.
    #[serde(default)]
    changes: Vec<NodeChangeDoc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeChangeDoc {
    at: String,
    read_slots: Option<u32>,
    /// Methods' new service times.
    #[serde(default)]
    costs: BTreeMap<String, String>,
}

fn default_block_interval() -> String {
    "1s".into()
}
fn default_block_exec() -> String {
    "100ms".into()
}
fn default_sync_slots() -> u32 {
    2
}
fn default_tip_lost_after() -> f64 {
    3.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientDoc {
    id: String,
    rate: f64,
    #[serde(default)]
    mix: BTreeMap<String, f64>,
    #[serde(default)]
    stake: u64,
    api_key: Option<String>,
    #[serde(default = "default_listener")]
    listener: String,
    /// Round trip between the client and the gateway.
    #[serde(default = "default_latency")]
    latency: String,
    /// The client's address (default 127.0.0.1).
    source: Option<String>,
    /// The client gives up on a request after this long.
    #[serde(default = "default_timeout")]
    timeout: String,
    /// The gateway replica (1 to `gateway.replicas`) this client sends to;
    /// unset, it sends to each replica in turn.
    replica: Option<usize>,
    /// This many clients like this one, `id-1`..`id-N`, from consecutive
    /// addresses starting at `source`.
    #[serde(default = "default_replicas")]
    replicas: u32,
    /// After a timeout, 429 or 503, the same request again at once, up to
    /// this many times.
    #[serde(default)]
    retries: u32,
    /// Every request with params of its own, so retries can be told apart.
    #[serde(default)]
    unique_params: bool,
    /// Reads of history: each request at a block of the first 500, most
    /// often a recent one (`stakegate_loadgen::run::history_params`).
    #[serde(default)]
    history: bool,
    /// Changes of rate during the run: `[{ at = "5s", rate = 600 }]`.
    #[serde(default)]
    phases: Vec<PhaseDoc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PhaseDoc {
    at: String,
    rate: f64,
}

fn default_replicas() -> u32 {
    1
}

fn default_timeout() -> String {
    "30s".into()
}

fn default_listener() -> String {
    "public".into()
}
fn default_latency() -> String {
    "0ms".into()
}

/// The most gateway replicas a run starts.
const MAX_REPLICAS: usize = 8;

#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    pub duration: Duration,
    pub workers: usize,
    /// `gateway.capacity_rps`: what the policies give out, if set.
    pub gateway_capacity_rps: Option<f64>,
    /// `gateway.capacity_node_ms`: the node time they give out, if set.
    pub gateway_capacity_node_ms: Option<f64>,
    pub filters: Vec<Filter>,
    /// In time order.
    pub swaps: Vec<Swap>,
    /// Gateway replicas, at least 1.
    pub replicas: usize,
    /// Redis stopped at `.0` for `.1`, in time order.
    pub redis_outages: Vec<(Duration, Duration)>,
    pub node: Node,
    pub clients: Vec<Client>,
}

/// A new policy for `filters[filter]` at `at` into the run.
#[derive(Debug, Clone)]
pub struct Swap {
    pub at: Duration,
    pub filter: usize,
    pub policy: String,
}

#[derive(Debug, Clone)]
pub struct Filter {
    pub name: String,
    pub module: PathBuf,
    pub policy: String,
    /// A stake QoS candidate in shadow (its policy's `shadow`): it decides
    /// every request before the live stake QoS and refuses none.
    pub shadow: bool,
}

impl Filter {
    /// Whether this is the admission gate with its answer cache on.
    pub fn caches(&self) -> bool {
        self.name == "admission-gate"
            && serde_json::from_str::<serde_json::Value>(&self.policy)
                .is_ok_and(|p| p.get("cache").is_some_and(|c| !c.is_null()))
    }

    /// The shadow candidate's policy as it would enforce, if this is one.
    pub fn enforcing_policy(&self) -> anyhow::Result<String> {
        let mut value: serde_json::Value = serde_json::from_str(&self.policy)?;
        if let Some(object) = value.as_object_mut() {
            object.remove("shadow");
        }
        Ok(value.to_string())
    }
}

#[derive(Debug, Clone)]
pub struct Node {
    pub read_slots: u32,
    /// The chain whose JSON-RPC it speaks.
    pub flavour: Flavour,
    pub costs: CostTable,
    pub block_interval: Duration,
    pub block_exec: Duration,
    pub sync_slots: u32,
    pub tip_lost_after: f64,
    /// In time order.
    pub changes: Vec<NodeChange>,
}

/// A change of the node during the run: its read slots (the simulator
/// only), methods' costs, or both.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeChange {
    pub at: Duration,
    pub read_slots: Option<u32>,
    pub costs: Vec<(String, Duration)>,
}

/// A client's address when the scenario gives none.
pub const DEFAULT_SOURCE: &str = "127.0.0.1";

#[derive(Debug, Clone)]
pub struct Client {
    pub id: String,
    pub rate: f64,
    pub mix: Vec<(String, f64)>,
    pub stake: u64,
    pub api_key: Option<String>,
    pub internal: bool,
    pub latency: Duration,
    pub source: String,
    pub timeout: Duration,
    pub retries: u32,
    pub unique_params: bool,
    pub history: bool,
    /// Changes of rate during the run.
    pub phases: Vec<Phase>,
    /// Its first request comes due this long into the run.
    pub offset_ms: u64,
    /// The gateway replica it sends to (from 0); `None`: each in turn.
    pub replica: Option<usize>,
}

impl Client {
    /// When its requests come due.
    pub fn schedule(&self) -> Schedule {
        Schedule::new(self.rate, &self.phases, self.offset_ms)
    }
}

fn parse_duration(field: &str, text: &str) -> anyhow::Result<Duration> {
    humantime::parse_duration(text).with_context(|| format!("{field}: bad duration {text:?}"))
}

/// A scenario file from the command line: a path, or the name of one
/// under `scenarios/` (`tip-flood`).
pub fn resolve(arg: &str) -> PathBuf {
    let path = Path::new(arg);
    if path.exists() || arg.contains('/') {
        return path.to_path_buf();
    }
    stakegate_stack::paths::project_root()
        .join("scenarios")
        .join(format!("{}.toml", arg.trim_end_matches(".toml")))
}

impl Scenario {
    /// Whether the gate's answer cache is on in its chain.
    pub fn caches(&self) -> bool {
        self.filters.iter().any(Filter::caches)
    }

    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, dir).with_context(|| format!("scenario {}", path.display()))
    }

    /// Parses a scenario; relative policy paths are taken from `dir`.
    pub fn parse(text: &str, dir: &Path) -> anyhow::Result<Self> {
        let doc: ScenarioDoc = toml::from_str(text)?;
        let duration = parse_duration("duration", &doc.duration)?;
        let gateway_capacity_rps = doc.gateway.capacity_rps;
        if gateway_capacity_rps.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            bail!("gateway.capacity_rps: must be positive");
        }
        let gateway_capacity_node_ms = doc.gateway.capacity_node_ms;
        if gateway_capacity_node_ms.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            bail!("gateway.capacity_node_ms: must be positive");
        }
        if duration.is_zero() || duration > Duration::from_secs(3600) {
            bail!("duration: must be between 0 and 1h");
        }
        let filters: Vec<Filter> = doc
            .gateway
            .filters
            .into_iter()
            .enumerate()
            .map(|(i, f)| filter(i, f, dir))
            .collect::<anyhow::Result<_>>()?;
        let mut swaps = Vec::new();
        for (i, swap) in doc.gateway.swaps.into_iter().enumerate() {
            let field = format!("gateway.swaps[{i}]");
            let at = parse_duration(&format!("{field}.at"), &swap.at)?;
            if at >= duration {
                bail!("{field}.at: must be within the run's duration");
            }
            let Some(filter) = filters
                .iter()
                .position(|f| f.name == swap.filter && !f.shadow)
            else {
                bail!(
                    "{field}.filter: {:?} is not in gateway.filters",
                    swap.filter
                );
            };
            let policy = policy_text(&field, swap.policy, swap.policy_inline, dir)?;
            swaps.push(Swap { at, filter, policy });
        }
        swaps.sort_by_key(|s| s.at);
        check_shadow(&filters, &swaps)?;
        let replicas = doc.gateway.replicas.unwrap_or(1);
        if !(1..=MAX_REPLICAS).contains(&replicas) {
            bail!("gateway.replicas: must be 1 to {MAX_REPLICAS}");
        }
        let mut redis_outages = Vec::new();
        for (i, outage) in doc.gateway.redis_outages.iter().enumerate() {
            let field = format!("gateway.redis_outages[{i}]");
            let at = parse_duration(&format!("{field}.at"), &outage.at)?;
            let length = parse_duration(&format!("{field}.duration"), &outage.duration)?;
            if replicas < 2 {
                bail!("{field}: Redis runs only with gateway.replicas of 2 or more");
            }
            if at + length >= duration || length.is_zero() {
                bail!("{field}: must start and end within the run");
            }
            redis_outages.push((at, length));
        }
        redis_outages.sort();
        if redis_outages.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            bail!("gateway.redis_outages: must not overlap");
        }
        let node = &doc.node;
        if node.read_slots == 0 || node.sync_slots == 0 || node.sync_slots > node.read_slots {
            bail!("node: read_slots must be >= 1 and sync_slots between 1 and read_slots");
        }
        let overrides: Vec<String> = node.costs.iter().map(|(m, c)| format!("{m}={c}")).collect();
        let mut changes = Vec::new();
        for (i, change) in node.changes.iter().enumerate() {
            let at = parse_duration(&format!("node.changes[{i}].at"), &change.at)?;
            if change
                .read_slots
                .is_some_and(|slots| slots < node.sync_slots)
            {
                bail!("node.changes[{i}].read_slots: must be at least sync_slots");
            }
            if change.read_slots.is_none() && change.costs.is_empty() {
                bail!("node.changes[{i}]: give read_slots, costs or both");
            }
            let costs = change
                .costs
                .iter()
                .map(|(method, cost)| {
                    let field = format!("node.changes[{i}].costs.{method}");
                    Ok((method.clone(), parse_duration(&field, cost)?))
                })
                .collect::<anyhow::Result<_>>()?;
            changes.push(NodeChange {
                at,
                read_slots: change.read_slots,
                costs,
            });
        }
        changes.sort();
        let flavour = match node.chain.as_deref() {
            None | Some("ethereum") => Flavour::Ethereum,
            Some("solana") => Flavour::Solana,
            Some(other) => bail!("node.chain: {other:?} is not ethereum or solana"),
        };
        let node = Node {
            read_slots: node.read_slots,
            flavour,
            costs: CostTable::of(flavour)
                .with_overrides(&overrides)
                .context("node.costs")?,
            block_interval: parse_duration("node.block_interval", &node.block_interval)?,
            block_exec: parse_duration("node.block_exec", &node.block_exec)?,
            sync_slots: node.sync_slots,
            tip_lost_after: node.tip_lost_after,
            changes,
        };
        let mut clients = Vec::new();
        for (i, c) in doc.clients.into_iter().enumerate() {
            let mut phases = Vec::new();
            for (k, phase) in c.phases.iter().enumerate() {
                let at = parse_duration(&format!("clients[{i}].phases[{k}].at"), &phase.at)?;
                if at >= duration || !(phase.rate.is_finite() && phase.rate >= 0.0) {
                    bail!("clients[{i}].phases[{k}]: at must be within the run and rate 0 or more");
                }
                phases.push(Phase {
                    at_ms: at.as_millis() as u64,
                    rate: phase.rate,
                });
            }
            if !(c.rate.is_finite() && (c.rate > 0.0 || (c.rate == 0.0 && !phases.is_empty()))) {
                bail!("clients[{i}] ({}): rate must be positive", c.id);
            }
            let mix: Vec<(String, f64)> = if c.mix.is_empty() {
                vec![("eth_blockNumber".into(), 1.0)]
            } else {
                c.mix.into_iter().collect()
            };
            if let Some((method, _)) = mix.iter().find(|(m, _)| node.costs.cost(m).is_none()) {
                bail!(
                    "clients[{i}] ({}): the node has no cost for {method}; add it to node.costs",
                    c.id
                );
            }
            if !matches!(c.listener.as_str(), "public" | "internal") {
                bail!(
                    "clients[{i}] ({}): listener must be \"public\" or \"internal\"",
                    c.id
                );
            }
            let replica = match c.replica {
                None => None,
                Some(r) if (1..=replicas).contains(&r) => Some(r - 1),
                Some(_) => bail!(
                    "clients[{i}] ({}): replica must be 1 to gateway.replicas ({replicas})",
                    c.id
                ),
            };
            let client = Client {
                replica,
                latency: parse_duration(&format!("clients[{i}].latency"), &c.latency)?,
                timeout: parse_duration(&format!("clients[{i}].timeout"), &c.timeout)?,
                internal: c.listener == "internal",
                source: c.source.unwrap_or_else(|| DEFAULT_SOURCE.into()),
                id: c.id,
                rate: c.rate,
                mix,
                stake: c.stake,
                api_key: c.api_key,
                retries: c.retries,
                unique_params: c.unique_params,
                history: c.history,
                phases,
                offset_ms: 0,
            };
            match c.replicas {
                0 => bail!("clients[{i}].replicas: must be at least 1"),
                1 => clients.push(client),
                n => {
                    let first: std::net::Ipv4Addr = client.source.parse().with_context(|| {
                        format!("clients[{i}].source: replicas need an IPv4 address")
                    })?;
                    // Replicas spread their first requests over one period,
                    // as clients that never agreed on a start would.
                    let period_ms = 1000.0 / client.rate.max(f64::MIN_POSITIVE);
                    for k in 0..n {
                        clients.push(Client {
                            id: format!("{}-{}", client.id, k + 1),
                            source: std::net::Ipv4Addr::from(u32::from(first).wrapping_add(k))
                                .to_string(),
                            offset_ms: (period_ms * f64::from(k) / f64::from(n)) as u64,
                            ..client.clone()
                        });
                    }
                }
            }
        }
        if clients.is_empty() {
            bail!("clients: at least one client is needed");
        }
        Ok(Self {
            name: doc.name,
            description: doc.description,
            duration,
            workers: doc.gateway.workers.unwrap_or(2).max(1),
            gateway_capacity_rps,
            gateway_capacity_node_ms,
            filters,
            swaps,
            replicas,
            redis_outages,
            node,
            clients,
        })
    }

    /// The clients as run summaries weigh them.
    pub fn parties(&self) -> Vec<crate::summary::Party> {
        self.clients
            .iter()
            .map(|c| crate::summary::Party {
                id: c.id.clone(),
                stake: c.stake,
                offered_rps: c.schedule().mean_rate(self.duration.as_secs_f64()),
                public: !c.internal,
            })
            .collect()
    }

    /// `gateway.capacity_node_ms` if set, else the node time (ms per
    /// second) of all the node's read slots.
    /// This scenario with its shadow candidate enforcing in the live stake
    /// QoS's place, if it has one: what the candidate's prediction is
    /// checked against.
    pub fn promoted(&self) -> anyhow::Result<Option<Scenario>> {
        let Some(at) = self.filters.iter().position(|f| f.shadow) else {
            return Ok(None);
        };
        let mut promoted = self.clone();
        let candidate = promoted.filters.remove(at);
        let live = promoted.filters[at..]
            .iter_mut()
            .find(|f| f.name == candidate.name)
            .context("a shadow candidate without a live stake QoS")?;
        live.policy = candidate.enforcing_policy()?;
        live.module = candidate.module;
        for swap in &mut promoted.swaps {
            if swap.filter > at {
                swap.filter -= 1;
            }
        }
        promoted.name += " (candidate enforcing)";
        Ok(Some(promoted))
    }

    pub fn capacity_node_ms(&self) -> f64 {
        self.gateway_capacity_node_ms
            .unwrap_or(f64::from(self.node.read_slots) * 1000.0)
    }

    /// `gateway.capacity_rps` if set, else requests per second the node
    /// serves with every read slot busy, for the scenario's overall method
    /// mix (weighted by client rates).
    pub fn capacity_rps(&self) -> f64 {
        if let Some(capacity) = self.gateway_capacity_rps {
            return capacity;
        }
        let (mut weight, mut cost) = (0.0, 0.0);
        for client in &self.clients {
            let total: f64 = client.mix.iter().map(|(_, w)| w).sum();
            let rate = client.schedule().mean_rate(self.duration.as_secs_f64());
            for (method, w) in &client.mix {
                let share = rate * w / total;
                weight += share;
                cost += share
                    * self
                        .node
                        .costs
                        .cost(method)
                        .unwrap_or_default()
                        .as_secs_f64();
            }
        }
        if cost == 0.0 {
            return f64::INFINITY;
        }
        f64::from(self.node.read_slots) / (cost / weight)
    }
}

fn filter(i: usize, doc: FilterDoc, dir: &Path) -> anyhow::Result<Filter> {
    let module = match doc.module {
        Some(module) => dir.join(module),
        None => stakegate_stack::paths::wasm_module(&doc.filter.replace('-', "_"))
            .with_context(|| format!("gateway.filters[{i}]: filter {:?}", doc.filter))?,
    };
    let field = format!("gateway.filters[{i}]");
    let mut policy = policy_text(&field, doc.policy, doc.policy_inline, dir)?;
    if let Some(overrides) = doc.policy_overrides {
        let mut value: serde_json::Value = serde_json::from_str(&policy).with_context(|| {
            format!("{field}.policy: not JSON, so policy_overrides cannot apply")
        })?;
        let object = value
            .as_object_mut()
            .with_context(|| format!("{field}.policy: not a JSON object"))?;
        for (key, over) in overrides {
            object.insert(key, serde_json::to_value(over)?);
        }
        policy = value.to_string();
    }
    let shadow =
        doc.filter == "stake-qos" && QosPolicy::parse(policy.as_bytes()).is_ok_and(|p| p.shadow);
    Ok(Filter {
        name: doc.filter,
        module,
        policy,
        shadow,
    })
}

/// A shadow candidate stands before the live stake QoS it would replace,
/// as in `envoy-config/gateway.yaml`, and at most one does. The simulator
/// then runs the candidate enforcing too, to check what the shadow
/// predicted; a swap of the live stake QoS would make that comparison moot.
fn check_shadow(filters: &[Filter], swaps: &[Swap]) -> anyhow::Result<()> {
    let Some(at) = filters.iter().position(|f| f.shadow) else {
        return Ok(());
    };
    if filters.iter().filter(|f| f.shadow).count() > 1 {
        bail!("gateway.filters: one stake QoS in shadow at most");
    }
    let Some(live) = filters
        .iter()
        .skip(at + 1)
        .position(|f| f.name == "stake-qos")
        .map(|i| i + at + 1)
    else {
        bail!(
            "gateway.filters[{at}]: a stake QoS in shadow comes before the live stake QoS it is a candidate for"
        );
    };
    if swaps.iter().any(|s| s.filter == live) {
        bail!("gateway.swaps: a scenario with a shadow candidate swaps the gate only");
    }
    Ok(())
}

/// A policy given as a file (relative to `dir`) or inline, as JSON text.
fn policy_text(
    field: &str,
    path: Option<String>,
    inline: Option<toml::Table>,
    dir: &Path,
) -> anyhow::Result<String> {
    match (path, inline) {
        (Some(path), None) => std::fs::read_to_string(dir.join(&path))
            .with_context(|| format!("{field}.policy: reading {path}")),
        (None, Some(table)) => Ok(serde_json::to_string(&table)?),
        _ => bail!("{field}: give exactly one of policy (a file) or policy_inline"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_scenarios_parse() {
        // Resolving their filters needs the modules `make build` makes.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
        let mut parsed = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Scenario::load(&path).unwrap_or_else(|e| panic!("{e:#}"));
                parsed += 1;
            }
        }
        assert!(parsed > 0);
    }

    #[test]
    fn the_shipped_scenarios_with_the_answer_cache_on_are_known() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
        let caches = |name: &str| Scenario::load(&dir.join(name)).unwrap().caches();
        assert!(caches("read-mix.toml") && caches("head-reads.toml"));
        assert!(caches("node-time-under-share.toml"));
        assert!(!caches("stake-shares.toml") && !caches("node-time-qos.toml"));
    }

    #[test]
    fn errors_name_the_field() {
        let base = "name = \"x\"\nduration = \"1s\"\n[node]\nread_slots = 4\n";
        let err = |extra: &str| {
            format!(
                "{:#}",
                Scenario::parse(&format!("{base}{extra}"), Path::new(".")).unwrap_err()
            )
        };
        assert_eq!(
            err("[[clients]]\nid = \"a\"\nrate = 0\n"),
            "clients[0] (a): rate must be positive"
        );
        assert_eq!(
            err("[[clients]]\nid = \"a\"\nrate = 1\nmix = { eth_fly = 1 }\n"),
            "clients[0] (a): the node has no cost for eth_fly; add it to node.costs"
        );
        assert!(err("[[clients]]\nid = \"a\"\nrate = 1\ncolour = 3\n")
            .contains("unknown field `colour`"));
    }

    #[test]
    fn replicas_pin_clients_and_outages_need_a_fleet() {
        let text = |gateway: &str, client: &str| {
            format!(
                "name = \"x\"\nduration = \"10s\"\n[gateway]\n{gateway}\n[node]\nread_slots = 4\n\
                 [[clients]]\nid = \"a\"\nrate = 1\n{client}\n"
            )
        };
        let parse =
            |gateway: &str, client: &str| Scenario::parse(&text(gateway, client), Path::new("."));
        let scenario = parse("replicas = 3", "replica = 2").unwrap();
        assert_eq!(
            (scenario.replicas, scenario.clients[0].replica),
            (3, Some(1))
        );
        assert_eq!(parse("", "").unwrap().clients[0].replica, None);
        let err =
            |gateway: &str, client: &str| format!("{:#}", parse(gateway, client).unwrap_err());
        assert_eq!(
            err("replicas = 2", "replica = 3"),
            "clients[0] (a): replica must be 1 to gateway.replicas (2)"
        );
        assert_eq!(err("replicas = 0", ""), "gateway.replicas: must be 1 to 8");
        assert_eq!(
            err("redis_outages = [{ at = \"1s\", duration = \"1s\" }]", ""),
            "gateway.redis_outages[0]: Redis runs only with gateway.replicas of 2 or more"
        );
        assert_eq!(
            err(
                "replicas = 2\nredis_outages = [{ at = \"5s\", duration = \"5s\" }]",
                ""
            ),
            "gateway.redis_outages[0]: must start and end within the run"
        );
    }

    #[test]
    fn a_shadow_candidate_stands_before_the_live_stake_qos() {
        let qos = |policy: &str| {
            format!("[[gateway.filters]]\nfilter = \"stake-qos\"\npolicy_inline = {policy}\n")
        };
        let (shadow, live) = (
            qos("{ capacityRps = 10, shadow = true }"),
            qos("{ capacityRps = 20 }"),
        );
        let parse = |filters: &str, swaps: &str| {
            let text = format!(
                "name = \"x\"\nduration = \"10s\"\n[gateway]\n{filters}{swaps}[node]\nread_slots = 4\n\
                 [[clients]]\nid = \"a\"\nrate = 1\n"
            );
            Scenario::parse(&text, Path::new("."))
        };
        let err = |filters: &str| format!("{:#}", parse(filters, "").unwrap_err());
        let scenario = parse(&format!("{shadow}{live}"), "").unwrap();
        assert_eq!(
            scenario
                .filters
                .iter()
                .map(|f| f.shadow)
                .collect::<Vec<_>>(),
            [true, false]
        );
        // Enforcing, the candidate takes the live one's place, without
        // its shadow flag.
        let promoted = scenario.promoted().unwrap().unwrap();
        assert_eq!(promoted.filters.len(), 1);
        assert_eq!(promoted.filters[0].policy, r#"{"capacityRps":10}"#);
        assert!(parse(&live, "").unwrap().promoted().unwrap().is_none());
        assert_eq!(
            err(&format!("{live}{shadow}")),
            "gateway.filters[1]: a stake QoS in shadow comes before the live stake QoS it is a candidate for"
        );
        assert_eq!(
            err(&format!("{shadow}{shadow}{live}")),
            "gateway.filters: one stake QoS in shadow at most"
        );
        let swap = "[[gateway.swaps]]\nat = \"5s\"\nfilter = \"stake-qos\"\npolicy_inline = { capacityRps = 5 }\n";
        assert_eq!(
            format!("{:#}", parse(&format!("{shadow}{live}"), swap).unwrap_err()),
            "gateway.swaps: a scenario with a shadow candidate swaps the gate only"
        );
    }

    #[test]
    fn capacity_follows_the_mix() {
        let text = "name = \"x\"\nduration = \"1s\"\n[node]\nread_slots = 8\ncosts = { eth_call = \"20ms\" }\n\
                    [[clients]]\nid = \"a\"\nrate = 100\nmix = { eth_call = 1 }\n";
        let scenario = Scenario::parse(text, Path::new(".")).unwrap();
        assert!((scenario.capacity_rps() - 400.0).abs() < 1e-6);
    }
}
