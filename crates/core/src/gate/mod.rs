//! The RPC admission gate (docs/background.md part 5, the "outer gate"), as seen by
//! one worker VM.
//!
//! One room per role; a file imports only those above it in this list:
//!
//! - `policy`: the policy document and its validation.
//! - `class`: internal / priority / default, from facts a client cannot forge.
//! - `shards`: the shared per-worker slot counts and the admission rule,
//!   kept in shared data by compare-and-swap (`crate::shared`).
//! - `drain`: the completion rate and the jittered `retry-after`.
//! - `reply`: what the gate sends on its own: replies and callouts.
//! - `counts`: what a VM counts, for the metrics.
//! - `worker`: one VM's gate, dedup state, counts and log, which its
//!   streams share.
//! - `websocket`: a public WebSocket's messages, slots and ids.
//! - `held`: a request's place while coalescing may hold it.
//! - `coalesce`: what settles the requests held for an answer.
//! - `stream`: one request's way through the gate (headers, body, response,
//!   end).
//! - `registry`: the VM's streams by context id, and the scheduling between
//!   them; the filter glue only makes the host calls it returns.
//!
//! **Spare slots.** A released slot is not written back at once: the worker
//! keeps it (`shards::Spare`) and its next request of the same kind reuses
//! it without touching shared data; spares return to the shared pool at the
//! next heartbeat. So a busy worker pays shared-data round trips only when
//! it needs more slots than it already holds. The limit stays exact, since a
//! spare still counts against it, and the price is that an idle worker's
//! spares stay reserved for up to one heartbeat.
//!
//! Where it differs from Erigon's gate: the count spans every Envoy worker
//! (Erigon counts in one process); internal callers are recognised by
//! listener, address or certificate instead of by code path; a `reserved`
//! share of slots is kept for priority traffic (left open in the source);
//! and `retry-after` is derived from the drain rate and jittered instead of
//! a constant 1 s.

pub mod at_head;
pub mod class;
pub mod coalesce;
pub mod counts;
pub mod drain;
pub mod held;
pub mod holds;
pub mod node_time;
pub mod policy;
pub mod registry;
pub mod reply;
pub mod shards;
pub mod stream;
pub mod websocket;
pub mod worker;

use crate::clock::Now;
use crate::dedup::engage::AtNode;
use crate::rejection::{retry_after_s, Fact, Jitter, Rejection, Rule, LIMIT_EXCEEDED};
use crate::shared::{update, Change, SharedStore, StoreError};
use class::RequestClass;
use drain::DrainRate;
use policy::GatePolicy;
use shards::{Limits, ShardTable, SlotKind, Slots, Spare, Totals};

/// The shared-data key; the layout version is part of it and of the value.
pub const SHARED_KEY: &str = "stakegate.admission_gate.v1.shards";

/// What an admitted request holds until it ends. Not `Copy`: a slot is
/// given back by moving its ticket into `InflightGate::release`, once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket holds a slot until it is released"]
pub struct Ticket {
    pub class: RequestClass,
    /// `None` for internal traffic, which holds no slot.
    pub slot: Option<SlotKind>,
    /// A public HTTP request, counted at the node for dedup's engagement.
    pub at_node: Option<AtNode>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    Admit(Ticket),
    Reject(Rejection),
}

/// A decision plus what the filter reports as metrics.
#[derive(Debug, PartialEq)]
pub struct Admission {
    pub decision: Decision,
    /// Slot totals as written or read; `None` when the store was not used.
    pub totals: Option<Totals>,
    pub cas_retries: u32,
    /// Set when the shared store failed; the decision is then a rejection.
    pub store_error: Option<StoreError>,
}

/// The slot a request of `class` takes (internal requests take none, but
/// have a kind for WebSocket bookkeeping: they are never limited).
pub fn slot_of(class: RequestClass) -> SlotKind {
    match class {
        RequestClass::Priority => SlotKind::Priority,
        RequestClass::Internal | RequestClass::Default => SlotKind::Default,
    }
}

/// The outcome of `InflightGate::take`.
#[derive(Debug, Clone, PartialEq)]
pub struct Taken {
    pub ok: bool,
    /// Slots taken (0 unless `ok`).
    pub count: u32,
    /// Slot totals as written or read; `None` when a spare slot served.
    pub totals: Option<Totals>,
    pub cas_retries: u32,
    /// Set when the shared store failed (then `ok` is false: fail closed).
    pub store_error: Option<StoreError>,
}

