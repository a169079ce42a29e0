//! The load generator keeps its schedule: against a fast upstream (Envoy
//! answering by itself), the offered rate is the requested one.

use stakegate_stack::{envoy, loadgen};
use stakegate_tests::{client, load};
use std::time::Duration;

#[test]
fn offered_rate_is_within_two_percent_at_2000_rps() {
    let envoy = envoy::direct_response(&[("public", "")], envoy::Answer::Itself)
        .unwrap()
        .concurrency(1)
        .start()
        .unwrap();
    let spec = load(
        &envoy.url("public").unwrap(),
        // A cap a stalled Envoy does not reach in a second: on a busy
        // machine, 256 in flight skipped 115 of 10,000.
        client("steady", 2000.0, "eth_blockNumber", 2000),
        Duration::from_secs(5),
        false,
    );
    let report = loadgen::run(&spec).unwrap();
    let steady = report.client("steady").unwrap();
    eprintln!("{}", serde_json::to_string(&steady.header).unwrap());

    let error = (steady.header.offered_rps - 2000.0).abs() / 2000.0;
    assert!(
        error < 0.02,
        "offered {} rps for 2000 requested",
        steady.header.offered_rps
    );
    assert_eq!(steady.header.scheduled, 10_000);
    assert_eq!(steady.count("200"), 10_000, "every request is answered");
    assert_eq!(steady.header.skipped_at_cap, 0);
    let served = envoy.stat("http.public.downstream_rq_2xx").unwrap();
    assert_eq!(served, 10_000, "Envoy saw every request");
}
