//! The gate in the node's time (policy `nodeTime`): what a request costs
//! the node, measured where the node's work begins and ends.
//!
//! A request holds its slot from when the gate lets it on to when the
//! node's answer starts: that span is the node's time on it, with no wait
//! at the gateway in it (a request that waited for a slot is measured from
//! when it got one), or the node says it (`serviceTimeHeader`). The gate
//!
//! - **measures** each answer's node time and tells the filters before it
//!   in the stream's filter state (`cost::NODE_US_PROPERTY`): stake QoS charges it
//!   instead of its own clock, which would count the wait here (a request
//!   that took a spare slot at once waited for nothing: unless the node
//!   says its time, the gate leaves it to QoS's clock). A request
//!   the gate answers itself (a coalesced waiter, a reused answer) is told
//!   `0`: the node did no work for it;
//! - **learns** each method's cost from those times (per worker: it only
//!   sorts calls into cheap and heavy, so no record is shared);
//! - **keeps slots for cheap calls** (`cheapSlots`): a request whose calls
//!   are all known and together cost at most `cheapBelowMs` may take every
//!   slot; any other may not take the last `cheapSlots`, so heavy calls can
//!   never fill the node and a light caller's call finds a slot free;
//! - **lets a request wait** for a slot (`waitMs`, at most `maxWaiting` per
//!   worker) rather than shedding it: the requests that reach the gate were
//!   admitted by stake QoS in their stakes' shares, and shedding whoever
//!   comes next when the gate is full would undo that. Waiting requests go
//!   on oldest first, across workers too (`Waiters`); one still waiting
//!   after `waitMs` is refused with 503.

use crate::clock::Now;
pub use crate::cost::NODE_US_PROPERTY;
use crate::cost::{BodyCost, Costs, Estimates, Unit, MAX_METHODS};
use crate::rejection::Rejection;
use crate::shared::{Reader, Record};
use crate::validate::{ensure, header_name, Fields, PolicyError};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};

