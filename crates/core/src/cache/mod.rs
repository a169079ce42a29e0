//! The answer cache: the node answers each question that cannot change
//! once, and the gate gives that answer to every identical request after,
//! with the request's own id, without the node.
//!
//! **Never stale.** Only answers that cannot change are kept (`rules`): to
//! a request that names a final block by number, a read by hash whose
//! answer lies in a final block, a Solana block or transaction at the
//! `finalized` commitment, the chain's id. Whether a block is final is the
//! node's word, as coalescing follows it (`dedup::finality`): an answer
//! about a block above the finalized one is never kept, so no reorg can
//! make a kept answer wrong. Errors, `null`s and answers with no result
//! are never kept (the next request may find what this one did not).
//!
//! **Per worker.** Each gate VM keeps its own cache in its own memory: a
//! hit is a map lookup and a reply, with no host call and no lock, and
//! eviction is exact. A cache in Envoy's shared data would copy each answer
//! out on every hit and could never free a key (shared data has no
//! delete). So `maxBytes` and `maxEntries` bound each worker, and a key is
//! asked of the node once per worker.
//!
//! **Keys.** A request's key is its route (the cluster Envoy's route chose,
//! the `:authority` and the `:path`: another route may be another node,
//! another chain), its body but its id, byte for byte, and where the id
//! was, hashed twice with SipHash under this worker's random
//! keys (128 bits no client can aim a collision at). Checking that a body
//! is one call with a plain id, and the cheap method test, come first;
//! the rules parse the params only on a miss. So a client gets the answer
//! another client's request had only when their requests differ in the id
//! alone; the same call spelled otherwise (spacing, member order) is
//! another key, asked of the node once more, never a wrong answer.
//! (Coalescing's canonical keys cost twice as much: the cache looks up
//! every request it may answer.)
//!
//! **Kept at the second miss.** A worker keeps a key's answer only when
//! the key missed before (a 64-bit digest of each key that missed once is
//! remembered, as many as `maxEntries`, then forgotten all at once): a
//! question asked once (a scan of unique keys, an identity that comes
//! once) costs the lookup alone, its answer is not read whole, and it
//! pushes out no answer that is asked for again (TinyLFU's doorkeeper).
//!
//! **Eviction by value.** Each answer is worth the node time it saves
//! (with `nodeTime`, its method's learned cost; else the same for every
//! answer). A full cache drops the answer of least worth, aged as in
//! GreedyDual: each kept or served answer's worth is counted from the
//! worth of the last one dropped, so an answer not asked for in a long
//! time goes before a dear one asked for often, and among equals the
//! least recently used goes first.
//!
//! **Standing by while nothing repeats.** A lookup reads the body whole
//! before admission; for traffic where no key comes twice (unique calls,
//! moving tags) that is work for nothing. So each worker counts, over
//! `WINDOW` lookups, the requests that repeated a key (a hit, or a miss of
//! a key that missed before); with fewer than one in `REPEATS_AT_LEAST`
//! it stands by: requests pass as if there were no cache but one in
//! `SAMPLE_EVERY`, which is looked up, and the first sampled request that
//! repeats a key engages it again.

pub mod head;
pub mod policy;
pub mod rules;

use crate::dedup::answer::{Answer, Id};
use crate::dedup::finality;
use crate::dedup::key::{Key, KEY_LEN};
use crate::jsonrpc::{self, Request};
use policy::CachePolicy;
use rules::{AtHead, Lifetime};
use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::ops::Range;

/// The response header that marks an answer from the cache.
pub const HEADER: &str = "x-stakegate-cache";

/// Lookups over which a worker's cache judges whether keys repeat.
pub const WINDOW: u32 = 1024;
/// Engaged while at least one lookup in this many repeats a key.
pub const REPEATS_AT_LEAST: u32 = 64;
/// Standing by, one request in this many is looked up.
pub const SAMPLE_EVERY: u32 = 16;

/// The bytes an entry is counted for beyond its answer: its key, its
/// place in the map and the eviction order, the answer's fields.
pub const ENTRY_OVERHEAD: u64 = 160;

/// A request the cache did not have, and may keep the answer of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    pub key: Key,
    pub ids: Vec<Id>,
    pub lifetime: Lifetime,
    /// What its answer saves the node each time it is served.
    pub worth: u64,
}

/// What the cache says of a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Its answer, with the request's own id.
    Hit(Answer, Vec<Id>),
    /// Missed before: its answer is kept if it cannot change.
    Miss(Miss),
    /// Its first miss on this worker: its answer is not kept.
    First,
    /// A read at `latest` the head answers (`cache.latest`; `head`).
    AtHead(AtHead, Vec<Id>),
    /// Its answer can change (or it is not one call with an id).
    Uncacheable,
}

/// Why an answer was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unkept {
    /// Not a found answer (an error, `null`, a failure, an encoded body).
    NotFound,
    /// Its block is not final (or the finalized block is not known).
    NotFinal,
    /// Larger than `maxAnswerBytes`.
    TooLarge,
}

