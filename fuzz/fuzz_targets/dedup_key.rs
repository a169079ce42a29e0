//! Any bytes as a request body for retry-storm protection: reading and
//! keying never panic, the key ignores the `id` and whitespace around the
//! body, and a duplicate's 429 body quoting the request's `id` is JSON with
//! that same `id`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::dedup::key::Body;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::rejection::{json_rpc_error_body, LIMIT_EXCEEDED};

fuzz_target!(|data: &[u8]| {
    let Ok(body) = Body::parse(data) else {
        return;
    };
    let calls = body.calls().expect("a parsed body has calls");
    assert!(!calls.is_empty());
    let key = body.key("client");
    let mut padded = b" \n".to_vec();
    padded.extend_from_slice(data);
    padded.extend_from_slice(b"\t ");
    assert_eq!(
        Body::parse(&padded).map(|b| b.key("client")).ok(),
        Some(key)
    );

    let policy = GatePolicy::parse(br#"{"maxInflight": 8, "dedup": {"methods": ["m"]}}"#)
        .expect("a valid policy");
    let dedup = stakegate_core::dedup::Dedup::new(policy.dedup.expect("dedup"), 1000, 30);
    if let Ok(keyed) = dedup.key(data, "client") {
        let answer = json_rpc_error_body(keyed.id.as_deref(), LIMIT_EXCEEDED, "duplicate");
        let value: serde_json::Value = serde_json::from_str(&answer).expect("the 429 body is JSON");
        if let Some(id) = &keyed.id {
            let quoted: serde_json::Value = serde_json::from_str(id).expect("the id is JSON");
            assert_eq!(value["id"], quoted);
        }
    }
});
