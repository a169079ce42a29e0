//! The compiled stake QoS filter in the offline host, in virtual time.

use stakegate_core::qos::page::ENTRY_LEN;
use stakegate_host::{Host, Reply, Request};
use std::time::Duration;

fn qos(policy: &str, workers: usize) -> Host {
    let module = stakegate_stack::paths::wasm_module("stake_qos").expect("make build");
    Host::new(&std::fs::read(module).unwrap(), policy.as_bytes(), workers).unwrap()
}

#[test]
fn one_refill_round_per_interval_across_workers() {
    let mut host = qos(r#"{"capacityRps": 100}"#, 2);
    host.advance(Duration::from_secs(1)).unwrap();
    let rounds = host.metric("stakegate.qos.rounds");
    // Every VM ticks every 20 ms; one of them wins each round (the very
    // first may be claimed twice, before the state exists).
    assert!((49..=51).contains(&rounds), "{rounds} rounds");
}

/// Sends one request per address, `per_ms` of them per virtual millisecond,
/// each answered at once.
fn from_addresses(host: &mut Host, addresses: impl Iterator<Item = String>, per_ms: usize) {
    for (n, address) in addresses.enumerate() {
        let request = Request::json_rpc(r#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#)
            .property(
                &["source", "address"],
                format!("{address}:40000").as_bytes(),
            );
        match host.request(n % host.workers(), &request).unwrap() {
            Reply::Continue(id) => host.finish(id, 200, Duration::from_millis(1)).unwrap(),
            Reply::LocalReply(reply) => panic!("throttled below capacity: {}", reply.status),
            Reply::Held(id) => panic!("QoS held {id:?}"),
        }
        if n % per_ms == per_ms - 1 {
            host.advance(Duration::from_millis(1)).unwrap();
        }
    }
}

#[test]
fn a_hundred_thousand_addresses_stay_within_max_identities() {
    // Identifying every request (far below capacity QoS would only count).
    let mut host = qos(
        r#"{"capacityRps": 1000000, "maxIdentities": 1000, "identifyAbove": 0}"#,
        2,
    );
    let address = |i: u32| format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255);
    from_addresses(&mut host, (0..2_000).map(address), 20);
    let after_2k = host.shared_data_size();
    from_addresses(&mut host, (2_000..100_000).map(address), 20);
    let after_100k = host.shared_data_size();
    // ceil(1000 / 128) = 8 pages of at most 128 entries (plus a 3-byte
    // header), the state record, the active-page bitmap, the demand sum and
    // the light state.
    let pages = 8;
    assert_eq!(after_100k.0, pages + 4, "keys: {after_100k:?}");
    assert!(
        after_100k.1 <= pages * (3 + 128 * ENTRY_LEN) + 256,
        "{} bytes",
        after_100k.1
    );
    assert_eq!(after_2k.0, after_100k.0);
    assert!(
        after_100k.1 <= after_2k.1 + ENTRY_LEN * pages,
        "{after_2k:?} -> {after_100k:?}"
    );
    // Active in the last round: the addresses that called in it (one call
    // each is idle after its first round), never more than the table holds.
    let identities = host.metric("stakegate.qos.identities");
    assert!(
        (200..=1024).contains(&identities),
        "{identities} identities"
    );
    assert!(host.metric("stakegate.qos.evicted") >= 98_000);
}

/// A sender through the host: its API key (or address), calls per request,
/// and requests per second.
struct Sender {
    key: Option<&'static str>,
    address: String,
    batch: usize,
    rate: f64,
}

fn sender(key: &'static str, rate: f64) -> Sender {
    Sender {
        key: Some(key),
        address: "10.0.0.1".into(),
        batch: 1,
        rate,
    }
}

/// Runs `senders` through `host` for `run_ms` of virtual time, each request
/// answered 5 ms later, spread over the workers; returns calls admitted
/// per sender from `measure_from_ms` on.
fn drive(host: &mut Host, senders: &[Sender], run_ms: u64, measure_from_ms: u64) -> Vec<u64> {
    let mut admitted = vec![0u64; senders.len()];
    let mut sent = vec![0u64; senders.len()];
    let mut pending: Vec<(u64, stakegate_host::RequestId)> = Vec::new();
    let mut turn = 0;
    for now in 0..run_ms {
        host.advance(Duration::from_millis(1)).unwrap();
        pending.retain(|(at, id)| {
            if *at > now {
                return true;
            }
            host.finish(*id, 200, Duration::from_millis(5)).unwrap();
            false
        });
        for (i, s) in senders.iter().enumerate() {
            let due = (now as f64 * s.rate / 1000.0) as u64;
            while sent[i] < due {
                sent[i] += 1;
                turn += 1;
                let call = r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[]}"#;
                let body = if s.batch == 1 {
                    call.to_string()
                } else {
                    format!("[{}]", vec![call; s.batch].join(","))
                };
                let mut request = Request::json_rpc(&body).property(
                    &["source", "address"],
                    format!("{}:4000", s.address).as_bytes(),
                );
                if let Some(key) = s.key {
                    request = request.header("x-api-key", key);
                }
                if let Reply::Continue(id) = host.request(turn % host.workers(), &request).unwrap()
                {
                    pending.push((now + 5, id));
                    if now >= measure_from_ms {
                        admitted[i] += s.batch as u64;
                    }
                }
            }
        }
    }
    admitted
}