/// How often each worker ticks while requests may wait: its waiting
/// requests look for a slot freed on another worker (its own releases and
/// other workers' wakes let them go at once), and an idle worker hands its
/// spare slots to other workers' waiting requests.
pub const WAIT_TICK_MS: u64 = 5;
pub const MAX_WAIT_MS: u64 = 60_000;
pub const MAX_WAITING: u32 = 100_000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct NodeTimeDoc {
    #[serde(default)]
    cheap_slots: Option<u32>,
    #[serde(default)]
    cheap_below_ms: Option<f64>,
    #[serde(default)]
    wait_ms: Option<u64>,
    #[serde(default)]
    max_waiting: Option<u32>,
    #[serde(default)]
    service_time_header: Option<String>,
    #[serde(default)]
    node_slots: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeTimePolicy {
    pub cheap_slots: u32,
    pub cheap_below_us: u64,
    pub wait_ms: u64,
    pub max_waiting: u32,
    /// A response header in which the node says its time on the request,
    /// in µs: used instead of the gate's clock, which also counts the hop
    /// to the node and back.
    pub service_time_header: Option<String>,
    /// The node's read concurrency: with `service_time_header`, the gate
    /// lets on up to this many (`maxInflight` scaled, `Occupancy`).
    /// `None`: `maxInflight`, no scale.
    pub node_slots: Option<u32>,
}

impl NodeTimePolicy {
    /// Compiles the block; `slots` is what public default traffic may take
    /// (`maxInflight` less `reserved`, `None` in pass-through), and the
    /// block needs `decideOnBody`, which gives the gate the whole body to
    /// price and to hold.
    pub(super) fn compile(
        doc: NodeTimeDoc,
        slots: Option<u32>,
        max_inflight: Option<u32>,
        decide_on_body: bool,
        f: &mut Fields,
    ) -> Result<Self, PolicyError> {
        ensure(decide_on_body, "nodeTime", || {
            "needs decideOnBody: true (the gate prices and holds a request by its whole body)"
                .into()
        })?;
        let cheap_slots = f.or("nodeTime.cheapSlots", doc.cheap_slots, 1);
        if let Some(slots) = slots {
            ensure(cheap_slots < slots, "nodeTime.cheapSlots", || {
                format!("must be less than maxInflight less reserved ({slots}), or heavy calls could never run; got {cheap_slots}")
            })?;
        }
        let cheap_below_ms = f.finite(
            "nodeTime.cheapBelowMs",
            doc.cheap_below_ms,
            1.0,
            0.0,
            60_000.0,
        )?;
        let wait_ms = f.range("nodeTime.waitMs", doc.wait_ms, 1000, 0, MAX_WAIT_MS)?;
        let max_waiting = f.range("nodeTime.maxWaiting", doc.max_waiting, 1024, 0, MAX_WAITING)?;
        let service_time_header = f.or_else(
            "nodeTime.serviceTimeHeader",
            doc.service_time_header.map(Some),
            "none",
            || None,
        );
        let service_time_header = service_time_header
            .map(|name| header_name("nodeTime.serviceTimeHeader", name))
            .transpose()?;
        if let Some(node_slots) = doc.node_slots {
            ensure(service_time_header.is_some(), "nodeTime.nodeSlots", || {
                "needs serviceTimeHeader: only the node's word on its time tells the hop to the node from the node's work".into()
            })?;
            ensure(
                node_slots >= max_inflight.unwrap_or(0) && node_slots <= 1_000_000,
                "nodeTime.nodeSlots",
                || {
                    format!(
                        "must be at least maxInflight ({}) and at most 1000000; got {node_slots}",
                        max_inflight.unwrap_or(0)
                    )
                },
            )?;
        }
        let node_slots = f.or_else(
            "nodeTime.nodeSlots",
            doc.node_slots.map(Some),
            "maxInflight",
            || None,
        );
        Ok(Self {
            node_slots,
            service_time_header,
            cheap_slots,
            cheap_below_us: (cheap_below_ms * 1000.0).round() as u64,
            wait_ms,
            max_waiting,
        })
    }
}

/// One worker's learned costs per method, and the methods it is learning
/// now: the first call of a method not measured yet goes as cheap (a
/// probe), so that a light method is not held behind heavy ones until its
/// first answer; the others wait for that answer, as heavy.
///
/// A method's cost is held at its dearest recent call, halving every
/// `HELD_HALF_LIFE_MS` without a dearer one: a mean would let a client
/// that floods a heavy method with calls the node refuses at once (fast
/// errors) make it look cheap, and then every client's heavy calls of it
/// would take the cheap slots.
#[derive(Debug, Default)]
pub struct Meter {
    learned: Estimates,
    /// When each method's cost was last measured (ms).
    measured_ms: HashMap<u64, u64>,
    probing: HashSet<u64>,
    occupancy: Occupancy,
}

/// How much longer a request holds its slot than the node works on it, as
/// the node says (`serviceTimeHeader`): the hop to the node and back and
/// Envoy's own time, which a busy gateway host makes long. The gate lets
/// on that many times `maxInflight` (`Limits::scaled`, at most
/// `MAX_SLOT_SCALE` times, and never more than `nodeSlots`, the node's read
/// concurrency), so that about `maxInflight` requests are at work in the
/// node whatever the host's load: were slots counted in the gateway's
/// time, a slow Envoy would leave the node idle while admitted requests
/// wait. The node's own queue is in the slot's time but not in what the
/// node says, so the scale cannot tell a node that queues from a slow hop:
/// `nodeSlots` bounds it, so the node never holds more than it can work on
/// (without it a node with fewer slots than the gate lets on made the
/// scale grow on its own queue). Without `nodeSlots` there is no scale.
#[derive(Debug, Clone, Copy, Default)]
struct Occupancy {
    slot_us: f64,
    node_us: f64,
}

/// The most the gate scales its slots by (`Occupancy`).
pub const MAX_SLOT_SCALE: f64 = 4.0;
/// What each new answer leaves of the sums before it (about the last few
/// hundred answers count).
const OCCUPANCY_KEPT: f64 = 0.995;

impl Occupancy {
    fn add(&mut self, slot_us: u64, node_us: u64) {
        self.slot_us = self.slot_us * OCCUPANCY_KEPT + slot_us as f64;
        self.node_us = self.node_us * OCCUPANCY_KEPT + node_us as f64;
    }

    fn scale(&self) -> f64 {
        if self.node_us <= 0.0 {
            return 1.0;
        }
        (self.slot_us / self.node_us).clamp(1.0, MAX_SLOT_SCALE)
    }
}

/// How fast a method's held cost falls while no call as dear comes.
pub const HELD_HALF_LIFE_MS: u64 = 1_000;

/// What the gate knows of a request's cost before it runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Priced {
    /// Every call's method is known and together they cost at most
    /// `cheapBelowMs`.
    pub cheap: bool,
    /// The method, if every call is of one (what its time teaches).
    pub method: Option<u64>,
    pub calls: u32,
    /// The first call of a method not measured yet (`method`).
    pub probe: bool,
}

