//! `stakegate sim SCENARIO.toml`: the scenario's clients through the
//! compiled filters in the offline host, against a virtual node, in virtual
//! time.
//!
//! The virtual node is rpc-node in miniature ([`node::VirtualNode`]). Each
//! client's requests arrive on a
//! fixed schedule; its `latency` is added to what it observes, and after its
//! `timeout` it gives up (a waiting request leaves the node's queue, one
//! being served is finished for nobody). The filters
//! form a chain, as in Envoy: a request goes upstream only if every filter
//! lets it through, and a later filter's local reply ends it for the
//! earlier ones.

mod node;

use crate::scenario::{Client, Scenario};
use crate::summary::{BaselineSummary, Summary, SwapResult};
use anyhow::Context;
use node::{Job, VirtualNode};
use stakegate_core::baseline::{BaselineQos, Mechanism};
use stakegate_host::{Host, LocalReply, Reply, Request, RequestId};
use stakegate_loadgen::report::{ClientHeader, Outcome, Recorder};
use stakegate_loadgen::run::{params_for, unique_params};
use stakegate_loadgen::Report;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// The scenario file.
    pub scenario: PathBuf,
    /// Print the JSON summary instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also show what another mechanism would have admitted per client from
    /// the same traffic: agave-ema-legacy or agave-threshold (docs/background.md part 1).
    #[arg(long = "baseline", value_parser = ["agave-ema-legacy", "agave-threshold"])]
    pub baselines: Vec<String>,
    /// Runs the same traffic with no filters in the way: what the node
    /// faces unprotected.
    #[arg(long)]
    pub no_filters: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Client `client`'s request number `n` is due.
    Arrive {
        client: usize,
        n: u64,
    },
    /// Attempt `attempt` (0 first, then retries) of that request, for the
    /// method at `method` in the client's mix.
    Attempt {
        client: usize,
        n: u64,
        attempt: u32,
        method: usize,
    },
    /// A request finished on the node.
    Served {
        job: usize,
    },
    /// The client stops waiting for a request.
    GiveUp {
        job: usize,
    },
    BlockArrives,
    BlockExecuted,
    /// The node's read slots change (`node.changes[index]`).
    NodeChange {
        index: usize,
    },
    /// `gateway.swaps[index]` is applied.
    Swap {
        index: usize,
    },
}

impl Event {
    /// The next attempt of a request whose attempt `attempt` failed.
    fn retry(client: usize, n: u64, attempt: u32, method: usize) -> Self {
        Event::Attempt {
            client,
            n,
            attempt: attempt + 1,
            method,
        }
    }
}

struct InFlight {
    client: usize,
    n: u64,
    attempt: u32,
    method: usize,
    arrived: u64,
    cost: Duration,
    /// The request's stream in each filter it went through: (filter, id).
    ids: Vec<(usize, RequestId)>,
    /// The node is working on it (it holds a slot).
    started: bool,
    /// The client gave up; the node finishes it for nobody.
    abandoned: bool,
}

