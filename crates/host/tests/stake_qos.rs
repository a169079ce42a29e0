//! The compiled stake QoS filter in the offline host, in virtual time.

use stakegate_host::Host;
use std::time::Duration;

fn qos(policy: &str, workers: usize) -> Host {
    let module = stakegate_stack::paths::wasm_module("stake_qos").expect("make build");
    Host::new(&std::fs::read(module).unwrap(), policy.as_bytes(), workers).unwrap()
}

#[test]
fn one_refill_round_per_interval_across_workers() {
    let mut host = qos(r#"{"capacityRps": 100}"#, 2);
    host.advance(Duration::from_secs(1)).unwrap();
    let rounds = host.metric("stakegate.qos.rounds");
    // Every VM ticks every 20 ms; one of them wins each round (the very
    // first may be claimed twice, before the state exists).
    assert!((49..=51).contains(&rounds), "{rounds} rounds");
}
