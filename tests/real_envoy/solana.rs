//! Solana through the whole gateway: rpc-node speaking Solana (`--chain
//! solana`: slots at three commitment levels, the methods providers see
//! most, PubSub), `stakegate init`'s gateway in front of it, and the real
//! client libraries (@solana/kit, @solana/web3.js 1.x, solana-py; pinned in
//! clients/) doing a dapp's everyday calls over HTTP and PubSub, through
//! the gateway and straight at the node.

use serde_json::{json, Value};
use stakegate_stack::{Envoy, RpcNode};
use stakegate_tests::{
    client_script, eventually, example_policy, gateway_on_one_worker, json_output,
    start_initialised, SETTLE,
};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const LIBRARIES: [&str; 3] = ["kit", "web3js", "solana-py"];

/// A slot every 400 ms, as on mainnet, each executed quickly.
const NODE_ARGS: [&str; 6] = [
    "--chain",
    "solana",
    "--block-interval",
    "400ms",
    "--block-exec",
    "20ms",
];

/// The gateway as an operator makes it: `stakegate init` with both example
/// policies, in front of the node. The directory must outlive Envoy.
fn gateway(node: &RpcNode) -> (Envoy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let gate_policy = dir.path().join("gate.json");
    let qos_policy = dir.path().join("qos.json");
    std::fs::write(&gate_policy, example_policy("admission-gate", json!({}))).unwrap();
    std::fs::write(&qos_policy, example_policy("stake-qos", json!({}))).unwrap();
    let envoy = start_initialised(dir.path(), node.addr(), &gate_policy, &qos_policy);
    (envoy, dir)
}

/// `library`'s script (clients/solana.mjs or clients/solana_ops.py) with
/// `args`, as the JSON it printed.
fn calls(library: &str, http: &str, ws: &str) -> Value {
    script(library, &[http, ws])
}

fn script(library: &str, args: &[&str]) -> Value {
    let file = if library == "solana-py" {
        "solana_ops.py"
    } else {
        "solana.mjs"
    };
    json_output(client_script(file, library).args(args))
}

/// What moves with the slot between two runs (slots, blockhashes and what
/// is derived from them): dropped, so that the rest compares exactly.
const MOVING: [&str; 15] = [
    "slot",
    "confirmations",
    "parent",
    "root",
    "blockHeight",
    "absoluteSlot",
    "slotIndex",
    "transactionCount",
    "blockhash",
    "previousBlockhash",
    "lastValidBlockHeight",
    "parentSlot",
    "blockTime",
    "signature",
    "context",
];

fn without_moving(value: &Value) -> Value {
    match value {
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .filter(|(k, _)| !MOVING.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), without_moving(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_moving).collect()),
        other => other.clone(),
    }
}

/// A slot as a library gives it: a number, or a string (kit's bigints).
fn slot(value: &Value) -> u64 {
    value
        .as_u64()
        .or_else(|| value.as_str()?.parse().ok())
        .unwrap_or_else(|| panic!("not a slot: {value}"))
}

#[test]
fn solana_libraries_get_through_the_gateway_what_they_get_from_the_node() {
    let node = RpcNode::start(&NODE_ARGS).unwrap();
    let (envoy, _dir) = gateway(&node);
    let public = envoy.listener("public").unwrap();
    for library in LIBRARIES {
        let direct = calls(library, &node.url(), &format!("ws://{}", node.addr()));
        let through = calls(
            library,
            &format!("http://{public}"),
            &format!("ws://{public}"),
        );
        for run in [&direct, &through] {
            assert_eq!(
                run["sentSignatureIsTheTransactions"], true,
                "{library}: {run}"
            );
            // Commitment levels: confirmed trails the newest slot that a
            // slot subscription saw, by at least one.
            assert!(
                slot(&run["slot"]) < slot(&run["pubsub"]["slot"]["slot"]),
                "{library}: {run}"
            );
            assert_eq!(
                run["pubsub"]["signature"]["value"],
                json!({"err": null}),
                "{library}"
            );
            assert!(
                run["programAccounts"].as_array().unwrap().len() == 3,
                "{library}: {run}"
            );
        }
        assert_eq!(
            without_moving(&through),
            without_moving(&direct),
            "{library}: through the gateway against straight at the node"
        );
        // Everything compared was there to compare.
        let compared = without_moving(&direct);
        for call in [
            "balance",
            "accountInfo",
            "multipleAccounts",
            "simulate",
            "pubsub",
        ] {
            assert!(!compared[call].is_null(), "{library}: {call} in {compared}");
        }
        // Each library's confirmation loop ends: the node says a
        // transaction sent is confirmed a slot after it lands (it said
        // `null` forever, and solana-py's `confirm_transaction` timed out
        // even straight at the node).
        for run in [&direct, &through] {
            let status = &run["signatureStatuses"]["value"][0]["confirmationStatus"];
            assert_eq!(status, "confirmed", "{library}: {run}");
            if library == "solana-py" {
                assert_eq!(run["confirmed"], "confirmed", "{run}");
            }
        }
    }
    // The node saw the calls that came through the gateway.
    assert!(
        envoy
            .stat("wasmcustom.stakegate.gate.admitted.default")
            .unwrap()
            > 0
    );
}

