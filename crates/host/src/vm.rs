//! One VM: a wasmtime instance of the module with its own memory and
//! contexts, like one Envoy worker's (or the main thread's) VM.

use crate::abi;
use crate::shared::Shared;
use crate::LocalReply;
use anyhow::{anyhow, bail};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use wasmtime::{Engine, Instance, Linker, Module, Store, TypedFunc};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// "main" or "worker-N".
    pub vm: String,
    pub level: &'static str,
    pub message: String,
}

/// A callout's response as the module reads it: headers and body.
pub type CallResponse = (Vec<(String, String)>, Vec<u8>);

/// `proxy_on_http_call_response(context, token, headers, body, trailers)`.
type OnHttpCallResponse = TypedFunc<(i32, i32, i32, i32, i32), ()>;

/// A stream's filter state: property path (as the ABI sends it) → value.
pub type FilterState = BTreeMap<Vec<u8>, Vec<u8>>;

/// One HTTP stream's state, as the module sees it through hostcalls.
#[derive(Debug, Default)]
pub struct Stream {
    pub request_headers: Vec<(String, String)>,
    pub request_body: Vec<u8>,
    pub response_headers: Vec<(String, String)>,
    pub trailers: Vec<(String, String)>,
    /// Property path (parts joined by NUL, as the ABI sends them) → value.
    pub properties: HashMap<Vec<u8>, Vec<u8>>,
    /// The properties the filters set on the stream (`proxy_set_property`):
    /// Envoy's filter state, which every filter of the stream reads.
    pub filter_state: FilterState,
    pub local_reply: Option<LocalReply>,
    /// The root context (plugin) the stream was created under.
    pub root: u32,
    /// The module paused the request (its answer comes later).
    pub held: bool,
    /// The module resumed the paused request.
    pub resumed: bool,
}

impl Stream {
    /// A property of the stream's filter state, which its own filter reads
    /// too.
    pub fn set_state(&mut self, path: Vec<u8>, value: Vec<u8>) {
        self.properties.insert(path.clone(), value.clone());
        self.filter_state.insert(path, value);
    }
}

/// What the module did with a request's headers and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Continue,
    Replied(LocalReply),
    /// Paused: it is answered or resumed later (`Vm::settled`).
    Held,
}

/// What became of a request the module paused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    Resumed,
    Replied(LocalReply),
}

pub struct VmState {
    pub name: String,
    /// 0 for the main VM, then the workers from 1.
    pub index: usize,
    /// The callout response being handed over: headers and body.
    pub call_response: Option<CallResponse>,
    pub shared: Rc<RefCell<Shared>>,
    pub logs: Rc<RefCell<Vec<LogLine>>>,
    pub plugin_config: Vec<u8>,
    pub vm_config: Vec<u8>,
    pub root_id: u32,
    /// The context the current callback runs for.
    pub current: u32,
    pub tick_period_ms: u32,
    pub streams: HashMap<u32, Stream>,
    /// Root contexts replaced by a new configuration, deleted once their
    /// last stream ends.
    pub retired_roots: Vec<u32>,
    /// Properties set on the plugin (root context).
    pub plugin_properties: HashMap<Vec<u8>, Vec<u8>>,
    pub random_state: u64,
}

impl VmState {
    pub fn log(&self, line: LogLine) {
        self.logs.borrow_mut().push(line);
    }

    pub fn property(&self, path: &[u8]) -> Option<Vec<u8>> {
        self.streams
            .get(&self.current)
            .and_then(|s| s.properties.get(path))
            .or_else(|| self.plugin_properties.get(path))
            .cloned()
    }

    pub fn set_property(&mut self, path: Vec<u8>, value: Vec<u8>) {
        let current = self.current;
        match self.streams.get_mut(&current) {
            Some(stream) => stream.set_state(path, value),
            None => {
                self.plugin_properties.insert(path, value);
            }
        }
    }
}

/// The exports the host calls, typed once.
struct Exports {
    context_create: TypedFunc<(i32, i32), ()>,
    vm_start: TypedFunc<(i32, i32), i32>,
    configure: TypedFunc<(i32, i32), i32>,
    tick: TypedFunc<i32, ()>,
    request_headers: TypedFunc<(i32, i32, i32), i32>,
    request_body: TypedFunc<(i32, i32, i32), i32>,
    response_headers: TypedFunc<(i32, i32, i32), i32>,
    done: TypedFunc<i32, i32>,
    log: TypedFunc<i32, ()>,
    delete: TypedFunc<i32, ()>,
    queue_ready: Option<TypedFunc<(i32, i32), ()>>,
    http_call_response: Option<OnHttpCallResponse>,
}

