//! The refill round (see the module doc of `qos` for the rule): take the
//! workers' reports off the queue, predict each active identity's demand,
//! find the water level, and grant every active identity its part.

use super::fair::{self, Claim};
use super::fleet::{Demand, FleetShare, Report, RoundFleet};
use super::light::{LightState, LIGHT_KEY};
use super::page::{page_key, Entry, Page, ENTRIES_PER_PAGE, IDLE, MILLI, SATISFIED, STAKED};
use super::policy::{Mode, QosPolicy};
use super::reactive::{self, Finished};
use super::report::{self, Delta, ReportQueue};
use super::state::{step_load, QosState, ACTIVE_KEY, DEMAND_KEY, STATE_KEY};
use crate::cost::{Estimates, Samples, Unit, ESTIMATES_KEY};
use crate::shared::{read, update, update_from, Change, Record, SharedStore, StoreError, Write};
use std::ops::Range;

/// Weight of the newest round in the demand prediction.
pub const DEMAND_SMOOTHING: f64 = 0.2;
/// Demand (calls per interval) under which an identity with no calls is idle.
pub const IDLE_DEMAND: f64 = 0.01;
/// What a satisfied identity is granted beyond its predicted demand.
pub const HEADROOM: f64 = 0.5;
/// An identity's first calls are taken as spread over this long.
pub const FIRST_SAMPLE_MS: u64 = 1000;
/// A late round makes up for at most this many intervals.
const MAX_CATCH_UP: u64 = 5;
/// Reports taken off the queue per round, at most (the rest wait).
const MAX_REPORTS: usize = 4096;

/// What a refill round did, for metrics and logs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoundReport {
    /// Identities with demand.
    pub identities: u64,
    pub evicted: u64,
    pub throttling: bool,
    pub load_rps: f64,
    pub capacity_rps: f64,
    pub level: f64,
    /// Pages read and written.
    pub pages: u64,
    /// The level was computed (pass one ran): demand could reach capacity.
    pub level_computed: bool,
    pub reports: u64,
    pub cas_retries: u32,
    /// Fleet mode: this replica's active identities' demand, to report.
    pub fleet: Option<RoundFleet>,
    /// The next rounds' requests are counted, not identified (`light`).
    pub counting: bool,
}

/// What the round needs of an entry's page, and what it computes for it.
struct Plan<'a> {
    /// Arrivals are per round; demand is per interval.
    intervals: f64,
    interval_ms: u64,
    level: f64,
    now_ms: u64,
    idle_ttl_ms: u64,
    min_tokens: i64,
    /// What a new identity's bucket starts with (`initialTokens`).
    initial_tokens: i64,
    fleet: Option<&'a FleetShare>,
    /// Shares are of calls (each costs 1); else of the policy's unit, a
    /// call costing what its identity's calls have cost (`cost`).
    calls: bool,
    /// A call's cost before anything is known of its identity.
    default_cost: f64,
}

