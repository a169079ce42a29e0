//! `stakegate bench`: what the filters cost a real Envoy.
//!
//! `gate-overhead`: what the admission gate costs Envoy's throughput.
//! Two Envoys at `--concurrency 1` answer every request with a
//! direct_response, one with the gate in front (at a limit it never
//! reaches). wrk loads them in alternating rounds, so both see the same
//! machine noise, and the result is the median of the per-round
//! throughput ratios gate / no-filter. On a machine with at least two
//! cores, Envoy is pinned to the last core and wrk to the first, so the two
//! do not take turns on one core.

use anyhow::{bail, Context};
use serde::Serialize;
use stakegate_stack::admin::Quantile;
use stakegate_stack::{paths, Envoy, EnvoyBuilder, FilterConfig};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct GateOverheadArgs {
    /// Rounds per side.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Length of one wrk run.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// wrk connections.
    #[arg(long, default_value_t = 32)]
    pub connections: u32,
    /// Where summary.json goes.
    #[arg(long, default_value = "results/gate-overhead")]
    pub out: PathBuf,
    /// Measure another module in the gate's place, e.g. a pass-through
    /// proxy-wasm module to see the cost of Envoy's Wasm runtime alone.
    #[arg(long)]
    pub module: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct OverheadSummary {
    rounds: usize,
    duration_s: f64,
    connections: u32,
    no_filter_rps: Vec<f64>,
    gate_rps: Vec<f64>,
    ratios: Vec<f64>,
    median_no_filter_rps: f64,
    median_gate_rps: f64,
    median_ratio: f64,
}

pub fn gate_overhead(args: &GateOverheadArgs) -> anyhow::Result<()> {
    require_wrk()?;
    let policy = r#"{"maxInflight": 1000000}"#;
    let module = match &args.module {
        Some(module) => module.clone(),
        None => paths::wasm_module("admission_gate")?,
    };
    let gate = FilterConfig::admission_gate(module, policy);
    let no_filter = EnvoyBuilder::new("bench/no-filter.yaml")
        .concurrency(1)
        .start()?;
    let gated = with_filter(gate).concurrency(1).start()?;
    let pinned = pin(&[&no_filter, &gated]);
    println!(
        "gate overhead: wrk -c{} for {:?} per round, {} alternating rounds, Envoy --concurrency 1{}",
        args.connections,
        args.duration,
        args.rounds,
        if pinned { ", Envoy and wrk pinned to separate cores" } else { "" }
    );
    // Warm both up (VM start, connection pools) before measuring.
    for envoy in [&no_filter, &gated] {
        wrk(envoy, args.connections, Duration::from_secs(1))?;
    }
    let (mut plain, mut with_gate, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=args.rounds {
        let a = wrk(&no_filter, args.connections, args.duration)?;
        let b = wrk(&gated, args.connections, args.duration)?;
        println!(
            "round {round}: no filter {a:>9.0} rps   gate {b:>9.0} rps   ratio {:.3}",
            b / a
        );
        plain.push(a);
        with_gate.push(b);
        ratios.push(b / a);
    }
    let admitted = gated.stat("wasmcustom.stakegate.gate.admitted.default")?;
    if admitted == 0 && args.module.is_none() {
        bail!("the gate admitted nothing: it was not in the request path");
    }
    let summary = OverheadSummary {
        rounds: args.rounds,
        duration_s: args.duration.as_secs_f64(),
        connections: args.connections,
        median_no_filter_rps: median(&plain),
        median_gate_rps: median(&with_gate),
        median_ratio: median(&ratios),
        no_filter_rps: plain,
        gate_rps: with_gate,
        ratios,
    };
    println!(
        "median: no filter {:.0} rps, gate {:.0} rps, gate/no-filter {:.3} (target >= 0.80); the gate admitted {admitted} requests",
        summary.median_no_filter_rps, summary.median_gate_rps, summary.median_ratio
    );
    crate::summary::write(&args.out, &summary)
}

/// Envoy answering by itself, behind `filter`.
fn with_filter(filter: FilterConfig) -> EnvoyBuilder {
    EnvoyBuilder::new("bench/filter.yaml")
        .var("FILTER_NAME", &filter.name)
        .var("FILTER_FILE", &filter.file)
        .filter(filter)
}

fn require_wrk() -> anyhow::Result<()> {
    if Command::new("wrk").arg("--version").output().is_err() {
        bail!("wrk is not installed: `apt-get install wrk` (or `make bench`, which does it)");
    }
    Ok(())
}

/// Requests per second wrk reached against the envoy's public listener,
/// with an optional Lua script shaping the requests.
fn wrk(envoy: &Envoy, connections: u32, duration: Duration) -> anyhow::Result<f64> {
    wrk_with(envoy, connections, duration, None)
}

fn wrk_with(
    envoy: &Envoy,
    connections: u32,
    duration: Duration,
    script: Option<&std::path::Path>,
) -> anyhow::Result<f64> {
    let mut command = Command::new("taskset");
    command.args(["-c", "0", "wrk"]).args([
        "-t1",
        &format!("-c{connections}"),
        &format!("-d{}s", duration.as_secs().max(1)),
    ]);
    if let Some(script) = script {
        command.arg("-s").arg(script);
    }
    let output = command
        .arg(envoy.url("public")?)
        .output()
        .context("running wrk")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if text.contains("Non-2xx") || text.contains("Socket errors") {
        bail!("wrk saw errors:\n{text}");
    }
    text.lines()
        .find_map(|line| line.strip_prefix("Requests/sec:"))
        .and_then(|rps| rps.trim().parse().ok())
        .with_context(|| format!("no Requests/sec in wrk's output:\n{text}"))
}

/// Pins every thread of each Envoy to the last core; wrk runs on core 0.
fn pin(envoys: &[&Envoy]) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        return false;
    }
    envoys.iter().all(|envoy| {
        Command::new("taskset")
            .args([
                "-a",
                "-cp",
                &(cores - 1).to_string(),
                &envoy.pid().to_string(),
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct QosRefillArgs {
    /// Distinct client addresses to send from: one unstaked identity each.
    #[arg(long, default_value_t = 20_000)]
    pub identities: u32,
    /// How long wrk cycles through the addresses.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    pub concurrency: u32,
    /// Where summary.json goes.
    #[arg(long, default_value = "results/qos-refill")]
    pub out: PathBuf,
}

/// Envoy flushes histograms (and so their "interval" quantiles) every 5 s
/// by default; waiting a little longer makes a window without traffic.
const STATS_FLUSH: Duration = Duration::from_millis(5_500);

#[derive(Debug, Serialize)]
struct RefillPhase {
    phase: &'static str,
    identities: i64,
    rounds_per_s: f64,
    /// Refill round duration over the phase's stats window, in µs.
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    max_us: Option<f64>,
}

#[derive(Debug, Serialize)]
struct RefillSummary {
    identities_sent: u32,
    max_identities: u32,
    refill_interval_ms: u32,
    concurrency: u32,
    phases: Vec<RefillPhase>,
}

/// `stakegate bench qos-refill`: how long one stake QoS refill round takes
/// in a real Envoy as the identity table fills. wrk sends from
/// `--identities` distinct addresses (in x-forwarded-for, behind a trusted
/// 127.0.0.1), at a capacity never reached, so every address stays an
/// identity until idleTtl; the filter's `refill_us` histogram gives each
/// phase's quantiles over one stats flush window: empty, while wrk sends,
/// and with the table full but no traffic.
pub fn qos_refill(args: &QosRefillArgs) -> anyhow::Result<()> {
    require_wrk()?;
    // Room for every address: identities hash into pages of 64, so a table
    // sized exactly would evict from its fullest pages.
    let max_identities = args.identities + args.identities / 4 + 64;
    let policy = format!(
        r#"{{"capacityRps": 1000000, "maxIdentities": {max_identities}, "identity": {{"trustedProxies": ["127.0.0.1/32"]}}}}"#
    );
    let qos = FilterConfig::stake_qos(paths::wasm_module("stake_qos")?, policy);
    let envoy = with_filter(qos).concurrency(args.concurrency).start()?;
    let script = tempfile::Builder::new().suffix(".lua").tempfile()?;
    std::fs::write(script.path(), addresses_script(args.identities))?;
    println!(
        "qos refill: {} addresses through Envoy --concurrency {} (maxIdentities {max_identities}), refill every 20 ms",
        args.identities, args.concurrency
    );
    let mut phases = Vec::new();
    let mut measure = |phase: &'static str, window: Duration| -> anyhow::Result<()> {
        let rounds = envoy.stat("wasmcustom.stakegate.qos.rounds")?;
        std::thread::sleep(window);
        let quantile = |q: f64, quantiles: &[Quantile]| {
            quantiles
                .iter()
                .find(|x| x.percent == q)
                .and_then(|x| x.interval)
        };
        let refill = envoy
            .admin()
            .histogram("wasmcustom.stakegate.qos.refill_us")?;
        let rounds = envoy.stat("wasmcustom.stakegate.qos.rounds")? - rounds;
        let result = RefillPhase {
            phase,
            identities: envoy.stat("wasmcustom.stakegate.qos.identities")?,
            rounds_per_s: rounds as f64 / window.as_secs_f64(),
            p50_us: quantile(50.0, &refill),
            p99_us: quantile(99.0, &refill),
            max_us: quantile(100.0, &refill),
        };
        let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        println!(
            "{:<8} identities {:>7}   rounds {:>5.1}/s   refill p50 {:>6} µs   p99 {:>6} µs   max {:>6} µs",
            result.phase,
            result.identities,
            result.rounds_per_s,
            us(result.p50_us),
            us(result.p99_us),
            us(result.max_us)
        );
        phases.push(result);
        Ok(())
    };
    measure("empty", STATS_FLUSH)?;
    let sender = std::thread::scope(|scope| {
        let sending = scope.spawn(|| wrk_with(&envoy, 16, args.duration, Some(script.path())));
        // The last full flush window inside wrk's run.
        std::thread::sleep(args.duration.saturating_sub(STATS_FLUSH));
        let loaded = measure("loaded", STATS_FLUSH);
        (sending.join(), loaded)
    });
    let rps = match sender {
        (Ok(rps), loaded) => {
            loaded?;
            rps?
        }
        (Err(_), _) => bail!("the wrk thread panicked"),
    };
    println!("wrk sent {rps:.0} rps");
    measure("idle", STATS_FLUSH)?;
    let summary = RefillSummary {
        identities_sent: args.identities,
        max_identities,
        refill_interval_ms: 20,
        concurrency: args.concurrency,
        phases,
    };
    crate::summary::write(&args.out, &summary)
}

/// A wrk script that POSTs eth_blockNumber from `count` addresses in turn
/// (10.0.0.0 upwards), each in x-forwarded-for.
fn addresses_script(count: u32) -> String {
    format!(
        r#"local n = 0
local body = '{{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber","params":[]}}'
request = function()
  local i = n % {count}
  n = n + 1
  local address = string.format("10.%d.%d.%d", math.floor(i / 65536) % 256, math.floor(i / 256) % 256, i % 256)
  return wrk.format("POST", "/", {{["content-type"] = "application/json", ["x-forwarded-for"] = address}}, body)
end
"#
    )
}
