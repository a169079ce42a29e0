//! The QoS filter's Envoy stats (`stakegate_qos_*` at `/stats/prometheus`),
//! each declared once, in the tables below.
//!
//! Requests bump local counts; each tick (every refill interval) hands them
//! to Envoy and sets the gauges from the shared state this VM just read, so
//! stats are at most one interval behind.

use proxy_wasm::types::MetricType;
use stakegate_core::qos::{Reason, StakeQos};
use stakegate_core::shared::StoreCounts;
use stakegate_glue::metrics::{self, add, set};

/// What requests and ticks counted since the last flush.
#[derive(Default)]
struct Counts {
    throttled_concurrency: u64,
    websockets_refused: u64,
    rounds: u64,
    store: StoreCounts,
    evicted: u64,
    leases: u64,
    websocket_calls: u64,
    fleet_exchanges: u64,
    fleet_failures: u64,
    /// Requests counted without identifying them (`qos::light`).
    counted: u64,
}

/// How a counter reads its count.
type Count = fn(&Counts) -> u64;

/// How a gauge reads its value: from this VM's QoS (the shared state as of
/// its last tick).
type Gauge = fn(&StakeQos) -> u64;

/// Counters: name, and the count it reports.
const COUNTERS: &[(&str, Count)] = &[
    ("throttled_concurrency", |c| c.throttled_concurrency),
    ("websocket.refused", |c| c.websockets_refused),
    ("rounds", |c| c.rounds),
    ("cas_retries", |c| c.store.cas_retries),
    ("store_errors", |c| c.store.store_errors),
    ("evicted", |c| c.evicted),
    ("leases", |c| c.leases),
    ("websocket.calls", |c| c.websocket_calls),
    ("fleet.exchanges", |c| c.fleet_exchanges),
    ("fleet.exchange_failures", |c| c.fleet_failures),
    ("counted", |c| c.counted),
];

/// Gauges: name, and its value.
const GAUGES: &[(&str, Gauge)] = &[
    ("throttling", |q| u64::from(q.state().throttling)),
    ("load_rps", |q| {
        q.state().load_rps(q.policy().refill_interval_ms).round() as u64
    }),
    ("capacity_rps", |q| q.state().capacity_rps.round() as u64),
    ("identities", |q| q.state().identities),
    ("counting", |q| u64::from(q.counting())),
];

/// A counter per tier (`admitted.<tier>`, `throttled.<tier>`).
struct PerTier {
    ids: Vec<u32>,
    counts: Vec<u64>,
}

impl PerTier {
    fn define(what: &str, tiers: &[String]) -> Result<Self, String> {
        Ok(Self {
            ids: tiers
                .iter()
                .map(|t| define(MetricType::Counter, &format!("{what}.{t}")))
                .collect::<Result<_, _>>()?,
            counts: vec![0; tiers.len()],
        })
    }

    fn bump(&mut self, tier: usize) {
        if let Some(n) = self.counts.get_mut(tier) {
            *n += 1;
        }
    }

    fn flush(&mut self) {
        for (id, n) in self.ids.iter().zip(&mut self.counts) {
            add(*id, std::mem::take(n));
        }
    }
}

pub struct QosMetrics {
    admitted: PerTier,
    throttled: PerTier,
    counters: Vec<u32>,
    gauges: Vec<u32>,
    refill_us: u32,
    fleet_replicas: u32,
    fleet_fallback: u32,
    fleet_exchange_ms: u32,
    fleet_duplicate_names: u32,
    counts: Counts,
}

fn define(kind: MetricType, name: &str) -> Result<u32, String> {
    metrics::define(kind, &format!("stakegate.qos.{name}"))
}

fn define_all<T>(kind: MetricType, table: &[(&str, T)]) -> Result<Vec<u32>, String> {
    table.iter().map(|(name, _)| define(kind, name)).collect()
}

impl QosMetrics {
    /// `tiers` are the policy's tier labels, `unstaked` and `staked` first.
    pub fn define(tiers: &[String]) -> Result<Self, String> {
        Ok(Self {
            admitted: PerTier::define("admitted", tiers)?,
            throttled: PerTier::define("throttled", tiers)?,
            counters: define_all(MetricType::Counter, COUNTERS)?,
            gauges: define_all(MetricType::Gauge, GAUGES)?,
            refill_us: define(MetricType::Histogram, "refill_us")?,
            fleet_replicas: define(MetricType::Gauge, "fleet.replicas")?,
            fleet_fallback: define(MetricType::Gauge, "fleet.fallback")?,
            fleet_exchange_ms: define(MetricType::Histogram, "fleet.exchange_ms")?,
            fleet_duplicate_names: define(MetricType::Gauge, "fleet.duplicate_names")?,
            counts: Counts::default(),
        })
    }

    pub fn admitted(&mut self, tier: usize) {
        self.admitted.bump(tier);
    }

    pub fn throttled(&mut self, tier: usize, reason: Reason) {
        self.throttled.bump(tier);
        match reason {
            Reason::Rate => {}
            Reason::Concurrency => self.counts.throttled_concurrency += 1,
            Reason::Websockets => self.counts.websockets_refused += 1,
        }
    }

    /// CAS retries and store errors, counted as the gate counts them.
    pub fn store(&mut self) -> &mut StoreCounts {
        &mut self.counts.store
    }

    /// A request touched shared data for a lease.
    pub fn leased(&mut self, leased: bool) {
        self.counts.leases += u64::from(leased);
    }

    /// JSON-RPC calls read on WebSockets (each charged as a call).
    pub fn websocket_calls(&mut self, n: u32) {
        self.counts.websocket_calls += u64::from(n);
    }

    pub fn evicted(&mut self, n: u64) {
        self.counts.evicted += n;
    }

    /// A fleet exchange was answered `took_ms` after it was sent, and its
    /// answer taken; it listed `duplicate_names` replica names two Envoys
    /// report under.
    pub fn fleet_exchanged(&mut self, took_ms: u64, duplicate_names: u32) {
        self.counts.fleet_exchanges += 1;
        set(self.fleet_exchange_ms, took_ms);
        set(self.fleet_duplicate_names, u64::from(duplicate_names));
    }

    /// A fleet exchange failed (refused, an error, or no answer in time).
    pub fn fleet_failed(&mut self) {
        self.counts.fleet_failures += 1;
    }

    /// A round in fleet mode: the replicas it saw, and whether it ran on
    /// the fallback share.
    pub fn fleet_round(&mut self, replicas: u32, fallback: bool) {
        set(self.fleet_replicas, u64::from(replicas));
        set(self.fleet_fallback, u64::from(fallback));
    }

    /// This VM ran the refill round, in `micros`.
    pub fn refill_took(&mut self, micros: u64) {
        self.counts.rounds += 1;
        set(self.refill_us, micros);
    }

    /// Hands the counts to Envoy (and resets them) and sets the gauges from
    /// `qos`.
    pub fn flush(&mut self, qos: &mut StakeQos) {
        self.counts.counted += qos.take_counted_requests();
        self.admitted.flush();
        self.throttled.flush();
        let counts = std::mem::take(&mut self.counts);
        for (id, (_, count)) in self.counters.iter().zip(COUNTERS) {
            add(*id, count(&counts));
        }
        for (id, (_, value)) in self.gauges.iter().zip(GAUGES) {
            set(*id, value(qos));
        }
    }
}
