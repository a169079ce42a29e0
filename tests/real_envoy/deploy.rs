//! `stakegate deploy` and `rollback` against a real Envoy at
//! `--concurrency 2`: swaps under load, broken inputs refused, and a stake
//! table change taking effect.

use crate::admission_gate::settles_to_zero;
use stakegate_loadgen::ClientSpec;
use stakegate_stack::{loadgen, paths, Envoy};
use stakegate_tests::{
    client, eventually, load_h2, node_behind_filter, node_behind_gate, qos_filter, SETTLE,
};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// Runs `stakegate deploy` (or `rollback` when `module` is `None`) against
/// `envoy`'s ECDS directory and admin.
fn stakegate(envoy: &Envoy, filter: &str, module_and_policy: Option<(&Path, &Path)>) -> Output {
    let mut command = std::process::Command::new(paths::tool("stakegate").unwrap());
    command
        .arg(if module_and_policy.is_some() {
            "deploy"
        } else {
            "rollback"
        })
        .args(["--filter", filter])
        .arg("--dir")
        .arg(envoy.ecds_dir())
        .args(["--admin", envoy.admin_url()])
        .arg("--envoy-log")
        .arg(envoy.log_path());
    if let Some((module, policy)) = module_and_policy {
        command
            .arg("--module")
            .arg(module)
            .arg("--policy")
            .arg(policy);
    }
    command.output().unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn deployed(output: &Output) -> String {
    assert!(output.status.success(), "{}", text(output));
    text(output)
}

/// The deployments stakegate recorded for `filter`.
fn history(envoy: &Envoy, filter: &str) -> Vec<serde_json::Value> {
    let path = envoy
        .ecds_dir()
        .join(format!(".stakegate/history/{filter}.json"));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["deployments"].as_array().unwrap().clone()
}

fn file(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// `module` with the custom section `name` appended.
fn with_section(module: &[u8], name: &str, contents: &str) -> Vec<u8> {
    let mut payload = vec![name.len() as u8];
    payload.extend_from_slice(name.as_bytes());
    payload.extend_from_slice(contents.as_bytes());
    assert!(payload.len() < 128, "one-byte LEB128 size");
    let mut out = module.to_vec();
    out.push(0);
    out.push(payload.len() as u8);
    out.extend_from_slice(&payload);
    out
}

/// Another version of `module` (a new sha256, so Envoy loads it as new
/// code) that behaves the same.
fn rebuilt(module: &[u8], build: &str) -> Vec<u8> {
    with_section(module, "stakegate.build", build)
}

/// A proxy-wasm module in WAT that declares itself the admission gate:
/// `imports`, and `configure` as the body of proxy_on_configure. Requests
/// pass.
fn wat_module(imports: &str, configure: &str) -> Vec<u8> {
    let text = include_str!("../fixtures/proxy-wasm.wat")
        .replace("{imports}", imports)
        .replace("{configure}", configure);
    with_section(
        &wat::parse_str(text).unwrap(),
        "stakegate.filter",
        "admission-gate",
    )
}

const INTERNAL: &str = r#""classes": {"internal": [{"listenerMetadata": "internal"}]}"#;

#[test]
fn ten_deploys_under_load_fail_no_request() {
    let policy = |limit: u32| format!(r#"{{"maxInflight": {limit}, {INTERNAL}}}"#);
    // Limits far above the load's 256 in flight: a swap, not the limit, is
    // what is tried (were one reached, the gate's 503 is its job, not a
    // failure).
    let (node, envoy) = node_behind_gate(&policy(4096), &["--read-slots", "64"]);
    let dir = tempfile::tempdir().unwrap();
    let gate = std::fs::read(paths::wasm_module("admission_gate").unwrap()).unwrap();
    let modules = [
        file(dir.path(), "gate-a.wasm", rebuilt(&gate, "a")),
        file(dir.path(), "gate-b.wasm", rebuilt(&gate, "b")),
    ];
    let policies = [
        file(dir.path(), "p4096.json", policy(4096)),
        file(dir.path(), "p2048.json", policy(2048)),
    ];
    const RATE: f64 = 2000.0;
    let duration = Duration::from_secs(32);
    let spec = load_h2(
        &envoy.url("public").unwrap(),
        // At most 256 in flight: a machine too busy for the rate sends
        // less (skipped at the cap) instead of piling requests up until
        // they time out.
        vec![client("steady", RATE, "eth_blockNumber", 256)],
        duration,
        4,
    );
    let load = std::thread::spawn(move || loadgen::run(&spec).unwrap());
    // The first deploy lands once the load flows through the gate (its
    // counts reach Envoy at its 1 s heartbeat).
    assert!(eventually(SETTLE, || {
        envoy
            .stat("wasmcustom.stakegate.gate.admitted.default")
            .unwrap()
            > 0
    }));
    // Each deploy changes one thing, the module and the policy in turn:
    // (a, 4096), (b, 4096), (b, 2048), (a, 2048), (a, 4096), ...
    let steps: Vec<(usize, usize)> = (0..10usize)
        .map(|i| (i.div_ceil(2) % 2, (i / 2) % 2))
        .collect();
    for (module, policy) in &steps {
        let output = stakegate(
            &envoy,
            "admission-gate",
            Some((&modules[*module], &policies[*policy])),
        );
        eprint!("{}", deployed(&output));
        // Spreads the ten deploys over the load's 32 s.
        std::thread::sleep(Duration::from_millis(2_500));
    }
    let report = load.join().unwrap();
    let deployments = history(&envoy, "admission-gate");
    assert_eq!(deployments.len(), 11, "the startup config and ten deploys");
    assert_eq!(deployments[0]["startup"], true);
    let deployments = &deployments[1..];
    let ms = |d: &serde_json::Value, field: &str| d[field].as_u64().unwrap();
    let applied: Vec<u64> = deployments.iter().map(|d| ms(d, "apply_ms")).collect();
    let staged: Vec<u64> = deployments.iter().map(|d| ms(d, "warm_up_ms")).collect();
    eprintln!(
        "{} requests at {RATE} rps for {duration:?}: status {:?}, admitted p99 {} ms; \
         swaps applied in {applied:?} ms after staging in {staged:?} ms \
         (odd steps and the first stage a new module)",
        report.count("200"),
        report.status,
        report.latency_ms.ok.p99,
    );
    // Timings are reported above, not judged: the limits here only catch
    // a swap that hung (staging is V8 compiling the module, eagerly, on
    // Envoy's main thread while the load shares the cores).
    assert!(applied.iter().all(|ms| *ms < 20_000), "{applied:?} ms");
    assert!(staged.iter().all(|ms| *ms < 60_000), "{staged:?} ms");
    // The load ran through all the swaps (a loaded machine sends less: a
    // tenth of the rate is a bound no slowdown reached).
    let sent = report.clients[0].header.sent;
    assert!(
        sent as f64 >= 0.1 * RATE * duration.as_secs_f64(),
        "sent {sent}"
    );
    // Every request was answered by the node or by the gate: a swap that
    // lost one would show as a reset, a timeout or another status.
    assert_eq!(
        report.count("200") + report.count("503"),
        sent,
        "{:?}",
        report.status
    );
    // And nothing leaked: the gate's count and the node's agree, at 0.
    assert!(settles_to_zero(&envoy), "in-flight gauges back to 0");
    assert_eq!(node.metrics().unwrap()["inflight"], 0);
}

#[test]
fn a_module_deployed_as_another_filter_is_refused() {
    let (_node, envoy) = node_behind_gate(&format!(r#"{{"maxInflight": 8, {INTERNAL}}}"#), &[]);
    let dir = tempfile::tempdir().unwrap();
    let qos = paths::wasm_module("stake_qos").unwrap();
    let policy = file(dir.path(), "qos.json", r#"{"capacityRps": 100}"#);
    let output = stakegate(&envoy, "admission-gate", Some((&qos, &policy)));
    assert!(!output.status.success());
    let said = text(&output);
    assert!(
        said.contains("the module declares itself the stake-qos filter, not admission-gate"),
        "{said}"
    );
    let attempts = "extension_config_discovery.http_filter.stakegate.admission_gate.update_attempt";
    assert_eq!(envoy.stat(attempts).unwrap(), 1, "Envoy was not touched");
}

#[test]
fn a_storm_of_concurrent_deploys_half_of_them_broken_leaves_the_last_good_one_serving() {
    let policy = |limit: u32| format!(r#"{{"maxInflight": {limit}, {INTERNAL}}}"#);
    let (_node, envoy) = node_behind_gate(&policy(64), &[]);
    let dir = tempfile::tempdir().unwrap();
    let gate = paths::wasm_module("admission_gate").unwrap();
    let qos = paths::wasm_module("stake_qos").unwrap();
    let bad = file(
        dir.path(),
        "bad.json",
        r#"{"maxInflight": 8, "reserved": 9}"#,
    );
    let unlinkable = file(
        dir.path(),
        "unlinkable.wasm",
        wat_module(
            r#"(import "env" "stakegate_not_in_envoy" (func))"#,
            "i32.const 1",
        ),
    );
    let envoy = std::sync::Arc::new(envoy);
    // Three operators, four deploys each: good, broken, good, broken.
    let storm: Vec<_> = (0..3u32)
        .map(|who| {
            let good: Vec<PathBuf> = (0..2)
                .map(|k| {
                    file(
                        dir.path(),
                        &format!("p{who}-{k}.json"),
                        policy(100 + 10 * who + k),
                    )
                })
                .collect();
            let broken = [
                (qos.clone(), good[0].clone()),
                (unlinkable.clone(), bad.clone()),
            ];
            let (envoy, gate) = (envoy.clone(), gate.clone());
            std::thread::spawn(move || {
                (0..4)
                    .map(|step| {
                        let (module, policy) = if step % 2 == 0 {
                            (gate.clone(), good[step / 2].clone())
                        } else {
                            broken[step / 2].clone()
                        };
                        stakegate(&envoy, "admission-gate", Some((&module, &policy)))
                            .status
                            .success()
                    })
                    .collect::<Vec<bool>>()
            })
        })
        .collect();
    let outcomes: Vec<bool> = storm.into_iter().flat_map(|t| t.join().unwrap()).collect();
    assert_eq!(
        outcomes,
        [true, false, true, false].repeat(3),
        "every good deploy applied, every broken one refused"
    );
    let deployments = history(&envoy, "admission-gate");
    assert_eq!(
        deployments.len(),
        7,
        "the startup config and six good deploys"
    );
    let last = deployments.last().unwrap();
    let version = "extension_config_discovery.http_filter.stakegate.admission_gate.version_text";
    assert_eq!(
        envoy.admin().text(version).unwrap().as_deref(),
        Some(last["version"].to_string().as_str())
    );
    let config = std::fs::read_to_string(envoy.ecds_dir().join("admission-gate.yaml")).unwrap();
    let serving: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(
        serving["resources"][0]["typed_config"]["config"]["configuration"]["value"], last["policy"],
        "on disk is what was last recorded"
    );
    let answer = stakegate_stack::http::post(
        &envoy.url("public").unwrap(),
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#,
    )
    .unwrap();
    assert_eq!(answer.status, 200);
}

#[test]
fn concurrent_deploys_take_turns_and_none_is_lost() {
    let policy = |limit: u32| format!(r#"{{"maxInflight": {limit}, {INTERNAL}}}"#);
    let (_node, envoy) = node_behind_gate(&policy(64), &[]);
    let dir = tempfile::tempdir().unwrap();
    let gate = paths::wasm_module("admission_gate").unwrap();
    let envoy = std::sync::Arc::new(envoy);
    let deploys: Vec<_> = (0..4u32)
        .map(|i| {
            let path = file(dir.path(), &format!("p{i}.json"), policy(100 + i));
            let (envoy, gate) = (envoy.clone(), gate.clone());
            std::thread::spawn(move || stakegate(&envoy, "admission-gate", Some((&gate, &path))))
        })
        .collect();
    for deploy in deploys {
        deployed(&deploy.join().unwrap());
    }
    let deployments = history(&envoy, "admission-gate");
    let versions: Vec<u64> = deployments
        .iter()
        .map(|d| d["version"].as_u64().unwrap())
        .collect();
    eprintln!("versions {versions:?}");
    assert_eq!(deployments.len(), 5, "the startup config and four deploys");
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    let version = "extension_config_discovery.http_filter.stakegate.admission_gate.version_text";
    assert_eq!(
        envoy.admin().text(version).unwrap().as_deref(),
        Some(versions[4].to_string().as_str()),
        "Envoy serves the last one recorded"
    );
}

#[test]
fn broken_inputs_are_refused_and_the_old_module_keeps_serving() {
    let policy = format!(r#"{{"maxInflight": 64, {INTERNAL}}}"#);
    let (_node, envoy) = node_behind_gate(&policy, &[]);
    let dir = tempfile::tempdir().unwrap();
    let gate = paths::wasm_module("admission_gate").unwrap();
    let good = file(dir.path(), "good.json", &policy);
    deployed(&stakegate(&envoy, "admission-gate", Some((&gate, &good))));
    let config = envoy.ecds_dir().join("admission-gate.yaml");
    let serving = std::fs::read_to_string(&config).unwrap();
    let attempts = "extension_config_discovery.http_filter.stakegate.admission_gate.update_attempt";
    let before = envoy.stat(attempts).unwrap();

    // A bad field: refused offline, with the field and the reason.
    let bad = file(
        dir.path(),
        "bad.json",
        r#"{"maxInflight": 8, "reserved": 9}"#,
    );
    let output = stakegate(&envoy, "admission-gate", Some((&gate, &bad)));
    assert!(!output.status.success());
    let said = text(&output);
    assert!(said.contains("refused before touching Envoy"), "{said}");
    assert!(
        said.contains("reserved: must be less than maxInflight"),
        "{said}"
    );

    // A module that refuses its configuration.
    let refuses = file(dir.path(), "refuses.wasm", wat_module("", "i32.const 0"));
    let output = stakegate(&envoy, "admission-gate", Some((&refuses, &good)));
    assert!(!output.status.success());
    let said = text(&output);
    assert!(said.contains("refused its configuration"), "{said}");
    assert_eq!(
        envoy.stat(attempts).unwrap(),
        before,
        "Envoy was not touched"
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), serving);

    // A module the offline host accepts but Envoy cannot link.
    let unlinkable = file(
        dir.path(),
        "unlinkable.wasm",
        wat_module(
            r#"(import "env" "stakegate_not_in_envoy" (func))"#,
            "i32.const 1",
        ),
    );
    let output = stakegate(&envoy, "admission-gate", Some((&unlinkable, &good)));
    assert!(!output.status.success());
    let said = text(&output);
    eprintln!("{said}");
    assert!(
        said.contains("Envoy rejected stakegate.admission_gate"),
        "{said}"
    );
    assert!(said.contains("config update rejected"), "{said}");
    assert!(said.contains("keeps serving"), "{said}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), serving);
    assert_eq!(history(&envoy, "admission-gate").len(), 2);
    // The gate still answers, and still counts what it admits.
    let admitted = "wasmcustom.stakegate.gate.admitted.default";
    let counted = envoy.stat(admitted).unwrap();
    let answer = stakegate_stack::http::post(
        &envoy.url("public").unwrap(),
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#,
    )
    .unwrap();
    assert_eq!(answer.status, 200);
    assert!(eventually(SETTLE, || {
        envoy.stat(admitted).unwrap() > counted
    }));
}

#[test]
fn rollback_restores_the_previous_deployment() {
    let policy = |limit: u32| format!(r#"{{"maxInflight": {limit}, {INTERNAL}}}"#);
    let (_node, envoy) = node_behind_gate(&policy(64), &[]);
    let dir = tempfile::tempdir().unwrap();
    let gate = paths::wasm_module("admission_gate").unwrap();
    let output = stakegate(&envoy, "admission-gate", None);
    assert!(!output.status.success());
    assert!(
        text(&output).contains("nothing to roll back to"),
        "{}",
        text(&output)
    );
    for limit in [64, 32] {
        let path = file(dir.path(), &format!("p{limit}.json"), policy(limit));
        deployed(&stakegate(&envoy, "admission-gate", Some((&gate, &path))));
    }
    let said = deployed(&stakegate(&envoy, "admission-gate", None));
    assert!(said.contains("rolled back from version"), "{said}");
    let deployments = history(&envoy, "admission-gate");
    assert_eq!(
        deployments.len(),
        2,
        "the startup config and the first deploy"
    );
    assert!(deployments[1]["policy"]
        .as_str()
        .unwrap()
        .contains("\"maxInflight\": 64"));
    let config = std::fs::read_to_string(envoy.ecds_dir().join("admission-gate.yaml")).unwrap();
    assert!(config.contains(r#"\"maxInflight\": 64"#), "{config}");
    let version = "extension_config_discovery.http_filter.stakegate.admission_gate.version_text";
    assert_eq!(
        envoy.admin().text(version).unwrap().as_deref(),
        Some(deployments[1]["version"].to_string().as_str())
    );
}

#[test]
fn rollback_returns_to_the_config_envoy_started_with() {
    let policy = |limit: u32| format!(r#"{{"maxInflight": {limit}, {INTERNAL}}}"#);
    let (_node, envoy) = node_behind_gate(&policy(7), &[]);
    let dir = tempfile::tempdir().unwrap();
    let gate = paths::wasm_module("admission_gate").unwrap();
    let path = file(dir.path(), "p32.json", policy(32));
    deployed(&stakegate(&envoy, "admission-gate", Some((&gate, &path))));
    deployed(&stakegate(&envoy, "admission-gate", None));
    let deployments = history(&envoy, "admission-gate");
    assert_eq!(deployments.len(), 1);
    assert_eq!(deployments[0]["startup"], true);
    assert_eq!(deployments[0]["policy"], policy(7));
    let config = std::fs::read_to_string(envoy.ecds_dir().join("admission-gate.yaml")).unwrap();
    assert!(config.contains(r#"\"maxInflight\": 7"#), "{config}");
    let output = stakegate(&envoy, "admission-gate", None);
    assert!(text(&output).contains("nothing to roll back to"));
}

/// sha256 of "key-stake-10" and "key-stake-40" (scenarios/stake-shares.toml).
const KEY_10: &str = "cd9f2d260bd52f2959aa869845529684dd8a378abe4cb14d8841f98b613b8a51";
const KEY_40: &str = "473c8f22f3caab363fb78c93e74a71a9f4668efd4b44e1ef9e737c88e712ab11";

#[test]
fn a_stake_table_change_moves_shares_within_a_second() {
    const CAPACITY: f64 = 400.0;
    let policy = |a: u64, b: u64| {
        format!(
            r#"{{"capacityRps": {CAPACITY}, "stakes": [
              {{"apiKeySha256": "{KEY_10}", "name": "a", "stake": {a}}},
              {{"apiKeySha256": "{KEY_40}", "name": "b", "stake": {b}}}]}}"#
        )
    };
    let (_node, envoy) = node_behind_filter(
        "qos.yaml",
        qos_filter(&policy(10_000_000, 10_000_000)),
        &["--read-slots", "64"],
    );
    let dir = tempfile::tempdir().unwrap();
    let module = paths::wasm_module("stake_qos").unwrap();
    let after = file(dir.path(), "after.json", policy(10_000_000, 40_000_000));
    let clients: Vec<ClientSpec> = [("a", "key-stake-10"), ("b", "key-stake-40")]
        .into_iter()
        .map(|(id, key)| ClientSpec {
            api_key: Some(key.into()),
            ..client(id, CAPACITY, "eth_call", 100_000)
        })
        .collect();
    let duration = Duration::from_secs(8);
    let spec = load_h2(&envoy.url("public").unwrap(), clients, duration, 2);
    let started = Instant::now();
    let load = std::thread::spawn(move || loadgen::run(&spec).unwrap());
    // The deploy lands mid-run: four seconds of shares before it.
    std::thread::sleep(Duration::from_secs(4));
    eprint!(
        "{}",
        deployed(&stakegate(&envoy, "stake-qos", Some((&module, &after))))
    );
    let confirmed = started.elapsed();
    let report = load.join().unwrap();
    let share_of_b = |second: usize| {
        let ok = |c: usize| report.clients[c].timeline[second].ok as f64;
        ok(1) / (ok(0) + ok(1))
    };
    let before = share_of_b(2);
    // The first whole second of the run after Envoy confirmed the change.
    let first = confirmed.as_secs_f64().ceil() as usize;
    let shares: Vec<String> = (0..8).map(|s| format!("{:.3}", share_of_b(s))).collect();
    eprintln!("b's share by second {shares:?}; the deploy was confirmed at {confirmed:?}");
    assert!(
        (before - 0.5).abs() <= 0.05,
        "equal stakes: b had {before:.3}"
    );
    for second in first..8 {
        let share = share_of_b(second);
        assert!(
            (share - 0.8).abs() <= 0.05,
            "second {second}: b had {share:.3}, its stake is 80 %"
        );
    }
}
