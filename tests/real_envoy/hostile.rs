//! Hostile clients against the shipped gateway config and a real Envoy:
//! slow uploads, WebSocket floods, upgrades where a body is expected,
//! aborts mid-body, a node killed and restarted, and an abort soak that
//! ends with nothing held. Their figures are in `docs/reliability.md`.
//!
//! Verdicts count requests and read gauges; none depends on how fast the
//! machine is (limits are far from what a slowdown can reach, or the gate's
//! count is compared with the node's).

use stakegate_loadgen::ClientSpec;
use stakegate_stack::{http, loadgen, Envoy, RpcNode};
use stakegate_tests::{
    client, eventually, example_policy, load, node_behind_filter, node_behind_filters,
    node_behind_gate, websocket, SETTLE,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const STAT: &str = "wasmcustom.stakegate.gate.";
const INTERNAL: &str = r#"{"listenerMetadata": "internal"}"#;

fn stat(envoy: &Envoy, name: &str) -> i64 {
    envoy.stat(&format!("{STAT}{name}")).unwrap()
}

/// The gate holds nothing and the node has nothing in flight.
fn nothing_held(envoy: &Envoy, node: &RpcNode) -> bool {
    eventually(SETTLE, || {
        let metrics = node.metrics().unwrap();
        ["inflight.default", "inflight.priority", "websocket.active"]
            .iter()
            .all(|gauge| stat(envoy, gauge) == 0)
            && metrics["inflight"] == 0
    })
}

/// A connection that sends request headers announcing a body, then
/// `trickle` bytes of it one at a time, `every` apart, on its own thread.
fn slow_upload(addr: SocketAddr, trickle: usize, every: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let Ok(mut stream) = TcpStream::connect(addr) else {
            return;
        };
        let _ = write!(
            stream,
            "POST / HTTP/1.1\r\nHost: rpc\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        );
        for _ in 0..trickle {
            std::thread::sleep(every);
            if stream.write_all(b" ").is_err() {
                return;
            }
        }
    })
}

#[test]
fn a_hundred_slow_uploads_hold_no_slot() {
    let policy = format!(r#"{{"maxInflight": 16, "classes": {{"internal": [{INTERNAL}]}}}}"#);
    let (node, envoy) = node_behind_gate(&policy, &["--read-slots", "64"]);
    let public = envoy.listener("public").unwrap();
    // Headers, then one byte a second: before the buffer filter, each held
    // a gate slot for as long as it trickled.
    let uploads: Vec<_> = (0..100)
        .map(|_| slow_upload(public, 6, Duration::from_secs(1)))
        .collect();
    assert!(eventually(SETTLE, || {
        envoy.stat("http.public.downstream_rq_active").unwrap() >= 100
    }));
    assert_eq!(stat(&envoy, "inflight.default"), 0, "no slot is held");

    let spec = load(
        &envoy.url("public").unwrap(),
        client("normal", 100.0, "eth_call", 1000),
        Duration::from_secs(3),
        false,
    );
    let internal_spec = load(
        &envoy.url("internal").unwrap(),
        client("internal", 50.0, "eth_blockNumber", 1000),
        Duration::from_secs(3),
        false,
    );
    let internal = std::thread::spawn(move || loadgen::run(&internal_spec).unwrap());
    let report = loadgen::run(&spec).unwrap();
    let internal = internal.join().unwrap();
    eprintln!("normal {:?}, internal {:?}", report.status, internal.status);
    assert_eq!(report.count("200"), 300, "{:?}", report.status);
    assert_eq!(internal.count("200"), 150, "{:?}", internal.status);
    for upload in uploads {
        upload.join().unwrap();
    }
    assert!(nothing_held(&envoy, &node));
}

#[test]
fn headers_without_a_body_are_ended_by_the_request_timeout() {
    let (_node, envoy) = node_behind_gate(r#"{"maxInflight": 4}"#, &[]);
    let mut stream = TcpStream::connect(envoy.listener("public").unwrap()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(45)))
        .unwrap();
    write!(
        stream,
        "POST / HTTP/1.1\r\nHost: rpc\r\nContent-Length: 10\r\n\r\n"
    )
    .unwrap();
    let started = Instant::now();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    eprintln!("after {:?}: {answer:?}", started.elapsed());
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert_eq!(
        stat(&envoy, "admitted.default"),
        0,
        "it never reached the gate"
    );
}

/// Sends `calls` eth_getLogs on one WebSocket at once and reads every answer.
fn websocket_burst(addr: SocketAddr, calls: usize) -> usize {
    let mut socket = websocket(addr);
    for id in 0..calls {
        socket
            .send(tungstenite::Message::text(format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_getLogs","params":[{{}}]}}"#
            )))
            .unwrap();
    }
    let mut answered = 0;
    while answered < calls {
        match socket.read().unwrap() {
            tungstenite::Message::Text(text) if text.contains("\"result\"") => answered += 1,
            _ => {}
        }
    }
    answered
}

