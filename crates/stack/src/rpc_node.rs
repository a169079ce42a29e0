//! The mock node as a process, on a free port.

use crate::http;
use crate::paths;
use crate::process::Process;
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

#[derive(Debug)]
pub struct RpcNode {
    process: Process,
    addr: SocketAddr,
    _workdir: tempfile::TempDir,
}

impl RpcNode {
    /// Starts `rpc-node --port 0 ARGS…` and waits until it serves.
    pub fn start<S: AsRef<str>>(args: &[S]) -> anyhow::Result<Self> {
        Self::start_on(0, args)
    }

    /// Starts `rpc-node --port PORT ARGS…` (0: a free port) and waits until
    /// it serves; a node restarted on its old port is the same upstream.
    pub fn start_on<S: AsRef<str>>(port: u16, args: &[S]) -> anyhow::Result<Self> {
        let workdir = tempfile::Builder::new()
            .prefix("stakegate-rpc-node-")
            .tempdir()?;
        let log = workdir.path().join("rpc-node.log");
        let binary = paths::tool("rpc-node")?;
        let mut child = Command::new(&binary)
            .args(["--port", &port.to_string()])
            .args(args.iter().map(AsRef::as_ref))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stdout = child.stdout.take().context("rpc-node stdout")?;
        let mut process = Process::new("rpc-node", child, log);

        // The first stdout line names the bound address. Read it on a thread
        // so a node that never prints cannot hang the caller.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) if !line.is_empty() => line,
            _ => {
                process.stop(Duration::from_secs(1));
                bail!("rpc-node did not start:\n{}", process.log_tail(40));
            }
        };
        let addr = line
            .trim()
            .strip_prefix("rpc-node listening on ")
            .with_context(|| format!("unexpected first line from rpc-node: {line:?}"))?
            .parse()?;
        let node = Self {
            process,
            addr,
            _workdir: workdir,
        };
        let health = http::get(&format!("http://{addr}/health"))?;
        if health.status != 200 {
            bail!("rpc-node /health answered {}", health.status);
        }
        Ok(node)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// The node's `/metrics` document.
    pub fn metrics(&self) -> anyhow::Result<serde_json::Value> {
        metrics(&format!("http://{}", self.addr))
    }

    /// Starts a new measurement window on the node.
    pub fn reset_metrics(&self) -> anyhow::Result<()> {
        reset_metrics(&format!("http://{}", self.addr))
    }

    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// The `/metrics` document of the rpc-node at `base` (`http://host:port`),
/// one this harness started or not.
pub fn metrics(base: &str) -> anyhow::Result<serde_json::Value> {
    http::get(&format!("{base}/metrics"))?.json()
}

/// Starts a new measurement window on the rpc-node at `base`.
pub fn reset_metrics(base: &str) -> anyhow::Result<()> {
    let answer = http::post(&format!("{base}/metrics/reset"), &[], "")?;
    if answer.status != 204 {
        bail!("rpc-node reset answered {}", answer.status);
    }
    Ok(())
}
