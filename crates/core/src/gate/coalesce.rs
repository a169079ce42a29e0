//! Coalescing at the gate: what a VM does with the requests it holds for
//! an answer (`dedup` has the shared table and the rules).
//!
//! A held request is `Waiting`. The glue keeps the list of this VM's held
//! streams and hands it to the functions here whenever something can
//! settle them: the leader's callout ended (`callout_ended`), a wake
//! message came on this VM's queue (`woken`), or the heartbeat
//! (`heartbeat`: deadlines, callouts that never ended, and a check of the
//! table for waiters whose wake may have been lost). Each returns `Acts`:
//! per stream, answer it, send its callout, or let it pass; and at most
//! one wake message for the other gate VMs.

use super::stream::{GateStream, GateWorker};
use super::Ticket;
use crate::clock::Now;
use crate::dedup::answer::{Answer, Id};
use crate::dedup::key::{Key, KEY_LEN};
use crate::dedup::{Completed, Outcome, Pending, Reuse, Verdict};
use crate::rejection::json_rpc_error_body;
use crate::shared::SharedStore;

/// Where the leader's request goes: the client's `:path` and `:authority`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target {
    pub path: String,
    pub authority: String,
}

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
}

/// An HTTP callout to make from the root context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub cluster: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// An answer for a held request: status, headers (the content type; the
/// encoding of an encoded answer its own client is given; a refusal's
/// `retry-after` and its own) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// A JSON body.
    pub fn json(status: u32, body: Vec<u8>) -> Self {
        Self {
            status,
            headers: vec![("content-type", "application/json".into())],
            body,
        }
    }

    /// A refusal, as a held request's answer: the same headers as any.
    pub fn refusal(refusal: crate::rejection::Rejection) -> Self {
        let mut reply = Self::json(refusal.status, refusal.body.into_bytes());
        if refusal.retry_after_s > 0 {
            reply
                .headers
                .push(("retry-after", refusal.retry_after_s.to_string()));
        }
        reply.headers.extend(refusal.headers);
        reply
    }

    /// The node's answer, with the body given.
    pub fn answer(answer: &Answer, body: Vec<u8>) -> Self {
        let mut headers = vec![("content-type", answer.content_type.clone())];
        if let Some(encoding) = &answer.content_encoding {
            headers.push(("content-encoding", encoding.clone()));
        }
        Self {
            status: answer.status,
            headers,
            body,
        }
    }
}

/// What to do with a held stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    Answer(Reply),
    /// Send this callout (from the root context); then `GateStream::led`
    /// with its token, or `lead_refused` if the host refused it.
    Dispatch(Callout),
    /// Let it go on through the route, uncoalesced.
    Resume,
}

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
}

/// A callout at the node: what its end completes.
#[derive(Debug)]
pub struct Led {
    pub(super) pending: Pending,
    pub(super) ids: Vec<Id>,
    /// The leader's gate slot, held until the callout ends.
    pub(super) ticket: Option<Ticket>,
    pub(super) started_ms: u64,
    pub(super) timeout_ms: u64,
    pub(super) reuse: Reuse,
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

/// A held stream, as the glue lends it: its context id and the stream.
pub type Held<'a> = (u32, &'a mut GateStream);

/// The answer to a request that got none: 502, a JSON-RPC error with its
/// own id(s).
pub(super) fn no_answer(ids: &[Id], message: &str) -> Reply {
    let errors: Vec<String> = ids
        .iter()
        .flatten()
        .map(|id| json_rpc_error_body(std::str::from_utf8(id).ok(), -32603, message))
        .collect();
    let body = match errors.as_slice() {
        [one] if ids.len() == 1 => one.clone(),
        [] => json_rpc_error_body(None, -32603, message),
        _ => format!("[{}]", errors.join(",")),
    };
    Reply::json(502, body.into_bytes())
}