impl Taken {
    fn failed(cas_retries: u32, e: StoreError) -> Self {
        Self {
            ok: false,
            count: 0,
            totals: None,
            cas_retries,
            store_error: Some(e),
        }
    }
}

/// What a heartbeat found.
#[derive(Debug, Clone, PartialEq)]
pub struct Heartbeat {
    pub totals: Totals,
    /// Slots reclaimed from workers that stopped heartbeating.
    pub expired_slots: u64,
    pub cas_retries: u32,
}

/// One worker VM's side of the gate.
#[derive(Debug, Clone)]
pub struct InflightGate {
    policy: GatePolicy,
    vm: Option<u32>,
    spare: Spare,
    drain: DrainRate,
    jitter: Jitter,
    /// `maxInflight` is scaled by this (`node_time::Occupancy`).
    slot_scale: f64,
}

impl InflightGate {
    pub fn new(policy: GatePolicy, seed: u64) -> Self {
        Self {
            policy,
            vm: None,
            spare: Spare::default(),
            drain: DrainRate::default(),
            jitter: Jitter::new(seed),
            slot_scale: 1.0,
        }
    }

    pub fn policy(&self) -> &GatePolicy {
        &self.policy
    }

    /// The limits requests are let on by: the policy's, with `maxInflight`
    /// scaled by how much longer a slot is held than the node works, up to
    /// `nodeTime.nodeSlots`.
    pub fn limits(&self) -> Limits {
        let node_slots = self.policy.node_time.as_ref().and_then(|n| n.node_slots);
        self.policy.limits.scaled(self.slot_scale, node_slots)
    }

    /// Sets the slot scale (`node_time::Occupancy`).
    pub fn scale_slots(&mut self, scale: f64) {
        self.slot_scale = scale;
    }

    /// Whether this VM holds a spare `kind` slot (its next request of that
    /// kind takes it without touching shared data).
    pub fn has_spare(&self, kind: SlotKind) -> bool {
        self.spare.slots.count(kind) > 0
    }

    /// This VM's shard id, once joined.
    pub fn vm(&self) -> Option<u32> {
        self.vm
    }

    /// A number no client can guess, for ids of the gate's own (a
    /// WebSocket's gateway ids).
    pub fn nonce(&mut self) -> u64 {
        self.jitter.next_u64()
    }

    pub fn drain_per_second(&self) -> f64 {
        self.drain.per_second()
    }

    /// Joins the shared table (once) and returns this VM's shard id.
    pub fn join(&mut self, store: &impl SharedStore, now_ms: u64) -> Result<u32, StoreError> {
        if let Some(vm) = self.vm {
            return Ok(vm);
        }
        let vm = update(store, SHARED_KEY, |table: &mut ShardTable| {
            Change::Write(table.join(now_ms))
        })
        .map_err(|(e, _)| e)?
        .value;
        self.vm = Some(vm);
        Ok(vm)
    }

    /// Decides one request (a WebSocket upgrade takes a connection
    /// place). Internal traffic is admitted without touching shared state;
    /// everything else takes a slot by CAS or is rejected.
    pub fn admit(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        class: RequestClass,
        websocket: bool,
    ) -> Admission {
        self.admit_priced(store, now, class, websocket, false)
    }

    /// `admit`, for a request that may not take the slots kept for cheap
    /// calls if `heavy` (`nodeTime.cheapSlots`).
    pub fn admit_priced(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        class: RequestClass,
        websocket: bool,
        heavy: bool,
    ) -> Admission {
        let slot = match (class, websocket) {
            (RequestClass::Internal, _) => {
                return Admission {
                    decision: Decision::Admit(Ticket {
                        class,
                        slot: None,
                        at_node: None,
                    }),
                    totals: None,
                    cas_retries: 0,
                    store_error: None,
                }
            }
            (_, true) => SlotKind::Websocket,
            (class, false) => slot_of(class),
        };
        let taken = self.take_slots(store, now, slot, 1, 1, heavy);
        if taken.ok {
            Admission {
                decision: Decision::Admit(Ticket {
                    class,
                    slot: Some(slot),
                    at_node: None,
                }),
                totals: taken.totals,
                cas_retries: taken.cas_retries,
                store_error: None,
            }
        } else {
            self.refuse(
                slot,
                taken.totals.unwrap_or_default(),
                taken.cas_retries,
                taken.store_error,
            )
        }
    }

