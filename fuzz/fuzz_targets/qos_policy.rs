//! Any bytes as a stake QoS policy: parsing never panics, and the buckets a
//! policy that parses makes admit, finish and refill without overflowing,
//! at any clock value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::qos::identity::Identity;
use stakegate_core::qos::policy::QosPolicy;
use stakegate_core::qos::report::MemoryQueue;
use stakegate_core::qos::{StakeQos, Verdict};
use stakegate_core::shared::MemoryStore;

fuzz_target!(|data: &[u8]| {
    let Ok(policy) = QosPolicy::parse(data) else {
        return;
    };
    assert!(policy.capacity_rps.is_finite() && policy.capacity_rps >= 1.0);
    let _ = policy.warnings();
    let store = MemoryStore::default();
    let queue = MemoryQueue::default();
    let stakes = [1, policy.unstaked_stake, u64::MAX / 2, u64::MAX];
    let mut qos = StakeQos::new(policy, 7);
    let mut tickets = Vec::new();
    for (step, now) in [1u64, 20, 21, 1_000, 60_000, u64::MAX / 4, u64::MAX]
        .into_iter()
        .enumerate()
    {
        for (i, stake) in stakes.iter().enumerate() {
            let identity = Identity {
                key: i as u64 + 1,
                stake: *stake,
                tier: 0,
                staked: i > 1,
                name: None,
                address: None,
            };
            if let Verdict::Admit(ticket) = qos.admit(&store, now, &identity).verdict {
                qos.charge(&ticket, u32::MAX);
                tickets.push(ticket);
            }
        }
        let _ = qos.tick(&store, &queue, now);
        if step % 2 == 1 {
            for ticket in tickets.drain(..) {
                qos.finish(now, ticket, Some(503));
            }
        }
    }
});
