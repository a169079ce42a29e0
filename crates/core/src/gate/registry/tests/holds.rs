//! The holding bounds (`gate::holds`) at work: reads held for the head,
//! requests held for an answer and requests waiting for a slot are refused
//! past `maxHeld` and `maxHeldPerIdentity`, and every count returns to 0.

use super::*;
use crate::rejection::Rule;
use serde_json::json;

/// Stream `id` of `caller` sends `body` whole.
fn send_as(r: &mut Rig, id: u32, caller: &mut Caller, body: &[u8]) -> Then {
    assert_eq!(r.headers(id, caller, post()), OnHeaders::Continue);
    r.request_body(id, body.len(), true, &mut Bytes(body.to_vec()), caller)
}

fn named(identity: u64) -> Caller {
    Caller {
        identity: Some(identity),
        ..Caller::default()
    }
}

fn refused_by_held(then: Then) -> (u32, serde_json::Value) {
    let Then::Refuse(refusal) = then else {
        panic!("expected a refusal, got {then:?}");
    };
    assert_eq!(refusal.rule, Rule::Held);
    (refusal.status, serde_json::from_str(&refusal.body).unwrap())
}

#[test]
fn reads_held_for_the_head_are_bounded_per_identity_and_per_worker_and_all_come_back() {
    let mut r = registry(
        r#"{"maxInflight": 8, "maxHeld": 8, "maxHeldPerIdentity": 3,
            "dedup": {}, "cache": {"latest": true}}"#,
    );
    for id in 1..=3 {
        assert_eq!(
            send_as(&mut r, id, &mut named(7), &number_call(id)),
            Then::Pause
        );
    }
    let (status, body) = refused_by_held(send_as(&mut r, 4, &mut named(7), &number_call(4)));
    assert_eq!(
        (status, &body["id"]),
        (429, &json!(4)),
        "its own id: {body}"
    );
    assert_eq!(body["error"]["data"]["limit"], 3);
    // Callers QoS did not name fill the default class's three quarters.
    for id in 5..=7 {
        assert_eq!(
            send_as(&mut r, id, &mut Caller::default(), &number_call(id)),
            Then::Pause
        );
    }
    let (status, _) = refused_by_held(send_as(&mut r, 8, &mut Caller::default(), &number_call(8)));
    assert_eq!(status, 503);
    assert_eq!((r.worker.counts.held, r.worker.counts.held_refused), (6, 2));
    // The head comes: every held read is answered, and nothing is held.
    let (poll, _) = r.next_callout().unwrap();
    assert_eq!(poll, HEAD_POLL);
    r.sent(poll, Ok(9));
    r.callout_ended(9, Some(head_answer("0x10", &hash("aa"))));
    let answered: Vec<u32> = answers(&r.take(0).0).iter().map(|(id, _)| *id).collect();
    assert_eq!(answered, [1, 2, 3, 5, 6, 7]);
    for id in 1..=8 {
        r.done(id);
    }
    assert_eq!(r.worker.counts.held, 0);
    assert_eq!(
        send_as(&mut r, 9, &mut named(7), &number_call(9)),
        Then::Pause
    );
}

#[test]
fn a_request_refused_past_the_bound_leaves_its_answers_key_to_the_others() {
    let mut r = registry(r#"{"maxInflight": 8, "maxHeldPerIdentity": 1, "dedup": {}}"#);
    assert_eq!(
        send_as(&mut r, 1, &mut named(7), CALL),
        Then::Pause,
        "leads"
    );
    assert_eq!(
        send_as(&mut r, 2, &mut named(7), CALL),
        Then::Pause,
        "waits"
    );
    let (status, _) = refused_by_held(send_as(&mut r, 3, &mut named(7), CALL));
    assert_eq!(status, 429);
    r.done(3);
    assert_eq!(
        send_as(&mut r, 4, &mut named(8), CALL),
        Then::Pause,
        "another waits"
    );
    let (id, _) = r.next_callout().unwrap();
    r.sent(id, Ok(40));
    let node = br#"{"jsonrpc":"2.0","id":1,"result":"0x2a"}"#;
    r.callout_ended(40, Some(answered(node)));
    let answered: Vec<u32> = answers(&r.take(0).0).iter().map(|(id, _)| *id).collect();
    assert_eq!(answered, [1, 2, 4]);
    assert_eq!(
        r.worker.counts.held, 0,
        "the leader is not held, its waiters were"
    );
}

#[test]
fn a_request_refused_instead_of_waiting_for_a_slot_stops_waiting() {
    let policy = r#"{"maxInflight": 1, "decideOnBody": true, "maxHeldPerIdentity": 1,
        "nodeTime": {"cheapSlots": 0, "waitMs": 1000}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    at_ms(1000);
    let proof = |id| call(id, "eth_getProof");
    assert_eq!(send_as(&mut r, 1, &mut named(7), &proof(1)), Then::Continue);
    assert_eq!(send_as(&mut r, 2, &mut named(7), &proof(2)), Then::Pause);
    let (status, _) = refused_by_held(send_as(&mut r, 3, &mut named(7), &proof(3)));
    assert_eq!(status, 429);
    assert_eq!(r.worker.counts.node_time.waiting, 1, "only 2 waits");
    r.done(3);
    r.response_headers(1, true, ok);
    r.done(1);
    assert_eq!(r.take(0).0, [Do::Resume(2, None)]);
    assert_eq!(r.worker.counts.held, 0);
}
