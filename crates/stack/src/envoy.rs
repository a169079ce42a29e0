//! A real Envoy, started from a config template on free ports.
//!
//! Templates under `envoy-config/` use `{{NAME}}` placeholders. Every
//! `*_PORT` placeholder not given defaults to 0, so the kernel picks a free
//! port with no race; the real ports are then read back from the admin
//! `/listeners` endpoint, and the admin address from `--admin-address-path`.

use crate::admin::Admin;
use crate::ecds::{self, EcdsUpdate, FilterConfig};
use crate::http;
use crate::paths;
use crate::process::Process;
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long Envoy may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct EnvoyBuilder {
    template: PathBuf,
    vars: BTreeMap<String, String>,
    concurrency: u32,
    extra_args: Vec<String>,
    filters: Vec<FilterConfig>,
    /// Environment variables of Envoy's process.
    env: Vec<(String, String)>,
}

impl EnvoyBuilder {
    /// `template` is a path, or a file name under `envoy-config/`.
    pub fn new(template: impl AsRef<Path>) -> Self {
        let template = template.as_ref();
        let template = if template.is_absolute() || template.exists() {
            template.to_path_buf()
        } else {
            paths::envoy_config(&template.to_string_lossy())
        };
        Self {
            template,
            // Listeners stay on loopback unless a run says otherwise, and
            // so does fleet mode's Webdis (on its default port).
            vars: [
                ("LISTEN_ADDRESS", "127.0.0.1"),
                ("ADMIN_ADDRESS", "127.0.0.1"),
                ("FLEET_HOST", "127.0.0.1"),
                ("FLEET_PORT", "7379"),
            ]
            .into_iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect(),
            concurrency: 2,
            extra_args: Vec::new(),
            filters: Vec::new(),
            env: Vec::new(),
        }
    }

    /// A Wasm filter to serve through file-based ECDS (`{{ECDS_DIR}}`).
    pub fn filter(mut self, config: FilterConfig) -> Self {
        self.filters.push(config);
        self
    }

    pub fn var(mut self, name: &str, value: impl ToString) -> Self {
        self.vars.insert(name.to_string(), value.to_string());
        self
    }

    /// Envoy worker threads (`--concurrency`).
    pub fn concurrency(mut self, workers: u32) -> Self {
        self.concurrency = workers;
        self
    }

    /// Sets an environment variable of Envoy's process.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    /// Points the `stakegate_fleet` cluster at `engine`'s Webdis and gives
    /// stake QoS its credentials.
    pub fn fleet(self, engine: &crate::FleetEngine) -> Self {
        self.var("FLEET_PORT", engine.addr().port())
            .env(stakegate_core::qos::fleet::AUTH_ENV, engine.credentials())
    }

    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Renders the template with this builder's variables.
    pub fn render(&self) -> anyhow::Result<String> {
        let text = std::fs::read_to_string(&self.template)
            .with_context(|| format!("reading {}", self.template.display()))?;
        render(&text, &self.vars).with_context(|| format!("rendering {}", self.template.display()))
    }

    pub fn start(mut self) -> anyhow::Result<Envoy> {
        let workdir = tempfile::Builder::new()
            .prefix("stakegate-envoy-")
            .tempdir()?;
        let ecds_dir = workdir.path().join("ecds");
        std::fs::create_dir(&ecds_dir)?;
        for filter in &self.filters {
            filter.write_both(&ecds_dir, "1")?;
        }
        self.vars
            .insert("ECDS_DIR".into(), ecds_dir.to_string_lossy().into_owned());
        let config = workdir.path().join("envoy.yaml");
        std::fs::write(&config, self.render()?)?;
        let admin_path = workdir.path().join("admin-address");
        let log = workdir.path().join("envoy.log");
        let log_file = std::fs::File::create(&log)?;
        let binary = paths::envoy_binary()?;
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .args(["--concurrency", &self.concurrency.to_string()])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--disable-hot-restart", "--log-level", "info"])
            .args(&self.extra_args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut envoy = Envoy {
            process: Process::new("envoy", child, log),
            admin: String::new(),
            listeners: BTreeMap::new(),
            config,
            ecds_dir,
            ecds_version: 1,
            _workdir: workdir,
        };
        envoy.wait_ready(&admin_path)?;
        Ok(envoy)
    }
}

/// How the listeners of `direct_response` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// At once (a `direct_response` route).
    Itself,
    /// Through a listener of the same Envoy as the upstream (cluster
    /// `rpc_node`), as a gateway passes requests to its node.
    Upstream,
}

