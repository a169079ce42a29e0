use super::*;
use crate::gate::class::RequestClass;
use crate::gate::policy::GatePolicy;
use crate::gate::Decision;
use crate::jsonrpc::Name;
use crate::request::testing::Bytes;
use crate::shared::MemoryStore;
use proptest::prelude::*;
use serde_json::{json, Value};

const MASK: [u8; 4] = [1, 2, 3, 4];

/// A gate, a store, and one public socket on it.
struct Rig {
    store: MemoryStore,
    gate: InflightGate,
    counts: Counts,
    linger: linger::Linger,
    subs: subscriptions::Subscriptions,
}

impl Rig {
    fn new(policy: &str) -> Self {
        let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
        let subs = subscriptions::Subscriptions::new(
            policy.max_subscriptions_per_websocket,
            policy.max_subscriptions_per_identity,
        );
        let gate = InflightGate::new(policy, 7);
        Self {
            store: MemoryStore::default(),
            gate,
            counts: Counts::default(),
            linger: linger::Linger::default(),
            subs,
        }
    }

    fn socket(&mut self) -> Websocket {
        let admission =
            self.gate
                .admit(&self.store, &mut Now::fixed(0), RequestClass::Default, true);
        let Decision::Admit(ticket) = admission.decision else {
            panic!("no connection place")
        };
        let limit = self.gate.policy().max_websocket_message_bytes;
        Websocket::new(ticket, SlotKind::Default, limit, 0xfeed, Some(1))
    }

    /// The client sends `bytes` (a whole piece held so far: `held`).
    fn send(&mut self, ws: &mut Websocket, held: &[u8]) -> Flow {
        ws.read(
            &mut Bytes(held.to_vec()),
            held.len(),
            &mut self.counts,
            &mut self.subs,
        );
        self.settle(ws)
    }

    fn settle(&mut self, ws: &mut Websocket) -> Flow {
        ws.settle(
            &mut self.gate,
            &self.store,
            &mut Now::fixed(0),
            &mut self.counts,
        )
        .0
    }

    /// Slots counted at the gate (in use and spare).
    fn inflight(&mut self) -> u32 {
        self.gate
            .heartbeat(&self.store, 0)
            .unwrap()
            .totals
            .inflight()
    }

    /// The node's bytes reach the socket; slots given back go back.
    fn answer(&mut self, ws: &mut Websocket, bytes: &[u8]) -> Vec<u8> {
        let (released, replace) = ws.answer(bytes, 0, &mut self.linger, &mut self.counts);
        for _ in 0..released {
            self.gate.give(ws.kind());
        }
        replace.unwrap_or_else(|| bytes.to_vec())
    }
}

fn client(text: &str) -> Vec<u8> {
    ws::encode(ws::OPCODE_TEXT, text.as_bytes(), Some(MASK))
}

fn server(text: &str) -> Vec<u8> {
    ws::encode(ws::OPCODE_TEXT, text.as_bytes(), None)
}

fn calls(ids: std::ops::Range<u32>) -> Vec<u8> {
    ids.flat_map(|i| {
        client(&format!(
            r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_getLogs","params":[]}}"#
        ))
    })
    .collect()
}

/// What one side's bytes hold: each message's JSON.
fn messages(side: Side, bytes: &[u8]) -> Vec<Value> {
    struct Collect(Vec<Value>);
    impl Sink for Collect {
        fn begin(&mut self) -> Option<usize> {
            Some(1 << 24)
        }
        fn message(&mut self, message: Message) {
            let payload = message.payload.unwrap_or_default();
            self.0
                .push(serde_json::from_slice(&payload).unwrap_or(Value::Null));
        }
    }
    let mut collect = Collect(Vec::new());
    FrameReader::new(side).feed(bytes, &mut collect);
    collect.0
}

