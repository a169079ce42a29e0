//! The simulator's node: rpc-node in miniature, in virtual time.
//!
//! One FIFO queue in front of `read_slots`: RPC requests hold one slot for
//! their method's cost, and each block needs `sync_slots` from the same
//! queue for `block_exec`, so a long queue of RPC requests holds the sync
//! loop back exactly as rpc-node's fair semaphore does
//! (`crates/rpc-node/src/slots.rs`). Tip lag is measured with rpc-node's
//! own `Chain`. The node knows jobs by number; what a job is and when it
//! ends is the simulator's business.

use crate::scenario::Node;
use crate::summary::{NodeSummary, Upstream};
use rpc_node::chain::Chain;
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// What waits for, or holds, the node's read slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// An RPC request, by the simulator's number for it.
    Rpc(usize),
    /// The sync loop executing a block.
    Sync,
}

pub struct VirtualNode {
    /// Free read slots; negative after the node shrank under load.
    free: i64,
    slots: u32,
    sync_slots: u32,
    queue: VecDeque<Job>,
    rpc_waiting: u64,
    queue_max: u64,
    /// RPC requests inside the node, waiting or being served.
    inflight: u64,
    inflight_max: u64,
    /// Requests that reached the node, and the distinct ones
    /// (client, request number): retries of one request are not distinct.
    requests: u64,
    unique: HashSet<(usize, u64)>,
    chain: Chain,
    /// Maps virtual time (ns) onto `Instant`s, which `Chain` speaks.
    origin: Instant,
}

impl VirtualNode {
    pub fn new(config: &Node) -> Self {
        Self {
            free: i64::from(config.read_slots),
            slots: config.read_slots,
            sync_slots: config.sync_slots,
            queue: VecDeque::new(),
            rpc_waiting: 0,
            queue_max: 0,
            inflight: 0,
            inflight_max: 0,
            requests: 0,
            unique: HashSet::new(),
            chain: Chain::new(config.block_interval.mul_f64(config.tip_lost_after)),
            origin: Instant::now(),
        }
    }

    fn at(&self, ns: u64) -> Instant {
        self.origin + Duration::from_nanos(ns)
    }

    /// RPC request `job`, attempt of `client`'s request `n`, joins the
    /// queue.
    pub fn arrive(&mut self, job: usize, client: usize, n: u64) {
        self.queue.push_back(Job::Rpc(job));
        self.rpc_waiting += 1;
        self.queue_max = self.queue_max.max(self.rpc_waiting);
        self.inflight += 1;
        self.inflight_max = self.inflight_max.max(self.inflight);
        self.requests += 1;
        self.unique.insert((client, n));
    }

    /// A waiting request's client gave up: it leaves the queue (its entry
    /// is skipped when it comes up, see `start_next`).
    pub fn abandon_waiting(&mut self) {
        self.rpc_waiting -= 1;
        self.inflight -= 1;
    }

    /// A request being served is done: its slot is free.
    pub fn served(&mut self) {
        self.free += 1;
        self.inflight -= 1;
    }

    /// A new block reaches the node at `now_ns`: the sync loop queues for
    /// its slots.
    pub fn block_arrives(&mut self, now_ns: u64) {
        self.chain.block_arrived(self.at(now_ns));
        self.queue.push_back(Job::Sync);
    }

    /// The sync loop executed its block at `now_ns` and gives its slots
    /// back.
    pub fn block_executed(&mut self, now_ns: u64) {
        self.free += i64::from(self.sync_slots);
        self.chain.block_executed(self.at(now_ns));
    }

    /// The node now has `slots` read slots (those in use stay in use).
    pub fn resize(&mut self, slots: u32) {
        self.free += i64::from(slots) - i64::from(self.slots);
        self.slots = slots;
    }

    /// Starts the job at the head of the queue if its slots are free, and
    /// returns it; `abandoned` says which RPC jobs' clients have gone.
    pub fn start_next(&mut self, abandoned: impl Fn(usize) -> bool) -> Option<Job> {
        while let Some(job) = self.queue.front().copied() {
            let needs = match job {
                Job::Rpc(request) if abandoned(request) => {
                    self.queue.pop_front();
                    continue;
                }
                Job::Rpc(_) => 1,
                Job::Sync => i64::from(self.sync_slots),
            };
            if self.free < needs {
                return None;
            }
            self.queue.pop_front();
            self.free -= needs;
            if let Job::Rpc(_) = job {
                self.rpc_waiting -= 1;
            }
            return Some(job);
        }
        None
    }

    /// Tip lag as of `now_ns`.
    pub fn observe(&mut self, now_ns: u64) {
        self.chain.observe(self.at(now_ns));
    }

    pub fn summary(&self) -> NodeSummary {
        NodeSummary {
            tip_lag_max_ms: (self.chain.lag_max().as_secs_f64() * 1e6).round() / 1e3,
            tip_lost: self.chain.tip_lost(),
            queue_max: self.queue_max,
            inflight_max: self.inflight_max,
            blocks_executed: self.chain.head(),
            upstream: Some(Upstream::new(self.requests, self.unique.len() as u64)),
            timeline: Vec::new(),
            calls_avoided: None,
            cache: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(read_slots: u32, sync_slots: u32) -> VirtualNode {
        VirtualNode::new(&Node {
            read_slots,
            flavour: Default::default(),
            costs: Default::default(),
            block_interval: Duration::from_secs(1),
            block_exec: Duration::from_millis(100),
            sync_slots,
            tip_lost_after: 3.0,
            changes: Vec::new(),
        })
    }

    #[test]
    fn the_sync_loop_waits_behind_every_earlier_request() {
        let mut node = node(2, 2);
        for job in 0..4 {
            node.arrive(job, 0, job as u64);
        }
        node.block_arrives(0);
        let none = |_| false;
        assert_eq!(node.start_next(none), Some(Job::Rpc(0)));
        assert_eq!(node.start_next(none), Some(Job::Rpc(1)));
        assert_eq!(node.start_next(none), None, "both slots busy");
        node.served();
        assert_eq!(node.start_next(none), Some(Job::Rpc(2)));
        node.served();
        node.served();
        assert_eq!(node.start_next(none), Some(Job::Rpc(3)));
        assert_eq!(
            node.start_next(none),
            None,
            "the block needs both slots, and one is busy"
        );
        node.served();
        assert_eq!(node.start_next(none), Some(Job::Sync));
        let summary = node.summary();
        assert_eq!((summary.queue_max, summary.inflight_max), (4, 4));
    }

    #[test]
    fn an_abandoned_request_is_skipped_and_a_shrunk_node_waits() {
        let mut node = node(1, 1);
        node.arrive(0, 0, 0);
        node.arrive(1, 0, 1);
        node.abandon_waiting();
        assert_eq!(node.start_next(|job| job == 0), Some(Job::Rpc(1)));
        node.resize(0);
        node.served();
        node.arrive(2, 0, 2);
        assert_eq!(node.start_next(|_| false), None, "no slot left");
        node.resize(1);
        assert_eq!(node.start_next(|_| false), Some(Job::Rpc(2)));
    }
}
