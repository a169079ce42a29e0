//! A request held at the gateway, as the registry reaches it: whether it
//! waits for an answer, whether it goes first, and the holding bounds
//! (`gate::holds`) it is counted against or refused by.

use super::{GateStream, State};
use crate::gate::class::RequestClass;
use crate::gate::shards::SlotKind;
use crate::gate::worker::GateWorker;
use crate::rejection::Rejection;
use crate::shared::SharedStore;

impl GateStream {
    /// Whether it is of the priority class (its waiting goes first).
    pub fn priority(&self) -> bool {
        match &self.state {
            State::Http(request) => request.place.class == RequestClass::Priority,
            State::Websocket(ws) => ws.kind() == SlotKind::Priority,
            State::Idle | State::Tunnel(_) => false,
        }
    }

    /// Whether it is held for an answer.
    pub fn coalesced(&self) -> bool {
        matches!(&self.state, State::Http(request) if request.place.held_for().is_some())
    }

    /// Stream `id` is to be held: counted, or refused past a bound, with
    /// what it waited for given up and the refusal answering its `body`.
    /// `identity` (stake QoS's name for its caller) is read only if needed.
    pub fn hold(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        id: u32,
        identity: impl FnOnce() -> Option<u64>,
        body: impl FnOnce() -> Vec<u8>,
    ) -> Result<(), Rejection> {
        let State::Http(request) = &mut self.state else {
            return Ok(());
        };
        let Err(refusal) = w.hold(id, request.place.class, identity) else {
            return Ok(());
        };
        if let Some(metered) = request.metered.as_mut().filter(|m| m.waits()) {
            metered.waiting = None;
            w.stop_waiting();
        }
        request.place.give_up(w, store);
        Err(refusal.answering(&body()))
    }
}
