//! Fleet mode in real Envoys: three gateway replicas (the whole gateway
//! config, each its own Envoy with its own node id) share one capacity
//! through real Redis and Webdis, with clients spread unevenly, and keep
//! serving while Redis is away.

use stakegate_loadgen::{ClientSpec, Report};
use stakegate_stack::admin::Admin;
use stakegate_stack::{loadgen, Envoy, EnvoyBuilder, FleetEngine, RpcNode};
use stakegate_tests::{client, eventually, gate_filter, load_h2, qos_filter};
use std::time::{Duration, Instant};

const CAPACITY: f64 = 300.0;
const REPLICAS: usize = 3;
const RUN_S: u64 = 14;
/// Redis is stopped over these seconds of the run.
const OUTAGE_S: (u64, u64) = (6, 9);

fn replica(node: &RpcNode, engine: &FleetEngine, name: &str) -> Envoy {
    let qos = format!(r#"{{"capacityRps": {CAPACITY}, "fleet": {{"syncMs": 100}}}}"#);
    EnvoyBuilder::new("gateway.yaml")
        .filter(qos_filter(&qos))
        .filter(gate_filter(r#"{"maxInflight": 1000}"#))
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .var("FLEET_PORT", engine.addr().port())
        .concurrency(1)
        .arg("--service-node")
        .arg(name)
        .start()
        .expect("envoy starts")
}

/// A client by address (each its own identity, all unstaked: equal
/// weights), sending `rate` calls per second to one replica.
fn by_address(id: &str, last_octet: u8, rate: f64) -> ClientSpec {
    ClientSpec {
        source: Some(format!("127.0.{last_octet}.1").parse().unwrap()),
        ..client(id, rate, "eth_blockNumber", 100_000)
    }
}

/// Admitted calls per client id over seconds `from..to` of every report.
fn admitted(reports: &[Report], ids: &[&str], from: usize, to: usize) -> Vec<u64> {
    ids.iter()
        .map(|id| {
            reports
                .iter()
                .flat_map(|r| r.clients.iter().filter(|c| c.header.id == *id))
                .map(|c| {
                    c.timeline[from..to.min(c.timeline.len())]
                        .iter()
                        .map(|s| s.ok)
                        .sum::<u64>()
                })
                .sum()
        })
        .collect()
}

fn gauge(admin: &Admin, name: &str) -> i64 {
    admin
        .stat(&format!("wasmcustom.stakegate.qos.{name}"))
        .unwrap_or(-1)
}

#[test]
fn three_replicas_share_one_capacity_and_survive_redis_going_away() {
    let node = RpcNode::start(&["--read-slots", "16"]).expect("rpc-node starts");
    let mut engine = FleetEngine::start().expect("redis and webdis start");
    let envoys: Vec<Envoy> = (1..=REPLICAS)
        .map(|i| replica(&node, &engine, &format!("gw-{i}")))
        .collect();
    let admins: Vec<Admin> = envoys.iter().map(Envoy::admin).collect();
    assert!(
        eventually(Duration::from_secs(10), || admins.iter().all(|a| gauge(
            a,
            "fleet.replicas"
        ) == REPLICAS
            as i64)),
        "every replica sees the fleet"
    );

    // "only" sends to replica 1 alone; "a" and "b" to all three. Each
    // offers the whole capacity: 3x it in all. Equal weights, so the
    // fleet-wide max-min share is a third each, wherever they send.
    let per_replica = |i: usize| -> Vec<ClientSpec> {
        let mut clients = vec![
            by_address("a", 2, CAPACITY / REPLICAS as f64),
            by_address("b", 3, CAPACITY / REPLICAS as f64),
        ];
        if i == 0 {
            clients.push(by_address("only", 1, CAPACITY));
        }
        clients
    };
    let started = Instant::now();
    let runs: Vec<_> = envoys
        .iter()
        .enumerate()
        .map(|(i, envoy)| {
            let spec = load_h2(
                &envoy.url("public").unwrap(),
                per_replica(i),
                Duration::from_secs(RUN_S),
                2,
            );
            std::thread::spawn(move || loadgen::run(&spec).expect("loadgen runs"))
        })
        .collect();
    // The outage, on the run's clock.
    std::thread::sleep(Duration::from_secs(OUTAGE_S.0).saturating_sub(started.elapsed()));
    engine.stop_redis();
    let fell_back = eventually(Duration::from_secs(2), || {
        admins.iter().all(|a| gauge(a, "fleet.fallback") == 1)
    });
    std::thread::sleep(Duration::from_secs(OUTAGE_S.1).saturating_sub(started.elapsed()));
    engine.start_redis().expect("redis starts again");
    let restored = eventually(Duration::from_secs(2), || {
        admins.iter().all(|a| gauge(a, "fleet.fallback") == 0)
    });
    let reports: Vec<Report> = runs.into_iter().map(|r| r.join().unwrap()).collect();

    let ids = ["only", "a", "b"];
    let check = |what: &str, from: u64, to: u64| {
        let got = admitted(&reports, &ids, from as usize, to as usize);
        let total: u64 = got.iter().sum();
        let rate = total as f64 / (to - from) as f64;
        let worst = got
            .iter()
            .map(|g| (*g as f64 / total as f64 * 100.0 - 100.0 / 3.0).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "{what}: admitted {got:?}, {rate:.0} rps of {CAPACITY}, max share error {worst:.2} pp"
        );
        (rate, worst)
    };
    let (steady, steady_error) = check("fleet", 2, OUTAGE_S.0);
    let (out, _) = check("redis away", OUTAGE_S.0, OUTAGE_S.1);
    let (after, after_error) = check("redis back (from 2 s on)", OUTAGE_S.1 + 2, RUN_S);
    for envoy in &envoys {
        for line in envoy.log().lines().filter(|l| l.contains("fleet exchange")) {
            eprintln!("{line}");
        }
    }

    assert!(fell_back, "every replica fell back while Redis was away");
    assert!(restored, "fleet shares were back within 2 s of Redis");
    let failed: u64 = reports
        .iter()
        .map(|r| r.count("503") + r.count("transport_error") + r.count("timeout"))
        .sum();
    assert_eq!(failed, 0, "no request failed because of Redis");
    assert!(
        (steady - CAPACITY).abs() <= 0.03 * CAPACITY,
        "fleet admitted {steady:.0} rps of {CAPACITY}"
    );
    assert!(
        steady_error <= 2.0,
        "fleet share error {steady_error:.2} pp"
    );
    assert!(
        out <= 1.05 * CAPACITY,
        "admitted {out:.0} rps of {CAPACITY} while Redis was away"
    );
    assert!(
        (after - CAPACITY).abs() <= 0.03 * CAPACITY && after_error <= 2.0,
        "after Redis came back: {after:.0} rps, {after_error:.2} pp"
    );
}
