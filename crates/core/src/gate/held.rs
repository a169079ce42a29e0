//! A request's place at the gate while coalescing may hold it: its slot,
//! its class, and what it waits for (`Waiting`). The stream keeps a
//! `Place`; coalescing (`coalesce`) drives the places of the requests held
//! for an answer through the steps here: lead, take an answer, fail, time
//! out, or pass on through the route.

use super::reply::{Act, Callout, Reply, Target};
use super::worker::GateWorker;
use super::Ticket;
use crate::cache::head::Head;
use crate::cache::rules::{pinned, AtHead};
use crate::cache::{Lookup, Miss};
use crate::clock::Now;
use crate::dedup::answer::{Answer, Id};
use crate::dedup::key::Key;
use crate::dedup::{Dedup, Outcome, Pending, Reuse, Verdict};
use crate::gate::class::RequestClass;
use crate::rejection::Rejection;
use crate::shared::SharedStore;

/// A request held for an answer.
#[derive(Debug)]
pub struct Waiting {
    pub key: Key,
    pub(super) ids: Vec<Id>,
    /// Its body, sent if it comes to lead.
    pub(super) body: Vec<u8>,
    pub(super) target: Target,
    pub(super) deadline_ms: u64,
    /// Its VM sends it (it is the leader's own client).
    pub(super) leads: bool,
    /// Led, before the callout has its token.
    pub(super) pending: Option<Pending>,
    /// Whether its found answer is reused (`Keyed::reuse`).
    pub(super) reuse: Reuse,
    pub(super) checked_ms: u64,
    /// A read at `latest` asked at the head's hash (`at_head`): only the
    /// answer to that may be kept (under `keep`), never one through the
    /// route, which asks at `latest`.
    pub(super) pinned: bool,
    pub(super) keep: Option<Miss>,
}

/// The node's time on a leader's callout, in µs: as the node said it
/// (`said`), or as the gate measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedTime {
    pub us: u64,
    pub said: bool,
}

/// A callout at the node: what its end completes.
#[derive(Debug)]
pub struct Led {
    pub(super) pending: Pending,
    pub(super) ids: Vec<Id>,
    /// The leader's gate slot, held until the callout ends.
    pub(super) ticket: Option<Ticket>,
    pub(super) started_us: u64,
    pub(super) timeout_ms: u64,
    pub(super) reuse: Reuse,
    /// Its body is a read at `latest` pinned to the head's hash.
    pub(super) pinned: bool,
}

/// A read at `latest` held for the head (`cache::head`).
#[derive(Debug)]
pub struct HeadRead {
    at: AtHead,
    ids: Vec<Id>,
    body: Vec<u8>,
    target: Target,
}

/// What dedup's check of a whole body found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// Not a duplicate to hold: on through the route.
    Continue,
    /// Held for an identical request's answer.
    Hold,
    /// It leads its key: held while this callout is sent.
    Lead(Callout),
    /// Answered with a kept answer.
    Answer(Reply),
    Refuse(Rejection),
}

/// A request's slot, class, and what it waits for if held.
#[derive(Debug)]
pub struct Place {
    /// `None` while the admission waits for the whole body, or while it
    /// waits for another request's answer (it puts no load on the node).
    pub(super) ticket: Option<Ticket>,
    pub(super) class: RequestClass,
    pub(super) waiting: Option<Waiting>,
    /// It missed the cache: its answer is kept if it cannot change.
    pub(super) cache: Option<Miss>,
    /// A read at `latest`, held for the head (it holds no slot).
    head: Option<HeadRead>,
}

impl Place {
    pub(super) fn new(ticket: Option<Ticket>, class: RequestClass) -> Self {
        Self {
            ticket,
            class,
            waiting: None,
            cache: None,
            head: None,
        }
    }

    /// It reads at `latest`: held for the head.
    pub(super) fn hold_for_head(
        &mut self,
        at: AtHead,
        ids: Vec<Id>,
        body: Vec<u8>,
        target: Option<Target>,
    ) {
        let target = target.unwrap_or_default();
        self.head = Some(HeadRead {
            at,
            ids,
            body,
            target,
        });
    }

