//! The harness and the plain gateway: JSON-RPC through a real Envoy to
//! rpc-node and back.

use serde_json::json;
use stakegate_stack::{envoy, http, EnvoyBuilder, FilterConfig};
use stakegate_tests::{
    example_policy, gate_filter, node_behind_envoy, node_behind_filters, qos_filter, websocket,
};
use std::io::{Read, Write};

#[test]
fn json_rpc_round_trips_through_envoy() {
    let (node, envoy) = node_behind_envoy("passthrough.yaml", &["--read-slots", "8"]);
    let url = envoy.url("public").unwrap();

    let single = http::post(
        &url,
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#,
    )
    .unwrap();
    assert_eq!(single.status, 200);
    assert_eq!(
        single.json().unwrap(),
        json!({"jsonrpc":"2.0","id":1,"result":"0x1"})
    );

    let batch = http::post(
        &url,
        &[],
        r#"[{"jsonrpc":"2.0","id":"a","method":"eth_call","params":[{"to":"0x01"},"latest"]},
            {"jsonrpc":"2.0","id":"b","method":"eth_mine"},
            {"jsonrpc":"2.0","id":"c","method":"eth_getBlockByNumber","params":["latest",false]}]"#,
    )
    .unwrap();
    assert_eq!(batch.status, 200);
    let batch = batch.json().unwrap();
    let entries = batch.as_array().expect("a batch answer is an array");
    assert_eq!(entries.len(), 3);
    assert_eq!(entries[0]["id"], "a");
    assert!(entries[0]["result"].is_string());
    assert_eq!(entries[1]["error"]["code"], -32601);
    assert_eq!(entries[2]["id"], "c");
    assert!(entries[2]["result"]["hash"].is_string());

    let malformed = http::post(&url, &[], "{\"jsonrpc\": ").unwrap();
    assert_eq!(malformed.status, 200);
    assert_eq!(malformed.json().unwrap()["error"]["code"], -32700);

    let metrics = node.metrics().unwrap();
    assert_eq!(metrics["served"]["eth_chainId"], 1);
    assert_eq!(metrics["served"]["eth_call"], 1);
    assert_eq!(metrics["served"]["eth_getBlockByNumber"], 1);
    assert_eq!(metrics["inflight"], 0);

    let stats = envoy.stats().unwrap();
    assert_eq!(stats["cluster.rpc_node.upstream_rq_200"], 3);
    assert_eq!(envoy.stat("http.public.downstream_rq_2xx").unwrap(), 3);
}

#[test]
fn the_shipped_configs_validate() {
    let passthrough = EnvoyBuilder::new("passthrough.yaml")
        .var("RPC_NODE_HOST", "127.0.0.1")
        .var("RPC_NODE_PORT", 8545);
    envoy::validate(&passthrough).unwrap_or_else(|e| panic!("passthrough.yaml: {e:#}"));
    let direct = envoy::direct_response(&[("a", ""), ("b", "")], envoy::Answer::Upstream).unwrap();
    envoy::validate(&direct).unwrap_or_else(|e| panic!("bench/direct.yaml: {e:#}"));
}

#[test]
fn a_broken_config_fails_with_envoys_reason() {
    let dir = tempfile_dir();
    let broken = dir.join("broken.yaml");
    std::fs::write(
        &broken,
        "static_resources: { listeners: [ { name: x, nonsense_field: 1 } ] }\n",
    )
    .unwrap();
    let err = EnvoyBuilder::new(&broken).start().unwrap_err().to_string();
    assert!(err.contains("Envoy exited"), "{err}");
    assert!(
        err.contains("nonsense_field"),
        "Envoy's reason is shown: {err}"
    );
    let err = envoy::validate(&EnvoyBuilder::new(&broken))
        .unwrap_err()
        .to_string();
    assert!(err.contains("nonsense_field"), "{err}");
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("stakegate-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every shipped Envoy config, with its filters serving these policies.
fn every_shipped_config(gate: &str, qos: &str) -> [(&'static str, Vec<FilterConfig>); 4] {
    [
        ("passthrough.yaml", vec![]),
        ("gate.yaml", vec![gate_filter(gate)]),
        ("qos.yaml", vec![qos_filter(qos)]),
        ("gateway.yaml", vec![qos_filter(qos), gate_filter(gate)]),
    ]
}

#[test]
fn an_http_1_0_client_is_answered_by_every_shipped_config() {
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#;
    for (template, filters) in
        every_shipped_config(r#"{"maxInflight": 8}"#, r#"{"capacityRps": 100}"#)
    {
        let (_node, envoy) = node_behind_filters(template, filters, &[]);
        // No Host header, as HTTP/1.0 allows; the connection closes after.
        let mut stream = std::net::TcpStream::connect(envoy.listener("public").unwrap()).unwrap();
        write!(
            stream,
            "POST / HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert!(
            answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
            "{template}: {answer}"
        );
        let (_, reply) = answer.split_once("\r\n\r\n").unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(reply).unwrap(),
            json!({"jsonrpc":"2.0","id":1,"result":"0x1"}),
            "{template}"
        );
    }
}

/// Every shipped config with the example policies, on the traffic of an
/// ordinary day: single calls, a batch, a large body (which reaches the
/// internal listener's gate in pieces: it has no buffer filter), a staked
/// caller and a WebSocket call. Nothing Envoy logs is a warning or worse: a
/// warning must mean a real problem.
#[test]
fn no_shipped_config_logs_a_warning_on_ordinary_traffic() {
    let single = r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#;
    let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"eth_chainId"},{"jsonrpc":"2.0","id":2,"method":"eth_blockNumber"}]"#;
    let large = format!(
        r#"{{"jsonrpc":"2.0","id":3,"method":"eth_call","params":[{{"to":"0x0000000000000000000000000000000000000001","data":"0x{}"}},"latest"]}}"#,
        "ab".repeat(200_000)
    );
    let (gate, qos) = (
        example_policy("admission-gate", json!({})),
        example_policy("stake-qos", json!({})),
    );
    for (template, filters) in every_shipped_config(&gate, &qos) {
        let (_node, envoy) = node_behind_filters(template, filters, &[]);
        let mut urls = vec![envoy.url("public").unwrap()];
        urls.extend(envoy.url("internal").ok());
        for url in &urls {
            for body in [single, batch, large.as_str()] {
                for key in [None, Some("key-stake-10")] {
                    let headers: Vec<(&str, &str)> =
                        key.map(|k| ("x-api-key", k)).into_iter().collect();
                    let answer = http::post(url, &headers, body).unwrap();
                    assert_eq!(answer.status, 200, "{template} {url}: {}", answer.body);
                }
            }
        }
        // The configs with the gate take WebSockets.
        if template.starts_with("gate") {
            let mut socket = websocket(envoy.listener("public").unwrap());
            socket
                .send(tungstenite::Message::text(single.to_string()))
                .unwrap();
            let reply = socket.read().unwrap();
            assert!(
                reply.to_text().unwrap().contains(r#""result""#),
                "{template}: {reply}"
            );
        }
        let log = envoy.log();
        let alarms: Vec<&str> = log
            .lines()
            .filter(|l| {
                ["][warning][", "][error][", "][critical]["]
                    .iter()
                    .any(|level| l.contains(level))
            })
            .collect();
        assert!(alarms.is_empty(), "{template}: {alarms:#?}");
    }
}