/// `envoy-config/bench/direct.yaml` with one listener per `(name,
/// http_filters)`: Envoy answering by itself behind each filter chain, at
/// once or through its own upstream listener. The Wasm filters among them
/// still have to be given to the builder.
pub fn direct_response(listeners: &[(&str, &str)], answer: Answer) -> anyhow::Result<EnvoyBuilder> {
    let route = match answer {
        Answer::Itself => {
            r#"                direct_response:
                  status: 200
                  body: { inline_string: '{"jsonrpc":"2.0","id":1,"result":"0x1"}' }"#
        }
        // The rate limits are read only by Envoy's rate-limit filter (the
        // bench's envoyproxy/ratelimit chain).
        Answer::Upstream => {
            "                route: { cluster: rpc_node, timeout: 60s, rate_limits: [{ actions: [{ remote_address: {} }] }] }"
        }
    };
    let path = paths::envoy_config("bench/listener.yaml");
    let template =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let blocks: Vec<String> = listeners
        .iter()
        .map(|(name, filters)| {
            template
                .replace("{{LISTENER_NAME}}", name)
                .replace("{{HTTP_FILTERS}}", filters)
                .replace("{{ROUTE_ACTION}}", route)
        })
        .collect();
    // The upstream listener's port is fixed before Envoy starts: its
    // cluster names it.
    let upstream = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    Ok(EnvoyBuilder::new("bench/direct.yaml")
        .var("LISTENERS", blocks.join("\n"))
        .var("UPSTREAM_PORT", upstream)
        .var("EXTRA_CLUSTERS", ""))
}

/// Replaces `{{NAME}}` placeholders. Unset `*_PORT` placeholders become 0;
/// any other unset placeholder is an error naming it. A value may itself
/// hold placeholders (a block of config naming `{{ECDS_DIR}}`): they are
/// filled from the same variables, one level deep.
pub fn render(text: &str, vars: &BTreeMap<String, String>) -> anyhow::Result<String> {
    let mut filled = vars.clone();
    for (name, value) in filled.iter_mut() {
        if value.contains("{{") {
            let mut others = vars.clone();
            others.remove(name);
            *value = render_once(value, &others)?;
        }
    }
    render_once(text, &filled)
}

fn render_once(text: &str, vars: &BTreeMap<String, String>) -> anyhow::Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut missing = Vec::new();
    while let Some(open) = rest.find("{{") {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find("}}") else {
            bail!("unclosed {{{{ placeholder");
        };
        let name = rest[open + 2..open + close].trim();
        match vars.get(name) {
            Some(value) => out.push_str(value),
            None if name.ends_with("_PORT") => out.push('0'),
            None => missing.push(name.to_string()),
        }
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    if !missing.is_empty() {
        bail!("no value for placeholder(s): {}", missing.join(", "));
    }
    Ok(out)
}

#[derive(Debug)]
pub struct Envoy {
    process: Process,
    admin: String,
    listeners: BTreeMap<String, SocketAddr>,
    config: PathBuf,
    ecds_dir: PathBuf,
    ecds_version: u64,
    _workdir: tempfile::TempDir,
}

impl Envoy {
    fn wait_ready(&mut self, admin_path: &Path) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.process.exited() {
                bail!(
                    "Envoy exited ({status}) before it was ready:\n{}",
                    self.problems()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "Envoy was not ready within {READY_TIMEOUT:?}:\n{}",
                    self.problems()
                );
            }
            if self.admin.is_empty() {
                if let Ok(addr) = std::fs::read_to_string(admin_path) {
                    if !addr.trim().is_empty() {
                        self.admin = format!("http://{}", addr.trim());
                    }
                }
            }
            if !self.admin.is_empty() {
                if let Ok(answer) = http::get(&format!("{}/ready", self.admin)) {
                    if answer.status == 200 {
                        break;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.listeners = self.read_listeners()?;
        Ok(())
    }

    /// Envoy's warnings and errors, or the end of its log if it has none.
    fn problems(&self) -> String {
        let log = self.process.log();
        let problems: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.contains("][critical][") || l.contains("][error][") || l.contains("][warning][")
            })
            .collect();
        if problems.is_empty() {
            self.process.log_tail(60)
        } else {
            problems.join("\n")
        }
    }