    /// The head poll it waited for ended (`head`: the head it found, if
    /// any). The head number and block come from the poll; a read of state
    /// is looked up pinned to the head's hash, and a miss is asked of the
    /// node at that hash as coalescing asks (it leads its pinned key, or
    /// waits for it), with a gate slot. With no head, or a read
    /// coalescing does not take, it goes on as it came (`Continue`).
    pub(super) fn at_head(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        head: Option<&Head>,
    ) -> Checked {
        let Some(read) = self.head.take() else {
            return Checked::Continue;
        };
        let ids = &read.ids;
        let answered = |w: &GateWorker, answer: &Answer| {
            let reply = Reply::answer(answer, ids).from_cache();
            Checked::Answer(reply.no_node_time(w.gate.policy()))
        };
        let at = match (head, &read.at) {
            (None, _) => return self.admitted(w, store, now, &read.body),
            (Some(head), AtHead::Number) => {
                w.cache_answered_by_head();
                return answered(w, &head.number_answer());
            }
            (Some(head), AtHead::Block) => {
                w.cache_answered_by_head();
                return answered(w, &head.block);
            }
            (Some(head), AtHead::State(at)) => pinned(&read.body, at, &head.hash),
        };
        let keep = match w.cache_lookup_pinned(&at, &read.target.route()) {
            Some(Lookup::Hit(answer, _)) => return answered(w, &answer),
            Some(Lookup::Miss(miss)) => Some(miss),
            _ => None,
        };
        if let refused @ Checked::Refuse(_) = self.admitted(w, store, now, &read.body) {
            return refused;
        }
        let checked = self.check(w, store, now, "pinned", at, Some(read.target));
        if let Some(waiting) = self.waiting.as_mut() {
            waiting.pinned = true;
            waiting.keep = keep;
        }
        checked
    }

