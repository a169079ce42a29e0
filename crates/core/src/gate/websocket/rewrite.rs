//! The text side of a public WebSocket: what each client message becomes
//! on its way to the node, and what each answer becomes on its way back.
//!
//! A message whose calls every node answers with the client's own ids (a
//! call with a plain `"id"`, a batch of them, anything that is no call and
//! gets an error) goes as it came. Otherwise the gate gives calls ids of
//! its own, *gateway ids* (`"sg-<socket nonce>-<n>"`), and remembers what
//! each stands for (`Restore`):
//! - a notification (no id: executed, never answered) gets one, so that
//!   its answer shows when the node is done with it; the answer is dropped;
//! - a call whose id key some node reads and another may not (`"ID"`,
//!   `"\u0069d"`, two of them), or whose id a node may write back spelled
//!   otherwise (`null`, `1e0`, `-0`, a 30-digit number, a string with
//!   escapes: `jsonrpc::echoed_as_written`), has its id members replaced
//!   by one gateway id; the answer gets the client's id back, as the
//!   client wrote it;
//! - calls packed into one batch by the gate (more calls than slots) each
//!   get one, so that the batch's answer can be split back into one
//!   answer per call;
//! - a response from the client (`result` or `error`, no `method`: nodes
//!   never call their clients) is not sent at all: a Go node ignores one,
//!   so its slot would never come back.

use crate::jsonrpc::{echoed_as_written, Entry, Id, Kind, Name, Shape, Summary};
use std::ops::Range;

/// What a gateway id's answer becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// The client's id, as it wrote it.
    Id(Vec<u8>),
    /// A notification's: no answer for the client.
    Drop,
    /// A subscribe refused past a limit (`subscriptions`): the gate's
    /// error, with the client's id, as it wrote it.
    Refuse(Vec<u8>, u32),
}

/// One call of a client message: its object without id members, and what
/// its gateway id, if it gets one, stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub bare: Vec<u8>,
    pub restore: Restore,
}

/// A client message, ready to go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outgoing {
    /// Sent as it is, alone; its answer carries the client's ids.
    Plain(Vec<u8>),
    /// A call, or a batch of calls (`batch`). `alone`: every id is plain,
    /// so sent by itself it goes as `original`; else (or packed with
    /// others) each call goes with a gateway id.
    Calls {
        original: Vec<u8>,
        batch: bool,
        calls: Vec<Call>,
        alone: bool,
        /// It may share a unit with others (a subscription may not).
        mergeable: bool,
    },
    /// A batch with entries that are no calls, some of whose calls take
    /// gateway ids; it goes alone.
    Batch(Vec<BatchEntry>),
}

/// One entry of a batch the gate rewrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchEntry {
    Plain(Vec<u8>),
    Call(Call),
}

/// What to do with a client message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    Send(Outgoing),
    /// A response, or a batch of them: nothing to send.
    Skip,
}

/// Decides what `payload` (a whole client message, `summary` its scan)
/// becomes.
pub fn prepare(payload: Vec<u8>, summary: &Summary) -> Prepared {
    if !summary.valid {
        return Prepared::Send(Outgoing::Plain(payload));
    }
    let entries: Vec<&Entry> = summary
        .entries
        .iter()
        .filter(|e| e.kind() != Kind::Response)
        .collect();
    let batch = summary.shape == Shape::Array;
    if entries.is_empty() && !summary.entries.is_empty() {
        return Prepared::Skip;
    }
    if !matches!(summary.shape, Shape::Object | Shape::Array) || entries.is_empty() {
        return Prepared::Send(Outgoing::Plain(payload));
    }
    let skipped = entries.len() < summary.entries.len();
    if entries.iter().all(|e| e.kind() == Kind::Call) {
        let calls: Vec<Call> = entries.iter().map(|e| call(&payload, e)).collect();
        let alone = !skipped && entries.iter().all(|e| echoed(&payload, e));
        let mergeable = !entries.iter().any(|e| {
            e.method
                .as_deref()
                .is_some_and(|m| m.to_ascii_lowercase().contains("subscribe"))
        });
        return Prepared::Send(Outgoing::Calls {
            original: payload,
            batch,
            calls,
            alone,
            mergeable,
        });
    }
    if !batch || entries.iter().all(|e| e.kind() == Kind::Invalid) {
        return Prepared::Send(Outgoing::Plain(payload));
    }
    let untouched = |e: &&Entry| e.kind() == Kind::Invalid || echoed(&payload, e);
    if !skipped && entries.iter().all(untouched) {
        return Prepared::Send(Outgoing::Plain(payload));
    }
    Prepared::Send(Outgoing::Batch(
        entries
            .iter()
            .map(|e| match e.kind() {
                Kind::Call => BatchEntry::Call(call(&payload, e)),
                _ => BatchEntry::Plain(payload[e.span.clone()].to_vec()),
            })
            .collect(),
    ))
}

/// Whether every node answers `entry` with its id as the client wrote it:
/// one plain id member, of a value no node re-spells.
fn echoed(payload: &[u8], entry: &Entry) -> bool {
    matches!(entry.id(), Id::Plain(value) if echoed_as_written(&payload[value.clone()]))
}

