//! `stakegate demo`: "tip under RPC flood" (docs/background.md part 5), for real.
//!
//! rpc-node runs with few read slots and its sync loop; an eth_call flood at
//! four times its capacity goes through Envoy's public listener while the
//! node's own callers use the internal listener. Both variants run the same
//! Envoy config (`envoy-config/gate.yaml`) and the compiled gate: "no-gate"
//! sets `maxInflight: -1` (counted, never limited), "gate" sets it at the
//! node's read slots. Each variant gets a fresh node and Envoy, measures an
//! unloaded baseline, then the flood, and reports what the clients saw and
//! what the node went through.

use crate::summary::{NodeSummary, Summary};
use anyhow::Context;
use serde::Serialize;
use stakegate_loadgen::{ClientSpec, RunSpec};
use stakegate_stack::{paths, Envoy, EnvoyBuilder, FilterConfig, RpcNode};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// How long the flood lasts.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub flood: Duration,
    /// Where summary.json goes.
    #[arg(long, default_value = "results/tip-flood")]
    pub out: PathBuf,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    pub concurrency: u32,
}

const READ_SLOTS: u32 = 8;
const SYNC_SLOTS: u32 = 2;
const ETH_CALL_COST_MS: u64 = 20;
const BLOCK_INTERVAL_MS: u64 = 1000;
const BLOCK_EXEC_MS: u64 = 100;
/// Requests per second the node can serve: every slot busy with eth_call.
const CAPACITY_RPS: f64 = READ_SLOTS as f64 * 1000.0 / ETH_CALL_COST_MS as f64;
const FLOOD_RPS: f64 = 4.0 * CAPACITY_RPS;
const BASELINE_RPS: f64 = 0.1 * CAPACITY_RPS;
/// The node's own callers, on the internal listener, during the flood.
const INTERNAL_RPS: f64 = 20.0;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// One way of running the gateway: the gate's `maxInflight`.
struct Variant {
    name: &'static str,
    max_inflight: i64,
}

const VARIANTS: &[Variant] = &[
    Variant {
        name: "no-gate",
        max_inflight: -1,
    },
    Variant {
        name: "gate",
        max_inflight: READ_SLOTS as i64,
    },
];

impl Variant {
    fn policy(&self) -> String {
        format!(
            r#"{{"maxInflight": {}, "classes": {{"internal": [{{"listenerMetadata": "internal"}}]}}}}"#,
            self.max_inflight
        )
    }
}

#[derive(Debug, Serialize)]
struct VariantResult {
    #[serde(flatten)]
    summary: Summary,
    max_inflight: i64,
    unloaded_p99_ms: f64,
    /// p99 of the flood's rejections, timed from when they came due.
    rejected_p99_ms: f64,
    /// The same rejections timed from their send: the gateway's answer time
    /// without the load generator's own scheduling lag.
    rejected_answer_p99_ms: f64,
    /// Internal requests the gate rejected (its own count).
    internal_rejected: i64,
    /// Internal requests that did not get a 200, for any reason.
    internal_failed: u64,
    /// Shared-data CAS retries and failures in the gate (contention).
    cas_retries: i64,
    store_errors: i64,
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
         capacity {CAPACITY_RPS:.0} rps), a block every {BLOCK_INTERVAL_MS} ms;\n\
         an eth_call flood at {FLOOD_RPS:.0} rps for {:?} through Envoy, with and without the gate.\n",
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
    crate::summary::write(&args.out, &summary)
}

fn run_variant(
    runtime: &tokio::runtime::Runtime,
    variant: &Variant,
    args: &DemoArgs,
) -> anyhow::Result<VariantResult> {
    let say = |what: &str| println!("[{}] {what}", variant.name);
    say(&format!(
        "starting rpc-node, and Envoy with the gate at maxInflight {}",
        variant.max_inflight
    ));
    let node = RpcNode::start(&[
        "--read-slots".to_string(),
        READ_SLOTS.to_string(),
        "--cost".into(),
        format!("eth_call={ETH_CALL_COST_MS}ms"),
        "--block-interval".into(),
        format!("{BLOCK_INTERVAL_MS}ms"),
        "--block-exec".into(),
        format!("{BLOCK_EXEC_MS}ms"),
        "--sync-slots".into(),
        SYNC_SLOTS.to_string(),
    ])?;
    let gate =
        FilterConfig::admission_gate(paths::wasm_module("admission_gate")?, variant.policy());
    let envoy = EnvoyBuilder::new("gate.yaml")
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .filter(gate)
        .concurrency(args.concurrency)
        .start()?;
    let public = envoy.url("public")?;

    say(&format!("unloaded baseline: {BASELINE_RPS:.0} rps for 3s"));
    let baseline = vec![client("baseline", BASELINE_RPS, "eth_call", None)];
    let baseline = runtime.block_on(stakegate_loadgen::run(&spec(
        &public,
        baseline,
        Duration::from_secs(3),
    )))?;
    node.reset_metrics()?;

    say(&format!(
        "flood: {FLOOD_RPS:.0} rps of eth_call for {:?}, and {INTERNAL_RPS:.0} rps on the internal listener",
        args.flood
    ));
    let clients = vec![
        client("flood", FLOOD_RPS, "eth_call", None),
        client(
            "internal",
            INTERNAL_RPS,
            "eth_blockNumber",
            Some(envoy.url("internal")?),
        ),
    ];
    let flood = runtime.block_on(stakegate_loadgen::run(&spec(&public, clients, args.flood)))?;
    let node = NodeSummary::from_metrics(&node.metrics()?);
    let internal_sent = flood.client("internal").map_or(0, |c| c.header.sent);
    let internal_failed = flood
        .client("internal")
        .map_or(0, |c| internal_sent - c.count("200"));
    let internal_rejected = internal_rejections(&envoy, internal_sent)?;
    let gate_stat = |name: &str| envoy.stat(&format!("wasmcustom.stakegate.gate.{name}"));
    say(&format!(
        "done: tip lag max {:.0} ms, {} flood requests rejected, {internal_rejected} internal rejected",
        node.tip_lag_max_ms,
        flood.client("flood").map_or(0, |c| c.count("503")),
    ));
    Ok(VariantResult {
        summary: Summary::from_report("tip-flood", CAPACITY_RPS, &flood, &[], Some(node)),
        max_inflight: variant.max_inflight,
        unloaded_p99_ms: baseline.latency_ms.ok.p99,
        rejected_p99_ms: flood
            .client("flood")
            .map_or(0.0, |c| c.latency_ms.rejected.p99),
        rejected_answer_p99_ms: flood
            .client("flood")
            .map_or(0.0, |c| c.latency_ms.rejected_service.p99),
        internal_rejected,
        internal_failed,
        cas_retries: gate_stat("cas_retries")?,
        store_errors: gate_stat("store_errors")?,
    })
}

