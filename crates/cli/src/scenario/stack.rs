//! The stack a scenario runs on: rpc-node and Envoy, either started by the
//! run (natively) or already up (the docker-compose stack).
//!
//! For compose, `stakegate scenario stack FILE --out DIR` writes what the
//! stack needs for one scenario into a shared volume: Envoy's bootstrap
//! (rendered from the same `envoy-config/` template a native run uses), the
//! filters' ECDS files, rpc-node's arguments, this binary (the containers'
//! healthcheck probe) and `stack.json`, which `scenario run --stack` reads
//! to find the parts and to check that the stack was made for the same
//! node and policies.

use super::{Filter, Scenario};
use crate::deploy::{self, Target};
use ::rpc_node::costs::Flavour;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use stakegate_stack::{http, rpc_node, Envoy, EnvoyBuilder, FilterConfig, FleetEngine, RpcNode};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Ports inside the compose network.
const NODE_PORT: u16 = 8545;
const PUBLIC_PORT: u16 = 10000;
const INTERNAL_PORT: u16 = 10001;
const ADMIN_PORT: u16 = 9901;
/// Webdis, fleet mode's way to Redis.
const WEBDIS_PORT: u16 = 7379;
/// How long `--stack` waits for the compose stack to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// `stack.json`: where the compose stack's parts are, and what it runs.
#[derive(Debug, Serialize, Deserialize)]
struct StackFile {
    scenario: String,
    node_args: Vec<String>,
    /// `(filter, policy)` in chain order.
    filters: Vec<(String, String)>,
    node_url: String,
    /// One per replica.
    gateways: Vec<GatewayFile>,
}

#[derive(Debug, Serialize, Deserialize)]
struct GatewayFile {
    public: String,
    internal: Option<String>,
    admin_url: String,
    ecds_dir: PathBuf,
}

/// One gateway replica: its listeners, admin and ECDS directory.
pub struct Gateway {
    pub public: SocketAddr,
    pub internal: Option<SocketAddr>,
    pub admin_url: String,
    ecds_dir: PathBuf,
    envoy_log: Option<PathBuf>,
}

pub struct Stack {
    node_url: String,
    gateways: Vec<Gateway>,
    /// Fleet mode's Redis and Webdis, in a native run with replicas.
    engine: Option<Mutex<FleetEngine>>,
    /// The processes of a native run (stopped on drop).
    _processes: Option<(RpcNode, Vec<Envoy>)>,
}

/// Replica `i`'s name in the fleet (its Envoy node id).
pub fn replica_name(i: usize) -> String {
    format!("gw-{}", i + 1)
}

