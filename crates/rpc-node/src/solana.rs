//! The Solana flavour (`rpc-node --chain solana`): slots at three
//! commitment levels that advance with the sync loop, the methods an RPC
//! provider sees most, with their answers in the shapes Solana's RPC gives
//! (so that @solana/kit, @solana/web3.js and solana-py accept them), and
//! PubSub over the WebSocket (`pubsub`).
//!
//! Each executed block is a slot (no slot is skipped, so the block height
//! is the slot). `processed` is the newest executed slot, `confirmed` the
//! one before, and `finalized` is `FINALIZED_DEPTH` behind, as on mainnet
//! where a slot roots about 32 slots later. A call without a commitment
//! gets `finalized`, Solana's default.
//!
//! The state is a function of the slot and the call: every account holds a
//! fixed balance derived from its address, every program owns
//! `PROGRAM_ACCOUNTS` accounts, and every transaction sent lands in the next
//! slot (`Landed`: `getSignatureStatuses` says it processed, then confirmed
//! a slot later, then finalized `FINALIZED_DEPTH` slots later, so clients'
//! confirmation loops end). Enough for clients to do their everyday work
//! and compare answers; no transaction is executed.

use crate::rpc::{self, fnv1a};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// The default table: what each method holds a read slot for. In the
/// spirit of providers' price lists (most calls cost one credit;
/// `getProgramAccounts` ten, with a lower rate limit of its own), and
/// heavier still here, as a scan of a program's accounts is on a node.
pub const COSTS: &[(&str, Duration)] = &[
    ("getHealth", Duration::from_micros(50)),
    ("getVersion", Duration::from_micros(50)),
    ("getGenesisHash", Duration::from_micros(50)),
    ("getSlot", Duration::from_micros(200)),
    ("getBlockHeight", Duration::from_micros(200)),
    ("getEpochInfo", Duration::from_micros(200)),
    ("getLatestBlockhash", Duration::from_micros(300)),
    ("isBlockhashValid", Duration::from_micros(300)),
    ("getFeeForMessage", Duration::from_micros(300)),
    (
        "getMinimumBalanceForRentExemption",
        Duration::from_micros(100),
    ),
    ("getBalance", Duration::from_millis(1)),
    ("getAccountInfo", Duration::from_millis(1)),
    ("getSignatureStatuses", Duration::from_millis(1)),
    ("getMultipleAccounts", Duration::from_millis(3)),
    ("sendTransaction", Duration::from_millis(3)),
    ("getTransaction", Duration::from_millis(5)),
    ("simulateTransaction", Duration::from_millis(8)),
    ("getSignaturesForAddress", Duration::from_millis(10)),
    ("getBlock", Duration::from_millis(20)),
    ("getProgramAccounts", Duration::from_millis(100)),
    // PubSub: the call that subscribes; notifications cost the node nothing
    // here.
    ("slotSubscribe", Duration::from_micros(100)),
    ("slotUnsubscribe", Duration::from_micros(50)),
    ("accountSubscribe", Duration::from_micros(100)),
    ("accountUnsubscribe", Duration::from_micros(50)),
    ("signatureSubscribe", Duration::from_micros(100)),
    ("signatureUnsubscribe", Duration::from_micros(50)),
];

/// How far `finalized` is behind the newest slot.
pub const FINALIZED_DEPTH: u64 = 32;
/// Accounts each program owns (`getProgramAccounts`).
pub const PROGRAM_ACCOUNTS: u64 = 3;
/// Slots in an epoch, as on mainnet.
const SLOTS_PER_EPOCH: u64 = 432_000;
/// A blockhash stays valid for this many blocks.
const BLOCKHASH_VALID_FOR: u64 = 150;
/// -32004: Solana's "block not available for slot".
pub const BLOCK_NOT_AVAILABLE: i64 = -32004;
/// -32016: Solana's "minimum context slot has not been reached".
pub const MIN_CONTEXT_SLOT_NOT_REACHED: i64 = -32016;
/// -32602: invalid params.
pub const INVALID_PARAMS: i64 = -32602;
const SYSTEM_PROGRAM: &str = "11111111111111111111111111111111";

