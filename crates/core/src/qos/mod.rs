//! Stake-weighted QoS: each client's share of the upstream's capacity
//! follows its stake, budget a client does not use goes to the others, and
//! nobody is throttled while the load is below a threshold of capacity
//! (docs/background.md, Agave's stake-weighted QoS: parts 1 to 3).
//!
//! # The allocation (each round, `round`)
//!
//! Every `refillIntervalMs` one VM runs a round: it claims it by CAS on the
//! state record, so one VM runs each round. A round hands out
//! `T = capacity × interval` tokens (one per JSON-RPC call) by **weighted
//! max-min over predicted demand** (`fair`):
//!
//! - an identity's *demand* `d` is its calls per interval, admitted or
//!   refused (a gateway refuses where a node would queue, so a refused call
//!   is demand too). A round with calls is a sample, its calls over the
//!   rounds since the identity's previous calls, smoothed into `d` with
//!   weight 0.2 (one call every 50 rounds is a rate of 0.02, not a burst);
//!   a quiet round only caps `d`, from the second one in a row, at one call
//!   per quiet round (`round::Plan::demand`);
//! - the water level `λ` is set so that `Σ min(d, λ × stake) = T`;
//! - an identity that wants less than its stake's part (`d ≤ λ × stake`) is
//!   *satisfied*: it is granted `d × 1.5` (the headroom lets it grow), and
//!   `d` of it is what the level was computed with, so capacity is filled
//!   when total demand reaches it; the others are granted `λ × stake`;
//! - an identity with no calls whose demand has fallen below 0.01 per
//!   interval is *idle* (one that sent once is, after about 100 rounds): it
//!   carries no weight and gets nothing, however many such identities the
//!   table holds. A new identity is never confused with an idle one: its
//!   first calls make it active at once, and it starts with
//!   `initialTokens` in its bucket.
//!
//! **Units.** A token is a call by default (`capacityRps`). In the node-time
//! unit (`capacityNodeMs`) it is a node millisecond, in the cost unit
//! (`capacityCost`) a cost unit: a call then costs its method's estimate,
//! settled to what it took the node (`cost`, `charge`), an identity's demand
//! is its calls times its cost per call, and everything below reads
//! "tokens" in that unit.
//!
//! A bucket holds at most two rounds of its grant (at least two tokens).
//! A client whose demand rises is satisfied, and granted half as much again
//! as it used, each round: it reaches its fair share in a few rounds (40 ms
//! at the default interval for a tenfold rise). A client that stops is
//! capped at one call per round after two quiet rounds, so nearly all its
//! share goes to the others at once.
//!
//! **Cost of a round.** It visits the pages that hold an active identity or
//! one with new counts (an active-page bitmap says which), reading each
//! once and writing it once (again only if a worker wrote it in between):
//! `2A` shared-data calls for `A` active pages of `P = ceil(maxIdentities /
//! 128)`, nothing for idle pages. Within a page, an idle identity with no
//! new calls is skipped (nothing of it changes; its quiet rounds are
//! counted from when it was last seen). The level takes two to four passes
//! over the active identities' demands, and is skipped when the demand
//! cannot reach capacity: the last round's total demand plus what this
//! round's calls can add to it (`round::demand_reaches`) bounds it, and
//! below capacity the level is infinite. Pages are changed in place
//! (`page`).
//!
//! # The request path (`StakeQos::admit`)
//!
//! Requests touch no shared data while throttling is off: each worker
//! counts its identities' calls, completions and latency locally and puts
//! them on a shared queue once per tick (`report`), where the round picks
//! them up. While throttling is on, a call needs a token. A worker takes
//! tokens from the identity's shared bucket in **leases** of a quarter of
//! the identity's grant per round (at least one token), by one CAS on its
//! page, and spends them locally; a worker that found the bucket empty does
//! not look again until the next round. A batch of `n` calls is admitted on
//! its first token when the headers arrive, and charged the other `n − 1`
//! once its body is read: the worker's lease goes into debt, paid from its
//! next leases.
//!
//! **What leases trade.** Nothing is admitted beyond the tokens taken from
//! the shared bucket, except a batch's debt: at most one batch (less its
//! first call) per worker and identity at a time. An identity can be
//! refused while another worker holds leased tokens for it that it has not
//! spent: at most `(W − 1) × lease` tokens for `W` workers, and they are not
//! lost, the holder spends them on its next calls of that identity.
//!
//! **Concurrency allowance.** Each worker lets an identity have
//! `max(floor, share_rps × latency × (1 + headroom))` requests in flight,
//! `latency` being that worker's EWMA of the identity's request latency
//! (Little's law: a client with slow methods or a long round trip keeps
//! enough in flight to reach its share). An identity the last round gave
//! all its demand (under its part) also has room for the spread of its
//! arrivals, four standard deviations of a Poisson count: a client under
//! its share is not refused for a burst its share covers, while one at its
//! part is held near its mean, which keeps queues short. The count is per
//! worker, so across `W` workers an identity may have up to `W` times its
//! allowance.
//!
//! # Failure
//!
//! If shared data fails, requests are admitted (fail open: the admission
//! gate protects the node) and the error is counted. Counts a worker could
//! not report stay local and go with its next report.

