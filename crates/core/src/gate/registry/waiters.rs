//! Requests waiting for a slot across the VMs (`nodeTime.waitMs`): each VM
//! says in shared data the turn of the waiter it would serve first, its
//! class and deadline (`node_time::Waiters`), and a VM whose first waiter
//! comes after another's gives its spare slots back and wakes that one.

use super::{Do, Registry};
use crate::clock::Now;
use crate::gate::node_time::{Turn, Waiters, SLOT_WAKE, WAITERS_KEY, WAIT_TICK_MS};
use crate::shared::{read, update, Change, SharedStore};

impl<S: SharedStore> Registry<S> {
    /// Whether requests may wait for a slot (`nodeTime.waitMs`).
    pub(super) fn slots_wait(&self) -> bool {
        let policy = self.worker.gate.policy();
        policy.node_time.as_ref().is_some_and(|n| n.wait_ms > 0)
    }

    /// The turn of this VM's first waiting request (of those that wait
    /// for a slot by `nodeTime.waitMs`): priority first, then oldest.
    fn first_turn(&self) -> Option<Turn> {
        self.waiting
            .iter()
            .filter_map(|id| {
                let stream = self.streams.get(id)?;
                Some(Turn::new(stream.priority(), stream.waits_until()?))
            })
            .min()
    }

    /// Says in shared data whose turn this VM's first waiting request is
    /// (when that changed), so that the other VMs serve priority and then
    /// the oldest first, and wake this one when they free a slot it should
    /// have.
    pub(super) fn announce(&mut self) {
        let oldest = self.first_turn();
        let Some(vm) = self.worker.gate.vm() else {
            return;
        };
        if oldest == self.announced {
            return;
        }
        let updated = update(&self.store, WAITERS_KEY, |w: &mut Waiters| {
            w.set(vm, oldest);
            Change::Write(())
        });
        match updated {
            Ok(u) => {
                self.worker.counts.store.retried(u.retries);
                self.announced = oldest;
            }
            Err((e, _)) => self
                .worker
                .note_store_error("announcing waiting requests", &e),
        }
    }

    /// Whether another VM's first waiting request goes before this VM's
    /// (a priority one before a default one, else the older); if so, this VM's spare slots go back to the shared pool and
    /// those VMs are woken to take them (if there were any).
    ///
    /// The waiters record is read at a tick (`tick`), at most once a wait
    /// tick; a release, which every request makes, goes by the record the
    /// last tick read (at most a wait tick old, as before), with no clock
    /// read and nothing to do while no VM has a request waiting.
    pub(super) fn defer_to_first(&mut self, now: &mut Now, tick: bool) -> bool {
        let Some(me) = self.worker.gate.vm() else {
            return false;
        };
        let ttl_ms = self.worker.gate.policy().stale_slot_ttl_ms;
        let stale = match &self.waiters_seen {
            Some((at, _)) => tick && now.ms().saturating_sub(*at) >= WAIT_TICK_MS,
            None => true,
        };
        if stale {
            let now_ms = now.ms();
            match read::<Waiters>(&self.store, WAITERS_KEY) {
                Ok((waiters, _)) => self.waiters_seen = Some((now_ms, waiters)),
                Err(e) => {
                    self.worker.note_store_error("reading waiting requests", &e);
                    return false;
                }
            }
        }
        let ahead = match &self.waiters_seen {
            Some((at, waiters)) if !waiters.is_empty() => {
                waiters.ahead(me, self.first_turn(), *at, ttl_ms)
            }
            _ => return false,
        };
        if ahead.is_empty() {
            return false;
        }
        match self.worker.gate.give_back(&self.store, now.ms()) {
            Ok(Some(retries)) => {
                self.worker.counts.store.retried(retries);
                self.todo.push(Do::Wake(ahead, SLOT_WAKE.to_vec()));
            }
            Ok(None) => {}
            Err(e) => self.worker.note_store_error("giving spare slots back", &e),
        }
        true
    }
}
