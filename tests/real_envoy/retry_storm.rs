//! Coalescing in a real Envoy at `--concurrency 2`: requests identical to
//! one in flight wait for its answer and get it with their own ids; a
//! client that gives up leaves the node's work to its retry; a failed
//! leader hands over; waits end at their deadline; 429 only past the
//! waiter cap; a poll the node has answered is sent again; and a retry
//! storm reaches the node once per request with no 429
//! (scenarios/retry-storm.toml, shortened).

use serde_json::{json, Value};
use stakegate_loadgen::ClientSpec;
use stakegate_stack::{http, loadgen, Envoy, RpcNode};
use stakegate_tests::{client, eventually, load_h2, node_behind_gate};
use std::thread::JoinHandle;
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

/// Posts `body` on a thread.
fn post(envoy: &Envoy, body: String) -> JoinHandle<http::Answer> {
    let url = envoy.url("public").unwrap();
    std::thread::spawn(move || http::post(&url, &[], &body).unwrap())
}

/// Waits until the node has received `n` requests.
fn node_received(node: &RpcNode, n: u64) -> bool {
    eventually(Duration::from_secs(10), || {
        node.metrics().unwrap()["requests"] == n
    })
}

fn requests(node: &RpcNode) -> u64 {
    node.metrics().unwrap()["requests"].as_u64().unwrap()
}

#[test]
fn identical_requests_wait_for_one_answer_and_each_gets_its_own_id() {
    let (node, envoy) = node_behind_gate(r#"{"maxInflight": 100, "dedup": {}}"#, SLOW_NODE);
    let leader = post(&envoy, call(1, "0x01"));
    assert!(node_received(&node, 1));
    // Each on its own connection, so on either worker. One is a string id,
    // one a batch of the same call with another id in it.
    let mut waiters: Vec<_> = (2..=5).map(|id| post(&envoy, call(id, "0x01"))).collect();
    waiters.push(post(
        &envoy,
        call(6, "0x01").replace(r#""id":6"#, r#""id":"six""#),
    ));
    let led = leader.join().unwrap();
    assert_eq!(led.status, 200, "{}", led.body);
    let result = led.json().unwrap()["result"].clone();
    assert!(result.is_string(), "{}", led.body);
    let mut ids: Vec<serde_json::Value> = Vec::new();
    for waiter in waiters {
        let answer = waiter.join().unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("content-type"), Some("application/json"));
        let body = answer.json().unwrap();
        assert_eq!(body["result"], result, "{}", answer.body);
        ids.push(body["id"].clone());
    }
    assert_eq!(serde_json::Value::from(ids), json!([2, 3, 4, 5, "six"]));
    assert_eq!(requests(&node), 1, "one call reached the node");
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "led") == 1
            && dedup_stat(&envoy, "coalesced") == 5
            && dedup_stat(&envoy, "shared") == 5
            && dedup_stat(&envoy, "waiting") == 0
    }));
    // A batch waits too, and gets the batch answer with its own ids.
    let batch = |a: &str, b: &str| {
        format!(
            "[{},{}]",
            call(0, "0x02").replace(r#""id":0"#, &format!(r#""id":{a}"#)),
            call(0, "0x03").replace(r#""id":0"#, &format!(r#""id":{b}"#))
        )
    };
    let first = post(&envoy, batch("10", "11"));
    assert!(node_received(&node, 2));
    let second = post(&envoy, batch(r#""x""#, "21"));
    let (first, second) = (first.join().unwrap(), second.join().unwrap());
    assert_eq!((first.status, second.status), (200, 200), "{}", second.body);
    let ids = |a: &http::Answer| -> Vec<serde_json::Value> {
        let body = a.json().unwrap();
        body.as_array()
            .unwrap()
            .iter()
            .map(|e| e["id"].clone())
            .collect()
    };
    assert_eq!(serde_json::Value::from(ids(&first)), json!([10, 11]));
    assert_eq!(serde_json::Value::from(ids(&second)), json!(["x", 21]));
    assert_eq!(requests(&node), 2);
}

#[test]
fn a_client_that_gives_up_leaves_the_nodes_answer_to_its_retry() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {"windowMs": 10000}}"#,
        SLOW_NODE,
    );
    let url = envoy.url("public").unwrap();
    // The client gives up after 500 ms, twice; its third try gets the
    // answer of the call its first try started.
    for id in 1..=2 {
        let gave_up = http::post_within(&url, &call(id, "0x07"), Duration::from_millis(500));
        assert!(gave_up.is_err(), "{gave_up:?}");
    }
    let retry = http::post(&url, &[], &call(3, "0x07")).unwrap();
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.json().unwrap()["id"], 3);
    assert_eq!(requests(&node), 1, "the node was asked once");
    // Given up on, that answer was also kept for a retry (it was taken by
    // the waiting one here). Given up before the answer came, the retry
    // that comes after it takes the kept answer: still one call at the
    // node. (`windowMs` keeps it long enough for this test to see it.)
    let gave_up = http::post_within(&url, &call(4, "0x08"), Duration::from_millis(500));
    assert!(gave_up.is_err());
    assert!(eventually(Duration::from_secs(10), || dedup_stat(
        &envoy, "kept"
    ) == 2));
    let retry = http::post(&url, &[], &call(5, "0x08")).unwrap();
    assert_eq!(
        (retry.status, retry.json().unwrap()["id"].clone()),
        (200, json!(5))
    );
    assert_eq!(requests(&node), 2);
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "taken") == 1 && dedup_stat(&envoy, "left") == 3
    }));
}