impl Plan<'_> {
    /// An identity's weight: its stake, in fleet mode times the part of its
    /// fleet-wide demand that arrives here.
    fn weight(&self, key: u64, stake: u64) -> f64 {
        match self.fleet {
            Some(fleet) => fleet.weight(key, stake),
            None => stake.max(1) as f64,
        }
    }

    /// What one of entry `i`'s calls costs after this round, in the unit:
    /// 1 for calls; else its cost per call, smoothed with weight
    /// `DEMAND_SMOOTHING` over the rounds with calls (each a sample: what
    /// its calls cost over how many came, at their identities' cost per call
    /// on the workers).
    fn cost(&self, page: &Page, i: usize, delta: Option<&Delta>) -> f64 {
        if self.calls {
            return 1.0;
        }
        let before = f64::from(page.cost(i));
        match delta.and_then(sample_cost) {
            Some(sample) if before > 0.0 => {
                DEMAND_SMOOTHING * sample + (1.0 - DEMAND_SMOOTHING) * before
            }
            Some(sample) => sample,
            None if before > 0.0 => before,
            None => self.default_cost,
        }
    }

    /// What a new identity's calls cost: its sample, else the default.
    fn first_cost(&self, delta: &Delta) -> f64 {
        if self.calls {
            return 1.0;
        }
        sample_cost(delta).unwrap_or(self.default_cost)
    }

    /// The rounds an identity's first calls are taken as spread over.
    fn first_since(&self) -> f64 {
        self.intervals
            .max(FIRST_SAMPLE_MS as f64 / self.interval_ms.max(1) as f64)
    }

    /// Entry `i`'s demand after this round, its calls this round, and the
    /// rounds it has now been quiet.
    ///
    /// A round with calls is a sample of the identity's rate: its calls
    /// over the rounds since its previous calls (so one call every 50
    /// rounds is a rate of 0.02, not a burst of 1 followed by nothing),
    /// smoothed into the demand. A round without calls only caps the
    /// demand, at one call per quiet round but the first: a client that
    /// stops falls to one call per round after two quiet rounds and a tenth
    /// of that after eleven, and a sparse client keeps its rate between its
    /// calls. One quiet round is not enough, because each worker reports
    /// once per interval at a moment of its own, and a report can miss one
    /// round and land in the next with two intervals' calls.
    ///
    /// An idle entry is not visited while it stays quiet (nothing of it
    /// changes), so its quiet rounds are counted from when it was last seen.
    ///
    /// An identity's first calls have no calls before them to measure
    /// against: they are taken as spread over a second (`FIRST_SAMPLE_MS`).
    /// So an identity that comes once reserves next to nothing of the
    /// capacity while its demand decays (it would otherwise hold a call per
    /// round, then one per quiet round, a few calls in all for the one it
    /// made), and one that keeps calling is measured from its second round
    /// on, as any other.
    fn demand(&self, page: &Page, i: usize, delta: Option<&Delta>) -> (f64, u32, u16) {
        let calls = delta.map_or(0, |d| d.arrivals);
        let before = f64::from(page.demand(i));
        let quiet = page.quiet(i);
        let first = before == 0.0 && quiet == 0 && page.flags(i) & IDLE == 0;
        if calls == 0 {
            let quiet = quiet.saturating_add(1);
            if quiet < 2 {
                return (before, 0, quiet);
            }
            let cap = 1.0 / (f64::from(quiet - 1) * self.intervals);
            return (before.min(cap), 0, quiet);
        }
        let mut since = (f64::from(quiet) + 1.0) * self.intervals;
        if page.flags(i) & IDLE != 0 {
            let elapsed = self.now_ms.saturating_sub(page.last_seen_ms(i));
            since = since.max(elapsed as f64 / self.interval_ms.max(1) as f64);
        }
        if first {
            since = since.max(self.first_since());
        }
        let sample = f64::from(calls) / since;
        (
            DEMAND_SMOOTHING * sample + (1.0 - DEMAND_SMOOTHING) * before,
            calls,
            0,
        )
    }

    /// Applies the round to one page: new identities from the reports
    /// (`deltas`, this page's), demand, idleness, grants, eviction.
    fn apply(&self, page: &mut Page, deltas: &[Delta]) -> Applied {
        let mut evicted = 0;
        let mut report = Vec::new();
        let mut by_entry: [Option<&Delta>; ENTRIES_PER_PAGE] = [None; ENTRIES_PER_PAGE];
        for (d, at) in deltas.iter().zip(places(page, deltas)) {
            // One a newcomer evicted before its turn is new again, as a
            // lookup in turn would find.
            let (i, out) = match at.filter(|&i| page.key(i) == d.key) {
                Some(i) => (i, false),
                // A new identity starts with the gift, as one a worker's
                // lease creates does.
                None => page.insert(&Entry {
                    key: d.key,
                    stake: d.stake,
                    tier: d.tier,
                    flags: d.flags,
                    last_seen_ms: self.now_ms,
                    tokens: self.initial_tokens,
                    ..Entry::default()
                }),
            };
            evicted += u64::from(out);
            by_entry[i] = Some(d);
        }
        let (mut active, mut demand_sum) = (0, 0.0);
        for (i, delta) in by_entry.into_iter().enumerate().take(page.len()) {
            if delta.is_none() && page.flags(i) & IDLE != 0 {
                continue;
            }
            let (demand, calls, quiet) = self.demand(page, i, delta);
            let cost = self.cost(page, i, delta);
            if let Some(d) = delta {
                page.set_stake(i, d.stake);
                page.set_tier(i, d.tier);
                page.set_flags(i, (page.flags(i) & !STAKED) | (d.flags & STAKED));
                page.set_last_seen_ms(i, self.now_ms);
            }
            page.set_quiet(i, quiet);
            let idle = calls == 0 && demand < IDLE_DEMAND;
            let flags = page.flags(i) & !(IDLE | SATISFIED);
            if idle {
                page.set_flags(i, flags | IDLE);
                page.set_demand(i, 0.0);
                page.set_grant(i, 0);
                continue;
            }
            active += 1;
            page.set_demand(i, demand as f32);
            if !self.calls {
                page.set_cost(i, cost as f32);
            }
            demand_sum += f64::from(demand as f32) * cost;
            // Demand in the unit: its calls at what each costs.
            let demand = demand * cost;
            if self.fleet.is_some() {
                report.push(Demand {
                    key: page.key(i),
                    stake: page.stake(i),
                    rps: (demand * 1000.0 / self.interval_ms.max(1) as f64) as f32,
                });
            }
            let claim = Claim {
                demand,
                weight: self.weight(page.key(i), page.stake(i)),
            };
            let satisfied = claim.demand <= self.level * claim.weight;
            let per_interval = if satisfied {
                claim.demand * (1.0 + HEADROOM)
            } else {
                fair::part(&claim, self.level)
            };
            page.set_flags(i, if satisfied { flags | SATISFIED } else { flags });
            let grant = (per_interval * MILLI as f64) as i64;
            page.set_grant(i, grant.max(0) as u64);
            // Two rounds of burst, at least two calls.
            let cap = (2 * grant)
                .max(self.min_tokens)
                .max((2.0 * cost * MILLI as f64) as i64);
            let tokens = page.tokens(i);
            if tokens < cap {
                let add = (per_interval * self.intervals * MILLI as f64) as i64;
                page.set_tokens(i, tokens.saturating_add(add).min(cap));
            }
        }
        let ttl = self.idle_ttl_ms;
        let now = self.now_ms;
        evicted += page
            .retain(|p, i| p.flags(i) & IDLE == 0 || now.saturating_sub(p.last_seen_ms(i)) <= ttl)
            as u64;
        Applied {
            active,
            evicted,
            demand_sum,
            report,
        }
    }
}

