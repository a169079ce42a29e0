//! One request's way through stake QoS, as the filter's stream sees it:
//! headers (admit or throttle; an admitted upgrade leaves the requests in
//! flight), body (a batch's other calls, or the calls sent on a WebSocket,
//! are charged), response headers (the upstream's status, in reactive mode)
//! and done (the request ends locally). Each step returns what the glue
//! must do or record, so the glue only makes host calls.
//!
//! With `decideOnBody`, a request with a body is admitted when the body is
//! whole (or its trailers arrive), so that a 429 answers each call by its
//! `id`; the identity is still read with the headers. A refused request
//! sent again before its `retry-after` is held until then (`early`), and
//! decided at the tick after (`retry_tick`).
//!
//! Far below the threshold a request is only counted (`light`): no
//! identity, no body read, no clock read; its body's size gives its calls'
//! bound.

use super::early;
use super::identity::{anonymous, identify, staked_by_key, Identity};
use super::ledger::Named;
use super::light::BodyBound;
use super::page::MILLI;
use super::policy::Mode;
use super::socket::{Charged, Socket};
use super::{Admission, Connection, StakeQos, Throttled, Ticket, Verdict};
use crate::clock::Now;
use crate::cost::SocketAnswered;
use crate::cost::Unit;
use crate::jsonrpc;
use crate::rejection::Rule;
use crate::request::{Body, RequestFacts};
use crate::shared::{SharedStore, StoreError};

/// What an admission decided, and what the glue records of it.
#[derive(Debug)]
pub struct Decided {
    /// Answer with this 429 instead of continuing.
    pub throttled: Option<Throttled>,
    /// The identity's tier (for the per-tier counters).
    pub tier: usize,
    /// A shared-bucket lease was taken.
    pub leased: bool,
    pub cas_retries: u32,
    /// An identity was evicted from the shared table to make room.
    pub evicted: bool,
    /// Shared data failed; the request was admitted without a token.
    pub store_error: Option<StoreError>,
    /// Shared data failed while a refusal was remembered, or a request
    /// looked up as a retry (`early`): a retry of it is decided at once.
    pub early_error: Option<StoreError>,
}

/// What a piece of request body asks of the glue.
#[derive(Debug, Default)]
pub struct OnBody {
    /// The admission, when this piece completed a body it waited for.
    pub decided: Option<Decided>,
    /// Hold the body until it is whole (the admission waits for it).
    pub hold: bool,
    /// Hold it as an early retry: the glue asks `retry_tick` at its ticks.
    pub early: bool,
    /// Calls read on a WebSocket.
    pub websocket_calls: u32,
    /// On a WebSocket, what charging its calls did (whether the gate is
    /// to hold its data: `socket`).
    pub socket: Option<Charged>,
}

/// An admitted upgrade.
#[derive(Debug)]
enum Upgraded {
    /// A WebSocket: its calls are the identity's (`socket`). Boxed: the
    /// plain request is the hot path.
    Websocket(Box<Socket>),
    /// Another protocol: unread.
    Tunnel(Connection),
}

/// A refused request sent again before the time its 429 gave, held
/// until then (`early`).
#[derive(Debug)]
struct Held {
    identity: Identity,
    body: Vec<u8>,
    until_ms: u64,
}

/// One stream's state in stake QoS.
#[derive(Debug, Default)]
pub struct QosStream {
    /// An admitted request in flight.
    ticket: Option<Ticket>,
    /// A request whose admission waits for its whole body.
    waiting: Option<Identity>,
    /// An early retry, held.
    held: Option<Box<Held>>,
    /// The body was looked at for a batch.
    charged: bool,
    upstream_status: Option<u32>,
    /// An admitted upgrade: not in flight; a WebSocket's calls are read
    /// from its client frames.
    upgraded: Option<Upgraded>,
    /// Counted without an identity (`light`).
    counted: bool,
    /// Counted, with the staked identity its API key names: the usage
    /// ledger counts its calls and refusals under that name.
    counted_as: Option<Named>,
    /// The rule that refused it further on, as its answer said.
    refused_by: Option<Rule>,
    /// The bound of its calls counted so far.
    bound: BodyBound,
    /// Its caller is in the stake table (the gate's `staked` matcher).
    staked: bool,
}

