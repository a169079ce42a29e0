//! Fleet mode's engine as processes: Redis (Debian's `redis-server`) on a
//! Unix socket of its own, and Webdis (Debian's `webdis`) in front of it on
//! a free loopback port. Redis can be stopped and started again on the same
//! socket, as an outage; Webdis reconnects by itself. envoyproxy/ratelimit
//! can run on the same Redis, for the benchmark that compares the two ways
//! to it.

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

/// Redis and Webdis in front of it. Webdis answers `PING` to anyone and
/// runs `EVAL` (the fleet's exchange) only for the gateways, which send its
/// credentials (`credentials`); it refuses everything else.
#[derive(Debug)]
pub struct FleetEngine {
    redis: Option<Process>,
    webdis: Process,
    addr: SocketAddr,
    credentials: String,
    dir: tempfile::TempDir,
}

/// Webdis's access rules: `PING` for anyone (health checks), `EVAL` for
/// whoever sends `credentials` (`user:password`), nothing else for anyone
/// (rules apply in order, a later one overriding an earlier one).
pub fn webdis_acl(credentials: &str) -> serde_json::Value {
    serde_json::json!([
        { "disabled": ["*"] },
        { "enabled": ["PING"] },
        { "http_basic_auth": credentials, "enabled": ["EVAL"] },
    ])
}

/// Fresh credentials, `stakegate:<random>`.
pub fn new_credentials() -> String {
    use std::hash::BuildHasher;
    let random = std::collections::hash_map::RandomState::new();
    let a = random.hash_one(std::time::SystemTime::now());
    let b = random.hash_one(std::process::id());
    format!("stakegate:{a:016x}{b:016x}")
}

impl FleetEngine {
    /// Starts Redis, then Webdis on a free port, and waits until Webdis
    /// answers a PING through Redis.
    pub fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("stakegate-redis-")
            .tempdir()?;
        let redis = start_redis(dir.path())?;
        let credentials = new_credentials();
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
                "acl": webdis_acl(&credentials),
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
                        credentials,
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

    /// The credentials Webdis runs the exchange for, `user:password`.
    pub fn credentials(&self) -> &str {
        &self.credentials
    }

    /// Redis's Unix socket.
    pub fn redis_socket(&self) -> PathBuf {
        socket(self.dir.path())
    }

    /// Starts envoyproxy/ratelimit (its `service_cmd` binary, at `binary`)
    /// on this Redis, with one rule: `requests_per_unit` per second for
    /// each `remote_address` of domain `stakegate`; returns it with its gRPC
    /// port once its health check answers.
    pub fn ratelimit(
        &self,
        binary: &Path,
        requests_per_unit: u64,
    ) -> anyhow::Result<(Process, u16)> {
        let root = self.dir.path().join("ratelimit");
        let config = root.join("ratelimit/config");
        std::fs::create_dir_all(&config)?;
        std::fs::write(
            config.join("config.yaml"),
            format!(
                "domain: stakegate\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: {requests_per_unit}\n"
            ),
        )?;
        let free = || -> anyhow::Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let (grpc, http, debug) = (free()?, free()?, free()?);
        let log = root.join("ratelimit.log");
        let child = Command::new(binary)
            .env("USE_STATSD", "false")
            .env("LOG_LEVEL", "warn")
            .env("REDIS_SOCKET_TYPE", "unix")
            .env("REDIS_URL", self.redis_socket())
            .env("RUNTIME_ROOT", &root)
            .env("RUNTIME_SUBDIRECTORY", "ratelimit")
            .env("RUNTIME_WATCH_ROOT", "false")
            .env("GRPC_HOST", "127.0.0.1")
            .env("GRPC_PORT", grpc.to_string())
            .env("HOST", "127.0.0.1")
            .env("PORT", http.to_string())
            .env("DEBUG_HOST", "127.0.0.1")
            .env("DEBUG_PORT", debug.to_string())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(std::fs::File::options().append(true).open(&log)?)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut process = Process::new("ratelimit", child, log);
        let deadline = Instant::now() + READY_TIMEOUT;
        let url = format!("http://127.0.0.1:{http}/healthcheck");
        while !http::get(&url).is_ok_and(|a| a.status == 200) {
            if process.exited().is_some() || Instant::now() > deadline {
                bail!(
                    "envoyproxy/ratelimit did not become healthy:\n{}",
                    process.log_tail(20)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok((process, grpc))
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