#[test]
fn a_websocket_flood_never_puts_more_than_the_gate_limit_at_the_node() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 16, "maxInflightPerWebsocket": 4}"#,
        &["--read-slots", "256", "--cost", "eth_getLogs=50ms"],
    );
    let addr = envoy.listener("public").unwrap();
    // 24 sockets with 10 calls each: 240 at once without the gate's count.
    let sockets: Vec<_> = (0..24)
        .map(|_| std::thread::spawn(move || websocket_burst(addr, 10)))
        .collect();
    let answered: usize = sockets.into_iter().map(|s| s.join().unwrap()).sum();
    let metrics = node.metrics().unwrap();
    eprintln!("node: {metrics}");
    assert_eq!(answered, 240, "every call was answered");
    let at_node = metrics["inflight_max"].as_u64().unwrap();
    assert!(
        (1..=16).contains(&at_node),
        "at most maxInflight at the node: {at_node}"
    );
    assert!(eventually(SETTLE, || stat(&envoy, "websocket.waits") > 0));
    // Every call read, and every message the node answered (calls the
    // sockets could not all send alone went packed, a batch an answer).
    let answers = metrics["requests"].as_i64().unwrap();
    assert!(eventually(SETTLE, || stat(&envoy, "websocket.messages")
        == 240 + answers));
    assert!(nothing_held(&envoy, &node));
}

/// Each answer's id as the client reads it (an answer per message, or per
/// batch entry), raw.
fn answer_ids(text: &str) -> Vec<String> {
    let summary = stakegate_core::jsonrpc::Summary::of(text.as_bytes());
    summary
        .entries
        .iter()
        .filter_map(|e| e.last(stakegate_core::jsonrpc::Name::Id))
        .map(|id| text[id.value.clone()].to_string())
        .collect()
}

/// A WebSocket message sent as `parts` frames (a fragmented message).
fn fragmented(socket: &mut tungstenite::WebSocket<TcpStream>, text: &str, parts: usize) {
    use tungstenite::protocol::frame::coding::{Data, OpCode};
    use tungstenite::protocol::frame::Frame;
    let bytes = text.as_bytes();
    let step = bytes.len().div_ceil(parts);
    for (i, chunk) in bytes.chunks(step).enumerate() {
        let opcode = if i == 0 {
            OpCode::Data(Data::Text)
        } else {
            OpCode::Data(Data::Continue)
        };
        let last = (i + 1) * step >= bytes.len();
        socket
            .write(tungstenite::Message::Frame(Frame::message(
                chunk.to_vec(),
                opcode,
                last,
            )))
            .unwrap();
    }
}

