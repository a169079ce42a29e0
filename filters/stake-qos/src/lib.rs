//! stake-qos: the proxy-wasm glue for stake-weighted rate shares.
//!
//! The logic lives in `stakegate_core::qos`; this crate reads what Envoy
//! gives it and maps decisions to actions:
//!
//! - `on_configure` parses the policy. A bad policy is logged with the
//!   field and the reason, and `false` makes Envoy refuse it, so the
//!   previous one keeps serving.
//! - request headers: resolve the identity and admit the request (one call)
//!   or answer 429. While throttling is off this touches no shared data.
//! - request body: a batch is charged its other calls.
//! - response headers (reactive mode): the upstream status, 503 and 429
//!   being back-pressure; `on_done` (or dropping the stream context) ends
//!   the request locally: its place in flight and its latency.
//! - `on_tick`, every refill interval on every worker: this worker's counts
//!   go on the report queue, the shared state is read, and the refill round
//!   runs if this VM wins it.

stakegate_glue::declare_filter!("stake-qos");

mod metrics;

use metrics::QosMetrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::qos::identity::{anonymous, identify};
use stakegate_core::qos::policy::{Mode, QosPolicy};
use stakegate_core::qos::report::QUEUE;
use stakegate_core::qos::{Admission, Connection, Reason, StakeQos, Throttled, Ticket, Verdict};
use stakegate_core::websocket::{FrameReader, Side};
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::host::{self, BodyOf};
use stakegate_glue::{now_ms, now_us, EnvoyQueue, EnvoyStore};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(QosRoot { context_id, worker: None })
    });
}}

struct Worker {
    qos: StakeQos,
    metrics: QosMetrics,
    queue: EnvoyQueue,
}

struct QosRoot {
    context_id: u32,
    worker: Option<Rc<RefCell<Worker>>>,
}

fn log(level: LogLevel, message: &str) {
    stakegate_glue::log("stake-qos", level, message);
}

impl QosRoot {
    fn configure(&mut self, config: &[u8]) -> Result<(), String> {
        let policy = QosPolicy::parse(config).map_err(|e| format!("policy rejected: {e}"))?;
        let metrics = QosMetrics::define(&policy.tiers)?;
        let queue = EnvoyQueue::register(QUEUE)?;
        self.set_tick_period(Duration::from_millis(policy.refill_interval_ms));
        let seed = now_us() ^ (u64::from(self.context_id) << 40);
        self.worker = Some(Rc::new(RefCell::new(Worker {
            qos: StakeQos::new(policy, seed),
            metrics,
            queue,
        })));
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
                qos,
                metrics,
                queue,
            } = &mut *worker;
            if let Err(e) = qos.flush(queue) {
                log(LogLevel::Warn, &metrics.store().failed("last report", &e));
            }
            metrics.flush(qos.state(), qos.policy().refill_interval_ms);
        }
        true
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
            qos,
            metrics,
            queue,
        } = &mut *worker;
        let started = now_us();
        match qos.tick(&EnvoyStore, queue, started / 1000) {
            Ok(tick) => {
                if let Some(round) = tick.round {
                    metrics.refill_took(now_us().saturating_sub(started));
                    metrics.store().retried(round.cas_retries);
                    metrics.evicted(round.evicted);
                }
            }
            Err(e) => log(LogLevel::Warn, &metrics.store().failed("tick", &e)),
        }
        metrics.flush(qos.state(), qos.policy().refill_interval_ms);
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.clone()?;
        Some(Box::new(QosStream {
            worker,
            ticket: None,
            charged: false,
            upstream_status: None,
            upgraded: None,
        }))
    }
}

struct QosStream {
    worker: Rc<RefCell<Worker>>,
    ticket: Option<Ticket>,
    /// The body was looked at for a batch.
    charged: bool,
    upstream_status: Option<u32>,
    /// An admitted upgrade: not in flight; a WebSocket's calls are read
    /// from its client frames and charged.
    upgraded: Option<(Connection, Option<FrameReader>)>,
}

