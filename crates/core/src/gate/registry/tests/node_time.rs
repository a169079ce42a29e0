//! The gate in node time: heavy calls wait for slots of their own, freed
//! slots go to the longest waiter across workers, and sockets wait their
//! turn like requests.

use super::*;

/// Stream `id`'s answer comes whole at `ms`: the node's time on it, as
/// told.
fn answer(r: &mut Rig, id: u32, ms: u64) -> Option<u64> {
    at_ms(ms);
    r.response_headers(id, true, ok)
}

#[test]
fn heavy_calls_leave_the_cheap_slot_and_wait_for_theirs_oldest_first() {
    let policy =
        r#"{"maxInflight": 2, "decideOnBody": true, "nodeTime": {"cheapSlots": 1, "waitMs": 100}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    // A method's first call probes it (as cheap): each is told its time.
    at_ms(1000);
    assert_eq!(send(&mut r, 1, &call(1, "eth_getProof")), Then::Continue);
    assert_eq!(answer(&mut r, 1, 1040), Some(40_000));
    r.done(1);
    assert_eq!(send(&mut r, 2, &call(2, "eth_blockNumber")), Then::Continue);
    assert_eq!(answer(&mut r, 2, 1040), Some(0));
    r.done(2);
    at_ms(1041);
    assert_eq!(send(&mut r, 2, &call(2, "eth_blockNumber")), Then::Continue);
    assert_eq!(answer(&mut r, 2, 1041), Some(0));
    r.done(2);
    // One heavy call runs; the next waits, as a cheap one goes by.
    at_ms(1100);
    assert_eq!(send(&mut r, 3, &call(3, "eth_getProof")), Then::Continue);
    assert_eq!(send(&mut r, 4, &call(4, "eth_getProof")), Then::Pause);
    assert_eq!(send(&mut r, 5, &call(5, "eth_blockNumber")), Then::Continue);
    assert_eq!(send(&mut r, 6, &call(6, "eth_getProof")), Then::Pause);
    assert!(r.take(0).0.is_empty());
    // The cheap call's end frees no heavy slot; the heavy one's does,
    // for the oldest waiting, which is measured from then.
    assert_eq!(answer(&mut r, 5, 1101), Some(1000));
    r.done(5);
    assert!(r.take(0).0.is_empty());
    assert_eq!(answer(&mut r, 3, 1140), Some(40_000));
    r.done(3);
    assert_eq!(r.take(0).0, [Do::Resume(4, None)]);
    at_ms(1150);
    assert_eq!(r.response_headers(4, false, ok), Some(10_000));
    // The other waited its 100 ms in vain: refused with its own id.
    at_ms(1200);
    r.retry_waiting();
    let (dos, _) = r.take(0);
    let [Do::Answer(6, reply)] = dos.as_slice() else {
        panic!("{dos:?}")
    };
    assert_eq!(reply.status, 503);
    assert!(String::from_utf8_lossy(&reply.body).contains(r#""id":6"#));
    let counts = &r.worker.counts.node_time;
    assert_eq!(
        (counts.waited, counts.wait_refused, counts.waiting),
        (1, 1, 0)
    );
    // The probes of the two methods went as cheap.
    assert_eq!((counts.cheap, counts.heavy), (4, 2));
}

#[test]
fn a_freed_slot_goes_to_the_worker_whose_request_waited_longest() {
    let policy = r#"{"maxInflight": 2, "decideOnBody": true, "nodeTime": {"cheapSlots": 1}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let store = MemoryStore::default();
    let mut a = Registry::new(policy.clone(), 1, &store, clock_us);
    let mut b = Registry::new(policy, 2, &store, clock_us);
    let send = |r: &mut Registry<&MemoryStore>, id: u32| {
        assert_eq!(r.headers(id, &mut Public, post()), OnHeaders::Continue);
        let body = call(id, "eth_getProof");
        r.request_body(id, body.len(), true, &mut Bytes(body), &mut Public)
    };
    // Each worker's probe learns eth_getProof (40 ms): heavy from then.
    for r in [&mut a, &mut b] {
        at_ms(1000);
        assert_eq!(send(r, 1), Then::Continue);
        at_ms(1040);
        assert_eq!(r.response_headers(1, true, ok), Some(40_000));
        r.done(1);
    }
    // B keeps its probe's slot as a spare: A's heavy request waits, until
    // B's next tick hands the spare over and wakes A.
    at_ms(1045);
    assert_eq!(send(&mut a, 2), Then::Pause);
    a.take(0);
    b.retry_waiting();
    let wake_a = Do::Wake(vec![a.worker.gate.vm().unwrap()], SLOT_WAKE.to_vec());
    assert_eq!(b.take(0).0, std::slice::from_ref(&wake_a));
    a.woken(SLOT_WAKE);
    assert_eq!(a.take(0).0, [Do::Resume(2, None)]);
    // B's request waits first, then A's.
    at_ms(1050);
    assert_eq!(send(&mut b, 3), Then::Pause);
    at_ms(1060);
    assert_eq!(send(&mut a, 4), Then::Pause);
    a.take(0);
    b.take(0);
    // A's wait tick reads who waits (it has no spare slot to hand over).
    at_ms(1085);
    a.retry_waiting();
    assert_eq!(a.take(0).0, []);
    // A's own request ends: the slot is B's, whose request waited
    // longer; A hands it over and wakes B.
    at_ms(1090);
    a.response_headers(2, true, ok);
    a.done(2);
    let (dos, _) = a.take(0);
    assert_eq!(
        dos,
        [Do::Wake(
            vec![b.worker.gate.vm().unwrap()],
            SLOT_WAKE.to_vec()
        )]
    );
    b.woken(SLOT_WAKE);
    assert_eq!(b.take(0).0, [Do::Resume(3, None)]);
    // B's ends: A's request is the oldest now, and B has none waiting.
    at_ms(1130);
    b.response_headers(3, true, ok);
    b.done(3);
    assert_eq!(b.take(0).0, [wake_a]);
    a.woken(SLOT_WAKE);
    assert_eq!(a.take(0).0, [Do::Resume(4, None)]);
}

/// Across workers, a staked caller's waiting request goes before an
/// unstaked crowd's however long the crowd waited: A's crowd waited
/// first, B's staked call came later, and the slot A frees is B's. (Workers
/// compared only ages before, and a crowd split over two workers took
/// freed slots while a staked call waited on the other.)
#[test]
fn a_freed_slot_goes_to_the_worker_whose_waiting_request_is_staked() {
    let policy = r#"{"maxInflight": 1, "decideOnBody": true,
        "nodeTime": {"cheapSlots": 0, "waitMs": 1000},
        "classes": {"priority": [{"staked": true}]}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let store = MemoryStore::default();
    let mut a = Registry::new(policy.clone(), 1, &store, clock_us);
    let mut b = Registry::new(policy, 2, &store, clock_us);
    at_ms(1000);
    assert_eq!(ask(&mut a, 1, false), Then::Continue);
    assert_eq!(ask(&mut a, 2, false), Then::Pause);
    at_ms(1010);
    assert_eq!(ask(&mut b, 3, true), Then::Pause);
    a.take(0);
    b.take(0);
    // A's wait tick reads who waits, then its own request ends.
    at_ms(1030);
    a.retry_waiting();
    assert_eq!(a.take(0).0, []);
    at_ms(1040);
    a.response_headers(1, true, ok);
    a.done(1);
    assert_eq!(
        a.take(0).0,
        [Do::Wake(
            vec![b.worker.gate.vm().unwrap()],
            SLOT_WAKE.to_vec()
        )]
    );
    b.woken(SLOT_WAKE);
    assert_eq!(b.take(0).0, [Do::Resume(3, None)]);
}

/// Stream `id` opens a public WebSocket.
fn open(r: &mut Rig, id: u32) {
    let head = Head {
        end_of_stream: false,
        upgrade: Upgrade::Websocket,
        content_length: None,
    };
    assert_eq!(
        r.headers(id, &mut Public, head),
        OnHeaders::ContinueWebsocket
    );
}

/// A text frame holding `text` (masked: the client's).
fn frame(text: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
    crate::websocket::encode(crate::websocket::OPCODE_TEXT, text.as_bytes(), mask)
}

#[test]
fn sockets_waiting_for_a_slot_go_on_oldest_first_as_answers_free_slots() {
    let policy = GatePolicy::parse(br#"{"maxInflight": 1, "heartbeatMs": 100}"#).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    at_ms(1000);
    let data = |r: &mut Rig, id: u32| {
        let call = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call"}}"#);
        let bytes = frame(&call, Some([1, 2, 3, 4]));
        r.request_body(id, bytes.len(), false, &mut Bytes(bytes), &mut Public)
    };
    for id in 1..=3 {
        open(&mut r, id);
    }
    assert_eq!(data(&mut r, 1), Then::Continue, "the one slot");
    assert_eq!(data(&mut r, 2), Then::Pause);
    assert_eq!(data(&mut r, 3), Then::Pause);
    // The node answers socket 1 after 100 ms: its slot goes to socket 2,
    // not 3.
    at_ms(1100);
    let answer = frame(r#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#, None);
    let replaced = r.response_body(1, answer.len(), false, &mut Bytes(answer));
    assert_eq!(replaced.replace, None);
    assert_eq!(r.take(0).0, [Do::Resume(2, None)]);
    // Socket 2 is cut with its call at the node: its slot is held while
    // the node runs it (a call took 100 ms lately), then socket 3 goes on.
    at_ms(1150);
    r.done(2);
    assert_eq!(r.take(0).0, []);
    assert_eq!(r.worker.counts.websocket.lingered, 1);
    at_ms(1199);
    r.retry_waiting();
    assert_eq!(r.take(0).0, []);
    at_ms(1200);
    r.retry_waiting();
    assert_eq!(r.take(0).0, [Do::Resume(3, None)]);
}

#[test]
fn far_from_full_a_request_on_a_spare_slot_is_not_priced() {
    let policy = r#"{"maxInflight": 8, "decideOnBody": true, "nodeTime": {"cheapSlots": 1}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    let counts = |r: &Rig| {
        let c = &r.worker.counts.node_time;
        (c.cheap, c.heavy, c.unpriced)
    };
    // From the pool: priced (a probe), and its answer teaches its cost.
    at_ms(1000);
    assert_eq!(send(&mut r, 1, &call(1, "eth_getProof")), Then::Continue);
    assert_eq!(answer(&mut r, 1, 1040), Some(40_000));
    r.done(1);
    // On the spare slot it left, with 1 of 8 in flight: not priced, and
    // not timed (it waited for nothing: stake QoS's clock times it).
    assert_eq!(send(&mut r, 2, &call(2, "eth_getProof")), Then::Continue);
    assert_eq!(counts(&r), (1, 0, 1));
    // Three more from the pool make 4 in flight, half the slots: busy.
    for id in 3..6 {
        assert_eq!(
            send(&mut r, id, &call(id, "eth_blockNumber")),
            Then::Continue
        );
    }
    assert!(r.worker.busy.engaged());
    assert_eq!(answer(&mut r, 2, 1050), None);
    r.done(2);
    // Now a heavy call is priced and leaves the spare slot for cheap ones
    // (the two eth_blockNumber after its probe were heavy until it was
    // measured).
    assert_eq!(send(&mut r, 6, &call(6, "eth_getProof")), Then::Continue);
    assert_eq!(counts(&r), (2, 3, 1));
    for id in 3..7 {
        answer(&mut r, id, 1060);
        r.done(id);
    }
    // A heartbeat 5 s after it was last busy, with nothing in flight:
    // standing by again.
    at_ms(1060 + STANDBY_MS);
    r.heartbeat();
    assert!(!r.worker.busy.engaged());
    assert_eq!(send(&mut r, 7, &call(7, "eth_getProof")), Then::Continue);
    assert_eq!(counts(&r), (2, 4, 1), "the heartbeat took the spares back");
    r.done(7);
    assert_eq!(send(&mut r, 8, &call(8, "eth_getProof")), Then::Continue);
    assert_eq!(counts(&r), (2, 4, 2));
}

/// With coalescing on, a request that finds the gate full waits for a slot
/// as any other (it was refused at once), and coalescing checks it once it
/// has one: it leads its key with that slot. A leader's answer says the
/// node's time on it in the policy's header, as the route would have.
#[test]
fn with_coalescing_on_a_request_waits_for_its_slot_then_leads_its_key() {
    let policy = r#"{"maxInflight": 1, "decideOnBody": true, "dedup": {},
        "nodeTime": {"cheapSlots": 0, "waitMs": 1000, "serviceTimeHeader": "x-node-service-us"}}"#;
    let policy = GatePolicy::parse(policy.as_bytes()).unwrap();
    let mut r = Registry::new(policy, 7, MemoryStore::default(), clock_us);
    at_ms(1000);
    let (first, second) = (call(1, "eth_getProof"), call(2, "eth_getLogs"));
    assert_eq!(send(&mut r, 1, &first), Then::Pause, "leads, with the slot");
    assert_eq!(send(&mut r, 2, &second), Then::Pause, "waits for the slot");
    assert_eq!(r.worker.counts.node_time.waiting, 1);
    let (leader, _) = r.next_callout().unwrap();
    assert_eq!((leader, r.next_callout()), (1, None));
    r.sent(1, Ok(40));
    // The leader's answer frees the slot: the waiter takes it and leads.
    at_ms(1040);
    let said = Response {
        said_us: Some(40_000),
        ..answered(br#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#)
    };
    r.callout_ended(40, Some(said));
    let dos = r.take(0).0;
    let [Do::Poke, Do::Answer(1, reply)] = dos.as_slice() else {
        panic!("{dos:?}")
    };
    assert_eq!(reply.node_us, Some(40_000));
    assert_eq!(reply.said_us, Some(40_000), "the node's word, echoed");
    r.done(1);
    let (leader, callout) = r.next_callout().expect("the waiter leads");
    assert_eq!((leader, callout.body), (2, second));
    let counts = &r.worker.counts;
    assert_eq!((counts.node_time.waited, counts.node_time.waiting), (1, 0));
    assert_eq!((counts.dedup.led, counts.rejected[2]), (2, 0));
}
