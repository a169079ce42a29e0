//! `stakegate`: the operator's command.

mod bench;
mod check;
mod demo;
mod deploy;
mod deploy_lock;
mod docs;
mod init;
mod scenario;
mod shadow;
mod sim;
mod summary;
mod top;
mod usage;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(version, about = "stakegate: RPC gateway policies for Envoy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a working gateway into a directory: Envoy's config (both filters) and their first ECDS files.
    Init(init::InitArgs),
    /// Load a module with a policy in the offline host: ok, or the module's reason.
    Check(check::CheckArgs),
    /// Validate a module and policy offline, then swap them into a running Envoy (file-based ECDS).
    Deploy(deploy::DeployArgs),
    /// Put a filter's previous deployment back into Envoy.
    Rollback(deploy::RollbackArgs),
    /// Tip under RPC flood: rpc-node behind a real Envoy, with and without the gate.
    Demo(demo::DemoArgs),
    /// Run a scenario through the compiled filters in virtual time.
    Sim(sim::SimArgs),
    /// Real runs of scenario files.
    #[command(subcommand)]
    Scenario(ScenarioCommand),
    /// Measurements against a real Envoy.
    #[command(subcommand)]
    Bench(Bench),
    /// The policy fields and metrics the code declares; with --check, whether policies/*.md say the same.
    Docs(docs::DocsArgs),
    /// A shadow candidate against the live stake QoS, per identity: requests, admitted, refused, would refuse, share, would-be share.
    Shadow(shadow::ShadowArgs),
    /// Stake QoS's usage ledger from a running Envoy: per identity its requests, calls, refusals by rule and node time.
    Usage(usage::UsageArgs),
    /// A running gateway live, like top: per identity its rate, share and refusals by rule; the node's in-flight, the gate's shedding, the fleet.
    Top(top::TopArgs),
    /// An API key's sha256, as a stake entry's apiKeySha256 holds it; with no KEY, of the first line on stdin (out of the shell's history).
    KeyHash { key: Option<String> },
    /// Exit 0 when URL answers 200 (the compose stack's healthcheck).
    Probe { url: String },
    /// Load fleet mode's exchange script into Redis as its admin user, after each start of Redis (the gateways' account may run no other script).
    FleetScript {
        /// Redis: host:port, or a Unix socket's path.
        #[arg(long)]
        redis: String,
        /// A file holding the password of Redis's stakegate-admin user.
        #[arg(long)]
        password_file: std::path::PathBuf,
        /// How long to try while Redis is not up yet.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
    },
}

#[derive(Debug, Subcommand)]
enum ScenarioCommand {
    /// Run a scenario for real: rpc-node, Envoy with its policies, and its clients; writes summary.json, timeline.csv and plots.
    Run(scenario::run::RunArgs),
    /// Write the docker-compose stack's files for a scenario into a shared directory.
    Stack(scenario::stack::StackArgs),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Every filter chain's throughput against Envoy with no filter, side by side (needs wrk).
    Filters(bench::FiltersArgs),
    /// What each kind of host call the filters make adds to a no-op filter (needs wrk).
    HostCalls(bench::FiltersArgs),
    /// How long a stake QoS refill round takes in Envoy as identities grow (needs wrk).
    QosRefill(bench::QosRefillArgs),
    /// What a request costs stake QoS, and Envoy's memory, at 10 to 100,000 identities (needs wrk).
    QosScale(bench::QosScaleArgs),
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The message chain, not a backtrace: operators read this.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Prints the hash policies hold instead of the key.
fn key_hash(key: Option<String>) -> anyhow::Result<()> {
    let key = match key {
        Some(key) => key,
        None => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            line.trim_end_matches(['\r', '\n']).to_string()
        }
    };
    if key.is_empty() {
        anyhow::bail!("no key: give it as an argument or on stdin");
    }
    println!("{}", stakegate_core::request::sha256_hex(key.as_bytes()));
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::FleetScript {
            redis,
            password_file,
            wait,
        } => {
            let password = std::fs::read_to_string(&password_file)
                .with_context(|| format!("reading {}", password_file.display()))?;
            stakegate_stack::redis::load_script(&redis, password.trim(), wait)?;
            println!(
                "fleet script {} loaded into Redis at {redis}",
                stakegate_core::qos::fleet::SCRIPT_SHA1
            );
            Ok(())
        }
        Command::Check(args) => check::run(&args),
        Command::Init(args) => init::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Usage(args) => usage::run(&args),
        Command::Shadow(args) => shadow::run(&args),
        Command::Top(args) => top::run(&args),
        Command::Deploy(args) => deploy::deploy(&args),
        Command::Rollback(args) => deploy::rollback(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Docs(args) => docs::run(&args),
        Command::Scenario(ScenarioCommand::Run(args)) => scenario::run::run(&args),
        Command::Scenario(ScenarioCommand::Stack(args)) => scenario::stack::write(&args),
        Command::Probe { url } => scenario::stack::probe(&url),
        Command::KeyHash { key } => key_hash(key),
        Command::Bench(Bench::Filters(args)) => bench::filters(&args),
        Command::Bench(Bench::HostCalls(args)) => bench::host_calls(&args),
        Command::Bench(Bench::QosRefill(args)) => bench::qos_refill(&args),
        Command::Bench(Bench::QosScale(args)) => bench::qos_scale(&args),
    }
}
