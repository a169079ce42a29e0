//! The stake QoS filter in a real Envoy at `--concurrency 2`: stake shares
//! under overload, the 429 shape, and policy errors.

use stakegate_loadgen::ClientSpec;
use stakegate_stack::ecds::EcdsUpdate;
use stakegate_stack::{http, loadgen, Envoy, RpcNode};
use stakegate_tests::{client, eventually, load_h2, node_behind_filter, qos_filter};
use std::time::Duration;

const CALL: &str = r#"{"jsonrpc":"2.0","id":1,"method":"eth_call"}"#;

fn example_policy(capacity_rps: u32) -> String {
    let path = stakegate_stack::paths::project_root().join("policies/stake-qos.example.json");
    let mut policy: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    policy["capacityRps"] = capacity_rps.into();
    policy.to_string()
}

fn node_behind_qos(policy: &str) -> (RpcNode, Envoy) {
    node_behind_filter(
        "qos.yaml",
        qos_filter(policy),
        &["--read-slots", "16", "--cost", "eth_call=10ms"],
    )
}

#[test]
fn stake_shares_hold_in_a_real_envoy() {
    const CAPACITY: f64 = 400.0;
    let (_node, envoy) = node_behind_qos(&example_policy(CAPACITY as u32));
    // Stakes in percent; the unstaked client sends no key.
    let stakes: [(u64, Option<&str>); 5] = [
        (0, None),
        (10, Some("key-stake-10")),
        (20, Some("key-stake-20")),
        (30, Some("key-stake-30")),
        (40, Some("key-stake-40")),
    ];
    let clients: Vec<ClientSpec> = stakes
        .iter()
        .map(|(stake, key)| ClientSpec {
            api_key: key.map(str::to_string),
            ..client(&format!("stake-{stake}"), CAPACITY, "eth_call", 100_000)
        })
        .collect();
    let duration = Duration::from_secs(8);
    let report = loadgen::run(&load_h2(
        &envoy.url("public").unwrap(),
        clients,
        duration,
        2,
    ))
    .unwrap();
    // Shares under overload: from the third second on. Before that the
    // load estimate is still rising toward the threshold, and nobody is
    // throttled while it is below (each client gets all it sends).
    const SETTLED: usize = 2;
    let admitted: Vec<u64> = report
        .clients
        .iter()
        .map(|c| c.timeline.iter().skip(SETTLED).map(|s| s.ok).sum())
        .collect();
    let total: u64 = admitted.iter().sum();
    let mut worst: f64 = 0.0;
    for ((stake, _), got) in stakes.iter().zip(&admitted) {
        let share = *got as f64 / total as f64 * 100.0;
        eprintln!("stake {stake} %: admitted {got} ({share:.2} %)");
        worst = worst.max((share - *stake as f64).abs());
    }
    let rate = total as f64 / (duration.as_secs_f64() - SETTLED as f64);
    eprintln!("admitted {rate:.0} rps of {CAPACITY}; max share error {worst:.2} pp");
    assert!(report.count("429") > 0, "the flood was throttled");
    assert!(worst <= 2.0, "max share error {worst:.2} pp");
    assert!(rate >= 0.98 * CAPACITY, "admitted {rate:.0} rps");
    assert_eq!(report.count("503") + report.count("transport_error"), 0);
}

#[test]
fn a_throttled_request_gets_429_with_retry_after_and_ratelimit_headers() {
    let (_node, envoy) = node_behind_qos(r#"{"capacityRps": 20}"#);
    let url = envoy.url("public").unwrap();
    // Back to back requests soon push the load estimate over 95 % of 20 rps.
    let throttled = (0..2000)
        .map(|_| http::post(&url, &[], CALL).unwrap())
        .find(|answer| answer.status != 200)
        .expect("a request is throttled");
    assert_eq!(throttled.status, 429);
    assert_eq!(throttled.header("content-type"), Some("application/json"));
    let retry_after: u32 = throttled.header("retry-after").unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    assert!(throttled
        .header("ratelimit-policy")
        .unwrap()
        .starts_with("\"stake\";q="));
    assert!(throttled.header("ratelimit").unwrap().contains(";t="));
    let body: serde_json::Value = serde_json::from_str(&throttled.body).unwrap();
    assert_eq!(body["error"]["code"], -32005);
    assert!(eventually(Duration::from_secs(2), || {
        envoy
            .stat("wasmcustom.stakegate.qos.throttled.unstaked")
            .unwrap()
            > 0
    }));
}

#[test]
fn a_bad_qos_policy_is_rejected_and_the_old_one_keeps_serving() {
    let (_node, mut envoy) = node_behind_qos(r#"{"capacityRps": 1000}"#);
    let url = envoy.url("public").unwrap();
    for (policy, reason) in [
        (
            r#"{"capacityRps": -5}"#,
            "policy rejected: capacityRps: must be between 1 and 10000000; got -5",
        ),
        (
            r#"{"capacityRps": 5, "stakes": [{"apiKeySha256": "my-secret-key", "name": "a", "stake": 1}]}"#,
            "policy rejected: stakes[0].apiKeySha256: must be 64 hex digits",
        ),
    ] {
        assert_eq!(
            envoy.update_filter(&qos_filter(policy)).unwrap(),
            EcdsUpdate::Rejected
        );
        assert!(envoy.log().contains(reason), "Envoy's log says: {reason}");
    }
    assert_eq!(http::post(&url, &[], CALL).unwrap().status, 200);
}
