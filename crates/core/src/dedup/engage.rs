//! When coalescing is engaged, and when it stands by.
//!
//! Two identical requests from one client are both at the node only when
//! an answer is late: a client retries after its timeout, and re-polls a
//! receipt or a balance after its interval, but a node that answers in a
//! few milliseconds has answered long before. Checking every request costs
//! the body's read, its key and two shared-data updates (and sending it by
//! callout), which is most of what the gate costs; so while every request
//! leaves the node quickly, coalescing **stands by**: requests pass as if
//! dedup were off. It **engages** when a request has been at the node for
//! `engageAfterMs` (100 ms), on any worker, and stands by again once none
//! has for `standbyAfterMs` (5 s). It starts engaged, until the node has
//! shown it is quick: until `standbyAfterMs` after the gateway's first
//! request (before, it stood by 5 s after it started, so on a gateway that
//! waited for its first client the first identical requests were both
//! sent).
//!
//! **How it is measured.** Each worker counts its requests at the node by
//! the tick (`TICK_MS`) they were admitted in: no clock read and no shared
//! data per request. At each tick, the oldest count still open tells the
//! age of the oldest request at the node, to a tick. A worker that sees one
//! older than `engageAfterMs` writes `now + standbyAfterMs` to the shared
//! record `stakegate.admission_gate.v2.dedup.engaged` (when that moves it
//! by more than a tick), and every worker reads it at its tick, so a worker
//! with nothing at the node engages with the others.
//!
//! **What standing by gives up.** A request that arrived while coalescing
//! stood by is not in the table: an identical one that arrives after it
//! engages is sent too (once: its own copies are coalesced from then on).
//! Identical requests from different clients in the same few milliseconds
//! (global methods: a raw transaction broadcast twice) reach a quick node
//! both, which answers the second itself; and answers that cannot change
//! are reused only while engaged. `engageAfterMs: 0` keeps it engaged.

use crate::shared::{read, Reader, Record, SharedStore, StoreError};
use std::collections::VecDeque;

/// How often a worker looks at its requests' ages (the gate's tick).
pub const TICK_MS: u64 = 100;
pub const ENGAGED_KEY: &str = "stakegate.admission_gate.v2.dedup.engaged";
const LAYOUT_VERSION: u8 = 1;

/// Until when coalescing is engaged, gateway-wide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct EngagedUntil(u64);

impl Record for EngagedUntil {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        match bytes {
            [] => Ok(Self(0)),
            [LAYOUT_VERSION, rest @ ..] if rest.len() == 8 => Ok(Self(Reader(rest).u64())),
            _ => Err(format!(
                "shared dedup engagement has {} bytes of version {:?}, this module reads version {LAYOUT_VERSION}",
                bytes.len(),
                bytes.first()
            )),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = vec![LAYOUT_VERSION];
        out.extend_from_slice(&self.0.to_le_bytes());
        out
    }
}

/// One worker's view: its requests at the node by tick, and the
/// engagement.
#[derive(Debug, Clone)]
pub struct Engagement {
    /// Ticks a request may be at the node before coalescing engages; 0:
    /// always engaged.
    after_ticks: u64,
    standby_after_ms: u64,
    /// The current tick.
    tick: u64,
    /// Requests at the node admitted in each tick from `first_tick` on
    /// (the first also holds older ones).
    at_node: VecDeque<u32>,
    first_tick: u64,
    /// This worker's own reason to be engaged, until then (ms); `None`
    /// before the first tick.
    until_ms: Option<u64>,
    /// As of the last tick (engaged before the first).
    engaged: bool,
    /// Whether a request has gone to the node from this worker. Until one
    /// has, it says nothing in the shared record (a quiet worker would hold
    /// the others engaged) and follows it; engaged while no worker has.
    seen: bool,
}

/// A request at the node, by the tick it was admitted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a request counted at the node is counted until it has ended"]
pub struct AtNode(u64);

impl Engagement {
    pub fn new(engage_after_ms: u64, standby_after_ms: u64) -> Self {
        Self {
            after_ticks: engage_after_ms.div_ceil(TICK_MS),
            standby_after_ms,
            tick: 0,
            at_node: VecDeque::from([0]),
            first_tick: 0,
            until_ms: None,
            engaged: true,
            seen: false,
        }
    }

    /// Whether requests are checked now.
    pub fn engaged(&self) -> bool {
        self.after_ticks == 0 || self.engaged
    }

    /// A request went to the node.
    pub fn started(&mut self) -> AtNode {
        self.seen = true;
        if let Some(n) = self.at_node.back_mut() {
            *n += 1;
        }
        AtNode(self.tick)
    }

    /// It has left the node (answered, failed or reset).
    pub fn ended(&mut self, request: AtNode) {
        let index = request.0.saturating_sub(self.first_tick) as usize;
        if let Some(n) = self.at_node.get_mut(index) {
            *n = n.saturating_sub(1);
        }
    }