impl QosStream {
    /// An admitted request with more to come may be an upgrade (a
    /// WebSocket): it leaves the requests in flight (`StakeQos::upgraded`).
    /// One header read, for requests whose headers do not end them.
    fn upgrade(&mut self) {
        let Some(upgrade) = host::request_header("upgrade") else {
            return;
        };
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let mut worker = self.worker.borrow_mut();
        let connection = worker.qos.upgraded(ticket);
        let reader = upgrade
            .eq_ignore_ascii_case("websocket")
            .then(|| FrameReader::new(Side::Client));
        self.upgraded = Some((connection, reader));
    }

    /// A piece of an upgraded stream's client data: the JSON-RPC calls it
    /// completes are charged to the identity.
    fn upgraded_data(&mut self, body_size: usize) {
        let Some((connection, Some(reader))) = &mut self.upgraded else {
            return;
        };
        let messages = reader.feed(&host::body(BodyOf::Request, 0, body_size));
        let calls = messages.requests + messages.notifications;
        if calls > 0 {
            if let Ok(mut worker) = self.worker.try_borrow_mut() {
                worker.qos.charge_calls(connection, calls);
                worker.metrics.websocket_calls(calls);
            }
        }
    }

    fn admit(&mut self) -> Result<(), Throttled> {
        let mut worker = self.worker.borrow_mut();
        let Worker { qos, metrics, .. } = &mut *worker;
        let identity =
            identify(qos.policy(), &mut StreamFacts).unwrap_or_else(|| anonymous(qos.policy()));
        let Admission {
            verdict,
            leased,
            cas_retries,
            evicted,
            store_error,
        } = qos.admit(&EnvoyStore, now_ms(), &identity);
        metrics.leased(leased);
        metrics.store().retried(cas_retries);
        metrics.evicted(u64::from(evicted));
        if let Some(e) = store_error {
            let line = metrics.store().failed("admitted without a token", &e);
            log(LogLevel::Warn, &line);
        }
        match verdict {
            Verdict::Admit(ticket) => {
                metrics.admitted(identity.tier);
                self.ticket = Some(ticket);
                Ok(())
            }
            Verdict::Throttle(throttled) => {
                metrics.throttled(identity.tier, throttled.reason == Reason::Concurrency);
                Err(throttled)
            }
        }
    }

    fn finish(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.qos.finish(now_ms(), ticket, self.upstream_status);
        }
    }
}

impl Context for QosStream {
    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for QosStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        match self.admit() {
            Ok(()) => {
                if !end_of_stream {
                    self.upgrade();
                }
                Action::Continue
            }
            Err(throttled) => {
                stakegate_glue::reject(&throttled.rejection);
                Action::Pause
            }
        }
    }

    /// A batch is charged the calls it holds beyond the first. Behind the
    /// buffer filter of the shipped configs the body is whole here; a body
    /// streamed in pieces is charged what its first piece holds.
    fn on_http_request_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if self.upgraded.is_some() {
            self.upgraded_data(body_size);
            return Action::Continue;
        }
        let Some(ticket) = &self.ticket else {
            return Action::Continue;
        };
        if std::mem::replace(&mut self.charged, true) || body_size == 0 {
            return Action::Continue;
        }
        let head = host::body(BodyOf::Request, 0, body_size.min(64));
        if head.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'[') {
            return Action::Continue;
        }
        let calls = stakegate_core::jsonrpc::calls(&host::body(BodyOf::Request, 0, body_size));
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.qos.charge(ticket, calls);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let reactive = self
            .worker
            .try_borrow()
            .is_ok_and(|w| w.qos.policy().mode == Mode::Reactive);
        if reactive {
            self.upstream_status = host::response_header(":status").and_then(|s| s.parse().ok());
        }
        Action::Continue
    }
}

impl Drop for QosStream {
    /// A stream deleted without `on_done` still ends its request.
    fn drop(&mut self) {
        self.finish();
    }
}