/// What a serde node (rpc-node, anvil) answers to what reached it: each
/// call with an `id` member gets `{"id", "result": method}`; a message of
/// notifications only gets nothing.
fn node(sent: &[u8]) -> Vec<u8> {
    let answer = |call: &Value| -> Option<Value> {
        let id = call.get("id")?;
        Some(json!({"jsonrpc": "2.0", "id": id, "result": call["method"]}))
    };
    let mut out = Vec::new();
    for message in messages(Side::Client, sent) {
        let answered = match &message {
            Value::Array(calls) => {
                let answers: Vec<Value> = calls.iter().filter_map(answer).collect();
                (!answers.is_empty()).then_some(Value::Array(answers))
            }
            call => answer(call),
        };
        if let Some(answered) = answered {
            out.extend(server(&answered.to_string()));
        }
    }
    out
}

/// The bytes that went on for `flow`, given the client's held `bytes`.
fn sent(flow: Flow, held: &[u8]) -> Vec<u8> {
    match flow {
        Flow::Through => held.to_vec(),
        Flow::Replace(bytes) => bytes,
        other => panic!("held: {other:?}"),
    }
}

#[test]
fn calls_that_fit_go_as_they_came_and_answers_give_their_slots_back() {
    let mut rig = Rig::new(r#"{"maxInflight": 8}"#);
    let mut ws = rig.socket();
    let three = calls(0..3);
    assert_eq!(rig.send(&mut ws, &three), Flow::Through);
    assert_eq!((ws.at_node(), rig.inflight()), (3, 3));
    let answers = node(&three);
    assert_eq!(rig.answer(&mut ws, &answers), answers, "passed untouched");
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
}

#[test]
fn more_calls_than_slots_are_packed_into_batches_and_each_answered() {
    let mut rig = Rig::new(r#"{"maxInflight": 3, "maxInflightPerWebsocket": 8}"#);
    let mut ws = rig.socket();
    let ten = calls(0..10);
    let to_node = sent(rig.send(&mut ws, &ten), &ten);
    let at_node = messages(Side::Client, &to_node);
    let sizes: Vec<usize> = at_node
        .iter()
        .map(|m| m.as_array().map_or(1, Vec::len))
        .collect();
    assert_eq!(sizes, [4, 3, 3], "three units for three slots");
    assert_eq!((ws.at_node(), rig.inflight(), rig.counts.merged), (3, 3, 3));
    let back = messages(Side::Server, &rig.answer(&mut ws, &node(&to_node)));
    let ids: Vec<Value> = back.iter().map(|a| a["id"].clone()).collect();
    assert_eq!(ids, (0..10).map(Value::from).collect::<Vec<_>>());
    assert!(back.iter().all(|a| a["result"] == "eth_getLogs"));
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
}

#[test]
fn a_notification_takes_a_slot_until_the_node_is_done_with_it() {
    let mut rig = Rig::new(r#"{"maxInflight": 8}"#);
    let mut ws = rig.socket();
    let note = client(r#"{"jsonrpc":"2.0","method":"eth_getLogs","params":[{}]}"#);
    let to_node = sent(rig.send(&mut ws, &note), &note);
    let at_node = messages(Side::Client, &to_node);
    assert_eq!(at_node[0]["id"], "sg-000000000000feed-0");
    assert_eq!((ws.at_node(), rig.inflight()), (1, 1));
    let back = rig.answer(&mut ws, &node(&to_node));
    assert!(
        back.is_empty(),
        "the client gets no answer to a notification"
    );
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
}

#[test]
fn an_id_some_node_would_not_read_is_made_plain_and_given_back_as_written() {
    let mut rig = Rig::new(r#"{"maxInflight": 8}"#);
    let mut ws = rig.socket();
    for (text, id) in [
        (
            r#"{"jsonrpc":"2.0","\u0069d":1e0,"method":"eth_chainId"}"#,
            "1e0",
        ),
        (
            r#"{"jsonrpc":"2.0","ID":"x","method":"eth_chainId"}"#,
            r#""x""#,
        ),
    ] {
        let bytes = client(text);
        let to_node = sent(rig.send(&mut ws, &bytes), &bytes);
        let back = rig.answer(&mut ws, &node(&to_node));
        assert_eq!(raw_ids(&back), [id]);
    }
    assert_eq!(rig.counts.rewritten, 2);
}

/// A client that closes with calls at the node: what it had not sent is
/// dropped, and its close reaches the node only once the node has answered
/// the rest, whose slots stay taken until then.
#[test]
fn a_close_waits_for_the_nodes_answers_to_what_was_sent() {
    let mut rig = Rig::new(r#"{"maxInflight": 2}"#);
    let mut ws = rig.socket();
    let to_node = sent(rig.send(&mut ws, &calls(0..2)), &calls(0..2));
    assert_eq!(rig.inflight(), 2);
    let mut held = calls(2..5);
    held.extend(ws::close_frame(1000, "bye", Some(MASK)));
    assert_eq!(rig.send(&mut ws, &held), Flow::ConnectionFull);
    assert!(ws.waiting());
    assert_eq!(rig.inflight(), 2, "still at the node");
    rig.answer(&mut ws, &node(&to_node));
    assert_eq!(rig.inflight(), 0);
    let Flow::Replace(out) = rig.settle(&mut ws) else {
        panic!("the close goes, alone")
    };
    assert_eq!(out, ws::close_frame(1000, "bye", Some(MASK)));
    assert!(!ws.waiting());
}

/// A subscribe past the socket's limit goes to the node as a method it
/// has not, under a gateway id, and the client gets the gate's error with
/// its own id; the others subscribe.
#[test]
fn a_subscribe_past_the_limit_is_refused_with_the_callers_id() {
    let mut rig = Rig::new(r#"{"maxInflight": 8, "maxSubscriptionsPerWebsocket": 2}"#);
    let mut ws = rig.socket();
    let subscribe = |id: u32| {
        client(&format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"accountSubscribe","params":["x"]}}"#
        ))
    };
    let bytes = [subscribe(1), subscribe(2), subscribe(3)].concat();
    let to_node = sent(rig.send(&mut ws, &bytes), &bytes);
    let at_node = messages(Side::Client, &to_node);
    assert_eq!(at_node.len(), 3);
    assert_eq!(at_node[2]["method"], "stakegate_subscriptionRefused");
    assert_eq!(rig.counts.subscriptions_refused, 1);
    // The node: two subscriptions, and an error for a method it has not.
    let answers = [
        server(r#"{"jsonrpc":"2.0","id":1,"result":11}"#),
        server(r#"{"jsonrpc":"2.0","id":2,"result":12}"#),
        server(
            r#"{"jsonrpc":"2.0","id":"sg-000000000000feed-0","error":{"code":-32601,"message":"Method not found"}}"#,
        ),
    ]
    .concat();
    let back = messages(Side::Server, &rig.answer(&mut ws, &answers));
    assert_eq!(back[2]["id"], 3);
    assert_eq!(back[2]["error"]["code"], -32005);
    assert_eq!(back[2]["error"]["data"]["rule"], "subscriptions");
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
}

#[test]
fn a_clients_response_is_not_sent() {
    let mut rig = Rig::new(r#"{"maxInflight": 8}"#);
    let mut ws = rig.socket();
    let response = client(r#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#);
    assert_eq!(rig.send(&mut ws, &response), Flow::Replace(Vec::new()));
    assert_eq!((ws.at_node(), rig.counts.skipped), (0, 1));
}

#[test]
fn data_waits_for_a_slot_and_goes_when_one_frees() {
    let mut rig = Rig::new(r#"{"maxInflight": 2, "maxInflightPerWebsocket": 8}"#);
    let mut a = rig.socket();
    let mut b = rig.socket();
    let two = calls(0..2);
    let to_node = sent(rig.send(&mut a, &two), &two);
    let one = calls(5..6);
    assert_eq!(rig.send(&mut b, &one), Flow::GateFull);
    assert!(b.waiting());
    // More arrives while held: only the new bytes are read.
    let grown = [one.clone(), calls(6..7)].concat();
    assert_eq!(rig.send(&mut b, &grown), Flow::GateFull);
    assert_eq!(rig.counts.waits, 1);
    let answers = node(&to_node);
    rig.answer(&mut a, &answers);
    // Two calls and two slots: each as itself, as they came.
    assert_eq!(rig.settle(&mut b), Flow::Through);
    assert_eq!(b.at_node(), 2);
}

#[test]
fn a_socket_waits_for_its_own_answers_past_its_allowance() {
    let mut rig = Rig::new(r#"{"maxInflight": 100, "maxInflightPerWebsocket": 2}"#);
    let mut ws = rig.socket();
    let five = calls(0..5);
    let to_node = sent(rig.send(&mut ws, &five), &five);
    assert_eq!(
        messages(Side::Client, &to_node).len(),
        2,
        "packed in its two units"
    );
    let more = calls(5..6);
    assert_eq!(rig.send(&mut ws, &more), Flow::ConnectionFull);
    rig.answer(&mut ws, &node(&to_node));
    assert!(matches!(
        rig.settle(&mut ws),
        Flow::Through | Flow::Replace(_)
    ));
}

/// Subscriptions sent together: `n` of them on the piece.
fn subscriptions(n: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            client(&format!(
                r#"{{"id":{i},"method":"eth_subscribe","params":["newHeads"]}}"#
            ))
        })
        .collect()
}

#[test]
fn more_subscriptions_at_once_than_a_socket_may_have_go_as_one_unit() {
    let mut rig = Rig::new(r#"{"maxInflight": 4, "maxInflightPerWebsocket": 2}"#);
    let mut ws = rig.socket();
    let fifty = subscriptions(50);
    let to_node = sent(rig.send(&mut ws, &fifty), &fifty);
    assert_eq!(to_node, fifty, "each as it came");
    assert_eq!((ws.at_node(), rig.inflight(), rig.counts.closed), (1, 1, 0));
    // The slot comes back with the last of the fifty answers, not before.
    let answers = node(&to_node);
    let each = messages(Side::Server, &answers);
    let (first, last) = answers.split_at(answers.len() - server(&each[49].to_string()).len());
    assert_eq!(rig.answer(&mut ws, first), first);
    assert_eq!((ws.at_node(), rig.inflight()), (1, 1));
    rig.answer(&mut ws, last);
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
    // With calls among them, the calls take the socket's other unit: the
    // two packed in one batch.
    let mixed = [subscriptions(3), calls(10..12)].concat();
    let to_node = sent(rig.send(&mut ws, &mixed), &mixed);
    assert_eq!(messages(Side::Client, &to_node).len(), 4);
    assert_eq!(ws.at_node(), 2);
    rig.answer(&mut ws, &node(&to_node));
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
    // A hundred to a unit: 250 at once need three, more than this socket
    // may ever have, and close it.
    let Flow::Replace(close) = rig.send(&mut ws, &subscriptions(250)) else {
        panic!()
    };
    assert_eq!(close[0], 0x88, "a close frame to the node");
    assert_eq!((rig.counts.closed, ws.at_node()), (1, 0));
}

#[test]
fn more_batches_at_once_than_a_socket_may_have_close_it() {
    let mut rig = Rig::new(r#"{"maxInflight": 100, "maxInflightPerWebsocket": 2}"#);
    let mut ws = rig.socket();
    let batches: Vec<u8> = (0..3)
        .flat_map(|i| {
            client(&format!(
                r#"[{{"id":{i},"method":"eth_subscribe","params":["newHeads"]}}]"#
            ))
        })
        .collect();
    let Flow::Replace(close) = rig.send(&mut ws, &batches) else {
        panic!()
    };
    assert_eq!(close[0], 0x88, "a close frame to the node");
    assert_eq!((rig.counts.closed, ws.at_node()), (1, 0));
    // Whatever the client sends next goes nowhere.
    assert_eq!(rig.send(&mut ws, &calls(0..1)), Flow::Replace(Vec::new()));
}

#[test]
fn a_fragmented_message_goes_once_whole_as_one_frame() {
    let mut rig = Rig::new(r#"{"maxInflight": 8}"#);
    let mut ws = rig.socket();
    let text = br#"{"jsonrpc":"2.0","id":9,"method":"eth_call","params":[]}"#;
    let mut first = ws::encode(ws::OPCODE_TEXT, &text[..20], Some(MASK));
    first[0] &= 0x7f;
    let ping = ws::encode(9, b"hi", Some(MASK));
    let last = ws::encode(ws::OPCODE_CONTINUATION, &text[20..], Some(MASK));
    // The first fragment and half the ping: the ping is not whole yet.
    let piece = [first.clone(), ping[..3].to_vec()].concat();
    assert_eq!(rig.send(&mut ws, &piece), Flow::Replace(Vec::new()));
    let rest = [ping[3..].to_vec(), last].concat();
    let Flow::Replace(out) = rig.send(&mut ws, &rest) else {
        panic!()
    };
    assert_eq!(
        out,
        [ping.clone(), client(std::str::from_utf8(text).unwrap())].concat()
    );
    assert_eq!(ws.at_node(), 1);
}

#[test]
fn a_message_over_the_limit_closes_the_socket() {
    let mut rig = Rig::new(r#"{"maxInflight": 8, "maxWebsocketMessageBytes": 1024}"#);
    let mut ws = rig.socket();
    let big = client(&format!(
        r#"{{"id":1,"method":"eth_call","params":["{}"]}}"#,
        "a".repeat(2000)
    ));
    let Flow::Replace(close) = rig.send(&mut ws, &big) else {
        panic!()
    };
    assert_eq!(&close[..1], &[0x88]);
    assert_eq!(rig.counts.closed, 1);
}

#[test]
fn a_packed_batch_the_node_refuses_whole_answers_each_call_with_its_error() {
    let mut rig = Rig::new(r#"{"maxInflight": 1}"#);
    let mut ws = rig.socket();
    let four = calls(0..4);
    sent(rig.send(&mut ws, &four), &four);
    let refusal = server(
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"batch too large"}}"#,
    );
    let back = messages(Side::Server, &rig.answer(&mut ws, &refusal));
    assert_eq!(back.len(), 4, "one per call");
    for (i, answer) in back.iter().enumerate() {
        assert_eq!(answer["id"], i);
        assert_eq!(answer["error"]["message"], "batch too large");
    }
    assert_eq!((ws.at_node(), rig.inflight()), (0, 0));
}

#[test]
fn pushes_pass_and_free_nothing() {
    let mut rig = Rig::new(r#"{"maxInflight": 8}"#);
    let mut ws = rig.socket();
    rig.send(&mut ws, &calls(0..1));
    let push = server(r#"{"jsonrpc":"2.0","method":"eth_subscription","params":{"result":{}}}"#);
    assert_eq!(rig.answer(&mut ws, &push), push);
    assert_eq!(ws.at_node(), 1);
}

fn message_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u32..1000).prop_map(|i| format!(
            r#"{{"jsonrpc":"2.0","id":{i},"method":"eth_call","params":[]}}"#
        )),
        (0u32..1000).prop_map(|i| format!(r#"{{"id":"s{i}","method":"eth_getBalance"}}"#)),
        Just(r#"{"jsonrpc":"2.0","method":"eth_getLogs","params":[{}]}"#.to_string()),
        (0u32..1000).prop_map(|i| format!(r#"{{"\u0069d":{i}.0,"method":"m"}}"#)),
        (0u32..1000).prop_map(|i| format!(r#"{{"ID":{i},"method":"m"}}"#)),
        crate::jsonrpc::testing::id_spelling()
            .prop_map(|id| format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call"}}"#)),
        (0u32..1000).prop_map(|i| format!(
            r#"[{{"id":{i},"method":"a"}},{{"method":"b"}},{{"id":"b{i}","method":"c"}}]"#
        )),
        (0u32..1000).prop_map(|i| format!(r#"{{"id":{i},"result":"0x0"}}"#)),
        (0u32..1000).prop_map(|i| format!(
            r#"{{"id":"sub{i}","method":"eth_subscribe","params":["newHeads"]}}"#
        )),
    ]
}

/// The ids a client expects answers for in `text`, as written.
fn expected(text: &str) -> Vec<String> {
    let summary = crate::jsonrpc::Summary::of(text.as_bytes());
    summary
        .entries
        .iter()
        .filter(|e| e.kind() == crate::jsonrpc::Kind::Call)
        .filter_map(|e| match e.id() {
            crate::jsonrpc::Id::Plain(r) | crate::jsonrpc::Id::Unsure(r) => {
                Some(text[r].to_string())
            }
            crate::jsonrpc::Id::Absent => None,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever a client sends, however cut: the node never has more units
    /// than the gate has slots, every call with an id is answered exactly
    /// once with its own id as written, and every slot comes back.
    #[test]
    fn every_call_is_answered_once_with_its_own_id(
        texts in prop::collection::vec(message_text(), 1..40),
        cuts in prop::collection::vec(0usize..4000, 0..6),
        slots in 1u32..6,
    ) {
        let policy = format!(r#"{{"maxInflight": {slots}, "maxInflightPerWebsocket": 8}}"#);
        let mut rig = Rig::new(&policy);
        let mut ws = rig.socket();
        let stream: Vec<u8> = texts.iter().flat_map(|t| client(t)).collect();
        let mut want: Vec<String> = texts.iter().flat_map(|t| expected(t)).collect();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (stream.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.push(stream.len());
        let mut got: Vec<String> = Vec::new();
        let mut held: Vec<u8> = Vec::new();
        let mut at_node: Vec<u8> = Vec::new();
        let mut from = 0;
        let subscriptions = texts.iter().filter(|t| t.contains("eth_subscribe")).count();
        for cut in cuts {
            held.extend_from_slice(&stream[from..cut]);
            from = cut;
            let mut flow = rig.send(&mut ws, &held);
            loop {
                prop_assert!(rig.inflight() <= slots);
                match flow {
                    Flow::Through | Flow::Replace(_) => {
                        at_node.extend(sent(flow, &held));
                        held.clear();
                        break;
                    }
                    Flow::GateFull | Flow::ConnectionFull => {
                        // The node answers what it has, which frees slots.
                        prop_assert!(!at_node.is_empty() || subscriptions > 0);
                        if at_node.is_empty() {
                            break;
                        }
                        let back = rig.answer(&mut ws, &node(&std::mem::take(&mut at_node)));
                        got.extend(raw_ids(&back));
                        flow = rig.settle(&mut ws);
                    }
                }
            }
        }
        if rig.counts.closed > 0 {
            // Only more subscriptions at once than a socket may hold.
            prop_assert!(subscriptions > 0);
            return Ok(());
        }
        let back = rig.answer(&mut ws, &node(&at_node));
        got.extend(raw_ids(&back));
        prop_assert!(held.is_empty() || !ws.waiting());
        want.sort();
        got.sort();
        prop_assert_eq!(got, want);
        prop_assert_eq!(ws.at_node(), 0);
        prop_assert_eq!(rig.inflight(), 0);
    }
}

/// Each answer's id as raw text (an answer per message, or per batch
/// entry).
fn raw_ids(bytes: &[u8]) -> Vec<String> {
    struct Ids(Vec<String>);
    impl Sink for Ids {
        fn begin(&mut self) -> Option<usize> {
            Some(1 << 24)
        }
        fn message(&mut self, m: Message) {
            let payload = m.payload.unwrap_or_default();
            for entry in &m.summary.entries {
                if let Some(id) = entry.last(Name::Id) {
                    self.0
                        .push(String::from_utf8_lossy(&payload[id.value.clone()]).into_owned());
                }
            }
        }
    }
    let mut ids = Ids(Vec::new());
    FrameReader::new(Side::Server).feed(bytes, &mut ids);
    ids.0
}
