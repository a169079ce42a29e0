//! A stream's steps, driven as the glue drives them.

use super::*;
use crate::qos::policy::QosPolicy;
use crate::request::MetadataScope;
use crate::shared::MemoryStore;
use std::net::IpAddr;

/// A client at one address whose request has `headers`.
struct Client(&'static [(&'static str, &'static str)]);

impl RequestFacts for Client {
    fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
        None
    }
    fn source_ip(&mut self) -> Option<IpAddr> {
        "192.0.2.7".parse().ok()
    }
    fn peer_uri_san(&mut self) -> Option<String> {
        None
    }
    fn header(&mut self, name: &str) -> Option<String> {
        let found = self.0.iter().find(|(n, _)| *n == name);
        found.map(|(_, v)| v.to_string())
    }
}

struct Bytes(Vec<u8>);

impl Body for Bytes {
    fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
        self.0.get(start..start + len).unwrap_or_default().to_vec()
    }
}

/// A masked client text frame holding `text`.
fn frame(text: &str) -> Vec<u8> {
    let mut out = vec![0x81, 0x80 | text.len() as u8, 0, 0, 0, 0];
    out.extend_from_slice(text.as_bytes());
    out
}

#[test]
fn a_websocket_is_not_in_flight_and_its_calls_are_counted() {
    let store = MemoryStore::default();
    let mut qos = StakeQos::new(QosPolicy::parse(br#"{"capacityRps": 100}"#).unwrap(), 1);
    let mut socket = QosStream::default();
    let upgrade = &[("upgrade", "websocket")];
    let decided = socket.headers(
        &mut qos,
        &store,
        &mut Now::fixed(0),
        &mut Client(upgrade),
        false,
    );
    assert!(decided.is_some_and(|d| d.throttled.is_none()));
    assert!(socket.ticket.is_none() && socket.upgraded.is_some());
    let two = [
        frame(r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#),
        frame(r#"{"jsonrpc":"2.0","id":2,"method":"eth_chainId"}"#),
    ]
    .concat();
    let size = two.len();
    let step = socket.body(
        &mut qos,
        &store,
        &mut Now::fixed(0),
        size,
        false,
        &mut Bytes(two),
    );
    assert_eq!(step.websocket_calls, 2);

    // A plain POST is in flight until done, and a batch is charged.
    let mut post = QosStream::default();
    post.headers(
        &mut qos,
        &store,
        &mut Now::fixed(0),
        &mut Client(&[]),
        false,
    );
    assert!(post.ticket.is_some() && post.upgraded.is_none());
    let batch = br#"[{"id":1,"method":"a"},{"id":2,"method":"b"}]"#.to_vec();
    let step = post.body(
        &mut qos,
        &store,
        &mut Now::fixed(0),
        batch.len(),
        true,
        &mut Bytes(batch),
    );
    assert_eq!(step.websocket_calls, 0);
    assert!(step.decided.is_none() && !step.hold);
    post.done(&mut qos, &mut Now::fixed(5));
    post.done(&mut qos, &mut Now::fixed(6));
    assert!(post.ticket.is_none());
}

#[test]
fn deciding_on_the_body_answers_each_call_of_a_throttled_batch() {
    let store = MemoryStore::default();
    let policy = br#"{"capacityRps": 100, "decideOnBody": true}"#;
    let mut qos = StakeQos::new(QosPolicy::parse(policy).unwrap(), 1);
    qos.state.throttling = true;
    let mut answers = Vec::new();
    for i in 0..20 {
        // Each a new request (the same one again would be an early
        // retry, held: below).
        let batch = format!(
            r#"[{{"jsonrpc":"2.0","id":1,"method":"a","params":[{i}]}},{{"jsonrpc":"2.0","id":2,"method":"b"}}]"#
        );
        let batch = batch.as_bytes();
        let mut post = QosStream::default();
        assert!(post
            .headers(
                &mut qos,
                &store,
                &mut Now::fixed(0),
                &mut Client(&[]),
                false
            )
            .is_none());
        let held = post.body(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            10,
            false,
            &mut Bytes(batch.to_vec()),
        );
        assert!(held.hold && held.decided.is_none(), "held until whole");
        let end = post.body(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            batch.len(),
            true,
            &mut Bytes(batch.to_vec()),
        );
        assert!(!end.hold);
        answers.push(end.decided.expect("decided at the end").throttled);
        post.done(&mut qos, &mut Now::fixed(1));
    }
    let refused = answers
        .iter()
        .flatten()
        .next()
        .expect("some were throttled");
    let body: Vec<serde_json::Value> = serde_json::from_str(&refused.rejection.body).unwrap();
    let ids: Vec<_> = body.iter().map(|e| e["id"].as_i64()).collect();
    assert_eq!(ids, [Some(1), Some(2)]);

    // Trailers end a request that waited.
    let mut trailed = QosStream::default();
    trailed.headers(
        &mut qos,
        &store,
        &mut Now::fixed(0),
        &mut Client(&[]),
        false,
    );
    assert!(trailed
        .trailers(&mut qos, &store, &mut Now::fixed(0))
        .is_some());
    assert!(
        trailed
            .trailers(&mut qos, &store, &mut Now::fixed(0))
            .is_none(),
        "once"
    );
}

#[test]
fn a_refused_request_sent_again_before_its_time_is_held_until_then() {
    let store = MemoryStore::default();
    let policy = br#"{"capacityRps": 100, "decideOnBody": true}"#;
    let mut qos = StakeQos::new(QosPolicy::parse(policy).unwrap(), 1);
    qos.state.throttling = true;
    let send = |qos: &mut StakeQos, body: &[u8], at_ms: u64| {
        let mut post = QosStream::default();
        let now = &mut Now::fixed(at_ms);
        post.headers(qos, &store, now, &mut Client(&[]), false);
        let step = post.body(
            qos,
            &store,
            now,
            body.len(),
            true,
            &mut Bytes(body.to_vec()),
        );
        (post, step)
    };
    // New requests until one is refused.
    let (refused, retry_after_s) = (0..100)
        .find_map(|i| {
            let body = format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_chainId"}}"#);
            let (mut post, step) = send(&mut qos, body.as_bytes(), 0);
            post.done(&mut qos, &mut Now::fixed(0));
            let throttled = step.decided?.throttled?;
            Some((body, throttled.rejection.retry_after_s))
        })
        .expect("one is refused");

    // The same request a millisecond later, as ethers sends it: held.
    let (mut again, step) = send(&mut qos, refused.as_bytes(), 1);
    assert!(step.hold && step.early && step.decided.is_none());
    assert_eq!(qos.early_held, 1);
    // Until its retry-after, and a part of the second after.
    let until_ms = again.held.as_ref().unwrap().until_ms;
    let retry_after_ms = 1000 * u64::from(retry_after_s);
    assert!((retry_after_ms..retry_after_ms + 1000).contains(&until_ms));
    // A second copy is not held: refused at once.
    let (_, copy) = send(&mut qos, refused.as_bytes(), 2);
    assert!(copy.decided.is_some_and(|d| d.throttled.is_some()));
    // Not before its time; then decided.
    let tick = |again: &mut QosStream, qos: &mut StakeQos, at_ms| {
        again.retry_tick(qos, &store, &mut Now::fixed(at_ms))
    };
    assert!(tick(&mut again, &mut qos, until_ms - 1).is_none());
    assert!(tick(&mut again, &mut qos, until_ms).is_some());
    assert!(tick(&mut again, &mut qos, until_ms + 1).is_none(), "once");
    assert_eq!(qos.early_held, 0);

    // A held request whose client goes away gives its place back.
    let other = r#"{"jsonrpc":"2.0","id":"x","method":"eth_chainId"}"#;
    let (mut post, step) = send(&mut qos, other.as_bytes(), until_ms);
    post.done(&mut qos, &mut Now::fixed(until_ms));
    assert!(
        step.decided.is_some_and(|d| d.throttled.is_some()),
        "no round refilled"
    );
    let (mut again, step) = send(&mut qos, other.as_bytes(), until_ms + 1);
    assert!(step.early && qos.early_held == 1);
    again.done(&mut qos, &mut Now::fixed(until_ms + 2));
    assert_eq!(qos.early_held, 0);
}

/// QoS with one staked API key, `k`, named `name`, counting or not.
fn keyed_qos(name: &str, counting: bool) -> StakeQos {
    let policy = format!(
        r#"{{"capacityRps": 1000, "stakes": [{{"apiKeySha256": "{}", "name": "{name}", "stake": 100}}]}}"#,
        crate::request::sha256_hex(b"k")
    );
    let mut qos = StakeQos::new(QosPolicy::parse(policy.as_bytes()).unwrap(), 1);
    qos.counting = counting;
    qos
}

/// Whether a request with `key` (an `x-api-key`) is staked as QoS
/// tells the gate, while it identifies requests and while it only
/// counts them; and the headers it read.
#[test]
fn a_staked_caller_is_told_to_the_gate_even_while_requests_are_only_counted() {
    let store = MemoryStore::default();
    for counting in [false, true] {
        let mut qos = keyed_qos("s", counting);
        for (headers, staked) in [
            (&[("x-api-key", "k")][..], true),
            (&[("x-api-key", "other")][..], false),
            (&[][..], false),
        ] {
            let mut stream = QosStream::default();
            stream.headers(
                &mut qos,
                &store,
                &mut Now::fixed(0),
                &mut Client(headers),
                true,
            );
            assert_eq!(stream.staked(), staked, "{headers:?}, counting {counting}");
        }
    }
}

/// While QoS only counts, a request whose API key is in the stake table
/// is counted in the usage ledger under that identity's name: its
/// batch's calls (its body is read for them, a key's requests only),
/// and the gate's refusal further on. No address or clock is read, and
/// no identity is made for decisions.
#[test]
fn while_qos_counts_a_staked_keys_requests_are_in_the_ledger_by_its_name() {
    let store = MemoryStore::default();
    let mut qos = keyed_qos("desk", true);
    let mut now = Now::lazy_us(|| panic!("no clock read"));
    let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"eth_chainId"},{"jsonrpc":"2.0","id":2,"method":"eth_chainId"},{"jsonrpc":"2.0","id":3,"method":"eth_chainId"}]"#;
    for (headers, refused) in [
        (&[("x-api-key", "k")][..], Some("gate-inflight")),
        (&[("x-api-key", "k")][..], None),
        (&[("x-api-key", "other")][..], None),
    ] {
        let mut stream = QosStream::default();
        let mut client = Client(headers);
        assert!(stream
            .headers(&mut qos, &store, &mut now, &mut client, false)
            .is_none());
        let mut body = Bytes(batch.to_vec());
        stream.body(&mut qos, &store, &mut now, batch.len(), true, &mut body);
        stream.response_headers(
            &qos,
            &mut now,
            || panic!("no status read"),
            || panic!("the gate's node time is not read"),
            || refused.map(str::to_string),
        );
        stream.done(&mut qos, &mut now);
    }
    assert!(!now.was_read());
    assert_eq!(qos.local_identities(), 0, "nothing to decide by");
    let by_label = qos.usage(&store, 1000).unwrap().unwrap();
    let desk = &by_label["desk"];
    assert_eq!((desk.requests, desk.calls), (2, 6), "{by_label:?}");
    assert_eq!(desk.share_rps, f64::INFINITY, "not limited");
    let gate = Rule::ALL.iter().position(|r| *r == Rule::GateInflight);
    assert_eq!(desk.refused[gate.unwrap()], 1);
    assert_eq!(by_label["unidentified"].requests, 1);
}

/// Facts that count what is asked of them.
#[derive(Default)]
struct Watched {
    headers: Vec<String>,
    addresses: u32,
}

impl RequestFacts for Watched {
    fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
        None
    }
    fn source_ip(&mut self) -> Option<IpAddr> {
        self.addresses += 1;
        "192.0.2.7".parse().ok()
    }
    fn peer_uri_san(&mut self) -> Option<String> {
        None
    }
    fn header(&mut self, name: &str) -> Option<String> {
        self.headers.push(name.to_string());
        None
    }
}

/// A body that must not be read.
struct Unread;

impl Body for Unread {
    fn read(&mut self, _: usize, _: usize) -> Vec<u8> {
        panic!("a counted request's body is not read")
    }
}

/// A request of 95 bytes in two pieces counted under `policy`, to its
/// end, asked nothing but whether it upgrades (not even the gate's
/// node time).
fn counted(policy: &[u8]) -> StakeQos {
    let store = MemoryStore::default();
    let mut qos = StakeQos::new(QosPolicy::parse(policy).unwrap(), 1);
    qos.counting = true;
    let mut facts = Watched::default();
    let mut now = Now::lazy_us(|| panic!("no clock read"));
    let mut post = QosStream::default();
    assert!(post
        .headers(&mut qos, &store, &mut now, &mut facts, false)
        .is_none());
    assert!(post
        .body(&mut qos, &store, &mut now, 40, false, &mut Unread)
        .decided
        .is_none());
    post.body(&mut qos, &store, &mut now, 95, true, &mut Unread);
    post.response_headers(
        &qos,
        &mut now,
        || panic!("no status read"),
        || panic!("the gate's node time is not read"),
        || panic!("no rule read"),
    );
    post.done(&mut qos, &mut now);
    assert!(!now.was_read());
    assert_eq!(facts.addresses, 0);
    assert_eq!(facts.headers, ["upgrade"], "only whether it upgrades");
    qos
}

#[test]
fn a_counted_request_is_neither_identified_nor_timed_nor_read() {
    let mut qos = counted(br#"{"capacityRps": 1000}"#);
    // 95 bytes: at most 4 calls, the first counted at the headers.
    assert_eq!(
        (qos.counted, qos.bound, qos.take_counted_requests()),
        (4, 0, 1)
    );
    assert_eq!(qos.local_identities(), 0);
    // The usage ledger has it, as unidentified.
    let by_label = qos.usage(&MemoryStore::default(), 1000).unwrap().unwrap();
    assert_eq!(by_label["unidentified"].requests, 1);

    // An upgrade is identified all the same (its allowance is per
    // identity), and so is everything once QoS identifies.
    let mut socket = QosStream::default();
    let decided = socket.headers(
        &mut qos,
        &MemoryStore::default(),
        &mut Now::fixed(0),
        &mut Client(&[("upgrade", "websocket")]),
        false,
    );
    assert!(decided.is_some() && qos.local_identities() == 1);
}

#[test]
fn in_node_time_a_counted_request_is_bounded_by_its_calls_at_the_dearest_cost() {
    let policy = br#"{"capacityNodeMs": 4000, "costs": {"eth_getLogs": 20}}"#;
    let mut qos = counted(policy);
    // At most 4 calls, each at most 20 ms (the table's dearest, above
    // the 10 ms default), in µs.
    assert_eq!(
        (qos.counted, qos.bound, qos.take_counted_requests()),
        (80_000, 0, 1)
    );
}
