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
use stakegate_host::{Callout, Host, LocalReply, Reply, Request, RequestId};
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
    worker: usize,
    request: Request,
    /// The request's stream in each filter it went through: (filter, id).
    ids: Vec<(usize, RequestId)>,
    /// The filter holding it (the gate's coalescing), and its stream there.
    held: Option<(usize, RequestId)>,
    /// The filters still to pass once the holding one lets it go.
    rest: Vec<usize>,
    /// Not a client's request: filter `.0`'s callout, sent for a held one.
    callout: Option<(usize, Callout)>,
    /// It is at the node (waiting or served).
    on_node: bool,
    /// The node is working on it (it holds a slot).
    started: bool,
    /// The client gave up; the node finishes it for nobody.
    abandoned: bool,
}

/// Where a request got to in the filter chain.
enum Passage {
    /// Through every filter: it goes to the node.
    Upstream,
    /// A filter answered it.
    Replied(LocalReply),
    /// A filter holds it: its answer, or its way on, comes later.
    Held,
}

/// Runs `r` through `filters` in order, from where it is. A local reply
/// ends it for the filters before (they see its status).
fn pass(hosts: &mut [Host], filters: &[usize], r: &mut InFlight) -> anyhow::Result<Passage> {
    for (at, &filter) in filters.iter().enumerate() {
        match hosts[filter].request(r.worker, &r.request)? {
            Reply::Continue(id) => r.ids.push((filter, id)),
            Reply::LocalReply(reply) => {
                for (filter, id) in std::mem::take(&mut r.ids) {
                    hosts[filter].finish(id, reply.status as u16, Duration::ZERO)?;
                }
                return Ok(Passage::Replied(reply));
            }
            Reply::Held(id) => {
                r.held = Some((filter, id));
                r.rest = filters[at + 1..].to_vec();
                return Ok(Passage::Held);
            }
        }
    }
    Ok(Passage::Upstream)
}

/// What the virtual node answers a callout: a result for each call with
/// an id, with that id.
fn node_answer(body: &[u8]) -> Vec<u8> {
    let answer = |call: &serde_json::Value| {
        call.get("id")
            .map(|id| serde_json::json!({"jsonrpc": "2.0", "id": id, "result": "0x"}))
    };
    let answer = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Array(calls)) => {
            serde_json::Value::Array(calls.iter().filter_map(answer).collect())
        }
        Ok(call) => answer(&call).unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    };
    answer.to_string().into_bytes()
}

/// What the run keeps of each client's requests and the node.
struct World<'a> {
    scenario: &'a Scenario,
    hosts: Vec<Host>,
    node: VirtualNode,
    requests: Vec<Option<InFlight>>,
    recorders: Vec<Recorder>,
    events: BinaryHeap<Reverse<(u64, Event)>>,
}

