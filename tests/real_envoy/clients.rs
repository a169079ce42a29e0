//! Real client libraries (web3.py, viem, ethers; versions pinned in
//! clients/) through the whole gateway in front of a real node (anvil):
//! every everyday operation, over HTTP and WebSocket, gives what it gives
//! straight at the node.

use serde_json::{json, Value};
use stakegate_stack::{paths, Anvil, Envoy, EnvoyBuilder};
use stakegate_tests::{example_policy, gate_filter, qos_filter};
use std::process::Command;

/// The gateway (`gateway.yaml`, both policies) in front of `anvil`.
fn gateway(anvil: &Anvil) -> Envoy {
    EnvoyBuilder::new("gateway.yaml")
        .filter(qos_filter(&example_policy("stake-qos", json!({}))))
        .filter(gate_filter(&example_policy(
            "admission-gate",
            json!({ "dedup": {} }),
        )))
        .var("RPC_NODE_HOST", anvil.addr().ip())
        .var("RPC_NODE_PORT", anvil.addr().port())
        .start()
        .unwrap()
}

/// The command that runs `library`'s operations (clients/ops.*) against an
/// HTTP and a WebSocket URL.
fn library(name: &str, http: &str, ws: &str) -> Command {
    let dir = paths::clients_dir().unwrap();
    let mut command = if name == "web3.py" {
        let mut c = Command::new(paths::project_root().join(".venv/bin/python"));
        c.arg(dir.join("ops.py"));
        c
    } else {
        let mut c = Command::new("node");
        c.arg(dir.join("ops.mjs")).arg(name);
        c
    };
    command.args([http, ws]);
    command
}

/// `library`'s operations against one endpoint, from one chain state:
/// anvil is snapshotted before and reverted after, so runs compare.
fn operations(anvil: &Anvil, name: &str, http: &str, ws: &str) -> Value {
    let snapshot = anvil.call("evm_snapshot", "[]").unwrap();
    let output = library(name, http, ws).output().unwrap();
    assert!(
        anvil
            .call("evm_revert", &format!("[{snapshot}]"))
            .unwrap()
            .as_bool()
            .unwrap(),
        "anvil reverted to its snapshot"
    );
    assert!(
        output.status.success(),
        "{name} at {http}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn web3py_viem_and_ethers_get_through_the_gateway_what_they_get_from_the_node() {
    let anvil = Anvil::start().unwrap();
    let envoy = gateway(&anvil);
    let node = anvil.addr();
    let public = envoy.listener("public").unwrap();
    for name in ["web3.py", "viem", "ethers"] {
        let direct = operations(
            &anvil,
            name,
            &format!("http://{node}"),
            &format!("ws://{node}"),
        );
        let through = operations(
            &anvil,
            name,
            &format!("http://{public}"),
            &format!("ws://{public}"),
        );
        eprintln!("{name}: {through}");
        assert_eq!(
            through, direct,
            "{name}: through the gateway, then straight"
        );
        // What each run did, so an empty answer cannot pass.
        assert_eq!(direct["chainId"], 31337, "{name}");
        assert_eq!(direct["call"], "0x1234", "{name}");
        assert_eq!(direct["transaction"]["status"], "success", "{name}");
        assert_eq!(direct["ws"]["newHead"], true, "{name}");
    }
}