#[test]
fn every_websocket_message_the_node_runs_takes_a_slot_and_every_call_gets_its_own_id() {
    // The whole gateway as `stakegate init` writes it, in front of a node
    // with 4 read slots: the gate admits 8 (6 for public calls).
    let (node, envoy) = node_behind_filters(
        "gateway.yaml",
        vec![
            stakegate_tests::qos_filter(&example_policy("stake-qos", serde_json::json!({}))),
            stakegate_tests::gate_filter(&example_policy("admission-gate", serde_json::json!({}))),
        ],
        &["--read-slots", "4", "--cost", "eth_getLogs=20ms"],
    );
    let mut socket = websocket(envoy.listener("public").unwrap());
    let mut want: Vec<String> = Vec::new();
    let mut calls = 0;
    let call = |id: &str, key: &str| {
        format!(r#"{{"jsonrpc":"2.0","{key}":{id},"method":"eth_getLogs","params":[{{}}]}}"#)
    };
    let note = r#"{"jsonrpc":"2.0","method":"eth_getLogs","params":[{}]}"#;
    // All in one write: notifications, ids written as one node reads them
    // and another does not, batches with a notification inside, fragmented
    // messages, plain calls.
    for i in 0..100 {
        socket.write(tungstenite::Message::text(note)).unwrap();
        calls += 1;
        if i % 5 == 0 {
            let id = format!("{i}e0");
            socket
                .write(tungstenite::Message::text(call(&id, r"\u0069d")))
                .unwrap();
            want.push(id);
            let id = format!(r#""up-{i}""#);
            socket
                .write(tungstenite::Message::text(call(&id, "ID")))
                .unwrap();
            want.push(id);
            calls += 2;
        }
        if i % 10 == 0 {
            let (a, b) = (format!(r#""b{i}""#), format!("{}", 1000 + i));
            let batch = format!("[{},{note},{}]", call(&a, "id"), call(&b, "id"));
            socket.write(tungstenite::Message::text(batch)).unwrap();
            want.extend([a, b]);
            calls += 3;
        }
        if i % 5 == 1 {
            let id = format!("{}", 2000 + i);
            fragmented(&mut socket, &call(&id, "id"), 3);
            want.push(id);
            calls += 1;
        }
        if i % 3 == 0 {
            let id = format!("{}", 3000 + i);
            socket
                .write(tungstenite::Message::text(call(&id, "id")))
                .unwrap();
            want.push(id);
            calls += 1;
        }
    }
    socket.flush().unwrap();
    let mut got = Vec::new();
    while got.len() < want.len() {
        match socket.read().unwrap() {
            tungstenite::Message::Text(text) => got.extend(answer_ids(text.as_str())),
            other => panic!("not an answer: {other:?}"),
        }
    }
    // Nothing more comes: no notification's answer, no second answer.
    socket
        .send(tungstenite::Message::text(call(r#""last""#, "id")))
        .unwrap();
    let last = socket.read().unwrap();
    assert_eq!(answer_ids(last.to_text().unwrap()), [r#""last""#]);
    want.sort();
    got.sort();
    assert_eq!(
        got, want,
        "every call answered once, with its id as written"
    );
    let metrics = node.metrics().unwrap();
    eprintln!("{calls} calls; node: {metrics}");
    assert_eq!(
        metrics["served"]["eth_getLogs"],
        calls + 1,
        "the node ran them all"
    );
    let at_node = metrics["inflight_max"].as_u64().unwrap();
    assert!(
        at_node <= 6,
        "the node had {at_node} at once; the gate admits 6"
    );
    // QoS charged every call, each of a batch's three included.
    assert!(eventually(SETTLE, || {
        envoy
            .stat("wasmcustom.stakegate.qos.websocket.calls")
            .unwrap()
            == calls as i64 + 1
    }));
    drop(socket);
    assert!(nothing_held(&envoy, &node));
}

/// A message past `maxWebsocketMessageBytes` could only be held whole at
/// the gateway without end: the socket is closed with a close frame that
/// says why, and the node never sees it. A message within the limit on the
/// next socket is served.
#[test]
fn a_websocket_message_past_the_limit_closes_the_socket_with_its_reason() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 8, "maxWebsocketMessageBytes": 4096}"#,
        &[],
    );
    let addr = envoy.listener("public").unwrap();
    let mut socket = websocket(addr);
    let padding = "0".repeat(8192);
    let large = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[{{"data":"0x{padding}"}},"latest"]}}"#
    );
    // Sent in fragments, as a client streaming a large message does.
    fragmented(&mut socket, &large, 4);
    socket.flush().unwrap();
    let close = match socket.read() {
        Ok(tungstenite::Message::Close(frame)) => frame,
        Ok(other) => panic!("not a close: {other:?}"),
        Err(e) => panic!("the socket ended without a close frame: {e}"),
    };
    let frame = close.expect("a close frame with a code");
    eprintln!("closed: {frame:?}");
    assert_eq!(u16::from(frame.code), 1009, "{frame:?}");
    assert!(
        frame.reason.contains("maxWebsocketMessageBytes"),
        "{frame:?}"
    );
    assert!(eventually(SETTLE, || stat(&envoy, "websocket.closed") == 1));
    let mut next = websocket(addr);
    next.send(tungstenite::Message::text(
        r#"{"jsonrpc":"2.0","id":2,"method":"eth_chainId"}"#,
    ))
    .unwrap();
    let answer = next.read().unwrap();
    assert!(answer.to_string().contains("\"result\""), "{answer}");
    let metrics = node.metrics().unwrap();
    assert!(
        metrics["served"].get("eth_call").is_none(),
        "the node never ran the large message: {metrics}"
    );
    drop(next);
    assert!(nothing_held(&envoy, &node));
}

#[test]
fn websockets_and_upgrade_requests_are_never_held_for_a_body_with_dedup_on() {
    let (node, envoy) = node_behind_gate(r#"{"maxInflight": 8, "dedup": {}}"#, &[]);
    let addr = envoy.listener("public").unwrap();
    let mut socket = websocket(addr);
    // The same read twice: over a WebSocket neither is a duplicate.
    for _ in 0..2 {
        socket
            .send(tungstenite::Message::text(
                r#"{"jsonrpc":"2.0","id":1,"method":"eth_getBalance","params":["0x1","latest"]}"#,
            ))
            .unwrap();
        let answer = socket.read().unwrap();
        assert!(answer.to_string().contains("\"result\""), "{answer}");
    }
    drop(socket);

    // A POST that asks to upgrade: Envoy would make it a tunnel whose body
    // never ends; the gate answers it at once.
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[]}"#;
    write!(
        stream,
        "POST / HTTP/1.1\r\nHost: rpc\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).expect("an answer, not a hang");
    assert_eq!(&head, b"HTTP/1.1 400");
    drop(stream);
    assert!(nothing_held(&envoy, &node));
}

#[test]
fn clients_that_abort_mid_body_leave_nothing_held() {
    let (node, envoy) = node_behind_gate(r#"{"maxInflight": 8, "dedup": {}}"#, &[]);
    let addr = envoy.listener("public").unwrap();
    for _ in 0..50 {
        let mut stream = TcpStream::connect(addr).unwrap();
        write!(
            stream,
            "POST / HTTP/1.1\r\nHost: rpc\r\nContent-Length: 100\r\n\r\n{{\"jsonrpc\":"
        )
        .unwrap();
    }
    let url = envoy.url("public").unwrap();
    let ok = http::post(
        &url,
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#,
    )
    .unwrap();
    assert_eq!(ok.status, 200);
    assert!(nothing_held(&envoy, &node));
}

#[test]
fn a_body_just_over_a_mebibyte_passes_with_dedup_at_its_largest() {
    let (_node, envoy) = node_behind_gate(
        r#"{"maxInflight": 8, "dedup": {"maxBodyBytes": 1048576}}"#,
        &[],
    );
    let padding = "0".repeat(1024 * 1024 + 100);
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[{{"data":"0x{padding}"}}]}}"#
    );
    let answer = http::post(&envoy.url("public").unwrap(), &[], &body).unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(eventually(SETTLE, || stat(&envoy, "dedup.too_large") == 1));
}

#[test]
fn a_node_killed_under_load_and_restarted_serves_again_with_nothing_leaked() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 16}"#,
        &["--read-slots", "32", "--cost", "eth_call=20ms"],
    );
    let port = node.addr().port();
    let url = envoy.url("public").unwrap();
    let spec = load(
        &url,
        client("steady", 200.0, "eth_call", 10_000),
        Duration::from_secs(4),
        false,
    );
    let run = std::thread::spawn(move || loadgen::run(&spec).unwrap());
    assert!(eventually(SETTLE, || stat(&envoy, "admitted.default") > 0));
    drop(node);
    let node = RpcNode::start_on(port, &["--read-slots", "32", "--cost", "eth_call=20ms"])
        .expect("the node restarts on its port");
    let report = run.join().unwrap();
    eprintln!("across the restart: {:?}", report.status);
    assert!(report.count("200") > 0);
    assert_eq!(
        report.count("timeout"),
        0,
        "nothing hung: {:?}",
        report.status
    );
    assert!(nothing_held(&envoy, &node));
    assert_eq!(
        http::post(
            &url,
            &[],
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#
        )
        .unwrap()
        .status,
        200
    );
}

