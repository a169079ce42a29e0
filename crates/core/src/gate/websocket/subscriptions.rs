//! Subscriptions a socket and an identity may hold open at once.
//!
//! A subscription costs the node nothing when it is made and something at
//! every event after (Solana's `accountSubscribe`, Ethereum's
//! `eth_subscribe`): a client with thousands open makes the node push
//! thousands of notifications a second, whoever else is waiting. So the
//! gate counts, on each worker, the subscribe calls each socket and each
//! identity (as stake QoS named it, `request::IDENTITY_PROPERTY`) sent, less
//! their unsubscribe calls, and a subscribe call past
//! `maxSubscriptionsPerWebsocket` or `maxSubscriptionsPerIdentity` is
//! refused: it goes to the node as a call of no method of the node's, under
//! a gateway id, and the node's error comes back to the client as the
//! gate's own (`-32005`, rule `subscriptions`), with its id. A subscribe
//! the node refuses itself is counted all the same (until its socket
//! closes): the count errs on the side of the node.

use super::rewrite::{Call, Outgoing, Restore};
use crate::jsonrpc::Summary;
use crate::rejection::{Fact, Rejection, Rule, LIMIT_EXCEEDED};
use std::collections::HashMap;

/// The method a refused subscribe is sent to the node as: none a node has.
pub const REFUSED_METHOD: &str = "stakegate_subscriptionRefused";

/// What a subscription message does to the counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Subscribe,
    Unsubscribe,
}

/// Whether `method` subscribes or unsubscribes (`eth_subscribe`,
/// `accountSubscribe`, `eth_unsubscribe`, `accountUnsubscribe`, any case).
pub fn kind(method: &str) -> Option<Kind> {
    let method = method.to_ascii_lowercase();
    if method.contains("unsubscribe") {
        Some(Kind::Unsubscribe)
    } else if method.contains("subscribe") {
        Some(Kind::Subscribe)
    } else {
        None
    }
}

/// One worker's subscriptions by identity, and the limits.
#[derive(Debug, Clone)]
pub struct Subscriptions {
    per_socket: u32,
    per_identity: u32,
    by_identity: HashMap<u64, u32>,
}

impl Subscriptions {
    pub fn new(per_socket: u32, per_identity: u32) -> Self {
        Self {
            per_socket,
            per_identity,
            by_identity: HashMap::new(),
        }
    }

    /// A subscription message of a socket with `open` subscriptions, of
    /// `identity` (if QoS named it): counted, or, a subscribe past a limit,
    /// the refusal it becomes (`None`: it goes as it is).
    pub fn sent(
        &mut self,
        kind: Kind,
        open: &mut u32,
        identity: Option<u64>,
        out: &Outgoing,
    ) -> Option<Outgoing> {
        let held = identity.map_or(0, |key| self.by_identity.get(&key).copied().unwrap_or(0));
        match kind {
            Kind::Unsubscribe => {
                self.release(identity, (*open).min(1));
                *open = open.saturating_sub(1);
                None
            }
            Kind::Subscribe if *open >= self.per_socket => Some(refusal(out, self.per_socket)),
            Kind::Subscribe if identity.is_some() && held >= self.per_identity => {
                Some(refusal(out, self.per_identity))
            }
            Kind::Subscribe => {
                *open += 1;
                if let Some(key) = identity {
                    *self.by_identity.entry(key).or_default() += 1;
                }
                None
            }
        }
    }

    /// `n` of `identity`'s subscriptions are gone (an unsubscribe, or its
    /// socket closed).
    pub fn release(&mut self, identity: Option<u64>, n: u32) {
        let Some(key) = identity else {
            return;
        };
        if let Some(held) = self.by_identity.get_mut(&key) {
            *held = held.saturating_sub(n);
            if *held == 0 {
                self.by_identity.remove(&key);
            }
        }
    }

    /// Subscriptions held on this worker, every identity together.
    pub fn held(&self) -> u64 {
        self.by_identity.values().map(|&n| u64::from(n)).sum()
    }
}

/// A subscription message's kind, if it is one call that subscribes or
/// unsubscribes.
pub fn of(out: &Outgoing) -> Option<Kind> {
    let Outgoing::Calls {
        original,
        batch: false,
        ..
    } = out
    else {
        return None;
    };
    let summary = Summary::of(original);
    kind(summary.entries.first()?.method.as_deref()?)
}

