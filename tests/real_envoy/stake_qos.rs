//! The stake QoS filter in a real Envoy at `--concurrency 2`: stake shares
//! under overload, the 429 shape, and policy errors.

use stakegate_loadgen::ClientSpec;
use stakegate_stack::ecds::EcdsUpdate;
use stakegate_stack::{http, loadgen, Envoy, RpcNode};
use stakegate_tests::{client, eventually, load_h2, node_behind_filter, qos_filter, SETTLE};
use std::time::Duration;

const CALL: &str = r#"{"jsonrpc":"2.0","id":1,"method":"eth_call"}"#;

fn example_policy(capacity_rps: u32) -> String {
    stakegate_tests::example_policy(
        "stake-qos",
        serde_json::json!({ "capacityRps": capacity_rps }),
    )
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
    let key_hash = stakegate_core::request::sha256_hex(b"desk-7-key");
    let (_node, envoy) = node_behind_qos(&format!(
        r#"{{"capacityRps": 20, "stakes": [{{"apiKeySha256": "{key_hash}", "name": "desk-7", "stake": 5000}}]}}"#
    ));
    let url = envoy.url("public").unwrap();
    // Back to back requests soon push the load estimate over 95 % of 20 rps.
    // A worker that refuses before its first refill round reached it knows
    // no share yet and says 0 (seen once on a busy machine): every refusal
    // is checked, and the first that names a share is read in full.
    let share_of = |answer: &http::Answer| -> f64 {
        let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
        body["error"]["data"]["share"].as_f64().unwrap()
    };
    let throttled = (0..2000)
        .map(|_| http::post(&url, &[("x-api-key", "desk-7-key")], CALL).unwrap())
        .filter(|answer| answer.status != 200)
        .inspect(|answer| {
            assert_eq!(answer.status, 429, "{}", answer.body);
            assert!(share_of(answer) >= 0.0, "{}", answer.body);
        })
        .find(|answer| share_of(answer) > 0.0)
        .expect("a request is throttled at its share");
    assert_eq!(throttled.status, 429);
    assert_eq!(throttled.header("content-type"), Some("application/json"));
    let retry_after: u32 = throttled.header("retry-after").unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    assert!(throttled
        .header("ratelimit-policy")
        .unwrap()
        .starts_with("\"stake-share\";q="));
    assert!(throttled.header("ratelimit").unwrap().contains(";t="));
    let body: serde_json::Value = serde_json::from_str(&throttled.body).unwrap();
    assert_eq!(body["error"]["code"], -32005);
    // Why: the rule, the identity's name (never its key), its share and
    // its rate, in the body and in headers.
    let data = &body["error"]["data"];
    assert_eq!(data["rule"], "stake-share");
    assert_eq!(data["identity"], "desk-7");
    assert_eq!(data["retryAfter"], retry_after);
    let share = data["share"].as_f64().unwrap();
    // The share reported is the worker's last grant over the configured
    // refill interval; on a loaded machine a round that ran late granted
    // more than 20 rps' worth (27 seen), so the bound is the capacity's
    // order of magnitude, not the capacity.
    assert!(share > 0.0 && share <= 40.0, "share {share}");
    assert!(data["rate"].as_f64().unwrap() > 0.0, "{data}");
    assert!(!throttled.body.contains("desk-7-key") && !throttled.body.contains(&key_hash));
    assert_eq!(throttled.header("x-stakegate-rule"), Some("stake-share"));
    assert_eq!(throttled.header("x-stakegate-identity"), Some("desk-7"));
    assert!(throttled.header("x-stakegate-share").is_some());
    assert!(eventually(SETTLE, || {
        envoy
            .stat("wasmcustom.stakegate.qos.throttled.staked")
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

/// A flood from its own address for `duration`; the calls admitted after
/// the first second.
fn flood_alone(envoy: &Envoy, duration: Duration) -> u64 {
    let flood = ClientSpec {
        source: Some("127.0.9.9".parse().unwrap()),
        ..client("flood", 1600.0, "eth_call", 100_000)
    };
    let report = loadgen::run(&load_h2(
        &envoy.url("public").unwrap(),
        vec![flood],
        duration,
        2,
    ))
    .unwrap();
    report.clients[0]
        .timeline
        .iter()
        .skip(1)
        .map(|s| s.ok)
        .sum()
}

#[test]
fn a_thousand_idle_identities_take_nothing_from_an_active_client() {
    let duration = Duration::from_secs(5);
    let (_node, alone) = node_behind_qos(r#"{"capacityRps": 400}"#);
    let empty = flood_alone(&alone, duration);
    drop(alone);

    let (_node, envoy) = node_behind_qos(r#"{"capacityRps": 400}"#);
    // 1,000 clients, each from its own address, send one request each.
    let crowd: Vec<ClientSpec> = (0..1000u32)
        .map(|i| ClientSpec {
            source: Some(
                format!("127.1.{}.{}", i / 250, i % 250 + 1)
                    .parse()
                    .unwrap(),
            ),
            ..client(&format!("once-{i}"), 1.0, "eth_call", 10)
        })
        .collect();
    let mut spec = load_h2(
        &envoy.url("public").unwrap(),
        crowd,
        Duration::from_secs(1),
        1,
    );
    spec.max_requests = 1;
    spec.http2 = false;
    let once = loadgen::run(&spec).unwrap();
    assert_eq!(once.count("200"), 1000, "{:?}", once.status);
    // They are in the table, and idle once their demand has decayed.
    assert!(eventually(SETTLE, || {
        envoy.stat("wasmcustom.stakegate.qos.identities").unwrap() == 0
    }));
    let beside = flood_alone(&envoy, duration);
    eprintln!("the flood alone: {empty} admitted; beside 1,000 idle identities: {beside}");
    assert!(
        (beside as f64 - empty as f64).abs() <= 0.02 * empty as f64,
        "alone {empty}, beside 1,000 idle identities {beside}"
    );
}

#[test]
fn a_light_staker_leaves_its_share_to_the_floods_in_a_real_envoy() {
    let out = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(stakegate_stack::paths::tool("stakegate").unwrap())
        .args([
            "scenario",
            "run",
            "partial-demand",
            "--json",
            "--duration",
            "10s",
        ])
        .arg("--out")
        .arg(out.path())
        .current_dir(stakegate_stack::paths::project_root())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let error = summary["max_share_error_pp"].as_f64().unwrap();
    let fill = summary["fill"].as_f64();
    eprintln!("partial-demand for real: max share error {error} pp, fill {fill:?}");
    for c in summary["clients"].as_array().unwrap() {
        eprintln!(
            "  {}: admitted {} rps, share {} (fair {})",
            c["id"], c["admitted_rps"], c["admitted_share"], c["fair_share"]
        );
    }
    // The shares are exact whatever the machine; the fill needs the load
    // to have been offered, which a busy machine may fall short of.
    assert!(error <= 1.5, "max share error {error} pp");
    if let Some(fill) = fill {
        assert!(fill >= 0.95, "fill {fill}");
    }
}

/// 127 clients, each from its own address, come once while a client
/// floods: the flood keeps what it gets alone (the example stake table).
#[test]
fn identities_that_come_once_during_a_flood_take_nothing_from_it() {
    let policy = example_policy(400);
    let flood = |crowd: bool| -> u64 {
        let (_node, envoy) = node_behind_qos(&policy);
        let once: Vec<ClientSpec> = (0..127u32)
            .map(|i| ClientSpec {
                source: Some(
                    format!("127.1.{}.{}", i / 250, i % 250 + 1)
                        .parse()
                        .unwrap(),
                ),
                offset_ms: 2000 + 10 * u64::from(i),
                ..client(&format!("once-{i}"), 1.0, "eth_call", 10)
            })
            .collect();
        let mut spec = load_h2(
            &envoy.url("public").unwrap(),
            once,
            Duration::from_secs(4),
            1,
        );
        spec.max_requests = 1;
        spec.http2 = false;
        let crowd = crowd.then(|| std::thread::spawn(move || loadgen::run(&spec).unwrap()));
        let admitted = flood_alone(&envoy, Duration::from_secs(6));
        if let Some(crowd) = crowd {
            let report = crowd.join().unwrap();
            assert_eq!(report.count("200"), 127, "{:?}", report.status);
        }
        admitted
    };
    let alone = flood(false);
    let beside = flood(true);
    eprintln!(
        "the flood alone: {alone} admitted; with 127 that came once: {beside} ({:.3})",
        beside as f64 / alone as f64
    );
    assert!(
        beside as f64 >= 0.97 * alone as f64,
        "alone {alone}, beside {beside}"
    );
}

/// In node time, stake QoS charges each answer what the admission gate
/// measured for it (here as the node said it, `serviceTimeHeader`), not
/// its own clock, which would count the hops too: answers that came
/// through the route and answers a coalescing leader's callout fetched
/// alike; and nothing for an answer the gate gave itself (a cache hit).
/// The gate tells it in the stream's filter state: nothing of it reaches
/// the client.
#[test]
fn in_node_time_qos_charges_what_the_node_said_and_nothing_for_a_hit() {
    let key = stakegate_core::request::sha256_hex(b"desk-key");
    let qos = format!(
        r#"{{"capacityNodeMs": 100000, "identifyAbove": 0, "decideOnBody": true,
            "identity": {{"order": ["apiKey", "address"], "apiKeyHeader": "x-api-key"}},
            "stakes": [{{"apiKeySha256": "{key}", "name": "desk", "stake": 1}}]}}"#
    );
    let gate = r#"{"maxInflight": 8, "decideOnBody": true, "dedup": {}, "cache": {},
                   "nodeTime": {"serviceTimeHeader": "x-node-service-us"}}"#;
    let (node, envoy) =
        stakegate_tests::gateway_on_one_worker(&qos, gate, &["--cost", "eth_call=3ms"]);
    let url = envoy.url("public").unwrap();
    let ask = |body: &str| {
        let answer = http::post(&url, &[("x-api-key", "desk-key")], body).unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(
            answer.headers.iter().all(|(n, _)| !n.contains("node-us")),
            "{:?}",
            answer.headers
        );
        answer
    };
    let charged = || {
        envoy
            .stat("wasmcustom.stakegate.qos.usage.desk.node_us")
            .unwrap()
    };
    // What the node said its answers took, summed: what QoS must charge.
    let said = || node.metrics().unwrap()["service_us_said"].as_i64().unwrap();
    let settled = |what: &str| {
        assert!(
            eventually(SETTLE, || charged() == said()),
            "{what}: charged {} µs, the node said {} µs: {}",
            charged(),
            said(),
            node.metrics().unwrap()
        );
    };
    for id in 0..20 {
        ask(&format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call","params":[{{"to":"0x{id:040x}"}},"latest"]}}"#
        ));
    }
    assert!(said() >= 20 * 3_000, "{} µs", said());
    settled("eth_call");
    // eth_chainId cannot change: the cache keeps it once asked again,
    // then answers it, charged nothing.
    let chain_id = r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}"#;
    let asked = (1..=5)
        .find(|_| ask(chain_id).header("x-stakegate-cache") == Some("hit"))
        .expect("a hit");
    let served = node.metrics().unwrap()["served"]["eth_chainId"].as_u64();
    assert_eq!(served, Some(asked - 1), "the hit did not reach the node");
    settled("eth_chainId, then a hit");
}
