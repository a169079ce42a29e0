//! What an admitted request is charged after its admission: a batch's
//! other calls, its body's costs in a unit other than calls, the node time
//! it took (settled when it ends), and the calls sent on a WebSocket; and
//! how an upgrade leaves the requests in flight. Touches no shared data.

use super::page::MILLI;
use super::{Connection, Reason, StakeQos, Throttled, Ticket, COST_SMOOTHING};
use crate::cost::Unit;

impl StakeQos {
    /// A batch admitted on one call turned out to hold `calls`: the rest
    /// are demand, and while throttling is on they are charged to the
    /// identity's lease (as a debt if it has too little).
    pub fn charge(&mut self, ticket: &Ticket, calls: u32) {
        self.add_calls(ticket.key, calls.saturating_sub(1));
    }

    /// In a unit other than calls: a request's body was read, and its
    /// `calls` calls are charged `units` (thousandths of the unit) in all,
    /// instead of the one call at its identity's cost it was admitted on.
    /// `method`: the one method of all its calls.
    pub fn charge_cost(
        &mut self,
        ticket: &mut Ticket,
        units: i64,
        calls: u32,
        method: Option<u64>,
    ) {
        let more = units - ticket.charged;
        (ticket.charged, ticket.calls, ticket.method) = (units, calls.max(1), method);
        // A batch's other calls are demand; its lease pays the estimates.
        self.count_calls(ticket.key, calls.saturating_sub(1));
        self.settle(ticket.key, more);
        // What its calls would cost the node: its demand is counted at it,
        // whether or not they are refused further on.
        self.learn_cost(ticket.key, units / i64::from(calls.max(1)));
    }

    /// The node-time unit: the answer's headers came with `status`, the
    /// node having taken `took_us` on the request: as the admission gate
    /// measured it (`gate::node_time`: from when it let the request on,
    /// with no wait at the gateway in it; 0 for an answer the node did not
    /// work for), or without a gate in `nodeTime` mode the time since
    /// admission. A 200's is a sample of its method's cost (a refusal
    /// further on, an error, or an answer the node did no work for says
    /// nothing of what the method costs).
    pub fn answered(&self, ticket: &mut Ticket, took_us: u64, status: Option<u32>) {
        if self.policy.costs.unit == Unit::NodeTime {
            ticket.node_us = Some(took_us);
            if status != Some(200) || took_us == 0 {
                ticket.method = None;
            }
        }
    }

    /// While throttling is on, `units` more (or fewer) are charged to the
    /// identity's lease.
    pub(super) fn settle(&mut self, key: u64, units: i64) {
        if self.state.throttling {
            if let Some(local) = self.locals.get_mut(&key) {
                local.lease = local.lease.saturating_sub(units);
            }
        }
    }

    /// An identity's call cost `per_call`: into its cost per call.
    pub(super) fn learn_cost(&mut self, key: u64, per_call: i64) {
        if let Some(local) = self.locals.get_mut(&key) {
            let smoothed =
                COST_SMOOTHING * per_call as f64 + (1.0 - COST_SMOOTHING) * local.cost as f64;
            local.cost = (smoothed as i64).max(1);
        }
    }

    /// An admitted request turned out to be an upgrade (a WebSocket): it
    /// leaves the identity's requests in flight at once, so that open
    /// subscriptions do not use up the concurrency allowance its HTTP calls
    /// need. Its admission was charged one call. It takes one of the
    /// identity's `websocketsPerIdentity` places on this worker, or is
    /// throttled if none is left.
    pub fn upgraded(&mut self, ticket: Ticket) -> Result<Connection, Throttled> {
        let allowance = self.policy.websockets_per_identity;
        let Some(local) = self.locals.get_mut(&ticket.key) else {
            return Ok(Connection { key: ticket.key });
        };
        local.inflight = local.inflight.saturating_sub(1);
        if local.websockets >= allowance {
            return Err(self.throttled(Reason::Websockets, ticket.key, MILLI, 0.0, 0));
        }
        local.websockets += 1;
        Ok(Connection { key: ticket.key })
    }

    /// An upgraded connection ended: its WebSocket place is free.
    pub fn closed(&mut self, connection: Connection) {
        if let Some(local) = self.locals.get_mut(&connection.key) {
            local.websockets = local.websockets.saturating_sub(1);
        }
    }

    /// `calls` more calls of the identity `key`: demand, and while
    /// throttling is on a charge to its lease at its cost per call.
    fn add_calls(&mut self, key: u64, calls: u32) {
        let units = self.count_calls(key, calls);
        self.settle(key, units);
    }

    /// `calls` more calls of the identity `key`, as demand only, at its cost
    /// per call; returns what they cost.
    fn count_calls(&mut self, key: u64, calls: u32) -> i64 {
        self.count_priced(key, calls, None)
    }

    /// `calls` more calls of the identity `key`, as demand only, costing
    /// `units` (`None`: its cost per call each); returns what they cost.
    pub(super) fn count_priced(&mut self, key: u64, calls: u32, units: Option<i64>) -> i64 {
        let Some(local) = self.locals.get_mut(&key) else {
            return 0;
        };
        if local.delta.is_empty() && calls > 0 {
            self.unreported.push(key);
        }
        local.delta.arrivals = local.delta.arrivals.saturating_add(calls);
        local.usage.calls += u64::from(calls);
        let units = units.unwrap_or_else(|| i64::from(calls).saturating_mul(local.cost));
        local.delta.units = local.delta.units.saturating_add(units.max(0) as u64);
        units
    }

    /// Ends an admitted request: its place in flight, its latency, and
    /// whether the upstream pushed back (`upstream_status` 503 or 429).
    /// Touches no shared data.
    pub fn finish(&mut self, now_ms: u64, ticket: Ticket, upstream_status: Option<u32>) {
        let Some(local) = self.locals.get_mut(&ticket.key) else {
            return;
        };
        let latency_ms = now_ms.saturating_sub(ticket.started_ms);
        let alpha = self.policy.latency_smoothing;
        local.inflight = local.inflight.saturating_sub(1);
        let sample = latency_ms.saturating_mul(1000).min(u64::from(u32::MAX)) as f64;
        local.latency_us = if local.latency_us == 0 {
            sample as u32
        } else {
            (alpha * sample + (1.0 - alpha) * f64::from(local.latency_us)) as u32
        };
        if local.delta.is_empty() {
            self.unreported.push(ticket.key);
        }
        let d = &mut local.delta;
        d.completions = d.completions.saturating_add(1);
        d.latency_sum_ms = d.latency_sum_ms.saturating_add(latency_ms as u32);
        d.overloads = d
            .overloads
            .saturating_add(u32::from(matches!(upstream_status, Some(503 | 429))));
        // The node-time unit: what it really took (a µs is a thousandth of
        // a node ms). A request whose answer never came keeps its estimate.
        if let Some(node_us) = ticket.node_us {
            local.usage.node_us = local.usage.node_us.saturating_add(node_us);
            let took = node_us.min(i64::MAX as u64) as i64;
            self.settle(ticket.key, took - ticket.charged);
            if let Some(method) = ticket.method {
                self.samples.add(method, ticket.calls, node_us);
            }
        }
    }
}
