//! A WebSocket at stake QoS. Its upgrade was admitted as one call of its
//! identity; after that, the calls its client sends on it are that
//! identity's as an HTTP request's are:
//!
//! - **demand**: each call read counts, at its cost (in node time, its
//!   method's estimate);
//! - **admission**: while throttling is on, the calls a piece of the
//!   client's data completes go on only with tokens from the identity's
//!   lease (leased from its bucket as an HTTP request's are: like an HTTP
//!   batch's, they go on the first call's tokens and the rest is a debt
//!   the next leases pay, so the identity's next calls wait for it), and
//!   only while the identity's calls in flight, HTTP requests and socket
//!   calls at the node together, are below its concurrency allowance (a
//!   piece's calls go on together, as an HTTP batch's do, on room for
//!   one). A socket's calls at the node are those the gate says it sent
//!   and were not answered yet, not those QoS let on: those may wait at
//!   the gate behind calls QoS holds, and counting them would wait for
//!   calls that wait;
//! - **hold**: else QoS tells the admission gate after it to hold the
//!   socket's data (`request::SOCKET_HOLD_PROPERTY`, read by the gate as
//!   each piece comes): the gate keeps what the client sends at the
//!   gateway, this piece on (a socket has no status to refuse a message
//!   with, and holding is back-pressure on the client's socket, as for
//!   slots). At each tick (`refillIntervalMs`) the held calls count as
//!   demand again (as a refused HTTP call tried again does) and try again;
//!   once they go on, QoS tells the gate to let the data go. QoS itself
//!   never holds a socket's data: two filters holding one stream's data
//!   share Envoy's one buffer, and what one held the other would send;
//! - **settling**: as the node's answers pass, the admission gate tells
//!   QoS how many of the socket's calls the node answered and how long
//!   their units took at the node (`cost::SOCKET_ANSWERED_PROPERTY`).
//!   Those calls leave the in-flight count, their latency goes into the
//!   identity's (the concurrency allowance's), and in node time the
//!   identity is charged what they took instead of their estimates (the
//!   usage ledger's node time too), as an HTTP request is settled when it
//!   ends; while the calls at the node are all of one method, what they
//!   took is a sample of its cost. Calls whose answers never come (the
//!   socket closed first) keep their estimates. The notifications the gate
//!   counts on the socket go into the identity's usage.
//!
//! A shadow never tells the gate to hold: it counts what it would hold.

use super::identity::Identity;
use super::page::MILLI;
use super::{Connection, Reason, StakeQos};
use crate::cost::{method_key, SocketAnswered, Unit};
use crate::request::Body;
use crate::shared::{SharedStore, StoreError};
use crate::websocket::{calls, FrameReader, Message, Side, Sink};
use std::collections::VecDeque;

/// Calls and what they cost, in thousandths of the unit, and their
/// method if they are all of one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Calls {
    calls: u32,
    units: i64,
    method: Method,
}

/// The method of some calls: none yet, one, or several.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Method {
    #[default]
    None,
    One(u64),
    Many,
}

impl Method {
    fn and(self, other: Method) -> Method {
        match (self, other) {
            (Method::None, m) | (m, Method::None) => m,
            (Method::One(a), Method::One(b)) if a == b => Method::One(a),
            _ => Method::Many,
        }
    }
}

impl Calls {
    fn add(&mut self, more: Calls) {
        self.calls = self.calls.saturating_add(more.calls);
        self.units = self.units.saturating_add(more.units);
        self.method = self.method.and(more.method);
    }
}

/// A client's WebSocket, as stake QoS follows it.
#[derive(Debug)]
pub struct Socket {
    connection: Connection,
    identity: Identity,
    reader: FrameReader,
    /// Read and not let on yet: the gate holds them.
    held: Calls,
    /// Let on and not answered yet, with what they were charged.
    at_node: Calls,
    /// What the gate said was answered, as of its last word.
    answered: SocketAnswered,
    /// When each lot of calls at the node went on (µs), and how many of
    /// them are not answered yet, oldest first: their latency, as an HTTP
    /// request's is counted from its admission to its answer.
    went: VecDeque<(u64, u32)>,
}

