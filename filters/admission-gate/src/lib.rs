//! admission-gate: the proxy-wasm glue for the RPC admission gate.
//!
//! Every decision is in `stakegate_core::gate` (its `registry` keeps this
//! VM's streams and says what to do); this crate reads what Envoy gives it,
//! reports it there, and makes the host calls it is told to:
//!
//! - `on_configure` parses the policy (plugin configuration). A bad policy
//!   is logged with the field and the reason, and `false` makes Envoy refuse
//!   the config, so the previous one keeps serving.
//! - each stream callback goes to the registry by context id; what it
//!   returns is done for this stream, and what it queued (`Do`) for others:
//!   answer a held request, resume one, wake the other gate VMs.
//! - the root context sends the leaders' callouts (so a client's going
//!   cannot cancel one), hands their answers back (`on_http_call_response`),
//!   reads the wake queue (`on_queue_ready`), and ticks: engagement, the
//!   finality poll, and every `heartbeatMs` the heartbeat and the metrics.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use stakegate_core::dedup::wake_queue;
use stakegate_core::gate::coalesce::Response;
use stakegate_core::gate::counts::{Snapshot, Ticked, METRICS};
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::gate::registry::{Do, Registry, Then};
use stakegate_core::gate::stream::{Head, OnHeaders};
use stakegate_glue::facts::StreamFacts;
use stakegate_glue::host::{self, BodyOf, HostBody};
use stakegate_glue::metrics::Stats;
use stakegate_glue::queues::WakeQueues;
use stakegate_glue::{now_ms, now_us, EnvoyStore};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

stakegate_glue::declare_filter!("admission-gate");

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(GateRoot { context_id, vm: None })
    });
}}

/// This VM's registry, metrics and wake queues, shared by its root and
/// stream contexts (a VM is single-threaded).
struct Vm {
    registry: Registry<EnvoyStore>,
    stats: Stats<Snapshot>,
    root: u32,
    queues: WakeQueues,
}

type Shared = Rc<RefCell<Vm>>;

/// Runs `call` on the registry, then logs and does what it queued, in
/// `current`'s context at the end; in a root context (`root`), it also
/// sends the callouts waiting.
fn with<T>(
    vm: &Shared,
    current: u32,
    root: bool,
    call: impl FnOnce(&mut Registry<EnvoyStore>) -> T,
) -> T {
    let (out, dos) = {
        let mut vm = vm.borrow_mut();
        let out = call(&mut vm.registry);
        let (dos, log) = vm.registry.take(current);
        log_all(&log);
        (out, dos)
    };
    carry_out(vm, current, dos);
    if root {
        dispatch(vm, current);
    }
    out
}

/// Does each `Do`, in the context of the stream it names, then returns to
/// `current`'s.
fn carry_out(vm: &Shared, current: u32, dos: Vec<Do>) {
    let mut moved = false;
    for todo in dos {
        match todo {
            Do::Answer(id, reply) => {
                moved = true;
                if host::act_on(id) {
                    let vm = vm.borrow();
                    host::send_reply(&reply, vm.registry.service_time_header());
                }
            }
            Do::Resume(id, bytes) => {
                moved = true;
                if host::act_on(id) {
                    if let Some(bytes) = bytes {
                        host::replace_body(BodyOf::Request, &bytes);
                    }
                    // A socket's calls sent: stake QoS counts them at the node.
                    if let Some(answered) = vm.borrow().registry.socket_answered(id) {
                        host::set_socket_answered(&answered);
                    }
                    host::resume_request();
                }
            }
            Do::Wake(vms, message) => vm.borrow_mut().queues.send(&vms, wake_queue, &message),
            Do::Poke => vm.borrow_mut().queues.poke(),
        }
    }
    if moved {
        host::act_on(current);
    }
}

/// Sends the leaders' callouts; called in a root-context callback, so the
/// callouts are the root's: a stream's end cannot cancel them.
fn dispatch(vm: &Shared, current: u32) {
    loop {
        let root = vm.borrow().root;
        let Some((id, callout)) = vm.borrow_mut().registry.next_callout() else {
            break;
        };
        host::act_on(root);
        let sent = host::send_callout(&callout);
        with(vm, current, false, |r| r.sent(id, sent));
    }
    host::act_on(current);
}

