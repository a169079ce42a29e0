//! Envoy stats from a filter's metric list (`stakegate_core::metrics`):
//! proxy-wasm metrics, which Envoy files under its `wasmcustom` namespace
//! (`stakegate_*` at `/stats/prometheus`). Requests only count in plain
//! values; a flush hands a snapshot of them to Envoy, one host call per
//! stat that changed. Failures to record are ignored: a stat must never
//! fail a request.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use stakegate_core::metrics::{Kind, Metric, Reading};
use stakegate_core::qos::ledger::{self, Usage};

/// A filter's stats, defined from its metric list.
pub struct Stats<T: 'static> {
    metrics: &'static [Metric<T>],
    /// Each metric's stats, one per label (or one).
    ids: Vec<Vec<u32>>,
}

impl<T> Stats<T> {
    /// Defines every metric of `metrics` as `prefix.name`, a stat per label
    /// of `labels` where the name has a placeholder. The error names the
    /// stat.
    pub fn define(
        prefix: &str,
        metrics: &'static [Metric<T>],
        labels: &[String],
    ) -> Result<Self, String> {
        let ids = metrics
            .iter()
            .map(|metric| {
                let kind = match metric.kind {
                    Kind::Counter => MetricType::Counter,
                    Kind::Gauge => MetricType::Gauge,
                    Kind::Histogram => MetricType::Histogram,
                };
                metric
                    .names(labels)
                    .iter()
                    .map(|name| {
                        let name = format!("{prefix}.{name}");
                        hostcalls::define_metric(kind, &name)
                            .map_err(|s| format!("defining metric {name}: {s:?}"))
                    })
                    .collect::<Result<Vec<u32>, String>>()
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { metrics, ids })
    }

    /// Hands `snapshot` to Envoy.
    pub fn flush(&self, snapshot: &T) {
        for (metric, ids) in self.metrics.iter().zip(&self.ids) {
            for (label, id) in ids.iter().enumerate() {
                match (metric.read)(snapshot, label) {
                    Reading::Skip | Reading::Add(0) => {}
                    Reading::Add(n) => {
                        let _ = hostcalls::increment_metric(*id, n.min(i64::MAX as u64) as i64);
                    }
                    Reading::Change(change) => {
                        let _ = hostcalls::increment_metric(*id, change);
                    }
                    Reading::Set(value) => {
                        let _ = hostcalls::record_metric(*id, value);
                    }
                    Reading::Record(values) => {
                        for value in values {
                            let _ = hostcalls::record_metric(*id, *value);
                        }
                    }
                }
            }
        }
    }
}

/// Stake QoS's usage ledger (`stakegate_core::qos::ledger`): a counter per
/// label and counter, `stakegate.qos.usage.<label>.<counter>`, and a label
/// of one identity's share, `….share_milli_rps` (a gauge, thousandths of a
/// call per second, `UNLIMITED` while QoS does not throttle), each defined
/// the first time it is set.
pub struct UsageStats {
    /// `stakegate.qos`, or a shadow's `stakegate.qos_shadow`.
    prefix: &'static str,
    ids: std::collections::HashMap<String, u32>,
}

impl UsageStats {
    pub fn new(prefix: &'static str) -> Self {
        Self {
            prefix,
            ids: Default::default(),
        }
    }

    pub fn flush(&mut self, by_label: &std::collections::BTreeMap<String, Usage>) {
        for (label, usage) in by_label {
            for (counter, n) in usage.counters() {
                if let Some(id) = self.id(MetricType::Counter, label, &counter) {
                    let _ = hostcalls::increment_metric(id, n.min(i64::MAX as u64) as i64);
                }
            }
            if !ledger::is_shared(label) {
                if let Some(id) = self.id(MetricType::Gauge, label, ledger::SHARE) {
                    // Saturates: infinite is `UNLIMITED`.
                    let _ = hostcalls::record_metric(id, (usage.share_rps * 1000.0) as u64);
                }
            }
        }
    }

    fn id(&mut self, kind: MetricType, label: &str, counter: &str) -> Option<u32> {
        let name = format!("{}.usage.{label}.{counter}", self.prefix);
        if let Some(id) = self.ids.get(&name) {
            return Some(*id);
        }
        let id = hostcalls::define_metric(kind, &name).ok()?;
        self.ids.insert(name, id);
        Some(id)
    }
}
