//! The node's finalized block, as the gate follows it, so that an answer
//! tied to a block is served again only once that block is final: a reorg
//! can drop any block above it, and with it a receipt, a transaction's
//! place, or a block fetched by hash, but never a final one.
//!
//! **Following.** Only while answers tied to a block are being found (a
//! leader's found answer to a `reuseMethods` call finds the number older
//! than `POLL_MS`), and at most every `POLL_MS`: at its next engagement
//! tick one gate VM, the first to claim the poll in the shared record by
//! CAS, asks the node for its finalized block by callout to dedup's
//! upstream (`eth_getBlockByNumber("finalized", false)`) and writes the
//! number it gets. So a gateway whose clients read no receipts or blocks
//! by hash asks nothing. A node that has no finalized block (it answers
//! `null` or an error; pre-merge chains, some L2s) is written as having
//! none. A number not answered within `STALE_MS` is not trusted. With no
//! trusted number, nothing tied to a block is reused: the answer is still
//! shared with the requests that waited for it (they asked at the same
//! moment), and a later request goes to the node.
//!
//! **Tied to a block.** An answer whose `result` names a block
//! (`blockNumber`, `number`, or its first entry's `blockNumber`) is reused
//! once that number is at or below the finalized one. One that names none
//! is reused only when its method's answer depends on the request alone
//! (`Reuse::Always`: a sent transaction's hash).

use crate::shared::{read, update, Change, Reader, Record, SharedStore, StoreError};

pub const KEY: &str = "stakegate.admission_gate.v2.dedup.finalized";
/// How often the finalized block is asked for, at most.
pub const POLL_MS: u64 = 1000;
/// A number older than this is not trusted.
pub const STALE_MS: u64 = 5000;
const VERSION: u8 = 1;

/// What the gate knows of the node's finalized block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Finalized {
    /// When a VM last claimed the poll.
    pub asked_ms: u64,
    /// When the last answer came; 0: never.
    pub answered_ms: u64,
    /// The finalized block's number; `None`: the node has none.
    pub number: Option<u64>,
}

impl Record for Finalized {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        if bytes.len() != 26 || bytes[0] != VERSION {
            return Err(format!(
                "shared finality record has version {} and {} bytes, this module reads version {VERSION}",
                bytes[0],
                bytes.len()
            ));
        }
        let mut r = Reader(&bytes[1..]);
        let (asked_ms, answered_ms) = (r.u64(), r.u64());
        let known = r.0[0] == 1;
        let mut r = Reader(&r.0[1..]);
        let number = r.u64();
        Ok(Self {
            asked_ms,
            answered_ms,
            number: known.then_some(number),
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        out.extend_from_slice(&self.asked_ms.to_le_bytes());
        out.extend_from_slice(&self.answered_ms.to_le_bytes());
        out.push(u8::from(self.number.is_some()));
        out.extend_from_slice(&self.number.unwrap_or(0).to_le_bytes());
        out
    }
}

/// The request body that asks the node for its finalized block.
pub const REQUEST: &[u8] =
    br#"{"jsonrpc":"2.0","id":1,"method":"eth_getBlockByNumber","params":["finalized",false]}"#;

/// Whether this VM asks now: a poll is due and this VM claimed it.
pub fn claim(store: &impl SharedStore, now_ms: u64) -> Result<bool, StoreError> {
    let updated = update(store, KEY, |record: &mut Finalized| {
        if now_ms.saturating_sub(record.asked_ms) < POLL_MS {
            return Change::Keep(false);
        }
        record.asked_ms = now_ms;
        Change::Write(true)
    })
    .map_err(|(e, _)| e)?;
    Ok(updated.value)
}

/// The node's answer to the poll (`None`: no answer): its finalized
/// block's number is written, or that it has none.
pub fn answered(
    store: &impl SharedStore,
    now_ms: u64,
    answer: Option<&[u8]>,
) -> Result<Option<u64>, StoreError> {
    let Some(body) = answer else {
        return Ok(None);
    };
    let number = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| hex(&v["result"]["number"]));
    update(store, KEY, |record: &mut Finalized| {
        record.answered_ms = now_ms;
        record.number = number;
        Change::Write(())
    })
    .map_err(|(e, _)| e)?;
    Ok(number)
}

/// What the gate knows of the finalized block at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    /// Its number, if known and fresh.
    pub number: Option<u64>,
    /// The number is older than `POLL_MS` (or unknown): ask again.
    pub due: bool,
}

/// The finalized block's number, if the gate knows it and the answer is
/// fresh, and whether it is due to be asked for again.
pub fn finalized(store: &impl SharedStore, now_ms: u64) -> Result<Known, StoreError> {
    let (record, _) = read::<Finalized>(store, KEY)?;
    let age = now_ms.saturating_sub(record.answered_ms);
    let answered = record.answered_ms > 0;
    Ok(Known {
        number: record.number.filter(|_| answered && age <= STALE_MS),
        due: !answered || age >= POLL_MS,
    })
}

/// The block an answer's `result` names, if any.
pub fn block_of(body: &[u8]) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let result = &value["result"];
    hex(&result["blockNumber"])
        .or_else(|| hex(&result["number"]))
        .or_else(|| hex(&result[0]["blockNumber"]))
}

fn hex(value: &serde_json::Value) -> Option<u64> {
    u64::from_str_radix(value.as_str()?.strip_prefix("0x")?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    #[test]
    fn one_vm_polls_a_second_and_the_answer_is_trusted_while_fresh() {
        let store = MemoryStore::default();
        assert!(claim(&store, 5000).unwrap());
        assert!(!claim(&store, 5500).unwrap(), "another VM, too soon");
        assert_eq!(
            finalized(&store, 5500).unwrap().number,
            None,
            "no answer yet"
        );
        let body = br#"{"jsonrpc":"2.0","id":1,"result":{"number":"0x24","hash":"0xab"}}"#;
        assert_eq!(answered(&store, 5600, Some(body)).unwrap(), Some(36));
        let known = |at| finalized(&store, at).unwrap();
        assert_eq!(
            known(5700),
            Known {
                number: Some(36),
                due: false
            }
        );
        assert_eq!(
            known(6600),
            Known {
                number: Some(36),
                due: true
            }
        );
        assert_eq!(known(10_600).number, Some(36));
        assert_eq!(known(10_601).number, None, "stale");
        assert!(claim(&store, 6000).unwrap());
        // A node with no finalized block.
        answered(
            &store,
            6100,
            Some(br#"{"jsonrpc":"2.0","id":1,"result":null}"#),
        )
        .unwrap();
        assert_eq!(finalized(&store, 6100).unwrap().number, None);
        let record = Finalized {
            asked_ms: 1,
            answered_ms: 2,
            number: Some(3),
        };
        assert_eq!(Finalized::decode(&record.encode()).unwrap(), record);
    }

    #[test]
    fn an_answer_names_its_block_where_it_has_one() {
        for (body, block) in [
            (
                r#"{"result":{"blockNumber":"0x10","status":"0x1"}}"#,
                Some(16),
            ),
            (r#"{"result":{"number":"0x2","hash":"0xab"}}"#, Some(2)),
            (r#"{"result":[{"blockNumber":"0x5","action":{}}]}"#, Some(5)),
            (r#"{"result":{"blockNumber":null}}"#, None),
            (r#"{"result":"0xabc"}"#, None),
            ("not json", None),
        ] {
            assert_eq!(block_of(body.as_bytes()), block, "{body}");
        }
    }
}