/// Runs a scenario and returns its summary, with what each of `baselines`
/// would have admitted from the same arrivals.
pub fn simulate(scenario: &Scenario, baselines: &[Mechanism]) -> anyhow::Result<Summary> {
    let total_stake: u64 = scenario.clients.iter().map(|c| c.stake).sum();
    // What each baseline would admit, per client and second.
    let seconds = scenario.duration.as_secs_f64().ceil() as usize;
    let mut models: Vec<(BaselineQos, Vec<Vec<u64>>)> = baselines
        .iter()
        .map(|m| {
            (
                BaselineQos::new(*m, scenario.capacity_rps(), total_stake),
                vec![vec![0; seconds]; scenario.clients.len()],
            )
        })
        .collect();
    let mut hosts = scenario
        .filters
        .iter()
        .map(|f| {
            let module = std::fs::read(&f.module)
                .with_context(|| format!("reading {}", f.module.display()))?;
            Host::new(&module, f.policy.as_bytes(), scenario.workers)
                .with_context(|| format!("filter {}", f.name))
        })
        .collect::<anyhow::Result<Vec<Host>>>()?;
    let end = scenario.duration.as_nanos() as u64;
    let node_config = &scenario.node;
    let mut node = VirtualNode::new(node_config);
    let mut recorders: Vec<Recorder> = scenario
        .clients
        .iter()
        .map(|_| Recorder::default())
        .collect();
    let mut scheduled = vec![0u64; scenario.clients.len()];
    let mut requests: Vec<Option<InFlight>> = Vec::new();
    let mut events: BinaryHeap<Reverse<(u64, Event)>> = BinaryHeap::new();
    // Each client's due times, in ns.
    let dues: Vec<Vec<u64>> = scenario
        .clients
        .iter()
        .map(|c| {
            c.schedule()
                .dues(scenario.duration.as_secs_f64())
                .map(|s| (s * 1e9) as u64)
                .collect()
        })
        .collect();
    for (client, due) in dues.iter().enumerate() {
        if let Some(first) = due.first() {
            events.push(Reverse((*first, Event::Arrive { client, n: 0 })));
        }
    }
    let block_ns = node_config.block_interval.as_nanos() as u64;
    events.push(Reverse((block_ns, Event::BlockArrives)));
    for (index, (at, _)) in node_config.changes.iter().enumerate() {
        events.push(Reverse((at.as_nanos() as u64, Event::NodeChange { index })));
    }
    for (index, swap) in scenario.swaps.iter().enumerate() {
        events.push(Reverse((swap.at.as_nanos() as u64, Event::Swap { index })));
    }
    let mut next_worker = 0;
    let mut swapped = Vec::new();
    let mut pickers: Vec<Picker> = scenario
        .clients
        .iter()
        .enumerate()
        .map(|(i, c)| Picker::new(c, i as u64))
        .collect();

    while let Some(Reverse((now, event))) = events.pop() {
        for host in &mut hosts {
            let behind = Duration::from_nanos(now).saturating_sub(host.now());
            host.advance(behind)?;
        }
        match event {
            Event::Arrive { client, n } => {
                let spec = &scenario.clients[client];
                if let Some(next) = dues[client].get(n as usize + 1) {
                    events.push(Reverse((*next, Event::Arrive { client, n: n + 1 })));
                }
                scheduled[client] += 1;
                let second = ((now / 1_000_000_000) as usize).min(seconds.saturating_sub(1));
                for (model, admitted) in &mut models {
                    admitted[client][second] += u64::from(model.offer(now, client, spec.stake));
                }
                let method = pickers[client].pick();
                events.push(Reverse((
                    now,
                    Event::Attempt {
                        client,
                        n,
                        attempt: 0,
                        method,
                    },
                )));
            }
            Event::Attempt {
                client,
                n,
                attempt,
                method,
            } => {
                let spec = &scenario.clients[client];
                let (name, cost) = (&spec.mix[method].0, Duration::ZERO);
                let cost = node_config.costs.cost(name).unwrap_or(cost);
                let request = request(spec, client, name, n, attempt);
                let worker = next_worker % scenario.workers;
                next_worker += 1;
                let chain = chain(scenario, spec.internal);
                match through_filters(&mut hosts, &chain, worker, &request)? {
                    Err(reply) => {
                        let second = (now / 1_000_000_000) as usize;
                        recorders[client].record(
                            second,
                            Outcome::Status(reply.status as u16),
                            spec.latency,
                            spec.latency,
                            false,
                        );
                        if matches!(reply.status, 429 | 503) && attempt < spec.retries {
                            events.push(Reverse((now, Event::retry(client, n, attempt, method))));
                        }
                    }
                    Ok(ids) => {
                        let job = requests.len();
                        requests.push(Some(InFlight {
                            client,
                            n,
                            attempt,
                            method,
                            arrived: now,
                            cost,
                            ids,
                            started: false,
                            abandoned: false,
                        }));
                        node.arrive(job, client, n);
                        events.push(Reverse((
                            now + spec.timeout.as_nanos() as u64,
                            Event::GiveUp { job },
                        )));
                    }
                }
            }
            Event::GiveUp { job } => {
                let Some(waiting) = requests.get_mut(job).and_then(Option::as_mut) else {
                    continue;
                };
                waiting.abandoned = true;
                for (filter, id) in std::mem::take(&mut waiting.ids) {
                    hosts[filter].abort(id)?;
                }
                let (client, started) = (waiting.client, waiting.started);
                let (n, attempt, method) = (waiting.n, waiting.attempt, waiting.method);
                if !started {
                    node.abandon_waiting();
                    requests[job] = None;
                }
                let second = (now / 1_000_000_000) as usize;
                let spec = &scenario.clients[client];
                recorders[client].record(
                    second,
                    Outcome::Timeout,
                    spec.timeout,
                    spec.timeout,
                    false,
                );
                if attempt < spec.retries {
                    events.push(Reverse((now, Event::retry(client, n, attempt, method))));
                }
            }
            Event::Served { job } => {
                let Some(done) = requests.get_mut(job).and_then(Option::take) else {
                    continue;
                };
                node.served();
                if done.abandoned {
                    continue;
                }
                let latency = Duration::from_nanos(now - done.arrived);
                for (filter, id) in done.ids {
                    hosts[filter].finish(id, 200, latency)?;
                }
                let second = (done.arrived / 1_000_000_000) as usize;
                let observed = latency + scenario.clients[done.client].latency;
                recorders[done.client].record(
                    second,
                    Outcome::Status(200),
                    observed,
                    observed,
                    false,
                );
            }
            Event::BlockArrives => {
                node.block_arrives(now);
                if now + block_ns < end {
                    events.push(Reverse((now + block_ns, Event::BlockArrives)));
                }
            }
            Event::NodeChange { index } => {
                node.resize(node_config.changes[index].1);
            }
            Event::Swap { index } => {
                let swap = &scenario.swaps[index];
                hosts[swap.filter]
                    .reconfigure(swap.policy.as_bytes())
                    .with_context(|| format!("gateway.swaps[{index}] at {:?}", swap.at))?;
                swapped.push(SwapResult {
                    at_s: swap.at.as_secs_f64(),
                    filter: scenario.filters[swap.filter].name.clone(),
                    version: None,
                    apply_ms: None,
                    error: None,
                });
            }
            Event::BlockExecuted => {
                node.block_executed(now);
            }
        }
        while let Some(job) = node.start_next(|r| requests[r].is_none()) {
            let (ends, event) = match job {
                Job::Rpc(job) => {
                    let cost = requests[job].as_mut().map_or(Duration::ZERO, |r| {
                        r.started = true;
                        r.cost
                    });
                    (cost, Event::Served { job })
                }
                Job::Sync => (node_config.block_exec, Event::BlockExecuted),
            };
            events.push(Reverse((now + ends.as_nanos() as u64, event)));
        }
        node.observe(now);
    }

    let report = report(scenario, &recorders, &scheduled);
    let parties = scenario.parties();
    let mut summary = Summary::from_report(
        &scenario.name,
        scenario.capacity_rps(),
        &report,
        &parties,
        Some(node.summary()),
    );
    summary.mode = "sim";
    summary.swaps = swapped;
    summary.filter_metrics = hosts.iter().flat_map(|h| h.metrics()).collect();
    summary.baselines = baselines
        .iter()
        .zip(models)
        .map(|(mechanism, (_, admitted))| {
            let offered: Vec<Vec<u64>> = summary
                .clients
                .iter()
                .map(|c| {
                    c.timeline
                        .iter()
                        .map(|s| s.ok + s.rejected + s.failed)
                        .collect()
                })
                .collect();
            BaselineSummary::new(
                mechanism.name(),
                scenario.duration.as_secs_f64(),
                scenario.capacity_rps(),
                &parties,
                &offered,
                &admitted,
            )
        })
        .collect();
    Ok(summary)
}

