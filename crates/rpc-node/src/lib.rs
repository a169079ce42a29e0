//! rpc-node: a mock JSON-RPC 2.0 node that fails the way a real node fails
//! under an RPC flood (docs/background.md part 5).
//!
//! - `slots`: the blocking read-slot semaphore that RPC and sync share.
//! - `costs`: the service time of each method, spent while holding a slot.
//! - `chain`: blocks arriving, being executed, and the tip lag.
//! - `rpc`: JSON-RPC framing and errors, and Ethereum's answers.
//! - `solana`: the Solana flavour's answers (`--chain solana`), and
//!   `pubsub`, its subscriptions over the WebSocket.
//! - `node`: the pieces together, plus `/metrics`.
//! - `server`: the HTTP surface.

pub mod chain;
pub mod costs;
pub mod node;
pub mod pubsub;
pub mod rpc;
pub mod server;
pub mod slots;
pub mod solana;
