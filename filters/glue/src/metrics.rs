//! Envoy stats from a filter: proxy-wasm metrics, which Envoy files under
//! its `wasmcustom` namespace (`stakegate_*` at `/stats/prometheus`).
//! Failures to record are ignored: a stat must never fail a request.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Defines a metric; the error names it.
pub fn define(kind: MetricType, name: &str) -> Result<u32, String> {
    hostcalls::define_metric(kind, name).map_err(|s| format!("defining metric {name}: {s:?}"))
}

/// Adds `n` to a counter (or gauge); 0 costs no hostcall.
pub fn add(id: u32, n: u64) {
    if n > 0 {
        let _ = hostcalls::increment_metric(id, n.min(i64::MAX as u64) as i64);
    }
}

/// Sets a gauge, or records a histogram value.
pub fn set(id: u32, value: u64) {
    let _ = hostcalls::record_metric(id, value);
}
