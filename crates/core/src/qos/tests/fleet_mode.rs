//! Fleet mode in virtual time: replicas exchanging through a fake engine,
//! and the exchange's own rules.

use super::*;
use crate::qos::fleet::exchange::{Exchange, Heard};
use crate::qos::fleet::member_name;

#[derive(Default)]
struct FakeRedis {
    reports: BTreeMap<String, (u64, String)>,
}

impl FakeRedis {
    /// Runs the exchange in `body` at `now`: stores the report, answers all
    /// reports younger than the member time to live.
    fn exchange(&mut self, body: &[u8], now: u64) -> Vec<u8> {
        let text = std::str::from_utf8(body).unwrap();
        let parts: Vec<&str> = text.split('/').collect();
        assert_eq!((parts[0], parts[2]), ("EVALSHA", "1"));
        let ttl: u64 = parts[5].parse().unwrap();
        self.reports
            .insert(parts[4].to_string(), (now, parts[6].to_string()));
        self.reports.retain(|_, (at, _)| now - *at <= ttl);
        let list: Vec<&str> = self
            .reports
            .iter()
            .flat_map(|(name, (_, report))| [name.as_str(), report.as_str()])
            .collect();
        serde_json::json!({ "EVALSHA": list })
            .to_string()
            .into_bytes()
    }
}

/// Fleet mode in virtual time: `replicas` gateways, each one VM over its
/// own store and queue, exchanging through `FakeRedis` (unreachable while
/// `down` holds the time); client `i` sends to the replicas in
/// `on[i]` in turn. Counts admitted calls per client per 100 ms.
fn drive_fleet(
    policy: QosPolicy,
    clients: &[Client],
    on: &[&[usize]],
    replicas: usize,
    run_ms: u64,
    down: std::ops::Range<u64>,
) -> Run {
    let stores: Vec<MemoryStore> = (0..replicas).map(|_| MemoryStore::default()).collect();
    let queues: Vec<MemoryQueue> = (0..replicas).map(|_| MemoryQueue::default()).collect();
    let mut vms: Vec<StakeQos> = (0..replicas)
        .map(|i| StakeQos::new(policy.clone(), i as u64 + 1))
        .collect();
    let fleet_policy = policy.fleet.clone().unwrap();
    let mut links: Vec<Exchange> = (0..replicas)
        .map(|i| Exchange::new(&fleet_policy, Some(format!("gw-{i}")), i as u64).unwrap())
        .collect();
    let mut redis = FakeRedis::default();
    let mut run = Run::new(clients.len(), run_ms);
    let mut pending: Vec<(u64, usize, Ticket)> = Vec::new();
    let mut sent = vec![0u64; clients.len()];
    for now in 1..=run_ms {
        if now == down.end {
            // Redis comes back empty, as a restarted one does.
            redis = FakeRedis::default();
        }
        for r in 0..replicas {
            if !(now + 7 * r as u64).is_multiple_of(20) {
                continue;
            }
            let tick = vms[r].tick(&stores[r], &queues[r], now).unwrap();
            let Some(mut fleet) = tick.round.and_then(|round| round.fleet) else {
                continue;
            };
            let Some(body) = links[r].request(&vms[r], &mut fleet) else {
                continue;
            };
            links[r].sent(now as u32, now);
            let (status, answer) = if down.contains(&now) {
                (Some(503), Vec::new())
            } else {
                (Some(200), redis.exchange(&body, now))
            };
            links[r].answered(&vms[r], &stores[r], now + 1, status, &answer);
        }
        finish_due(&mut vms, &mut pending, now);
        for (i, c) in clients.iter().enumerate() {
            let due = (now as f64 * c.rate / 1000.0) as u64;
            while sent[i] < due {
                sent[i] += 1;
                let r = on[i][sent[i] as usize % on[i].len()];
                match vms[r].admit(&stores[r], now, &c.id).verdict {
                    Verdict::Admit(ticket) => {
                        pending.push((now + c.latency_ms, r, ticket));
                        run.per_window[i][(now / 100) as usize] += 1;
                    }
                    Verdict::Throttle(_) => run.throttled += 1,
                }
            }
        }
    }
    run
}

