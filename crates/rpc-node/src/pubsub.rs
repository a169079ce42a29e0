//! Solana PubSub on the node's WebSocket: `slotSubscribe`,
//! `accountSubscribe`, `signatureSubscribe` and their unsubscribes.
//!
//! A subscribe call takes a read slot like any call (its cost is in the
//! table). Notifications follow the sync loop: each executed slot notifies
//! every slot subscription; every account subscription whose commitment
//! level reached a new slot (every account is written every slot here, as
//! a busy account is); and, once, every signature subscription whose level
//! reached the slot after it subscribed (every transaction lands in the
//! next slot), which then ends, as on Solana.

use crate::solana::{self, Commitment, FINALIZED_DEPTH, INVALID_PARAMS};
use serde_json::{json, Value};
use std::collections::BTreeMap;

#[derive(Debug)]
enum Kind {
    Slot,
    Account {
        pubkey: String,
        commitment: Commitment,
        encoding: String,
        /// The last slot it was told of.
        told: u64,
    },
    Signature {
        commitment: Commitment,
        /// The slot its transaction lands in.
        lands: u64,
    },
}

/// One socket's subscriptions.
#[derive(Debug, Default)]
pub struct Subscriptions {
    next: u64,
    live: BTreeMap<u64, Kind>,
}

/// Whether `method` is one of PubSub's (WebSocket only).
pub fn is_pubsub(method: &str) -> bool {
    method.ends_with("Subscribe") || method.ends_with("Unsubscribe")
}

impl Subscriptions {
    /// A (un)subscribe call's result when `head` is the newest slot: the
    /// new subscription's id, or `true` for one removed.
    pub fn call(
        &mut self,
        method: &str,
        params: &Value,
        head: u64,
    ) -> Result<Value, (i64, String)> {
        let invalid = |what: &str| (INVALID_PARAMS, format!("Invalid params: {what}"));
        let text = |i: usize| params.get(i).and_then(Value::as_str).map(str::to_string);
        let commitment = Commitment::of(params);
        let kind = match method {
            "slotSubscribe" => Kind::Slot,
            "accountSubscribe" => Kind::Account {
                pubkey: text(0).ok_or_else(|| invalid("a pubkey"))?,
                commitment,
                encoding: params
                    .get(1)
                    .and_then(|c| c.get("encoding"))
                    .and_then(Value::as_str)
                    .unwrap_or("base64")
                    .to_string(),
                told: commitment.slot(head),
            },
            "signatureSubscribe" => {
                text(0).ok_or_else(|| invalid("a signature"))?;
                Kind::Signature {
                    commitment,
                    lands: head + 1,
                }
            }
            "slotUnsubscribe" | "accountUnsubscribe" | "signatureUnsubscribe" => {
                let id = params.get(0).and_then(Value::as_u64);
                return match id.and_then(|id| self.live.remove(&id)) {
                    Some(_) => Ok(json!(true)),
                    None => Err(invalid("Invalid subscription id.")),
                };
            }
            _ => {
                return Err((
                    crate::rpc::METHOD_NOT_FOUND,
                    format!("Method not found: {method}"),
                ))
            }
        };
        let id = self.next;
        self.next += 1;
        self.live.insert(id, kind);
        Ok(json!(id))
    }

    /// The notifications for a newly executed slot `head`, in subscription
    /// order; ended subscriptions are removed.
    pub fn notify(&mut self, head: u64) -> Vec<Value> {
        let mut out = Vec::new();
        let mut ended = Vec::new();
        for (id, kind) in &mut self.live {
            let (method, result) = match kind {
                Kind::Slot => (
                    "slotNotification",
                    json!({
                        "parent": head.saturating_sub(1),
                        "root": head.saturating_sub(FINALIZED_DEPTH),
                        "slot": head,
                    }),
                ),
                Kind::Account {
                    pubkey,
                    commitment,
                    encoding,
                    told,
                } => {
                    let slot = commitment.slot(head);
                    if slot <= *told {
                        continue;
                    }
                    *told = slot;
                    (
                        "accountNotification",
                        json!({"context": {"slot": slot}, "value": solana::account_at(pubkey, encoding)}),
                    )
                }
                Kind::Signature { commitment, lands } => {
                    let slot = commitment.slot(head);
                    if slot < *lands {
                        continue;
                    }
                    ended.push(*id);
                    (
                        "signatureNotification",
                        json!({"context": {"slot": slot}, "value": {"err": null}}),
                    )
                }
            };
            out.push(json!({
                "jsonrpc": "2.0",
                "method": method,
                "params": {"result": result, "subscription": id},
            }));
        }
        for id in ended {
            self.live.remove(&id);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_notified_as_the_slots_come() {
        let mut subs = Subscriptions::default();
        let slot = subs.call("slotSubscribe", &json!([]), 100).unwrap();
        let account = subs
            .call(
                "accountSubscribe",
                &json!([solana::key("a"), {"commitment": "confirmed"}]),
                100,
            )
            .unwrap();
        let signature = subs
            .call(
                "signatureSubscribe",
                &json!(["sig", {"commitment": "confirmed"}]),
                100,
            )
            .unwrap();
        assert_eq!((slot, account, signature), (json!(0), json!(1), json!(2)));
        let methods = |notes: &[Value]| -> Vec<String> {
            notes
                .iter()
                .map(|n| n["method"].as_str().unwrap().to_string())
                .collect()
        };
        // Slot 101: confirmed reaches 100 (99 when it subscribed), and the
        // transaction, landing in 101, is not confirmed yet.
        let notes = subs.notify(101);
        assert_eq!(methods(&notes), ["slotNotification", "accountNotification"]);
        assert_eq!(notes[0]["params"]["result"]["slot"], 101);
        assert_eq!(notes[1]["params"]["result"]["context"]["slot"], 100);
        let notes = subs.notify(102);
        assert_eq!(
            methods(&notes),
            [
                "slotNotification",
                "accountNotification",
                "signatureNotification"
            ]
        );
        assert_eq!(notes[2]["params"]["subscription"], 2);
        // The signature's subscription ended; the others go on until
        // unsubscribed.
        assert_eq!(methods(&subs.notify(103)).len(), 2);
        assert_eq!(
            subs.call("slotUnsubscribe", &json!([0]), 103).unwrap(),
            json!(true)
        );
        assert_eq!(
            subs.call("slotUnsubscribe", &json!([0]), 103)
                .unwrap_err()
                .0,
            INVALID_PARAMS
        );
        assert_eq!(methods(&subs.notify(104)), ["accountNotification"]);
    }
}
