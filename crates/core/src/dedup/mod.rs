//! Retry-storm protection (docs/background.md part 4, Agave's outstanding-request
//! map, at the gateway), by **coalescing**: a request identical to one the
//! node is already working on is not sent again; it waits at the gateway
//! and gets that request's answer, with its own JSON-RPC ids.
//!
//! - `key`: what makes two requests the same (scope, method, canonical
//!   params; never the JSON-RPC id).
//! - `table`: the shared-data pages of outstanding requests.
//! - `answer`: an answer as it travels to the requests that waited for it.
//! - `policy`: the `dedup` section of the gate's policy.
//!
//! **The leader.** The first of a set of identical requests *leads*: its
//! entry is written (`check`) and the gate VM sends it to the node itself,
//! as an HTTP callout to the policy's upstream cluster, not through the
//! client's stream. So a client that gives up does not cancel the node's
//! work: its retry waits for the same call. The leader's own client waits
//! like any other.
//!
//! **Waiters.** An identical request that finds the entry in flight is
//! counted in it and held (`Verdict::Wait`), for at most `maxWaitMs`.
//! When the answer comes, the leading VM answers its own waiters, and, if
//! the entry counts others, puts the answer on every live gate VM's wake
//! queue (`wake_queue`); each answers its waiters for that key. Past
//! `maxWaiters` on one key, a request is refused with 429: the one refusal
//! left.
//!
//! **Failure.** A callout that fails (no answer, or a 5xx) gives its own
//! client what it got, and another waiter leads: one on the same VM at
//! once; else the entry is orphaned and the other VMs are woken to claim
//! it (`check` again), the first to come back leading. A waiter that finds
//! no wake (a lost message, a VM gone) checks again on the heartbeat.
//!
//! **Answers a client gave up on** (the retry storm: a client's timeout is
//! shorter than the node's answer) are kept for `windowMs` in one of the
//! page's answer slots, and the next identical request takes it
//! (`Verdict::Take`): that is the retry of the client that gave up, which
//! may come just after the answer. An answer nobody gave up on is never
//! given again: a later identical request (a receipt poll, a balance at
//! `latest`) wants a fresh one.
//!
//! While in flight, an entry is trusted for `windowMs`, then for as long as
//! its owner, the leading gate VM, is alive in the gate's shard table; a
//! request that finds it owned by a vanished VM leads instead.
//!
//! **Failure is open.** A full page, a store error, an unreadable body, or
//! a callout that cannot be made lets the request pass through the route as
//! it is: dedup never refuses a request it is not sure about.
//!
//! **Bounds.** Entries: `maxEntries`. Kept answers: `ANSWER_SLOTS` per page
//! (a new one takes the slot of the page's oldest when none is free),
//! each at most `maxAnswerBytes` (so at most `pages × 4 × maxAnswerBytes`
//! of shared data). A wake message carries one answer, once per live gate
//! VM, and is taken off the queue at once. A waiting request holds its
//! buffered body (at most `maxBodyBytes`) and no gate slot.

pub mod answer;
pub mod engage;
pub mod finality;
pub mod key;
pub mod policy;
pub mod table;

use crate::gate::shards::ShardTable;
use crate::gate::SHARED_KEY as SHARDS_KEY;
use crate::jsonrpc::{self, same_id, Request};
use crate::rejection::{Fact, Rejection, Rule, LIMIT_EXCEEDED};
use crate::request::{sha256_hex, RequestFacts};
use crate::shared::{read, update, Change, SharedStore, StoreError, Write};
use answer::{Answer, Id};
use key::{Key, Unkeyed};
use policy::{DedupPolicy, Scope, ALWAYS_REUSE, FINALIZED_REUSE};
use std::sync::Arc;
use table::{page_of, Entry, Page, State, ANSWER_SLOTS, ENTRIES_PER_PAGE};

const PREFIX: &str = "stakegate.admission_gate.v2.dedup";

/// The shared-data key of page `index`.
pub fn page_key(index: u32) -> String {
    format!("{PREFIX}.{index}")
}

