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
use stakegate_tests::{client, eventually, load_h2, node_behind_gate, SETTLE};
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
    eventually(SETTLE, || node.metrics().unwrap()["requests"] == n)
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
    assert!(eventually(SETTLE, || {
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
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "kept") == 2));
    let retry = http::post(&url, &[], &call(5, "0x08")).unwrap();
    assert_eq!(
        (retry.status, retry.json().unwrap()["id"].clone()),
        (200, json!(5))
    );
    assert_eq!(requests(&node), 2);
    assert!(eventually(SETTLE, || {
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
    assert!(eventually(SETTLE, || {
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
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "kept") == 1));
    let url = envoy.url("public").unwrap();
    let retry = http::post(&url, &[], &call(3, "0x01")).unwrap();
    assert_eq!(
        (retry.status, retry.json().unwrap()["id"].clone()),
        (200, json!(3))
    );
    assert_eq!(requests(&node), 1);
    assert!(eventually(SETTLE, || {
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
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "waiting") == 2));
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
    assert!(eventually(SETTLE, || {
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
    assert!(eventually(SETTLE, || {
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
    // A final block by hash (genesis): the first read finds the gate not
    // knowing the finalized block yet, which it asks for; then one call
    // for three reads.
    let genesis = format!("0x{:064x}", 0);
    send(3, "eth_getBlockByHash", &genesis);
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "finality_known") == 1));
    for id in 4..=6 {
        send(id, "eth_getBlockByHash", &genesis);
    }
    // A block not final (the head, with 64 to go): every read reaches the
    // node.
    let head = || node.metrics().unwrap()["head"].as_u64().unwrap();
    assert!(eventually(SETTLE, || head() >= 1));
    let head = format!("0x{:064x}", head());
    for id in 7..=8 {
        send(id, "eth_getBlockByHash", &head);
    }
    // A receipt not mined yet (null): every poll reaches the node.
    for id in 9..=11 {
        assert_eq!(send(id, "eth_getTransactionReceipt", "0xcd"), Value::Null);
    }
    let served = node.metrics().unwrap()["served"].clone();
    assert_eq!(served["eth_sendRawTransaction"], 1, "{served}");
    assert_eq!(served["eth_getBlockByHash"], 2 + 2, "{served}");
    assert_eq!(served["eth_getTransactionReceipt"], 3, "{served}");
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "taken") == 3));
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

/// The raw text of each id in `body` (an answer, or each entry of a batch's).
fn raw_ids(body: &str) -> Vec<String> {
    let summary = stakegate_core::jsonrpc::Summary::of(body.as_bytes());
    summary
        .entries
        .iter()
        .filter_map(|e| e.last(stakegate_core::jsonrpc::Name::Id))
        .map(|id| body[id.value.clone()].to_string())
        .collect()
}

/// Ids as clients write them, that a node re-serialising them changes:
/// exponents, trailing zeros, escapes, numbers past an f64's precision.
const ODD_IDS: &[&str] = &[
    "1e0",
    "7.50",
    "-0",
    "2E+1",
    r#""\u0061b""#,
    r#""tab\t""#,
    "123456789012345678901234567890",
    "0.1e1",
    r#""""#,
    "42",
];

#[test]
fn a_node_that_rewrites_ids_gives_every_coalesced_client_exactly_its_own_id() {
    // rpc-node re-serialises ids, as serde nodes do (1e0 comes back 1.0).
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {"windowMs": 10000}}"#,
        &["--read-slots", "64", "--cost", "eth_call=300ms"],
    );
    let mut mismatches = Vec::new();
    let mut checked = 0;
    for round in 0..ODD_IDS.len() {
        // A leader and three waiters, each with another spelling.
        let data = format!("0x{round:02x}");
        let ids: Vec<&str> = (0..4)
            .map(|k| ODD_IDS[(round + 3 * k) % ODD_IDS.len()])
            .collect();
        let body = |id: &str| call(0, &data).replace(r#""id":0"#, &format!(r#""id":{id}"#));
        let before = requests(&node);
        let leader = post(&envoy, body(ids[0]));
        assert!(node_received(&node, before + 1));
        let waiters: Vec<_> = ids[1..].iter().map(|id| post(&envoy, body(id))).collect();
        for (id, answer) in ids.iter().zip(std::iter::once(leader).chain(waiters)) {
            let answer = answer.join().unwrap();
            assert_eq!(answer.status, 200, "{}", answer.body);
            checked += 1;
            if raw_ids(&answer.body) != [id.to_string()] {
                mismatches.push(format!("sent {id}, got {}", answer.body));
            }
        }
    }
    // A batch waits for a batch with the same calls: each entry its own id.
    let batch = |a: &str, b: &str| {
        format!(
            "[{},{}]",
            call(0, "0xb1").replace(r#""id":0"#, &format!(r#""id":{a}"#)),
            call(0, "0xb2").replace(r#""id":0"#, &format!(r#""id":{b}"#))
        )
    };
    let before = requests(&node);
    let first = post(&envoy, batch("5e0", "6e0"));
    assert!(node_received(&node, before + 1));
    let second = post(&envoy, batch("5", "6"));
    for (want, answer) in [(["5e0", "6e0"], first), (["5", "6"], second)] {
        let answer = answer.join().unwrap();
        let mut got = raw_ids(&answer.body);
        got.sort();
        checked += 1;
        if got != want {
            mismatches.push(format!("sent {want:?}, got {}", answer.body));
        }
    }
    // Across clients: the same signed transaction from three senders, the
    // third after the first two, from the kept answer.
    let send = |id: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_sendRawTransaction","params":["0xf86c"]}}"#
        )
    };
    let before = requests(&node);
    let a = post(&envoy, send("1e0"));
    let b = post(&envoy, send("42"));
    for (id, answer) in [("1e0", a), ("42", b)] {
        let answer = answer.join().unwrap();
        checked += 1;
        if raw_ids(&answer.body) != [id] {
            mismatches.push(format!("sent {id}, got {}", answer.body));
        }
    }
    let later = http::post(&envoy.url("public").unwrap(), &[], &send("7")).unwrap();
    checked += 1;
    if raw_ids(&later.body) != ["7"] {
        mismatches.push(format!("sent 7, got {}", later.body));
    }
    eprintln!("{checked} answers checked, {} mismatches", mismatches.len());
    assert!(mismatches.is_empty(), "{mismatches:#?}");
    assert!(requests(&node) <= before + 2, "the sends were coalesced");
    assert!(dedup_stat(&envoy, "shared") > 0);
}

#[test]
fn an_answer_the_node_gzips_reaches_every_client_readable() {
    // A node (or a proxy in front of it) that gzips whatever is accepted.
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 100, "dedup": {}}"#,
        &["--read-slots", "64", "--cost", "eth_call=500ms", "--gzip"],
    );
    let url = envoy.url("public").unwrap();
    let send = |id: u32| {
        let url = url.clone();
        let body = call(u64::from(id), "0xee");
        std::thread::spawn(move || {
            http::post_raw(&url, &[("accept-encoding", "gzip")], &body).unwrap()
        })
    };
    let leader = send(1);
    assert!(node_received(&node, 1));
    let waiters: Vec<_> = (2..=4).map(send).collect();
    for (id, answer) in (1..=4).zip(std::iter::once(leader).chain(waiters)) {
        let (status, headers, body) = answer.join().unwrap();
        let encoding = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-encoding"))
            .map(|(_, v)| v.as_str());
        let text = match encoding {
            Some("gzip") => {
                let mut text = String::new();
                std::io::Read::read_to_string(
                    &mut flate2::read::GzDecoder::new(&body[..]),
                    &mut text,
                )
                .unwrap_or_else(|e| panic!("{id}: not gzip: {e}"));
                text
            }
            None => String::from_utf8(body).unwrap(),
            Some(other) => panic!("{id}: {other}"),
        };
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{id} could not read its answer ({e}): {text:?}"));
        assert_eq!(answer["id"], id, "{text}");
        assert!(answer["result"].is_string(), "{text}");
    }
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "unshared") >= 1));
}

