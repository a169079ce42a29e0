//! What a gate VM counts as things happen, and what its heartbeat finds:
//! handed to Envoy as metrics by the glue once per heartbeat.

use super::class::RequestClass;
use super::node_time::Priced;
use super::shards::Totals;
use super::websocket;
use crate::metrics::{add, set, Kind, Metric, Reading};
use crate::shared::StoreCounts;

/// Retry-storm protection's counts (all zero while it is off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DedupCounts {
    /// Requests that led their key: sent to the node by callout.
    pub led: u64,
    /// Requests held for an identical request's answer.
    pub coalesced: u64,
    /// Held requests answered with another request's answer.
    pub shared: u64,
    /// Answers nobody stayed for, kept for a retry.
    pub kept: u64,
    /// Requests answered with a kept answer.
    pub taken: u64,
    /// Held requests that came to lead after their leader failed or
    /// vanished.
    pub handed_over: u64,
    /// Wake messages saying a leader failed, to a VM holding its waiters.
    pub woken_by_failure: u64,
    /// Held requests answered 504 at `maxWaitMs`.
    pub wait_timeouts: u64,
    /// Held requests whose client went first.
    pub left: u64,
    /// Refused with 429: too many held for one answer.
    pub refused: u64,
    /// Answers only their own client could be given (encoded, or ids that
    /// name no single call): the others went to the node.
    pub unshared: u64,
    /// Callouts the host refused or that got no answer.
    pub callouts_failed: u64,
    /// Passed unchecked: not JSON-RPC, a method not deduplicated, trailers.
    pub skipped: u64,
    /// Passed unchecked: body over `maxBodyBytes`.
    pub too_large: u64,
    /// Passed unrecorded: the key's page was full.
    pub table_full: u64,
    pub purged: u64,
    /// Passed unchecked: coalescing stood by, the node being quick
    /// (`dedup::engage`).
    pub standing_by: u64,
    /// Passed by the cache and coalescing: routed to a cluster other than
    /// `dedup.upstream.cluster`.
    pub other_cluster: u64,
}

/// The answer cache's counts (all zero while it is off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheCounts {
    /// Requests answered from the cache.
    pub hits: u64,
    /// Requests whose answer could be kept and was not there.
    pub misses: u64,
    /// Requests whose answer can change: never looked up.
    pub uncacheable: u64,
    /// Reads at `latest` held for a head poll (`cache.latest`).
    pub at_head: u64,
    /// Head polls sent, and those that found no head (their reads went
    /// on as they came).
    pub head_polls: u64,
    pub head_failed: u64,
    /// Reads at `latest` let on at once: holding stood by, not paying.
    pub head_passed: u64,
    /// Reads at the head's hash the node answered with an error or `null`:
    /// they went on at `latest`, with every request waiting on them here.
    pub head_unpinned: u64,
    /// Passed without a lookup: the cache stood by, no key repeating.
    pub standing_by: u64,
    /// Answers kept.
    pub kept: u64,
    /// Answers to misses not kept: not found (an error, `null`), not final
    /// yet, or too large.
    pub not_kept: u64,
    /// Answers dropped to make room.
    pub evicted: u64,
    /// Change of the answers this VM keeps, and of their bytes.
    pub entries: i64,
    pub bytes: i64,
}

/// The node-time counts (all zero without `nodeTime`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeTimeCounts {
    /// Requests admitted as cheap (they may take the cheap slots).
    pub cheap: u64,
    /// Requests admitted as heavy.
    pub heavy: u64,
    /// Requests admitted on a spare slot while the gate was not busy,
    /// without a price.
    pub unpriced: u64,
    /// Requests that waited for a slot and got one.
    pub waited: u64,
    /// Requests refused with 503 after waiting `waitMs`, or because
    /// `maxWaiting` were waiting already.
    pub wait_refused: u64,
    /// Change of the requests waiting for a slot on this VM.
    pub waiting: i64,
    /// This VM's slot scale (`node_time::Occupancy`) in thousandths, when
    /// an answer changed it.
    pub slot_scale_milli: Option<u64>,
}

impl NodeTimeCounts {
    /// A request got its slot, priced so (or not at all).
    pub fn admitted(&mut self, priced: Option<Priced>) {
        match priced {
            Some(priced) if priced.cheap => self.cheap += 1,
            Some(_) => self.heavy += 1,
            None => self.unpriced += 1,
        }
    }
}

