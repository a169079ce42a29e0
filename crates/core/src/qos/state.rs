//! The gateway-wide QoS state, one shared-data record
//! (`stakegate.stake_qos.v3.state`) written only by the elected refiller and
//! read by every VM at its tick: the round clock, the load estimate,
//! whether throttling is on, the (possibly discovered) capacity, the water
//! level of the last allocation, and the active identities.
//!
//! Layout (version 2): version `u8`, `throttling` `u8`, then 11 eight-byte
//! little-endian fields in the order of the struct below.

use super::policy::{Mode, QosPolicy};
use crate::shared::{Reader, Record};

pub const STATE_KEY: &str = "stakegate.stake_qos.v3.state";
/// A bitmap of the pages that hold an active identity, written by the round.
pub const ACTIVE_KEY: &str = "stakegate.stake_qos.v3.active";
/// The active identities' demand after the last round (`round::DemandSum`).
pub const DEMAND_KEY: &str = "stakegate.stake_qos.v3.demand";

pub const LAYOUT_VERSION: u8 = 2;
const LEN: usize = 2 + 8 * 11;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct QosState {
    /// Start of the current round, on a grid of refill intervals. 0 until
    /// the first round.
    pub round_ms: u64,
    /// Rounds run so far.
    pub round: u64,
    /// EMA of arrivals (calls admitted or refused) per refill interval.
    pub load_ema: f64,
    pub throttling: bool,
    /// The capacity shares are cut from: the policy's, or in reactive mode
    /// the discovered one. 0 means "not yet set".
    pub capacity_rps: f64,
    /// Identities with demand in the last round.
    pub identities: u64,
    /// The last round's water level: tokens per round per unit of stake
    /// for identities that wanted more (infinite while nobody did).
    pub level: f64,
    /// Reactive mode: the lowest mean upstream latency seen (drifting up
    /// slowly), the window's sums, and when capacity last changed.
    pub baseline_latency_ms: f64,
    pub window_completions: u64,
    pub window_latency_ms: u64,
    pub window_overloads: u64,
    pub last_adjust_ms: u64,
}

impl QosState {
    /// The capacity shares are cut from: the policy's in proactive mode (so
    /// a new policy takes effect at once), and in reactive mode the
    /// discovered one, starting from the policy's.
    pub fn settle_capacity(&mut self, policy: &QosPolicy) {
        if let Some(fleet) = &policy.fleet {
            // The round sets it from the fleet's allocation.
            if self.capacity_rps <= 0.0 {
                self.capacity_rps = policy.capacity_rps / f64::from(fleet.assume_replicas);
            }
            return;
        }
        if self.capacity_rps <= 0.0 || policy.mode == Mode::Proactive {
            self.capacity_rps = policy.capacity_rps;
        }
    }

    /// The load estimate in requests per second.
    pub fn load_rps(&self, refill_interval_ms: u64) -> f64 {
        self.load_ema * 1000.0 / refill_interval_ms as f64
    }
}

impl Record for QosState {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        if bytes[0] != LAYOUT_VERSION || bytes.len() != LEN {
            return Err(format!(
                "shared QoS state has version {} and {} bytes, this module reads version {LAYOUT_VERSION} of {LEN}",
                bytes[0],
                bytes.len()
            ));
        }
        let mut r = Reader(&bytes[1..]);
        // Fields are read in layout order: the literal's order.
        Ok(Self {
            throttling: r.u8() != 0,
            round_ms: r.u64(),
            round: r.u64(),
            load_ema: r.f64(),
            capacity_rps: r.f64(),
            identities: r.u64(),
            level: r.f64(),
            baseline_latency_ms: r.f64(),
            window_completions: r.u64(),
            window_latency_ms: r.u64(),
            window_overloads: r.u64(),
            last_adjust_ms: r.u64(),
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LEN);
        out.push(LAYOUT_VERSION);
        out.push(u8::from(self.throttling));
        for v in [
            self.round_ms,
            self.round,
            self.load_ema.to_bits(),
            self.capacity_rps.to_bits(),
            self.identities,
            self.level.to_bits(),
            self.baseline_latency_ms.to_bits(),
            self.window_completions,
            self.window_latency_ms,
            self.window_overloads,
            self.last_adjust_ms,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }
}

/// The load estimate: an EMA of arrivals per refill interval with
/// `a = 2/(N+1)`. A round that closes `k` intervals at once (ticks came
/// late) counts its arrivals once and decays the `k-1` missed intervals with
/// zero load. Agave's old load estimate re-applied the same load `k` times
/// instead: from 0, a load of 1000 over a 15 ms gap of 5 ms intervals
/// (N = 10) gave 450 where 121 is right (docs/background.md).
pub fn step_load(ema: f64, arrivals: u64, intervals: u64, smoothing: u32) -> f64 {
    let a = 2.0 / (f64::from(smoothing) + 1.0);
    let after = a * arrivals as f64 + (1.0 - a) * ema;
    let missed = intervals.saturating_sub(1).min(100_000) as i32;
    after * (1.0 - a).powi(missed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips() {
        let state = QosState {
            round_ms: 12,
            round: 3,
            level: 0.25,
            load_ema: 3.5,
            throttling: true,
            capacity_rps: 800.0,
            identities: 5,
            baseline_latency_ms: 9.5,
            window_completions: 10,
            window_latency_ms: 100,
            window_overloads: 1,
            last_adjust_ms: 40,
        };
        assert_eq!(QosState::decode(&state.encode()).unwrap(), state);
        assert!(QosState::decode(&[1, 2]).is_err());
    }

    #[test]
    fn a_gap_counts_its_load_once() {
        // Agave's case: N = 10, load 1000 over a 3-interval gap from 0.
        let fixed = step_load(0.0, 1000, 3, 10);
        assert!((fixed - 121.7).abs() < 0.5, "{fixed}");
        let buggy = (0..3).fold(0.0, |ema, _| step_load(ema, 1000, 1, 10));
        assert!((buggy - 450.0).abs() < 3.0, "{buggy}");
    }
}
