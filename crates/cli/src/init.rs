//! `stakegate init`: a working gateway from nothing. Writes, into one
//! directory, Envoy's config (`envoy.yaml`, rendered from
//! `envoy-config/gateway.yaml`, which this binary carries) and the first
//! ECDS files of both filters, each module validated with its policy and
//! stored as `stakegate deploy` stores it. Then `envoy -c DIR/envoy.yaml`
//! starts the gateway, and `stakegate deploy --dir DIR` changes it.

use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

/// The whole gateway's template (QoS, then the gate, then the router).
const GATEWAY: &str = include_str!("../../../envoy-config/gateway.yaml");

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
    #[arg(
        long,
        default_value = "target/wasm32-wasip1/release/admission_gate.wasm"
    )]
    pub gate_module: PathBuf,
    #[arg(long, default_value = "policies/admission-gate.example.json")]
    pub gate_policy: PathBuf,
    #[arg(long, default_value = "target/wasm32-wasip1/release/stake_qos.wasm")]
    pub qos_module: PathBuf,
    #[arg(long, default_value = "policies/stake-qos.example.json")]
    pub qos_policy: PathBuf,
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
    // Resolvable now, or Envoy would start with a node it cannot find.
    (node_host.as_str(), node_port)
        .to_socket_addrs()
        .with_context(|| format!("--node {}: {node_host} does not resolve", args.node))?;
    let (fleet_host, fleet_port) = address("--fleet", &args.fleet)?;
    let gate_policy = read(&args.gate_policy, "gate policy")?;
    let qos_policy = read(&args.qos_policy, "QoS policy")?;
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    // Starting over: the deployments recorded before are not in effect.
    let history = dir.join(".stakegate").join("history");
    if history.exists() {
        std::fs::remove_dir_all(&history)
            .with_context(|| format!("removing {}", history.display()))?;
    }
    crate::deploy::first_config(&dir, "stake-qos", &args.qos_module, &qos_policy)?;
    crate::deploy::first_config(&dir, "admission-gate", &args.gate_module, &gate_policy)?;
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
    println!(
        "wrote {config}: stake QoS ({qos}) and the admission gate ({gate}) in front of {node}\n\
         public  http://{listen}:{public}\n\
         internal http://{listen}:{internal} (never rejected)\n\
         start:   envoy -c {config}\n\
         change:  stakegate deploy --dir {dir} --admin http://{admin} --filter admission-gate|stake-qos --module M --policy P{fleet}",
        config = config.display(),
        qos = args.qos_policy.display(),
        gate = args.gate_policy.display(),
        node = args.node,
        listen = args.listen,
        public = args.public_port,
        internal = args.internal_port,
        dir = dir.display(),
        admin = args.admin,
    );
    Ok(())
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