fn call(payload: &[u8], entry: &Entry) -> Call {
    let restore = match entry.id() {
        Id::Absent => Restore::Drop,
        Id::Plain(value) | Id::Unsure(value) => Restore::Id(payload[value].to_vec()),
    };
    Call {
        bare: without_ids(payload, entry),
        restore,
    }
}

/// The object of `entry` with every member a node may read as its id
/// removed (and the commas that went with them).
fn without_ids(payload: &[u8], entry: &Entry) -> Vec<u8> {
    let base = entry.span.start;
    let mut text = payload[entry.span.clone()].to_vec();
    let mut ids: Vec<Range<usize>> = entry
        .named(Name::Id)
        .map(|m| m.key.start - base..m.value.end - base)
        .collect();
    ids.sort_by_key(|r| r.start);
    for member in ids.into_iter().rev() {
        let after = skip_space(&text, member.end);
        let cut = if text.get(after) == Some(&b',') {
            member.start..after + 1
        } else {
            // The last member: the comma before it goes.
            let mut before = member.start;
            while before > 0 && text[before - 1].is_ascii_whitespace() {
                before -= 1;
            }
            if before > 0 && text[before - 1] == b',' {
                before -= 1;
            }
            before..member.end
        };
        text.drain(cut);
    }
    text
}

