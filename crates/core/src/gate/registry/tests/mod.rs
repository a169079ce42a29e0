use super::*;
use crate::gate::node_time::STANDBY_MS;
use crate::gate::stream::Upgrade;
use crate::request::testing::{Bytes, Public};
use crate::shared::MemoryStore;

mod holds;
mod node_time;

const CALL: &[u8] = br#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[{}]}"#;

type Rig = Registry<MemoryStore>;

fn registry(policy: &str) -> Rig {
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    Registry::new(policy, 7, MemoryStore::default(), || 0)
}

fn post() -> Head {
    Head {
        end_of_stream: false,
        upgrade: Upgrade::None,
        content_length: None,
    }
}

/// Stream `id` sends `body` whole.
fn send(r: &mut Rig, id: u32, body: &[u8]) -> Then {
    assert_eq!(r.headers(id, &mut Public, post()), OnHeaders::Continue);
    r.request_body(id, body.len(), true, &mut Bytes(body.to_vec()), &mut Public)
}

/// An `eth_getProof` from a caller stake QoS found `staked` (or not).
fn ask<S: SharedStore>(r: &mut Registry<S>, id: u32, staked: bool) -> Then {
    let caller = &mut Caller {
        staked,
        ..Caller::default()
    };
    assert_eq!(r.headers(id, caller, post()), OnHeaders::Continue);
    let body = call(id, "eth_getProof");
    r.request_body(id, body.len(), true, &mut Bytes(body), caller)
}

fn answered(body: &[u8]) -> Response {
    Response {
        status: 200,
        content_type: "application/json".into(),
        content_encoding: None,
        body: body.to_vec(),
        said_us: None,
    }
}

