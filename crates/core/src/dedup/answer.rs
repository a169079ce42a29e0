//! The node's answer to a coalesced request, as it travels to the other
//! requests that waited for it: in a wake message on a gate VM's shared
//! queue, or kept in an answer slot for a retry (`mod.rs`).
//!
//! **Ids.** Each request gets the answer with its own JSON-RPC ids, as it
//! wrote them (`Answer::body_for`), whatever the node did to the ids (a
//! node that re-serialises them turns `1e0` into `1.0`): a single call's
//! answer gets the request's id in place of the node's; a batch's entries
//! are matched to the leader's calls by id *value* (`jsonrpc::same_id`),
//! and each gets the id of the request's call at that position. Only the
//! `id` members change; every other byte is the node's. An answer whose
//! entries cannot all be matched to one call each, or that is encoded
//! (`content-encoding`, which the gate's callout asks the node not to
//! use), is not shared (`shareable`): its own client gets it as it came,
//! and the others go to the node themselves.

use super::key::{Key, KEY_LEN};
use crate::jsonrpc::{same_id, Name, Shape, Summary};
use crate::shared::Reader;
use std::ops::Range;

const VERSION: u8 = 1;
/// An id length that marks a notification (no id).
const NO_ID: u16 = u16::MAX;

/// A call's `id` as raw JSON, `None` for a notification.
pub type Id = Option<Vec<u8>>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub key: Key,
    pub status: u32,
    pub content_type: String,
    /// The node's `content-encoding`, if it encoded the body. Such an
    /// answer is never shared or kept, so it is not in `encode`.
    pub content_encoding: Option<String>,
    /// The leader's calls' ids, in call order.
    pub ids: Vec<Id>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn encode(&self) -> Vec<u8> {
        let ids: usize = self
            .ids
            .iter()
            .map(|i| 2 + i.as_ref().map_or(0, Vec::len))
            .sum();
        let mut out = Vec::with_capacity(32 + self.content_type.len() + ids + self.body.len());
        out.push(VERSION);
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.status.to_le_bytes());
        let content_type = &self.content_type.as_bytes()[..self.content_type.len().min(1024)];
        out.extend_from_slice(&(content_type.len() as u16).to_le_bytes());
        out.extend_from_slice(content_type);
        out.extend_from_slice(&(self.ids.len() as u32).to_le_bytes());
        for id in &self.ids {
            match id {
                Some(raw) if raw.len() < usize::from(NO_ID) => {
                    out.extend_from_slice(&(raw.len() as u16).to_le_bytes());
                    out.extend_from_slice(raw);
                }
                _ => out.extend_from_slice(&NO_ID.to_le_bytes()),
            }
        }
        out.extend_from_slice(&self.body);
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut at = Cursor(bytes);
        if at.take(1)? != [VERSION] {
            return None;
        }
        let mut key = [0; KEY_LEN];
        key.copy_from_slice(at.take(KEY_LEN)?);
        let status = Reader(at.take(4)?).u32();
        let len = Reader(at.take(2)?).u16();
        let content_type = String::from_utf8(at.take(usize::from(len))?.to_vec()).ok()?;
        let count = Reader(at.take(4)?).u32() as usize;
        let mut ids = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            let len = Reader(at.take(2)?).u16();
            ids.push(if len == NO_ID {
                None
            } else {
                Some(at.take(usize::from(len))?.to_vec())
            });
        }
        Some(Self {
            key,
            status,
            content_type,
            content_encoding: None,
            ids,
            body: at.0.to_vec(),
        })
    }

    /// Whether every request identical to the leader can be given this
    /// answer with its own ids: it is not encoded, and each of its ids
    /// names exactly one of the leader's calls (a `null` the leader did
    /// not write names none, and stays).
    pub fn shareable(&self) -> bool {
        self.content_encoding.is_none()
            && self
                .matches()
                .is_some_and(|m| m.iter().all(|(_, call)| call.is_some()))
    }

    /// The body as the request with `own` ids (in call order) gets it.
    pub fn body_for(&self, own: &[Id]) -> Vec<u8> {
        let Some(matches) = self.matches().filter(|_| self.content_encoding.is_none()) else {
            return self.body.clone();
        };
        let mut out = Vec::with_capacity(self.body.len() + 16 * matches.len());
        let mut from = 0;
        for (span, call) in matches {
            let Some(new) = call.and_then(|c| own.get(c)?.as_deref()) else {
                continue;
            };
            out.extend_from_slice(&self.body[from..span.start]);
            out.extend_from_slice(new);
            from = span.end;
        }
        out.extend_from_slice(&self.body[from..]);
        out
    }

    /// Each id in the answer: where it is, and the leader's call it
    /// answers (`None`: no single one). A single call's answer answers the
    /// leader's one call whatever its id says, but for `null`; a batch's
    /// entries are matched by id value. A `null` answers a call only if
    /// the leader wrote `null` itself: otherwise it is a node's error about
    /// something it could not read, the same for every identical request,
    /// and is left out. `None` when the body is not JSON.
    fn matches(&self) -> Option<Vec<(Range<usize>, Option<usize>)>> {
        let summary = Summary::of(&self.body);
        if !summary.valid {
            return None;
        }
        let leader: Vec<(usize, &[u8])> = self
            .ids
            .iter()
            .enumerate()
            .filter_map(|(i, id)| Some((i, id.as_deref()?)))
            .collect();
        let by_value = |value: &[u8]| {
            let mut same = leader.iter().filter(|(_, id)| same_id(id, value));
            match (same.next(), same.next()) {
                (Some((i, _)), None) => Some(*i),
                _ => None,
            }
        };
        let ids = summary
            .entries
            .iter()
            .filter_map(|e| e.last(Name::Id))
            .map(|m| m.value.clone());
        Some(
            ids.filter_map(|span| {
                let value = &self.body[span.clone()];
                let null = value == b"null";
                if null && !leader.iter().any(|(_, id)| same_id(id, value)) {
                    return None;
                }
                let call = match (summary.shape, leader.as_slice()) {
                    (Shape::Object, [(only, _)]) if !null => Some(*only),
                    _ => by_value(value),
                };
                Some((span, call))
            })
            .collect(),
        )
    }

    /// A single call's answer that found something: a `result` that is
    /// not `null`, and no `error`.
    pub fn found(&self) -> bool {
        let summary = Summary::of(&self.body);
        let Some(entry) = summary
            .entries
            .first()
            .filter(|_| summary.valid && summary.shape == Shape::Object)
        else {
            return false;
        };
        match (entry.last(Name::Result), entry.has(Name::Error)) {
            (Some(result), false) => &self.body[result.value.clone()] != b"null",
            _ => false,
        }
    }
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jsonrpc::testing::id_spelling;

    fn ids(raw: &[Option<&str>]) -> Vec<Id> {
        raw.iter()
            .map(|i| i.map(|s| s.as_bytes().to_vec()))
            .collect()
    }

    fn answer(body: &str, leader: &[Option<&str>]) -> Answer {
        Answer {
            key: [3; KEY_LEN],
            status: 200,
            content_type: "application/json".into(),
            content_encoding: None,
            ids: ids(leader),
            body: body.as_bytes().to_vec(),
        }
    }

    fn rewritten(a: &Answer, own: &[Option<&str>]) -> String {
        String::from_utf8(a.body_for(&ids(own))).unwrap()
    }

    #[test]
    fn a_waiter_gets_its_own_id() {
        let a = answer(
            r#"{"jsonrpc":"2.0", "id" : 7,"result":{"id":7,"x":"\"id\":7"}}"#,
            &[Some("7")],
        );
        assert_eq!(
            rewritten(&a, &[Some(r#""abc""#)]),
            r#"{"jsonrpc":"2.0", "id" : "abc","result":{"id":7,"x":"\"id\":7"}}"#
        );
        assert_eq!(
            rewritten(&a, &[Some("7")]),
            String::from_utf8(a.body.clone()).unwrap()
        );
    }

    #[test]
    fn a_node_that_rewrites_ids_cannot_give_anyone_the_wrong_one() {
        // serde turns 1e0 into 1.0: the leader gets 1e0 back, a waiter its own.
        let a = answer(
            r#"{"jsonrpc":"2.0","id":1.0,"result":"0x1"}"#,
            &[Some("1e0")],
        );
        assert!(a.shareable());
        assert_eq!(
            rewritten(&a, &[Some("1e0")]),
            r#"{"jsonrpc":"2.0","id":1e0,"result":"0x1"}"#
        );
        assert_eq!(
            rewritten(&a, &[Some("42")]),
            r#"{"jsonrpc":"2.0","id":42,"result":"0x1"}"#
        );
        // A node that answers a single call with some other id.
        let a = answer(r#"{"id":"a","result":1}"#, &[Some("7")]);
        assert_eq!(rewritten(&a, &[Some("9")]), r#"{"id":9,"result":1}"#);
        // A batch's entries by value, in the node's order.
        let a = answer(
            r#"[{"id":6.0,"result":"b"},{"id":5.0,"result":"a"}]"#,
            &[Some("5e0"), Some("6e0")],
        );
        assert!(a.shareable());
        assert_eq!(
            rewritten(&a, &[Some("5"), Some("6")]),
            r#"[{"id":6,"result":"b"},{"id":5,"result":"a"}]"#
        );
        assert_eq!(
            rewritten(&a, &[Some("5e0"), Some("6e0")]),
            r#"[{"id":6e0,"result":"b"},{"id":5e0,"result":"a"}]"#
        );
    }

    #[test]
    fn an_answer_that_cannot_be_matched_or_read_is_not_shared() {
        // An id that names none of the leader's calls.
        assert!(!answer(
            r#"[{"id":3,"result":1},{"id":2,"result":1}]"#,
            &[Some("1"), Some("2")]
        )
        .shareable());
        // Two of the leader's calls with one value.
        assert!(!answer(
            r#"[{"id":1,"result":1},{"id":1,"result":2}]"#,
            &[Some("1"), Some("1.0")]
        )
        .shareable());
        let mut encoded = answer(r#"{"id":1,"result":1}"#, &[Some("1")]);
        encoded.content_encoding = Some("gzip".into());
        assert!(!encoded.shareable());
        assert_eq!(rewritten(&encoded, &[Some("2")]), r#"{"id":1,"result":1}"#);
    }

    proptest::proptest! {
        /// Whatever ids the leader and a waiter wrote, and however the
        /// node re-serialises them, each gets exactly its own ids back.
        #[test]
        fn every_request_gets_exactly_its_own_ids(
            leader in proptest::collection::vec(id_spelling(), 1..5),
            waiter in proptest::collection::vec(id_spelling(), 5),
            reversed in proptest::bool::ANY,
        ) {
            let leader: Vec<String> = leader;
            let values: Vec<serde_json::Value> =
                leader.iter().map(|i| serde_json::from_str(i).unwrap()).collect();
            let batch = leader.len() > 1;
            let mut entries: Vec<String> = values
                .iter()
                .enumerate()
                .map(|(i, v)| serde_json::json!({"jsonrpc": "2.0", "id": v, "result": i}).to_string())
                .collect();
            if reversed {
                entries.reverse();
            }
            let body = if batch { format!("[{}]", entries.join(",")) } else { entries[0].clone() };
            let own: Vec<Option<&str>> = leader.iter().map(|i| Some(i.as_str())).collect();
            let a = answer(&body, &own);
            let distinct = (0..values.len()).all(|i| (0..i).all(|j| {
                !same_id(leader[i].as_bytes(), leader[j].as_bytes())
            }));
            if !distinct {
                return Ok(());
            }
            proptest::prop_assert!(a.shareable(), "{}", body);
            for ids in [own.clone(), waiter.iter().take(leader.len()).map(|i| Some(i.as_str())).collect()] {
                let got = rewritten(&a, &ids);
                let summary = Summary::of(got.as_bytes());
                for entry in &summary.entries {
                    let id = &got[entry.last(Name::Id).unwrap().value.clone()];
                    let call: usize = entry.last(Name::Result).map(|r| got[r.value.clone()].parse().unwrap()).unwrap();
                    proptest::prop_assert_eq!(Some(id), ids[call]);
                }
            }
        }
    }

    #[test]
    fn a_null_the_leader_wrote_is_the_leaders_id_and_each_waiter_gets_its_own() {
        let a = answer(
            r#"{"jsonrpc":"2.0","id":null,"result":"0x1"}"#,
            &[Some("null")],
        );
        assert!(a.shareable());
        assert_eq!(
            rewritten(&a, &[Some("42")]),
            r#"{"jsonrpc":"2.0","id":42,"result":"0x1"}"#
        );
        assert_eq!(
            rewritten(&a, &[Some(r#""victim""#)]),
            r#"{"jsonrpc":"2.0","id":"victim","result":"0x1"}"#
        );
        assert_eq!(
            rewritten(&a, &[Some("null")]),
            r#"{"jsonrpc":"2.0","id":null,"result":"0x1"}"#
        );
        // In a batch, by value: the one call the leader wrote `null` for.
        let a = answer(
            r#"[{"id":1,"result":"a"},{"id":null,"result":"b"}]"#,
            &[Some("null"), Some("1")],
        );
        assert!(a.shareable());
        assert_eq!(
            rewritten(&a, &[Some("7"), Some("8")]),
            r#"[{"id":8,"result":"a"},{"id":7,"result":"b"}]"#
        );
        // Two nulls cannot be told apart.
        let a = answer(
            r#"[{"id":null,"result":"a"},{"id":null,"result":"b"}]"#,
            &[Some("null"), Some("null")],
        );
        assert!(!a.shareable());
    }

    #[test]
    fn a_batch_maps_ids_by_position_whatever_the_answer_order() {
        let a = answer(
            r#"[{"id":"b","result":2},{"jsonrpc":"2.0","id":1,"error":{"code":-1}}]"#,
            &[Some("1"), None, Some(r#""b""#)],
        );
        assert_eq!(
            rewritten(&a, &[Some("10"), None, Some("11")]),
            r#"[{"id":11,"result":2},{"jsonrpc":"2.0","id":10,"error":{"code":-1}}]"#
        );
    }

    #[test]
    fn bodies_that_are_not_json_rpc_pass_as_they_are() {
        for body in [
            "not json",
            "",
            r#"{"id":1"#,
            r#"[{"id":1},"#,
            "[1,2]",
            "{}",
            "[]",
        ] {
            let a = answer(body, &[Some("1")]);
            assert_eq!(rewritten(&a, &[Some("2")]), body, "{body}");
        }
        // An id the leader did not send (a parse error's null) stays.
        let a = answer(r#"{"id":null,"error":{}}"#, &[Some("1")]);
        assert_eq!(rewritten(&a, &[Some("2")]), r#"{"id":null,"error":{}}"#);
    }

    #[test]
    fn an_answer_is_found_when_its_result_is_not_null() {
        let found = |body: &str| answer(body, &[Some("1")]).found();
        assert!(found(
            r#"{"jsonrpc":"2.0","id":1,"result":{"blockHash":"0xab"}}"#
        ));
        assert!(found(r#" {"result" : "0x0"} "#));
        assert!(!found(r#"{"jsonrpc":"2.0","id":1,"result":null}"#));
        assert!(!found(r#"{"id":1,"error":{"code":-32000},"result":"0x"}"#));
        assert!(!found(r#"[{"id":1,"result":"0x1"}]"#));
        assert!(!found("not json"));
    }

    #[test]
    fn answers_round_trip() {
        let a = answer(
            r#"{"id":1,"result":"0x1"}"#,
            &[Some("1"), None, Some(r#""x""#)],
        );
        assert_eq!(Answer::decode(&a.encode()), Some(a.clone()));
        let bytes = a.encode();
        for cut in [0, 1, 10, 22, 25] {
            assert_eq!(Answer::decode(&bytes[..cut]), None, "cut at {cut}");
        }
    }
}
