//! The outstanding-request table in shared data: `pages` shared-data keys,
//! each holding up to `ENTRIES_PER_PAGE` entries. A key lives in page
//! `key % pages`, so memory is bounded by `maxEntries` (proxy-wasm cannot
//! delete a shared-data key, so one key per request would grow forever).
//! A page with no room lets the request pass (`table_full`).
//!
//! Layout (little-endian): version `u8`, entry count `u16`, then
//! `ENTRY_LEN`-byte entries: key (16 bytes), `start_ms` u64, `end_ms` u64
//! (0 while in flight), `owner` u32 (the gate VM's shard id).

use crate::dedup::key::{Key, KEY_LEN};
use crate::shared::{PageLayout, Reader, Record};

pub const LAYOUT_VERSION: u8 = 1;
pub const ENTRIES_PER_PAGE: usize = 64;
pub const ENTRY_LEN: usize = KEY_LEN + 8 + 8 + 4;
const HEADER_LEN: usize = PageLayout::HEADER_LEN;
const LAYOUT: PageLayout = PageLayout {
    what: "dedup",
    version: LAYOUT_VERSION,
    entry_len: ENTRY_LEN,
    max_entries: ENTRIES_PER_PAGE,
};

/// One request sent upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    pub start_ms: u64,
    /// When it completed; 0 while in flight.
    pub end_ms: u64,
    /// The gate VM that sent it, which alone completes it.
    pub owner: u32,
}

impl Entry {
    pub fn in_flight(&self) -> bool {
        self.end_ms == 0
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
                    end_ms: r.u64(),
                    owner: r.u32(),
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
            out.extend_from_slice(&e.end_ms.to_le_bytes());
            out.extend_from_slice(&e.owner.to_le_bytes());
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
                    end_ms: 0,
                    owner: 3,
                },
                Entry {
                    key: [9; KEY_LEN],
                    start_ms: 5,
                    end_ms: 6,
                    owner: u32::MAX,
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
        assert!(Page::decode(&[2]).unwrap_err().contains("version 2"));
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
