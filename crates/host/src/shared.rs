//! What all VMs of one host share, as Envoy shares it between the VMs of
//! one `vm_id`: shared data (with Envoy's CAS tokens), shared queues,
//! metrics by name, and the clock, which here is virtual.

use std::collections::{BTreeMap, HashMap, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Debug, Default)]
pub struct Shared {
    /// Virtual time since the host started, in nanoseconds.
    pub now_ns: u64,
    /// Wall-clock origin reported to modules, so `now` looks like a date.
    pub epoch_ns: u64,
    data: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    queues: Vec<(String, VecDeque<Vec<u8>>)>,
    metric_ids: Vec<(String, MetricKind)>,
    metric_values: BTreeMap<String, i64>,
}

impl Shared {
    pub fn new(epoch_ns: u64) -> Self {
        Self {
            epoch_ns,
            next_cas: 1,
            ..Self::default()
        }
    }

    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.data.get(key).cloned()
    }

    /// Envoy's rule: a non-zero `cas` must match the stored token; every
    /// write takes a fresh token from one counter for all keys.
    pub fn set(&mut self, key: &str, value: &[u8], cas: u32) -> bool {
        if let Some((_, current)) = self.data.get(key) {
            if cas != 0 && cas != *current {
                return false;
            }
        }
        let token = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        self.data.insert(key.to_string(), (value.to_vec(), token));
        true
    }

    /// How many keys shared data holds, and their values' total bytes.
    pub fn data_size(&self) -> (usize, usize) {
        let bytes = self.data.values().map(|(value, _)| value.len()).sum();
        (self.data.len(), bytes)
    }

    pub fn register_queue(&mut self, name: &str) -> u32 {
        match self.queues.iter().position(|(n, _)| n == name) {
            Some(i) => i as u32,
            None => {
                self.queues.push((name.to_string(), VecDeque::new()));
                (self.queues.len() - 1) as u32
            }
        }
    }

    pub fn resolve_queue(&self, name: &str) -> Option<u32> {
        self.queues
            .iter()
            .position(|(n, _)| n == name)
            .map(|i| i as u32)
    }

    pub fn queue(&mut self, id: u32) -> Option<&mut VecDeque<Vec<u8>>> {
        self.queues.get_mut(id as usize).map(|(_, q)| q)
    }

    /// Metric ids are global here (Envoy's are per VM but name the same
    /// stat), so defining a name twice returns the same id.
    pub fn define_metric(&mut self, kind: MetricKind, name: &str) -> u32 {
        if let Some(i) = self.metric_ids.iter().position(|(n, _)| n == name) {
            return i as u32;
        }
        self.metric_ids.push((name.to_string(), kind));
        self.metric_values.entry(name.to_string()).or_insert(0);
        (self.metric_ids.len() - 1) as u32
    }

    fn metric_name(&self, id: u32) -> Option<(String, MetricKind)> {
        self.metric_ids.get(id as usize).cloned()
    }

    pub fn increment_metric(&mut self, id: u32, offset: i64) -> bool {
        let Some((name, _)) = self.metric_name(id) else {
            return false;
        };
        *self.metric_values.entry(name).or_default() += offset;
        true
    }

    /// Gauges take the value; histograms keep the last value recorded.
    pub fn record_metric(&mut self, id: u32, value: u64) -> bool {
        let Some((name, _)) = self.metric_name(id) else {
            return false;
        };
        self.metric_values
            .insert(name, value.min(i64::MAX as u64) as i64);
        true
    }

    pub fn metric(&self, id: u32) -> Option<i64> {
        let (name, _) = self.metric_name(id)?;
        self.metric_values.get(&name).copied()
    }

    pub fn metrics(&self) -> BTreeMap<String, i64> {
        self.metric_values.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_follows_envoy() {
        let mut shared = Shared::new(0);
        assert!(shared.set("k", b"a", 0));
        let (_, cas) = shared.get("k").unwrap();
        assert!(shared.set("other", b"x", 0));
        assert!(shared.set("k", b"b", cas), "untouched since read");
        assert!(!shared.set("k", b"c", cas), "the token moved on");
        assert!(shared.set("k", b"d", 0), "zero writes unconditionally");
        assert_eq!(shared.get("k").unwrap().0, b"d");
    }

    #[test]
    fn metrics_are_shared_by_name() {
        let mut shared = Shared::new(0);
        let a = shared.define_metric(MetricKind::Counter, "c");
        let b = shared.define_metric(MetricKind::Counter, "c");
        assert_eq!(a, b);
        shared.increment_metric(a, 2);
        shared.increment_metric(b, 3);
        assert_eq!(shared.metrics()["c"], 5);
        assert!(!shared.increment_metric(99, 1));
    }
}