#[test]
fn a_leaders_answer_goes_to_every_request_waiting_with_its_own_id() {
    let mut r = registry(r#"{"maxInflight": 8, "dedup": {}}"#);
    // The first leads: held, and a wake-up asked for to send its callout.
    assert_eq!(send(&mut r, 1, CALL), Then::Pause);
    assert_eq!(r.take(0).0, [Do::Poke]);
    // The same call with another id waits for its answer.
    let again = br#"{"jsonrpc":"2.0","id":"b","method":"eth_call","params":[{}]}"#;
    assert_eq!(send(&mut r, 2, again), Then::Pause);
    assert_eq!(r.coalesced(), 2);
    let (id, callout) = r.next_callout().expect("the leader's callout");
    assert_eq!((id, callout.body.as_slice()), (1, CALL));
    assert_eq!(r.next_callout(), None);
    r.sent(1, Ok(40));
    let node = br#"{"jsonrpc":"2.0","id":1,"result":"0x2a"}"#;
    r.callout_ended(40, Some(answered(node)));
    let (dos, _) = r.take(0);
    let bodies: Vec<(u32, String)> = dos
        .iter()
        .map(|d| match d {
            Do::Answer(id, reply) => (*id, String::from_utf8_lossy(&reply.body).into()),
            other => panic!("not an answer: {other:?}"),
        })
        .collect();
    assert_eq!(
        bodies,
        [
            (1, r#"{"jsonrpc":"2.0","id":1,"result":"0x2a"}"#.into()),
            (2, r#"{"jsonrpc":"2.0","id":"b","result":"0x2a"}"#.into()),
        ]
    );
    assert_eq!(r.coalesced(), 0);
}

/// With `nodeTime`, a leader's answer tells the filters before the gate
/// the node's time on its callout (here as the node said it), a waiter's
/// that the node did no work for it; without, neither says anything.
#[test]
fn a_leaders_answer_says_the_node_s_time_on_its_callout_and_a_waiter_s_none() {
    let node_us = |policy: &str, said_us: Option<u64>| {
        let mut r = registry(policy);
        assert_eq!(send(&mut r, 1, CALL), Then::Pause);
        assert_eq!(send(&mut r, 2, CALL), Then::Pause);
        r.take(0);
        let (id, _) = r.next_callout().unwrap();
        r.sent(id, Ok(40));
        let node = br#"{"jsonrpc":"2.0","id":1,"result":"0x2a"}"#;
        r.callout_ended(
            40,
            Some(Response {
                said_us,
                ..answered(node)
            }),
        );
        let (dos, _) = r.take(0);
        let told: Vec<(u32, Option<u64>)> = dos
            .iter()
            .map(|d| match d {
                Do::Answer(id, reply) => (*id, reply.node_us),
                other => panic!("not an answer: {other:?}"),
            })
            .collect();
        // The gate's replies pass through its own response path, which
        // measures nothing over what they said.
        for (id, _) in &told {
            assert_eq!(r.response_headers(*id, false, |_| None), None, "{id}");
        }
        told
    };
    let timed = r#"{"maxInflight": 8, "decideOnBody": true, "dedup": {},
                   "nodeTime": {"serviceTimeHeader": "x-node-us"}}"#;
    assert_eq!(node_us(timed, Some(7000)), [(1, Some(7000)), (2, Some(0))]);
    // Not said: the gate's clock, here a fixed one.
    assert_eq!(node_us(timed, None), [(1, Some(0)), (2, Some(0))]);
    let untimed = r#"{"maxInflight": 8, "decideOnBody": true, "dedup": {}}"#;
    assert_eq!(node_us(untimed, Some(7000)), [(1, None), (2, None)]);
}

#[test]
fn a_leader_whose_stream_ended_sends_nothing_and_a_refused_callout_passes_its_request() {
    let mut r = registry(r#"{"maxInflight": 8, "dedup": {}}"#);
    assert_eq!(send(&mut r, 1, CALL), Then::Pause);
    r.done(1);
    assert_eq!(r.next_callout(), None, "its client went before the callout");
    assert_eq!(r.take(0).0, [Do::Poke]);
    // A new leader whose callout the host refuses goes through the route.
    assert_eq!(send(&mut r, 2, CALL), Then::Pause);
    let (id, _) = r.next_callout().unwrap();
    r.sent(id, Err("BadArgument".into()));
    let (dos, log) = r.take(0);
    assert_eq!(dos, [Do::Poke, Do::Resume(2, None)]);
    assert!(log[0].contains("was refused (BadArgument)"), "{log:?}");
    assert_eq!(r.worker.counts.dedup.callouts_failed, 1);
}

thread_local! {
    static CLOCK_US: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn clock_us() -> u64 {
    CLOCK_US.with(|c| c.get())
}

fn at_ms(ms: u64) {
    CLOCK_US.with(|c| c.set(ms * 1000));
}

fn call(id: u32, method: &str) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}"}}"#).into_bytes()
}

/// A 200's headers.
fn ok(name: &str) -> Option<String> {
    (name == ":status").then(|| "200".into())
}

/// A request for block `number` with id `id` (raw JSON).
fn block_request(id: &str, number: &str) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_getBlockByNumber","params":["{number}",false]}}"#)
        .into_bytes()
}

fn block_answer(number: &str) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":1,"result":{{"number":"{number}","hash":"0xab"}}}}"#)
        .into_bytes()
}

/// A 200 with a JSON body of `length` bytes.
fn json_headers(length: usize) -> impl FnMut(&str) -> Option<String> {
    move |name| match name {
        ":status" => Some("200".into()),
        "content-type" => Some("application/json".into()),
        "content-length" => Some(length.to_string()),
        _ => None,
    }
}