impl Stack {
    /// Starts rpc-node and the scenario's gateway replicas on free local
    /// ports (with Redis and Webdis for fleet mode when there are several).
    pub fn start(scenario: &Scenario, concurrency: Option<u32>) -> anyhow::Result<Self> {
        let node = RpcNode::start(&node_args(scenario))?;
        let engine = if scenario.replicas > 1 {
            Some(FleetEngine::start()?)
        } else {
            None
        };
        let mut envoys = Vec::with_capacity(scenario.replicas);
        for i in 0..scenario.replicas {
            let mut builder = EnvoyBuilder::new(template(scenario)?)
                .var("RPC_NODE_HOST", node.addr().ip())
                .var("RPC_NODE_PORT", node.addr().port())
                .concurrency(concurrency.unwrap_or(scenario.workers as u32))
                .arg("--service-node")
                .arg(replica_name(i));
            if let Some(engine) = &engine {
                builder = builder.fleet(engine);
            }
            for filter in &scenario.filters {
                builder = builder.filter(filter_config(filter, &filter.module));
            }
            envoys.push(builder.start()?);
        }
        let gateways = envoys
            .iter()
            .map(|envoy| {
                Ok(Gateway {
                    public: envoy.listener("public")?,
                    internal: envoy.listener("internal").ok(),
                    admin_url: envoy.admin_url().to_string(),
                    ecds_dir: envoy.ecds_dir().to_path_buf(),
                    envoy_log: Some(envoy.log_path().to_path_buf()),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            node_url: format!("http://{}", node.addr()),
            gateways,
            engine: engine.map(Mutex::new),
            _processes: Some((node, envoys)),
        })
    }

    /// The compose stack `stack.json` describes, once it is ready, if it
    /// was made for `scenario`'s node and policies.
    pub fn attach(path: &Path, scenario: &Scenario) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file: StackFile =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let filters: Vec<(String, String)> = scenario
            .filters
            .iter()
            .map(|f| (f.name.clone(), f.policy.clone()))
            .collect();
        if file.node_args != node_args(scenario)
            || file.filters != filters
            || file.gateways.len() != scenario.replicas
        {
            bail!(
                "the stack was made for scenario {:?}, whose node, policies or replicas differ from {:?}'s; \
                 make it for this one: SCENARIO={} docker compose up -d --force-recreate",
                file.scenario,
                scenario.name,
                scenario.name
            );
        }
        let resolve = |addr: &str| -> anyhow::Result<SocketAddr> {
            addr.to_socket_addrs()
                .with_context(|| format!("resolving {addr}"))?
                .next()
                .with_context(|| format!("{addr} has no address"))
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        let ready = std::iter::once(format!("{}/health", file.node_url)).chain(
            file.gateways
                .iter()
                .map(|g| format!("{}/ready", g.admin_url)),
        );
        for url in ready {
            while !http::get(&url).is_ok_and(|a| a.status == 200) {
                if Instant::now() > deadline {
                    bail!("{url} is not ready after {READY_TIMEOUT:?}");
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let gateways = file
            .gateways
            .into_iter()
            .map(|g| {
                Ok(Gateway {
                    public: resolve(&g.public)?,
                    internal: g.internal.as_deref().map(resolve).transpose()?,
                    admin_url: g.admin_url,
                    ecds_dir: g.ecds_dir,
                    envoy_log: None,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            node_url: file.node_url,
            gateways,
            engine: None,
            _processes: None,
        })
    }

    /// The node's `/metrics` document.
    pub fn node_metrics(&self) -> anyhow::Result<serde_json::Value> {
        rpc_node::metrics(&self.node_url)
    }

    /// Starts a new measurement window on the node.
    pub fn reset_node(&self) -> anyhow::Result<()> {
        rpc_node::reset_metrics(&self.node_url)
    }

    /// The gateway replicas.
    pub fn gateways(&self) -> &[Gateway] {
        &self.gateways
    }

    /// The public listener of each replica `replica` names (every one for
    /// `None`), or their internal ones.
    pub fn listeners(
        &self,
        internal: bool,
        replica: Option<usize>,
    ) -> anyhow::Result<Vec<SocketAddr>> {
        self.gateways
            .iter()
            .enumerate()
            .filter(|(i, _)| replica.is_none_or(|r| r == *i))
            .map(|(_, g)| {
                if internal {
                    g.internal.context(
                        "the gateway has no internal listener (the admission-gate config has one)",
                    )
                } else {
                    Ok(g.public)
                }
            })
            .collect()
    }

    /// Where `stakegate deploy` swaps `filter`, on every replica.
    pub fn deploy_targets(&self, filter: &str) -> Vec<Target> {
        self.gateways
            .iter()
            .map(|g| Target {
                filter: filter.to_string(),
                gateway: deploy::Gateway {
                    dir: g.ecds_dir.clone(),
                    admin: Some(g.admin_url.clone()),
                },
                timeout: Duration::from_secs(10),
                envoy_log: g.envoy_log.clone(),
            })
            .collect()
    }

    /// Stops Redis (`true`) or starts it again and waits until Webdis
    /// reaches it (`false`). Only a native run controls Redis.
    pub fn redis_down(&self, down: bool) -> anyhow::Result<()> {
        let engine = self
            .engine
            .as_ref()
            .context("this run does not control Redis (only native runs with replicas do)")?;
        let mut engine = engine.lock().map_err(|_| anyhow::anyhow!("engine lock"))?;
        if down {
            engine.stop_redis();
            Ok(())
        } else {
            engine.start_redis()
        }
    }

    /// Whether this run can stop Redis.
    pub fn controls_redis(&self) -> bool {
        self.engine.is_some()
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct StackArgs {
    /// The scenario file, or the name of one under scenarios/.
    pub scenario: String,
    /// The shared directory (a volume) to write into.
    #[arg(long)]
    pub out: PathBuf,
    /// Where the gateway container finds the filter modules.
    #[arg(long, default_value = "/modules")]
    pub modules: PathBuf,
}

/// `stakegate scenario stack`: the compose stack's files for a scenario.
pub fn write(args: &StackArgs) -> anyhow::Result<()> {
    let scenario = Scenario::load(&super::resolve(&args.scenario))?;
    if !scenario.node.changes.is_empty() {
        bail!("node.changes: only `stakegate sim` changes the node's read slots during a run");
    }
    // Everything is written into a staging directory first, and only the
    // files that changed are moved into place (by rename, which Envoy's
    // ECDS watch and a running healthcheck both tolerate): `docker-compose
    // run` runs this again before every run, and an unchanged stack must
    // stay untouched, while one whose policies a run swapped goes back to
    // the scenario's own.
    let out = &args.out;
    let staging = out.join(".staging");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir_all(staging.join("bin"))
        .with_context(|| format!("creating {}", staging.display()))?;
    // One replica's files at the top (service `gateway`); several, each in
    // a directory of its own (`gw-1/` for service `gateway`, `gw-2/` for
    // `gateway-2`, ...), with Webdis's config for fleet mode.
    let mut gateways = Vec::new();
    for i in 0..scenario.replicas {
        let (dir, host) = match (scenario.replicas, i) {
            (1, _) => (PathBuf::new(), "gateway".to_string()),
            (_, 0) => (PathBuf::from(replica_name(i)), "gateway".to_string()),
            _ => (PathBuf::from(replica_name(i)), format!("gateway-{}", i + 1)),
        };
        let ecds_dir = out.join(&dir).join("ecds");
        std::fs::create_dir_all(staging.join(&dir).join("ecds"))?;
        let envoy = EnvoyBuilder::new(template(&scenario)?)
            .var("RPC_NODE_HOST", "rpc-node")
            .var("RPC_NODE_PORT", NODE_PORT)
            .var("FLEET_HOST", "webdis")
            .var("FLEET_PORT", WEBDIS_PORT)
            .var("LISTEN_ADDRESS", "0.0.0.0")
            .var("ADMIN_ADDRESS", "0.0.0.0")
            .var("PUBLIC_PORT", PUBLIC_PORT)
            .var("INTERNAL_PORT", INTERNAL_PORT)
            .var("ADMIN_PORT", ADMIN_PORT)
            .var("ECDS_DIR", ecds_dir.display())
            .render()?;
        std::fs::write(staging.join(&dir).join("envoy.yaml"), envoy)?;
        for filter in &scenario.filters {
            let module = args
                .modules
                .join(format!("{}.wasm", filter.name.replace('-', "_")));
            filter_config(filter, &module).write_both(&staging.join(&dir).join("ecds"), "1")?;
        }
        gateways.push(GatewayFile {
            public: format!("{host}:{PUBLIC_PORT}"),
            internal: has_internal_listener(&scenario)?.then(|| format!("{host}:{INTERNAL_PORT}")),
            admin_url: format!("http://{host}:{ADMIN_PORT}"),
            ecds_dir,
        });
    }
    if scenario.replicas > 1 {
        // Webdis runs the exchange only for who sends the fleet's
        // credentials, which the gateways get in their environment.
        let env = stakegate_core::qos::fleet::AUTH_ENV;
        let credentials = std::env::var(env)
            .ok()
            .filter(|c| c.contains(':'))
            .with_context(|| format!("{env} must hold Webdis's credentials, user:password, for the fleet (docker-compose.fleet.yml passes it)"))?;
        // Redis lets Webdis's account run only the fleet's script (which
        // `stakegate fleet-script` loads as the admin) on the fleet's keys.
        let passwords = redis_passwords(out);
        let redis_conf = format!(
            "port 6379\nbind 0.0.0.0\nprotected-mode no\nsave \"\"\nappendonly no\n{}",
            stakegate_stack::redis::redis_acl(&passwords.0, &passwords.1)
        );
        std::fs::write(staging.join("redis.conf"), redis_conf)?;
        std::fs::write(staging.join("redis-admin"), &passwords.1)?;
        let webdis = serde_json::json!({
            "redis_host": "redis",
            "redis_port": 6379,
            "redis_auth": passwords.0,
            "http_host": "0.0.0.0",
            "http_port": WEBDIS_PORT,
            "threads": 2,
            "daemonize": false,
            "database": 0,
            "verbosity": 3,
            "logfile": "/tmp/webdis.log",
            "acl": stakegate_stack::redis::webdis_acl(&credentials),
        });
        std::fs::write(staging.join("webdis.json"), webdis.to_string())?;
    }
    let mut node = vec!["--host".to_string(), "0.0.0.0".into(), "--port".into()];
    node.push(NODE_PORT.to_string());
    node.extend(node_args(&scenario));
    std::fs::write(staging.join("rpc-node.args"), node.join("\n") + "\n")?;
    // The healthchecks run in images that are not ours: the static probe
    // (the loadgen image's), not this binary.
    let probe = stakegate_stack::paths::tool("stakegate-probe")?;
    std::fs::copy(&probe, staging.join("bin/stakegate-probe"))
        .with_context(|| format!("copying {} for the healthchecks", probe.display()))?;
    let file = StackFile {
        scenario: scenario.name.clone(),
        node_args: node_args(&scenario),
        filters: scenario
            .filters
            .iter()
            .map(|f| (f.name.clone(), f.policy.clone()))
            .collect(),
        node_url: format!("http://rpc-node:{NODE_PORT}"),
        gateways,
    };
    std::fs::write(
        staging.join("stack.json"),
        serde_json::to_string_pretty(&file)?,
    )?;
    let changed = move_changed(&staging, out)?;
    std::fs::remove_dir_all(&staging)?;
    if changed == 0 {
        eprintln!(
            "stack for {} in {} is current",
            scenario.name,
            out.display()
        );
        return Ok(());
    }
    eprintln!(
        "stack for {} written to {} (envoy.yaml and ecds/ per gateway, rpc-node.args, stack.json)",
        scenario.name,
        out.display()
    );
    Ok(())
}

/// Moves each file under `from` to the same place under `to` unless an
/// identical one is there; returns how many moved.
fn move_changed(from: &Path, to: &Path) -> anyhow::Result<usize> {
    let mut moved = 0;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            std::fs::create_dir_all(&target)?;
            moved += move_changed(&entry.path(), &target)?;
        } else if std::fs::read(&target).ok() != Some(std::fs::read(entry.path())?) {
            std::fs::rename(entry.path(), &target)
                .with_context(|| format!("moving {} into place", target.display()))?;
            moved += 1;
        }
    }
    Ok(moved)
}

/// rpc-node's arguments for the scenario's `[node]`.
fn node_args(scenario: &Scenario) -> Vec<String> {
    let node = &scenario.node;
    let mut args = vec![
        "--read-slots".to_string(),
        node.read_slots.to_string(),
        "--sync-slots".into(),
        node.sync_slots.to_string(),
        "--block-interval".into(),
        format!("{}ms", node.block_interval.as_millis()),
        "--block-exec".into(),
        format!("{}ms", node.block_exec.as_millis()),
        "--tip-lost-after".into(),
        node.tip_lost_after.to_string(),
    ];
    if node.flavour == Flavour::Solana {
        args.extend(["--chain".into(), "solana".into()]);
    }
    for (method, cost) in node.costs.methods() {
        args.push("--cost".into());
        args.push(format!("{method}={}us", cost.as_micros()));
    }
    // rpc-node counts them from its first request, about when the load
    // starts.
    for change in &node.changes {
        for (method, cost) in &change.costs {
            args.push("--cost-change".into());
            args.push(format!(
                "{}ms:{method}={}us",
                change.at.as_millis(),
                cost.as_micros()
            ));
        }
    }
    args
}

/// The gateway config for the scenario's filter chain.
fn template(scenario: &Scenario) -> anyhow::Result<&'static str> {
    let names: Vec<&str> = scenario
        .filters
        .iter()
        .filter(|f| !f.shadow)
        .map(|f| f.name.as_str())
        .collect();
    let shadow = scenario.filters.iter().any(|f| f.shadow);
    if shadow && names != ["stake-qos", "admission-gate"] {
        bail!(
            "gateway.filters: a shadow candidate runs for real in the whole gateway's config only (stake-qos then admission-gate), which has its slot"
        );
    }
    Ok(match names.as_slice() {
        [] => "passthrough.yaml",
        ["admission-gate"] => "gate.yaml",
        ["stake-qos"] => "qos.yaml",
        ["stake-qos", "admission-gate"] => "gateway.yaml",
        _ => bail!(
            "gateway.filters: real runs have Envoy configs for stake-qos then admission-gate (the whole gateway), either alone, or none; not {names:?}"
        ),
    })
}

/// Whether the scenario's config has an internal listener (the gate's).
pub fn has_internal_listener(scenario: &Scenario) -> anyhow::Result<bool> {
    Ok(matches!(template(scenario)?, "gate.yaml" | "gateway.yaml"))
}

fn filter_config(filter: &Filter, module: &Path) -> FilterConfig {
    if filter.shadow {
        FilterConfig::stake_qos(module, &filter.policy).shadow()
    } else if filter.name == "stake-qos" {
        FilterConfig::stake_qos(module, &filter.policy)
    } else {
        FilterConfig::admission_gate(module, &filter.policy)
    }
}

/// `stakegate probe URL`: exit 0 when `URL` answers 200 (the containers'
/// healthcheck; they have no shell or curl).
pub fn probe(url: &str) -> anyhow::Result<()> {
    let answer = http::get(url)?;
    if answer.status != 200 {
        bail!("{url} answered {}", answer.status);
    }
    Ok(())
}

/// Redis's passwords for the compose fleet (Webdis's account, the admin's):
/// those a stack already written in `out` has (compose may run the stack
/// step again while Redis runs with them), else fresh ones.
fn redis_passwords(out: &Path) -> (String, String) {
    let admin = std::fs::read_to_string(out.join("redis-admin")).ok();
    let webdis = std::fs::read_to_string(out.join("webdis.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|doc| doc["redis_auth"].as_str().map(str::to_string));
    match (webdis, admin) {
        (Some(webdis), Some(admin)) if !webdis.is_empty() && !admin.is_empty() => (webdis, admin),
        _ => (
            stakegate_stack::redis::new_secret(),
            stakegate_stack::redis::new_secret(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::move_changed;
    use std::path::Path;

    fn put(dir: &Path, file: &str, text: &str) {
        let path = dir.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn only_changed_files_move_into_place() {
        let (staging, out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        put(out.path(), "ecds/gate.yaml", "v1");
        put(out.path(), "envoy.yaml", "same");
        let before = std::fs::metadata(out.path().join("envoy.yaml"))
            .unwrap()
            .modified()
            .unwrap();
        put(staging.path(), "ecds/gate.yaml", "v2");
        put(staging.path(), "envoy.yaml", "same");
        put(staging.path(), "stack.json", "{}");

        assert_eq!(move_changed(staging.path(), out.path()).unwrap(), 2);
        let read = |file: &str| std::fs::read_to_string(out.path().join(file)).unwrap();
        assert_eq!(read("ecds/gate.yaml"), "v2");
        assert_eq!(read("stack.json"), "{}");
        // The unchanged file is the one that was there, untouched.
        let after = std::fs::metadata(out.path().join("envoy.yaml"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(before, after);
        assert!(staging.path().join("envoy.yaml").exists());
        assert_eq!(move_changed(staging.path(), out.path()).unwrap(), 0);
    }
}
