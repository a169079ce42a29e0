//! The admission gate in a real Envoy at `--concurrency 2`: exactness, no
//! leaks, internal traffic, WebSockets, the rejection shape, and policy
//! errors.

use stakegate_loadgen::{ClientSpec, Report};
use stakegate_stack::ecds::EcdsUpdate;
use stakegate_stack::envoy;
use stakegate_stack::{http, loadgen, Envoy, EnvoyBuilder, FilterConfig};
use stakegate_tests::{client, eventually, gate_filter, load, node_behind_gate, SETTLE};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const STAT: &str = "wasmcustom.stakegate.gate.";
const CHAIN_ID: &str = r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#;
const SLOW: &str = r#"{"jsonrpc":"2.0","id":2,"method":"slow_call"}"#;
const INTERNAL_BY_LISTENER: &str = r#"{"listenerMetadata": "internal"}"#;

fn stat(envoy: &Envoy, name: &str) -> i64 {
    envoy.stat(&format!("{STAT}{name}")).unwrap()
}

/// The gate flushes its stats once per heartbeat (1 s by default), so a
/// count is checked by waiting for it to arrive.
fn stat_reaches(envoy: &Envoy, name: &str, expected: i64) -> bool {
    let reached = eventually(SETTLE, || stat(envoy, name) == expected);
    if !reached {
        eprintln!("{STAT}{name} is {}, expected {expected}", stat(envoy, name));
    }
    reached
}

pub(crate) fn settles_to_zero(envoy: &Envoy) -> bool {
    eventually(SETTLE, || {
        [
            "inflight.default",
            "inflight.priority",
            "inflight.internal",
            "websocket.active",
        ]
        .iter()
        .all(|gauge| stat(envoy, gauge) == 0)
    })
}

/// Sends `SLOW` on a thread; it holds a slot until the node answers.
fn hold_a_slot(url: String) -> std::thread::JoinHandle<u16> {
    std::thread::spawn(move || http::post(&url, &[], SLOW).unwrap().status)
}

#[test]
fn the_gate_config_validates() {
    let example = stakegate_tests::example_policy("admission-gate", serde_json::json!({}));
    let builder = EnvoyBuilder::new("gate.yaml")
        .var("RPC_NODE_HOST", "127.0.0.1")
        .var("RPC_NODE_PORT", 8545)
        .filter(gate_filter(&example));
    envoy::validate(&builder).unwrap();
}

#[test]
fn admitted_inflight_never_exceeds_the_limit_under_a_concurrent_burst() {
    // Plenty of node slots, so the gate is the only limit; 50 ms calls overlap.
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 8}"#,
        &["--read-slots", "256", "--cost", "eth_call=50ms"],
    );
    let burst = client("burst", 2000.0, "eth_call", 100_000);
    let report = loadgen::run(&load(
        &envoy.url("public").unwrap(),
        burst,
        Duration::from_secs(3),
        true,
    ))
    .unwrap();
    let metrics = node.metrics().unwrap();
    eprintln!("node: {metrics}\nstatus: {:?}", report.status);

    assert_eq!(
        metrics["inflight_max"], 8,
        "the node saw at most, and at some point exactly, the limit"
    );
    let (admitted, rejected) = (report.count("200"), report.count("503"));
    assert_eq!(
        admitted + rejected,
        6000,
        "every request was answered: {:?}",
        report.status
    );
    assert!(
        admitted > 100 && rejected > 3000,
        "{admitted} admitted, {rejected} rejected"
    );
    assert!(stat_reaches(&envoy, "admitted.default", admitted as i64));
    assert!(stat_reaches(&envoy, "rejected.default", rejected as i64));
    assert!(settles_to_zero(&envoy));
}

