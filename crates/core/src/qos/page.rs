//! The identity table in shared data: a fixed number of pages, each a
//! shared-data key holding up to `ENTRIES_PER_PAGE` entries. An identity
//! lives in page `key % pages`, so the number of keys, and the memory, is
//! bounded by `maxIdentities` however many clients come and go (proxy-wasm
//! cannot delete a shared-data key, so one key per identity would grow
//! forever).
//!
//! Every change to a page is a CAS update (`crate::shared`). A full page
//! makes room by evicting, in this order: an identity idle past the TTL, an
//! unstaked one, the least recently seen. The cap is therefore enforced per
//! page: a page can fill up before the whole table does.
//!
//! Layout (little-endian): version `u8`, entry count `u16`, then
//! `ENTRY_LEN`-byte entries.

use crate::shared::{PageLayout, Reader, Record};

pub const LAYOUT_VERSION: u8 = 1;
pub const ENTRIES_PER_PAGE: usize = 64;
pub const ENTRY_LEN: usize = 72;
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

/// One identity's bucket and the counts the refiller reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: u64,
    pub stake: u64,
    /// Milli-tokens in the bucket.
    pub tokens: i64,
    /// Milli-tokens the last round allocated.
    pub allocated: u64,
    pub last_seen_ms: u64,
    /// Requests admitted or refused since the last round: the load, and
    /// the demand `eff` is predicted from.
    pub arrivals: u32,
    pub inflight: u32,
    /// EWMA of request latency, start to response end, in µs.
    pub latency_us: u32,
    /// Requests finished since the last round, their summed latency in ms,
    /// and how many the upstream answered 503 or 429 (back-pressure).
    pub completions: u32,
    pub latency_sum_ms: u32,
    pub overloads: u32,
    pub tier: u8,
    pub staked: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    pub entries: Vec<Entry>,
}

impl Page {
    pub fn find_mut(&mut self, key: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.key == key)
    }

    /// The entry for `fresh.key`, inserting `fresh` if absent (evicting if
    /// the page is full). Returns the entry and whether one was evicted.
    pub fn entry(&mut self, fresh: Entry, now_ms: u64, idle_ttl_ms: u64) -> (&mut Entry, bool) {
        if let Some(i) = self.entries.iter().position(|e| e.key == fresh.key) {
            return (&mut self.entries[i], false);
        }
        if self.entries.len() < ENTRIES_PER_PAGE {
            self.entries.push(fresh);
            let last = self.entries.len() - 1;
            return (&mut self.entries[last], false);
        }
        let victim = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| {
                let idle = now_ms.saturating_sub(e.last_seen_ms) > idle_ttl_ms;
                // Idle first, then unstaked, then the least recently seen.
                (!idle, e.staked, e.last_seen_ms)
            })
            .map_or(0, |(i, _)| i);
        self.entries[victim] = fresh;
        (&mut self.entries[victim], true)
    }
}

impl Record for Page {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let entries = LAYOUT
            .entries(bytes)?
            .map(|chunk| {
                let mut r = Reader(chunk);
                Entry {
                    key: r.u64(),
                    stake: r.u64(),
                    tokens: r.u64() as i64,
                    allocated: r.u64(),
                    last_seen_ms: r.u64(),
                    arrivals: {
                        let _demand = r.u32();
                        r.u32()
                    },
                    inflight: r.u32(),
                    latency_us: r.u32(),
                    completions: r.u32(),
                    latency_sum_ms: r.u32(),
                    overloads: r.u32(),
                    tier: r.u8(),
                    staked: r.u8() != 0,
                }
            })
            .collect();
        Ok(Self { entries })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = vec![0; HEADER_LEN + self.entries.len() * ENTRY_LEN];
        out[..HEADER_LEN].copy_from_slice(&LAYOUT.header(self.entries.len()));
        for (e, chunk) in self
            .entries
            .iter()
            .zip(out[HEADER_LEN..].chunks_exact_mut(ENTRY_LEN))
        {
            let (wide, rest) = chunk.split_at_mut(40);
            let (narrow, flags) = rest.split_at_mut(28);
            for (v, field) in [e.key, e.stake, e.tokens as u64, e.allocated, e.last_seen_ms]
                .into_iter()
                .zip(wide.chunks_exact_mut(8))
            {
                field.copy_from_slice(&v.to_le_bytes());
            }
            // The first slot is the demand that older modules of this layout
            // read (their admitted count). It holds arrivals, so that such a
            // module serving beside this one during a swap predicts alike.
            for (v, field) in [
                e.arrivals,
                e.arrivals,
                e.inflight,
                e.latency_us,
                e.completions,
                e.latency_sum_ms,
                e.overloads,
            ]
            .into_iter()
            .zip(narrow.chunks_exact_mut(4))
            {
                field.copy_from_slice(&v.to_le_bytes());
            }
            flags[0] = e.tier;
            flags[1] = u8::from(e.staked);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: u64, last_seen_ms: u64, staked: bool) -> Entry {
        Entry {
            key,
            stake: 1000,
            last_seen_ms,
            staked,
            ..Entry::default()
        }
    }

    #[test]
    fn pages_round_trip_and_reject_bad_bytes() {
        let page = Page {
            entries: vec![
                Entry {
                    key: 7,
                    tokens: -3,
                    overloads: 2,
                    tier: 3,
                    staked: true,
                    ..entry(7, 99, true)
                },
                entry(8, 1, false),
            ],
        };
        let bytes = page.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * ENTRY_LEN);
        assert_eq!(Page::decode(&bytes).unwrap(), page);
        assert_eq!(Page::decode(&[]).unwrap(), Page::default());
        assert!(Page::decode(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .contains("expected"));
        assert!(Page::decode(&[9]).unwrap_err().contains("version 9"));
    }

    #[test]
    fn a_full_page_evicts_idle_then_unstaked_then_oldest() {
        let mut page = Page::default();
        for key in 1..=ENTRIES_PER_PAGE as u64 {
            page.entry(entry(key, 1000 + key, key % 2 == 0), 1000, 60_000);
        }
        assert_eq!(page.entries.len(), ENTRIES_PER_PAGE);
        // No one idle: the oldest unstaked (key 1) goes.
        let (_, evicted) = page.entry(entry(100, 2000, false), 2000, 60_000);
        assert!(evicted);
        assert!(page.find_mut(1).is_none());
        // A staked newcomer also evicts an unstaked one.
        page.entry(entry(101, 2000, true), 2000, 60_000);
        assert!(page.find_mut(3).is_none());
        assert!(page.find_mut(2).is_some());
        // Later only key 100 is active: an idle one goes even if staked.
        for e in &mut page.entries {
            e.staked = e.key != 100;
        }
        page.find_mut(100).unwrap().last_seen_ms = 100_000;
        page.entry(entry(102, 100_000, false), 100_000, 60_000);
        assert!(page.find_mut(2).is_none());
        assert!(page.find_mut(100).is_some());
        assert_eq!(page.entries.len(), ENTRIES_PER_PAGE);
    }
}
