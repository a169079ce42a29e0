//! One VM's gate: the in-flight gate, dedup's table and engagement, the
//! counts and the log lines its streams share. Everything a stream or
//! coalescing does to shared state goes through here.

use super::counts::{Counts, Ticked};
use super::reply::{Callout, Target};
use super::{Admission, Decision, Heartbeat, InflightGate, Taken, Ticket};
use crate::cache::rules::Lifetime;
use crate::cache::{Cache, Lookup, Miss};
use crate::clock::Now;
use crate::dedup::answer::Answer;
use crate::dedup::engage::Engagement;
use crate::dedup::{finality, Dedup};
use crate::gate::class::RequestClass;
use crate::gate::holds::Holds;
use crate::gate::node_time::{Busy, Meter};
use crate::gate::websocket::linger::Linger;
use crate::gate::websocket::subscriptions::Subscriptions;
use crate::rejection::Rejection;
use crate::shared::{SharedStore, StoreError};

/// How long a read of the finalized block's number is used.
const FINALIZED_MEMO_MS: u64 = 100;

/// One VM's gate: what its streams share.
#[derive(Debug)]
pub struct GateWorker {
    pub gate: InflightGate,
    /// Retry-storm protection, when the policy has it.
    pub dedup: Option<Dedup>,
    /// The answer cache, when the policy has it.
    pub cache: Option<Cache>,
    /// Whether it is engaged (with `dedup`).
    engagement: Option<Engagement>,
    pub counts: Counts,
    /// Lines for Envoy's log, taken by the glue after each call.
    log: Vec<String>,
    /// Lines logged once per VM (`note_once`), already logged.
    told: Vec<String>,
    /// The finality poll's callout at the node (`dedup::finality`).
    finality_poll: Option<u32>,
    /// An answer tied to a block found the finalized number out of date.
    wants_finality: bool,
    /// The last read of the finalized number: when, and what it said.
    finalized_read: Option<(u64, Option<u64>)>,
    /// Where requests go (their `:path` and `:authority`), for the poll.
    target: Option<Target>,
    /// The methods' learned costs (with `nodeTime`).
    pub meter: Meter,
    /// Slots held for cut sockets' units (`websocket::linger`).
    pub linger: Linger,
    /// Subscriptions open by identity (`websocket::subscriptions`).
    pub subscriptions: Subscriptions,
    /// Requests waiting for a slot (`nodeTime.waitMs`).
    waiting_for_slot: u32,
    /// Requests held at the gateway, bounded (`gate::holds`).
    holds: Holds,
    /// Whether the gate is busy (with `nodeTime`), and from how many in
    /// flight.
    pub busy: Busy,
    busy_threshold: u32,
}

impl GateWorker {
    pub fn new(gate: InflightGate) -> Self {
        let policy = gate.policy();
        let dedup = policy
            .dedup
            .clone()
            .map(|d| Dedup::new(d, policy.heartbeat_ms));
        let engagement = policy
            .dedup
            .as_ref()
            .map(|d| Engagement::new(d.engage_after_ms, d.standby_after_ms));
        let busy_threshold = policy.node_time.as_ref().map_or(u32::MAX, |n| {
            let limits = policy.limits;
            let slots = limits
                .max_inflight
                .map(|m| m.saturating_sub(limits.reserved));
            Busy::threshold(slots, n.cheap_slots)
        });
        let cache = policy.cache.clone().map(Cache::new);
        let subscriptions = Subscriptions::new(
            policy.max_subscriptions_per_websocket,
            policy.max_subscriptions_per_identity,
        );
        Self {
            gate,
            dedup,
            cache,
            engagement,
            counts: Counts::default(),
            log: Vec::new(),
            told: Vec::new(),
            finality_poll: None,
            wants_finality: false,
            finalized_read: None,
            target: None,
            meter: Meter::default(),
            linger: Linger::default(),
            subscriptions,
            waiting_for_slot: 0,
            holds: Holds::default(),
            busy: Busy::default(),
            busy_threshold,
        }
    }

    /// The node's finalized block, for an answer tied to a block; one out
    /// of date is asked for again at the next tick (`finality_poll`).
    /// A read is used for `FINALIZED_MEMO_MS` (the number only grows, so
    /// a read that old says less, never more).
    pub(super) fn finalized(&mut self, store: &impl SharedStore, now_ms: u64) -> Option<u64> {
        if let Some((at_ms, number)) = self.finalized_read {
            if now_ms.saturating_sub(at_ms) < FINALIZED_MEMO_MS {
                return number;
            }
        }
        match finality::finalized(store, now_ms) {
            Ok(known) => {
                self.wants_finality |= known.due;
                self.finalized_read = Some((now_ms, known.number));
                known.number
            }
            Err(e) => {
                self.note_store_error("finality read", &e);
                None
            }
        }
    }