#[test]
fn a_rejection_is_a_fast_503_with_retry_after_and_a_json_rpc_error() {
    let (_node, envoy) = node_behind_gate(r#"{"maxInflight": 1}"#, &["--cost", "slow_call=2s"]);
    let url = envoy.url("public").unwrap();
    let held = hold_a_slot(url.clone());
    assert!(eventually(SETTLE, || stat(&envoy, "inflight.default") == 1));

    let rejected = http::post(&url, &[], CHAIN_ID).unwrap();
    assert_eq!(rejected.status, 503);
    assert_eq!(rejected.header("content-type"), Some("application/json"));
    let retry_after: u32 = rejected.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry_after), "retry-after {retry_after}");
    let body = rejected.json().unwrap();
    assert_eq!(body["jsonrpc"], "2.0");
    assert_eq!(body["id"], serde_json::Value::Null);
    assert_eq!(body["error"]["code"], -32005);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("in-flight request limit"));
    // It says which limit refused, and how full it was.
    let data = &body["error"]["data"];
    assert_eq!(data["rule"], "gate-inflight");
    assert_eq!(data["retryAfter"], retry_after);
    assert_eq!(
        (data["inFlight"].as_u64(), data["limit"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(rejected.header("x-stakegate-rule"), Some("gate-inflight"));
    assert_eq!(rejected.header("x-stakegate-limit"), Some("1"));

    assert_eq!(held.join().unwrap(), 200);
    assert!(settles_to_zero(&envoy));
    assert_eq!(
        http::post(&url, &[], CHAIN_ID).unwrap().status,
        200,
        "the slot came back"
    );
}

#[test]
fn internal_traffic_is_never_rejected_and_public_clients_cannot_pose_as_internal() {
    // Internal by listener, or by a header the public listener strips.
    let policy = format!(
        r#"{{"maxInflight": 4, "classes": {{"internal": [{INTERNAL_BY_LISTENER},
            {{"strippedHeader": {{"name": "x-stakegate-class", "value": "internal"}}}}]}}}}"#
    );
    let (node, envoy) =
        node_behind_gate(&policy, &["--read-slots", "8", "--cost", "eth_call=20ms"]);
    // The flood claims to be internal; the public listener must strip that.
    let flood = ClientSpec {
        api_key: Some("internal".into()),
        key_header: "x-stakegate-class".into(),
        ..client("flood", 2000.0, "eth_call", 100_000)
    };
    let flood_spec = load(
        &envoy.url("public").unwrap(),
        flood,
        Duration::from_secs(4),
        true,
    );
    let internal_spec = load(
        &envoy.url("internal").unwrap(),
        client("internal", 100.0, "eth_call", 1000),
        Duration::from_secs(4),
        false,
    );
    let flood = std::thread::spawn(move || loadgen::run(&flood_spec).unwrap());
    let internal: Report = loadgen::run(&internal_spec).unwrap();
    let flood: Report = flood.join().unwrap();
    eprintln!(
        "flood {:?}\ninternal {:?}\nnode {}",
        flood.status,
        internal.status,
        node.metrics().unwrap()
    );

    assert!(
        flood.count("503") > 4000,
        "the flood is shed: {:?}",
        flood.status
    );
    assert_eq!(
        internal.count("200"),
        400,
        "internal: {:?}",
        internal.status
    );
    assert!(stat_reaches(&envoy, "admitted.internal", 400));
    assert!(stat_reaches(
        &envoy,
        "rejected.default",
        flood.count("503") as i64
    ));
    assert_eq!(stat(&envoy, "rejected.internal"), 0);
    assert!(settles_to_zero(&envoy));
}

#[test]
fn no_slot_leaks_after_client_aborts_upstream_resets_and_local_replies() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 16}"#,
        &[
            "--read-slots",
            "64",
            "--cost",
            "eth_call=30ms",
            "--cost",
            "eth_getLogs=300ms",
        ],
    );
    let url = envoy.url("public").unwrap();
    // Clients that give up after 100 ms abort most eth_getLogs calls
    // mid-request, over HTTP/1.1 (connection closed) and HTTP/2 (stream reset).
    for http2 in [false, true] {
        let impatient = ClientSpec {
            mix: [
                ("eth_call".to_string(), 1.0),
                ("eth_getLogs".to_string(), 1.0),
            ]
            .into(),
            ..client("impatient", 300.0, "", 10_000)
        };
        let mut spec = load(&url, impatient, Duration::from_secs(2), http2);
        spec.timeout = Duration::from_millis(100);
        let report = loadgen::run(&spec).unwrap();
        eprintln!("http2={http2}: {:?}", report.status);
        assert!(
            report.count("timeout") > 50,
            "clients aborted: {:?}",
            report.status
        );
    }
    assert!(settles_to_zero(&envoy), "client aborts leaked slots");

    // The node dies under load: in-flight requests see upstream resets, and
    // later ones a local reply from the router (no upstream).
    let dying = load(
        &url,
        client("dying", 200.0, "eth_getLogs", 10_000),
        Duration::from_secs(2),
        false,
    );
    let run = std::thread::spawn(move || loadgen::run(&dying).unwrap());
    assert!(eventually(SETTLE, || stat(&envoy, "inflight.default") > 0));
    drop(node);
    let report = run.join().unwrap();
    eprintln!("node killed: {:?}", report.status);
    assert!(
        report.count("503") > 0,
        "the router answered for the dead node: {:?}",
        report.status
    );
    assert!(
        settles_to_zero(&envoy),
        "upstream resets or local replies leaked slots"
    );
}

/// Opens a WebSocket through Envoy; returns the stream and the status.
fn websocket(addr: std::net::SocketAddr) -> (TcpStream, u16) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET / HTTP/1.1\r\nHost: rpc\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (stream, status)
}

