//! `stakegate check --module X.wasm --policy P.json`: does this module
//! accept this policy, and does it handle a request? Run in the offline
//! host, exactly as Envoy would load it (vm_start, configure on the main
//! thread and a worker), so a bad policy or a broken module is caught
//! before it gets near Envoy.

use anyhow::Context;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::qos::policy::QosPolicy;
use stakegate_host::{Host, Reply, Request};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The compiled filter module.
    #[arg(long)]
    pub module: PathBuf,
    /// The policy document (JSON) it is configured with.
    #[arg(long)]
    pub policy: PathBuf,
}

/// What a check found, for the caller to print.
pub struct Checked {
    pub smoke: String,
    /// The filter the module declares itself to be.
    pub filter: Option<String>,
    /// Valid values that are probably mistakes (`field: why`).
    pub warnings: Vec<String>,
}

pub fn check(module: &[u8], policy: &[u8]) -> anyhow::Result<Checked> {
    let mut host = Host::new(module, policy, 1)?;
    let filter = stakegate_host::declared_filter(module);
    let warnings = match filter.as_deref() {
        Some("admission-gate") => GatePolicy::parse(policy).map(|p| p.warnings()),
        Some("stake-qos") => QosPolicy::parse(policy).map(|p| p.warnings()),
        _ => Ok(Vec::new()),
    }
    .unwrap_or_default()
    .iter()
    .map(ToString::to_string)
    .collect();
    let request = Request::json_rpc(r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#);
    let smoke = match host.request(0, &request)? {
        Reply::Continue(id) => {
            host.finish(id, 200, Duration::from_millis(1))?;
            "admitted".to_string()
        }
        Reply::LocalReply(reply) => format!("answered locally with {}", reply.status),
        Reply::Held(id) => {
            // eth_blockNumber is never held (dedup skips it); end it anyway.
            host.abort(id)?;
            "held".to_string()
        }
    };
    // A few heartbeats, so tick handlers run too.
    host.advance(Duration::from_secs(3))?;
    Ok(Checked {
        smoke,
        filter,
        warnings,
    })
}

pub fn run(args: &CheckArgs) -> anyhow::Result<()> {
    let module = std::fs::read(&args.module)
        .with_context(|| format!("reading {}", args.module.display()))?;
    let policy = std::fs::read(&args.policy)
        .with_context(|| format!("reading {}", args.policy.display()))?;
    let checked = check(&module, &policy)
        .with_context(|| format!("{} with {}", args.module.display(), args.policy.display()))?;
    for warning in &checked.warnings {
        eprintln!("warning: {warning}");
    }
    println!(
        "ok: {} ({}) accepts {}; a smoke request was {}",
        args.module.display(),
        checked
            .filter
            .as_deref()
            .unwrap_or("declares no stakegate filter"),
        args.policy.display(),
        checked.smoke
    );
    Ok(())
}
