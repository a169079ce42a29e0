//! What happened, per client: status counts, latency histograms, a timeline.
//!
//! Latency is measured from the moment a request was *due* on the schedule,
//! not from when it was sent, so a stalled sender cannot hide queueing
//! (no coordinated omission). Rejections are also timed from when they were
//! sent, which is how long the gateway took to answer them, apart from any
//! lag of the sender itself.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Status(u16),
    TransportError,
    Timeout,
}

impl Outcome {
    fn key(self) -> &'static str {
        match self {
            Outcome::Status(200) => "200",
            Outcome::Status(429) => "429",
            Outcome::Status(503) => "503",
            Outcome::Status(_) => "other",
            Outcome::TransportError => "transport_error",
            Outcome::Timeout => "timeout",
        }
    }

    fn is_rejection(self) -> bool {
        matches!(self, Outcome::Status(429 | 503))
    }
}

/// Per-second counts, by the second the request came due.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Second {
    pub ok: u64,
    pub rejected: u64,
    pub failed: u64,
    /// Node time the answers of this second's requests took, in ms, as the
    /// node says (`x-node-service-us`, rpc-node's); 0 from other nodes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub node_ms: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

#[derive(Debug)]
pub struct Recorder {
    status: BTreeMap<&'static str, u64>,
    rpc_errors: u64,
    all: Histogram<u64>,
    ok: Histogram<u64>,
    rejected: Histogram<u64>,
    rejected_service: Histogram<u64>,
    timeline: Vec<Second>,
}

fn histogram() -> Histogram<u64> {
    // Microseconds from 1 µs to one hour, 3 significant digits. The bounds
    // are constants, so construction cannot fail.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap_or_else(|_| unreachable!())
}

impl Default for Recorder {
    fn default() -> Self {
        let status = ["200", "429", "503", "other", "transport_error", "timeout"]
            .into_iter()
            .map(|k| (k, 0))
            .collect();
        Self {
            status,
            rpc_errors: 0,
            all: histogram(),
            ok: histogram(),
            rejected: histogram(),
            rejected_service: histogram(),
            timeline: Vec::new(),
        }
    }
}

impl Recorder {
    /// `second` is when the request came due, from the start of the run;
    /// `latency` runs from the due time and `service` from the send;
    /// `node` is the node's own time on it, when it says.
    pub fn record(
        &mut self,
        second: usize,
        outcome: Outcome,
        latency: Duration,
        service: Duration,
        node: Option<Duration>,
        rpc_error: bool,
    ) {
        *self.status.entry(outcome.key()).or_default() += 1;
        self.rpc_errors += u64::from(rpc_error);
        let micros = |d: Duration| (d.as_micros() as u64).clamp(1, 3_600_000_000);
        let (service, micros) = (micros(service), micros(latency));
        self.all.saturating_record(micros);
        if self.timeline.len() <= second {
            self.timeline.resize(second + 1, Second::default());
        }
        let slot = &mut self.timeline[second];
        slot.node_ms += node.map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        match outcome {
            Outcome::Status(200) => {
                self.ok.saturating_record(micros);
                slot.ok += 1;
            }
            o if o.is_rejection() => {
                self.rejected.saturating_record(micros);
                self.rejected_service.saturating_record(service);
                slot.rejected += 1;
            }
            _ => slot.failed += 1,
        }
    }

    /// Adds another recorder's histograms and counts into this one.
    pub fn merge(&mut self, other: &Recorder) {
        for (key, count) in &other.status {
            *self.status.entry(key).or_default() += count;
        }
        self.rpc_errors += other.rpc_errors;
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.all.add(&other.all);
        let _ = self.ok.add(&other.ok);
        let _ = self.rejected.add(&other.rejected);
        let _ = self.rejected_service.add(&other.rejected_service);
    }

    pub fn status(&self) -> BTreeMap<String, u64> {
        self.status
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect()
    }

    pub fn latencies(&self) -> Latencies {
        Latencies {
            all: LatencySummary::of(&self.all),
            ok: LatencySummary::of(&self.ok),
            rejected: LatencySummary::of(&self.rejected),
            rejected_service: LatencySummary::of(&self.rejected_service),
        }
    }

