//! stake-qos: the proxy-wasm glue for stake-weighted rate shares.
//!
//! The logic lives in `stakegate_core::qos` (a stream's steps in
//! `qos::stream`); this crate reads what Envoy gives it, maps decisions to
//! actions and records the metrics:
//!
//! - `on_configure` parses the policy. A bad policy is logged with the
//!   field and the reason, and `false` makes Envoy refuse it, so the
//!   previous one keeps serving.
//! - request headers: far below the threshold, count the request and no
//!   more (`qos::light`); otherwise resolve the identity and admit the
//!   request (one call) or answer 429. While throttling is off this touches
//!   no shared data. An admitted WebSocket leaves the requests in flight.
//! - request body: with `decideOnBody`, the admission of a request with a
//!   body (its 429 then answers each call by `id`); a batch is charged its
//!   other calls, a WebSocket the calls sent on it.
//! - response headers (reactive mode): the upstream status, 503 and 429
//!   being back-pressure; `on_done` (or dropping the stream context) ends
//!   the request locally: its place in flight and its latency.
//! - a refused request sent again before its `retry-after` (`qos::early`)
//!   is paused, and decided at the first tick after that time: resumed or
//!   answered 429 from the root context.
//! - `on_tick`, every refill interval on every worker: this worker's counts
//!   go on the report queue, the shared state is read, and the refill round
//!   runs if this VM wins it. In fleet mode that VM sends the exchange with
//!   the other replicas when one is due (`fleet`), and
//!   `on_http_call_response` takes its answer.

stakegate_glue::declare_filter!("stake-qos");

mod fleet;

use fleet::FleetLink;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::clock::Now;
use stakegate_core::qos::counts::{Counts, Snapshot, METRICS};
use stakegate_core::qos::policy::QosPolicy;
use stakegate_core::qos::report::QUEUE;
use stakegate_core::qos::socket::Charged;
use stakegate_core::qos::stream::{Decided, QosStream};
use stakegate_core::qos::StakeQos;
use stakegate_core::rejection::RULE_HEADER;
use stakegate_core::request::{IDENTITY_PROPERTY, SOCKET_HOLD_PROPERTY, STAKED_PROPERTY};
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::host::{self, BodyOf, HostBody};
use stakegate_glue::metrics::{Stats, UsageStats};
use stakegate_glue::{now_us, EnvoyQueue, EnvoyStore};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(QosRoot {
            context_id,
            worker: None,
            fleet: None,
        })
    });
}}

struct Worker {
    qos: StakeQos,
    counts: Counts,
    stats: Stats<Snapshot>,
    queue: EnvoyQueue,
    /// The usage ledger's stats, defined as labels come.
    usage: UsageStats,
    /// WebSockets whose data the gate holds for their identity's share, by
    /// context: their calls try again at the ticks.
    held: HashMap<u32, Rc<RefCell<QosStream>>>,
    /// Requests sent again before their `retry-after`, by context: decided
    /// at the tick after it.
    early: HashMap<u32, Rc<RefCell<QosStream>>>,
}

impl Worker {
    /// Hands what was counted, and the gauges, to Envoy.
    fn flush(&mut self) {
        let snapshot = self.counts.snapshot(&mut self.qos);
        self.stats.flush(&snapshot);
    }
}

struct QosRoot {
    context_id: u32,
    worker: Option<Rc<RefCell<Worker>>>,
    /// Fleet mode: the exchange with the other replicas.
    fleet: Option<FleetLink>,
}

fn log(level: LogLevel, message: &str) {
    stakegate_glue::log("stake-qos", level, message);
}

impl QosRoot {
    fn configure(&mut self, config: &[u8]) -> Result<(), String> {
        let policy = QosPolicy::parse(config).map_err(|e| format!("policy rejected: {e}"))?;
        let policy_prefix = policy.stats_prefix();
        let stats = Stats::define(policy.stats_prefix(), METRICS, &policy.tiers)?;
        let queue = EnvoyQueue::register(QUEUE)?;
        let fleet = policy.fleet.as_ref().map(FleetLink::new).transpose()?;
        self.set_tick_period(Duration::from_millis(policy.refill_interval_ms));
        let seed = now_us() ^ (u64::from(self.context_id) << 40);
        self.worker = Some(Rc::new(RefCell::new(Worker {
            qos: StakeQos::new(policy, seed),
            counts: Counts::default(),
            stats,
            queue,
            usage: UsageStats::new(policy_prefix),
            held: HashMap::new(),
            early: HashMap::new(),
        })));
        self.fleet = fleet;
        Ok(())
    }
}

