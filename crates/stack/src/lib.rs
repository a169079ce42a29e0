//! stakegate-stack: the real stack as processes.
//!
//! Tests, `make demo` and scenario runs all start Envoy and rpc-node through
//! this crate, so they share one way of finding binaries, rendering configs,
//! waiting for readiness and reading stats. Every process is stopped when its
//! handle drops, and its log is printed if that happens during a panic (a
//! failing test).

pub mod admin;
pub mod anvil;
pub mod delay;
pub mod ecds;
pub mod envoy;
pub mod http;
pub mod loadgen;
pub mod paths;
pub mod process;
pub mod redis;
pub mod rpc_node;

pub use anvil::Anvil;
pub use delay::DelayRelay;
pub use ecds::FilterConfig;
pub use envoy::{Envoy, EnvoyBuilder};
pub use redis::FleetEngine;
pub use rpc_node::RpcNode;
