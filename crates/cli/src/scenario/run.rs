//! `stakegate scenario run`: a scenario for real.
//!
//! rpc-node with the scenario's `[node]`, Envoy with its filter chain
//! (through `envoy-config/` and file-based ECDS) and one load generator
//! process for all its clients. While the load runs, the node is sampled ten
//! times a second (progress on stderr, and the node's side of the
//! timeline), and `gateway.swaps` are deployed as `stakegate deploy` does
//! it. Clients with a `latency` reach Envoy through a relay that delays
//! every byte by half that round trip each way ([`DelayRelay`]); clients
//! with a `source` send from 127.x.y.z with the source's last three bytes,
//! so Envoy tells them apart by address.
//!
//! Results go to `--out` (default `results/<name>`): summary.json (the
//! format in `scenarios/README.md`, `mode: "real"`), timeline.csv and three PNG plots.

use super::fleet;
use super::stack::Stack;
use super::{plot, Scenario, DEFAULT_SOURCE};
use crate::deploy;
use crate::summary::{NodeSecond, NodeSummary, Summary, SwapResult};
use anyhow::{bail, Context};
use stakegate_loadgen::{ClientSpec, Report, RunSpec};
use stakegate_stack::{loadgen, DelayRelay};
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The scenario file, or the name of one under scenarios/ (tip-flood).
    pub scenario: String,
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
    /// Run on the compose stack this file describes (written by
    /// `stakegate scenario stack`) instead of starting one.
    #[arg(long)]
    pub stack: Option<PathBuf>,
    /// Run for this long instead of the scenario's duration (swaps and
    /// Redis outages past it are dropped).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
}

/// How often the node is sampled during the run (a block holds the tip
/// back for about block_exec, 100 ms by default).
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let (scenario, summary) = run_and_record(args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", crate::sim::table(&scenario, &summary));
    }
    Ok(())
}

/// Runs the scenario `args` name and writes its results to `--out`;
/// returns the scenario as run (`--no-filters` and `--duration` applied)
/// and its summary.
pub fn run_and_record(args: &RunArgs) -> anyhow::Result<(Scenario, Summary)> {
    let mut scenario = Scenario::load(&super::resolve(&args.scenario))?;
    if args.no_filters {
        scenario.filters.clear();
        scenario.swaps.clear();
        scenario.name += "-no-filters";
    }
    if let Some(duration) = args.duration {
        scenario.duration = duration;
        scenario.swaps.retain(|s| s.at < duration);
        scenario
            .redis_outages
            .retain(|&(at, length)| at + length < duration);
    }
    if scenario.node.changes.iter().any(|c| c.read_slots.is_some()) {
        bail!("node.changes: only `stakegate sim` changes the node's read slots during a run");
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("results").join(&scenario.name));
    let stack = match &args.stack {
        Some(path) => {
            say(&format!("using the compose stack of {}", path.display()));
            Stack::attach(path, &scenario)?
        }
        None => {
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
            Stack::start(&scenario, args.concurrency)?
        }
    };
    let summary = execute(&scenario, &stack)?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    crate::summary::write(&out, &summary)?;
    let csv = out.join("timeline.csv");
    std::fs::write(&csv, timeline_csv(&summary))?;
    eprintln!("timeline written to {}", csv.display());
    for path in plot::draw(&summary, &out)? {
        eprintln!("plot written to {}", path.display());
    }
    Ok((scenario, summary))
}

fn say(what: &str) {
    eprintln!("[scenario] {what}");
}

/// Runs the load on the stack, with the sampler and the swaps beside it,
/// and summarises.
fn execute(scenario: &Scenario, stack: &Stack) -> anyhow::Result<Summary> {
    let (spec, _relays) = run_spec(scenario, stack)?;
    stack.reset_node()?;

    say(&format!(
        "{} clients, {:.0} rps offered for {:?}",
        scenario.clients.len(),
        scenario.clients.iter().map(|c| c.rate).sum::<f64>(),
        scenario.duration
    ));
    if !scenario.redis_outages.is_empty() && !stack.controls_redis() {
        bail!("gateway.redis_outages: only a native run stops Redis; run it without --stack, or with --duration ending before the first outage");
    }
    let done = AtomicBool::new(false);
    let started = Instant::now();
    let (report, samples, swaps, fleet) = std::thread::scope(|s| {
        let sampler = s.spawn(|| sample(stack, started, scenario.duration, &done));
        let swapper = s.spawn(|| swap(scenario, stack, started, &done));
        let fleet = (scenario.replicas > 1)
            .then(|| s.spawn(|| fleet::watch(scenario, stack, started, &done)));
        let report = loadgen::run(&spec);
        done.store(true, Ordering::Relaxed);
        let samples = sampler.join().expect("the sampler does not panic");
        let swaps = swapper.join().expect("the swapper does not panic");
        let fleet = fleet.map(|f| f.join().expect("the fleet watch does not panic"));
        (report, samples, swaps, fleet)
    });
    let report = report?;
    let node_metrics = stack.node_metrics()?;
    let mut node_summary = NodeSummary::from_metrics(&node_metrics);
    node_summary.timeline = samples;
    let answered = report.count("200");
    if let (Some(at_node), true) = (node_metrics["requests"].as_u64(), answered > 0) {
        let avoided = 1.0 - at_node as f64 / answered as f64;
        node_summary.calls_avoided = Some((avoided * 1000.0).round() / 1000.0);
        say(&format!(
            "the node saw {at_node} requests for the {answered} answered: {:.1} % never reached it",
            100.0 * avoided
        ));
    }
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
    if let Some(watched) = fleet {
        summary.fleet = Some(fleet::summarise(scenario, &summary, watched?));
    }
    Ok(summary)
}

