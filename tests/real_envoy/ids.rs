//! Every client gets its own `id` back, byte for byte, as it wrote it,
//! through the gateway `stakegate init` writes (the example policies: the
//! cache and coalescing on): from the cache, from coalescing (a client's
//! own duplicates, and anyone's same transaction), and on WebSockets,
//! where rpc-node (a serde node) would write `1e0` back as `1.0`. A first
//! asker whose id is `null` poisons no one's answer.

use serde_json::json;
use stakegate_core::jsonrpc::{Name, Summary};
use stakegate_stack::{http, Envoy, RpcNode};
use stakegate_tests::{eventually, websocket};
use std::time::Duration;

const STAT: &str = "wasmcustom.stakegate.gate.";
const TX: &str = "0x02f8b20181948449bdee618501dcd6500083016b93942dabcea55a12d73191aece59f508b191fb68adac80b844095ea7b3";

/// Id spellings a client may write: `null`, numbers a serde node
/// re-spells (`1e0`, `-0`, `-7.5E-1`, 30 digits), plain numbers and
/// strings, strings with escapes. `n` of them, in a fixed order.
fn id_spellings(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| match i % 8 {
            0 => "null".to_string(),
            1 => format!("{i}e0"),
            2 => "-0".to_string(),
            3 => format!("-{i}.5E-1"),
            4 => format!("12345678901234567890123456789{}", i % 10),
            5 => format!(r#""\u0041{i}\"\n""#),
            6 => format!(r#""c-{i}""#),
            _ => i.to_string(),
        })
        .collect()
}

/// The raw text of each id in an answer (one per batch entry).
fn raw_ids(body: &str) -> Vec<String> {
    let summary = Summary::of(body.as_bytes());
    summary
        .entries
        .iter()
        .filter_map(|e| e.last(Name::Id))
        .map(|m| body[m.value.clone()].to_string())
        .collect()
}

fn call(id: &str, method: &str, params: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#)
}

/// The gateway `stakegate init` writes with the example policies (QoS far
/// from throttling), in front of `node`.
fn gateway(node: &RpcNode, dir: &std::path::Path) -> Envoy {
    let (gate_policy, qos_policy) = (dir.join("gate.json"), dir.join("qos.json"));
    let gate = stakegate_tests::example_policy("admission-gate", json!({}));
    let qos = stakegate_tests::example_policy("stake-qos", json!({ "capacityRps": 1_000_000 }));
    std::fs::write(&gate_policy, gate).unwrap();
    std::fs::write(&qos_policy, qos).unwrap();
    stakegate_tests::start_initialised(dir, node.addr(), &gate_policy, &qos_policy)
}

/// Each of `ids` asks `body_of(id)` at once; every answer must carry its
/// asker's id as written.
fn at_once(url: &str, ids: &[String], body_of: impl Fn(&str) -> String) {
    let asks: Vec<_> = ids
        .iter()
        .map(|id| {
            let (url, body, id) = (url.to_string(), body_of(id), id.clone());
            std::thread::spawn(move || (id, http::post(&url, &[], &body).unwrap()))
        })
        .collect();
    for ask in asks {
        let (id, answer) = ask.join().unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(raw_ids(&answer.body), [id], "{}", answer.body);
    }
}

#[test]
fn every_client_gets_its_own_id_back_byte_for_byte() {
    let node = RpcNode::start(&[
        "--cost",
        "eth_sendRawTransaction=300ms",
        "--cost",
        "eth_getLogs=300ms",
    ])
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let envoy = gateway(&node, dir.path());
    let url = envoy.url("public").unwrap();
    let stat = |name: &str| envoy.stat(&format!("{STAT}{name}")).unwrap_or(0);
    let ids = id_spellings(40);

    // The cache: `null` askers first, then every spelling, twice over.
    let mut hits = 0;
    for method in ["eth_chainId", "net_version"] {
        for id in ["null"; 6]
            .iter()
            .map(|s| s.to_string())
            .chain(ids.clone())
            .chain(ids.clone())
        {
            let answer = http::post(&url, &[], &call(&id, method, "[]")).unwrap();
            assert_eq!(
                raw_ids(&answer.body),
                [id.clone()],
                "{method}: {}",
                answer.body
            );
            hits += usize::from(answer.header("x-stakegate-cache") == Some("hit"));
        }
    }
    assert!(hits >= 100, "the cache answered {hits} of 184");

    // Coalescing: dedup engages once a request has stayed at the node.
    let slow = call("1", "eth_getLogs", r#"[{"fromBlock":"0x0"}]"#);
    assert_eq!(http::post(&url, &[], &slow).unwrap().status, 200);
    assert!(eventually(Duration::from_secs(10), || stat(
        "dedup.engaged"
    ) == 1));
    for round in 0..3 {
        // Anyone's same transaction (global scope), a `null` among them.
        at_once(&url, &ids[..12], |id| {
            call(
                id,
                "eth_sendRawTransaction",
                &format!(r#"["{TX}{round:02x}"]"#),
            )
        });
        // One client's own duplicates (client scope).
        at_once(&url, &ids[12..24], |id| {
            call(
                id,
                "eth_getLogs",
                &format!(r#"[{{"fromBlock":"0x{round}"}}]"#),
            )
        });
    }
    assert!(
        eventually(Duration::from_secs(5), || stat("dedup.shared") >= 30),
        "coalesced answers: {}",
        stat("dedup.shared")
    );

    // A WebSocket: one at a time, then all at once (packed into batches).
    let mut socket = websocket(envoy.listener("public").unwrap());
    for id in &ids {
        socket.send(call(id, "eth_chainId", "[]").into()).unwrap();
        let answer = socket.read().unwrap().into_text().unwrap();
        assert_eq!(raw_ids(&answer), [id.clone()], "{answer}");
    }
    for id in &ids {
        let text = call(id, "eth_getLogs", "[{}]");
        socket.send(text.into()).unwrap();
    }
    let mut got: Vec<String> = (0..ids.len())
        .flat_map(|_| raw_ids(&socket.read().unwrap().into_text().unwrap()))
        .collect();
    let mut want = ids.clone();
    got.sort();
    want.sort();
    assert_eq!(got, want);
}
