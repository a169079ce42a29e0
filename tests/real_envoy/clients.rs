//! Real client libraries (web3.py, viem, ethers; versions pinned in
//! clients/) through the whole gateway in front of a real node (anvil):
//! every everyday operation, over HTTP and WebSocket, gives what it gives
//! straight at the node.

use serde_json::{json, Value};
use stakegate_stack::{http, Anvil, Envoy};
use stakegate_tests::{
    assert_refused_call_by_call, client_script, eventually, example_policy, gateway_on_one_worker,
    json_output, start_initialised, SETTLE,
};
use std::io::Write;
use std::process::Command;

/// The gateway as an operator makes it: `stakegate init` in front of
/// `anvil` (both example policies, dedup on), then Envoy from what it
/// wrote. The directory must outlive Envoy.
fn gateway(anvil: &Anvil) -> (Envoy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let gate_policy = dir.path().join("gate.json");
    let qos_policy = dir.path().join("qos.json");
    std::fs::write(
        &gate_policy,
        example_policy("admission-gate", json!({ "dedup": {} })),
    )
    .unwrap();
    std::fs::write(&qos_policy, example_policy("stake-qos", json!({}))).unwrap();
    let envoy = start_initialised(dir.path(), anvil.addr(), &gate_policy, &qos_policy);
    (envoy, dir)
}

/// The command that runs `library`'s script (clients/ops.*) with `args`.
pub(crate) fn library(name: &str, args: &[&str]) -> Command {
    let script = if name == "web3.py" {
        "ops.py"
    } else {
        "ops.mjs"
    };
    let mut command = client_script(script, name);
    command.args(args);
    command
}

pub(crate) const LIBRARIES: [&str; 3] = ["web3.py", "viem", "ethers"];

