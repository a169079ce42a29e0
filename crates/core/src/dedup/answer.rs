//! The node's answer to a coalesced request, as it travels to the other
//! requests that waited for it: in a wake message on a gate VM's shared
//! queue, or kept in an answer slot for a retry (`mod.rs`).
//!
//! Each waiter gets the answer with its own JSON-RPC ids put back
//! (`Answer::body_for`): waiters are identical to the leader but for their
//! ids, so the leader's ids (kept in the answer, in call order) map to the
//! waiter's by position. Only the `id` members of the response's top-level
//! object (or of a batch response's entries) change; every other byte is
//! the node's.

use super::key::{Key, KEY_LEN};
use crate::shared::Reader;

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
            ids,
            body: at.0.to_vec(),
        })
    }

    /// The body as the request with `own` ids (in call order) gets it.
    pub fn body_for(&self, own: &[Id]) -> Vec<u8> {
        if own == self.ids.as_slice() {
            return self.body.clone();
        }
        let mapped = |id: &[u8]| -> Option<&[u8]> {
            let at = self.ids.iter().position(|i| i.as_deref() == Some(id))?;
            own.get(at)?.as_deref()
        };
        let spans = id_spans(&self.body);
        let mut out = Vec::with_capacity(self.body.len() + 16 * spans.len());
        let mut from = 0;
        for (start, end) in spans {
            let Some(new) = mapped(&self.body[start..end]) else {
                continue;
            };
            out.extend_from_slice(&self.body[from..start]);
            out.extend_from_slice(new);
            from = end;
        }
        out.extend_from_slice(&self.body[from..]);
        out
    }
}

impl Answer {
    /// A single call's answer that found something: a `result` that is
    /// not `null`, and no `error`.
    pub fn found(&self) -> bool {
        let body = &self.body;
        let at = space(body, 0);
        if body.get(at) != Some(&b'{') {
            return false;
        }
        let member = |name: &[u8]| object_member(body, at, name).and_then(|(span, _)| span);
        match (member(b"\"result\""), member(b"\"error\"")) {
            (Some((start, end)), None) => &body[start..end] != b"null",
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

/// Where the `id` values are in a JSON-RPC response: its top-level
/// object's, or each top-level entry's of a batch response. A body that is
/// not JSON has none.
fn id_spans(body: &[u8]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let at = space(body, 0);
    let found = match body.get(at) {
        Some(b'{') => object_id(body, at).map(|(id, _)| spans.extend(id)),
        Some(b'[') => (|| {
            let mut i = space(body, at + 1);
            if body.get(i) == Some(&b']') {
                return Some(());
            }
            loop {
                if body.get(i) == Some(&b'{') {
                    let (id, end) = object_id(body, i)?;
                    spans.extend(id);
                    i = end;
                } else {
                    i = skip(body, i, 0)?;
                }
                i = space(body, i);
                match body.get(i)? {
                    b',' => i = space(body, i + 1),
                    b']' => return Some(()),
                    _ => return None,
                }
            }
        })(),
        _ => None,
    };
    if found.is_none() {
        spans.clear();
    }
    spans
}

/// The span of the object at `at`'s `id` value, and where the object ends.
fn object_id(body: &[u8], at: usize) -> Option<(Option<(usize, usize)>, usize)> {
    object_member(body, at, b"\"id\"")
}

/// The span of the object at `at`'s member `name` (its raw key, quotes
/// included; the last one, as JSON readers take it), and where the object
/// ends.
fn object_member(body: &[u8], at: usize, name: &[u8]) -> Option<(Option<(usize, usize)>, usize)> {
    let mut id = None;
    let mut i = space(body, at + 1);
    if body.get(i) == Some(&b'}') {
        return Some((None, i + 1));
    }
    loop {
        let key_end = string(body, i)?;
        let key = &body[i..key_end];
        i = space(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        let start = space(body, i + 1);
        let end = skip(body, start, 1)?;
        if key == name {
            id = Some((start, end));
        }
        i = space(body, end);
        match body.get(i)? {
            b',' => i = space(body, i + 1),
            b'}' => return Some((id, i + 1)),
            _ => return None,
        }
    }
}

fn space(body: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = body.get(i) {
        i += 1;
    }
    i
}

/// The end of the string token at `at`.
fn string(body: &[u8], at: usize) -> Option<usize> {
    if body.get(at) != Some(&b'"') {
        return None;
    }
    let mut i = at + 1;
    loop {
        match body.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// The end of the value at `at` (nested no deeper than `MAX_DEPTH`).
fn skip(body: &[u8], at: usize, depth: usize) -> Option<usize> {
    if depth > super::key::MAX_DEPTH {
        return None;
    }
    match body.get(at)? {
        b'"' => string(body, at),
        open @ (b'{' | b'[') => {
            let close = if *open == b'{' { b'}' } else { b']' };
            let mut i = space(body, at + 1);
            if body.get(i) == Some(&close) {
                return Some(i + 1);
            }
            loop {
                if *open == b'{' {
                    i = space(body, string(body, i)?);
                    if body.get(i) != Some(&b':') {
                        return None;
                    }
                    i = space(body, i + 1);
                }
                i = space(body, skip(body, i, depth + 1)?);
                match body.get(i)? {
                    b',' => i = space(body, i + 1),
                    b if *b == close => return Some(i + 1),
                    _ => return None,
                }
            }
        }
        _ => {
            let end = body[at..]
                .iter()
                .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .map_or(body.len(), |n| at + n);
            (end > at).then_some(end)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
