//! The identity table in shared data: a fixed number of pages, each a
//! shared-data key holding up to `ENTRIES_PER_PAGE` entries. An identity
//! lives in page `key % pages`, so the number of keys, and the memory, is
//! bounded by `maxIdentities` however many clients come and go (proxy-wasm
//! cannot delete a shared-data key, so one key per identity would grow
//! forever).
//!
//! Every change to a page is a CAS update (`crate::shared`). A page is kept
//! as its bytes and changed in place: the refill round visits every active
//! page 50 times a second, and decoding 128 entries into structs and back is
//! most of what a visit would otherwise cost. Each visit is two host calls
//! (read, write): 128 entries a page rather than 64 made a round at 20,000
//! identities about a third cheaper in Envoy.
//!
//! A full page makes room by evicting, in this order: an idle identity, an
//! unstaked one, the least recently seen. The cap is therefore enforced per
//! page: a page can fill up before the whole table does.
//!
//! # Layout (version 4, keys `stakegate.stake_qos.v4.page.<n>`)
//!
//! Version `u8`, entry count `u16`, then 52-byte entries, little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | `key`: the identity (never 0) |
//! | 8 | `stake` |
//! | 8 | `tokens`: the shared bucket, in milli-tokens (may be negative: a batch's debt) |
//! | 8 | `grant`: milli-tokens the last round added per round |
//! | 4 | `demand`: predicted calls per round (`f32`) |
//! | 1 | `tier` |
//! | 1 | flags: 1 staked, 2 idle |
//! | 2 | `quiet`: rounds since its last calls |
//! | 8 | `last_seen_ms` |
//! | 4 | `cost`: what one of its calls costs in the policy's unit, smoothed (`f32`; 0 until its first round) |
//!
//! `tokens`, `grant` and the bucket are in thousandths of the policy's unit
//! (`qos::cost`): of a call, of a node millisecond (a µs) or of a cost unit.
//!
//! Earlier versions are never read by this module: version 1 (`…v1.page.<n>`,
//! 72-byte entries, per-request counts), version 2 (`…v2.page.<n>`, the
//! same entries 64 to a page, so identities map to other pages) and version
//! 3 (`…v3.page.<n>`, without `cost`). During a swap from such a module the
//! two keep separate tables, and the new table fills within a round.

use crate::shared::{PageLayout, Record};

const PAGE_KEY_PREFIX: &str = "stakegate.stake_qos.v4.page.";

/// The shared-data key of page `page` of the identity table.
pub fn page_key(page: u32) -> String {
    format!("{PAGE_KEY_PREFIX}{page}")
}

pub const LAYOUT_VERSION: u8 = 4;
pub const ENTRIES_PER_PAGE: usize = 128;
pub const ENTRY_LEN: usize = 52;
const HEADER_LEN: usize = PageLayout::HEADER_LEN;
const LAYOUT: PageLayout = PageLayout {
    what: "QoS",
    version: LAYOUT_VERSION,
    entry_len: ENTRY_LEN,
    max_entries: ENTRIES_PER_PAGE,
};

/// Tokens are kept in thousandths, so shares of a few tokens per round
/// split by stake without rounding away anyone's fraction.
pub const MILLI: i64 = 1000;

pub const STAKED: u8 = 1;
pub const IDLE: u8 = 2;
/// The last round gave the identity all its predicted demand (it is under
/// its part of the water level).
pub const SATISFIED: u8 = 4;

const KEY: usize = 0;
const STAKE: usize = 8;
const TOKENS: usize = 16;
const GRANT: usize = 24;
const DEMAND: usize = 32;
const TIER: usize = 36;
const FLAGS: usize = 37;
const QUIET: usize = 38;
const LAST_SEEN: usize = 40;
const COST: usize = 48;

/// One identity, as inserted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entry {
    pub key: u64,
    pub stake: u64,
    pub tokens: i64,
    pub grant: u64,
    pub demand: f32,
    pub tier: u8,
    pub flags: u8,
    pub quiet: u16,
    pub last_seen_ms: u64,
    pub cost: f32,
}

/// A page as its bytes (header included), read and changed in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    bytes: Vec<u8>,
}

