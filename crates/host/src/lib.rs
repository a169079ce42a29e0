//! stakegate-host: an offline proxy-wasm host on wasmtime.
//!
//! It runs a *compiled* filter module the way Envoy does, quickly and
//! deterministically: `W` worker VMs and a main-thread VM over one
//! shared-data store, on a virtual clock the caller advances. Ticks reach
//! every VM (main and workers) at their own period, as in Envoy.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use stakegate_host::{Host, Reply, Request};
//! use std::time::Duration;
//! let module = std::fs::read("target/wasm32-wasip1/release/admission_gate.wasm")?;
//! let mut host = Host::new(&module, br#"{"maxInflight": 8}"#, 2)?;
//! match host.request(0, &Request::json_rpc(r#"{"jsonrpc":"2.0","id":1,"method":"eth_call"}"#))? {
//!     Reply::Continue(id) => host.finish(id, 200, Duration::from_millis(5))?,
//!     Reply::LocalReply(reply) => println!("rejected with {}", reply.status),
//!     // Held for another request's answer (dedup): see `take_settled`.
//!     Reply::Held(id) => host.abort(id)?,
//! }
//! host.advance(Duration::from_secs(1))?;
//! println!("{:?}", host.metrics());
//! # Ok(()) }
//! ```
//!
//! Hostcalls are in `hostcalls`. HTTP callouts are the caller's to answer
//! (`take_callouts`, `answer_callout`); a request the module pauses comes
//! back as `Reply::Held`, and `take_settled` says what became of it once
//! the module answered or resumed it. Queued items reach their VM's root
//! context at once (`proxy_on_queue_ready`). gRPC calls answer
//! "unsupported", and an import the host does not define traps with its
//! name. A trap surfaces as an error carrying the module's last error log
//! (a Rust module's panic message).

mod abi;
mod hostcalls;
mod shared;
mod vm;

pub use shared::Callout;
pub use vm::{FilterState, LogLine};

use anyhow::{anyhow, bail, Context};
use shared::Shared;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::time::Duration;
use vm::{Settled, Stream, Vm, VmState};
use wasmtime::{Engine, Linker, Module};

/// What the module reported as the wall clock at virtual time zero
/// (2025-01-01T00:00:00Z), so runs are reproducible.
const EPOCH_NS: u64 = 1_735_689_600_000_000_000;
const ROOT_CONTEXT: u32 = 1;
/// The node id the host gives the modules.
pub const NODE_ID: &[u8] = b"stakegate-offline-host";

/// Header names and values, in order.
pub type Headers = Vec<(String, String)>;

/// A reply the module sent instead of letting the request through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Headers,
    pub body: Vec<u8>,
    /// The stream's filter state when the module sent it.
    pub filter_state: vm::FilterState,
}

/// What a filter's response path hands the filters before it, as Envoy
/// does: the response headers as it left them, and the stream's filter
/// state (the properties the filters after it set).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Passed {
    pub headers: Vec<(String, String)>,
    pub filter_state: vm::FilterState,
}

impl LocalReply {
    /// What it passes to the filters before the one that sent it.
    pub fn passed(&self) -> Passed {
        Passed {
            headers: self.headers.clone(),
            filter_state: self.filter_state.clone(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A request in flight: which worker has it, and its stream context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId {
    worker: usize,
    context: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The module let the request through; `finish` or `abort` it later.
    Continue(RequestId),
    LocalReply(LocalReply),
    /// The module paused it: it is answered or let through later, and
    /// `Host::take_settled` says which (or `abort` it).
    Held(RequestId),
}

/// A request as the filter sees it.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Properties by path, e.g. `(["source", "address"], b"10.1.2.3:4000")`.
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
}

impl Request {
    /// A JSON-RPC POST from 127.0.0.1.
    pub fn json_rpc(body: &str) -> Self {
        Self {
            headers: vec![
                (":method".into(), "POST".into()),
                (":path".into(), "/".into()),
                (":authority".into(), "rpc".into()),
                ("content-type".into(), "application/json".into()),
                ("content-length".into(), body.len().to_string()),
            ],
            body: body.as_bytes().to_vec(),
            properties: Vec::new(),
        }
        .property(&["source", "address"], b"127.0.0.1:40000")
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), value.to_string()));
        self
    }

