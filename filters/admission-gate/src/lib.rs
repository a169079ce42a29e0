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
//! - request body: dedup's check, or a WebSocket's messages, held while
//!   they wait for a slot. A request that leads its key is held while the
//!   root context sends it to the node as a callout (so its client's going
//!   cannot cancel it); one identical to a request in flight is held for
//!   that request's answer.
//! - `on_http_call_response` (root): a leader's answer, for every request
//!   here waiting on its key, and on the other gate VMs' wake queues.
//! - `on_queue_ready` (root): callouts to send, and wake messages: an
//!   answer, or a failed leader to take over.
//! - response: the end of the node's response gives the slot back; a
//!   WebSocket's answers give their messages' slots back, and held
//!   WebSockets on this worker retry.
//! - `on_done` (or, if that never comes, dropping the stream context) gives
//!   back whatever is left.
//! - `on_tick` is the heartbeat (shard, spares, dedup sweep, metrics,
//!   held requests' deadlines) and retries held WebSockets.

mod metrics;

use metrics::GateMetrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::clock::Now;
use stakegate_core::dedup::{engage, wake_queue};
use stakegate_core::gate::coalesce::{Act, Acts, Callout, Held, Reply, Response};
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::gate::stream::{
    GateStream, GateWorker, Head, OnBody, OnHeaders, Settled, Ticked,
};
use stakegate_core::gate::InflightGate;
use stakegate_core::rejection::Rejection;
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::host::{self, BodyOf, HostBody};
use stakegate_glue::{now_ms, EnvoyStore};
use std::cell::{RefCell, RefMut};
use std::collections::HashMap;
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
    /// Streams held for an answer (dedup), oldest first.
    coalesced: Vec<(u32, Weak<RefCell<GateStream>>)>,
    /// Leaders' callouts, sent from the root context.
    to_dispatch: Vec<(u32, Callout)>,
    root: u32,
    /// This VM's wake queue, and whether a wake-up to send callouts is on it.
    wake: Option<u32>,
    poked: bool,
    vm_id: String,
    /// Other gate VMs' wake queues, by VM.
    peers: HashMap<u32, u32>,
    /// Warnings already logged.
    told: Vec<String>,
    /// When the heartbeat's work last ran.
    last_heartbeat_ms: u64,
}

type StreamRef = (u32, Weak<RefCell<GateStream>>);

/// Borrows the live streams of `list` (one borrowed elsewhere is skipped).
fn borrow_all(list: &[StreamRef]) -> Vec<(u32, Rc<RefCell<GateStream>>)> {
    list.iter()
        .filter_map(|(id, weak)| Some((*id, weak.upgrade()?)))
        .collect()
}