impl Default for Page {
    fn default() -> Self {
        Self {
            bytes: LAYOUT.header(0).to_vec(),
        }
    }
}

macro_rules! field {
    ($get:ident, $set:ident, $ty:ty, $at:expr) => {
        pub fn $get(&self, i: usize) -> $ty {
            let at = HEADER_LEN + i * ENTRY_LEN + $at;
            const N: usize = std::mem::size_of::<$ty>();
            let mut b = [0; N];
            b.copy_from_slice(&self.bytes[at..at + N]);
            <$ty>::from_le_bytes(b)
        }
        pub fn $set(&mut self, i: usize, value: $ty) {
            let at = HEADER_LEN + i * ENTRY_LEN + $at;
            let b = value.to_le_bytes();
            self.bytes[at..at + b.len()].copy_from_slice(&b);
        }
    };
}

impl Page {
    pub fn len(&self) -> usize {
        (self.bytes.len() - HEADER_LEN) / ENTRY_LEN
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    field!(key, set_key, u64, KEY);
    field!(stake, set_stake, u64, STAKE);
    field!(tokens, set_tokens, i64, TOKENS);
    field!(grant, set_grant, u64, GRANT);
    field!(demand, set_demand, f32, DEMAND);
    field!(quiet, set_quiet, u16, QUIET);
    field!(last_seen_ms, set_last_seen_ms, u64, LAST_SEEN);
    field!(cost, set_cost, f32, COST);

    pub fn tier(&self, i: usize) -> u8 {
        self.bytes[HEADER_LEN + i * ENTRY_LEN + TIER]
    }

    pub fn set_tier(&mut self, i: usize, tier: u8) {
        self.bytes[HEADER_LEN + i * ENTRY_LEN + TIER] = tier;
    }

    pub fn flags(&self, i: usize) -> u8 {
        self.bytes[HEADER_LEN + i * ENTRY_LEN + FLAGS]
    }

    pub fn set_flags(&mut self, i: usize, flags: u8) {
        self.bytes[HEADER_LEN + i * ENTRY_LEN + FLAGS] = flags;
    }

    pub fn find(&self, key: u64) -> Option<usize> {
        (0..self.len()).find(|&i| self.key(i) == key)
    }

    /// Entry `i` as a struct (tests, debugging).
    pub fn get(&self, i: usize) -> Entry {
        Entry {
            key: self.key(i),
            stake: self.stake(i),
            tokens: self.tokens(i),
            grant: self.grant(i),
            demand: self.demand(i),
            tier: self.tier(i),
            flags: self.flags(i),
            quiet: self.quiet(i),
            last_seen_ms: self.last_seen_ms(i),
            cost: self.cost(i),
        }
    }

    fn write(&mut self, i: usize, e: &Entry) {
        self.set_key(i, e.key);
        self.set_stake(i, e.stake);
        self.set_tokens(i, e.tokens);
        self.set_grant(i, e.grant);
        self.set_demand(i, e.demand);
        self.set_tier(i, e.tier);
        self.set_flags(i, e.flags);
        self.set_quiet(i, e.quiet);
        self.set_last_seen_ms(i, e.last_seen_ms);
        self.set_cost(i, e.cost);
    }

    /// The entry for `fresh.key`, inserting `fresh` if it is absent
    /// (evicting if the page is full). Returns its index and whether an
    /// identity was evicted.
    pub fn entry(&mut self, fresh: &Entry) -> (usize, bool) {
        match self.find(fresh.key) {
            Some(i) => (i, false),
            None => self.insert(fresh),
        }
    }

    /// Inserts `fresh`, whose key the page does not hold (evicting if the
    /// page is full). Returns its index and whether an identity was
    /// evicted.
    pub fn insert(&mut self, fresh: &Entry) -> (usize, bool) {
        let n = self.len();
        if n < ENTRIES_PER_PAGE {
            self.bytes.resize(self.bytes.len() + ENTRY_LEN, 0);
            self.bytes[..HEADER_LEN].copy_from_slice(&LAYOUT.header(n + 1));
            self.write(n, fresh);
            return (n, false);
        }
        // Idle first, then unstaked, then the least recently seen.
        let victim = (0..n)
            .min_by_key(|&i| {
                let flags = self.flags(i);
                (flags & IDLE == 0, flags & STAKED != 0, self.last_seen_ms(i))
            })
            .unwrap_or(0);
        self.write(victim, fresh);
        (victim, true)
    }

    /// Removes the entries `keep` refuses (order is not kept); returns how
    /// many went.
    pub fn retain(&mut self, mut keep: impl FnMut(&Page, usize) -> bool) -> usize {
        let mut n = self.len();
        let mut i = 0;
        let before = n;
        while i < n {
            if keep(self, i) {
                i += 1;
                continue;
            }
            n -= 1;
            if i != n {
                let (head, tail) = self.bytes.split_at_mut(HEADER_LEN + n * ENTRY_LEN);
                head[HEADER_LEN + i * ENTRY_LEN..HEADER_LEN + (i + 1) * ENTRY_LEN]
                    .copy_from_slice(&tail[..ENTRY_LEN]);
            }
        }
        self.bytes.truncate(HEADER_LEN + n * ENTRY_LEN);
        self.bytes[..HEADER_LEN].copy_from_slice(&LAYOUT.header(n));
        before - n
    }
}

impl Record for Page {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        Self::decode_owned(bytes.to_vec())
    }

