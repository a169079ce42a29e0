//! An HTTP request that finds the gate full (`nodeTime.waitMs`): it waits
//! for a slot, or is refused; once it has one, coalescing checks it.

use super::{HttpRequest, OnBody, Settled};
use crate::clock::Now;
use crate::gate::node_time::Full;
use crate::gate::worker::GateWorker;
use crate::rejection::Rejection;
use crate::shared::SharedStore;

impl HttpRequest {
    /// The gate is full: with `nodeTime.waitMs` it waits for a slot if
    /// fewer than `maxWaiting` do (its `body` kept for dedup's check, which
    /// comes once it has the slot); else it is refused.
    pub(super) fn refused(
        &mut self,
        w: &mut GateWorker,
        now: &mut Now,
        refusal: Rejection,
        body: Vec<u8>,
    ) -> OnBody {
        let refusal = refusal.answering(&body);
        let wait_ms = w.gate.policy().node_time.as_ref().map_or(0, |n| n.wait_ms);
        match &mut self.metered {
            Some(metered) if wait_ms > 0 && w.start_waiting() => {
                metered.waiting = Some((now.ms().saturating_add(wait_ms), refusal));
                let checks = w.dedup.as_ref().filter(|_| self.dedup_client.is_some());
                if checks.is_some_and(|d| d.fits(body.len() as u64)) {
                    self.checks_later = Some(body);
                }
                OnBody::Hold
            }
            metered => {
                // It would have waited, but `maxWaiting` already do.
                let full = metered.is_some() && wait_ms > 0;
                w.counts.node_time.wait_refused += u64::from(full);
                self.dedup_client = None;
                w.refused(self.place.class, false);
                OnBody::Refuse(refusal)
            }
        }
    }

    /// A request waiting for a slot tries again (`Full` permitting), or
    /// is refused once it has waited `waitMs`.
    pub(super) fn settle(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        full: &mut Full,
    ) -> Settled {
        let Some(metered) = &mut self.metered else {
            return Settled::Through(None);
        };
        let Some((until_ms, _)) = &metered.waiting else {
            return Settled::Through(None);
        };
        let heavy = metered.priced.is_some_and(|p| !p.cheap);
        if full.expire && now.ms() >= *until_ms {
            let refusal = metered.waiting.take().map(|(_, r)| r);
            w.stop_waiting();
            w.counts.node_time.wait_refused += 1;
            w.refused(self.place.class, false);
            return refusal.map_or(Settled::GateFull, Settled::Refuse);
        }
        if full.blocks(heavy) {
            return Settled::GateFull;
        }
        match w.try_admit(store, now, self.place.class, false, heavy) {
            Ok(ticket) => {
                metered.waiting = None;
                w.stop_waiting();
                w.counts.node_time.waited += 1;
                self.slot_taken(w, now, ticket);
                match self.checks_later.take() {
                    Some(body) => Settled::Checked(self.check(w, store, now, body)),
                    None => Settled::Through(None),
                }
            }
            Err(_) => {
                full.found(heavy);
                Settled::GateFull
            }
        }
    }
}
