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

/// Who registered a queue: the VM (0 main, then the workers from 1) and
/// its root context.
pub type Owner = (usize, u32);

/// An HTTP callout a VM made, for the host's caller to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    /// The VM that made it (0 main, then the workers from 1).
    pub vm: usize,
    pub token: u32,
    pub cluster: String,
    pub body: Vec<u8>,
}

#[derive(Debug, Default)]
pub struct Shared {
    /// Virtual time since the host started, in nanoseconds.
    pub now_ns: u64,
    /// Wall-clock origin reported to modules, so `now` looks like a date.
    pub epoch_ns: u64,
    data: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    /// Queues: name, items, and the VM and root context that registered
    /// it (which is told when an item arrives).
    queues: Vec<(String, VecDeque<Vec<u8>>, Option<Owner>)>,
    /// Queues with new items: (registering VM and root, queue), to deliver.
    ready: Vec<(Owner, u32)>,
    /// HTTP callouts made and not yet answered.
    pub callouts: Vec<Callout>,
    next_token: u32,
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

    /// Registers `name` for root context `root` of VM `vm` (as in Envoy,
    /// the last to register it is told of its items).
    pub fn register_queue(&mut self, name: &str, vm: usize, root: u32) -> u32 {
        match self.queues.iter().position(|(n, _, _)| n == name) {
            Some(i) => {
                self.queues[i].2 = Some((vm, root));
                i as u32
            }
            None => {
                self.queues
                    .push((name.to_string(), VecDeque::new(), Some((vm, root))));
                (self.queues.len() - 1) as u32
            }
        }
    }

    pub fn resolve_queue(&self, name: &str) -> Option<u32> {
        self.queues
            .iter()
            .position(|(n, _, _)| n == name)
            .map(|i| i as u32)
    }

    pub fn queue(&mut self, id: u32) -> Option<&mut VecDeque<Vec<u8>>> {
        self.queues.get_mut(id as usize).map(|(_, q, _)| q)
    }

    /// Puts `value` on queue `id`, and notes that its VM is to be told.
    pub fn enqueue(&mut self, id: u32, value: Vec<u8>) -> bool {
        let Some((_, queue, owner)) = self.queues.get_mut(id as usize) else {
            return false;
        };
        queue.push_back(value);
        if let Some(vm) = owner {
            if !self.ready.contains(&(*vm, id)) {
                self.ready.push((*vm, id));
            }
        }
        true
    }

    /// The queues with new items, by the VM and root context to tell.
    pub fn take_ready(&mut self) -> Vec<(Owner, u32)> {
        std::mem::take(&mut self.ready)
    }

    /// Records a callout from VM `vm`; returns its token.
    pub fn call(&mut self, vm: usize, cluster: String, body: Vec<u8>) -> u32 {
        self.next_token += 1;
        self.callouts.push(Callout {
            vm,
            token: self.next_token,
            cluster,
            body,
        });
        self.next_token
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