#[test]
fn a_leader_without_an_answer_hands_over_to_a_waiter() {
    // The leader's callout gives up after 1 s on a node that takes 2 s.
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {"upstream": {"timeoutMs": 1000}}}"#,
        SLOW_NODE,
    );
    let leader = post(&envoy, call(1, "0x01"));
    assert!(node_received(&node, 1));
    let waiter = post(&envoy, call(2, "0x01"));
    // Envoy's 504 for the callout, as a JSON-RPC error with its id.
    let led = leader.join().unwrap();
    assert_eq!(led.status, 504, "{}", led.body);
    assert_eq!(led.json().unwrap()["id"], 1);
    // The waiter leads then: a second call at the node, which times out
    // the same way.
    let waited = waiter.join().unwrap();
    assert_eq!(waited.status, 504, "{}", waited.body);
    let body = waited.json().unwrap();
    assert_eq!(
        (body["id"].clone(), body["error"]["code"].clone()),
        (json!(2), json!(-32603))
    );
    assert_eq!(requests(&node), 2);
    assert!(eventually(Duration::from_secs(10), || {
        dedup_stat(&envoy, "handed_over") == 1
            && dedup_stat(&envoy, "callouts_failed") == 2
            && dedup_stat(&envoy, "waiting") == 0
    }));
}

#[test]
fn a_wait_ends_at_its_deadline_with_504_and_the_answer_is_kept() {
    // Every held request waits at most maxWaitMs, the leader's own client
    // too; the node's answer, when it comes, is kept for a retry.
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "heartbeatMs": 100, "dedup": {"maxWaitMs": 300, "windowMs": 10000}}"#,
        SLOW_NODE,
    );
    let leader = post(&envoy, call(1, "0x01"));
    assert!(node_received(&node, 1));
    let waited = post(&envoy, call(2, "0x01")).join().unwrap();
    assert_eq!(waited.status, 504, "{}", waited.body);
    assert_eq!(waited.json().unwrap()["id"], 2);
    let led = leader.join().unwrap();
    assert_eq!(
        (led.status, led.json().unwrap()["id"].clone()),
        (504, json!(1))
    );
    assert!(eventually(Duration::from_secs(10), || dedup_stat(
        &envoy, "kept"
    ) == 1));
    let url = envoy.url("public").unwrap();
    let retry = http::post(&url, &[], &call(3, "0x01")).unwrap();
    assert_eq!(
        (retry.status, retry.json().unwrap()["id"].clone()),
        (200, json!(3))
    );
    assert_eq!(requests(&node), 1);
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "wait_timeouts") == 2 && dedup_stat(&envoy, "waiting") == 0
    }));
}

#[test]
fn past_max_waiters_the_next_identical_request_gets_429() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {"maxWaiters": 2, "maxBodyBytes": 2048}}"#,
        SLOW_NODE,
    );
    let leader = post(&envoy, call(1, "0x01"));
    assert!(node_received(&node, 1));
    let waiter = post(&envoy, call(2, "0x01"));
    assert!(eventually(Duration::from_secs(5), || dedup_stat(
        &envoy, "waiting"
    ) == 2));
    let url = envoy.url("public").unwrap();
    let refused = http::post(&url, &[], &call(3, "0x01")).unwrap();
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.json().unwrap()["id"], 3);
    // A body over maxBodyBytes passes whole, unchecked, twice.
    let large = call(4, &format!("0x{}", "ab".repeat(2000)));
    for _ in 0..2 {
        let answer = http::post(&url, &[], &large).unwrap();
        assert_eq!(
            (answer.status, answer.json().unwrap()["id"].clone()),
            (200, json!(4))
        );
    }
    assert_eq!(leader.join().unwrap().status, 200);
    assert_eq!(waiter.join().unwrap().status, 200);
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "refused") == 1 && dedup_stat(&envoy, "too_large") == 2
    }));
}