#[test]
fn a_final_answer_is_kept_and_served_again_with_no_slot_and_no_node() {
    let policy = r#"{"maxInflight": 1, "dedup": {"engageAfterMs": 100, "standbyAfterMs": 100}, "cache": {}}"#;
    let mut r = Registry::new(
        GatePolicy::parse(policy.as_bytes()).unwrap(),
        7,
        MemoryStore::default(),
        clock_us,
    );
    at_ms(10_000);
    let finalized = br#"{"jsonrpc":"2.0","id":1,"result":{"number":"0x20"}}"#;
    crate::dedup::finality::answered(&r.store, 10_000, Some(finalized)).unwrap();
    // Coalescing starts engaged: a request leads by callout. The key's
    // first miss is not kept; its second is, on the way to its client.
    for (id, token) in [(1, 40), (11, 41)] {
        assert_eq!(send(&mut r, id, &block_request("1", "0x10")), Then::Pause);
        let (leader, _) = r.next_callout().unwrap();
        r.sent(leader, Ok(token));
        r.callout_ended(token, Some(answered(&block_answer("0x10"))));
        let answered_it =
            matches!(r.take(0).0.as_slice(), [Do::Poke, Do::Answer(i, _)] if *i == id);
        assert!(answered_it);
        r.done(id);
    }
    assert_eq!(r.worker.counts.cache.kept, 1);
    // The same call with another id: from the cache, at once.
    let Then::Answer(reply) = send(&mut r, 2, &block_request(r#""x""#, "0x10")) else {
        panic!("a hit")
    };
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(
        (body["id"].as_str(), body["result"]["number"].as_str()),
        (Some("x"), Some("0x10"))
    );
    assert!(reply
        .headers
        .contains(&(crate::cache::HEADER, "hit".into())));
    assert_eq!(r.next_callout(), None, "the node is not asked");
    r.done(2);
    // Standing by, a miss goes through the route with the gate's one slot;
    // a hit meanwhile takes none. A first miss is not read whole.
    at_ms(10_200);
    r.engage(10_200);
    at_ms(10_400);
    r.engage(10_400);
    assert!(!r.worker.dedup_engaged(), "standing by");
    let node = block_answer("0x11");
    assert_eq!(
        send(&mut r, 30, &block_request("3", "0x11")),
        Then::Continue
    );
    r.response_headers(30, false, json_headers(node.len()));
    let mut piece = Bytes(node[..10].to_vec());
    assert!(!r.response_body(30, 10, false, &mut piece).hold);
    r.response_body(30, node.len(), true, &mut Bytes(node.clone()));
    assert_eq!(send(&mut r, 3, &block_request("3", "0x11")), Then::Continue);
    let hit = send(&mut r, 4, &block_request("4", "0x10"));
    assert!(matches!(hit, Then::Answer(_)));
    r.response_headers(3, false, json_headers(node.len()));
    assert!(r.response_body(3, 10, false, &mut piece).hold, "read whole");
    let on = r.response_body(3, node.len(), true, &mut Bytes(node.clone()));
    assert!(!on.hold && on.released);
    let hit = send(&mut r, 5, &block_request("5", "0x11"));
    assert!(matches!(hit, Then::Answer(_)));
    // A block above the finalized one: its answer is not kept, nor read
    // whole.
    for id in [6, 7] {
        let request = block_request("6", "0x21");
        assert_eq!(send(&mut r, id, &request), Then::Continue);
        let node = block_answer("0x21");
        r.response_headers(id, false, json_headers(node.len()));
        assert!(!r.response_body(id, 10, false, &mut piece).hold);
        r.response_body(id, node.len(), true, &mut Bytes(node));
    }
    assert_eq!(send(&mut r, 8, &block_request("8", "0x21")), Then::Continue);
    let counts = &r.worker.counts.cache;
    assert_eq!(
        (
            counts.hits,
            counts.misses,
            counts.kept,
            counts.not_kept,
            counts.entries
        ),
        (3, 7, 2, 2, 2)
    );
}

#[test]
fn with_no_key_repeating_the_cache_stands_by_and_requests_pass_unread() {
    let policy = r#"{"maxInflight": 8, "dedup": {"engageAfterMs": 100, "standbyAfterMs": 100}, "cache": {}}"#;
    let mut r = registry(policy);
    let mut id = 0;
    let mut unique = |r: &mut Rig| {
        id += 1;
        let block = format!("{:#x}", 0x1000 + id);
        assert_eq!(send(r, id, &block_request("1", &block)), Then::Continue);
        r.done(id);
    };
    // The first request, engaged (it waits for the finalized block), ends
    // at once: the node has shown it is quick.
    at_ms(9_900);
    send(&mut r, 99, &block_request("1", "0x1"));
    r.done(99);
    for ms in [10_000, 10_200, 10_400] {
        at_ms(ms);
        r.engage(ms);
    }
    assert!(!r.worker.dedup_engaged(), "coalescing stands by");
    for _ in 1..crate::cache::WINDOW {
        unique(&mut r);
    }
    let counts = |r: &Rig| {
        (
            r.worker.counts.cache.misses,
            r.worker.counts.cache.standing_by,
        )
    };
    assert_eq!(counts(&r), (crate::cache::WINDOW.into(), 0));
    // Standing by: one request in SAMPLE_EVERY is looked up.
    let every = crate::cache::SAMPLE_EVERY;
    for _ in 0..every * 2 {
        unique(&mut r);
    }
    assert_eq!(
        counts(&r),
        ((crate::cache::WINDOW + 2).into(), (every * 2 - 2).into())
    );
}

#[test]
fn a_request_on_a_spare_slot_is_timed_only_by_the_node_s_own_word() {
    let policy = r#"{"maxInflight": 8, "decideOnBody": true, "nodeTime": {"serviceTimeHeader": "x-node-us"}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    at_ms(1000);
    assert_eq!(send(&mut r, 1, &call(1, "eth_call")), Then::Continue);
    at_ms(1010);
    r.done(1);
    // On the spare slot the first left: unpriced, and the node says 7 ms.
    assert_eq!(send(&mut r, 2, &call(2, "eth_call")), Then::Continue);
    assert_eq!(r.worker.counts.node_time.unpriced, 1);
    at_ms(1020);
    let told = |name: &str| match name {
        ":status" => Some("200".into()),
        "x-node-us" => Some("7000".into()),
        _ => None,
    };
    assert_eq!(r.response_headers(2, true, told), Some(7000));
}

fn head_answer(number: &str, hash: &str) -> Response {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":1,"result":{{"number":"{number}","hash":"{hash}","miner":"0x0"}}}}"#
    );
    answered(body.as_bytes())
}