/// Calls of a socket the node answered: the time their units took at the
/// node (µs), what they were charged (thousandths of the unit), their
/// method if they were all of one, and their latency (µs) from when they
/// went on.
#[derive(Debug, Default)]
struct Answered {
    calls: u32,
    node_us: u64,
    charged: i64,
    method: Option<u64>,
    latency_us: u64,
}

/// What a try to let a socket's calls on did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Charged {
    /// The gate is to hold the socket's data now (`Some(true)`) or to let
    /// it go (`Some(false)`); `None`: no change.
    pub hold: Option<bool>,
    /// Why the calls did not go on (for the metrics), when they did not.
    pub held_by: Option<Reason>,
    /// A lease was taken, and its retries.
    pub leased: bool,
    pub cas_retries: u32,
    pub evicted: bool,
    /// Shared data failed; the calls went on without tokens.
    pub store_error: Option<StoreError>,
}

impl Socket {
    pub fn new(connection: Connection, identity: Identity) -> Self {
        Self {
            connection,
            identity,
            reader: FrameReader::new(Side::Client),
            held: Calls::default(),
            at_node: Calls::default(),
            answered: SocketAnswered::default(),
            went: VecDeque::new(),
        }
    }

    /// A piece of the client's data (`size` bytes, all new: QoS never
    /// holds it): the calls it completes are demand, and go on if they may
    /// (while the gate holds the socket's data they wait behind what it
    /// holds). Returns how many there were, and what trying did.
    pub fn read(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now_us: u64,
        body: &mut impl Body,
        size: usize,
    ) -> (u32, Charged) {
        let mut priced = Priced {
            qos,
            read: Calls::default(),
        };
        self.reader.feed(&body.read(0, size), &mut priced);
        let read = priced.read;
        if read.calls == 0 {
            return (0, Charged::default());
        }
        qos.socket_demand(self.connection.key, read.calls, read.units);
        if self.holding() {
            self.held.add(read);
            return (read.calls, Charged::default());
        }
        self.held = read;
        let mut charged = self.send(qos, store, now_us);
        if self.holding() {
            charged.hold = Some(true);
        }
        (read.calls, charged)
    }

    /// Its identity's table key.
    pub fn identity_key(&self) -> u64 {
        self.identity.key
    }

    /// Whether the gate holds its data (calls wait).
    pub fn holding(&self) -> bool {
        self.held.calls > 0
    }

    /// At a tick, while the gate holds its data: the held calls go on if
    /// they may now, and the gate lets the data go; else they are demand
    /// again (as a refused HTTP call tried again is: a client that waits
    /// for its answers before it sends more would otherwise look as if it
    /// wanted no more than it got).
    pub fn tick(&mut self, qos: &mut StakeQos, store: &impl SharedStore, now_us: u64) -> Charged {
        if !self.holding() {
            return Charged::default();
        }
        let mut charged = self.send(qos, store, now_us);
        if self.holding() {
            qos.socket_demand_again(self.connection.key, self.held.calls, self.held.units);
            // Held still: nothing new for the gate or the metrics.
            charged.held_by = None;
        } else {
            charged.hold = Some(false);
        }
        charged
    }

    /// Lets the held calls on if the identity may send them now (a shadow
    /// always does, counting what it would have held).
    fn send(&mut self, qos: &mut StakeQos, store: &impl SharedStore, now_us: u64) -> Charged {
        let charged = qos.socket_calls(store, now_us, &self.identity, self.held);
        if charged.held_by.is_none() || qos.policy().shadow {
            self.went.push_back((now_us, self.held.calls));
            self.at_node.add(self.held);
            self.held = Calls::default();
        }
        charged
    }

