//! The usage ledger: per identity, the requests it sent, their calls, the
//! ones refused by each rule (QoS's own, and the admission gate's further
//! on, read from the answer's `x-stakegate-rule`), and in node time the
//! node's time its requests took. Envoy gets it as counters
//! `stakegate.qos.usage.<label>.<counter>`, and `stakegate usage` prints it.
//!
//! The number of series is bounded whatever the number of identities:
//! - a staked identity is labelled with its name in the stake table;
//! - an unstaked address group gets a label of its own (`unstaked:<net>`)
//!   once QoS has refused it: the busiest unnamed clients are the ones over
//!   their share;
//! - which labels exist is one shared record, so every worker together
//!   gives at most `usage.series` names and `usage.addressSeries` address
//!   groups labels. Envoy keeps a stat until it exits, so a label once
//!   given stays;
//! - every other identity counts under `unstaked` or, a staked one once
//!   the bound is reached, `other`.
//!
//! Far below the threshold QoS counts requests without identifying them
//! (`identifyAbove`). It still reads their API key (to tell the gate who is
//! staked), so a request with a staked key counts under that identity's
//! name, its calls too; the rest are the `unidentified` label's requests
//! (their calls are not read). `identifyAbove: 0` puts every request on its
//! identity, at the cost of identifying each.

use crate::rejection::Rule;
use crate::shared::{read, update, Change, Record, SharedStore, StoreError};
use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

/// The labels that have series, every worker's.
pub const LABELS_KEY: &str = "stakegate.stake_qos.v3.usage_labels";
/// How often a worker hands its ledger to Envoy.
pub const LEDGER_EVERY_MS: u64 = 250;
/// The label of unstaked identities that have none of their own.
pub const UNSTAKED: &str = "unstaked";
/// The label of staked identities past the bound.
pub const OTHER: &str = "other";
/// The label of requests counted without an identity.
pub const UNIDENTIFIED: &str = "unidentified";

/// A label that sums several identities (no share of its own).
pub fn is_shared(label: &str) -> bool {
    [UNSTAKED, OTHER, UNIDENTIFIED].contains(&label)
}
/// The counters of a label, after `stakegate.qos.usage.<label>.`.
pub const COUNTERS: [&str; 4] = ["requests", "calls", "node_us", "notifications"];
/// The gauge of a label of one identity: its share, in thousandths of a
/// call per second; `UNLIMITED` while QoS does not throttle.
pub const SHARE: &str = "share_milli_rps";
pub const UNLIMITED: u64 = u64::MAX;
/// A refusal counter's prefix: `refused.<rule>`.
pub const REFUSED: &str = "refused";

/// One identity's (or label's) counts since the last hand-over.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub requests: u64,
    pub calls: u64,
    /// By `Rule::ALL`'s order.
    pub refused: [u64; Rule::ALL.len()],
    /// Node time its answered requests took, in µs (node-time unit only).
    pub node_us: u64,
    /// Notifications its WebSockets' subscriptions brought it.
    pub notifications: u64,
    /// Not a count: its share as of its last request, in calls per second
    /// at its cost (QoS's weighted max-min over demand); infinite while QoS
    /// does not throttle. Meaningful for a label of one identity only.
    pub share_rps: f64,
}

impl Usage {
    /// Nothing was counted (the share is not a count).
    pub fn is_empty(&self) -> bool {
        self.requests == 0
            && self.calls == 0
            && self.node_us == 0
            && self.notifications == 0
            && self.refused == [0; Rule::ALL.len()]
    }

    pub fn add(&mut self, other: &Usage) {
        self.requests += other.requests;
        self.calls += other.calls;
        self.node_us += other.node_us;
        self.notifications += other.notifications;
        self.share_rps = self.share_rps.max(other.share_rps);
        for (mine, theirs) in self.refused.iter_mut().zip(other.refused) {
            *mine += theirs;
        }
    }

    /// Counts one refusal by `rule`.
    pub fn refused_by(&mut self, rule: Rule) {
        if let Some(i) = Rule::ALL.iter().position(|r| *r == rule) {
            self.refused[i] += 1;
        }
    }

    /// `(counter name, value)` of every counter that is not 0.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let plain = COUNTERS
            .iter()
            .zip([self.requests, self.calls, self.node_us, self.notifications])
            .map(|(name, n)| (name.to_string(), n));
        let refused = Rule::ALL
            .iter()
            .zip(self.refused)
            .map(|(rule, n)| (format!("{REFUSED}.{}", rule.name()), n));
        plain.chain(refused).filter(|(_, n)| *n > 0).collect()
    }
}