/// The bodies the gate answered with, by stream.
fn answers(dos: &[Do]) -> Vec<(u32, serde_json::Value)> {
    dos.iter()
        .filter_map(|d| match d {
            Do::Answer(id, reply) => Some((*id, serde_json::from_slice(&reply.body).unwrap())),
            _ => None,
        })
        .collect()
}

fn latest_rig() -> Rig {
    registry(r#"{"maxInflight": 8, "dedup": {}, "cache": {"latest": true}}"#)
}

fn hash(byte: &str) -> String {
    format!("0x{}", byte.repeat(32))
}

fn number_call(id: u32) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_blockNumber"}}"#).into_bytes()
}

fn balance_call(id: u32) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_getBalance","params":["0x01","latest"]}}"#)
        .into_bytes()
}

/// Stream `id`'s read at `latest`, then the head poll for it, answered
/// with `head` (`None`: no answer); what was done.
fn read_at(r: &mut Rig, id: u32, body: &[u8], head: Option<&str>, token: u32) -> Vec<Do> {
    assert_eq!(send(r, id, body), Then::Pause);
    let (poll, _) = r.next_callout().unwrap();
    assert_eq!(poll, HEAD_POLL);
    r.sent(poll, Ok(token));
    r.new_turn();
    r.callout_ended(token, head.map(|h| head_answer("0x10", h)));
    r.take(0).0
}

