//! Fleet mode's engine as processes: Redis (Debian's `redis-server`) on a
//! Unix socket of its own, and Webdis (Debian's `webdis`) in front of it on
//! a free loopback port. Redis can be stopped and started again on the same
//! socket, as an outage; Webdis reconnects by itself. envoyproxy/ratelimit
//! can run beside it, on a Redis of its own, for the benchmark that
//! compares the two ways to it.
//!
//! Two locks keep the engine the fleet's own. Webdis runs `EVALSHA` (and
//! `PING`) only for the gateways' credentials. Redis's ACL (`redis_acl`)
//! lets Webdis's account (Redis's `default` user, the one Webdis 0.1.9
//! authenticates as) run only `EVALSHA`, `PING`, and the commands the
//! fleet's script calls, on the fleet's keys only (`*:members`,
//! `*:report:*`); scripts are loaded by an admin user (`SCRIPT LOAD` of
//! `fleet::SCRIPT` after each start of Redis), so a holder of the
//! gateways' credentials can run the fleet's script and nothing else.

use crate::http;
use crate::process::Process;
use anyhow::{bail, Context};
use std::io::{BufRead, Read, Write};
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
/// runs `EVALSHA` (the fleet's exchange) only for the gateways, which send
/// its credentials (`credentials`); it refuses everything else, and Redis
/// lets its account run the fleet's script alone.
#[derive(Debug)]
pub struct FleetEngine {
    redis: Option<Process>,
    webdis: Process,
    addr: SocketAddr,
    credentials: String,
    /// Redis's passwords: Webdis's account, and `ADMIN_USER`'s.
    passwords: (String, String),
    dir: tempfile::TempDir,
    /// envoyproxy/ratelimit's own Redis, if it runs.
    ratelimit_redis: Option<Process>,
}

/// Webdis's access rules: `PING` for anyone (health checks), `EVALSHA`
/// for whoever sends `credentials` (`user:password`), nothing else for
/// anyone (rules apply in order, a later one overriding an earlier one).
pub fn webdis_acl(credentials: &str) -> serde_json::Value {
    serde_json::json!([
        { "disabled": ["*"] },
        { "enabled": ["PING"] },
        { "http_basic_auth": credentials, "enabled": ["EVALSHA"] },
    ])
}

/// The Redis user that loads the fleet's script (and may do anything).
pub const ADMIN_USER: &str = "stakegate-admin";

/// Redis's ACL (`redis.conf` lines): the `default` user, which Webdis
/// authenticates as with `webdis_password`, may run `PING`, `EVALSHA` and
/// the commands `fleet::SCRIPT` calls, on the fleet's keys; `ADMIN_USER`,
/// with `admin_password`, anything.
pub fn redis_acl(webdis_password: &str, admin_password: &str) -> String {
    format!(
        "user default on >{webdis_password} resetkeys ~*:members ~*:report:* resetchannels -@all \
         +ping +evalsha +time +set +get +zadd +zremrangebyscore +zrange +pexpire\n\
         user {ADMIN_USER} on >{admin_password} ~* &* +@all\n"
    )
}

/// Loads the fleet's script into the Redis at `addr` (a Unix socket's
/// path, or `host:port`) as `ADMIN_USER`, checking that Redis names it as
/// the gateways do (`fleet::SCRIPT_SHA1`); tries again until `wait` has
/// passed while Redis is not there yet.
pub fn load_script(addr: &str, admin_password: &str, wait: Duration) -> anyhow::Result<()> {
    use stakegate_core::qos::fleet::{SCRIPT, SCRIPT_SHA1};
    let deadline = Instant::now() + wait;
    let auth = ["AUTH", ADMIN_USER, admin_password];
    let sha = loop {
        match command(addr, &[&auth[..], &["SCRIPT", "LOAD", SCRIPT]]) {
            Ok(sha) => break sha,
            Err(e) if Instant::now() < deadline && e.downcast_ref::<std::io::Error>().is_some() => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(e.context(format!("loading the fleet's script into Redis at {addr}")))
            }
        }
    };
    anyhow::ensure!(
        sha == SCRIPT_SHA1,
        "Redis names the fleet's script {sha}, the gateways ask for {SCRIPT_SHA1}"
    );
    Ok(())
}