fn skip_space(text: &[u8], mut at: usize) -> usize {
    while text.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

/// A gateway id's JSON text: a string no client would write by chance.
pub fn gateway_id(nonce: u64, seq: u64) -> String {
    format!("\"sg-{nonce:016x}-{seq}\"")
}

/// The sequence number of a gateway id of socket `nonce`, from its JSON
/// text.
pub fn gateway_seq(nonce: u64, text: &[u8]) -> Option<u64> {
    let prefix = format!("\"sg-{nonce:016x}-");
    let rest = text.strip_prefix(prefix.as_bytes())?.strip_suffix(b"\"")?;
    if rest.is_empty() || !rest.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(rest).ok()?.parse().ok()
}

/// `bare` (an object with no id member, `{` first) with `"id":<id>` as
/// its first member.
pub fn with_id(bare: &[u8], id: &str) -> Vec<u8> {
    let Some((&open, rest)) = bare.split_first() else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(bare.len() + id.len() + 6);
    out.push(open);
    out.extend_from_slice(b"\"id\":");
    out.extend_from_slice(id.as_bytes());
    if rest.get(skip_space(rest, 0)) != Some(&b'}') {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    out
}

/// `text` with the byte range `range` replaced by `with`.
pub fn replace(text: &[u8], range: Range<usize>, with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + with.len());
    out.extend_from_slice(&text[..range.start]);
    out.extend_from_slice(with);
    out.extend_from_slice(&text[range.end..]);
    out
}

/// An answer the gate makes for a call the node's answer did not cover:
/// the node's `error` object when it sent one, else a JSON-RPC internal
/// error.
pub fn error_answer(id: &[u8], node_error: Option<&[u8]>) -> Vec<u8> {
    let error = node_error.map_or_else(
        || br#"{"code":-32603,"message":"the node's answer did not name this call"}"#.to_vec(),
        <[u8]>::to_vec,
    );
    [
        br#"{"jsonrpc":"2.0","id":"#.as_slice(),
        id,
        br#","error":"#,
        &error,
        b"}",
    ]
    .concat()
}

/// A server answer's call ids that are gateway ids of socket `nonce`:
/// the entry index (0 for an object), the id value's range, its seq.
pub fn gateway_ids(
    nonce: u64,
    payload: &[u8],
    summary: &Summary,
) -> Vec<(usize, Range<usize>, u64)> {
    summary
        .entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let id = e.last(Name::Id)?;
            let seq = gateway_seq(nonce, &payload[id.value.clone()])?;
            Some((i, id.value.clone(), seq))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared(text: &str) -> Prepared {
        prepare(text.as_bytes().to_vec(), &Summary::of(text.as_bytes()))
    }

    fn s(bytes: &[u8]) -> &str {
        std::str::from_utf8(bytes).unwrap()
    }

    #[test]
    fn what_every_node_answers_alike_goes_as_it_came() {
        for text in ["not json", "[]", "42", r#"[5,{"x":1}]"#] {
            assert_eq!(
                prepared(text),
                Prepared::Send(Outgoing::Plain(text.as_bytes().to_vec())),
                "{text}"
            );
        }
        for text in [
            r#"{"jsonrpc":"2.0","id":7,"method":"eth_call"}"#,
            r#"[{"jsonrpc":"2.0","id":1,"method":"a"},{"id":"x","method":"b"}]"#,
        ] {
            let Prepared::Send(Outgoing::Calls {
                alone,
                mergeable,
                original,
                ..
            }) = prepared(text)
            else {
                panic!("{text}")
            };
            assert!(alone && mergeable, "{text}");
            assert_eq!(original, text.as_bytes());
        }
    }

    #[test]
    fn an_id_a_node_may_spell_otherwise_goes_with_a_gateway_id() {
        for id in [
            "null",
            "1e0",
            "-0",
            "1.5",
            "0123",
            "123456789012345678901234567890",
            r#""\u0041""#,
            r#""a<b""#,
        ] {
            let text = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call"}}"#);
            let Prepared::Send(Outgoing::Calls { alone, calls, .. }) = prepared(&text) else {
                panic!("{text}")
            };
            assert!(!alone, "{text}");
            assert_eq!(calls[0].restore, Restore::Id(id.as_bytes().to_vec()));
        }
        for id in ["0", "-7", "123456789012345", r#""sub-1 x""#] {
            assert!(crate::jsonrpc::echoed_as_written(id.as_bytes()), "{id}");
        }
    }

    #[test]
    fn notifications_and_unsure_ids_lose_their_id_members() {
        for (text, bare, restore) in [
            (
                r#"{"jsonrpc":"2.0","method":"eth_getLogs","params":[{}]}"#,
                r#"{"jsonrpc":"2.0","method":"eth_getLogs","params":[{}]}"#,
                Restore::Drop,
            ),
            (
                r#"{"\u0069d":7,"method":"m"}"#,
                r#"{"method":"m"}"#,
                Restore::Id(b"7".to_vec()),
            ),
            (
                r#"{"method":"m", "ID" : "x" , "id":2}"#,
                r#"{"method":"m" }"#,
                Restore::Id(b"2".to_vec()),
            ),
        ] {
            let Prepared::Send(Outgoing::Calls {
                calls,
                alone,
                batch,
                ..
            }) = prepared(text)
            else {
                panic!("{text}")
            };
            assert!(!alone && !batch, "{text}");
            assert_eq!(
                calls,
                [Call {
                    bare: bare.as_bytes().to_vec(),
                    restore
                }],
                "{text}"
            );
        }
    }

    #[test]
    fn a_gateway_id_is_the_first_member_and_reads_back() {
        let id = gateway_id(0xabc, 42);
        assert_eq!(
            s(&with_id(br#"{"method":"m"}"#, &id)),
            r#"{"id":"sg-0000000000000abc-42","method":"m"}"#
        );
        assert_eq!(
            s(&with_id(b"{ }", &id)),
            r#"{"id":"sg-0000000000000abc-42" }"#
        );
        assert_eq!(gateway_seq(0xabc, id.as_bytes()), Some(42));
        assert_eq!(gateway_seq(0xabd, id.as_bytes()), None);
        assert_eq!(gateway_seq(0xabc, br#""sg-0000000000000abc-""#), None);
        let value: serde_json::Value =
            serde_json::from_slice(&with_id(br#"{"method":"m","params":[]}"#, &id)).unwrap();
        assert_eq!(value["id"], "sg-0000000000000abc-42");
    }

    #[test]
    fn responses_are_not_sent_and_subscriptions_are_not_merged() {
        assert_eq!(
            prepared(r#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#),
            Prepared::Skip
        );
        assert_eq!(
            prepared(r#"[{"id":1,"result":1},{"id":2,"error":{}}]"#),
            Prepared::Skip
        );
        let Prepared::Send(Outgoing::Calls {
            calls,
            alone,
            batch,
            ..
        }) = prepared(r#"[{"id":1,"result":1},{"method":"note"},{"id":3,"method":"a"}]"#)
        else {
            panic!()
        };
        assert!(batch && !alone, "a response left out: not as it came");
        assert_eq!(calls.len(), 2);
        let Prepared::Send(Outgoing::Batch(entries)) = prepared(r#"[7,{"method":"note"}]"#) else {
            panic!()
        };
        assert_eq!(entries[0], BatchEntry::Plain(b"7".to_vec()));
        for method in [
            "eth_subscribe",
            "eth_unsubscribe",
            "slotSubscribe",
            "accountUnsubscribe",
        ] {
            let text = format!(r#"{{"id":1,"method":"{method}","params":[]}}"#);
            let Prepared::Send(Outgoing::Calls { mergeable, .. }) = prepared(&text) else {
                panic!()
            };
            assert!(!mergeable, "{method}");
        }
    }

    #[test]
    fn an_answer_is_found_by_its_gateway_id() {
        let answer = format!(
            r#"[{{"jsonrpc":"2.0","id":{},"result":1}},{{"id":5,"result":2}}]"#,
            gateway_id(9, 3)
        );
        let summary = Summary::of(answer.as_bytes());
        let found = gateway_ids(9, answer.as_bytes(), &summary);
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].0, found[0].2), (0, 3));
        assert_eq!(
            s(&replace(answer.as_bytes(), found[0].1.clone(), b"\"x\"")),
            r#"[{"jsonrpc":"2.0","id":"x","result":1},{"id":5,"result":2}]"#
        );
        assert_eq!(
            s(&error_answer(
                b"7",
                Some(br#"{"code":-32600,"message":"batch too large"}"#)
            )),
            r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32600,"message":"batch too large"}}"#
        );
    }
}
