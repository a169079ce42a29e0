//! The run summary, shared by simulated and real runs so the two can be
//! compared field by field (documented in `scenarios/README.md`).
//!
//! **Fairness** is measured against each client's weighted max-min fair
//! share of what it offered (`stakegate_core::qos::fair`, the same rule the
//! stake QoS filter allocates by): the capacity is shared by stake among the
//! clients that offer more than their part, and the others get what they
//! offer. A client's weight is its stake, at least 1000 (the implicit stake
//! of an unstaked client). Raw stake shares are only fair when every client
//! floods. Clients on the internal listener are outside the shares.

use serde::Serialize;
use stakegate_core::qos::fair::{self, Claim};
use stakegate_loadgen::report::{LatencySummary, Second};
use stakegate_loadgen::Report;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    fn of(l: &LatencySummary) -> Self {
        Self {
            p50: l.p50,
            p99: l.p99,
            max: l.max,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ClientSummary {
    pub id: String,
    pub stake: u64,
    pub offered_rps: f64,
    pub admitted_rps: f64,
    /// This client's part of what the public clients were admitted, from
    /// `steady_from_s` on.
    pub admitted_share: f64,
    /// This client's part of the total stake.
    pub stake_share: f64,
    /// Its part under weighted max-min fairness of the rates offered, from
    /// `steady_from_s` on (see the module doc).
    pub fair_share: f64,
    /// On the public listener (internal clients are outside the shares).
    pub public: bool,
    pub status_counts: BTreeMap<String, u64>,
    /// Latency of this client's admitted requests.
    pub latency_ms: Latency,
    /// How soon this client's rejected requests (429, 503) were answered,
    /// from when they were sent.
    pub rejected_latency_ms: Latency,
    /// Node time, in ms, for what the node answered this client, and its
    /// part of the public clients' node time and its weighted max-min fair
    /// part of it (`Summary::measure_node_time`).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub node_time: Option<ClientNodeTime>,
    /// Admitted, rejected and failed requests per second of the run, by
    /// the second they came due.
    pub timeline: Vec<Second>,
}

/// A client's node time: all of it, and its shares over the steady seconds.
#[derive(Debug, Clone, Serialize)]
pub struct ClientNodeTime {
    /// Over the whole run.
    pub node_ms: f64,
    pub node_share: f64,
    pub fair_node_share: f64,
}

/// The run's node time, over the steady seconds: shares as for calls, with
/// each client's offered node time its offered calls times what its
/// answered calls cost the node on average.
#[derive(Debug, Clone, Serialize)]
pub struct NodeTime {
    /// The node time given out per second (ms/s): QoS's capacity in the
    /// node-time unit, else all the node's read slots.
    pub capacity_node_ms: f64,
    pub max_node_share_error_pp: f64,
    /// Node time used ÷ `capacity_node_ms`, when the public clients offered
    /// at least it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_fill: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeSummary {
    pub tip_lag_max_ms: f64,
    pub tip_lost: bool,
    pub queue_max: u64,
    pub inflight_max: u64,
    pub blocks_executed: u64,
    /// What reached the node, when it counts it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<Upstream>,
    /// Of the requests answered 200, the share the node never saw (the
    /// gateway answered them: its answer cache, coalescing), in a real run:
    /// `1 - requests at the node / answered`. The gateway's own calls (the
    /// finality poll) count as the node's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calls_avoided: Option<f64>,
    /// What the run does not model of the gate's answer cache, if it is
    /// on (the simulator).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<&'static str>,
    /// Per second of a real run, sampled from the node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<NodeSecond>,
}

/// The node during one second of a run: the largest values sampled.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeSecond {
    pub tip_lag_ms: f64,
    pub queue_depth: u64,
}

/// A policy swapped in during a run, and how it went.
#[derive(Debug, Clone, Serialize)]
pub struct SwapResult {
    /// When it was applied, in seconds into the run.
    pub at_s: f64,
    pub filter: String,
    /// The ECDS version Envoy confirmed, or the error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apply_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Requests that reached the node, against the distinct requests among
/// them (same method and params, whatever the id).
#[derive(Debug, Clone, Serialize)]
pub struct Upstream {
    pub requests: u64,
    pub unique_requests: u64,
    /// `requests / unique_requests`: 1.0 when no request reached the node
    /// twice.
    pub amplification: f64,
}

impl std::fmt::Display for SwapResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "swap of {} at {:.1} s", self.filter, self.at_s)?;
        match (&self.error, self.version, self.apply_ms) {
            (Some(error), ..) => write!(f, ": FAILED: {error}"),
            (None, Some(version), Some(ms)) => {
                write!(f, ": version {version}, applied by Envoy in {ms} ms")
            }
            _ => write!(f, ": applied"),
        }
    }
}

