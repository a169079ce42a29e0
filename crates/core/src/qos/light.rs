//! Counting without identifying, far below the threshold.
//!
//! Identifying a request costs host calls: its address (a property read,
//! the dearest call QoS makes), its API key, the clock, and its body, read
//! to find a batch's calls. Far below capacity nobody can be throttled and
//! nobody's share matters, so QoS only counts there: while an **upper
//! bound** of the load stays below `identifyAbove` (0.5) of capacity, a
//! request is counted in its worker's report as `calls_bound` of its body's
//! size, with no identity to decide by, no address and no clock read. Its
//! API key is read (one header; the gate needs to know who is staked), so
//! the usage ledger counts a staked key's requests, and their calls (its
//! body read for a batch), under its name.
//!
//! **The bound.** A JSON-RPC call in a batch takes at least
//! `MIN_CALL_BYTES` (`{"jsonrpc":"2.0","method":""}` and a comma), so a
//! body of `b` bytes holds at most `ceil(b / 30)` calls. The bound needs
//! only the body's size, which Envoy hands over with the body. It is
//! counted for every request, identified or not, and the round keeps its
//! EMA beside the load's (`LightState`), so switching between counting and
//! identifying is decided on one measure whatever the mode, and cannot
//! flap. Because the bound is never below the calls, a gateway that counts
//! has a real load below `identifyAbove × capacity`, which is below the
//! threshold: nobody is throttled while QoS counts, batches or not.
//!
//! **In node time** (`capacityNodeMs`) a body's size bounds its calls but
//! not what they cost, so each call of the bound counts at the dearest
//! cost known (`defaultCost`, the `costs` table, the learned estimates),
//! in µs, in the same fields, compared with `identifyAbove` of the
//! capacity in node ms. With `capacityCost` every request is identified.
//!
//! **What it costs.** A typical single call of 150 to 300 bytes bounds at
//! 5 to 10 calls, so QoS starts identifying at about a tenth of capacity for
//! such traffic; from there on the demand of every identity is measured as
//! before, with about half the capacity (from a tenth to the threshold) to
//! build its estimate. While it counts, calls are load without an identity:
//! the identities' demands decay as if they were quiet. A request counted
//! is not in flight for the concurrency allowance, which matters only while
//! throttling. Upgrades (WebSockets) are always identified: their allowance
//! is per identity. Reactive and fleet modes: reactive mode identifies every
//! request (its capacity follows their latency); a replica in fleet mode
//! that counts reports no identities, and so its demand starts to count in
//! the fleet's shares once it identifies.
//!
//! **Shared data.** `stakegate.stake_qos.v3.light`, written by the VM that
//! runs the round and read by every VM at its tick: layout version 1, then
//! `counting` u8 and the bound's EMA f64 (little-endian).

use crate::shared::{Reader, Record};

pub const LIGHT_KEY: &str = "stakegate.stake_qos.v3.light";
const LAYOUT_VERSION: u8 = 1;
const LEN: usize = 1 + 1 + 8;

/// The fewest bytes a JSON-RPC call takes in a batch.
pub const MIN_CALL_BYTES: usize = 30;

/// At most how many calls a body of `bytes` holds (at least one).
pub fn calls_bound(bytes: usize) -> u32 {
    bytes.div_ceil(MIN_CALL_BYTES).clamp(1, u32::MAX as usize) as u32
}

/// Whether QoS counts without identifying, and the bound's load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LightState {
    pub counting: bool,
    /// EMA of the calls' bound per refill interval.
    pub bound_ema: f64,
}

impl Record for LightState {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        if bytes[0] != LAYOUT_VERSION || bytes.len() != LEN {
            return Err(format!(
                "shared QoS light state has version {} and {} bytes, this module reads version {LAYOUT_VERSION} of {LEN}",
                bytes[0],
                bytes.len()
            ));
        }
        let mut r = Reader(&bytes[1..]);
        Ok(Self {
            counting: r.u8() != 0,
            bound_ema: r.f64(),
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LEN);
        out.push(LAYOUT_VERSION);
        out.push(u8::from(self.counting));
        out.extend_from_slice(&self.bound_ema.to_le_bytes());
        out
    }
}

/// A body arriving in pieces: the bound of what has arrived, counted once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BodyBound {
    counted: u32,
}

impl BodyBound {
    /// The body has `size` bytes so far: the calls to add to the bound.
    pub fn grow(&mut self, size: usize) -> u32 {
        let bound = calls_bound(size);
        let more = bound.saturating_sub(self.counted);
        self.counted = self.counted.max(bound);
        more
    }

    /// The request had no body: one call.
    pub fn at_least_one(&mut self) -> u32 {
        let more = u32::from(self.counted == 0);
        self.counted = self.counted.max(1);
        more
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_never_below_a_batchs_calls() {
        let call = r#"{"jsonrpc":"2.0","method":""}"#;
        for n in 1..200 {
            let batch = format!("[{}]", vec![call; n].join(","));
            assert!(calls_bound(batch.len()) as usize >= n, "{n} calls");
        }
        assert_eq!(calls_bound(0), 1);
        assert_eq!(calls_bound(150), 5);
    }

    #[test]
    fn a_body_in_pieces_is_counted_once() {
        let mut bound = BodyBound::default();
        assert_eq!(bound.grow(10), 1);
        assert_eq!(bound.grow(61), 2);
        assert_eq!(bound.grow(61), 0);
        assert_eq!(bound.at_least_one(), 0);
        assert_eq!(BodyBound::default().at_least_one(), 1);
    }

    #[test]
    fn the_state_round_trips() {
        let state = LightState {
            counting: true,
            bound_ema: 12.5,
        };
        assert_eq!(LightState::decode(&state.encode()).unwrap(), state);
        assert_eq!(LightState::decode(&[]).unwrap(), LightState::default());
        assert!(LightState::decode(&[2, 0]).is_err());
    }
}
