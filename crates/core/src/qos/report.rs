//! What each worker tells the refiller: its identities' arrivals and
//! completions since its last report. A worker counts these locally, per
//! request, and once per tick puts one report on a shared queue; the VM
//! that runs the next refill round takes every report off the queue. So
//! requests never write shared data for their counts, and no two workers
//! ever race on a report.
//!
//! # Layout (version 3), on the queue `stakegate.stake_qos.v3.reports`
//!
//! Version `u8`, entry count `u32`, then 42-byte entries, little-endian:
//! `key` u64, `stake` u64, `tier` u8, flags u8 (1: staked), `arrivals`
//! u32 (calls, admitted or refused), `completions` u32, `latency_sum_ms`
//! u32, `overloads` u32 (upstream 503 or 429), `units` u64 (what the
//! arrivals cost, in thousandths of the policy's unit: `qos::cost`); then
//! `counted` u32 (the bound of the calls counted without an identity:
//! `qos::light`; in node time µs, each call at the dearest cost known) and
//! `bound` u32 (the same for the identified requests' calls); then the node-time samples: count `u16`, and 20-byte entries of
//! method key u64, calls u32, µs u64. Version 2 (an earlier module's,
//! during a swap) has 34-byte entries without `units` (its calls cost one
//! each) and no samples; version 1 not the trailer either.

use super::page::MILLI;
use crate::cost::Samples;
use crate::shared::{Reader, StoreError};

pub const QUEUE: &str = "stakegate.stake_qos.v3.reports";
pub const LAYOUT_VERSION: u8 = 3;
const HEADER_LEN: usize = 5;
const ENTRY_LEN: usize = 42;
const OLD_ENTRY_LEN: usize = 34;
const TRAILER_LEN: usize = 8;
const SAMPLE_LEN: usize = 20;

/// One identity's counts in a report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delta {
    pub key: u64,
    pub stake: u64,
    pub tier: u8,
    /// `page::STAKED` when it is in the stake table.
    pub flags: u8,
    pub arrivals: u32,
    pub completions: u32,
    pub latency_sum_ms: u32,
    pub overloads: u32,
    /// What the arrivals cost, in thousandths of the policy's unit (each
    /// at its identity's cost per call when it came).
    pub units: u64,
}

impl Delta {
    /// Adds `other`'s counts (same identity) to these.
    pub fn add(&mut self, other: &Delta) {
        (self.stake, self.tier, self.flags) = (other.stake, other.tier, other.flags);
        self.arrivals = self.arrivals.saturating_add(other.arrivals);
        self.completions = self.completions.saturating_add(other.completions);
        self.latency_sum_ms = self.latency_sum_ms.saturating_add(other.latency_sum_ms);
        self.overloads = self.overloads.saturating_add(other.overloads);
        self.units = self.units.saturating_add(other.units);
    }

    pub fn is_empty(&self) -> bool {
        self.arrivals == 0 && self.completions == 0
    }
}

/// One worker's counts since its last report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerReport {
    pub deltas: Vec<Delta>,
    /// The bound of the calls counted without an identity (in calls, or
    /// in node time µs).
    pub counted: u32,
    /// The bound of the identified requests' calls, in the same.
    pub bound: u32,
    /// Node time measured per method (the node-time unit).
    pub samples: Samples,
}

impl WorkerReport {
    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty() && self.counted == 0 && self.bound == 0 && self.samples.0.is_empty()
    }
}

pub fn encode(report: &WorkerReport) -> Vec<u8> {
    let deltas = &report.deltas;
    let mut out = Vec::with_capacity(HEADER_LEN + deltas.len() * ENTRY_LEN + TRAILER_LEN);
    out.push(LAYOUT_VERSION);
    out.extend_from_slice(&(deltas.len() as u32).to_le_bytes());
    for d in deltas {
        out.extend_from_slice(&d.key.to_le_bytes());
        out.extend_from_slice(&d.stake.to_le_bytes());
        out.push(d.tier);
        out.push(d.flags);
        for v in [d.arrivals, d.completions, d.latency_sum_ms, d.overloads] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&d.units.to_le_bytes());
    }
    out.extend_from_slice(&report.counted.to_le_bytes());
    out.extend_from_slice(&report.bound.to_le_bytes());
    let mut samples: Vec<_> = report
        .samples
        .0
        .iter()
        .take(usize::from(u16::MAX))
        .collect();
    samples.sort_unstable_by_key(|(k, _)| **k);
    out.extend_from_slice(&(samples.len() as u16).to_le_bytes());
    for (key, (calls, us)) in samples {
        out.extend_from_slice(&key.to_le_bytes());
        out.extend_from_slice(&calls.to_le_bytes());
        out.extend_from_slice(&us.to_le_bytes());
    }
    out
}