/// The refused subscribe `out` becomes: a call the node has no method
/// for, under a gateway id whose answer is the gate's error with the
/// client's id.
fn refusal(out: &Outgoing, limit: u32) -> Outgoing {
    let id = match out {
        Outgoing::Calls { calls, .. } => match calls.first().map(|c| &c.restore) {
            Some(Restore::Id(id)) => Some(id.clone()),
            _ => None,
        },
        _ => None,
    };
    let restore = match id {
        Some(id) => Restore::Refuse(id, limit),
        None => Restore::Drop,
    };
    let bare = format!(r#"{{"jsonrpc":"2.0","method":"{REFUSED_METHOD}"}}"#).into_bytes();
    // Packed with other calls when slots are few: a client refused a
    // hundred at once takes no hundred units.
    Outgoing::Calls {
        original: Vec::new(),
        batch: false,
        calls: vec![Call { bare, restore }],
        alone: false,
        mergeable: true,
    }
}

/// The gate's answer to a refused subscribe, with the client's `id`.
pub fn refused_answer(id: &[u8], limit: u32) -> Vec<u8> {
    let id = std::str::from_utf8(id).unwrap_or("null");
    let rejection = Rejection::explained(
        Rule::Subscriptions,
        429,
        0,
        LIMIT_EXCEEDED,
        "too many subscriptions open for this client",
        &[Fact::Limit(limit)],
    );
    crate::rejection::error_body_of(&rejection, Some(id)).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subscribe(id: u32) -> Outgoing {
        let original = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"accountSubscribe"}}"#);
        Outgoing::Calls {
            original: original.into_bytes(),
            batch: false,
            calls: vec![Call {
                bare: Vec::new(),
                restore: Restore::Id(id.to_string().into_bytes()),
            }],
            alone: true,
            mergeable: false,
        }
    }

    #[test]
    fn methods_that_subscribe_and_unsubscribe() {
        assert_eq!(kind("eth_subscribe"), Some(Kind::Subscribe));
        assert_eq!(kind("accountSubscribe"), Some(Kind::Subscribe));
        assert_eq!(kind("eth_unsubscribe"), Some(Kind::Unsubscribe));
        assert_eq!(kind("slotUnsubscribe"), Some(Kind::Unsubscribe));
        assert_eq!(kind("eth_call"), None);
        assert_eq!(of(&subscribe(1)), Some(Kind::Subscribe));
    }

    #[test]
    fn a_subscribe_past_the_sockets_or_the_identitys_limit_is_refused() {
        let mut subs = Subscriptions::new(2, 3);
        let (mut a, mut b) = (0, 0);
        assert!(subs
            .sent(Kind::Subscribe, &mut a, Some(7), &subscribe(1))
            .is_none());
        assert!(subs
            .sent(Kind::Subscribe, &mut a, Some(7), &subscribe(2))
            .is_none());
        let refused = subs
            .sent(Kind::Subscribe, &mut a, Some(7), &subscribe(3))
            .unwrap();
        let Outgoing::Calls { calls, .. } = &refused else {
            unreachable!()
        };
        assert_eq!(calls[0].restore, Restore::Refuse(b"3".to_vec(), 2));
        // Another socket of the identity: one more, then its limit.
        assert!(subs
            .sent(Kind::Subscribe, &mut b, Some(7), &subscribe(4))
            .is_none());
        assert!(subs
            .sent(Kind::Subscribe, &mut b, Some(7), &subscribe(5))
            .is_some());
        assert_eq!((a, b, subs.held()), (2, 1, 3));
        // An unsubscribe, and a socket's close, give room back.
        assert!(subs
            .sent(Kind::Unsubscribe, &mut a, Some(7), &subscribe(6))
            .is_none());
        assert!(subs
            .sent(Kind::Subscribe, &mut b, Some(7), &subscribe(7))
            .is_none());
        subs.release(Some(7), b);
        assert_eq!(subs.held(), 1);
        let answer = refused_answer(b"3", 2);
        let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(
            (
                &answer["id"],
                &answer["error"]["code"],
                &answer["error"]["data"]["rule"]
            ),
            (&3.into(), &(-32005).into(), &"subscriptions".into())
        );
    }
}