/// Commands on one new connection to the Redis at `addr` (a Unix
/// socket's path, or `host:port`): the last one's answer, a simple string
/// or bulk string; or the first error Redis gave.
fn command(addr: &str, commands: &[&[&str]]) -> anyhow::Result<String> {
    if addr.contains('/') {
        let stream = std::os::unix::net::UnixStream::connect(addr)?;
        stream.set_read_timeout(Some(READY_TIMEOUT))?;
        exchange(stream, commands)
    } else {
        let stream = std::net::TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(READY_TIMEOUT))?;
        exchange(stream, commands)
    }
}

fn exchange(mut stream: impl Read + Write, commands: &[&[&str]]) -> anyhow::Result<String> {
    let mut out = Vec::new();
    for args in commands {
        out.extend(format!("*{}\r\n", args.len()).bytes());
        for arg in *args {
            out.extend(format!("${}\r\n{arg}\r\n", arg.len()).bytes());
        }
    }
    stream.write_all(&out)?;
    let mut reader = std::io::BufReader::new(stream);
    let mut answer = String::new();
    for _ in commands {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        answer = match line.split_at_checked(1) {
            Some(("+", text)) => text.to_string(),
            Some(("-", error)) => bail!("Redis: {error}"),
            Some(("$", len)) => {
                let len: usize = len.parse().context("a bulk string's length")?;
                let mut bulk = vec![0; len + 2];
                reader.read_exact(&mut bulk)?;
                bulk.truncate(len);
                String::from_utf8(bulk)?
            }
            _ => bail!("Redis answered {line:?}"),
        };
    }
    Ok(answer)
}

/// A fresh random secret (32 hex digits).
pub fn new_secret() -> String {
    new_credentials()["stakegate:".len()..].to_string()
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
        let passwords = (new_secret(), new_secret());
        let conf = dir.path().join("redis.conf");
        std::fs::write(&conf, redis_acl(&passwords.0, &passwords.1))?;
        let redis = start_redis(dir.path(), Some(&passwords.1))?;
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
                "redis_auth": passwords.0,
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
                        passwords,
                        dir,
                        ratelimit_redis: None,
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

    /// The passwords of Redis's users: Webdis's account (`default`), and
    /// `ADMIN_USER`.
    pub fn redis_passwords(&self) -> (&str, &str) {
        (&self.passwords.0, &self.passwords.1)
    }

    /// Starts envoyproxy/ratelimit (its `service_cmd` binary, at `binary`)
    /// on a Redis of its own (this one's ACL is the fleet's), with one
    /// rule: `requests_per_unit` per second for each `remote_address` of
    /// domain `stakegate`; returns it with its gRPC port once its health
    /// check answers.
    pub fn ratelimit(
        &mut self,
        binary: &Path,
        requests_per_unit: u64,
    ) -> anyhow::Result<(Process, u16)> {
        let root = self.dir.path().join("ratelimit");
        std::fs::create_dir_all(&root)?;
        self.ratelimit_redis = Some(start_redis(&root, None)?);
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
            .env("REDIS_URL", socket(&root))
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
            self.redis = Some(start_redis(self.dir.path(), Some(&self.passwords.1))?);
        }
        wait_ping(self.addr, &mut self.webdis)
    }
}

fn socket(dir: &Path) -> PathBuf {
    dir.join("redis.sock")
}

/// Starts Redis on `dir`'s socket; with `admin`, under the fleet's ACL
/// (`dir/redis.conf`), with the fleet's script loaded by `ADMIN_USER`.
fn start_redis(dir: &Path, admin: Option<&str>) -> anyhow::Result<Process> {
    let log = dir.join("redis.log");
    let mut redis = Command::new(binary("redis-server")?);
    if admin.is_some() {
        redis.arg(dir.join("redis.conf"));
    }
    let child = redis
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
    let mut process = Process::new("redis", child, log);
    let deadline = Instant::now() + READY_TIMEOUT;
    let at = socket(dir).display().to_string();
    // Up once it answers (a NOAUTH too, under the ACL).
    while command(&at, &[&["PING"]]).is_err_and(|e| !e.to_string().contains("NOAUTH")) {
        if process.exited().is_some() || Instant::now() > deadline {
            bail!("Redis did not start:\n{}", process.log_tail(20));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(admin) = admin {
        load_script(&at, admin, READY_TIMEOUT)?;
    }
    Ok(process)
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