pub fn decode(bytes: &[u8]) -> Result<WorkerReport, String> {
    let (entry_len, trailer) = match bytes.first() {
        Some(&LAYOUT_VERSION) => (ENTRY_LEN, TRAILER_LEN),
        Some(2) => (OLD_ENTRY_LEN, TRAILER_LEN),
        Some(1) => (OLD_ENTRY_LEN, 0),
        version => {
            return Err(format!(
            "QoS report has layout version {version:?}, this module reads 1 to {LAYOUT_VERSION}"
        ))
        }
    };
    if bytes.len() < HEADER_LEN {
        return Err(format!("QoS report is {} bytes, too short", bytes.len()));
    }
    let mut r = Reader(&bytes[1..]);
    let count = r.u32() as usize;
    let fixed = HEADER_LEN
        .saturating_add(count.saturating_mul(entry_len))
        .saturating_add(trailer);
    let v3 = bytes.first() == Some(&LAYOUT_VERSION);
    let samples = match bytes.get(fixed..fixed.saturating_add(2)) {
        Some(n) if v3 => usize::from(u16::from_le_bytes([n[0], n[1]])),
        _ => 0,
    };
    let expected = if v3 {
        fixed + 2 + samples * SAMPLE_LEN
    } else {
        fixed
    };
    if bytes.len() != expected {
        return Err(format!(
            "QoS report is {} bytes, expected {expected} for {count} entries",
            bytes.len()
        ));
    }
    let deltas = (0..count)
        .map(|_| {
            let mut d = Delta {
                key: r.u64(),
                stake: r.u64(),
                tier: r.u8(),
                flags: r.u8(),
                arrivals: r.u32(),
                completions: r.u32(),
                latency_sum_ms: r.u32(),
                overloads: r.u32(),
                units: 0,
            };
            d.units = if entry_len == ENTRY_LEN {
                r.u64()
            } else {
                u64::from(d.arrivals) * MILLI as u64
            };
            d
        })
        .collect();
    let (counted, bound) = if trailer > 0 {
        (r.u32(), r.u32())
    } else {
        (0, 0)
    };
    let mut taken = Samples::default();
    if v3 {
        r.u16();
        for _ in 0..samples {
            let key = r.u64();
            let calls = r.u32();
            taken.add(key, calls, r.u64());
        }
    }
    Ok(WorkerReport {
        deltas,
        counted,
        bound,
        samples: taken,
    })
}

/// The shared queue reports travel on (proxy-wasm's shared queues).
pub trait ReportQueue {
    fn push(&self, report: &[u8]) -> Result<(), StoreError>;
    /// The oldest report, or `None` when the queue is empty.
    fn pop(&self) -> Result<Option<Vec<u8>>, StoreError>;
}

/// An in-memory queue, for tests.
#[derive(Debug, Default)]
pub struct MemoryQueue(std::cell::RefCell<std::collections::VecDeque<Vec<u8>>>);

impl ReportQueue for MemoryQueue {
    fn push(&self, report: &[u8]) -> Result<(), StoreError> {
        self.0.borrow_mut().push_back(report.to_vec());
        Ok(())
    }

    fn pop(&self) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.0.borrow_mut().pop_front())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_reject_bad_bytes() {
        let deltas = vec![
            Delta {
                key: 1,
                stake: u64::MAX,
                tier: 2,
                flags: 1,
                arrivals: 7,
                completions: 6,
                latency_sum_ms: 60,
                overloads: 1,
                units: 7_400,
            },
            Delta::default(),
        ];
        let mut samples = Samples::default();
        samples.add(5, 3, 600);
        let report = WorkerReport {
            deltas,
            counted: 40,
            bound: 9,
            samples,
        };
        let bytes = encode(&report);
        assert_eq!(decode(&bytes).unwrap(), report);
        assert!(decode(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .contains("expected"));
        assert!(decode(&[9]).unwrap_err().contains("version"));
        assert!(decode(&[]).is_err());
        assert!(decode(&[3, 0]).is_err());
    }

    #[test]
    fn an_earlier_modules_report_is_read_in_calls() {
        // Version 2: 34-byte entries, the trailer, no samples.
        let mut v2 = vec![2];
        v2.extend_from_slice(&1u32.to_le_bytes());
        v2.extend_from_slice(&9u64.to_le_bytes());
        v2.extend_from_slice(&5u64.to_le_bytes());
        v2.extend_from_slice(&[0, 1]);
        for v in [7u32, 6, 60, 1, 40, 9] {
            v2.extend_from_slice(&v.to_le_bytes());
        }
        let read = decode(&v2).unwrap();
        assert_eq!(read.deltas[0].units, 7 * MILLI as u64, "a call costs 1");
        assert_eq!((read.counted, read.bound), (40, 9));
        // Version 1: no trailer.
        let mut v1 = v2[..v2.len() - 8].to_vec();
        v1[0] = 1;
        let read = decode(&v1).unwrap();
        assert_eq!((read.deltas[0].arrivals, read.counted), (7, 0));
    }
}