impl Upstream {
    pub fn new(requests: u64, unique_requests: u64) -> Self {
        Self {
            requests,
            unique_requests,
            amplification: if unique_requests == 0 {
                1.0
            } else {
                round(requests as f64 / unique_requests as f64)
            },
        }
    }
}

impl NodeSummary {
    /// From rpc-node's `/metrics` document.
    pub fn from_metrics(metrics: &serde_json::Value) -> Self {
        Self {
            tip_lag_max_ms: metrics["tip_lag_max_ms"].as_f64().unwrap_or(0.0),
            tip_lost: metrics["tip_lost"].as_bool().unwrap_or(false),
            queue_max: metrics["queue_max"].as_u64().unwrap_or(0),
            inflight_max: metrics["inflight_max"].as_u64().unwrap_or(0),
            blocks_executed: metrics["head"].as_u64().unwrap_or(0),
            upstream: metrics["requests"].as_u64().map(|requests| {
                Upstream::new(requests, metrics["unique_requests"].as_u64().unwrap_or(0))
            }),
            timeline: Vec::new(),
            calls_avoided: None,
            cache: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub scenario: String,
    /// "sim" or "real".
    pub mode: &'static str,
    pub duration_s: f64,
    pub capacity_rps: f64,
    pub offered_rps: f64,
    pub admitted_rps: f64,
    /// "200", "429", "503", "other", "transport_error", "timeout".
    pub status_counts: BTreeMap<String, u64>,
    /// Latency of admitted (200) requests.
    pub latency_ms: Latency,
    /// Largest |admitted_share - fair_share| over clients, in percentage
    /// points, over the seconds from `steady_from_s` on.
    pub max_share_error_pp: f64,
    /// Where the shares and the fill are measured from.
    pub steady_from_s: f64,
    /// Admitted ÷ capacity from `steady_from_s` on, when the public clients
    /// offered at least the capacity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fill: Option<f64>,
    /// Node-time shares, when the node said what its answers cost.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub node_time: Option<NodeTime>,
    pub clients: Vec<ClientSummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeSummary>,
    /// What other admission mechanisms would have done with the same
    /// traffic (`stakegate sim --baseline`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub baselines: Vec<BaselineSummary>,
    /// Policies swapped in during the run (`gateway.swaps`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub swaps: Vec<SwapResult>,
    /// The filters' own metrics at the end of a simulated run, by name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub filter_metrics: BTreeMap<String, i64>,
    /// A run with several gateway replicas (`gateway.replicas`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetSummary>,
    /// A stake QoS candidate in shadow: what it predicted against what it
    /// refused enforcing the same traffic (the simulator only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowCheck>,
}

/// A shadow candidate's prediction, checked: the simulator runs the same
/// seeded traffic again with the candidate enforcing in the live one's
/// place, and compares its refusals per identity.
#[derive(Debug, Clone, Serialize)]
pub struct ShadowCheck {
    pub identities: Vec<ShadowIdentity>,
    /// The largest prediction error over identities, in per cent of what the
    /// candidate refused enforcing (of its requests, for an identity it
    /// refused nothing).
    pub max_error_pct: f64,
}

/// One identity (a usage-ledger label), counted by stake QoS's own rules.
#[derive(Debug, Clone, Serialize)]
pub struct ShadowIdentity {
    pub identity: String,
    pub requests: u64,
    /// Refused by the live stake QoS in the shadow run.
    pub live_refused: u64,
    /// What the candidate, in shadow, would have refused.
    pub would_refuse: u64,
    /// What the candidate refused when it enforced.
    pub refused_enforcing: u64,
    pub error_pct: f64,
}

impl ShadowIdentity {
    pub fn new(
        identity: String,
        requests: u64,
        live_refused: u64,
        would_refuse: u64,
        refused_enforcing: u64,
    ) -> Self {
        let base = if refused_enforcing > 0 {
            refused_enforcing
        } else {
            requests.max(1)
        };
        let error_pct = 100.0 * would_refuse.abs_diff(refused_enforcing) as f64 / base as f64;
        Self {
            identity,
            requests,
            live_refused,
            would_refuse,
            refused_enforcing,
            error_pct,
        }
    }
}

impl ShadowCheck {
    pub fn new(identities: Vec<ShadowIdentity>) -> Self {
        let max_error_pct = identities.iter().map(|i| i.error_pct).fold(0.0, f64::max);
        Self {
            identities,
            max_error_pct,
        }
    }
}

/// Several gateway replicas sharing one capacity (stake QoS fleet mode).
#[derive(Debug, Clone, Serialize)]
pub struct FleetSummary {
    pub replicas: usize,
    /// The fewest replicas any replica counted in the fleet, sampled before
    /// the first outage.
    pub replicas_seen_min: i64,
    /// The run cut at Redis's outages: `fleet` before the first, `redis
    /// away` during each, `redis back` from two seconds after each.
    pub phases: Vec<FleetPhase>,
    pub redis_outages: Vec<Outage>,
    /// How long an exchange with Redis took, from Envoy's histogram (the
    /// slowest replica's quantiles over the run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exchange_ms: Option<ExchangeLatency>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ExchangeLatency {
    pub p50: f64,
    pub p99: f64,
}

/// Whole seconds of a fleet run, fleet-wide.
#[derive(Debug, Clone, Serialize)]
pub struct FleetPhase {
    pub phase: String,
    pub from_s: f64,
    pub to_s: f64,
    pub admitted_rps: f64,
    /// `admitted_rps` ÷ the fleet's capacity.
    pub of_capacity: f64,
    /// Against each client's fleet-wide weighted max-min share.
    pub max_share_error_pp: f64,
    /// Requests that got no answer (transport errors, timeouts, other
    /// statuses than 200, 429 and 503).
    pub failed: u64,
}

/// Redis stopped during a run, as measured.
#[derive(Debug, Clone, Serialize)]
pub struct Outage {
    /// When it was stopped, and when it answered again, seconds into the run.
    pub at_s: f64,
    pub back_s: f64,
    /// From `at_s` until every replica ran on its fallback share.
    pub all_on_fallback_after_s: Option<f64>,
    /// From `back_s` until no replica did.
    pub fleet_shares_back_after_s: Option<f64>,
}

/// Another mechanism's admissions for the same arrivals.
#[derive(Debug, Clone, Serialize)]
pub struct BaselineSummary {
    pub mechanism: &'static str,
    pub admitted_rps: f64,
    pub max_share_error_pp: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fill: Option<f64>,
    pub clients: Vec<BaselineClient>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BaselineClient {
    pub id: String,
    pub admitted_rps: f64,
    pub admitted_share: f64,
    pub stake_share: f64,
    pub fair_share: f64,
}

/// A client as the shares see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Party {
    pub id: String,
    pub stake: u64,
    pub offered_rps: f64,
    /// On the public listener (internal clients are outside the shares).
    pub public: bool,
}

/// The implicit stake of an unstaked client, and every stake's floor.
pub const UNSTAKED_STAKE: u64 = 1000;

/// Shares are measured from this second of a run on: the first seconds
/// are the filters' demand estimates settling.
pub const WARMUP_S: usize = 2;

/// Fairness over some seconds of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Fairness {
    /// Per party, its part of what the public parties were admitted.
    pub admitted: Vec<f64>,
    /// Per party, its part under weighted max-min fairness, second by
    /// second, of the rates it offered.
    pub fair: Vec<f64>,
    pub max_error_pp: f64,
    /// Admitted ÷ capacity, when the public parties offered at least it.
    pub fill: Option<f64>,
}

/// Fairness over `seconds` of a run: `offered[i][s]` and `admitted[i][s]`
/// are party `i`'s requests due and admitted in second `s`. Each second's
/// fair parts are water-filling of that second's offered rates over the
/// capacity (so a client that changes its rate mid-run is held to what it
/// offered when it offered it).
pub fn fairness(
    parties: &[Party],
    offered: &[Vec<u64>],
    admitted: &[Vec<u64>],
    capacity_rps: f64,
    seconds: std::ops::Range<usize>,
) -> Fairness {
    let floats = |rows: &[Vec<u64>]| -> Vec<Vec<f64>> {
        rows.iter()
            .map(|r| r.iter().map(|&v| v as f64).collect())
            .collect()
    };
    fairness_of(
        parties,
        &floats(offered),
        &floats(admitted),
        capacity_rps,
        seconds,
    )
}

/// `fairness` of any measure (calls, node time): `offered[i][s]` and
/// `admitted[i][s]` are party `i`'s in second `s`, `capacity` per second.
pub fn fairness_of(
    parties: &[Party],
    offered: &[Vec<f64>],
    admitted: &[Vec<f64>],
    capacity_rps: f64,
    seconds: std::ops::Range<usize>,
) -> Fairness {
    let n = parties.len();
    let (mut fair, mut got) = (vec![0.0; n], vec![0.0; n]);
    let (mut offered_total, mut admitted_total) = (0.0, 0.0);
    let at = |rows: &[Vec<f64>], i: usize, s: usize| rows.get(i).and_then(|r| r.get(s)).copied();
    for s in seconds.clone() {
        let claims: Vec<Claim> = parties
            .iter()
            .enumerate()
            .map(|(i, p)| Claim {
                demand: if p.public {
                    at(offered, i, s).unwrap_or(0.0)
                } else {
                    0.0
                },
                weight: p.stake.max(UNSTAKED_STAKE) as f64,
            })
            .collect();
        for (i, part) in fair::shares(&claims, capacity_rps).into_iter().enumerate() {
            fair[i] += part;
        }
        for (i, _) in parties.iter().enumerate().filter(|(_, p)| p.public) {
            got[i] += at(admitted, i, s).unwrap_or(0.0);
            offered_total += at(offered, i, s).unwrap_or(0.0);
            admitted_total += at(admitted, i, s).unwrap_or(0.0);
        }
    }
    let fair_total: f64 = fair.iter().sum();
    let fair: Vec<f64> = fair
        .iter()
        .map(|f| {
            if fair_total > 0.0 {
                round_share(f / fair_total)
            } else {
                0.0
            }
        })
        .collect();
    let admitted: Vec<f64> = parties
        .iter()
        .zip(&got)
        .map(|(p, g)| {
            if p.public {
                share(*g, admitted_total)
            } else {
                0.0
            }
        })
        .collect();
    let max_error_pp = round(
        parties
            .iter()
            .zip(admitted.iter().zip(&fair))
            .filter(|(p, _)| p.public)
            .map(|(_, (a, f))| (a - f).abs() * 100.0)
            .fold(0.0, f64::max),
    );
    let span = seconds.len() as f64;
    let fill = (capacity_rps.is_finite() && span > 0.0 && offered_total >= capacity_rps * span)
        .then(|| round(admitted_total / span / capacity_rps));
    Fairness {
        admitted,
        fair,
        max_error_pp,
        fill,
    }
}

/// The steady seconds of a run `duration_s` long: from `WARMUP_S` (or a
/// quarter of a short run) to the last whole second.
pub fn steady_seconds(duration_s: f64) -> std::ops::Range<usize> {
    let whole = duration_s.floor() as usize;
    WARMUP_S.min(whole / 4)..whole.max(1)
}

impl BaselineSummary {
    /// From per-party, per-second counts: `offered` as the run's clients
    /// sent them, `admitted` as this mechanism would have admitted them.
    pub fn new(
        mechanism: &'static str,
        duration_s: f64,
        capacity_rps: f64,
        parties: &[Party],
        offered: &[Vec<u64>],
        admitted: &[Vec<u64>],
    ) -> Self {
        let total_stake: u64 = parties.iter().map(|p| p.stake).sum();
        let shares = fairness(
            parties,
            offered,
            admitted,
            capacity_rps,
            steady_seconds(duration_s),
        );
        let clients: Vec<BaselineClient> = parties
            .iter()
            .enumerate()
            .map(|(i, p)| BaselineClient {
                id: p.id.clone(),
                admitted_rps: round(admitted[i].iter().sum::<u64>() as f64 / duration_s),
                admitted_share: shares.admitted[i],
                stake_share: ratio(p.stake, total_stake),
                fair_share: shares.fair[i],
            })
            .collect();
        Self {
            mechanism,
            admitted_rps: round(admitted.iter().flatten().sum::<u64>() as f64 / duration_s),
            max_share_error_pp: shares.max_error_pp,
            fill: shares.fill,
            clients,
        }
    }
}

impl Summary {
    pub fn client(&self, id: &str) -> Option<&ClientSummary> {
        self.clients.iter().find(|c| c.id == id)
    }

