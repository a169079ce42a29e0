//! The refill round (see the module doc of `qos` for the rule): take the
//! workers' reports off the queue, predict each active identity's demand,
//! find the water level, and grant every active identity its part.

use super::fair::{self, Claim};
use super::fleet::{Demand, FleetShare, Report, RoundFleet};
use super::light::{LightState, LIGHT_KEY};
use super::page::{page_key, Entry, Page, ENTRIES_PER_PAGE, IDLE, MILLI, STAKED};
use super::policy::{Mode, QosPolicy};
use super::reactive::{self, Finished};
use super::report::{self, Delta, ReportQueue};
use super::state::{step_load, QosState, ACTIVE_KEY, DEMAND_KEY, STATE_KEY};
use crate::shared::{read, update, update_from, Change, Record, SharedStore, StoreError, Write};
use std::collections::{BTreeMap, HashMap};

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
    fn apply(&self, page: &mut Page, deltas: &[&Delta]) -> Applied {
        let mut evicted = 0;
        let mut report = Vec::new();
        let mut by_entry = [None; ENTRIES_PER_PAGE];
        for d in deltas {
            // A new identity starts with the gift, as one a worker's lease
            // creates does.
            let (i, out) = page.entry(&Entry {
                key: d.key,
                stake: d.stake,
                tier: d.tier,
                flags: d.flags,
                last_seen_ms: self.now_ms,
                tokens: self.initial_tokens,
                ..Entry::default()
            });
            evicted += u64::from(out);
            by_entry[i] = Some(*d);
        }
        let (mut active, mut demand_sum) = (0, 0.0);
        for (i, delta) in by_entry.into_iter().enumerate().take(page.len()) {
            if delta.is_none() && page.flags(i) & IDLE != 0 {
                continue;
            }
            let (demand, calls, quiet) = self.demand(page, i, delta);
            if let Some(d) = delta {
                page.set_stake(i, d.stake);
                page.set_tier(i, d.tier);
                page.set_flags(i, (page.flags(i) & !STAKED) | (d.flags & STAKED));
                page.set_last_seen_ms(i, self.now_ms);
            }
            page.set_quiet(i, quiet);
            let idle = calls == 0 && demand < IDLE_DEMAND;
            let flags = page.flags(i) & !IDLE;
            if idle {
                page.set_flags(i, flags | IDLE);
                page.set_demand(i, 0.0);
                page.set_grant(i, 0);
                continue;
            }
            active += 1;
            page.set_flags(i, flags);
            page.set_demand(i, demand as f32);
            demand_sum += f64::from(demand as f32);
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
            let per_interval = if claim.demand <= self.level * claim.weight {
                claim.demand * (1.0 + HEADROOM)
            } else {
                fair::part(&claim, self.level)
            };
            let grant = (per_interval * MILLI as f64) as i64;
            page.set_grant(i, grant.max(0) as u64);
            // Two rounds of burst, at least two tokens.
            let cap = (2 * grant).max(self.min_tokens);
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

/// What a round did to one page.
struct Applied {
    active: u64,
    evicted: u64,
    /// The demand of its active identities, as written.
    demand_sum: f64,
    /// Fleet mode: its active identities' demand.
    report: Vec<Demand>,
}

/// Runs one round over the policy's pages, as the VM that claimed it.
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
    let mut deltas: HashMap<u64, Delta> = HashMap::new();
    let mut finished = Finished::default();
    let mut arrivals = 0u64;
    // The calls' bound (`light`): of the counted requests and the
    // identified ones.
    let mut bound = 0u64;
    while (report.reports as usize) < MAX_REPORTS {
        let Some(bytes) = queue.pop()? else { break };
        report.reports += 1;
        // A report this module cannot read (a swap's other layout) is
        // dropped: its counts are a round's worth of demand at most.
        let Ok(worker) = report::decode(&bytes) else {
            continue;
        };
        arrivals += u64::from(worker.counted);
        bound += u64::from(worker.counted) + u64::from(worker.bound);
        for d in worker.deltas {
            arrivals += u64::from(d.arrivals);
            finished.completions += u64::from(d.completions);
            finished.latency_ms += u64::from(d.latency_sum_ms);
            finished.overloads += u64::from(d.overloads);
            deltas
                .entry(d.key)
                .or_insert(Delta {
                    key: d.key,
                    ..Delta::default()
                })
                .add(&d);
        }
    }

    // The pages to visit: those the last round left active, and those of
    // identities with new counts.
    let (active_before, active_cas) = read_active(store)?;
    let mut visit: BTreeMap<u32, Vec<&Delta>> = BTreeMap::new();
    for page in 0..pages {
        if bit(&active_before, page) {
            visit.entry(page).or_default();
        }
    }
    for d in deltas.values() {
        visit
            .entry((d.key % u64::from(pages.max(1))) as u32)
            .or_default()
            .push(d);
    }
    // In key order, so that a round's outcome does not depend on the
    // map's (a new identity's place in its page, the order of the sums).
    for page_deltas in visit.values_mut() {
        page_deltas.sort_unstable_by_key(|d| d.key);
    }

    let intervals = intervals.clamp(1, MAX_CATCH_UP) as f64;
    let mut plan = Plan {
        intervals,
        interval_ms: policy.refill_interval_ms,
        level: f64::INFINITY,
        now_ms,
        idle_ttl_ms: policy.idle_ttl_ms,
        min_tokens: 2 * MILLI,
        initial_tokens: i64::from(policy.initial_tokens) * MILLI,
        fleet,
    };
    // Pass one: every active identity's demand, for the level; skipped when
    // the demand cannot reach capacity (then the level is infinite).
    let capacity_rps = fleet.map_or(previous.capacity_rps, |f| f.capacity_rps);
    let per_interval = capacity_rps * policy.refill_interval_ms as f64 / 1000.0;
    let mut read_pages = Vec::with_capacity(visit.len());
    if demand_reaches(store, previous.round, arrivals, intervals, per_interval)? {
        let mut claims = Vec::new();
        for (&index, page_deltas) in &visit {
            let (page, cas) = read::<Page>(store, &page_key(index))?;
            let mut by_entry = [None; ENTRIES_PER_PAGE];
            for d in page_deltas {
                match page.find(d.key) {
                    Some(i) => by_entry[i] = Some(*d),
                    None => claims.push(Claim {
                        demand: DEMAND_SMOOTHING * f64::from(d.arrivals) / plan.first_since(),
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
                        demand,
                        weight: plan.weight(page.key(i), page.stake(i)),
                    });
                }
            }
            read_pages.push((index, Some((page, cas))));
        }
        plan.level = fair::level(&claims, per_interval);
        report.level_computed = true;
    } else {
        read_pages.extend(visit.keys().map(|&index| (index, None)));
    }

    // Pass two: grant, from what pass one read (read again only if a
    // worker wrote the page in between).
    let mut active_after = vec![0u8; (pages as usize).div_ceil(8)];
    let mut demand_sum = 0.0;
    let mut fleet_report = fleet.map(|_| Report::default());
    for (index, read_before) in read_pages {
        let page_deltas = &visit[&index];
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
        if let Some(r) = &mut fleet_report {
            r.0.extend(page_report);
        }
        demand_sum += page_demand;
        report.identities += active;
        report.evicted += evicted;
        report.cas_retries += updated.retries;
        report.pages += 1;
        if active > 0 {
            active_after[index as usize / 8] |= 1 << (index % 8);
        }
    }
    // Only this round's VM writes it; a failed write is redone next round.
    // Until then a page with active identities may go unvisited, and its
    // demand uncounted: the demand sum is not written either.
    let active_written = active_after == active_before
        || store.store(ACTIVE_KEY, &active_after, active_cas) == Ok(Write::Stored);

    let updated = update(store, STATE_KEY, |s: &mut QosState| {
        s.round = s.round.wrapping_add(1);
        s.load_ema = step_load(
            s.load_ema,
            arrivals,
            intervals as u64,
            policy.load_smoothing,
        );
        s.identities = report.identities;
        s.level = plan.level;
        match fleet {
            Some(f) => s.capacity_rps = f.capacity_rps,
            None => s.settle_capacity(policy),
        }
        let load_rps = s.load_rps(policy.refill_interval_ms);
        if policy.mode == Mode::Reactive {
            reactive::adjust(s, policy, now_ms, finished, load_rps);
        }
        s.throttling = load_rps >= policy.throttle_threshold * s.capacity_rps;
        Change::Write(())
    })
    .map_err(|(e, _)| e)?;
    report.cas_retries += updated.retries;
    let state = updated.table;
    report.counting = count_or_identify(policy, store, &state, bound, intervals as u64)?;
    // Only this round's VM writes it; without it (not written, or a write
    // that failed) the next round computes the level.
    if active_written {
        let _ = store.store(
            DEMAND_KEY,
            &DemandSum {
                round: state.round,
                sum: demand_sum,
            }
            .encode(),
            None,
        );
    }
    report.throttling = state.throttling;
    report.load_rps = state.load_rps(policy.refill_interval_ms);
    report.capacity_rps = state.capacity_rps;
    report.level = plan.level;
    report.fleet = fleet.zip(fleet_report).map(|(f, report)| RoundFleet {
        report,
        replicas: f.replicas,
        fallback: f.fallback,
    });
    Ok((state, report))
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
    let bound_rps = bound_ema * 1000.0 / policy.refill_interval_ms as f64;
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
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    /// An identity's demand over a run of rounds with these calls.
    fn demands(calls: &[u32]) -> Vec<f64> {
        let mut page = Page::default();
        page.entry(&Entry {
            key: 1,
            demand: 16.0,
            ..Entry::default()
        });
        calls
            .iter()
            .map(|&c| {
                let delta = Delta {
                    key: 1,
                    arrivals: c,
                    ..Delta::default()
                };
                let plan = Plan {
                    intervals: 1.0,
                    interval_ms: 20,
                    level: f64::INFINITY,
                    now_ms: 0,
                    idle_ttl_ms: 60_000,
                    min_tokens: 2 * MILLI,
                    initial_tokens: 8 * MILLI,
                    fleet: None,
                };
                let (demand, _, quiet) = plan.demand(&page, 0, Some(&delta));
                page.set_demand(0, demand as f32);
                page.set_quiet(0, quiet);
                demand
            })
            .collect()
    }

    /// Every page's bytes and the state after each of `rounds` rounds of
    /// `arrivals(round)` calls spread over 40 identities; with
    /// `forget_demand`, the last round's demand sum is lost before each
    /// round, so that pass one always runs.
    fn rounds(capacity: u32, forget_demand: bool) -> (Vec<Vec<Vec<u8>>>, u32) {
        let policy = QosPolicy::parse(
            format!(r#"{{"capacityRps": {capacity}, "maxIdentities": 512}}"#).as_bytes(),
        )
        .unwrap();
        let (store, queue) = (MemoryStore::default(), report::MemoryQueue::default());
        let mut state = QosState {
            capacity_rps: f64::from(capacity),
            ..QosState::default()
        };
        let mut seen = Vec::new();
        let mut computed = 0;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..400u64 {
            // Load swings between a tenth and twice capacity, in waves.
            let wave = 0.1 + 1.9 * ((round as f64 / 40.0).sin() + 1.0) / 2.0;
            let calls = (wave * f64::from(capacity) / 50.0) as u32;
            let mut deltas = Vec::new();
            for _ in 0..calls {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let key = 1 + (x % 40) * (x % 7 + 1) % 40;
                deltas.push(Delta {
                    key,
                    stake: key * 1000,
                    arrivals: 1,
                    ..Delta::default()
                });
            }
            queue
                .push(&report::encode(&report::WorkerReport {
                    deltas,
                    ..Default::default()
                }))
                .unwrap();
            if forget_demand {
                store.store(DEMAND_KEY, &[], None).unwrap();
            }
            let report;
            (state, report) = run(&policy, &store, &queue, round * 20, &state, 1, None).unwrap();
            computed += u32::from(report.level_computed);
            let pages = (0..4)
                .map(|i| store.load(&page_key(i)).unwrap().0.unwrap_or_default())
                .collect();
            seen.push(pages);
        }
        (seen, computed)
    }

    #[test]
    fn skipping_the_level_below_capacity_changes_nothing() {
        for capacity in [500, 2000] {
            let (skipping, computed) = rounds(capacity, false);
            let (always, every) = rounds(capacity, true);
            assert_eq!(every, 400);
            assert!(
                (50..350).contains(&computed),
                "capacity {capacity}: the level was computed in {computed} rounds of 400"
            );
            let first = (0..400).find(|&r| skipping[r] != always[r]);
            assert!(
                first.is_none(),
                "capacity {capacity}: the pages differ from round {first:?}"
            );
        }
    }

    /// A store whose writes of the active-page bitmap fail.
    struct NoBitmap(MemoryStore);

    impl SharedStore for NoBitmap {
        fn load(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.0.load(key)
        }
        fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<Write, StoreError> {
            if key == ACTIVE_KEY {
                return Ok(Write::CasMismatch);
            }
            self.0.store(key, value, cas)
        }
    }

    /// Whether each of three rounds, a call each, far below capacity,
    /// computed the level.
    fn levels_computed(store: &impl SharedStore) -> Vec<bool> {
        let policy =
            QosPolicy::parse(br#"{"capacityRps": 1000000, "maxIdentities": 512}"#).unwrap();
        let queue = report::MemoryQueue::default();
        let mut state = QosState {
            capacity_rps: 1e6,
            ..QosState::default()
        };
        (0..3u64)
            .map(|round| {
                let call = Delta {
                    key: round + 1,
                    arrivals: 1,
                    ..Delta::default()
                };
                queue
                    .push(&report::encode(&report::WorkerReport {
                        deltas: vec![call],
                        ..Default::default()
                    }))
                    .unwrap();
                let report;
                (state, report) = run(&policy, store, &queue, round * 20, &state, 1, None).unwrap();
                report.level_computed
            })
            .collect()
    }

    #[test]
    fn without_the_bitmap_written_the_next_round_computes_the_level() {
        // The first round has no demand sum to go by.
        assert_eq!(
            levels_computed(&MemoryStore::default()),
            [true, false, false]
        );
        assert_eq!(
            levels_computed(&NoBitmap(MemoryStore::default())),
            [true, true, true]
        );
    }

    #[test]
    fn a_report_that_misses_one_round_does_not_move_the_demand() {
        // 16 calls a round; one round's report comes a round late.
        let got = demands(&[16, 0, 32, 16]);
        assert!(got.iter().all(|d| (d - 16.0).abs() < 1e-3), "{got:?}");
    }

    #[test]
    fn a_client_that_stops_loses_its_demand_from_the_second_quiet_round() {
        let got = demands(&[16, 0, 0, 0, 0]);
        assert_eq!(&got[..2], &[16.0, 16.0]);
        assert_eq!(&got[2..], &[1.0, 0.5, 1.0 / 3.0]);
    }

    #[test]
    fn a_sparse_client_keeps_its_rate_between_its_calls() {
        // One call every ten rounds settles at 0.1 a round.
        let mut calls = Vec::new();
        for _ in 0..30 {
            calls.push(1);
            calls.extend([0; 9]);
        }
        let got = demands(&calls);
        let last = &got[got.len() - 10..];
        assert!(last.iter().all(|d| (d - 0.1).abs() < 0.02), "{last:?}");
    }
}