impl Meter {
    /// A method's learned cost in µs, if it has one.
    pub fn estimate_us(&self, method: &str) -> Option<u64> {
        let ms = self.learned.get(crate::cost::method_key(method))?;
        ms.is_finite().then(|| (ms * 1000.0).round() as u64)
    }

    /// Prices a whole body: a body the strict reader does not take is not
    /// cheap, nor is a method not measured yet unless its call is the
    /// method's probe (one at a time, while the table has room).
    pub fn price(&mut self, body: &[u8], cheap_below_us: u64) -> Priced {
        let unknown = Costs {
            unit: Unit::NodeTime,
            table: Default::default(),
            default: f64::INFINITY,
        };
        let BodyCost {
            units: ms,
            method,
            calls,
        } = unknown.of_body(body, &self.learned);
        let probe = match method {
            Some(key) if ms.is_infinite() && calls == 1 && self.learned.len() < MAX_METHODS => {
                self.probing.insert(key)
            }
            _ => false,
        };
        Priced {
            cheap: probe || ms * 1000.0 <= cheap_below_us as f64,
            method,
            calls,
            probe,
        }
    }

    /// A request priced `priced` took the node `us`, measured at `now_ms`.
    pub fn learn(&mut self, priced: Priced, us: u64, now_ms: u64) {
        if let Some(method) = priced.method {
            let since = self.measured_ms.insert(method, now_ms);
            let elapsed = since.map_or(0, |at| now_ms.saturating_sub(at));
            let kept = 0.5_f64.powf(elapsed as f64 / HELD_HALF_LIFE_MS as f64);
            let per_call = us as f64 / 1000.0 / f64::from(priced.calls.max(1));
            self.learned.hold(method, per_call, kept);
        }
        self.ended(priced);
    }

    /// A request held its slot `slot_us` while the node says it worked
    /// `node_us` on it.
    pub fn occupied(&mut self, slot_us: u64, node_us: u64) {
        self.occupancy.add(slot_us, node_us);
    }

    /// How many times `maxInflight` the gate lets on (`Occupancy`).
    pub fn slot_scale(&self) -> f64 {
        self.occupancy.scale()
    }

    /// A request priced `priced` is over, learned from or not: a probe
    /// makes room for the method's next.
    pub fn ended(&mut self, priced: Priced) {
        if let (true, Some(method)) = (priced.probe, priced.method) {
            self.probing.remove(&method);
        }
    }
}

/// The VMs with requests waiting for a slot, each with the turn of the
/// request it would serve first: requests wait priority first, then oldest
/// first, across VMs, not only within one. A VM that frees a slot serves
/// its own first waiter only if no other VM's goes before it; else (and
/// when it has none waiting) it gives its spare slots back and wakes the
/// VMs whose first waiters go before (`SLOT_WAKE` on their wake queues). A
/// VM that runs all its waiting requests' slots itself would starve
/// another VM's clients, and one that went by age alone would give a slot
/// to its crowd's oldest while a staked call waited on the other worker.
///
/// Layout: count `u16`, then per VM its number `u32`, its first waiter's
/// class `u8` (0 priority, 1 default) and deadline `u64`, little-endian. An
/// entry past its deadline by the stale-slot TTL is a VM that went away (a
/// live one refuses its requests at their deadline and takes its entry
/// off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Waiters(pub Vec<(u32, Turn)>);

/// Where a waiting request stands: priority requests before default ones,
/// each class oldest (earliest deadline) first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Turn {
    /// 0 for the priority class, 1 for the default class.
    pub class: u8,
    /// When it must go (ms).
    pub deadline: u64,
}

impl Turn {
    pub fn new(priority: bool, deadline: u64) -> Self {
        Self {
            class: u8::from(!priority),
            deadline,
        }
    }
}

/// v2: v1 had no class, so a new VM beside an old one during a module swap
/// keeps to its own record.
pub const WAITERS_KEY: &str = "stakegate.admission_gate.v2.waiters";
/// The wake message that says a slot is free.
pub const SLOT_WAKE: &[u8] = b"slot";

impl Waiters {
    /// Sets `vm`'s first waiter's turn (`None`: nothing waits there).
    pub fn set(&mut self, vm: u32, first: Option<Turn>) {
        self.0.retain(|(v, _)| *v != vm);
        if let Some(turn) = first {
            self.0.push((vm, turn));
        }
    }