/// A commitment level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commitment {
    Processed,
    Confirmed,
    Finalized,
}

impl Commitment {
    /// The level a call's config object asks for; `finalized` without one.
    pub fn of(params: &Value) -> Self {
        let named = params
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|p| p.get("commitment")?.as_str());
        match named {
            Some("processed" | "recent" | "single") => Commitment::Processed,
            Some("confirmed" | "singleGossip") => Commitment::Confirmed,
            _ => Commitment::Finalized,
        }
    }

    /// The slot this level has reached when `head` is the newest executed.
    pub fn slot(self, head: u64) -> u64 {
        match self {
            Commitment::Processed => head,
            Commitment::Confirmed => head.saturating_sub(1),
            Commitment::Finalized => head.saturating_sub(FINALIZED_DEPTH),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Commitment::Processed => "processed",
            Commitment::Confirmed => "confirmed",
            Commitment::Finalized => "finalized",
        }
    }
}

/// `len` bytes derived from `seed`, in base58: 32 for a pubkey or a
/// blockhash, 64 for a signature.
fn derived(seed: &str, len: usize) -> String {
    let bytes: Vec<u8> = (0..len.div_ceil(8))
        .flat_map(|i| fnv1a(format!("{seed}/{i}").as_bytes()).to_le_bytes())
        .take(len)
        .collect();
    bs58::encode(bytes).into_string()
}

/// A pubkey (or a blockhash) derived from `seed`.
pub fn key(seed: &str) -> String {
    derived(seed, 32)
}

fn blockhash(slot: u64) -> String {
    key(&format!("blockhash/{slot}"))
}

/// An account's balance: fixed, from its address.
fn lamports(pubkey: &str) -> u64 {
    1_000_000_000 + fnv1a(pubkey.as_bytes()) % 1_000_000_000
}

/// The account at `pubkey`, in the `encoding` asked for, owned by `owner`.
fn account(pubkey: &str, owner: &str, encoding: &str) -> Value {
    let data = match encoding {
        "base58" => json!(["", "base58"]),
        // The node cannot parse an account it knows nothing of, and
        // answers base64, as Solana's RPC does.
        _ => json!(["", "base64"]),
    };
    json!({
        "data": data,
        "executable": false,
        "lamports": lamports(pubkey),
        "owner": owner,
        "rentEpoch": u64::MAX,
        "space": 0,
    })
}

/// A system account at `pubkey` (what account subscriptions are told).
pub(crate) fn account_at(pubkey: &str, encoding: &str) -> Value {
    account(pubkey, SYSTEM_PROGRAM, encoding)
}

fn encoding_of(params: &Value) -> &str {
    params
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|p| p.get("encoding")?.as_str())
        .unwrap_or("base64")
}

fn with_context(slot: u64, value: Value) -> Value {
    json!({"context": {"apiVersion": "2.2.0", "slot": slot}, "value": value})
}

/// The first signature of a transaction sent as base64 (or base58): what
/// `sendTransaction` answers.
fn first_signature(params: &Value) -> Option<String> {
    use base64::Engine;
    let text = params.get(0)?.as_str()?;
    let bytes = match encoding_of(params) {
        "base58" => bs58::decode(text).into_vec().ok()?,
        _ => base64::engine::general_purpose::STANDARD
            .decode(text)
            .ok()?,
    };
    // A compact-u16 count (one byte below 128), then 64-byte signatures.
    let count = *bytes.first()?;
    if count == 0 || count >= 0x80 || bytes.len() < 1 + 64 {
        return None;
    }
    Some(bs58::encode(&bytes[1..65]).into_string())
}

/// The transactions sent, by first signature, with the slot each landed in
/// (the one after the head when it was sent). The oldest are forgotten past
/// `KEPT_SIGNATURES`, as a node's status cache lets old ones go.
#[derive(Debug, Default)]
pub struct Landed {
    slots: HashMap<String, u64>,
    order: VecDeque<String>,
}

pub const KEPT_SIGNATURES: usize = 100_000;