/// A policy of capacity `capacity` staking `key-a` .. `key-d` as given.
fn staked(capacity: u32, stakes: &[(&str, u64)]) -> String {
    let entries: Vec<String> = stakes
        .iter()
        .map(|(key, stake)| {
            format!(
                r#"{{"apiKeySha256": "{}", "name": "{key}", "stake": {stake}}}"#,
                sha256(key)
            )
        })
        .collect();
    format!(
        r#"{{"capacityRps": {capacity}, "stakes": [{}]}}"#,
        entries.join(",")
    )
}

fn sha256(text: &str) -> String {
    stakegate_core::request::sha256_hex(text.as_bytes())
}

#[test]
fn a_light_staker_leaves_its_share_to_the_floods_through_the_module() {
    // key-a holds 60 % of the stake and sends 100 of 1,000 rps; the floods
    // share the other 900 by stake, 1 : 3.
    let policy = staked(
        1000,
        &[
            ("key-a", 60_000_000),
            ("key-b", 10_000_000),
            ("key-c", 30_000_000),
        ],
    );
    let mut host = qos(&policy, 2);
    let got = drive(
        &mut host,
        &[
            sender("key-a", 100.0),
            sender("key-b", 2000.0),
            sender("key-c", 2000.0),
        ],
        8000,
        3000,
    );
    let total: u64 = got.iter().sum();
    assert!(total >= 4900, "{got:?}: {total} of 5,000");
    assert!(got[0] >= 490, "{got:?}");
    let b_share = got[1] as f64 / (got[1] + got[2]) as f64;
    assert!((b_share - 0.25).abs() <= 0.01, "{got:?}");
}

#[test]
fn a_thousand_idle_identities_take_nothing_from_an_active_one() {
    let flood = |host: &mut Host, from_ms: u64| {
        drive(
            host,
            &[Sender {
                key: None,
                address: "10.9.9.9".into(),
                batch: 1,
                rate: 1600.0,
            }],
            from_ms + 4000,
            from_ms + 1000,
        )[0]
    };
    // Identifying every request: the crowd alone is far below capacity.
    let policy = r#"{"capacityRps": 400, "identifyAbove": 0}"#;
    let alone = flood(&mut qos(policy, 2), 0);
    // 1,000 identities send one request each, then go quiet (an identity
    // that sent once is idle after about 100 rounds, 2 s).
    let mut host = qos(policy, 2);
    let crowd: Vec<Sender> = (0..1000)
        .map(|i| Sender {
            key: None,
            address: format!("10.1.{}.{}", i / 250, i % 250 + 1),
            batch: 1,
            rate: 1.0,
        })
        .collect();
    drive(&mut host, &crowd, 1001, 0);
    host.advance(Duration::from_millis(100)).unwrap();
    // They were seen: the table holds them (an identity that comes once
    // is idle after its first round: its call is taken as spread over a
    // second).
    let seen = host.metric("stakegate.qos.evicted") == 0 && host.shared_data_size().1 >= 900 * 48;
    assert!(seen, "{:?}", host.shared_data_size());
    // They stay in the table (the idle TTL is a minute), with no weight.
    host.advance(Duration::from_secs(3)).unwrap();
    assert_eq!(host.metric("stakegate.qos.identities"), 0);
    assert!(
        host.shared_data_size().1 >= 900 * 48,
        "{:?}",
        host.shared_data_size()
    );
    let beside = flood(&mut host, 0);
    eprintln!("alone {alone}, beside 1,000 idle identities {beside}");
    assert!(
        (beside as f64 - alone as f64).abs() <= 0.02 * alone as f64,
        "alone {alone}, beside 1,000 idle identities {beside}"
    );
}