    /// Whether the cache and coalescing look at a request the route sends
    /// to `cluster` (`None`: the host cannot say): only if it is
    /// `dedup.upstream.cluster`, the node they poll and send callouts to.
    /// Another cluster is another node, maybe another chain: its requests
    /// pass them by (`dedup.other_cluster`), and the log says so once.
    pub(super) fn fronts(&mut self, cluster: Option<&str>) -> bool {
        let (Some(dedup), Some(cluster)) = (&self.dedup, cluster) else {
            return true;
        };
        let upstream = &dedup.policy().upstream.cluster;
        if cluster == upstream {
            return true;
        }
        self.counts.dedup.other_cluster += 1;
        let line = format!(
            "requests routed to cluster {cluster:?} pass the cache and coalescing by: they front dedup.upstream.cluster {upstream:?} only (give each node or chain a gate of its own, see policies/admission-gate.md)"
        );
        self.note_once(&line);
        false
    }

    /// Whether the cache looks a request up (it has a cache, and keys
    /// repeat or this request is a sample), counted.
    pub(super) fn cache_looks_up(&mut self) -> bool {
        let Some(cache) = self.cache.as_mut() else {
            return false;
        };
        let looks = cache.looks_up();
        self.counts.cache.standing_by += u64::from(!looks);
        looks
    }

    /// The cache's word on a whole request body (`None`: no cache),
    /// counted. A miss at a block number above the finalized one (or with
    /// none known) comes back as `First`: its answer would not be kept, so
    /// it is not read whole.
    pub(super) fn cache_lookup(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
        body: &[u8],
        route: &str,
    ) -> Option<Lookup> {
        let meter = &self.meter;
        // What an answer saves: its method's learned node time, else the
        // same for every answer.
        let lookup = self.cache.as_mut()?.lookup(body, route, |method| {
            meter.estimate_us(method).unwrap_or(1000)
        });
        let lookup = match lookup {
            Lookup::Miss(Miss {
                lifetime: Lifetime::AtBlock(n),
                ..
            }) if self.finalized(store, now_ms).is_none_or(|f| n > f) => {
                self.counts.cache.not_kept += 1;
                Lookup::First
            }
            lookup => lookup,
        };
        let counts = &mut self.counts.cache;
        match &lookup {
            Lookup::Hit(..) => counts.hits += 1,
            Lookup::Miss(_) | Lookup::First => counts.misses += 1,
            Lookup::Uncacheable => counts.uncacheable += 1,
            Lookup::AtHead(..) => counts.at_head += 1,
        }
        Some(lookup)
    }

    /// A read at `latest` pinned to the head's hash, looked up
    /// (`Place::at_head`), counted as a lookup.
    pub(super) fn cache_lookup_pinned(&mut self, body: &[u8], route: &str) -> Option<Lookup> {
        let meter = &self.meter;
        let lookup = self.cache.as_mut()?.lookup_pinned(body, route, |method| {
            meter.estimate_us(method).unwrap_or(1000)
        });
        let counts = &mut self.counts.cache;
        match &lookup {
            Lookup::Hit(..) => counts.hits += 1,
            Lookup::Miss(_) | Lookup::First => counts.misses += 1,
            _ => counts.uncacheable += 1,
        }
        Some(lookup)
    }

    /// A read at `latest` was answered from the head poll: a hit.
    pub(super) fn cache_answered_by_head(&mut self) {
        if let Some(cache) = self.cache.as_mut() {
            cache.saw_head();
            self.counts.cache.hits += 1;
        }
    }

    /// The answer to a request that missed the cache: kept if it cannot
    /// change.
    pub(super) fn cache_keep(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
        miss: Miss,
        answer: &Answer,
    ) {
        let finalized = match miss.lifetime {
            Lifetime::AtBlock(_) | Lifetime::NamedBlock => self.finalized(store, now_ms),
            _ => None,
        };
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        let before = cache.size();
        let kept = cache.keep(miss, answer, finalized);
        let after = cache.size();
        let counts = &mut self.counts.cache;
        match kept {
            Ok(evicted) => {
                counts.kept += 1;
                counts.evicted += evicted;
            }
            Err(_) => counts.not_kept += 1,
        }
        counts.entries += after.0 as i64 - before.0 as i64;
        counts.bytes += after.1 as i64 - before.1 as i64;
    }