pub struct Vm {
    store: Store<VmState>,
    exports: Exports,
}

/// Checks that `module` is a proxy-wasm module, naming what is missing.
pub fn check_proxy_wasm(module: &Module) -> anyhow::Result<()> {
    let exports: Vec<&str> = module.exports().map(|e| e.name()).collect();
    if !abi::ABI_VERSIONS.iter().any(|v| exports.contains(v)) {
        bail!(
            "not a proxy-wasm module: it exports none of {} (it exports: {})",
            abi::ABI_VERSIONS.join(", "),
            if exports.is_empty() {
                "nothing".to_string()
            } else {
                exports.join(", ")
            }
        );
    }
    for needed in [
        "memory",
        "proxy_on_memory_allocate",
        "proxy_on_context_create",
        "proxy_on_vm_start",
        "proxy_on_configure",
    ] {
        if !exports.contains(&needed) {
            bail!("not a usable proxy-wasm module: it does not export {needed}");
        }
    }
    Ok(())
}

/// A trap or host error, with what the module last said at error level
/// (its panic message, for a Rust module).
fn trap(
    e: wasmtime::Error,
    during: &str,
    logs: &Rc<RefCell<Vec<LogLine>>>,
    vm: &str,
) -> anyhow::Error {
    let said = logs
        .borrow()
        .iter()
        .rev()
        .find(|l| l.vm == vm && matches!(l.level, "critical" | "error" | "stderr"))
        .map(|l| format!("\nthe module said: {}", l.message))
        .unwrap_or_default();
    anyhow!("{vm}: {during} failed: {e:#}{said}")
}

impl Vm {
    pub fn new(
        engine: &Engine,
        module: &Module,
        linker: &Linker<VmState>,
        state: VmState,
    ) -> anyhow::Result<Self> {
        let (name, logs) = (state.name.clone(), state.logs.clone());
        let mut store = Store::new(engine, state);
        let instance: Instance = linker
            .instantiate(&mut store, module)
            .map_err(|e| trap(e, "instantiating", &logs, &name))?;
        macro_rules! export {
            ($name:literal) => {
                instance
                    .get_typed_func(&mut store, $name)
                    .map_err(|e| anyhow!("{name}: export {}: {e:?}", $name))?
            };
        }
        let exports = Exports {
            context_create: export!("proxy_on_context_create"),
            vm_start: export!("proxy_on_vm_start"),
            configure: export!("proxy_on_configure"),
            tick: export!("proxy_on_tick"),
            request_headers: export!("proxy_on_request_headers"),
            request_body: export!("proxy_on_request_body"),
            response_headers: export!("proxy_on_response_headers"),
            done: export!("proxy_on_done"),
            log: export!("proxy_on_log"),
            delete: export!("proxy_on_delete"),
            queue_ready: instance
                .get_typed_func(&mut store, "proxy_on_queue_ready")
                .ok(),
            http_call_response: instance
                .get_typed_func(&mut store, "proxy_on_http_call_response")
                .ok(),
        };
        for init in ["_initialize", "_start"] {
            if let Ok(f) = instance.get_typed_func::<(), ()>(&mut store, init) {
                f.call(&mut store, ())
                    .map_err(|e| trap(e, init, &logs, &name))?;
                break;
            }
        }
        Ok(Self { store, exports })
    }

    fn fail(&self, e: wasmtime::Error, during: &str) -> anyhow::Error {
        let state = self.store.data();
        trap(e, during, &state.logs, &state.name)
    }

    pub fn state(&self) -> &VmState {
        self.store.data()
    }

    pub fn state_mut(&mut self) -> &mut VmState {
        self.store.data_mut()
    }

