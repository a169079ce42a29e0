//! Coalescing at the gate: what a VM does with the requests it holds for
//! an answer (`dedup` has the shared table and the rules).
//!
//! A held request is `Waiting` in its stream's `Place` (`held`). The
//! registry lends this VM's held places, oldest first, to the functions
//! here whenever something can settle them: the leader's callout ended
//! (`callout_ended`), the host refused it (`lead_refused`), a wake message
//! came on this VM's queue (`woken`), or the heartbeat (`heartbeat`:
//! deadlines, callouts that never ended, and a check of the table for
//! waiters whose wake may have been lost). Each returns `Acts`: per
//! stream, answer it, send its callout, or let it pass; and at most one
//! wake message for the other gate VMs.

use super::held::{Led, LedTime, Place};
use super::reply::Act;
use super::worker::GateWorker;
use crate::clock::Now;
use crate::dedup::answer::{Answer, Id};
use crate::dedup::key::{Key, KEY_LEN};
use crate::dedup::{Completed, Outcome, Pending, Reuse, Verdict};
use crate::shared::SharedStore;
use std::collections::HashMap;

/// What the glue does after a step.
#[derive(Debug, Default)]
pub struct Acts {
    pub acts: Vec<(u32, Act)>,
    /// A wake message for every other live gate VM's queue.
    pub wake: Option<Vec<u8>>,
}

/// The node's answer to a callout, as Envoy gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u32,
    pub content_type: String,
    /// `content-encoding`, unless absent or `identity`.
    pub content_encoding: Option<String>,
    pub body: Vec<u8>,
    /// The node's time on it, in µs, as the node says it
    /// (`nodeTime.serviceTimeHeader`).
    pub said_us: Option<u64>,
}

impl Response {
    /// The answer from its headers (`header`) and `body`; an answer with
    /// no status is a 502, one with no content type JSON. `said_in`: the
    /// header in which the node says its time, if it does.
    pub fn read(
        header: impl Fn(&str) -> Option<String>,
        body: Vec<u8>,
        said_in: Option<&str>,
    ) -> Self {
        Self {
            status: header(":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(502),
            content_type: header("content-type").unwrap_or_else(|| "application/json".into()),
            content_encoding: header("content-encoding")
                .filter(|e| !e.eq_ignore_ascii_case("identity")),
            body,
            said_us: said_in.and_then(|name| header(name)?.trim().parse().ok()),
        }
    }

    /// The answer, to the calls with these `ids`, for requests on `key`.
    pub fn answer(self, key: Key, ids: Vec<Id>) -> Answer {
        Answer {
            key,
            status: self.status,
            content_type: self.content_type,
            content_encoding: self.content_encoding,
            ids,
            body: self.body,
        }
    }
}

/// A message on a gate VM's wake queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// The answer for the requests waiting on its key.
    Answer(Answer),
    /// The leader failed: a waiter on the key should come to lead.
    Failed(Key),
    /// The answer could not be shared: the requests waiting on the key go
    /// to the node themselves.
    Pass(Key),
}

impl Wake {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Wake::Answer(answer) => [&[1u8][..], &answer.encode()].concat(),
            Wake::Failed(key) => [&[2u8][..], key].concat(),
            Wake::Pass(key) => [&[3u8][..], key].concat(),
        }
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let key = |rest: &[u8]| -> Option<Key> {
            let mut key = [0; KEY_LEN];
            (rest.len() == KEY_LEN).then(|| key.copy_from_slice(rest))?;
            Some(key)
        };
        match bytes.split_first()? {
            (1, rest) => Answer::decode(rest).map(Wake::Answer),
            (2, rest) => key(rest).map(Wake::Failed),
            (3, rest) => key(rest).map(Wake::Pass),
            _ => None,
        }
    }
}

/// A request held for an answer, as the registry lends it: its stream's
/// context id and its place.
pub type Held<'a> = (u32, &'a mut Place);