#[test]
fn an_abort_soak_ends_with_nothing_in_flight() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 16, "dedup": {}}"#,
        &[
            "--read-slots",
            "32",
            "--cost",
            "eth_call=20ms",
            "--cost",
            "eth_getLogs=200ms",
        ],
    );
    let url = envoy.url("public").unwrap();
    // Impatient clients over HTTP/1.1 and HTTP/2: timeouts from 15 ms to
    // 2 s cut requests at every stage (queued, at the node, answering).
    let clients: Vec<ClientSpec> = [15u64, 60, 250, 2000]
        .iter()
        .enumerate()
        .map(|(i, timeout)| ClientSpec {
            mix: [
                ("eth_call".to_string(), 3.0),
                ("eth_getLogs".to_string(), 1.0),
            ]
            .into(),
            timeout_ms: Some(*timeout),
            unique_params: i % 2 == 0,
            ..client(&format!("impatient-{timeout}ms"), 150.0, "", 10_000)
        })
        .collect();
    // STAKEGATE_SOAK_SECONDS makes a long soak of it (docs/reliability.md).
    let seconds = std::env::var("STAKEGATE_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let mut total = 0;
    for http2 in [false, true] {
        let mut spec =
            stakegate_tests::load_h2(&url, clients.clone(), Duration::from_secs(seconds), 4);
        spec.http2 = http2;
        let report = loadgen::run(&spec).unwrap();
        eprintln!("http2={http2}: {:?}", report.status);
        assert!(report.count("timeout") > 100, "{:?}", report.status);
        total += report.status.values().sum::<u64>();
    }
    eprintln!("{total} requests");
    assert!(nothing_held(&envoy, &node), "a slot leaked");
}