    fn read_listeners(&self) -> anyhow::Result<BTreeMap<String, SocketAddr>> {
        let doc = http::get(&format!("{}/listeners?format=json", self.admin))?.json()?;
        let mut listeners = BTreeMap::new();
        for status in doc["listener_statuses"].as_array().into_iter().flatten() {
            let name = status["name"].as_str().unwrap_or_default();
            let socket = &status["local_address"]["socket_address"];
            let (Some(address), Some(port)) =
                (socket["address"].as_str(), socket["port_value"].as_u64())
            else {
                continue;
            };
            listeners.insert(name.to_string(), format!("{address}:{port}").parse()?);
        }
        Ok(listeners)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The admin base URL, e.g. `http://127.0.0.1:40123`.
    pub fn admin_url(&self) -> &str {
        &self.admin
    }

    /// The address a named listener actually bound.
    pub fn listener(&self, name: &str) -> anyhow::Result<SocketAddr> {
        self.listeners.get(name).copied().with_context(|| {
            format!(
                "no listener {name:?}; Envoy has {:?}",
                self.listeners.keys().collect::<Vec<_>>()
            )
        })
    }

    /// `http://ADDR/` for a named listener.
    pub fn url(&self, listener: &str) -> anyhow::Result<String> {
        Ok(format!("http://{}/", self.listener(listener)?))
    }

    /// The admin API.
    pub fn admin(&self) -> Admin {
        Admin::new(&self.admin)
    }

    /// Counters and gauges from the admin `/stats`, by name.
    pub fn stats(&self) -> anyhow::Result<BTreeMap<String, i64>> {
        self.admin().stats()
    }

    /// One counter or gauge; 0 if Envoy has not created it yet.
    pub fn stat(&self, name: &str) -> anyhow::Result<i64> {
        self.admin().stat(name)
    }

    /// Replaces a filter's ECDS config (atomically) and waits until Envoy
    /// has applied or rejected it. Returns Envoy's verdict.
    pub fn update_filter(&mut self, config: &FilterConfig) -> anyhow::Result<EcdsUpdate> {
        self.ecds_version += 1;
        let version = self.ecds_version.to_string();
        let verdict = ecds::apply(
            &self.admin(),
            &self.ecds_dir,
            config,
            &version,
            READY_TIMEOUT,
        )?;
        Ok(verdict.update)
    }

    /// The directory Envoy watches for filter configs (file-based ECDS).
    pub fn ecds_dir(&self) -> &Path {
        &self.ecds_dir
    }

    /// Envoy's log file (its stdout and stderr).
    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    pub fn config_path(&self) -> &Path {
        &self.config
    }

    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Print Envoy's log when this handle is dropped, even without a panic.
    pub fn show_log_on_drop(&mut self) {
        self.process.show_log_on_drop = true;
    }
}

/// Runs `envoy --mode validate` on a rendered template; returns Envoy's
/// output on failure.
pub fn validate(builder: &EnvoyBuilder) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut builder = builder.clone();
    for filter in &builder.filters {
        filter.write_both(dir.path(), "1")?;
    }
    builder
        .vars
        .insert("ECDS_DIR".into(), dir.path().to_string_lossy().into_owned());
    let config = dir.path().join("envoy.yaml");
    std::fs::write(&config, builder.render()?)?;
    let output = Command::new(paths::envoy_binary()?)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&config)
        .output()?;
    if !output.status.success() {
        bail!(
            "envoy --mode validate rejected {}:\n{}{}",
            builder.template.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn placeholders_are_replaced_and_ports_default_to_zero() {
        let text = "port: {{PUBLIC_PORT}} host: {{ RPC_NODE_HOST }}:{{RPC_NODE_PORT}}";
        let out = render(
            text,
            &vars(&[("RPC_NODE_HOST", "127.0.0.1"), ("RPC_NODE_PORT", "8545")]),
        )
        .unwrap();
        assert_eq!(out, "port: 0 host: 127.0.0.1:8545");
    }

    #[test]
    fn a_value_may_name_other_placeholders() {
        let out = render(
            "filters: {{FILTERS}}",
            &vars(&[("FILTERS", "path {{DIR}}/a.yaml"), ("DIR", "/tmp/x")]),
        )
        .unwrap();
        assert_eq!(out, "filters: path /tmp/x/a.yaml");
    }

    #[test]
    fn missing_placeholders_are_named() {
        let err = render("{{A}} {{B_PORT}} {{C}}", &vars(&[])).unwrap_err();
        assert_eq!(err.to_string(), "no value for placeholder(s): A, C");
    }
}
