//! Coalescing in the compiled admission gate, in the offline host: a
//! request that leads its key is sent as a callout and held; identical
//! ones wait, on any worker, and get its answer with their own ids; a
//! failed leader hands over; an answer a client gave up on is kept for its
//! retry; a lost leader is replaced; and what passes unchecked.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use stakegate_host::{Callout, Host, LocalReply, Reply, Request, RequestId};
use std::time::Duration;

fn gate(dedup: &str, workers: usize) -> Host {
    let module = stakegate_stack::paths::wasm_module("admission_gate").expect("make build");
    let policy = format!(
        r#"{{"maxInflight": 10000, "dedup": {dedup},
            "classes": {{"internal": [{{"listenerMetadata": "internal"}}]}}}}"#
    );
    Host::new(&std::fs::read(module).unwrap(), policy.as_bytes(), workers).unwrap()
}

fn call(id: u64, params: &str) -> Request {
    Request::json_rpc(&format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call","params":[{params},"latest"]}}"#
    ))
}

fn sent(host: &mut Host, worker: usize, request: &Request) -> RequestId {
    match host.request(worker, request).unwrap() {
        Reply::Continue(id) => id,
        other => panic!("expected it through, got {other:?}"),
    }
}

fn held(host: &mut Host, worker: usize, request: &Request) -> RequestId {
    match host.request(worker, request).unwrap() {
        Reply::Held(id) => id,
        other => panic!("expected it held, got {other:?}"),
    }
}

fn replied(reply: &Reply) -> &LocalReply {
    match reply {
        Reply::LocalReply(reply) => reply,
        other => panic!("expected a local reply, got {other:?}"),
    }
}

fn json(reply: &LocalReply) -> serde_json::Value {
    serde_json::from_slice(&reply.body).unwrap()
}

/// The one callout made since the last call.
fn callout(host: &mut Host) -> Callout {
    let mut callouts = host.take_callouts();
    assert_eq!(callouts.len(), 1, "{callouts:?}");
    callouts.remove(0)
}

fn answer(id: u64) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"0xabc"}}"#).into_bytes()
}

fn stat(host: &Host, name: &str) -> i64 {
    host.metric(&format!("stakegate.gate.dedup.{name}"))
}

