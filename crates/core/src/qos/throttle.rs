//! A refused request's answer: a 429 that says which limit refused it
//! (the share, the concurrency allowance, the WebSockets), the identity's
//! name, share and rate, when to come back, and the IETF draft RateLimit
//! headers of that limit and no other (policies/refusals.md).

use super::page::MILLI;
use super::{Reason, StakeQos, Throttled};
use crate::rejection::{retry_after_s, Fact, Rejection, Rule, LIMIT_EXCEEDED};

impl StakeQos {
    /// A 429 for identity `key`: `need` is a call's cost (thousandths of
    /// the unit), `share_rps` the identity's share (the unit per second),
    /// `allowance` its concurrency allowance (`Reason::Concurrency`). Its
    /// `RateLimit-Policy` and `RateLimit` headers describe the limit that
    /// refused it: the share in calls per second at this call's cost, or
    /// the requests in flight, or the WebSockets open; its `data` and
    /// `x-stakegate-*` headers say the rule, the identity's name, its share
    /// and its rate in calls per second (policies/refusals.md).
    pub(super) fn throttled(
        &mut self,
        reason: Reason,
        key: u64,
        need: i64,
        share_rps: f64,
        allowance: u32,
    ) -> Throttled {
        let jitter = self.jitter.next_unit();
        let max = self.policy.retry_after_max_s;
        let interval_s = self.interval_s();
        let need = need.max(1);
        let calls_per_s = share_rps / (need as f64 / MILLI as f64);
        let rule = match reason {
            Reason::Rate => Rule::StakeShare,
            Reason::Concurrency => Rule::Concurrency,
            Reason::Websockets => Rule::Websockets,
        };
        let local = self.locals.get_mut(&key).map(|local| {
            local.usage.refused_by(rule);
            local.refused = true;
            &*local
        });
        let tokens = local.map_or(0, |l| l.lease);
        let rate = local.map_or(0.0, |l| f64::from(l.demand) / interval_s);
        let name = local.and_then(|l| l.name.as_deref()).unwrap_or("unstaked");
        let (message, retry_after_s, quota, remaining, unit) = match reason {
            // Until the lease holds a call at the current share.
            Reason::Rate => {
                let missing = ((need - tokens).max(1) as u64).div_ceil(need as u64) as u32;
                (
                    "rate limit exceeded: over this client's stake share",
                    retry_after_s(missing, calls_per_s, jitter, max),
                    calls_per_s.round() as u64,
                    (tokens.max(0) / need) as u64,
                    ";w=1",
                )
            }
            // About one request's latency, i.e. the next second.
            Reason::Concurrency => {
                let latency_us = local.map_or(0, |l| l.latency_us).max(1);
                (
                    "too many requests in flight for this client's stake share",
                    retry_after_s(1, 1e6 / f64::from(latency_us), jitter, max),
                    u64::from(allowance),
                    0,
                    ";qu=\"concurrent-requests\"",
                )
            }
            // When a socket closes is unknown: soon, spread out.
            Reason::Websockets => (
                "too many WebSockets open for this client",
                retry_after_s(1, 1.0, jitter, max),
                u64::from(self.policy.websockets_per_identity),
                0,
                ";qu=\"concurrent-requests\"",
            ),
        };
        let mut facts = vec![Fact::Identity(name.to_string())];
        match reason {
            Reason::Rate => facts.extend([Fact::Share(calls_per_s), Fact::Rate(rate)]),
            Reason::Concurrency => facts.extend([
                Fact::Share(calls_per_s),
                Fact::Rate(rate),
                Fact::Limit(allowance),
            ]),
            Reason::Websockets => facts.push(Fact::Limit(self.policy.websockets_per_identity)),
        }
        let mut rejection = Rejection::explained(
            rule,
            Rejection::TOO_MANY_REQUESTS,
            retry_after_s,
            LIMIT_EXCEEDED,
            message,
            &facts,
        );
        let name = rule.name();
        rejection.headers.extend([
            ("ratelimit-policy", format!("\"{name}\";q={quota}{unit}")),
            (
                "ratelimit",
                format!("\"{name}\";r={remaining};t={retry_after_s}"),
            ),
        ]);
        Throttled { reason, rejection }
    }
}
