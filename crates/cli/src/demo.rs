//! `stakegate demo`: "tip under RPC flood" (SEEDS.md part 5), for real.
//!
//! rpc-node runs with few read slots and its sync loop; an eth_call flood at
//! four times its capacity goes through Envoy. Each variant gets a fresh node
//! and Envoy, measures an unloaded baseline, then the flood, and reports what
//! the clients saw and what the node went through.

use crate::summary::{NodeSummary, Summary};
use anyhow::Context;
use serde::Serialize;
use stakegate_loadgen::{ClientSpec, Report, RunSpec};
use stakegate_stack::{EnvoyBuilder, RpcNode};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// How long the flood lasts.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub flood: Duration,
    /// Where summary.json goes.
    #[arg(long, default_value = "results/tip-flood")]
    pub out: PathBuf,
}

const READ_SLOTS: u32 = 8;
const ETH_CALL_COST_MS: u64 = 20;
const BLOCK_INTERVAL_MS: u64 = 1000;
/// Requests per second the node can serve: every slot busy with eth_call.
const CAPACITY_RPS: f64 = READ_SLOTS as f64 * 1000.0 / ETH_CALL_COST_MS as f64;
const FLOOD_RPS: f64 = 4.0 * CAPACITY_RPS;
const BASELINE_RPS: f64 = 0.1 * CAPACITY_RPS;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// One way of running the gateway.
struct Variant {
    name: &'static str,
    template: &'static str,
}

const VARIANTS: &[Variant] = &[Variant {
    name: "no-gate",
    template: "passthrough.yaml",
}];

#[derive(Debug, Serialize)]
struct VariantResult {
    #[serde(flatten)]
    summary: Summary,
    unloaded_p99_ms: f64,
    rejected_p99_ms: f64,
}

#[derive(Debug, Serialize)]
struct DemoSummary {
    scenario: &'static str,
    capacity_rps: f64,
    flood_rps: f64,
    block_interval_ms: u64,
    variants: BTreeMap<&'static str, VariantResult>,
}

pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    println!(
        "tip under RPC flood: rpc-node with {READ_SLOTS} read slots (eth_call {ETH_CALL_COST_MS} ms, \
         capacity {CAPACITY_RPS:.0} rps), blocks every {BLOCK_INTERVAL_MS} ms;\n\
         eth_call flood at {FLOOD_RPS:.0} rps for {:?} through Envoy.\n",
        args.flood
    );
    let runtime = tokio::runtime::Runtime::new()?;
    let mut variants = BTreeMap::new();
    for variant in VARIANTS {
        let result = run_variant(&runtime, variant, args)
            .with_context(|| format!("variant {}", variant.name))?;
        variants.insert(variant.name, result);
    }
    let summary = DemoSummary {
        scenario: "tip-flood",
        capacity_rps: CAPACITY_RPS,
        flood_rps: FLOOD_RPS,
        block_interval_ms: BLOCK_INTERVAL_MS,
        variants,
    };
    println!("\n{}", table(&summary));
    std::fs::create_dir_all(&args.out)?;
    let path = args.out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)?;
    println!("summary written to {}", path.display());
    Ok(())
}