#[test]
fn a_batch_pays_one_token_per_call_through_the_module() {
    // The unstaked client's 50-call batches against a 10 M staker: shares
    // are counted in calls, so the unstaked one gets a sliver.
    let policy = staked(1000, &[("key-a", 10_000_000)]);
    let mut host = qos(&policy, 2);
    let got = drive(
        &mut host,
        &[
            Sender {
                key: None,
                address: "10.2.2.2".into(),
                batch: 50,
                rate: 100.0,
            },
            sender("key-a", 2000.0),
        ],
        6000,
        2000,
    );
    let share = got[0] as f64 / (got[0] + got[1]) as f64;
    assert!(
        share < 0.02,
        "{got:?}: the batches got {:.1} % of calls",
        100.0 * share
    );
}

#[test]
fn leases_admit_no_more_than_the_tokens_with_four_workers() {
    let mut host = qos(r#"{"capacityRps": 1000}"#, 4);
    let got = drive(
        &mut host,
        &[Sender {
            key: None,
            address: "10.3.3.3".into(),
            batch: 1,
            rate: 5000.0,
        }],
        6000,
        1000,
    )[0];
    // 5 s at 1,000 rps, plus at most the two-round bucket (40) and one
    // lease per worker (four of a quarter of a 20-token round).
    assert!(got <= 5000 + 40 + 20, "{got}");
    assert!(got >= 4900, "{got}");
    let leases = host.metric("stakegate.qos.leases");
    assert!(leases < 30_000 / 10, "{leases} leases for 30,000 requests");
}

#[test]
fn far_below_its_threshold_qos_counts_and_a_batch_flood_makes_it_identify_and_throttle() {
    let mut host = qos(r#"{"capacityRps": 1000}"#, 2);
    let light = |i: u8| Sender {
        key: None,
        address: format!("10.0.0.{i}"),
        batch: 1,
        rate: 20.0,
    };
    // 60 rps of 55-byte calls: a bound of 120 calls a second, under half of
    // 1,000.
    let quiet = [light(1), light(2), light(3)];
    drive(&mut host, &quiet, 2000, 0);
    assert_eq!(host.metric("stakegate.qos.counting"), 1);
    assert_eq!(host.metric("stakegate.qos.identities"), 0);
    let counted = host.metric("stakegate.qos.counted");
    assert!((110..=120).contains(&counted), "{counted} of 120 counted");
    let admitted: i64 = ["unstaked", "staked"]
        .iter()
        .map(|t| host.metric(&format!("stakegate.qos.admitted.{t}")))
        .sum();
    assert!(admitted <= 10, "{admitted} identified while counting");

    // Batches of 20 calls at 100 a second: twice the capacity in calls,
    // and more by their bound: QoS identifies, and throttles to capacity.
    let flood = Sender {
        key: None,
        address: "10.0.0.9".into(),
        batch: 20,
        rate: 100.0,
    };
    let got = drive(&mut host, &[flood], 4000, 2000);
    assert_eq!(host.metric("stakegate.qos.counting"), 0);
    assert_eq!(host.metric("stakegate.qos.throttling"), 1);
    // 1,000 calls a second for 2 s, give or take a batch's debt.
    assert!((1900..=2100).contains(&got[0]), "{} calls admitted", got[0]);
}