    /// Takes one `slot`: a spare one if this VM has it, else one from the
    /// shared pool by CAS if the limits allow.
    pub fn take(&mut self, store: &impl SharedStore, now: &mut Now, slot: SlotKind) -> Taken {
        self.take_n(store, now, slot, 1)
    }

    /// Takes `n` `slot`s at once, or none: from this VM's spares if it has
    /// that many, else from the shared pool by one CAS.
    pub fn take_n(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        slot: SlotKind,
        n: u32,
    ) -> Taken {
        self.take_between(store, now, slot, n, n)
    }

    /// Takes as many `slot`s as there are, up to `most`, if that is at
    /// least `least`, or none (`Taken::count`): from this VM's spares if it
    /// has `most`, else from the shared pool by one CAS (which returns the
    /// spares first).
    pub fn take_between(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        slot: SlotKind,
        least: u32,
        most: u32,
    ) -> Taken {
        self.take_slots(store, now, slot, least, most, false)
    }

    /// `take_between`; a `heavy` request leaves the cheap slots free. It
    /// takes no spare: the shared write returns them first, and only the
    /// shared count says whether a cheap slot would be taken.
    pub fn take_slots(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        slot: SlotKind,
        least: u32,
        most: u32,
        heavy: bool,
    ) -> Taken {
        let heavy = heavy && self.policy.limits.cheap > 0;
        if !heavy && self.spare.take_n(slot, most) {
            return Taken {
                ok: true,
                count: most,
                totals: None,
                cas_retries: 0,
                store_error: None,
            };
        }
        let now_ms = now.ms();
        let vm = match self.join(store, now_ms) {
            Ok(vm) => vm,
            Err(e) => return Taken::failed(0, e),
        };
        let limits = self.limits();
        let spare = self.spare;
        let result = update(store, SHARED_KEY, |table: &mut ShardTable| {
            // Spares go back to the pool with this write.
            table.heartbeat(vm, now_ms, &spare);
            match table.try_admit_between(vm, now_ms, slot, least..=most, heavy, &limits) {
                0 if spare.is_empty() => Change::Keep(0),
                taken => Change::Write(taken),
            }
        });
        match result {
            Ok(updated) => {
                // Any spares were returned by the write (or there were none).
                self.spare = Spare::default();
                Taken {
                    ok: updated.value > 0,
                    count: updated.value,
                    totals: Some(updated.table.totals()),
                    cas_retries: updated.retries,
                    store_error: None,
                }
            }
            Err((e, retries)) => Taken::failed(retries, e),
        }
    }

    /// Gives back one `slot` taken with `take`: it becomes spare, for this
    /// VM's next request or its next heartbeat. Touches no shared data.
    pub fn give(&mut self, slot: SlotKind) {
        self.spare.release(slot);
    }

    fn refuse(
        &mut self,
        slot: SlotKind,
        totals: Totals,
        cas_retries: u32,
        store_error: Option<StoreError>,
    ) -> Admission {
        let (rule, held, message) = match slot {
            SlotKind::Websocket => (
                Rule::GateWebsockets,
                totals.websocket,
                "websocket connection limit reached, retry later",
            ),
            _ => (
                Rule::GateInflight,
                totals.inflight(),
                "the node is at its in-flight request limit, retry later",
            ),
        };
        let retry_after_s = retry_after_s(
            held,
            self.drain.per_second(),
            self.jitter.next_unit(),
            self.policy.retry_after_max_s,
        );
        let mut facts = vec![Fact::Inflight(held)];
        facts.extend(self.limits().most(slot).map(Fact::Limit));
        Admission {
            decision: Decision::Reject(Rejection::explained(
                rule,
                Rejection::OVERLOADED,
                retry_after_s,
                LIMIT_EXCEEDED,
                message,
                &facts,
            )),
            totals: Some(totals),
            cas_retries,
            store_error,
        }
    }

    /// Gives back what `ticket` holds (see `give`).
    pub fn release(&mut self, ticket: Ticket) {
        if let Some(slot) = ticket.slot {
            self.give(slot);
        }
    }