/// Where each of `deltas` (in key order) is in `page`, `None` for an
/// identity it does not hold: one walk of the page, where a lookup per
/// identity was a tenth of a round. A 64-bit filter of the identities
/// (six bits of each, mixed) leaves the binary search to about one entry
/// in six at ten identities a page.
fn places(page: &Page, deltas: &[Delta]) -> Vec<Option<usize>> {
    let mut found = vec![None; deltas.len()];
    if deltas.is_empty() {
        return found;
    }
    let bit = |key: u64| 1u64 << (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58);
    let filter = deltas.iter().fold(0, |f, d| f | bit(d.key));
    for i in 0..page.len() {
        let key = page.key(i);
        if filter & bit(key) != 0 {
            if let Ok(j) = deltas.binary_search_by_key(&key, |d| d.key) {
                found[j] = Some(i);
            }
        }
    }
    found
}

/// What a report's calls cost each, in the unit, if it has calls.
fn sample_cost(delta: &Delta) -> Option<f64> {
    (delta.arrivals > 0).then(|| delta.units as f64 / MILLI as f64 / f64::from(delta.arrivals))
}

/// What a round did to one page.
struct Applied {
    active: u64,
    evicted: u64,
    /// The demand of its active identities, as written.
    demand_sum: f64,
    /// Fleet mode: its active identities' demand.
    report: Vec<Demand>,
}

