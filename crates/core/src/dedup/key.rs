//! The request key: what makes two JSON-RPC requests the same request.
//!
//! A key is the first 16 bytes of
//! `sha256("stakegate.dedup.v1" 0 scope 0 canonical(request without id))`,
//! the canonical form being `jsonrpc::canonical`'s: whitespace, member
//! order and the calls' own ids do not matter, anything else does.
//!
//! **Batches** are keyed as a whole: the gateway forwards a batch as one
//! upstream request, so it can only send or refuse all of it. Keying entry by
//! entry would need the gateway to split a batch and merge the node's
//! answers. A batch is deduplicated only when every entry's method is, and
//! takes `global` scope only when every entry's method does.

use crate::jsonrpc::canonical::{Canonical, Unread};
use sha2::{Digest, Sha256};

pub const KEY_LEN: usize = 16;

/// A request key.
pub type Key = [u8; KEY_LEN];

/// Why a body is not deduplicated; the request passes as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unkeyed {
    /// Not JSON, or not a JSON-RPC request or batch every node reads the
    /// same way (`jsonrpc::Request`), or a call's id key some node would
    /// not read.
    NotJsonRpc,
    /// Nested deeper than `jsonrpc::scan::MAX_DEPTH`.
    TooDeep,
}

/// The key of request `body` under `scope` (`global`, or a client's name).
pub fn key(body: &[u8], scope: &str) -> Result<Key, Unkeyed> {
    let canonical = Canonical::parse(body).map_err(|e| match e {
        Unread::NotJson => Unkeyed::NotJsonRpc,
        Unread::TooDeep => Unkeyed::TooDeep,
    })?;
    let mut hash = Sha256::new();
    hash.update(b"stakegate.dedup.v1\0");
    hash.update(scope.as_bytes());
    hash.update(b"\0");
    canonical.write(&mut |bytes| hash.update(bytes));
    let digest = hash.finalize();
    let mut key = [0; KEY_LEN];
    key.copy_from_slice(&digest[..KEY_LEN]);
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use crate::jsonrpc::scan::MAX_DEPTH;
    use crate::jsonrpc::{Id, Request};

    fn key(body: &str) -> Key {
        super::key(body.as_bytes(), "client").unwrap()
    }

    /// Why `body` has no key, read as dedup reads it: its calls, then its
    /// canonical form.
    fn unkeyed(body: &str) -> Unkeyed {
        match Request::read(body.as_bytes()) {
            None => Unkeyed::NotJsonRpc,
            Some(_) => super::key(body.as_bytes(), "c").unwrap_err(),
        }
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
        let body = br#"{"method":"m","params":[]}"#;
        assert_ne!(super::key(body, "global"), super::key(body, "client"));
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
            assert!(super::key(bad.as_bytes(), "c").is_err(), "{bad}");
        }
        assert!(super::key(br#"{"id":"\u00e9\n\/","method":"m"}"#, "c").is_ok());
        assert!(super::key(br#"{"id":-0.5e-3,"method":"m"}"#, "c").is_ok());
        assert!(super::key(br#"{"id":0,"method":"m"}"#, "c").is_ok());
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
        let body = br#"[{"id":3,"method":"a"},{"method":"b","id":"x"}]"#;
        let request = Request::read(body).unwrap();
        assert!(request.batch);
        let calls: Vec<(&str, Option<&[u8]>)> = request
            .calls
            .iter()
            .map(|c| (c.method, request.id(c)))
            .collect();
        assert_eq!(
            calls,
            [
                ("a", Some(b"3".as_slice())),
                ("b", Some(br#""x""#.as_slice()))
            ]
        );
        assert!(request.calls.iter().all(|c| matches!(c.id, Id::Plain(_))));
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
            (r#"{"method":"m","METHOD":"n"}"#, Unkeyed::NotJsonRpc),
            (r#"{"Method":"m"}"#, Unkeyed::NotJsonRpc),
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
            assert_eq!(unkeyed(body), why, "{body:?}");
        }
        let deep = format!(
            r#"{{"method":"m","params":{}{}}}"#,
            "[".repeat(MAX_DEPTH + 1),
            "]".repeat(MAX_DEPTH + 1)
        );
        assert_eq!(
            super::key(deep.as_bytes(), "c").unwrap_err(),
            Unkeyed::TooDeep
        );
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
