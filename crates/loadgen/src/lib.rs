//! stakegate-loadgen: an open-loop, multi-identity JSON-RPC load generator.
//!
//! Requests leave on a fixed schedule whatever the responses do, latency is
//! measured from when each request was due, and both the duration and the
//! request count are bounded. See `run` for the sender and `report` for what
//! is measured.

pub mod report;
pub mod run;
pub mod spec;

pub use report::{ClientReport, Report};
pub use run::run;
pub use spec::{ClientSpec, Phase, RunSpec, Schedule};
