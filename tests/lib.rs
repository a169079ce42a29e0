//! Helpers shared by the real-Envoy integration tests.

use stakegate_loadgen::{ClientSpec, RunSpec};
use stakegate_stack::{http, Envoy, EnvoyBuilder, FilterConfig, RpcNode};
use std::time::Duration;

/// rpc-node with `args`, behind Envoy started from `template` at `--concurrency 2`.
pub fn node_behind_envoy(template: &str, node_args: &[&str]) -> (RpcNode, Envoy) {
    start_behind(EnvoyBuilder::new(template), node_args, 2)
}

/// rpc-node with `node_args`, then Envoy from `builder` pointed at it.
fn start_behind(builder: EnvoyBuilder, node_args: &[&str], workers: u32) -> (RpcNode, Envoy) {
    let node = RpcNode::start(node_args).expect("rpc-node starts");
    let envoy = builder
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .concurrency(workers)
        .start()
        .expect("envoy starts");
    (node, envoy)
}

/// One client, `rate` rps of `mix` for `duration`, bounded by a timeout.
pub fn load(target: &str, client: ClientSpec, duration: Duration, http2: bool) -> RunSpec {
    RunSpec {
        http2,
        ..load_h2(target, vec![client], duration, 1)
    }
}

/// `clients` over HTTP/2 on `connections` connections each, for
/// `duration`, bounded by a timeout.
pub fn load_h2(
    target: &str,
    clients: Vec<ClientSpec>,
    duration: Duration,
    connections: usize,
) -> RunSpec {
    let fastest = clients.iter().map(|c| c.rate).fold(0.0, f64::max);
    RunSpec {
        target: target.to_string(),
        duration,
        max_requests: (fastest * duration.as_secs_f64()).ceil() as u64,
        timeout: Duration::from_secs(30),
        http2: true,
        connections,
        clients,
    }
}

pub fn client(id: &str, rate: f64, method: &str, concurrency: usize) -> ClientSpec {
    ClientSpec {
        mix: [(method.to_string(), 1.0)].into(),
        concurrency,
        ..ClientSpec::new(id, rate)
    }
}

/// rpc-node with `node_args` behind Envoy started from `template` with
/// `filter` loaded through ECDS, at `--concurrency 2`.
pub fn node_behind_filter(
    template: &str,
    filter: FilterConfig,
    node_args: &[&str],
) -> (RpcNode, Envoy) {
    node_behind_filters(template, vec![filter], node_args)
}

/// rpc-node with `node_args` behind Envoy started from `template` with
/// every one of `filters` loaded through ECDS, at `--concurrency 2`.
pub fn node_behind_filters(
    template: &str,
    filters: Vec<FilterConfig>,
    node_args: &[&str],
) -> (RpcNode, Envoy) {
    let builder = filters
        .into_iter()
        .fold(EnvoyBuilder::new(template), EnvoyBuilder::filter);
    start_behind(builder, node_args, 2)
}

/// rpc-node with `node_args` behind the whole gateway (gateway.yaml) with
/// these policies, on one Envoy worker: a slot or a WebSocket place given
/// back is at once the next request's (with more workers a spare slot
/// moves at the gate's heartbeat, and QoS counts sockets per worker).
pub fn gateway_on_one_worker(
    qos_policy: &str,
    gate_policy: &str,
    node_args: &[&str],
) -> (RpcNode, Envoy) {
    let builder = EnvoyBuilder::new("gateway.yaml")
        .filter(qos_filter(qos_policy))
        .filter(gate_filter(gate_policy));
    start_behind(builder, node_args, 1)
}

/// A shipped example policy (`NAME.example.json` under policies/) with `changes`
/// made to its top-level fields.
pub fn example_policy(name: &str, changes: serde_json::Value) -> String {
    let path = stakegate_stack::paths::project_root().join(format!("policies/{name}.example.json"));
    let mut policy: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for (field, value) in changes.as_object().expect("changes are an object") {
        policy[field] = value.clone();
    }
    policy.to_string()
}

/// rpc-node behind Envoy's gate config (public and internal listeners) with
/// the compiled admission gate serving `policy`.
pub fn node_behind_gate(policy: &str, node_args: &[&str]) -> (RpcNode, Envoy) {
    node_behind_filter("gate.yaml", gate_filter(policy), node_args)
}

/// The compiled admission gate with `policy`.
pub fn gate_filter(policy: &str) -> FilterConfig {
    let module = stakegate_stack::paths::wasm_module("admission_gate").expect("make build");
    FilterConfig::admission_gate(module, policy)
}