#[test]
fn identical_requests_on_every_worker_get_the_leaders_answer_with_their_ids() {
    let mut host = gate("{}", 2);
    let leader = held(&mut host, 0, &call(1, r#"{"data":"0x01"}"#));
    let sent = callout(&mut host);
    assert_eq!(sent.cluster, "rpc_node");
    assert_eq!(sent.body, call(1, r#"{"data":"0x01"}"#).body);
    // Retries with new ids and other spacing, on both workers.
    let waiters = [
        held(&mut host, 1, &call(2, r#"{ "data" : "0x01" }"#)),
        held(&mut host, 0, &call(3, r#"{"data":"0x01"}"#)),
    ];
    assert!(host.take_callouts().is_empty(), "one call for all of them");
    // Other params are another request.
    let other = held(&mut host, 1, &call(4, r#"{"data":"0x02"}"#));
    let _ = callout(&mut host);
    host.answer_callout(&sent, Some((200, answer(1)))).unwrap();
    let mut settled = host.take_settled();
    settled.sort_by_key(|(id, _)| format!("{id:?}"));
    let ids: Vec<RequestId> = settled.iter().map(|(id, _)| *id).collect();
    let mut expected = vec![leader, waiters[0], waiters[1]];
    expected.sort_by_key(|id| format!("{id:?}"));
    assert_eq!(ids, expected);
    for (id, reply) in &settled {
        let reply = replied(reply);
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("content-type"), Some("application/json"));
        let want = if *id == leader {
            1
        } else if *id == waiters[0] {
            2
        } else {
            3
        };
        assert_eq!(json(reply)["id"], want);
        assert_eq!(json(reply)["result"], "0xabc");
    }
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(stat(&host, "led"), 2);
    assert_eq!(stat(&host, "coalesced"), 2);
    assert_eq!(stat(&host, "shared"), 2);
    assert_eq!(stat(&host, "waiting"), 1, "{other:?} still waits");
    // Held requests hold no gate slot; the leader's callout gave its back.
    assert_eq!(host.metric("stakegate.gate.inflight.default"), 1);
}

#[test]
fn a_failed_leader_hands_over_and_an_answer_given_up_on_is_kept_for_the_retry() {
    let mut host = gate(r#"{"windowMs": 3000}"#, 2);
    let request = |id| call(id, r#"{"data":"0x01"}"#);
    let leader = held(&mut host, 0, &request(1));
    let first = callout(&mut host);
    let waiter = held(&mut host, 1, &request(2));
    // The callout fails (no answer): the leader's client gets 502 with its
    // id, and the waiter on the other worker leads with a callout of its own.
    host.answer_callout(&first, None).unwrap();
    let settled = host.take_settled();
    assert_eq!(settled.len(), 1, "{settled:?}");
    assert_eq!(settled[0].0, leader);
    let reply = replied(&settled[0].1);
    assert_eq!((reply.status, json(reply)["id"].clone()), (502, 1.into()));
    let second = callout(&mut host);
    assert_eq!(second.body, request(2).body);
    // Its client gives up; the answer comes after: kept, and the retry
    // takes it without a call.
    host.abort(waiter).unwrap();
    host.answer_callout(&second, Some((200, answer(2))))
        .unwrap();
    let retry = host.request(0, &request(3)).unwrap();
    let reply = replied(&retry);
    assert_eq!((reply.status, json(reply)["id"].clone()), (200, 3.into()));
    assert!(host.take_callouts().is_empty());
    host.advance(Duration::from_secs(1)).unwrap();
    for (name, count) in [
        ("handed_over", 1),
        ("woken_by_failure", 1),
        ("callouts_failed", 1),
        ("kept", 1),
        ("taken", 1),
        ("left", 1),
        ("waiting", 0),
    ] {
        assert_eq!(stat(&host, name), count, "{name}");
    }
}

#[test]
fn a_request_led_by_a_vanished_worker_is_led_again() {
    let mut host = gate(r#"{"windowMs": 2000}"#, 2);
    let request = call(1, r#"{"data":"0x01"}"#);
    held(&mut host, 0, &request);
    let _lost = callout(&mut host);
    // Worker 0's VM vanishes: its callout's answer never comes.
    host.remove_worker(0).unwrap();
    let waiter = held(&mut host, 1, &request);
    // Once the window is over and worker 0 has missed its heartbeats, the
    // waiter's own check on the heartbeat makes it lead.
    host.advance(Duration::from_secs(4)).unwrap();
    let again = callout(&mut host);
    host.answer_callout(&again, Some((200, answer(1)))).unwrap();
    let settled = host.take_settled();
    assert_eq!(settled.len(), 1);
    assert_eq!(settled[0].0, waiter);
    assert_eq!(replied(&settled[0].1).status, 200);
}

#[test]
fn past_max_waiters_a_request_gets_429() {
    let mut host = gate(r#"{"maxWaiters": 2}"#, 1);
    let request = call(1, r#"{"data":"0x01"}"#);
    held(&mut host, 0, &request);
    held(&mut host, 0, &request);
    let reply = host.request(0, &request).unwrap();
    let reply = replied(&reply);
    assert_eq!(
        (reply.status, reply.header("retry-after")),
        (429, Some("1"))
    );
    assert_eq!(json(reply)["error"]["code"], -32005);
}

#[test]
fn large_bodies_polls_and_internal_traffic_pass_unchecked() {
    let mut host = gate(r#"{"windowMs": 5000, "maxBodyBytes": 200}"#, 1);
    let large = call(1, &format!(r#"{{"data":"0x{}"}}"#, "ab".repeat(200)));
    let poll =
        Request::json_rpc(r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber","params":[]}"#);
    let internal = call(1, r#"{"data":"0x01"}"#).listener_class("internal");
    let garbage = Request::json_rpc("{not json");
    for request in [&large, &poll, &internal, &garbage] {
        for _ in 0..2 {
            sent(&mut host, 0, request);
        }
    }
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(stat(&host, "too_large"), 2);
    assert_eq!(stat(&host, "skipped"), 4);
    assert_eq!(stat(&host, "led"), 0);
    assert!(host.take_callouts().is_empty());
}

#[test]
fn the_same_signed_transaction_is_one_request_whoever_sends_it() {
    let mut host = gate("{}", 2);
    let tx = |from: &str| {
        Request::json_rpc(
            r#"{"jsonrpc":"2.0","id":9,"method":"eth_sendRawTransaction","params":["0xf86b0a"]}"#,
        )
        .property(&["source", "address"], from.as_bytes())
    };
    held(&mut host, 0, &tx("192.0.2.1:1000"));
    held(&mut host, 1, &tx("198.51.100.7:2000"));
    assert_eq!(host.take_callouts().len(), 1);
    // eth_call is per client.
    let request = call(1, r#"{"data":"0x01"}"#);
    held(&mut host, 0, &request.clone().header("x-api-key", "alice"));
    held(&mut host, 0, &request.clone().header("x-api-key", "bob"));
    held(&mut host, 1, &request.header("x-api-key", "alice"));
    assert_eq!(host.take_callouts().len(), 2);
}

/// Random distinct requests each lead; sent again while in flight, every
/// one waits, and no other call is made.
#[test]
fn random_requests_coalesce_only_when_identical() {
    let mut host = gate(r#"{"maxEntries": 8192}"#, 4);
    let mut rng = SmallRng::seed_from_u64(5);
    let methods = ["eth_call", "eth_getLogs", "eth_getBalance", "eth_getProof"];
    let mut seen = std::collections::BTreeSet::new();
    let mut requests = Vec::new();
    while requests.len() < 2000 {
        let method = methods[rng.random_range(0..methods.len())];
        let params = match rng.random_range(0..3) {
            0 => format!(r#"["0x{:x}","latest"]"#, rng.random_range(0..4000u32)),
            1 => format!(
                r#"[{{"fromBlock":{},"toBlock":"latest"}}]"#,
                rng.random_range(0..4000u32)
            ),
            _ => format!("[{}]", rng.random_range(0..4000u32)),
        };
        if seen.insert((method, params.clone())) {
            requests.push(Request::json_rpc(&format!(
                r#"{{"jsonrpc":"2.0","id":{},"method":"{method}","params":{params}}}"#,
                requests.len()
            )));
        }
    }
    for request in &requests {
        held(&mut host, rng.random_range(0..4), request);
    }
    assert_eq!(host.take_callouts().len(), requests.len());
    for request in &requests {
        held(&mut host, rng.random_range(0..4), request);
    }
    assert!(host.take_callouts().is_empty());
}

#[test]
fn coalescing_stands_by_while_the_node_answers_quickly_and_engages_when_one_stays() {
    let mut host = gate(r#"{"engageAfterMs": 100, "standbyAfterMs": 1000}"#, 2);
    // Engaged from the start: the first request leads by callout.
    let first = held(&mut host, 0, &call(1, r#"{"data":"0x01"}"#));
    let first_call = callout(&mut host);
    host.answer_callout(&first_call, Some((200, answer(1))))
        .unwrap();
    assert_eq!(host.take_settled()[0].0, first);
    // A second with nothing slow at the node: it stands by, on both
    // workers, and quick answers (each gone within a tick) keep it so.
    host.advance(Duration::from_millis(1200)).unwrap();
    for i in 0..12 {
        let id = sent_through(&mut host, i % 2, 10 + i as u64);
        host.finish(id, 200, Duration::from_millis(1)).unwrap();
        host.advance(Duration::from_millis(100)).unwrap();
    }
    assert_eq!(stat(&host, "engaged"), 0);
    // Identical requests now both go to the node by the route, unchecked.
    let a = sent(&mut host, 0, &call(30, r#"{"data":"0x02"}"#));
    let b = sent(&mut host, 1, &call(31, r#"{"data":"0x02"}"#));
    assert!(host.take_callouts().is_empty());
    // One of them stays at the node: a tick later it is 100 ms old, and
    // coalescing engages on every worker.
    host.finish(b, 200, Duration::from_millis(1)).unwrap();
    host.advance(Duration::from_millis(250)).unwrap();
    assert_eq!(stat(&host, "engaged"), 1);
    let retry = held(&mut host, 1, &call(32, r#"{"data":"0x03"}"#));
    let led = callout(&mut host);
    let twin = held(&mut host, 0, &call(33, r#"{"data":"0x03"}"#));
    assert!(host.take_callouts().is_empty(), "the twin waits for it");
    host.answer_callout(&led, Some((200, answer(32)))).unwrap();
    let settled: Vec<RequestId> = host.take_settled().iter().map(|(id, _)| *id).collect();
    assert!(settled.contains(&retry) && settled.contains(&twin));
    host.finish(a, 200, Duration::from_millis(1)).unwrap();
    host.advance(Duration::from_secs(1)).unwrap();
    let standing_by = stat(&host, "standing_by");
    assert_eq!(standing_by, 14, "12 quick requests and the two twins");
}

/// A request with params of its own, let through the route.
fn sent_through(host: &mut Host, worker: usize, id: u64) -> RequestId {
    sent(
        host,
        worker,
        &call(id, &format!(r#"{{"data":"0x{id:x}"}}"#)),
    )
}