mod charge;
pub mod counts;
pub mod early;
pub mod fair;
pub mod fleet;
pub mod identity;
mod lease;
pub mod ledger;
pub mod light;
pub mod page;
pub mod policy;
pub mod reactive;
pub mod report;
mod round;
pub mod socket;
pub mod state;
pub mod stream;
mod throttle;
mod usage;

use crate::cost::{Estimates, Samples, Unit, ESTIMATES_KEY};
use crate::rejection::{Jitter, Rejection};
use crate::shared::{read, SharedStore, StoreError, Write};
use fleet::{FleetShare, FleetView, FLEET_KEY};
use identity::Identity;
use ledger::{Ledger, Named, Usage, Who};
use light::{LightState, LIGHT_KEY};
use page::{ENTRIES_PER_PAGE, MILLI, STAKED};
use policy::QosPolicy;
use report::{Delta, ReportQueue, WorkerReport};
use state::QosState;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

pub use round::RoundReport;

pub use page::page_key;
pub use round::{DEMAND_SMOOTHING, FIRST_SAMPLE_MS, HEADROOM, IDLE_DEMAND};
pub use state::{ACTIVE_KEY, DEMAND_KEY, STATE_KEY};
/// A lease is this fraction of the identity's grant per round.
const LEASE_DIVISOR: u64 = 4;
/// How often a worker drops local identities long idle.
const SWEEP_EVERY_MS: u64 = 1000;

/// What an admitted request carries until it ends. Not `Copy`: it is given
/// back once, by moving it into `StakeQos::finish`.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket counts a request in flight until it is finished"]
pub struct Ticket {
    key: u64,
    started_ms: u64,
    /// What the request has been charged so far, in thousandths of the
    /// unit: one call at its identity's cost when admitted, its calls'
    /// estimates once its body is read (`charge_cost`).
    charged: i64,
    calls: u32,
    /// The method, when all its calls are of one (its node time is then a
    /// sample of that method's cost).
    method: Option<u64>,
    /// The node-time unit: when it was admitted, and how long until its
    /// answer's headers came (`answered`).
    started_us: u64,
    node_us: Option<u64>,
}

impl Ticket {
    fn new(key: u64, now_us: u64, charged: i64) -> Self {
        Self {
            key,
            started_ms: now_us / 1000,
            charged,
            calls: 1,
            method: None,
            started_us: now_us,
            node_us: None,
        }
    }
}

/// An admitted WebSocket (or other upgraded stream), after `upgraded`: it
/// is not a request in flight, but the calls sent on it are charged to its
/// identity (`charge_calls`), and it holds one of the identity's
/// WebSocket places until `closed`.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a connection holds its identity's WebSocket place until it is closed"]
pub struct Connection {
    key: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The bucket is empty.
    Rate,
    /// The identity's concurrency allowance is used up.
    Concurrency,
    /// The identity holds `websocketsPerIdentity` WebSockets open on this
    /// worker.
    Websockets,
}

/// A 429, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Throttled {
    pub reason: Reason,
    /// With `RateLimit-Policy` (the identity's share, requests per second)
    /// and `RateLimit` (whole tokens left) as in the IETF httpapi draft.
    pub rejection: Rejection,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Admit(Ticket),
    Throttle(Throttled),
}

#[derive(Debug)]
pub struct Admission {
    pub verdict: Verdict,
    /// A shared-bucket lease was taken (one CAS on the identity's page).
    pub leased: bool,
    pub cas_retries: u32,
    /// An identity was evicted from the shared table to make room.
    pub evicted: bool,
    /// Shared data failed; the request was admitted without a token.
    pub store_error: Option<StoreError>,
}

