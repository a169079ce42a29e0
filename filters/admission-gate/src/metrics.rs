//! The gate's Envoy stats. proxy-wasm metrics are Envoy stats shared by all
//! workers; Envoy files them under its `wasmcustom` namespace, so they show
//! as `stakegate_gate_*` at `/stats/prometheus`.
//!
//! Each hostcall costs a trip out of the VM, so requests only bump local
//! counts; `flush` hands them to Envoy and sets the gauges from the shared
//! totals once per heartbeat. Stats are therefore at most one heartbeat
//! (`heartbeatMs`, default 1 s) behind.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use stakegate_core::gate::class::RequestClass;
use stakegate_core::gate::shards::Totals;
use stakegate_glue::metrics::{add, define, set};

#[derive(Default)]
struct Pending {
    admitted: [u64; 3],
    rejected: [u64; 3],
    internal_inflight: i64,
    websocket_rejected: u64,
    cas_retries: u64,
    store_errors: u64,
    expired_slots: u64,
    dedup: DedupCounts,
}

/// Retry-storm protection's counts (all zero while it is off).
#[derive(Default)]
pub struct DedupCounts {
    /// Requests recorded in the table and sent.
    pub tracked: u64,
    pub duplicates_rejected: u64,
    /// Passed unchecked: not JSON-RPC, or a method not deduplicated.
    pub skipped: u64,
    /// Passed unchecked: body over `maxBodyBytes`.
    pub too_large: u64,
    /// Passed unrecorded: the key's page was full.
    pub table_full: u64,
    pub purged: u64,
}

struct DedupIds {
    tracked: u32,
    duplicates_rejected: u32,
    skipped: u32,
    too_large: u32,
    table_full: u32,
    purged: u32,
    entries: u32,
}

pub struct GateMetrics {
    admitted: [u32; 3],
    rejected: [u32; 3],
    inflight: [u32; 3],
    websocket_active: u32,
    websocket_rejected: u32,
    cas_retries: u32,
    store_errors: u32,
    expired_slots: u32,
    dedup: DedupIds,
    pending: Pending,
}

fn index(class: RequestClass) -> usize {
    match class {
        RequestClass::Internal => 0,
        RequestClass::Priority => 1,
        RequestClass::Default => 2,
    }
}

fn per_class(kind: MetricType, what: &str) -> Result<[u32; 3], String> {
    let mut ids = [0; 3];
    for class in RequestClass::ALL {
        ids[index(class)] = define(kind, &format!("stakegate.gate.{what}.{}", class.name()))?;
    }
    Ok(ids)
}

impl GateMetrics {
    pub fn define() -> Result<Self, String> {
        Ok(Self {
            admitted: per_class(MetricType::Counter, "admitted")?,
            rejected: per_class(MetricType::Counter, "rejected")?,
            inflight: per_class(MetricType::Gauge, "inflight")?,
            websocket_active: define(MetricType::Gauge, "stakegate.gate.websocket.active")?,
            websocket_rejected: define(MetricType::Counter, "stakegate.gate.websocket.rejected")?,
            cas_retries: define(MetricType::Counter, "stakegate.gate.cas_retries")?,
            store_errors: define(MetricType::Counter, "stakegate.gate.store_errors")?,
            expired_slots: define(MetricType::Counter, "stakegate.gate.expired_slots")?,
            dedup: DedupIds {
                tracked: define(MetricType::Counter, "stakegate.gate.dedup.tracked")?,
                duplicates_rejected: define(
                    MetricType::Counter,
                    "stakegate.gate.dedup.duplicates_rejected",
                )?,
                skipped: define(MetricType::Counter, "stakegate.gate.dedup.skipped")?,
                too_large: define(MetricType::Counter, "stakegate.gate.dedup.too_large")?,
                table_full: define(MetricType::Counter, "stakegate.gate.dedup.table_full")?,
                purged: define(MetricType::Counter, "stakegate.gate.dedup.purged")?,
                entries: define(MetricType::Gauge, "stakegate.gate.dedup.entries")?,
            },
            pending: Pending::default(),
        })
    }

    pub fn admitted(&mut self, class: RequestClass) {
        self.pending.admitted[index(class)] += 1;
    }

    pub fn rejected(&mut self, class: RequestClass, websocket: bool) {
        self.pending.rejected[index(class)] += 1;
        self.pending.websocket_rejected += u64::from(websocket);
    }

    /// Internal requests hold no shared slot, so their gauge is the sum of
    /// every worker's own count.
    pub fn internal_inflight(&mut self, delta: i64) {
        self.pending.internal_inflight += delta;
    }

    pub fn cas_retries(&mut self, n: u32) {
        self.pending.cas_retries += u64::from(n);
    }

    pub fn store_error(&mut self) {
        self.pending.store_errors += 1;
    }

    pub fn expired_slots(&mut self, n: u64) {
        self.pending.expired_slots += n;
    }

    /// Dedup's counts, to bump.
    pub fn dedup(&mut self) -> &mut DedupCounts {
        &mut self.pending.dedup
    }

    /// Sets the dedup table's entry count, from this heartbeat's sweep.
    pub fn dedup_entries(&mut self, entries: u64) {
        set(self.dedup.entries, entries);
    }

    /// Hands the pending counts to Envoy and sets the gauges from `totals`,
    /// the shared slot counts as of this heartbeat.
    pub fn flush(&mut self, totals: Option<Totals>) {
        let pending = std::mem::take(&mut self.pending);
        for class in RequestClass::ALL {
            add(self.admitted[index(class)], pending.admitted[index(class)]);
            add(self.rejected[index(class)], pending.rejected[index(class)]);
        }
        if pending.internal_inflight != 0 {
            let id = self.inflight[index(RequestClass::Internal)];
            let _ = hostcalls::increment_metric(id, pending.internal_inflight);
        }
        add(self.websocket_rejected, pending.websocket_rejected);
        add(self.cas_retries, pending.cas_retries);
        add(self.store_errors, pending.store_errors);
        add(self.expired_slots, pending.expired_slots);
        let (ids, counts) = (&self.dedup, &pending.dedup);
        add(ids.tracked, counts.tracked);
        add(ids.duplicates_rejected, counts.duplicates_rejected);
        add(ids.skipped, counts.skipped);
        add(ids.too_large, counts.too_large);
        add(ids.table_full, counts.table_full);
        add(ids.purged, counts.purged);
        if let Some(totals) = totals {
            set(
                self.inflight[index(RequestClass::Default)],
                u64::from(totals.default),
            );
            set(
                self.inflight[index(RequestClass::Priority)],
                u64::from(totals.priority),
            );
            set(self.websocket_active, u64::from(totals.websocket));
        }
    }
}