/// With `cache.latest`, a read at `latest` is held until a head poll
/// that went out after it came answers: `eth_blockNumber` and the head
/// block come from the poll, a read of state is asked at the head's hash
/// (and kept under it), and a new head, on another branch, is asked again.
#[test]
fn reads_at_latest_wait_for_a_head_poll_and_are_answered_at_its_block() {
    use crate::cache::head::REQUEST as POLL;
    let mut r = latest_rig();
    let (a, b) = (hash("aa"), hash("bb"));
    let (number, balance) = (number_call, balance_call);
    let block = |id: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_getBlockByNumber","params":["latest",false]}}"#
        )
    };
    assert_eq!(send(&mut r, 1, &number(1)), Then::Pause);
    assert_eq!(send(&mut r, 2, &balance(2)), Then::Pause);
    assert_eq!(send(&mut r, 3, block(3).as_bytes()), Then::Pause);
    assert!(r.take(0).0.contains(&Do::Poke));
    let (id, poll) = r.next_callout().unwrap();
    assert_eq!((id, poll.body.as_slice()), (HEAD_POLL, POLL));
    assert_eq!(r.next_callout(), None, "one poll at a time");
    r.sent(HEAD_POLL, Ok(50));
    // This one came after the poll went out: the next poll's.
    assert_eq!(send(&mut r, 4, &number(4)), Then::Pause);
    r.callout_ended(50, Some(head_answer("0x10", &a)));
    let got = answers(&r.take(0).0);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        (got[0].0, &got[0].1["id"], &got[0].1["result"]),
        (1, &1.into(), &"0x10".into())
    );
    assert_eq!(
        (got[1].0, &got[1].1["result"]["hash"]),
        (3, &a.clone().into())
    );
    // The next poll (for 4), then 2's read at the head's hash.
    let (id, _) = r.next_callout().unwrap();
    assert_eq!(id, HEAD_POLL);
    r.sent(HEAD_POLL, Ok(51));
    let (id, pinned) = r.next_callout().unwrap();
    let params: serde_json::Value = serde_json::from_slice(&pinned.body).unwrap();
    assert_eq!(
        (id, &params["params"][1]["blockHash"]),
        (2, &a.clone().into())
    );
    r.sent(2, Ok(52));
    r.callout_ended(
        52,
        Some(answered(br#"{"jsonrpc":"2.0","id":2,"result":"0x2a"}"#)),
    );
    r.callout_ended(51, Some(head_answer("0x10", &a)));
    let got = answers(&r.take(0).0);
    assert_eq!(got.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [2, 4]);
    assert_eq!(got[0].1["result"], "0x2a");
    // The pinned key's second miss is kept; its third is a hit, with no
    // callout but the poll.
    let ask = |r: &mut Rig, id: u32, head: &str, token: u32| {
        assert_eq!(send(r, id, &balance(id)), Then::Pause);
        let (poll, _) = r.next_callout().unwrap();
        r.sent(poll, Ok(token));
        r.callout_ended(token, Some(head_answer("0x10", head)));
        if let Some((leader, _)) = r.next_callout() {
            r.sent(leader, Ok(token + 1));
            let node = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"0x2a"}}"#);
            r.callout_ended(token + 1, Some(answered(node.as_bytes())));
        }
        let got = answers(&r.take(0).0);
        assert_eq!((got[0].0, &got[0].1["result"]), (id, &"0x2a".into()));
        r.done(id);
    };
    ask(&mut r, 5, &a, 60);
    assert_eq!(r.worker.counts.cache.kept, 1);
    let misses = r.worker.counts.cache.misses;
    ask(&mut r, 6, &a, 70);
    assert_eq!(r.worker.counts.cache.misses, misses, "a hit");
    // Another branch's head, at the same height: asked again.
    ask(&mut r, 7, &b, 80);
    assert_eq!(r.worker.counts.cache.misses, misses + 1);
    assert_eq!(r.worker.counts.cache.at_head, 7);
}

/// A head poll that answers hundreds of held reads answers them over
/// several turns, `TURN_ACTIONS` each, every read once: Envoy nests the
/// local replies asked for in one go, and V8 stops a VM past a few hundred.
#[test]
fn many_reads_answered_at_once_are_answered_a_turn_at_a_time() {
    let mut r = latest_rig();
    let held = 3 * TURN_ACTIONS + 5;
    for id in 1..=held {
        assert_eq!(send(&mut r, id, &number_call(id)), Then::Pause);
    }
    let (poll, _) = r.next_callout().unwrap();
    r.sent(poll, Ok(9));
    r.take(0);
    r.new_turn();
    r.callout_ended(9, Some(head_answer("0x10", &hash("aa"))));
    let mut answered = Vec::new();
    for turn in 0..4 {
        let dos = r.take(0).0;
        let got = answers(&dos);
        assert_eq!(
            got.len() as u32,
            TURN_ACTIONS.min(held - answered.len() as u32)
        );
        assert_eq!(dos.contains(&Do::Poke), turn < 3, "turn {turn}");
        // Within the turn, nothing more.
        assert!(answers(&r.take(0).0).is_empty());
        answered.extend(got.iter().map(|(id, _)| *id));
        r.new_turn();
    }
    answered.sort_unstable();
    assert_eq!(answered, (1..=held).collect::<Vec<_>>());
    assert_eq!(r.take(0).0, []);
}