/// The stake QoS config too puts whole requests in front of its filter.
#[test]
fn slow_uploads_do_not_reach_the_stake_qos_filter() {
    let (_node, envoy) = node_behind_filter(
        "qos.yaml",
        stakegate_tests::qos_filter(r#"{"capacityRps": 100}"#),
        &[],
    );
    let uploads: Vec<_> = (0..20)
        .map(|_| slow_upload(envoy.listener("public").unwrap(), 2, Duration::from_secs(1)))
        .collect();
    assert!(eventually(SETTLE, || {
        envoy.stat("http.public.downstream_rq_active").unwrap() >= 20
    }));
    assert_eq!(
        envoy.stat("wasmcustom.stakegate.qos.identities").unwrap(),
        0,
        "no request reached the filter"
    );
    for upload in uploads {
        upload.join().unwrap();
    }
}

/// Sends one request whose `x-api-key` value is the byte 0xff (HTTP allows
/// bytes above 0x7f in values); returns the status line.
fn request_with_a_raw_byte_header(addr: SocketAddr, nonce: u32) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[{nonce}]}}"#);
    let mut request = format!(
        "POST / HTTP/1.1\r\nHost: rpc\r\nContent-Type: application/json\r\nContent-Length: {}\r\nx-api-key: ",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(b"\xff\xfe\r\n\r\n");
    request.extend_from_slice(body.as_bytes());
    stream.write_all(&request).unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).unwrap();
    String::from_utf8_lossy(&head).into_owned()
}

