//! `stakegate check` as an operator runs it, against the compiled gate.

use std::process::{Command, Output};

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn check(module: &std::path::Path, policy: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.json");
    std::fs::write(&policy_path, policy).unwrap();
    Command::new(env!("CARGO_BIN_EXE_stakegate"))
        .args(["check", "--module"])
        .arg(module)
        .arg("--policy")
        .arg(&policy_path)
        .output()
        .unwrap()
}

fn gate() -> std::path::PathBuf {
    root().join("target/wasm32-wasip1/release/admission_gate.wasm")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_good_policy_is_ok() {
    let example =
        std::fs::read_to_string(root().join("policies/admission-gate.example.json")).unwrap();
    let output = check(&gate(), &example);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.starts_with("ok: "), "{stdout}");
    assert!(stdout.contains("a smoke request was admitted"), "{stdout}");
}

#[test]
fn a_broken_policy_is_refused_naming_the_field_and_the_reason() {
    let output = check(&gate(), r#"{"maxInflight": 8, "reserved": 9}"#);
    assert!(!output.status.success());
    assert!(
        stderr(&output)
            .contains("policy rejected: reserved: must be less than maxInflight (8); got 9"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn a_stake_qos_cost_table_is_checked_field_by_field() {
    let qos = root().join("target/wasm32-wasip1/release/stake_qos.wasm");
    let good = check(
        &qos,
        r#"{"capacityNodeMs": 7600, "costs": {"eth_getLogs": 20}}"#,
    );
    assert!(good.status.success(), "{}", stderr(&good));
    let bad = check(
        &qos,
        r#"{"capacityNodeMs": 7600, "costs": {"eth_call": -5}}"#,
    );
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("costs.eth_call: must be between 0.001 and 1000000; got -5"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn a_gate_in_node_time_is_checked_in_the_module() {
    let good = r#"{"maxInflight": 6, "decideOnBody": true, "nodeTime": {"serviceTimeHeader": "x-node-service-us"}}"#;
    let output = check(&gate(), good);
    assert!(output.status.success(), "{}", stderr(&output));
    for (policy, says) in [
        (
            r#"{"maxInflight": 6, "nodeTime": {}}"#,
            "nodeTime: needs decideOnBody: true",
        ),
        (
            r#"{"maxInflight": 6, "reserved": 2, "decideOnBody": true, "nodeTime": {"cheapSlots": 4}}"#,
            "nodeTime.cheapSlots: must be less than maxInflight less reserved (4)",
        ),
        (
            r#"{"maxInflight": 6, "decideOnBody": true, "nodeTime": {"waitMs": 600000}}"#,
            "nodeTime.waitMs: must be between 0 and 60000",
        ),
        (
            r#"{"maxInflight": 6, "decideOnBody": true, "nodeTime": {"serviceTimeHeader": "bad header"}}"#,
            "nodeTime.serviceTimeHeader",
        ),
    ] {
        let output = check(&gate(), policy);
        assert!(!output.status.success(), "{policy}");
        assert!(
            stderr(&output).contains(says),
            "{policy}: {}",
            stderr(&output)
        );
    }
}

#[test]
fn a_module_that_is_not_proxy_wasm_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.wasm");
    std::fs::write(
        &plain,
        wat::parse_str(r#"(module (func (export "run")))"#).unwrap(),
    )
    .unwrap();
    let output = check(&plain, r#"{"maxInflight": 8}"#);
    assert!(!output.status.success());
    assert!(
        stderr(&output)
            .contains("not a proxy-wasm module: it exports none of proxy_abi_version_0_2_1"),
        "{}",
        stderr(&output)
    );

    let output = check(&root().join("README.md"), r#"{"maxInflight": 8}"#);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("not a WebAssembly module"),
        "{}",
        stderr(&output)
    );
}