/// The node does not know the head's hash (a node behind the head): the
/// pinned read's leader and the read waiting on it go on at `latest`, and
/// their answers through the route are never kept under the hash.
#[test]
fn a_read_the_node_will_not_answer_at_the_head_s_hash_goes_on_at_latest() {
    let mut r = latest_rig();
    for id in [10, 11] {
        assert_eq!(send(&mut r, id, &balance_call(id)), Then::Pause);
    }
    let (poll, _) = r.next_callout().unwrap();
    r.sent(poll, Ok(85));
    r.callout_ended(85, Some(head_answer("0x11", &hash("cc"))));
    let (leader, _) = r.next_callout().unwrap();
    r.sent(leader, Ok(86));
    let unknown =
        br#"{"jsonrpc":"2.0","id":10,"error":{"code":-32000,"message":"header not found"}}"#;
    r.callout_ended(86, Some(answered(unknown)));
    let resumed: Vec<Do> = r.take(0).0.into_iter().filter(|d| *d != Do::Poke).collect();
    assert_eq!(resumed, [Do::Resume(10, None), Do::Resume(11, None)]);
    assert_eq!(r.worker.counts.cache.head_unpinned, 1);
    for id in [10, 11] {
        let node = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"0x2b"}}"#).into_bytes();
        r.response_headers(id, false, json_headers(node.len()));
        let on = r.response_body(id, node.len(), true, &mut Bytes(node));
        assert!(!on.hold);
        r.done(id);
    }
    assert_eq!(r.worker.counts.cache.kept, 0);
}

/// A poll with no answer lets its read on as it came; one read per poll
/// (a call at the node for each, as without holding) stands holding by.
#[test]
fn a_failed_poll_lets_its_read_on_and_reads_that_share_no_poll_stop_being_held() {
    let mut r = latest_rig();
    let dos = read_at(&mut r, 8, &balance_call(8), None, 90);
    assert_eq!(dos, [Do::Poke, Do::Resume(8, None)]);
    assert_eq!(r.worker.counts.cache.head_failed, 1);
    let mut id = 100;
    while !r.heads.standing_by() {
        id += 1;
        let dos = read_at(&mut r, id, &number_call(id), Some(&hash("aa")), id);
        assert_eq!(answers(&dos)[0].1["result"], "0x10");
        assert!(id < 100 + 2 * crate::gate::at_head::JUDGE_EVERY as u32);
    }
    assert_eq!(send(&mut r, 1, &number_call(1)), Then::Continue);
    assert_eq!(r.next_callout(), None);
    assert_eq!(r.worker.counts.cache.head_passed, 1);
}

/// A public client at 192.0.2.1, as the filters before the gate left it:
/// routed to a cluster and path, found in stake QoS's table, named by it.
#[derive(Default)]
struct Caller {
    route: Option<(&'static str, &'static str)>,
    staked: bool,
    identity: Option<u64>,
}

impl crate::request::RequestFacts for Caller {
    fn metadata_class(&mut self, _: crate::request::MetadataScope) -> Option<String> {
        None
    }
    fn source_ip(&mut self) -> Option<std::net::IpAddr> {
        "192.0.2.1".parse().ok()
    }
    fn peer_uri_san(&mut self) -> Option<String> {
        None
    }
    fn header(&mut self, name: &str) -> Option<String> {
        let (_, path) = self.route?;
        (name == ":path").then(|| path.to_string())
    }
    fn route_cluster(&mut self) -> Option<String> {
        self.route.map(|(cluster, _)| cluster.to_string())
    }
    fn staked(&mut self) -> bool {
        self.staked
    }
    fn qos_identity(&mut self) -> Option<u64> {
        self.identity
    }
}