    /// The run's seconds, as the clients' timelines count them.
    pub fn seconds(&self) -> usize {
        self.clients
            .iter()
            .map(|c| c.timeline.len())
            .max()
            .unwrap_or(0)
    }

    /// The clients as the shares see them.
    pub fn parties(&self) -> Vec<Party> {
        self.clients
            .iter()
            .map(|c| Party {
                id: c.id.clone(),
                stake: c.stake,
                offered_rps: c.offered_rps,
                public: c.public,
            })
            .collect()
    }

    /// Node-time shares from the clients' timelines, against
    /// `capacity_node_ms` per second; nothing when no answer said what it
    /// cost the node.
    pub fn measure_node_time(&mut self, capacity_node_ms: f64) {
        let used = |c: &ClientSummary| c.timeline.iter().map(|s| s.node_ms).sum::<f64>();
        if self.clients.iter().all(|c| used(c) == 0.0) {
            return;
        }
        let parties = self.parties();
        let per_call: Vec<f64> = self
            .clients
            .iter()
            .map(|c| {
                let ok: u64 = c.timeline.iter().map(|s| s.ok).sum();
                if ok == 0 {
                    0.0
                } else {
                    used(c) / ok as f64
                }
            })
            .collect();
        let offered: Vec<Vec<f64>> = self
            .clients
            .iter()
            .zip(&per_call)
            .map(|(c, cost)| {
                let calls = |s: &Second| (s.ok + s.rejected + s.failed) as f64;
                c.timeline.iter().map(|s| calls(s) * cost).collect()
            })
            .collect();
        let admitted: Vec<Vec<f64>> = self
            .clients
            .iter()
            .map(|c| c.timeline.iter().map(|s| s.node_ms).collect())
            .collect();
        let seconds = steady_seconds(self.duration_s);
        let shares = fairness_of(&parties, &offered, &admitted, capacity_node_ms, seconds);
        for (i, c) in self.clients.iter_mut().enumerate() {
            c.node_time = Some(ClientNodeTime {
                node_ms: round(used(c)),
                node_share: shares.admitted[i],
                fair_node_share: shares.fair[i],
            });
        }
        self.node_time = Some(NodeTime {
            capacity_node_ms,
            max_node_share_error_pp: shares.max_error_pp,
            node_fill: shares.fill,
        });
    }