/// anvil's dev account 0, unlocked: it sends the transactions.
const SENDER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";

/// Reads on anvil through the gateway (coalescing engaged throughout,
/// kept answers served for 10 s) while the chain reorganises under them:
/// a transaction is mined, read by receipt, by hash and by its block's
/// hash (three clients at once), then the block is dropped (`evm_revert`)
/// and another mined at its height. Every answer the gateway gives is
/// compared with the node's at that moment: a receipt of a block no longer
/// on the chain is never served, while a receipt in a final block (64
/// deep, as anvil finalises) is served again: from coalescing's kept
/// answer or from the answer cache (on in the example policy), whichever
/// holds it first on the worker that takes the read.
#[test]
fn a_reorg_never_makes_the_gateway_serve_a_stale_answer() {
    let anvil = stakegate_stack::Anvil::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate_policy = dir.path().join("gate.json");
    let qos_policy = dir.path().join("qos.json");
    std::fs::write(
        &gate_policy,
        stakegate_tests::example_policy(
            "admission-gate",
            json!({ "dedup": { "windowMs": 10000, "standbyAfterMs": 600000 } }),
        ),
    )
    .unwrap();
    std::fs::write(
        &qos_policy,
        stakegate_tests::example_policy("stake-qos", json!({})),
    )
    .unwrap();
    let envoy =
        stakegate_tests::start_initialised(dir.path(), anvil.addr(), &gate_policy, &qos_policy);
    let url = envoy.url("public").unwrap();
    // A transaction, mined (anvil mines it a moment after answering).
    let send_tx = |value: u64| {
        let hash = anvil
            .call(
                "eth_sendTransaction",
                &format!(r#"[{{"from":"{SENDER}","to":"0x{value:040x}","value":"0x{value:x}"}}]"#),
            )
            .unwrap();
        let receipt = || {
            anvil
                .call("eth_getTransactionReceipt", &format!("[{hash}]"))
                .unwrap()
        };
        assert!(eventually(SETTLE, || !receipt().is_null()));
        hash
    };
    let body = |method: &str, params: &Value| {
        json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
    };
    // Through the gateway, three clients at once; each answer against the
    // node's, asked right after (nothing mines in between).
    let mut checked = 0;
    let mut stale = Vec::new();
    let mut read = |method: &str, params: Value| {
        let request = body(method, &params);
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (url, request) = (url.clone(), request.clone());
                std::thread::spawn(move || http::post(&url, &[], &request).unwrap())
            })
            .collect();
        let answers: Vec<Value> = readers
            .into_iter()
            .map(|r| r.join().unwrap().json().unwrap()["result"].clone())
            .collect();
        let truth = anvil.call(method, &params.to_string()).unwrap();
        for answer in answers {
            checked += 1;
            if answer != truth {
                stale.push(format!("{method}{params}: gateway {answer}, node {truth}"));
            }
        }
        truth
    };
    // A transaction in a block that becomes final.
    let settled = send_tx(1);
    anvil.call("anvil_mine", r#"["0x46"]"#).unwrap();
    for round in 0..8u64 {
        let snapshot = anvil.call("evm_snapshot", "[]").unwrap();
        let hash = send_tx(100 + round);
        let receipt = read("eth_getTransactionReceipt", json!([hash]));
        let block = receipt["blockHash"].clone();
        assert!(block.is_string(), "mined: {receipt}");
        read("eth_getBlockByHash", json!([block, false]));
        read("eth_getTransactionByHash", json!([hash]));
        // The reorg: the block is gone, another takes its height.
        assert_eq!(
            anvil.call("evm_revert", &format!("[{snapshot}]")).unwrap(),
            true
        );
        send_tx(200 + round);
        assert_eq!(
            read("eth_getTransactionReceipt", json!([hash])),
            Value::Null
        );
        assert_eq!(
            read("eth_getBlockByHash", json!([block, false])),
            Value::Null
        );
        read("eth_getTransactionByHash", json!([hash]));
        read("eth_getTransactionReceipt", json!([settled]));
    }
    // The counts reach Envoy at the gate's heartbeat.
    assert!(eventually(SETTLE, || dedup_stat(&envoy, "led") > 0));
    let served_again = || {
        let hits = envoy.stat("wasmcustom.stakegate.gate.cache.hits").unwrap();
        (dedup_stat(&envoy, "taken"), hits)
    };
    eventually(SETTLE, || {
        let (taken, hits) = served_again();
        taken + hits > 0
    });
    let (taken, hits) = served_again();
    eprintln!(
        "{checked} answers checked against the node, {} stale; {} led, {} shared, {taken} served from kept answers, {hits} from the cache",
        stale.len(),
        dedup_stat(&envoy, "led"),
        dedup_stat(&envoy, "shared"),
    );
    assert!(stale.is_empty(), "{stale:#?}");
    assert!(taken + hits > 0, "the final receipt was served again");
}
