//! Agave's stake-weighted QoS as it was (docs/background.md part 1), for side-by-side
//! comparison with stakegate's policies in the simulator. Requests stand in
//! for streams.
//!
//! Both models estimate load with an integer EMA of requests per 5 ms
//! interval, `ema' = (load*a + ema*(1024-a)) / 1024` with `a = 2*1024/(N+1)`,
//! and give each client a quota per 100 ms window:
//!
//! - `agave-ema-legacy` (N = 10): staked quota
//!   `max(2*W*W*stake / (max(ema, W/4) * total_stake), U+1)`, unstaked `U`;
//!   it keeps the catch-up bug (a gap of k intervals re-applies the same
//!   load k times) and the `W/4` floor that keeps quotas small at no load.
//! - `agave-threshold` (N = 40): nobody is throttled while `ema` is below
//!   95 % of the maximum load per interval; above it, staked quota
//!   `max(budget*stake/total_stake, U+1)` with `budget = 2W` per 100 ms,
//!   unstaked `U`. Missed intervals decay with zero load.
//!
//! `W` is the staked budget per 50 ms: 80 % of capacity (20 % is reserved for
//! unstaked clients), and `U = 20` per 100 ms, as in the source.

use std::collections::HashMap;

const INTERVAL_NS: u64 = 5_000_000;
const WINDOW_NS: u64 = 100_000_000;
/// Unstaked quota per 100 ms.
pub const UNSTAKED_QUOTA: u64 = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    EmaLegacy,
    Threshold,
}

impl Mechanism {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "agave-ema-legacy" => Some(Self::EmaLegacy),
            "agave-threshold" => Some(Self::Threshold),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::EmaLegacy => "agave-ema-legacy",
            Self::Threshold => "agave-threshold",
        }
    }
}

/// The integer EMA of load per 5 ms interval.
#[derive(Debug, Clone)]
pub struct LoadEma {
    a: u64,
    value: u64,
    load: u64,
    interval_start: u64,
    /// Re-apply the last load for every missed interval (the old bug).
    catch_up_bug: bool,
}

impl LoadEma {
    pub fn new(n: u64, catch_up_bug: bool) -> Self {
        Self {
            a: 2 * 1024 / (n + 1),
            value: 0,
            load: 0,
            interval_start: 0,
            catch_up_bug,
        }
    }

    fn step(&mut self, load: u64) {
        self.value = (load * self.a + self.value * (1024 - self.a)) / 1024;
    }

    /// Closes every interval that ended by `now_ns`.
    pub fn advance(&mut self, now_ns: u64) {
        let elapsed = now_ns.saturating_sub(self.interval_start) / INTERVAL_NS;
        if elapsed == 0 {
            return;
        }
        if self.catch_up_bug {
            for _ in 0..elapsed {
                self.step(self.load);
            }
        } else {
            self.step(self.load);
            for _ in 1..elapsed.min(10_000) {
                self.step(0);
            }
        }
        self.load = 0;
        self.interval_start += elapsed * INTERVAL_NS;
    }

    pub fn record(&mut self) {
        self.load += 1;
    }

    pub fn value(&self) -> u64 {
        self.value
    }
}

/// One mechanism's admission decisions over a stream of requests.
#[derive(Debug, Clone)]
pub struct BaselineQos {
    mechanism: Mechanism,
    ema: LoadEma,
    /// Staked budget per 50 ms.
    w: u64,
    /// Maximum load per 5 ms interval.
    max_per_interval: u64,
    total_stake: u64,
    windows: HashMap<usize, (u64, u64)>,
}

impl BaselineQos {
    pub fn new(mechanism: Mechanism, capacity_rps: f64, total_stake: u64) -> Self {
        let per_ms = capacity_rps / 1000.0;
        let (n, bug) = match mechanism {
            Mechanism::EmaLegacy => (10, true),
            Mechanism::Threshold => (40, false),
        };
        Self {
            mechanism,
            ema: LoadEma::new(n, bug),
            w: ((per_ms * 0.8 * 50.0).round() as u64).max(1),
            max_per_interval: ((per_ms * 5.0).round() as u64).max(1),
            total_stake: total_stake.max(1),
            windows: HashMap::new(),
        }
    }

