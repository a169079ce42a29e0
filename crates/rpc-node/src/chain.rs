//! The node's own chain-following work, and how far behind the tip it is.
//!
//! Blocks arrive on a fixed interval (the network produces them whatever the
//! node is doing). The node executes them one at a time, in order. The *tip
//! lag* is how long the oldest block that is not yet executed has been
//! waiting: `now - arrived(oldest pending)`, or zero when caught up. The tip
//! counts as lost once that lag exceeds `lost_after` (a multiple of the block
//! interval), mirroring docs/background.md part 5's "the node lost the chain tip".
//!
//! Time is passed in, so the logic is tested with fabricated instants.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Chain {
    /// Arrival times of blocks not yet executed, oldest first.
    pending: VecDeque<Instant>,
    /// Number of the last executed block.
    head: u64,
    lost_after: Duration,
    lag_max: Duration,
    tip_lost: bool,
}

impl Chain {
    pub fn new(lost_after: Duration) -> Self {
        Self {
            pending: VecDeque::new(),
            head: 0,
            lost_after,
            lag_max: Duration::ZERO,
            tip_lost: false,
        }
    }

    pub fn block_arrived(&mut self, now: Instant) {
        self.pending.push_back(now);
        self.observe(now);
    }

    /// The oldest pending block finished executing.
    pub fn block_executed(&mut self, now: Instant) {
        // The block's lag right up to the end of its execution counts.
        self.observe(now);
        if self.pending.pop_front().is_some() {
            self.head += 1;
        }
        self.observe(now);
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    pub fn head(&self) -> u64 {
        self.head
    }

    pub fn tip_lag(&self, now: Instant) -> Duration {
        self.pending.front().map_or(Duration::ZERO, |arrived| {
            now.saturating_duration_since(*arrived)
        })
    }

    /// Folds the current lag into the maximum and the tip-lost flag. Called
    /// on every chain event and by a periodic sampler, so a lag that keeps
    /// growing while the executor is starved is still seen.
    pub fn observe(&mut self, now: Instant) -> Duration {
        let lag = self.tip_lag(now);
        self.lag_max = self.lag_max.max(lag);
        if lag > self.lost_after {
            self.tip_lost = true;
        }
        lag
    }

    pub fn lag_max(&self) -> Duration {
        self.lag_max
    }

    /// True once the lag has exceeded `lost_after` since the last reset.
    pub fn tip_lost(&self) -> bool {
        self.tip_lost
    }

    /// Forgets the maxima, keeping the chain itself, so a test or a demo can
    /// measure one window.
    pub fn reset_maxima(&mut self, now: Instant) {
        self.lag_max = Duration::ZERO;
        self.tip_lost = false;
        self.observe(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn caught_up_chain_has_zero_lag() {
        let t0 = Instant::now();
        let mut chain = Chain::new(3000 * MS);
        assert_eq!(chain.tip_lag(t0), Duration::ZERO);
        chain.block_arrived(t0);
        chain.block_executed(t0 + 50 * MS);
        assert_eq!(chain.tip_lag(t0 + 900 * MS), Duration::ZERO);
        assert_eq!(chain.head(), 1);
        assert_eq!(chain.lag_max(), 50 * MS);
        assert!(!chain.tip_lost());
    }

    #[test]
    fn lag_is_measured_from_the_oldest_pending_block() {
        let t0 = Instant::now();
        let mut chain = Chain::new(3000 * MS);
        chain.block_arrived(t0);
        chain.block_arrived(t0 + 1000 * MS);
        chain.block_arrived(t0 + 2000 * MS);
        assert_eq!(chain.tip_lag(t0 + 2500 * MS), 2500 * MS);
        chain.block_executed(t0 + 2600 * MS);
        // The block that arrived at 1000 ms is now the oldest pending one.
        assert_eq!(chain.tip_lag(t0 + 2600 * MS), 1600 * MS);
        assert_eq!(chain.pending(), 2);
        assert_eq!(chain.lag_max(), 2600 * MS);
    }

    #[test]
    fn tip_is_lost_past_the_threshold_and_stays_lost_until_reset() {
        let t0 = Instant::now();
        let mut chain = Chain::new(3000 * MS);
        chain.block_arrived(t0);
        chain.observe(t0 + 3000 * MS);
        assert!(!chain.tip_lost(), "exactly at the threshold is not lost");
        chain.observe(t0 + 3001 * MS);
        assert!(chain.tip_lost());
        chain.block_executed(t0 + 3100 * MS);
        assert!(chain.tip_lost(), "recovering does not erase the loss");
        chain.reset_maxima(t0 + 3200 * MS);
        assert!(!chain.tip_lost());
        assert_eq!(chain.lag_max(), Duration::ZERO);
    }

    #[test]
    fn executing_with_nothing_pending_changes_nothing() {
        let t0 = Instant::now();
        let mut chain = Chain::new(MS);
        chain.block_executed(t0);
        assert_eq!(chain.head(), 0);
        assert!(!chain.has_pending());
    }
}