/// This VM's coalescing: its leaders' callouts at the node, by token.
#[derive(Debug, Default)]
pub struct Coalescer {
    callouts: HashMap<u32, Led>,
}

impl Coalescer {
    /// The callout of the request at `place` went out as `token` at
    /// `now_us`: it holds the key's lead and the slot until it ends.
    pub fn sent(&mut self, w: &GateWorker, token: u32, place: &mut Place, now_us: u64) {
        if let Some(led) = place.led(w, now_us) {
            self.callouts.insert(token, led);
        }
    }

    /// Callout `token` ended, with the node's response or without one.
    pub fn callout_ended(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        token: u32,
        response: Option<Response>,
        held: &mut [Held<'_>],
    ) -> Acts {
        let mut step = Step::new(w, store, now, held);
        step.callout_ended(self, token, response);
        step.acts
    }

    /// The host refused the callout of stream `id` (`status`, as the host
    /// said it): it goes through the route as it is, and the key is led by
    /// someone else.
    pub fn lead_refused(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        id: u32,
        status: &str,
        held: &mut [Held<'_>],
    ) -> Acts {
        w.counts.dedup.callouts_failed += 1;
        let cluster = w
            .dedup
            .as_ref()
            .map(|d| d.policy().upstream.cluster.clone())
            .unwrap_or_default();
        w.note_once(&format!(
            "a dedup leader's callout to cluster {cluster:?} was refused ({status}): its request goes through the route uncoalesced; check dedup.upstream.cluster"
        ));
        let mut step = Step::new(w, store, now, held);
        let Some((_, place)) = step.held.iter_mut().find(|(i, _)| *i == id) else {
            return step.acts;
        };
        let Some(pending) = place.stop_leading() else {
            return step.acts;
        };
        step.acts.acts.push((id, Act::Resume));
        step.finish_lead(pending, None, Reuse::No, Some(id));
        step.acts
    }

    /// A wake message from another VM (or this one).
    pub fn woken(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        message: &[u8],
        held: &mut [Held<'_>],
    ) -> Acts {
        let mut step = Step::new(w, store, now, held);
        match Wake::decode(message) {
            Some(Wake::Answer(answer)) => step.answer_all(&answer),
            Some(Wake::Failed(key)) => {
                if step.waits_here(&key) {
                    step.w.counts.dedup.woken_by_failure += 1;
                    step.check_again(&key);
                }
            }
            Some(Wake::Pass(key)) => step.pass_all(&key),
            None => step
                .w
                .note("a wake message this module cannot read was dropped"),
        }
        step.acts
    }

    /// The heartbeat: held requests past their deadline get 504; callouts
    /// past their timeout (Envoy may queue one for a cluster with no
    /// healthy host, and then its timeout never fires) count as failed;
    /// and each key waited for here is checked again, once per heartbeat,
    /// in case its wake was lost.
    pub fn heartbeat(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        held: &mut [Held<'_>],
    ) -> Acts {
        let now_ms = now.ms();
        let stuck: Vec<u32> = self
            .callouts
            .iter()
            .filter(|(_, led)| {
                now_ms
                    > (led.started_us / 1000)
                        .saturating_add(led.timeout_ms)
                        .saturating_add(5000)
            })
            .map(|(token, _)| *token)
            .collect();
        // Each ended callout's step is its own; the first wake message of
        // them is sent.
        let mut acts = Acts::default();
        for token in stuck {
            let mut step = Step::new(w, store, now, held);
            step.callout_ended(self, token, None);
            acts.acts.extend(step.acts.acts);
            acts.wake = acts.wake.or(step.acts.wake);
        }
        let mut step = Step::new(w, store, now, held);
        step.acts = acts;
        step.expire(now_ms);
        step.check_due(now_ms);
        step.acts
    }
}

/// One coalescing step: the worker, the store, the clock and the held
/// places it may settle, and what it has decided so far.
struct Step<'s, 'p, S: SharedStore> {
    w: &'s mut GateWorker,
    store: &'s S,
    now: &'s mut Now,
    held: &'s mut [Held<'p>],
    acts: Acts,
    /// With `nodeTime`, the node's time on the callout whose answer is
    /// being handed out, for its leader here (`Place::answer`).
    led: Option<LedTime>,
    /// The node answered a read pinned to the head's hash with an error or
    /// `null`: every request on its key, the leader too, goes on at
    /// `latest` as it came (a node behind the head does not know the hash
    /// yet; an error at `latest` is the client's to see from the node).
    unpin: bool,
}

impl<'s, 'p, S: SharedStore> Step<'s, 'p, S> {
    fn new(
        w: &'s mut GateWorker,
        store: &'s S,
        now: &'s mut Now,
        held: &'s mut [Held<'p>],
    ) -> Self {
        Self {
            w,
            store,
            now,
            held,
            acts: Acts::default(),
            led: None,
            unpin: false,
        }
    }

    /// Whether a request here waits on `key`.
    fn waits_here(&self, key: &Key) -> bool {
        self.held
            .iter()
            .any(|(_, p)| p.held_for().is_some_and(|w| w.key == *key))
    }

    /// Callout `token` of `coalescer` ended, with `response` or none.
    fn callout_ended(&mut self, coalescer: &mut Coalescer, token: u32, response: Option<Response>) {
        let Some(led) = coalescer.callouts.remove(&token) else {
            return;
        };
        if let Some(ticket) = led.ticket {
            self.w.release(ticket);
        }
        if self.w.gate.policy().node_time.is_some() {
            self.led = response.as_ref().map(|r| LedTime {
                us: r
                    .said_us
                    .unwrap_or_else(|| self.now.us().saturating_sub(led.started_us)),
                said: r.said_us.is_some(),
            });
        }
        let answer = response.map(|r| r.answer(led.pending.key, led.ids));
        if answer.as_ref().is_none_or(|a| a.status >= 500) {
            self.w.counts.dedup.callouts_failed += 1;
        }
        self.unpin = led.pinned
            && answer
                .as_ref()
                .is_some_and(|a| a.status < 500 && !a.found());
        self.finish_lead(led.pending, answer, led.reuse, None);
    }

    /// Held requests past their deadline get 504.
    fn expire(&mut self, now_ms: u64) {
        for (id, place) in self.held.iter_mut() {
            if let Some(reply) = place.expire(self.w, self.store, now_ms) {
                self.acts.acts.push((*id, Act::Answer(reply)));
            }
        }
    }

    /// Each key waited for here, not checked for a heartbeat, is checked
    /// again.
    fn check_due(&mut self, now_ms: u64) {
        let every_ms = self.w.gate.policy().heartbeat_ms;
        let due: Vec<Key> = self
            .held
            .iter()
            .filter_map(|(_, p)| p.held_for())
            .filter(|w| !w.leads && now_ms.saturating_sub(w.checked_ms) >= every_ms)
            .map(|w| w.key)
            .collect();
        let mut checked: Vec<Key> = Vec::new();
        for key in due {
            if !checked.contains(&key) {
                checked.push(key);
                self.check_again(&key);
            }
        }
    }

    /// The requests here waiting on `key`, other than `resumed`.
    fn waiting_on(&self, key: &Key, resumed: Option<u32>) -> u32 {
        self.held
            .iter()
            .filter(|(i, p)| Some(*i) != resumed && p.held_for().is_some_and(|w| w.key == *key))
            .count() as u32
    }

    /// A leader's call ended with `answer` (`None`: no answer); a found
    /// answer that `reuse` allows serves identical ones for `windowMs`.
    /// `resumed`: the leader's stream, which goes on through the route
    /// instead.
    fn finish_lead(
        &mut self,
        pending: Pending,
        answer: Option<Answer>,
        reuse: Reuse,
        resumed: Option<u32>,
    ) {
        let Some(dedup) = self.w.dedup.clone() else {
            return;
        };
        let key = pending.key;
        let shared = !self.unpin && answer.as_ref().is_some_and(Answer::shareable);
        let (outcome, settled, can_lead) = match &answer {
            Some(a) if a.status < 500 && !shared => self.unshared(a),
            Some(a) if a.status < 500 => {
                let n = self.waiting_on(&key, resumed);
                self.answer_all(a);
                (self.keeps(a, reuse, dedup.policy().max_answer_bytes), n, 0)
            }
            failed => {
                let settled = u32::from(resumed.is_some())
                    + self.fail_leaders(failed.as_ref(), &key, resumed);
                (Outcome::Failed, settled, self.waiting_on(&key, resumed))
            }
        };
        let now_ms = self.now.ms();
        let completed =
            match dedup.complete(self.store, &pending, outcome, settled, can_lead, now_ms) {
                Ok((completed, retries)) => {
                    self.w.counts.store.retried(retries);
                    completed
                }
                Err(e) => {
                    self.w.note_store_error("dedup completion", &e);
                    // The waiters here check again on the heartbeat.
                    Completed::Done
                }
            };
        match completed {
            Completed::Share { remote, keep } => {
                if let (Some(slot), Some(a)) = (keep, &answer) {
                    match dedup.keep(self.store, slot, a) {
                        Ok(()) => self.w.counts.dedup.kept += 1,
                        Err(e) => self.w.note_store_error("keeping an answer", &e),
                    }
                }
                if remote > 0 {
                    self.acts.wake = match answer {
                        Some(a) if shared => Some(Wake::Answer(a).encode()),
                        _ => Some(Wake::Pass(key).encode()),
                    };
                }
            }
            Completed::LeadHere(pending) => self.lead_here(pending),
            Completed::Orphaned => self.acts.wake = Some(Wake::Failed(key).encode()),
            Completed::Done => {}
        }
    }

    /// An answer only its own client can read with its ids: the leader
    /// here gets it, the others go to the node themselves. (An answer to a
    /// read unpinned: the leader goes too, `unpin`.)
    fn unshared(&mut self, a: &Answer) -> (Outcome, u32, u32) {
        match self.unpin {
            true => self.w.counts.cache.head_unpinned += 1,
            false => self.w.counts.dedup.unshared += 1,
        }
        let n = self.waiting_on(&a.key, None);
        for (id, place) in self.held.iter_mut() {
            if place.held_for().is_some_and(|w| w.leads && w.key == a.key) {
                let act = match self.unpin {
                    true => place.pass(self.w, self.store, self.now),
                    false => {
                        let now_ms = self.now.ms();
                        Act::Answer(place.answer(self.w, self.store, now_ms, a, self.led))
                    }
                };
                self.acts.acts.push((*id, act));
            }
        }
        self.pass_all(&a.key);
        let keep = Outcome::Answered {
            keep: false,
            reuse: false,
        };
        (keep, n, 0)
    }

    /// Whether a good answer is kept for retries, and served again.
    fn keeps(&mut self, a: &Answer, reuse: Reuse, max_answer_bytes: u64) -> Outcome {
        if a.body.len() as u64 > max_answer_bytes {
            // Too large to share or keep: the other VMs' waiters lead in
            // turn.
            return Outcome::Failed;
        }
        let finalized = match reuse {
            Reuse::OnceFinal if a.found() => self.w.finalized(self.store, self.now.ms()),
            _ => None,
        };
        let reuse = reuse.allows(a, finalized);
        Outcome::Answered { keep: true, reuse }
    }

    /// The leaders here of `key` (other than `resumed`) get the failure;
    /// returns how many.
    fn fail_leaders(&mut self, failed: Option<&Answer>, key: &Key, resumed: Option<u32>) -> u32 {
        let mut n = 0;
        for (id, place) in self.held.iter_mut() {
            if Some(*id) != resumed && place.held_for().is_some_and(|w| w.leads && w.key == *key) {
                let reply = place.failed(failed);
                self.acts.acts.push((*id, Act::Answer(reply)));
                n += 1;
            }
        }
        n
    }

    /// Hands `pending` to the first request here that waits on its key.
    fn lead_here(&mut self, pending: Pending) {
        let key = pending.key;
        let Some(at) = self.first_waiter(&key) else {
            return;
        };
        self.lead_at(pending, at);
    }

    /// The first request here waiting (not leading) on `key`.
    fn first_waiter(&self, key: &Key) -> Option<usize> {
        self.held
            .iter()
            .position(|(_, p)| p.held_for().is_some_and(|w| !w.leads && w.key == *key))
    }

    /// The request at `held[at]` leads `pending` after a failed or lost
    /// leader.
    fn lead_at(&mut self, pending: Pending, at: usize) {
        self.w.counts.dedup.handed_over += 1;
        let (id, place) = &mut self.held[at];
        let id = *id;
        match place.lead(self.w, self.store, self.now, pending) {
            Ok(callout) => self.acts.acts.push((id, Act::Dispatch(callout))),
            Err((reply, pending)) => {
                // The gate is full: this one is refused, the next leads.
                self.acts.acts.push((id, Act::Answer(reply)));
                self.finish_lead(pending, None, Reuse::No, Some(id));
            }
        }
    }

    /// Every request here waiting on the answer's key gets it.
    fn answer_all(&mut self, answer: &Answer) {
        for (id, place) in self.held.iter_mut() {
            if place.held_for().is_some_and(|w| w.key == answer.key) {
                let reply = place.answer(self.w, self.store, self.now.ms(), answer, self.led);
                self.acts.acts.push((*id, Act::Answer(reply)));
            }
        }
    }

    /// Checks `key` in the table again for the requests here waiting on
    /// it: one of them may lead, or take a kept answer for all of them.
    fn check_again(&mut self, key: &Key) {
        let (Some(dedup), Some(vm)) = (self.w.dedup.clone(), self.w.gate.vm()) else {
            return;
        };
        let Some(at) = self.first_waiter(key) else {
            return;
        };
        let now_ms = self.now.ms();
        for (_, place) in self.held.iter_mut() {
            place.checked(key, now_ms);
        }
        let checked = match dedup.check(self.store, key, vm, now_ms, true) {
            Ok(checked) => checked,
            Err(e) => {
                self.w
                    .note_store_error("dedup check of a waiting request", &e);
                return;
            }
        };
        self.w.counts.store.retried(checked.cas_retries);
        self.w.counts.dedup.purged += checked.purged;
        match checked.verdict {
            Verdict::Wait => {}
            Verdict::Lead(pending) => self.lead_at(pending, at),
            Verdict::Take(slot) => match dedup.take(self.store, slot, key) {
                Ok(Some(answer)) => {
                    self.w.counts.dedup.taken += 1;
                    self.answer_all(&answer);
                }
                _ => self.pass_all(key),
            },
            Verdict::Refuse(_) | Verdict::TableFull => self.pass_all(key),
        }
    }

    /// The requests here waiting on `key` go through the route as they are.
    fn pass_all(&mut self, key: &Key) {
        for (id, place) in self.held.iter_mut() {
            if place.held_for().is_some_and(|w| !w.leads && w.key == *key) {
                let act = place.pass(self.w, self.store, self.now);
                self.acts.acts.push((*id, act));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_messages_round_trip() {
        let answer = Answer {
            key: [5; KEY_LEN],
            status: 200,
            content_type: "application/json".into(),
            content_encoding: None,
            ids: vec![Some(b"1".to_vec())],
            body: b"{}".to_vec(),
        };
        for wake in [
            Wake::Answer(answer),
            Wake::Failed([9; KEY_LEN]),
            Wake::Pass([8; KEY_LEN]),
        ] {
            assert_eq!(Wake::decode(&wake.encode()), Some(wake));
        }
        assert_eq!(Wake::decode(&[2, 1, 2]), None);
        assert_eq!(Wake::decode(&[]), None);
    }
}
