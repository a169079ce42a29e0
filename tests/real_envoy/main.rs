//! Integration tests against a real Envoy, real compiled modules and real
//! sockets on 127.0.0.1. Run with `make test` (which builds what they use);
//! they run one at a time so timing-sensitive tests do not share the cores.

mod admission_gate;
mod answers;
mod cache;
mod clients;
mod deploy;
mod failure_mode;
mod fleet;
mod floods;
mod foundation;
mod gateway;
mod hostile;
mod loadgen;
mod quickstart;
mod retry_storm;
mod scenario_run;
mod shadow;
mod solana;
mod stake_qos;