/// The shared-data key of an answer slot.
pub fn answer_key(slot: Slot) -> String {
    format!("{PREFIX}.answer.{}.{}", slot.page, slot.index)
}

/// The name of gate VM `vm`'s wake queue.
pub fn wake_queue(vm: u32) -> String {
    format!("{PREFIX}.wake.{vm}")
}

/// An owner that missed this many heartbeats no longer holds its entries
/// in flight.
pub const MISSED_HEARTBEATS: u64 = 3;

/// Why a request is not checked; it passes as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    Body(Unkeyed),
    /// A method the policy does not deduplicate.
    Method,
    /// A batch whose ids repeat (as values: `1` and `1.0` are one id): an
    /// answer could not be given back id by id.
    RepeatedIds,
}

/// A body's key, and its calls' ids (to give an answer back with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyed {
    pub key: Key,
    pub ids: Vec<Id>,
    /// Whether its found answer serves identical requests for `windowMs`.
    pub reuse: Reuse,
}

/// Whether a Solana call asks for the `finalized` commitment: in its
/// config object, or by giving none (Solana's default).
pub(crate) fn asks_finalized(body: &[u8]) -> bool {
    let Ok(call) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let configs = call["params"].as_array().into_iter().flatten();
    let asked = configs
        .filter_map(|p| p.as_object())
        .find_map(|config| config.get("commitment"));
    match asked {
        None => true,
        Some(commitment) => commitment == "finalized",
    }
}

/// Whether a found answer is served again (`reuseMethods`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    No,
    /// Its answer depends on the request alone (a sent transaction's hash).
    Always,
    /// Once the block its answer names is final (`finality`).
    OnceFinal,
}

impl Reuse {
    /// Whether `answer` is served again, the node's finalized block being
    /// `finalized`.
    pub fn allows(self, answer: &Answer, finalized: Option<u64>) -> bool {
        let found = answer.status == 200 && answer.found();
        match self {
            Reuse::No => false,
            Reuse::Always => found,
            Reuse::OnceFinal => {
                found
                    && finality::block_of(&answer.body)
                        .zip(finalized)
                        .is_some_and(|(block, finalized)| block <= finalized)
            }
        }
    }
}

/// An answer slot: page and index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub page: u32,
    pub index: u8,
}

/// An entry this VM leads; `complete` it when its callout ends.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "an entry led stays in flight until it is completed"]
pub struct Pending {
    pub key: Key,
    start_ms: u64,
    owner: u32,
}

impl Pending {
    /// When it was led.
    pub fn start_ms(&self) -> u64 {
        self.start_ms
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nobody is sending it: this VM sends it (the entry is written).
    Lead(Pending),
    /// Identical to one in flight: wait for its answer.
    Wait,
    /// An answer nobody stayed for, in this slot: it is this request's.
    Take(Slot),
    /// Too many wait for this answer already: 429.
    Refuse(Rejection),
    /// Its page has no room: send it, unrecorded.
    TableFull,
}

/// A verdict plus what the filter counts.
#[derive(Debug, PartialEq, Eq)]
pub struct Checked {
    pub verdict: Verdict,
    /// Expired entries removed on the way.
    pub purged: u64,
    pub cas_retries: u32,
}

/// How a leader's callout ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// An answer to share. `keep`: it may be kept (it fits); `reuse`: it
    /// cannot change, and serves every identical request for `windowMs`.
    Answered { keep: bool, reuse: bool },
    /// No answer, or a 5xx: another waiter leads.
    Failed,
}

/// What the table says to do after a leader's callout ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Completed {
    /// Answered: waiters on other VMs need the answer (`remote` of them),
    /// and, if a client gave up on it, the answer is kept in `keep` for
    /// its retry.
    Share { remote: u32, keep: Option<Slot> },
    /// Failed: a waiter on this VM leads now.
    LeadHere(Pending),
    /// Failed: the entry is orphaned; other VMs' waiters must be woken.
    Orphaned,
    /// Nothing more to do.
    Done,
}

/// What a sweep of the whole table found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sweep {
    pub entries: u64,
    pub purged: u64,
    pub cas_retries: u32,
}

