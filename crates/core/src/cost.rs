//! What a call costs, in the unit stake QoS cuts shares in (`Unit`), and
//! the per-method estimates learned from measured node time, which the
//! admission gate also keeps (`gate::node_time`) to tell cheap calls from
//! heavy ones.
//!
//! - **Calls**: every call costs 1.
//! - **Node time**: a call costs the node's time on it, in ms. It is known
//!   only when its answer comes, so a request is charged an estimate when
//!   its body is read (its methods' estimates) and the difference when it
//!   ends (`Settle`). Estimates are learned per method from the measured
//!   times, shared by every worker through the refill round
//!   (`Estimates`): each worker reports its samples, the round folds them
//!   in and writes the table, each worker reads it at its tick. The
//!   policy's `costs` seed them; a method with no estimate yet is charged
//!   `defaultCost`.
//! - **Cost**: a static table (compute units), `defaultCost` for a method
//!   not in it; nothing is learned.
//!
//! # The estimates record (`stakegate.stake_qos.v3.costs`)
//!
//! Version `u8` (1), count `u16`, then 16-byte entries, little-endian:
//! method key `u64` (`method_key`), estimate in µs `u32`, samples `u32`
//! (capped). Written only by the VM that runs the round.

use crate::shared::{Reader, Record};
use std::collections::HashMap;

pub const ESTIMATES_KEY: &str = "stakegate.stake_qos.v3.costs";
/// The property in which the admission gate tells the filters before it
/// the node's time on a request, in µs as decimal digits
/// (`gate::node_time`). Envoy keeps it in the stream's filter state
/// (`wasm.stakegate_node_us`), which no client sees: no header to add,
/// and none for stake QoS to take off again.
pub const NODE_US_PROPERTY: &str = "stakegate_node_us";
/// The property in which the admission gate tells the filters before it
/// what the node has answered on a WebSocket so far: its calls, the time
/// their units took at the node (sent to answered) in µs, the
/// notifications it pushed, and the calls sent to the node, as decimal
/// numbers (`SocketAnswered`; a reader takes a missing third or fourth as
/// 0). Totals, so that a reader that missed a piece loses nothing.
pub const SOCKET_ANSWERED_PROPERTY: &str = "stakegate_socket_answered";

/// What `SOCKET_ANSWERED_PROPERTY` holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAnswered {
    pub calls: u64,
    pub node_us: u64,
    pub pushes: u64,
    /// Calls sent to the node (those at the node are `sent - calls`).
    pub sent: u64,
}

impl SocketAnswered {
    pub fn text(&self) -> String {
        format!(
            "{} {} {} {}",
            self.calls, self.node_us, self.pushes, self.sent
        )
    }

    pub fn read(text: &[u8]) -> Option<Self> {
        let mut numbers = std::str::from_utf8(text).ok()?.split(' ');
        let mut next = || numbers.next().map(str::parse::<u64>);
        Some(Self {
            calls: next()?.ok()?,
            node_us: next()?.ok()?,
            pushes: next().unwrap_or(Ok(0)).ok()?,
            sent: next().unwrap_or(Ok(0)).ok()?,
        })
    }
}
const VERSION: u8 = 1;
const ENTRY_LEN: usize = 16;
/// Methods learned at most; a method past it keeps `defaultCost` (a client
/// that invents method names cannot grow the table).
pub const MAX_METHODS: usize = 256;
/// Weight of one sample in a method's estimate, and the most a round's
/// samples weigh together: an estimate follows a change of cost within
/// about ten rounds of samples, and one odd sample moves it a tenth.
const SAMPLE_WEIGHT: f64 = 0.1;
const ROUND_WEIGHT: f64 = 0.5;

/// The unit shares are cut in: what the capacity field names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// `capacityRps`: calls per second.
    Calls,
    /// `capacityNodeMs`: node milliseconds per second.
    NodeTime,
    /// `capacityCost`: cost units per second (`costs`).
    Cost,
}

/// A method's key in the tables: FNV-1a of its name.
pub fn method_key(method: &str) -> u64 {
    method.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The policy's costs: the unit, the table (seeds in the node-time unit),
/// and the cost of a method not in it, each in the unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Costs {
    pub unit: Unit,
    pub table: HashMap<u64, f64>,
    pub default: f64,
}

