//! Helpers shared by the real-Envoy integration tests.

use stakegate_loadgen::{ClientSpec, RunSpec};
use stakegate_stack::{Envoy, EnvoyBuilder, RpcNode};
use std::time::Duration;

/// rpc-node with `args`, behind Envoy started from `template` at `--concurrency 2`.
pub fn node_behind_envoy(template: &str, node_args: &[&str]) -> (RpcNode, Envoy) {
    let node = RpcNode::start(node_args).expect("rpc-node starts");
    let envoy = EnvoyBuilder::new(template)
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .concurrency(2)
        .start()
        .expect("envoy starts");
    (node, envoy)
}

/// One client, `rate` rps of `mix` for `duration`, bounded by a timeout.
pub fn load(target: &str, client: ClientSpec, duration: Duration, http2: bool) -> RunSpec {
    RunSpec {
        target: target.to_string(),
        duration,
        max_requests: (client.rate * duration.as_secs_f64()).ceil() as u64,
        timeout: Duration::from_secs(30),
        http2,
        clients: vec![client],
    }
}

pub fn client(id: &str, rate: f64, method: &str, concurrency: usize) -> ClientSpec {
    ClientSpec {
        mix: [(method.to_string(), 1.0)].into(),
        concurrency,
        ..ClientSpec::new(id, rate)
    }
}
