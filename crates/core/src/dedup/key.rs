//! The request key: what makes two JSON-RPC requests the same request.
//!
//! A key is the first 16 bytes of
//! `sha256("stakegate.dedup.v1" 0 scope 0 canonical(request without id))`.
//!
//! **Canonical form.** The body is parsed into a tree of raw tokens and
//! written back with no whitespace and each object's members sorted by
//! their raw key bytes (a stable sort, so repeated keys keep their order).
//! Scalars are copied byte for byte: `1` and `1.0`, or `"A"` and
//! `"\u0041"`, stay different. So canonicalising can only miss a duplicate,
//! never merge two requests a node could answer differently: the canonical
//! text is the same JSON value as the input, and from it the input's tree
//! can be read back up to member order and whitespace. Only the top-level
//! `id` member is left out (a retry usually takes a new id); an `id` inside
//! `params` is kept.
//!
//! **Batches** are keyed as a whole: the gateway forwards a batch as one
//! upstream request, so it can only send or refuse all of it. Keying entry by
//! entry would need the gateway to split a batch and merge the node's
//! answers. A batch is deduplicated only when every entry's method is, and
//! takes `global` scope only when every entry's method does.

use sha2::{Digest, Sha256};

/// Nesting deeper than this is not deduplicated (and not recursed into).
pub const MAX_DEPTH: usize = 64;

pub const KEY_LEN: usize = 16;

/// A request key.
pub type Key = [u8; KEY_LEN];

/// Why a body is not deduplicated; the request passes as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unkeyed {
    /// Not JSON, or not a JSON-RPC request or batch.
    NotJsonRpc,
    /// Nested deeper than `MAX_DEPTH`.
    TooDeep,
}

/// A parsed request body, borrowing from the body bytes.
#[derive(Debug)]
pub struct Body<'a> {
    root: Node<'a>,
}

/// One request of the body (the whole body, or one batch entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call<'a> {
    pub method: &'a str,
    /// The `id` member as raw JSON, if there is one.
    pub id: Option<&'a [u8]>,
}

#[derive(Debug)]
enum Node<'a> {
    /// A string (with its quotes), number, `true`, `false` or `null`,
    /// exactly as written.
    Scalar(&'a [u8]),
    Array(Vec<Node<'a>>),
    /// Members with their raw keys (quotes included), sorted.
    Object(Vec<(&'a [u8], Node<'a>)>),
}

impl<'a> Body<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, Unkeyed> {
        let mut parser = Parser { bytes, at: 0 };
        let root = parser.value(0)?;
        parser.space();
        if parser.at != bytes.len() {
            return Err(Unkeyed::NotJsonRpc);
        }
        let body = Self { root };
        if body.calls().is_none() {
            return Err(Unkeyed::NotJsonRpc);
        }
        Ok(body)
    }

    /// The requests in the body: one, or a batch's entries in order. `None`
    /// if any is not an object with exactly one plain string `method`.
    pub fn calls(&self) -> Option<Vec<Call<'a>>> {
        match &self.root {
            Node::Object(members) => Some(vec![call(members)?]),
            Node::Array(entries) if !entries.is_empty() => entries
                .iter()
                .map(|entry| match entry {
                    Node::Object(members) => call(members),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    pub fn is_batch(&self) -> bool {
        matches!(self.root, Node::Array(_))
    }

    /// The key of this body under `scope` (`global`, or a client's name).
    pub fn key(&self, scope: &str) -> Key {
        let mut hash = Sha256::new();
        hash.update(b"stakegate.dedup.v1\0");
        hash.update(scope.as_bytes());
        hash.update(b"\0");
        match &self.root {
            Node::Array(entries) => {
                hash.update(b"[");
                for (i, entry) in entries.iter().enumerate() {
                    if i > 0 {
                        hash.update(b",");
                    }
                    write_request(entry, &mut hash);
                }
                hash.update(b"]");
            }
            request => write_request(request, &mut hash),
        }
        let digest = hash.finalize();
        let mut key = [0; KEY_LEN];
        key.copy_from_slice(&digest[..KEY_LEN]);
        key
    }
}

const METHOD: &[u8] = b"\"method\"";
const ID: &[u8] = b"\"id\"";

fn call<'a>(members: &[(&'a [u8], Node<'a>)]) -> Option<Call<'a>> {
    let mut methods = members.iter().filter(|(k, _)| *k == METHOD);
    let method = match (methods.next(), methods.next()) {
        (Some((_, Node::Scalar(raw))), None) => plain_string(raw)?,
        _ => return None,
    };
    let id = members.iter().rev().find_map(|(k, v)| match v {
        Node::Scalar(raw) if *k == ID => Some(*raw),
        _ => None,
    });
    Some(Call { method, id })
}

/// The contents of a string token with no escapes, else `None`.
fn plain_string(raw: &[u8]) -> Option<&str> {
    let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    if inner.contains(&b'\\') {
        return None;
    }
    std::str::from_utf8(inner).ok()
}

/// A request object without its top-level `id`, but marked by whether it
/// had one: a notification (no `id`) gets no answer, so it is never the
/// same request as a call.
fn write_request(node: &Node<'_>, out: &mut Sha256) {
    match node {
        Node::Object(members) => {
            let call = members.iter().any(|(k, _)| *k == ID);
            out.update(if call { b"c" } else { b"n" });
            write_members(members.iter().filter(|(k, _)| *k != ID), out)
        }
        other => write(other, out),
    }
}

fn write_members<'n, 'a: 'n>(
    members: impl Iterator<Item = &'n (&'a [u8], Node<'a>)>,
    out: &mut Sha256,
) {
    out.update(b"{");
    for (i, (key, value)) in members.enumerate() {
        if i > 0 {
            out.update(b",");
        }
        out.update(key);
        out.update(b":");
        write(value, out);
    }
    out.update(b"}");
}

fn write(node: &Node<'_>, out: &mut Sha256) {
    match node {
        Node::Scalar(raw) => out.update(raw),
        Node::Array(items) => {
            out.update(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.update(b",");
                }
                write(item, out);
            }
            out.update(b"]");
        }
        Node::Object(members) => write_members(members.iter(), out),
    }
}

