//! JSON-RPC 2.0 framing: parse a body into calls, and shape responses.
//!
//! Errors follow the spec: -32700 for a body that is not JSON, -32600 for a
//! value that is not a request (or an empty batch), -32601 for a method the
//! node does not know. A request without an `id` is a notification and gets
//! no response entry.

use serde_json::{json, Value};

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;

/// One entry of a body, checked.
#[derive(Debug, PartialEq)]
pub enum Call {
    Request {
        /// `None` for a notification.
        id: Option<Value>,
        method: String,
        params: Value,
    },
    Invalid {
        id: Value,
        reason: &'static str,
    },
}

/// A parsed body: one call, or a batch of them.
#[derive(Debug, PartialEq)]
pub enum Body {
    Single(Call),
    Batch(Vec<Call>),
}

/// Parses a body, or returns the single error response to send instead.
pub fn parse(body: &[u8]) -> Result<Body, Value> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| error(Value::Null, PARSE_ERROR, &format!("parse error: {e}")))?;
    match value {
        Value::Array(entries) if entries.is_empty() => Err(error(
            Value::Null,
            INVALID_REQUEST,
            "invalid request: empty batch",
        )),
        Value::Array(entries) => Ok(Body::Batch(entries.into_iter().map(check).collect())),
        single => Ok(Body::Single(check(single))),
    }
}

fn check(value: Value) -> Call {
    let Value::Object(mut object) = value else {
        return Call::Invalid {
            id: Value::Null,
            reason: "a request must be an object",
        };
    };
    let id = match object.remove("id") {
        None => None,
        Some(id @ (Value::Null | Value::Number(_) | Value::String(_))) => Some(id),
        Some(_) => {
            return Call::Invalid {
                id: Value::Null,
                reason: "id must be a string, a number or null",
            }
        }
    };
    let invalid = |reason| Call::Invalid {
        id: id.clone().unwrap_or(Value::Null),
        reason,
    };
    if object.get("jsonrpc") != Some(&Value::String("2.0".into())) {
        return invalid("jsonrpc must be \"2.0\"");
    }
    let method = match object.remove("method") {
        Some(Value::String(method)) => method,
        _ => return invalid("method must be a string"),
    };
    let params = match object.remove("params") {
        None => Value::Array(Vec::new()),
        Some(params @ (Value::Array(_) | Value::Object(_))) => params,
        Some(_) => return invalid("params must be an array or an object"),
    };
    Call::Request { id, method, params }
}

pub fn error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

