use super::scan::Scanner;
use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};

fn text<'a>(message: &'a str, range: &std::ops::Range<usize>) -> &'a str {
    &message[range.clone()]
}

#[test]
fn batches_count_their_entries() {
    assert_eq!(calls(br#"{"id":1,"method":"eth_call","params":[1,2]}"#), 1);
    assert_eq!(
        calls(br#" [ {"id":1,"method":"a","params":[[1,2],{"x":"],["}]}, {"id":2}, 3 ] "#),
        3
    );
    assert_eq!(calls(br#"[{"method":"a","params":["\"],["]}]"#), 1);
    assert_eq!(calls(b"[]"), 1);
    assert_eq!(calls(b"garbage"), 1);
    assert_eq!(calls(b""), 1);
    let fifty = format!("[{}]", vec![r#"{"id":1,"method":"m"}"#; 50].join(","));
    assert_eq!(calls(fifty.as_bytes()), 50);
}

#[test]
fn a_call_has_its_members_where_they_are() {
    let message = r#" {"jsonrpc":"2.0", "id" : "a-1","method":"eth_call","params":[{"id":7}]} "#;
    let summary = Summary::of(message.as_bytes());
    assert!(summary.valid);
    assert_eq!(summary.shape, Shape::Object);
    let [call] = summary.entries.as_slice() else {
        panic!("{summary:?}")
    };
    assert_eq!(call.kind(), Kind::Call);
    assert_eq!(text(message, &call.span), message.trim());
    let Id::Plain(id) = call.id() else {
        panic!("{:?}", call.id())
    };
    assert_eq!(text(message, &id), r#""a-1""#);
    assert_eq!(call.method.as_deref(), Some("eth_call"));
    // The `id` inside params is not the call's.
    assert_eq!(call.named(Name::Id).count(), 1);
}

#[test]
fn a_batch_has_an_entry_per_value() {
    let message = r#"[{"id":1,"method":"a"}, 5, {"method":"note"}, {"id":2,"result":"0x1"}, []]"#;
    let summary = Summary::of(message.as_bytes());
    assert!(summary.valid);
    assert_eq!(summary.shape, Shape::Array);
    let kinds: Vec<Kind> = summary.entries.iter().map(Entry::kind).collect();
    assert_eq!(
        kinds,
        [
            Kind::Call,
            Kind::Invalid,
            Kind::Call,
            Kind::Response,
            Kind::Invalid
        ]
    );
    let spans: Vec<&str> = summary
        .entries
        .iter()
        .map(|e| text(message, &e.span))
        .collect();
    assert_eq!(
        spans,
        [
            r#"{"id":1,"method":"a"}"#,
            "5",
            r#"{"method":"note"}"#,
            r#"{"id":2,"result":"0x1"}"#,
            "[]"
        ]
    );
    assert_eq!(summary.entries[2].id(), Id::Absent);
}

#[test]
fn keys_are_read_as_any_node_reads_them() {
    for (message, id) in [
        (r#"{"\u0069d":1,"method":"m"}"#, "1"),
        (r#"{"ID":2,"method":"m"}"#, "2"),
        (r#"{"Id":3,"method":"m"}"#, "3"),
        (r#"{"id":4,"id":5,"method":"m"}"#, "5"),
        (r#"{"i\u0044":6,"method":"m"}"#, "6"),
    ] {
        let summary = Summary::of(message.as_bytes());
        let Id::Unsure(range) = summary.entries[0].id() else {
            panic!("{message}: {:?}", summary.entries[0].id())
        };
        assert_eq!(text(message, &range), id, "{message}");
    }
    // Go folds U+017F (long s) to `s` and U+212A (Kelvin) to `k`.
    let summary = Summary::of("{\"id\":1,\"reſult\":2}".as_bytes());
    assert_eq!(summary.entries[0].kind(), Kind::Response);
    let summary = Summary::of(br#"{"METHOD":"eth_call"}"#);
    assert_eq!(summary.entries[0].kind(), Kind::Call);
    assert_eq!(summary.entries[0].method.as_deref(), Some("eth_call"));
    assert_eq!(summary.entries[0].id(), Id::Absent);
    // Not names: longer, shorter, or an escape of something else.
    for message in [
        r#"{"idx":1,"method":"m"}"#,
        r#"{"i":1,"method":"m"}"#,
        r#"{"i\"d":1,"method":"m"}"#,
    ] {
        assert_eq!(
            Summary::of(message.as_bytes()).entries[0].id(),
            Id::Absent,
            "{message}"
        );
    }
    let escaped_method = Summary::of(br#"{"method":"e\u0074h_call","id":1}"#);
    assert_eq!(
        escaped_method.entries[0].method.as_deref(),
        Some("eth_call")
    );
    let numeric_method = Summary::of(br#"{"method":"eth_call","method":7,"id":1}"#);
    assert_eq!(numeric_method.entries[0].method, None);
    // A method name is kept up to 128 characters, in whatever pieces.
    for (len, kept) in [(128, true), (129, false), (5000, false)] {
        let message = format!(r#"{{"method":"{}","id":1}}"#, "m".repeat(len));
        for piece in [1, 7, message.len()] {
            let mut scanner = Scanner::default();
            message
                .as_bytes()
                .chunks(piece)
                .for_each(|p| scanner.push(p));
            let summary = scanner.finish();
            assert!(summary.valid);
            assert_eq!(
                summary.entries[0].method.is_some(),
                kept,
                "{len} in {piece}s"
            );
        }
    }
}

#[test]
fn what_is_not_json_is_invalid() {
    for bad in [
        "",
        "   ",
        "not json",
        r#"{"id":1"#,
        r#"{"id":1,}"#,
        r#"{"id" 1}"#,
        r#"[1,]"#,
        r#"[1 2]"#,
        r#"{"a":tru}"#,
        r#"{"a":nulls}"#,
        r#"{"a":"\q"}"#,
        r#"{"a":"\u12g4"}"#,
        "{\"a\":\"\u{1}\"}",
        r#"{"a":1}}"#,
        r#"{"a":1} x"#,
        r#"[}"#,
        r#"{]"#,
        r#"{1:2}"#,
    ] {
        assert!(!Summary::of(bad.as_bytes()).valid, "{bad:?}");
    }
    let deep = format!(
        "{}{}",
        "[".repeat(MAX_DEPTH_PLUS),
        "]".repeat(MAX_DEPTH_PLUS)
    );
    assert!(!Summary::of(deep.as_bytes()).valid);
    let deep_enough = format!(
        "{}{}",
        "[".repeat(scan::MAX_DEPTH),
        "]".repeat(scan::MAX_DEPTH)
    );
    assert!(Summary::of(deep_enough.as_bytes()).valid);
    for good in [
        "1", "\"x\"", "null", " true ", "[]", "{}", "-0.5e-3", "[[],{}]",
    ] {
        assert!(Summary::of(good.as_bytes()).valid, "{good:?}");
    }
}

#[test]
fn ids_are_the_same_when_their_values_are() {
    for (a, b) in [
        ("1", "1.0"),
        ("1e0", "1.0"),
        ("123456789012345678901234567890", "1.2345678901234568e+29"),
        (r#""a""#, r#""\u0061""#),
        ("null", " null"),
        ("1e999", "1e999"),
    ] {
        assert!(same_id(a.as_bytes(), b.as_bytes()), "{a} {b}");
    }
    for (a, b) in [
        ("1", "2"),
        ("1", r#""1""#),
        (r#""a""#, r#""A""#),
        ("1e999", "2e999"),
    ] {
        assert!(!same_id(a.as_bytes(), b.as_bytes()), "{a} {b}");
    }
}

const MAX_DEPTH_PLUS: usize = scan::MAX_DEPTH + 1;

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        // Binary fractions, which read back exactly.
        any::<i16>().prop_map(|i| Value::from(f64::from(i) / 8.0)),
        "[a-c0-9x\"\\\\ é\u{1}\u{1F600}]{0,6}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-d]{1,2}|id|ID|method|result", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A call or a batch of calls, with and without ids.
fn message() -> impl Strategy<Value = Value> {
    let call = (prop::option::of(json_value()), "[a-z_]{1,12}", json_value())
        .boxed()
        .prop_map(|(id, method, params)| {
            let mut call = json!({"jsonrpc": "2.0", "method": method, "params": params});
            if let Some(id) = id {
                call["id"] = id;
            }
            call
        })
        .boxed();
    prop_oneof![
        call.clone(),
        prop::collection::vec(call, 0..6).prop_map(Value::Array),
        json_value(),
    ]
}

/// Each call's id as Go reads it (the last key equal to `id` whatever its
/// case), in order: `Some(None)` for a call with none, `None` for an entry
/// that is not an object.
fn serde_ids(value: &Value) -> Vec<Option<Option<Value>>> {
    let entry = |v: &Value| {
        v.as_object().map(|o| {
            o.iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("id"))
                .map(|(_, v)| v.clone())
                .next_back()
        })
    };
    match value {
        Value::Array(items) => items.iter().map(entry).collect(),
        Value::Object(_) => vec![entry(value)],
        _ => Vec::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Every serialisation serde writes is valid, and each call's `id`
    /// (where its key is plain) is the value serde reads.
    #[test]
    fn summaries_agree_with_serde(value in message(), pretty in any::<bool>()) {
        let text = if pretty {
            serde_json::to_string_pretty(&value).unwrap()
        } else {
            value.to_string()
        };
        let summary = Summary::of(text.as_bytes());
        prop_assert!(summary.valid, "{}", text);
        let ids = serde_ids(&value);
        prop_assert_eq!(summary.entries.len(), ids.len(), "{}", text);
        for (entry, id) in summary.entries.iter().zip(ids) {
            match (entry.id(), id) {
                (Id::Absent, Some(None)) | (_, None) => {}
                (Id::Plain(range) | Id::Unsure(range), Some(Some(id))) => {
                    let read: Value = serde_json::from_str(&text[range]).unwrap();
                    prop_assert_eq!(read, id);
                }
                (got, want) => prop_assert!(false, "{}: {:?} vs {:?}", text, got, want),
            }
        }
    }

    /// However a message is cut into pieces, the summary is the same.
    #[test]
    fn any_split_reads_the_same(value in message(), cuts in prop::collection::vec(0usize..4096, 0..8)) {
        let text = value.to_string();
        let whole = Summary::of(text.as_bytes());
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).collect();
        cuts.sort_unstable();
        let mut scanner = scan::Scanner::default();
        let mut from = 0;
        for cut in cuts.into_iter().chain([text.len()]) {
            scanner.push(&text.as_bytes()[from..cut]);
            from = cut;
        }
        prop_assert_eq!(scanner.finish(), whole);
    }

    /// Validity is serde's, for texts near JSON.
    #[test]
    fn validity_is_serdes(value in json_value(), cut in 0usize..200, junk in "[\\]\\[{},:\"0-9a]{0,2}") {
        let mut text = value.to_string();
        let mut at = cut % (text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.insert_str(at, &junk);
        let ours = Summary::of(text.as_bytes()).valid;
        let serde = serde_json::from_str::<Value>(&text).is_ok();
        // Our numbers are looser than serde's (`01`, `1.`), nothing else.
        if ours != serde {
            prop_assert!(ours && !serde, "{:?}: ours {} serde {}", text, ours, serde);
            prop_assert!(text.bytes().any(|b| b.is_ascii_digit()), "{:?}", text);
        }
    }
}