impl Worker {
    /// Runs a coalescing step over the streams held for an answer, then
    /// does what it says. `in_root`: this is a root-context callback, where
    /// callouts can be sent at once.
    fn coalesce(
        &mut self,
        current: u32,
        in_root: bool,
        step: impl FnOnce(&mut GateWorker, &mut [Held<'_>]) -> Acts,
    ) {
        let streams = borrow_all(&self.coalesced);
        let mut borrowed: Vec<(u32, RefMut<'_, GateStream>)> = streams
            .iter()
            .filter_map(|(id, s)| Some((*id, s.try_borrow_mut().ok()?)))
            .collect();
        let mut held: Vec<Held<'_>> = borrowed.iter_mut().map(|(id, s)| (*id, &mut **s)).collect();
        let acts = step(&mut self.core, &mut held);
        drop(held);
        drop(borrowed);
        self.log();
        self.act(current, in_root, acts);
    }

    fn act(&mut self, current: u32, in_root: bool, acts: Acts) {
        if let Some(message) = acts.wake {
            self.broadcast(&message);
        }
        let mut acted = false;
        for (id, act) in acts.acts {
            match act {
                Act::Answer(reply) => {
                    acted = true;
                    if host::act_on(id) {
                        answer(&reply);
                    }
                }
                Act::Resume => {
                    acted = true;
                    if host::act_on(id) {
                        host::resume_request();
                    }
                }
                Act::Dispatch(callout) => self.to_dispatch.push((id, callout)),
            }
        }
        if in_root {
            self.dispatch(current);
        } else if !self.to_dispatch.is_empty() {
            self.poke();
        }
        if acted {
            host::act_on(current);
        }
        self.coalesced.retain(|(_, weak)| {
            weak.upgrade()
                .is_some_and(|s| s.try_borrow().map_or(true, |s| s.held_for().is_some()))
        });
    }

    /// Sends the leaders' callouts; called in a root-context callback, so
    /// the callouts are the root's: a stream's end cannot cancel them.
    fn dispatch(&mut self, current: u32) {
        while !self.to_dispatch.is_empty() {
            let (id, callout) = self.to_dispatch.remove(0);
            let stream = self
                .coalesced
                .iter()
                .find(|(i, _)| *i == id)
                .and_then(|(_, weak)| weak.upgrade());
            // A stream that ended first has left its key to its waiters.
            let Some(stream) = stream.filter(|s| s.try_borrow().is_ok_and(|s| s.awaits_callout()))
            else {
                continue;
            };
            host::act_on(self.root);
            match send(&callout) {
                Ok(token) => {
                    if let Ok(mut stream) = stream.try_borrow_mut() {
                        stream.led(&mut self.core, token, now_ms());
                    }
                }
                Err(status) => {
                    self.note_once(&format!(
                        "a dedup leader's callout to cluster {:?} was refused ({status:?}): its request goes through the route uncoalesced; check dedup.upstream.cluster",
                        callout.cluster
                    ));
                    self.coalesce(current, true, |core, held| {
                        core.lead_refused(&EnvoyStore, &mut Now::lazy(now_ms), id, held)
                    });
                }
            }
        }
        host::act_on(current);
    }

    /// Puts a wake-up on this VM's own queue, so the root context sends
    /// the callouts waiting (the heartbeat does, if there is no queue).
    fn poke(&mut self) {
        if let (Some(queue), false) = (self.wake, self.poked) {
            self.poked = host::enqueue(queue, &[]);
        }
    }

    /// Registers this VM's wake queue once its shard (VM number) is known.
    fn register_wake(&mut self) {
        if self.wake.is_some() || self.core.dedup.is_none() {
            return;
        }
        if let Some(vm) = self.core.gate.vm() {
            self.wake = host::register_queue(&wake_queue(vm));
        }
    }

    /// Puts `message` on every other live gate VM's wake queue.
    fn broadcast(&mut self, message: &[u8]) {
        let (Some(dedup), Some(me)) = (self.core.dedup.as_ref(), self.core.gate.vm()) else {
            return;
        };
        for vm in dedup.peers(&EnvoyStore, me, now_ms()) {
            let queue = match self.peers.get(&vm) {
                Some(queue) => Some(*queue),
                None => host::resolve_queue(&self.vm_id, &wake_queue(vm)),
            };
            match queue {
                Some(queue) if host::enqueue(queue, message) => {
                    self.peers.insert(vm, queue);
                }
                _ => {
                    self.peers.remove(&vm);
                }
            }
        }
    }

    fn note_once(&mut self, line: &str) {
        if !self.told.iter().any(|t| t == line) {
            log(LogLevel::Warn, line);
            self.told.push(line.to_string());
        }
    }

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
                Settled::Through(bytes) => {
                    acted = true;
                    if host::act_on(id) {
                        if let Some(bytes) = bytes {
                            host::replace_body(BodyOf::Request, &bytes);
                        }
                        host::resume_request();
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

/// Sends `callout` (from a root-context callback, so that it is the
/// root's).
fn send(callout: &Callout) -> Result<u32, proxy_wasm::types::Status> {
    let headers: Vec<(&str, &str)> = callout
        .headers
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .collect();
    proxy_wasm::hostcalls::dispatch_http_call(
        &callout.cluster,
        headers,
        Some(&callout.body),
        vec![],
        Duration::from_millis(callout.timeout_ms),
    )
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
        // With dedup, a tick every engage::TICK_MS says whether it engages;
        // the heartbeat's work runs on every heartbeatMs of them.
        let tick_ms = match policy.dedup {
            Some(_) => policy.heartbeat_ms.min(engage::TICK_MS),
            None => policy.heartbeat_ms,
        };
        let now_ms = now_ms();
        let gate = InflightGate::new(policy, now_ms ^ (u64::from(self.context_id) << 32));
        let mut core = GateWorker::new(gate);
        core.join(&EnvoyStore, now_ms);
        self.set_tick_period(Duration::from_millis(tick_ms));
        let vm_id = stakegate_glue::property_string(&["plugin_vm_id"]).unwrap_or_default();
        let mut worker = Worker {
            core,
            metrics,
            held: Vec::new(),
            coalesced: Vec::new(),
            to_dispatch: Vec::new(),
            root: self.context_id,
            wake: None,
            poked: false,
            vm_id,
            peers: HashMap::new(),
            told: Vec::new(),
            last_heartbeat_ms: now_ms,
        };
        worker.register_wake();
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
            let waiting = worker.coalesced.len();
            let Worker { core, metrics, .. } = &mut *worker;
            metrics.flush(&mut core.counts, &Ticked::default(), waiting);
        }
        true
    }

    /// A leader's callout ended: its answer goes to every request waiting
    /// for it.
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(worker) = &self.worker else { return };
        let mut worker = worker.borrow_mut();
        let answer = (num_headers > 0).then(|| host::body(BodyOf::CallResponse, 0, body_size));
        if worker
            .core
            .finality_answered(&EnvoyStore, now_ms(), token, answer.as_deref())
        {
            worker.log();
            return;
        }
        // No headers: the callout failed (reset, timeout, no upstream).
        let response = answer.map(|body| Response {
            status: host::call_response_header(":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(502),
            content_type: host::call_response_header("content-type")
                .unwrap_or_else(|| "application/json".into()),
            content_encoding: host::call_response_header("content-encoding")
                .filter(|e| !e.eq_ignore_ascii_case("identity")),
            body,
        });
        worker.coalesce(self.context_id, true, |core, held| {
            core.callout_ended(&EnvoyStore, &mut Now::lazy(now_ms), token, response, held)
        });
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
        let now = now_ms();
        if worker.core.dedup.is_some() {
            worker.core.engage(&EnvoyStore, now);
            worker.metrics.engaged(worker.core.dedup_engaged());
            if let Some(poll) = worker.core.finality_poll(&EnvoyStore, now) {
                worker.core.finality_sent(send(&poll).ok());
            }
        }
        let heartbeat_ms = worker.core.gate.policy().heartbeat_ms;
        if now.saturating_sub(worker.last_heartbeat_ms) + engage::TICK_MS / 2 < heartbeat_ms {
            worker.log();
            return;
        }
        worker.last_heartbeat_ms = now;
        let ticked = worker.core.tick(&EnvoyStore, now);
        worker.register_wake();
        worker.coalesce(self.context_id, true, |core, held| {
            core.heartbeat(&EnvoyStore, &mut Now::lazy(now_ms), held)
        });
        worker.log();
        let waiting = worker.coalesced.len();
        let Worker { core, metrics, .. } = &mut *worker;
        metrics.flush(&mut core.counts, &ticked, waiting);
        worker.wake(self.context_id);
    }

    /// Wake messages: callouts to send, answers, failed leaders.
    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(worker) = &self.worker else { return };
        let mut worker = worker.borrow_mut();
        worker.poked = false;
        worker.dispatch(self.context_id);
        while let Ok(Some(message)) = host::dequeue(queue_id) {
            if message.is_empty() {
                continue;
            }
            worker.coalesce(self.context_id, true, |core, held| {
                core.woken(&EnvoyStore, &mut Now::lazy(now_ms), &message, held)
            });
        }
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

/// Answers the current request with another request's answer (or a
/// refusal made for it while it was held).
fn answer(reply: &Reply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .collect();
    host::send_response(reply.status, &headers, &reply.body);
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
        self.with(|stream, w, _| {
            stream.done(w, &EnvoyStore);
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
            worker.core.dedup_engaged(),
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
        let coalesced = stream.held_for().is_some();
        drop(stream);
        worker.log();
        let me = (self.context_id, Rc::downgrade(&self.stream));
        match action {
            OnBody::Continue => Action::Continue,
            OnBody::Hold if coalesced => {
                worker.coalesced.push(me);
                Action::Pause
            }
            OnBody::Hold => {
                let waits = self.stream.try_borrow().is_ok_and(|s| s.waiting());
                if waits && !worker.held.iter().any(|(id, _)| *id == self.context_id) {
                    worker.held.push(me);
                }
                Action::Pause
            }
            OnBody::Lead(callout) => {
                worker.coalesced.push(me);
                worker.to_dispatch.push((self.context_id, callout));
                worker.poke();
                Action::Pause
            }
            OnBody::Answer(reply) => {
                answer(&reply);
                Action::Pause
            }
            OnBody::ContinueWith(bytes) => {
                host::replace_body(BodyOf::Request, &bytes);
                Action::Continue
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
        self.with(|stream, w, _| stream.response_headers(w, &EnvoyStore, end_of_stream));
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Answers give slots back; held streams (this one too) retry.
        self.with(|stream, w, _| {
            let answered = stream.response_body(
                w,
                &EnvoyStore,
                body_size,
                end_of_stream,
                &mut HostBody(BodyOf::Response),
            );
            if let Some(bytes) = answered.replace {
                host::replace_body(BodyOf::Response, &bytes);
            }
            answered.released
        });
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with(|stream, w, _| stream.response_trailers(w, &EnvoyStore));
        Action::Continue
    }
}

impl Drop for GateHttp {
    /// A stream deleted without `on_done` still gives back what it holds.
    fn drop(&mut self) {
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            if let Ok(mut stream) = self.stream.try_borrow_mut() {
                stream.done(&mut worker.core, &EnvoyStore);
            }
        }
    }
}