/// What a gate VM reports as metrics, counted as things happen and handed
/// to Envoy by the glue once per heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// By `RequestClass::index`.
    pub admitted: [u64; 3],
    pub rejected: [u64; 3],
    /// Change of internal requests in flight (they hold no shared slot).
    pub internal_inflight: i64,
    /// Public WebSockets (`gate::websocket`).
    pub websocket: websocket::Counts,
    /// Requests whose body reached the gate in pieces (no buffer filter in
    /// front of it).
    pub bodies_streamed: u64,
    pub store: StoreCounts,
    pub expired_slots: u64,
    pub dedup: DedupCounts,
    pub node_time: NodeTimeCounts,
    pub cache: CacheCounts,
    /// Change of the requests held at the gateway (`gate::holds`), and
    /// the requests refused past its bounds.
    pub held: i64,
    pub held_refused: u64,
}

/// What a heartbeat found, for the gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ticked {
    /// The shared slot counts (`None`: the store failed).
    pub totals: Option<Totals>,
    /// The dedup table's size.
    pub dedup_entries: Option<u64>,
    /// The node's finalized block, as dedup knows it (fresh).
    pub finalized: Option<u64>,
}

/// What a flush hands to Envoy: the counts since the last one, and what
/// the heartbeat or the engagement tick found (`None`: not this time).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub counts: Counts,
    pub ticked: Option<Ticked>,
    /// The change of the requests this VM holds for an answer.
    pub waiting: Option<i64>,
    pub engaged: Option<bool>,
}

impl Snapshot {
    /// The labels of `<class>` metrics, in `RequestClass::index` order.
    pub fn classes() -> Vec<String> {
        RequestClass::ALL.iter().map(|c| c.name().into()).collect()
    }

    fn totals(&self) -> Option<&Totals> {
        self.ticked.as_ref()?.totals.as_ref()
    }

    /// `inflight.<class>`: internal requests hold no shared slot, so each
    /// VM adds its change; the others are the shared totals.
    fn inflight(&self, class: usize) -> Reading<'_> {
        match RequestClass::ALL[class] {
            RequestClass::Internal => match self.counts.internal_inflight {
                0 => Reading::Skip,
                change => Reading::Change(change),
            },
            RequestClass::Priority => set(self.totals().map(|t| u64::from(t.priority))),
            RequestClass::Default => set(self.totals().map(|t| u64::from(t.default))),
        }
    }

    fn finalized(&self) -> Option<Option<u64>> {
        self.ticked.as_ref().map(|t| t.finalized)
    }
}

/// A gauge each VM adds its change to.
fn change<'a>(by: i64) -> Reading<'a> {
    match by {
        0 => Reading::Skip,
        by => Reading::Change(by),
    }
}