/// Reads stake QoS's word again for each waiting WebSocket (whether its
/// data waits for its identity's share), before a tick's retry; then back
/// to the root context `root`.
fn read_socket_holds(vm: &Shared, root: u32) {
    let waiting = vm.borrow().registry.waiting_sockets();
    for id in waiting {
        if let Some(hold) = host::act_on(id).then(host::socket_hold).flatten() {
            vm.borrow_mut().registry.hold_socket(id, hold);
        }
    }
    host::act_on(root);
}

fn log_all(lines: &[String]) {
    for line in lines {
        stakegate_glue::log("admission-gate", LogLevel::Warn, line);
    }
}

struct GateRoot {
    context_id: u32,
    vm: Option<Shared>,
}

impl GateRoot {
    fn configure(&mut self, config: &[u8]) -> Result<(), String> {
        let policy = GatePolicy::parse(config).map_err(|e| format!("policy rejected: {e}"))?;
        let stats = Stats::define("stakegate.gate", METRICS, &Snapshot::classes())?;
        let registry = Registry::new(policy, self.context_id, EnvoyStore, now_us);
        self.set_tick_period(Duration::from_millis(registry.tick_ms()));
        let mut vm = Vm {
            registry,
            stats,
            root: self.context_id,
            queues: WakeQueues::new(),
        };
        vm.queues.register(vm.registry.wake_queue());
        log_all(&vm.registry.take(self.context_id).1);
        self.vm = Some(Rc::new(RefCell::new(vm)));
        Ok(())
    }
}

impl Context for GateRoot {
    /// The plugin is being deleted (a swap or reload; Envoy does it once its
    /// last stream has ended): spare slots go back now rather than after
    /// the stale-slot TTL, and the last counts reach Envoy.
    fn on_done(&mut self) -> bool {
        if let Some(vm) = &self.vm {
            let mut vm = vm.borrow_mut();
            vm.registry.leave();
            log_all(&vm.registry.take(self.context_id).1);
            let snapshot = vm.registry.snapshot(Some(Ticked::default()));
            vm.stats.flush(&snapshot);
        }
        true
    }

    /// A callout ended: the finality poll's, or a leader's, whose answer
    /// goes to every request waiting for it.
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(vm) = &self.vm else { return };
        vm.borrow_mut().registry.new_turn();
        // No headers: the callout failed (reset, timeout, no upstream).
        with(vm, self.context_id, true, |r| {
            let response = (num_headers > 0).then(|| {
                let body = host::body(BodyOf::CallResponse, 0, body_size);
                Response::read(host::call_response_header, body, r.service_time_header())
            });
            r.callout_ended(token, response)
        });
    }
}

impl RootContext for GateRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        stakegate_glue::accept("admission-gate", self.configure(&config))
    }

    fn on_tick(&mut self) {
        let Some(vm) = &self.vm else { return };
        let now = now_ms();
        vm.borrow_mut().registry.new_turn();
        let engaged = vm.borrow_mut().registry.engage(now);
        if let Some((engaged, poll)) = engaged {
            let snapshot = Snapshot {
                engaged: Some(engaged),
                ..Snapshot::default()
            };
            vm.borrow().stats.flush(&snapshot);
            if let Some(poll) = poll {
                let token = host::send_callout(&poll).ok();
                vm.borrow_mut().registry.worker.finality_sent(token);
            }
        }
        read_socket_holds(vm, self.context_id);
        if !vm.borrow_mut().registry.heartbeat_due(now) {
            // Requests waiting for a slot look for one freed elsewhere, and
            // an idle VM hands its spare slots to other VMs' waiters.
            with(vm, self.context_id, false, |r| {
                if r.retries_on_tick() {
                    r.retry_waiting();
                }
            });
            return;
        }
        let ticked = with(vm, self.context_id, true, Registry::heartbeat);
        {
            let mut vm = vm.borrow_mut();
            let name = vm.registry.wake_queue();
            vm.queues.register(name);
            let snapshot = vm.registry.snapshot(Some(ticked));
            vm.stats.flush(&snapshot);
        }
        with(vm, self.context_id, false, Registry::retry_waiting);
    }

    /// Wake messages: callouts to send, answers, failed leaders; and the
    /// answers and resumes a past turn left (`registry::TURN_ACTIONS`).
    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(vm) = &self.vm else { return };
        {
            let mut vm = vm.borrow_mut();
            vm.queues.read();
            vm.registry.new_turn();
        }
        with(vm, self.context_id, true, |_| ());
        while let Ok(Some(message)) = host::dequeue(queue_id) {
            with(vm, self.context_id, true, |r| r.woken(&message));
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(GateHttp {
            id: context_id,
            vm: self.vm.clone()?,
        }))
    }
}

