//! Reactive mode: the capacity shares are cut from follows upstream
//! back-pressure instead of a configured number (docs/background.md part 2, open
//! questions). Stake shares still decide *who* is throttled.
//!
//! The rule is AIMD anchored on what the upstream delivered, evaluated by
//! the refiller every `adjustIntervalMs` (default 200 ms) over the requests
//! that finished in that window:
//!
//! - **Back-pressure**: any upstream 503 or 429, or a mean latency above
//!   `latencyTolerance` (default 2) × the baseline.
//!   - If demand pressed against the capacity, the upstream was saturated
//!     and what it delivered (finished requests per second, less its
//!     503/429s) is what it can do: capacity becomes
//!     `min(capacity, delivered × decrease)` (default 0.9). The margin
//!     drains the backlog that built up before the window closed. While
//!     the backlog drains, latency stays high but the upstream keeps
//!     delivering, so repeated windows do not compound the cut.
//!   - Otherwise (the upstream slowed with room to spare, or nothing
//!     finished) `capacity *= decrease`.
//!
//!   Either way, not below `minCapacityRps`.
//! - **Healthy and pressed**: the load estimate is at the throttle threshold
//!   of the current capacity (demand would use more). Then capacity grows by
//!   `increasePerSecond` (default 0.1) × the policy's `capacityRps` per
//!   second, not above `maxCapacityRps`.
//! - Otherwise capacity stays.
//!
//! The baseline is the lowest window mean seen; it drifts 1 % of the way up
//! toward each higher mean, so a lasting change of method mix is learned
//! instead of read as congestion forever.

use crate::qos::policy::QosPolicy;
use crate::qos::state::QosState;

/// What finished upstream during one round.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Finished {
    pub completions: u64,
    pub latency_ms: u64,
    pub overloads: u64,
}

/// Folds a round into the window and, when the window is over, adjusts
/// `state.capacity_rps`. `load_rps` is the current load estimate.
pub fn adjust(
    state: &mut QosState,
    policy: &QosPolicy,
    now_ms: u64,
    round: Finished,
    load_rps: f64,
) {
    state.window_completions += round.completions;
    state.window_latency_ms += round.latency_ms;
    state.window_overloads += round.overloads;
    if state.last_adjust_ms == 0 {
        state.last_adjust_ms = now_ms;
    }
    let elapsed_ms = now_ms.saturating_sub(state.last_adjust_ms);
    if elapsed_ms < policy.reactive.adjust_interval_ms {
        return;
    }
    let r = &policy.reactive;
    let mean = (state.window_completions > 0)
        .then(|| state.window_latency_ms as f64 / state.window_completions as f64);
    if let Some(mean) = mean {
        state.baseline_latency_ms =
            if state.baseline_latency_ms <= 0.0 || mean < state.baseline_latency_ms {
                mean
            } else {
                state.baseline_latency_ms + (mean - state.baseline_latency_ms) * 0.01
            };
    }
    let slow = mean.is_some_and(|m| m > r.latency_tolerance * state.baseline_latency_ms.max(1.0));
    let pressed = load_rps >= policy.throttle_threshold * state.capacity_rps;
    if state.window_overloads > 0 || slow {
        let delivered = state
            .window_completions
            .saturating_sub(state.window_overloads) as f64
            * 1000.0
            / elapsed_ms as f64;
        let cut = if pressed && delivered > 0.0 {
            state.capacity_rps.min(delivered * r.decrease)
        } else {
            state.capacity_rps * r.decrease
        };
        state.capacity_rps = cut.max(r.min_capacity_rps);
    } else if pressed {
        let step = r.increase_per_second * policy.capacity_rps * elapsed_ms as f64 / 1000.0;
        state.capacity_rps = (state.capacity_rps + step).min(r.max_capacity_rps);
    }
    state.window_completions = 0;
    state.window_latency_ms = 0;
    state.window_overloads = 0;
    state.last_adjust_ms = now_ms;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> QosPolicy {
        QosPolicy::parse(br#"{"capacityRps": 1000, "mode": "reactive"}"#).unwrap()
    }

    fn window(
        state: &mut QosState,
        p: &QosPolicy,
        at: u64,
        mean_ms: u64,
        overloads: u64,
        load: f64,
    ) {
        let round = Finished {
            completions: 100,
            latency_ms: 100 * mean_ms,
            overloads,
        };
        adjust(state, p, at, round, load);
    }

    #[test]
    fn backs_off_to_what_the_upstream_delivered_and_grows_under_demand() {
        let p = policy();
        let mut s = QosState {
            capacity_rps: 1000.0,
            last_adjust_ms: 1,
            ..QosState::default()
        };
        // Each window: 100 requests finish in 200 ms, 500 rps delivered.
        window(&mut s, &p, 201, 10, 0, 100.0);
        assert_eq!((s.capacity_rps, s.baseline_latency_ms), (1000.0, 10.0));
        window(&mut s, &p, 401, 30, 0, 2000.0);
        assert_eq!(s.capacity_rps, 450.0, "pressed, 3x the baseline: 0.9 x 500");
        window(&mut s, &p, 601, 30, 0, 2000.0);
        assert_eq!(s.capacity_rps, 450.0, "the backlog drains: no compounding");
        window(&mut s, &p, 801, 10, 3, 100.0);
        assert_eq!(s.capacity_rps, 405.0, "upstream 503s with room to spare");
        window(&mut s, &p, 1001, 10, 0, 2000.0);
        assert_eq!(
            s.capacity_rps, 425.0,
            "+10 % of 1000 rps per second, for 0.2 s"
        );
        window(&mut s, &p, 1201, 10, 0, 100.0);
        assert_eq!(s.capacity_rps, 425.0, "no demand, no growth");
        // Within the window nothing changes.
        window(&mut s, &p, 1300, 90, 9, 2000.0);
        assert_eq!(s.capacity_rps, 425.0);
    }

    #[test]
    fn capacity_stays_within_its_bounds() {
        let p = policy();
        let mut s = QosState {
            capacity_rps: 1000.0,
            baseline_latency_ms: 10.0,
            last_adjust_ms: 1,
            ..QosState::default()
        };
        for i in 1..100 {
            window(&mut s, &p, 1 + i * 200, 10, 1, 0.0);
        }
        assert_eq!(s.capacity_rps, p.reactive.min_capacity_rps);
        for i in 100..1000 {
            window(&mut s, &p, 1 + i * 200, 10, 0, 1e9);
        }
        assert_eq!(s.capacity_rps, p.reactive.max_capacity_rps);
    }
}
