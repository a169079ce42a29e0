//! What a QoS VM counts as requests and ticks go, and its metrics: the
//! glue hands a `Snapshot` to Envoy once per tick (every refill interval),
//! so stats are at most one interval behind.

use super::{Reason, StakeQos};
use crate::metrics::{add, set, Kind, Metric, Reading};
use crate::shared::StoreCounts;

/// Counted since the last snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// By tier index (`QosPolicy::tiers`).
    pub admitted: Vec<u64>,
    pub throttled: Vec<u64>,
    pub throttled_concurrency: u64,
    pub websockets_refused: u64,
    pub rounds: u64,
    pub store: StoreCounts,
    pub evicted: u64,
    pub leases: u64,
    pub websocket_calls: u64,
    /// Times a WebSocket's calls were held for its identity's share (the
    /// concurrency allowance among them).
    pub websocket_held: u64,
    /// Requests sent again before their `retry-after`, held until then
    /// (`early`).
    pub retries_held: u64,
    pub fleet_exchanges: u64,
    pub fleet_failures: u64,
    /// The refill rounds this VM ran, in microseconds.
    pub refill_us: Vec<u64>,
    /// Fleet exchanges' round trips, in milliseconds.
    pub exchange_ms: Vec<u64>,
    /// Fleet mode: the replicas the last round saw, and whether it ran on
    /// the fallback share.
    pub fleet_round: Option<(u32, bool)>,
    /// Fleet mode: replica names two Envoys report under, as of the last
    /// exchange.
    pub duplicate_names: Option<u32>,
}

fn bump(by_tier: &mut Vec<u64>, tier: usize) {
    if by_tier.len() <= tier {
        by_tier.resize(tier + 1, 0);
    }
    by_tier[tier] += 1;
}

impl Counts {
    pub fn admitted(&mut self, tier: usize) {
        bump(&mut self.admitted, tier);
    }

    pub fn throttled(&mut self, tier: usize, reason: Reason) {
        bump(&mut self.throttled, tier);
        match reason {
            Reason::Rate => {}
            Reason::Concurrency => self.throttled_concurrency += 1,
            Reason::Websockets => self.websockets_refused += 1,
        }
    }

    /// A WebSocket's calls were held for `reason`.
    pub fn socket_held(&mut self, reason: Reason) {
        self.websocket_held += 1;
        if reason == Reason::Concurrency {
            self.throttled_concurrency += 1;
        }
    }

    /// This VM ran the refill round, in `micros`.
    pub fn refill_took(&mut self, micros: u64) {
        self.rounds += 1;
        self.refill_us.push(micros);
    }

    /// A fleet exchange was answered `took_ms` after it was sent, and its
    /// answer taken; it listed `duplicate_names` replica names two Envoys
    /// report under.
    pub fn fleet_exchanged(&mut self, took_ms: u64, duplicate_names: u32) {
        self.fleet_exchanges += 1;
        self.exchange_ms.push(took_ms);
        self.duplicate_names = Some(duplicate_names);
    }

    /// What to hand Envoy now: these counts (taken), and `qos`'s gauges.
    pub fn snapshot(&mut self, qos: &mut StakeQos) -> Snapshot {
        let state = qos.state();
        let gauges = Gauges {
            throttling: state.throttling,
            load_rps: state.load_rps(qos.policy().refill_interval_ms).round() as u64,
            capacity_rps: state.capacity_rps.round() as u64,
            identities: state.identities,
            counting: qos.counting(),
        };
        Snapshot {
            counted: qos.take_counted_requests(),
            counts: std::mem::take(self),
            gauges,
        }
    }
}

/// The QoS state's gauges, as of this VM's last tick.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gauges {
    pub throttling: bool,
    pub load_rps: u64,
    pub capacity_rps: u64,
    pub identities: u64,
    pub counting: bool,
}

/// What a flush hands to Envoy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub counts: Counts,
    /// Requests counted without an identity (`qos::light`).
    pub counted: u64,
    pub gauges: Gauges,
}

fn tier(by_tier: &[u64], tier: usize) -> Reading<'static> {
    add(by_tier.get(tier).copied().unwrap_or(0))
}

/// Stake QoS's metrics (`stakegate.qos.*`); `policies/stake-qos.md` has
/// what each means.
#[rustfmt::skip]
pub const METRICS: &[Metric<Snapshot>] = &[
    Metric { name: "admitted.<tier>", kind: Kind::Counter, read: |s, t| tier(&s.counts.admitted, t) },
    Metric { name: "throttled.<tier>", kind: Kind::Counter, read: |s, t| tier(&s.counts.throttled, t) },
    Metric { name: "throttled_concurrency", kind: Kind::Counter, read: |s, _| add(s.counts.throttled_concurrency) },
    Metric { name: "websocket.refused", kind: Kind::Counter, read: |s, _| add(s.counts.websockets_refused) },
    Metric { name: "rounds", kind: Kind::Counter, read: |s, _| add(s.counts.rounds) },
    Metric { name: "cas_retries", kind: Kind::Counter, read: |s, _| add(s.counts.store.cas_retries) },
    Metric { name: "store_errors", kind: Kind::Counter, read: |s, _| add(s.counts.store.store_errors) },
    Metric { name: "evicted", kind: Kind::Counter, read: |s, _| add(s.counts.evicted) },
    Metric { name: "leases", kind: Kind::Counter, read: |s, _| add(s.counts.leases) },
    Metric { name: "websocket.calls", kind: Kind::Counter, read: |s, _| add(s.counts.websocket_calls) },
    Metric { name: "websocket.held", kind: Kind::Counter, read: |s, _| add(s.counts.websocket_held) },
    Metric { name: "retries_held", kind: Kind::Counter, read: |s, _| add(s.counts.retries_held) },
    Metric { name: "fleet.exchanges", kind: Kind::Counter, read: |s, _| add(s.counts.fleet_exchanges) },
    Metric { name: "fleet.exchange_failures", kind: Kind::Counter, read: |s, _| add(s.counts.fleet_failures) },
    Metric { name: "counted", kind: Kind::Counter, read: |s, _| add(s.counted) },
    Metric { name: "throttling", kind: Kind::Gauge, read: |s, _| Reading::Set(u64::from(s.gauges.throttling)) },
    Metric { name: "load_rps", kind: Kind::Gauge, read: |s, _| Reading::Set(s.gauges.load_rps) },
    Metric { name: "capacity_rps", kind: Kind::Gauge, read: |s, _| Reading::Set(s.gauges.capacity_rps) },
    Metric { name: "identities", kind: Kind::Gauge, read: |s, _| Reading::Set(s.gauges.identities) },
    Metric { name: "counting", kind: Kind::Gauge, read: |s, _| Reading::Set(u64::from(s.gauges.counting)) },
    Metric { name: "refill_us", kind: Kind::Histogram, read: |s, _| Reading::Record(&s.counts.refill_us) },
    Metric { name: "fleet.replicas", kind: Kind::Gauge, read: |s, _| set(s.counts.fleet_round.map(|(n, _)| u64::from(n))) },
    Metric { name: "fleet.fallback", kind: Kind::Gauge, read: |s, _| set(s.counts.fleet_round.map(|(_, f)| u64::from(f))) },
    Metric { name: "fleet.exchange_ms", kind: Kind::Histogram, read: |s, _| Reading::Record(&s.counts.exchange_ms) },
    Metric { name: "fleet.duplicate_names", kind: Kind::Gauge, read: |s, _| set(s.counts.duplicate_names.map(u64::from)) },
];
