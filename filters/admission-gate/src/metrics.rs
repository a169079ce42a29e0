//! The gate's Envoy stats. proxy-wasm metrics are Envoy stats shared by all
//! workers; Envoy files them under its `wasmcustom` namespace, so they show
//! as `stakegate_gate_*` at `/stats/prometheus`.
//!
//! Each hostcall costs a trip out of the VM, so requests only bump the
//! core's `Counts`; `flush` hands them to Envoy and sets the gauges from
//! the shared totals once per heartbeat. Stats are therefore at most one
//! heartbeat (`heartbeatMs`, default 1 s) behind.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use stakegate_core::gate::class::RequestClass;
use stakegate_core::gate::stream::{Counts, Ticked};
use stakegate_glue::metrics::{add, define, set};

/// How a counter reads its count.
type Count = fn(&Counts) -> u64;

/// Counters: name, and the count it reports.
const COUNTERS: &[(&str, Count)] = &[
    ("websocket.rejected", |c| c.websocket.rejected),
    ("websocket.messages", |c| c.websocket.messages),
    ("websocket.waits", |c| c.websocket.waits),
    ("websocket.closed", |c| c.websocket.closed),
    ("websocket.merged", |c| c.websocket.merged),
    ("websocket.rewritten", |c| c.websocket.rewritten),
    ("websocket.skipped", |c| c.websocket.skipped),
    ("bodies_streamed", |c| c.bodies_streamed),
    ("cas_retries", |c| c.store.cas_retries),
    ("store_errors", |c| c.store.store_errors),
    ("expired_slots", |c| c.expired_slots),
    ("dedup.led", |c| c.dedup.led),
    ("dedup.coalesced", |c| c.dedup.coalesced),
    ("dedup.shared", |c| c.dedup.shared),
    ("dedup.kept", |c| c.dedup.kept),
    ("dedup.taken", |c| c.dedup.taken),
    ("dedup.handed_over", |c| c.dedup.handed_over),
    ("dedup.woken_by_failure", |c| c.dedup.woken_by_failure),
    ("dedup.wait_timeouts", |c| c.dedup.wait_timeouts),
    ("dedup.left", |c| c.dedup.left),
    ("dedup.refused", |c| c.dedup.refused),
    ("dedup.unshared", |c| c.dedup.unshared),
    ("dedup.callouts_failed", |c| c.dedup.callouts_failed),
    ("dedup.skipped", |c| c.dedup.skipped),
    ("dedup.too_large", |c| c.dedup.too_large),
    ("dedup.table_full", |c| c.dedup.table_full),
    ("dedup.purged", |c| c.dedup.purged),
    ("dedup.standing_by", |c| c.dedup.standing_by),
];

pub struct GateMetrics {
    admitted: [u32; 3],
    rejected: [u32; 3],
    inflight: [u32; 3],
    websocket_active: u32,
    dedup_entries: u32,
    /// Requests held for an answer, on every worker (each adds its change).
    dedup_waiting: u32,
    dedup_engaged: u32,
    /// The node's finalized block as dedup knows it, and whether it does.
    dedup_finalized: u32,
    dedup_finality_known: u32,
    waiting_reported: i64,
    counters: Vec<u32>,
}

fn stat(name: &str) -> String {
    format!("stakegate.gate.{name}")
}

fn per_class(kind: MetricType, what: &str) -> Result<[u32; 3], String> {
    let mut ids = [0; 3];
    for class in RequestClass::ALL {
        ids[class.index()] = define(kind, &stat(&format!("{what}.{}", class.name())))?;
    }
    Ok(ids)
}

impl GateMetrics {
    /// Whether dedup checks requests now (set at every tick).
    pub fn engaged(&self, engaged: bool) {
        set(self.dedup_engaged, u64::from(engaged));
    }

    pub fn define() -> Result<Self, String> {
        Ok(Self {
            admitted: per_class(MetricType::Counter, "admitted")?,
            rejected: per_class(MetricType::Counter, "rejected")?,
            inflight: per_class(MetricType::Gauge, "inflight")?,
            websocket_active: define(MetricType::Gauge, &stat("websocket.active"))?,
            dedup_entries: define(MetricType::Gauge, &stat("dedup.entries"))?,
            dedup_waiting: define(MetricType::Gauge, &stat("dedup.waiting"))?,
            dedup_engaged: define(MetricType::Gauge, &stat("dedup.engaged"))?,
            dedup_finalized: define(MetricType::Gauge, &stat("dedup.finalized"))?,
            dedup_finality_known: define(MetricType::Gauge, &stat("dedup.finality_known"))?,
            waiting_reported: 0,
            counters: COUNTERS
                .iter()
                .map(|(name, _)| define(MetricType::Counter, &stat(name)))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Hands the counts to Envoy (and resets them), and sets the gauges
    /// from what the heartbeat found (`ticked`) and `waiting`, the
    /// requests this VM holds for an answer.
    pub fn flush(&mut self, counts: &mut Counts, ticked: &Ticked, waiting: usize) {
        let change = waiting as i64 - self.waiting_reported;
        if change != 0 {
            let _ = hostcalls::increment_metric(self.dedup_waiting, change);
            self.waiting_reported = waiting as i64;
        }
        let counts = std::mem::take(counts);
        for class in RequestClass::ALL {
            add(self.admitted[class.index()], counts.admitted[class.index()]);
            add(self.rejected[class.index()], counts.rejected[class.index()]);
        }
        if counts.internal_inflight != 0 {
            let id = self.inflight[RequestClass::Internal.index()];
            let _ = hostcalls::increment_metric(id, counts.internal_inflight);
        }
        for (id, (_, count)) in self.counters.iter().zip(COUNTERS) {
            add(*id, count(&counts));
        }
        if let Some(totals) = ticked.totals {
            set(
                self.inflight[RequestClass::Default.index()],
                u64::from(totals.default),
            );
            set(
                self.inflight[RequestClass::Priority.index()],
                u64::from(totals.priority),
            );
            set(self.websocket_active, u64::from(totals.websocket));
        }
        if let Some(entries) = ticked.dedup_entries {
            set(self.dedup_entries, entries);
        }
        set(self.dedup_finalized, ticked.finalized.unwrap_or(0));
        set(
            self.dedup_finality_known,
            u64::from(ticked.finalized.is_some()),
        );
    }
}