/// One gate VM's side of dedup. Cloned per request by the stream steps
/// that need it beside the worker, so the policy is shared, not copied.
#[derive(Debug, Clone)]
pub struct Dedup {
    policy: Arc<DedupPolicy>,
    /// How stale an owner's heartbeat may be before its in-flight entries
    /// stop counting past the window.
    owner_max_age_ms: u64,
}

/// Which gate VMs are alive, from the shard table, read at most once.
struct Owners<'s, S> {
    store: &'s S,
    me: u32,
    now_ms: u64,
    max_age_ms: u64,
    table: Option<Option<ShardTable>>,
}

impl<S: SharedStore> Owners<'_, S> {
    fn table(&mut self) -> Option<&ShardTable> {
        let store = self.store;
        self.table
            .get_or_insert_with(|| read::<ShardTable>(store, SHARDS_KEY).ok().map(|(t, _)| t))
            .as_ref()
    }

    /// Unknown (the table cannot be read) counts as gone: dedup fails open.
    fn alive(&mut self, vm: u32) -> bool {
        if vm == self.me {
            return true;
        }
        let (now_ms, max_age_ms) = (self.now_ms, self.max_age_ms);
        self.table().is_some_and(|t| {
            t.shards
                .iter()
                .any(|s| s.vm == vm && now_ms.saturating_sub(s.heartbeat_ms) <= max_age_ms)
        })
    }
}

/// Whether an entry still stands: in flight, for `window` and then while
/// its owner lives; orphaned, while a waiter may still come back for it;
/// unclaimed, until it expires.
fn live<S: SharedStore>(
    e: &Entry,
    now_ms: u64,
    policy: &DedupPolicy,
    owners: &mut Owners<'_, S>,
) -> bool {
    match e.state {
        State::InFlight => {
            now_ms < e.start_ms.saturating_add(policy.window_ms) || owners.alive(e.owner)
        }
        State::Orphaned => e.waiters > 0 && now_ms < e.start_ms.saturating_add(policy.max_wait_ms),
        State::Unclaimed | State::Reusable => now_ms < e.until_ms,
    }
}

/// The entry for `key` in `page`, with the expired ones removed; how many.
fn find<S: SharedStore>(
    page: &mut Page,
    key: &Key,
    now_ms: u64,
    policy: &DedupPolicy,
    owners: &mut Owners<'_, S>,
) -> (Option<usize>, u64) {
    let before = page.entries.len();
    page.entries
        .retain(|e| e.key == *key || live(e, now_ms, policy, owners));
    let purged = (before - page.entries.len()) as u64;
    (page.entries.iter().position(|e| e.key == *key), purged)
}

impl Dedup {
    /// `heartbeat_ms` comes from the gate's policy.
    pub fn new(policy: DedupPolicy, heartbeat_ms: u64) -> Self {
        Self {
            policy: Arc::new(policy),
            owner_max_age_ms: MISSED_HEARTBEATS * heartbeat_ms,
        }
    }

    pub fn policy(&self) -> &DedupPolicy {
        &self.policy
    }

    /// Whether a body of `content_length` bytes could be checked.
    pub fn fits(&self, content_length: u64) -> bool {
        content_length <= self.policy.max_body_bytes
    }

