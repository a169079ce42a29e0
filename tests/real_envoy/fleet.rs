//! Fleet mode's membership in real Envoys: replicas of the whole gateway
//! that start or stop change the fleet size every replica counts, through
//! real Redis and Webdis. (The fleet's shares and Redis outages are tested
//! by running scenarios/fleet.toml, in scenario_run.rs.)

use stakegate_stack::admin::Admin;
use stakegate_stack::{Envoy, EnvoyBuilder, FleetEngine, RpcNode};
use stakegate_tests::{eventually, gate_filter, qos_filter};
use std::time::Duration;

/// One replica: gateway.yaml with both filters, QoS in fleet mode.
fn replica(node: &RpcNode, engine: &FleetEngine, name: &str) -> Envoy {
    EnvoyBuilder::new("gateway.yaml")
        .filter(qos_filter(
            r#"{"capacityRps": 300, "fleet": {"syncMs": 100}}"#,
        ))
        .filter(gate_filter(r#"{"maxInflight": 100}"#))
        .var("RPC_NODE_HOST", node.addr().ip())
        .var("RPC_NODE_PORT", node.addr().port())
        .var("FLEET_PORT", engine.addr().port())
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
        eventually(Duration::from_secs(10), || all_see(&admins, 2)),
        "two replicas count each other"
    );

    // A third joins: counted from its first exchange (every 100 ms).
    let third = replica(&node, &engine, "gw-3");
    let mut with_third = admins.clone();
    with_third.push(third.admin());
    assert!(
        eventually(Duration::from_secs(5), || all_see(&with_third, 3)),
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
        eventually(Duration::from_secs(5), || all_see(&admins, 2)),
        "the replicas left count two again"
    );
}
