//! `stakegate scenario run`: a scenario for real.
//!
//! rpc-node with the scenario's `[node]`, Envoy with its filter chain
//! (through `envoy-config/` and file-based ECDS) and one load generator
//! process for every client. While the load runs, the node is sampled four
//! times a second (progress on stderr, and the node's side of the
//! timeline), and `gateway.swaps` are deployed as `stakegate deploy` does
//! it. Clients with a `latency` reach Envoy through a relay that delays
//! every byte by half that round trip each way ([`DelayRelay`]); clients
//! with a `source` send from 127.x.y.z with the source's last three bytes,
//! so Envoy tells them apart by address.
//!
//! Results go to `--out` (default `results/<name>`): summary.json (the
//! PRODUCT.md format, `mode: "real"`), timeline.csv and three PNG plots.

use super::{plot, Scenario};
use crate::deploy::{self, Target};
use crate::summary::{NodeSecond, NodeSummary, Summary, SwapResult};
use anyhow::{bail, Context};
use stakegate_loadgen::{ClientSpec, Report, RunSpec};
use stakegate_stack::{loadgen, DelayRelay, Envoy, EnvoyBuilder, FilterConfig, RpcNode};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The scenario file.
    pub scenario: PathBuf,
    /// Print the JSON summary on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Where summary.json, timeline.csv and the plots go (default
    /// results/<scenario name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The same traffic with no filter in the way (Envoy passes it through).
    #[arg(long)]
    pub no_filters: bool,
    /// Envoy worker threads (default: the scenario's gateway.workers).
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Run for this long instead of the scenario's duration (swaps past it
    /// are dropped).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
}

/// How often the node is sampled during the run.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let mut scenario = Scenario::load(&args.scenario)?;
    if args.no_filters {
        scenario.filters.clear();
        scenario.swaps.clear();
        scenario.name += "-no-filters";
    }
    if let Some(duration) = args.duration {
        scenario.duration = duration;
        scenario.swaps.retain(|s| s.at < duration);
    }
    if !scenario.node.changes.is_empty() {
        bail!("node.changes: only `stakegate sim` changes the node's read slots during a run");
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("results").join(&scenario.name));
    let summary = execute(&scenario, args.concurrency)?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    crate::summary::write(&out, &summary)?;
    let csv = out.join("timeline.csv");
    std::fs::write(&csv, timeline_csv(&summary))?;
    eprintln!("timeline written to {}", csv.display());
    for path in plot::draw(&summary, &out)? {
        eprintln!("plot written to {}", path.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", crate::sim::table(&scenario, &summary));
        for swap in &summary.swaps {
            println!("{}", swap_line(swap));
        }
    }
    Ok(())
}

fn say(what: &str) {
    eprintln!("[scenario] {what}");
}