    /// The gate says, at `now_us`, what the node has answered on this
    /// socket so far (totals): the calls answered since its last word are
    /// settled.
    pub fn answered(&mut self, qos: &mut StakeQos, now_us: u64, total: SocketAnswered) {
        let calls = total.calls.saturating_sub(self.answered.calls);
        let node_us = total.node_us.saturating_sub(self.answered.node_us);
        let pushes = total.pushes.saturating_sub(self.answered.pushes);
        let sent = total.sent.saturating_sub(self.answered.sent);
        self.answered = total;
        qos.socket_notified(self.connection.key, pushes);
        qos.socket_at_node(self.connection.key, sent, calls);
        if calls == 0 {
            return;
        }
        let calls = u32::try_from(calls)
            .unwrap_or(u32::MAX)
            .min(self.at_node.calls);
        let charged = match self.at_node.calls {
            0 => 0,
            n => self.at_node.units * i64::from(calls) / i64::from(n),
        };
        // The oldest lot still at the node went on first: its latency.
        let mut left = calls;
        let mut went_us = now_us;
        while left > 0 {
            let Some((at, n)) = self.went.front_mut() else {
                break;
            };
            went_us = *at;
            let taken = left.min(*n);
            (*n, left) = (*n - taken, left - taken);
            if *n == 0 {
                self.went.pop_front();
            }
        }
        let method = match self.at_node.method {
            Method::One(method) => Some(method),
            Method::None | Method::Many => None,
        };
        self.at_node.calls -= calls;
        self.at_node.units -= charged;
        if self.at_node.calls == 0 {
            self.at_node = Calls::default();
            self.went.clear();
        }
        let answered = Answered {
            calls,
            node_us,
            charged,
            method,
            latency_us: now_us.saturating_sub(went_us),
        };
        qos.socket_answered(self.connection.key, answered);
    }

    /// The socket is over: its calls still at the node leave the in-flight
    /// count (their estimates stay charged), and its WebSocket place is
    /// free.
    pub fn close(self, qos: &mut StakeQos) {
        let at_node = self.answered.sent.saturating_sub(self.answered.calls);
        qos.socket_at_node(self.connection.key, 0, at_node);
        qos.closed(self.connection);
    }
}

/// Prices each message the client completes: its calls, at their costs.
struct Priced<'a> {
    qos: &'a StakeQos,
    read: Calls,
}

impl Sink for Priced<'_> {
    fn message(&mut self, message: Message) {
        let n = calls(&message);
        let method = message
            .summary
            .entries
            .iter()
            .map(|e| {
                e.method
                    .as_deref()
                    .map_or(Method::Many, |m| Method::One(method_key(m)))
            })
            .fold(Method::None, Method::and);
        let costs = &self.qos.policy().costs;
        let units = match costs.unit {
            // In calls, a call at its identity's cost (`count_calls`).
            Unit::Calls => 0,
            _ => {
                let learned = self.qos.learned();
                let priced: f64 = message
                    .summary
                    .entries
                    .iter()
                    .filter_map(|e| e.method.as_deref())
                    .map(|m| costs.of(m, learned))
                    .sum();
                let unpriced = n.saturating_sub(
                    message
                        .summary
                        .entries
                        .iter()
                        .filter(|e| e.method.is_some())
                        .count() as u32,
                );
                ((priced + f64::from(unpriced) * costs.default) * MILLI as f64) as i64
            }
        };
        self.read.add(Calls {
            calls: n,
            units,
            method,
        });
    }
}

impl StakeQos {
    /// `calls` calls read on a socket of identity `key`, costing `units`
    /// (in the calls unit, each at the identity's cost per call): demand.
    fn socket_demand(&mut self, key: u64, calls: u32, units: i64) {
        let units = (self.policy.costs.unit != Unit::Calls).then_some(units);
        self.count_priced(key, calls, units);
    }

    /// `calls` held calls of a socket of identity `key` are demand again
    /// (not calls it sent again: the ledger counts them once).
    fn socket_demand_again(&mut self, key: u64, calls: u32, units: i64) {
        let sent = self.locals.get(&key).map(|l| l.usage.calls);
        self.socket_demand(key, calls, units);
        if let (Some(sent), Some(local)) = (sent, self.locals.get_mut(&key)) {
            local.usage.calls = sent;
        }
    }

