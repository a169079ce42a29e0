//! One simulated run: the events in virtual time (arrivals, attempts,
//! time-outs, the node's work, blocks, swaps) and what each does to the
//! filters' hosts, the virtual node and the clients' records.

use super::node::{Job, VirtualNode};
use crate::scenario::{Client, Scenario};
use crate::summary::{BaselineSummary, Summary, SwapResult};
use anyhow::Context;
use rpc_node::costs::CostTable;
use stakegate_core::baseline::{BaselineQos, Mechanism};
use stakegate_host::{Callout, Host, LocalReply, Passed, Reply, Request, RequestId};
use stakegate_loadgen::report::{ClientHeader, Outcome, Recorder};
use stakegate_loadgen::run::{history_params, params_for, unique_params};
use stakegate_loadgen::Report;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

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
                let ids = std::mem::take(&mut r.ids);
                finish_all(hosts, ids, reply.status, Duration::ZERO, reply.passed())?;
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

/// Ends a request's streams from the last filter to the first, as Envoy
/// encodes a response: each sees `status`, the response headers the
/// filters after it left and the stream's filter state (`passed` from
/// where the answer came).
fn finish_all(
    hosts: &mut [Host],
    ids: Vec<(usize, RequestId)>,
    status: u32,
    latency: Duration,
    mut passed: Passed,
) -> anyhow::Result<()> {
    for (filter, id) in ids.into_iter().rev() {
        passed.headers.retain(|(name, _)| name != ":status");
        passed = hosts[filter].finish_with(id, status as u16, latency, passed)?;
    }
    Ok(())
}

/// The header in which the virtual node says its time on an answer, in
/// µs, as rpc-node does.
const SERVICE_HEADER: &str = "x-node-service-us";

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

/// A run: the filters' hosts, the node, each client's requests and what
/// it observed, and the events still to come.
pub struct World<'a> {
    scenario: &'a Scenario,
    hosts: Vec<Host>,
    node: VirtualNode,
    requests: Vec<Option<InFlight>>,
    recorders: Vec<Recorder>,
    events: BinaryHeap<Reverse<(u64, Event)>>,
    /// Each client's due times, in ns.
    dues: Vec<Vec<u64>>,
    /// Requests each client sent (not counting retries).
    scheduled: Vec<u64>,
    /// What each baseline would admit, per client and second.
    models: Vec<(BaselineQos, Vec<Vec<u64>>)>,
    pickers: Vec<Picker>,
    next_worker: usize,
    swapped: Vec<SwapResult>,
    seconds: usize,
    end: u64,
    block_ns: u64,
    /// The node's costs as of now (`node.changes` may change them).
    costs: CostTable,
}

impl<'a> World<'a> {
    /// The run of `scenario`, before its first event, with `baselines`
    /// offered the same arrivals.
    pub fn new(scenario: &'a Scenario, baselines: &[Mechanism]) -> anyhow::Result<Self> {
        let total_stake: u64 = scenario.clients.iter().map(|c| c.stake).sum();
        let seconds = scenario.duration.as_secs_f64().ceil() as usize;
        let models = baselines
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
        let node_config = &scenario.node;
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
        let mut events = BinaryHeap::new();
        for (client, due) in dues.iter().enumerate() {
            if let Some(first) = due.first() {
                events.push(Reverse((*first, Event::Arrive { client, n: 0 })));
            }
        }
        let block_ns = node_config.block_interval.as_nanos() as u64;
        events.push(Reverse((block_ns, Event::BlockArrives)));
        for (index, change) in node_config.changes.iter().enumerate() {
            let at = change.at.as_nanos() as u64;
            events.push(Reverse((at, Event::NodeChange { index })));
        }
        for (index, swap) in scenario.swaps.iter().enumerate() {
            events.push(Reverse((swap.at.as_nanos() as u64, Event::Swap { index })));
        }
        Ok(Self {
            scenario,
            hosts,
            node: VirtualNode::new(node_config),
            requests: Vec::new(),
            recorders: scenario
                .clients
                .iter()
                .map(|_| Recorder::default())
                .collect(),
            events,
            dues,
            scheduled: vec![0; scenario.clients.len()],
            models,
            pickers: scenario
                .clients
                .iter()
                .enumerate()
                .map(|(i, c)| Picker::new(c, i as u64))
                .collect(),
            next_worker: 0,
            swapped: Vec::new(),
            seconds,
            end: scenario.duration.as_nanos() as u64,
            block_ns,
            costs: scenario.node.costs.clone(),
        })
    }

