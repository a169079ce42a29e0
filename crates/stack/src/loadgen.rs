//! The load generator as a process: the optimised binary keeps its schedule
//! whatever build the caller is (tests run unoptimised).

use crate::paths;
use anyhow::{bail, Context};
use stakegate_loadgen::{Report, RunSpec};
use std::process::Command;

/// Runs `loadgen` with `spec` and returns its report.
pub fn run(spec: &RunSpec) -> anyhow::Result<Report> {
    spec.validate()?;
    let dir = tempfile::tempdir()?;
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, serde_json::to_vec(&spec.clients)?)?;
    let mut command = Command::new(paths::tool("loadgen")?);
    command
        .args(["--target", &spec.target])
        .args(["--duration", &format!("{}ms", spec.duration.as_millis())])
        .args(["--max-requests", &spec.max_requests.to_string()])
        .args(["--timeout", &format!("{}ms", spec.timeout.as_millis())])
        .arg("--clients-file")
        .arg(&clients);
    if spec.http2 {
        command.arg("--http2");
        command.args(["--connections", &spec.connections.to_string()]);
    }
    let output = command.output().context("running loadgen")?;
    if !output.status.success() {
        bail!(
            "loadgen failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).context("loadgen printed no JSON report")
}