    pub fn finish(&self, header: ClientHeader) -> ClientReport {
        ClientReport {
            header,
            status: self.status(),
            rpc_errors: self.rpc_errors,
            latency_ms: self.latencies(),
            timeline: self.timeline.clone(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl LatencySummary {
    fn of(h: &Histogram<u64>) -> Self {
        let ms = |micros: u64| micros as f64 / 1000.0;
        Self {
            count: h.len(),
            mean: h.mean().round() / 1000.0,
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Latencies {
    /// Every answered or failed request.
    pub all: LatencySummary,
    /// Requests answered 200.
    pub ok: LatencySummary,
    /// Requests rejected with 429 or 503.
    pub rejected: LatencySummary,
    /// The same rejections, timed from when they were sent rather than due:
    /// the gateway's answer time without the sender's own lag.
    pub rejected_service: LatencySummary,
}

/// The schedule side of a client's report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClientHeader {
    pub id: String,
    pub requested_rps: f64,
    /// Requests that came due, over the time the schedule actually took.
    pub offered_rps: f64,
    pub scheduled: u64,
    pub sent: u64,
    pub skipped_at_cap: u64,
    /// How late the sender ever was against the schedule.
    pub dispatch_lag_max_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClientReport {
    #[serde(flatten)]
    pub header: ClientHeader,
    /// Counts by "200", "429", "503", "other", "transport_error", "timeout".
    pub status: BTreeMap<String, u64>,
    /// 200 responses whose body carried a JSON-RPC error.
    pub rpc_errors: u64,
    pub latency_ms: Latencies,
    pub timeline: Vec<Second>,
}

impl ClientReport {
    pub fn count(&self, key: &str) -> u64 {
        self.status.get(key).copied().unwrap_or(0)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub target: String,
    pub duration_s: f64,
    pub http2: bool,
    /// Status counts over every client.
    pub status: BTreeMap<String, u64>,
    /// Latency over every client.
    pub latency_ms: Latencies,
    pub clients: Vec<ClientReport>,
}

impl Report {
    pub fn count(&self, key: &str) -> u64 {
        self.status.get(key).copied().unwrap_or(0)
    }

    pub fn client(&self, id: &str) -> Option<&ClientReport> {
        self.clients.iter().find(|c| c.header.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn header() -> ClientHeader {
        ClientHeader {
            id: "a".into(),
            requested_rps: 1.0,
            offered_rps: 1.0,
            scheduled: 4,
            sent: 4,
            skipped_at_cap: 0,
            dispatch_lag_max_ms: 0.0,
        }
    }

    #[test]
    fn outcomes_land_in_their_buckets() {
        let mut r = Recorder::default();
        r.record(0, Outcome::Status(200), 2 * MS, MS, Some(MS), false);
        r.record(0, Outcome::Status(200), 4 * MS, MS, Some(3 * MS), true);
        r.record(1, Outcome::Status(503), MS, MS, None, false);
        r.record(1, Outcome::Status(500), MS, MS, None, false);
        r.record(2, Outcome::Timeout, 1000 * MS, MS, None, false);
        let report = r.finish(header());
        assert_eq!(report.count("200"), 2);
        assert_eq!(report.count("503"), 1);
        assert_eq!(report.count("other"), 1);
        assert_eq!(report.count("timeout"), 1);
        assert_eq!(report.count("429"), 0);
        assert_eq!(report.rpc_errors, 1);
        assert_eq!(report.latency_ms.ok.count, 2);
        // hdrhistogram keeps 3 significant digits.
        assert!(
            (report.latency_ms.ok.max - 4.0).abs() < 0.005,
            "{}",
            report.latency_ms.ok.max
        );
        assert_eq!(report.latency_ms.rejected.count, 1);
        assert_eq!(report.latency_ms.rejected_service.count, 1);
        assert_eq!(report.latency_ms.all.count, 5);
        assert_eq!(
            report.timeline,
            vec![
                Second {
                    ok: 2,
                    rejected: 0,
                    failed: 0,
                    node_ms: 4.0,
                },
                Second {
                    ok: 0,
                    rejected: 1,
                    failed: 1,
                    node_ms: 0.0,
                },
                Second {
                    ok: 0,
                    rejected: 0,
                    failed: 1,
                    node_ms: 0.0,
                },
            ]
        );
    }
}