/// One identity as one worker sees it.
#[derive(Debug, Clone)]
struct Local {
    page: u32,
    stake: u64,
    tier: u8,
    staked: bool,
    /// Milli-tokens leased from the shared bucket and not spent yet;
    /// negative: a batch's debt.
    lease: i64,
    /// Milli-tokens per round the last round granted (as of the last lease).
    grant: u64,
    /// Calls per round the last round predicted (as of the last lease).
    demand: f32,
    /// Its name in the stake table, or its address group, for refusals
    /// and the usage ledger.
    name: Option<Arc<str>>,
    address: Option<(IpAddr, u8)>,
    /// The usage ledger's counts since the last hand-over, and whether QoS
    /// ever refused it (an address group then gets a label of its own).
    usage: Usage,
    refused: bool,
    /// The round in which the shared bucket was found empty.
    dry_round: Option<u64>,
    inflight: u32,
    /// Upgraded connections open (WebSockets).
    websockets: u32,
    /// The last round gave it all its predicted demand (as of the last
    /// lease).
    satisfied: bool,
    /// EWMA of request latency, start to response end, in µs.
    latency_us: u32,
    /// What one of its calls costs, in thousandths of the unit: its calls'
    /// estimates, smoothed (always one call in the calls unit).
    cost: i64,
    /// Counts since the last report.
    delta: Delta,
    last_seen_ms: u64,
}

/// What a tick did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tick {
    /// The refill round, if this VM ran it.
    pub round: Option<RoundReport>,
    /// Identities in this worker's report.
    pub reported: usize,
}

/// One VM's side of stake QoS: the policy, the state as of its last tick,
/// and its identities' local counts and leases.
#[derive(Debug)]
pub struct StakeQos {
    policy: QosPolicy,
    pages: u32,
    state: QosState,
    jitter: Jitter,
    locals: HashMap<u64, Local>,
    /// Local identities with counts since the last report (so a report
    /// visits those, not every identity this worker knows).
    unreported: Vec<u64>,
    /// Counts of local identities dropped before they were reported.
    orphans: Vec<Delta>,
    /// The usage ledger: this worker's labels, and the usage of local
    /// identities dropped before it was handed over.
    ledger: Ledger,
    unlabelled: Vec<(Who, bool, Usage)>,
    /// Requests are counted, not identified (`light`), as of the last tick.
    counting: bool,
    /// Calls counted without an identity, and the bound of the identified
    /// requests' calls, since the last report.
    counted: u32,
    bound: u32,
    /// What one call of the bound counts (`light`): 1 in calls; in node
    /// time the dearest call known, in µs: the default cost, the policy's
    /// table and the learned estimates, whichever is most.
    call_bound: u32,
    /// Requests counted without an identity, for the metrics.
    counted_requests: u64,
    last_sweep_ms: u64,
    /// The node-time unit: the learned estimates as of the last tick, and
    /// this worker's samples since its last report.
    learned: Estimates,
    samples: Samples,
    /// Early retries this worker holds (`early`).
    early_held: u32,
}

/// Weight of the newest call in an identity's cost per call.
const COST_SMOOTHING: f64 = 0.2;

impl StakeQos {
    pub fn new(policy: QosPolicy, seed: u64) -> Self {
        let pages = policy.max_identities.div_ceil(ENTRIES_PER_PAGE as u32);
        let mut state = QosState::default();
        state.settle_capacity(&policy);
        let call_bound = call_bound(&policy, &Estimates::default());
        Self {
            policy,
            pages,
            state,
            jitter: Jitter::new(seed),
            locals: HashMap::new(),
            unreported: Vec::new(),
            orphans: Vec::new(),
            ledger: Ledger::default(),
            unlabelled: Vec::new(),
            counting: false,
            counted: 0,
            bound: 0,
            call_bound,
            counted_requests: 0,
            last_sweep_ms: 0,
            learned: Estimates::default(),
            samples: Samples::default(),
            early_held: 0,
        }
    }

    /// The learned node-time estimates, as of the last tick.
    pub fn learned(&self) -> &Estimates {
        &self.learned
    }

    /// A call at the policy's default cost, in thousandths of the unit.
    fn default_cost(&self) -> i64 {
        (self.policy.costs.default * MILLI as f64) as i64
    }

    /// Whether requests are counted without identifying them (`light`).
    pub fn counting(&self) -> bool {
        self.counting
    }