impl Landed {
    fn record(&mut self, signature: &str, slot: u64) {
        if self.slots.insert(signature.to_string(), slot).is_none() {
            self.order.push_back(signature.to_string());
        }
        while self.order.len() > KEPT_SIGNATURES {
            if let Some(old) = self.order.pop_front() {
                self.slots.remove(&old);
            }
        }
    }

    /// A signature's status as `getSignatureStatuses` gives it: `null` if
    /// unknown or not landed yet.
    fn status(&self, signature: &str, head: u64) -> Value {
        let Some(&slot) = self.slots.get(signature).filter(|s| **s <= head) else {
            return Value::Null;
        };
        let depth = head - slot;
        let (status, confirmations) = match depth {
            d if d >= FINALIZED_DEPTH => ("finalized", Value::Null),
            0 => ("processed", json!(0)),
            d => ("confirmed", json!(d)),
        };
        json!({"slot": slot, "confirmations": confirmations, "err": null,
               "status": {"Ok": null}, "confirmationStatus": status})
    }
}

/// `answer`, with the transactions sent kept in `landed`:
/// `sendTransaction` records its signature, `getSignatureStatuses` answers
/// from them.
pub fn answer_keeping(
    method: &str,
    params: &Value,
    head: u64,
    landed: &mut Landed,
) -> Result<Value, (i64, String)> {
    let result = answer(method, params, head)?;
    match method {
        "sendTransaction" => {
            if let Some(signature) = result.as_str() {
                landed.record(signature, head + 1);
            }
            Ok(result)
        }
        // Unknown to `answer` alone (`answer_keeping` knows what was sent).
        "getSignatureStatuses" => {
            let signatures = params.get(0).and_then(Value::as_array);
            let statuses: Vec<Value> = signatures
                .into_iter()
                .flatten()
                .map(|s| s.as_str().map_or(Value::Null, |s| landed.status(s, head)))
                .collect();
            Ok(with_context(head, json!(statuses)))
        }
        _ => Ok(result),
    }
}