impl Costs {
    /// What one call of `method` is charged, in the unit, with what has
    /// been learned.
    pub fn of(&self, method: &str, learned: &Estimates) -> f64 {
        match self.unit {
            Unit::Calls => 1.0,
            Unit::Cost => self
                .table
                .get(&method_key(method))
                .copied()
                .unwrap_or(self.default),
            Unit::NodeTime => {
                let key = method_key(method);
                learned
                    .get(key)
                    .or_else(|| self.table.get(&key).copied())
                    .unwrap_or(self.default)
            }
        }
    }

    /// What a body's calls are charged: each method's cost, and a body the
    /// strict reader does not take is its calls at the default.
    pub fn of_body(&self, body: &[u8], learned: &Estimates) -> BodyCost {
        let Some(request) = crate::jsonrpc::Request::read(body) else {
            let calls = crate::jsonrpc::calls(body);
            return BodyCost {
                units: f64::from(calls) * self.default,
                method: None,
                calls,
            };
        };
        let units = request
            .calls
            .iter()
            .map(|c| self.of(c.method, learned))
            .sum();
        let mut keys = request.calls.iter().map(|c| method_key(c.method));
        let first = keys.next();
        BodyCost {
            units,
            method: first.filter(|&first| keys.all(|key| key == first)),
            calls: u32::try_from(request.calls.len()).unwrap_or(u32::MAX),
        }
    }
}

/// What a body's calls cost together, in the unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BodyCost {
    pub units: f64,
    /// The method, if every call is of one.
    pub method: Option<u64>,
    /// Its calls (at least one).
    pub calls: u32,
}

/// The learned node-time estimates, per method, in ms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Estimates {
    by_method: HashMap<u64, (f64, u32)>,
}

impl Estimates {
    pub fn get(&self, key: u64) -> Option<f64> {
        self.by_method.get(&key).map(|(ms, _)| *ms)
    }

    pub fn len(&self) -> usize {
        self.by_method.len()
    }

    /// The dearest method's estimate, in ms.
    pub fn max(&self) -> Option<f64> {
        self.by_method.values().map(|(ms, _)| *ms).reduce(f64::max)
    }

    pub fn is_empty(&self) -> bool {
        self.by_method.is_empty()
    }

    /// Folds a round's samples in: `samples` calls of the method took
    /// `total_ms` together. A method not known yet starts at its samples'
    /// mean; past `MAX_METHODS`, new methods are not learned.
    pub fn learn(&mut self, key: u64, samples: u32, total_ms: f64) {
        if samples == 0 {
            return;
        }
        let mean = total_ms / f64::from(samples);
        let full = self.by_method.len() >= MAX_METHODS;
        match self.by_method.get_mut(&key) {
            Some((ms, seen)) => {
                let weight = (SAMPLE_WEIGHT * f64::from(samples)).min(ROUND_WEIGHT);
                *ms += weight * (mean - *ms);
                *seen = seen.saturating_add(samples);
            }
            None if !full => {
                self.by_method.insert(key, (mean, samples));
            }
            None => {}
        }
    }
}

impl Estimates {
    /// A method's estimate held at its dearest recent call (the admission
    /// gate's): `ms` if that is above the held value once decayed to its
    /// share `kept`, else that decayed value; past `MAX_METHODS`, new
    /// methods are not learned.
    pub fn hold(&mut self, key: u64, ms: f64, kept: f64) {
        let full = self.by_method.len() >= MAX_METHODS;
        match self.by_method.get_mut(&key) {
            Some((held, seen)) => {
                *held = ms.max(*held * kept);
                *seen = seen.saturating_add(1);
            }
            None if !full => {
                self.by_method.insert(key, (ms, 1));
            }
            None => {}
        }
    }
}

