//! How fast admitted requests complete: the rate the gate's `retry-after`
//! comes from (`crate::rejection::retry_after_s`).
//!
//! Every release bumps the shared `completions` counter (see `shards`), so
//! each worker sees the gateway-wide count. On each heartbeat a worker folds
//! the change since its last one into an EMA of completions per second.

/// Weight of the newest sample in the EMA.
const ALPHA: f64 = 0.3;

#[derive(Debug, Clone, Default)]
pub struct DrainRate {
    last: Option<(u64, u64)>,
    per_second: f64,
}

impl DrainRate {
    /// Folds in the shared `completions` counter as seen at `now_ms`.
    pub fn observe(&mut self, now_ms: u64, completions: u64) {
        if let Some((then_ms, then_completions)) = self.last {
            if now_ms <= then_ms {
                return;
            }
            let elapsed_s = (now_ms - then_ms) as f64 / 1000.0;
            let sample = completions.wrapping_sub(then_completions) as f64 / elapsed_s;
            self.per_second = if self.per_second == 0.0 {
                sample
            } else {
                ALPHA * sample + (1.0 - ALPHA) * self.per_second
            };
        }
        self.last = Some((now_ms, completions));
    }

    pub fn per_second(&self) -> f64 {
        self.per_second
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_follows_the_shared_counter() {
        let mut rate = DrainRate::default();
        rate.observe(0, 100);
        assert_eq!(rate.per_second(), 0.0);
        rate.observe(1000, 500);
        assert_eq!(rate.per_second(), 400.0);
        rate.observe(2000, 600);
        assert!((rate.per_second() - (0.3 * 100.0 + 0.7 * 400.0)).abs() < 1e-9);
        rate.observe(2000, 900);
        assert!(
            (rate.per_second() - 310.0).abs() < 1e-9,
            "no time passed: ignored"
        );
    }
}
