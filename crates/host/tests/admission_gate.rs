//! The compiled admission gate in the offline host: the same behaviours the
//! real-Envoy tests check, deterministically and in virtual time.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use stakegate_host::{Host, Reply, Request, RequestId};
use std::time::Duration;

const CALL: &str = r#"{"jsonrpc":"2.0","id":1,"method":"eth_call"}"#;

fn gate(policy: &str, workers: usize) -> Host {
    let module = stakegate_stack::paths::wasm_module("admission_gate").expect("make build");
    Host::new(&std::fs::read(module).unwrap(), policy.as_bytes(), workers).unwrap()
}

fn send(host: &mut Host, worker: usize) -> Option<RequestId> {
    match host.request(worker, &Request::json_rpc(CALL)).unwrap() {
        Reply::Continue(id) => Some(id),
        Reply::LocalReply(reply) => {
            assert_eq!(reply.status, 503);
            None
        }
        Reply::Held(id) => panic!("held {id:?} with dedup off"),
    }
}

#[test]
fn admitted_inflight_never_exceeds_the_limit_across_four_workers() {
    let mut host = gate(r#"{"maxInflight": 8}"#, 4);
    let mut rng = SmallRng::seed_from_u64(7);
    let mut inflight: Vec<RequestId> = Vec::new();
    let (mut admitted, mut rejected, mut max_inflight) = (0, 0, 0);
    for _ in 0..2000 {
        if !inflight.is_empty() && rng.random_bool(0.45) {
            let id = inflight.swap_remove(rng.random_range(0..inflight.len()));
            host.finish(id, 200, Duration::from_millis(5)).unwrap();
        } else {
            match send(&mut host, rng.random_range(0..4)) {
                Some(id) => {
                    inflight.push(id);
                    admitted += 1;
                }
                None => rejected += 1,
            }
        }
        max_inflight = max_inflight.max(inflight.len());
        assert!(inflight.len() <= 8, "{} in flight", inflight.len());
        if rng.random_bool(0.01) {
            host.advance(Duration::from_millis(500)).unwrap();
        }
    }
    assert_eq!(max_inflight, 8, "the limit was reached, not just respected");
    assert!(
        admitted > 500 && rejected > 100,
        "{admitted} admitted, {rejected} rejected"
    );
    for id in inflight.drain(..) {
        host.finish(id, 200, Duration::ZERO).unwrap();
    }
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(host.metric("stakegate.gate.admitted.default"), admitted);
    assert_eq!(host.metric("stakegate.gate.rejected.default"), rejected);
    assert_eq!(host.metric("stakegate.gate.inflight.default"), 0);
}

#[test]
fn no_slot_leaks_after_random_aborts() {
    let mut host = gate(r#"{"maxInflight": 6}"#, 4);
    let mut rng = SmallRng::seed_from_u64(11);
    let mut inflight = Vec::new();
    for _ in 0..3000 {
        if let Some(id) = send(&mut host, rng.random_range(0..4)) {
            inflight.push(id);
        }
        if inflight.len() > 3 || (!inflight.is_empty() && rng.random_bool(0.3)) {
            let id = inflight.swap_remove(rng.random_range(0..inflight.len()));
            if rng.random_bool(0.5) {
                host.abort(id).unwrap();
            } else {
                host.finish(id, 503, Duration::from_millis(1)).unwrap();
            }
        }
    }
    for id in inflight {
        host.abort(id).unwrap();
    }
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(host.metric("stakegate.gate.inflight.default"), 0);
    let refilled: Vec<_> = (0..6).filter_map(|i| send(&mut host, i % 4)).collect();
    assert_eq!(refilled.len(), 6, "every slot is available again");
    assert_eq!(send(&mut host, 0), None);
}

#[test]
fn a_vanished_workers_slots_expire_after_the_ttl() {
    let policy = r#"{"maxInflight": 4, "heartbeatMs": 100, "staleSlotTtlMs": 1000}"#;
    let mut host = gate(policy, 4);
    host.advance(Duration::from_millis(50)).unwrap();
    let held: Vec<_> = (0..4).map(|_| send(&mut host, 3).unwrap()).collect();
    host.remove_worker(3).unwrap();
    assert_eq!(
        send(&mut host, 0),
        None,
        "the vanished worker's slots still count"
    );

    host.advance(Duration::from_millis(950)).unwrap();
    assert_eq!(send(&mut host, 1), None, "not before the TTL");
    host.advance(Duration::from_millis(200)).unwrap();
    assert!(
        send(&mut host, 1).is_some(),
        "the slots came back after the TTL"
    );
    assert_eq!(host.metric("stakegate.gate.expired_slots"), 4);
    assert!(host
        .logs()
        .iter()
        .any(|l| l.message.contains("reclaimed 4 slots")));
    assert!(host
        .finish(held[0], 200, Duration::ZERO)
        .unwrap_err()
        .to_string()
        .contains("removed"));
}

#[test]
fn internal_requests_are_admitted_past_the_limit() {
    let policy =
        r#"{"maxInflight": 1, "classes": {"internal": [{"listenerMetadata": "internal"}]}}"#;
    let mut host = gate(policy, 2);
    send(&mut host, 0).unwrap();
    assert_eq!(send(&mut host, 1), None);
    let internal = Request::json_rpc(CALL).listener_class("internal");
    for worker in [0, 1, 0] {
        assert!(matches!(
            host.request(worker, &internal).unwrap(),
            Reply::Continue(_)
        ));
    }
}

#[test]
fn a_rejection_carries_retry_after_and_the_json_rpc_error() {
    let mut host = gate(r#"{"maxInflight": 1}"#, 1);
    send(&mut host, 0).unwrap();
    let Reply::LocalReply(reply) = host.request(0, &Request::json_rpc(CALL)).unwrap() else {
        panic!("admitted over the limit")
    };
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert!(reply.header("retry-after").unwrap().parse::<u32>().unwrap() >= 1);
    assert_eq!(
        String::from_utf8(reply.body.clone()).unwrap(),
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32005,"message":"the node is at its in-flight request limit, retry later","data":{"rule":"gate-inflight","retryAfter":"#.to_string()
            + reply.header("retry-after").unwrap()
            + r#","inFlight":1,"limit":1}}}"#
    );
    assert_eq!(reply.header("x-stakegate-rule"), Some("gate-inflight"));
}

#[test]
fn a_bad_policy_is_refused_with_the_modules_reason() {
    let module =
        std::fs::read(stakegate_stack::paths::wasm_module("admission_gate").unwrap()).unwrap();
    let err = Host::new(&module, br#"{"maxInflight": 0}"#, 1)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        err,
        "the module refused its configuration: stakegate admission-gate: policy rejected: maxInflight: must be between 1 and 1000000, or -1 for pass-through; got 0"
    );
}

#[test]
fn a_new_policy_serves_new_requests_and_in_flight_ones_finish_under_the_old() {
    let mut host = gate(r#"{"maxInflight": 2}"#, 2);
    let first: Vec<RequestId> = (0..2).filter_map(|i| send(&mut host, i % 2)).collect();
    assert_eq!(first.len(), 2);
    assert!(send(&mut host, 0).is_none(), "the old limit holds");

    let err = host
        .reconfigure(br#"{"maxInflight": "many"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("maxInflight"), "{err}");
    assert!(
        send(&mut host, 1).is_none(),
        "a refused policy changes nothing"
    );

    host.reconfigure(br#"{"maxInflight": 3}"#).unwrap();
    let second = send(&mut host, 1).expect("the new limit admits a third");
    assert!(send(&mut host, 0).is_none(), "and no fourth");
    for id in first.into_iter().chain([second]) {
        host.finish(id, 200, Duration::from_millis(5)).unwrap();
    }
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(host.metric("stakegate.gate.inflight.default"), 0);
    assert_eq!(host.metric("stakegate.gate.admitted.default"), 3);
}
