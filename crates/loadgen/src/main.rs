use anyhow::Context;
use clap::Parser;
use stakegate_loadgen::{ClientSpec, Report, RunSpec};
use std::time::Duration;

/// Open-loop JSON-RPC load: several client identities, each on its own schedule.
///
/// Prints a JSON report on stdout and a short table on stderr.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Where to send, e.g. http://127.0.0.1:10000/
    #[arg(long)]
    target: String,
    /// A client identity (repeatable):
    /// id=NAME,rate=RPS[,key=API_KEY][,header=x-api-key][,mix=eth_call:8+eth_blockNumber:2][,concurrency=1024][,target=URL (again for several, each in turn)]
    #[arg(
        long = "client",
        value_name = "SPEC",
        required_unless_present = "clients_file"
    )]
    clients: Vec<ClientSpec>,
    /// Clients as a JSON array of {id, rate, api_key, key_header, mix, concurrency}.
    #[arg(long, value_name = "PATH")]
    clients_file: Option<std::path::PathBuf>,
    /// How long requests keep coming due (at most 1h).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// At most this many requests per client, whatever the duration.
    #[arg(long, default_value_t = 10_000_000)]
    max_requests: u64,
    /// A request not answered within this counts as a timeout.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Use HTTP/2 with prior knowledge (h2c).
    #[arg(long)]
    http2: bool,
    /// With --http2: connections per client, used in turn.
    #[arg(long, default_value_t = 1)]
    connections: usize,
}

fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if let Some(path) = &args.clients_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let clients: Vec<ClientSpec> = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a JSON array of clients", path.display()))?;
        args.clients.extend(clients);
    }
    let spec = RunSpec {
        target: args.target,
        duration: args.duration,
        max_requests: args.max_requests,
        timeout: args.timeout,
        http2: args.http2,
        connections: args.connections,
        clients: args.clients,
    };
    spec.validate()?;
    let report = tokio::runtime::Runtime::new()?.block_on(stakegate_loadgen::run(&spec))?;
    eprint!("{}", table(&report));
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn table(report: &Report) -> String {
    let mut out = format!(
        "{:<12} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10}\n",
        "client",
        "req/s",
        "offered",
        "200",
        "429",
        "503",
        "errors",
        "skipped",
        "ok p99 ms",
        "max ms"
    );
    for c in &report.clients {
        let errors = c.count("other") + c.count("transport_error") + c.count("timeout");
        out += &format!(
            "{:<12} {:>9.1} {:>9.1} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10.2} {:>10.2}\n",
            c.header.id,
            c.header.requested_rps,
            c.header.offered_rps,
            c.count("200"),
            c.count("429"),
            c.count("503"),
            errors,
            c.header.skipped_at_cap,
            c.latency_ms.ok.p99,
            c.latency_ms.all.max,
        );
    }
    out
}
