//! admission-gate: the proxy-wasm glue for the RPC admission gate.
//!
//! Every decision is in `stakegate_core::gate::stream`; this crate reads
//! what Envoy gives it, reports it there, and makes the host calls it is
//! told to:
//!
//! - `on_configure` parses the policy (plugin configuration). A bad policy
//!   is logged with the field and the reason, and `false` makes Envoy refuse
//!   the config, so the previous one keeps serving.
//! - request headers: admit or refuse (503) before any body byte is read.
//! - request body: dedup's check (429 for a duplicate), or a WebSocket's
//!   messages, held while they wait for a slot.
//! - response: the end of the node's response gives the slot back; a
//!   WebSocket's answers give their messages' slots back, and held
//!   WebSockets on this worker retry.
//! - `on_done` (or, if that never comes, dropping the stream context) gives
//!   back whatever is left.
//! - `on_tick` is the heartbeat (shard, spares, dedup sweep, metrics) and
//!   retries held WebSockets.

mod metrics;

use metrics::GateMetrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::clock::Now;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::gate::stream::{GateStream, GateWorker, Head, OnBody, OnHeaders, Settled};
use stakegate_core::gate::InflightGate;
use stakegate_core::rejection::Rejection;
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::host::{self, BodyOf, HostBody};
use stakegate_glue::{now_ms, EnvoyStore};
use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Duration;

stakegate_glue::declare_filter!("admission-gate");

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(GateRoot { context_id, worker: None })
    });
}}

/// This VM's gate, metrics and held WebSockets, shared by its root and
/// stream contexts (a VM is single-threaded).
struct Worker {
    core: GateWorker,
    metrics: GateMetrics,
    /// Streams held for a slot, oldest first.
    held: Vec<(u32, Weak<RefCell<GateStream>>)>,
}

impl Worker {
    fn log(&mut self) {
        for line in self.core.take_log() {
            log(LogLevel::Warn, &line);
        }
    }

    /// Lets held streams retry for slots, oldest first, and resumes those
    /// that got them (or closes those that never can); `current` is the
    /// context this runs in.
    fn wake(&mut self, current: u32) {
        if self.held.is_empty() {
            return;
        }
        let mut now = Now::lazy(now_ms);
        let mut acted = false;
        let mut i = 0;
        while i < self.held.len() {
            let (id, stream) = &self.held[i];
            let id = *id;
            let Some(stream) = stream.upgrade() else {
                self.held.remove(i);
                continue;
            };
            let Ok(mut stream) = stream.try_borrow_mut() else {
                i += 1;
                continue;
            };
            match stream.settle(&mut self.core, &EnvoyStore, &mut now) {
                Settled::ConnectionFull => i += 1,
                Settled::GateFull => break,
                settled => {
                    acted = true;
                    if host::act_on(id) {
                        if settled == Settled::Through {
                            host::resume_request();
                        } else {
                            host::close_request();
                        }
                    }
                    self.held.remove(i);
                }
            }
        }
        if acted {
            host::act_on(current);
        }
    }
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
        let gate = InflightGate::new(policy, now_ms ^ (u64::from(self.context_id) << 32));
        let mut core = GateWorker::new(gate);
        core.join(&EnvoyStore, now_ms);
        self.set_tick_period(heartbeat);
        let mut worker = Worker {
            core,
            metrics,
            held: Vec::new(),
        };
        worker.log();
        self.worker = Some(Rc::new(RefCell::new(worker)));
        Ok(())
    }
}

impl Context for GateRoot {
    /// The plugin is being deleted (a swap or reload; Envoy does it once its
    /// last stream has ended): spare slots go back now rather than after
    /// the stale-slot TTL, and the last counts reach Envoy.
    fn on_done(&mut self) -> bool {
        if let Some(worker) = &self.worker {
            let mut worker = worker.borrow_mut();
            worker.core.leave(&EnvoyStore, now_ms());
            worker.log();
            let Worker { core, metrics, .. } = &mut *worker;
            metrics.flush(&mut core.counts, None, None);
        }
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
        let (totals, entries) = worker.core.tick(&EnvoyStore, now_ms());
        worker.log();
        let Worker { core, metrics, .. } = &mut *worker;
        metrics.flush(&mut core.counts, totals, entries);
        worker.wake(self.context_id);
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.clone()?;
        Some(Box::new(GateHttp {
            context_id,
            worker,
            stream: Rc::new(RefCell::new(GateStream::default())),
        }))
    }
}