#[derive(Debug)]
struct Kept {
    answer: Answer,
    /// Its place in the eviction order.
    rank: (u64, u64),
    bytes: u64,
    worth: u64,
}

/// One worker's cache.
#[derive(Debug)]
pub struct Cache {
    policy: CachePolicy,
    entries: HashMap<Key, Kept>,
    /// Least worth first: (worth counted from `floor`, sequence), key.
    order: BTreeSet<((u64, u64), Key)>,
    /// The worth of the last answer dropped (GreedyDual's inflation).
    floor: u64,
    seq: u64,
    bytes: u64,
    /// Digests of the keys that missed once since it was last cleared.
    seen: HashSet<u64>,
    /// The keys of the two halves of a request's key (`key`).
    hashers: [RandomState; 2],
    standby: Standby,
}

/// Whether keys repeat (see the module's docs).
#[derive(Debug, Default)]
struct Standby {
    standing_by: bool,
    /// Engaged: lookups in this window, and those that repeated a key.
    /// Standing by: requests passed since the last sample.
    looked: u32,
    repeated: u32,
}

impl Standby {
    fn looks_up(&mut self) -> bool {
        if !self.standing_by {
            return true;
        }
        self.looked += 1;
        if self.looked < SAMPLE_EVERY {
            return false;
        }
        self.looked = 0;
        true
    }

    fn saw(&mut self, repeat: bool) {
        if self.standing_by {
            if repeat {
                *self = Self::default();
            }
            return;
        }
        self.looked += 1;
        self.repeated += u32::from(repeat);
        if self.looked == WINDOW {
            let standing_by = self.repeated * REPEATS_AT_LEAST < WINDOW;
            *self = Self {
                standing_by,
                ..Self::default()
            };
        }
    }
}

impl Cache {
    pub fn new(policy: CachePolicy) -> Self {
        Self {
            policy,
            entries: HashMap::new(),
            order: BTreeSet::new(),
            floor: 0,
            seq: 0,
            bytes: 0,
            seen: HashSet::new(),
            hashers: [RandomState::new(), RandomState::new()],
            standby: Standby::default(),
        }
    }

    /// Whether to look the next request up: always while keys repeat,
    /// one in `SAMPLE_EVERY` while the cache stands by.
    pub fn looks_up(&mut self) -> bool {
        self.standby.looks_up()
    }

    /// Whether it stands by (no key repeated lately).
    pub fn standing_by(&self) -> bool {
        self.standby.standing_by
    }

    pub fn policy(&self) -> &CachePolicy {
        &self.policy
    }

    /// Answers kept, and the bytes they are counted for.
    pub fn size(&self) -> (u64, u64) {
        (self.entries.len() as u64, self.bytes)
    }

    /// Looks `body` up; `worth` prices a method (the node time its answer
    /// saves).
    /// A read at the head is not judged yet: its lookup at the head is
    /// (`lookup_pinned`, `saw_head`).
    pub fn lookup(&mut self, body: &[u8], route: &str, worth: impl FnOnce(&str) -> u64) -> Lookup {
        let lookup = self.find(body, route, worth, false);
        if !matches!(lookup, Lookup::AtHead(..)) {
            self.standby
                .saw(matches!(lookup, Lookup::Hit(..) | Lookup::Miss(_)));
        }
        lookup
    }

    /// Looks up a read at `latest` pinned to the head's hash
    /// (`rules::pinned`). Its key is apart from every request's own: a
    /// client that asks at that hash itself is never given it.
    pub fn lookup_pinned(
        &mut self,
        body: &[u8],
        route: &str,
        worth: impl FnOnce(&str) -> u64,
    ) -> Lookup {
        let lookup = self.find(body, route, worth, true);
        self.standby
            .saw(matches!(lookup, Lookup::Hit(..) | Lookup::Miss(_)));
        lookup
    }

    /// A read at the head was answered from the head poll itself: a key
    /// that repeats.
    pub fn saw_head(&mut self) {
        self.standby.saw(true);
    }