fn run_variant(
    runtime: &tokio::runtime::Runtime,
    variant: &Variant,
    args: &DemoArgs,
) -> anyhow::Result<VariantResult> {
    let say = |what: &str| println!("[{}] {what}", variant.name);
    say("starting rpc-node and Envoy");
    let node = RpcNode::start(&[
        "--read-slots".to_string(),
        READ_SLOTS.to_string(),
        "--cost".into(),
        format!("eth_call={ETH_CALL_COST_MS}ms"),
        "--block-interval".into(),
        format!("{BLOCK_INTERVAL_MS}ms"),
        "--block-exec".into(),
        "100ms".into(),
        "--sync-slots".into(),
        "4".into(),
    ])?;
    let envoy = EnvoyBuilder::new(variant.template)
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .concurrency(2)
        .start()?;
    let target = envoy.url("public")?;

    say(&format!("unloaded baseline: {BASELINE_RPS:.0} rps for 3s"));
    let baseline = runtime.block_on(stakegate_loadgen::run(&spec(
        &target,
        "baseline",
        BASELINE_RPS,
        Duration::from_secs(3),
    )))?;
    node.reset_metrics()?;

    say(&format!(
        "flood: {FLOOD_RPS:.0} rps of eth_call for {:?}",
        args.flood
    ));
    let flood = runtime.block_on(stakegate_loadgen::run(&spec(
        &target, "flood", FLOOD_RPS, args.flood,
    )))?;
    let node_summary = NodeSummary::from_metrics(&node.metrics()?);
    say(&format!(
        "done: {} answered, {} rejected, tip lag max {:.0} ms",
        flood.count("200"),
        flood.count("503"),
        node_summary.tip_lag_max_ms
    ));
    Ok(result(&flood, &baseline, node_summary))
}

fn spec(target: &str, id: &str, rate: f64, duration: Duration) -> RunSpec {
    RunSpec {
        target: target.into(),
        duration,
        max_requests: (rate * duration.as_secs_f64()).ceil() as u64,
        timeout: CLIENT_TIMEOUT,
        // Thousands of queued requests ride on a few connections.
        http2: true,
        clients: vec![ClientSpec {
            mix: [("eth_call".to_string(), 1.0)].into(),
            concurrency: 1_000_000,
            ..ClientSpec::new(id, rate)
        }],
    }
}

fn result(flood: &Report, baseline: &Report, node: NodeSummary) -> VariantResult {
    VariantResult {
        summary: Summary::from_report(
            "tip-flood",
            CAPACITY_RPS,
            flood,
            &BTreeMap::new(),
            Some(node),
        ),
        unloaded_p99_ms: baseline.latency_ms.ok.p99,
        rejected_p99_ms: flood.latency_ms.rejected.p99,
    }
}

fn table(summary: &DemoSummary) -> String {
    type Row = (&'static str, fn(&VariantResult) -> String);
    let rows: &[Row] = &[
        ("offered rps", |v| format!("{:.0}", v.summary.offered_rps)),
        ("answered 200", |v| count(v, "200")),
        ("rejected 503", |v| count(v, "503")),
        ("timed out", |v| count(v, "timeout")),
        ("transport errors", |v| count(v, "transport_error")),
        ("admitted rps", |v| format!("{:.0}", v.summary.admitted_rps)),
        ("unloaded p99 ms", |v| format!("{:.1}", v.unloaded_p99_ms)),
        ("admitted p50 ms", |v| {
            format!("{:.1}", v.summary.latency_ms.p50)
        }),
        ("admitted p99 ms", |v| {
            format!("{:.1}", v.summary.latency_ms.p99)
        }),
        ("admitted max ms", |v| {
            format!("{:.1}", v.summary.latency_ms.max)
        }),
        ("rejected p99 ms", |v| format!("{:.2}", v.rejected_p99_ms)),
        ("node queue max", |v| node(v, |n| n.queue_max.to_string())),
        ("node tip lag max ms", |v| {
            node(v, |n| format!("{:.0}", n.tip_lag_max_ms))
        }),
        ("tip lost", |v| node(v, |n| n.tip_lost.to_string())),
    ];
    let mut out = format!("{:<22}", "");
    for name in summary.variants.keys() {
        out += &format!("{name:>14}");
    }
    out.push('\n');
    for (label, cell) in rows {
        out += &format!("{label:<22}");
        for variant in summary.variants.values() {
            out += &format!("{:>14}", cell(variant));
        }
        out.push('\n');
    }
    out
}

fn count(v: &VariantResult, key: &str) -> String {
    v.summary
        .status_counts
        .get(key)
        .copied()
        .unwrap_or(0)
        .to_string()
}

fn node(v: &VariantResult, f: fn(&NodeSummary) -> String) -> String {
    v.summary.node.as_ref().map_or("-".into(), f)
}