fn fleet_policy(capacity: u32) -> QosPolicy {
    let json = format!(r#"{{"capacityRps": {capacity}, "fleet": {{"syncMs": 100}}}}"#);
    QosPolicy::parse(json.as_bytes()).unwrap()
}

/// One client only on the first replica, two on all three, each offering
/// the whole capacity: together 3× it.
fn uneven_fleet() -> (Vec<Client>, Vec<&'static [usize]>) {
    let clients = vec![
        client(1, 1000, 600.0),
        client(2, 1000, 600.0),
        client(3, 2000, 600.0),
    ];
    (clients, vec![&[0], &[0, 1, 2], &[0, 1, 2]])
}

#[test]
fn a_fleet_admits_its_capacity_once_with_fleet_wide_max_min_shares() {
    let (clients, on) = uneven_fleet();
    let run = drive_fleet(fleet_policy(600), &clients, &on, 3, 6000, 0..0);
    let admitted = run.admitted(100, 2000, 6000);
    let total: u64 = admitted.iter().sum();
    // 600 a second for 4 s.
    assert!(
        (total as f64 - 2400.0).abs() <= 0.03 * 2400.0,
        "admitted {total} of 2400: {admitted:?}"
    );
    let error = share_error(&admitted, &fair_shares(&clients, 600.0));
    assert!(error <= 2.0, "{admitted:?}: {error} pp");
}

#[test]
fn a_fleet_without_redis_falls_back_to_its_part_and_recovers() {
    let (clients, on) = uneven_fleet();
    let run = drive_fleet(fleet_policy(600), &clients, &on, 3, 9000, 3000..6000);
    // Out: at most capacity (each replica a third of it), give or take
    // what the buckets held when it went.
    let out: u64 = run.admitted(100, 3000, 6000).iter().sum();
    assert!(
        out as f64 <= 1.05 * 1800.0,
        "admitted {out} of 1800 while out"
    );
    // Back: fleet shares again within two seconds.
    let admitted = run.admitted(100, 7000, 9000);
    let error = share_error(&admitted, &fair_shares(&clients, 600.0));
    assert!(error <= 2.0, "{admitted:?}: {error} pp after");
}

/// Webdis's answer listing replicas `names` (the `n`th of instance `n`),
/// each with an empty report.
fn listing(names: &[&str]) -> Vec<u8> {
    let members: Vec<String> = names
        .iter()
        .map(|n| member_name(n, n.trim_start_matches("gw-").parse().unwrap_or(9)))
        .collect();
    let list: Vec<&str> = members.iter().flat_map(|m| [m.as_str(), "01"]).collect();
    serde_json::json!({ "EVALSHA": list })
        .to_string()
        .into_bytes()
}

#[test]
fn an_exchange_times_out_by_itself_and_logs_a_spell_of_failures_once() {
    let policy = fleet_policy(300);
    let qos = StakeQos::new(policy.clone(), 1);
    let store = MemoryStore::default();
    let fleet = policy.fleet.clone().unwrap();
    let mut link = Exchange::new(&fleet, Some("gw-1".into()), 1).unwrap();
    link.sent(7, 1000);
    assert!(link.owns(7) && !link.owns(8));
    assert_eq!(link.expire(1000 + fleet.timeout_ms), None);
    let Some(Heard::Failed { log: Some(line) }) = link.expire(1001 + fleet.timeout_ms) else {
        panic!("the exchange times out");
    };
    assert!(
        line.contains("no answer within fleet.timeoutMs (250 ms)"),
        "{line}"
    );
    link.sent(8, 2000);
    assert_eq!(
        link.answered(&qos, &store, 2001, Some(503), b""),
        Some(Heard::Failed { log: None }),
        "the same spell is not logged again"
    );
    link.sent(9, 3000);
    let Some(Heard::Exchanged {
        took_ms: 1,
        back: Some(line),
        duplicate_names: 0,
        warn: None,
    }) = link.answered(&qos, &store, 3001, Some(200), &listing(&["gw-1", "gw-2"]))
    else {
        panic!("the answer is taken");
    };
    assert!(line.contains("works again: 2 replicas"), "{line}");
    assert_eq!(link.answered(&qos, &store, 3002, Some(200), b""), None);
}

#[test]
fn a_refused_exchange_says_which_credentials_are_missing() {
    let policy = fleet_policy(300);
    let qos = StakeQos::new(policy.clone(), 1);
    let store = MemoryStore::default();
    let fleet = policy.fleet.clone().unwrap();
    let mut link = Exchange::new(&fleet, Some("gw-1".into()), 1).unwrap();
    link.sent(1, 100);
    let Some(Heard::Failed { log: Some(line) }) =
        link.answered(&qos, &store, 101, Some(403), b"Forbidden")
    else {
        panic!("a refusal is a failed exchange, logged");
    };
    assert!(
        line.contains("STAKEGATE_FLEET_AUTH=user:password"),
        "{line}"
    );
}

#[test]
fn after_a_failure_an_answer_listing_fewer_replicas_gives_only_the_fleet_size() {
    let policy = fleet_policy(300);
    let qos = StakeQos::new(policy.clone(), 1);
    let store = MemoryStore::default();
    let fleet = policy.fleet.clone().unwrap();
    let mut link = Exchange::new(&fleet, Some("gw-1".into()), 1).unwrap();
    let view = |store: &MemoryStore| read::<FleetView>(store, FLEET_KEY).unwrap().0;
    // A fresh replica trusts its first answer.
    link.sent(1, 100);
    link.answered(
        &qos,
        &store,
        101,
        Some(200),
        &listing(&["gw-1", "gw-2", "gw-3"]),
    );
    assert_eq!((view(&store).replicas, view(&store).answered_ms), (3, 101));
    // Redis restarted: the first answer after the failure lists only who
    // has reported since. It sets the size, not the allocation.
    link.sent(2, 200);
    link.answered(&qos, &store, 201, None, b"");
    link.sent(3, 300);
    link.answered(&qos, &store, 301, Some(200), &listing(&["gw-1"]));
    assert_eq!((view(&store).replicas, view(&store).answered_ms), (1, 101));
    // The next one is trusted, whatever it lists.
    link.sent(4, 400);
    link.answered(&qos, &store, 401, Some(200), &listing(&["gw-1", "gw-2"]));
    assert_eq!((view(&store).replicas, view(&store).answered_ms), (2, 401));
}

#[test]
fn a_replica_needs_a_name_redis_can_carry() {
    let fleet = fleet_policy(300).fleet.unwrap();
    let err = Exchange::new(&fleet, Some("gw 1".into()), 1).unwrap_err();
    assert!(
        err.contains("fleet.replica: not set, and Envoy's node id (\"gw 1\")"),
        "{err}"
    );
    assert!(Exchange::new(&fleet, None, 1).is_err());
    assert_eq!(
        Exchange::new(&fleet, Some("gw-1".into()), 0xab)
            .unwrap()
            .member(),
        "gw-1~00000000000000ab"
    );
}