#[test]
fn a_poll_answered_by_the_node_is_sent_again_at_once() {
    // A receipt wait: the same call every 50 ms until its answer changes.
    // Each poll follows the last one's answer, so none is identical to a
    // call in flight, however long the window.
    let (node, envoy) =
        node_behind_gate(r#"{"maxInflight": 100, "dedup": {"windowMs": 10000}}"#, &[]);
    let url = envoy.url("public").unwrap();
    for id in 1..=5 {
        let answer = http::post(&url, &[], &call(id, "0x05")).unwrap();
        assert_eq!(answer.status, 200, "poll {id}: {}", answer.body);
        assert_eq!(answer.json().unwrap()["id"], id);
    }
    assert_eq!(requests(&node), 5);
    assert!(eventually(Duration::from_secs(5), || {
        dedup_stat(&envoy, "led") == 5 && dedup_stat(&envoy, "taken") == 0
    }));
}

#[test]
fn answers_that_cannot_change_are_reused_and_a_receipt_not_found_is_not() {
    // (The mock node serves eth_getBlockByHash once it is given a cost.)
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {"windowMs": 10000}}"#,
        &["--cost", "eth_getBlockByHash=1ms"],
    );
    let url = envoy.url("public").unwrap();
    let send = |id: u64, method: &str, param: &str| {
        let body =
            format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":["{param}"]}}"#);
        let answer = http::post(&url, &[], &body).unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        let body = answer.json().unwrap();
        assert_eq!(body["id"], id);
        body["result"].clone()
    };
    // The same signed transaction, sent twice: one call, the same hash.
    let hash = send(1, "eth_sendRawTransaction", "0xf86b0a");
    assert!(hash.is_string(), "{hash}");
    assert_eq!(send(2, "eth_sendRawTransaction", "0xf86b0a"), hash);
    // A block by hash, found: one call for three reads.
    for id in 3..=5 {
        send(id, "eth_getBlockByHash", "0xab");
    }
    // A receipt not mined yet (null): every poll reaches the node.
    for id in 6..=8 {
        assert_eq!(send(id, "eth_getTransactionReceipt", "0xcd"), Value::Null);
    }
    let served = node.metrics().unwrap()["served"].clone();
    assert_eq!(
        served,
        json!({"eth_sendRawTransaction": 1, "eth_getBlockByHash": 1, "eth_getTransactionReceipt": 3})
    );
    assert!(eventually(Duration::from_secs(5), || dedup_stat(
        &envoy, "taken"
    ) == 3));
}

/// Four wallets at 5 rps with a 1 s timeout, each request retried at once up
/// to 3 times, against a node that needs 2 s per call.
fn storm(envoy: &Envoy, node: &RpcNode, seconds: u64) -> (serde_json::Value, serde_json::Value) {
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
    (metrics, serde_json::to_value(&report.status).unwrap())
}

fn amplification(metrics: &serde_json::Value) -> f64 {
    metrics["requests"].as_f64().unwrap() / metrics["unique_requests"].as_f64().unwrap()
}

#[test]
fn a_retry_storm_reaches_the_node_once_per_request_with_no_429() {
    let (node, envoy) = node_behind_gate(r#"{"maxInflight": 1000, "dedup": {}}"#, SLOW_NODE);
    let (with, status) = storm(&envoy, &node, 10);
    drop(envoy);
    drop(node);
    let (node, envoy) = node_behind_gate(r#"{"maxInflight": 1000}"#, SLOW_NODE);
    let (without, _) = storm(&envoy, &node, 10);

    assert!(with["unique_requests"].as_u64().unwrap() >= 190, "{with}");
    assert!(
        amplification(&with) <= 1.02,
        "with dedup: {}",
        amplification(&with)
    );
    assert!(
        amplification(&without) >= 3.5,
        "without: {}",
        amplification(&without)
    );
    assert_eq!(status["429"], 0, "{status}");
    assert_eq!(with["tip_lost"], false);
    let lag = |m: &serde_json::Value| m["tip_lag_max_ms"].as_f64().unwrap();
    assert!(
        lag(&with) < lag(&without),
        "{} vs {}",
        lag(&with),
        lag(&without)
    );
}