/// The answer to `method` with `params` when `head` is the newest executed
/// slot: a result, or an error object (`Err`).
pub fn answer(method: &str, params: &Value, head: u64) -> Result<Value, (i64, String)> {
    let commitment = Commitment::of(params);
    let slot = commitment.slot(head);
    let min_context = params
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|p| p.get("minContextSlot")?.as_u64());
    if let Some(min) = min_context.filter(|min| *min > slot) {
        return Err((
            MIN_CONTEXT_SLOT_NOT_REACHED,
            format!(
                "Minimum context slot has not been reached (context slot {slot}, minimum {min})"
            ),
        ));
    }
    let text = |i: usize| params.get(i).and_then(Value::as_str);
    let invalid = |what: &str| (INVALID_PARAMS, format!("Invalid params: {what}"));
    Ok(match method {
        "getHealth" => json!("ok"),
        "getVersion" => json!({"solana-core": "2.2.0", "feature-set": 3_294_202_862u64}),
        "getGenesisHash" => json!(blockhash(0)),
        "getSlot" | "getBlockHeight" => json!(slot),
        "getEpochInfo" => json!({
            "absoluteSlot": slot,
            "blockHeight": slot,
            "epoch": slot / SLOTS_PER_EPOCH,
            "slotIndex": slot % SLOTS_PER_EPOCH,
            "slotsInEpoch": SLOTS_PER_EPOCH,
            "transactionCount": slot * 1_000,
        }),
        "getLatestBlockhash" => with_context(
            slot,
            json!({"blockhash": blockhash(slot), "lastValidBlockHeight": slot + BLOCKHASH_VALID_FOR}),
        ),
        "isBlockhashValid" => {
            let valid = text(0).is_some_and(|hash| {
                (slot.saturating_sub(BLOCKHASH_VALID_FOR)..=slot).any(|s| blockhash(s) == hash)
            });
            with_context(slot, json!(valid))
        }
        "getFeeForMessage" => with_context(slot, json!(5_000)),
        "getMinimumBalanceForRentExemption" => {
            let size = params.get(0).and_then(Value::as_u64).unwrap_or(0);
            json!((128 + size) * 6_960)
        }
        "getBalance" => {
            let pubkey = text(0).ok_or_else(|| invalid("a pubkey"))?;
            with_context(slot, json!(lamports(pubkey)))
        }
        "getAccountInfo" => {
            let pubkey = text(0).ok_or_else(|| invalid("a pubkey"))?;
            with_context(slot, account(pubkey, SYSTEM_PROGRAM, encoding_of(params)))
        }
        "getMultipleAccounts" => {
            let keys = params
                .get(0)
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("an array of pubkeys"))?;
            let accounts: Vec<Value> = keys
                .iter()
                .map(|k| {
                    k.as_str().map_or(Value::Null, |k| {
                        account(k, SYSTEM_PROGRAM, encoding_of(params))
                    })
                })
                .collect();
            with_context(slot, json!(accounts))
        }
        "getProgramAccounts" => {
            let program = text(0).ok_or_else(|| invalid("a program id"))?;
            let accounts: Vec<Value> = (0..PROGRAM_ACCOUNTS)
                .map(|i| {
                    let pubkey = key(&format!("{program}/{i}"));
                    let account = account(&pubkey, program, encoding_of(params));
                    json!({"pubkey": pubkey, "account": account})
                })
                .collect();
            let with_context_asked = params
                .get(1)
                .and_then(|c| c.get("withContext"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            if with_context_asked {
                with_context(slot, json!(accounts))
            } else {
                json!(accounts)
            }
        }
        "getSignaturesForAddress" => {
            let address = text(0).ok_or_else(|| invalid("an address"))?;
            let signatures: Vec<Value> = (0..2u64)
                .filter(|i| slot > *i)
                .map(|i| {
                    let at = slot - i;
                    json!({
                        "signature": derived(&format!("{address}/signature/{at}"), 64),
                        "slot": at,
                        "err": null,
                        "memo": null,
                        "blockTime": 1_700_000_000 + at / 2,
                        "confirmationStatus": commitment.name(),
                    })
                })
                .collect();
            json!(signatures)
        }
        // Transactions are not kept: every one is "not found", as one the
        // node has pruned.
        "getTransaction" => Value::Null,
        // Unknown to `answer` alone (`answer_keeping` knows what was sent).
        "getSignatureStatuses" => {
            let signatures = params
                .get(0)
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("an array of signatures"))?;
            with_context(slot, json!(vec![Value::Null; signatures.len()]))
        }
        "sendTransaction" => {
            json!(first_signature(params).ok_or_else(|| invalid("a signed transaction"))?)
        }
        "simulateTransaction" => with_context(
            slot,
            json!({"err": null, "logs": [], "accounts": null, "unitsConsumed": 150, "returnData": null}),
        ),
        "getBlock" => {
            let wanted = params
                .get(0)
                .and_then(Value::as_u64)
                .ok_or_else(|| invalid("a slot"))?;
            if wanted > slot {
                return Err((
                    BLOCK_NOT_AVAILABLE,
                    format!("Block not available for slot {wanted}"),
                ));
            }
            let details = params
                .get(1)
                .and_then(|c| c.get("transactionDetails"))
                .and_then(Value::as_str)
                .unwrap_or("full");
            let mut block = json!({
                "blockHeight": wanted,
                "blockTime": 1_700_000_000 + wanted / 2,
                "blockhash": blockhash(wanted),
                "parentSlot": wanted.saturating_sub(1),
                "previousBlockhash": blockhash(wanted.saturating_sub(1)),
                "rewards": [],
            });
            match details {
                "none" => {}
                "signatures" => block["signatures"] = json!([]),
                _ => block["transactions"] = json!([]),
            }
            block
        }
        _ => return Err((rpc::METHOD_NOT_FOUND, format!("Method not found: {method}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commitment_levels_trail_the_newest_slot() {
        let slot = |params: Value| answer("getSlot", &params, 100).unwrap();
        assert_eq!(slot(json!([])), json!(100 - FINALIZED_DEPTH));
        assert_eq!(slot(json!([{"commitment": "processed"}])), json!(100));
        assert_eq!(slot(json!([{"commitment": "confirmed"}])), json!(99));
        assert_eq!(slot(json!([{"commitment": "finalized"}])), json!(68));
        let early = answer(
            "getSlot",
            &json!([{"commitment": "confirmed", "minContextSlot": 150}]),
            100,
        );
        assert_eq!(early.unwrap_err().0, MIN_CONTEXT_SLOT_NOT_REACHED);
    }

    #[test]
    fn answers_have_solanas_shapes() {
        let balance = answer("getBalance", &json!([key("a")]), 50).unwrap();
        assert_eq!(balance["context"]["slot"], 50 - FINALIZED_DEPTH);
        assert!(balance["value"].as_u64().unwrap() >= 1_000_000_000);
        let info = answer(
            "getAccountInfo",
            &json!([key("a"), {"encoding": "base64"}]),
            50,
        )
        .unwrap();
        assert_eq!(info["value"]["data"], json!(["", "base64"]));
        assert_eq!(info["value"]["lamports"], balance["value"]);
        let accounts = answer("getProgramAccounts", &json!([key("p")]), 50).unwrap();
        assert_eq!(
            accounts.as_array().unwrap().len(),
            PROGRAM_ACCOUNTS as usize
        );
        assert_eq!(accounts[0]["account"]["owner"], key("p"));
        let hash = answer("getLatestBlockhash", &json!([]), 50).unwrap();
        let hash = hash["value"]["blockhash"].as_str().unwrap().to_string();
        assert_eq!(bs58::decode(&hash).into_vec().unwrap().len(), 32);
        let valid = answer("isBlockhashValid", &json!([hash]), 60).unwrap();
        assert_eq!(valid["value"], true);
        let block = answer("getBlock", &json!([60, {"commitment": "confirmed"}]), 60);
        assert_eq!(block.unwrap_err().0, BLOCK_NOT_AVAILABLE);
        let block = answer(
            "getBlock",
            &json!([10, {"transactionDetails": "signatures"}]),
            60,
        )
        .unwrap();
        assert_eq!(block["parentSlot"], 9);
        assert_eq!(block["signatures"], json!([]));
    }

    /// A transaction with one signature, all `byte`, in base64.
    fn signed(byte: u8) -> String {
        use base64::Engine;
        let mut tx = vec![1u8];
        tx.extend([byte; 64]);
        tx.extend([0u8; 40]);
        base64::engine::general_purpose::STANDARD.encode(&tx)
    }

    #[test]
    fn a_sent_transaction_answers_its_first_signature() {
        let encoded = signed(7);
        let signature = answer(
            "sendTransaction",
            &json!([encoded, {"encoding": "base64"}]),
            5,
        )
        .unwrap();
        assert_eq!(signature, json!(bs58::encode([7u8; 64]).into_string()));
        let bad = answer("sendTransaction", &json!(["not base64!"]), 5);
        assert_eq!(bad.unwrap_err().0, INVALID_PARAMS);
    }

    #[test]
    fn a_sent_transaction_is_processed_then_confirmed_then_finalized() {
        let encoded = signed(9);
        let mut landed = Landed::default();
        let sent = answer_keeping("sendTransaction", &json!([encoded]), 5, &mut landed);
        let signature = sent.unwrap();
        let params = json!([[signature, "unknown"], {"searchTransactionHistory": true}]);
        let mut statuses = |head| {
            answer_keeping("getSignatureStatuses", &params, head, &mut landed).unwrap()["value"]
                .clone()
        };
        assert_eq!(statuses(5), json!([null, null]), "it lands in slot 6");
        assert_eq!(statuses(6)[0]["confirmationStatus"], "processed");
        assert_eq!(statuses(6)[0]["slot"], 6);
        assert_eq!(statuses(7)[0]["confirmationStatus"], "confirmed");
        assert_eq!(statuses(7)[0]["confirmations"], 1);
        let finalized = statuses(6 + FINALIZED_DEPTH)[0].clone();
        assert_eq!(finalized["confirmationStatus"], "finalized");
        assert_eq!(finalized["confirmations"], Value::Null);
        assert_eq!(finalized["err"], Value::Null);
        assert_eq!(statuses(7)[1], Value::Null, "never sent");
    }
}
