use super::*;
use proptest::prelude::*;

/// One frame: `fin`, `opcode`, `payload`, masked with `mask` if given.
pub(crate) fn frame(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = encode(opcode, payload, mask);
    if !fin {
        out[0] &= 0x7f;
    }
    out
}

fn text(payload: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
    encode(OPCODE_TEXT, payload.as_bytes(), mask)
}

const MASK: Option<[u8; 4]> = Some([0x37, 0xfa, 0x21, 0x3d]);

/// Everything a reader reported.
#[derive(Default)]
struct Log {
    limit: Option<usize>,
    messages: Vec<Message>,
    controls: Vec<Vec<u8>>,
    raw: Vec<(std::ops::Range<usize>, bool)>,
}

impl Sink for Log {
    fn begin(&mut self) -> Option<usize> {
        self.limit
    }
    fn raw(&mut self, range: std::ops::Range<usize>, control: bool) {
        self.raw.push((range, control));
    }
    fn control(&mut self, frame: &[u8]) {
        self.controls.push(frame.to_vec());
    }
    fn message(&mut self, message: Message) {
        self.messages.push(message);
    }
}

fn count(side: Side, bytes: &[u8]) -> Count {
    let mut count = Count::default();
    FrameReader::new(side).feed(bytes, &mut count);
    count
}