impl World<'_> {
    /// A client's request got `status` at `now`; a 429 or 503 is retried.
    fn answered(&mut self, now: u64, r: &InFlight, status: u32) {
        let spec = &self.scenario.clients[r.client];
        let observed = Duration::from_nanos(now - r.arrived) + spec.latency;
        let second = (r.arrived / 1_000_000_000) as usize;
        self.recorders[r.client].record(
            second,
            Outcome::Status(status as u16),
            observed,
            observed,
            false,
        );
        if matches!(status, 429 | 503) && r.attempt < spec.retries {
            let retry = Event::retry(r.client, r.n, r.attempt, r.method);
            self.events.push(Reverse((now, retry)));
        }
    }

    /// Puts request `job` on the node.
    fn send_to_node(&mut self, job: usize) {
        if let Some(r) = self.requests[job].as_mut() {
            r.on_node = true;
            let (client, n) = (r.client, r.n);
            self.node.arrive(job, client, n);
        }
    }

    /// After the filters ran: their callouts go to the node, and held
    /// requests they settled are answered or go on, until nothing moves.
    fn pump(&mut self, now: u64) -> anyhow::Result<()> {
        loop {
            let mut moved = false;
            for filter in 0..self.hosts.len() {
                for callout in self.hosts[filter].take_callouts() {
                    moved = true;
                    // The held request it is for sent the same body.
                    let leader = self.requests.iter().flatten().find(|r| {
                        r.held.is_some_and(|(f, _)| f == filter) && r.request.body == callout.body
                    });
                    let (client, n, cost, worker) = leader
                        .map_or((0, u64::MAX, Duration::ZERO, 0), |r| {
                            (r.client, r.n, r.cost, r.worker)
                        });
                    let job = self.requests.len();
                    self.requests.push(Some(InFlight {
                        client,
                        n,
                        attempt: 0,
                        method: 0,
                        arrived: now,
                        cost,
                        worker,
                        request: Request::default(),
                        ids: Vec::new(),
                        held: None,
                        rest: Vec::new(),
                        callout: Some((filter, callout)),
                        on_node: false,
                        started: false,
                        abandoned: false,
                    }));
                    self.send_to_node(job);
                }
                for (id, reply) in self.hosts[filter].take_settled() {
                    let Some(job) = self
                        .requests
                        .iter()
                        .position(|r| r.as_ref().is_some_and(|r| r.held == Some((filter, id))))
                    else {
                        continue;
                    };
                    moved = true;
                    let Some(mut r) = self.requests[job].take() else {
                        continue;
                    };
                    r.held = None;
                    match reply {
                        Reply::LocalReply(reply) => {
                            for (filter, id) in std::mem::take(&mut r.ids) {
                                self.hosts[filter].finish(
                                    id,
                                    reply.status as u16,
                                    Duration::ZERO,
                                )?;
                            }
                            self.answered(now, &r, reply.status);
                        }
                        Reply::Continue(id) | Reply::Held(id) => {
                            r.ids.push((filter, id));
                            let rest = std::mem::take(&mut r.rest);
                            match pass(&mut self.hosts, &rest, &mut r)? {
                                Passage::Replied(reply) => self.answered(now, &r, reply.status),
                                Passage::Held => self.requests[job] = Some(r),
                                Passage::Upstream => {
                                    self.requests[job] = Some(r);
                                    self.send_to_node(job);
                                }
                            }
                        }
                    }
                }
            }
            if !moved {
                return Ok(());
            }
        }
    }
}