    /// Arrives on a listener whose metadata says
    /// `filter_metadata.stakegate.class: CLASS`, as Envoy reports it.
    pub fn listener_class(self, class: &str) -> Self {
        self.property(
            &[
                "xds",
                "listener_metadata",
                "filter_metadata",
                "stakegate",
                "class",
            ],
            class.as_bytes(),
        )
    }

    /// Sets a property (replacing one at the same path).
    pub fn property(mut self, path: &[&str], value: &[u8]) -> Self {
        let path: Vec<String> = path.iter().map(|p| p.to_string()).collect();
        self.properties.retain(|(p, _)| *p != path);
        self.properties.push((path, value.to_vec()));
        self
    }
}

fn property_key(path: &[String]) -> Vec<u8> {
    path.join("\0").into_bytes()
}

pub struct Host {
    shared: Rc<RefCell<Shared>>,
    logs: Rc<RefCell<Vec<LogLine>>>,
    main: Vm,
    /// `None` once removed (a vanished VM).
    workers: Vec<Option<Vm>>,
    /// When each VM's next tick is due (main first), in virtual ns.
    next_tick: Vec<Option<u64>>,
    next_context: u32,
    /// Held requests answered or let through since the last `take_settled`.
    settled: Vec<(RequestId, Reply)>,
}

