//! Retry-storm protection in the compiled admission gate, in the offline
//! host: duplicates refused while in flight, and within the window after a
//! client abandoned the original; a lost completion, and what passes
//! unchecked.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use stakegate_host::{Host, LocalReply, Reply, Request, RequestId};
use std::time::Duration;

fn gate(dedup: &str, workers: usize) -> Host {
    let module = stakegate_stack::paths::wasm_module("admission_gate").expect("make build");
    let policy = format!(
        r#"{{"maxInflight": 10000, "dedup": {dedup},
            "classes": {{"internal": [{{"listenerMetadata": "internal"}}]}}}}"#
    );
    Host::new(&std::fs::read(module).unwrap(), policy.as_bytes(), workers).unwrap()
}

fn call(id: u64, params: &str) -> Request {
    Request::json_rpc(&format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call","params":[{params},"latest"]}}"#
    ))
}

fn sent(host: &mut Host, worker: usize, request: &Request) -> RequestId {
    match host.request(worker, request).unwrap() {
        Reply::Continue(id) => id,
        Reply::LocalReply(reply) => panic!(
            "refused: {} {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ),
    }
}

fn refused(host: &mut Host, worker: usize, request: &Request) -> LocalReply {
    match host.request(worker, request).unwrap() {
        Reply::Continue(_) => panic!("sent upstream, expected a duplicate"),
        Reply::LocalReply(reply) => reply,
    }
}

#[test]
fn a_duplicate_is_refused_until_its_abandoned_original_s_window_ends() {
    let mut host = gate(r#"{"windowMs": 3000}"#, 2);
    let original = sent(&mut host, 0, &call(1, r#"{"data":"0x01"}"#));
    // A retry with a new id, on another worker: 429 with the rest of the window.
    let reply = refused(&mut host, 1, &call(2, r#"{ "data" : "0x01" }"#));
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("retry-after"), Some("3"));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["id"], 2);
    assert_eq!(body["error"]["code"], -32005);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("duplicate"));
    // Other params are another request.
    let other = sent(&mut host, 1, &call(3, r#"{"data":"0x02"}"#));
    // Abandoned by its client, it still blocks until start + window (the
    // node may still be working on it)...
    host.advance(Duration::from_millis(1000)).unwrap();
    host.abort(original).unwrap();
    let reply = refused(&mut host, 0, &call(4, r#"{"data":"0x01"}"#));
    assert_eq!(reply.header("retry-after"), Some("2"));
    // ...and no longer.
    host.advance(Duration::from_millis(2000)).unwrap();
    let again = sent(&mut host, 0, &call(5, r#"{"data":"0x01"}"#));
    for id in [other, again] {
        host.finish(id, 200, Duration::ZERO).unwrap();
    }
    host.advance(Duration::from_millis(1000)).unwrap();
    assert_eq!(host.metric("stakegate.gate.dedup.duplicates_rejected"), 2);
    assert_eq!(host.metric("stakegate.gate.dedup.tracked"), 3);
    // The 429s still count as admitted by the gate and gave their slots back.
    assert_eq!(host.metric("stakegate.gate.inflight.default"), 0);
}

#[test]
fn a_slow_original_blocks_its_retries_past_the_window() {
    let mut host = gate(r#"{"windowMs": 1000}"#, 2);
    let request = call(1, r#"{"data":"0x01"}"#);
    let original = sent(&mut host, 0, &request);
    host.advance(Duration::from_secs(5)).unwrap();
    assert_eq!(
        refused(&mut host, 1, &request).header("retry-after"),
        Some("1")
    );
    host.finish(original, 200, Duration::from_secs(5)).unwrap();
    host.advance(Duration::from_millis(1)).unwrap();
    let id = sent(&mut host, 1, &request);
    host.finish(id, 200, Duration::ZERO).unwrap();
}

#[test]
fn an_answered_original_stops_blocking_at_once() {
    // A poll for a receipt not yet mined: the node answers null, and the
    // next poll 50 ms later must reach it, whatever the window.
    let mut host = gate(r#"{"windowMs": 10000}"#, 2);
    let poll = Request::json_rpc(
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_getTransactionReceipt","params":["0xab"]}"#,
    );
    for (worker, status) in [(0, 200), (1, 503), (0, 200)] {
        let id = sent(&mut host, worker, &poll);
        host.finish(id, status, Duration::from_millis(50)).unwrap();
    }
    // A stream its client reset still blocks for the window.
    let other = call(2, r#"{"data":"0x02"}"#);
    let abandoned = sent(&mut host, 0, &other);
    host.abort(abandoned).unwrap();
    refused(&mut host, 1, &other);
    host.advance(Duration::from_millis(1000)).unwrap();
    assert_eq!(host.metric("stakegate.gate.dedup.tracked"), 4);
    assert_eq!(host.metric("stakegate.gate.dedup.abandoned"), 1);
    assert_eq!(host.metric("stakegate.gate.dedup.duplicates_rejected"), 1);
}

#[test]
fn a_lost_completion_stops_blocking_when_the_window_ends() {
    let mut host = gate(r#"{"windowMs": 5000}"#, 2);
    let request = call(1, r#"{"data":"0x01"}"#);
    sent(&mut host, 0, &request);
    // Worker 0's VM vanishes with the request in flight: its completion
    // never comes.
    host.remove_worker(0).unwrap();
    host.advance(Duration::from_millis(4990)).unwrap();
    refused(&mut host, 1, &request);
    host.advance(Duration::from_millis(10)).unwrap();
    let id = sent(&mut host, 1, &request);
    host.finish(id, 200, Duration::ZERO).unwrap();
    host.advance(Duration::from_secs(6)).unwrap();
    assert_eq!(host.metric("stakegate.gate.dedup.entries"), 0);
    assert!(host.metric("stakegate.gate.dedup.purged") >= 2);
}

#[test]
fn large_bodies_polls_and_internal_traffic_pass_unchecked() {
    let mut host = gate(r#"{"windowMs": 5000, "maxBodyBytes": 200}"#, 1);
    let large = call(1, &format!(r#"{{"data":"0x{}"}}"#, "ab".repeat(200)));
    let poll =
        Request::json_rpc(r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber","params":[]}"#);
    let internal = call(1, r#"{"data":"0x01"}"#).listener_class("internal");
    let garbage = Request::json_rpc("{not json");
    for request in [&large, &poll, &internal, &garbage] {
        for _ in 0..2 {
            sent(&mut host, 0, request);
        }
    }
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(host.metric("stakegate.gate.dedup.too_large"), 2);
    assert_eq!(host.metric("stakegate.gate.dedup.skipped"), 4);
    assert_eq!(host.metric("stakegate.gate.dedup.duplicates_rejected"), 0);
}

#[test]
fn the_same_signed_transaction_is_one_request_whoever_sends_it() {
    let mut host = gate("{}", 2);
    let tx = |from: &str| {
        Request::json_rpc(
            r#"{"jsonrpc":"2.0","id":9,"method":"eth_sendRawTransaction","params":["0xf86b0a"]}"#,
        )
        .property(&["source", "address"], from.as_bytes())
    };
    sent(&mut host, 0, &tx("192.0.2.1:1000"));
    refused(&mut host, 1, &tx("198.51.100.7:2000"));
    // eth_call is per client.
    let request = call(1, r#"{"data":"0x01"}"#);
    sent(&mut host, 0, &request.clone().header("x-api-key", "alice"));
    sent(&mut host, 0, &request.clone().header("x-api-key", "bob"));
    refused(&mut host, 1, &request.header("x-api-key", "alice"));
}

/// Random distinct requests are never refused; sent again while in flight,
/// every one is.
#[test]
fn random_requests_are_refused_only_as_duplicates() {
    let mut host = gate(r#"{"windowMs": 60000, "maxEntries": 8192}"#, 4);
    let mut rng = SmallRng::seed_from_u64(5);
    let methods = ["eth_call", "eth_getLogs", "eth_getBalance", "eth_getProof"];
    let mut seen = std::collections::BTreeSet::new();
    let mut requests = Vec::new();
    while requests.len() < 2000 {
        let method = methods[rng.random_range(0..methods.len())];
        let params = match rng.random_range(0..3) {
            0 => format!(r#"["0x{:x}","latest"]"#, rng.random_range(0..4000u32)),
            1 => format!(
                r#"[{{"fromBlock":{},"toBlock":"latest"}}]"#,
                rng.random_range(0..4000u32)
            ),
            _ => format!("[{}]", rng.random_range(0..4000u32)),
        };
        if seen.insert((method, params.clone())) {
            requests.push(Request::json_rpc(&format!(
                r#"{{"jsonrpc":"2.0","id":{},"method":"{method}","params":{params}}}"#,
                requests.len()
            )));
        }
    }
    for request in &requests {
        sent(&mut host, rng.random_range(0..4), request);
    }
    for request in &requests {
        assert_eq!(
            refused(&mut host, rng.random_range(0..4), request).status,
            429
        );
    }
}