    /// At an engagement tick, when an answer tied to a block asked for it
    /// and no VM asked in the last `finality::POLL_MS`: the callout that
    /// asks the node for its finalized block.
    pub fn finality_poll(&mut self, store: &impl SharedStore, now_ms: u64) -> Option<Callout> {
        let upstream = self.dedup.as_ref()?.policy().upstream.clone();
        if !std::mem::take(&mut self.wants_finality) || self.finality_poll.is_some() {
            return None;
        }
        match finality::claim(store, now_ms) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                self.note_store_error("finality poll", &e);
                return None;
            }
        }
        let target = self.callout_target();
        Some(Callout::post(
            &upstream.cluster,
            &target,
            finality::REQUEST.to_vec(),
            upstream.timeout_ms.min(finality::STALE_MS),
        ))
    }

    /// The finality poll went out as `token` (`None`: the host refused).
    pub fn finality_sent(&mut self, token: Option<u32>) {
        self.finality_poll = token;
    }

    /// Callout `token` ended with `body` (`None`: no answer). Returns
    /// whether it was the finality poll.
    pub fn finality_answered(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
        token: u32,
        body: Option<&[u8]>,
    ) -> bool {
        if self.finality_poll != Some(token) {
            return false;
        }
        self.finality_poll = None;
        if let Err(e) = finality::answered(store, now_ms, body) {
            self.note_store_error("finality answer", &e);
        }
        true
    }

    /// Where requests go, for the finality poll: the first seen is kept.
    /// Where the gate's own callouts go: where requests went last.
    pub(super) fn callout_target(&self) -> Target {
        self.target.clone().unwrap_or_default()
    }

    pub(super) fn saw_target(&mut self, target: &Target) {
        if self.target.is_none() {
            self.target = Some(target.clone());
        }
    }

    /// Whether requests are checked for duplicates now (dedup is on and
    /// engaged).
    pub fn dedup_engaged(&self) -> bool {
        self.engagement.as_ref().is_some_and(Engagement::engaged)
    }

    /// Every `engage::TICK_MS`: whether dedup engages or stands by.
    pub fn engage(&mut self, store: &impl SharedStore, now_ms: u64) {
        if let Some(engagement) = &mut self.engagement {
            if let Err(e) = engagement.tick(store, now_ms) {
                self.note_store_error("dedup engagement", &e);
            }
        }
    }

    /// What to write to Envoy's log (warnings), once each.
    pub fn take_log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.log)
    }

    /// A line for Envoy's log.
    pub(super) fn note(&mut self, line: &str) {
        self.log.push(line.to_string());
    }

    /// A line for Envoy's log, once in this VM's life.
    pub(super) fn note_once(&mut self, line: &str) {
        if !self.told.iter().any(|t| t == line) {
            self.told.push(line.to_string());
            self.note(line);
        }
    }

    pub(super) fn note_store_error(&mut self, what: &str, e: &StoreError) {
        let line = self.counts.store.failed(what, e);
        self.log.push(line);
    }

    pub(super) fn taken(&mut self, taken: &Taken) {
        self.counts.store.retried(taken.cas_retries);
        if let Some(e) = &taken.store_error {
            self.note_store_error("admission failed closed", e);
        }
    }

    pub(super) fn admit(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        class: RequestClass,
        upgrade: bool,
        heavy: bool,
    ) -> Result<Ticket, Rejection> {
        let admitted = self.try_admit(store, now, class, upgrade, heavy);
        if admitted.is_err() {
            self.refused(class, upgrade);
        }
        admitted
    }

    /// `admit`, with a refusal not counted: the request may wait.
    pub(super) fn try_admit(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        class: RequestClass,
        upgrade: bool,
        heavy: bool,
    ) -> Result<Ticket, Rejection> {
        let Admission {
            decision,
            totals,
            cas_retries,
            store_error,
        } = self.gate.admit_priced(store, now, class, upgrade, heavy);
        if let Some(totals) = totals {
            self.busy
                .seen(totals.inflight(), self.busy_threshold, now.ms());
        }
        self.counts.store.retried(cas_retries);
        if let Some(e) = store_error {
            self.note_store_error("admission failed closed", &e);
        }
        match decision {
            Decision::Admit(mut ticket) => {
                if !upgrade && class != RequestClass::Internal {
                    ticket.at_node = self.engagement.as_mut().map(Engagement::started);
                }
                self.counts.admitted[class.index()] += 1;
                if ticket.slot.is_none() {
                    self.counts.internal_inflight += 1;
                }
                Ok(ticket)
            }
            Decision::Reject(rejection) => Err(rejection),
        }
    }

    /// A request would wait for a slot: whether fewer than `maxWaiting`
    /// do (then it is counted as waiting).
    pub(super) fn start_waiting(&mut self) -> bool {
        let most = self
            .gate
            .policy()
            .node_time
            .as_ref()
            .map_or(0, |n| n.max_waiting);
        let room = self.waiting_for_slot < most;
        if room {
            self.waiting_for_slot += 1;
            self.counts.node_time.waiting += 1;
        }
        room
    }

    /// Stream `id` of `class` is to be held: counted, or refused past the
    /// holding bounds (`gate::holds`).
    pub(super) fn hold(
        &mut self,
        id: u32,
        class: RequestClass,
        identity: impl FnOnce() -> Option<u64>,
    ) -> Result<(), Rejection> {
        let policy = self.gate.policy();
        let bounds = (policy.max_held, policy.max_held_per_identity);
        let before = self.holds.held();
        let held = self.holds.hold(id, class, identity, bounds);
        self.counts.held += (self.holds.held() - before) as i64;
        if held.is_err() {
            self.counts.held_refused += 1;
            self.refused(class, false);
        }
        held
    }

    /// Stream `id` is held no longer (let on, answered, or over).
    pub(super) fn release_hold(&mut self, id: u32) {
        let before = self.holds.held();
        self.holds.release(id);
        self.counts.held -= (before - self.holds.held()) as i64;
    }

    /// A request stopped waiting for a slot (it got one, was refused, or
    /// went).
    pub(super) fn stop_waiting(&mut self) {
        self.waiting_for_slot = self.waiting_for_slot.saturating_sub(1);
        self.counts.node_time.waiting -= 1;
    }

    /// Counts a refusal.
    pub(super) fn refused(&mut self, class: RequestClass, upgrade: bool) {
        self.counts.rejected[class.index()] += 1;
        self.counts.websocket.rejected += u64::from(upgrade);
    }

    /// Gives back the slots held for cut sockets whose time has come
    /// (no clock read while none is held).
    pub(super) fn give_lingering(&mut self, now: &mut Now) {
        if self.linger.held() == 0 {
            return;
        }
        for kind in self.linger.due(now.ms()) {
            self.gate.give(kind);
        }
    }

    pub(super) fn release(&mut self, mut ticket: Ticket) {
        if let (Some(at), Some(engagement)) = (ticket.at_node.take(), &mut self.engagement) {
            engagement.ended(at);
        }
        if ticket.slot.is_none() {
            self.counts.internal_inflight -= 1;
        }
        self.gate.release(ticket);
    }

    /// The heartbeat (every `heartbeatMs`): sweeps the dedup table, gives
    /// spare slots back, expires vanished workers' shards. Returns the slot
    /// totals for the gauges, and the dedup table's size.
    pub fn tick(&mut self, store: &impl SharedStore, now_ms: u64) -> Ticked {
        let mut entries = None;
        if let (Some(dedup), Some(vm)) = (self.dedup.as_ref(), self.gate.vm()) {
            match dedup.sweep(store, vm, now_ms) {
                Ok(sweep) => {
                    self.counts.dedup.purged += sweep.purged;
                    self.counts.store.retried(sweep.cas_retries);
                    entries = Some(sweep.entries);
                }
                Err(e) => self.note_store_error("dedup sweep", &e),
            }
        }
        let totals = match self.gate.heartbeat(store, now_ms) {
            Ok(Heartbeat {
                totals,
                expired_slots,
                cas_retries,
            }) => {
                self.counts.store.retried(cas_retries);
                self.counts.expired_slots += expired_slots;
                self.busy
                    .seen(totals.inflight(), self.busy_threshold, now_ms);
                self.busy.tick(now_ms);
                if expired_slots > 0 {
                    self.log.push(format!(
                        "reclaimed {expired_slots} slots held by a worker that stopped heartbeating"
                    ));
                }
                Some(totals)
            }
            Err(e) => {
                self.note_store_error("heartbeat", &e);
                None
            }
        };
        let finalized = match self.dedup {
            Some(_) => finality::finalized(store, now_ms)
                .ok()
                .and_then(|k| k.number),
            None => None,
        };
        Ticked {
            totals,
            dedup_entries: entries,
            finalized,
        }
    }

    /// Takes this worker's shard before traffic arrives; if the store is
    /// unavailable, the first request joins instead.
    pub fn join(&mut self, store: &impl SharedStore, now_ms: u64) {
        if let Err(e) = self.gate.join(store, now_ms) {
            self.note_store_error("joining the shared slot table", &e);
        }
    }

    /// The plugin is being deleted: spare slots go back at once.
    pub fn leave(&mut self, store: &impl SharedStore, now_ms: u64) {
        match self.gate.leave(store, now_ms) {
            Ok(0) => {}
            Ok(held) => self.log.push(format!(
                "leaving with {held} slots still held; they expire with the stale-slot TTL"
            )),
            Err(e) => self.note_store_error("leaving the slot table", &e),
        }
    }
}
