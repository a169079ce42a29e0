//! `stakegate init`: a working gateway from nothing. Writes, into one
//! directory, Envoy's config (`envoy.yaml`, rendered from
//! `envoy-config/gateway.yaml`, which this binary carries), the example
//! policies to edit (`policies/`, also carried), and the first ECDS files
//! of both filters, each module validated with its policy and stored as
//! `stakegate deploy` stores it. Then `envoy -c DIR/envoy.yaml
//! --disable-hot-restart` starts the gateway, and `stakegate deploy --dir
//! DIR` changes it.

use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The whole gateway's template (QoS, then the gate, then the router).
const GATEWAY: &str = include_str!("../../../envoy-config/gateway.yaml");

/// A filter as init sets it up: its module's name, and the example
/// policy written into a new gateway's directory for the operator to edit.
struct Example {
    module: &'static str,
    file: &'static str,
    text: &'static str,
}

const QOS: Example = Example {
    module: "stake_qos",
    file: "stake-qos.json",
    text: include_str!("../../../policies/stake-qos.example.json"),
};

const GATE: Example = Example {
    module: "admission_gate",
    file: "admission-gate.json",
    text: include_str!("../../../policies/admission-gate.example.json"),
};

impl Example {
    /// The policy's text and file: the one given, else the example in
    /// `dir/policies/` (written there once; the operator's edits are kept).
    fn policy(&self, dir: &Path, given: Option<&Path>) -> anyhow::Result<(String, PathBuf)> {
        if let Some(path) = given {
            let what = format!("policy {}", self.file.trim_end_matches(".json"));
            return Ok((read(path, &what)?, path.to_path_buf()));
        }
        let path = dir.join("policies").join(self.file);
        if !path.exists() {
            std::fs::create_dir_all(dir.join("policies"))?;
            std::fs::write(&path, self.text)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok((read(&path, "policy")?, path))
    }

    /// The module given, else the one `make build` built.
    fn module(&self, given: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
        match given {
            Some(module) => Ok(module.clone()),
            None => stakegate_stack::paths::wasm_module(self.module),
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct InitArgs {
    /// The directory to write: Envoy's config, and the ECDS directory it watches.
    #[arg(long, default_value = "envoy-config/live")]
    pub dir: PathBuf,
    /// The node's JSON-RPC address, `host:port` or `http://host:port`.
    #[arg(long)]
    pub node: String,
    /// Where the public and internal listeners bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub listen: String,
    /// The public listener's port (RPC clients).
    #[arg(long, default_value_t = 8080)]
    pub public_port: u16,
    /// The internal listener's port (the node's own callers; never rejected).
    #[arg(long, default_value_t = 8081)]
    pub internal_port: u16,
    /// Envoy's admin address (keep it private: it can change Envoy).
    #[arg(long, default_value = "127.0.0.1:9901")]
    pub admin: SocketAddr,
    /// The gate's module (default: the one `make build` built).
    #[arg(long)]
    pub gate_module: Option<PathBuf>,
    /// The gate's policy (default: the example, written to
    /// DIR/policies/admission-gate.json for you to edit).
    #[arg(long)]
    pub gate_policy: Option<PathBuf>,
    /// Stake QoS's module (default: the one `make build` built).
    #[arg(long)]
    pub qos_module: Option<PathBuf>,
    /// Stake QoS's policy (default: the example, written to
    /// DIR/policies/stake-qos.json for you to edit).
    #[arg(long)]
    pub qos_policy: Option<PathBuf>,
    /// Webdis (Redis over HTTP), `host:port`: where a QoS policy in fleet
    /// mode exchanges demand with the other replicas. Unused otherwise.
    #[arg(long, default_value = "127.0.0.1:7379")]
    pub fleet: String,
    /// Replace a gateway already initialised in `--dir`.
    #[arg(long)]
    pub force: bool,
}

/// `host` and `port` from `host:port` or an `http://` URL (`flag`'s value).
fn address(flag: &str, node: &str) -> anyhow::Result<(String, u16)> {
    let rest = match node.split_once("://") {
        Some(("http", rest)) => rest,
        Some((scheme, _)) => {
            bail!("{flag} {node}: the gateway speaks plain HTTP to it, not {scheme}")
        }
        None => node,
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = authority
        .rsplit_once(':')
        .with_context(|| format!("{flag} {node}: give the port, e.g. 127.0.0.1:8545"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("{flag} {node}: {port} is not a port"))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    if host.is_empty() {
        bail!("{flag} {node}: no host");
    }
    Ok((host, port))
}

fn read(path: &Path, what: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading the {what} {}", path.display()))
}

pub fn run(args: &InitArgs) -> anyhow::Result<()> {
    let config = args.dir.join("envoy.yaml");
    if config.exists() && !args.force {
        bail!(
            "{} exists: a gateway is already initialised there (change it with `stakegate deploy`, or pass --force to start over)",
            config.display()
        );
    }
    let (node_host, node_port) = address("--node", &args.node)?;
    let (node_host, node_note) = node_address(&args.node, &node_host, node_port)?;
    let (fleet_host, fleet_port) = address("--fleet", &args.fleet)?;
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    let (qos_policy, qos_path) = QOS.policy(&dir, args.qos_policy.as_deref())?;
    let (gate_policy, gate_path) = GATE.policy(&dir, args.gate_policy.as_deref())?;
    let qos_module = QOS.module(args.qos_module.as_ref())?;
    let gate_module = GATE.module(args.gate_module.as_ref())?;
    // Starting over: the deployments recorded before are not in effect.
    let history = dir.join(".stakegate").join("history");
    if history.exists() {
        std::fs::remove_dir_all(&history)
            .with_context(|| format!("removing {}", history.display()))?;
    }
    // Where deploy, rollback and shadow find Envoy's admin without --admin
    // (not known before Envoy starts if it picks the port).
    let admin_file = dir.join(crate::deploy::ADMIN_FILE);
    std::fs::create_dir_all(dir.join(".stakegate"))?;
    let admin_said = if args.admin.port() == 0 {
        let _ = std::fs::remove_file(&admin_file);
        "port 0: pass --admin to deploy".to_string()
    } else {
        std::fs::write(&admin_file, format!("http://{}\n", args.admin))
            .with_context(|| format!("writing {}", admin_file.display()))?;
        format!(
            "deploy, rollback and shadow read it from {}",
            admin_file.display()
        )
    };
    crate::deploy::first_config(&dir, "stake-qos", &qos_module, &qos_policy)?;
    crate::deploy::first_config(&dir, "admission-gate", &gate_module, &gate_policy)?;
    let vars: BTreeMap<String, String> = [
        ("ADMIN_ADDRESS", args.admin.ip().to_string()),
        ("ADMIN_PORT", args.admin.port().to_string()),
        ("LISTEN_ADDRESS", args.listen.clone()),
        ("PUBLIC_PORT", args.public_port.to_string()),
        ("INTERNAL_PORT", args.internal_port.to_string()),
        ("RPC_NODE_HOST", node_host),
        ("RPC_NODE_PORT", node_port.to_string()),
        ("FLEET_HOST", fleet_host),
        ("FLEET_PORT", fleet_port.to_string()),
        ("ECDS_DIR", dir.to_string_lossy().into_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let rendered = stakegate_stack::envoy::render(GATEWAY, &vars)?;
    std::fs::write(&config, rendered).with_context(|| format!("writing {}", config.display()))?;
    let fleet = fleet_note(&qos_policy, &args.fleet);
    // The binary itself, with hot restart off: as the project's tests run
    // it, and what a service manager should run (hot restart needs a
    // `--base-id` of its own for each Envoy on one machine).
    let envoy = stakegate_stack::paths::envoy_command()
        .map_or_else(|_| "envoy".into(), |bin| bin.display().to_string());
    // This binary, by the path it was run as: `stakegate` is seldom on PATH.
    let stakegate = std::env::args()
        .next()
        .unwrap_or_else(|| "stakegate".into());
    let node_note = node_note.map_or(String::new(), |note| format!("{note}\n"));
    println!(
        "{node_note}wrote {config}: stake QoS ({qos}) and the admission gate ({gate}) in front of {node}\n\
         public   http://{listen}:{public}\n\
         internal http://{listen}:{internal} (never rejected)\n\
         start:   {envoy} -c {config} --disable-hot-restart\n\
         edit:    {qos} (stakes: `{stakegate} key-hash KEY` gives an API key's apiKeySha256) and {gate}\n\
         change:  {stakegate} deploy --dir {dir} --filter stake-qos --policy {qos}{fleet}\n\
         admin:   http://{admin} ({admin_said})",
        config = config.display(),
        qos = qos_path.display(),
        gate = gate_path.display(),
        node = args.node,
        listen = args.listen,
        public = args.public_port,
        internal = args.internal_port,
        dir = dir.display(),
        admin = args.admin,
    );
    Ok(())
}

/// The node's host as Envoy should dial it, and what to tell the operator.
/// A name with several addresses dials the one the node answers on, and so
/// does a name for this machine: `localhost` may be `::1` and `127.0.0.1`,
/// a node often listens on one of them only, and Envoy's own resolver may
/// pick `::1` where the system's gave `127.0.0.1`.
fn node_address(node: &str, host: &str, port: u16) -> anyhow::Result<(String, Option<String>)> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("--node {node}: {host} does not resolve"))?
        .collect();
    let answering: Vec<&SocketAddr> = addrs
        .iter()
        .filter(|addr| TcpStream::connect_timeout(addr, Duration::from_secs(1)).is_ok())
        .collect();
    Ok(match answering.first() {
        None => (
            host.to_string(),
            Some(format!(
                "warning: nothing answers at {node} yet; the gateway answers 503 until the node does"
            )),
        ),
        Some(addr)
            if answering.len() < addrs.len()
                || (host.parse::<IpAddr>().is_err() && addrs.iter().all(|a| a.ip().is_loopback())) =>
        {
            let all: Vec<String> = addrs.iter().map(|a| a.ip().to_string()).collect();
            (
                addr.ip().to_string(),
                Some(format!(
                    "{host} is {} here; the node answers on {}, so the gateway dials that",
                    all.join(" and "),
                    addr.ip()
                )),
            )
        }
        Some(_) => (host.to_string(), None),
    })
}

/// What a replica of a fleet needs at start, when the QoS policy is in
/// fleet mode: a name of its own, unless the policy gives one, and
/// Webdis's credentials in its environment.
fn fleet_note(qos_policy: &str, webdis: &str) -> String {
    let Ok(policy) = stakegate_core::qos::policy::QosPolicy::parse(qos_policy.as_bytes()) else {
        return String::new();
    };
    let Some(fleet) = policy.fleet else {
        return String::new();
    };
    let name = match fleet.replica {
        Some(name) => format!("as {name:?} (fleet.replica)"),
        None => "with --service-node NAME, a name of its own".into(),
    };
    format!(
        "\nfleet:   start each replica {name}, with {env}=user:password (Webdis's credentials, policies/stake-qos.md \"Fleet mode\") in Envoy's environment; Webdis at {webdis}",
        env = stakegate_core::qos::fleet::AUTH_ENV,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_name_is_written_as_the_address_the_node_answers_on() {
        let node = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = node.local_addr().unwrap().port();
        let (host, note) = node_address("http://localhost", "localhost", port).unwrap();
        assert_eq!(host, "127.0.0.1");
        assert!(note.unwrap().contains("the node answers on 127.0.0.1"));
        // An address as given stays; nothing answering is said, not fatal.
        let (host, note) = node_address("n", "127.0.0.1", port).unwrap();
        assert_eq!((host.as_str(), note), ("127.0.0.1", None));
        drop(node);
        let (host, note) = node_address("n", "localhost", port).unwrap();
        assert_eq!(host, "localhost");
        assert!(note.unwrap().starts_with("warning: nothing answers"));
        assert!(node_address("n", "no-such-host.invalid", port).is_err());
    }

    #[test]
    fn the_node_is_a_host_and_port_or_an_http_url() {
        assert_eq!(
            address("--node", "127.0.0.1:8545").unwrap(),
            ("127.0.0.1".into(), 8545)
        );
        assert_eq!(
            address("--node", "http://anvil:8545/").unwrap(),
            ("anvil".into(), 8545)
        );
        assert_eq!(
            address("--node", "http://[::1]:8545").unwrap(),
            ("::1".into(), 8545)
        );
        for (bad, why) in [
            ("https://node:443", "plain HTTP"),
            ("node", "give the port"),
            ("node:x", "not a port"),
            (":8545", "no host"),
        ] {
            let e = address("--node", bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