/// The filters a request goes through, by index: all of them on the public
/// listener; on the internal one only the admission gate, as in
/// envoy-config/gateway.yaml (internal calls are never throttled by QoS).
fn chain(scenario: &Scenario, internal: bool) -> Vec<usize> {
    (0..scenario.filters.len())
        .filter(|&i| !internal || scenario.filters[i].name != "stake-qos")
        .collect()
}

/// Runs the request through the filters of `chain` in order. `Err` is the
/// local reply that stopped it; the filters before that one see their
/// stream end.
fn through_filters(
    hosts: &mut [Host],
    chain: &[usize],
    worker: usize,
    request: &Request,
) -> anyhow::Result<Result<Vec<(usize, RequestId)>, LocalReply>> {
    let mut ids = Vec::with_capacity(chain.len());
    for &filter in chain {
        match hosts[filter].request(worker, request)? {
            Reply::Continue(id) => ids.push((filter, id)),
            Reply::LocalReply(reply) => {
                for (filter, id) in ids {
                    hosts[filter].finish(id, reply.status as u16, Duration::ZERO)?;
                }
                return Ok(Err(reply));
            }
        }
    }
    Ok(Ok(ids))
}

/// The request the loadgen would send: the same params, and ids that
/// differ between attempts.
fn request(client: &Client, index: usize, method: &str, n: u64, attempt: u32) -> Request {
    let params = if client.unique_params {
        unique_params(method, index as u64, n)
    } else {
        params_for(method).to_string()
    };
    let id = n * 1000 + u64::from(attempt);
    let body = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#);
    let mut request = Request::json_rpc(&body).property(
        &["source", "address"],
        format!("{}:40000", client.source).as_bytes(),
    );
    if client.internal {
        request = request.listener_class("internal");
    }
    if let Some(key) = &client.api_key {
        request = request.header("x-api-key", key);
    }
    request
}