impl GateWorker {
    /// Callout `token` ended, with the node's response or without one.
    pub fn callout_ended(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        token: u32,
        response: Option<Response>,
        held: &mut [Held<'_>],
    ) -> Acts {
        let Some(led) = self.callouts.remove(&token) else {
            return Acts::default();
        };
        if let Some(ticket) = led.ticket {
            self.release(ticket);
        }
        let answer = response.map(|r| Answer {
            key: led.pending.key,
            status: r.status,
            content_type: r.content_type,
            content_encoding: r.content_encoding,
            ids: led.ids,
            body: r.body,
        });
        if answer.as_ref().is_none_or(|a| a.status >= 500) {
            self.counts.dedup.callouts_failed += 1;
        }
        let mut acts = Acts::default();
        let (pending, reuse) = (led.pending, led.reuse);
        self.finish_lead(store, now, pending, answer, reuse, None, held, &mut acts);
        acts
    }

    /// The host refused the callout of stream `id`: it goes through the
    /// route as it is, and the key is led by someone else.
    pub fn lead_refused(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        id: u32,
        held: &mut [Held<'_>],
    ) -> Acts {
        self.counts.dedup.callouts_failed += 1;
        let mut acts = Acts::default();
        let Some((_, stream)) = held.iter_mut().find(|(i, _)| *i == id) else {
            return acts;
        };
        let Some(pending) = stream.stop_leading() else {
            return acts;
        };
        acts.acts.push((id, Act::Resume));
        self.finish_lead(
            store,
            now,
            pending,
            None,
            Reuse::No,
            Some(id),
            held,
            &mut acts,
        );
        acts
    }

    /// A wake message from another VM (or this one).
    pub fn woken(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        message: &[u8],
        held: &mut [Held<'_>],
    ) -> Acts {
        let mut acts = Acts::default();
        match Wake::decode(message) {
            Some(Wake::Answer(answer)) => self.answer_all(&answer, held, &mut acts),
            Some(Wake::Failed(key)) => {
                if held
                    .iter()
                    .any(|(_, s)| s.held_for().is_some_and(|w| w.key == key))
                {
                    self.counts.dedup.woken_by_failure += 1;
                    self.check_again(store, now, &key, held, &mut acts);
                }
            }
            Some(Wake::Pass(key)) => self.pass_all(store, now, &key, held, &mut acts),
            None => self.note("a wake message this module cannot read was dropped"),
        }
        acts
    }

    /// The heartbeat: held requests past their deadline get 504; callouts
    /// past their timeout (Envoy may queue one for a cluster with no
    /// healthy host, and then its timeout never fires) count as failed;
    /// and each key waited for here is checked again, once per heartbeat,
    /// in case its wake was lost.
    pub fn heartbeat(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        held: &mut [Held<'_>],
    ) -> Acts {
        let mut acts = Acts::default();
        let now_ms = now.ms();
        let stuck: Vec<u32> = self
            .callouts
            .iter()
            .filter(|(_, led)| {
                now_ms
                    > led
                        .started_ms
                        .saturating_add(led.timeout_ms)
                        .saturating_add(5000)
            })
            .map(|(token, _)| *token)
            .collect();
        for token in stuck {
            let ended = self.callout_ended(store, now, token, None, held);
            acts.acts.extend(ended.acts);
            acts.wake = acts.wake.or(ended.wake);
        }
        for (id, stream) in held.iter_mut() {
            if let Some(reply) = stream.expire(self, store, now_ms) {
                acts.acts.push((*id, Act::Answer(reply)));
            }
        }
        let every_ms = self.gate.policy().heartbeat_ms;
        let due: Vec<Key> = held
            .iter()
            .filter_map(|(_, s)| s.held_for())
            .filter(|w| !w.leads && now_ms.saturating_sub(w.checked_ms) >= every_ms)
            .map(|w| w.key)
            .collect();
        let mut checked: Vec<Key> = Vec::new();
        for key in due {
            if !checked.contains(&key) {
                checked.push(key);
                self.check_again(store, now, &key, held, &mut acts);
            }
        }
        acts
    }

    /// A leader's call ended with `answer` (`None`: no answer); a found
    /// answer that `reuse` allows serves identical ones for `windowMs`.
    /// `resumed`: the leader's stream, which goes on through the route
    /// instead.
    #[allow(clippy::too_many_arguments)]
    fn finish_lead(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        pending: Pending,
        answer: Option<Answer>,
        reuse: Reuse,
        resumed: Option<u32>,
        held: &mut [Held<'_>],
        acts: &mut Acts,
    ) {
        let Some(dedup) = self.dedup.clone() else {
            return;
        };
        let key = pending.key;
        let max_answer = dedup.policy().max_answer_bytes;
        let here = |held: &[Held<'_>]| {
            held.iter()
                .filter(|(i, s)| Some(*i) != resumed && s.held_for().is_some_and(|w| w.key == key))
                .count() as u32
        };
        let shared = answer.as_ref().is_some_and(Answer::shareable);
        let (outcome, settled, can_lead) = match &answer {
            Some(a) if a.status < 500 && !shared => {
                // Only its own client can read it with its ids: the others
                // go to the node themselves.
                self.counts.dedup.unshared += 1;
                let n = here(held);
                for (id, stream) in held.iter_mut() {
                    if stream.held_for().is_some_and(|w| w.leads && w.key == key) {
                        let reply = stream.answer(self, a);
                        acts.acts.push((*id, Act::Answer(reply)));
                    }
                }
                self.pass_all(store, now, &key, held, acts);
                let keep = Outcome::Answered {
                    keep: false,
                    reuse: false,
                };
                (keep, n, 0)
            }
            Some(a) if a.status < 500 => {
                let n = here(held);
                self.answer_all(a, held, acts);
                if a.body.len() as u64 <= max_answer {
                    let finalized = match reuse {
                        Reuse::OnceFinal if a.found() => self.finalized(store, now.ms()),
                        _ => None,
                    };
                    let reuse = reuse.allows(a, finalized);
                    (Outcome::Answered { keep: true, reuse }, n, 0)
                } else {
                    // Too large to share or keep: the other VMs' waiters
                    // lead in turn.
                    (Outcome::Failed, n, 0)
                }
            }
            failed => {
                let mut settled = u32::from(resumed.is_some());
                for (id, stream) in held.iter_mut() {
                    if Some(*id) != resumed
                        && stream.held_for().is_some_and(|w| w.leads && w.key == key)
                    {
                        let reply = stream.failed(failed.as_ref());
                        acts.acts.push((*id, Act::Answer(reply)));
                        settled += 1;
                    }
                }
                (Outcome::Failed, settled, here(held))
            }
        };
        let completed = match dedup.complete(store, &pending, outcome, settled, can_lead, now.ms())
        {
            Ok((completed, retries)) => {
                self.counts.store.retried(retries);
                completed
            }
            Err(e) => {
                self.note_store_error("dedup completion", &e);
                // The waiters here check again on the heartbeat.
                Completed::Done
            }
        };
        match completed {
            Completed::Share { remote, keep } => {
                if let (Some(slot), Some(a)) = (keep, &answer) {
                    match dedup.keep(store, slot, a) {
                        Ok(()) => self.counts.dedup.kept += 1,
                        Err(e) => self.note_store_error("keeping an answer", &e),
                    }
                }
                if remote > 0 {
                    acts.wake = match answer {
                        Some(a) if shared => Some(Wake::Answer(a).encode()),
                        _ => Some(Wake::Pass(key).encode()),
                    };
                }
            }
            Completed::LeadHere(pending) => self.lead_here(store, now, pending, held, acts),
            Completed::Orphaned => acts.wake = Some(Wake::Failed(key).encode()),
            Completed::Done => {}
        }
    }

    /// Hands `pending` to the first request here that waits on its key.
    fn lead_here(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        pending: Pending,
        held: &mut [Held<'_>],
        acts: &mut Acts,
    ) {
        let key = pending.key;
        let Some(at) = held
            .iter()
            .position(|(_, s)| s.held_for().is_some_and(|w| !w.leads && w.key == key))
        else {
            return;
        };
        self.lead_at(store, now, pending, at, held, acts);
    }

    /// The request at `held[at]` leads `pending` after a failed or lost
    /// leader.
    fn lead_at(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        pending: Pending,
        at: usize,
        held: &mut [Held<'_>],
        acts: &mut Acts,
    ) {
        self.counts.dedup.handed_over += 1;
        let (id, stream) = &mut held[at];
        let id = *id;
        match stream.lead(self, store, now, pending) {
            Ok(callout) => acts.acts.push((id, Act::Dispatch(callout))),
            Err((reply, pending)) => {
                // The gate is full: this one is refused, the next leads.
                acts.acts.push((id, Act::Answer(reply)));
                self.finish_lead(store, now, pending, None, Reuse::No, Some(id), held, acts);
            }
        }
    }

    /// Every request here waiting on the answer's key gets it.
    fn answer_all(&mut self, answer: &Answer, held: &mut [Held<'_>], acts: &mut Acts) {
        for (id, stream) in held.iter_mut() {
            if stream.held_for().is_some_and(|w| w.key == answer.key) {
                let reply = stream.answer(self, answer);
                acts.acts.push((*id, Act::Answer(reply)));
            }
        }
    }

    /// Checks `key` in the table again for the requests here waiting on
    /// it: one of them may lead, or take a kept answer for all of them.
    fn check_again(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        key: &Key,
        held: &mut [Held<'_>],
        acts: &mut Acts,
    ) {
        let (Some(dedup), Some(vm)) = (self.dedup.clone(), self.gate.vm()) else {
            return;
        };
        let Some(at) = held
            .iter()
            .position(|(_, s)| s.held_for().is_some_and(|w| !w.leads && w.key == *key))
        else {
            return;
        };
        let now_ms = now.ms();
        for (_, stream) in held.iter_mut() {
            stream.checked(key, now_ms);
        }
        let checked = match dedup.check(store, key, vm, now_ms, true) {
            Ok(checked) => checked,
            Err(e) => {
                self.note_store_error("dedup check of a waiting request", &e);
                return;
            }
        };
        self.counts.store.retried(checked.cas_retries);
        self.counts.dedup.purged += checked.purged;
        match checked.verdict {
            Verdict::Wait => {}
            Verdict::Lead(pending) => self.lead_at(store, now, pending, at, held, acts),
            Verdict::Take(slot) => match dedup.take(store, slot, key) {
                Ok(Some(answer)) => {
                    self.counts.dedup.taken += 1;
                    self.answer_all(&answer, held, acts);
                }
                _ => self.pass_all(store, now, key, held, acts),
            },
            Verdict::Refuse(_) | Verdict::TableFull => self.pass_all(store, now, key, held, acts),
        }
    }

    /// The requests here waiting on `key` go through the route as they are.
    fn pass_all(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        key: &Key,
        held: &mut [Held<'_>],
        acts: &mut Acts,
    ) {
        for (id, stream) in held.iter_mut() {
            if stream.held_for().is_some_and(|w| !w.leads && w.key == *key) {
                let act = stream.pass(self, store, now);
                acts.acts.push((*id, act));
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

    #[test]
    fn a_request_that_got_no_answer_gets_a_json_rpc_error_with_its_ids() {
        let one = no_answer(&[Some(b"7".to_vec())], "x");
        assert_eq!(one.status, 502);
        let body: serde_json::Value = serde_json::from_slice(&one.body).unwrap();
        assert_eq!(
            (body["id"].clone(), body["error"]["code"].clone()),
            (7.into(), (-32603).into())
        );
        let batch = no_answer(&[Some(b"1".to_vec()), None, Some(b"\"b\"".to_vec())], "x");
        let body: serde_json::Value = serde_json::from_slice(&batch.body).unwrap();
        assert_eq!(body.as_array().unwrap().len(), 2);
    }
}
