//! `stakegate bench gate-overhead`: what the admission gate costs Envoy.
//!
//! Two Envoys at `--concurrency 1` answer every request with a
//! direct_response, one with the gate in front (at a limit it never
//! reaches). wrk loads them in alternating rounds, so both see the same
//! machine noise, and the result is the median of the per-round
//! throughput ratios gate / no-filter. On a machine with at least two
//! cores, Envoy is pinned to the last core and wrk to the first, so the two
//! do not take turns on one core.

use anyhow::{bail, Context};
use serde::Serialize;
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
    if Command::new("wrk").arg("--version").output().is_err() {
        bail!("wrk is not installed: `apt-get install wrk` (or `make bench`, which does it)");
    }
    let policy = r#"{"maxInflight": 1000000}"#;
    let module = match &args.module {
        Some(module) => module.clone(),
        None => paths::wasm_module("admission_gate")?,
    };
    let gate = FilterConfig::admission_gate(module, policy);
    let no_filter = EnvoyBuilder::new("bench/no-filter.yaml")
        .concurrency(1)
        .start()?;
    let gated = EnvoyBuilder::new("bench/gate.yaml")
        .filter(gate)
        .concurrency(1)
        .start()?;
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
    std::fs::create_dir_all(&args.out)?;
    let path = args.out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)?;
    println!("summary written to {}", path.display());
    Ok(())
}

/// Requests per second wrk reached against the envoy's public listener.
fn wrk(envoy: &Envoy, connections: u32, duration: Duration) -> anyhow::Result<f64> {
    let output = Command::new("taskset")
        .args(["-c", "0", "wrk"])
        .args([
            "-t1",
            &format!("-c{connections}"),
            &format!("-d{}s", duration.as_secs().max(1)),
        ])
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