/// Runs one round over the policy's pages, as the VM that claimed it:
/// take the workers' reports, find the pages to visit, set the level (pass
/// one), grant (pass two), and write the round's state.
pub(super) fn run(
    policy: &QosPolicy,
    store: &impl SharedStore,
    queue: &impl ReportQueue,
    now_ms: u64,
    previous: &QosState,
    intervals: u64,
    fleet: Option<&FleetShare>,
) -> Result<(QosState, RoundReport), StoreError> {
    let pages = policy.max_identities.div_ceil(ENTRIES_PER_PAGE as u32);
    let mut report = RoundReport::default();
    let taken = take_reports(queue, policy.costs.unit, &mut report)?;
    let (active_before, active_cas) = read_active(store)?;
    let visit = Visit::new(pages, &active_before, taken.deltas);
    let intervals = intervals.clamp(1, MAX_CATCH_UP) as f64;
    let mut plan = Plan {
        intervals,
        interval_ms: policy.refill_interval_ms,
        level: f64::INFINITY,
        now_ms,
        idle_ttl_ms: policy.idle_ttl_ms,
        min_tokens: 2 * MILLI,
        initial_tokens: (f64::from(policy.initial_tokens) * policy.costs.default * MILLI as f64)
            as i64,
        fleet,
        calls: policy.costs.unit == Unit::Calls,
        default_cost: policy.costs.default,
    };
    let capacity_rps = fleet.map_or(previous.capacity_rps, |f| f.capacity_rps);
    let per_interval = capacity_rps * policy.refill_interval_ms as f64 / 1000.0;
    // In calls the arrivals bound how far demand can rise; in another unit
    // a cost per call can rise too, and the level is computed every round.
    let read_pages = if !plan.calls
        || demand_reaches(
            store,
            previous.round,
            taken.arrivals,
            intervals,
            per_interval,
        )? {
        report.level_computed = true;
        level(store, &visit, &mut plan, per_interval)?
    } else {
        visit
            .pages
            .iter()
            .map(|(index, _)| (*index, None))
            .collect()
    };
    let granted = grant(store, read_pages, &visit, &plan, pages, &mut report)?;
    // Only this round's VM writes it; a failed write is redone next round.
    // Until then a page with active identities may go unvisited, and its
    // demand uncounted: the demand sum is not written either.
    let active_written = granted.active == active_before
        || store.store(ACTIVE_KEY, &granted.active, active_cas) == Ok(Write::Stored);
    if policy.costs.unit == Unit::NodeTime && !taken.samples.0.is_empty() {
        learn(store, &taken.samples)?;
    }
    let written = Written {
        // The load, in the unit.
        arrivals: if plan.calls {
            taken.arrivals
        } else {
            (taken.units + MILLI as u64 / 2) / MILLI as u64
        },
        finished: taken.finished,
        intervals: intervals as u64,
        level: plan.level,
    };
    let state = write_state(policy, store, now_ms, fleet, &written, &mut report)?;
    report.counting = count_or_identify(policy, store, &state, taken.bound, intervals as u64)?;
    // Only this round's VM writes it; without it (not written, or a write
    // that failed) the next round computes the level.
    if active_written {
        let sum = DemandSum {
            round: state.round,
            sum: granted.demand_sum,
        };
        let _ = store.store(DEMAND_KEY, &sum.encode(), None);
    }
    report.throttling = state.throttling;
    report.load_rps = state.load_rps(policy.refill_interval_ms);
    report.capacity_rps = state.capacity_rps;
    report.level = plan.level;
    report.fleet = fleet
        .zip(granted.fleet_report)
        .map(|(f, report)| RoundFleet {
            report,
            replicas: f.replicas,
            fallback: f.fallback,
        });
    Ok((state, report))
}

/// What the workers reported since the last round.
struct Taken {
    /// As they came: an identity may have several.
    deltas: Vec<Delta>,
    finished: Finished,
    arrivals: u64,
    /// The calls' bound (`light`): of the counted requests and the
    /// identified ones.
    bound: u64,
    /// What the identified arrivals cost, in thousandths of the unit.
    units: u64,
    /// Node time measured per method.
    samples: Samples,
}

