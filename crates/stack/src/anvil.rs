//! anvil, Foundry's local Ethereum node (npm `@foundry-rs/anvil-linux-amd64`),
//! as a process on a free port: the real node that client libraries are
//! tested against.

use crate::http;
use crate::paths;
use crate::process::Process;
use anyhow::{bail, Context};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Anvil {
    process: Process,
    addr: SocketAddr,
    _workdir: tempfile::TempDir,
}

impl Anvil {
    /// Starts `anvil --port 0` and waits until it answers JSON-RPC.
    pub fn start() -> anyhow::Result<Self> {
        let workdir = tempfile::Builder::new()
            .prefix("stakegate-anvil-")
            .tempdir()?;
        let log = workdir.path().join("anvil.log");
        let binary = paths::clients_dir()?.join("node_modules/.bin/anvil");
        let child = Command::new(&binary)
            .args(["--port", "0", "--host", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut process = Process::new("anvil", child, log);
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            let log = process.log();
            if let Some(addr) = log
                .lines()
                .find_map(|l| l.strip_prefix("Listening on "))
                .and_then(|a| a.trim().parse().ok())
            {
                break addr;
            }
            if process.exited().is_some() || Instant::now() > deadline {
                process.stop(Duration::from_secs(1));
                bail!("anvil did not start:\n{}", process.log_tail(40));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let anvil = Self {
            process,
            addr,
            _workdir: workdir,
        };
        anvil.call("eth_chainId", "[]")?;
        Ok(anvil)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Calls `method` with `params` (JSON) straight at anvil; its result.
    pub fn call(&self, method: &str, params: &str) -> anyhow::Result<serde_json::Value> {
        let body = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"{method}","params":{params}}}"#);
        let answer = http::post(&format!("http://{}", self.addr), &[], &body)?.json()?;
        match answer.get("result") {
            Some(result) => Ok(result.clone()),
            None => bail!("{method}: {answer}"),
        }
    }
}
