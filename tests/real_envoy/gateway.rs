//! The whole gateway (`envoy-config/gateway.yaml`): stake QoS, then the
//! admission gate with dedup, then the router, in one real Envoy.

use serde_json::json;
use stakegate_loadgen::ClientSpec;
use stakegate_stack::{http, loadgen, paths, Envoy, EnvoyBuilder, RpcNode};
use stakegate_tests::{
    assert_refused_call_by_call, client, eventually, example_policy, gate_filter,
    gateway_on_one_worker, load_h2, node_behind_filters, qos_filter, stakegate_init,
    start_initialised, websocket, SETTLE,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ANSWER: &str = r#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#;

fn stat(envoy: &Envoy, name: &str) -> i64 {
    envoy
        .stat(&format!("wasmcustom.stakegate.{name}"))
        .unwrap_or(0)
}

/// A node that speaks HTTP/1.1 only, as some do: it answers every request
/// with `ANSWER`, anything else with 505 and a closed connection, and keeps
/// every request's head (lowercased) for the test to read.
fn http_1_1_only_node() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let kept = heads.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let kept = kept.clone();
            std::thread::spawn(move || serve_http_1_1(stream, &kept));
        }
    });
    (addr, heads)
}

fn serve_http_1_1(stream: TcpStream, heads: &Mutex<Vec<String>>) {
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            head.push_str(&line.to_ascii_lowercase());
        }
        if !head.lines().next().unwrap_or("").ends_with("http/1.1") {
            let _ = writer.write_all(b"HTTP/1.1 505 HTTP Version Not Supported\r\n\r\n");
            return;
        }
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        heads.lock().unwrap().push(head);
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
            ANSWER.len()
        );
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

#[test]
fn the_gateway_reaches_an_http_1_1_node_without_the_clients_key_or_a_claimed_class() {
    let (node, heads) = http_1_1_only_node();
    let envoy = EnvoyBuilder::new("gateway.yaml")
        .filter(qos_filter(&example_policy("stake-qos", json!({}))))
        .filter(gate_filter(&example_policy("admission-gate", json!({}))))
        .var("RPC_NODE_HOST", node.ip())
        .var("RPC_NODE_PORT", node.port())
        .start()
        .unwrap();
    let answer = http::post(
        &envoy.url("public").unwrap(),
        &[
            ("x-api-key", "key-stake-10"),
            ("x-stakegate-class", "priority"),
        ],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#,
    )
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        answer.json().unwrap(),
        json!({"jsonrpc":"2.0","id":1,"result":"0x1"})
    );
    // QoS knew the client by its key, and a staker is in the shipped policy's priority
    // class by QoS's word.
    assert!(eventually(SETTLE, || {
        stat(&envoy, "qos.admitted.bronze") == 1 && stat(&envoy, "gate.admitted.priority") == 1
    }));
    // A public caller claiming the class by header is a default request.
    let claimed = http::post(
        &envoy.url("public").unwrap(),
        &[("x-stakegate-class", "priority")],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#,
    )
    .unwrap();
    assert_eq!(claimed.status, 200, "{}", claimed.body);
    assert!(eventually(SETTLE, || {
        stat(&envoy, "gate.admitted.default") == 1
    }));
    assert_eq!(stat(&envoy, "gate.admitted.priority"), 1);
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2, "{heads:?}");
    for head in &heads {
        assert!(
            !head.contains("x-api-key"),
            "the key reached the node: {head}"
        );
        assert!(!head.contains("x-stakegate-class"), "{head}");
    }
}

/// One JSON-RPC call on `socket`, and its answer's `result`.
fn call(socket: &mut tungstenite::WebSocket<TcpStream>, id: u32) -> serde_json::Value {
    socket
        .send(tungstenite::Message::text(format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_blockNumber"}}"#
        )))
        .unwrap();
    loop {
        if let tungstenite::Message::Text(text) = socket.read().unwrap() {
            let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
            if answer["id"] == id {
                return answer["result"].clone();
            }
        }
    }
}

