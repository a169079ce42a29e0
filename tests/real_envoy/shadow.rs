//! Shadow deploys in the whole gateway (envoy-config/gateway.yaml): a
//! candidate stake QoS policy decides every request beside the live one
//! and refuses none; `stakegate shadow` compares them; an automatic
//! promotion over budget drops the candidate, one within it makes it live
//! (and `rollback` undoes that).

use serde_json::json;
use stakegate_loadgen::ClientSpec;
use stakegate_stack::{loadgen, paths, Envoy};
use stakegate_tests::{
    client, eventually, example_policy, gate_filter, load_h2, node_behind_filters, qos_filter,
    SETTLE,
};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Two staked clients at 150 requests a second each.
fn staked_pair() -> Vec<ClientSpec> {
    let staked = |id: &str, key: &str| ClientSpec {
        api_key: Some(key.into()),
        ..client(id, 150.0, "eth_call", 64)
    };
    vec![staked("a", "key-stake-10"), staked("b", "key-stake-40")]
}

/// What `during` returns, run while `clients` send to `envoy` (one-second
/// runs, until it returns, at most two minutes), and the runs' reports: a
/// load that outlasts a command however slowly the machine runs it.
fn loaded<T>(
    envoy: &Envoy,
    clients: Vec<ClientSpec>,
    during: impl FnOnce() -> T,
) -> (T, Vec<stakegate_loadgen::Report>) {
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let url = envoy.url("public").unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            let second = Duration::from_secs(1);
            (0..120)
                .take_while(|_| !stop.load(Ordering::Relaxed))
                .map(|_| loadgen::run(&load_h2(&url, clients.clone(), second, 2)).unwrap())
                .collect()
        });
        let out = {
            let _stop = Stop(&stop);
            during()
        };
        (out, load.join().unwrap())
    })
}