    /// A request counted without an identity: its first call, or more of
    /// its calls' bound as its body arrives, each at `call_bound`. `named`:
    /// the staked identity its API key names (key and name), whose usage
    /// ledger row it counts in (else `unidentified`'s).
    pub fn count(&mut self, calls: u32, new_request: bool, named: Option<&Named>) {
        let units = calls.saturating_mul(self.call_bound);
        self.counted = self.counted.saturating_add(units);
        self.counted_requests += u64::from(new_request);
        if !new_request {
            return;
        }
        match named {
            Some(named) => {
                let usage = self.ledger.counted_row(named);
                usage.requests += 1;
                usage.calls += 1;
            }
            None => self.ledger.unidentified += 1,
        }
    }

    /// A request counted under its staked key's name held `calls` calls (a
    /// batch): its row has the others.
    pub fn count_calls_of(&mut self, named: &Named, calls: u32) {
        self.ledger.counted_row(named).calls += u64::from(calls.saturating_sub(1));
    }

    /// More of an identified request's calls' bound, each at `call_bound`.
    pub fn bound(&mut self, calls: u32) {
        let units = calls.saturating_mul(self.call_bound);
        self.bound = self.bound.saturating_add(units);
    }

    /// Requests counted without an identity since the last call.
    pub fn take_counted_requests(&mut self) -> u64 {
        std::mem::take(&mut self.counted_requests)
    }

    pub fn policy(&self) -> &QosPolicy {
        &self.policy
    }