impl Context for QosRoot {
    /// The plugin is being deleted (a swap or reload): this worker's last
    /// counts go on the queue and reach Envoy instead of dying with the VM.
    fn on_done(&mut self) -> bool {
        if let Some(worker) = &self.worker {
            let mut worker = worker.borrow_mut();
            let Worker {
                qos, counts, queue, ..
            } = &mut *worker;
            if let Err(e) = qos.flush(queue) {
                log(LogLevel::Warn, &counts.store.failed("last report", &e));
            }
            // The last usage too, whenever the last hand-over was.
            match qos.usage(&EnvoyStore, u64::MAX) {
                Ok(Some(by_label)) => worker.usage.flush(&by_label),
                Ok(None) => {}
                Err(e) => log(LogLevel::Warn, &counts.store.failed("usage ledger", &e)),
            }
            worker.flush();
        }
        true
    }

    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let (Some(worker), Some(fleet)) = (&self.worker, &mut self.fleet) else {
            return;
        };
        if fleet.owns(token) {
            let mut worker = worker.borrow_mut();
            let Worker { qos, counts, .. } = &mut *worker;
            fleet.answered(qos, num_headers, body_size, counts);
        }
    }
}

impl RootContext for QosRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        stakegate_glue::accept("stake-qos", self.configure(&config))
    }

    fn on_tick(&mut self) {
        let Some(worker) = &self.worker else { return };
        let mut worker = worker.borrow_mut();
        let Worker {
            qos, counts, queue, ..
        } = &mut *worker;
        let started = now_us();
        let mut fleet_round = None;
        match qos.tick(&EnvoyStore, queue, started / 1000) {
            Ok(tick) => {
                if let Some(round) = tick.round {
                    counts.refill_took(now_us().saturating_sub(started));
                    counts.store.retried(round.cas_retries);
                    counts.evicted += round.evicted;
                    fleet_round = round.fleet;
                }
            }
            Err(e) => log(LogLevel::Warn, &counts.store.failed("tick", &e)),
        }
        if let Some(fleet) = &mut self.fleet {
            fleet.tick(qos, fleet_round, counts);
        }
        // Held sockets' calls try again with this tick's state.
        let Worker {
            qos,
            counts,
            held,
            early,
            ..
        } = &mut *worker;
        held.retain(|id, stream| {
            let Ok(mut stream) = stream.try_borrow_mut() else {
                return true;
            };
            let now = &mut Now::lazy_us(now_us);
            // The gate's word on what it sent the node and had answered.
            if let Some(total) = host::act_on(*id).then(host::socket_answered).flatten() {
                stream.socket_answered(qos, now, total);
            }
            let charged = stream.socket_tick(qos, &EnvoyStore, now);
            let go = charged.is_none_or(|charged| socket_charged(counts, charged) == Some(false));
            if go && host::act_on(*id) {
                host::set_property(SOCKET_HOLD_PROPERTY, b"0");
            }
            !go
        });
        // Early retries whose time has come: let on, or answered.
        early.retain(|id, stream| {
            let Ok(mut stream) = stream.try_borrow_mut() else {
                return true;
            };
            let now = &mut Now::lazy_us(now_us);
            let Some(decided) = stream.retry_tick(qos, &EnvoyStore, now) else {
                return true;
            };
            if host::act_on(*id) && decided_action(counts, decided, false) == Action::Continue {
                host::resume_request();
            }
            false
        });
        host::act_on(self.context_id);
        match qos.usage(&EnvoyStore, now_us() / 1000) {
            Ok(Some(by_label)) => worker.usage.flush(&by_label),
            Ok(None) => {}
            Err(e) => log(LogLevel::Warn, &counts.store.failed("usage ledger", &e)),
        }
        worker.flush();
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.clone()?;
        Some(Box::new(QosHttp {
            id: context_id,
            worker,
            stream: Rc::default(),
        }))
    }
}

/// A stream: the worker it runs on, and its state in core (shared with
/// the worker's held sockets, which its root context resumes).
struct QosHttp {
    id: u32,
    worker: Rc<RefCell<Worker>>,
    stream: Rc<RefCell<QosStream>>,
}

impl QosHttp {
    fn done(&mut self) {
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.held.remove(&self.id);
            worker.early.remove(&self.id);
            if let Ok(mut stream) = self.stream.try_borrow_mut() {
                stream.done(&mut worker.qos, &mut Now::lazy_us(now_us));
            }
        }
    }
}

/// Counts what letting a socket's calls on did; whether the gate is to
/// hold its data now, or to let it go (`None`: no change).
fn socket_charged(counts: &mut Counts, charged: Charged) -> Option<bool> {
    counts.leases += u64::from(charged.leased);
    counts.store.retried(charged.cas_retries);
    counts.evicted += u64::from(charged.evicted);
    if let Some(e) = &charged.store_error {
        let line = counts
            .store
            .failed("socket calls let on without a token", e);
        log(LogLevel::Warn, &line);
    }
    if let Some(reason) = charged.held_by {
        counts.socket_held(reason);
    }
    charged.hold
}

impl Context for QosHttp {
    fn on_done(&mut self) -> bool {
        self.done();
        true
    }
}

