//! admission-gate: the proxy-wasm glue for the RPC admission gate.
//!
//! The logic lives in `stakegate_core::gate`; this crate reads what Envoy
//! gives it and maps decisions to actions:
//!
//! - `on_configure` parses the policy (plugin configuration). A bad policy
//!   is logged with the field and the reason, and `false` makes Envoy refuse
//!   the config, so the previous one keeps serving.
//! - `on_http_request_headers` classifies the request and admits it or sends
//!   the 503, before any body byte is read.
//! - `on_done` (or, if that never comes, dropping the stream context) gives
//!   the slot back.
//! - `on_tick` heartbeats this worker's shard, settles any release debt, and
//!   expires shards of workers that vanished.

mod metrics;

use metrics::GateMetrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::gate::class::classify;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::gate::{Admission, Decision, InflightGate, Rejection, Ticket};
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::{now_ms, EnvoyStore};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(GateRoot { context_id, worker: None })
    });
}}

/// This VM's gate and metrics, shared by its root and stream contexts (a VM
/// is single-threaded).
struct Worker {
    gate: InflightGate,
    metrics: GateMetrics,
    /// The clock as of the last heartbeat. Requests use it instead of a
    /// hostcall each: shard heartbeats only need tick resolution.
    now_ms: u64,
}

struct GateRoot {
    context_id: u32,
    worker: Option<Rc<RefCell<Worker>>>,
}

fn log(level: LogLevel, message: &str) {
    stakegate_glue::log("admission-gate", level, message);
}

impl GateRoot {
    fn configure(&mut self, config: &[u8]) -> Result<(), String> {
        let policy = GatePolicy::parse(config).map_err(|e| format!("policy rejected: {e}"))?;
        let metrics = GateMetrics::define()?;
        let heartbeat = Duration::from_millis(policy.heartbeat_ms);
        let now_ms = now_ms();
        let mut gate = InflightGate::new(policy, now_ms ^ (u64::from(self.context_id) << 32));
        // Joining now gives this worker its shard before traffic arrives; if
        // the store is unavailable, the first request joins instead.
        if let Err(e) = gate.join(&EnvoyStore, now_ms) {
            log(
                LogLevel::Warn,
                &format!("joining the shared slot table: {e}"),
            );
        }
        self.set_tick_period(heartbeat);
        let worker = Worker {
            gate,
            metrics,
            now_ms,
        };
        self.worker = Some(Rc::new(RefCell::new(worker)));
        Ok(())
    }
}

impl Context for GateRoot {
    /// The plugin is being deleted (a swap or reload; Envoy does it once its
    /// last stream has ended): spare slots go back now rather than after
    /// the stale-slot TTL, and the last counts reach Envoy.
    fn on_done(&mut self) -> bool {
        let Some(worker) = &self.worker else {
            return true;
        };
        let mut worker = worker.borrow_mut();
        let Worker { gate, metrics, .. } = &mut *worker;
        match gate.leave(&EnvoyStore, now_ms()) {
            Ok(0) => {}
            Ok(held) => log(
                LogLevel::Warn,
                &format!(
                    "leaving with {held} slots still held; they expire with the stale-slot TTL"
                ),
            ),
            Err(e) => {
                metrics.store_error();
                log(LogLevel::Warn, &format!("leaving the slot table: {e}"));
            }
        }
        metrics.flush(None);
        true
    }
}

impl RootContext for GateRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        stakegate_glue::accept("admission-gate", self.configure(&config))
    }

    fn on_tick(&mut self) {
        let Some(worker) = &self.worker else { return };
        let mut worker = worker.borrow_mut();
        let Worker {
            gate,
            metrics,
            now_ms: now,
        } = &mut *worker;
        *now = now_ms();
        let totals = match gate.heartbeat(&EnvoyStore, *now) {
            Ok(beat) => {
                metrics.cas_retries(beat.cas_retries);
                metrics.expired_slots(beat.expired_slots);
                if beat.expired_slots > 0 {
                    log(
                        LogLevel::Warn,
                        &format!(
                            "reclaimed {} slots held by a worker that stopped heartbeating",
                            beat.expired_slots
                        ),
                    );
                }
                Some(beat.totals)
            }
            Err(e) => {
                metrics.store_error();
                log(LogLevel::Warn, &format!("heartbeat: {e}"));
                None
            }
        };
        metrics.flush(totals);
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.clone()?;
        Some(Box::new(GateStream {
            worker,
            ticket: None,
        }))
    }
}

struct GateStream {
    worker: Rc<RefCell<Worker>>,
    ticket: Option<Ticket>,
}

impl GateStream {
    fn admit(&mut self) -> Result<(), Rejection> {
        let websocket = self
            .get_http_request_header("upgrade")
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        let mut worker = self.worker.borrow_mut();
        let Worker {
            gate,
            metrics,
            now_ms,
        } = &mut *worker;
        let policy = gate.policy();
        let class = classify(&policy.internal, &policy.priority, &mut StreamFacts);
        let Admission {
            decision,
            cas_retries,
            store_error,
            ..
        } = gate.admit(&EnvoyStore, *now_ms, class, websocket);
        metrics.cas_retries(cas_retries);
        if let Some(e) = store_error {
            metrics.store_error();
            log(LogLevel::Warn, &format!("admission failed closed: {e}"));
        }
        match decision {
            Decision::Admit(ticket) => {
                metrics.admitted(class);
                if ticket.slot.is_none() {
                    metrics.internal_inflight(1);
                }
                self.ticket = Some(ticket);
                Ok(())
            }
            Decision::Reject(rejection) => {
                metrics.rejected(class, websocket);
                Err(rejection)
            }
        }
    }

    fn release(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let mut worker = self.worker.borrow_mut();
        if ticket.slot.is_none() {
            worker.metrics.internal_inflight(-1);
        }
        worker.gate.release(ticket);
    }
}

impl Context for GateStream {
    fn on_done(&mut self) -> bool {
        self.release();
        true
    }
}

impl HttpContext for GateStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        match self.admit() {
            Ok(()) => Action::Continue,
            Err(rejection) => {
                stakegate_glue::reject(
                    Rejection::STATUS,
                    rejection.retry_after_s,
                    &[],
                    &rejection.body,
                );
                Action::Pause
            }
        }
    }
}

impl Drop for GateStream {
    /// A stream deleted without `on_done` still gives its slot back.
    fn drop(&mut self) {
        self.release();
    }
}