impl Host {
    /// Loads `module` into a main-thread VM and `workers` worker VMs, and
    /// runs vm_start and configure with `plugin_config` on each. Fails with
    /// the module's own error if it refuses the configuration.
    pub fn new(module: &[u8], plugin_config: &[u8], workers: usize) -> anyhow::Result<Self> {
        if !module.starts_with(b"\0asm") {
            let start = String::from_utf8_lossy(&module[..module.len().min(8)]).into_owned();
            bail!("not a WebAssembly module: it does not start with the \\0asm magic (it starts with {start:?})");
        }
        let engine = Engine::default();
        let module =
            Module::new(&engine, module).map_err(|e| anyhow!("not a WebAssembly module: {e:#}"))?;
        vm::check_proxy_wasm(&module)?;
        let mut linker = Linker::new(&engine);
        hostcalls::define(&mut linker).map_err(|e| anyhow!("defining hostcalls: {e:?}"))?;
        linker
            .define_unknown_imports_as_traps(&module)
            .map_err(|e| anyhow!("{e:?}"))?;

        let shared = Rc::new(RefCell::new(Shared::new(EPOCH_NS)));
        let logs = Rc::new(RefCell::new(Vec::new()));
        let mut vms = Vec::with_capacity(workers + 1);
        for index in 0..=workers {
            let name = if index == 0 {
                "main".to_string()
            } else {
                format!("worker-{}", index - 1)
            };
            // Envoy's node id is what `--service-node` says at start; the
            // host stands in with a name of its own (fleet mode names a
            // replica by it when its policy does not).
            let plugin_properties = [
                (vec!["plugin_root_id".to_string()], b"stakegate".to_vec()),
                (vec!["node".to_string(), "id".to_string()], NODE_ID.to_vec()),
            ]
            .into_iter()
            .map(|(path, value)| (property_key(&path), value))
            .collect();
            let state = VmState {
                name: name.clone(),
                index,
                call_response: None,
                shared: shared.clone(),
                logs: logs.clone(),
                plugin_config: plugin_config.to_vec(),
                vm_config: Vec::new(),
                root_id: ROOT_CONTEXT,
                current: ROOT_CONTEXT,
                tick_period_ms: 0,
                streams: HashMap::new(),
                retired_roots: Vec::new(),
                plugin_properties,
                random_state: 0x9e37_79b9_7f4a_7c15 ^ index as u64,
            };
            let mut vm = Vm::new(&engine, &module, &linker, state)?;
            if !vm.start()? {
                bail!(
                    "the module refused its configuration{}",
                    said(&logs.borrow(), &name, 0)
                );
            }
            vms.push(vm);
        }
        let main = vms.remove(0);
        let mut host = Self {
            shared,
            logs,
            main,
            workers: vms.into_iter().map(Some).collect(),
            next_tick: vec![None; workers + 1],
            next_context: ROOT_CONTEXT + 1,
            settled: Vec::new(),
        };
        host.schedule_ticks(0);
        Ok(host)
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Virtual time since the host started.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.shared.borrow().now_ns)
    }

    fn worker(&mut self, worker: usize) -> anyhow::Result<&mut Vm> {
        let count = self.workers.len();
        match self.workers.get_mut(worker) {
            Some(Some(vm)) => Ok(vm),
            Some(None) => bail!("worker {worker} was removed"),
            None => bail!("there is no worker {worker} (the host has {count})"),
        }
    }

    /// Swaps in a new policy for the same module, on every VM (main first),
    /// as Envoy does with an ECDS update: new streams use it, streams in
    /// flight finish under the old one. Fails with the module's reason if
    /// the main VM refuses it, and then nothing changes.
    pub fn reconfigure(&mut self, plugin_config: &[u8]) -> anyhow::Result<()> {
        let root = self.next_context;
        self.next_context += 1;
        let from = self.logs.borrow().len();
        if !self.main.configure_new_root(root, plugin_config)? {
            bail!(
                "the module refused the new configuration{}",
                said(&self.logs.borrow(), "main", from)
            );
        }
        for vm in self.workers.iter_mut().flatten() {
            if !vm.configure_new_root(root, plugin_config)? {
                bail!(
                    "worker {} refused a configuration the main VM took",
                    vm.state().name
                );
            }
        }
        Ok(())
    }

    /// Runs a request through `worker`'s VM.
    pub fn request(&mut self, worker: usize, request: &Request) -> anyhow::Result<Reply> {
        let context = self.next_context;
        self.next_context += 1;
        let stream = Stream {
            request_headers: request.headers.clone(),
            request_body: request.body.clone(),
            properties: request
                .properties
                .iter()
                .map(|(path, value)| (property_key(path), value.clone()))
                .collect(),
            ..Stream::default()
        };
        let vm = self.worker(worker)?;
        let id = RequestId { worker, context };
        let reply = match vm.request(context, stream)? {
            vm::Request::Continue => Reply::Continue(id),
            vm::Request::Held => Reply::Held(id),
            vm::Request::Replied(reply) => {
                // A local reply ends the stream there, as in Envoy.
                vm.finish(context, Some(reply.headers.clone()))?;
                Reply::LocalReply(reply)
            }
        };
        self.deliver()?;
        Ok(reply)
    }

    /// Held requests answered or let through since the last call: each
    /// as `LocalReply` (its stream has ended) or `Continue` (now in flight
    /// upstream; `finish` or `abort` it).
    pub fn take_settled(&mut self) -> Vec<(RequestId, Reply)> {
        std::mem::take(&mut self.settled)
    }

    /// HTTP callouts the VMs made since the last call; answer each with
    /// `answer_callout`.
    pub fn take_callouts(&mut self) -> Vec<Callout> {
        std::mem::take(&mut self.shared.borrow_mut().callouts)
    }

    /// Answers `callout` with `status` and a JSON `body`, or, with `None`,
    /// fails it (a reset or timeout: no headers).
    pub fn answer_callout(
        &mut self,
        callout: &Callout,
        response: Option<(u32, Vec<u8>)>,
    ) -> anyhow::Result<()> {
        let response = response.map(|(status, body)| (status, Vec::new(), body));
        self.answer_callout_with(callout, response)
    }

    /// `answer_callout`, the answer with headers of its own beside
    /// `:status` and `content-type`.
    pub fn answer_callout_with(
        &mut self,
        callout: &Callout,
        response: Option<(u32, Headers, Vec<u8>)>,
    ) -> anyhow::Result<()> {
        let response = response.map(|(status, more, body)| {
            let mut headers = vec![
                (":status".to_string(), status.to_string()),
                ("content-type".to_string(), "application/json".to_string()),
            ];
            headers.extend(more);
            (headers, body)
        });
        if let Some(vm) = self.vm(callout.vm) {
            vm.call_response(callout.token, response)?;
        }
        self.deliver()
    }

    /// The VM at `index` (0 main, then the workers), if it is there.
    fn vm(&mut self, index: usize) -> Option<&mut Vm> {
        match index {
            0 => Some(&mut self.main),
            i => self.workers.get_mut(i - 1).and_then(Option::as_mut),
        }
    }

    /// Tells VMs of their queues' new items, and collects the held
    /// requests that got settled on the way, until nothing moves.
    fn deliver(&mut self) -> anyhow::Result<()> {
        loop {
            let ready = self.shared.borrow_mut().take_ready();
            for ((index, root), queue) in &ready {
                if let Some(vm) = self.vm(*index) {
                    vm.queue_ready(*root, *queue)?;
                }
            }
            let mut moved = !ready.is_empty();
            for worker in 0..self.workers.len() {
                let Some(vm) = self.workers[worker].as_mut() else {
                    continue;
                };
                for (context, settled) in vm.settled() {
                    moved = true;
                    let id = RequestId { worker, context };
                    let reply = match settled {
                        Settled::Resumed => Reply::Continue(id),
                        Settled::Replied(reply) => {
                            vm.finish(context, Some(reply.headers.clone()))?;
                            Reply::LocalReply(reply)
                        }
                    };
                    self.settled.push((id, reply));
                }
            }
            if !moved {
                return Ok(());
            }
        }
    }

    /// The upstream answered `status` after `latency`: response headers,
    /// then the end of the stream. (The clock is the caller's to advance.)
    pub fn finish(&mut self, id: RequestId, status: u16, latency: Duration) -> anyhow::Result<()> {
        self.finish_with(id, status, latency, Passed::default())
            .map(drop)
    }

    /// `finish`, the response carrying what the filters after this one
    /// passed (headers besides `:status`, and the stream's filter state):
    /// returns what this filter passes on to the filters before it.
    pub fn finish_with(
        &mut self,
        id: RequestId,
        status: u16,
        latency: Duration,
        passed: Passed,
    ) -> anyhow::Result<Passed> {
        let vm = self.worker(id.worker)?;
        let stream = vm
            .state_mut()
            .streams
            .get_mut(&id.context)
            .with_context(|| format!("request {id:?} is not in flight"))?;
        stream.properties.insert(
            property_key(&["request".into(), "duration".into()]),
            (latency.as_nanos() as i64).to_le_bytes().to_vec(),
        );
        stream.properties.insert(
            property_key(&["response".into(), "code".into()]),
            i64::from(status).to_le_bytes().to_vec(),
        );
        for (path, value) in passed.filter_state {
            stream.set_state(path, value);
        }
        let mut response = vec![(":status".to_string(), status.to_string())];
        response.extend(passed.headers);
        let passed = vm.finish(id.context, Some(response))?;
        self.deliver()?;
        Ok(passed)
    }

    /// The stream ended without a response (client or upstream reset).
    pub fn abort(&mut self, id: RequestId) -> anyhow::Result<()> {
        self.worker(id.worker)?.finish(id.context, None)?;
        self.deliver()
    }

    /// Drops a worker's VM with no callback at all, as when a VM vanishes
    /// (crash, reload): its streams never end and it never ticks again.
    pub fn remove_worker(&mut self, worker: usize) -> anyhow::Result<()> {
        self.worker(worker)?;
        self.workers[worker] = None;
        self.next_tick[worker + 1] = None;
        Ok(())
    }

    /// Moves the virtual clock forward, delivering every tick that falls
    /// due on the way, in time order, to each VM at its own period.
    pub fn advance(&mut self, dt: Duration) -> anyhow::Result<()> {
        let target = self.shared.borrow().now_ns + dt.as_nanos() as u64;
        loop {
            let due = self
                .next_tick
                .iter()
                .enumerate()
                .filter_map(|(i, t)| t.map(|t| (t, i)))
                .filter(|(t, _)| *t <= target)
                .min();
            let Some((at, index)) = due else { break };
            self.shared.borrow_mut().now_ns = at;
            let vm = if index == 0 {
                Some(&mut self.main)
            } else {
                self.workers[index - 1].as_mut()
            };
            if let Some(vm) = vm {
                vm.tick()?;
            }
            self.deliver()?;
            self.schedule_tick(index, at);
        }
        self.shared.borrow_mut().now_ns = target;
        Ok(())
    }

    fn schedule_ticks(&mut self, now: u64) {
        for index in 0..self.next_tick.len() {
            self.schedule_tick(index, now);
        }
    }

    fn schedule_tick(&mut self, index: usize, from: u64) {
        let period = match index {
            0 => Some(self.main.state().tick_period_ms),
            i => self.workers[i - 1]
                .as_ref()
                .map(|vm| vm.state().tick_period_ms),
        };
        self.next_tick[index] = period
            .filter(|p| *p > 0)
            .map(|p| from + u64::from(p) * 1_000_000);
    }

    /// Shared data as Envoy would hold it: (keys, bytes of values).
    pub fn shared_data_size(&self) -> (usize, usize) {
        self.shared.borrow().data_size()
    }

    /// Every metric the module defined, by name.
    pub fn metrics(&self) -> BTreeMap<String, i64> {
        self.shared.borrow().metrics()
    }

    pub fn metric(&self, name: &str) -> i64 {
        self.metrics().get(name).copied().unwrap_or(0)
    }

    pub fn logs(&self) -> Vec<LogLine> {
        self.logs.borrow().clone()
    }
}

