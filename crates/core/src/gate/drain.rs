//! How fast admitted requests complete, and the `retry-after` it implies.
//!
//! Every release bumps the shared `completions` counter (see `shards`), so
//! each worker sees the gateway-wide count. On each heartbeat a worker folds
//! the change since its last one into an EMA of completions per second.
//!
//! `retry-after` is the time the current in-flight set needs to drain at
//! that rate, `base = ceil(inflight / rate)`, at least 1 s, plus a random
//! extra of up to `max(base, 2)` seconds, so clients rejected together come
//! back spread over a window instead of in lockstep (docs/background.md part 5,
//! follow-ups). With a fast node (base 1 s) that is 1, 2 or 3 s.

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

/// Seconds a rejected client should wait. `jitter` is uniform in [0, 1).
pub fn retry_after_s(inflight: u32, drain_per_second: f64, jitter: f64, max_s: u32) -> u32 {
    let base = if drain_per_second > 0.0 {
        (f64::from(inflight) / drain_per_second).ceil().max(1.0)
    } else {
        1.0
    };
    let extra = (jitter.clamp(0.0, 1.0) * base.max(2.0)).round();
    ((base + extra).min(f64::from(max_s)) as u32).max(1)
}

/// A small xorshift generator for jitter: proxy-wasm has no random hostcall
/// and the jitter needs no cryptographic quality.
#[derive(Debug, Clone)]
pub struct Jitter(u64);

impl Jitter {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// Uniform in [0, 1).
    pub fn next_unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
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

    #[test]
    fn retry_after_is_the_drain_time_stretched_by_jitter() {
        assert_eq!(
            retry_after_s(8, 400.0, 0.0, 30),
            1,
            "drains in 20 ms: at least 1 s"
        );
        assert_eq!(
            retry_after_s(8, 400.0, 0.999, 30),
            3,
            "plus up to 2 s of jitter"
        );
        assert_eq!(retry_after_s(8, 0.0, 0.0, 30), 1, "no rate yet");
        assert_eq!(retry_after_s(100, 20.0, 0.0, 30), 5);
        assert_eq!(retry_after_s(100, 20.0, 0.5, 30), 8);
        assert_eq!(retry_after_s(100, 20.0, 0.999, 30), 10);
        assert_eq!(retry_after_s(10_000, 1.0, 0.5, 30), 30, "capped");
    }

    #[test]
    fn jitter_spreads_retries() {
        let mut jitter = Jitter::new(42);
        let values: Vec<u32> = (0..1000)
            .map(|_| retry_after_s(100, 20.0, jitter.next_unit(), 30))
            .collect();
        for s in 5..=10 {
            assert!(values.contains(&s), "{s} s never chosen");
        }
        assert!(values.iter().all(|s| (5..=10).contains(s)));
        let fast: Vec<u32> = (0..1000)
            .map(|_| retry_after_s(8, 400.0, jitter.next_unit(), 30))
            .collect();
        for s in 1..=3 {
            assert!(fast.contains(&s), "{s} s never chosen for a fast node");
        }
    }
}