impl QosStream {
    /// Request headers: the identity, then the admission (`None` while it
    /// waits for the body). An admitted request whose headers do not end it
    /// may be an upgrade (one header read): a WebSocket leaves the
    /// identity's requests in flight at once.
    pub fn headers(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
        facts: &mut impl RequestFacts,
        end_of_stream: bool,
    ) -> Option<Decided> {
        let upgrade = (!end_of_stream).then(|| facts.header("upgrade")).flatten();
        if upgrade.is_none() && qos.counting() {
            self.counted = true;
            let by_key = staked_by_key(qos.policy(), facts);
            self.staked = by_key.is_some();
            self.counted_as = by_key.and_then(|i| Some((i.key, i.name?)));
            qos.count(self.bound.at_least_one(), true, self.counted_as.as_ref());
            return None;
        }
        qos.bound(self.bound.at_least_one());
        let identity = identify(qos.policy(), facts).unwrap_or_else(|| anonymous(qos.policy()));
        self.staked = identity.staked;
        if upgrade.is_none() && !end_of_stream && qos.policy().decide_on_body {
            self.waiting = Some(identity);
            return None;
        }
        let (mut decided, ticket) = admit(qos, store, now.us(), &identity);
        if let Some(ticket) = ticket {
            match upgrade {
                Some(upgrade) => match qos.upgraded(ticket) {
                    Ok(connection) => {
                        self.upgraded = Some(match upgrade.eq_ignore_ascii_case("websocket") {
                            true => {
                                Upgraded::Websocket(Box::new(Socket::new(connection, identity)))
                            }
                            false => Upgraded::Tunnel(connection),
                        });
                    }
                    Err(throttled) => decided.throttled = Some(throttled),
                },
                None => self.ticket = Some(ticket),
            }
        }
        Some(decided)
    }

