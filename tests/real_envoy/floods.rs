//! Floods a hostile client can afford, against the gateway `stakegate
//! init` writes with the example policies (the cache and coalescing on):
//! many reads held at once, sockets opened, filled and closed. None may
//! stop a VM, put more at the node than the gate allows, refuse a staker
//! under its share, or leave anything held once the clients are gone.
//! Verdicts count requests and read gauges, never time.

use serde_json::json;
use stakegate_loadgen::ClientSpec;
use stakegate_stack::{loadgen, Envoy, RpcNode};
use stakegate_tests::{client, eventually, load_h2, websocket, SETTLE};
use std::time::Duration;

const STAT: &str = "wasmcustom.stakegate.gate.";

/// The gateway `stakegate init` writes in front of `node`, the example
/// gate policy changed by `gate` (top-level fields), and `qos`.
fn gateway(node: &RpcNode, dir: &std::path::Path, gate: serde_json::Value, qos: String) -> Envoy {
    let (gate_policy, qos_policy) = (dir.join("gate.json"), dir.join("qos.json"));
    let gate = stakegate_tests::example_policy("admission-gate", gate);
    std::fs::write(&gate_policy, gate).unwrap();
    std::fs::write(&qos_policy, qos).unwrap();
    stakegate_tests::start_initialised(dir, node.addr(), &gate_policy, &qos_policy)
}

/// The example QoS policy, as shipped.
fn example_qos() -> String {
    stakegate_tests::example_policy("stake-qos", json!({}))
}

