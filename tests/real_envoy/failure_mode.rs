//! The failure mode the admission gate exists for (docs/background.md part 5), with
//! traffic straight to rpc-node: a blocking read-slot queue starves the
//! node's own sync loop and it loses the chain tip.

use stakegate_stack::{loadgen, RpcNode};
use stakegate_tests::{client, load};
use std::time::Duration;

/// 8 read slots; blocks every 200 ms, each holding 4 slots for 20 ms.
const NODE: &[&str] = &[
    "--read-slots",
    "8",
    "--block-interval",
    "200ms",
    "--block-exec",
    "20ms",
    "--sync-slots",
    "4",
    "--tip-lost-after",
    "5",
];
const BLOCK_INTERVAL_MS: f64 = 200.0;

#[test]
fn an_eth_call_flood_queues_and_loses_the_tip() {
    let node = RpcNode::start(NODE).unwrap();
    // eth_call costs 5 ms, so 8 slots serve at most 1,600 rps; send 5,000.
    // HTTP/2 keeps the backlog in the node's queue rather than in sockets.
    let flood = client("flood", 5000.0, "eth_call", 100_000);
    let report = loadgen::run(&load(&node.url(), flood, Duration::from_secs(4), true)).unwrap();
    let metrics = node.metrics().unwrap();
    eprintln!("node after flood: {metrics}");

    let queue_max = metrics["queue_max"].as_u64().unwrap();
    assert!(
        queue_max > 2000,
        "the queue grows far past the 8 slots: {queue_max}"
    );
    let lag_max = metrics["tip_lag_max_ms"].as_f64().unwrap();
    assert!(
        lag_max > 5.0 * BLOCK_INTERVAL_MS,
        "tip lag passes 5 block intervals: {lag_max} ms"
    );
    assert_eq!(metrics["tip_lost"], true);
    let flood = report.client("flood").unwrap();
    assert!(
        flood.latency_ms.ok.max > 1000.0,
        "queued requests wait seconds: max {} ms",
        flood.latency_ms.ok.max
    );
}

#[test]
fn without_a_flood_the_tip_stays_within_one_interval() {
    let node = RpcNode::start(NODE).unwrap();
    // About a third of capacity, for 15 blocks.
    let calm = client("calm", 500.0, "eth_call", 1000);
    let report = loadgen::run(&load(&node.url(), calm, Duration::from_secs(3), false)).unwrap();
    let metrics = node.metrics().unwrap();
    eprintln!("node after calm load: {metrics}");

    assert_eq!(report.client("calm").unwrap().count("200"), 1500);
    let lag_max = metrics["tip_lag_max_ms"].as_f64().unwrap();
    assert!(
        lag_max < BLOCK_INTERVAL_MS,
        "tip lag stays under one interval: {lag_max} ms"
    );
    assert_eq!(metrics["tip_lost"], false);
    assert!(
        metrics["head"].as_u64().unwrap() >= 14,
        "blocks keep executing: {metrics}"
    );
}
