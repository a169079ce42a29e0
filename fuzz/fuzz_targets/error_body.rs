//! Any message text in a JSON-RPC error body: the body is JSON, and the
//! message reads back unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::rejection::{json_rpc_error_body, LIMIT_EXCEEDED};

fuzz_target!(|data: &[u8]| {
    let message = String::from_utf8_lossy(data);
    let body = json_rpc_error_body(None, LIMIT_EXCEEDED, &message);
    let value: serde_json::Value = serde_json::from_str(&body).expect("the body is JSON");
    assert_eq!(value["error"]["message"], message.as_ref());
    assert_eq!(value["error"]["code"], LIMIT_EXCEEDED);
    assert!(value["id"].is_null());
});