/// A strict JSON reader that keeps raw tokens.
struct Parser<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Parser<'a> {
    fn space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.bytes.get(self.at).copied()
    }

    fn expect(&mut self, byte: u8) -> Result<(), Unkeyed> {
        if self.peek() == Some(byte) {
            self.at += 1;
            Ok(())
        } else {
            Err(Unkeyed::NotJsonRpc)
        }
    }

    fn value(&mut self, depth: usize) -> Result<Node<'a>, Unkeyed> {
        if depth > MAX_DEPTH {
            return Err(Unkeyed::TooDeep);
        }
        match self.peek().ok_or(Unkeyed::NotJsonRpc)? {
            b'{' => {
                self.at += 1;
                let mut members = Vec::new();
                if self.peek() == Some(b'}') {
                    self.at += 1;
                    return Ok(Node::Object(members));
                }
                loop {
                    self.space();
                    let key = self.string()?;
                    self.expect(b':')?;
                    members.push((key, self.value(depth + 1)?));
                    if self.peek() == Some(b',') {
                        self.at += 1;
                    } else {
                        self.expect(b'}')?;
                        break;
                    }
                }
                // Stable: members under one key keep their order.
                members.sort_by(|a, b| a.0.cmp(b.0));
                Ok(Node::Object(members))
            }
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                if self.peek() == Some(b']') {
                    self.at += 1;
                    return Ok(Node::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if self.peek() == Some(b',') {
                        self.at += 1;
                    } else {
                        self.expect(b']')?;
                        break;
                    }
                }
                Ok(Node::Array(items))
            }
            b'"' => Ok(Node::Scalar(self.string()?)),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(Unkeyed::NotJsonRpc),
        }
    }

    /// A string token, quotes included, escapes left as written (and
    /// checked: only JSON's escapes, so a token echoed back stays JSON).
    fn string(&mut self) -> Result<&'a [u8], Unkeyed> {
        let start = self.at;
        if self.bytes.get(start) != Some(&b'"') {
            return Err(Unkeyed::NotJsonRpc);
        }
        let mut i = start + 1;
        loop {
            match self.bytes.get(i) {
                None => return Err(Unkeyed::NotJsonRpc),
                Some(b'"') => break,
                Some(b'\\') => match self.bytes.get(i + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                    Some(b'u')
                        if self
                            .bytes
                            .get(i + 2..i + 6)
                            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit)) =>
                    {
                        i += 6
                    }
                    _ => return Err(Unkeyed::NotJsonRpc),
                },
                Some(&b) if b < 0x20 => return Err(Unkeyed::NotJsonRpc),
                Some(_) => i += 1,
            }
        }
        self.at = i + 1;
        Ok(&self.bytes[start..self.at])
    }

    fn literal(&mut self, word: &[u8]) -> Result<Node<'a>, Unkeyed> {
        let start = self.at;
        if self.bytes[start..].starts_with(word) {
            self.at += word.len();
            Ok(Node::Scalar(&self.bytes[start..self.at]))
        } else {
            Err(Unkeyed::NotJsonRpc)
        }
    }

    /// `-? int frac? exp?`, as JSON has it.
    fn number(&mut self) -> Result<Node<'a>, Unkeyed> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.bytes.get(p.at).is_some_and(u8::is_ascii_digit) {
                p.at += 1;
            }
            if p.at == from {
                Err(Unkeyed::NotJsonRpc)
            } else {
                Ok(())
            }
        };
        if self.bytes.get(self.at) == Some(&b'-') {
            self.at += 1;
        }
        // No leading zeros: `0`, or a digit 1-9 then any digits.
        if self.bytes.get(self.at) == Some(&b'0') {
            self.at += 1;
        } else {
            digits(self)?;
        }
        if self.bytes.get(self.at) == Some(&b'.') {
            self.at += 1;
            digits(self)?;
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.at) {
            self.at += 1;
            if let Some(b'+' | b'-') = self.bytes.get(self.at) {
                self.at += 1;
            }
            digits(self)?;
        }
        Ok(Node::Scalar(&self.bytes[start..self.at]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn key(body: &str) -> Key {
        Body::parse(body.as_bytes()).unwrap().key("client")
    }

    #[test]
    fn id_whitespace_and_member_order_do_not_matter() {
        let a = key(
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[{"to":"0x1","data":"0x2"},"latest"]}"#,
        );
        let b = key(
            r#" { "params" : [ { "data":"0x2", "to":"0x1" } , "latest" ] ,
                 "method":"eth_call", "id":"retry-7", "jsonrpc":"2.0" } "#,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn anything_else_matters() {
        let base = key(r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[1]}"#);
        for other in [
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[1.0]}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":["1"]}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_estimateGas","params":[1]}"#,
            r#"{"jsonrpc":"1.0","id":1,"method":"eth_call","params":[1]}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[1],"x":0}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[[1]]}"#,
        ] {
            assert_ne!(base, key(other), "{other}");
        }
        let body = Body::parse(br#"{"method":"m","params":[]}"#).unwrap();
        assert_ne!(body.key("global"), body.key("client"));
    }

    #[test]
    fn a_notification_is_not_the_same_request_as_a_call() {
        assert_ne!(
            key(r#"{"jsonrpc":"2.0","method":"eth_call","params":[1]}"#),
            key(r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[1]}"#)
        );
    }

    #[test]
    fn only_json_escapes_are_read() {
        for bad in [
            r#"{"id":"\q","method":"m"}"#,
            r#"{"id":"\u12","method":"m"}"#,
            r#"{"id":"\u12zz","method":"m"}"#,
            r#"{"id":-0222,"method":"m"}"#,
            r#"{"id":01,"method":"m"}"#,
        ] {
            assert!(Body::parse(bad.as_bytes()).is_err(), "{bad}");
        }
        assert!(Body::parse(br#"{"id":"\u00e9\n\/","method":"m"}"#).is_ok());
        assert!(Body::parse(br#"{"id":-0.5e-3,"method":"m"}"#).is_ok());
        assert!(Body::parse(br#"{"id":0,"method":"m"}"#).is_ok());
    }

    #[test]
    fn only_the_top_level_id_is_dropped() {
        assert_ne!(
            key(r#"{"method":"m","params":{"id":1}}"#),
            key(r#"{"method":"m","params":{"id":2}}"#)
        );
    }

    #[test]
    fn calls_and_batches() {
        let body = Body::parse(br#"[{"id":3,"method":"a"},{"method":"b","id":"x"}]"#).unwrap();
        assert!(body.is_batch());
        assert_eq!(
            body.calls().unwrap(),
            vec![
                Call {
                    method: "a",
                    id: Some(b"3".as_slice())
                },
                Call {
                    method: "b",
                    id: Some(br#""x""#.as_slice())
                }
            ]
        );
        // A batch in another order is another batch (answers come in order).
        assert_ne!(
            key(r#"[{"method":"a"},{"method":"b"}]"#),
            key(r#"[{"method":"b"},{"method":"a"}]"#)
        );
    }

    #[test]
    fn what_is_not_keyed() {
        for (body, why) in [
            ("", Unkeyed::NotJsonRpc),
            ("not json", Unkeyed::NotJsonRpc),
            (r#"{"method":"m"} x"#, Unkeyed::NotJsonRpc),
            (r#"{"params":[]}"#, Unkeyed::NotJsonRpc),
            (r#"{"method":7}"#, Unkeyed::NotJsonRpc),
            (r#"{"method":"m","method":"n"}"#, Unkeyed::NotJsonRpc),
            (r#"{"method":"e\u0074h_call"}"#, Unkeyed::NotJsonRpc),
            ("[]", Unkeyed::NotJsonRpc),
            (r#"[{"method":"m"},3]"#, Unkeyed::NotJsonRpc),
            (r#"{"method":"m","params":[01x]}"#, Unkeyed::NotJsonRpc),
            (r#"{"method":"m","params":[1.]}"#, Unkeyed::NotJsonRpc),
            (
                r#"{"method":"m","params":["a
b"]}"#,
                Unkeyed::NotJsonRpc,
            ),
        ] {
            assert_eq!(Body::parse(body.as_bytes()).unwrap_err(), why, "{body:?}");
        }
        let deep = format!(
            r#"{{"method":"m","params":{}{}}}"#,
            "[".repeat(MAX_DEPTH + 1),
            "]".repeat(MAX_DEPTH + 1)
        );
        assert_eq!(Body::parse(deep.as_bytes()).unwrap_err(), Unkeyed::TooDeep);
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-c0-9x\"\\\\ é]{0,6}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-d]{1,2}|id", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn request() -> impl Strategy<Value = (String, Value)> {
        (
            prop_oneof![
                Just("eth_call".to_string()),
                Just("eth_getLogs".to_string()),
                Just("eth_sendRawTransaction".to_string()),
                "[a-z_]{1,8}",
            ],
            json_value(),
        )
    }

    /// `value` as another client could write it: objects' members in
    /// reverse order, spaces and newlines between tokens.
    fn scrambled(value: &Value) -> String {
        match value {
            Value::Array(items) => {
                let items: Vec<String> = items.iter().map(scrambled).collect();
                format!("[ {} ]", items.join(" ,\n"))
            }
            Value::Object(members) => {
                let members: Vec<String> = members
                    .iter()
                    .rev()
                    .map(|(k, v)| format!("{} :\t{}", Value::from(k.as_str()), scrambled(v)))
                    .collect();
                format!("{{ {} }}", members.join(" , "))
            }
            scalar => scalar.to_string(),
        }
    }

    fn written(method: &str, params: &Value, id: u64, scramble: bool) -> String {
        if scramble {
            format!(
                r#"{{ "params" : {}, "id": {id}, "method" : "{method}", "jsonrpc":"2.0" }}"#,
                scrambled(params)
            )
        } else {
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// No false positives: requests that differ in method or params,
        /// as JSON values, never share a key.
        #[test]
        fn different_requests_never_share_a_key(
            (m1, p1) in request(),
            (m2, p2) in request(),
            ids in (any::<u64>(), any::<u64>()),
            shuffle in any::<bool>(),
        ) {
            prop_assume!(m1 != m2 || p1 != p2);
            let a = written(&m1, &p1, ids.0, shuffle);
            let b = written(&m2, &p2, ids.1, false);
            prop_assert_ne!(key(&a), key(&b), "{} vs {}", a, b);
        }

        /// And the same request, however written, always does.
        #[test]
        fn the_same_request_always_shares_a_key(
            (method, params) in request(),
            ids in (any::<u64>(), any::<u64>()),
        ) {
            let a = written(&method, &params, ids.0, true);
            let b = written(&method, &params, ids.1, false);
            prop_assert_eq!(key(&a), key(&b), "{} vs {}", a, b);
        }
    }
}
