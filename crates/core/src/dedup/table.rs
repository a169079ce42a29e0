//! The outstanding-request table in shared data: `pages` shared-data keys,
//! each holding up to `ENTRIES_PER_PAGE` entries. A key lives in page
//! `key % pages`, so memory is bounded by `maxEntries` (proxy-wasm cannot
//! delete a shared-data key, so one key per request would grow forever).
//! A page with no room lets the request pass (`table_full`).
//!
//! Layout (little-endian): version `u8`, entry count `u16`, then
//! `ENTRY_LEN`-byte entries: key (16 bytes), `start_ms` u64, `until_ms`
//! u64, `owner` u32 (the leading gate VM's shard id), `waiters` u32,
//! `state` u8, `slot` u8, `abandoned` u8.

use crate::dedup::key::{Key, KEY_LEN};
use crate::shared::{PageLayout, Reader, Record};

pub const LAYOUT_VERSION: u8 = 2;
pub const ENTRIES_PER_PAGE: usize = 64;
pub const ENTRY_LEN: usize = KEY_LEN + 8 + 8 + 4 + 4 + 1 + 1 + 1;
/// Answer slots per page: how many answers kept for a retry a page holds.
pub const ANSWER_SLOTS: u8 = 4;
const HEADER_LEN: usize = PageLayout::HEADER_LEN;
const LAYOUT: PageLayout = PageLayout {
    what: "dedup",
    version: LAYOUT_VERSION,
    entry_len: ENTRY_LEN,
    max_entries: ENTRIES_PER_PAGE,
};

/// Where a request stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum State {
    /// Its leader's call is at the node.
    #[default]
    InFlight = 0,
    /// Its leader's call failed and waiters are left: the first of them
    /// to come back for it leads.
    Orphaned = 1,
    /// Answered after a client gave up on it: the answer is in slot
    /// `slot` until `until_ms`, for the first identical request (the retry).
    Unclaimed = 2,
    /// Answered with what cannot change (a found receipt, a block by
    /// hash): the answer in slot `slot` serves every identical request
    /// until `until_ms`.
    Reusable = 3,
}

/// One request sent upstream, and who waits for its answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    /// When its leader sent it.
    pub start_ms: u64,
    /// An unclaimed answer serves until then.
    pub until_ms: u64,
    /// The gate VM that leads (0 once orphaned).
    pub owner: u32,
    /// Requests waiting for the answer, on every VM, the leader's own
    /// client among them.
    pub waiters: u32,
    pub state: State,
    pub slot: u8,
    /// A client gave up waiting for it: its retry may come after the answer.
    pub abandoned: bool,
}

impl Entry {
    pub fn in_flight(&self) -> bool {
        self.state == State::InFlight
    }

    /// It holds an answer in its slot.
    pub fn answered(&self) -> bool {
        matches!(self.state, State::Unclaimed | State::Reusable)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    pub entries: Vec<Entry>,
}

/// The page `key` lives in.
pub fn page_of(key: &Key, pages: u32) -> u32 {
    let mut low = [0; 8];
    low.copy_from_slice(&key[..8]);
    (u64::from_le_bytes(low) % u64::from(pages.max(1))) as u32
}

impl Record for Page {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let entries = LAYOUT
            .entries(bytes)?
            .map(|chunk| {
                let mut key = [0; KEY_LEN];
                key.copy_from_slice(&chunk[..KEY_LEN]);
                let mut r = Reader(&chunk[KEY_LEN..]);
                Entry {
                    key,
                    start_ms: r.u64(),
                    until_ms: r.u64(),
                    owner: r.u32(),
                    waiters: r.u32(),
                    state: match r.u8() {
                        1 => State::Orphaned,
                        2 => State::Unclaimed,
                        3 => State::Reusable,
                        _ => State::InFlight,
                    },
                    slot: r.u8(),
                    abandoned: r.u8() != 0,
                }
            })
            .collect();
        Ok(Self { entries })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.entries.len() * ENTRY_LEN);
        out.extend_from_slice(&LAYOUT.header(self.entries.len()));
        for e in &self.entries {
            out.extend_from_slice(&e.key);
            out.extend_from_slice(&e.start_ms.to_le_bytes());
            out.extend_from_slice(&e.until_ms.to_le_bytes());
            out.extend_from_slice(&e.owner.to_le_bytes());
            out.extend_from_slice(&e.waiters.to_le_bytes());
            out.push(e.state as u8);
            out.push(e.slot);
            out.push(u8::from(e.abandoned));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_reject_bad_bytes() {
        let page = Page {
            entries: vec![
                Entry {
                    key: [7; KEY_LEN],
                    start_ms: 1_700_000_000_000,
                    owner: 3,
                    waiters: 9,
                    ..Entry::default()
                },
                Entry {
                    key: [9; KEY_LEN],
                    start_ms: 5,
                    until_ms: 6,
                    owner: u32::MAX,
                    waiters: 0,
                    state: State::Unclaimed,
                    slot: 1,
                    abandoned: true,
                },
            ],
        };
        let bytes = page.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * ENTRY_LEN);
        assert_eq!(Page::decode(&bytes).unwrap(), page);
        assert_eq!(Page::decode(&[]).unwrap(), Page::default());
        assert!(Page::decode(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .contains("expected"));
        assert!(Page::decode(&[3]).unwrap_err().contains("version 3"));
    }

    #[test]
    fn keys_spread_over_pages() {
        let mut counts = [0u32; 8];
        for i in 0..8000u32 {
            let mut key = [0; KEY_LEN];
            key[..4].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
            counts[page_of(&key, 8) as usize] += 1;
        }
        assert!(counts.iter().all(|&n| n > 800), "{counts:?}");
    }
}
