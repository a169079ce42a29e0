//! Solana through the whole gateway: rpc-node speaking Solana (`--chain
//! solana`: slots at three commitment levels, the methods providers see
//! most, PubSub), `stakegate init`'s gateway in front of it, and the real
//! client libraries (@solana/kit, @solana/web3.js 1.x, solana-py; pinned in
//! clients/) doing a dapp's everyday calls over HTTP and PubSub, through
//! the gateway and straight at the node.

use serde_json::{json, Value};
use stakegate_stack::{paths, Envoy, RpcNode};
use stakegate_tests::{example_policy, start_initialised};
use std::process::Command;

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

/// `library`'s calls against one endpoint (clients/solana.mjs or
/// clients/solana_ops.py), as the JSON it printed.
fn calls(library: &str, http: &str, ws: &str) -> Value {
    let dir = paths::clients_dir().unwrap();
    let mut command = if library == "solana-py" {
        let mut c = Command::new(paths::project_root().join(".venv/bin/python"));
        c.arg(dir.join("solana_ops.py"));
        c
    } else {
        let mut c = Command::new("node");
        c.arg(dir.join("solana.mjs")).arg(library);
        c
    };
    let output = command.args([http, ws]).output().unwrap();
    assert!(
        output.status.success(),
        "{library} at {http}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// What moves with the slot between two runs (slots, blockhashes and what
/// is derived from them): dropped, so that the rest compares exactly.
const MOVING: [&str; 14] = [
    "slot",
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
    for library in ["kit", "web3js", "solana-py"] {
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
    }
    // The node saw the calls that came through the gateway.
    assert!(
        envoy
            .stat("wasmcustom.stakegate.gate.admitted.default")
            .unwrap()
            > 0
    );
}
