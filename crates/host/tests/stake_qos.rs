//! The compiled stake QoS filter in the offline host, in virtual time.

use stakegate_host::{Host, Reply, Request};
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

/// Sends one request per address, `per_ms` of them per virtual millisecond,
/// each answered at once.
fn from_addresses(host: &mut Host, addresses: impl Iterator<Item = String>, per_ms: usize) {
    for (n, address) in addresses.enumerate() {
        let request = Request::json_rpc(r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#)
            .property(
                &["source", "address"],
                format!("{address}:40000").as_bytes(),
            );
        match host.request(n % host.workers(), &request).unwrap() {
            Reply::Continue(id) => host.finish(id, 200, Duration::from_millis(1)).unwrap(),
            Reply::LocalReply(reply) => panic!("throttled below capacity: {}", reply.status),
        }
        if n % per_ms == per_ms - 1 {
            host.advance(Duration::from_millis(1)).unwrap();
        }
    }
}

#[test]
fn a_hundred_thousand_addresses_stay_within_max_identities() {
    let mut host = qos(r#"{"capacityRps": 1000000, "maxIdentities": 1000}"#, 2);
    let address = |i: u32| format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255);
    from_addresses(&mut host, (0..2_000).map(address), 20);
    let after_2k = host.shared_data_size();
    from_addresses(&mut host, (2_000..100_000).map(address), 20);
    let after_100k = host.shared_data_size();
    // ceil(1000 / 64) = 16 pages of at most 64 entries of 48 bytes (plus a
    // 3-byte header), the state record and the active-page bitmap.
    let pages = 16;
    assert_eq!(after_100k.0, pages + 2, "keys: {after_100k:?}");
    assert!(
        after_100k.1 <= pages * (3 + 64 * 48) + 256,
        "{} bytes",
        after_100k.1
    );
    assert_eq!(after_2k.0, after_100k.0);
    assert!(
        after_100k.1 <= after_2k.1 + 48 * pages,
        "{after_2k:?} -> {after_100k:?}"
    );
    let identities = host.metric("stakegate.qos.identities");
    assert!(
        (900..=1024).contains(&identities),
        "{identities} identities"
    );
    assert!(host.metric("stakegate.qos.evicted") >= 98_000);
}
