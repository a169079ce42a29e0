//! Any bytes as an admission gate policy: parsing never panics, a policy
//! that parses is within its documented bounds, and the gate it makes
//! admits, releases and heartbeats without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::clock::Now;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::gate::stream::{GateStream, Head, Upgrade};
use stakegate_core::gate::worker::GateWorker;
use stakegate_core::gate::InflightGate;
use stakegate_core::request::{MetadataScope, RequestFacts};
use stakegate_core::shared::MemoryStore;

struct Public;

impl RequestFacts for Public {
    fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
        None
    }
    fn source_ip(&mut self) -> Option<std::net::IpAddr> {
        "10.1.2.3".parse().ok()
    }
    fn peer_uri_san(&mut self) -> Option<String> {
        None
    }
    fn header(&mut self, _: &str) -> Option<String> {
        Some("x".into())
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(policy) = GatePolicy::parse(data) else {
        return;
    };
    assert!(policy.heartbeat_ms >= 100 && policy.heartbeat_ms <= 60_000);
    assert!(policy.stale_slot_ttl_ms >= 3 * policy.heartbeat_ms);
    if let Some(max) = policy.limits.max_inflight {
        assert!(policy.limits.reserved < max);
    }
    let _ = policy.warnings();
    let store = MemoryStore::default();
    let mut worker = GateWorker::new(InflightGate::new(policy, 1));
    for now in [0u64, 1, u64::MAX / 2, u64::MAX] {
        let mut stream = GateStream::default();
        for upgrade in [Upgrade::None, Upgrade::Websocket] {
            let head = Head {
                end_of_stream: true,
                upgrade,
                content_length: Some(u64::MAX),
            };
            let _ = stream.headers(&mut worker, &store, &mut Now::fixed(now), &mut Public, head);
            stream.done(&mut worker, &store, &mut Now::fixed(now));
        }
        let _ = worker.tick(&store, now);
    }
});