/// Takes the workers' reports off the queue (at most `MAX_REPORTS`).
fn take_reports(
    queue: &impl ReportQueue,
    unit: Unit,
    report: &mut RoundReport,
) -> Result<Taken, StoreError> {
    let mut taken = Taken {
        deltas: Vec::new(),
        finished: Finished::default(),
        arrivals: 0,
        bound: 0,
        units: 0,
        samples: Samples::default(),
    };
    while (report.reports as usize) < MAX_REPORTS {
        let Some(bytes) = queue.pop()? else { break };
        report.reports += 1;
        // A report this module cannot read (a swap's other layout) is
        // dropped: its counts are a round's worth of demand at most.
        let Ok(worker) = report::decode(&bytes) else {
            continue;
        };
        // Counted without an identity: calls, or in node time µs (as
        // thousandths of a node ms, the unit's own).
        match unit {
            Unit::Calls => taken.arrivals += u64::from(worker.counted),
            _ => taken.units = taken.units.saturating_add(u64::from(worker.counted)),
        }
        taken.bound += u64::from(worker.counted) + u64::from(worker.bound);
        for (key, (calls, us)) in worker.samples.0 {
            taken.samples.add(key, calls, us);
        }
        for d in worker.deltas {
            taken.arrivals += u64::from(d.arrivals);
            taken.units = taken.units.saturating_add(d.units);
            taken.finished.completions += u64::from(d.completions);
            taken.finished.latency_ms += u64::from(d.latency_sum_ms);
            taken.finished.overloads += u64::from(d.overloads);
            taken.deltas.push(d);
        }
    }
    Ok(taken)
}

/// Folds the round's node-time samples into the shared estimates. Only
/// this round's VM writes them; a failed write loses a round's samples.
fn learn(store: &impl SharedStore, samples: &Samples) -> Result<(), StoreError> {
    let (mut learned, cas) = read::<Estimates>(store, ESTIMATES_KEY)?;
    let mut keys: Vec<_> = samples.0.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let (calls, us) = samples.0[&key];
        learned.learn(key, calls, us as f64 / 1000.0);
    }
    let _ = store.store(ESTIMATES_KEY, &learned.encode(), cas);
    Ok(())
}

/// The pages to visit, in order: those the last round left active, and
/// those of identities with new counts, each with its identities' counts
/// in key order (so that a round's outcome does not depend on the reports'
/// order: a new identity's place in its page, the order of the sums).
struct Visit {
    /// One per identity (its reports added up), by page, then key.
    deltas: Vec<Delta>,
    /// Each page to visit, with its identities' counts in `deltas`.
    pages: Vec<(u32, Range<usize>)>,
}

impl Visit {
    fn new(pages: u32, active_before: &[u8], reported: Vec<Delta>) -> Self {
        let page_of = |d: &Delta| (d.key % u64::from(pages.max(1))) as u32;
        // An identity's reports stay in the order they came, so the last
        // one's stake and tier win.
        let mut order: Vec<(u32, u64, u32)> = reported
            .iter()
            .enumerate()
            .map(|(i, d)| (page_of(d), d.key, i as u32))
            .collect();
        order.sort_unstable();
        let mut deltas: Vec<Delta> = Vec::with_capacity(reported.len());
        for d in order.iter().map(|&(_, _, i)| &reported[i as usize]) {
            match deltas.last_mut() {
                Some(last) if last.key == d.key => last.add(d),
                _ => {
                    let mut first = Delta {
                        key: d.key,
                        ..Delta::default()
                    };
                    first.add(d);
                    deltas.push(first);
                }
            }
        }
        let mut visit = Vec::new();
        let mut start = 0;
        for page in 0..pages {
            let end = start
                + deltas[start..]
                    .iter()
                    .take_while(|d| page_of(d) == page)
                    .count();
            if end > start || bit(active_before, page) {
                visit.push((page, start..end));
            }
            start = end;
        }
        Self {
            deltas,
            pages: visit,
        }
    }

    /// Page `index`'s counts (`at`, its place in `pages`).
    fn deltas(&self, at: usize) -> &[Delta] {
        &self.deltas[self.pages[at].1.clone()]
    }
}

/// A page as pass one read it, for pass two (`None`: not read).
type ReadPage = (u32, Option<(Page, Option<u32>)>);