#[test]
fn a_batch_is_its_calls_and_a_response_is_none() {
    let mut bytes = text(
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[]}"#,
        MASK,
    );
    bytes.extend(text(
        r#"{"jsonrpc":"2.0","method":"note","params":{"id":3}}"#,
        MASK,
    ));
    bytes.extend(text(
        r#"[{"id":1,"method":"a"},{"method":"b"},{"id":2,"result":1}]"#,
        MASK,
    ));
    bytes.extend(text(r#"{"jsonrpc":"2.0","id":9,"result":"0x1"}"#, MASK));
    bytes.extend(text("not json", MASK));
    assert_eq!(
        count(Side::Client, &bytes),
        Count {
            messages: 5,
            calls: 1 + 1 + 2 + 1
        }
    );
}

#[test]
fn server_notifications_are_pushes() {
    let push = r#"{"jsonrpc":"2.0","method":"eth_subscription","params":{"subscription":"0xab","result":{"id":1}}}"#;
    let mut log = Log::default();
    let mut bytes = text(r#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#, None);
    bytes.extend(text(push, None));
    bytes.extend(text(
        r#"{"jsonrpc":"2.0","error":{"code":-32000},"id":null}"#,
        None,
    ));
    bytes.extend(text(r#"[{"id":1,"result":1}]"#, None));
    FrameReader::new(Side::Server).feed(&bytes, &mut log);
    let pushes: Vec<bool> = log.messages.iter().map(Message::is_push).collect();
    assert_eq!(pushes, [false, true, false, false]);
}

#[test]
fn fragments_control_frames_and_long_lengths() {
    let big = format!(
        r#"{{"jsonrpc":"2.0","method":"eth_call","params":["{}"],"id":7}}"#,
        "a".repeat(70_000)
    );
    let (first, second) = big.as_bytes().split_at(40_000);
    let mut bytes = frame(false, OPCODE_TEXT, first, MASK);
    let ping = frame(true, 9, b"ping", MASK);
    bytes.extend(&ping);
    bytes.extend(frame(true, OPCODE_CONTINUATION, second, MASK));
    let close = frame(true, OPCODE_CLOSE, &[3, 232], MASK);
    bytes.extend(&close);
    let mut log = Log {
        limit: Some(1 << 20),
        ..Log::default()
    };
    FrameReader::new(Side::Client).feed(&bytes, &mut log);
    assert_eq!(log.controls, [ping, close]);
    let [message] = log.messages.as_slice() else {
        panic!("{} messages", log.messages.len())
    };
    assert_eq!(message.payload.as_deref(), Some(big.as_bytes()));
    assert_eq!(
        (message.frames, message.mask, message.len),
        (2, MASK, big.len() as u64)
    );
    assert_eq!(
        message.summary.entries[0].method.as_deref(),
        Some("eth_call")
    );
}

#[test]
fn raw_ranges_cover_every_byte_once_in_order() {
    let mut bytes = text(r#"{"id":1,"method":"a"}"#, MASK);
    let pong = bytes.len()..bytes.len() + 10;
    bytes.extend(frame(true, 10, b"pong", MASK));
    bytes.extend(text(r#"{"id":2,"method":"b"}"#, MASK));
    for cut in 0..=bytes.len() {
        let mut log = Log::default();
        let mut reader = FrameReader::new(Side::Client);
        reader.feed(&bytes[..cut], &mut log);
        let first = log.raw.len();
        reader.feed(&bytes[cut..], &mut log);
        let mut next = 0;
        for (i, (range, control)) in log.raw.iter().enumerate() {
            let base = if i < first { 0 } else { cut };
            assert_eq!(range.start + base, next, "cut {cut}");
            next = range.end + base;
            let in_pong = pong.contains(&(range.start + base));
            assert_eq!(*control, in_pong, "cut {cut}: {range:?}");
        }
        assert_eq!(next, bytes.len());
        assert_eq!(log.messages.len(), 2);
        assert!(!reader.in_progress());
    }
}

#[test]
fn a_kept_message_over_the_limit_overflows() {
    let mut log = Log {
        limit: Some(10),
        ..Log::default()
    };
    FrameReader::new(Side::Client).feed(&text(r#"{"id":1,"method":"eth_call"}"#, MASK), &mut log);
    assert!(log.messages[0].overflowed);
    assert_eq!(log.messages[0].payload, None);
}

#[test]
fn compressed_messages_are_unreadable_and_count_as_a_call() {
    let mut compressed = frame(true, OPCODE_TEXT, b"\x01\x02\x03", MASK);
    compressed[0] |= 0x40;
    let mut log = Log::default();
    FrameReader::new(Side::Client).feed(&compressed, &mut log);
    assert!(log.messages[0].compressed);
    assert_eq!(count(Side::Client, &compressed).calls, 1);
}

#[test]
fn a_close_frame_carries_its_code_and_reason() {
    let close = close_frame(1008, "too many calls at once", None);
    assert_eq!(&close[..4], &[0x88, 24, 0x03, 0xf0]);
    assert_eq!(&close[4..], b"too many calls at once");
    let long = close_frame(1008, &"é".repeat(100), None);
    assert!(long.len() <= 2 + 125);
}

proptest! {
    /// However the stream is cut into pieces, the same messages and
    /// control frames come out.
    #[test]
    fn any_split_reads_the_same(cuts in proptest::collection::vec(0usize..2000, 0..12)) {
        let mut stream = Vec::new();
        for i in 0..20 {
            let body = if i % 3 == 0 {
                format!(r#"{{"jsonrpc":"2.0","method":"n","params":[{}]}}"#, "1,".repeat(i * 7) + "1")
            } else {
                format!(r#"{{"params":["{}"],"id":{i},"method":"m"}}"#, "x".repeat(i * 13))
            };
            stream.extend(text(&body, MASK));
            if i % 5 == 0 {
                stream.extend(frame(true, 10, b"pong", MASK));
            }
        }
        let read = |pieces: &[&[u8]]| {
            let mut log = Log { limit: Some(1 << 16), ..Log::default() };
            let mut reader = FrameReader::new(Side::Client);
            for piece in pieces {
                reader.feed(piece, &mut log);
            }
            (log.messages, log.controls)
        };
        let whole = read(&[&stream]);
        prop_assert_eq!(whole.0.len(), 20);
        prop_assert_eq!(whole.1.len(), 4);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (stream.len() + 1)).collect();
        cuts.sort_unstable();
        let mut pieces = Vec::new();
        let mut from = 0;
        for cut in cuts.into_iter().chain([stream.len()]) {
            pieces.push(&stream[from..cut]);
            from = cut;
        }
        prop_assert_eq!(read(&pieces), whole);
    }

    /// Arbitrary bytes never panic and never make more messages than they
    /// could hold frames (two bytes each, at least).
    #[test]
    fn garbage_is_harmless(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        for side in [Side::Client, Side::Server] {
            let got = count(side, &bytes);
            prop_assert!(got.messages as usize <= bytes.len() / 2);
        }
    }
}