fn report(scenario: &Scenario, recorders: &[Recorder], scheduled: &[u64]) -> Report {
    let duration = scenario.duration.as_secs_f64();
    let mut overall = Recorder::default();
    let clients = scenario
        .clients
        .iter()
        .zip(recorders)
        .zip(scheduled)
        .map(|((client, recorder), scheduled)| {
            overall.merge(recorder);
            recorder.finish(ClientHeader {
                id: client.id.clone(),
                requested_rps: client.rate,
                offered_rps: (*scheduled as f64 / duration * 1000.0).round() / 1000.0,
                scheduled: *scheduled,
                sent: *scheduled,
                skipped_at_cap: 0,
                dispatch_lag_max_ms: 0.0,
            })
        })
        .collect();
    Report {
        target: format!("sim:{}", scenario.name),
        duration_s: duration,
        http2: false,
        status: overall.status(),
        latency_ms: overall.latencies(),
        clients,
    }
}

/// Deterministic weighted method choice (a per-client LCG).
struct Picker {
    /// Cumulative weight and index into the client's mix.
    cumulative: Vec<(f64, usize)>,
    state: u64,
}

impl Picker {
    fn new(client: &Client, seed: u64) -> Self {
        let total: f64 = client.mix.iter().map(|(_, w)| w).sum();
        let mut sum = 0.0;
        let cumulative = client
            .mix
            .iter()
            .enumerate()
            .map(|(i, (_, w))| {
                sum += w / total;
                (sum, i)
            })
            .collect();
        Self {
            cumulative,
            state: seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        }
    }

    fn pick(&mut self) -> usize {
        self.state = self
            .state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = (self.state >> 11) as f64 / (1u64 << 53) as f64;
        self.cumulative
            .iter()
            .find(|(upto, _)| x < *upto)
            .or(self.cumulative.last())
            .map_or(0, |(_, i)| *i)
    }
}

pub fn table(scenario: &Scenario, summary: &Summary) -> String {
    let mut out = format!("{}\n", scenario.description);
    out += &format!(
        "{} ({}): {:.0} rps offered, {:.0} rps admitted, capacity {:.0} rps over {:.0} s\n",
        summary.scenario,
        summary.mode,
        summary.offered_rps,
        summary.admitted_rps,
        summary.capacity_rps,
        summary.duration_s
    );
    out += &format!(
        "{:<14} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "client",
        "stake",
        "offered",
        "admitted",
        "rejected",
        "adm %",
        "stake %",
        "p50 ms",
        "p99 ms"
    );
    for c in &summary.clients {
        let rejected = c.status_counts.get("503").copied().unwrap_or(0)
            + c.status_counts.get("429").copied().unwrap_or(0);
        out += &format!(
            "{:<14} {:>8} {:>10.1} {:>10.1} {:>9} {:>9.1} {:>9.1} {:>9.2} {:>9.2}\n",
            c.id,
            c.stake,
            c.offered_rps,
            c.admitted_rps,
            rejected,
            c.admitted_share * 100.0,
            c.stake_share * 100.0,
            c.latency_ms.p50,
            c.latency_ms.p99,
        );
    }
    if let Some(node) = &summary.node {
        out += &format!(
            "node: tip lag max {:.0} ms, tip lost {}, queue max {}, blocks {}\n",
            node.tip_lag_max_ms, node.tip_lost, node.queue_max, node.blocks_executed
        );
        if let Some(up) = &node.upstream {
            out += &format!(
                "upstream: {} requests, {} unique, amplification {:.3}\n",
                up.requests, up.unique_requests, up.amplification
            );
        }
    }
    out += &format!("max share error: {:.1} pp\n", summary.max_share_error_pp);
    let seconds: Vec<String> = summary
        .admitted_by_second()
        .iter()
        .map(u64::to_string)
        .collect();
    out += &format!("admitted by second: {}\n", seconds.join(" "));
    for swap in &summary.swaps {
        out += &format!("{swap}\n");
    }
    for baseline in &summary.baselines {
        out += &format!(
            "\nbaseline {}: would admit {:.0} rps, max share error {:.1} pp\n",
            baseline.mechanism, baseline.admitted_rps, baseline.max_share_error_pp
        );
        out += &format!(
            "{:<14} {:>10} {:>9} {:>9}\n",
            "client", "admitted", "adm %", "stake %"
        );
        for c in &baseline.clients {
            out += &format!(
                "{:<14} {:>10.1} {:>9.1} {:>9.1}\n",
                c.id,
                c.admitted_rps,
                c.admitted_share * 100.0,
                c.stake_share * 100.0
            );
        }
    }
    out
}

pub fn run(args: &SimArgs) -> anyhow::Result<()> {
    let mut scenario = Scenario::load(&args.scenario)?;
    if args.no_filters {
        scenario.filters.clear();
        scenario.swaps.clear();
        scenario.name += " (no filters)";
    }
    let baselines: Vec<Mechanism> = args
        .baselines
        .iter()
        .filter_map(|b| Mechanism::parse(b))
        .collect();
    let summary = simulate(&scenario, &baselines)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", table(&scenario, &summary));
    }
    Ok(())
}