    /// This client's quota per 100 ms window, now.
    fn quota(&self, stake: u64) -> Option<u64> {
        if stake == 0 {
            return Some(UNSTAKED_QUOTA);
        }
        let (w, ema, total) = (
            self.w as u128,
            self.ema.value() as u128,
            self.total_stake as u128,
        );
        match self.mechanism {
            Mechanism::EmaLegacy => {
                let load = ema.max(w / 4).max(1);
                let quota = 2 * w * w * stake as u128 / (load * total);
                Some((quota as u64).max(UNSTAKED_QUOTA + 1))
            }
            Mechanism::Threshold => {
                if self.ema.value() * 100 < self.max_per_interval * 95 {
                    None
                } else {
                    Some(((2 * w * stake as u128 / total) as u64).max(UNSTAKED_QUOTA + 1))
                }
            }
        }
    }

    /// Would this mechanism admit `client`'s request at `now_ns`?
    pub fn offer(&mut self, now_ns: u64, client: usize, stake: u64) -> bool {
        self.ema.advance(now_ns);
        self.ema.record();
        let quota = self.quota(stake);
        let window = self.windows.entry(client).or_insert((now_ns, 0));
        if now_ns >= window.0 + WINDOW_NS {
            *window = (now_ns - (now_ns - window.0) % WINDOW_NS, 0);
        }
        match quota {
            Some(quota) if window.1 >= quota => false,
            _ => {
                window.1 += 1;
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catch_up_bug_and_its_fix_match_the_source() {
        // docs/background.md part 1: a 15 ms gap with load 1000, from 0: 450 with the
        // bug, 121 when missed intervals decay with zero load.
        for (bug, expected) in [(true, 450), (false, 121)] {
            let mut ema = LoadEma::new(10, bug);
            for _ in 0..1000 {
                ema.record();
            }
            ema.advance(15_000_000);
            assert_eq!(ema.value(), expected, "catch-up bug: {bug}");
        }
    }

    #[test]
    fn legacy_throttles_a_small_staker_on_an_idle_node() {
        // 400k rps capacity; a client with 0.01 % of the stake sending
        // 1,000 rps (100 per 100 ms) into an otherwise idle node.
        let mut legacy = BaselineQos::new(Mechanism::EmaLegacy, 400_000.0, 10_000);
        let mut threshold = BaselineQos::new(Mechanism::Threshold, 400_000.0, 10_000);
        let (mut by_legacy, mut by_threshold) = (0, 0);
        for i in 0..1000u64 {
            let now = i * 1_000_000;
            by_legacy += u64::from(legacy.offer(now, 0, 1));
            by_threshold += u64::from(threshold.offer(now, 0, 1));
        }
        assert_eq!(
            by_threshold, 1000,
            "below the threshold nobody is throttled"
        );
        assert!(
            by_legacy < 400,
            "the W/4 floor keeps the quota small: {by_legacy}"
        );
    }

    #[test]
    fn under_load_threshold_quotas_follow_stake() {
        // Two stakers at 1:3, together offering 10x capacity; counted once
        // the EMA (N = 40) has caught up with the load.
        let mut qos = BaselineQos::new(Mechanism::Threshold, 10_000.0, 4);
        let mut admitted = [0u64; 2];
        for i in 0..200_000u64 {
            let (now, client) = (i * 10_000, (i % 2) as usize);
            let stake = if client == 0 { 1 } else { 3 };
            let ok = qos.offer(now, client, stake);
            if now >= 500_000_000 {
                admitted[client] += u64::from(ok);
            }
        }
        let share = admitted[1] as f64 / (admitted[0] + admitted[1]) as f64;
        assert!((share - 0.75).abs() < 0.02, "share {share}");
    }
}