/// Runs a scenario and returns its summary, with what each of `baselines`
/// would have admitted from the same arrivals.
pub fn simulate(scenario: &Scenario, baselines: &[Mechanism]) -> anyhow::Result<Summary> {
    if scenario.replicas > 1 {
        anyhow::bail!(
            "gateway.replicas: the simulator runs one gateway; run a fleet for real (`stakegate scenario run`); the fleet rule itself is tested in virtual time in crates/core"
        );
    }
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
    let hosts = scenario
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
    let node = VirtualNode::new(node_config);
    let recorders: Vec<Recorder> = scenario
        .clients
        .iter()
        .map(|_| Recorder::default())
        .collect();
    let mut scheduled = vec![0u64; scenario.clients.len()];
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

    let mut w = World {
        scenario,
        hosts,
        node,
        requests: Vec::new(),
        recorders,
        events,
    };
    while let Some(Reverse((now, event))) = w.events.pop() {
        for host in &mut w.hosts {
            let behind = Duration::from_nanos(now).saturating_sub(host.now());
            host.advance(behind)?;
        }
        match event {
            Event::Arrive { client, n } => {
                let spec = &scenario.clients[client];
                if let Some(next) = dues[client].get(n as usize + 1) {
                    w.events
                        .push(Reverse((*next, Event::Arrive { client, n: n + 1 })));
                }
                scheduled[client] += 1;
                let second = ((now / 1_000_000_000) as usize).min(seconds.saturating_sub(1));
                for (model, admitted) in &mut models {
                    admitted[client][second] += u64::from(model.offer(now, client, spec.stake));
                }
                let method = pickers[client].pick();
                w.events.push(Reverse((
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
                let name = &spec.mix[method].0;
                let cost = node_config.costs.cost(name).unwrap_or(Duration::ZERO);
                let mut r = InFlight {
                    client,
                    n,
                    attempt,
                    method,
                    arrived: now,
                    cost,
                    worker: next_worker % scenario.workers,
                    request: request(spec, client, name, n, attempt),
                    ids: Vec::new(),
                    held: None,
                    rest: Vec::new(),
                    callout: None,
                    on_node: false,
                    started: false,
                    abandoned: false,
                };
                next_worker += 1;
                let passage = pass(&mut w.hosts, &chain(scenario, spec.internal), &mut r)?;
                if let Passage::Replied(reply) = passage {
                    w.answered(now, &r, reply.status);
                } else {
                    let job = w.requests.len();
                    w.requests.push(Some(r));
                    if matches!(passage, Passage::Upstream) {
                        w.send_to_node(job);
                    }
                    w.events.push(Reverse((
                        now + spec.timeout.as_nanos() as u64,
                        Event::GiveUp { job },
                    )));
                }
            }
            Event::GiveUp { job } => {
                let Some(waiting) = w.requests.get_mut(job).and_then(Option::as_mut) else {
                    continue;
                };
                waiting.abandoned = true;
                let mut streams = std::mem::take(&mut waiting.ids);
                streams.extend(waiting.held.take());
                let (client, started, on_node) = (waiting.client, waiting.started, waiting.on_node);
                let (n, attempt, method) = (waiting.n, waiting.attempt, waiting.method);
                if !started {
                    if on_node {
                        w.node.abandon_waiting();
                    }
                    w.requests[job] = None;
                }
                for (filter, id) in streams {
                    w.hosts[filter].abort(id)?;
                }
                let second = (now / 1_000_000_000) as usize;
                let spec = &scenario.clients[client];
                w.recorders[client].record(
                    second,
                    Outcome::Timeout,
                    spec.timeout,
                    spec.timeout,
                    false,
                );
                if attempt < spec.retries {
                    w.events
                        .push(Reverse((now, Event::retry(client, n, attempt, method))));
                }
            }
            Event::Served { job } => {
                let Some(done) = w.requests.get_mut(job).and_then(Option::take) else {
                    continue;
                };
                w.node.served();
                if let Some((filter, callout)) = &done.callout {
                    let answer = node_answer(&callout.body);
                    w.hosts[*filter].answer_callout(callout, Some((200, answer)))?;
                } else if !done.abandoned {
                    let latency = Duration::from_nanos(now - done.arrived);
                    for (filter, id) in &done.ids {
                        w.hosts[*filter].finish(*id, 200, latency)?;
                    }
                    w.answered(now, &done, 200);
                }
            }
            Event::BlockArrives => {
                w.node.block_arrives(now);
                if now + block_ns < end {
                    w.events
                        .push(Reverse((now + block_ns, Event::BlockArrives)));
                }
            }
            Event::NodeChange { index } => {
                w.node.resize(node_config.changes[index].1);
            }
            Event::Swap { index } => {
                let swap = &scenario.swaps[index];
                w.hosts[swap.filter]
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
                w.node.block_executed(now);
            }
        }
        w.pump(now)?;
        let requests = &mut w.requests;
        while let Some(job) = w.node.start_next(|r| requests[r].is_none()) {
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
            w.events
                .push(Reverse((now + ends.as_nanos() as u64, event)));
        }
        w.node.observe(now);
    }
    let World {
        hosts,
        node,
        recorders,
        ..
    } = w;

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
    if let Some(fleet) = &summary.fleet {
        out += &format!(
            "\nfleet of {} replicas (each saw at least {}){}:\n",
            fleet.replicas,
            fleet.replicas_seen_min,
            fleet
                .exchange_ms
                .as_ref()
                .map_or(String::new(), |e| format!(
                    ", exchanges with Redis p50 {:.1} ms, p99 {:.1} ms",
                    e.p50, e.p99
                ))
        );
        for p in &fleet.phases {
            out += &format!(
                "  {:<11} {:>4.0}-{:<4.0} s  {:>6.1} rps ({:.3} of capacity), max share error {:.2} pp, {} failed\n",
                p.phase, p.from_s, p.to_s, p.admitted_rps, p.of_capacity, p.max_share_error_pp, p.failed
            );
        }
        for o in &fleet.redis_outages {
            let after = |s: Option<f64>| s.map_or("never".into(), |s| format!("after {s:.1} s"));
            out += &format!(
                "  Redis away {:.1}-{:.1} s: every replica on its fallback share {}, fleet shares back {}\n",
                o.at_s,
                o.back_s,
                after(o.all_on_fallback_after_s),
                after(o.fleet_shares_back_after_s)
            );
        }
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