pub fn result(id: Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// Blocks behind the head that are final (Ethereum finalises two epochs
/// of 32 slots; anvil answers `finalized` the same way), and safe.
pub const FINALITY_DEPTH: u64 = 64;
pub const SAFE_DEPTH: u64 = 32;

/// The block a block tag or number names, given the executed head: `None`
/// for one not reached yet, or not a block tag or number.
fn block_named(tag: &Value, head: u64) -> Option<u64> {
    let number = match tag.as_str()? {
        "latest" | "pending" => head,
        "safe" => head.saturating_sub(SAFE_DEPTH),
        "finalized" => head.saturating_sub(FINALITY_DEPTH),
        "earliest" => 0,
        hex => u64::from_str_radix(hex.strip_prefix("0x")?, 16).ok()?,
    };
    (number <= head).then_some(number)
}

/// Block `n` as this chain has it: its hash is its number, written out.
fn block(n: u64) -> Value {
    json!({
        "number": format!("{n:#x}"),
        "hash": format!("0x{n:064x}"),
        "parentHash": format!("0x{:064x}", n.saturating_sub(1)),
        "transactions": [],
    })
}

/// A plausible result for a known method, given the executed head, on
/// chain `chain_id`.
pub fn canned_result(method: &str, params: &Value, head: u64, chain_id: u64) -> Value {
    let hex = |n: u64| Value::String(format!("{n:#x}"));
    match method {
        "eth_blockNumber" => hex(head),
        "eth_chainId" => hex(chain_id),
        "net_version" => Value::String(chain_id.to_string()),
        "web3_clientVersion" => {
            Value::String(concat!("stakegate-rpc-node/", env!("CARGO_PKG_VERSION")).into())
        }
        "eth_getBlockByNumber" => block_named(&params[0], head).map_or(Value::Null, block),
        "eth_getBlockByHash" => block_named(&params[0], head)
            .filter(|_| params[0].as_str().is_some_and(|h| h.len() == 66))
            .map_or(Value::Null, block),
        "eth_call" => Value::String(format!("0x{:064x}", params.to_string().len())),
        "eth_getProof" => {
            json!({"accountProof": [], "balance": "0x0", "nonce": "0x0", "storageProof": []})
        }
        "eth_getLogs" => json!([]),
        "eth_getTransactionReceipt" => Value::Null,
        "eth_sendRawTransaction" => {
            Value::String(format!("0x{:064x}", fnv1a(params.to_string().as_bytes())))
        }
        _ => hex(0),
    }
}

pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: Value, method: &str) -> Call {
        Call::Request {
            id: Some(id),
            method: method.into(),
            params: json!([]),
        }
    }

    #[test]
    fn a_single_request_parses() {
        let body = br#"{"jsonrpc":"2.0","id":7,"method":"eth_blockNumber"}"#;
        assert_eq!(
            parse(body).unwrap(),
            Body::Single(request(json!(7), "eth_blockNumber"))
        );
    }

    #[test]
    fn a_batch_parses_entry_by_entry() {
        let body = br#"[{"jsonrpc":"2.0","id":"a","method":"eth_call","params":[{}]},
                        {"jsonrpc":"1.0","id":2,"method":"eth_call"},
                        {"jsonrpc":"2.0","method":"eth_chainId"}]"#;
        let Body::Batch(calls) = parse(body).unwrap() else {
            panic!("not a batch")
        };
        assert_eq!(calls.len(), 3);
        assert!(matches!(&calls[0], Call::Request { id: Some(id), .. } if id == "a"));
        assert_eq!(
            calls[1],
            Call::Invalid {
                id: json!(2),
                reason: "jsonrpc must be \"2.0\""
            }
        );
        assert!(matches!(&calls[2], Call::Request { id: None, .. }));
    }

    #[test]
    fn malformed_json_is_a_parse_error() {
        let err = parse(b"{\"jsonrpc\":").unwrap_err();
        assert_eq!(err["error"]["code"], PARSE_ERROR);
        assert_eq!(err["id"], Value::Null);
    }

    #[test]
    fn an_empty_batch_is_invalid() {
        let err = parse(b"[]").unwrap_err();
        assert_eq!(err["error"]["code"], INVALID_REQUEST);
    }

    #[test]
    fn non_requests_are_invalid_with_a_reason() {
        for (body, reason) in [
            (&b"42"[..], "a request must be an object"),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":5}"#,
                "method must be a string",
            ),
            (
                br#"{"jsonrpc":"2.0","id":[1],"method":"x"}"#,
                "id must be a string, a number or null",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"x","params":3}"#,
                "params must be an array or an object",
            ),
        ] {
            let Body::Single(Call::Invalid { reason: got, .. }) = parse(body).unwrap() else {
                panic!("{body:?} should be invalid");
            };
            assert_eq!(got, reason);
        }
    }

    #[test]
    fn blocks_are_named_by_tag_number_or_hash() {
        let number = |method: &str, param: &str| {
            canned_result(method, &json!([param, false]), 100, 1)["number"].clone()
        };
        assert_eq!(number("eth_getBlockByNumber", "latest"), json!("0x64"));
        assert_eq!(number("eth_getBlockByNumber", "finalized"), json!("0x24"));
        assert_eq!(number("eth_getBlockByNumber", "safe"), json!("0x44"));
        assert_eq!(number("eth_getBlockByNumber", "0x7"), json!("0x7"));
        assert_eq!(number("eth_getBlockByNumber", "0x65"), Value::Null);
        let hash = format!("0x{:064x}", 7);
        assert_eq!(number("eth_getBlockByHash", &hash), json!("0x7"));
        assert_eq!(number("eth_getBlockByHash", "0x7"), Value::Null);
    }

    #[test]
    fn block_number_reports_the_head() {
        assert_eq!(
            canned_result("eth_blockNumber", &json!([]), 255, 1),
            json!("0xff")
        );
    }
}
