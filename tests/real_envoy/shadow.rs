//! Shadow deploys in the whole gateway (envoy-config/gateway.yaml): a
//! candidate stake QoS policy decides every request beside the live one
//! and refuses none; `stakegate shadow` compares them; an automatic
//! promotion over budget drops the candidate, one within it makes it live
//! (and `rollback` undoes that).

use serde_json::json;
use stakegate_loadgen::ClientSpec;
use stakegate_stack::{loadgen, paths, Envoy};
use stakegate_tests::{
    client, example_policy, gate_filter, load_h2, node_behind_filters, qos_filter,
};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

/// `stakegate ARGS` against `envoy`'s ECDS directory and admin.
fn stakegate(envoy: &Envoy, args: &[&str]) -> Output {
    std::process::Command::new(paths::tool("stakegate").unwrap())
        .args(args)
        .args(["--filter", "stake-qos", "--admin", envoy.admin_url()])
        .arg("--dir")
        .arg(envoy.ecds_dir())
        .output()
        .unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn policy_file(dir: &Path, name: &str, capacity: u32) -> PathBuf {
    let path = dir.join(name);
    let policy = example_policy("stake-qos", json!({ "capacityRps": capacity }));
    std::fs::write(&path, policy).unwrap();
    path
}

/// Two staked clients at 150 requests a second each, for `seconds`.
fn load(envoy: &Envoy, seconds: u64) -> std::thread::JoinHandle<stakegate_loadgen::Report> {
    let url = envoy.url("public").unwrap();
    std::thread::spawn(move || {
        let staked = |id: &str, key: &str| ClientSpec {
            api_key: Some(key.into()),
            ..client(id, 150.0, "eth_call", 64)
        };
        let clients = vec![staked("a", "key-stake-10"), staked("b", "key-stake-40")];
        loadgen::run(&load_h2(&url, clients, Duration::from_secs(seconds), 2)).unwrap()
    })
}

/// `deploy --shadow` of `policy`, promoted or dropped after 3 s of load.
fn watched(envoy: &Envoy, policy: &Path) -> Output {
    let module = paths::wasm_module("stake_qos").unwrap();
    let running = load(envoy, 5);
    let (module, policy) = (module.to_str().unwrap(), policy.to_str().unwrap());
    let args = ["deploy", "--shadow", "--module", module, "--policy", policy];
    let out = stakegate(envoy, &[&args[..], &["--promote-after", "3s"]].concat());
    running.join().unwrap();
    out
}

fn shadow_stat(envoy: &Envoy, name: &str) -> i64 {
    envoy
        .stat(&format!("wasmcustom.stakegate.qos_shadow.{name}"))
        .unwrap_or(0)
}

#[test]
fn a_shadow_candidate_refuses_nothing_is_compared_and_promoted_or_dropped_by_its_budget() {
    // Live: 1600 rps, far above the 300 the clients send.
    let (_node, envoy) = node_behind_filters(
        "gateway.yaml",
        vec![
            qos_filter(&example_policy("stake-qos", json!({ "capacityRps": 1600 }))),
            gate_filter(&example_policy(
                "admission-gate",
                json!({ "maxInflight": 64 }),
            )),
        ],
        &["--read-slots", "64", "--cost", "eth_call=1ms"],
    );
    let dir = tempfile::tempdir().unwrap();
    let module = paths::wasm_module("stake_qos").unwrap();
    let module = module.to_str().unwrap();
    let strict = policy_file(dir.path(), "strict.json", 100);

    // A candidate with a sixteenth of the capacity, as a shadow.
    let out = stakegate(
        &envoy,
        &[
            "deploy",
            "--shadow",
            "--module",
            module,
            "--policy",
            strict.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let running = load(&envoy, 4);
    let compared = std::process::Command::new(paths::tool("stakegate").unwrap())
        .args([
            "shadow",
            "--json",
            "--interval",
            "3s",
            "--admin",
            envoy.admin_url(),
        ])
        .output()
        .unwrap();
    let report = running.join().unwrap();
    // It refused nothing: every request was answered by the node.
    assert_eq!(
        report.count("200"),
        report.clients.iter().map(|c| c.header.sent).sum::<u64>()
    );
    assert!(compared.status.success(), "{}", text(&compared));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&compared.stdout).unwrap();
    eprintln!("{}", serde_json::to_string(&rows).unwrap());
    for identity in ["stake-10", "stake-40"] {
        let row = rows
            .iter()
            .find(|r| r["identity"] == identity)
            .expect(identity);
        assert_eq!(row["refused"], 0, "{row}");
        assert!(row["wouldRefuse"].as_u64().unwrap() > 0, "{row}");
        assert_eq!(row["staked"], true);
    }
    assert!(
        shadow_stat(&envoy, "throttled.gold") > 0,
        "its own stats, apart"
    );
    assert_eq!(
        envoy
            .stat("wasmcustom.stakegate.qos.throttled.gold")
            .unwrap(),
        0
    );

    // Promoted automatically only within budget: this one is far over it.
    let out = watched(&envoy, &strict);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("was dropped: staked identities would be refused"),
        "{}",
        text(&out)
    );
    let slot = std::fs::read_to_string(envoy.ecds_dir().join("stake-qos.shadow.yaml")).unwrap();
    assert!(
        slot.contains("HeaderMutation"),
        "the slot is empty again: {slot}"
    );
    let history = envoy.ecds_dir().join(".stakegate/history/stake-qos.json");
    assert!(!history.exists(), "nothing was deployed live");

    // A looser candidate is within budget (it would refuse nothing): live.
    let loose = policy_file(dir.path(), "loose.json", 3200);
    let out = watched(&envoy, &loose);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("promoted the shadow candidate"),
        "{}",
        text(&out)
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&history).unwrap()).unwrap();
    let deployments = doc["deployments"].as_array().unwrap();
    assert_eq!(
        deployments.len(),
        2,
        "the startup config, then the promoted one"
    );
    assert!(deployments[1]["policy"].as_str().unwrap().contains("3200"));
    assert!(!deployments[1]["policy"]
        .as_str()
        .unwrap()
        .contains("shadow"));
    // A normal deployment: rollback returns to the startup policy.
    let out = stakegate(&envoy, &["rollback"]);
    assert!(out.status.success(), "{}", text(&out));
    // With no candidate, promoting says so.
    let out = stakegate(&envoy, &["deploy", "--promote"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("no shadow candidate"), "{}", text(&out));
}
