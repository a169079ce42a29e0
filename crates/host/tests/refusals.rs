//! Every rule that refuses a request, walked with the compiled filters in
//! the offline host: each refusal names its rule in `x-stakegate-rule` and
//! in the JSON-RPC error's `data` (with its `retryAfter` equal to the
//! `retry-after` header), and a 429 of stake QoS carries `RateLimit`
//! headers of the limit that refused it and no other
//! (policies/refusals.md).

use stakegate_core::rejection::Rule;
use stakegate_host::{Host, LocalReply, Reply, Request};
use std::collections::BTreeSet;
use std::time::Duration;

const CALL: &str =
    r#"{"jsonrpc":"2.0","id":7,"method":"eth_call","params":[{"data":"0x01"},"latest"]}"#;

fn host(module: &str, policy: &str) -> Host {
    let module = stakegate_stack::paths::wasm_module(module).expect("make build");
    Host::new(&std::fs::read(module).unwrap(), policy.as_bytes(), 1).unwrap()
}

/// A WebSocket upgrade (`method` GET for a real one) with a byte of body,
/// so that its headers do not end the stream, as in Envoy.
fn upgrade(method: &str) -> Request {
    let mut request = Request::json_rpc("x");
    request.headers.retain(|(name, _)| name != ":method");
    request
        .header(":method", method)
        .header("upgrade", "websocket")
        .header("connection", "upgrade")
}

/// Checks `reply` is `rule`'s refusal, explained; returns its error data.
fn explained(reply: &Reply, status: u32, rule: Rule) -> serde_json::Value {
    let Reply::LocalReply(reply) = reply else {
        panic!("{rule:?}: expected a refusal, got {reply:?}");
    };
    assert_eq!(reply.status, status, "{rule:?}");
    assert_eq!(reply.header("x-stakegate-rule"), Some(rule.name()));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    let data = body["error"]["data"].clone();
    assert_eq!(data["rule"], rule.name(), "{body}");
    let retry_after = reply
        .header("retry-after")
        .map(|s| s.parse::<u64>().unwrap());
    assert_eq!(
        data["retryAfter"].as_u64().filter(|s| *s > 0),
        retry_after,
        "{body}"
    );
    if status == 429 && [Rule::StakeShare, Rule::Concurrency, Rule::Websockets].contains(&rule) {
        ratelimit_names_the_rule(reply, rule);
    }
    data
}

fn ratelimit_names_the_rule(reply: &LocalReply, rule: Rule) {
    let quoted = format!("\"{}\";", rule.name());
    for header in ["ratelimit-policy", "ratelimit"] {
        let value = reply
            .header(header)
            .unwrap_or_else(|| panic!("no {header}"));
        assert!(value.starts_with(&quoted), "{header}: {value}");
    }
    let policy = reply.header("ratelimit-policy").unwrap();
    let unit = if rule == Rule::StakeShare {
        ";w=1"
    } else {
        "qu=\"concurrent-requests\""
    };
    assert!(policy.contains(unit), "{policy}");
}

fn through(reply: Reply) -> stakegate_host::RequestId {
    match reply {
        Reply::Continue(id) => id,
        other => panic!("expected it through, got {other:?}"),
    }
}