    /// Lets `held` calls of `identity`'s socket on: while throttling is
    /// on, with tokens from its lease and within its concurrency allowance.
    fn socket_calls(
        &mut self,
        store: &impl SharedStore,
        now_us: u64,
        identity: &Identity,
        held: Calls,
    ) -> Charged {
        let now_ms = now_us / 1000;
        let mut sent = Charged::default();
        let (round, interval_s) = (self.state.round, self.interval_s());
        let (floor, headroom) = (self.policy.concurrency_floor, self.policy.headroom);
        let throttling = self.state.throttling;
        let need = match self.policy.costs.unit {
            Unit::Calls => {
                let cost = self.locals.get(&identity.key).map_or(MILLI, |l| l.cost);
                cost.saturating_mul(i64::from(held.calls))
            }
            _ => held.units,
        };
        let local = self.local(identity, now_ms);
        if !throttling {
            return sent;
        }
        let share_units = local.grant as f64 / MILLI as f64 / interval_s;
        let per_call = need / i64::from(held.calls.max(1));
        let allowance = local.allowance(floor, headroom, share_units, per_call);
        if local.inflight >= allowance {
            sent.held_by = Some(Reason::Concurrency);
            return sent;
        }
        // Like an HTTP batch: the calls go on the first one's tokens, the
        // rest charged as a debt that the next leases pay (the identity's
        // other calls wait for it), since a piece's calls cannot be split.
        let first = (need / i64::from(held.calls.max(1))).max(1);
        if let Some((page, want)) = local.lease_want(first, round) {
            sent.leased = true;
            match self.lease(store, now_ms, identity, page, want) {
                Ok(leased) => {
                    sent.cas_retries = leased.retries;
                    sent.evicted = leased.evicted;
                    if let Some(local) = self.locals.get_mut(&identity.key) {
                        local.took_lease(&leased, want, round);
                    }
                }
                Err((e, retries)) => {
                    // Fail open: the admission gate protects the node.
                    sent.cas_retries = retries;
                    sent.store_error = Some(e);
                }
            }
        }
        let Some(local) = self.locals.get_mut(&identity.key) else {
            return sent;
        };
        if local.lease >= first || sent.store_error.is_some() {
            if sent.store_error.is_none() {
                local.lease -= need;
            }
        } else {
            local.dry_round = Some(round);
            sent.held_by = Some(Reason::Rate);
        }
        sent
    }

    /// Identity `key`'s sockets got `pushes` notifications: in its usage.
    fn socket_notified(&mut self, key: u64, pushes: u64) {
        if let Some(local) = self.locals.get_mut(&key).filter(|_| pushes > 0) {
            local.usage.notifications += pushes;
        }
    }

    /// The gate sent `sent` more of identity `key`'s socket calls to the
    /// node and the node answered `answered`: its calls in flight (the
    /// concurrency allowance's) are those the node has, by the gate's
    /// word, not those QoS let on (the gate may still hold some behind
    /// calls QoS holds: counting them would wait for calls that wait).
    fn socket_at_node(&mut self, key: u64, sent: u64, answered: u64) {
        if let Some(local) = self.locals.get_mut(&key) {
            let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
            local.inflight = (local.inflight)
                .saturating_add(clamp(sent))
                .saturating_sub(clamp(answered));
        }
    }

    /// Some of identity `key`'s socket calls ended: their latency goes
    /// into its own (the concurrency allowance's), and in node time it is
    /// charged what they took instead of their estimates; calls all of one
    /// method are a sample of its cost.
    fn socket_answered(&mut self, key: u64, answered: Answered) {
        let node_time = self.policy.costs.unit == Unit::NodeTime;
        let alpha = self.policy.latency_smoothing;
        let Some(local) = self.locals.get_mut(&key) else {
            return;
        };
        if answered.calls == 0 || answered.node_us == 0 {
            return;
        }
        let sample = answered.latency_us.min(u64::from(u32::MAX)) as f64;
        local.latency_us = if local.latency_us == 0 {
            sample as u32
        } else {
            (alpha * sample + (1.0 - alpha) * f64::from(local.latency_us)) as u32
        };
        if !node_time {
            return;
        }
        local.usage.node_us = local.usage.node_us.saturating_add(answered.node_us);
        if let Some(method) = answered.method {
            self.samples.add(method, answered.calls, answered.node_us);
        }
        let took = answered.node_us.min(i64::MAX as u64) as i64;
        self.settle(key, took - answered.charged);
        // Its cost per call, as its HTTP calls teach it (the usage ledger's
        // share in calls is its grant at that cost).
        self.learn_cost(key, took / i64::from(answered.calls));
    }
}