    fn encode(&self) -> Vec<u8> {
        self.bytes.clone()
    }

    fn decode_owned(bytes: Vec<u8>) -> Result<Self, String> {
        LAYOUT.entries(&bytes).map(drop)?;
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        Ok(Self { bytes })
    }

    fn encoded(&self) -> std::borrow::Cow<'_, [u8]> {
        (&self.bytes[..]).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: u64, last_seen_ms: u64, flags: u8) -> Entry {
        Entry {
            key,
            stake: 1000,
            last_seen_ms,
            flags,
            ..Entry::default()
        }
    }

    #[test]
    fn pages_round_trip_and_reject_bad_bytes() {
        let mut page = Page::default();
        let full = Entry {
            key: 7,
            stake: u64::MAX,
            tokens: -3,
            grant: 12_345,
            demand: 2.5,
            tier: 3,
            flags: STAKED | IDLE,
            quiet: 7,
            last_seen_ms: 99,
            cost: 0.25,
        };
        page.entry(&full);
        page.entry(&entry(8, 1, 0));
        let bytes = page.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * ENTRY_LEN);
        let back = Page::decode(&bytes).unwrap();
        assert_eq!(back.get(0), full);
        assert_eq!(back.get(1), entry(8, 1, 0));
        assert_eq!(Page::decode(&[]).unwrap(), Page::default());
        assert!(Page::decode(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .contains("expected"));
        assert!(Page::decode(&[1, 0, 0]).unwrap_err().contains("version 1"));
    }

    #[test]
    fn a_full_page_evicts_idle_then_unstaked_then_oldest() {
        let mut page = Page::default();
        for key in 1..=ENTRIES_PER_PAGE as u64 {
            let flags = if key % 2 == 0 { STAKED } else { 0 };
            page.entry(&entry(key, 1000 + key, flags));
        }
        assert_eq!(page.len(), ENTRIES_PER_PAGE);
        // No one idle: the oldest unstaked (key 1) goes.
        let (_, evicted) = page.entry(&entry(1000, 2000, 0));
        assert!(evicted);
        assert!(page.find(1).is_none());
        // An idle one goes before any other, even staked and recent.
        let i = page.find(64).unwrap();
        page.set_flags(i, STAKED | IDLE);
        page.entry(&entry(1001, 2000, STAKED));
        assert!(page.find(64).is_none());
        assert!(page.find(3).is_some());
        assert_eq!(page.len(), ENTRIES_PER_PAGE);
    }

    #[test]
    fn retain_removes_in_place() {
        let mut page = Page::default();
        for key in 1..=10 {
            page.entry(&entry(key, key, 0));
        }
        assert_eq!(page.retain(|p, i| p.key(i) % 3 != 0), 3);
        let mut keys: Vec<u64> = (0..page.len()).map(|i| page.key(i)).collect();
        keys.sort_unstable();
        assert_eq!(keys, vec![1, 2, 4, 5, 7, 8, 10]);
        assert_eq!(Page::decode(&page.encode()).unwrap(), page);
    }
}