#[test]
fn every_rule_names_itself_and_its_limit() {
    let mut walked = BTreeSet::new();
    let mut walk = |rule: Rule| walked.insert(rule.name());

    // The gate: in flight, WebSockets, identical requests waiting, a
    // request that can never be served.
    let mut gate = host(
        "admission_gate",
        r#"{"maxInflight": 1, "maxWebsocketConnections": 1}"#,
    );
    let first = through(gate.request(0, &Request::json_rpc(CALL)).unwrap());
    let data = explained(
        &gate.request(0, &Request::json_rpc(CALL)).unwrap(),
        503,
        Rule::GateInflight,
    );
    assert_eq!(
        (data["inFlight"].as_u64(), data["limit"].as_u64()),
        (Some(1), Some(1))
    );
    walk(Rule::GateInflight);
    gate.finish(first, 200, Duration::from_millis(1)).unwrap();
    let _socket = through(gate.request(0, &upgrade("GET")).unwrap());
    let data = explained(
        &gate.request(0, &upgrade("GET")).unwrap(),
        503,
        Rule::GateWebsockets,
    );
    assert_eq!(data["limit"], 1);
    walk(Rule::GateWebsockets);
    explained(
        &gate.request(0, &upgrade("POST")).unwrap(),
        400,
        Rule::InvalidRequest,
    );
    walk(Rule::InvalidRequest);

    let mut dedup = host(
        "admission_gate",
        r#"{"maxInflight": 100, "dedup": {"maxWaiters": 1}}"#,
    );
    assert!(matches!(
        dedup.request(0, &Request::json_rpc(CALL)).unwrap(),
        Reply::Held(_)
    ));
    let data = explained(
        &dedup.request(0, &Request::json_rpc(CALL)).unwrap(),
        429,
        Rule::DedupWaiters,
    );
    assert_eq!(data["limit"], 1);
    walk(Rule::DedupWaiters);

    // One request may be held on the worker: the leader is not held, its
    // first waiter is, the next is refused.
    let mut held = host(
        "admission_gate",
        r#"{"maxInflight": 100, "maxHeld": 1, "dedup": {}}"#,
    );
    for _ in 0..2 {
        let reply = held.request(0, &Request::json_rpc(CALL)).unwrap();
        assert!(matches!(reply, Reply::Held(_)), "{reply:?}");
    }
    let data = explained(
        &held.request(0, &Request::json_rpc(CALL)).unwrap(),
        503,
        Rule::Held,
    );
    assert_eq!((&data["inFlight"], &data["limit"]), (&1.into(), &1.into()));
    walk(Rule::Held);

    // Stake QoS: its share, its concurrency allowance, its WebSockets. A
    // staked client floods a capacity of 20 calls a second.
    let key = "desk-7-key";
    let hash = stakegate_core::request::sha256_hex(key.as_bytes());
    let mut qos = host(
        "stake_qos",
        &format!(
            r#"{{"capacityRps": 20, "identifyAbove": 0, "websocketsPerIdentity": 1,
                "concurrency": {{"floor": 1, "headroom": 0}},
                "stakes": [{{"apiKeySha256": "{hash}", "name": "desk-7", "stake": 5000}}]}}"#
        ),
    );
    let call = || Request::json_rpc(CALL).header("x-api-key", key);
    // Each answered a millisecond later, so QoS learns its latency.
    let mut shared = None;
    let mut pending = None;
    for _ in 0..2000 {
        qos.advance(Duration::from_millis(1)).unwrap();
        if let Some(id) = pending.take() {
            qos.finish(id, 200, Duration::from_millis(1)).unwrap();
        }
        match qos.request(0, &call()).unwrap() {
            Reply::Continue(id) => pending = Some(id),
            refused => {
                shared = Some(explained(&refused, 429, Rule::StakeShare));
                break;
            }
        }
    }
    let data = shared.expect("the flood is throttled by its share");
    assert_eq!(data["identity"], "desk-7");
    assert!(
        data["share"].as_f64().unwrap() > 0.0 && data["rate"].as_f64().unwrap() > 0.0,
        "{data}"
    );
    walk(Rule::StakeShare);
    // Past the round, a lease holds calls again: one in flight is all its
    // allowance at this share and latency, so a second at once is refused.
    let mut concurrency = None;
    for _ in 0..2000 {
        qos.advance(Duration::from_millis(1)).unwrap();
        if let Some(id) = pending.take() {
            qos.finish(id, 200, Duration::from_millis(1)).unwrap();
        }
        if let Reply::Continue(held) = qos.request(0, &call()).unwrap() {
            let second = qos.request(0, &call()).unwrap();
            pending = Some(held);
            if let Reply::LocalReply(reply) = &second {
                if reply.header("x-stakegate-rule") == Some(Rule::Concurrency.name()) {
                    concurrency = Some(explained(&second, 429, Rule::Concurrency));
                    break;
                }
            }
        }
    }
    let data = concurrency.expect("a second request at once is refused by the allowance");
    assert_eq!(data["limit"], 1);
    walk(Rule::Concurrency);
    if let Some(id) = pending.take() {
        qos.finish(id, 200, Duration::from_millis(1)).unwrap();
    }
    let socket = |qos: &mut Host| {
        qos.request(0, &upgrade("GET").header("x-api-key", key))
            .unwrap()
    };
    let mut sockets = Vec::new();
    let mut refused = None;
    for _ in 0..20 {
        qos.advance(Duration::from_millis(50)).unwrap();
        match socket(&mut qos) {
            Reply::Continue(id) => sockets.push(id),
            Reply::LocalReply(reply) if reply.header("x-stakegate-rule") == Some("websockets") => {
                refused = Some(Reply::LocalReply(reply));
                break;
            }
            Reply::LocalReply(reply) => {
                eprintln!("upgrade: {:?}", reply.header("x-stakegate-rule"))
            }
            Reply::Held(_) => panic!("QoS held an upgrade"),
        }
    }
    let refused =
        refused.unwrap_or_else(|| panic!("no refusal for WebSockets: {} open", sockets.len()));
    assert_eq!(sockets.len(), 1, "one socket open, the next refused");
    explained(&refused, 429, Rule::Websockets);
    walk(Rule::Websockets);

    // A subscribe past its bound is refused on its socket, not with a
    // status: its JSON-RPC error names the rule (the gate's WebSocket
    // tests, and tests/real_envoy/floods.rs through Envoy).
    let every: BTreeSet<&str> = Rule::ALL
        .iter()
        .filter(|r| **r != Rule::Subscriptions)
        .map(|r| r.name())
        .collect();
    assert_eq!(walked, every, "every rule walked");
}