    /// The key of a request body, or why it has none. `route` names where
    /// it goes (the gate's `Target::route`: identical calls to another
    /// node, maybe another chain, share nothing); `client` is the sender's
    /// name for `client` scope (`client_name`, read with the headers:
    /// Envoy serves no headers during the body phase).
    pub fn key(&self, body: &[u8], route: &str, client: &str) -> Result<Keyed, Skip> {
        let request = Request::read(body).ok_or(Skip::Body(Unkeyed::NotJsonRpc))?;
        let calls = &request.calls;
        let policy = &self.policy;
        if !calls.iter().all(|c| policy.methods.contains(c.method)) {
            return Err(Skip::Method);
        }
        // An id key one node reads and another does not: their answers
        // could carry different ids.
        if calls.iter().any(|c| matches!(c.id, jsonrpc::Id::Unsure(_))) {
            return Err(Skip::Body(Unkeyed::NotJsonRpc));
        }
        let ids: Vec<Id> = calls
            .iter()
            .map(|c| request.id(c).map(<[u8]>::to_vec))
            .collect();
        let seen: Vec<&[u8]> = ids.iter().flatten().map(Vec::as_slice).collect();
        let repeated = (0..seen.len()).any(|i| (0..i).any(|j| same_id(seen[i], seen[j])));
        if repeated {
            return Err(Skip::RepeatedIds);
        }
        let global = policy.scope == Scope::Global
            || calls
                .iter()
                .all(|c| policy.global_methods.contains(c.method));
        let scope = if global { "global" } else { client };
        let method = calls[0].method;
        let reuse = match policy.reuse_methods.contains(method) {
            false => Reuse::No,
            _ if request.batch => Reuse::No,
            true if ALWAYS_REUSE.contains(&method) => Reuse::Always,
            true if FINALIZED_REUSE.contains(&method) => match asks_finalized(body) {
                true => Reuse::Always,
                false => Reuse::No,
            },
            true => Reuse::OnceFinal,
        };
        Ok(Keyed {
            key: key::key(body, &format!("{route}\n{scope}")).map_err(Skip::Body)?,
            ids,
            reuse,
        })
    }

    /// Checks `key` against the table as gate VM `vm`. `waiting`: the
    /// request is already counted as a waiter (it was woken, or checks
    /// again on the heartbeat).
    pub fn check(
        &self,
        store: &impl SharedStore,
        key: &Key,
        vm: u32,
        now_ms: u64,
        waiting: bool,
    ) -> Result<Checked, StoreError> {
        let policy = &self.policy;
        let mut owners = self.owners(store, vm, now_ms);
        let page_index = page_of(key, policy.pages);
        let lead = Pending {
            key: *key,
            start_ms: now_ms,
            owner: vm,
        };
        let updated = update(store, &page_key(page_index), |page: &mut Page| {
            let (found, purged) = find(page, key, now_ms, policy, &mut owners);
            let (verdict, changed) = match found {
                None if page.entries.len() < ENTRIES_PER_PAGE => {
                    page.entries.push(Entry {
                        key: *key,
                        start_ms: now_ms,
                        owner: vm,
                        waiters: 1,
                        ..Entry::default()
                    });
                    (Verdict::Lead(lead.clone()), true)
                }
                None => (Verdict::TableFull, false),
                Some(i) => {
                    let e = &mut page.entries[i];
                    let standing = live(e, now_ms, policy, &mut owners);
                    match e.state {
                        State::Reusable if standing => {
                            let slot = Slot {
                                page: page_index,
                                index: e.slot,
                            };
                            (Verdict::Take(slot), false)
                        }
                        State::Unclaimed if standing => {
                            let slot = Slot {
                                page: page_index,
                                index: e.slot,
                            };
                            page.entries.swap_remove(i);
                            (Verdict::Take(slot), true)
                        }
                        State::InFlight if standing && waiting => (Verdict::Wait, false),
                        State::InFlight if standing && e.waiters >= policy.max_waiters => {
                            (Verdict::Refuse(self.refusal(e.waiters)), false)
                        }
                        State::InFlight if standing => {
                            e.waiters += 1;
                            (Verdict::Wait, true)
                        }
                        // Orphaned, expired, or led by a VM that is gone:
                        // this request leads it now.
                        _ => {
                            *e = Entry {
                                key: *key,
                                start_ms: now_ms,
                                owner: vm,
                                waiters: if e.answered() {
                                    1
                                } else {
                                    e.waiters + u32::from(!waiting)
                                },
                                ..Entry::default()
                            };
                            (Verdict::Lead(lead.clone()), true)
                        }
                    }
                }
            };
            if purged > 0 || changed {
                Change::Write((verdict, purged))
            } else {
                Change::Keep((verdict, purged))
            }
        })
        .map_err(|(e, _)| e)?;
        let (verdict, purged) = updated.value;
        Ok(Checked {
            verdict,
            purged,
            cas_retries: updated.retries,
        })
    }

