//! WebSocket frames read as they pass through the gateway, for what a
//! policy needs to know: how many JSON-RPC messages went each way, and
//! which of them wait for an answer.
//!
//! A `FrameReader` takes one direction's bytes in whatever pieces Envoy
//! hands them over (a frame may span pieces, a piece may hold many frames)
//! and keeps only a few bytes of state. Client frames are masked (RFC 6455
//! 5.3) and are unmasked here; a message may be fragmented over several
//! frames, with control frames (ping, pong, close) in between, which are
//! skipped.
//!
//! **What a message is.** Only the top level of its JSON is read, byte by
//! byte, never parsed into values:
//! - a client message *expects an answer* if it is an array (a batch) or an
//!   object with an `id` member; a notification (no `id`) does not;
//! - a server message is an *answer* unless it is an object whose first
//!   member among `id`, `result`, `error` and `method` is `method` (a
//!   subscription notification: `{"jsonrpc":"2.0","method":"eth_subscription",…}`).
//!   Ethereum and Solana nodes write `id` or `method` before the payload.
//!
//! Compressed messages (permessage-deflate) cannot be read; the gate keeps
//! them from being negotiated by removing `sec-websocket-extensions` from
//! the upgrade request. Should one arrive anyway, a client message counts
//! as expecting an answer and a server message as an answer.

/// Which side of the connection a reader's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Masked frames from the client.
    Client,
    /// Unmasked frames from the node.
    Server,
}

/// Messages completed in the bytes fed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Messages {
    /// Client messages that expect an answer.
    pub requests: u32,
    /// Client notifications (no answer expected).
    pub notifications: u32,
    /// Server answers.
    pub answers: u32,
    /// Server-initiated messages (subscription notifications).
    pub pushes: u32,
}

impl Messages {
    pub fn total(&self) -> u32 {
        self.requests + self.notifications + self.answers + self.pushes
    }
}

/// Longest frame header: 2 bytes, 8 of extended length, 4 of mask.
const MAX_HEADER: usize = 14;

#[derive(Debug, Clone)]
pub struct FrameReader {
    side: Side,
    header: [u8; MAX_HEADER],
    header_len: usize,
    /// Payload bytes left in the current frame (once its header is read).
    remaining: u64,
    in_frame: bool,
    mask: Option<[u8; 4]>,
    /// Position in the mask for the next payload byte.
    mask_at: usize,
    /// The current frame carries message data (text, binary, continuation).
    data: bool,
    fin: bool,
    /// The message being read, if any.
    message: Option<TopLevel>,
}

impl FrameReader {
    pub fn new(side: Side) -> Self {
        Self {
            side,
            header: [0; MAX_HEADER],
            header_len: 0,
            remaining: 0,
            in_frame: false,
            mask: None,
            mask_at: 0,
            data: false,
            fin: false,
            message: None,
        }
    }

    /// Reads `bytes`, the next piece of this direction's stream, and returns
    /// the messages it completed.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Messages {
        let mut done = Messages::default();
        loop {
            if !self.in_frame {
                let Some(rest) = self.read_header(bytes) else {
                    return done;
                };
                bytes = rest;
                if self.remaining == 0 {
                    self.end_frame(&mut done);
                    continue;
                }
            }
            if bytes.is_empty() {
                return done;
            }
            let take = usize::try_from(self.remaining)
                .unwrap_or(usize::MAX)
                .min(bytes.len());
            let (payload, rest) = bytes.split_at(take);
            if self.data {
                if let Some(message) = &mut self.message {
                    for &b in payload {
                        let b = match self.mask {
                            Some(mask) => {
                                let unmasked = b ^ mask[self.mask_at];
                                self.mask_at = (self.mask_at + 1) % 4;
                                unmasked
                            }
                            None => b,
                        };
                        message.push(b);
                    }
                }
            }
            self.remaining -= take as u64;
            bytes = rest;
            if self.remaining == 0 {
                self.end_frame(&mut done);
            }
        }
    }

    /// Accumulates a frame header; returns the bytes after it once whole.
    fn read_header<'b>(&mut self, mut bytes: &'b [u8]) -> Option<&'b [u8]> {
        loop {
            let needed = self.header_needed();
            if self.header_len >= needed {
                break;
            }
            let (&b, rest) = bytes.split_first()?;
            self.header[self.header_len] = b;
            self.header_len += 1;
            bytes = rest;
        }
        let h = &self.header;
        let (fin, rsv1, opcode) = (h[0] & 0x80 != 0, h[0] & 0x40 != 0, h[0] & 0x0f);
        let masked = h[1] & 0x80 != 0;
        let (length, at) = match h[1] & 0x7f {
            126 => (u64::from(u16::from_be_bytes([h[2], h[3]])), 4),
            127 => {
                let mut n = [0; 8];
                n.copy_from_slice(&h[2..10]);
                (u64::from_be_bytes(n), 10)
            }
            n => (u64::from(n), 2),
        };
        self.mask = masked.then(|| [h[at], h[at + 1], h[at + 2], h[at + 3]]);
        self.mask_at = 0;
        self.remaining = length;
        self.fin = fin;
        self.data = opcode < 8;
        if matches!(opcode, 1 | 2) {
            // A new message (a continuation without one is read as one).
            self.message = Some(TopLevel::new(rsv1));
        } else if opcode == 0 && self.message.is_none() {
            self.message = Some(TopLevel::new(true));
        }
        self.header_len = 0;
        self.in_frame = true;
        Some(bytes)
    }

    /// Header bytes needed, as far as what has been read tells.
    fn header_needed(&self) -> usize {
        if self.header_len < 2 {
            return 2;
        }
        let masked = if self.header[1] & 0x80 != 0 { 4 } else { 0 };
        let extended = match self.header[1] & 0x7f {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        2 + extended + masked
    }

    fn end_frame(&mut self, done: &mut Messages) {
        self.in_frame = false;
        if !(self.data && self.fin) {
            return;
        }
        let Some(message) = self.message.take() else {
            return;
        };
        match (self.side, message.expects_answer(), message.is_push()) {
            (Side::Client, true, _) => done.requests += 1,
            (Side::Client, false, _) => done.notifications += 1,
            (Side::Server, _, true) => done.pushes += 1,
            (Side::Server, _, false) => done.answers += 1,
        }
    }
}

