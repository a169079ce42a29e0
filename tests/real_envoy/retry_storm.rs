//! Retry-storm protection in a real Envoy at `--concurrency 2`: duplicates
//! are refused at the gateway while the original is outstanding, a poll
//! the node has answered is sent again, bodies over the limit pass whole,
//! and a retry storm reaches the node once per request
//! (scenarios/retry-storm.toml, shortened).

use stakegate_loadgen::ClientSpec;
use stakegate_stack::{http, loadgen, Envoy, RpcNode};
use stakegate_tests::{client, eventually, load_h2, node_behind_gate};
use std::time::Duration;

const STAT: &str = "wasmcustom.stakegate.gate.dedup.";

/// The node of scenarios/retry-storm.toml: 64 slots, eth_call slowed to 2 s.
const SLOW_NODE: &[&str] = &[
    "--read-slots",
    "64",
    "--cost",
    "eth_call=2s",
    "--sync-slots",
    "2",
];

fn call(id: u64, data: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call","params":[{{"to":"0x01","data":"{data}"}},"latest"]}}"#
    )
}

fn dedup_stat(envoy: &Envoy, name: &str) -> i64 {
    envoy.stat(&format!("{STAT}{name}")).unwrap()
}

#[test]
fn a_duplicate_is_refused_while_the_original_is_outstanding() {
    let (_node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {"windowMs": 4000, "maxBodyBytes": 2048}}"#,
        SLOW_NODE,
    );
    let url = envoy.url("public").unwrap();
    let original = {
        let url = url.clone();
        std::thread::spawn(move || http::post(&url, &[], &call(1, "0x01")).unwrap())
    };
    // Wait until the original is recorded (the sweep's gauge), not for a
    // guessed time.
    assert!(eventually(Duration::from_secs(5), || dedup_stat(
        &envoy, "entries"
    ) == 1));
    let retry = http::post(&url, &[], &call(2, "0x01")).unwrap();
    assert_eq!(retry.status, 429, "{}", retry.body);
    let retry_after: u32 = retry.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=4).contains(&retry_after), "retry-after {retry_after}");
    let body = retry.json().unwrap();
    assert_eq!(body["id"], 2);
    assert_eq!(body["error"]["code"], -32005);
    // Other params go through; so does a body over maxBodyBytes, twice,
    // whole (the node answers it).
    assert_eq!(http::post(&url, &[], &call(3, "0x02")).unwrap().status, 200);
    let large = call(4, &format!("0x{}", "ab".repeat(2000)));
    for _ in 0..2 {
        let answer = http::post(&url, &[], &large).unwrap();
        assert_eq!(answer.status, 200);
        assert_eq!(answer.json().unwrap()["id"], 4);
    }
    assert_eq!(original.join().unwrap().status, 200);
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "duplicates_rejected") == 1 && dedup_stat(&envoy, "too_large") == 2
    }));
}

#[test]
fn a_poll_answered_by_the_node_is_sent_again_at_once() {
    // A receipt wait: the same call every 50 ms until its answer changes.
    // Each poll follows the last one's answer, so none is a duplicate of
    // a call in flight, however long the window.
    let (node, envoy) =
        node_behind_gate(r#"{"maxInflight": 100, "dedup": {"windowMs": 10000}}"#, &[]);
    let url = envoy.url("public").unwrap();
    for id in 1..=5 {
        let answer = http::post(&url, &[], &call(id, "0x05")).unwrap();
        assert_eq!(answer.status, 200, "poll {id}: {}", answer.body);
        assert_eq!(answer.json().unwrap()["id"], id);
    }
    let metrics = node.metrics().unwrap();
    assert_eq!(metrics["requests"], 5, "{metrics}");
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "tracked") == 5 && dedup_stat(&envoy, "duplicates_rejected") == 0
    }));
}

/// Four wallets at 5 rps with a 1 s timeout, each request retried at once up
/// to 3 times, against a node that needs 2 s per call.
fn storm(envoy: &Envoy, node: &RpcNode, seconds: u64) -> serde_json::Value {
    let wallets: Vec<ClientSpec> = (1..=4)
        .map(|i| ClientSpec {
            retries: 3,
            unique_params: true,
            ..client(&format!("wallet-{i}"), 5.0, "eth_call", 1000)
        })
        .collect();
    let spec = stakegate_loadgen::RunSpec {
        timeout: Duration::from_secs(1),
        ..load_h2(
            &envoy.url("public").unwrap(),
            wallets,
            Duration::from_secs(seconds),
            2,
        )
    };
    let report = loadgen::run(&spec).unwrap();
    eprintln!("status: {:?}", report.status);
    let metrics = node.metrics().unwrap();
    eprintln!(
        "node: {} requests, {} unique, tip lag max {} ms, queue max {}",
        metrics["requests"],
        metrics["unique_requests"],
        metrics["tip_lag_max_ms"],
        metrics["queue_max"]
    );
    metrics
}

fn amplification(metrics: &serde_json::Value) -> f64 {
    metrics["requests"].as_f64().unwrap() / metrics["unique_requests"].as_f64().unwrap()
}

#[test]
fn a_retry_storm_reaches_the_node_once_per_request() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 1000, "dedup": {"windowMs": 10000}}"#,
        SLOW_NODE,
    );
    let with = storm(&envoy, &node, 10);
    drop(envoy);
    drop(node);
    let (node, envoy) = node_behind_gate(r#"{"maxInflight": 1000}"#, SLOW_NODE);
    let without = storm(&envoy, &node, 10);

    assert!(with["unique_requests"].as_u64().unwrap() >= 190, "{with}");
    assert!(
        amplification(&with) <= 1.05,
        "with dedup: {}",
        amplification(&with)
    );
    assert!(
        amplification(&without) >= 3.5,
        "without: {}",
        amplification(&without)
    );
    assert_eq!(with["tip_lost"], false);
    let lag = |m: &serde_json::Value| m["tip_lag_max_ms"].as_f64().unwrap();
    assert!(
        lag(&with) < lag(&without),
        "{} vs {}",
        lag(&with),
        lag(&without)
    );
}
