//! The chain's head as the gate has just seen it, for reads at `latest`
//! (`cache.latest`).
//!
//! **Never stale.** A read at `latest` is held until a head poll that
//! started after it came answers (`eth_getBlockByNumber("latest",
//! false)`, one poll in flight per worker, shared by every read waiting
//! for it). The block the poll names was the node's head at a moment
//! while the read waited, so an answer about that block is an answer the
//! node could have given the read: `eth_blockNumber` and the head block
//! come from the poll itself; a read of state is asked at the head's
//! block hash (EIP-1898) and kept under that hash, where its answer
//! cannot change. A new head, on this branch or another, has another
//! hash: no answer kept for the old one is served for it, so a reorg
//! needs nothing dropped. A poll that fails lets its reads go on to the
//! node as they came.

use crate::dedup::answer::Answer;

/// The poll's request body.
pub const REQUEST: &[u8] =
    br#"{"jsonrpc":"2.0","id":1,"method":"eth_getBlockByNumber","params":["latest",false]}"#;

/// The head block, as a poll found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub number: u64,
    /// `0x` and 64 hex digits.
    pub hash: String,
    /// The poll's answer: the head block, for `eth_getBlockByNumber`.
    pub block: Answer,
}

impl Head {
    /// The head in the poll's answer: a found 200 whose result has a
    /// number and a hash; `None` for anything else.
    pub fn read(answer: Answer) -> Option<Self> {
        if answer.status != 200 || answer.content_encoding.is_some() || !answer.found() {
            return None;
        }
        let value: serde_json::Value = serde_json::from_slice(&answer.body).ok()?;
        let number = value["result"]["number"].as_str()?.strip_prefix("0x")?;
        let number = u64::from_str_radix(number, 16).ok()?;
        let hash = value["result"]["hash"].as_str()?;
        let digits = hash.strip_prefix("0x")?;
        if digits.len() != 64 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        Some(Self {
            number,
            hash: hash.to_string(),
            block: Answer {
                ids: vec![Some(b"1".to_vec())],
                ..answer
            },
        })
    }

    /// `eth_blockNumber`'s answer at this head (id 1, replaced by each
    /// request's own).
    pub fn number_answer(&self) -> Answer {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":1,"result":"0x{:x}"}}"#,
            self.number
        );
        Answer {
            content_type: "application/json".into(),
            body: body.into_bytes(),
            ..self.block.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: &str) -> Answer {
        Answer {
            key: [0; 16],
            status: 200,
            content_type: "application/json".into(),
            content_encoding: None,
            ids: vec![Some(b"1".to_vec())],
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_poll_names_the_head_by_number_and_hash_or_nothing() {
        let hash = format!("0x{}", "0a".repeat(32));
        let body =
            format!(r#"{{"jsonrpc":"2.0","id":1,"result":{{"number":"0x1f","hash":"{hash}"}}}}"#);
        let head = Head::read(answer(&body)).unwrap();
        assert_eq!((head.number, head.hash.as_str()), (31, hash.as_str()));
        let number = head.number_answer();
        let served: serde_json::Value =
            serde_json::from_slice(&number.body_for(&[Some(b"\"a\"".to_vec())])).unwrap();
        assert_eq!(
            served,
            serde_json::json!({"jsonrpc": "2.0", "id": "a", "result": "0x1f"})
        );
        for body in [
            r#"{"jsonrpc":"2.0","id":1,"result":null}"#.to_string(),
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32000,"message":"x"}}"#.to_string(),
            body.replace(&hash, "0xab"),
            body.replace(&hash, &format!("0x{}\\\"", "0a".repeat(31))),
            body.replace("0x1f", "31"),
        ] {
            assert_eq!(Head::read(answer(&body)), None, "{body}");
        }
        let mut failed = answer(&body);
        failed.status = 503;
        assert_eq!(Head::read(failed), None);
    }
}