    /// Refreshes this VM's shard, returns its spare slots, expires dead
    /// workers' shards, and updates the drain rate. Called on every tick;
    /// if the write fails, the spares stay and go back next time.
    pub fn heartbeat(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
    ) -> Result<Heartbeat, StoreError> {
        let vm = self.join(store, now_ms)?;
        let spare = self.spare;
        let ttl = self.policy.stale_slot_ttl_ms;
        let updated = update(store, SHARED_KEY, |table: &mut ShardTable| {
            let expired = table.expire(now_ms, ttl);
            table.heartbeat(vm, now_ms, &spare);
            Change::Write(expired)
        })
        .map_err(|(e, _)| e)?;
        self.spare = Spare::default();
        self.drain.observe(now_ms, updated.table.completions);
        Ok(Heartbeat {
            totals: updated.table.totals(),
            expired_slots: updated.value,
            cas_retries: updated.retries,
        })
    }

    /// Gives this VM's spare slots back to the shared pool now, so that a
    /// request waiting on another worker can take them (`nodeTime.waitMs`).
    /// Returns the CAS retries, or `None` if there were none to give.
    pub fn give_back(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
    ) -> Result<Option<u32>, StoreError> {
        let (Some(vm), false) = (self.vm, self.spare.slots == Slots::default()) else {
            return Ok(None);
        };
        let spare = self.spare;
        let updated = update(store, SHARED_KEY, |table: &mut ShardTable| {
            table.heartbeat(vm, now_ms, &spare);
            Change::Write(())
        })
        .map_err(|(e, _)| e)?;
        self.spare = Spare::default();
        Ok(Some(updated.retries))
    }