/// The load: every client at its rate, from its address, with its timeout,
/// and the delay relays of clients with a latency (they serve while kept).
fn run_spec(scenario: &Scenario, stack: &Stack) -> anyhow::Result<(RunSpec, Vec<DelayRelay>)> {
    let mut relays: BTreeMap<(Duration, SocketAddr), DelayRelay> = BTreeMap::new();
    let mut clients = Vec::with_capacity(scenario.clients.len());
    let mut told = false;
    for client in &scenario.clients {
        // Without the gate (the passthrough and QoS-only configs) there is
        // no internal listener, and no class to tell traffic apart by.
        let internal = client.internal && super::stack::has_internal_listener(scenario)?;
        let direct = stack
            .listeners(internal, client.replica)
            .with_context(|| format!("client {}", client.id))?;
        // A source address is a loopback one: it can reach a listener on
        // loopback, or the relay, but not the compose stack's gateway.
        let local = !client.latency.is_zero() || direct.iter().all(|a| a.ip().is_loopback());
        let mut targets = Vec::with_capacity(direct.len());
        for addr in direct {
            if client.latency.is_zero() {
                targets.push(format!("http://{addr}/"));
            } else {
                let relay = match relays.entry((client.latency, addr)) {
                    Entry::Occupied(relay) => relay.into_mut(),
                    Entry::Vacant(slot) => slot.insert(DelayRelay::start(addr, client.latency)?),
                };
                targets.push(relay.url());
            }
        }
        if !local && client.source != DEFAULT_SOURCE && !told {
            eprintln!("[scenario] note: on the compose stack every client comes from the loadgen container's address; the scenario's client source addresses apply to native runs");
            told = true;
        }
        clients.push(ClientSpec {
            mix: client.mix.iter().cloned().collect(),
            api_key: client.api_key.clone(),
            // Open loop: the schedule, not the answers, paces a client.
            concurrency: 1_000_000,
            targets,
            retries: client.retries,
            unique_params: client.unique_params,
            history: client.history,
            source: if local {
                loopback(&client.source)?
            } else {
                None
            },
            timeout_ms: Some(client.timeout.as_millis() as u64),
            phases: client.phases.clone(),
            offset_ms: client.offset_ms,
            ..ClientSpec::new(&client.id, client.rate)
        });
    }
    let fastest = clients.iter().map(|c| c.rate).fold(0.0, f64::max);
    let spec = RunSpec {
        target: format!("http://{}/", stack.listeners(false, Some(0))?[0]),
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
    stack: &Stack,
    started: Instant,
    duration: Duration,
    done: &AtomicBool,
) -> Vec<NodeSecond> {
    let mut seconds: Vec<NodeSecond> = Vec::new();
    let mut served_before = 0u64;
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(SAMPLE_EVERY);
        let Ok(metrics) = stack.node_metrics() else {
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
    stack: &Stack,
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
        let at_s = (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
        // Every replica gets the policy; the result is the slowest one's.
        let result = stack
            .deploy_targets(&filter.name)
            .iter()
            .map(|target| deploy::deploy_policy(target, &filter.module, &swap.policy))
            .reduce(|a, b| match (a, b) {
                (Ok(a), Ok(b)) if b.apply_ms > a.apply_ms => Ok(b),
                (Err(e), _) | (_, Err(e)) => Err(e),
                (a, _) => a,
            })
            .context("no gateway to deploy to")
            .and_then(|r| r);
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

fn summarise(scenario: &Scenario, report: &Report, node: NodeSummary) -> Summary {
    let mut summary = Summary::from_report(
        &scenario.name,
        scenario.capacity_rps(),
        report,
        &scenario.parties(),
        Some(node),
    );
    summary.measure_node_time(scenario.capacity_node_ms());
    summary
}

/// Per second and per client: admitted, rejected and failed requests (by
/// the second they came due), with the node's tip lag and queue in that
/// second.
pub fn timeline_csv(summary: &Summary) -> String {
    let mut out = String::from("second,client,admitted,rejected,failed,tip_lag_ms,node_queue\n");
    let node: &[NodeSecond] = summary.node.as_ref().map_or(&[], |n| &n.timeline);
    for second in 0..summary.seconds() {
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
