//! Which answers cannot change, read from the request: the cache's one
//! table of rules (`policies/admission-gate.md` has it with the reason for
//! each row).
//!
//! A request is looked at only when it is one call with an id (a batch or
//! a notification is never cached). Its `params` are read strictly: a
//! member written twice (`params`, `fromBlock`…) makes it uncacheable, as
//! nodes do not agree on which one counts.

use crate::dedup::asks_finalized;
use crate::dedup::policy::FINALIZED_REUSE;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::ops::Range;

/// Why a found answer to a request may be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// The answer depends on the node's chain alone (`eth_chainId`).
    Fixed,
    /// A read by hash: its answer names the block it is in, and is kept
    /// once that block is final.
    NamedBlock,
    /// A read at block `n` (a number in the params): kept if `n` is final
    /// when the answer comes.
    AtBlock(u64),
    /// Solana, at the `finalized` commitment: a found finalized block or
    /// transaction cannot change.
    Finalized,
    /// A read at `latest`, asked of the node at the head's block hash
    /// (`AtHead::State`): the state at a block cannot change.
    Pinned,
}

/// A read at `latest` the gate answers at the head it has just seen
/// (`cache.latest`): held until a head poll that started after it came
/// says which block is the head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtHead {
    /// `eth_blockNumber`: the head's number.
    Number,
    /// `eth_getBlockByNumber("latest", false)`: the head block, as the
    /// poll got it.
    Block,
    /// A read of state at `latest`: where `"latest"` is in the body, to be
    /// replaced by the head's hash (EIP-1898).
    State(Range<usize>),
}

/// Reads of state at a block, which may be an EIP-1898 block object, and
/// the position of the block in their params.
const STATE_AT: &[(&str, usize)] = &[
    ("eth_getBalance", 1),
    ("eth_getCode", 1),
    ("eth_getTransactionCount", 1),
    ("eth_call", 1),
    ("eth_getStorageAt", 2),
    ("eth_getProof", 2),
];