    /// A read at `latest` not held after all (holding stands by): it goes
    /// on as it came, with a gate slot (`Continue`), or is refused.
    pub(super) fn pass_head(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Checked {
        let body = self.head.take().map(|read| read.body).unwrap_or_default();
        self.admitted(w, store, now, &body)
    }

    /// Takes a gate slot for it if it holds none (`Continue`), or the
    /// gate's refusal.
    fn admitted(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        body: &[u8],
    ) -> Checked {
        if self.ticket.is_none() {
            match w.admit(store, now, self.class, false, false) {
                Ok(ticket) => self.ticket = Some(ticket),
                Err(refusal) => return Checked::Refuse(refusal.answering(body)),
            }
        }
        Checked::Continue
    }

    /// What it waits for, if it is held for an answer.
    pub fn held_for(&self) -> Option<&Waiting> {
        self.waiting.as_ref()
    }

    /// It leads, and its callout is still to be sent.
    pub fn awaits_callout(&self) -> bool {
        self.held_for().is_some_and(|w| w.pending.is_some())
    }

    /// Dedup's check of its whole body (`request`), for `client`: it leads
    /// its key, waits for an identical request's answer, takes a kept
    /// answer, or passes.
    pub(super) fn check(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        client: &str,
        request: Vec<u8>,
        target: Option<Target>,
    ) -> Checked {
        let Some(dedup) = w.dedup.clone() else {
            return Checked::Continue;
        };
        let target = target.unwrap_or_default();
        let (keyed, vm) = match (dedup.key(&request, &target.route(), client), w.gate.vm()) {
            (Ok(keyed), Some(vm)) => (keyed, vm),
            _ => {
                w.counts.dedup.skipped += 1;
                return Checked::Continue;
            }
        };
        let now_ms = now.ms();
        let checked = match dedup.check(store, &keyed.key, vm, now_ms, false) {
            Ok(checked) => checked,
            Err(e) => {
                w.note_store_error("dedup check passed a request", &e);
                return Checked::Continue;
            }
        };
        w.counts.store.retried(checked.cas_retries);
        w.counts.dedup.purged += checked.purged;
        let waiting = Waiting {
            key: keyed.key,
            ids: keyed.ids,
            body: request,
            target,
            deadline_ms: now_ms.saturating_add(dedup.policy().max_wait_ms),
            leads: false,
            pending: None,
            reuse: keyed.reuse,
            checked_ms: now_ms,
            pinned: false,
            keep: None,
        };
        match checked.verdict {
            Verdict::Lead(pending) => {
                w.counts.dedup.led += 1;
                let callout = callout(&dedup, &waiting);
                self.waiting = Some(Waiting {
                    leads: true,
                    pending: Some(pending),
                    ..waiting
                });
                Checked::Lead(callout)
            }
            Verdict::Wait => {
                w.counts.dedup.coalesced += 1;
                if let Some(ticket) = self.ticket.take() {
                    w.release(ticket);
                }
                self.waiting = Some(waiting);
                Checked::Hold
            }
            Verdict::Take(slot) => match dedup.take(store, slot, &waiting.key) {
                Ok(Some(answer)) => {
                    w.counts.dedup.taken += 1;
                    let reply = Reply::answer(&answer, &waiting.ids);
                    Checked::Answer(reply.no_node_time(w.gate.policy()))
                }
                _ => Checked::Continue,
            },
            Verdict::TableFull => {
                w.counts.dedup.table_full += 1;
                Checked::Continue
            }
            Verdict::Refuse(rejection) => {
                w.counts.dedup.refused += 1;
                Checked::Refuse(rejection.answering(&waiting.body))
            }
        }
    }

    /// Its callout was sent at `now_us`: the callout holds the key's lead
    /// and the gate slot from now on.
    pub(super) fn led(&mut self, w: &GateWorker, now_us: u64) -> Option<Led> {
        let waiting = self.waiting.as_mut()?;
        let pending = waiting.pending.take()?;
        let timeout_ms = w
            .dedup
            .as_ref()
            .map_or(0, |d| d.policy().upstream.timeout_ms);
        Some(Led {
            pending,
            ids: waiting.ids.clone(),
            ticket: self.ticket.take(),
            started_us: now_us,
            timeout_ms,
            reuse: waiting.reuse,
            pinned: waiting.pinned,
        })
    }

    /// Its callout could not be sent: it stops leading and holding (it
    /// goes on through the route with its slot).
    pub(super) fn stop_leading(&mut self) -> Option<Pending> {
        let pending = self.waiting.as_mut()?.pending.take();
        self.waiting = None;
        pending
    }

    /// It comes to lead `pending`: it takes a gate slot, and its callout
    /// is to be sent. A full gate refuses it (and `pending` goes back).
    pub(super) fn lead(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        pending: Pending,
    ) -> Result<Callout, (Reply, Pending)> {
        let Some(dedup) = w.dedup.clone() else {
            return Err((Reply::none(&[], "dedup is off"), pending));
        };
        if self.ticket.is_none() {
            match w.admit(store, now, self.class, false, false) {
                Ok(ticket) => self.ticket = Some(ticket),
                Err(refusal) => {
                    let body = self.waiting.take().map(|w| w.body).unwrap_or_default();
                    return Err((Reply::refusal(refusal.answering(&body)), pending));
                }
            }
        }
        let Some(waiting) = self.waiting.as_mut() else {
            return Err((Reply::none(&[], "the request is gone"), pending));
        };
        waiting.leads = true;
        waiting.pending = Some(pending);
        Ok(callout(&dedup, waiting))
    }

    /// It gets `answer`, with its own ids (and the cache keeps it, if it
    /// missed and the answer cannot change). A leader's says the node's
    /// time on its callout (`led`), and echoes the node's own word on it;
    /// any other's says the node did none.
    pub(super) fn answer(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now_ms: u64,
        answer: &Answer,
        led: Option<LedTime>,
    ) -> Reply {
        let Some(waiting) = self.waiting.take() else {
            return Reply::none(&[], "the request is gone");
        };
        if let Some(miss) = waiting.keep.or_else(|| self.cache.take()) {
            w.cache_keep(store, now_ms, miss, answer);
        }
        let reply = Reply::answer(answer, &waiting.ids);
        if waiting.leads {
            return Reply {
                node_us: led.map(|l| l.us),
                said_us: led.filter(|l| l.said).map(|l| l.us),
                ..reply
            };
        }
        w.counts.dedup.shared += 1;
        reply.no_node_time(w.gate.policy())
    }

    /// Its own callout failed: the node's 5xx as it came if it is JSON,
    /// else a JSON-RPC error with the status (Envoy's own 503 or 504 for a
    /// callout it could not complete), or 502 with no answer at all.
    pub(super) fn failed(&mut self, answer: Option<&Answer>) -> Reply {
        let Some(waiting) = self.waiting.take() else {
            return Reply::none(&[], "the request is gone");
        };
        match answer {
            Some(answer) if answer.content_type.contains("json") => {
                Reply::answer(answer, &waiting.ids)
            }
            Some(answer) => Reply {
                status: answer.status,
                ..Reply::none(&waiting.ids, "the node did not answer in time")
            },
            None => Reply::none(&waiting.ids, "the node did not answer"),
        }
    }

    /// Past its deadline, a held request gets 504 and is no longer counted.
    pub(super) fn expire(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now_ms: u64,
    ) -> Option<Reply> {
        if self.waiting.as_ref()?.deadline_ms > now_ms {
            return None;
        }
        let waiting = self.give_up(w, store)?;
        w.counts.dedup.wait_timeouts += 1;
        Some(Reply {
            status: 504,
            ..Reply::none(
                &waiting.ids,
                "timed out waiting for the node's answer to an identical request",
            )
        })
    }

    /// It waits here no longer (past its deadline, or past the holding
    /// bounds, `gate::holds`): a read held for the head is let go, and a
    /// request held for an answer leaves its key (returned).
    pub(super) fn give_up(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
    ) -> Option<Waiting> {
        self.head = None;
        let waiting = self.waiting.take()?;
        if let Some(dedup) = w.dedup.clone() {
            if let Err(e) = dedup.left(store, &waiting.key) {
                w.note_store_error("dedup: a held request stopped waiting", &e);
            }
        }
        Some(waiting)
    }

    /// The table was checked for `key` at `now_ms`.
    pub(super) fn checked(&mut self, key: &Key, now_ms: u64) {
        if let Some(waiting) = self.waiting.as_mut() {
            if waiting.key == *key {
                waiting.checked_ms = now_ms;
            }
        }
    }

    /// It goes through the route as it is, with a gate slot (or the gate's
    /// refusal).
    pub(super) fn pass(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Act {
        let body = self.waiting.take().map(|w| w.body).unwrap_or_default();
        match self.admitted(w, store, now, &body) {
            Checked::Refuse(refusal) => Act::Answer(Reply::refusal(refusal)),
            _ => Act::Resume,
        }
    }

    /// The stream is over: whatever it holds goes back. A request still
    /// held leaves the table (if it led and its callout was not sent yet,
    /// its key is left to its waiters, who check again on the heartbeat).
    pub(super) fn leave(self, w: &mut GateWorker, store: &impl SharedStore) {
        if let (Some(waiting), Some(dedup)) = (self.waiting, w.dedup.clone()) {
            w.counts.dedup.left += 1;
            let left = match waiting.pending {
                Some(pending) => {
                    let at = pending.start_ms();
                    dedup
                        .complete(store, &pending, Outcome::Failed, 1, 0, at)
                        .map(|(_, retries)| retries)
                }
                None => dedup.left(store, &waiting.key),
            };
            match left {
                Ok(retries) => w.counts.store.retried(retries),
                Err(e) => w.note_store_error("dedup: a held request left", &e),
            }
        }
        if let Some(ticket) = self.ticket {
            w.release(ticket);
        }
    }
}

/// The leader's request, as a callout to the policy's upstream.
fn callout(dedup: &Dedup, waiting: &Waiting) -> Callout {
    let upstream = &dedup.policy().upstream;
    Callout::post(
        &upstream.cluster,
        &waiting.target,
        waiting.body.clone(),
        upstream.timeout_ms,
    )
}
