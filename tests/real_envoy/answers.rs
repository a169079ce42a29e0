//! Answers the gateway shares (the cache's, coalescing's) reach only the
//! clients they belong to, through the gateway `stakegate init` writes
//! (the example policies: the cache and coalescing on):
//! - every client gets its own `id` back, byte for byte, as it wrote it:
//!   from the cache, from coalescing (a client's own duplicates, and
//!   anyone's same transaction), and on WebSockets, where rpc-node (a serde
//!   node) would write `1e0` back as `1.0`; a first asker whose id is
//!   `null` poisons no one's answer;
//! - a second route on the listener, to another chain's node, gets only
//!   its own chain's answers.

use serde_json::json;
use stakegate_core::jsonrpc::{same_id, Name, Summary};
use stakegate_stack::{http, Envoy, RpcNode};
use stakegate_tests::{eventually, websocket, SETTLE};

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

    // The cache: `null` askers first, then every spelling, twice over. A
    // miss is the node's own answer (rpc-node re-spells `1e0` as `1.0`):
    // the same id, by value; a hit is the asker's id as written.
    let mut hits = 0;
    for method in ["eth_chainId", "net_version"] {
        for id in ["null"; 6]
            .iter()
            .map(|s| s.to_string())
            .chain(ids.clone())
            .chain(ids.clone())
        {
            let answer = http::post(&url, &[], &call(&id, method, "[]")).unwrap();
            let got = raw_ids(&answer.body);
            if answer.header("x-stakegate-cache") == Some("hit") {
                hits += 1;
                assert_eq!(got, std::slice::from_ref(&id), "{method}: {}", answer.body);
            } else {
                assert!(
                    same_id(got[0].as_bytes(), id.as_bytes()),
                    "{method}: {}",
                    answer.body
                );
            }
        }
    }
    assert!(hits >= 100, "the cache answered {hits} of 184");

    // Coalescing: dedup engages once a request has stayed at the node.
    let slow = call("1", "eth_getLogs", r#"[{"fromBlock":"0x0"}]"#);
    assert_eq!(http::post(&url, &[], &slow).unwrap().status, 200);
    assert!(eventually(SETTLE, || stat("dedup.engaged") == 1));
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
        eventually(SETTLE, || stat("dedup.shared") >= 30),
        "coalesced answers: {}",
        stat("dedup.shared")
    );

    // A WebSocket: one at a time, then all at once (packed into batches).
    let mut socket = websocket(envoy.listener("public").unwrap());
    for id in &ids {
        socket.send(call(id, "eth_chainId", "[]").into()).unwrap();
        let answer = socket.read().unwrap().into_text().unwrap();
        assert_eq!(raw_ids(&answer), std::slice::from_ref(id), "{answer}");
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

/// init's config with a second route, `/base`, to `base`'s node: another
/// chain behind the same listener.
fn with_second_route(dir: &std::path::Path, base: &RpcNode) {
    let path = dir.join("envoy.yaml");
    let config = std::fs::read_to_string(&path).unwrap();
    let route = "              - match: { prefix: \"/\" }\n                route: { cluster: rpc_node, timeout: 60s }\n";
    assert!(config.contains(route), "init's public route changed");
    let config = config.replacen(
        route,
        &format!("              - match: {{ prefix: \"/base\" }}\n                route: {{ cluster: base_node, prefix_rewrite: \"/\", timeout: 60s }}\n{route}"),
        1,
    );
    let config = config.replace(
        "  clusters:\n",
        &format!(
            "  clusters:\n  - name: base_node\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment:\n      cluster_name: base_node\n      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }} }}] }}]\n",
            base.addr().port()
        ),
    );
    std::fs::write(&path, config).unwrap();
}

/// Two chains behind one listener (init's route, and `/base` to a node of
/// chain 8453): each chain's clients get its own chain's answers, from the
/// cache or not, and no read of one reaches the other's node by a
/// coalescing callout (the second route passes the cache and coalescing
/// by: they front `dedup.upstream.cluster`).
#[test]
fn a_second_route_on_the_listener_gets_only_its_own_chains_answers() {
    let slow = [
        "--cost",
        "eth_getLogs=300ms",
        "--cost",
        "eth_getProof=300ms",
    ];
    let eth = RpcNode::start(&slow).unwrap();
    let base = RpcNode::start(&[&slow[..], &["--chain-id", "8453"]].concat()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gate_policy, qos_policy) = (dir.path().join("gate.json"), dir.path().join("qos.json"));
    let gate = stakegate_tests::example_policy("admission-gate", json!({}));
    let qos = stakegate_tests::example_policy("stake-qos", json!({ "capacityRps": 1_000_000 }));
    std::fs::write(&gate_policy, gate).unwrap();
    std::fs::write(&qos_policy, qos).unwrap();
    let init = stakegate_tests::stakegate_init(dir.path(), eth.addr(), &gate_policy, &qos_policy);
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    with_second_route(dir.path(), &base);
    let envoy = stakegate_stack::EnvoyBuilder::new(dir.path().join("envoy.yaml"))
        .start()
        .unwrap();
    let url = envoy.url("public").unwrap();
    let base_url = format!("{}/base", url.trim_end_matches('/'));
    let stat = |name: &str| envoy.stat(&format!("{STAT}{name}")).unwrap_or(0);

    // Each asks in turn, again and again: the cache keeps each chain's own.
    for i in 0..20 {
        for (url, chain_id, version) in [(&url, "0x1", "1"), (&base_url, "0x2105", "8453")] {
            let chain = http::post(url, &[], &call(&i.to_string(), "eth_chainId", "[]")).unwrap();
            assert_eq!(chain.status, 200, "{url}: {chain:?}");
            assert_eq!(
                chain.json().unwrap()["result"],
                chain_id,
                "{url}: {}",
                chain.body
            );
            let net = http::post(url, &[], &call(&i.to_string(), "net_version", "[]")).unwrap();
            assert_eq!(
                net.json().unwrap()["result"],
                version,
                "{url}: {}",
                net.body
            );
        }
    }
    assert!(eventually(SETTLE, || stat("cache.hits") >= 20));

    // Coalescing engaged by a slow call on the first chain; the second
    // chain's identical reads at once still reach the second node only.
    let proof = call("1", "eth_getProof", r#"["0x01",[],"latest"]"#);
    assert_eq!(http::post(&url, &[], &proof).unwrap().status, 200);
    assert!(eventually(SETTLE, || stat("dedup.engaged") == 1));
    // Before, each of these led its key by a callout to the first
    // chain's node (the one `dedup.upstream` names).
    for i in 0..6 {
        let logs = call(&i.to_string(), "eth_getLogs", r#"[{"fromBlock":"0x0"}]"#);
        let answer = http::post(&base_url, &[], &logs).unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.json().unwrap()["result"], json!([]));
    }
    let served = |node: &RpcNode| {
        node.metrics().unwrap()["served"]["eth_getLogs"]
            .as_u64()
            .unwrap_or(0)
    };
    assert_eq!(
        served(&eth),
        0,
        "the first chain's node ran the second's reads"
    );
    assert_eq!(served(&base), 6);
    assert!(eventually(SETTLE, || stat("dedup.other_cluster") >= 12));
}