    /// Runs every event, in time order; after each the filters' callouts
    /// and settled requests move, and the node starts what it can.
    pub fn run(&mut self) -> anyhow::Result<()> {
        while let Some(Reverse((now, event))) = self.events.pop() {
            for host in &mut self.hosts {
                let behind = Duration::from_nanos(now).saturating_sub(host.now());
                host.advance(behind)?;
            }
            self.handle(now, event)?;
            self.pump(now)?;
            self.start_jobs(now);
            self.node.observe(now);
        }
        Ok(())
    }

    fn handle(&mut self, now: u64, event: Event) -> anyhow::Result<()> {
        match event {
            Event::Arrive { client, n } => self.arrive(now, client, n),
            Event::Attempt {
                client,
                n,
                attempt,
                method,
            } => self.attempt(now, client, n, attempt, method)?,
            Event::GiveUp { job } => self.give_up(now, job)?,
            Event::Served { job } => self.served(now, job)?,
            Event::BlockArrives => {
                self.node.block_arrives(now);
                if now + self.block_ns < self.end {
                    self.events
                        .push(Reverse((now + self.block_ns, Event::BlockArrives)));
                }
            }
            Event::NodeChange { index } => {
                let change = &self.scenario.node.changes[index];
                if let Some(slots) = change.read_slots {
                    self.node.resize(slots);
                }
                for (method, cost) in &change.costs {
                    self.costs.set(method, *cost);
                }
            }
            Event::Swap { index } => {
                let swap = &self.scenario.swaps[index];
                self.hosts[swap.filter]
                    .reconfigure(swap.policy.as_bytes())
                    .with_context(|| format!("gateway.swaps[{index}] at {:?}", swap.at))?;
                self.swapped.push(SwapResult {
                    at_s: swap.at.as_secs_f64(),
                    filter: self.scenario.filters[swap.filter].name.clone(),
                    version: None,
                    apply_ms: None,
                    error: None,
                });
            }
            Event::BlockExecuted => self.node.block_executed(now),
        }
        Ok(())
    }

    /// Client `client`'s request number `n` is due: the next is scheduled,
    /// the baselines see it, and its first attempt is made now.
    fn arrive(&mut self, now: u64, client: usize, n: u64) {
        let spec = &self.scenario.clients[client];
        if let Some(next) = self.dues[client].get(n as usize + 1) {
            self.events
                .push(Reverse((*next, Event::Arrive { client, n: n + 1 })));
        }
        self.scheduled[client] += 1;
        let second = ((now / 1_000_000_000) as usize).min(self.seconds.saturating_sub(1));
        for (model, admitted) in &mut self.models {
            admitted[client][second] += u64::from(model.offer(now, client, spec.stake));
        }
        let method = self.pickers[client].pick();
        let attempt = Event::Attempt {
            client,
            n,
            attempt: 0,
            method,
        };
        self.events.push(Reverse((now, attempt)));
    }

    /// An attempt goes through the filters: answered by one, held by one,
    /// or sent to the node; the client gives up after its timeout.
    fn attempt(
        &mut self,
        now: u64,
        client: usize,
        n: u64,
        attempt: u32,
        method: usize,
    ) -> anyhow::Result<()> {
        let scenario = self.scenario;
        let spec = &scenario.clients[client];
        let name = &spec.mix[method].0;
        let cost = self.costs.cost(name).unwrap_or(Duration::ZERO);
        let mut r = InFlight {
            client,
            n,
            attempt,
            method,
            arrived: now,
            cost,
            worker: self.next_worker % scenario.workers,
            request: request(spec, client, name, n, attempt),
            ids: Vec::new(),
            held: None,
            rest: Vec::new(),
            callout: None,
            on_node: false,
            started: false,
            abandoned: false,
        };
        self.next_worker += 1;
        let passage = pass(&mut self.hosts, &chain(scenario, spec.internal), &mut r)?;
        if let Passage::Replied(reply) = passage {
            self.answered(now, &r, reply.status, None);
            return Ok(());
        }
        let job = self.requests.len();
        self.requests.push(Some(r));
        if matches!(passage, Passage::Upstream) {
            self.send_to_node(job);
        }
        let give_up = now + spec.timeout.as_nanos() as u64;
        self.events.push(Reverse((give_up, Event::GiveUp { job })));
        Ok(())
    }