    fn find(
        &mut self,
        body: &[u8],
        route: &str,
        worth: impl FnOnce(&str) -> u64,
        pinned: bool,
    ) -> Lookup {
        let Some(request) = Request::read(body).filter(|r| !r.batch) else {
            return Lookup::Uncacheable;
        };
        let call = &request.calls[0];
        // One id, written plainly (a notification has no answer to keep).
        let jsonrpc::Id::Plain(id) = &call.id else {
            return Lookup::Uncacheable;
        };
        if !rules::keeps(call.method) {
            return self.at_head(call.method, body, id);
        }
        let ids = vec![Some(body[id.clone()].to_vec())];
        let key = self.key(body, id, route, pinned);
        if let Some(kept) = self.entries.get_mut(&key) {
            self.order.remove(&(kept.rank, key));
            self.seq += 1;
            kept.rank = (self.floor.saturating_add(kept.worth), self.seq);
            self.order.insert((kept.rank, key));
            return Lookup::Hit(kept.answer.clone(), ids);
        }
        let lifetime = match pinned {
            true => Some(Lifetime::Pinned),
            false => rules::lifetime(call.method, body),
        };
        let Some(lifetime) = lifetime else {
            return self.at_head(call.method, body, id);
        };
        if !self.seen.contains(&digest(&key)) {
            if self.seen.len() as u64 >= self.policy.max_entries {
                self.seen.clear();
            }
            self.seen.insert(digest(&key));
            return Lookup::First;
        }
        Lookup::Miss(Miss {
            key,
            ids,
            lifetime,
            worth: worth(call.method).max(1),
        })
    }

    /// A request that cannot be kept under its own key: read at the head,
    /// if `cache.latest` and the rules say so.
    fn at_head(&self, method: &str, body: &[u8], id: &Range<usize>) -> Lookup {
        let at = self.policy.latest.then(|| rules::at_head(method, body));
        match at.flatten() {
            Some(at) => Lookup::AtHead(at, vec![Some(body[id.clone()].to_vec())]),
            None => Lookup::Uncacheable,
        }
    }

    /// The answer to a request that missed came: kept if it cannot change
    /// (`finalized`: the node's finalized block, if known and fresh).
    /// Returns how many answers were dropped for it.
    pub fn keep(
        &mut self,
        miss: Miss,
        answer: &Answer,
        finalized: Option<u64>,
    ) -> Result<u64, Unkept> {
        // One call with an id: its answer is the request's whatever id the
        // node wrote (`Answer::body_for`).
        let found = answer.status == 200
            && answer.content_encoding.is_none()
            && matches!(answer.ids.as_slice(), [Some(_)])
            && answer.found();
        if !found {
            return Err(Unkept::NotFound);
        }
        let block = match miss.lifetime {
            Lifetime::Fixed | Lifetime::Finalized | Lifetime::Pinned => None,
            Lifetime::AtBlock(n) => Some(n),
            Lifetime::NamedBlock => Some(finality::block_of(&answer.body).ok_or(Unkept::NotFinal)?),
        };
        if block.is_some_and(|b| finalized.is_none_or(|f| b > f)) {
            return Err(Unkept::NotFinal);
        }
        if answer.body.len() as u64 > self.policy.max_answer_bytes {
            return Err(Unkept::TooLarge);
        }
        let bytes = answer.body.len() as u64 + answer.content_type.len() as u64 + ENTRY_OVERHEAD;
        self.remove(&miss.key);
        self.seen.remove(&digest(&miss.key));
        let mut evicted = 0;
        while !self.entries.is_empty()
            && (self.entries.len() as u64 >= self.policy.max_entries
                || self.bytes + bytes > self.policy.max_bytes)
        {
            let Some((rank, key)) = self.order.pop_first() else {
                break;
            };
            self.floor = rank.0;
            if let Some(gone) = self.entries.remove(&key) {
                self.bytes -= gone.bytes;
            }
            evicted += 1;
        }
        self.seq += 1;
        let rank = (self.floor.saturating_add(miss.worth), self.seq);
        // The answer keeps the ids of the request it answered: `body_for`
        // matches its entries to them.
        let mut answer = answer.clone();
        answer.key = miss.key;
        self.order.insert((rank, miss.key));
        self.bytes += bytes;
        self.entries.insert(
            miss.key,
            Kept {
                answer,
                rank,
                bytes,
                worth: miss.worth,
            },
        );
        Ok(evicted)
    }

    /// A request's key: its route, the body but its id, byte for byte,
    /// and where the id was, as two SipHash digests with this worker's
    /// random keys; a pinned read's apart.
    fn key(&self, body: &[u8], id: &Range<usize>, route: &str, pinned: bool) -> Key {
        let half = |state: &RandomState| {
            let mut hasher = state.build_hasher();
            hasher.write_u8(u8::from(pinned));
            hasher.write(route.as_bytes());
            hasher.write_u8(0xff);
            hasher.write_usize(id.start);
            hasher.write(&body[..id.start]);
            hasher.write(&body[id.end..]);
            hasher.finish().to_le_bytes()
        };
        let mut key = [0; KEY_LEN];
        key[..8].copy_from_slice(&half(&self.hashers[0]));
        key[8..].copy_from_slice(&half(&self.hashers[1]));
        key
    }

    fn remove(&mut self, key: &Key) {
        if let Some(gone) = self.entries.remove(key) {
            self.order.remove(&(gone.rank, *key));
            self.bytes -= gone.bytes;
        }
    }
}

/// A key's first half, for the keys that missed once.
fn digest(key: &Key) -> u64 {
    let mut first = [0; 8];
    first.copy_from_slice(&key[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests;