#[test]
fn a_throttled_batch_is_answered_call_by_call() {
    let (_node, envoy) = node_behind_filters(
        "gateway.yaml",
        vec![
            qos_filter(&example_policy("stake-qos", json!({ "capacityRps": 10 }))),
            gate_filter(&example_policy("admission-gate", json!({}))),
        ],
        &[],
    );
    let url = envoy.url("public").unwrap();
    let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"eth_chainId"},{"jsonrpc":"2.0","method":"eth_chainId"},{"jsonrpc":"2.0","id":"x","method":"eth_blockNumber"}]"#;
    // One client, one batch after another, far over 10 calls a second:
    // QoS starts throttling within a few refill rounds.
    let throttled = (0..500)
        .map(|_| http::post(&url, &[], batch).unwrap())
        .find(|answer| answer.status != 200)
        .expect("QoS throttled the client");
    // The notification gets no answer; the calls get theirs, by id.
    assert_refused_call_by_call(&throttled, 429, &[json!(1), json!("x")]);
    assert!(throttled.header("retry-after").is_some());
}

/// A WebSocket upgrade through `addr`: the socket, or the status it was
/// refused with.
fn try_websocket(addr: SocketAddr) -> Result<tungstenite::WebSocket<TcpStream>, u16> {
    let stream = TcpStream::connect(addr).unwrap();
    match tungstenite::client(format!("ws://{addr}/"), stream) {
        Ok((socket, _)) => Ok(socket),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response))) => {
            Err(response.status().as_u16())
        }
        Err(e) => panic!("WebSocket upgrade through {addr}: {e}"),
    }
}

#[test]
fn an_identity_gets_its_websocket_allowance_and_a_429_beyond_it() {
    // One worker: the allowance is per identity on each worker.
    let (_node, envoy) = gateway_on_one_worker(
        &example_policy("stake-qos", json!({ "websocketsPerIdentity": 2 })),
        &example_policy("admission-gate", json!({})),
        &[],
    );
    let public = envoy.listener("public").unwrap();
    let mut first = try_websocket(public).expect("the first socket");
    let _second = try_websocket(public).expect("the second socket");
    assert_eq!(
        try_websocket(public).err(),
        Some(429),
        "the third is refused"
    );
    assert!(call(&mut first, 1).is_string(), "the open ones still serve");
    first.close(None).unwrap();
    drop(first);
    // Once Envoy has seen the first one close, its place is free again.
    let mut refused = 0;
    assert!(eventually(SETTLE, || {
        let again = try_websocket(public);
        refused += u64::from(again.is_err());
        again.is_ok()
    }));
    assert!(eventually(SETTLE, || stat(&envoy, "qos.websocket.refused")
        == 1 + refused as i64));
}

