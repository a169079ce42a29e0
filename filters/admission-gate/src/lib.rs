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
//! - With `dedup` in the policy, an admitted request's body is held
//!   until it has been read whole (up to `maxBodyBytes`; a larger body
//!   goes on unchecked, never cut). `on_http_request_body` then refuses a
//!   duplicate with 429, or records the request and lets it go upstream.
//!   Internal traffic is never checked.
//! - `on_done` (or, if that never comes, dropping the stream context) gives
//!   the slot back and completes the request's dedup entry.
//! - `on_tick` heartbeats this worker's shard, settles any release debt,
//!   expires shards of workers that vanished, and sweeps expired dedup
//!   entries.

mod metrics;

use metrics::GateMetrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::dedup::{client_name, Dedup, Pending, Verdict, DUPLICATE_STATUS};
use stakegate_core::gate::class::{classify, RequestClass};
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
    /// Retry-storm protection, when the policy has it.
    dedup: Option<Dedup>,
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
        let dedup = policy
            .dedup
            .clone()
            .map(|d| Dedup::new(d, policy.heartbeat_ms, policy.retry_after_max_s));
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
            dedup,
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
            dedup,
            metrics,
            now_ms: now,
        } = &mut *worker;
        *now = now_ms();
        if let (Some(dedup), Some(vm)) = (dedup.as_ref(), gate.vm()) {
            match dedup.sweep(&EnvoyStore, vm, *now) {
                Ok(sweep) => {
                    metrics.dedup().purged += sweep.purged;
                    metrics.cas_retries(sweep.cas_retries);
                    metrics.dedup_entries(sweep.entries);
                }
                Err(e) => {
                    metrics.store_error();
                    log(LogLevel::Warn, &format!("dedup sweep: {e}"));
                }
            }
        }
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
            reading_body: false,
            client: String::new(),
            sent: None,
        }))
    }
}

struct GateStream {
    worker: Rc<RefCell<Worker>>,
    ticket: Option<Ticket>,
    /// The body is held until it is whole and checked for a duplicate.
    reading_body: bool,
    /// The sender's name for dedup's `client` scope, read with the headers.
    client: String,
    /// This request's entry in the dedup table, completed when it ends.
    sent: Option<Pending>,
}

/// A 429 to send for a duplicate.
struct Duplicate {
    retry_after_s: u32,
    body: String,
}

impl GateStream {
    fn admit(&mut self) -> Result<RequestClass, Rejection> {
        let websocket = self
            .get_http_request_header("upgrade")
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        let mut worker = self.worker.borrow_mut();
        let Worker {
            gate,
            metrics,
            now_ms,
            ..
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
                Ok(class)
            }
            Decision::Reject(rejection) => {
                metrics.rejected(class, websocket);
                Err(rejection)
            }
        }
    }

    /// Whether to hold the headers and read the body for dedup.
    fn wants_body(&mut self, class: RequestClass, end_of_stream: bool) -> bool {
        let worker = self.worker.clone();
        let mut worker = worker.borrow_mut();
        let Some(dedup) = &worker.dedup else {
            return false;
        };
        if end_of_stream || class == RequestClass::Internal {
            return false;
        }
        let length = self
            .get_http_request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if length.is_some_and(|n| !dedup.fits(n)) {
            worker.metrics.dedup().too_large += 1;
            return false;
        }
        self.client = client_name(dedup.policy(), &mut StreamFacts);
        true
    }

    /// Checks a whole body: `Err` is the 429 for a duplicate. Anything that
    /// goes wrong lets the request pass.
    fn check(&mut self, body: &[u8]) -> Result<(), Duplicate> {
        let mut worker = self.worker.borrow_mut();
        let Worker {
            gate,
            dedup,
            metrics,
            ..
        } = &mut *worker;
        let (Some(dedup), Some(vm)) = (dedup.as_ref(), gate.vm()) else {
            metrics.dedup().skipped += 1;
            return Ok(());
        };
        let Ok(keyed) = dedup.key(body, &self.client) else {
            metrics.dedup().skipped += 1;
            return Ok(());
        };
        let checked = match dedup.check(&EnvoyStore, &keyed, vm, now_ms()) {
            Ok(checked) => checked,
            Err(e) => {
                metrics.store_error();
                log(
                    LogLevel::Warn,
                    &format!("dedup check passed a request: {e}"),
                );
                return Ok(());
            }
        };
        metrics.cas_retries(checked.cas_retries);
        let counts = metrics.dedup();
        counts.purged += checked.purged;
        match checked.verdict {
            Verdict::Send(pending) => {
                counts.tracked += 1;
                self.sent = Some(pending);
                Ok(())
            }
            Verdict::TableFull => {
                counts.table_full += 1;
                Ok(())
            }
            Verdict::Duplicate {
                retry_after_s,
                body,
            } => {
                counts.duplicates_rejected += 1;
                Err(Duplicate {
                    retry_after_s,
                    body,
                })
            }
        }
    }

    fn release(&mut self) {
        let mut worker = self.worker.borrow_mut();
        let Worker {
            gate,
            dedup,
            metrics,
            ..
        } = &mut *worker;
        if let (Some(pending), Some(dedup)) = (self.sent.take(), dedup.as_ref()) {
            match dedup.complete(&EnvoyStore, pending, now_ms()) {
                Ok((purged, retries)) => {
                    metrics.dedup().purged += purged;
                    metrics.cas_retries(retries);
                }
                Err(e) => {
                    metrics.store_error();
                    log(LogLevel::Warn, &format!("dedup completion: {e}"));
                }
            }
        }
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        if ticket.slot.is_none() {
            metrics.internal_inflight(-1);
        }
        gate.release(ticket);
    }
}

impl Context for GateStream {
    fn on_done(&mut self) -> bool {
        self.release();
        true
    }
}

impl HttpContext for GateStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        match self.admit() {
            Ok(class) => {
                // Headers cannot be held while the body is read: Envoy turns
                // a paused header phase into StopAllIteration, and the body
                // never reaches the filter (proxy-wasm spec issue #63). So
                // the headers go on, the body is held, and a duplicate's
                // upstream stream is reset before any body byte is sent: the
                // node never receives the request.
                self.reading_body = self.wants_body(class, end_of_stream);
                Action::Continue
            }
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

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.body_ended_by_trailers();
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.reading_body {
            return Action::Continue;
        }
        let fits = self
            .worker
            .borrow()
            .dedup
            .as_ref()
            .is_some_and(|d| d.fits(body_size as u64));
        if !fits {
            // Too large to check: it goes on as it is, with what was held.
            self.reading_body = false;
            self.worker.borrow_mut().metrics.dedup().too_large += 1;
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.reading_body = false;
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        match self.check(&body) {
            Ok(()) => Action::Continue,
            Err(duplicate) => {
                stakegate_glue::reject(
                    DUPLICATE_STATUS,
                    duplicate.retry_after_s,
                    &[],
                    &duplicate.body,
                );
                Action::Pause
            }
        }
    }
}

impl GateStream {
    /// Trailers end a body without `end_of_stream` on its last chunk: it
    /// goes on unchecked rather than wait for an end that will not come.
    fn body_ended_by_trailers(&mut self) {
        if std::mem::take(&mut self.reading_body) {
            self.worker.borrow_mut().metrics.dedup().skipped += 1;
        }
    }
}

impl Drop for GateStream {
    /// A stream deleted without `on_done` still gives its slot back.
    fn drop(&mut self) {
        self.release();
    }
}
