use super::*;
use crate::shared::MemoryStore;

/// A round in calls, below capacity, at `now_ms`.
fn calls_plan(now_ms: u64) -> Plan<'static> {
    Plan {
        intervals: 1.0,
        interval_ms: 20,
        level: f64::INFINITY,
        now_ms,
        idle_ttl_ms: 60_000,
        min_tokens: 2 * MILLI,
        initial_tokens: 8 * MILLI,
        fleet: None,
        calls: true,
        default_cost: 1.0,
    }
}

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
            let plan = calls_plan(0);
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
    let policy = QosPolicy::parse(br#"{"capacityRps": 1000000, "maxIdentities": 512}"#).unwrap();
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

#[test]
fn a_reported_identity_a_newcomer_evicted_first_comes_in_again() {
    // A full page, oldest first; every identity has a stake and demand.
    let mut page = Page::default();
    for key in 1..=ENTRIES_PER_PAGE as u64 {
        page.entry(&Entry {
            key: key * 10,
            stake: 1,
            demand: 1.0,
            last_seen_ms: key,
            ..Entry::default()
        });
    }
    let plan = calls_plan(1000);
    let call = |key| Delta {
        key,
        arrivals: 1,
        ..Delta::default()
    };
    // In key order: newcomer 5 evicts the oldest (10), which has calls
    // of its own and so comes back, evicting the next oldest (20).
    let applied = plan.apply(&mut page, &[call(5), call(10)]);
    assert_eq!(applied.evicted, 2);
    assert!(page.find(5).is_some());
    assert!(page.find(10).is_some());
    assert!(page.find(20).is_none());
    assert!(page.find(30).is_some());
    assert_eq!(page.len(), ENTRIES_PER_PAGE);
    let back = page.get(page.find(10).unwrap());
    assert_eq!((back.last_seen_ms, back.tokens > 0), (1000, true));
}