    /// The state as of this VM's last tick.
    pub fn state(&self) -> &QosState {
        &self.state
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    fn interval_s(&self) -> f64 {
        self.policy.refill_interval_ms as f64 / 1000.0
    }

    /// This worker's record of `identity`, made if it has none (making room
    /// by dropping an idle one when the table is full).
    fn local(&mut self, identity: &Identity, now_ms: u64) -> &mut Local {
        // The size first: a lookup in a table of 100,000 misses the cache.
        if self.locals.len() >= self.policy.max_identities as usize
            && !self.locals.contains_key(&identity.key)
        {
            let idle = self
                .locals
                .iter()
                .filter(|(_, l)| l.inflight == 0)
                .min_by_key(|(_, l)| l.last_seen_ms)
                .map(|(k, _)| *k);
            if let Some(local) = idle.and_then(|k| self.locals.remove(&k)) {
                if !local.delta.is_empty() {
                    self.orphans.push(local.delta);
                }
                if !local.usage.is_empty() {
                    self.unlabelled.push(local.ledger_row());
                }
            }
        }
        let pages = self.pages;
        let cost = self.default_cost();
        let local = self.locals.entry(identity.key).or_insert_with(|| Local {
            page: (identity.key % u64::from(pages)) as u32,
            stake: 0,
            tier: 0,
            staked: false,
            lease: 0,
            grant: 0,
            demand: 0.0,
            name: None,
            address: None,
            usage: Usage::default(),
            refused: false,
            dry_round: None,
            inflight: 0,
            websockets: 0,
            satisfied: false,
            latency_us: 0,
            cost,
            delta: Delta {
                key: identity.key,
                ..Delta::default()
            },
            last_seen_ms: now_ms,
        });
        // Who the identity is comes from the policy serving now, so a new
        // stake table takes effect from this request and the next round.
        local.stake = identity.stake;
        local.tier = identity.tier as u8;
        local.staked = identity.staked;
        if local.name != identity.name {
            local.name = identity.name.clone();
        }
        local.address = identity.address;
        local.last_seen_ms = now_ms;
        if local.delta.is_empty() {
            // It is being counted: the next report visits it.
            self.unreported.push(identity.key);
        }
        local
    }

    /// Decides a request when its headers arrive (one call; a batch is
    /// charged the rest with `charge`, or `charge_cost` in a unit other
    /// than calls).
    pub fn admit(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
        identity: &Identity,
    ) -> Admission {
        self.admit_at(store, now_ms.saturating_mul(1000), identity)
    }

    /// `admit`, at `now_us` µs (node time is measured from it).
    pub fn admit_at(
        &mut self,
        store: &impl SharedStore,
        now_us: u64,
        identity: &Identity,
    ) -> Admission {
        let now_ms = now_us / 1000;
        let throttling = self.state.throttling;
        let round = self.state.round;
        let interval_s = self.interval_s();
        let (floor, headroom) = (self.policy.concurrency_floor, self.policy.headroom);
        let local = self.local(identity, now_ms);
        // One call at the identity's cost per call: its body may say more.
        let need = local.cost.max(1);
        local.delta.arrivals = local.delta.arrivals.saturating_add(1);
        local.delta.units = local.delta.units.saturating_add(need as u64);
        local.usage.requests += 1;
        local.usage.calls += 1;
        let admitted = |local: &mut Local| {
            local.inflight = local.inflight.saturating_add(1);
            Verdict::Admit(Ticket::new(identity.key, now_us, need))
        };
        let mut admission = Admission {
            verdict: Verdict::Admit(Ticket::new(identity.key, now_us, need)),
            leased: false,
            cas_retries: 0,
            evicted: false,
            store_error: None,
        };
        if !throttling {
            admission.verdict = admitted(local);
            return admission;
        }
        let share_rps = local.grant as f64 / MILLI as f64 / interval_s;
        let allowance = local.allowance(floor, headroom, share_rps, need);
        if local.inflight >= allowance {
            admission.verdict = Verdict::Throttle(self.throttled(
                Reason::Concurrency,
                identity.key,
                need,
                share_rps,
                allowance,
            ));
            return admission;
        }
        let want = local.lease_want(need, round);
        let leased = match want {
            None => None,
            Some((page, want)) => {
                admission.leased = true;
                match self.lease(store, now_ms, identity, page, want) {
                    Ok(leased) => {
                        admission.cas_retries = leased.retries;
                        admission.evicted = leased.evicted;
                        Some((leased, want))
                    }
                    Err((e, retries)) => {
                        // Fail open: the admission gate protects the node.
                        admission.cas_retries = retries;
                        admission.store_error = Some(e);
                        let local = self.local(identity, now_ms);
                        admission.verdict = admitted(local);
                        return admission;
                    }
                }
            }
        };
        // Made above, and nothing since takes it out.
        let Some(local) = self.locals.get_mut(&identity.key) else {
            return admission;
        };
        if let Some((leased, want)) = leased {
            local.took_lease(&leased, want, round);
        }
        if local.lease >= need {
            local.lease -= need;
            admission.verdict = admitted(local);
            return admission;
        }
        local.dry_round = Some(round);
        admission.verdict =
            Verdict::Throttle(self.throttled(Reason::Rate, identity.key, need, share_rps, 0));
        admission
    }

    /// Every refill interval: reports this worker's counts, refreshes its
    /// view of the state, and runs the refill round if it is due and this
    /// VM wins it.
    pub fn tick(
        &mut self,
        store: &impl SharedStore,
        queue: &impl ReportQueue,
        now_ms: u64,
    ) -> Result<Tick, StoreError> {
        let reported = self.report(queue)?;
        if now_ms.saturating_sub(self.last_sweep_ms) >= SWEEP_EVERY_MS {
            self.sweep(now_ms);
        }
        let (mut state, cas) = read::<QosState>(store, STATE_KEY)?;
        state.settle_capacity(&self.policy);
        self.state = state.clone();
        self.counting =
            self.policy.identify_above > 0.0 && read::<LightState>(store, LIGHT_KEY)?.0.counting;
        if self.policy.costs.unit == Unit::NodeTime {
            self.learned = read::<Estimates>(store, ESTIMATES_KEY)?.0;
            self.call_bound = call_bound(&self.policy, &self.learned);
        }
        let interval = self.policy.refill_interval_ms;
        if state.round_ms != 0 && now_ms < state.round_ms.saturating_add(interval) {
            return Ok(Tick {
                round: None,
                reported,
            });
        }
        let intervals = if state.round_ms == 0 {
            1
        } else {
            (now_ms - state.round_ms) / interval
        };
        let mut claimed = state.clone();
        claimed.round_ms = if state.round_ms == 0 {
            now_ms
        } else {
            state.round_ms + intervals * interval
        };
        if store.store(STATE_KEY, &crate::shared::Record::encode(&claimed), cas)?
            == Write::CasMismatch
        {
            return Ok(Tick {
                round: None,
                reported,
            });
        }
        let fleet = match &self.policy.fleet {
            Some(f) => {
                let (view, _) = read::<FleetView>(store, FLEET_KEY)?;
                Some(FleetShare::of(&view, f, self.policy.capacity_rps, now_ms))
            }
            None => None,
        };
        let (state, report) = round::run(
            &self.policy,
            store,
            queue,
            now_ms,
            &state,
            intervals,
            fleet.as_ref(),
        )?;
        self.state = state;
        self.counting = report.counting;
        Ok(Tick {
            round: Some(report),
            reported,
        })
    }

    /// Puts this worker's counts since its last report on the queue (the
    /// plugin is going away: nothing is lost with it).
    pub fn flush(&mut self, queue: &impl ReportQueue) -> Result<usize, StoreError> {
        self.report(queue)
    }

    /// Puts this worker's counts since its last report on the queue.
    fn report(&mut self, queue: &impl ReportQueue) -> Result<usize, StoreError> {
        let mut deltas = std::mem::take(&mut self.orphans);
        for key in self.unreported.drain(..) {
            let Some(local) = self.locals.get_mut(&key) else {
                continue;
            };
            if !local.delta.is_empty() {
                local.delta.stake = local.stake;
                local.delta.tier = local.tier;
                local.delta.flags = if local.staked { STAKED } else { 0 };
                deltas.push(local.delta);
                local.delta = Delta {
                    key: local.delta.key,
                    ..Delta::default()
                };
            }
        }
        let worker = WorkerReport {
            deltas,
            counted: std::mem::take(&mut self.counted),
            bound: std::mem::take(&mut self.bound),
            samples: std::mem::take(&mut self.samples),
        };
        if worker.is_empty() {
            return Ok(0);
        }
        match queue.push(&report::encode(&worker)) {
            Ok(()) => Ok(worker.deltas.len()),
            Err(e) => {
                // Keep them for the next report.
                self.orphans = worker.deltas;
                self.counted = self.counted.saturating_add(worker.counted);
                self.bound = self.bound.saturating_add(worker.bound);
                self.samples = worker.samples;
                Err(e)
            }
        }
    }

    /// Drops local identities idle past the TTL with nothing in flight or
    /// unreported (their leftover lease goes with them).
    fn sweep(&mut self, now_ms: u64) {
        self.last_sweep_ms = now_ms;
        let ttl = self.policy.idle_ttl_ms;
        self.locals.retain(|_, l| {
            l.inflight > 0
                || l.websockets > 0
                || !l.delta.is_empty()
                || !l.usage.is_empty()
                || now_ms.saturating_sub(l.last_seen_ms) <= ttl
        });
    }

    /// Identities this worker keeps locally.
    pub fn local_identities(&self) -> usize {
        self.locals.len()
    }
}

impl Local {
    /// Its concurrency allowance on this worker, its share being
    /// `share_units` per second and a call costing `per_call` thousandths:
    /// `concurrency_allowance` of its share in calls.
    fn allowance(&self, floor: u32, headroom: f64, share_units: f64, per_call: i64) -> u32 {
        let share_rps = share_units / (per_call.max(1) as f64 / MILLI as f64);
        concurrency_allowance(floor, headroom, share_rps, self.latency_us, self.satisfied)
    }
}

/// `max(floor, share_rps × latency × (1 + headroom))`: Little's law, so a
/// slow path keeps enough requests in flight to reach its share.
/// An identity under its part (`satisfied`) also has room for the spread
/// of its arrivals, four standard deviations of a Poisson count, so it is
/// not refused for their ordinary bursts. One at its part is held near the
/// mean, which keeps its queue, and everyone's latency, short.
/// Until an identity's first request finishes its latency is unknown, and
/// it is not limited.
pub fn concurrency_allowance(
    floor: u32,
    headroom: f64,
    share_rps: f64,
    latency_us: u32,
    satisfied: bool,
) -> u32 {
    if latency_us == 0 {
        return u32::MAX;
    }
    let mut bdp = share_rps * f64::from(latency_us) / 1e6 * (1.0 + headroom);
    if satisfied {
        bdp += 4.0 * bdp.sqrt();
    }
    (bdp.ceil().min(f64::from(u32::MAX)) as u32).max(floor)
}

/// What one call of the bound counts (`light`): 1 in calls; in node time
/// the dearest call known, in µs (a call no estimate covers costs the
/// default).
fn call_bound(policy: &QosPolicy, learned: &Estimates) -> u32 {
    let costs = &policy.costs;
    match costs.unit {
        Unit::Calls | Unit::Cost => 1,
        Unit::NodeTime => {
            let dearest = costs
                .table
                .values()
                .copied()
                .chain(learned.max())
                .fold(costs.default, f64::max);
            (dearest * MILLI as f64)
                .ceil()
                .clamp(1.0, f64::from(u32::MAX)) as u32
        }
    }
}

#[cfg(test)]
mod tests;
