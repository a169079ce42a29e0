//! The run summary of PRODUCT.md ("Contracts"), shared by simulated and
//! real runs so the two can be compared field by field.

use serde::Serialize;
use stakegate_loadgen::report::Second;
use stakegate_loadgen::Report;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ClientSummary {
    pub id: String,
    pub stake: u64,
    pub offered_rps: f64,
    pub admitted_rps: f64,
    /// This client's part of everything admitted.
    pub admitted_share: f64,
    /// This client's part of the total stake.
    pub stake_share: f64,
    pub status_counts: BTreeMap<String, u64>,
    /// Latency of this client's admitted requests.
    pub latency_ms: Latency,
    /// Admitted, rejected and failed requests per second of the run, by
    /// the second they came due.
    pub timeline: Vec<Second>,
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
    /// Largest |admitted_share - stake_share| over clients, in percentage points.
    pub max_share_error_pp: f64,
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
}

/// Another mechanism's admissions for the same arrivals.
#[derive(Debug, Clone, Serialize)]
pub struct BaselineSummary {
    pub mechanism: &'static str,
    pub admitted_rps: f64,
    pub max_share_error_pp: f64,
    pub clients: Vec<BaselineClient>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BaselineClient {
    pub id: String,
    pub admitted_rps: f64,
    pub admitted_share: f64,
    pub stake_share: f64,
}

impl BaselineSummary {
    /// From per-client admitted counts over `duration_s`.
    pub fn new(mechanism: &'static str, duration_s: f64, clients: &[(String, u64, u64)]) -> Self {
        let total_stake: u64 = clients.iter().map(|(_, stake, _)| stake).sum();
        let admitted: u64 = clients.iter().map(|(_, _, admitted)| admitted).sum();
        let clients: Vec<BaselineClient> = clients
            .iter()
            .map(|(id, stake, count)| BaselineClient {
                id: id.clone(),
                admitted_rps: round(*count as f64 / duration_s),
                admitted_share: ratio(*count, admitted),
                stake_share: ratio(*stake, total_stake),
            })
            .collect();
        Self {
            mechanism,
            admitted_rps: round(admitted as f64 / duration_s),
            max_share_error_pp: share_error(
                clients.iter().map(|c| (c.admitted_share, c.stake_share)),
                total_stake,
            ),
            clients,
        }
    }
}

/// Largest |admitted share - stake share| in percentage points (0 when no
/// stake is set).
fn share_error(shares: impl Iterator<Item = (f64, f64)>, total_stake: u64) -> f64 {
    if total_stake == 0 {
        return 0.0;
    }
    round(
        shares
            .map(|(admitted, stake)| (admitted - stake).abs() * 100.0)
            .fold(0.0, f64::max),
    )
}

impl Summary {
    pub fn client(&self, id: &str) -> Option<&ClientSummary> {
        self.clients.iter().find(|c| c.id == id)
    }

    /// Requests admitted over every client, per second of the run.
    pub fn admitted_by_second(&self) -> Vec<u64> {
        let seconds = self.clients.iter().map(|c| c.timeline.len()).max();
        (0..seconds.unwrap_or(0))
            .map(|s| {
                self.clients
                    .iter()
                    .filter_map(|c| c.timeline.get(s))
                    .map(|second| second.ok)
                    .sum()
            })
            .collect()
    }

    /// Summarises a real run; `stakes` gives each client's stake (absent: 0).
    pub fn from_report(
        scenario: &str,
        capacity_rps: f64,
        report: &Report,
        stakes: &BTreeMap<String, u64>,
        node: Option<NodeSummary>,
    ) -> Self {
        let duration = report.duration_s.max(f64::EPSILON);
        let total_stake: u64 = stakes.values().sum();
        let admitted_total: u64 = report.clients.iter().map(|c| c.count("200")).sum();
        let clients: Vec<ClientSummary> = report
            .clients
            .iter()
            .map(|c| {
                let stake = stakes.get(&c.header.id).copied().unwrap_or(0);
                ClientSummary {
                    id: c.header.id.clone(),
                    stake,
                    offered_rps: c.header.offered_rps,
                    admitted_rps: round(c.count("200") as f64 / duration),
                    admitted_share: ratio(c.count("200"), admitted_total),
                    stake_share: ratio(stake, total_stake),
                    status_counts: c.status.clone(),
                    latency_ms: Latency {
                        p50: c.latency_ms.ok.p50,
                        p99: c.latency_ms.ok.p99,
                        max: c.latency_ms.ok.max,
                    },
                    timeline: c.timeline.clone(),
                }
            })
            .collect();
        let max_share_error_pp = share_error(
            clients.iter().map(|c| (c.admitted_share, c.stake_share)),
            total_stake,
        );
        Self {
            scenario: scenario.into(),
            mode: "real",
            duration_s: round(report.duration_s),
            capacity_rps,
            offered_rps: round(clients.iter().map(|c| c.offered_rps).sum()),
            admitted_rps: round(admitted_total as f64 / duration),
            status_counts: report.status.clone(),
            latency_ms: Latency {
                p50: report.latency_ms.ok.p50,
                p99: report.latency_ms.ok.p99,
                max: report.latency_ms.ok.max,
            },
            max_share_error_pp,
            clients,
            node,
            baselines: Vec::new(),
            swaps: Vec::new(),
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
    if whole == 0 {
        0.0
    } else {
        (part as f64 / whole as f64 * 1e4).round() / 1e4
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