struct GateHttp {
    id: u32,
    vm: Shared,
}

impl GateHttp {
    fn with<T>(&self, call: impl FnOnce(&mut Registry<EnvoyStore>) -> T) -> T {
        with(&self.vm, self.id, false, call)
    }
}

/// Refuses the current request: the node did no work for it, so stake
/// QoS charges it no node time.
fn refuse(rejection: &stakegate_core::rejection::Rejection) -> Action {
    host::set_node_us(0);
    stakegate_glue::reject(rejection);
    Action::Pause
}

impl Context for GateHttp {
    fn on_done(&mut self) -> bool {
        self.with(|r| r.done(self.id));
        true
    }
}

impl HttpContext for GateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let on = self.with(|r| {
            let head = Head::read(
                end_of_stream,
                r.worker.dedup_engaged(),
                host::request_header,
            );
            r.headers(self.id, &mut StreamFacts, head)
        });
        match on {
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
        let mut body = HostBody(BodyOf::Request);
        let (then, said_in) = self.with(|r| {
            // On a WebSocket, stake QoS's word first: hold its data or not.
            if let Some(hold) = r.is_socket(self.id).then(host::socket_hold).flatten() {
                r.hold_socket(self.id, hold);
            }
            let then = r.request_body(
                self.id,
                body_size,
                end_of_stream,
                &mut body,
                &mut StreamFacts,
            );
            if let Some(answered) = r.socket_answered(self.id) {
                host::set_socket_answered(&answered);
            }
            let said_in = match &then {
                Then::Answer(reply) if reply.said_us.is_some() => r.service_time_header(),
                _ => None,
            };
            (then, said_in.map(str::to_string))
        });
        match then {
            Then::Continue => Action::Continue,
            Then::ContinueWith(bytes) => {
                host::replace_body(BodyOf::Request, &bytes);
                Action::Continue
            }
            Then::Pause => Action::Pause,
            Then::Answer(reply) => {
                host::send_reply(&reply, said_in.as_deref());
                Action::Pause
            }
            Then::Refuse(refusal) => refuse(&refusal),
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        match self.with(|r| r.request_trailers(self.id)) {
            Err(refusal) => refuse(&refusal),
            Ok(()) => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let node_us =
            self.with(|r| r.response_headers(self.id, end_of_stream, host::response_header));
        if let Some(us) = node_us {
            host::set_node_us(us);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut body = HostBody(BodyOf::Response);
        let on = self.with(|r| r.response_body(self.id, body_size, end_of_stream, &mut body));
        if on.hold {
            return Action::Pause;
        }
        if let Some(answered) = &on.socket_answered {
            host::set_socket_answered(answered);
        }
        if let Some(bytes) = on.replace {
            host::replace_body(BodyOf::Response, &bytes);
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with(|r| r.response_trailers(self.id));
        Action::Continue
    }
}

impl Drop for GateHttp {
    /// A stream deleted without `on_done` still gives back what it holds.
    fn drop(&mut self) {
        if let Ok(mut vm) = self.vm.try_borrow_mut() {
            vm.registry.done(self.id);
        }
    }
}