    /// Whether no VM has a request waiting.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The live VMs other than `me` whose first waiter goes before `than`
    /// (any, if `than` is `None`).
    pub fn ahead(&self, me: u32, than: Option<Turn>, now_ms: u64, ttl_ms: u64) -> Vec<u32> {
        self.0
            .iter()
            .filter(|(vm, turn)| {
                *vm != me
                    && turn.deadline.saturating_add(ttl_ms) >= now_ms
                    && than.is_none_or(|than| *turn < than)
            })
            .map(|(vm, _)| *vm)
            .collect()
    }
}

impl Record for Waiters {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + ENTRY_BYTES * self.0.len());
        out.extend_from_slice(&(self.0.len() as u16).to_le_bytes());
        for (vm, turn) in &self.0 {
            out.extend_from_slice(&vm.to_le_bytes());
            out.push(turn.class);
            out.extend_from_slice(&turn.deadline.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        let count = bytes
            .get(..2)
            .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
            .ok_or("waiters: too short")?;
        if bytes.len() != 2 + ENTRY_BYTES * count {
            return Err(format!(
                "waiters: {} bytes for {count} entries",
                bytes.len()
            ));
        }
        let mut r = Reader(&bytes[2..]);
        Ok(Self(
            (0..count)
                .map(|_| {
                    let vm = r.u32();
                    let class = r.u8();
                    (
                        vm,
                        Turn {
                            class,
                            deadline: r.u64(),
                        },
                    )
                })
                .collect(),
        ))
    }
}

/// A VM's entry in `Waiters`: number, class, deadline.
const ENTRY_BYTES: usize = 4 + 1 + 8;

/// Whether the gate is busy: it prices every request while it is, and
/// otherwise only those that take a slot from the shared pool.
///
/// Reading and pricing a body is most of what `nodeTime` costs a request
/// (`make bench`). A price decides only whether a request may take one of
/// the last `cheapSlots`, and a request that takes one of its worker's
/// spare slots adds nothing to the count in flight, so far from the limit
/// it needs none. The gate is busy from when a slot write or heartbeat
/// shows `threshold` requests in flight (half the public slots, or fewer
/// if the cheap slots are more than half) until `STANDBY_MS` pass without
/// one showing it. What that gives up: a worker's spares may go to heavy
/// requests until its next heartbeat or slot write shows the others made
/// the gate busy, and an unpriced request's answer teaches nothing (every
/// request that takes a slot from the pool is priced, so the costs stay
/// learned).
#[derive(Debug, Default)]
pub struct Busy {
    engaged: bool,
    last_ms: u64,
}

/// The gate stands by again after this long without being busy.
pub const STANDBY_MS: u64 = 5_000;

impl Busy {
    /// From how many requests in flight the gate is busy, of `slots` that
    /// public default traffic may take (`None`: pass-through, never).
    pub fn threshold(slots: Option<u32>, cheap_slots: u32) -> u32 {
        slots.map_or(u32::MAX, |slots| {
            slots
                .saturating_sub(cheap_slots)
                .min(slots.div_ceil(2))
                .max(1)
        })
    }

    /// A slot write or heartbeat at `now_ms` found `inflight` in flight.
    pub fn seen(&mut self, inflight: u32, threshold: u32, now_ms: u64) {
        if inflight >= threshold {
            self.engaged = true;
            self.last_ms = now_ms;
        }
    }

    /// At a tick: standing by once `STANDBY_MS` passed without being busy.
    pub fn tick(&mut self, now_ms: u64) {
        if self.engaged && now_ms.saturating_sub(self.last_ms) >= STANDBY_MS {
            self.engaged = false;
        }
    }

    pub fn engaged(&self) -> bool {
        self.engaged
    }
}

/// A request under `nodeTime`: its price (`None` if it took a spare slot
/// while the gate was not busy), when it got its slot (µs), and while it
/// waits for one, until when (ms) and its refusal then.
#[derive(Debug)]
pub(super) struct Metered {
    pub priced: Option<Priced>,
    pub since_us: Option<u64>,
    pub waiting: Option<(u64, Rejection)>,
}

impl Metered {
    pub fn new(priced: Option<Priced>) -> Self {
        Self {
            priced,
            since_us: None,
            waiting: None,
        }
    }

    pub fn waits(&self) -> bool {
        self.waiting.is_some()
    }

    /// Its request got its slot: a priced one's node time starts now (an
    /// unpriced one took a spare slot at once, so stake QoS's own clock,
    /// with no wait at the gate in it, times it alike, and the gate reads
    /// no clock for it).
    pub fn slot_taken(&mut self, now: &mut Now) {
        self.since_us = self.priced.is_some().then(|| now.us());
    }

