//! The README's quick start ("Start from nothing"), run as written against
//! anvil: the lines between `<!-- quickstart -->` and `<!-- /quickstart -->`,
//! from the project root, in bash, with `$HOME` a temp directory.
//!
//! Two changes only, so that the test needs no fixed port: `make setup
//! build` is left out (`make test` ran both before this test), and the
//! ports are free ones (anvil's for 8545; the listeners' and the admin's
//! given to `init` and `deploy` as flags).

use stakegate_stack::anvil::Anvil;
use stakegate_stack::paths;
use std::net::TcpListener;
use std::process::Command;

/// The quick start's lines, from the README.
fn quickstart() -> Vec<String> {
    let readme = std::fs::read_to_string(paths::project_root().join("README.md")).unwrap();
    let (_, rest) = readme.split_once("<!-- quickstart -->").unwrap();
    let (block, _) = rest.split_once("<!-- /quickstart -->").unwrap();
    block
        .lines()
        .filter(|line| !line.starts_with("```") && !line.trim().is_empty())
        .map(str::to_string)
        .collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn the_readme_quick_start_serves_a_call_and_takes_a_deploy() {
    let lines = quickstart();
    assert_eq!(lines[0], "make setup build", "{lines:?}");
    let anvil = Anvil::start().unwrap();
    let (public, internal, admin) = (free_port(), free_port(), free_port());
    let script: Vec<String> = lines[1..]
        .iter()
        .map(|line| {
            let line = line
                .replace("localhost:8545", &format!("localhost:{}", anvil.addr().port()))
                .replace("127.0.0.1:8080", &format!("127.0.0.1:{public}"));
            if line.contains("stakegate init") {
                format!(
                    "{line} --public-port {public} --internal-port {internal} --admin 127.0.0.1:{admin}"
                )
            } else if line.contains("stakegate deploy") {
                format!("{line} --admin http://127.0.0.1:{admin}")
            } else {
                line
            }
        })
        .collect();
    let home = tempfile::tempdir().unwrap();
    // Its own process group, so that the Envoy it starts in the background
    // is stopped with it.
    let mut bash = Command::new("bash");
    bash.arg("-ec")
        .arg(script.join("\n"))
        .current_dir(paths::project_root())
        .env("HOME", home.path());
    std::os::unix::process::CommandExt::process_group(&mut bash, 0);
    let child = bash
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let group = child.id();
    let output = child.wait_with_output().unwrap();
    let dir = home.path().join("stakegate");
    // Read before Envoy is stopped (it logs the SIGTERM as a warning).
    let log = std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
    let _ = Command::new("kill")
        .args(["--", &format!("-{group}")])
        .status();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(
        output.status.success(),
        "{script:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    // init dialled the address anvil answers on, not `localhost`.
    let config = std::fs::read_to_string(dir.join("envoy.yaml")).unwrap();
    assert!(
        config.contains(&format!(
            "address: 127.0.0.1, port_value: {}",
            anvil.addr().port()
        )),
        "{stdout}"
    );
    // key-hash, the call through the gateway, the deploy.
    assert!(
        stdout
            .lines()
            .any(|l| l.len() == 64 && l.bytes().all(|b| b.is_ascii_hexdigit())),
        "{stdout}"
    );
    assert!(
        stdout.contains(r#"{"jsonrpc":"2.0","id":1,"result":"0x"#),
        "{stdout}"
    );
    assert!(stdout.contains("deployed stake-qos version 2"), "{stdout}");
    // The example policies are in the gateway's directory to edit.
    for policy in ["stake-qos.json", "admission-gate.json"] {
        assert!(dir.join("policies").join(policy).is_file(), "{policy}");
    }
    // Envoy said nothing alarming about the config init wrote.
    let alarms: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("][warning][") || l.contains("][error][") || l.contains("][critical][")
        })
        .collect();
    assert!(alarms.is_empty(), "{alarms:#?}");
}