/// Counts an admission and answers a throttled request; a shadow only
/// counts it (it would have refused it) and lets it go on.
fn decided_action(counts: &mut Counts, decided: Decided, shadow: bool) -> Action {
    counts.leases += u64::from(decided.leased);
    counts.store.retried(decided.cas_retries);
    counts.evicted += u64::from(decided.evicted);
    if let Some(e) = &decided.store_error {
        let line = counts.store.failed("admitted without a token", e);
        log(LogLevel::Warn, &line);
    }
    if let Some(e) = &decided.early_error {
        let line = counts.store.failed("early retries (decided at once)", e);
        log(LogLevel::Warn, &line);
    }
    match decided.throttled {
        None => {
            counts.admitted(decided.tier);
            Action::Continue
        }
        Some(throttled) => {
            counts.throttled(decided.tier, throttled.reason);
            if shadow {
                return Action::Continue;
            }
            stakegate_glue::reject(&throttled.rejection);
            Action::Pause
        }
    }
}

impl HttpContext for QosHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let (Ok(mut worker), Ok(mut stream)) =
            (self.worker.try_borrow_mut(), self.stream.try_borrow_mut())
        else {
            return Action::Continue;
        };
        let Worker { qos, counts, .. } = &mut *worker;
        let decided = stream.headers(
            qos,
            &EnvoyStore,
            &mut Now::lazy_us(now_us),
            &mut StreamFacts,
            end_of_stream,
        );
        // The gate after QoS gives a staked caller priority (its `staked`
        // matcher); a shadow tells nobody anything.
        if !qos.policy().shadow {
            if stream.staked() {
                host::set_property(STAKED_PROPERTY, b"1");
            }
            // The gate bounds an identity's subscriptions and held
            // requests.
            if let Some(key) = stream.identity_key() {
                host::set_property(IDENTITY_PROPERTY, format!("{key:x}").as_bytes());
            }
        }
        match decided {
            Some(admission) => decided_action(counts, admission, qos.policy().shadow),
            None => Action::Continue,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Ok(mut worker) = self.worker.try_borrow_mut() else {
            return Action::Continue;
        };
        let Worker {
            qos,
            counts,
            held,
            early,
            ..
        } = &mut *worker;
        let Ok(mut stream) = self.stream.try_borrow_mut() else {
            return Action::Continue;
        };
        // On a socket, first the gate's word on what it sent the node.
        if let Some(total) = stream.is_socket().then(host::socket_answered).flatten() {
            stream.socket_answered(qos, &mut Now::lazy_us(now_us), total);
        }
        let step = stream.body(
            qos,
            &EnvoyStore,
            &mut Now::lazy_us(now_us),
            body_size,
            end_of_stream,
            &mut HostBody(BodyOf::Request),
        );
        counts.websocket_calls += u64::from(step.websocket_calls);
        if let Some(charged) = step.socket {
            // The gate after QoS holds the socket's data while its calls
            // wait for their identity's share; QoS itself lets it go.
            match socket_charged(counts, charged) {
                Some(true) => {
                    host::set_property(SOCKET_HOLD_PROPERTY, b"1");
                    held.insert(self.id, self.stream.clone());
                }
                Some(false) => {
                    host::set_property(SOCKET_HOLD_PROPERTY, b"0");
                    held.remove(&self.id);
                }
                None => {}
            }
            return Action::Continue;
        }
        match step.decided {
            Some(admission) => decided_action(counts, admission, qos.policy().shadow),
            None if step.early => {
                counts.retries_held += 1;
                early.insert(self.id, self.stream.clone());
                Action::Pause
            }
            None if step.hold => Action::Pause,
            None => Action::Continue,
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let Ok(mut worker) = self.worker.try_borrow_mut() else {
            return Action::Continue;
        };
        let Worker { qos, counts, .. } = &mut *worker;
        let Ok(mut stream) = self.stream.try_borrow_mut() else {
            return Action::Continue;
        };
        match stream.trailers(qos, &EnvoyStore, &mut Now::lazy_us(now_us)) {
            Some(admission) => decided_action(counts, admission, qos.policy().shadow),
            None => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let (Ok(worker), Ok(mut stream)) =
            (self.worker.try_borrow(), self.stream.try_borrow_mut())
        {
            stream.response_headers(
                &worker.qos,
                &mut Now::lazy_us(now_us),
                || host::response_header(":status").and_then(|s| s.parse().ok()),
                host::node_us,
                || host::response_header(RULE_HEADER),
            );
        }
        Action::Continue
    }

    /// On a WebSocket, what the gate says the node has answered: settled
    /// (calls held for the identity's share try again at the next tick).
    fn on_http_response_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        let (Ok(mut worker), Ok(mut stream)) =
            (self.worker.try_borrow_mut(), self.stream.try_borrow_mut())
        else {
            return Action::Continue;
        };
        if !stream.is_socket() {
            return Action::Continue;
        }
        if let Some(total) = host::socket_answered() {
            stream.socket_answered(&mut worker.qos, &mut Now::lazy_us(now_us), total);
        }
        Action::Continue
    }
}

impl Drop for QosHttp {
    /// A stream deleted without `on_done` still ends its request.
    fn drop(&mut self) {
        self.done();
    }
}