    /// The gate answers its request itself (a kept or coalesced answer, a
    /// leader's from its callout): that answer passes through the gate's
    /// response path too, where the node's time on it is not measured
    /// again (the reply says it, `Reply::node_us`).
    pub fn answered_here(&mut self) {
        self.since_us = None;
    }
}

/// What one pass over the waiting streams has found full, so that it
/// tries no slot it knows it cannot get: a heavy request that found none
/// says nothing of the cheap slots, a cheap one that found none says the
/// gate is full.
#[derive(Debug, Clone, Copy, Default)]
pub struct Full {
    heavy: bool,
    pub(super) all: bool,
    /// Requests that waited `waitMs` are refused in this pass.
    pub(super) expire: bool,
}

impl Full {
    pub fn expiring(expire: bool) -> Self {
        Self {
            expire,
            ..Self::default()
        }
    }

    pub(super) fn blocks(&self, heavy: bool) -> bool {
        self.all || (heavy && self.heavy)
    }

    pub(super) fn found(&mut self, heavy: bool) {
        if heavy {
            self.heavy = true;
        } else {
            self.all = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::method_key;

    const BLOCK: &[u8] = br#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#;
    const PROOF: &[u8] = br#"{"jsonrpc":"2.0","id":2,"method":"eth_getProof","params":[]}"#;

    #[test]
    fn slots_held_longer_than_the_node_works_scale_the_limit_within_bounds() {
        let mut meter = Meter::default();
        assert_eq!(meter.slot_scale(), 1.0, "nothing said yet");
        // Each request holds its slot 6 ms for 3 ms of the node's work.
        for _ in 0..2000 {
            meter.occupied(6_000, 3_000);
        }
        assert!((meter.slot_scale() - 2.0).abs() < 1e-6);
        // A host so slow that the node works a hundredth of the slot time.
        for _ in 0..2000 {
            meter.occupied(100_000, 1_000);
        }
        assert_eq!(meter.slot_scale(), MAX_SLOT_SCALE);
        // The node says more than the slot (clocks apart): no scale.
        for _ in 0..2000 {
            meter.occupied(1_000, 2_000);
        }
        assert_eq!(meter.slot_scale(), 1.0);
    }

    #[test]
    fn a_method_is_cheap_once_measured_cheap_and_a_batch_by_its_sum() {
        let mut meter = Meter::default();
        let first = meter.price(BLOCK, 1000);
        assert!(first.cheap && first.probe, "its first call probes");
        assert_eq!(first.method, Some(method_key("eth_blockNumber")));
        let second = meter.price(BLOCK, 1000);
        assert!(
            !second.cheap,
            "not measured yet: heavy until its probe's answer"
        );
        meter.ended(second);
        meter.learn(first, 200, 0);
        assert!(meter.price(BLOCK, 1000).cheap);
        let proof = meter.price(PROOF, 1000);
        assert!(proof.probe);
        meter.learn(proof, 40_000, 0);
        assert!(!meter.price(PROOF, 1000).cheap);
        // A probe that ended unanswered lets the next call probe.
        let call = br#"{"jsonrpc":"2.0","id":3,"method":"eth_call"}"#;
        let probe = meter.price(call, 1000);
        meter.ended(probe);
        assert!(meter.price(call, 1000).probe);
        assert_eq!(meter.learned.get(method_key("eth_getProof")), Some(40.0));
        let five: Vec<String> = (0..5)
            .map(|i| format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_blockNumber"}}"#))
            .collect();
        let batch = format!("[{}]", five.join(","));
        let priced = meter.price(batch.as_bytes(), 1000);
        assert!(priced.cheap, "5 x 0.2 ms is 1 ms");
        assert_eq!(priced.calls, 5);
        assert!(!meter.price(batch.as_bytes(), 999).cheap);
        assert!(!meter.price(b"not json", 1000).cheap);
    }

    #[test]
    fn quick_errors_cannot_make_a_heavy_method_cheap_faster_than_its_cost_decays() {
        let mut meter = Meter::default();
        let probe = meter.price(PROOF, 1000);
        meter.learn(probe, 40_000, 0);
        // A flood of calls answered at once (the node refusing their
        // params), all within a second: still heavy.
        for ms in 0..1000 {
            let quick = meter.price(PROOF, 1000);
            meter.learn(quick, 100, ms);
        }
        assert!(!meter.price(PROOF, 1000).cheap);
        // A real one resets it; with no call as dear for 6 s more it has
        // halved 6 times, below 1 ms: cheap, which it then really is.
        let real = meter.price(PROOF, 1000);
        meter.learn(real, 40_000, 1000);
        assert!(!meter.price(PROOF, 1000).cheap);
        let quick = meter.price(PROOF, 1000);
        meter.learn(quick, 100, 7000);
        assert!(meter.price(PROOF, 1000).cheap);
    }

    #[test]
    fn the_gate_is_busy_from_half_its_slots_or_its_heavy_slots_and_stands_by_later() {
        assert_eq!(Busy::threshold(Some(6), 1), 3);
        assert_eq!(Busy::threshold(Some(8), 6), 2, "heavy calls may take 2");
        assert_eq!(Busy::threshold(Some(2), 1), 1);
        assert_eq!(Busy::threshold(None, 1), u32::MAX, "pass-through");
        let mut busy = Busy::default();
        busy.seen(2, 3, 100);
        assert!(!busy.engaged());
        busy.seen(3, 3, 200);
        busy.tick(200 + STANDBY_MS - 1);
        assert!(busy.engaged());
        busy.tick(200 + STANDBY_MS);
        assert!(!busy.engaged());
    }

    #[test]
    fn waiters_round_trip_and_say_whose_turn_comes_first() {
        let (staked, crowd) = (|at| Turn::new(true, at), |at| Turn::new(false, at));
        let mut waiters = Waiters::default();
        waiters.set(1, Some(crowd(1000)));
        waiters.set(2, Some(crowd(5000)));
        waiters.set(3, Some(crowd(5000)));
        waiters.set(3, None);
        let back = Waiters::decode(&waiters.encode()).unwrap();
        assert_eq!(back, waiters);
        assert_eq!(back.ahead(2, None, 4000, 10_000), [1]);
        assert_eq!(
            back.ahead(1, Some(crowd(4000)), 4000, 10_000),
            [2; 0],
            "1 is oldest"
        );
        assert_eq!(back.ahead(9, Some(crowd(6000)), 4000, 10_000), [1, 2]);
        assert_eq!(back.ahead(9, None, 12_000, 10_000), [2], "1 went away");
        // A staked call, however young, goes before the crowd's oldest.
        waiters.set(4, Some(staked(9000)));
        let back = Waiters::decode(&waiters.encode()).unwrap();
        assert_eq!(back.ahead(1, Some(crowd(1000)), 4000, 10_000), [4]);
        assert_eq!(back.ahead(4, Some(staked(9000)), 4000, 10_000), [2; 0]);
        assert_eq!(back.ahead(1, Some(staked(8000)), 4000, 10_000), [2; 0]);
        assert!(Waiters::decode(&[1, 0, 7]).is_err());
    }

    #[test]
    fn the_block_needs_decide_on_body_and_leaves_heavy_calls_a_slot() {
        let compile = |json: &str, slots, body| {
            let doc: NodeTimeDoc = serde_json::from_str(json).unwrap();
            NodeTimePolicy::compile(doc, slots, Some(10), body, &mut Fields::default())
        };
        let err = compile("{}", Some(8), false).unwrap_err().to_string();
        assert!(err.starts_with("nodeTime: needs decideOnBody"), "{err}");
        let err = compile(r#"{"cheapSlots": 8}"#, Some(8), true).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("nodeTime.cheapSlots: must be less than"),
            "{err}"
        );
        let policy = compile(r#"{"cheapBelowMs": 0.5}"#, Some(8), true).unwrap();
        assert_eq!(
            policy,
            NodeTimePolicy {
                cheap_slots: 1,
                cheap_below_us: 500,
                wait_ms: 1000,
                max_waiting: 1024,
                service_time_header: None,
                node_slots: None,
            }
        );
        let err = compile(r#"{"nodeSlots": 12}"#, Some(8), true).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("nodeTime.nodeSlots: needs serviceTimeHeader"),
            "{err}"
        );
        let header = r#""serviceTimeHeader": "x-node-service-us""#;
        let err = compile(&format!(r#"{{"nodeSlots": 9, {header}}}"#), Some(8), true);
        assert!(err
            .unwrap_err()
            .to_string()
            .starts_with("nodeTime.nodeSlots: must be at least maxInflight (10)"),);
        let policy = compile(&format!(r#"{{"nodeSlots": 12, {header}}}"#), Some(8), true);
        assert_eq!(policy.unwrap().node_slots, Some(12));
    }
}
