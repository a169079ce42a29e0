//! The gate's shared state: one record of per-worker shards, kept in one
//! shared-data key and changed only by compare-and-swap (see `crate::shared`).
//!
//! # Layout (version 1)
//!
//! Little-endian, written by every worker VM of the plugin's `vm_id`:
//!
//! | bytes | field |
//! |---|---|
//! | 1 | layout version (1) |
//! | 4 | `next_vm`: the id the next VM to join takes |
//! | 8 | `completions`: admitted requests released, ever (the drain rate's source) |
//! | 2 | shard count |
//! | 24 × n | shards: `vm` u32, `heartbeat_ms` u64, `default` u32, `priority` u32, `websocket` u32 |
//!
//! Each VM owns one shard and only ever changes its own counts; any VM may
//! drop a shard whose heartbeat is older than the stale-slot TTL, which is
//! how slots held by a VM that disappeared (reload, swap, crash) come back.
//!
//! # Exactness
//!
//! A request is admitted only inside a successful CAS on the whole record,
//! after checking the sum over live shards against the limit. Two workers
//! admitting at once cannot both pass on the same count: the second CAS
//! fails, re-reads, and re-checks. So the admitted in-flight total never
//! exceeds the limit, however many workers there are.

use crate::shared::Reader;
use std::fmt;

pub const LAYOUT_VERSION: u8 = 1;
const HEADER_LEN: usize = 1 + 4 + 8 + 2;
const SHARD_LEN: usize = 4 + 8 + 4 + 4 + 4;

/// What one admitted request holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    Default,
    Priority,
    Websocket,
}

/// Slots by kind: what a shard holds, what a worker keeps spare, and the
/// totals over all shards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Slots {
    pub default: u32,
    pub priority: u32,
    pub websocket: u32,
}

/// Slots held across all shards.
pub type Totals = Slots;

impl Slots {
    pub fn count(&self, kind: SlotKind) -> u32 {
        match kind {
            SlotKind::Default => self.default,
            SlotKind::Priority => self.priority,
            SlotKind::Websocket => self.websocket,
        }
    }

    fn count_mut(&mut self, kind: SlotKind) -> &mut u32 {
        match kind {
            SlotKind::Default => &mut self.default,
            SlotKind::Priority => &mut self.priority,
            SlotKind::Websocket => &mut self.websocket,
        }
    }

    /// Requests counted against `maxInflight`.
    pub fn inflight(&self) -> u32 {
        self.default.saturating_add(self.priority)
    }

    fn sum(&self) -> u64 {
        u64::from(self.default) + u64::from(self.priority) + u64::from(self.websocket)
    }

    fn plus(self, other: &Slots) -> Slots {
        Slots {
            default: self.default.saturating_add(other.default),
            priority: self.priority.saturating_add(other.priority),
            websocket: self.websocket.saturating_add(other.websocket),
        }
    }