/// The top level of one JSON text, read byte by byte: whether it is a
/// batch, and which of `id` / `method` / `result` / `error` it has.
#[derive(Debug, Clone)]
struct TopLevel {
    /// Compressed or otherwise unreadable.
    opaque: bool,
    depth: u32,
    started: bool,
    array: bool,
    object: bool,
    in_string: bool,
    escape: bool,
    expect_key: bool,
    capturing: bool,
    key: [u8; 8],
    key_len: usize,
    has_id: bool,
    /// The first of `id`, `result`, `error`, `method` seen.
    first: Option<Member>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Member {
    Id,
    Method,
    Result,
    Error,
}

impl TopLevel {
    fn new(opaque: bool) -> Self {
        Self {
            opaque,
            depth: 0,
            started: false,
            array: false,
            object: false,
            in_string: false,
            escape: false,
            expect_key: false,
            capturing: false,
            key: [0; 8],
            key_len: 0,
            has_id: false,
            first: None,
        }
    }

    fn push(&mut self, b: u8) {
        if self.opaque {
            return;
        }
        if self.in_string {
            if self.escape {
                self.escape = false;
                self.capture(0);
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.capturing {
                    self.capturing = false;
                    self.key_done();
                }
            } else {
                self.capture(b);
            }
            return;
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 1 && self.object && self.expect_key {
                    self.capturing = true;
                    self.key_len = 0;
                }
            }
            b'{' | b'[' => {
                if !self.started {
                    self.started = true;
                    self.object = b == b'{';
                    self.array = b == b'[';
                }
                self.depth = self.depth.saturating_add(1);
                if self.depth == 1 && self.object {
                    self.expect_key = true;
                }
            }
            b'}' | b']' => self.depth = self.depth.saturating_sub(1),
            b':' if self.depth == 1 => self.expect_key = false,
            b',' if self.depth == 1 && self.object => self.expect_key = true,
            b' ' | b'\t' | b'\r' | b'\n' => {}
            _ => self.started = true,
        }
    }

    /// A key byte; 0 stands for an escape, so an escaped key matches nothing.
    fn capture(&mut self, b: u8) {
        if self.capturing {
            if self.key_len < self.key.len() {
                self.key[self.key_len] = b;
            }
            self.key_len = self.key_len.saturating_add(1);
        }
    }

    fn key_done(&mut self) {
        let key = &self.key[..self.key_len.min(self.key.len())];
        let member = match (self.key_len, key) {
            (2, b"id") => Member::Id,
            (6, b"method") => Member::Method,
            (6, b"result") => Member::Result,
            (5, b"error") => Member::Error,
            _ => return,
        };
        self.has_id |= member == Member::Id;
        self.first.get_or_insert(member);
    }

    /// A client message: a batch, or an object with an `id`.
    fn expects_answer(&self) -> bool {
        self.opaque || self.array || self.has_id
    }