/// Answers are shared within a route only: a request routed to another
/// cluster passes the cache and coalescing by, and identical calls to
/// another path of the same cluster share nothing.
#[test]
fn answers_are_shared_within_one_route_only() {
    let mut r = registry(r#"{"maxInflight": 8, "dedup": {}, "cache": {}}"#);
    let chain_id = br#"{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}"#;
    let ask = |r: &mut Rig, id: u32, facts: &mut Caller, body: &[u8]| {
        assert_eq!(r.headers(id, facts, post()), OnHeaders::Continue);
        r.request_body(id, body.len(), true, &mut Bytes(body.to_vec()), facts)
    };
    let other = || Caller {
        route: Some(("base_node", "/")),
        ..Caller::default()
    };
    assert_eq!(ask(&mut r, 1, &mut other(), chain_id), Then::Continue);
    assert_eq!(
        (
            r.worker.counts.dedup.other_cluster,
            r.worker.counts.cache.misses
        ),
        (1, 0),
        "not looked up"
    );
    r.done(1);
    // Coalescing (engaged from the start): one leader per route.
    let eth = |path| Caller {
        route: Some(("rpc_node", path)),
        ..Caller::default()
    };
    assert!(matches!(ask(&mut r, 2, &mut eth("/a"), CALL), Then::Pause));
    assert!(matches!(ask(&mut r, 3, &mut eth("/b"), CALL), Then::Pause));
    assert!(matches!(ask(&mut r, 4, &mut eth("/a"), CALL), Then::Pause));
    let leaders: Vec<u32> = std::iter::from_fn(|| r.next_callout().map(|(id, _)| id)).collect();
    assert_eq!(leaders, [2, 3], "4 waits for 2");
    assert_eq!(r.worker.counts.dedup.other_cluster, 1);
}

/// With `{"staked": true}` among the priority matchers, a staked caller's
/// request waiting for a slot gets the next one before unstaked requests
/// that waited longer: an unstaked crowd cannot push it out.
#[test]
fn a_staked_callers_waiting_request_goes_before_an_unstaked_crowd() {
    let policy = r#"{"maxInflight": 1, "decideOnBody": true,
        "nodeTime": {"cheapSlots": 0, "waitMs": 1000},
        "classes": {"priority": [{"staked": true}]}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    at_ms(1000);
    assert_eq!(ask(&mut r, 1, false), Then::Continue);
    for id in 2..=4 {
        assert_eq!(ask(&mut r, id, false), Then::Pause);
    }
    at_ms(1010);
    assert_eq!(ask(&mut r, 5, true), Then::Pause);
    at_ms(1040);
    r.response_headers(1, true, |_| None);
    r.done(1);
    assert_eq!(r.take(0).0, [Do::Resume(5, None)]);
}

/// What a past turn left for a stream is not handed out in that stream's
/// own callback (Envoy would carry a resume out before the callback's own
/// pause undid it): it waits for the next turn.
#[test]
fn a_streams_own_queued_resume_waits_for_a_turn_of_its_own() {
    let mut r = latest_rig();
    let held = TURN_ACTIONS + 1;
    for id in 1..=held {
        assert_eq!(send(&mut r, id, &number_call(id)), Then::Pause);
    }
    let (poll, _) = r.next_callout().unwrap();
    r.sent(poll, Ok(9));
    r.take(0);
    r.new_turn();
    r.callout_ended(9, Some(head_answer("0x10", &hash("aa"))));
    assert_eq!(answers(&r.take(0).0).len() as u32, TURN_ACTIONS);
    // The one left, in its own callback: not now.
    r.new_turn();
    let left = held;
    assert!(answers(&r.take(left).0).is_empty());
    assert_eq!(answers(&r.take(0).0)[0].0, left);
}
