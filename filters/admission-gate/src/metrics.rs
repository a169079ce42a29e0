//! The gate's Envoy stats. proxy-wasm metrics are Envoy stats shared by all
//! workers; Envoy files them under its `wasmcustom` namespace, so they show
//! as `stakegate_gate_*` at `/stats/prometheus`.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use stakegate_core::gate::class::RequestClass;
use stakegate_core::gate::shards::Totals;

pub struct GateMetrics {
    admitted: [u32; 3],
    rejected: [u32; 3],
    inflight: [u32; 3],
    websocket_active: u32,
    websocket_rejected: u32,
    cas_retries: u32,
    store_errors: u32,
    expired_slots: u32,
}

fn index(class: RequestClass) -> usize {
    match class {
        RequestClass::Internal => 0,
        RequestClass::Priority => 1,
        RequestClass::Default => 2,
    }
}

fn define(kind: MetricType, name: &str) -> Result<u32, String> {
    hostcalls::define_metric(kind, name).map_err(|s| format!("defining metric {name}: {s:?}"))
}

fn per_class(kind: MetricType, what: &str) -> Result<[u32; 3], String> {
    let mut ids = [0; 3];
    for class in RequestClass::ALL {
        ids[index(class)] = define(kind, &format!("stakegate.gate.{what}.{}", class.name()))?;
    }
    Ok(ids)
}

fn add(id: u32, n: i64) {
    let _ = hostcalls::increment_metric(id, n);
}

fn set(id: u32, value: u32) {
    let _ = hostcalls::record_metric(id, u64::from(value));
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
        })
    }

    pub fn admitted(&self, class: RequestClass) {
        add(self.admitted[index(class)], 1);
    }

    pub fn rejected(&self, class: RequestClass, websocket: bool) {
        add(self.rejected[index(class)], 1);
        if websocket {
            add(self.websocket_rejected, 1);
        }
    }

    /// Internal requests hold no shared slot; their gauge moves by itself.
    pub fn internal_inflight(&self, delta: i64) {
        add(self.inflight[index(RequestClass::Internal)], delta);
    }

    /// The shared totals, as the last write saw them.
    pub fn totals(&self, totals: Totals) {
        set(self.inflight[index(RequestClass::Default)], totals.default);
        set(
            self.inflight[index(RequestClass::Priority)],
            totals.priority,
        );
        set(self.websocket_active, totals.websocket);
    }

    pub fn cas_retries(&self, n: u32) {
        if n > 0 {
            add(self.cas_retries, i64::from(n));
        }
    }

    pub fn store_error(&self) {
        add(self.store_errors, 1);
    }

    pub fn expired_slots(&self, n: u64) {
        if n > 0 {
            add(self.expired_slots, n as i64);
        }
    }
}