#[test]
fn under_a_flood_the_gateway_sheds_with_429_and_503_serves_internal_calls_and_keeps_websockets() {
    const IN_FLIGHT: u64 = 8;
    let (node, envoy) = node_behind_filters(
        "gateway.yaml",
        vec![
            qos_filter(&example_policy("stake-qos", json!({ "capacityRps": 200 }))),
            gate_filter(&example_policy(
                "admission-gate",
                json!({ "maxInflight": IN_FLIGHT, "reserved": 2, "dedup": {} }),
            )),
        ],
        &["--read-slots", "64", "--cost", "eth_call=40ms"],
    );
    let mut socket = websocket(envoy.listener("public").unwrap());
    assert!(
        call(&mut socket, 1).is_string(),
        "a WebSocket through QoS and the gate"
    );

    let internal_url = envoy.url("internal").unwrap();
    // Real traffic: every call its own params, so dedup passes them.
    let flood = |id: &str| ClientSpec {
        unique_params: true,
        ..client(id, 400.0, "eth_call", 100_000)
    };
    let clients = vec![
        ClientSpec {
            api_key: Some("key-stake-10".into()),
            ..flood("staked")
        },
        // Another address than the WebSocket's, so another identity.
        ClientSpec {
            source: Some("127.0.0.2".parse().unwrap()),
            ..flood("unstaked")
        },
        ClientSpec {
            targets: vec![internal_url],
            ..client("internal", 20.0, "eth_call", 4)
        },
    ];
    // `stakegate top --once` watches the first 3 s of the flood.
    let top = std::process::Command::new(paths::tool("stakegate").unwrap())
        .args([
            "top",
            "--once",
            "--interval",
            "2s",
            "--admin",
            envoy.admin_url(),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let report = loadgen::run(&load_h2(
        &envoy.url("public").unwrap(),
        clients,
        Duration::from_secs(4),
        2,
    ))
    .unwrap();
    let top = top.wait_with_output().unwrap();
    let top = String::from_utf8(top.stdout).unwrap();
    eprintln!("{top}");
    assert!(
        top.starts_with("qos   requests ") && top.contains("\ngate  in flight "),
        "{top}"
    );
    // Each flood by its identity, with its rate over those seconds and the
    // share QoS gives it (QoS throttles them).
    for identity in ["stake-10", "unstaked:127.0.0.2/32"] {
        let fields: Vec<&str> = top
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{identity} ")))
            .unwrap_or_else(|| panic!("no line for {identity}: {top}"))
            .split_whitespace()
            .collect();
        let number = |i: usize| fields[i].parse::<f64>();
        assert!(number(0).unwrap() > 0.0, "{identity} rate: {top}");
        assert!(number(2).is_ok(), "{identity} share: {top}");
    }
    for c in &report.clients {
        eprintln!("{}: sent {} {:?}", c.header.id, c.header.sent, c.status);
    }
    for id in ["staked", "unstaked"] {
        let c = report.client(id).unwrap();
        let answered = c.count("200") + c.count("429") + c.count("503");
        assert_eq!(
            answered, c.header.sent,
            "{id}: only 200, 429 or 503: {:?}",
            c.status
        );
    }
    assert!(eventually(SETTLE, || stat(
        &envoy,
        "qos.throttled.unstaked"
    ) > 0));
    assert!(
        report.count("503") > 0,
        "the gate shed what QoS let through"
    );
    let internal = report.client("internal").unwrap();
    assert_eq!(
        internal.count("200"),
        internal.header.sent,
        "{:?}",
        internal.status
    );

    let at_node = node.metrics().unwrap()["inflight_max"].as_u64().unwrap();
    assert!(
        at_node <= IN_FLIGHT + 4 + 1,
        "the gate's limit, internal calls and the socket: {at_node}"
    );
    assert!(
        call(&mut socket, 2).is_string(),
        "the WebSocket outlived the flood"
    );
    // QoS read both calls on the socket and charged them to its sender.
    assert!(eventually(SETTLE, || stat(&envoy, "qos.websocket.calls") == 2));

    // The usage ledger, as an operator reads it: the staked client by its
    // name, the unstaked flood by its address (QoS refused it), each with
    // its refusals by rule, the gate's 503s included.
    let stakegate_usage = |json: bool| {
        let out = std::process::Command::new(paths::tool("stakegate").unwrap())
            .args(["usage", "--admin", envoy.admin_url()])
            .args(json.then_some("--json"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let usage =
        || -> Vec<serde_json::Value> { serde_json::from_slice(&stakegate_usage(true)).unwrap() };
    let row =
        |rows: &[serde_json::Value], id: &str| rows.iter().find(|r| r["identity"] == id).cloned();
    let sent = |id: &str| report.client(id).unwrap().header.sent;
    let refusals = |id: &str, status: &str| report.client(id).unwrap().count(status);
    // Workers hand their ledger over every quarter second. Every request is in it: on its identity, or unidentified while QoS
    // only counted (far below its threshold, at the flood's start).
    let total = |rows: &[serde_json::Value]| -> u64 {
        rows.iter().map(|r| r["requests"].as_u64().unwrap()).sum()
    };
    // The two floods, the WebSocket's upgrade; internal calls skip QoS.
    let expected = sent("staked") + sent("unstaked") + 1;
    assert!(eventually(SETTLE, || total(&usage()) == expected));
    let rows = usage();
    let table = String::from_utf8(stakegate_usage(false)).unwrap();
    eprintln!("{table}");
    assert!(table.contains("stake-10") && table.contains("unstaked:127.0.0.2/32"));
    for (id, label) in [
        ("staked", "stake-10"),
        ("unstaked", "unstaked:127.0.0.2/32"),
    ] {
        let r = row(&rows, label).unwrap();
        let by = |rule: &str| r["refused"][rule].as_u64().unwrap_or(0);
        let count = |field: &str| r[field].as_u64().unwrap();
        // QoS refuses only what it identified; the rest (counted at the
        // start) went on, to the node or to the gate's 503.
        let unidentified = sent(id) - count("requests");
        assert!(unidentified < sent(id) / 10, "{label}: {r}");
        assert_eq!(
            by("stake-share") + by("concurrency"),
            refusals(id, "429"),
            "{label}: {r}"
        );
        let shed = refusals(id, "503");
        assert!(by("gate-inflight") <= shed && shed <= by("gate-inflight") + unidentified);
        let served = refusals(id, "200");
        assert!(count("admitted") <= served && served <= count("admitted") + unidentified);
    }
    // Both were limited to the share QoS gave them, the staked one's
    // far above the unstaked one's.
    let share = |label: &str| {
        let r = row(&rows, label).unwrap();
        assert_eq!(r["limited"], true, "{r}");
        r["shareRps"].as_f64().unwrap()
    };
    assert!(share("stake-10") > 10.0 * share("unstaked:127.0.0.2/32"));
    // At /stats/prometheus, one metric holds every identity, by label.
    let prometheus = http::get(&format!("{}/stats/prometheus", envoy.admin_url()))
        .unwrap()
        .body;
    let has = |metric: &str, labels: &[&str]| {
        prometheus.lines().any(|line| {
            line.starts_with(&format!("{metric}{{"))
                && labels.iter().all(|l| line.contains(l))
                && line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) > Some(0.0)
        })
    };
    let (desk, flood) = (
        r#"identity="stake-10""#,
        r#"identity="unstaked:127.0.0.2/32""#,
    );
    assert!(has("stakegate_qos_usage_requests", &[desk]), "{prometheus}");
    assert!(has(
        "stakegate_qos_usage_refused",
        &[desk, r#"rule="stake-share""#]
    ));
    assert!(has(
        "stakegate_qos_usage_refused",
        &[flood, r#"rule="gate-inflight""#]
    ));
    // A key never appears: the staked client is known by its name.
    let text = serde_json::to_string(&rows).unwrap();
    assert!(!text.contains("key-stake-10"));
}

#[test]
fn init_writes_a_gateway_that_envoy_starts_and_deploy_then_changes() {
    let node = RpcNode::start::<&str>(&[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = paths::project_root();
    let module = |name: &str| paths::wasm_module(name).unwrap();
    let stakegate = || std::process::Command::new(paths::tool("stakegate").unwrap());
    let (gate_policy, qos_policy) = (
        root.join("policies/admission-gate.example.json"),
        root.join("policies/stake-qos.example.json"),
    );
    let envoy = start_initialised(dir.path(), node.addr(), &gate_policy, &qos_policy);
    let answer = http::post(
        &envoy.url("public").unwrap(),
        &[("x-api-key", "key-stake-10")],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#,
    )
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    // QoS knew the client by its key, and the shipped gate policy puts stakers in its
    // priority class.
    assert!(eventually(SETTLE, || {
        stat(&envoy, "qos.admitted.bronze") == 1 && stat(&envoy, "gate.admitted.priority") == 1
    }));

    let policy = dir.path().join("gate.json");
    std::fs::write(&policy, r#"{"maxInflight": 4}"#).unwrap();
    let deployed = stakegate()
        .arg("deploy")
        .args(["--filter", "admission-gate", "--admin", envoy.admin_url()])
        .arg("--dir")
        .arg(dir.path())
        .arg("--module")
        .arg(module("admission_gate"))
        .arg("--policy")
        .arg(&policy)
        .output()
        .unwrap();
    assert!(
        deployed.status.success(),
        "{}",
        String::from_utf8_lossy(&deployed.stderr)
    );
    let history: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(".stakegate/history/admission-gate.json"))
            .unwrap(),
    )
    .unwrap();
    let deployments = history["deployments"].as_array().unwrap();
    assert_eq!(deployments.len(), 2, "init's config, then the deploy");
    assert_eq!(deployments[0]["startup"], true);
    assert_eq!(deployments[1]["policy"], r#"{"maxInflight": 4}"#);

    let again = stakegate_init(dir.path(), node.addr(), &gate_policy, &qos_policy);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already initialised"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}
