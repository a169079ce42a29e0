//! Shares of the node's time (`capacityNodeMs`) in virtual time: callers of
//! methods that cost the node from 0.2 ms to 40 ms, each request charged
//! its methods' estimates when its body is read and what it took when it
//! ends, the estimates learned by the round.

use super::*;
use crate::cost::method_key;
use crate::qos::report::MemoryQueue;
use crate::shared::MemoryStore;

/// A caller of one method whose cost (ms) may change at `change_ms`.
struct Caller {
    id: Identity,
    method: &'static str,
    rate: f64,
    cost_ms: f64,
    change: Option<(u64, f64)>,
}

fn caller(key: u64, method: &'static str, rate: f64, cost_ms: f64) -> Caller {
    Caller {
        id: identity(key, 25_000_000),
        method,
        rate,
        cost_ms,
        change: None,
    }
}

impl Caller {
    fn cost_ms(&self, now: u64) -> f64 {
        match self.change {
            Some((at, cost)) if now >= at => cost,
            _ => self.cost_ms,
        }
    }

    fn body(&self) -> Vec<u8> {
        format!(r#"{{"jsonrpc":"2.0","id":1,"method":"{}"}}"#, self.method).into_bytes()
    }
}

/// What a run gave each caller: node time (µs) and calls, from `from_ms`;
/// and the first VM's estimates at the end.
struct NodeRun {
    node_us: Vec<u64>,
    calls: Vec<u64>,
    vms: Vec<StakeQos>,
}

/// Two workers and a main-thread VM, as `drive`; each admitted request
/// holds the node exactly its method's cost.
fn drive_node_time(policy: &str, callers: &[Caller], run_ms: u64, from_ms: u64) -> NodeRun {
    let policy = QosPolicy::parse(policy.as_bytes()).unwrap();
    let store = MemoryStore::default();
    let queue = MemoryQueue::default();
    let workers = 2;
    let mut vms: Vec<StakeQos> = (0..=workers)
        .map(|i| StakeQos::new(policy.clone(), i as u64 + 1))
        .collect();
    let mut next_tick: Vec<u64> = (0..=workers as u64).map(|i| (i * 7 + 3) % 20).collect();
    let mut pending: Vec<(u64, usize, usize, Ticket)> = Vec::new();
    let mut run = NodeRun {
        node_us: vec![0; callers.len()],
        calls: vec![0; callers.len()],
        vms: Vec::new(),
    };
    let mut sent = vec![0u64; callers.len()];
    let mut turn = 0;
    for now in 1..=run_ms {
        for (vm, next) in vms.iter_mut().zip(&mut next_tick) {
            if now >= *next {
                vm.tick(&store, &queue, now).unwrap();
                *next = now + 20;
            }
        }
        for (done_us, vm, i, mut ticket) in pending.extract_if(.., |p| p.0 <= now * 1000) {
            let took = done_us - ticket.started_us;
            vms[vm].answered(&mut ticket, took, Some(200));
            if ticket.started_us >= from_ms * 1000 {
                run.node_us[i] += took;
                run.calls[i] += 1;
            }
            vms[vm].finish(now, ticket, Some(200));
        }
        for (i, c) in callers.iter().enumerate() {
            let due = (now as f64 * c.rate / 1000.0) as u64;
            while sent[i] < due {
                sent[i] += 1;
                turn += 1;
                let vm = 1 + turn % workers;
                let now_us = now * 1000;
                if let Verdict::Admit(mut ticket) = vms[vm].admit_at(&store, now_us, &c.id).verdict
                {
                    let body = c.body();
                    let cost = vms[vm].policy().costs.of_body(&body, vms[vm].learned());
                    vms[vm].charge_cost(
                        &mut ticket,
                        (cost.units * MILLI as f64) as i64,
                        1,
                        cost.method,
                    );
                    let took_us = (c.cost_ms(now) * 1000.0) as u64;
                    pending.push((now_us + took_us, vm, i, ticket));
                }
            }
        }
    }
    run.vms = vms;
    run
}

const NODE_POLICY: &str = r#"{"capacityNodeMs": 4000, "throttleThreshold": 0.95}"#;

#[test]
fn equal_stakes_share_the_nodes_time_not_its_calls() {
    // Four floods, each of one method: 0.2, 5, 20 and 40 ms a call.
    let callers = [
        caller(1, "eth_blockNumber", 400.0, 0.2),
        caller(2, "eth_call", 400.0, 5.0),
        caller(3, "eth_getLogs", 400.0, 20.0),
        caller(4, "eth_getProof", 400.0, 40.0),
    ];
    let (run_ms, from_ms) = (6000, 2000);
    let run = drive_node_time(NODE_POLICY, &callers, run_ms, from_ms);
    let seconds = (run_ms - from_ms) as f64 / 1000.0;
    let node_ms: Vec<f64> = run
        .node_us
        .iter()
        .map(|us| *us as f64 / 1000.0 / seconds)
        .collect();
    // Max-min over node time: the light caller wants 80 ms/s and gets it;
    // the other three share the rest equally.
    let light_wants = 400.0 * 0.2;
    assert!(
        node_ms[0] >= 0.97 * light_wants,
        "the light caller gets what it sends: {node_ms:?}"
    );
    let rest = 4000.0 - light_wants;
    for (i, got) in node_ms.iter().enumerate().skip(1) {
        assert!(
            (got / (rest / 3.0) - 1.0).abs() < 0.05,
            "caller {i}: {got:.0} ms/s of node time, fair {:.0}: {node_ms:?}",
            rest / 3.0
        );
    }
    eprintln!("node ms/s {node_ms:?}, calls {:?}", run.calls);
    let used: f64 = node_ms.iter().sum();
    assert!(
        used >= 0.93 * 4000.0,
        "the node time is given out: {used:.0}"
    );
    // Calls are anything but equal: eth_call gets eight times eth_getProof's.
    assert!(run.calls[1] > 7 * run.calls[3], "{:?}", run.calls);
}

#[test]
fn an_estimate_is_learned_and_follows_a_change_of_cost_within_two_seconds() {
    // eth_call costs 5 ms, then 50 ms from 4 s; an unknown method (no
    // seed) is charged the default until learned.
    let mut changing = caller(1, "eth_call", 50.0, 5.0);
    changing.change = Some((4000, 50.0));
    let callers = [changing, caller(2, "eth_unknown", 20.0, 2.0)];
    let policy = r#"{"capacityNodeMs": 100000, "costs": {"eth_call": 5}}"#;
    let before = drive_node_time(policy, &callers, 3900, 0);
    let learned = before.vms[1].learned();
    let call = learned.get(method_key("eth_call")).unwrap();
    assert!((call - 5.0).abs() < 0.5, "{call}");
    let unknown = learned.get(method_key("eth_unknown")).unwrap();
    assert!(
        (unknown - 2.0).abs() < 0.2,
        "learned, not the default: {unknown}"
    );
    let after = drive_node_time(policy, &callers, 6000, 0);
    let call = after.vms[1].learned().get(method_key("eth_call")).unwrap();
    assert!((call - 50.0).abs() <= 5.0, "within 10 % 2 s after: {call}");
}

#[test]
fn a_request_is_charged_its_estimate_then_what_it_took() {
    let policy =
        QosPolicy::parse(br#"{"capacityNodeMs": 1000, "costs": {"eth_getLogs": 20}}"#).unwrap();
    let store = MemoryStore::default();
    let mut qos = StakeQos::new(policy, 1);
    qos.state.throttling = true;
    let who = identity(9, 1000);
    let Verdict::Admit(mut ticket) = qos.admit_at(&store, 1_000_000, &who).verdict else {
        panic!("the new identity's gift admits it")
    };
    let lease = |qos: &StakeQos| qos.locals[&9].lease;
    let admitted = lease(&qos);
    // Admitted on one call at the default (10 ms); its body says 20 ms.
    assert_eq!(ticket.charged, 10_000);
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"eth_getLogs"}"#;
    let cost = qos.policy().costs.of_body(body, qos.learned());
    let method = cost.method;
    qos.charge_cost(&mut ticket, (cost.units * MILLI as f64) as i64, 1, method);
    assert_eq!(lease(&qos), admitted - 10_000);
    // The node took 35 ms: 15 more are charged.
    qos.answered(&mut ticket, 35_000, Some(200));
    qos.finish(1035, ticket, Some(200));
    assert_eq!(lease(&qos), admitted - 25_000);
    assert_eq!(
        qos.samples.0[&method_key("eth_getLogs")],
        (1, 35_000),
        "a sample of its method"
    );
    // Refused further on (a 503 in 1 ms): nothing learned, 1 ms charged.
    let Verdict::Admit(mut ticket) = qos.admit_at(&store, 1_100_000, &who).verdict else {
        panic!("the lease holds more")
    };
    let before = lease(&qos) + ticket.charged;
    qos.charge_cost(&mut ticket, 20_000, 1, method);
    qos.answered(&mut ticket, 1_000, Some(503));
    qos.finish(1101, ticket, Some(503));
    assert_eq!(lease(&qos), before - 1_000);
    assert_eq!(qos.samples.0[&method_key("eth_getLogs")], (1, 35_000));
    // The gate answered it with another request's answer and says the
    // node took 0: its estimate comes back, and nothing is learned.
    let Verdict::Admit(mut ticket) = qos.admit_at(&store, 1_150_000, &who).verdict else {
        panic!("the lease holds more")
    };
    let before = lease(&qos) + ticket.charged;
    qos.charge_cost(&mut ticket, 20_000, 1, method);
    qos.answered(&mut ticket, 0, Some(200));
    qos.finish(1151, ticket, Some(200));
    assert_eq!(lease(&qos), before);
    assert_eq!(qos.samples.0[&method_key("eth_getLogs")], (1, 35_000));
    // A batch of two: its estimates, once, then the one time it took.
    let Verdict::Admit(mut ticket) = qos.admit_at(&store, 1_200_000, &who).verdict else {
        panic!("the lease holds more")
    };
    let before = lease(&qos) + ticket.charged;
    let batch = br#"[{"id":1,"method":"eth_getLogs"},{"id":2,"method":"eth_getLogs"}]"#;
    let cost = qos.policy().costs.of_body(batch, qos.learned());
    assert_eq!(
        (cost.units, cost.method, cost.calls),
        (40.0, Some(method_key("eth_getLogs")), 2)
    );
    let method = cost.method;
    qos.charge_cost(&mut ticket, 40_000, 2, method);
    assert_eq!(lease(&qos), before - 40_000);
    qos.answered(&mut ticket, 50_000, Some(200));
    qos.finish(1250, ticket, Some(200));
    assert_eq!(lease(&qos), before - 50_000);
    assert_eq!(qos.samples.0[&method_key("eth_getLogs")], (3, 85_000));
}

#[test]
fn in_node_time_qos_counts_below_identify_above_by_calls_at_the_dearest_cost() {
    // 1000 node ms/s: 20,000 µs a round; identifying from 10,000, which is
    // 20 calls of the bound at the 0.5 ms default.
    let json = br#"{"capacityNodeMs": 1000, "defaultCost": 0.5, "loadSmoothing": 4}"#;
    let policy = QosPolicy::parse(json).unwrap();
    let (store, queue) = (MemoryStore::default(), MemoryQueue::default());
    let mut qos = StakeQos::new(policy, 1);
    let mut now = 1000;
    let mut rounds = |qos: &mut StakeQos, n: usize, calls: u32, counted: bool| -> Vec<bool> {
        (0..n)
            .map(|_| {
                match counted {
                    true => qos.count(calls, true, None),
                    false => qos.bound(calls),
                }
                now += 20;
                qos.tick(&store, &queue, now).unwrap();
                qos.counting()
            })
            .collect()
    };
    let quiet = rounds(&mut qos, 20, 5, true);
    assert!(quiet[5..].iter().all(|&c| c), "2.5 of 10 node ms a round");
    let busy = rounds(&mut qos, 20, 30, true);
    assert!(!busy[19], "15 node ms a round: identifies");
    assert!(
        !qos.state.throttling,
        "the counted bound is load, below 0.95"
    );
    let identified = rounds(&mut qos, 20, 30, false);
    assert!(identified.iter().all(|&c| !c), "{identified:?}");
    let calm = rounds(&mut qos, 20, 5, false);
    assert!(calm[19], "back to counting");
    // The counted bound is load: over the threshold, QoS throttles (and so
    // identifies).
    let over = rounds(&mut qos, 40, 60, true);
    assert!(qos.state.throttling && !over[39]);
    // A dearer method learned raises every call's bound.
    let mut learned = Estimates::default();
    learned.learn(method_key("eth_getProof"), 1, 40.0);
    assert_eq!(super::super::call_bound(&qos.policy, &learned), 40_000);
}
