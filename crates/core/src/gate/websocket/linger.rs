//! Slots of calls the node still runs after their socket was cut.
//!
//! A socket that closes with a close frame waits for the node's answers
//! (`mod.rs`, "Closing"). One cut without it (the client's connection
//! reset) takes the answers with it, but not the node's work: a node runs
//! the calls it has to the end, and Envoy cannot tell when. So the slots
//! of the units it had at the node are not given back at once: each is
//! held until the node is expected to be done with its unit: its calls
//! times the longest a call took lately on this worker's sockets
//! (`DEFAULT_CALL_MS` before any was answered), counted from when it was
//! sent or, if later, from when the last unit held before it is due (as if
//! the node ran the cut units one after another: they queue at the node
//! behind each other), at most `MAX_MS` after it was sent. An estimate, on
//! the safe side: a node that stops a socket's calls when it closes (geth
//! does) leaves those slots idle until then.

use crate::gate::shards::SlotKind;
use std::collections::VecDeque;

/// A call's time before any unit was answered on this worker's sockets.
pub const DEFAULT_CALL_MS: u64 = 3000;
/// The longest a cut socket's unit holds its slot after it was sent.
pub const MAX_MS: u64 = 30_000;
/// Answered units the per-call time is the longest of.
const SAMPLES: usize = 32;

/// One worker's held slots and recent call times.
#[derive(Debug, Default)]
pub struct Linger {
    /// The time per call of the last answered units, ms (newest last).
    per_call_ms: VecDeque<u64>,
    /// Slots held for cut sockets' units, and when each goes back (ms).
    held: Vec<(u64, SlotKind)>,
}

impl Linger {
    /// A unit of `calls` calls was answered `took_ms` after it was sent.
    pub fn answered(&mut self, took_ms: u64, calls: u32) {
        if self.per_call_ms.len() == SAMPLES {
            self.per_call_ms.pop_front();
        }
        self.per_call_ms
            .push_back(took_ms.div_ceil(u64::from(calls.max(1))));
    }

    /// The longest a call took lately.
    pub fn per_call_ms(&self) -> u64 {
        self.per_call_ms
            .iter()
            .copied()
            .max()
            .unwrap_or(DEFAULT_CALL_MS)
    }

    /// A cut socket's unit of `calls` calls, sent at `sent_ms`: whether
    /// its slot is held (else it goes back now).
    pub fn hold(&mut self, kind: SlotKind, now_ms: u64, sent_ms: u64, calls: u32) -> bool {
        let runs_ms = u64::from(calls.max(1)) * self.per_call_ms();
        let behind = self.held.iter().map(|&(until, _)| until).max();
        let starts = behind.map_or(sent_ms, |b| b.max(sent_ms));
        let until = starts
            .saturating_add(runs_ms)
            .min(sent_ms.saturating_add(MAX_MS));
        if until <= now_ms {
            return false;
        }
        self.held.push((until, kind));
        true
    }

    /// The held slots whose time has come, taken.
    pub fn due(&mut self, now_ms: u64) -> Vec<SlotKind> {
        let mut due = Vec::new();
        self.held.retain(|&(until, kind)| {
            let keep = until > now_ms;
            if !keep {
                due.push(kind);
            }
            keep
        });
        due
    }

    /// Slots held.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_units_slot_is_held_for_its_calls_at_the_longest_recent_time() {
        let mut linger = Linger::default();
        // Nothing answered yet: `DEFAULT_CALL_MS` a call.
        assert!(linger.hold(SlotKind::Default, 100, 0, 2));
        assert!(linger.due(2 * DEFAULT_CALL_MS - 1).is_empty());
        assert_eq!(linger.due(2 * DEFAULT_CALL_MS), [SlotKind::Default]);
        // 8 calls in 2.4 s, then 1 in 100 ms: 300 ms a call.
        linger.answered(2400, 8);
        linger.answered(100, 1);
        assert_eq!(linger.per_call_ms(), 300);
        assert!(!linger.hold(SlotKind::Default, 500, 0, 1), "done already");
        assert!(linger.hold(SlotKind::Default, 500, 0, 7));
        // Behind the first: from when it is due.
        assert!(linger.hold(SlotKind::Default, 500, 100, 1));
        assert_eq!(linger.held(), 2);
        assert!(linger.due(2099).is_empty());
        assert_eq!(linger.due(2100), [SlotKind::Default]);
        assert!(linger.due(2399).is_empty());
        assert_eq!(linger.due(2400), [SlotKind::Default]);
        // Never past MAX_MS.
        assert!(linger.hold(SlotKind::Default, 0, 0, 1_000_000));
        assert_eq!(linger.due(MAX_MS), [SlotKind::Default]);
    }

    #[test]
    fn only_recent_answers_count() {
        let mut linger = Linger::default();
        linger.answered(5000, 1);
        for _ in 0..SAMPLES {
            linger.answered(10, 1);
        }
        assert_eq!(linger.per_call_ms(), 10);
    }
}