/// `deploy --shadow` of `policy`, promoted or dropped after a 3 s watch
/// under load.
fn watched(envoy: &Envoy, policy: &Path) -> Output {
    let module = paths::wasm_module("stake_qos").unwrap();
    let (module, policy) = (module.to_str().unwrap(), policy.to_str().unwrap());
    let args = ["deploy", "--shadow", "--module", module, "--policy", policy];
    let args = [&args[..], &["--promote-after", "3s"]].concat();
    loaded(envoy, staked_pair(), || stakegate(envoy, &args)).0
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
    let (compared, reports) = loaded(&envoy, staked_pair(), || {
        reading(&envoy, &["shadow", "--json", "--interval", "3s"])
            .output()
            .unwrap()
    });
    // It refused nothing: every request was answered by the node.
    for report in reports {
        assert_eq!(
            report.count("200"),
            report.clients.iter().map(|c| c.header.sent).sum::<u64>()
        );
    }
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

/// A quiet day: a staked key at 50 requests a second and an anonymous
/// client at 30, 80 of the live policy's 1,600 (5 %).
fn quiet_clients() -> Vec<ClientSpec> {
    vec![
        ClientSpec {
            api_key: Some("key-stake-40".into()),
            ..client("staked", 50.0, "eth_call", 8)
        },
        client("anonymous", 30.0, "eth_call", 8),
    ]
}

/// `quiet_clients` for `seconds`.
fn quiet_day(envoy: &Envoy, seconds: u64) -> std::thread::JoinHandle<stakegate_loadgen::Report> {
    let url = envoy.url("public").unwrap();
    let duration = Duration::from_secs(seconds);
    std::thread::spawn(move || loadgen::run(&load_h2(&url, quiet_clients(), duration, 2)).unwrap())
}

/// `stakegate ARGS --admin` (the commands that read a gateway, not write it).
fn reading(envoy: &Envoy, args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(paths::tool("stakegate").unwrap());
    command.args(args).args(["--admin", envoy.admin_url()]);
    command
}

#[test]
fn on_a_quiet_gateway_usage_top_and_a_shadow_name_who_sends_what() {
    let (_node, envoy) = node_behind_filters(
        "gateway.yaml",
        vec![
            qos_filter(&example_policy("stake-qos", json!({}))),
            gate_filter(&example_policy(
                "admission-gate",
                json!({ "maxInflight": 64 }),
            )),
        ],
        &["--read-slots", "64", "--cost", "eth_call=1ms"],
    );
    // usage and top, at the example policy's defaults (far below capacity,
    // QoS only counts): the staked key by its name, with its calls, the
    // anonymous client as unidentified, and the request rate as sent.
    // `top` watches 3 s from when the ledger shows the load running (its
    // window inside the load's 10 s however slowly the load starts).
    let running = quiet_day(&envoy, 10);
    let staked_row = || -> serde_json::Value {
        let out = reading(&envoy, &["usage", "--json"]).output().unwrap();
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        let row = rows.iter().find(|r| r["identity"] == "stake-40");
        row.cloned().unwrap_or_default()
    };
    assert!(eventually(SETTLE, || staked_row()["calls"]
        .as_u64()
        .is_some_and(|calls| calls > 0)));
    let top = reading(&envoy, &["top", "--once", "--interval", "3s"])
        .output()
        .unwrap();
    let report = running.join().unwrap();
    let top = String::from_utf8(top.stdout).unwrap();
    eprintln!("{top}");
    let rate: f64 = top
        .strip_prefix("qos   requests ")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("{top}"))
        .parse()
        .unwrap();
    assert!((rate - 80.0).abs() <= 8.0, "{rate}/s for 80/s sent: {top}");
    assert!(top.lines().any(|l| l.starts_with("stake-40 ")), "{top}");
    assert!(top.lines().any(|l| l.starts_with("unidentified ")), "{top}");
    let sent = report.client("staked").unwrap().header.sent;
    assert!(
        eventually(SETTLE, || staked_row()["calls"] == sent),
        "stake-40 sent {sent}: {}",
        staked_row()
    );

    // A candidate 40 times stricter: the report names whom it would refuse,
    // as many as its own counters say, the anonymous client too (the live
    // policy counts it as unidentified).
    let dir = tempfile::tempdir().unwrap();
    let strict = policy_file(dir.path(), "strict.json", 40);
    let module = paths::wasm_module("stake_qos").unwrap();
    let (module, strict) = (module.to_str().unwrap(), strict.to_str().unwrap());
    let args = ["deploy", "--shadow", "--module", module, "--policy", strict];
    let out = stakegate(&envoy, &args);
    assert!(out.status.success(), "{}", text(&out));
    let refused_by_shadow = |tier: &str| shadow_stat(&envoy, &format!("throttled.{tier}"));
    let before = [refused_by_shadow("gold"), refused_by_shadow("unstaked")];
    // The comparison's interval holds the whole load: it starts once the
    // command has read the ledgers (it says no candidate has counted
    // anything yet), and ends seconds after the load.
    let mut compare = reading(&envoy, &["shadow", "--json", "--interval", "9s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(compare.stderr.take().unwrap()),
        &mut said,
    )
    .unwrap();
    assert!(said.contains("has counted anything yet"), "{said}");
    quiet_day(&envoy, 4).join().unwrap();
    let out = compare.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("{}", serde_json::to_string(&rows).unwrap());
    let row = |id: &str| rows.iter().find(|r| r["identity"] == id).cloned();
    assert!(
        row("unidentified").is_some(),
        "the live policy only counted: {rows:?}"
    );
    let staked = row("stake-40").expect("the staked key by its name");
    assert_eq!(staked["staked"], true);
    let anonymous = row("unstaked:127.0.0.1/32").expect("the anonymous client by its address");
    let after = [refused_by_shadow("gold"), refused_by_shadow("unstaked")];
    for (row, (before, after)) in [staked, anonymous].iter().zip(before.iter().zip(after)) {
        let counted = (after - before) as f64;
        let reported = row["wouldRefuse"].as_f64().unwrap();
        assert!(counted > 0.0, "{row}");
        assert!(
            (reported - counted).abs() <= 0.01 * counted,
            "{row}: the shadow counted {counted}"
        );
    }

    // Promoted automatically? It would refuse the staked key: dropped, and
    // the reason names it. The load outlasts the deploy and its 5 s watch
    // (the staked key's 250 requests, well over the 100 a verdict needs).
    let auto = [
        &args[..],
        &["--promote-after", "5s", "--max-extra-refusals", "1"],
    ]
    .concat();
    let (out, _) = loaded(&envoy, quiet_clients(), || stakegate(&envoy, &auto));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("was dropped: staked identities would be refused")
            && text(&out).contains("stake-40 "),
        "{}",
        text(&out)
    );
}