#[test]
fn the_websocket_limit_holds_for_the_life_of_each_connection() {
    let (node, envoy) =
        node_behind_gate(r#"{"maxInflight": 100, "maxWebsocketConnections": 2}"#, &[]);
    let addr = envoy.listener("public").unwrap();
    let (first, a) = websocket(addr);
    let (_second, b) = websocket(addr);
    assert_eq!((a, b), (101, 101));
    let (_, refused) = websocket(addr);
    assert_eq!(refused, 503);
    assert!(stat_reaches(&envoy, "websocket.rejected", 1));
    assert_eq!(node.metrics().unwrap()["websockets"], 2);
    assert_eq!(
        http::post(&envoy.url("public").unwrap(), &[], CHAIN_ID)
            .unwrap()
            .status,
        200,
        "RPC is unaffected"
    );

    drop(first);
    assert!(eventually(SETTLE, || stat(&envoy, "websocket.active") == 1));
    let (_third, c) = websocket(addr);
    assert_eq!(c, 101, "a closed connection frees its place");
}

#[test]
fn a_bad_policy_is_rejected_with_its_reason_and_the_previous_one_keeps_serving() {
    let (_node, mut envoy) = node_behind_gate(r#"{"maxInflight": 1}"#, &["--cost", "slow_call=2s"]);
    let url = envoy.url("public").unwrap();

    for (policy, reason) in [
        (
            r#"{"maxInflight": 0}"#,
            "policy rejected: maxInflight: must be between 1 and 1000000, or -1 for pass-through; got 0",
        ),
        (
            r#"{"maxInflight": 4, "maxInfligth": 5}"#,
            "policy rejected: maxInfligth: unknown field `maxInfligth`",
        ),
    ] {
        assert_eq!(
            envoy.update_filter(&gate_filter(policy)).unwrap(),
            EcdsUpdate::Rejected
        );
        assert!(
            envoy.log().contains(reason),
            "Envoy's log names the field and the reason: {reason}"
        );
    }

    let held = hold_a_slot(url.clone());
    assert!(eventually(SETTLE, || stat(&envoy, "inflight.default") == 1));
    assert_eq!(
        http::post(&url, &[], CHAIN_ID).unwrap().status,
        503,
        "maxInflight 1 still holds"
    );

    assert_eq!(
        envoy
            .update_filter(&gate_filter(r#"{"maxInflight": 2}"#))
            .unwrap(),
        EcdsUpdate::Applied
    );
    assert_eq!(
        http::post(&url, &[], CHAIN_ID).unwrap().status,
        200,
        "the new limit applies"
    );
    assert_eq!(held.join().unwrap(), 200);
}

#[test]
fn slots_of_a_vanished_worker_expire_after_the_stale_slot_ttl() {
    // The TTL is long enough that two ECDS updates and one request fit in
    // it on a loaded machine; the bounds below are on counts and on "not
    // before the TTL", never on how soon after it.
    const TTL: Duration = Duration::from_secs(5);
    let policy = format!(
        r#"{{"maxInflight": 4, "heartbeatMs": 200, "staleSlotTtlMs": {}}}"#,
        TTL.as_millis()
    );
    // No request before the ghost: a worker VM keeps a released slot spare
    // until its next heartbeat, and would admit with it whatever the ghost
    // holds (the spare counts against the limit, so that is exact).
    let (_node, mut envoy) = node_behind_gate(&policy, &[]);
    let url = envoy.url("public").unwrap();

    // A module under the gate's vm_id takes every slot and goes silent.
    let ghost = FilterConfig {
        module: stakegate_stack::paths::wasm_module("ghost_worker").unwrap(),
        policy: r#"{"hold": 4}"#.into(),
        ..gate_filter(&policy)
    };
    // Taken before the ghost exists, so its slots cannot expire sooner
    // than TTL after this instant.
    let vanished = std::time::Instant::now();
    assert_eq!(envoy.update_filter(&ghost).unwrap(), EcdsUpdate::Applied);
    assert_eq!(
        envoy.update_filter(&gate_filter(&policy)).unwrap(),
        EcdsUpdate::Applied
    );

    let first = http::post(&url, &[], CHAIN_ID).unwrap();
    assert_eq!(
        first.status,
        503,
        "the vanished worker's slots are still counted ({:?} after it took them)",
        vanished.elapsed()
    );
    // Stats are published once per heartbeat.
    assert!(eventually(SETTLE, || stat(&envoy, "inflight.default") >= 4));
    assert!(
        eventually(TTL * 6, || http::post(&url, &[], CHAIN_ID).unwrap().status
            == 200),
        "the slots never came back"
    );
    let recovered = vanished.elapsed();
    eprintln!(
        "slots recovered {recovered:?} after the worker vanished (TTL {TTL:?}, heartbeat 0.2 s)"
    );
    assert!(recovered >= TTL, "not before the TTL: {recovered:?}");
    assert!(eventually(SETTLE, || stat(&envoy, "expired_slots") >= 4));
    assert!(envoy.log().contains("reclaimed"), "the reclaim is logged");
}