#[test]
fn a_header_value_that_is_not_utf8_crashes_no_filter() {
    let (_node, gate) = node_behind_gate(r#"{"maxInflight": 8, "dedup": {}}"#, &[]);
    let (_node2, qos) = node_behind_filter(
        "qos.yaml",
        stakegate_tests::qos_filter(r#"{"capacityRps": 100}"#),
        &[],
    );
    for (envoy, plugin) in [(&gate, "admission_gate"), (&qos, "stake_qos")] {
        for nonce in 0..3 {
            assert_eq!(
                request_with_a_raw_byte_header(envoy.listener("public").unwrap(), nonce),
                "HTTP/1.1 200"
            );
        }
        let reloads = envoy
            .stat(&format!("wasm.stakegate.{plugin}.vm_reload"))
            .unwrap();
        assert_eq!(reloads, 0, "{plugin}'s VM never crashed");
    }
}

/// One long call holds the node's only slot after quick ones: the
/// completion rate the gate measures decays towards nothing, and the time
/// for a slot to free is the long call's, a minute. A client told that in
/// `retry-after` (viem honours it, three times) would fail only after
/// minutes; the gate's default caps it at what the client libraries handle
/// within their own timeouts (docs/clients.md).
#[test]
fn a_503_never_tells_a_client_to_wait_longer_than_the_libraries_handle() {
    let (node, envoy) = node_behind_gate(
        r#"{"maxInflight": 1, "heartbeatMs": 100, "staleSlotTtlMs": 10000}"#,
        &["--cost", "test_hold=60s"],
    );
    let url = envoy.url("public").unwrap();
    let quick = r#"{"jsonrpc":"2.0","id":2,"method":"eth_chainId"}"#;
    // Quick calls first (two workers pass one slot between them at their
    // heartbeats, so some are refused on the way).
    let mut served = 0;
    assert!(eventually(SETTLE, || {
        served += u32::from(http::post(&url, &[], quick).unwrap().status == 200);
        served >= 20
    }));
    let public = envoy.listener("public").unwrap();
    let hold = r#"{"jsonrpc":"2.0","id":1,"method":"test_hold","params":[]}"#;
    let at_node = || node.metrics().unwrap()["inflight"].as_u64() == Some(1);
    // The long call takes the slot (sent again if it was refused: the two
    // workers pass the one slot between them at their heartbeats).
    let held = (0..50)
        .find_map(|_| {
            let mut held = TcpStream::connect(public).unwrap();
            write!(
                held,
                "POST / HTTP/1.1\r\nHost: rpc\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{hold}",
                hold.len()
            )
            .unwrap();
            eventually(Duration::from_secs(1), at_node).then_some(held)
        })
        .expect("the long call reached the node");
    // Refusals over 40 heartbeats, as the measured rate decays (the old
    // rule reached its 30 s cap within them).
    let mut waits = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(4) {
        let answer = http::post(&url, &[], quick).unwrap();
        assert_eq!(answer.status, 503, "{}", answer.body);
        waits.push(
            answer
                .header("retry-after")
                .unwrap()
                .parse::<u32>()
                .unwrap(),
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "retry-after over {} refusals: {:?}",
        waits.len(),
        waits.iter().fold([0; 4], |mut n, &s| {
            n[(s as usize).min(3)] += 1;
            n
        })
    );
    assert!(waits.iter().all(|s| (1..=3).contains(s)), "{waits:?}");
    drop(held);
}