    /// Creates the root context, then vm_start and configure, as Envoy does
    /// when it loads a plugin. `Ok(false)` means the module refused its
    /// configuration.
    pub fn start(&mut self) -> anyhow::Result<bool> {
        let root = self.state().root_id as i32;
        self.state_mut().current = root as u32;
        let (vm_config, plugin_config) = (
            self.state().vm_config.len(),
            self.state().plugin_config.len(),
        );
        self.exports
            .context_create
            .call(&mut self.store, (root, 0))
            .map_err(|e| self.fail(e, "proxy_on_context_create (root)"))?;
        let started = self
            .exports
            .vm_start
            .call(&mut self.store, (root, vm_config as i32))
            .map_err(|e| self.fail(e, "proxy_on_vm_start"))?;
        if started == 0 {
            return Ok(false);
        }
        let configured = self
            .exports
            .configure
            .call(&mut self.store, (root, plugin_config as i32))
            .map_err(|e| self.fail(e, "proxy_on_configure"))?;
        Ok(configured != 0)
    }

    /// A new plugin configuration on this VM, as Envoy applies a changed
    /// filter config whose module is unchanged: a new root context
    /// `root_id`, configured with `plugin_config`, serves the streams that
    /// start from now on, while streams already in flight finish on theirs.
    /// `Ok(false)` means the module refused the configuration; the old root
    /// context then keeps serving.
    pub fn configure_new_root(
        &mut self,
        root_id: u32,
        plugin_config: &[u8],
    ) -> anyhow::Result<bool> {
        let old_config =
            std::mem::replace(&mut self.state_mut().plugin_config, plugin_config.to_vec());
        self.state_mut().current = root_id;
        self.exports
            .context_create
            .call(&mut self.store, (root_id as i32, 0))
            .map_err(|e| self.fail(e, "proxy_on_context_create (root)"))?;
        let configured = self
            .exports
            .configure
            .call(
                &mut self.store,
                (root_id as i32, plugin_config.len() as i32),
            )
            .map_err(|e| self.fail(e, "proxy_on_configure"))?;
        if configured == 0 {
            self.state_mut().plugin_config = old_config;
            return Ok(false);
        }
        let old_root = std::mem::replace(&mut self.state_mut().root_id, root_id);
        self.state_mut().retired_roots.push(old_root);
        self.delete_idle_roots()?;
        Ok(true)
    }

    /// Deletes every retired root context with no stream left (done, then
    /// delete), as Envoy deletes a replaced plugin after its last stream.
    fn delete_idle_roots(&mut self) -> anyhow::Result<()> {
        let state = self.state();
        let (idle, busy): (Vec<u32>, Vec<u32>) = state
            .retired_roots
            .iter()
            .copied()
            .partition(|root| !state.streams.values().any(|s| s.root == *root));
        self.state_mut().retired_roots = busy;
        for root in idle {
            self.state_mut().current = root;
            self.exports
                .done
                .call(&mut self.store, root as i32)
                .map_err(|e| self.fail(e, "proxy_on_done (root)"))?;
            self.exports
                .delete
                .call(&mut self.store, root as i32)
                .map_err(|e| self.fail(e, "proxy_on_delete (root)"))?;
        }
        Ok(())
    }

    pub fn tick(&mut self) -> anyhow::Result<()> {
        let root = self.state().root_id;
        self.state_mut().current = root;
        self.exports
            .tick
            .call(&mut self.store, root as i32)
            .map_err(|e| self.fail(e, "proxy_on_tick"))
    }

    /// Runs a request's headers and body through a new stream context.
    /// Returns the module's local reply, if it sent one.
    pub fn request(&mut self, context: u32, stream: Stream) -> anyhow::Result<Request> {
        let root = self.state().root_id;
        let (headers, body_len) = (stream.request_headers.len(), stream.request_body.len());
        self.state_mut()
            .streams
            .insert(context, Stream { root, ..stream });
        self.state_mut().current = context;
        self.exports
            .context_create
            .call(&mut self.store, (context as i32, root as i32))
            .map_err(|e| self.fail(e, "proxy_on_context_create"))?;
        let action = self
            .exports
            .request_headers
            .call(
                &mut self.store,
                (context as i32, headers as i32, i32::from(body_len == 0)),
            )
            .map_err(|e| self.fail(e, "proxy_on_request_headers"))?;
        // As in Envoy, paused headers stop the body too (proxy-wasm maps a
        // paused header phase to StopAllIteration): the body reaches the
        // filter only after headers that continued.
        let action = if action == abi::ACTION_CONTINUE
            && body_len > 0
            && self.local_reply(context).is_none()
        {
            self.state_mut().current = context;
            self.exports
                .request_body
                .call(&mut self.store, (context as i32, body_len as i32, 1))
                .map_err(|e| self.fail(e, "proxy_on_request_body"))?
        } else {
            action
        };
        if let Some(reply) = self.local_reply(context) {
            return Ok(Request::Replied(reply));
        }
        if action == abi::ACTION_CONTINUE {
            return Ok(Request::Continue);
        }
        if let Some(stream) = self.state_mut().streams.get_mut(&context) {
            stream.held = true;
        }
        Ok(Request::Held)
    }

