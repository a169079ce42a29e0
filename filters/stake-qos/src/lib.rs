//! stake-qos: the proxy-wasm glue for stake-weighted rate shares.
//!
//! The logic lives in `stakegate_core::qos`; this crate reads what Envoy
//! gives it and maps decisions to actions:
//!
//! - `on_configure` parses the policy. A bad policy is logged with the
//!   field and the reason, and `false` makes Envoy refuse it, so the
//!   previous one keeps serving.
//! - `on_http_request_headers` resolves the identity and admits the request
//!   or answers 429, before any body byte is read.
//! - `on_http_response_headers` notes the upstream status (503 and 429 are
//!   back-pressure in reactive mode); `on_done` (or dropping the stream
//!   context) ends the request: its in-flight count and its latency.
//! - `on_tick`, every refill interval on every worker, reads the shared
//!   state and runs the refill round if this VM wins it.

mod metrics;

use metrics::QosMetrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::qos::identity::{anonymous, identify};
use stakegate_core::qos::policy::QosPolicy;
use stakegate_core::qos::{Admission, Reason, StakeQos, Throttled, Ticket, Verdict};
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::{now_ms, now_us, EnvoyStore};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

stakegate_glue::declare_filter!("stake-qos");

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(QosRoot { context_id, worker: None })
    });
}}

struct Worker {
    qos: StakeQos,
    metrics: QosMetrics,
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
        self.set_tick_period(Duration::from_millis(policy.refill_interval_ms));
        let seed = now_us() ^ (u64::from(self.context_id) << 40);
        self.worker = Some(Rc::new(RefCell::new(Worker {
            qos: StakeQos::new(policy, seed),
            metrics,
        })));
        Ok(())
    }
}

impl Context for QosRoot {
    /// The plugin is being deleted (a swap or reload): the last counts
    /// reach Envoy instead of dying with the VM.
    fn on_done(&mut self) -> bool {
        if let Some(worker) = &self.worker {
            let mut worker = worker.borrow_mut();
            let Worker { qos, metrics } = &mut *worker;
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
        let Worker { qos, metrics } = &mut *worker;
        let started = now_us();
        match qos.tick(&EnvoyStore, started / 1000) {
            Ok(Some(round)) => {
                metrics.refill_took(now_us().saturating_sub(started));
                metrics.cas_retries(round.cas_retries);
                metrics.evicted(round.evicted);
            }
            Ok(None) => {}
            Err(e) => {
                metrics.store_error();
                log(LogLevel::Warn, &format!("refill round: {e}"));
            }
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
            upstream_status: None,
        }))
    }
}

struct QosStream {
    worker: Rc<RefCell<Worker>>,
    ticket: Option<Ticket>,
    upstream_status: Option<u32>,
}

impl QosStream {
    fn admit(&mut self) -> Result<(), Throttled> {
        let mut worker = self.worker.borrow_mut();
        let Worker { qos, metrics } = &mut *worker;
        let identity =
            identify(qos.policy(), &mut StreamFacts).unwrap_or_else(|| anonymous(qos.policy()));
        let Admission {
            verdict,
            cas_retries,
            evicted,
            store_error,
        } = qos.admit(&EnvoyStore, now_ms(), &identity);
        metrics.cas_retries(cas_retries);
        metrics.evicted(u64::from(evicted));
        if let Some(e) = store_error {
            metrics.store_error();
            log(LogLevel::Warn, &format!("admitted without accounting: {e}"));
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
        let mut worker = self.worker.borrow_mut();
        let Worker { qos, metrics } = &mut *worker;
        match qos.finish(&EnvoyStore, now_ms(), ticket, self.upstream_status) {
            Ok(retries) => metrics.cas_retries(retries),
            Err(e) => {
                metrics.store_error();
                log(LogLevel::Warn, &format!("ending a request: {e}"));
            }
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
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        match self.admit() {
            Ok(()) => Action::Continue,
            Err(throttled) => {
                let [(policy_name, policy), (limit_name, limit)] = throttled.rate_limit_headers();
                stakegate_glue::reject(
                    Throttled::STATUS,
                    throttled.retry_after_s,
                    &[(policy_name, &policy), (limit_name, &limit)],
                    &throttled.body,
                );
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.upstream_status =
            stakegate_glue::host::response_header(":status").and_then(|s| s.parse().ok());
        Action::Continue
    }
}

impl Drop for QosStream {
    /// A stream deleted without `on_done` still ends its request.
    fn drop(&mut self) {
        self.finish();
    }
}
