//! Fleet mode's engine as processes: Redis (Debian's `redis-server`) on a
//! Unix socket of its own, and Webdis (Debian's `webdis`) in front of it on
//! a free loopback port. Redis can be stopped and started again on the same
//! socket, as an outage; Webdis reconnects by itself.

use crate::http;
use crate::process::Process;
use anyhow::{bail, Context};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// `name` on the `PATH`.
fn binary(name: &str) -> anyhow::Result<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .with_context(|| {
            format!("{name} not found on the PATH: `make setup` installs Debian's redis-server and webdis")
        })
}

/// Redis and Webdis in front of it.
#[derive(Debug)]
pub struct FleetEngine {
    redis: Option<Process>,
    webdis: Process,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl FleetEngine {
    /// Starts Redis, then Webdis on a free port, and waits until Webdis
    /// answers a PING through Redis.
    pub fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("stakegate-redis-")
            .tempdir()?;
        let redis = start_redis(dir.path())?;
        // Webdis takes a port, not 0: a free one, tried again if another
        // process takes it first.
        let mut last = None;
        for attempt in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let config = dir.path().join(format!("webdis-{attempt}.json"));
            let log = dir.path().join(format!("webdis-{attempt}.log"));
            let settings = serde_json::json!({
                "redis_host": socket(dir.path()),
                "redis_port": 0,
                "http_host": "127.0.0.1",
                "http_port": port,
                "threads": 1,
                "daemonize": false,
                "database": 0,
                "verbosity": 3,
                "logfile": log,
            });
            std::fs::write(&config, settings.to_string())?;
            let child = Command::new(binary("webdis")?)
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting webdis")?;
            let mut webdis = Process::new("webdis", child, log);
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            match wait_ping(addr, &mut webdis) {
                Ok(()) => {
                    return Ok(Self {
                        redis: Some(redis),
                        webdis,
                        addr,
                        dir,
                    })
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("webdis did not start")))
    }

    /// Webdis's address (Envoy's `stakegate_fleet` cluster).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops Redis (Webdis stays up and answers 503).
    pub fn stop_redis(&mut self) {
        if let Some(mut redis) = self.redis.take() {
            redis.stop(Duration::from_secs(2));
        }
    }

    /// Starts Redis again, empty, on the same socket, and waits until
    /// Webdis reaches it.
    pub fn start_redis(&mut self) -> anyhow::Result<()> {
        if self.redis.is_none() {
            self.redis = Some(start_redis(self.dir.path())?);
        }
        wait_ping(self.addr, &mut self.webdis)
    }
}

fn socket(dir: &Path) -> PathBuf {
    dir.join("redis.sock")
}

fn start_redis(dir: &Path) -> anyhow::Result<Process> {
    let log = dir.join("redis.log");
    let child = Command::new(binary("redis-server")?)
        .args(["--port", "0", "--unixsocket"])
        .arg(socket(dir))
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .arg("--logfile")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    Ok(Process::new("redis", child, log))
}

/// Waits until `PING` through Webdis gets Redis's `PONG`.
fn wait_ping(addr: SocketAddr, webdis: &mut Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let url = format!("http://{addr}/PING");
    loop {
        if http::get(&url).is_ok_and(|a| a.status == 200 && a.body.contains("PONG")) {
            return Ok(());
        }
        if webdis.exited().is_some() {
            bail!("webdis exited:\n{}", webdis.log_tail(20));
        }
        if Instant::now() > deadline {
            bail!("Redis is not reachable through webdis at {addr} after {READY_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
