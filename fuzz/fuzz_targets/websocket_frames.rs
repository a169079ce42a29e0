//! Any bytes as a WebSocket stream, both ways: reading never panics,
//! however the bytes are cut into pieces the same messages come out, and
//! the gate's socket (every message the client sent, then the node's
//! bytes) never panics either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::clock::Now;
use stakegate_core::gate::class::RequestClass;
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::gate::shards::SlotKind;
use stakegate_core::gate::websocket::linger::Linger;
use stakegate_core::gate::websocket::subscriptions::Subscriptions;
use stakegate_core::gate::websocket::{Counts, Websocket};
use stakegate_core::gate::{Decision, InflightGate};
use stakegate_core::request::Body;
use stakegate_core::shared::MemoryStore;
use stakegate_core::websocket::{Count, FrameReader, Side};

fn read(side: Side, pieces: &[&[u8]]) -> Count {
    let mut reader = FrameReader::new(side);
    let mut total = Count::default();
    for piece in pieces {
        reader.feed(piece, &mut total);
    }
    total
}

struct Bytes(Vec<u8>);

impl Body for Bytes {
    fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
        self.0.get(start..start + len).unwrap_or_default().to_vec()
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let at = usize::from(cut) * stream.len() / 256;
    let (a, b) = stream.split_at(at);
    for side in [Side::Client, Side::Server] {
        let whole = read(side, &[stream]);
        assert_eq!(whole, read(side, &[a, b]));
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(whole, read(side, &bytes));
        assert!(whole.messages as usize <= stream.len() / 2);
    }
    let store = MemoryStore::default();
    let policy = GatePolicy::parse(br#"{"maxInflight": 3, "maxWebsocketMessageBytes": 4096}"#);
    let Ok(policy) = policy else { return };
    let mut gate = InflightGate::new(policy, 1);
    let Decision::Admit(ticket) = gate
        .admit(&store, &mut Now::fixed(0), RequestClass::Default, true)
        .decision
    else {
        return;
    };
    let mut socket = Websocket::new(ticket, SlotKind::Default, 4096, 9, Some(1));
    let mut counts = Counts::default();
    let mut subs = Subscriptions::new(1000, 2000);
    socket.read(&mut Bytes(a.to_vec()), a.len(), &mut counts, &mut subs);
    let _ = socket.settle(&mut gate, &store, &mut Now::fixed(0), &mut counts);
    let (released, _) = socket.answer(b, 0, &mut Linger::default(), &mut counts);
    assert!(released <= 3);
});