/// Lines of Envoy's log that say a Wasm VM failed.
fn vm_failures(envoy: &Envoy) -> Vec<String> {
    std::fs::read_to_string(envoy.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Uncaught") || l.contains("Maximum call stack"))
        .map(str::to_string)
        .collect()
}

/// 2,000 addresses, each keeping one `eth_blockNumber` in flight, with
/// `cache.latest`: every read waits for a head poll, and one poll answers
/// hundreds at once. Envoy nests the local replies a VM asks for in one go,
/// and V8 stopped both VMs past about 500 (then empty 503s, a gauge that
/// never came down); the gate now answers a turn's worth at a time.
#[test]
fn two_thousand_reads_held_for_a_head_poll_stop_no_vm_and_leave_nothing_held() {
    let node = RpcNode::start(&["--block-interval", "200ms"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate = json!({ "cache": { "latest": true } });
    let envoy = gateway(&node, dir.path(), gate, example_qos());
    let mut crowd: Vec<ClientSpec> = (0..2000u32)
        .map(|i| ClientSpec {
            source: Some(
                format!("127.2.{}.{}", i / 250, i % 250 + 1)
                    .parse()
                    .unwrap(),
            ),
            ..client(&format!("reader-{i}"), 20.0, "eth_blockNumber", 1)
        })
        .collect();
    crowd.push(ClientSpec {
        api_key: Some("key-stake-40".into()),
        ..client("staker", 20.0, "eth_blockNumber", 1)
    });
    let mut spec = load_h2(
        &envoy.url("public").unwrap(),
        crowd,
        Duration::from_secs(5),
        1,
    );
    spec.http2 = false;
    let report = loadgen::run(&spec).unwrap();
    let staker = report.client("staker").unwrap();
    eprintln!(
        "2,000 readers and a staker: {:?}; the staker {:?}, p50 {} ms; reads held {}",
        report.status,
        staker.status,
        staker.latency_ms.all.p50,
        envoy.stat(&format!("{STAT}cache.at_head")).unwrap_or(-1)
    );
    let failures = vm_failures(&envoy);
    assert!(
        failures.is_empty(),
        "{} VM failures: {:?}",
        failures.len(),
        failures.first()
    );
    assert!(report.count("200") >= 2000, "{:?}", report.status);
    assert_eq!(report.count("503"), 0, "{:?}", report.status);
    assert_eq!(
        staker.count("200"),
        staker.status.values().sum::<u64>(),
        "{:?}",
        staker.status
    );
    assert!(staker.count("200") > 0);
    assert!(
        eventually(SETTLE, || {
            envoy.stat(&format!("{STAT}dedup.waiting")).unwrap() == 0
                && envoy.stat(&format!("{STAT}held")).unwrap() == 0
                && envoy.stat(&format!("{STAT}inflight.default")).unwrap() == 0
        }),
        "held {}",
        envoy.stat(&format!("{STAT}dedup.waiting")).unwrap()
    );
}

/// One unstaked address keeping 200 reads at `latest` in flight while
/// each head poll takes the node 300 ms: past `maxHeldPerIdentity` on a
/// worker its reads are refused at once (rule `held`, counted in its
/// usage), a staker beside it never is, and nothing stays held once it is
/// gone.
/// (Stake QoS names callers only above half its capacity, so the policy's
/// capacity is below the flood's rate.)
#[test]
fn one_address_holding_reads_is_refused_past_its_bound_and_a_staker_never_is() {
    let node = RpcNode::start(&["--cost", "eth_getBlockByNumber=300ms"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate = json!({ "cache": { "latest": true }, "maxHeldPerIdentity": 16 });
    let qos = stakegate_tests::example_policy("stake-qos", json!({ "capacityRps": 400 }));
    let envoy = gateway(&node, dir.path(), gate, qos);
    let clients = vec![
        ClientSpec {
            source: Some("127.3.0.1".parse().unwrap()),
            concurrency: 200,
            ..client("holder", 1000.0, "eth_blockNumber", 1)
        },
        ClientSpec {
            api_key: Some("key-stake-40".into()),
            concurrency: 4,
            ..client("staker", 20.0, "eth_blockNumber", 1)
        },
    ];
    let mut spec = load_h2(
        &envoy.url("public").unwrap(),
        clients,
        Duration::from_secs(5),
        1,
    );
    spec.http2 = false;
    let report = loadgen::run(&spec).unwrap();
    let (holder, staker) = (
        report.client("holder").unwrap(),
        report.client("staker").unwrap(),
    );
    let refused = envoy.stat(&format!("{STAT}held_refused")).unwrap();
    eprintln!(
        "holder {:?}, staker {:?}; refused past the holding bound: {refused}",
        holder.status, staker.status
    );
    assert!(vm_failures(&envoy).is_empty());
    assert!(refused > 0, "the holder was never refused for holding");
    assert!(holder.count("429") >= refused as u64, "{:?}", holder.status);
    assert!(holder.count("200") > 0, "{:?}", holder.status);
    // The staker's refusals, if any, are stake QoS's (a share that follows
    // a demand it predicts too low: the node-time issue's), never the
    // holding bound's.
    let usage = |what: &str| {
        envoy
            .stat(&format!("wasmcustom.stakegate.qos.usage.{what}"))
            .unwrap()
    };
    assert_eq!(usage("stake-40.refused.held"), 0);
    assert!(usage("unstaked:127.3.0.1/32.refused.held") > 0);
    assert_eq!(
        staker.count("200") + staker.count("429"),
        staker.status.values().sum::<u64>(),
        "{:?}",
        staker.status
    );
    assert_eq!(
        staker.count("429") as i64,
        usage("stake-40.refused.stake-share")
    );
    assert!(staker.count("200") >= 25, "{:?}", staker.status);
    assert!(
        eventually(SETTLE, || {
            envoy.stat(&format!("{STAT}held")).unwrap() == 0
                && envoy.stat(&format!("{STAT}dedup.waiting")).unwrap() == 0
        }),
        "held {}",
        envoy.stat(&format!("{STAT}held")).unwrap()
    );
}

/// One socket: 50 heavy calls, then, 100 ms later, a close (`cut`: the
/// connection dropped with no close frame).
fn fill_and_close(addr: std::net::SocketAddr, cut: bool) {
    let mut socket = websocket(addr);
    for i in 0..50 {
        let call = format!(
            r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_getLogs","params":[{{"fromBlock":"0x{i:x}"}}]}}"#
        );
        socket.send(call.into()).unwrap();
    }
    socket.flush().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    if cut {
        return;
    }
    socket.close(None).unwrap();
    // The node's answers, then its close.
    while socket.read().is_ok() {}
}

/// Open, flood, close, again: a node runs a socket's calls to the end
/// after the socket closes, so their slots must stay taken until then. A
/// close now waits for the node's answers; a cut socket's slots are held
/// for the node's expected work. Before, 8 such sockets put 49 (closed)
/// and 70 (cut) calls at once on a node behind 6 public slots.
#[test]
fn sockets_closed_or_cut_with_calls_at_the_node_never_put_more_there_than_the_gate_allows() {
    let node = RpcNode::start(&["--read-slots", "4", "--cost", "eth_getLogs=100ms"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let envoy = gateway(&node, dir.path(), json!({}), example_qos());
    let public = envoy.listener("public").unwrap();
    for round in 0..8 {
        fill_and_close(public, round % 2 == 1);
    }
    let metrics = node.metrics().unwrap();
    eprintln!(
        "node: in flight at most {}, queue at most {}, served {}; units held for cut sockets: {}",
        metrics["inflight_max"],
        metrics["queue_max"],
        metrics["served"],
        envoy
            .stat(&format!("{STAT}websocket.lingered"))
            .unwrap_or(-1)
    );
    assert!(metrics["inflight_max"].as_u64().unwrap() <= 6, "{metrics}");
    assert!(metrics["served"]["eth_getLogs"].as_u64().unwrap() >= 50);
}

/// The example QoS policy in node time (`capacityNodeMs` 4,500) with two
/// equal stakes, for the keys `key-attacker` and `key-victim`.
fn equal_stakes_in_node_time() -> String {
    let stake = |name: &str| {
        let key = format!("key-{name}");
        json!({"apiKeySha256": stakegate_core::request::sha256_hex(key.as_bytes()), "name": name, "stake": 25_000_000})
    };
    let mut qos: serde_json::Value =
        serde_json::from_str(&stakegate_tests::example_policy("stake-qos", json!({}))).unwrap();
    let qos = qos.as_object_mut().unwrap();
    qos.remove("capacityRps");
    qos.insert("capacityNodeMs".into(), json!(4500));
    qos.insert("stakes".into(), json!([stake("attacker"), stake("victim")]));
    json!(qos).to_string()
}

/// One socket of `key-attacker` keeping 8 `eth_getProof` out until
/// `until`: the answers it got from `from` to then (those to come are
/// read, not counted).
fn proof_socket(
    addr: std::net::SocketAddr,
    (from, until): (std::time::Instant, std::time::Instant),
    seed: u64,
) -> u64 {
    use tungstenite::client::IntoClientRequest;
    let mut request = format!("ws://{addr}/").into_client_request().unwrap();
    request
        .headers_mut()
        .insert("x-api-key", "key-attacker".parse().unwrap());
    let socket = loop {
        let stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        match tungstenite::client(request.clone(), stream) {
            Ok((socket, _)) => break socket,
            // Its identity over its share: the upgrade is a call too.
            Err(_) if std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("no socket: {e}"),
        }
    };
    let mut socket = socket;
    let call = |n: u64| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{n},"method":"eth_getProof","params":["0x{:040x}",[],"latest"]}}"#,
            seed * 1_000_000 + n
        )
    };
    let (mut sent, mut answered, mut by_then) = (0, 0, 0);
    while sent < 8 {
        sent += 1;
        socket.send(call(sent).into()).unwrap();
    }
    while answered < sent {
        let message = socket.read().unwrap();
        if message.is_text() {
            answered += 1;
            let now = std::time::Instant::now();
            if now < until {
                by_then += u64::from(now >= from);
                sent += 1;
                socket.send(call(sent).into()).unwrap();
            }
        }
    }
    by_then
}

/// Two equal stakes in node time; one floods `eth_getProof` (40 ms) over
/// HTTP, the other on 6 sockets keeping 8 calls out each. Before, a
/// message on a socket was never held and charged no node time: the
/// sockets took 1.7 times their share (3,845 ms/s against 1,109). Now each
/// gets about half, and the sockets' identity is charged what the node
/// spent on its calls.
#[test]
fn a_websocket_flood_of_heavy_calls_gets_its_node_time_share_and_is_charged_what_it_took() {
    let node = RpcNode::start(&["--read-slots", "8", "--cost", "eth_getProof=40ms"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The gate waits for slots in node time; coalescing and the cache
    // off: a request dedup checks does not wait for a slot yet (the
    // node-time issue's), and these calls are all distinct anyway.
    let gate = json!({
        "nodeTime": {"serviceTimeHeader": "x-node-service-us"},
        "dedup": null,
        "cache": null
    });
    let envoy = gateway(&node, dir.path(), gate, equal_stakes_in_node_time());
    let public = envoy.listener("public").unwrap();
    // Measured from the 3rd second: throttling on, and the sockets open.
    let (run, warm) = (Duration::from_secs(12), 3);
    let start = std::time::Instant::now();
    let window = (start + Duration::from_secs(warm), start + run);
    let sockets: Vec<_> = (0..6)
        .map(|seed| std::thread::spawn(move || proof_socket(public, window, seed)))
        .collect();
    let victim = ClientSpec {
        api_key: Some("key-victim".into()),
        unique_params: true,
        ..client("victim", 400.0, "eth_getProof", 3)
    };
    let mut spec = load_h2(&envoy.url("public").unwrap(), vec![victim], run, 1);
    spec.http2 = false;
    let report = loadgen::run(&spec).unwrap();
    let attacker: u64 = sockets.into_iter().map(|s| s.join().unwrap()).sum();
    let timeline = &report.clients[0].timeline;
    let victim: u64 = timeline.iter().skip(warm as usize).map(|s| s.ok).sum();
    let seconds = (run.as_secs() - warm) as f64;
    let (attacker_ms, victim_ms) = (
        attacker as f64 * 40.0 / seconds,
        victim as f64 * 40.0 / seconds,
    );
    let share = attacker_ms / (attacker_ms + victim_ms);
    // The ledger, once the last counts are handed over.
    let ledger_us = |name: &str| {
        envoy
            .stat(&format!("wasmcustom.stakegate.qos.usage.{name}.node_us"))
            .unwrap_or(0)
    };
    let metrics = node.metrics().unwrap();
    let ran_us = metrics["service_us_websocket"].as_u64().unwrap() as f64;
    let charged = || ledger_us("attacker") as f64 / ran_us;
    // Charged within 10 % (the gate times a unit from sending to its
    // answer, the node only its own work).
    let settled = eventually(SETTLE, || charged() >= 0.9);
    let charged = charged();
    eprintln!(
        "node ms/s: sockets {attacker_ms:.0}, HTTP {victim_ms:.0} ({share:.3} to the sockets); \
         sockets charged {charged:.3} of what the node spent on them; the victim {:?}",
        report.status
    );
    // The ledger's shares in calls (grant over cost per call): equal
    // stakes, one method. Before, the sockets' identity showed its grant
    // at the default cost, 7.3 times the victim's; now its cost per call
    // is learned from what its calls took: 1.9 times (a gap not
    // explained yet; the node-time shares above are right).
    let share_rps = |name: &str| {
        envoy
            .stat(&format!(
                "wasmcustom.stakegate.qos.usage.{name}.share_milli_rps"
            ))
            .unwrap_or(0) as f64
    };
    let shares = share_rps("attacker") / share_rps("victim");
    eprintln!("ledger shares in calls, sockets to HTTP: {shares:.2}");
    // In shares, not ms/s: what the node gets through depends on the
    // machine's load.
    assert!((share - 0.5).abs() <= 0.03, "the sockets' share {share:.3}");
    assert!(settled && charged <= 1.1, "charged {charged:.3}");
    assert!((0.5..=3.0).contains(&shares), "ledger shares {shares:.2}");
}

/// 100 unstaked addresses, each in a closed loop of `eth_getProof`, beside
/// a staked client on 12 connections, through init's gateway with the
/// gate waiting for slots in node time: the staked client's calls wait
/// before the crowd's (the example policy's `{"staked": true}` priority
/// matcher, as stake QoS says), so it gets about what it gets alone.
/// Before, the gate served the crowd first come, first served: the staker
/// got 151 calls to the crowd's 1,759. The staker keeps more calls than
/// the gate's 8 slots, so one of its calls always waits when a slot frees:
/// with exactly 8, a slot freed while its client turned around went to the
/// crowd, and how often depended on the machine's speed (710 of 820 on a
/// busy one). And across Envoy's two workers a staked call goes before the
/// crowd's too (they compared only ages: 760 of 823 beside two busy
/// loops; now 776 of 799, quiet 811 of 824, the crowd 16 to 29).
#[test]
fn an_unstaked_crowd_in_closed_loops_cannot_push_out_a_stakers_calls() {
    let node = RpcNode::start(&["--cost", "eth_getProof=40ms"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate = json!({"nodeTime": {"serviceTimeHeader": "x-node-service-us"}});
    let envoy = gateway(&node, dir.path(), gate, example_qos());
    let url = envoy.url("public").unwrap();
    let staker = || ClientSpec {
        api_key: Some("key-stake-40".into()),
        unique_params: true,
        ..client("staker", 400.0, "eth_getProof", 12)
    };
    let crowd: Vec<ClientSpec> = (0..100u32)
        .map(|i| ClientSpec {
            source: Some(
                format!("127.3.{}.{}", i / 250, i % 250 + 1)
                    .parse()
                    .unwrap(),
            ),
            unique_params: true,
            ..client(&format!("crowd-{i}"), 100.0, "eth_getProof", 1)
        })
        .collect();
    let run = |clients: Vec<ClientSpec>, seconds: u64| {
        let mut spec = load_h2(&url, clients, Duration::from_secs(seconds), 8);
        spec.http2 = false;
        loadgen::run(&spec).unwrap()
    };
    // Warm (the gate learns the method's cost), then alone.
    run(vec![staker()], 2);
    let alone = run(vec![staker()], 5).count("200");
    let mut clients = crowd;
    clients.push(staker());
    let beside = run(clients, 5);
    let (staker, crowd) = (
        beside.client("staker").unwrap().count("200"),
        beside.count("200") - beside.client("staker").unwrap().count("200"),
    );
    eprintln!(
        "the staker alone {alone}, beside the crowd {staker} (the crowd {crowd}, {:?})",
        beside.status
    );
    assert!(
        staker as f64 >= 0.9 * alone as f64,
        "alone {alone}, beside {staker}"
    );
}

/// A wallet's burst through init's gateway in node time with the example
/// policy's coalescing on (kept engaged): 50 distinct `eth_getBalance` at
/// once against 6 public slots. Each waits for its slot and is then checked
/// by coalescing (it leads its own key), so all are answered, each with the
/// node's word on its time as the route would give it. Before, a request
/// coalescing checks was refused at once when the gate was full.
#[test]
fn a_burst_with_coalescing_on_waits_for_slots_and_every_answer_says_the_nodes_time() {
    let node = RpcNode::start(&["--cost", "eth_getBalance=20ms"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate = json!({
        "dedup": {"engageAfterMs": 0},
        "nodeTime": {"serviceTimeHeader": "x-node-service-us"}
    });
    let envoy = gateway(&node, dir.path(), gate, example_qos());
    let url = envoy.url("public").unwrap();
    let all = std::sync::Arc::new(std::sync::Barrier::new(50));
    let answers: Vec<_> = (0..50)
        .map(|i| {
            let (url, all) = (url.clone(), all.clone());
            std::thread::spawn(move || {
                let call = format!(
                    r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_getBalance","params":["0x{i:040x}","latest"]}}"#
                );
                all.wait();
                stakegate_stack::http::post(&url, &[], &call).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    let said = answers
        .iter()
        .filter(|a| {
            a.header("x-node-service-us")
                .is_some_and(|us| us.parse::<u64>().is_ok())
        })
        .count();
    let stat = |name: &str| envoy.stat(&format!("{STAT}{name}")).unwrap();
    // The counters reach Envoy at the workers' heartbeats.
    let counted = eventually(SETTLE, || stat("dedup.led") + stat("dedup.skipped") >= 50);
    let (led, waited) = (stat("dedup.led"), stat("node_time.waited"));
    eprintln!("50 at once: {said} said the node's time; led {led}, waited for a slot {waited}");
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(said, 50);
    assert!(
        counted && led >= 40 && waited > 0,
        "led {led}, waited {waited}"
    );
}

/// One socket subscribing to `n` accounts, 100 at a time, kept open until
/// everyone at `all` has passed it twice (once all have subscribed, and
/// once they are seen): the subscriptions it got, and those the gate
/// refused, said on `counts` once it has subscribed.
fn subscriber(
    addr: std::net::SocketAddr,
    n: u32,
    seed: u32,
    all: &std::sync::Barrier,
    counts: &std::sync::mpsc::Sender<(u32, u32)>,
) {
    let mut socket = stakegate_tests::websocket(addr);
    let (mut got, mut refused) = (0, 0);
    for wave in 0..n / 100 {
        for i in 0..100 {
            let id = wave * 100 + i;
            let call = format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"accountSubscribe","params":["acct-{seed}-{id}",{{"commitment":"processed"}}]}}"#
            );
            socket.send(call.into()).unwrap();
        }
        let mut answered = 0;
        while answered < 100 {
            let text = socket.read().unwrap().into_text().unwrap_or_default();
            let answer: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            if answer.get("id").is_none() {
                continue; // a notification
            }
            answered += 1;
            match answer["error"]["data"]["rule"].as_str() {
                Some("subscriptions") => refused += 1,
                _ if answer.get("result").is_some() => got += 1,
                _ => panic!("{text}"),
            }
        }
    }
    counts.send((got, refused)).unwrap();
    all.wait();
    all.wait();
}

/// One unstaked address opens 16 sockets and asks 2,000 subscriptions on
/// each; a staker reads balances beside it. Each socket gets at most
/// `maxSubscriptionsPerWebsocket` (1,000) and the address at most
/// `maxSubscriptionsPerIdentity` (2,000) on each worker: the rest are
/// refused with their own errors, and the staker is never refused for its
/// share (a slot it finds taken, at most 1 %). Before, every subscription
/// was made (the node pushed 6,763 notifications a second) and the staker
/// was refused 9 calls in 193.
#[test]
fn an_address_subscribing_past_its_bounds_is_refused_and_a_staker_beside_it_is_not() {
    let node = RpcNode::start(&["--chain", "solana", "--block-interval", "2s"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let envoy = gateway(&node, dir.path(), json!({}), example_qos());
    let public = envoy.listener("public").unwrap();
    let all = std::sync::Arc::new(std::sync::Barrier::new(17));
    let (counts, counted) = std::sync::mpsc::channel();
    let sockets: Vec<_> = (0..16)
        .map(|seed| {
            let (all, counts) = (all.clone(), counts.clone());
            std::thread::spawn(move || subscriber(public, 2000, seed, &all, &counts))
        })
        .collect();
    let staker = ClientSpec {
        api_key: Some("key-stake-40".into()),
        ..client("staker", 50.0, "getBalance", 4)
    };
    let mut spec = load_h2(
        &envoy.url("public").unwrap(),
        vec![staker],
        Duration::from_secs(8),
        1,
    );
    spec.http2 = false;
    let report = loadgen::run(&spec).unwrap();
    // Every socket has subscribed: the gauge, then the sockets close.
    all.wait();
    let open = || {
        envoy
            .stat("wasmcustom.stakegate.gate.websocket.subscriptions")
            .unwrap_or(-1)
    };
    let (got, refused) = (0..16)
        .map(|_| counted.recv().unwrap())
        .fold((0, 0), |(g, r), (a, b)| (g + a, r + b));
    // The gauge reaches Envoy at the workers' heartbeats.
    let mut seen = 0;
    eventually(SETTLE, || {
        seen = open();
        seen == i64::from(got)
    });
    all.wait();
    for socket in sockets {
        socket.join().unwrap();
    }
    eprintln!(
        "subscribed {got}, refused {refused} of 32,000; the staker {:?}; QoS held sockets {} times",
        report.status,
        envoy
            .stat("wasmcustom.stakegate.qos.websocket.held")
            .unwrap_or(-1)
    );
    // The notifications they brought, in the address's usage.
    let notified = || {
        let stats = envoy.stats().unwrap();
        stats
            .iter()
            .filter(|(name, _)| name.starts_with("wasmcustom.stakegate.qos.usage."))
            .filter(|(name, _)| name.ends_with(".notifications"))
            .map(|(_, n)| *n)
            .sum::<i64>()
    };
    assert!(eventually(SETTLE, || notified() > 0));
    eprintln!(
        "notifications in the ledger: {}; subscriptions open, as the gate counts them: {seen}",
        notified()
    );
    assert!(
        got <= 2 * 2000,
        "at most the identity's bound on each of 2 workers: {got}"
    );
    assert_eq!(got + refused, 32_000);
    assert_eq!(seen, i64::from(got), "the gauge, all sockets open");
    assert!(eventually(SETTLE, || open() == 0), "{}", open());
    // The staker: never refused for its share, and its calls found a slot
    // (in calls, with no waiting, a socket's units can hold every public
    // slot for a moment: on a busy machine 1 call in 400 found none).
    assert_eq!(report.count("429"), 0, "{:?}", report.status);
    assert!(report.count("200") >= 396, "{:?}", report.status);
}
