//! Any bytes as a request body for retry-storm protection: reading and
//! keying never panic, the key ignores the `id` and whitespace around the
//! body, and a refusal answering the body is JSON with each call's `id`.
//! The same bytes as a node's answer: given to a waiter with other ids, a
//! JSON answer stays JSON, and the answer record round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::dedup::answer::Answer;
use stakegate_core::dedup::key;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::jsonrpc::Request;
use stakegate_core::rejection::{Rejection, Rule, LIMIT_EXCEEDED};

fuzz_target!(|data: &[u8]| {
    let Some(request) = Request::read(data) else {
        return;
    };
    assert!(!request.calls.is_empty());
    if let Ok(key) = key::key(data, "client") {
        let mut padded = b" \n".to_vec();
        padded.extend_from_slice(data);
        padded.extend_from_slice(b"\t ");
        assert_eq!(key::key(&padded, "client").ok(), Some(key));
    }

    let policy = GatePolicy::parse(br#"{"maxInflight": 8, "dedup": {"methods": ["m"]}}"#)
        .expect("a valid policy");
    let dedup = stakegate_core::dedup::Dedup::new(policy.dedup.expect("dedup"), 1000);
    let _ = dedup.key(data, "route", "client");

    let ids: Vec<Option<Vec<u8>>> = request
        .calls
        .iter()
        .map(|c| request.id(c).map(<[u8]>::to_vec))
        .collect();
    let own: Vec<Option<Vec<u8>>> = ids
        .iter()
        .map(|id| id.as_ref().map(|_| br#""w""#.to_vec()))
        .collect();
    let answer = Answer {
        key: [7; 16],
        status: 200,
        content_type: "application/json".into(),
        content_encoding: None,
        ids,
        body: data.to_vec(),
    };
    let given = answer.body_for(&own);
    if serde_json::from_slice::<serde_json::Value>(data).is_ok() {
        assert!(
            serde_json::from_slice::<serde_json::Value>(&given).is_ok(),
            "{}",
            String::from_utf8_lossy(&given)
        );
    }
    assert_eq!(Answer::decode(&answer.encode()), Some(answer));

    // A refusal answering this body is JSON: for one call, its own id (or
    // null where a JSON reader refuses the id); for a batch, an array with
    // one error per call that has an id.
    let refusal =
        Rejection::new(Rule::DedupWaiters, 429, 1, LIMIT_EXCEEDED, "duplicate").answering(data);
    let value: serde_json::Value =
        serde_json::from_str(&refusal.body).expect("the refusal's body is JSON");
    let ids: Vec<&[u8]> = request.calls.iter().filter_map(|c| request.id(c)).collect();
    let readable = |raw: &[u8]| serde_json::from_slice::<serde_json::Value>(raw).ok();
    match (request.batch, ids.as_slice(), &value) {
        (_, [], v) => assert!(v["id"].is_null()),
        (false, [id], v) => assert_eq!(v["id"], readable(id).unwrap_or_default()),
        (_, ids, serde_json::Value::Array(errors)) => {
            assert_eq!(errors.len(), ids.len());
            for (error, id) in errors.iter().zip(ids) {
                assert_eq!(error["id"], readable(id).unwrap_or_default());
                assert_eq!(error["error"]["code"], LIMIT_EXCEEDED);
            }
        }
        (_, _, v) => panic!("a batch answered with {v}"),
    }
});
