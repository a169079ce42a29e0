//! stakegate-core: the policy logic both filters and the simulator share.
//!
//! Everything here takes plain values and returns plain values: no proxy-wasm
//! types, and no clock (callers pass `now` in). That keeps each mechanism
//! testable with a fake clock, runnable in the offline host in virtual time,
//! and identical in Envoy.

pub mod rejection;