impl Record for Estimates {
    fn encode(&self) -> Vec<u8> {
        let mut entries: Vec<_> = self.by_method.iter().collect();
        entries.sort_unstable_by_key(|(k, _)| **k);
        let mut out = Vec::with_capacity(3 + entries.len() * ENTRY_LEN);
        out.push(VERSION);
        out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        for (key, (ms, seen)) in entries {
            out.extend_from_slice(&key.to_le_bytes());
            let us = (ms * 1000.0).round().clamp(0.0, f64::from(u32::MAX)) as u32;
            out.extend_from_slice(&us.to_le_bytes());
            out.extend_from_slice(&seen.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        if bytes[0] != VERSION {
            return Err(format!(
                "cost estimates have layout version {}, this module reads {VERSION}",
                bytes[0]
            ));
        }
        let mut r = Reader(bytes.get(1..).unwrap_or_default());
        if bytes.len() < 3 {
            return Err("cost estimates: too short".into());
        }
        let count = usize::from(r.u16());
        if bytes.len() != 3 + count * ENTRY_LEN {
            return Err(format!(
                "cost estimates are {} bytes, expected {} for {count} entries",
                bytes.len(),
                3 + count * ENTRY_LEN
            ));
        }
        let by_method = (0..count)
            .map(|_| {
                let key = r.u64();
                let ms = f64::from(r.u32()) / 1000.0;
                (key, (ms, r.u32()))
            })
            .collect();
        Ok(Self { by_method })
    }
}

/// One worker's node-time samples since its last report: per method (a
/// request whose calls are all of one method), calls and µs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Samples(pub HashMap<u64, (u32, u64)>);

impl Samples {
    /// `calls` calls of the method `key` took `us` together.
    pub fn add(&mut self, key: u64, calls: u32, us: u64) {
        if self.0.len() >= MAX_METHODS && !self.0.contains_key(&key) {
            return;
        }
        let (n, total) = self.0.entry(key).or_default();
        *n = n.saturating_add(calls);
        *total = total.saturating_add(us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_follows_a_change_of_cost_within_a_few_rounds() {
        let mut learned = Estimates::default();
        let key = method_key("eth_call");
        learned.learn(key, 10, 50.0);
        assert_eq!(learned.get(key), Some(5.0), "starts at its samples' mean");
        let mut rounds = 0;
        while (learned.get(key).unwrap() - 50.0).abs() > 5.0 {
            learned.learn(key, 10, 500.0);
            rounds += 1;
        }
        assert!(rounds <= 5, "{rounds} rounds");
        // One odd sample moves it a tenth of the way.
        learned.learn(key, 1, 0.0);
        assert!(learned.get(key).unwrap() > 40.0);
    }

    #[test]
    fn the_table_is_bounded_and_round_trips() {
        let mut learned = Estimates::default();
        for i in 0..(MAX_METHODS as u64 + 10) {
            learned.learn(i, 1, 2.5);
        }
        assert_eq!(learned.len(), MAX_METHODS);
        let bytes = learned.encode();
        assert_eq!(Estimates::decode(&bytes).unwrap(), learned);
        assert!(Estimates::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(Estimates::decode(&[9]).is_err());
        assert_eq!(Estimates::decode(&[]).unwrap(), Estimates::default());
    }

    #[test]
    fn a_body_is_charged_each_method_and_the_default_for_what_is_unread() {
        let mut table = HashMap::new();
        table.insert(method_key("eth_getLogs"), 20.0);
        let costs = Costs {
            unit: Unit::NodeTime,
            table,
            default: 10.0,
        };
        let mut learned = Estimates::default();
        let single = br#"{"jsonrpc":"2.0","id":1,"method":"eth_getLogs"}"#;
        let cost = |units, method: Option<&str>, calls| BodyCost {
            units,
            method: method.map(method_key),
            calls,
        };
        assert_eq!(
            costs.of_body(single, &learned),
            cost(20.0, Some("eth_getLogs"), 1)
        );
        learned.learn(method_key("eth_getLogs"), 4, 100.0);
        assert_eq!(costs.of_body(single, &learned).units, 25.0, "learned first");
        let mixed = br#"[{"id":1,"method":"eth_getLogs"},{"id":2,"method":"eth_new"}]"#;
        assert_eq!(costs.of_body(mixed, &learned), cost(35.0, None, 2));
        assert_eq!(costs.of_body(b"[1,2,3]", &learned), cost(30.0, None, 3));
        let calls = Costs {
            unit: Unit::Calls,
            table: HashMap::new(),
            default: 1.0,
        };
        assert_eq!(calls.of_body(mixed, &learned).units, 2.0);
    }
}
