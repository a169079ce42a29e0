//! `stakegate docs --check` against the repository's policies/ and against
//! copies with one thing changed: each change is named.

use std::path::Path;
use std::process::Command;

/// Runs the check on a copy of the repository's `policies/` whose page
/// `file` has `from` replaced by `to`; returns whether it passed, and what
/// it printed.
fn check_with(file: &str, from: &str, to: &str) -> (bool, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let copy = tempfile::tempdir().unwrap();
    std::fs::create_dir(copy.path().join("policies")).unwrap();
    for page in ["policies/admission-gate.md", "policies/stake-qos.md"] {
        let mut text = std::fs::read_to_string(root.join(page)).unwrap();
        if page == file {
            assert!(text.contains(from), "{page} has no {from:?}");
            text = text.replacen(from, to, 1);
        }
        std::fs::write(copy.path().join(page), text).unwrap();
    }
    let output = Command::new(env!("CARGO_BIN_EXE_stakegate"))
        .args(["docs", "--check", "--root"])
        .arg(copy.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), said)
}

#[test]
fn the_docs_say_what_the_code_does() {
    let (ok, said) = check_with("policies/stake-qos.md", "", "");
    assert!(ok, "{said}");
}

#[test]
fn a_default_a_field_or_a_metric_the_docs_get_wrong_fails_the_check() {
    for (file, from, to, named) in [
        (
            "policies/admission-gate.md",
            "| `heartbeatMs` | `1000` |",
            "| `heartbeatMs` | `2000` |",
            "`heartbeatMs` has default `2000` in the docs, `1000` in the code",
        ),
        (
            "policies/stake-qos.md",
            "| `fleet.maxReplicas` | 16 |",
            "| `fleet.maxReplica` | 16 |",
            "`fleet.maxReplica` is not a field of this policy",
        ),
        (
            "policies/stake-qos.md",
            "| `stakegate.qos.leases` | counter |",
            "| `stakegate.qos.leases` | gauge |",
            "`stakegate.qos.leases` is a gauge in the docs, a counter in the code",
        ),
        (
            "policies/admission-gate.md",
            "| `stakegate.gate.dedup.unshared` | counter |",
            "| `stakegate.gate.dedup.unshare` | counter |",
            "metric `stakegate.gate.dedup.unshared` (counter) is not in its table",
        ),
    ] {
        let (ok, said) = check_with(file, from, to);
        assert!(!ok, "{to} passed");
        assert!(said.contains(named), "{to}: {said}");
    }
}