/// Pass one: every active identity's demand, for the water level (run
/// only when demand can reach capacity; else the level is infinite).
fn level(
    store: &impl SharedStore,
    visit: &Visit,
    plan: &mut Plan<'_>,
    per_interval: f64,
) -> Result<Vec<ReadPage>, StoreError> {
    let mut read_pages = Vec::with_capacity(visit.pages.len());
    let mut claims = Vec::new();
    for (at, &(index, _)) in visit.pages.iter().enumerate() {
        let (page, cas) = read::<Page>(store, &page_key(index))?;
        let mut by_entry: [Option<&Delta>; ENTRIES_PER_PAGE] = [None; ENTRIES_PER_PAGE];
        let deltas = visit.deltas(at);
        for (d, place) in deltas.iter().zip(places(&page, deltas)) {
            match place {
                Some(i) => by_entry[i] = Some(d),
                None => claims.push(Claim {
                    demand: DEMAND_SMOOTHING * f64::from(d.arrivals) / plan.first_since()
                        * plan.first_cost(d),
                    weight: plan.weight(d.key, d.stake),
                }),
            }
        }
        for (i, delta) in by_entry.into_iter().enumerate().take(page.len()) {
            if delta.is_none() && page.flags(i) & IDLE != 0 {
                continue;
            }
            let (demand, calls, _) = plan.demand(&page, i, delta);
            if calls > 0 || demand >= IDLE_DEMAND {
                claims.push(Claim {
                    demand: demand * plan.cost(&page, i, delta),
                    weight: plan.weight(page.key(i), page.stake(i)),
                });
            }
        }
        read_pages.push((index, Some((page, cas))));
    }
    plan.level = fair::level(&claims, per_interval);
    Ok(read_pages)
}

/// What pass two granted.
struct Granted {
    /// The bitmap of the pages left with an active identity.
    active: Vec<u8>,
    demand_sum: f64,
    fleet_report: Option<Report>,
}

/// Pass two: grant, from what pass one read (read again only if a worker
/// wrote the page in between).
fn grant(
    store: &impl SharedStore,
    read_pages: Vec<ReadPage>,
    visit: &Visit,
    plan: &Plan<'_>,
    pages: u32,
    report: &mut RoundReport,
) -> Result<Granted, StoreError> {
    let mut granted = Granted {
        active: vec![0u8; (pages as usize).div_ceil(8)],
        demand_sum: 0.0,
        fleet_report: plan.fleet.map(|_| Report::default()),
    };
    for (at, (index, read_before)) in read_pages.into_iter().enumerate() {
        let page_deltas = visit.deltas(at);
        let updated = update_from(store, &page_key(index), read_before, |p: &mut Page| {
            Change::Write(plan.apply(p, page_deltas))
        })
        .map_err(|(e, _)| e)?;
        let Applied {
            active,
            evicted,
            demand_sum: page_demand,
            report: page_report,
        } = updated.value;
        if let Some(r) = &mut granted.fleet_report {
            r.0.extend(page_report);
        }
        granted.demand_sum += page_demand;
        report.identities += active;
        report.evicted += evicted;
        report.cas_retries += updated.retries;
        report.pages += 1;
        if active > 0 {
            granted.active[index as usize / 8] |= 1 << (index % 8);
        }
    }
    Ok(granted)
}

/// What the round writes in the state record besides its report.
struct Written {
    arrivals: u64,
    finished: Finished,
    intervals: u64,
    level: f64,
}

/// The round's state: its number, the load, the level, the capacity and
/// whether it throttles.
fn write_state(
    policy: &QosPolicy,
    store: &impl SharedStore,
    now_ms: u64,
    fleet: Option<&FleetShare>,
    written: &Written,
    report: &mut RoundReport,
) -> Result<QosState, StoreError> {
    let updated = update(store, STATE_KEY, |s: &mut QosState| {
        s.round = s.round.wrapping_add(1);
        s.load_ema = step_load(
            s.load_ema,
            written.arrivals,
            written.intervals,
            policy.load_smoothing,
        );
        s.identities = report.identities;
        s.level = written.level;
        match fleet {
            Some(f) => s.capacity_rps = f.capacity_rps,
            None => s.settle_capacity(policy),
        }
        let load_rps = s.load_rps(policy.refill_interval_ms);
        if policy.mode == Mode::Reactive {
            reactive::adjust(s, policy, now_ms, written.finished, load_rps);
        }
        s.throttling = load_rps >= policy.throttle_threshold * s.capacity_rps;
        Change::Write(())
    })
    .map_err(|(e, _)| e)?;
    report.cas_retries += updated.retries;
    Ok(updated.table)
}