/// One getBalance by each library, with its default retries, against a
/// gateway that refuses it: with 503 (the gate's one slot held by a call
/// the node takes two minutes over) and with 429 (stake QoS giving out 1
/// call per second while the same address floods). What each is finally
/// given, how many attempts reached Envoy, and after how long, is the
/// table in docs/clients.md (printed here).
#[test]
fn each_solana_library_when_refused_is_given_our_error_and_retries_as_measured() {
    let mut args: Vec<&str> = NODE_ARGS.to_vec();
    args.extend(["--cost", "test_hold=120s"]);
    let mut table = String::from("library | gateway's answer | attempts | given | after ms\n");
    // Refusals Envoy counted that were not the libraries' (the flood's).
    let others = std::sync::atomic::AtomicU64::new(0);
    let mut run = |envoy: &Envoy, class: &str, expected: &str| {
        let public = envoy.listener("public").unwrap();
        let answered = || {
            envoy
                .stat(&format!("http.public.downstream_rq_{class}"))
                .unwrap()
        };
        for library in LIBRARIES {
            let before = answered() - others.load(Ordering::SeqCst) as i64;
            let outcome = script(library, &["overload", &format!("http://{public}")]);
            // Envoy counts a response as it ends, before its client has it.
            let attempts = answered() - others.load(Ordering::SeqCst) as i64 - before;
            table += &format!(
                "{library} | {class} | {attempts} | {} (status {}, retry-after {}, rule {}) | {}\n",
                outcome["error"],
                outcome["status"],
                outcome["retryAfter"],
                outcome["rule"],
                outcome["ms"]
            );
            eprintln!("{table}");
            assert!(
                (1..=12).contains(&attempts),
                "{library}: {attempts} attempts"
            );
            // A library that retries may find a call free on a later
            // attempt (the share refills while it backs off): an answer is
            // then right, after at least one refusal (counted above).
            let Some(error) = outcome["error"].as_str() else {
                assert!(outcome.get("answer").is_some(), "{library}: {outcome}");
                continue;
            };
            assert!(
                error.contains(expected) || outcome["status"] == expected.parse::<u16>().unwrap(),
                "{library}: {outcome}"
            );
        }
    };

    let (node, envoy) = gateway_on_one_worker(
        &example_policy("stake-qos", json!({})),
        r#"{"maxInflight": 1, "decideOnBody": true}"#,
        &args,
    );
    let public = envoy.listener("public").unwrap();
    let hold = r#"{"jsonrpc":"2.0","id":1,"method":"test_hold","params":[]}"#;
    let mut held = std::net::TcpStream::connect(public).unwrap();
    write!(
        held,
        "POST / HTTP/1.1\r\nhost: rpc\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{hold}",
        hold.len()
    )
    .unwrap();
    assert!(eventually(SETTLE, || {
        node.metrics().is_ok_and(|m| m["inflight"] == 1)
    }));
    run(&envoy, "5xx", "503");
    drop(held);
    drop((node, envoy));

    // A retry sent before its retry-after is held until then (qos::early):
    // web3.js's are, so retry-after is kept to 3 s at most.
    let (_node, envoy) = gateway_on_one_worker(
        r#"{"capacityRps": 1, "decideOnBody": true, "retryAfterMaxS": 3}"#,
        r#"{"maxInflight": 8, "decideOnBody": true}"#,
        &NODE_ARGS,
    );
    // The same address floods while the libraries call, so that QoS keeps
    // refusing it (a new request each time: none is an early retry);
    // bounded in count and time, and stopped when they are done, or when
    // the test fails.
    let url = envoy.url("public").unwrap();
    let stop = AtomicBool::new(false);
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = Stop(&stop);
        s.spawn(|| {
            let deadline = std::time::Instant::now() + Duration::from_secs(180);
            for i in 0..5_000 {
                if stop.load(Ordering::Relaxed) || std::time::Instant::now() > deadline {
                    break;
                }
                let body = format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"getSlot"}}"#);
                if stakegate_stack::http::post(&url, &[], &body).is_ok_and(|a| a.status == 429) {
                    others.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        // Throttled before the libraries start.
        assert!(eventually(SETTLE, || {
            envoy
                .stat("wasmcustom.stakegate.qos.throttled.unstaked")
                .unwrap_or(0)
                > 0
        }));
        run(&envoy, "4xx", "429");
    });
}