/// Starts the stack, runs the load, and summarises.
fn execute(scenario: &Scenario, concurrency: Option<u32>) -> anyhow::Result<Summary> {
    say(&format!(
        "starting rpc-node ({} read slots) and Envoy with {}",
        scenario.node.read_slots,
        if scenario.filters.is_empty() {
            "no filter".to_string()
        } else {
            scenario
                .filters
                .iter()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    let node = RpcNode::start(&node_args(scenario))?;
    let mut builder = EnvoyBuilder::new(template(scenario)?)
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .concurrency(concurrency.unwrap_or(scenario.workers as u32));
    for filter in &scenario.filters {
        builder = builder.filter(filter_config(&filter.name, &filter.module, &filter.policy));
    }
    let envoy = builder.start()?;
    let (spec, _relays) = run_spec(scenario, &envoy)?;
    node.reset_metrics()?;

    say(&format!(
        "{} clients, {:.0} rps offered for {:?}",
        scenario.clients.len(),
        scenario.clients.iter().map(|c| c.rate).sum::<f64>(),
        scenario.duration
    ));
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let (report, samples, swaps) = std::thread::scope(|s| {
        let sampler = s.spawn(|| sample(&node, started, scenario.duration, &done));
        let swapper = s.spawn(|| swap(scenario, &envoy, started, &done));
        let report = loadgen::run(&spec);
        done.store(true, Ordering::Relaxed);
        let samples = sampler.join().expect("the sampler does not panic");
        let swaps = swapper.join().expect("the swapper does not panic");
        (report, samples, swaps)
    });
    let report = report?;
    let mut node_summary = NodeSummary::from_metrics(&node.metrics()?);
    node_summary.timeline = samples;
    if !scenario.clients.iter().any(|c| c.unique_params) {
        // The node tells requests apart by params: without unique params
        // every request of a method looks like a retry of the first.
        node_summary.upstream = None;
    }
    say(&format!(
        "done: {} admitted, tip lag max {:.0} ms",
        report.count("200"),
        node_summary.tip_lag_max_ms
    ));
    let mut summary = summarise(scenario, &report, node_summary);
    summary.swaps = swaps;
    Ok(summary)
}

fn node_args(scenario: &Scenario) -> Vec<String> {
    let node = &scenario.node;
    let mut args = vec![
        "--read-slots".to_string(),
        node.read_slots.to_string(),
        "--sync-slots".into(),
        node.sync_slots.to_string(),
        "--block-interval".into(),
        format!("{}ms", node.block_interval.as_millis()),
        "--block-exec".into(),
        format!("{}ms", node.block_exec.as_millis()),
        "--tip-lost-after".into(),
        node.tip_lost_after.to_string(),
    ];
    for (method, cost) in node.costs.methods() {
        args.push("--cost".into());
        args.push(format!("{method}={}us", cost.as_micros()));
    }
    args
}

/// The gateway config for the scenario's filter chain.
fn template(scenario: &Scenario) -> anyhow::Result<&'static str> {
    let names: Vec<&str> = scenario.filters.iter().map(|f| f.name.as_str()).collect();
    Ok(match names.as_slice() {
        [] => "passthrough.yaml",
        ["admission-gate"] => "gate.yaml",
        ["stake-qos"] => "qos.yaml",
        _ => bail!(
            "gateway.filters: real runs have Envoy configs for one filter (admission-gate or stake-qos) or none, not {names:?}"
        ),
    })
}

fn filter_config(name: &str, module: &Path, policy: &str) -> FilterConfig {
    if name == "stake-qos" {
        FilterConfig::stake_qos(module, policy)
    } else {
        FilterConfig::admission_gate(module, policy)
    }
}

/// The load: every client at its rate, from its address, with its timeout,
/// and the delay relays of clients with a latency (they serve while kept).
fn run_spec(scenario: &Scenario, envoy: &Envoy) -> anyhow::Result<(RunSpec, Vec<DelayRelay>)> {
    let mut relays: BTreeMap<(Duration, bool), DelayRelay> = BTreeMap::new();
    let mut clients = Vec::with_capacity(scenario.clients.len());
    for client in &scenario.clients {
        let listener = if client.internal {
            "internal"
        } else {
            "public"
        };
        let direct = envoy.listener(listener).with_context(|| {
            format!(
                "client {}: the gateway has no {listener} listener",
                client.id
            )
        })?;
        let target = if client.latency.is_zero() {
            format!("http://{direct}/")
        } else {
            let key = (client.latency, client.internal);
            if !relays.contains_key(&key) {
                relays.insert(key, DelayRelay::start(direct, client.latency)?);
            }
            relays[&key].url()
        };
        clients.push(ClientSpec {
            mix: client.mix.iter().cloned().collect(),
            api_key: client.api_key.clone(),
            // Open loop: the schedule, not the answers, paces a client.
            concurrency: 1_000_000,
            target: Some(target),
            retries: client.retries,
            unique_params: client.unique_params,
            source: loopback(&client.source)?,
            timeout_ms: Some(client.timeout.as_millis() as u64),
            ..ClientSpec::new(&client.id, client.rate)
        });
    }
    let fastest = clients.iter().map(|c| c.rate).fold(0.0, f64::max);
    let spec = RunSpec {
        target: envoy.url("public")?,
        duration: scenario.duration,
        max_requests: (fastest * scenario.duration.as_secs_f64()).ceil() as u64,
        timeout: Duration::from_secs(30),
        // Thousands of queued requests ride on a few connections per
        // client, spread over Envoy's workers.
        http2: true,
        connections: 2,
        clients,
    };
    Ok((spec, relays.into_values().collect()))
}

/// A scenario source address on loopback: 127 and its last three bytes
/// (127.0.0.1 stays itself).
fn loopback(source: &str) -> anyhow::Result<Option<IpAddr>> {
    let addr: Ipv4Addr = source
        .parse()
        .with_context(|| format!("client source {source:?}: an IPv4 address"))?;
    let [_, b, c, d] = addr.octets();
    Ok(Some(IpAddr::V4(Ipv4Addr::new(127, b, c, d))))
}

/// Samples the node until `done`, printing progress once a second; returns
/// the largest tip lag and queue depth of each second.
fn sample(
    node: &RpcNode,
    started: Instant,
    duration: Duration,
    done: &AtomicBool,
) -> Vec<NodeSecond> {
    let mut seconds: Vec<NodeSecond> = Vec::new();
    let mut served_before = 0u64;
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(SAMPLE_EVERY);
        let Ok(metrics) = node.metrics() else {
            continue;
        };
        let second = started.elapsed().as_secs() as usize;
        if seconds.len() <= second {
            if let Some(last) = seconds.last() {
                let served: u64 = metrics["served"]
                    .as_object()
                    .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
                eprintln!(
                    "[{:>4}/{} s] node: {:>6} rps served, queue {:>5}, tip lag {:>6.0} ms",
                    seconds.len(),
                    duration.as_secs(),
                    served.saturating_sub(served_before),
                    last.queue_depth,
                    last.tip_lag_ms
                );
                served_before = served;
            }
            seconds.resize(second + 1, NodeSecond::default());
        }
        let now = &mut seconds[second];
        now.tip_lag_ms = now
            .tip_lag_ms
            .max(metrics["tip_lag_ms"].as_f64().unwrap_or(0.0));
        now.queue_depth = now
            .queue_depth
            .max(metrics["queue_depth"].as_u64().unwrap_or(0));
    }
    seconds
}

/// Deploys each of `gateway.swaps` when it is due, until `done`.
fn swap(
    scenario: &Scenario,
    envoy: &Envoy,
    started: Instant,
    done: &AtomicBool,
) -> Vec<SwapResult> {
    let mut results = Vec::new();
    for swap in &scenario.swaps {
        while started.elapsed() < swap.at {
            if done.load(Ordering::Relaxed) {
                return results;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let filter = &scenario.filters[swap.filter];
        let target = Target {
            filter: filter.name.clone(),
            dir: envoy.ecds_dir().to_path_buf(),
            admin: envoy.admin_url().to_string(),
            timeout: Duration::from_secs(10),
            envoy_log: Some(envoy.log_path().to_path_buf()),
        };
        let at_s = (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
        let result = deploy::deploy_policy(&target, &filter.module, &swap.policy);
        let line = match &result {
            Ok(d) => format!(
                "swapped {} policy in: version {}, applied in {} ms",
                filter.name, d.version, d.apply_ms
            ),
            Err(e) => format!("swap of {} failed: {e:#}", filter.name),
        };
        say(&format!("{at_s:.1} s: {line}"));
        results.push(SwapResult {
            at_s,
            filter: filter.name.clone(),
            version: result.as_ref().ok().map(|d| d.version),
            apply_ms: result.as_ref().ok().map(|d| d.apply_ms),
            error: result.err().map(|e| format!("{e:#}")),
        });
    }
    results
}

fn swap_line(swap: &SwapResult) -> String {
    match (&swap.error, swap.version, swap.apply_ms) {
        (Some(error), ..) => format!(
            "swap at {:.1} s of {}: FAILED: {error}",
            swap.at_s, swap.filter
        ),
        (None, Some(version), Some(ms)) => format!(
            "swap at {:.1} s of {}: version {version}, applied by Envoy in {ms} ms",
            swap.at_s, swap.filter
        ),
        _ => format!("swap at {:.1} s of {}", swap.at_s, swap.filter),
    }
}

fn summarise(scenario: &Scenario, report: &Report, node: NodeSummary) -> Summary {
    let stakes: BTreeMap<String, u64> = scenario
        .clients
        .iter()
        .map(|c| (c.id.clone(), c.stake))
        .collect();
    Summary::from_report(
        &scenario.name,
        scenario.capacity_rps(),
        report,
        &stakes,
        Some(node),
    )
}

/// Per second and per client: admitted, rejected and failed requests (by
/// the second they came due), with the node's tip lag and queue in that
/// second.
pub fn timeline_csv(summary: &Summary) -> String {
    let mut out = String::from("second,client,admitted,rejected,failed,tip_lag_ms,node_queue\n");
    let node: &[NodeSecond] = summary.node.as_ref().map_or(&[], |n| &n.timeline);
    let seconds = summary
        .clients
        .iter()
        .map(|c| c.timeline.len())
        .max()
        .unwrap_or(0);
    for second in 0..seconds {
        let (lag, queue) = node
            .get(second)
            .map_or((String::new(), String::new()), |n| {
                (format!("{:.0}", n.tip_lag_ms), n.queue_depth.to_string())
            });
        for client in &summary.clients {
            let s = client.timeline.get(second).cloned().unwrap_or_default();
            let _ = writeln!(
                out,
                "{second},{},{},{},{},{lag},{queue}",
                client.id, s.ok, s.rejected, s.failed
            );
        }
    }
    out
}