    /// A piece of request body, `size` bytes. A request waiting for its
    /// admission is held until its body is whole, then admitted; a 429
    /// answers its calls. A batch is charged the calls it holds beyond the
    /// first (behind the buffer filter of the shipped configs the body is
    /// whole here; a body streamed in pieces is charged what its first
    /// piece holds). On a WebSocket, the calls the piece completes are
    /// charged.
    pub fn body(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnBody {
        match &mut self.upgraded {
            Some(Upgraded::Websocket(socket)) => {
                let (calls, charged) = socket.read(qos, store, now.us(), body, size);
                return OnBody {
                    websocket_calls: calls,
                    socket: Some(charged),
                    ..OnBody::default()
                };
            }
            Some(Upgraded::Tunnel(_)) => return OnBody::default(),
            None => {}
        }
        let more = self.bound.grow(size);
        if self.counted {
            qos.count(more, false, None);
            // A staked key's calls, for its ledger row: a batch's are read
            // once (behind the shipped configs' buffer the body is whole).
            if let Some(named) = &self.counted_as {
                if !std::mem::replace(&mut self.charged, true) && size > 0 {
                    qos.count_calls_of(named, batch_calls(body, size));
                }
            }
            return OnBody::default();
        }
        qos.bound(more);
        let mut decided = None;
        if self.waiting.is_some() && !end_of_stream {
            return OnBody {
                hold: true,
                ..OnBody::default()
            };
        }
        if let Some(identity) = self.waiting.take() {
            // Read whole only while QoS throttles (nothing is refused
            // otherwise): to find an early retry, or to answer a 429.
            let bytes = match qos.state().throttling {
                true => body.read(0, size),
                false => Vec::new(),
            };
            let (until_ms, early_error) = match early_until(qos, store, now, &identity, &bytes) {
                Ok(until_ms) => (until_ms, None),
                Err(e) => (None, Some(e)),
            };
            if let Some(until_ms) = until_ms {
                qos.early_held += 1;
                self.held = Some(Box::new(Held {
                    identity,
                    body: bytes,
                    until_ms,
                }));
                return OnBody {
                    hold: true,
                    early: true,
                    ..OnBody::default()
                };
            }
            let mut admitted = self.decide(qos, store, now, &identity, &bytes);
            admitted.early_error = admitted.early_error.or(early_error);
            decided = Some(admitted);
        }
        if let Some(ticket) = &mut self.ticket {
            if !std::mem::replace(&mut self.charged, true) && size > 0 {
                charge(qos, ticket, size, body);
            }
        }
        OnBody {
            decided,
            ..OnBody::default()
        }
    }

    /// Request trailers end the request: an admission waiting for the body
    /// is made now (a 429 answers `id: null`).
    pub fn trailers(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Option<Decided> {
        let identity = self.waiting.take()?;
        Some(self.admit(qos, store, now.us(), &identity))
    }

    fn admit(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now_us: u64,
        identity: &Identity,
    ) -> Decided {
        let (decided, ticket) = admit(qos, store, now_us, identity);
        self.ticket = ticket;
        decided
    }

    /// Admits a request whose body is whole: a 429 answers its calls, and
    /// is remembered until its `retry-after` and a part of the second
    /// after it, set by its hash (`early`; not by a shadow, which refuses
    /// nobody).
    fn decide(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
        identity: &Identity,
        body: &[u8],
    ) -> Decided {
        let mut decided = self.admit(qos, store, now.us(), identity);
        let Some(throttled) = decided.throttled.take() else {
            return decided;
        };
        let rejection = throttled.rejection.answering(body);
        if !qos.policy().shadow {
            // Within the second after its retry-after (whole seconds), by
            // its hash: retries refused together are not decided together.
            let now_ms = now.ms();
            let sent = early::sent(identity.key, body);
            let until_ms = now_ms + 1000 * u64::from(rejection.retry_after_s) + sent % 1000;
            match early::refused(store, sent, until_ms, now_ms) {
                Ok(retries) => decided.cas_retries += retries,
                Err(e) => decided.early_error = Some(e),
            }
        }
        decided.throttled = Some(Throttled {
            rejection,
            ..throttled
        });
        decided
    }

    /// At a tick, an early retry whose time has come is decided (`None`:
    /// none is held, or not yet). Admitted, it is charged its calls.
    pub fn retry_tick(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Option<Decided> {
        if self.held.as_ref()?.until_ms > now.ms() {
            return None;
        }
        let held = self.held.take()?;
        qos.early_held -= 1;
        let decided = self.decide(qos, store, now, &held.identity, &held.body);
        if let Some(ticket) = &mut self.ticket {
            self.charged = true;
            charge(qos, ticket, held.body.len(), &mut held.body.as_slice());
        }
        Some(decided)
    }

    /// Response headers: in reactive mode the upstream's status (503 and
    /// 429 are back-pressure); in the node-time unit, the status and the
    /// time the request took until them (`told_us`: as the admission gate
    /// told it, `cost::NODE_US_PROPERTY`). The status is read only then. In
    /// node time a request counted without an identity reads nothing. With
    /// the usage ledger on, an identified request's answer (or a counted
    /// one's its staked key named) is asked which
    /// rule refused it further on (`rule`, the gate's `x-stakegate-rule`):
    /// if the status was read, only for a 429 or a 503. A shadow does not
    /// ask: its ledger is what it would refuse itself.
    pub fn response_headers(
        &mut self,
        qos: &StakeQos,
        now: &mut Now,
        status: impl FnOnce() -> Option<u32>,
        told_us: impl FnOnce() -> Option<u64>,
        rule: impl FnOnce() -> Option<String>,
    ) {
        let unit = qos.policy().costs.unit;
        if self.counted && unit == Unit::NodeTime && self.counted_as.is_none() {
            return;
        }
        let node_time = unit == Unit::NodeTime && self.ticket.is_some();
        let status_read = qos.policy().mode == Mode::Reactive || node_time;
        if status_read {
            self.upstream_status = status();
        }
        if (self.ticket.is_some() || self.counted_as.is_some())
            && qos.policy().usage_on()
            && !qos.policy().shadow
            && (!status_read || matches!(self.upstream_status, Some(429 | 503)))
        {
            self.refused_by = rule().as_deref().and_then(Rule::from_name);
        }
        if let (Some(ticket), true) = (&mut self.ticket, node_time) {
            let took_us = told_us().unwrap_or_else(|| now.us().saturating_sub(ticket.started_us));
            qos.answered(ticket, took_us, self.upstream_status);
        }
    }

    /// The stream is over: the request ends locally (its place in flight
    /// and its latency, and a refusal further on in the usage ledger), or
    /// an upgraded connection gives back its WebSocket place. Safe to call
    /// more than once.
    pub fn done(&mut self, qos: &mut StakeQos, now: &mut Now) {
        if self.held.take().is_some() {
            qos.early_held -= 1;
        }
        if let (Some(named), Some(rule)) = (self.counted_as.take(), self.refused_by) {
            qos.counted_refused_further(&named, rule);
        }
        if let Some(ticket) = self.ticket.take() {
            if let Some(rule) = self.refused_by.take() {
                qos.refused_further(ticket.key, rule);
            }
            qos.finish(now.ms(), ticket, self.upstream_status);
        }
        match self.upgraded.take() {
            Some(Upgraded::Websocket(socket)) => socket.close(qos),
            Some(Upgraded::Tunnel(connection)) => qos.closed(connection),
            None => {}
        }
    }

    /// At a tick, a WebSocket whose data the gate holds for its identity's
    /// share: its calls go on if they may now (`None`: it is no WebSocket,
    /// or not held).
    pub fn socket_tick(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Option<Charged> {
        match &mut self.upgraded {
            Some(Upgraded::Websocket(socket)) if socket.holding() => {
                Some(socket.tick(qos, store, now.us()))
            }
            _ => None,
        }
    }

    /// Whether its caller is in the stake table, as its headers said: the
    /// glue tells the gate (`request::STAKED_PROPERTY`).
    pub fn staked(&self) -> bool {
        self.staked
    }

    /// Its identity's key, when its headers named one (QoS identifies
    /// callers unless it only counts): the glue tells the gate, which
    /// bounds an identity's subscriptions and held requests by it
    /// (`request::IDENTITY_PROPERTY`).
    pub fn identity_key(&self) -> Option<u64> {
        match &self.upgraded {
            Some(Upgraded::Websocket(socket)) => Some(socket.identity_key()),
            Some(Upgraded::Tunnel(_)) => None,
            None => self
                .ticket
                .as_ref()
                .map(|t| t.key)
                .or_else(|| self.waiting.as_ref().map(|i| i.key)),
        }
    }

    /// Whether it is a WebSocket (its answers are read: `socket_answered`).
    pub fn is_socket(&self) -> bool {
        matches!(self.upgraded, Some(Upgraded::Websocket(_)))
    }

    /// The admission gate says what the node has answered on this
    /// WebSocket so far (`socket`).
    pub fn socket_answered(&mut self, qos: &mut StakeQos, now: &mut Now, total: SocketAnswered) {
        if let Some(Upgraded::Websocket(socket)) = &mut self.upgraded {
            socket.answered(qos, now.us(), total);
        }
    }
}

/// Charges an admitted request what its body holds: in calls, a batch's
/// other calls; in another unit, its calls' costs.
fn charge(qos: &mut StakeQos, ticket: &mut Ticket, size: usize, body: &mut impl Body) {
    if qos.policy().costs.unit == Unit::Calls {
        let calls = batch_calls(body, size);
        if calls > 1 {
            qos.charge(ticket, calls);
        }
        return;
    }
    let cost = qos
        .policy()
        .costs
        .of_body(&body.read(0, size), qos.learned());
    qos.charge_cost(
        ticket,
        (cost.units * MILLI as f64) as i64,
        cost.calls,
        cost.method,
    );
}

/// The calls a body of `size` bytes holds: a batch's (read whole only if
/// its first bytes open an array), else 1.
fn batch_calls(body: &mut impl Body, size: usize) -> u32 {
    let head = body.read(0, size.min(64));
    match head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        true => jsonrpc::calls(&body.read(0, size)),
        false => 1,
    }
}

/// If `identity`'s request, `body`, was refused and is sent again before
/// its time, until when to hold it. Looked up only while QoS throttles
/// (nothing is refused otherwise), and not by a shadow, nor past the
/// worker's bound.
fn early_until(
    qos: &StakeQos,
    store: &impl SharedStore,
    now: &mut Now,
    identity: &Identity,
    body: &[u8],
) -> Result<Option<u64>, StoreError> {
    if qos.policy().shadow
        || !qos.state().throttling
        || body.is_empty()
        || qos.early_held >= early::HELD_PER_WORKER
    {
        return Ok(None);
    }
    early::early(store, early::sent(identity.key, body), now.ms())
}

/// Admits `identity`'s request: what was decided, and the ticket if it
/// was admitted.
fn admit(
    qos: &mut StakeQos,
    store: &impl SharedStore,
    now_us: u64,
    identity: &Identity,
) -> (Decided, Option<Ticket>) {
    let Admission {
        verdict,
        leased,
        cas_retries,
        evicted,
        store_error,
    } = qos.admit_at(store, now_us, identity);
    let (throttled, ticket) = match verdict {
        Verdict::Admit(ticket) => (None, Some(ticket)),
        Verdict::Throttle(throttled) => (Some(throttled), None),
    };
    let decided = Decided {
        throttled,
        tier: identity.tier,
        leased,
        cas_retries,
        evicted,
        store_error,
        early_error: None,
    };
    (decided, ticket)
}

#[cfg(test)]
mod tests;