/// The compiled stake QoS filter with `policy`.
pub fn qos_filter(policy: &str) -> FilterConfig {
    let module = stakegate_stack::paths::wasm_module("stake_qos").expect("make build");
    FilterConfig::stake_qos(module, policy)
}

/// How long state that settles asynchronously (a count published at the
/// workers' next heartbeat, a gauge back to 0, a stat of a new config) is
/// waited for: a limit no slowdown reaches, as `eventually` returns as soon
/// as the state holds. Beside two busy-looping processes a 1 s heartbeat's
/// counts took more than 5 s to arrive.
pub const SETTLE: Duration = Duration::from_secs(30);

/// Polls `condition` every 10 ms until it holds or `within` passes; returns
/// whether it held. For waiting on state that settles asynchronously
/// (gauges, heartbeats), never for hiding a race.
pub fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A WebSocket client through `addr` (an Envoy listener), with a 30 s read
/// timeout so a test cannot hang on it.
pub fn websocket(addr: std::net::SocketAddr) -> tungstenite::WebSocket<std::net::TcpStream> {
    let stream = std::net::TcpStream::connect(addr).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("sets a timeout");
    let (socket, response) = tungstenite::client(format!("ws://{addr}/"), stream)
        .unwrap_or_else(|e| panic!("WebSocket upgrade through {addr}: {e}"));
    assert_eq!(response.status(), 101);
    socket
}

/// `stakegate init` into `dir` for a node at `node`, with the compiled
/// modules and the policy files `gate_policy` and `qos_policy`, every
/// listener on a free port. Its output, for the caller to check.
pub fn stakegate_init(
    dir: &std::path::Path,
    node: std::net::SocketAddr,
    gate_policy: &std::path::Path,
    qos_policy: &std::path::Path,
) -> std::process::Output {
    let module = |name: &str| stakegate_stack::paths::wasm_module(name).expect("make build");
    std::process::Command::new(stakegate_stack::paths::tool("stakegate").expect("make build"))
        .arg("init")
        .arg("--dir")
        .arg(dir)
        .args(["--node", &format!("http://{node}")])
        .args(["--public-port", "0", "--internal-port", "0"])
        .args(["--admin", "127.0.0.1:0"])
        .arg("--gate-module")
        .arg(module("admission_gate"))
        .arg("--gate-policy")
        .arg(gate_policy)
        .arg("--qos-module")
        .arg(module("stake_qos"))
        .arg("--qos-policy")
        .arg(qos_policy)
        .output()
        .expect("stakegate runs")
}

/// `stakegate_init`, which must succeed, then Envoy started from the config
/// it wrote into `dir` (which must outlive it).
pub fn start_initialised(
    dir: &std::path::Path,
    node: std::net::SocketAddr,
    gate_policy: &std::path::Path,
    qos_policy: &std::path::Path,
) -> Envoy {
    let init = stakegate_init(dir, node, gate_policy, qos_policy);
    assert!(
        init.status.success(),
        "stakegate init: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    EnvoyBuilder::new(dir.join("envoy.yaml"))
        .start()
        .expect("envoy starts from what init wrote")
}

/// Checks that `answer` refused a batch with `status` and an array of
/// JSON-RPC errors (-32005), one per call, with the calls' `ids` in order.
pub fn assert_refused_call_by_call(answer: &http::Answer, status: u16, ids: &[serde_json::Value]) {
    assert_eq!(answer.status, status, "{}", answer.body);
    let errors = answer.json().unwrap();
    let answered: Vec<&serde_json::Value> = errors
        .as_array()
        .unwrap_or_else(|| panic!("an array: {errors}"))
        .iter()
        .map(|e| {
            assert_eq!(e["error"]["code"], -32005, "{e}");
            &e["id"]
        })
        .collect();
    assert_eq!(answered, ids.iter().collect::<Vec<_>>());
}

/// What `command` printed, as JSON, once it has exited successfully (its
/// stderr in the panic otherwise).
pub fn json_output(command: &mut std::process::Command) -> serde_json::Value {
    let output = command.output().expect("the command runs");
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON on stdout")
}

/// The command that runs a client script under clients/: a Python one
/// (`.py`, with the project's `.venv`), or a Node one given `library` as
/// its first argument.
pub fn client_script(script: &str, library: &str) -> std::process::Command {
    let dir = stakegate_stack::paths::clients_dir().expect("make setup");
    if script.ends_with(".py") {
        let python = stakegate_stack::paths::project_root().join(".venv/bin/python");
        let mut command = std::process::Command::new(python);
        command.arg(dir.join(script));
        command
    } else {
        let mut command = std::process::Command::new("node");
        command.arg(dir.join(script)).arg(library);
        command
    }
}
