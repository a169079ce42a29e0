//! `stakegate`: the operator's command.

mod bench;
mod demo;
mod summary;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(version, about = "stakegate: RPC gateway policies for Envoy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Tip under RPC flood: rpc-node behind a real Envoy, with and without the gate.
    Demo(demo::DemoArgs),
    /// Measurements against a real Envoy.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Throughput of Envoy with the admission gate vs without (needs wrk).
    GateOverhead(bench::GateOverheadArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Demo(args) => demo::run(&args),
        Command::Bench(Bench::GateOverhead(args)) => bench::gate_overhead(&args),
    }
}