/// The gate's metrics (`stakegate.gate.*`), `policies/admission-gate.md`
/// has what each means.
#[rustfmt::skip]
pub const METRICS: &[Metric<Snapshot>] = &[
    Metric { name: "admitted.<class>", kind: Kind::Counter, read: |s, c| add(s.counts.admitted[c]) },
    Metric { name: "rejected.<class>", kind: Kind::Counter, read: |s, c| add(s.counts.rejected[c]) },
    Metric { name: "inflight.<class>", kind: Kind::Gauge, read: |s, c| s.inflight(c) },
    Metric { name: "websocket.active", kind: Kind::Gauge, read: |s, _| set(s.totals().map(|t| u64::from(t.websocket))) },
    Metric { name: "websocket.rejected", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.rejected) },
    Metric { name: "websocket.messages", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.messages) },
    Metric { name: "websocket.waits", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.waits) },
    Metric { name: "websocket.closed", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.closed) },
    Metric { name: "websocket.merged", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.merged) },
    Metric { name: "websocket.rewritten", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.rewritten) },
    Metric { name: "websocket.skipped", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.skipped) },
    Metric { name: "websocket.lingered", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.lingered) },
    Metric { name: "websocket.subscriptions_refused", kind: Kind::Counter, read: |s, _| add(s.counts.websocket.subscriptions_refused) },
    Metric { name: "websocket.subscriptions", kind: Kind::Gauge, read: |s, _| change(s.counts.websocket.subscriptions) },
    Metric { name: "held", kind: Kind::Gauge, read: |s, _| change(s.counts.held) },
    Metric { name: "held_refused", kind: Kind::Counter, read: |s, _| add(s.counts.held_refused) },
    Metric { name: "bodies_streamed", kind: Kind::Counter, read: |s, _| add(s.counts.bodies_streamed) },
    Metric { name: "cas_retries", kind: Kind::Counter, read: |s, _| add(s.counts.store.cas_retries) },
    Metric { name: "store_errors", kind: Kind::Counter, read: |s, _| add(s.counts.store.store_errors) },
    Metric { name: "expired_slots", kind: Kind::Counter, read: |s, _| add(s.counts.expired_slots) },
    Metric { name: "dedup.led", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.led) },
    Metric { name: "dedup.coalesced", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.coalesced) },
    Metric { name: "dedup.shared", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.shared) },
    Metric { name: "dedup.kept", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.kept) },
    Metric { name: "dedup.taken", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.taken) },
    Metric { name: "dedup.handed_over", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.handed_over) },
    Metric { name: "dedup.woken_by_failure", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.woken_by_failure) },
    Metric { name: "dedup.wait_timeouts", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.wait_timeouts) },
    Metric { name: "dedup.left", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.left) },
    Metric { name: "dedup.refused", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.refused) },
    Metric { name: "dedup.unshared", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.unshared) },
    Metric { name: "dedup.callouts_failed", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.callouts_failed) },
    Metric { name: "dedup.skipped", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.skipped) },
    Metric { name: "dedup.too_large", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.too_large) },
    Metric { name: "dedup.table_full", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.table_full) },
    Metric { name: "dedup.purged", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.purged) },
    Metric { name: "dedup.standing_by", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.standing_by) },
    Metric { name: "dedup.other_cluster", kind: Kind::Counter, read: |s, _| add(s.counts.dedup.other_cluster) },
    Metric { name: "dedup.engaged", kind: Kind::Gauge, read: |s, _| set(s.engaged.map(u64::from)) },
    Metric { name: "dedup.entries", kind: Kind::Gauge, read: |s, _| set(s.ticked.as_ref().and_then(|t| t.dedup_entries)) },
    Metric { name: "dedup.waiting", kind: Kind::Gauge, read: |s, _| match s.waiting { Some(0) | None => Reading::Skip, Some(change) => Reading::Change(change) } },
    Metric { name: "dedup.finalized", kind: Kind::Gauge, read: |s, _| set(s.finalized().map(|f| f.unwrap_or(0))) },
    Metric { name: "node_time.cheap", kind: Kind::Counter, read: |s, _| add(s.counts.node_time.cheap) },
    Metric { name: "node_time.heavy", kind: Kind::Counter, read: |s, _| add(s.counts.node_time.heavy) },
    Metric { name: "node_time.unpriced", kind: Kind::Counter, read: |s, _| add(s.counts.node_time.unpriced) },
    Metric { name: "node_time.waited", kind: Kind::Counter, read: |s, _| add(s.counts.node_time.waited) },
    Metric { name: "node_time.wait_refused", kind: Kind::Counter, read: |s, _| add(s.counts.node_time.wait_refused) },
    Metric { name: "node_time.waiting", kind: Kind::Gauge, read: |s, _| change(s.counts.node_time.waiting) },
    Metric { name: "node_time.slot_scale", kind: Kind::Gauge, read: |s, _| set(s.counts.node_time.slot_scale_milli) },
    Metric { name: "cache.hits", kind: Kind::Counter, read: |s, _| add(s.counts.cache.hits) },
    Metric { name: "cache.misses", kind: Kind::Counter, read: |s, _| add(s.counts.cache.misses) },
    Metric { name: "cache.uncacheable", kind: Kind::Counter, read: |s, _| add(s.counts.cache.uncacheable) },
    Metric { name: "cache.at_head", kind: Kind::Counter, read: |s, _| add(s.counts.cache.at_head) },
    Metric { name: "cache.head_polls", kind: Kind::Counter, read: |s, _| add(s.counts.cache.head_polls) },
    Metric { name: "cache.head_failed", kind: Kind::Counter, read: |s, _| add(s.counts.cache.head_failed) },
    Metric { name: "cache.head_passed", kind: Kind::Counter, read: |s, _| add(s.counts.cache.head_passed) },
    Metric { name: "cache.head_unpinned", kind: Kind::Counter, read: |s, _| add(s.counts.cache.head_unpinned) },
    Metric { name: "cache.standing_by", kind: Kind::Counter, read: |s, _| add(s.counts.cache.standing_by) },
    Metric { name: "cache.kept", kind: Kind::Counter, read: |s, _| add(s.counts.cache.kept) },
    Metric { name: "cache.not_kept", kind: Kind::Counter, read: |s, _| add(s.counts.cache.not_kept) },
    Metric { name: "cache.evicted", kind: Kind::Counter, read: |s, _| add(s.counts.cache.evicted) },
    Metric { name: "cache.entries", kind: Kind::Gauge, read: |s, _| change(s.counts.cache.entries) },
    Metric { name: "cache.bytes", kind: Kind::Gauge, read: |s, _| change(s.counts.cache.bytes) },
    Metric { name: "dedup.finality_known", kind: Kind::Gauge, read: |s, _| set(s.finalized().map(|f| u64::from(f.is_some()))) },
];