    /// This VM's plugin is being deleted (a swap, a reload): gives its
    /// spare slots back and drops its shard, so they do not wait out the
    /// stale-slot TTL. Returns the slots still held by requests it had not
    /// finished; those expire with the TTL.
    pub fn leave(&mut self, store: &impl SharedStore, now_ms: u64) -> Result<u64, StoreError> {
        let Some(vm) = self.vm.take() else {
            return Ok(0);
        };
        let spare = std::mem::take(&mut self.spare);
        update(store, SHARED_KEY, |table: &mut ShardTable| {
            Change::Write(table.leave(vm, now_ms, &spare))
        })
        .map(|updated| updated.value)
        .map_err(|(e, _)| {
            self.spare = spare;
            e
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    fn gate(policy: &str, seed: u64) -> InflightGate {
        InflightGate::new(GatePolicy::parse(policy.as_bytes()).unwrap(), seed)
    }

    fn ticket(admission: Admission) -> Ticket {
        match admission.decision {
            Decision::Admit(ticket) => ticket,
            Decision::Reject(_) => panic!("rejected: {admission:?}"),
        }
    }

    #[test]
    fn heavy_requests_and_socket_messages_leave_the_cheap_slot() {
        let policy = r#"{"maxInflight": 3, "decideOnBody": true, "nodeTime": {"cheapSlots": 1}}"#;
        let mut g = gate(policy, 1);
        let store = MemoryStore::default();
        let now = &mut Now::fixed(0);
        let heavy = |g: &mut InflightGate, now: &mut Now| {
            g.admit_priced(&store, now, RequestClass::Default, false, true)
        };
        let _one = ticket(heavy(&mut g, now));
        let socket = g.take_slots(&store, now, SlotKind::Default, 1, 2, true);
        assert_eq!(
            (socket.ok, socket.count),
            (true, 1),
            "one of two: the last is kept"
        );
        assert!(matches!(heavy(&mut g, now).decision, Decision::Reject(_)));
        let cheap = g.admit_priced(&store, now, RequestClass::Default, false, false);
        let _cheap = ticket(cheap);
    }

    #[test]
    fn internal_traffic_is_never_rejected_nor_counted() {
        let store = MemoryStore::default();
        let mut worker = gate(r#"{"maxInflight": 1}"#, 1);
        let first = worker.admit(&store, &mut Now::fixed(0), RequestClass::Default, false);
        assert!(matches!(first.decision, Decision::Admit(_)));
        for _ in 0..100 {
            let internal = worker.admit(&store, &mut Now::fixed(0), RequestClass::Internal, false);
            assert_eq!(
                internal.decision,
                Decision::Admit(Ticket {
                    class: RequestClass::Internal,
                    slot: None,
                    at_node: None,
                })
            );
        }
        assert!(matches!(
            worker
                .admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
                .decision,
            Decision::Reject(_)
        ));
    }

    #[test]
    fn a_rejection_has_the_unified_shape() {
        let store = MemoryStore::default();
        let mut worker = gate(r#"{"maxInflight": 1}"#, 1);
        worker.admit(&store, &mut Now::fixed(0), RequestClass::Default, false);
        let Decision::Reject(rejection) = worker
            .admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
            .decision
        else {
            panic!("admitted over the limit");
        };
        assert!(rejection.retry_after_s >= 1);
        assert_eq!(
            rejection.body,
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32005,"message":"the node is at its in-flight request limit, retry later","data":{"rule":"gate-inflight","retryAfter":1,"inFlight":1,"limit":1}}}"#
        );
        assert_eq!(
            rejection.headers[0],
            ("x-stakegate-rule", "gate-inflight".into())
        );
    }

    #[test]
    fn workers_share_one_limit() {
        let store = MemoryStore::default();
        let mut a = gate(r#"{"maxInflight": 2}"#, 1);
        let mut b = gate(r#"{"maxInflight": 2}"#, 2);
        let _held = ticket(a.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        let _held = ticket(b.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        assert!(matches!(
            a.admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
                .decision,
            Decision::Reject(_)
        ));
        assert!(matches!(
            b.admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
                .decision,
            Decision::Reject(_)
        ));
        assert_ne!(a.vm(), b.vm());
    }

    #[test]
    fn a_released_slot_is_reused_without_shared_data_then_returned_by_the_heartbeat() {
        let store = MemoryStore::default();
        let mut a = gate(r#"{"maxInflight": 1}"#, 1);
        let mut b = gate(r#"{"maxInflight": 1}"#, 2);
        let first = ticket(a.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        a.release(first);
        let (_, cas_before) = store.load(SHARED_KEY).unwrap();
        let reuse = a.admit(&store, &mut Now::fixed(0), RequestClass::Default, false);
        assert!(matches!(reuse.decision, Decision::Admit(_)));
        assert_eq!(reuse.totals, None, "served from the spare slot");
        assert_eq!(
            store.load(SHARED_KEY).unwrap().1,
            cas_before,
            "no shared write"
        );

        a.release(ticket(reuse));
        assert!(
            matches!(
                b.admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
                    .decision,
                Decision::Reject(_)
            ),
            "a spare still counts against the limit"
        );
        let beat = a.heartbeat(&store, 1).unwrap();
        assert_eq!(beat.totals, Totals::default(), "the heartbeat returned it");
        assert!(matches!(
            b.admit(&store, &mut Now::fixed(2), RequestClass::Default, false)
                .decision,
            Decision::Admit(_)
        ));
    }

    #[test]
    fn spares_are_only_reused_by_their_own_kind() {
        let store = MemoryStore::default();
        let mut a = gate(r#"{"maxInflight": 2, "reserved": 1}"#, 1);
        let priority = ticket(a.admit(&store, &mut Now::fixed(0), RequestClass::Priority, false));
        a.release(priority);
        let default = a.admit(&store, &mut Now::fixed(0), RequestClass::Default, false);
        assert!(matches!(default.decision, Decision::Admit(_)));
        assert_eq!(
            default.totals.unwrap().default,
            1,
            "taken from the pool, which got the spare back"
        );
        assert_eq!(default.totals.unwrap().priority, 0);
        assert!(
            matches!(
                a.admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
                    .decision,
                Decision::Reject(_)
            ),
            "default still cannot take the reserve"
        );
    }

    #[test]
    fn a_leaving_vm_gives_its_spares_back_at_once() {
        let store = MemoryStore::default();
        let policy = r#"{"maxInflight": 2}"#;
        let (mut old, mut new) = (gate(policy, 1), gate(policy, 2));
        let done = ticket(old.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        let open = ticket(old.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        old.release(done);
        assert!(
            matches!(
                new.admit(&store, &mut Now::fixed(0), RequestClass::Default, false)
                    .decision,
                Decision::Reject(_)
            ),
            "the spare still counts"
        );
        assert_eq!(old.leave(&store, 10).unwrap(), 1, "one request still open");
        assert!(matches!(
            new.admit(&store, &mut Now::fixed(10), RequestClass::Default, false)
                .decision,
            Decision::Admit(_)
        ));
        // The open request's slot stays counted until the stale-slot TTL.
        assert!(open.slot.is_some());
        assert_eq!(new.heartbeat(&store, 20).unwrap().totals.default, 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Admit {
            worker: usize,
            class: RequestClass,
            websocket: bool,
        },
        Release {
            worker: usize,
            pick: usize,
        },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let class = prop_oneof![
            Just(RequestClass::Internal),
            Just(RequestClass::Priority),
            Just(RequestClass::Default)
        ];
        prop_oneof![
            (0..4usize, class, proptest::bool::weighted(0.1)).prop_map(
                |(worker, class, websocket)| Op::Admit {
                    worker,
                    class,
                    websocket
                }
            ),
            (0..4usize, any::<usize>()).prop_map(|(worker, pick)| Op::Release { worker, pick }),
        ]
    }

    proptest::proptest! {
        /// Over any interleaving of four workers, the slots counted (in use
        /// and spare) never pass the limit, default traffic never takes the
        /// reserve, and releasing everything and a heartbeat per worker
        /// return every count to zero.
        #[test]
        fn never_over_the_limit_and_back_to_zero(ops in proptest::collection::vec(op(), 1..300)) {
            let store = MemoryStore::default();
            let policy = r#"{"maxInflight": 5, "reserved": 2, "maxWebsocketConnections": 2}"#;
            let mut workers: Vec<InflightGate> = (0..4).map(|i| gate(policy, i + 1)).collect();
            let mut held: Vec<Vec<Ticket>> = (0..4).map(|_| Vec::new()).collect();
            for op in ops {
                match op {
                    Op::Admit { worker, class, websocket } => {
                        let admission = workers[worker].admit(&store, &mut Now::fixed(0), class, websocket);
                        if let Decision::Admit(ticket) = admission.decision {
                            held[worker].push(ticket);
                        }
                    }
                    Op::Release { worker, pick } => {
                        if !held[worker].is_empty() {
                            let index = pick % held[worker].len();
                            let ticket = held[worker].swap_remove(index);
                            workers[worker].release(ticket);
                        }
                    }
                }
                let totals = workers[0].heartbeat(&store, 0).unwrap().totals;
                proptest::prop_assert!(totals.inflight() <= 5);
                proptest::prop_assert!(totals.default <= 3);
                proptest::prop_assert!(totals.websocket <= 2);
            }
            for (worker, tickets) in held.iter_mut().enumerate() {
                for ticket in tickets.drain(..) {
                    workers[worker].release(ticket);
                }
            }
            for worker in &mut workers {
                worker.heartbeat(&store, 0).unwrap();
            }
            proptest::prop_assert_eq!(workers[0].heartbeat(&store, 0).unwrap().totals, Totals::default());
        }
    }

    #[test]
    fn a_dead_workers_slots_expire_after_the_ttl() {
        // (A dead worker's spares are in its shard too, and expire with it.)
        let store = MemoryStore::default();
        let policy = r#"{"maxInflight": 2, "heartbeatMs": 100, "staleSlotTtlMs": 1000}"#;
        let mut dead = gate(policy, 1);
        let mut alive = gate(policy, 2);
        let _held = ticket(dead.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        let _held = ticket(dead.admit(&store, &mut Now::fixed(0), RequestClass::Default, false));
        drop(dead); // never heartbeats again
        assert!(matches!(
            alive
                .admit(&store, &mut Now::fixed(500), RequestClass::Default, false)
                .decision,
            Decision::Reject(_)
        ));
        let beat = alive.heartbeat(&store, 1000).unwrap();
        assert_eq!((beat.expired_slots, beat.totals.inflight()), (0, 2));
        let beat = alive.heartbeat(&store, 1001).unwrap();
        assert_eq!((beat.expired_slots, beat.totals.inflight()), (2, 0));
        assert!(matches!(
            alive
                .admit(&store, &mut Now::fixed(1002), RequestClass::Default, false)
                .decision,
            Decision::Admit(_)
        ));
    }

    #[test]
    fn a_foreign_layout_fails_closed_with_the_reason() {
        let store = MemoryStore::default();
        store.store(SHARED_KEY, &[7, 0, 0], None).unwrap();
        let mut worker = gate(r#"{"maxInflight": 2}"#, 1);
        let admission = worker.admit(&store, &mut Now::fixed(0), RequestClass::Default, false);
        assert!(matches!(admission.decision, Decision::Reject(_)));
        assert_eq!(
            admission.store_error.unwrap().to_string(),
            "shared gate state has layout version 7, this module reads 1"
        );
        assert!(matches!(
            worker
                .admit(&store, &mut Now::fixed(0), RequestClass::Internal, false)
                .decision,
            Decision::Admit(_)
        ));
    }
}