    /// A server message that is not an answer.
    fn is_push(&self) -> bool {
        !self.opaque && self.object && self.first == Some(Member::Method)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One frame: `fin`, `opcode`, `payload`, masked with `mask` if given.
    fn frame(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
        let mut out = vec![(u8::from(fin) << 7) | opcode];
        let masked = u8::from(mask.is_some()) << 7;
        match payload.len() {
            n if n < 126 => out.push(masked | n as u8),
            n if n <= 0xffff => {
                out.push(masked | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(masked | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        match mask {
            Some(mask) => {
                out.extend_from_slice(&mask);
                out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
            }
            None => out.extend_from_slice(payload),
        }
        out
    }

    fn text(payload: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
        frame(true, 1, payload.as_bytes(), mask)
    }

    const MASK: Option<[u8; 4]> = Some([0x37, 0xfa, 0x21, 0x3d]);

    #[test]
    fn client_messages_with_an_id_expect_an_answer() {
        let mut reader = FrameReader::new(Side::Client);
        let mut bytes = text(
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[]}"#,
            MASK,
        );
        // ethers puts the id last.
        bytes.extend(text(
            r#"{"method":"eth_getLogs","params":[{"id":9}],"id":42,"jsonrpc":"2.0"}"#,
            MASK,
        ));
        bytes.extend(text(
            r#"{"jsonrpc":"2.0","method":"note","params":{"id":3}}"#,
            MASK,
        ));
        bytes.extend(text(
            r#"[{"id":1,"method":"a"},{"id":2,"method":"b"}]"#,
            MASK,
        ));
        assert_eq!(
            reader.feed(&bytes),
            Messages {
                requests: 3,
                notifications: 1,
                ..Messages::default()
            }
        );
    }

    #[test]
    fn server_notifications_are_not_answers() {
        let mut reader = FrameReader::new(Side::Server);
        let mut bytes = text(r#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#, None);
        bytes.extend(text(
            r#"{"jsonrpc":"2.0","method":"eth_subscription","params":{"subscription":"0xab","result":{"id":1}}}"#,
            None,
        ));
        bytes.extend(text(
            r#"{"jsonrpc":"2.0","error":{"code":-32000},"id":null}"#,
            None,
        ));
        bytes.extend(text(r#"[{"id":1,"result":1}]"#, None));
        assert_eq!(
            reader.feed(&bytes),
            Messages {
                answers: 3,
                pushes: 1,
                ..Messages::default()
            }
        );
    }

    #[test]
    fn fragments_control_frames_and_long_lengths() {
        let mut reader = FrameReader::new(Side::Client);
        let big = format!(
            r#"{{"jsonrpc":"2.0","method":"eth_call","params":["{}"],"id":7}}"#,
            "a".repeat(70_000)
        );
        let (first, second) = big.as_bytes().split_at(40_000);
        let mut bytes = frame(false, 1, first, MASK);
        bytes.extend(frame(true, 9, b"ping", MASK));
        bytes.extend(frame(true, 0, second, MASK));
        bytes.extend(frame(true, 8, &[3, 232], MASK));
        assert_eq!(reader.feed(&bytes).requests, 1);
    }

    #[test]
    fn escaped_keys_match_nothing() {
        let mut reader = FrameReader::new(Side::Client);
        let bytes = text(r#"{"i\u0064":1,"method":"m","x":"\"id\""}"#, MASK);
        assert_eq!(reader.feed(&bytes).notifications, 1);
    }

    #[test]
    fn compressed_messages_count_conservatively() {
        let mut client = FrameReader::new(Side::Client);
        let mut server = FrameReader::new(Side::Server);
        let compressed = |mask| {
            let mut f = frame(true, 1, b"\x01\x02\x03", mask);
            f[0] |= 0x40;
            f
        };
        assert_eq!(client.feed(&compressed(MASK)).requests, 1);
        assert_eq!(server.feed(&compressed(None)).answers, 1);
    }

    proptest! {
        /// However the stream is cut into pieces, the same messages come out.
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
            let whole = FrameReader::new(Side::Client).feed(&stream);
            prop_assert_eq!(whole, Messages { requests: 13, notifications: 7, ..Messages::default() });
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (stream.len() + 1)).collect();
            cuts.sort_unstable();
            let mut reader = FrameReader::new(Side::Client);
            let mut total = Messages::default();
            let mut from = 0;
            for cut in cuts.into_iter().chain([stream.len()]) {
                let got = reader.feed(&stream[from..cut]);
                total.requests += got.requests;
                total.notifications += got.notifications;
                from = cut;
            }
            prop_assert_eq!(total, whole);
        }

        /// Arbitrary bytes never panic and never count more messages than
        /// they could hold frames (two bytes each, at least).
        #[test]
        fn garbage_is_harmless(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut reader = FrameReader::new(Side::Server);
            let got = reader.feed(&bytes);
            prop_assert!(got.total() as usize <= bytes.len() / 2);
        }
    }
}