/// The gate's own count of rejected internal requests, read once its stats
/// (flushed every heartbeat) account for all `sent` of them, or after a few
/// heartbeats if some never reached the gate (transport failures).
fn internal_rejections(envoy: &Envoy, sent: u64) -> anyhow::Result<i64> {
    let stat = |name: &str| envoy.stat(&format!("wasmcustom.stakegate.gate.{name}.internal"));
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let rejected = stat("rejected")?;
        if stat("admitted")? + rejected >= sent as i64 || Instant::now() > deadline {
            return Ok(rejected);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn spec(target: &str, clients: Vec<ClientSpec>, duration: Duration) -> RunSpec {
    let fastest = clients.iter().map(|c| c.rate).fold(0.0, f64::max);
    RunSpec {
        target: target.into(),
        duration,
        max_requests: (fastest * duration.as_secs_f64()).ceil() as u64,
        timeout: CLIENT_TIMEOUT,
        // Thousands of queued requests ride on a few connections, spread
        // over Envoy's workers as a flood from many clients would be.
        http2: true,
        connections: 4,
        clients,
    }
}

fn client(id: &str, rate: f64, method: &str, target: Option<String>) -> ClientSpec {
    ClientSpec {
        mix: [(method.to_string(), 1.0)].into(),
        concurrency: 1_000_000,
        target,
        ..ClientSpec::new(id, rate)
    }
}

fn table(summary: &DemoSummary) -> String {
    type Cell = fn(&VariantResult) -> String;
    let rows: &[(&str, Cell)] = &[
        ("flood offered rps", |v| {
            format!("{:.0}", flood(v).offered_rps)
        }),
        ("flood answered 200", |v| status(v, "flood", "200")),
        ("flood rejected 503", |v| status(v, "flood", "503")),
        ("flood timed out", |v| status(v, "flood", "timeout")),
        ("flood transport errors", |v| {
            status(v, "flood", "transport_error")
        }),
        ("admitted rps", |v| format!("{:.0}", flood(v).admitted_rps)),
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
        ("rejected p99 ms (due)", |v| {
            format!("{:.2}", v.rejected_p99_ms)
        }),
        ("rejected p99 ms (sent)", |v| {
            format!("{:.2}", v.rejected_answer_p99_ms)
        }),
        ("node queue max", |v| node(v, |n| n.queue_max.to_string())),
        ("node tip lag max ms", |v| {
            node(v, |n| format!("{:.0}", n.tip_lag_max_ms))
        }),
        ("tip lost", |v| node(v, |n| n.tip_lost.to_string())),
        ("internal answered", |v| status(v, "internal", "200")),
        ("internal failed", |v| v.internal_failed.to_string()),
        ("internal rejected (gate)", |v| {
            v.internal_rejected.to_string()
        }),
        ("gate CAS retries", |v| v.cas_retries.to_string()),
    ];
    let columns: Vec<(&str, &VariantResult)> = VARIANTS
        .iter()
        .filter_map(|variant| Some((variant.name, summary.variants.get(variant.name)?)))
        .collect();
    let mut out = format!("{:<26}", "");
    for (name, _) in &columns {
        out += &format!("{name:>14}");
    }
    out.push('\n');
    for (label, cell) in rows {
        out += &format!("{label:<26}");
        for (_, variant) in &columns {
            out += &format!("{:>14}", cell(variant));
        }
        out.push('\n');
    }
    out
}

fn flood(v: &VariantResult) -> &crate::summary::ClientSummary {
    // The flood client is always part of the run.
    &v.summary.clients[0]
}

fn status(v: &VariantResult, id: &str, key: &str) -> String {
    v.summary
        .client(id)
        .and_then(|c| c.status_counts.get(key))
        .copied()
        .unwrap_or(0)
        .to_string()
}

fn node(v: &VariantResult, f: fn(&NodeSummary) -> String) -> String {
    v.summary.node.as_ref().map_or("-".into(), f)
}