/// `library`'s operations against one endpoint, from one chain state:
/// anvil is snapshotted before and reverted after, so runs compare.
fn operations(anvil: &Anvil, name: &str, http: &str, ws: &str) -> Value {
    let snapshot = anvil.call("evm_snapshot", "[]").unwrap();
    let output = library(name, &[http, ws]).output().unwrap();
    assert!(
        anvil
            .call("evm_revert", &format!("[{snapshot}]"))
            .unwrap()
            .as_bool()
            .unwrap(),
        "anvil reverted to its snapshot"
    );
    assert!(
        output.status.success(),
        "{name} at {http}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn web3py_viem_and_ethers_get_through_the_gateway_what_they_get_from_the_node() {
    let anvil = Anvil::start().unwrap();
    let (envoy, _dir) = gateway(&anvil);
    let node = anvil.addr();
    let public = envoy.listener("public").unwrap();
    for name in LIBRARIES {
        // The whole run's time, receipt wait included, is printed beside
        // (a figure, not a check: this machine is shared).
        let started = std::time::Instant::now();
        let direct = operations(
            &anvil,
            name,
            &format!("http://{node}"),
            &format!("ws://{node}"),
        );
        let direct_ms = started.elapsed().as_millis();
        let started = std::time::Instant::now();
        let through = operations(
            &anvil,
            name,
            &format!("http://{public}"),
            &format!("ws://{public}"),
        );
        let through_ms = started.elapsed().as_millis();
        eprintln!("{name}: {through}");
        eprintln!("{name}: straight {direct_ms} ms, through the gateway {through_ms} ms");
        assert_eq!(
            through, direct,
            "{name}: through the gateway, then straight"
        );
        // What each run did, so an empty answer cannot pass.
        assert_eq!(direct["chainId"], 31337, "{name}");
        assert_eq!(direct["call"], "0x1234", "{name}");
        assert_eq!(direct["transaction"]["status"], "success", "{name}");
        assert_eq!(direct["ws"]["newHead"], true, "{name}");
    }
}

/// ethers over its share at QoS: `CALLS` balance reads at once through the
/// gateway `stakegate init` writes (the example policies, dedup and cache
/// on; QoS at `CAPACITY` rps and identifying every request, so that one
/// client is over its share). ethers reads `retry-after` as milliseconds
/// and retries a 429 twelve times within milliseconds; the gateway holds a
/// request sent again before its time until then (`qos::early`), so every
/// call is answered, in at most four attempts, and each answer after a 429
/// comes no sooner than the `retry-after` it gave.
#[test]
fn ethers_over_its_share_is_answered_no_sooner_than_retry_after_meant() {
    const CALLS: usize = 40;
    // Half the calls sent at once: over its share however slowly the
    // machine sends them (at 40, a busy machine's 40 stayed under it).
    const CAPACITY: u32 = 20;
    let anvil = Anvil::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate_policy = dir.path().join("gate.json");
    let qos_policy = dir.path().join("qos.json");
    // The gate's slots are not what is tried here: the reads at once would
    // take its six public ones (anvil answers each in about a millisecond).
    std::fs::write(
        &gate_policy,
        example_policy("admission-gate", json!({ "maxInflight": 64 })),
    )
    .unwrap();
    let small = json!({ "capacityRps": CAPACITY, "identifyAbove": 0, "throttleThreshold": 0.01 });
    std::fs::write(&qos_policy, example_policy("stake-qos", small)).unwrap();
    let envoy = start_initialised(dir.path(), anvil.addr(), &gate_policy, &qos_policy);
    let url = envoy.url("public").unwrap();
    let stat = |name: &str| {
        envoy
            .stat(&format!("wasmcustom.stakegate.qos.{name}"))
            .unwrap()
    };
    // This client (its address) is over its share: new requests until QoS
    // throttles and refuses one.
    let refused = (0..2000).any(|i| {
        let body = format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_chainId"}}"#);
        http::post(&url, &[], &body).unwrap().status == 429
    });
    assert!(refused && stat("throttling") == 1, "QoS throttles");
    let calls = json_output(&mut library(
        "ethers",
        &["limited", &url, &CALLS.to_string()],
    ));
    let calls = calls.as_array().unwrap();
    assert_eq!(calls.len(), CALLS);
    let mut least_wait = i64::MAX;
    for call in calls {
        assert_eq!(call["error"], Value::Null, "{call}");
        let refusals = call["refused"].as_array().unwrap();
        let sent = call["sent"].as_u64().unwrap();
        assert_eq!(sent, refusals.len() as u64 + 1, "{call}");
        assert!(sent <= 4, "{sent} attempts: {call}");
        // Each 429 is followed, no sooner than its retry-after, by the next
        // answer: another 429 or the balance. (250 ms allow for the two
        // answers' ways to the client.)
        let next = refusals
            .iter()
            .skip(1)
            .map(|r| &r["ms"])
            .chain([&call["answeredMs"]]);
        for (refusal, next) in refusals.iter().zip(next) {
            assert_eq!(refusal["status"], 429, "{call}");
            let retry_after_ms = 1000 * refusal["retryAfter"].as_i64().unwrap();
            let waited = next.as_i64().unwrap() - refusal["ms"].as_i64().unwrap();
            least_wait = least_wait.min(waited - retry_after_ms);
            assert!(waited >= retry_after_ms - 250, "{call}");
        }
    }
    let refusals: usize = calls
        .iter()
        .map(|c| c["refused"].as_array().unwrap().len())
        .sum();
    let most = calls.iter().map(|c| c["sent"].as_u64().unwrap()).max();
    let most = most.unwrap_or(0);
    let last = calls
        .iter()
        .map(|c| c["answeredMs"].as_u64().unwrap())
        .max()
        .unwrap_or(0);
    let held = stat("retries_held");
    eprintln!(
        "ethers: {CALLS} of {CALLS} answered; {refusals} × 429, each retry held ({held}); \
         at most {most} attempts; least wait after a 429 beyond its retry-after {least_wait} ms; \
         last answer at {last} ms"
    );
    // Without the hold, ethers sent a refused call again within
    // milliseconds, up to twelve times, and its caller got an error.
    assert!(refusals > 0, "some calls were refused");
    assert_eq!(held, refusals as i64, "every retry of a 429 was held");
}

/// Sends `body` to `addr` (named in its host, as the libraries do: the host is
/// part of what makes two calls the same) and never reads the answer: the
/// request stays in flight until the socket is dropped.
fn in_flight(addr: std::net::SocketAddr, body: &str) -> std::net::TcpStream {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "POST / HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}

#[test]
fn under_overload_each_library_is_given_our_error_and_retries_as_measured() {
    // Two slots and dedup; the node takes two minutes over test_hold (a
    // method of the test's, which dedup leaves alone, so a dropped client
    // cancels it), and 8 s over eth_getLogs.
    // One Envoy worker, so that a slot given back is at once the next
    // request's (with more, a worker's spare slot moves at its heartbeat).
    // Nothing drains, so the gate's retry-after grows to its cap, the
    // default's 3 s.
    let (node, envoy) = gateway_on_one_worker(
        &example_policy("stake-qos", json!({})),
        // Coalescing stays engaged from the start (it would from the first
        // held call on; this takes the start's timing out of the test).
        r#"{"maxInflight": 2, "dedup": {"standbyAfterMs": 600000}, "decideOnBody": true}"#,
        &["--cost", "test_hold=120s", "--cost", "eth_getLogs=8s"],
    );
    let public = envoy.listener("public").unwrap();
    let url = format!("http://{public}");
    let at_node = |n: u64| eventually(SETTLE, || node.metrics().is_ok_and(|m| m["inflight"] == n));
    let answered = |class: &str| {
        envoy
            .stat(&format!("http.public.downstream_rq_{class}"))
            .unwrap()
    };
    let mut table =
        String::from("library | call | gateway's answer | attempts | given | after ms\n");
    let mut run = |name: &str, what: &str, class: &str, expected: &[&str]| {
        let before = answered(class);
        let output = library(name, &["overload", &url, what]).output().unwrap();
        assert!(
            output.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let outcome: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
            panic!(
                "{name} {what}: {e}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
        });
        let attempts = answered(class) - before;
        table += &format!(
            "{name} | {what} | {class} | {attempts} | {} | {}\n",
            outcome["error"], outcome["ms"]
        );
        eprintln!("{table}");
        let error = outcome["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} {what}: an answer: {outcome}"));
        // The caller is told the gateway's answer, in the library's words:
        // the status, or the JSON-RPC error.
        assert!(
            expected.iter().any(|s| error.contains(s)),
            "{name} {what}: {error}"
        );
        // Every library stops by itself (ethers' most is 12 attempts).
        assert!(
            (1..=12).contains(&attempts),
            "{name} {what}: {attempts} attempts"
        );
    };

    // Requests held at the node; each set is dropped before Envoy's 60 s
    // route timeout could end it.
    let hold = |method: &str, params: &[String]| {
        let held: Vec<_> = params
            .iter()
            .map(|p| {
                in_flight(
                    public,
                    &format!(r#"{{"jsonrpc":"2.0","id":1,"method":"{method}","params":[{p}]}}"#),
                )
            })
            .collect();
        assert!(at_node(params.len() as u64));
        held
    };
    // Dedup: the same eth_getLogs is in flight, so each library's call
    // waits for it at the gateway and is given its answer: no refusal, and
    // one call at the node for both.
    for name in LIBRARIES {
        assert!(at_node(0));
        let _original = hold("eth_getLogs", &["{}".to_string()]);
        let output = library(name, &["overload", &url, "duplicate"])
            .output()
            .unwrap();
        let outcome: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("{name}: {e}: {}", String::from_utf8_lossy(&output.stderr)));
        assert_eq!(outcome["error"], Value::Null, "{name}: {outcome}");
        eprintln!(
            "{name} | duplicate | 200, the original's answer | 1 | {} | {}",
            outcome["result"], outcome["ms"]
        );
    }
    assert!(eventually(SETTLE, || {
        envoy
            .stat("wasmcustom.stakegate.gate.dedup.shared")
            .unwrap()
            == 3
    }));
    assert!(at_node(0));
    let served = node.metrics().unwrap()["served"].clone();
    assert_eq!(served, json!({"eth_getLogs": 3}), "one call for each pair");
    let batch_of = |method: &str| {
        format!(
            r#"[{{"jsonrpc":"2.0","id":7,"method":"{method}","params":[{{}}]}},{{"jsonrpc":"2.0","id":"b","method":"{method}","params":[{{}}]}}]"#
        )
    };
    // The gate: both slots held.
    for (i, name) in LIBRARIES.iter().enumerate() {
        assert!(at_node(0));
        let _full = hold(
            "test_hold",
            &[format!(r#"{{"n":{i}}}"#), format!(r#"{{"n":{i},"m":1}}"#)],
        );
        for what in ["single", "batch"] {
            run(name, what, "5xx", &["503", "LimitExceeded"]);
        }
        let answer = http::post(&url, &[], &batch_of("eth_chainId")).unwrap();
        assert_refused_call_by_call(&answer, 503, &[json!(7), json!("b")]);
    }
    let served = node.metrics().unwrap()["served"].clone();
    assert_eq!(
        served,
        json!({"eth_getLogs": 3}),
        "nothing else got past the gateway"
    );
}

/// Each library calls a node slower than its 1 s timeout and retries on
/// the timeout (viem and web3.py by themselves; ethers does not retry a
/// timeout, so the program does, as an app would). Through the gateway,
/// with dedup, every retry waits for the first call's answer at the node:
/// each library gets its answer, with no 429 and one call at the node.
#[test]
fn libraries_retrying_into_a_slow_node_get_their_answer_from_one_call() {
    let (node, envoy) = gateway_on_one_worker(
        &example_policy("stake-qos", json!({})),
        r#"{"maxInflight": 64, "dedup": {}, "decideOnBody": true}"#,
        &["--cost", "eth_call=2500ms", "--cost", "test_hold=120s"],
    );
    let public = envoy.listener("public").unwrap();
    let url = format!("http://{public}");
    // The node is slow: a request held there for more than 100 ms engages
    // coalescing.
    let _slow = in_flight(
        public,
        r#"{"jsonrpc":"2.0","id":1,"method":"test_hold","params":[]}"#,
    );
    assert!(eventually(SETTLE, || {
        envoy
            .stat("wasmcustom.stakegate.gate.dedup.engaged")
            .unwrap()
            == 1
    }));
    let answered = || envoy.stat("http.public.downstream_rq_total").unwrap();
    for name in LIBRARIES {
        let before = answered();
        let output = library(name, &["overload", &url, "slow"]).output().unwrap();
        let outcome: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("{name}: {e}: {}", String::from_utf8_lossy(&output.stderr)));
        eprintln!(
            "{name} | slow node, retried | {} attempts at Envoy | {} | {} ms",
            answered() - before,
            outcome["result"],
            outcome["ms"]
        );
        assert_eq!(outcome["error"], Value::Null, "{name}: {outcome}");
        assert!(
            outcome["result"]
                .as_str()
                .is_some_and(|r| r.starts_with("0x")),
            "{name}: {outcome}"
        );
    }
    let status = |class: &str| {
        envoy
            .stat(&format!("http.public.downstream_rq_{class}"))
            .unwrap()
    };
    assert_eq!(
        (status("4xx"), status("5xx")),
        (0, 0),
        "no 429, no 503, nor any other refusal"
    );
    assert!(eventually(SETTLE, || {
        node.metrics().unwrap()["served"]["eth_call"] == 3
    }));
    assert_eq!(
        node.metrics().unwrap()["served"]["eth_call"],
        3,
        "one call at the node for each library, however many retries"
    );
}

/// A dapp's page load: a hundred reads at once on one WebSocket
/// (`asyncio.gather`, `Promise.all`), through the gateway `stakegate init`
/// writes, whose gate admits 6 public calls at a time. Each library gets
/// every answer, the same as straight at anvil: the calls past the slots
/// wait at the gateway, packed, instead of the socket being cut.
#[test]
fn a_hundred_calls_at_once_on_one_websocket_are_all_answered_for_every_library() {
    const CALLS: usize = 100;
    let anvil = Anvil::start().unwrap();
    let (envoy, _dir) = gateway(&anvil);
    let public = envoy.listener("public").unwrap();
    let burst = |name: &str, url: &str| -> Value {
        json_output(&mut library(name, &["burst", url, &CALLS.to_string()]))
    };
    for name in LIBRARIES {
        let direct = burst(name, &format!("ws://{}", anvil.addr()));
        let through = burst(name, &format!("ws://{public}"));
        eprintln!(
            "{name}: {} of {CALLS} answered in {} ms straight, {} in {} ms through the gateway ({})",
            direct["answered"], direct["ms"], through["answered"], through["ms"], through["error"]
        );
        assert_eq!(
            direct["answered"], CALLS,
            "{name} straight: {}",
            direct["error"]
        );
        assert_eq!(through["answered"], CALLS, "{name}: {}", through["error"]);
        assert_eq!(through["balances"], direct["balances"], "{name}");
    }
    let stat = |name: &str| {
        envoy
            .stat(&format!("wasmcustom.stakegate.gate.websocket.{name}"))
            .unwrap()
    };
    assert!(eventually(SETTLE, || stat("merged") > 0));
    eprintln!(
        "gate: {} batches packed, {} waits, {} sockets closed",
        stat("merged"),
        stat("waits"),
        stat("closed")
    );
    assert_eq!(stat("closed"), 0);
}

/// An app opens its subscriptions together: 50 `newHeads` subscriptions
/// asked for at once on viem's one socket, through `stakegate init`'s
/// gateway (6 public slots): all are opened, each sees the next block, and
/// the gate closes no socket (they share a unit at the node).
#[test]
fn fifty_subscriptions_opened_at_once_on_one_websocket_each_see_the_next_block() {
    let anvil = Anvil::start().unwrap();
    let (envoy, _dir) = gateway(&anvil);
    let public = envoy.listener("public").unwrap();
    let got = json_output(&mut library(
        "viem",
        &["subscribe", &format!("ws://{public}"), "50"],
    ));
    assert_eq!(got, json!({"opened": 50, "notified": 50}));
    let closed = envoy
        .stat("wasmcustom.stakegate.gate.websocket.closed")
        .unwrap();
    assert_eq!(closed, 0);
}
