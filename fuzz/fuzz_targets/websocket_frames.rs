//! Any bytes as a WebSocket stream, both ways: reading never panics, and
//! however the bytes are cut into pieces, the same messages come out.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stakegate_core::websocket::{FrameReader, Messages, Side};

fn read(side: Side, pieces: &[&[u8]]) -> Messages {
    let mut reader = FrameReader::new(side);
    let mut total = Messages::default();
    for piece in pieces {
        let got = reader.feed(piece);
        total.requests += got.requests;
        total.notifications += got.notifications;
        total.answers += got.answers;
        total.pushes += got.pushes;
    }
    total
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
        assert!(whole.total() as usize <= stream.len() / 2);
    }
});