    /// The client stops waiting for `job`: its streams are aborted, a
    /// request not started leaves the node, and it is retried if it may be.
    fn give_up(&mut self, now: u64, job: usize) -> anyhow::Result<()> {
        let Some(waiting) = self.requests.get_mut(job).and_then(Option::as_mut) else {
            return Ok(());
        };
        waiting.abandoned = true;
        let mut streams = std::mem::take(&mut waiting.ids);
        streams.extend(waiting.held.take());
        let (client, started, on_node) = (waiting.client, waiting.started, waiting.on_node);
        let (n, attempt, method) = (waiting.n, waiting.attempt, waiting.method);
        if !started {
            if on_node {
                self.node.abandon_waiting();
            }
            self.requests[job] = None;
        }
        for (filter, id) in streams {
            self.hosts[filter].abort(id)?;
        }
        let second = (now / 1_000_000_000) as usize;
        let spec = &self.scenario.clients[client];
        self.recorders[client].record(
            second,
            Outcome::Timeout,
            spec.timeout,
            spec.timeout,
            None,
            false,
        );
        if attempt < spec.retries {
            self.events
                .push(Reverse((now, Event::retry(client, n, attempt, method))));
        }
        Ok(())
    }

    /// The node finished `job`: a callout's answer goes to its filter, a
    /// client's request (if it still waits) is answered 200.
    fn served(&mut self, now: u64, job: usize) -> anyhow::Result<()> {
        let Some(done) = self.requests.get_mut(job).and_then(Option::take) else {
            return Ok(());
        };
        self.node.served();
        if let Some((filter, callout)) = &done.callout {
            // The node says its time on it, as rpc-node does.
            let said = (SERVICE_HEADER.into(), done.cost.as_micros().to_string());
            let answer = (200, vec![said], node_answer(&callout.body));
            self.hosts[*filter].answer_callout_with(callout, Some(answer))?;
        } else if !done.abandoned {
            let latency = Duration::from_nanos(now - done.arrived);
            let passed = Passed::default();
            finish_all(&mut self.hosts, done.ids.clone(), 200, latency, passed)?;
            self.answered(now, &done, 200, Some(done.cost));
        }
        Ok(())
    }

    /// The node starts what its free slots can take.
    fn start_jobs(&mut self, now: u64) {
        let requests = &mut self.requests;
        while let Some(job) = self.node.start_next(|r| requests[r].is_none()) {
            let (ends, event) = match job {
                Job::Rpc(job) => {
                    let cost = requests[job].as_mut().map_or(Duration::ZERO, |r| {
                        r.started = true;
                        r.cost
                    });
                    (cost, Event::Served { job })
                }
                Job::Sync => (self.scenario.node.block_exec, Event::BlockExecuted),
            };
            self.events
                .push(Reverse((now + ends.as_nanos() as u64, event)));
        }
    }

    /// The run's summary, with what `baselines` would have admitted.
    pub fn summary(self, baselines: &[Mechanism]) -> Summary {
        let scenario = self.scenario;
        let report = report(scenario, &self.recorders, &self.scheduled);
        let parties = scenario.parties();
        let mut summary = Summary::from_report(
            &scenario.name,
            scenario.capacity_rps(),
            &report,
            &parties,
            Some(self.node.summary()),
        );
        summary.mode = "sim";
        summary.measure_node_time(scenario.capacity_node_ms());
        summary.swaps = self.swapped;
        summary.filter_metrics = self.hosts.iter().flat_map(|h| h.metrics()).collect();
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
        summary.baselines = baselines
            .iter()
            .zip(self.models)
            .map(|(mechanism, (_, admitted))| {
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
        summary
    }

    /// A client's request got `status` at `now`, `node` being the node's
    /// time on it if the node answered it; a 429 or 503 is retried.
    fn answered(&mut self, now: u64, r: &InFlight, status: u32, node: Option<Duration>) {
        let spec = &self.scenario.clients[r.client];
        let observed = Duration::from_nanos(now - r.arrived) + spec.latency;
        let second = (r.arrived / 1_000_000_000) as usize;
        self.recorders[r.client].record(
            second,
            Outcome::Status(status as u16),
            observed,
            observed,
            node,
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
                            let ids = std::mem::take(&mut r.ids);
                            let status = reply.status;
                            finish_all(
                                &mut self.hosts,
                                ids,
                                status,
                                Duration::ZERO,
                                reply.passed(),
                            )?;
                            // A leader's answer says the node's time on it.
                            let said = reply.header(SERVICE_HEADER).and_then(|us| us.parse().ok());
                            self.answered(now, &r, reply.status, said.map(Duration::from_micros));
                        }
                        Reply::Continue(id) | Reply::Held(id) => {
                            r.ids.push((filter, id));
                            let rest = std::mem::take(&mut r.rest);
                            match pass(&mut self.hosts, &rest, &mut r)? {
                                Passage::Replied(reply) => {
                                    self.answered(now, &r, reply.status, None)
                                }
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
    } else if client.history {
        history_params(method, index as u64, n)
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