/// Who an identity is for the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Who {
    Named(Arc<str>),
    /// An unstaked address group: its network and prefix.
    Address(IpAddr, u8),
    Unknown,
    /// Counted without an identity.
    Unidentified,
}

/// The labels given so far, one per line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Labels(pub Vec<String>);

impl Record for Labels {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes).map_err(|e| format!("usage labels: {e}"))?;
        Ok(Self(text.lines().map(str::to_string).collect()))
    }

    fn encode(&self) -> Vec<u8> {
        self.0.join("\n").into_bytes()
    }
}

/// The label `who` asks for (it may get `unstaked` or `other` instead);
/// `None` when it asks for none of its own.
fn wanted(who: &Who, refused: bool) -> Option<String> {
    match who {
        Who::Named(name) => Some(name.replace(['\n', '\r'], " ")),
        Who::Address(net, prefix) if refused => Some(format!("{UNSTAKED}:{net}/{prefix}")),
        _ => None,
    }
}

fn is_address(label: &str) -> bool {
    label.starts_with("unstaked:")
}

/// A worker's side of the ledger: the labels it knows are given.
#[derive(Debug, Default)]
pub struct Ledger {
    given: HashSet<String>,
    /// The bounds (names, addresses) the shared record was last seen full
    /// at, of names and of addresses: no use asking for one of those then
    /// (a label once given stays, so this worker knows them all).
    full: Option<((u32, u32), (bool, bool))>,
    pub last_ms: u64,
    /// Requests counted without an identity since the last hand-over.
    pub unidentified: u64,
    /// Requests counted with a staked API key since the last hand-over, by
    /// identity key: its name and usage (no more entries than the stake
    /// table has keys).
    pub counted: std::collections::HashMap<u64, (Arc<str>, Usage)>,
}

/// A staked identity a counted request's API key names: its key and name.
pub type Named = (u64, Arc<str>);

impl Ledger {
    /// The row of requests counted under `named` since the last hand-over.
    pub fn counted_row(&mut self, (key, name): &Named) -> &mut Usage {
        &mut self
            .counted
            .entry(*key)
            .or_insert_with(|| (name.clone(), Usage::default()))
            .1
    }

    /// Sums `rows` (who, whether QoS refused it, its usage) by label,
    /// giving new labels within `series` names and `address_series`
    /// address groups (one shared write for all of them).
    pub fn label(
        &mut self,
        store: &impl SharedStore,
        rows: Vec<(Who, bool, Usage)>,
        series: u32,
        address_series: u32,
    ) -> Result<BTreeMap<String, Usage>, StoreError> {
        let bounds = (series, address_series);
        let full = match self.full {
            Some((at, full)) if at == bounds => full,
            _ => (false, false),
        };
        let mut asked: Vec<String> = rows
            .iter()
            .filter_map(|(who, refused, _)| wanted(who, *refused))
            .filter(|label| !self.given.contains(label))
            .filter(|label| if is_address(label) { !full.1 } else { !full.0 })
            .collect();
        asked.sort();
        asked.dedup();
        if !asked.is_empty() {
            self.give(store, asked, bounds)?;
        }
        let mut by_label: BTreeMap<String, Usage> = BTreeMap::new();
        for (who, refused, usage) in rows {
            let label = match wanted(&who, refused) {
                _ if who == Who::Unidentified => UNIDENTIFIED.to_string(),
                Some(label) if self.given.contains(&label) => label,
                _ if matches!(who, Who::Named(_)) => OTHER.to_string(),
                _ => UNSTAKED.to_string(),
            };
            by_label.entry(label).or_default().add(&usage);
        }
        Ok(by_label)
    }

