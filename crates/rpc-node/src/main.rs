use anyhow::{bail, Context};
use clap::Parser;
use rpc_node::costs::{CostChange, CostTable, Flavour};
use rpc_node::node::{Node, NodeConfig};
use std::io::Write;
use std::time::Duration;

/// A mock JSON-RPC node with blocking read slots and an internal sync loop.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one (printed on the first line of stdout).
    #[arg(long, default_value_t = 8545)]
    port: u16,
    /// Read slots shared by RPC requests and block execution.
    #[arg(long, default_value_t = 64)]
    read_slots: u32,
    /// A method's service time, METHOD=DURATION (repeatable); adds unknown methods.
    #[arg(long = "cost", value_name = "METHOD=DURATION")]
    costs: Vec<String>,
    /// A method's service time from some time after the first request on,
    /// AT:METHOD=DURATION (repeatable), e.g. 10s:eth_call=50ms.
    #[arg(long = "cost-change", value_name = "AT:METHOD=DURATION")]
    cost_changes: Vec<String>,
    /// A new block arrives this often.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    block_interval: Duration,
    /// Time to execute one block, holding --sync-slots read slots.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    block_exec: Duration,
    /// Read slots one block execution holds [default: 4, or --read-slots
    /// when that is fewer].
    #[arg(long)]
    sync_slots: Option<u32>,
    /// The tip counts as lost when the lag exceeds this many block intervals.
    #[arg(long, default_value_t = 3.0)]
    tip_lost_after: f64,
    /// Gzip every HTTP answer, whatever the request accepts, as some nodes
    /// and the proxies in front of them do.
    #[arg(long)]
    gzip: bool,
    /// The chain whose JSON-RPC the node speaks (its methods, their
    /// default costs and answers; Solana's slots, commitment levels and
    /// PubSub).
    #[arg(long, value_enum, default_value_t = Flavour::Ethereum)]
    chain: Flavour,
    /// The chain id `eth_chainId` and `net_version` answer (Ethereum).
    #[arg(long, default_value_t = 1)]
    chain_id: u64,
    /// Worker threads for the node's runtime (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
}

const DEFAULT_SYNC_SLOTS: u32 = 4;

impl Args {
    fn config(&self) -> anyhow::Result<NodeConfig> {
        if self.read_slots == 0 {
            bail!("--read-slots must be at least 1");
        }
        let sync_slots = self
            .sync_slots
            .unwrap_or(DEFAULT_SYNC_SLOTS.min(self.read_slots));
        if sync_slots == 0 || sync_slots > self.read_slots {
            bail!(
                "--sync-slots must be between 1 and --read-slots ({}), got {sync_slots}",
                self.read_slots,
            );
        }
        if self.block_interval < Duration::from_millis(10) {
            bail!("--block-interval must be at least 10ms");
        }
        if !(self.tip_lost_after.is_finite() && self.tip_lost_after > 0.0) {
            bail!("--tip-lost-after must be a positive number of block intervals");
        }
        Ok(NodeConfig {
            read_slots: self.read_slots,
            costs: CostTable::of(self.chain).with_overrides(&self.costs)?,
            cost_changes: self
                .cost_changes
                .iter()
                .map(|c| CostChange::parse(c))
                .collect::<anyhow::Result<_>>()?,
            block_interval: self.block_interval,
            block_exec: self.block_exec,
            sync_slots,
            tip_lost_after_blocks: self.tip_lost_after,
            gzip: self.gzip,
            flavour: self.chain,
            chain_id: self.chain_id,
        })
    }
}

/// The command line, with `--args-file PATH` replaced by the file's
/// whitespace-separated arguments (for images with no shell, such as the
/// compose stack's, where another container writes the node's arguments).
fn command_line() -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut args = std::env::args();
    while let Some(arg) = args.next() {
        if arg == "--args-file" {
            let path = args.next().context("--args-file needs a path")?;
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
            out.extend(text.split_whitespace().map(str::to_string));
        } else {
            out.push(arg);
        }
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse_from(command_line()?);
    let config = args.config()?;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        runtime.worker_threads(threads);
    }
    runtime.enable_all().build()?.block_on(serve(args, config))
}

async fn serve(args: Args, config: NodeConfig) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    eprintln!(
        "rpc-node: read_slots={} sync_slots={} block_interval={:?} block_exec={:?} tip_lost_after={}x",
        config.read_slots, config.sync_slots, config.block_interval, config.block_exec, config.tip_lost_after_blocks
    );
    for (method, cost) in config.costs.methods() {
        eprintln!("rpc-node: cost {method} = {cost:?}");
    }
    for change in &config.cost_changes {
        eprintln!(
            "rpc-node: cost {} = {:?} from {:?} after the first request",
            change.method, change.cost, change.at
        );
    }
    let node = Node::new(config);
    node.start_sync();
    let mut stdout = std::io::stdout();
    writeln!(stdout, "rpc-node listening on {addr}")?;
    stdout.flush()?;
    tokio::select! {
        () = rpc_node::server::serve(listener, rpc_node::server::router(node)) => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> anyhow::Result<NodeConfig> {
        Args::try_parse_from(std::iter::once("rpc-node").chain(args.iter().copied()))?.config()
    }

    #[test]
    fn the_defaults_hold_for_any_number_of_read_slots() {
        assert_eq!(config(&[]).unwrap().sync_slots, 4);
        assert_eq!(config(&["--read-slots", "1"]).unwrap().sync_slots, 1);
        assert_eq!(config(&["--read-slots", "3"]).unwrap().sync_slots, 3);
        assert_eq!(
            config(&["--read-slots", "2", "--sync-slots", "3"])
                .unwrap_err()
                .to_string(),
            "--sync-slots must be between 1 and --read-slots (2), got 3"
        );
    }
}