    /// At the gate's tick: ages its requests a tick, engages if one has
    /// been at the node too long, and follows the other workers. Returns
    /// whether it is engaged.
    pub fn tick(&mut self, store: &impl SharedStore, now_ms: u64) -> Result<bool, StoreError> {
        if self.after_ticks == 0 {
            return Ok(true);
        }
        // The oldest open tick: requests admitted in it are that old.
        while self.at_node.len() > 1 && self.at_node.front() == Some(&0) {
            self.at_node.pop_front();
            self.first_tick += 1;
        }
        let oldest_open = self
            .at_node
            .iter()
            .position(|&n| n > 0)
            .map(|i| self.first_tick + i as u64);
        let slow = oldest_open.is_some_and(|t| self.tick - t >= self.after_ticks);
        self.tick += 1;
        self.at_node.push_back(0);
        // Older than the engagement's age, requests are counted together.
        while self.at_node.len() as u64 > self.after_ticks + 2 {
            let oldest = self.at_node.pop_front().unwrap_or(0);
            self.first_tick += 1;
            if let Some(next) = self.at_node.front_mut() {
                *next += oldest;
            }
        }
        let (EngagedUntil(shared), cas) = read::<EngagedUntil>(store, ENGAGED_KEY)?;
        if self.seen {
            let mine = match self.until_ms {
                Some(until) if !slow => until,
                // Its first request, after another worker's: the
                // gateway's first request started the clock.
                None if !slow && shared > 0 => shared,
                // Slow; or the gateway's first request: engaged from the
                // start until `standbyAfterMs` after it.
                _ => now_ms + self.standby_after_ms,
            };
            if mine > shared + TICK_MS {
                // A lost race is fine: the other worker engaged too.
                store.store(ENGAGED_KEY, &EngagedUntil(mine).encode(), cas)?;
            }
            self.until_ms = Some(mine);
        }
        self.engaged = match self.until_ms {
            // No worker has sent a request yet.
            None if shared == 0 => true,
            mine => now_ms < mine.unwrap_or(0).max(shared),
        };
        Ok(self.engaged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    /// Ticks `e` `n` times from `*now`.
    fn ticks(e: &mut Engagement, store: &MemoryStore, now: &mut u64, n: u32) -> bool {
        let mut engaged = false;
        for _ in 0..n {
            *now += TICK_MS;
            engaged = e.tick(store, *now).unwrap();
        }
        engaged
    }

    #[test]
    fn it_stands_by_while_the_node_is_quick_and_engages_when_a_request_stays() {
        let store = MemoryStore::default();
        let mut e = Engagement::new(100, 1000);
        let mut now = 0;
        assert!(e.engaged(), "engaged until the node shows it is quick");
        // Requests that leave within a tick.
        for _ in 0..11 {
            let r = e.started();
            e.ended(r);
            ticks(&mut e, &store, &mut now, 1);
        }
        assert!(!e.engaged(), "quick for a second: standing by");
        // One request stays: after a tick it is 100 ms old.
        let slow = e.started();
        assert!(!ticks(&mut e, &store, &mut now, 1));
        assert!(ticks(&mut e, &store, &mut now, 1), "engaged");
        e.ended(slow);
        // It stays engaged for standbyAfterMs after the last slow tick.
        assert!(ticks(&mut e, &store, &mut now, 9));
        assert!(!ticks(&mut e, &store, &mut now, 2), "standing by again");
    }

    #[test]
    fn a_worker_with_nothing_at_the_node_follows_one_that_engaged() {
        let store = MemoryStore::default();
        let (mut a, mut b) = (Engagement::new(100, 1000), Engagement::new(100, 1000));
        let (mut now_a, mut now_b) = (0, 0);
        for (e, now) in [(&mut a, &mut now_a), (&mut b, &mut now_b)] {
            let quick = e.started();
            e.ended(quick);
            ticks(e, &store, now, 12);
        }
        assert!(!a.engaged() && !b.engaged());
        let _stuck = a.started();
        ticks(&mut a, &store, &mut now_a, 2);
        assert!(a.engaged());
        assert!(
            ticks(&mut b, &store, &mut now_b, 1),
            "b engages from the shared record"
        );
    }

    #[test]
    fn it_stays_engaged_until_the_gateways_first_request_shows_the_node_quick() {
        let store = MemoryStore::default();
        let (mut first, mut quiet) = (Engagement::new(100, 1000), Engagement::new(100, 1000));
        let (mut now, mut now_quiet) = (0, 0);
        assert!(ticks(&mut first, &store, &mut now, 100), "10 s, no request");
        assert!(ticks(&mut quiet, &store, &mut now_quiet, 100));
        assert_eq!(read::<EngagedUntil>(&store, ENGAGED_KEY).unwrap().0 .0, 0);
        let request = first.started();
        first.ended(request);
        assert!(
            ticks(&mut first, &store, &mut now, 9),
            "engaged for 1 s more"
        );
        assert!(
            !ticks(&mut first, &store, &mut now, 2),
            "then quick: standing by"
        );
        // A worker that has sent none follows the shared record, and its
        // first request, quick, does not start the clock again.
        assert!(!ticks(&mut quiet, &store, &mut now_quiet, 11));
        let request = quiet.started();
        quiet.ended(request);
        assert!(!ticks(&mut quiet, &store, &mut now_quiet, 1));
    }

    #[test]
    fn old_requests_are_counted_together_and_still_end() {
        let store = MemoryStore::default();
        let mut e = Engagement::new(100, 1000);
        let mut now = 0;
        let old = e.started();
        ticks(&mut e, &store, &mut now, 50);
        assert!(e.at_node.len() <= 4, "{:?}", e.at_node);
        assert!(e.engaged());
        e.ended(old);
        assert_eq!(e.at_node.iter().sum::<u32>(), 0);
        assert!(!ticks(&mut e, &store, &mut now, 12));
        assert!(
            Engagement::new(0, 1000).engaged(),
            "engageAfterMs 0: always"
        );
    }
}