/// Updates the bound's load (`light`) with this round's `bound` calls over
/// `intervals`, and says whether the next rounds' requests are counted
/// without identifying: below `identifyAbove` of capacity by the bound,
/// and never while throttling. Only this round's VM writes it; a failed
/// write leaves the last one for a round.
fn count_or_identify(
    policy: &QosPolicy,
    store: &impl SharedStore,
    state: &QosState,
    bound: u64,
    intervals: u64,
) -> Result<bool, StoreError> {
    let (previous, _) = read::<LightState>(store, LIGHT_KEY)?;
    let bound_ema = step_load(previous.bound_ema, bound, intervals, policy.load_smoothing);
    // Calls, or in node time µs (thousandths of the unit).
    let per_unit = match policy.costs.unit {
        Unit::Calls => 1.0,
        _ => MILLI as f64,
    };
    let bound_rps = bound_ema * 1000.0 / policy.refill_interval_ms as f64 / per_unit;
    let light = LightState {
        counting: policy.identify_above > 0.0
            && !state.throttling
            && bound_rps < policy.identify_above * state.capacity_rps,
        bound_ema,
    };
    let _ = store.store(LIGHT_KEY, &light.encode(), None);
    Ok(light.counting)
}

/// Whether this round's demand may reach `per_interval` (so that the level
/// must be computed): the demand the last round wrote (`DemandSum`, if that
/// round was `round`) bounds it. An identity's demand rises in a round by
/// at most `DEMAND_SMOOTHING` times its calls per interval (a sample is its
/// calls over at least one interval), and a new identity's starts there;
/// a quiet one's only falls. So the demand after this round is at most
/// last round's plus `DEMAND_SMOOTHING × arrivals / intervals`, and when
/// that is within capacity, everyone is satisfied: the level is infinite,
/// exactly as pass one would find.
fn demand_reaches(
    store: &impl SharedStore,
    round: u64,
    arrivals: u64,
    intervals: f64,
    per_interval: f64,
) -> Result<bool, StoreError> {
    let (bytes, _) = store.load(DEMAND_KEY)?;
    let last = bytes
        .and_then(|b| DemandSum::decode(&b).ok())
        .filter(|d| d.round == round);
    Ok(last.is_none_or(|d| {
        let bound = d.sum + DEMAND_SMOOTHING * arrivals as f64 / intervals;
        // The sum is of f32 demands; a margin for its rounding.
        bound > per_interval * (1.0 - 1e-6)
    }))
}

/// The active identities' demand after round `round`: 8 bytes of round,
/// 8 of sum (f64), little-endian.
#[derive(Debug, Clone, Copy, PartialEq)]
struct DemandSum {
    round: u64,
    sum: f64,
}

impl DemandSum {
    fn encode(&self) -> Vec<u8> {
        let mut out = self.round.to_le_bytes().to_vec();
        out.extend_from_slice(&self.sum.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, ()> {
        let round = bytes.get(..8).ok_or(())?;
        let sum = bytes.get(8..16).ok_or(())?;
        Ok(Self {
            round: u64::from_le_bytes(round.try_into().map_err(|_| ())?),
            sum: f64::from_le_bytes(sum.try_into().map_err(|_| ())?),
        })
    }
}

fn read_active(store: &impl SharedStore) -> Result<(Vec<u8>, Option<u32>), StoreError> {
    let (bytes, cas) = store.load(ACTIVE_KEY)?;
    Ok((bytes.unwrap_or_default(), cas))
}

fn bit(bits: &[u8], index: u32) -> bool {
    bits.get(index as usize / 8)
        .is_some_and(|b| b & (1 << (index % 8)) != 0)
}

#[cfg(test)]
mod tests;
