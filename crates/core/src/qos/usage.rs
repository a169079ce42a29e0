//! A worker's side of the usage ledger (`ledger`): what its identities
//! used since the last hand-over, labelled, for Envoy's counters; and the
//! refusals further on that a request's answer names.

use super::ledger::{Named, Usage, Who, LEDGER_EVERY_MS};
use super::{Local, StakeQos};
use crate::rejection::Rule;
use crate::shared::{SharedStore, StoreError};
use std::collections::BTreeMap;

impl Local {
    /// Its ledger row: who, whether QoS refused it, its usage.
    pub(super) fn ledger_row(&self) -> (Who, bool, Usage) {
        let who = match (&self.name, self.address) {
            (Some(name), _) => Who::Named(name.clone()),
            (None, Some((net, prefix))) => Who::Address(net, prefix),
            (None, None) => Who::Unknown,
        };
        (who, self.refused, self.usage)
    }
}

impl StakeQos {
    /// Every `LEDGER_EVERY_MS`: this worker's usage since the last time,
    /// by label (`None` between times, or with the ledger off).
    pub fn usage(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
    ) -> Result<Option<BTreeMap<String, Usage>>, StoreError> {
        let (series, address_series) = (self.policy.usage_series, self.policy.usage_address_series);
        if !self.policy.usage_on() || now_ms < self.ledger.last_ms.saturating_add(LEDGER_EVERY_MS) {
            return Ok(None);
        }
        self.ledger.last_ms = now_ms;
        let mut rows = std::mem::take(&mut self.unlabelled);
        let unidentified = std::mem::take(&mut self.ledger.unidentified);
        if unidentified > 0 {
            let usage = Usage {
                requests: unidentified,
                ..Usage::default()
            };
            rows.push((Who::Unidentified, false, usage));
        }
        // Counted: nobody is throttled while QoS only counts.
        for (_, (name, usage)) in self.ledger.counted.drain() {
            let usage = Usage {
                share_rps: f64::INFINITY,
                ..usage
            };
            rows.push((Who::Named(name), false, usage));
        }
        let throttling = self.state.throttling;
        let interval_s = self.interval_s();
        for local in self.locals.values_mut() {
            if !local.usage.is_empty() {
                // Its grant per round, in calls at its cost per call.
                let calls = local.grant as f64 / local.cost.max(1) as f64;
                local.usage.share_rps = if throttling {
                    calls / interval_s
                } else {
                    f64::INFINITY
                };
                rows.push(local.ledger_row());
                local.usage = Usage::default();
            }
        }
        self.ledger
            .label(store, rows, series, address_series)
            .map(Some)
    }

    /// A request admitted here was refused further on (the admission
    /// gate's answer named `rule`).
    pub fn refused_further(&mut self, key: u64, rule: Rule) {
        if let Some(local) = self.locals.get_mut(&key) {
            local.usage.refused_by(rule);
        }
    }

    /// A request counted under its staked key's name (`count`) was refused
    /// further on.
    pub fn counted_refused_further(&mut self, named: &Named, rule: Rule) {
        self.ledger.counted_row(named).refused_by(rule);
    }
}

#[cfg(test)]
mod tests {
    use crate::qos::identity::Identity;
    use crate::qos::ledger::LEDGER_EVERY_MS;
    use crate::qos::policy::QosPolicy;
    use crate::qos::{StakeQos, Verdict};
    use crate::rejection::Rule;
    use crate::shared::MemoryStore;
    use std::collections::BTreeMap;
    use std::net::IpAddr;

    #[test]
    fn a_worker_hands_over_its_identities_usage_every_quarter_second() {
        let policy = QosPolicy::parse(br#"{"capacityRps": 1000}"#).unwrap();
        let mut qos = StakeQos::new(policy, 1);
        let store = MemoryStore::default();
        let desk = Identity {
            key: 7,
            stake: 5000,
            tier: 1,
            staked: true,
            name: Some("desk-7".into()),
            address: None,
        };
        let visitor = Identity {
            key: 8,
            stake: 1000,
            tier: 0,
            staked: false,
            name: None,
            address: Some((IpAddr::from([192, 0, 2, 0]), 24)),
        };
        for (identity, n) in [(&desk, 3), (&visitor, 2)] {
            for _ in 0..n {
                let Verdict::Admit(ticket) = qos.admit(&store, 10, identity).verdict else {
                    panic!("not throttling")
                };
                qos.charge(&ticket, 4);
                let key = ticket.key;
                qos.finish(20, ticket, Some(503));
                qos.refused_further(key, Rule::GateInflight);
            }
        }
        let by_label = qos
            .usage(&store, LEDGER_EVERY_MS)
            .unwrap()
            .expect("the time has come");
        let desk = by_label["desk-7"];
        assert_eq!((desk.requests, desk.calls), (3, 12));
        assert_eq!(desk.refused[3], 3, "{desk:?}");
        // An address QoS never refused has no label of its own.
        assert_eq!(by_label["unstaked"].requests, 2);
        let next = 2 * LEDGER_EVERY_MS;
        assert_eq!(qos.usage(&store, next - 1).unwrap(), None, "not yet");
        assert_eq!(qos.usage(&store, next).unwrap(), Some(BTreeMap::new()));
    }
}