/// The gate's coalescing with Solana's rules: identical scans in flight go
/// to the node once, each caller getting the answer with its own id; a
/// block asked at `finalized` is served again (it cannot change), one at
/// `confirmed` is not (a fork can undo it).
#[test]
fn identical_solana_reads_reach_the_node_once_and_only_finalized_answers_are_served_again() {
    let mut args: Vec<&str> = NODE_ARGS.to_vec();
    args.extend(["--cost", "getProgramAccounts=1s"]);
    let (node, envoy) = gateway_on_one_worker(
        &example_policy("stake-qos", json!({})),
        // Coalescing engaged from the start, not from the first held call.
        r#"{"maxInflight": 4, "decideOnBody": true, "dedup": {"standbyAfterMs": 600000}}"#,
        &args,
    );
    let url = envoy.url("public").unwrap();
    let served = |method: &str| {
        node.metrics().unwrap()["served"][method]
            .as_u64()
            .unwrap_or(0)
    };
    let scan = |id: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"getProgramAccounts","params":["TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA",{{"encoding":"base64"}}]}}"#
        )
    };
    let answers: Vec<Value> = std::thread::scope(|s| {
        let calls: Vec<_> = (1..=5)
            .map(|id| {
                let (url, body) = (&url, scan(id));
                s.spawn(move || stakegate_stack::http::post(url, &[], &body).unwrap())
            })
            .collect();
        calls
            .into_iter()
            .map(|c| serde_json::from_str(&c.join().unwrap().body).unwrap())
            .collect()
    });
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer["id"], i as u64 + 1, "{answer}");
        assert_eq!(answer["result"], answers[0]["result"]);
        assert_eq!(answer["result"].as_array().unwrap().len(), 3, "{answer}");
    }
    assert_eq!(
        served("getProgramAccounts"),
        1,
        "five identical scans, one at the node"
    );

    let block = |commitment: &str| {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":9,"method":"getBlock","params":[0,{{"commitment":"{commitment}","transactionDetails":"none"}}]}}"#
        );
        let answer = stakegate_stack::http::post(&url, &[], &body).unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
    };
    for _ in 0..3 {
        block("finalized");
    }
    assert_eq!(
        served("getBlock"),
        1,
        "a finalized block, asked three times"
    );
    for _ in 0..3 {
        block("confirmed");
    }
    assert_eq!(
        served("getBlock"),
        4,
        "a confirmed block goes to the node each time"
    );
}

/// A wallet or an indexer opens its subscriptions at once on start: 50
/// accounts and the slot, asked for together on the library's one socket,
/// through `stakegate init`'s gateway. Every one is answered and notified
/// (the gateway's example policies let one client open them together), and
/// all are closed again.
#[test]
fn many_subscriptions_opened_at_once_on_one_socket_are_each_notified() {
    let node = RpcNode::start(&NODE_ARGS).unwrap();
    let (envoy, _dir) = gateway(&node);
    let public = envoy.listener("public").unwrap();
    let (http, ws) = (format!("http://{public}"), format!("ws://{public}"));
    for library in ["kit", "web3js"] {
        let got = script(library, &["many", &http, &ws, "50"]);
        assert_eq!(
            got,
            json!({
                "subscriptions": 51,
                "slotNotified": 1,
                "accountsNotified": 50,
                "accountSlots": got["accountSlots"],
            }),
            "{library}"
        );
        // Notified from the slots the node executed, a few at most.
        let slots = got["accountSlots"].as_u64().unwrap();
        assert!((1..=50).contains(&slots), "{library}: {got}");
    }
}