    /// Adds what of `asked` fits to the shared labels, and learns every
    /// label given. One that did not fit is asked again at the next
    /// hand-over unless its kind is full (a larger bound after a swap
    /// gives it room).
    fn give(
        &mut self,
        store: &impl SharedStore,
        asked: Vec<String>,
        (series, address_series): (u32, u32),
    ) -> Result<(), StoreError> {
        // Which of `asked` `labels` has, or has room for; and whether it
        // is then full, of names and of addresses.
        let fit = |labels: &Labels| {
            let known: HashSet<&str> = labels.0.iter().map(String::as_str).collect();
            let addresses = labels.0.iter().filter(|l| is_address(l)).count() as u32;
            let mut room = (
                series.saturating_sub(labels.0.len() as u32 - addresses),
                address_series.saturating_sub(addresses),
            );
            let mut new = Vec::new();
            for label in asked.iter().filter(|a| !known.contains(a.as_str())) {
                let left = if is_address(label) {
                    &mut room.1
                } else {
                    &mut room.0
                };
                if *left > 0 {
                    *left -= 1;
                    new.push(label.clone());
                }
            }
            (new, (room.0 == 0, room.1 == 0))
        };
        let (mut labels, _) = read::<Labels>(store, LABELS_KEY)?;
        if !fit(&labels).0.is_empty() {
            labels = update(store, LABELS_KEY, |l: &mut Labels| {
                let (new, _) = fit(l);
                if new.is_empty() {
                    return Change::Keep(());
                }
                l.0.extend(new);
                Change::Write(())
            })
            .map_err(|(e, _)| e)?
            .table;
        }
        self.full = Some(((series, address_series), fit(&labels).1));
        self.given.extend(labels.0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    fn usage(requests: u64) -> Usage {
        Usage {
            requests,
            calls: requests,
            ..Usage::default()
        }
    }

    fn named(name: &str) -> Who {
        Who::Named(name.into())
    }

    #[test]
    fn labels_are_bounded_whatever_the_number_of_identities() {
        let store = MemoryStore::default();
        let mut workers = [Ledger::default(), Ledger::default()];
        // Two workers see 100 staked names and 100 refused addresses.
        for (w, ledger) in workers.iter_mut().enumerate() {
            let mut rows: Vec<(Who, bool, Usage)> = (0..100)
                .map(|i| (named(&format!("desk-{}", i * 2 + w)), false, usage(1)))
                .collect();
            rows.extend((0..100u8).map(|i| {
                let net = IpAddr::from([10, w as u8, i, 0]);
                (Who::Address(net, 24), true, usage(2))
            }));
            // Unrefused addresses and unknowns ask for no label.
            rows.push((
                Who::Address(IpAddr::from([192, 0, 2, 1]), 32),
                false,
                usage(5),
            ));
            rows.push((Who::Unknown, false, usage(7)));
            let by_label = ledger.label(&store, rows, 20, 4).unwrap();
            let total: u64 = by_label.values().map(|u| u.requests).sum();
            assert_eq!(total, 100 + 200 + 5 + 7, "nothing is lost");
            assert!(by_label.len() <= 20 + 4 + 2, "{:?}", by_label.keys());
        }
        let (labels, _) = read::<Labels>(&store, LABELS_KEY).unwrap();
        assert_eq!(labels.0.len(), 20 + 4);
        let addresses = labels.0.iter().filter(|l| is_address(l)).count();
        assert_eq!(addresses, 4);
        assert!(labels.0.contains(&"unstaked:10.0.0.0/24".to_string()));
        // A given label keeps its series on every worker; the rest go to
        // `other` (staked) or `unstaked`.
        let rows = vec![
            (named("desk-0"), false, usage(1)),
            (named("desk-199"), false, usage(1)),
            (
                Who::Address(IpAddr::from([10, 1, 99, 0]), 24),
                true,
                usage(1),
            ),
        ];
        let by_label = workers[1].label(&store, rows, 20, 4).unwrap();
        let keys: Vec<&str> = by_label.keys().map(String::as_str).collect();
        assert_eq!(keys, ["desk-0", "other", "unstaked"]);
    }

    #[test]
    fn a_hundred_thousand_identities_make_at_most_the_configured_series() {
        let store = MemoryStore::default();
        let mut ledger = Ledger::default();
        let rows: Vec<(Who, bool, Usage)> = (0..100_000u32)
            .map(|i| {
                let who = if i % 2 == 0 {
                    named(&format!("client-{i}"))
                } else {
                    Who::Address(IpAddr::from(i.to_be_bytes()), 32)
                };
                (who, true, usage(1))
            })
            .collect();
        let by_label = ledger.label(&store, rows, 64, 16).unwrap();
        // 64 names, 16 addresses, `other` and `unstaked`: 82 labels.
        assert_eq!(by_label.len(), 64 + 16 + 2);
        assert_eq!(by_label.values().map(|u| u.requests).sum::<u64>(), 100_000);
        assert_eq!(by_label["other"].requests, 50_000 - 64);
        let series: usize = by_label.values().map(|u| u.counters().len() + 1).sum();
        assert!(series <= 82 * (3 + 1 + 7), "{series}");
    }

    #[test]
    fn counters_name_each_rule_and_skip_zeros() {
        let mut u = usage(3);
        u.refused_by(Rule::StakeShare);
        u.refused_by(Rule::GateInflight);
        u.refused_by(Rule::GateInflight);
        let counters = u.counters();
        assert_eq!(
            counters,
            [
                ("requests".to_string(), 3),
                ("calls".to_string(), 3),
                ("refused.stake-share".to_string(), 1),
                ("refused.gate-inflight".to_string(), 2),
            ]
        );
    }
}