    /// The leader's callout for `pending` ended. `settled`: the waiting
    /// requests on this VM that its end settles (answered, or the leader's
    /// own client given its failure); `can_lead`: those left on this VM
    /// that could lead after a failure. Returns what to do next and the
    /// CAS retries.
    pub fn complete(
        &self,
        store: &impl SharedStore,
        pending: &Pending,
        outcome: Outcome,
        settled: u32,
        can_lead: u32,
        now_ms: u64,
    ) -> Result<(Completed, u32), StoreError> {
        let page_index = page_of(&pending.key, self.policy.pages);
        let window_ms = self.policy.window_ms;
        let updated = update(store, &page_key(page_index), |page: &mut Page| {
            let Some(i) = page.entries.iter().position(|e| {
                e.key == pending.key
                    && e.owner == pending.owner
                    && e.start_ms == pending.start_ms
                    && e.in_flight()
            }) else {
                return Change::Keep(Completed::Done);
            };
            let e = page.entries[i];
            let completed = match outcome {
                Outcome::Answered { keep, reuse } => {
                    let remote = e.waiters.saturating_sub(settled);
                    let nobody = e.waiters == 0 && settled == 0;
                    let used: Vec<u8> = page
                        .entries
                        .iter()
                        .filter(|e| e.answered())
                        .map(|e| e.slot)
                        .collect();
                    let mut i = i;
                    let mut free = (0..ANSWER_SLOTS).find(|s| !used.contains(s));
                    let wanted = keep && (reuse || nobody || e.abandoned);
                    if wanted && free.is_none() {
                        // Every slot holds an answer: the oldest gives its
                        // slot up (its retry has most likely come).
                        let oldest = (0..page.entries.len())
                            .filter(|&k| page.entries[k].answered())
                            .min_by_key(|&k| page.entries[k].until_ms);
                        if let Some(k) = oldest {
                            free = Some(page.entries[k].slot);
                            page.entries.swap_remove(k);
                            if i == page.entries.len() {
                                i = k;
                            }
                        }
                    }
                    match free.filter(|_| wanted) {
                        Some(index) => {
                            let e = &mut page.entries[i];
                            e.state = if reuse {
                                State::Reusable
                            } else {
                                State::Unclaimed
                            };
                            e.until_ms = now_ms.saturating_add(window_ms);
                            e.slot = index;
                            e.waiters = 0;
                            let slot = Slot {
                                page: page_index,
                                index,
                            };
                            return Change::Write(Completed::Share {
                                remote,
                                keep: Some(slot),
                            });
                        }
                        None => Completed::Share { remote, keep: None },
                    }
                }
                Outcome::Failed => {
                    let left = e.waiters.saturating_sub(settled);
                    if can_lead > 0 {
                        let e = &mut page.entries[i];
                        e.start_ms = now_ms;
                        e.waiters = left;
                        return Change::Write(Completed::LeadHere(Pending {
                            key: pending.key,
                            start_ms: now_ms,
                            owner: pending.owner,
                        }));
                    }
                    if left > 0 {
                        let e = &mut page.entries[i];
                        e.state = State::Orphaned;
                        e.owner = 0;
                        e.start_ms = now_ms;
                        e.waiters = left;
                        return Change::Write(Completed::Orphaned);
                    }
                    Completed::Done
                }
            };
            page.entries.swap_remove(i);
            Change::Write(completed)
        })
        .map_err(|(e, _)| e)?;
        Ok((updated.value, updated.retries))
    }

    /// A request that waited for `key` left without its answer (its client
    /// went, or its wait ran out): it is no longer counted. An orphaned
    /// entry nobody waits for goes.
    pub fn left(&self, store: &impl SharedStore, key: &Key) -> Result<u32, StoreError> {
        let page = page_key(page_of(key, self.policy.pages));
        let updated = update(store, &page, |page: &mut Page| {
            let Some(i) = page
                .entries
                .iter()
                .position(|e| e.key == *key && !e.answered())
            else {
                return Change::Keep(());
            };
            let e = &mut page.entries[i];
            e.waiters = e.waiters.saturating_sub(1);
            e.abandoned = true;
            if e.state == State::Orphaned && e.waiters == 0 {
                page.entries.swap_remove(i);
            }
            Change::Write(())
        })
        .map_err(|(e, _)| e)?;
        Ok(updated.retries)
    }

