//! Retries that come back before their time.
//!
//! A 429 says when to come back: `retry-after`, in seconds (RFC 9110).
//! Not every client reads it so: ethers takes the number as milliseconds
//! and retries a 429 up to twelve times within a few tens of
//! milliseconds, then tells its caller only that the retries ran out. So
//! when QoS refuses a request whose body it read (`decideOnBody`), it
//! remembers the refusal (the identity and the body, hashed) until the
//! time it gave; the first request that is the same, byte for byte, from
//! the same identity before then is **held** at the gateway until that
//! time, and then decided as if its client had waited. A client that
//! waits as the header means is never held; a refused request that comes
//! back with a new `id` is a new request.
//!
//! The refusals are kept in shared data, so that a retry on another
//! worker's connection finds them: `SHARDS` pages of at most `PER_SHARD`
//! entries (hash, until when), each entry dropped once its time has
//! passed or a retry took it. A page that is full drops the entry due
//! soonest: an early retry comes within milliseconds, so under a flood of
//! refusals an entry still lives long enough to be found. A second copy of
//! a held request is refused as usual, and a worker holds at most
//! `HELD_PER_WORKER` requests; past that, refused as usual.

use crate::shared::{read, update, Change, PageLayout, Reader, Record, SharedStore, StoreError};
use std::hash::{Hash, Hasher};

/// Pages of remembered refusals.
const SHARDS: u64 = 16;
/// Refusals a page holds.
const PER_SHARD: usize = 32;
/// Early retries one worker holds at once.
pub const HELD_PER_WORKER: u32 = 64;

const KEY_PREFIX: &str = "stakegate.stake_qos.v1.early.";

const LAYOUT: PageLayout = PageLayout {
    what: "QoS early retries",
    version: 1,
    entry_len: 16,
    max_entries: PER_SHARD,
};

/// What identifies a request sent again: its identity and its body.
pub fn sent(identity: u64, body: &[u8]) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    identity.hash(&mut hasher);
    body.hash(&mut hasher);
    hasher.finish()
}

fn key_of(sent: u64) -> String {
    format!("{KEY_PREFIX}{}", sent % SHARDS)
}

/// One page: refused requests (`sent`) and when each may come back (ms).
#[derive(Debug, Default)]
struct Refusals(Vec<(u64, u64)>);

impl Record for Refusals {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let entries = LAYOUT.entries(bytes)?;
        Ok(Self(
            entries
                .map(|entry| {
                    let mut r = Reader(entry);
                    (r.u64(), r.u64())
                })
                .collect(),
        ))
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = LAYOUT.header(self.0.len()).to_vec();
        for (sent, until_ms) in &self.0 {
            out.extend_from_slice(&sent.to_le_bytes());
            out.extend_from_slice(&until_ms.to_le_bytes());
        }
        out
    }
}

/// Remembers that request `sent` was refused until `until_ms`. The CAS
/// retries it took.
pub fn refused(
    store: &impl SharedStore,
    sent: u64,
    until_ms: u64,
    now_ms: u64,
) -> Result<u32, StoreError> {
    let updated = update(store, &key_of(sent), |page: &mut Refusals| {
        page.0.retain(|&(s, until)| until > now_ms && s != sent);
        if page.0.len() >= PER_SHARD {
            let soonest = (0..page.0.len()).min_by_key(|&i| page.0[i].1);
            page.0.swap_remove(soonest.unwrap_or(0));
        }
        page.0.push((sent, until_ms));
        Change::Write(())
    });
    updated.map(|u| u.retries).map_err(|(e, _)| e)
}

/// If request `sent` comes back before the time its refusal gave, takes
/// that refusal (a second copy is not held) and says until when to hold
/// it. One read when nothing is remembered for it.
pub fn early(store: &impl SharedStore, sent: u64, now_ms: u64) -> Result<Option<u64>, StoreError> {
    let key = key_of(sent);
    let (page, _) = read::<Refusals>(store, &key)?;
    if !page.0.iter().any(|&(s, until)| s == sent && until > now_ms) {
        return Ok(None);
    }
    let updated = update(store, &key, |page: &mut Refusals| {
        let found = page.0.iter().position(|&(s, _)| s == sent);
        match found.map(|i| page.0.swap_remove(i).1) {
            Some(until) => Change::Write((until > now_ms).then_some(until)),
            None => Change::Keep(None),
        }
    });
    updated.map(|u| u.value).map_err(|(e, _)| e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    #[test]
    fn a_request_sent_again_before_its_time_is_found_once() {
        let store = MemoryStore::default();
        let a = sent(7, br#"{"id":1,"method":"eth_blockNumber"}"#);
        refused(&store, a, 2_000, 1_000).unwrap();
        // Another identity's, or another id's, is a new request.
        assert_eq!(
            early(
                &store,
                sent(8, br#"{"id":1,"method":"eth_blockNumber"}"#),
                1_001
            ),
            Ok(None)
        );
        assert_eq!(
            early(
                &store,
                sent(7, br#"{"id":2,"method":"eth_blockNumber"}"#),
                1_001
            ),
            Ok(None)
        );
        assert_eq!(early(&store, a, 1_001), Ok(Some(2_000)));
        // Taken: a second copy is refused as usual.
        assert_eq!(early(&store, a, 1_002), Ok(None));
        // Back after its time: nothing to hold.
        refused(&store, a, 2_000, 1_000).unwrap();
        assert_eq!(early(&store, a, 2_000), Ok(None));
    }

    #[test]
    fn a_full_page_drops_the_refusal_due_soonest() {
        let store = MemoryStore::default();
        // Requests that share one page.
        let on_page: Vec<u64> = (0u64..)
            .map(|i| sent(i, b"{}"))
            .filter(|s| s % SHARDS == 0)
            .take(PER_SHARD + 1)
            .collect();
        for (i, s) in on_page.iter().enumerate() {
            refused(&store, *s, 10_000 - i as u64, 0).unwrap();
        }
        let (page, _) = read::<Refusals>(&store, &key_of(on_page[0])).unwrap();
        assert_eq!(page.0.len(), PER_SHARD);
        // The last one in (due soonest) replaced the one due soonest before it.
        assert_eq!(early(&store, on_page[PER_SHARD - 1], 1), Ok(None));
        assert_eq!(
            early(&store, on_page[PER_SHARD], 1),
            Ok(Some(10_000 - PER_SHARD as u64))
        );
        assert_eq!(early(&store, on_page[0], 1), Ok(Some(10_000)));
    }
}
