//! `stakegate deploy` and `rollback` without an Envoy: what they refuse
//! before anything changes. (With a real Envoy: tests/real_envoy/deploy.rs.)

use std::path::Path;
use std::process::{Command, Output};

fn stakegate(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stakegate"))
        .args(args)
        .arg("--dir")
        .arg(dir)
        // Nothing listens on the discard port.
        .args(["--admin", "http://127.0.0.1:9"])
        .output()
        .unwrap()
}

fn said(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn an_unreachable_envoy_changes_nothing() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let gate = root.join("target/wasm32-wasip1/release/admission_gate.wasm");
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, r#"{"maxInflight": 8}"#).unwrap();
    let output = stakegate(
        &[
            "deploy",
            "--filter",
            "admission-gate",
            "--module",
            gate.to_str().unwrap(),
            "--policy",
            policy.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert!(!output.status.success());
    assert!(
        said(&output).contains("nothing was changed"),
        "{}",
        said(&output)
    );
    assert!(!dir.path().join("admission-gate.yaml").exists());
}

#[test]
fn rollback_needs_two_deployments_and_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let output = stakegate(&["rollback", "--filter", "stake-qos"], dir.path());
    assert!(!output.status.success());
    assert!(
        said(&output).contains("nothing to roll back to: stake-qos has 0 deployment(s)"),
        "{}",
        said(&output)
    );
    let output = stakegate(
        &["rollback", "--filter", "stake-qos"],
        &dir.path().join("missing"),
    );
    assert!(
        said(&output).contains("--dir must be the ECDS directory Envoy watches"),
        "{}",
        said(&output)
    );
    let output = stakegate(&["rollback", "--filter", "nginx"], dir.path());
    assert!(
        said(&output).contains("possible values: admission-gate, stake-qos"),
        "{}",
        said(&output)
    );
}

/// The README's fleet recipe: `stakegate init --fleet` with a QoS policy
/// holding `"fleet": {}` (each replica named at start by
/// `--service-node`), checked offline as a deploy checks it.
#[test]
fn init_takes_the_readmes_fleet_recipe() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    let qos = dir.path().join("stakes.json");
    std::fs::write(&qos, r#"{"capacityRps": 300, "fleet": {}}"#).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_stakegate"))
        .arg("init")
        .arg("--dir")
        .arg(dir.path().join("gw"))
        .args(["--node", "127.0.0.1:8545", "--fleet", "127.0.0.1:7379"])
        .arg("--qos-policy")
        .arg(&qos)
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", said(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("--service-node NAME"), "{stdout}");
    assert!(
        stdout.contains("STAKEGATE_FLEET_AUTH=user:password"),
        "{stdout}"
    );
}

/// `init` says in its directory where Envoy's admin listens, and `deploy`
/// given only `--dir` goes there (an operator who moved the admin port
/// needs no `--admin` after).
#[test]
fn deploy_finds_the_admin_init_wrote_into_the_directory() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let module = |name: &str| root.join(format!("target/wasm32-wasip1/release/{name}.wasm"));
    let dir = tempfile::tempdir().unwrap();
    let init = Command::new(env!("CARGO_BIN_EXE_stakegate"))
        .args([
            "init",
            "--node",
            "http://127.0.0.1:9",
            "--admin",
            "127.0.0.1:9",
        ])
        .arg("--dir")
        .arg(dir.path())
        .arg("--gate-module")
        .arg(module("admission_gate"))
        .arg("--qos-module")
        .arg(module("stake_qos"))
        .output()
        .unwrap();
    assert!(init.status.success(), "{}", said(&init));
    let printed = String::from_utf8_lossy(&init.stdout);
    assert!(
        printed.contains("admin:   http://127.0.0.1:9 (deploy"),
        "{printed}"
    );
    // The example policy init wrote for the operator to edit.
    let policy = dir.path().join("policies").join("stake-qos.json");
    let deploy = Command::new(env!("CARGO_BIN_EXE_stakegate"))
        .args(["deploy", "--filter", "stake-qos", "--policy"])
        .arg(&policy)
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!deploy.status.success());
    assert!(
        said(&deploy).contains("cannot read Envoy's admin at http://127.0.0.1:9"),
        "{}",
        said(&deploy)
    );
}
