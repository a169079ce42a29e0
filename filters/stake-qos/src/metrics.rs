//! The QoS filter's Envoy stats (`stakegate_qos_*` at `/stats/prometheus`).
//!
//! Requests bump local counts; each tick (every refill interval) hands them
//! to Envoy and sets the gauges from the shared state this VM just read, so
//! stats are at most one interval behind.

use proxy_wasm::types::MetricType;
use stakegate_core::qos::state::QosState;
use stakegate_glue::metrics::{self, add, set};

#[derive(Default)]
struct Pending {
    admitted: Vec<u64>,
    throttled: Vec<u64>,
    throttled_concurrency: u64,
    cas_retries: u64,
    store_errors: u64,
    evicted: u64,
    leases: u64,
}

pub struct QosMetrics {
    admitted: Vec<u32>,
    throttled: Vec<u32>,
    throttled_concurrency: u32,
    throttling: u32,
    load_rps: u32,
    capacity_rps: u32,
    identities: u32,
    refill_us: u32,
    rounds: u32,
    cas_retries: u32,
    store_errors: u32,
    evicted: u32,
    leases: u32,
    pending: Pending,
}

fn define(kind: MetricType, name: &str) -> Result<u32, String> {
    metrics::define(kind, &format!("stakegate.qos.{name}"))
}

impl QosMetrics {
    /// `tiers` are the policy's tier labels, `unstaked` and `staked` first.
    pub fn define(tiers: &[String]) -> Result<Self, String> {
        let per_tier = |what: &str| {
            tiers
                .iter()
                .map(|t| define(MetricType::Counter, &format!("{what}.{t}")))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            admitted: per_tier("admitted")?,
            throttled: per_tier("throttled")?,
            throttled_concurrency: define(MetricType::Counter, "throttled_concurrency")?,
            throttling: define(MetricType::Gauge, "throttling")?,
            load_rps: define(MetricType::Gauge, "load_rps")?,
            capacity_rps: define(MetricType::Gauge, "capacity_rps")?,
            identities: define(MetricType::Gauge, "identities")?,
            refill_us: define(MetricType::Histogram, "refill_us")?,
            rounds: define(MetricType::Counter, "rounds")?,
            cas_retries: define(MetricType::Counter, "cas_retries")?,
            store_errors: define(MetricType::Counter, "store_errors")?,
            evicted: define(MetricType::Counter, "evicted")?,
            leases: define(MetricType::Counter, "leases")?,
            pending: Pending {
                admitted: vec![0; tiers.len()],
                throttled: vec![0; tiers.len()],
                ..Pending::default()
            },
        })
    }

    pub fn admitted(&mut self, tier: usize) {
        if let Some(n) = self.pending.admitted.get_mut(tier) {
            *n += 1;
        }
    }

    pub fn throttled(&mut self, tier: usize, concurrency: bool) {
        if let Some(n) = self.pending.throttled.get_mut(tier) {
            *n += 1;
        }
        self.pending.throttled_concurrency += u64::from(concurrency);
    }

    pub fn cas_retries(&mut self, n: u32) {
        self.pending.cas_retries += u64::from(n);
    }

    pub fn store_error(&mut self) {
        self.pending.store_errors += 1;
    }

    /// A request touched shared data for a lease.
    pub fn leased(&mut self, leased: bool) {
        self.pending.leases += u64::from(leased);
    }

    pub fn evicted(&mut self, n: u64) {
        self.pending.evicted += n;
    }

    pub fn refill_took(&self, micros: u64) {
        add(self.rounds, 1);
        set(self.refill_us, micros);
    }

    /// Hands the pending counts to Envoy and sets the gauges from `state`.
    pub fn flush(&mut self, state: &QosState, interval_ms: u64) {
        let p = &mut self.pending;
        for (id, n) in self.admitted.iter().zip(&mut p.admitted) {
            add(*id, std::mem::take(n));
        }
        for (id, n) in self.throttled.iter().zip(&mut p.throttled) {
            add(*id, std::mem::take(n));
        }
        add(
            self.throttled_concurrency,
            std::mem::take(&mut p.throttled_concurrency),
        );
        add(self.cas_retries, std::mem::take(&mut p.cas_retries));
        add(self.store_errors, std::mem::take(&mut p.store_errors));
        add(self.evicted, std::mem::take(&mut p.evicted));
        add(self.leases, std::mem::take(&mut p.leases));
        set(self.throttling, u64::from(state.throttling));
        set(self.load_rps, state.load_rps(interval_ms).round() as u64);
        set(self.capacity_rps, state.capacity_rps.round() as u64);
        set(self.identities, state.identities);
    }
}
