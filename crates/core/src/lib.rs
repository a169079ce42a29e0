//! stakegate-core: the policy logic both filters and the simulator share.
//!
//! Everything here takes plain values and returns plain values: no proxy-wasm
//! types, and no clock (callers pass `now` in, as a value or as a
//! `clock::Now` read when first needed). That keeps each mechanism
//! testable with a fake clock, runnable in the offline host in virtual time,
//! and identical in Envoy.
//!
//! - `gate`: the RPC admission gate (docs/background.md part 5).
//! - `dedup`: retry-storm protection, an optional part of the gate (docs/background.md part 4).
//! - `qos`: stake-weighted rate shares and concurrency allowances (docs/background.md parts 1-3).
//! - `baseline`: Agave's stake-weighted QoS as it was (docs/background.md part 1), for comparison.
//! - `clock`: the time, passed in, read from the host only when needed.
//! - `jsonrpc`: what the filters read of a JSON-RPC body without parsing it.
//! - `rejection`: the one error shape every rejection has, and its `retry-after`.
//! - `request`: what a filter can tell about a request (`RequestFacts`), and
//!   the address networks policies match.
//! - `shared`: compare-and-swap updates of records in proxy-wasm shared data.
//! - `websocket`: WebSocket frames read in passing, counted as JSON-RPC messages.
//! - `validate`: the toolkit policies are checked with (errors name the field).

pub mod baseline;
pub mod cache;
pub mod clock;
pub mod cost;
pub mod dedup;
pub mod gate;
pub mod jsonrpc;
pub mod metrics;
pub mod qos;
pub mod rejection;
pub mod request;
pub mod shared;
pub mod validate;
pub mod websocket;