    /// Tells root context `root` that queue `queue` has items.
    pub fn queue_ready(&mut self, root: u32, queue: u32) -> anyhow::Result<()> {
        let Some(f) = self.exports.queue_ready.clone() else {
            return Ok(());
        };
        self.state_mut().current = root;
        f.call(&mut self.store, (root as i32, queue as i32))
            .map_err(|e| self.fail(e, "proxy_on_queue_ready"))
    }

    /// Hands callout `token`'s response (`None`: it failed) to the root.
    pub fn call_response(
        &mut self,
        token: u32,
        response: Option<CallResponse>,
    ) -> anyhow::Result<()> {
        let Some(f) = self.exports.http_call_response.clone() else {
            return Ok(());
        };
        let root = self.state().root_id;
        let (headers, body) = response
            .as_ref()
            .map_or((0, 0), |(h, b)| (h.len(), b.len()));
        let state = self.state_mut();
        state.current = root;
        state.call_response = response;
        let called = f
            .call(
                &mut self.store,
                (root as i32, token as i32, headers as i32, body as i32, 0),
            )
            .map_err(|e| self.fail(e, "proxy_on_http_call_response"));
        self.state_mut().call_response = None;
        called
    }

    /// Paused requests the module has since answered or resumed.
    pub fn settled(&mut self) -> Vec<(u32, Settled)> {
        let mut settled = Vec::new();
        for (context, stream) in &mut self.state_mut().streams {
            if !stream.held {
                continue;
            }
            if let Some(reply) = &stream.local_reply {
                settled.push((*context, Settled::Replied(reply.clone())));
            } else if stream.resumed {
                settled.push((*context, Settled::Resumed));
            } else {
                continue;
            }
            stream.held = false;
        }
        settled.sort_by_key(|(context, _)| *context);
        settled
    }

    fn local_reply(&self, context: u32) -> Option<LocalReply> {
        self.state()
            .streams
            .get(&context)
            .and_then(|s| s.local_reply.clone())
    }

    /// Ends a stream: response headers (unless it was reset), then done,
    /// log and delete, as Envoy does.
    pub fn finish(
        &mut self,
        context: u32,
        response: Option<Vec<(String, String)>>,
    ) -> anyhow::Result<crate::Passed> {
        self.state_mut().current = context;
        let answered = response.is_some();
        if let Some(headers) = response {
            let count = headers.len();
            if let Some(stream) = self.state_mut().streams.get_mut(&context) {
                stream.response_headers = headers;
            }
            self.exports
                .response_headers
                .call(&mut self.store, (context as i32, count as i32, 1))
                .map_err(|e| self.fail(e, "proxy_on_response_headers"))?;
        }
        // The response headers as the filter left them, and the filter
        // state, for the filters before it.
        let passed = match self.state_mut().streams.get(&context) {
            Some(stream) if answered => crate::Passed {
                headers: stream.response_headers.clone(),
                filter_state: stream.filter_state.clone(),
            },
            _ => crate::Passed::default(),
        };
        self.state_mut().current = context;
        self.exports
            .done
            .call(&mut self.store, context as i32)
            .map_err(|e| self.fail(e, "proxy_on_done"))?;
        self.exports
            .log
            .call(&mut self.store, context as i32)
            .map_err(|e| self.fail(e, "proxy_on_log"))?;
        self.exports
            .delete
            .call(&mut self.store, context as i32)
            .map_err(|e| self.fail(e, "proxy_on_delete"))?;
        self.state_mut().streams.remove(&context);
        self.delete_idle_roots()?;
        Ok(passed)
    }
}