    /// Keeps an answer nobody stayed for in its slot.
    pub fn keep(
        &self,
        store: &impl SharedStore,
        slot: Slot,
        answer: &Answer,
    ) -> Result<(), StoreError> {
        match store.store(&answer_key(slot), &answer.encode(), None)? {
            Write::Stored => Ok(()),
            Write::CasMismatch => Err(StoreError::Host("unconditional write refused".into())),
        }
    }

    /// The kept answer for `key` in `slot`, if it is still there.
    pub fn take(
        &self,
        store: &impl SharedStore,
        slot: Slot,
        key: &Key,
    ) -> Result<Option<Answer>, StoreError> {
        let (bytes, _) = store.load(&answer_key(slot))?;
        Ok(bytes
            .and_then(|b| Answer::decode(&b))
            .filter(|a| a.key == *key))
    }

    /// The other live gate VMs, to wake with an answer or a failure.
    pub fn peers(&self, store: &impl SharedStore, me: u32, now_ms: u64) -> Vec<u32> {
        let mut owners = self.owners(store, me, now_ms);
        let max_age_ms = self.owner_max_age_ms;
        owners.table().map_or_else(Vec::new, |t| {
            t.shards
                .iter()
                .filter(|s| s.vm != me && now_ms.saturating_sub(s.heartbeat_ms) <= max_age_ms)
                .map(|s| s.vm)
                .collect()
        })
    }

    /// Purges expired entries from every page and counts what is left.
    /// Called on the heartbeat; a page's first failure ends the sweep.
    pub fn sweep(
        &self,
        store: &impl SharedStore,
        vm: u32,
        now_ms: u64,
    ) -> Result<Sweep, StoreError> {
        let policy = &self.policy;
        let mut owners = self.owners(store, vm, now_ms);
        let mut sweep = Sweep::default();
        for index in 0..policy.pages {
            let updated = update(store, &page_key(index), |page: &mut Page| {
                let before = page.entries.len();
                page.entries
                    .retain(|e| live(e, now_ms, policy, &mut owners));
                let purged = (before - page.entries.len()) as u64;
                if purged > 0 {
                    Change::Write(purged)
                } else {
                    Change::Keep(0)
                }
            })
            .map_err(|(e, _)| e)?;
            sweep.purged += updated.value;
            sweep.entries += updated.table.entries.len() as u64;
            sweep.cas_retries += updated.retries;
        }
        Ok(sweep)
    }

    fn owners<'s, S: SharedStore>(&self, store: &'s S, me: u32, now_ms: u64) -> Owners<'s, S> {
        Owners {
            store,
            me,
            now_ms,
            max_age_ms: self.owner_max_age_ms,
            table: None,
        }
    }

    fn refusal(&self, waiters: u32) -> Rejection {
        Rejection::explained(
            Rule::DedupWaiters,
            Rejection::TOO_MANY_REQUESTS,
            1,
            LIMIT_EXCEEDED,
            "too many identical requests are waiting for the node's answer; retry after the retry-after header",
            &[Fact::Inflight(waiters), Fact::Limit(self.policy.max_waiters)],
        )
    }
}

/// A client's name for `client` scope: its API key's hash when it sends
/// one, else its address. (The key need not be known to the gate: a client
/// that sends someone else's key shares only that key's dedup scope, which
/// requires knowing the key.)
pub fn client_name(policy: &DedupPolicy, facts: &mut impl RequestFacts) -> String {
    if let Some(key) = facts.header(&policy.api_key_header) {
        return format!("key:{}", sha256_hex(key.as_bytes()));
    }
    match facts.source_ip() {
        Some(ip) => format!("addr:{ip}"),
        None => "anonymous".to_string(),
    }
}

#[cfg(test)]
mod tests;