struct GateHttp {
    context_id: u32,
    worker: Rc<RefCell<Worker>>,
    stream: Rc<RefCell<GateStream>>,
}

fn refuse(rejection: &Rejection) -> Action {
    stakegate_glue::reject(rejection);
    Action::Pause
}

impl GateHttp {
    /// Runs `step` on this stream with the worker; when it gave slots back,
    /// held streams retry.
    fn with(&mut self, step: impl FnOnce(&mut GateStream, &mut GateWorker, &mut Now) -> bool) {
        let mut worker = self.worker.borrow_mut();
        let released = match self.stream.try_borrow_mut() {
            Ok(mut stream) => step(&mut stream, &mut worker.core, &mut Now::lazy(now_ms)),
            Err(_) => false,
        };
        worker.log();
        if released {
            worker.wake(self.context_id);
        }
    }
}

impl Context for GateHttp {
    fn on_done(&mut self) -> bool {
        self.with(|stream, w, now| {
            stream.done(w, &EnvoyStore, now);
            true
        });
        true
    }
}

impl HttpContext for GateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let mut worker = self.worker.borrow_mut();
        let head = Head::read(
            end_of_stream,
            worker.core.dedup.is_some(),
            host::request_header,
        );
        let Ok(mut stream) = self.stream.try_borrow_mut() else {
            return Action::Continue;
        };
        let action = stream.headers(
            &mut worker.core,
            &EnvoyStore,
            &mut Now::lazy(now_ms),
            &mut StreamFacts,
            head,
        );
        worker.log();
        match action {
            OnHeaders::Continue => Action::Continue,
            OnHeaders::ContinueWebsocket => {
                // No compression, so the messages stay readable.
                host::remove_request_header("sec-websocket-extensions");
                Action::Continue
            }
            OnHeaders::Refuse(refusal) => refuse(&refusal),
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut worker = self.worker.borrow_mut();
        let Ok(mut stream) = self.stream.try_borrow_mut() else {
            return Action::Continue;
        };
        let action = stream.request_body(
            &mut worker.core,
            &EnvoyStore,
            &mut Now::lazy(now_ms),
            body_size,
            end_of_stream,
            &mut HostBody(BodyOf::Request),
        );
        worker.log();
        match action {
            OnBody::Continue => Action::Continue,
            OnBody::Hold => {
                if stream.waiting() && !worker.held.iter().any(|(id, _)| *id == self.context_id) {
                    worker
                        .held
                        .push((self.context_id, Rc::downgrade(&self.stream)));
                }
                Action::Pause
            }
            OnBody::Close => {
                host::close_request();
                Action::Pause
            }
            OnBody::Refuse(refusal) => refuse(&refusal),
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let mut refused = None;
        self.with(|stream, w, now| {
            refused = stream.request_trailers(w, &EnvoyStore, now).err();
            false
        });
        match refused {
            Some(refusal) => refuse(&refusal),
            None => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.with(|stream, w, now| stream.response_headers(w, &EnvoyStore, now, end_of_stream));
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Answers give slots back; held streams (this one too) retry.
        self.with(|stream, w, now| {
            stream.response_body(
                w,
                &EnvoyStore,
                now,
                body_size,
                end_of_stream,
                &mut HostBody(BodyOf::Response),
            )
        });
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with(|stream, w, now| stream.response_trailers(w, &EnvoyStore, now));
        Action::Continue
    }
}

impl Drop for GateHttp {
    /// A stream deleted without `on_done` still gives back what it holds.
    fn drop(&mut self) {
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            if let Ok(mut stream) = self.stream.try_borrow_mut() {
                stream.done(&mut worker.core, &EnvoyStore, &mut Now::lazy(now_ms));
            }
        }
    }
}