    fn minus(self, other: &Slots) -> Slots {
        Slots {
            default: self.default.saturating_sub(other.default),
            priority: self.priority.saturating_sub(other.priority),
            websocket: self.websocket.saturating_sub(other.websocket),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shard {
    pub vm: u32,
    /// The owner's clock when it last wrote, in ms since the Unix epoch.
    pub heartbeat_ms: u64,
    pub held: Slots,
}

/// The admission limits, compiled from the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `None`: pass-through (policy `-1`), counted but never limited.
    pub max_inflight: Option<u32>,
    /// Slots only priority traffic may take.
    pub reserved: u32,
    /// Slots a heavy request may not take (policy `nodeTime.cheapSlots`).
    pub cheap: u32,
    /// WebSocket connections; `None`: unlimited.
    pub max_websocket: Option<u32>,
    /// Messages one WebSocket connection may have in flight at the node;
    /// each also takes an in-flight slot.
    pub per_websocket: u32,
}

impl Limits {
    /// The limits with `maxInflight` times `scale`, up to `most` (at
    /// least `maxInflight`; `None`: no scale): slots held longer than the
    /// node works (`node_time::Occupancy`).
    pub fn scaled(self, scale: f64, most: Option<u32>) -> Limits {
        let (Some(m), Some(most)) = (self.max_inflight, most) else {
            return self;
        };
        let scaled = (f64::from(m) * scale.max(1.0)) as u32;
        Limits {
            max_inflight: Some(scaled.min(most).max(m)),
            ..self
        }
    }

    /// The most `kind` slots there can ever be (`None`: unlimited).
    pub fn most(&self, kind: SlotKind) -> Option<u32> {
        match kind {
            SlotKind::Default => self.max_inflight.map(|m| m.saturating_sub(self.reserved)),
            SlotKind::Priority => self.max_inflight,
            SlotKind::Websocket => self.max_websocket,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutError {
    UnknownVersion(u8),
    Truncated { expected: usize, got: usize },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::UnknownVersion(v) => {
                write!(
                    f,
                    "shared gate state has layout version {v}, this module reads {LAYOUT_VERSION}"
                )
            }
            LayoutError::Truncated { expected, got } => {
                write!(
                    f,
                    "shared gate state is truncated: {got} bytes, expected {expected}"
                )
            }
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardTable {
    pub next_vm: u32,
    pub completions: u64,
    pub shards: Vec<Shard>,
}

impl crate::shared::Record for ShardTable {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        ShardTable::decode(bytes).map_err(|e| e.to_string())
    }

    fn encode(&self) -> Vec<u8> {
        ShardTable::encode(self)
    }
}

impl ShardTable {
    /// An empty value (a key never written) is an empty table.
    pub fn decode(bytes: &[u8]) -> Result<Self, LayoutError> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        if bytes[0] != LAYOUT_VERSION {
            return Err(LayoutError::UnknownVersion(bytes[0]));
        }
        let truncated = |expected| LayoutError::Truncated {
            expected,
            got: bytes.len(),
        };
        if bytes.len() < HEADER_LEN {
            return Err(truncated(HEADER_LEN));
        }
        let mut r = Reader(&bytes[1..]);
        let next_vm = r.u32();
        let completions = r.u64();
        let count = usize::from(r.u16());
        let expected = HEADER_LEN + count * SHARD_LEN;
        if bytes.len() < expected {
            return Err(truncated(expected));
        }
        let shards = (0..count)
            .map(|_| Shard {
                vm: r.u32(),
                heartbeat_ms: r.u64(),
                held: Slots {
                    default: r.u32(),
                    priority: r.u32(),
                    websocket: r.u32(),
                },
            })
            .collect();
        Ok(Self {
            next_vm,
            completions,
            shards,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.shards.len() * SHARD_LEN);
        out.push(LAYOUT_VERSION);
        out.extend_from_slice(&self.next_vm.to_le_bytes());
        out.extend_from_slice(&self.completions.to_le_bytes());
        out.extend_from_slice(&(self.shards.len().min(usize::from(u16::MAX)) as u16).to_le_bytes());
        for s in self.shards.iter().take(usize::from(u16::MAX)) {
            out.extend_from_slice(&s.vm.to_le_bytes());
            out.extend_from_slice(&s.heartbeat_ms.to_le_bytes());
            for count in [s.held.default, s.held.priority, s.held.websocket] {
                out.extend_from_slice(&count.to_le_bytes());
            }
        }
        out
    }

    /// Gives a joining VM its id and an empty shard.
    pub fn join(&mut self, now_ms: u64) -> u32 {
        let vm = self.next_vm;
        self.next_vm = self.next_vm.wrapping_add(1);
        self.shards.push(Shard {
            vm,
            heartbeat_ms: now_ms,
            ..Shard::default()
        });
        vm
    }

    pub fn totals(&self) -> Totals {
        self.shards
            .iter()
            .fold(Slots::default(), |t, s| t.plus(&s.held))
    }

    /// Drops shards not heard from for more than `ttl_ms` (their owner is
    /// gone) and returns how many slots they held.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> u64 {
        let mut reclaimed = 0;
        self.shards.retain(|s| {
            let stale = now_ms.saturating_sub(s.heartbeat_ms) > ttl_ms;
            if stale {
                reclaimed += s.held.sum();
            }
            !stale
        });
        reclaimed
    }

    /// The caller's own shard, refreshed to `now_ms`. A VM whose shard was
    /// expired (it stalled past the TTL) gets a fresh empty one back.
    fn own(&mut self, vm: u32, now_ms: u64) -> &mut Shard {
        let index = match self.shards.iter().position(|s| s.vm == vm) {
            Some(index) => index,
            None => {
                self.shards.push(Shard {
                    vm,
                    ..Shard::default()
                });
                self.shards.len() - 1
            }
        };
        let shard = &mut self.shards[index];
        shard.heartbeat_ms = shard.heartbeat_ms.max(now_ms);
        shard
    }

    /// Marks `vm` alive and gives its spare slots back to the pool.
    pub fn heartbeat(&mut self, vm: u32, now_ms: u64, spare: &Spare) {
        let shard = self.own(vm, now_ms);
        shard.held = shard.held.minus(&spare.slots);
        self.completions = self.completions.wrapping_add(spare.completed);
    }

    /// `vm` is going away: its spare slots go back to the pool and, if it
    /// holds nothing else, its shard goes. Slots still held (a request its
    /// VM had not finished) stay in the shard and expire with the TTL.
    /// Returns what is still held.
    pub fn leave(&mut self, vm: u32, now_ms: u64, spare: &Spare) -> u64 {
        self.heartbeat(vm, now_ms, spare);
        let held = self.own(vm, now_ms).held.sum();
        if held == 0 {
            self.shards.retain(|s| s.vm != vm);
        }
        held
    }

    /// Takes one `kind` slot for `vm` if the limits allow it.
    pub fn try_admit(&mut self, vm: u32, now_ms: u64, kind: SlotKind, limits: &Limits) -> bool {
        self.try_admit_n(vm, now_ms, kind, 1, limits)
    }

    /// Takes `n` `kind` slots for `vm` if the limits allow all of them, or
    /// none.
    pub fn try_admit_n(
        &mut self,
        vm: u32,
        now_ms: u64,
        kind: SlotKind,
        n: u32,
        limits: &Limits,
    ) -> bool {
        self.try_admit_between(vm, now_ms, kind, n..=n, false, limits) > 0
    }

    /// Takes as many `kind` slots for `vm` as the limits allow, up to the
    /// end of `count`, if that is at least its start (else none); a
    /// `heavy` request leaves the cheap slots. Returns how many.
    pub fn try_admit_between(
        &mut self,
        vm: u32,
        now_ms: u64,
        kind: SlotKind,
        count: std::ops::RangeInclusive<u32>,
        heavy: bool,
        limits: &Limits,
    ) -> u32 {
        let (least, most) = count.into_inner();
        let totals = self.totals();
        let room = |held: u32, max: u32| max.saturating_sub(held);
        // A heavy request leaves the cheap slots free, whoever holds the rest.
        let cheap = if heavy { limits.cheap } else { 0 };
        let room = match kind {
            SlotKind::Default => limits.max_inflight.map(|max| {
                room(
                    totals.inflight(),
                    max.saturating_sub(limits.reserved).saturating_sub(cheap),
                )
            }),
            SlotKind::Priority => limits
                .max_inflight
                .map(|max| room(totals.inflight(), max.saturating_sub(cheap))),
            SlotKind::Websocket => limits.max_websocket.map(|max| room(totals.websocket, max)),
        };
        let taken = room.map_or(most, |room| room.min(most));
        if taken < least.max(1) {
            return 0;
        }
        let count = self.own(vm, now_ms).held.count_mut(kind);
        *count = count.saturating_add(taken);
        taken
    }
}

/// Slots a VM holds in its shard that no request is using: released
/// slots, kept for the VM's next request of the same kind so that most
/// admissions and every release touch no shared data. They go back to the
/// shared pool at the VM's next heartbeat, and count against the limit
/// until then, so the limit stays exact (in use + spare <= limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spare {
    pub slots: Slots,
    /// Requests released since the last heartbeat (for the drain rate).
    pub completed: u64,
}

impl Spare {
    /// A released slot becomes spare.
    pub fn release(&mut self, kind: SlotKind) {
        let count = self.slots.count_mut(kind);
        *count = count.saturating_add(1);
        self.completed = self.completed.saturating_add(1);
    }

    /// Takes a spare slot of `kind`, if there is one.
    pub fn take(&mut self, kind: SlotKind) -> bool {
        self.take_n(kind, 1)
    }

    /// Takes `n` spare slots of `kind`, if there are that many.
    pub fn take_n(&mut self, kind: SlotKind, n: u32) -> bool {
        let count = self.slots.count_mut(kind);
        let available = *count >= n;
        if available {
            *count -= n;
        }
        available
    }

    pub fn is_empty(&self) -> bool {
        *self == Spare::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_inflight: Some(4),
        reserved: 1,
        cheap: 0,
        max_websocket: Some(1),
        per_websocket: 1,
    };

    #[test]
    fn encoding_round_trips() {
        let mut table = ShardTable::default();
        let a = table.join(10);
        let b = table.join(20);
        assert!(table.try_admit(a, 30, SlotKind::Default, &LIMITS));
        assert!(table.try_admit(b, 40, SlotKind::Priority, &LIMITS));
        let mut spare = Spare::default();
        spare.release(SlotKind::Priority);
        table.heartbeat(b, 50, &spare);
        let bytes = table.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * SHARD_LEN);
        assert_eq!(ShardTable::decode(&bytes).unwrap(), table);
        assert_eq!(table.completions, 1);
    }

    #[test]
    fn an_empty_value_is_an_empty_table() {
        assert_eq!(ShardTable::decode(&[]).unwrap(), ShardTable::default());
    }

    #[test]
    fn foreign_layouts_are_refused_with_a_reason() {
        assert_eq!(
            ShardTable::decode(&[9, 0]).unwrap_err().to_string(),
            "shared gate state has layout version 9, this module reads 1"
        );
        let mut bytes = ShardTable::default().encode();
        bytes[13] = 3; // claims three shards
        assert_eq!(
            ShardTable::decode(&bytes).unwrap_err(),
            LayoutError::Truncated {
                expected: HEADER_LEN + 3 * SHARD_LEN,
                got: HEADER_LEN
            }
        );
    }

    #[test]
    fn default_traffic_cannot_take_reserved_slots() {
        let mut table = ShardTable::default();
        let vm = table.join(0);
        let admitted = (0..10)
            .filter(|_| table.try_admit(vm, 0, SlotKind::Default, &LIMITS))
            .count();
        assert_eq!(admitted, 3, "4 slots, 1 reserved");
        assert!(
            table.try_admit(vm, 0, SlotKind::Priority, &LIMITS),
            "priority takes the reserve"
        );
        assert!(
            !table.try_admit(vm, 0, SlotKind::Priority, &LIMITS),
            "and no more"
        );
        assert_eq!(table.totals().inflight(), 4);
    }

    #[test]
    fn a_scaled_limit_grows_up_to_the_nodes_slots() {
        let limits = Limits {
            max_inflight: Some(6),
            reserved: 1,
            cheap: 1,
            max_websocket: None,
            per_websocket: 1,
        };
        assert_eq!(limits.scaled(1.7, Some(16)).max_inflight, Some(10));
        assert_eq!(
            limits.scaled(1.7, Some(8)).max_inflight,
            Some(8),
            "the node's slots"
        );
        assert_eq!(
            limits.scaled(1.7, None).max_inflight,
            Some(6),
            "no nodeSlots"
        );
        assert_eq!(limits.scaled(0.5, Some(16)).max_inflight, Some(6));
        assert_eq!(limits.scaled(1.7, Some(16)).reserved, 1);
        let open = Limits {
            max_inflight: None,
            ..limits
        };
        assert_eq!(open.scaled(3.0, Some(16)).max_inflight, None);
    }

    #[test]
    fn the_limit_spans_every_shard() {
        let mut table = ShardTable::default();
        let a = table.join(0);
        let b = table.join(0);
        assert!(table.try_admit(a, 0, SlotKind::Default, &LIMITS));
        assert!(table.try_admit(b, 0, SlotKind::Default, &LIMITS));
        assert!(table.try_admit(a, 0, SlotKind::Default, &LIMITS));
        assert!(!table.try_admit(b, 0, SlotKind::Default, &LIMITS));
        let mut spare = Spare::default();
        spare.release(SlotKind::Default);
        table.heartbeat(a, 0, &spare);
        assert!(table.try_admit(b, 0, SlotKind::Default, &LIMITS));
    }

    #[test]
    fn websockets_have_their_own_limit() {
        let mut table = ShardTable::default();
        let vm = table.join(0);
        assert!(table.try_admit(vm, 0, SlotKind::Websocket, &LIMITS));
        assert!(!table.try_admit(vm, 0, SlotKind::Websocket, &LIMITS));
        assert!(
            table.try_admit(vm, 0, SlotKind::Default, &LIMITS),
            "they do not use in-flight slots"
        );
    }

    #[test]
    fn pass_through_counts_but_never_limits() {
        let open = Limits {
            max_inflight: None,
            reserved: 0,
            cheap: 0,
            max_websocket: None,
            per_websocket: 1,
        };
        let mut table = ShardTable::default();
        let vm = table.join(0);
        for _ in 0..1000 {
            assert!(table.try_admit(vm, 0, SlotKind::Default, &open));
        }
        assert_eq!(table.totals().default, 1000);
    }

    #[test]
    fn stale_shards_expire_and_return_their_slots() {
        let mut table = ShardTable::default();
        let gone = table.join(1_000);
        let alive = table.join(1_000);
        assert!(table.try_admit(gone, 1_000, SlotKind::Default, &LIMITS));
        assert!(table.try_admit(gone, 1_000, SlotKind::Websocket, &LIMITS));
        table.heartbeat(alive, 5_000, &Spare::default());
        assert_eq!(
            table.expire(11_000, 10_000),
            0,
            "exactly at the TTL is not stale"
        );
        assert_eq!(table.expire(11_001, 10_000), 2);
        assert_eq!(table.shards.len(), 1);
        assert_eq!(table.shards[0].vm, alive);
        assert_eq!(table.totals(), Totals::default());
    }

    #[test]
    fn a_vm_that_was_expired_gets_a_fresh_shard() {
        let mut table = ShardTable::default();
        let vm = table.join(0);
        table.expire(100_000, 10_000);
        assert!(table.try_admit(vm, 100_000, SlotKind::Default, &LIMITS));
        assert_eq!(
            table.shards,
            vec![Shard {
                vm,
                heartbeat_ms: 100_000,
                held: Slots {
                    default: 1,
                    ..Slots::default()
                },
            }]
        );
    }

    #[test]
    fn spare_slots_go_back_at_a_heartbeat() {
        let mut table = ShardTable::default();
        let vm = table.join(0);
        assert!(table.try_admit(vm, 0, SlotKind::Default, &LIMITS));
        assert!(table.try_admit(vm, 0, SlotKind::Priority, &LIMITS));
        let mut spare = Spare::default();
        spare.release(SlotKind::Default);
        spare.release(SlotKind::Priority);
        assert!(
            !spare.take(SlotKind::Websocket),
            "only released kinds are spare"
        );
        table.heartbeat(vm, 10, &spare);
        assert_eq!(table.totals(), Totals::default());
        assert_eq!(table.completions, 2);
        assert_eq!(table.shards[0].heartbeat_ms, 10);
    }
}