    /// Requests admitted over every client, per second of the run.
    pub fn admitted_by_second(&self) -> Vec<u64> {
        (0..self.seconds())
            .map(|s| {
                self.clients
                    .iter()
                    .filter_map(|c| c.timeline.get(s))
                    .map(|second| second.ok)
                    .sum()
            })
            .collect()
    }

    /// Summarises a run from its load report; `parties` says each client's
    /// stake and listener (a client not in it is public with no stake).
    pub fn from_report(
        scenario: &str,
        capacity_rps: f64,
        report: &Report,
        parties: &[Party],
        node: Option<NodeSummary>,
    ) -> Self {
        let duration = report.duration_s.max(f64::EPSILON);
        let total_stake: u64 = parties.iter().map(|p| p.stake).sum();
        let parties: Vec<Party> = report
            .clients
            .iter()
            .map(|c| {
                let known = parties.iter().find(|p| p.id == c.header.id);
                Party {
                    id: c.header.id.clone(),
                    stake: known.map_or(0, |p| p.stake),
                    offered_rps: c.header.offered_rps,
                    public: known.is_none_or(|p| p.public),
                }
            })
            .collect();
        let admitted: Vec<u64> = report.clients.iter().map(|c| c.count("200")).collect();
        let per_second = |f: fn(&Second) -> u64| -> Vec<Vec<u64>> {
            report
                .clients
                .iter()
                .map(|c| c.timeline.iter().map(f).collect())
                .collect()
        };
        let shares = fairness(
            &parties,
            &per_second(|s| s.ok + s.rejected + s.failed),
            &per_second(|s| s.ok),
            capacity_rps,
            steady_seconds(report.duration_s),
        );
        let clients: Vec<ClientSummary> = report
            .clients
            .iter()
            .zip(&parties)
            .enumerate()
            .map(|(i, (c, p))| ClientSummary {
                id: c.header.id.clone(),
                stake: p.stake,
                offered_rps: c.header.offered_rps,
                admitted_rps: round(c.count("200") as f64 / duration),
                admitted_share: shares.admitted[i],
                stake_share: ratio(p.stake, total_stake),
                fair_share: shares.fair[i],
                public: p.public,
                status_counts: c.status.clone(),
                latency_ms: Latency::of(&c.latency_ms.ok),
                rejected_latency_ms: Latency::of(&c.latency_ms.rejected_service),
                node_time: None,
                timeline: c.timeline.clone(),
            })
            .collect();
        Self {
            scenario: scenario.into(),
            mode: "real",
            duration_s: round(report.duration_s),
            capacity_rps,
            offered_rps: round(clients.iter().map(|c| c.offered_rps).sum()),
            admitted_rps: round(admitted.iter().sum::<u64>() as f64 / duration),
            status_counts: report.status.clone(),
            latency_ms: Latency::of(&report.latency_ms.ok),
            max_share_error_pp: shares.max_error_pp,
            fill: shares.fill,
            node_time: None,
            steady_from_s: steady_seconds(report.duration_s).start as f64,
            clients,
            node,
            baselines: Vec::new(),
            swaps: Vec::new(),
            filter_metrics: BTreeMap::new(),
            fleet: None,
            shadow: None,
        }
    }
}

/// Writes `summary` as `dir/summary.json` and says where.
pub fn write(dir: &std::path::Path, summary: &impl Serialize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(summary)?)?;
    eprintln!("summary written to {}", path.display());
    Ok(())
}

fn ratio(part: u64, whole: u64) -> f64 {
    share(part as f64, whole as f64)
}

fn share(part: f64, whole: f64) -> f64 {
    if whole == 0.0 {
        0.0
    } else {
        (part / whole * 1e4).round() / 1e4
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn round_share(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}