/// Whether `body`, one call of `method`, reads at `latest` in a way the
/// head answers (the block written `"latest"`, plainly, as its last
/// param).
pub fn at_head(method: &str, body: &[u8]) -> Option<AtHead> {
    let call: Call = serde_json::from_slice(body).ok()?;
    let params: Vec<&str> = call.params.iter().map(|p| p.get()).collect();
    match (method, params.as_slice()) {
        ("eth_blockNumber", []) => return Some(AtHead::Number),
        ("eth_getBlockByNumber", [r#""latest""#, "false"]) => return Some(AtHead::Block),
        _ => {}
    }
    let (_, at) = STATE_AT.iter().find(|(m, _)| *m == method)?;
    let latest = *params.get(*at).filter(|p| **p == r#""latest""#)?;
    if params.len() != at + 1 {
        return None;
    }
    let start = latest.as_ptr() as usize - body.as_ptr() as usize;
    Some(AtHead::State(start..start + latest.len()))
}

/// `body` with its `"latest"` (at `at`) replaced by the block with this
/// hash, as an EIP-1898 block object.
pub fn pinned(body: &[u8], at: &Range<usize>, hash: &str) -> Vec<u8> {
    let object = format!(r#"{{"blockHash":"{hash}"}}"#);
    let mut out = Vec::with_capacity(body.len() + object.len());
    out.extend_from_slice(&body[..at.start]);
    out.extend_from_slice(object.as_bytes());
    out.extend_from_slice(&body[at.end..]);
    out
}

/// Methods whose answer depends on the chain alone.
const FIXED: &[&str] = &["eth_chainId", "net_version", "getGenesisHash"];

/// Reads by hash whose found answer names its block (`finality::block_of`).
const BY_HASH: &[&str] = &[
    "eth_getBlockByHash",
    "eth_getTransactionByHash",
    "eth_getTransactionReceipt",
    "eth_getTransactionByBlockHashAndIndex",
    "trace_transaction",
];

/// Reads at a block, and the position of the block in their params (and
/// the reads of state, `STATE_AT`).
const AT_BLOCK: &[(&str, usize)] = &[
    ("eth_getBlockByNumber", 0),
    ("eth_getBlockTransactionCountByNumber", 0),
    ("eth_getTransactionByBlockNumberAndIndex", 0),
    ("eth_getUncleCountByBlockNumber", 0),
    ("eth_getUncleByBlockNumberAndIndex", 0),
    ("eth_getBlockReceipts", 0),
    ("trace_block", 0),
    ("trace_replayBlockTransactions", 0),
    ("debug_traceBlockByNumber", 0),
    ("eth_feeHistory", 1),
];

/// One call's params, each left unread until a rule needs it; a member
/// written twice fails. (The method is `jsonrpc::Request`'s: written once,
/// plainly.)
#[derive(Deserialize)]
struct Call<'a> {
    #[serde(borrow, default)]
    params: Vec<&'a RawValue>,
}

/// `eth_getLogs`'s filter, strictly (a member written twice fails).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LogFilter<'a> {
    #[serde(borrow)]
    from_block: Option<&'a RawValue>,
    #[serde(borrow)]
    to_block: Option<&'a RawValue>,
    #[serde(borrow)]
    block_hash: Option<&'a RawValue>,
}

/// An EIP-1898 block object, strictly.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockObject<'a> {
    #[serde(borrow)]
    block_number: Option<&'a RawValue>,
    #[serde(borrow)]
    block_hash: Option<&'a RawValue>,
}

/// Whether a method's answer is ever kept: the cheap test, before the
/// body is parsed.
pub fn keeps(method: &str) -> bool {
    FIXED.contains(&method)
        || BY_HASH.contains(&method)
        || FINALIZED_REUSE.contains(&method)
        || method == "eth_getLogs"
        || AT_BLOCK.iter().chain(STATE_AT).any(|(m, _)| *m == method)
}

/// Why the answer to `body`, one call of `method`, may be kept, if it may.
pub fn lifetime(method: &str, body: &[u8]) -> Option<Lifetime> {
    let call: Call = serde_json::from_slice(body).ok()?;
    let param = |at: usize| -> Option<&str> { call.params.get(at).map(|p| p.get()) };
    if FIXED.contains(&method) {
        return Some(Lifetime::Fixed);
    }
    if BY_HASH.contains(&method) {
        return Some(Lifetime::NamedBlock);
    }
    if FINALIZED_REUSE.contains(&method) {
        return asks_finalized(body).then_some(Lifetime::Finalized);
    }
    if method == "eth_getLogs" {
        return logs_block(param(0)?).map(Lifetime::AtBlock);
    }
    let (_, at) = AT_BLOCK
        .iter()
        .chain(STATE_AT)
        .find(|(m, _)| *m == method)?;
    block_number(param(*at)?).map(Lifetime::AtBlock)
}

/// A block parameter's number: a hex quantity, `earliest`, or an EIP-1898
/// object with `blockNumber`. Tags that move (`latest`, `safe`,
/// `finalized`, `pending`) and block hashes have none.
fn block_number(param: &str) -> Option<u64> {
    if param.starts_with('{') {
        let object: BlockObject = serde_json::from_str(param).ok()?;
        if object.block_hash.is_some() {
            return None;
        }
        return block_number(object.block_number?.get());
    }
    match serde_json::from_str::<String>(param).ok()?.as_str() {
        "earliest" => Some(0),
        hex => quantity(hex),
    }
}

/// The last block an `eth_getLogs` filter reads, when both its ends are
/// numbers (an end left out is `latest`).
fn logs_block(filter: &str) -> Option<u64> {
    let filter: LogFilter = serde_json::from_str(filter).ok()?;
    if filter.block_hash.is_some() {
        return None;
    }
    let from = block_number(filter.from_block?.get())?;
    let to = block_number(filter.to_block?.get())?;
    Some(from.max(to))
}

fn quantity(hex: &str) -> Option<u64> {
    let digits = hex.strip_prefix("0x")?;
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn of(method: &str, params: Value) -> Option<Lifetime> {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        lifetime(method, body.to_string().as_bytes())
    }

    #[test]
    fn reads_at_a_numbered_block_name_it_and_moving_tags_are_never_cached() {
        use Lifetime::*;
        let addr = "0x00000000000000000000000000000000000000aa";
        for (method, params, expected) in [
            ("eth_chainId", json!([]), Some(Fixed)),
            (
                "eth_getBlockByNumber",
                json!(["0x10", false]),
                Some(AtBlock(16)),
            ),
            (
                "eth_getBlockByNumber",
                json!(["earliest", false]),
                Some(AtBlock(0)),
            ),
            ("eth_getBlockByNumber", json!(["latest", false]), None),
            ("eth_getBlockByNumber", json!(["finalized", false]), None),
            ("eth_getBlockByNumber", json!(["safe", false]), None),
            ("eth_getBlockByNumber", json!(["pending", false]), None),
            ("eth_getBlockByNumber", json!([16, false]), None),
            ("eth_getBalance", json!([addr, "0x2a"]), Some(AtBlock(42))),
            ("eth_getBalance", json!([addr]), None),
            (
                "eth_getBalance",
                json!([addr, {"blockNumber": "0x2a"}]),
                Some(AtBlock(42)),
            ),
            ("eth_getBalance", json!([addr, {"blockHash": "0xab"}]), None),
            (
                "eth_call",
                json!([{"to": addr, "data": "0x"}, "0x5"]),
                Some(AtBlock(5)),
            ),
            (
                "eth_call",
                json!([{"to": addr, "data": "0x"}, "latest"]),
                None,
            ),
            (
                "eth_getStorageAt",
                json!([addr, "0x0", "0x7"]),
                Some(AtBlock(7)),
            ),
            (
                "eth_getLogs",
                json!([{"fromBlock": "0x1", "toBlock": "0x9"}]),
                Some(AtBlock(9)),
            ),
            ("eth_getLogs", json!([{"fromBlock": "0x1"}]), None),
            (
                "eth_getLogs",
                json!([{"fromBlock": "0x1", "toBlock": "latest"}]),
                None,
            ),
            ("eth_getLogs", json!([{"blockHash": "0xab"}]), None),
            (
                "eth_getTransactionReceipt",
                json!(["0xab"]),
                Some(NamedBlock),
            ),
            ("eth_getTransactionCount", json!([addr, "pending"]), None),
            ("eth_sendRawTransaction", json!(["0x00"]), None),
            ("eth_getFilterChanges", json!(["0x1"]), None),
            ("eth_blockNumber", json!([]), None),
            ("getTransaction", json!(["sig"]), Some(Finalized)),
            (
                "getBlock",
                json!([5, {"commitment": "finalized"}]),
                Some(Finalized),
            ),
            ("getBlock", json!([5, {"commitment": "confirmed"}]), None),
            ("getBalance", json!(["key"]), None),
            ("getGenesisHash", json!([]), Some(Fixed)),
        ] {
            assert_eq!(of(method, params.clone()), expected, "{method} {params}");
        }
    }

    #[test]
    fn the_docs_table_of_rules_names_every_method_the_rules_keep() {
        let docs = include_str!("../../../../policies/admission-gate.md");
        let start = docs
            .find("## The answer cache")
            .expect("the cache's section");
        let section = &docs[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        let kept = FIXED
            .iter()
            .chain(BY_HASH)
            .chain(FINALIZED_REUSE)
            .chain(AT_BLOCK.iter().chain(STATE_AT).map(|(m, _)| m))
            .chain(&["eth_getLogs"]);
        for method in kept {
            assert!(keeps(method));
            assert!(
                section.contains(&format!("`{method}`")),
                "{method} is not in the docs' table"
            );
        }
    }

    #[test]
    fn reads_at_latest_are_answered_at_the_head_and_state_reads_pinned_to_its_hash() {
        let addr = "0x00000000000000000000000000000000000000aa";
        let head = |method: &str, params: Value| {
            let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
            let body = body.to_string().into_bytes();
            (at_head(method, &body), body)
        };
        assert_eq!(head("eth_blockNumber", json!([])).0, Some(AtHead::Number));
        assert_eq!(
            head("eth_getBlockByNumber", json!(["latest", false])).0,
            Some(AtHead::Block)
        );
        for (method, params) in [
            ("eth_getBlockByNumber", json!(["latest", true])),
            ("eth_getBlockByNumber", json!(["0x1", false])),
            ("eth_getBalance", json!([addr, "pending"])),
            ("eth_getBalance", json!([addr, "0x1"])),
            ("eth_getBalance", json!([addr])),
            ("eth_getBalance", json!([addr, "latest", "latest"])),
            ("eth_getLogs", json!([{"toBlock": "latest"}])),
            ("eth_blockNumber", json!(["latest"])),
            ("eth_sendRawTransaction", json!(["latest"])),
        ] {
            assert_eq!(head(method, params.clone()).0, None, "{method} {params}");
        }
        let call = json!([{"to": addr, "data": "0x"}, "latest"]);
        let (Some(AtHead::State(at)), body) = head("eth_call", call) else {
            panic!("eth_call at latest is read at the head");
        };
        assert_eq!(&body[at.clone()], br#""latest""#);
        let hash = format!("0x{}", "ab".repeat(32));
        let pinned: Value = serde_json::from_slice(&pinned(&body, &at, &hash)).unwrap();
        assert_eq!(
            pinned["params"],
            json!([{"to": addr, "data": "0x"}, {"blockHash": hash}])
        );
        assert_eq!(pinned["id"], 1);
        assert_eq!(
            lifetime("eth_call", &body),
            None,
            "never kept under its own key"
        );
    }

    #[test]
    fn a_member_written_twice_is_never_cached() {
        for (method, body) in [
            (
                "eth_getBalance",
                r#"{"jsonrpc":"2.0","id":1,"method":"eth_getBalance","params":["0xaa","latest"],"params":["0xaa","0x1"]}"#,
            ),
            (
                "eth_getLogs",
                r#"{"jsonrpc":"2.0","id":1,"method":"eth_getLogs","params":[{"fromBlock":"0x1","toBlock":"latest","toBlock":"0x2"}]}"#,
            ),
            (
                "eth_getBalance",
                r#"{"jsonrpc":"2.0","id":1,"method":"eth_getBalance","params":["0xaa",{"blockNumber":"latest","blockNumber":"0x1"}]}"#,
            ),
            ("eth_getBalance", "not json"),
        ] {
            assert_eq!(lifetime(method, body.as_bytes()), None, "{body}");
        }
    }
}
