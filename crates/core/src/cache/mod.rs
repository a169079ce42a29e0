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
//! **Eviction by value.** Each answer is worth the node time it saves
//! (with `nodeTime`, its method's learned cost; else the same for every
//! answer). A full cache drops the answer of least worth, aged as in
//! GreedyDual: each kept or served answer's worth is counted from the
//! worth of the last one dropped, so an answer not asked for in a long
//! time goes before a dear one asked for often, and among equals the
//! least recently used goes first.

pub mod policy;
pub mod rules;

use crate::dedup::answer::{Answer, Id};
use crate::dedup::finality;
use crate::dedup::key::{self, Key};
use crate::jsonrpc::Request;
use policy::CachePolicy;
use rules::Lifetime;
use std::collections::{BTreeSet, HashMap};

/// The response header that marks an answer from the cache.
pub const HEADER: &str = "x-stakegate-cache";

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
    /// Not kept yet: its answer may be.
    Miss(Miss),
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
        }
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
    pub fn lookup(&mut self, body: &[u8], worth: impl FnOnce(&str) -> u64) -> Lookup {
        let Some(request) = Request::read(body).filter(|r| !r.batch) else {
            return Lookup::Uncacheable;
        };
        let call = &request.calls[0];
        let Some(id) = request.id(call) else {
            return Lookup::Uncacheable;
        };
        if matches!(call.id, crate::jsonrpc::Id::Unsure(_)) {
            return Lookup::Uncacheable;
        }
        let Some(lifetime) = rules::lifetime(body) else {
            return Lookup::Uncacheable;
        };
        let Ok(key) = key::key(body, "cache") else {
            return Lookup::Uncacheable;
        };
        let ids = vec![Some(id.to_vec())];
        if let Some(kept) = self.entries.get_mut(&key) {
            self.order.remove(&(kept.rank, key));
            self.seq += 1;
            kept.rank = (self.floor.saturating_add(kept.worth), self.seq);
            self.order.insert((kept.rank, key));
            return Lookup::Hit(kept.answer.clone(), ids);
        }
        Lookup::Miss(Miss {
            key,
            ids,
            lifetime,
            worth: worth(call.method).max(1),
        })
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
        let found = answer.status == 200 && answer.shareable() && answer.found();
        if !found {
            return Err(Unkept::NotFound);
        }
        let block = match miss.lifetime {
            Lifetime::Fixed | Lifetime::Finalized => None,
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

    fn remove(&mut self, key: &Key) {
        if let Some(gone) = self.entries.remove(key) {
            self.order.remove(&(gone.rank, *key));
            self.bytes -= gone.bytes;
        }
    }
}

#[cfg(test)]
mod tests;