/// What VM `vm` logged at error level or above from `logs[from..]`, as
/// ": a; b" (empty when it said nothing).
fn said(logs: &[LogLine], vm: &str, from: usize) -> String {
    let said: Vec<&str> = logs[from..]
        .iter()
        .filter(|l| l.vm == vm && matches!(l.level, "error" | "critical"))
        .map(|l| l.message.as_str())
        .collect();
    if said.is_empty() {
        String::new()
    } else {
        format!(": {}", said.join("; "))
    }
}

/// The filter a module declares itself to be (its `stakegate.filter`
/// custom section, see `stakegate_glue::declare_filter`), if any.
pub fn declared_filter(module: &[u8]) -> Option<String> {
    custom_sections(module)
        .find(|(name, _)| *name == b"stakegate.filter")
        .and_then(|(_, contents)| String::from_utf8(contents.to_vec()).ok())
}

/// A module's custom sections, `(name, contents)`; stops at anything
/// malformed.
fn custom_sections(module: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut at = if module.starts_with(b"\0asm") {
        8
    } else {
        module.len()
    };
    std::iter::from_fn(move || loop {
        let id = *module.get(at)?;
        let (size, len) = leb128(module.get(at + 1..)?)?;
        let start = at + 1 + len;
        let payload = module.get(start..start.checked_add(size)?)?;
        at = start + size;
        if id == 0 {
            let (name_len, len) = leb128(payload)?;
            let name = payload.get(len..len.checked_add(name_len)?)?;
            return Some((name, &payload[len + name_len..]));
        }
    })
}

/// An unsigned LEB128 number and how many bytes it took.
fn leb128(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut value: usize = 0;
    for (i, &b) in bytes.iter().enumerate().take(5) {
        value |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}
