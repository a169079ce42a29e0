//! Fleet mode in real Envoys, through real Redis and Webdis: replicas that
//! start or stop change the fleet size every replica counts; and a fleet
//! that trusts nothing it cannot check: two replicas with one name, reports
//! nobody sent, or a key of the wrong type never make it admit more than
//! its capacity. (The fleet's shares and Redis outages are tested by
//! running scenarios/fleet.toml, in scenario_run.rs.)

use stakegate_loadgen::ClientSpec;
use stakegate_stack::admin::Admin;
use stakegate_stack::redis::ADMIN_USER;
use stakegate_stack::{http, loadgen, Envoy, EnvoyBuilder, FleetEngine, RpcNode};
use stakegate_tests::{
    client, eventually, example_policy, gate_filter, load_h2, qos_filter, SETTLE,
};
use std::time::Duration;

/// One replica: gateway.yaml with both filters, QoS in fleet mode.
fn replica(node: &RpcNode, engine: &FleetEngine, name: &str) -> Envoy {
    replica_with(
        node,
        engine,
        name,
        r#"{"capacityRps": 300, "fleet": {"syncMs": 100}}"#,
    )
}

fn replica_with(node: &RpcNode, engine: &FleetEngine, name: &str, qos_policy: &str) -> Envoy {
    EnvoyBuilder::new("gateway.yaml")
        .filter(qos_filter(qos_policy))
        .filter(gate_filter(r#"{"maxInflight": 100}"#))
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .fleet(engine)
        .concurrency(1)
        .arg("--service-node")
        .arg(name)
        .start()
        .expect("envoy starts")
}

fn fleet_size(admin: &Admin) -> i64 {
    admin
        .stat("wasmcustom.stakegate.qos.fleet.replicas")
        .unwrap_or(-1)
}

#[test]
fn replicas_that_join_and_leave_change_the_fleet_size() {
    let node = RpcNode::start::<&str>(&[]).expect("rpc-node starts");
    let engine = FleetEngine::start().expect("redis and webdis start");
    let first = [
        replica(&node, &engine, "gw-1"),
        replica(&node, &engine, "gw-2"),
    ];
    let admins: Vec<Admin> = first.iter().map(Envoy::admin).collect();
    let all_see = |admins: &[Admin], n: i64| admins.iter().all(|a| fleet_size(a) == n);
    assert!(
        eventually(SETTLE, || all_see(&admins, 2)),
        "two replicas count each other"
    );

    // A third joins: counted from its first exchange (every 100 ms).
    let third = replica(&node, &engine, "gw-3");
    let mut with_third = admins.clone();
    with_third.push(third.admin());
    assert!(
        eventually(SETTLE, || all_see(&with_third, 3)),
        "every replica counts the one that joined"
    );
    assert_eq!(
        third
            .stat("wasmcustom.stakegate.qos.fleet.fallback")
            .unwrap(),
        0,
        "it shares the fleet's capacity, not a fallback"
    );

    // It stops: it leaves the fleet once it has not reported for
    // memberTtlMs (1 s), and the others' parts cover the whole again.
    drop(third);
    assert!(
        eventually(SETTLE, || all_see(&admins, 2)),
        "the replicas left count two again"
    );
}

const CAPACITY: f64 = 300.0;

/// Two replicas with the example stake table (300 rps in all), in front of
/// a quick node; both named `names`.
fn staked_fleet(names: [&str; 2]) -> (RpcNode, FleetEngine, Vec<Envoy>) {
    let node = RpcNode::start(&["--read-slots", "64"]).expect("rpc-node starts");
    let engine = FleetEngine::start().expect("redis and webdis start");
    let policy = example_policy(
        "stake-qos",
        serde_json::json!({ "capacityRps": CAPACITY, "fleet": { "syncMs": 100 } }),
    );
    let replicas: Vec<Envoy> = names
        .iter()
        .map(|name| replica_with(&node, &engine, name, &policy))
        .collect();
    (node, engine, replicas)
}

/// The example's stakers 40, 20 and 10 at 250 rps each (750 offered for
/// 300), each sending to both replicas in turn, for 8 s: what each was
/// admitted per second over the last 5.
fn flood(replicas: &[Envoy]) -> Vec<(String, f64)> {
    let targets: Vec<String> = replicas.iter().map(|r| r.url("public").unwrap()).collect();
    let clients: Vec<ClientSpec> = [40, 20, 10]
        .iter()
        .map(|stake| ClientSpec {
            api_key: Some(format!("key-stake-{stake}")),
            targets: targets.clone(),
            unique_params: true,
            ..client(&format!("stake-{stake}"), 250.0, "eth_call", 1000)
        })
        .collect();
    let report = loadgen::run(&load_h2(&targets[0], clients, Duration::from_secs(8), 2)).unwrap();
    report
        .clients
        .iter()
        .map(|c| {
            let ok: u64 = c.timeline.iter().skip(3).take(5).map(|s| s.ok).sum();
            (c.header.id.clone(), ok as f64 / 5.0)
        })
        .collect()
}

/// Each staker's weighted max-min share of the capacity (stakes 40, 20,
/// 10, all asking more than that): what the fleet gives, and what each
/// replica's fallback (half the capacity, the same stakes) gives too.
fn fair(id: &str) -> f64 {
    let stake: f64 = id.trim_start_matches("stake-").parse().unwrap();
    CAPACITY * stake / 70.0
}

fn check_within_capacity(case: &str, admitted: &[(String, f64)]) {
    let total: f64 = admitted.iter().map(|(_, rps)| rps).sum();
    eprintln!("{case}: {admitted:?}, {total:.1} rps in all for {CAPACITY}");
    assert!(
        total <= CAPACITY * 1.05,
        "{case}: {total:.1} rps admitted for {CAPACITY}"
    );
    for (id, rps) in admitted {
        // Far below a machine-speed limit: a client starved by the fault
        // gets a few per cent of its share.
        assert!(
            *rps >= fair(id) * 0.5,
            "{case}: {id} got {rps:.1} rps of its {:.1}",
            fair(id)
        );
    }
}

#[test]
fn two_replicas_with_one_name_count_as_two_and_say_so() {
    let (_node, _engine, replicas) = staked_fleet(["gw-1", "gw-1"]);
    let admins: Vec<Admin> = replicas.iter().map(Envoy::admin).collect();
    assert!(eventually(SETTLE, || {
        admins.iter().all(|a| fleet_size(a) == 2)
    }));
    check_within_capacity("one name, two replicas", &flood(&replicas));
    for r in &replicas {
        assert_eq!(
            r.stat("wasmcustom.stakegate.qos.fleet.duplicate_names")
                .unwrap(),
            1
        );
        assert!(r.log().contains("gw-1"), "the log names the duplicate");
    }
}

/// Commands run in Redis directly as its admin, as one who got past
/// Webdis and Redis's ACL could, all at once (`MULTI`); their answers.
fn redis(engine: &FleetEngine, commands: &[Vec<String>]) -> String {
    let mut all = vec![command(&["MULTI"])];
    all.extend(commands.iter().cloned());
    all.push(command(&["EXEC"]));
    let (ok, out) = redis_as(engine, ADMIN_USER, engine.redis_passwords().1, &all);
    assert!(ok, "{commands:?}: {out}");
    out
}

/// Commands run in Redis directly as `user`: whether redis-cli ended
/// well, and the answers.
fn redis_as(
    engine: &FleetEngine,
    user: &str,
    password: &str,
    commands: &[Vec<String>],
) -> (bool, String) {
    use std::io::Write;
    let mut child = std::process::Command::new("redis-cli")
        .arg("-s")
        .arg(engine.redis_socket())
        .args(["--user", user, "--no-auth-warning"])
        .env("REDISCLI_AUTH", password)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli runs");
    let script: String = commands.iter().map(|c| c.join(" ") + "\n").collect();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let out = String::from_utf8(output.stdout).unwrap();
    (output.status.success(), out)
}

fn command(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

#[test]
fn webdis_runs_the_exchange_only_for_the_gateways() {
    let engine = FleetEngine::start().expect("redis and webdis start");
    let url = |command: &str| format!("http://{}/{command}", engine.addr());
    assert_eq!(
        http::get(&url("PING")).unwrap().status,
        200,
        "health checks"
    );
    for command in ["SET/stakegate:members/x", "EVAL/return%201/0", "FLUSHALL"] {
        assert_eq!(http::get(&url(command)).unwrap().status, 403, "{command}");
    }
    let basic = stakegate_core::qos::fleet::basic_authorization(engine.credentials());
    // A command with the gateways' credentials: status and body.
    let with = |command: &str| {
        let (status, _, body) = http::post_raw(
            &format!("http://{}/", engine.addr()),
            &[("authorization", &basic)],
            command,
        )
        .unwrap();
        (status, String::from_utf8_lossy(&body).to_string())
    };
    let sha1 = stakegate_core::qos::fleet::SCRIPT_SHA1;
    let exchange = with(&format!(
        "EVALSHA/{sha1}/1/stakegate:members/probe~1/1000/01"
    ));
    assert_eq!(exchange.0, 200, "the exchange runs: {}", exchange.1);
    assert!(exchange.1.contains("probe~1"), "{}", exchange.1);
    // Before, EVAL ran any script for the credentials (KEYS among them).
    // Webdis 0.1.9 takes a command its ACL enables by a prefix of the
    // name (EVAL for EVALSHA): Redis's ACL refuses it then.
    let refused = |command: &str| {
        let (status, body) = with(command);
        assert!(
            status == 403 || body.contains("NOPERM"),
            "{command}: {status} {body}"
        );
    };
    for command in [
        "EVAL/return redis.call('KEYS','*')/0",
        "EVAL/return 1/0",
        "SCRIPT/LOAD/return 1",
        "SET/stakegate:members/x",
        "KEYS/*",
    ] {
        refused(command);
    }
    // Only the script an admin loaded: any other is unknown to Redis.
    let (_, other) = with("EVALSHA/e0e1f9fabfc9d4800c877a703b823ac0578ff8db/0");
    assert!(other.contains("NOSCRIPT"), "{other}");
    // Webdis's own account in Redis, were Webdis's ACL got round: the
    // fleet's script and its commands on the fleet's keys, nothing else.
    let webdis = engine.redis_passwords().0;
    let (_, denied) = redis_as(
        &engine,
        "default",
        webdis,
        &[
            command(&["KEYS", "*"]),
            command(&["EVAL", "return 1", "0"]),
            command(&["GET", "other:key"]),
            command(&["FLUSHALL"]),
            command(&["GET", "stakegate:members"]),
        ],
    );
    assert_eq!(denied.matches("NOPERM").count(), 4, "{denied}");
}

#[test]
fn fifty_phantom_reports_cannot_make_the_fleet_admit_more_nor_starve_a_client() {
    let (_node, engine, replicas) = staked_fleet(["gw-1", "gw-2"]);
    let admins: Vec<Admin> = replicas.iter().map(Envoy::admin).collect();
    assert!(eventually(SETTLE, || {
        admins.iter().all(|a| fleet_size(a) == 2)
    }));
    // What a real replica reports, read in Redis: its identities' keys
    // and stakes. Under load, so that it has identities to report.
    let targets: Vec<String> = replicas.iter().map(|r| r.url("public").unwrap()).collect();
    let warm = ClientSpec {
        api_key: Some("key-stake-40".into()),
        targets: targets.clone(),
        ..client("warm", 100.0, "eth_call", 100)
    };
    loadgen::run(&load_h2(&targets[0], vec![warm], Duration::from_secs(2), 1)).unwrap();
    let members = redis(
        &engine,
        &[command(&["ZRANGE", "stakegate:members", "0", "-1"])],
    );
    // (After MULTI's and the queued command's answers.)
    let member = members
        .lines()
        .find(|l| l.contains('~'))
        .unwrap()
        .to_string();
    let key = format!("stakegate:report:{member}");
    let report = redis(&engine, &[command(&["GET", &key])]);
    let report = report.lines().last().unwrap().trim();
    assert!(report.len() > 2, "the replica reports identities: {report}");
    // Fifty members that never expire (a score far in the future), each
    // claiming every one of those identities at 100,000 calls a second.
    let heavy: String = report.as_bytes()[2..]
        .chunks(40)
        .map(|entry| {
            format!(
                "{}{}",
                std::str::from_utf8(&entry[..32]).unwrap(),
                "0050c347"
            )
        })
        .collect();
    let phantoms: Vec<Vec<String>> = (0..50)
        .flat_map(|i| {
            let phantom = format!("phantom-{i}~{i:016x}");
            let key = format!("stakegate:report:{phantom}");
            [
                command(&["ZADD", "stakegate:members", "9999999999999", &phantom]),
                command(&["SET", &key, &format!("01{heavy}")]),
            ]
        })
        .collect();
    redis(&engine, &phantoms);
    check_within_capacity("fifty phantoms", &flood(&replicas));
    for r in &replicas {
        assert!(
            r.stat("wasmcustom.stakegate.qos.fleet.exchange_failures")
                .unwrap()
                > 0
        );
        assert!(
            r.log().contains("more than fleet.maxReplicas"),
            "the log says why"
        );
    }
}

#[test]
fn a_key_of_the_wrong_type_makes_every_replica_fall_back_within_capacity() {
    let (_node, engine, replicas) = staked_fleet(["gw-1", "gw-2"]);
    let admins: Vec<Admin> = replicas.iter().map(Envoy::admin).collect();
    assert!(eventually(SETTLE, || {
        admins.iter().all(|a| fleet_size(a) == 2)
    }));
    redis(
        &engine,
        &[
            command(&["DEL", "stakegate:members"]),
            command(&["SET", "stakegate:members", "garbage"]),
        ],
    );
    check_within_capacity("members key of the wrong type", &flood(&replicas));
    for a in &admins {
        assert_eq!(
            a.stat("wasmcustom.stakegate.qos.fleet.fallback").unwrap(),
            1
        );
    }
}
