//! WebSocket frames read as they pass through the gateway (RFC 6455).
//!
//! A `FrameReader` takes one direction's bytes in whatever pieces Envoy
//! hands them over (a frame may span pieces, a piece may hold many frames)
//! and tells a `Sink` what it found, in stream order: which bytes of the
//! piece belong to which frame, each control frame (ping, pong, close)
//! once whole, and each data message once whole, with its JSON-RPC
//! summary (`crate::jsonrpc::scan`) and, if the sink asked to keep it, its
//! payload. Client frames are masked (5.3) and are unmasked here; a
//! message may be fragmented over several frames, with control frames in
//! between.
//!
//! The reader keeps only a frame header's bytes and the scanner's state,
//! unless the sink keeps a message: then its payload, up to the limit the
//! sink gives (a message over it is reported as `overflowed`, its payload
//! dropped).
//!
//! `encode` writes a message back as one frame, which is how the gate
//! forwards a message it changed or held.
//!
//! Compressed messages (permessage-deflate, `rsv1`) cannot be read: their
//! summary is empty and `compressed` is set. The gate keeps compression
//! from being negotiated by removing `sec-websocket-extensions` from the
//! upgrade request.

use crate::jsonrpc::scan::{Scanner, Summary};
use std::ops::Range;

#[cfg(test)]
mod tests;

/// Which side of the connection a reader's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Masked frames from the client.
    Client,
    /// Unmasked frames from the node.
    Server,
}

pub const OPCODE_CONTINUATION: u8 = 0;
pub const OPCODE_TEXT: u8 = 1;
pub const OPCODE_BINARY: u8 = 2;
pub const OPCODE_CLOSE: u8 = 8;

/// A whole data message, as the sink is told of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Text (1) or binary (2).
    pub opcode: u8,
    /// Its first frame's masking key (client messages).
    pub mask: Option<[u8; 4]>,
    /// Frames it came in.
    pub frames: u32,
    /// Sent compressed: unreadable.
    pub compressed: bool,
    pub summary: Summary,
    /// The payload, unmasked, if the sink kept it.
    pub payload: Option<Vec<u8>>,
    /// It was kept, and grew past the sink's limit (its payload is gone).
    pub overflowed: bool,
    /// Its payload's length.
    pub len: u64,
}

/// What a reader reports to.
pub trait Sink {
    /// A data message begins. Return the most payload bytes to keep of it,
    /// or `None` to keep none.
    fn begin(&mut self) -> Option<usize> {
        None
    }
    /// Bytes `range` of the piece are part of a frame: header or payload,
    /// of a control frame (`control`) or of the current data message.
    fn raw(&mut self, _range: Range<usize>, _control: bool) {}
    /// A control frame is whole: its bytes as they came, header included.
    fn control(&mut self, _frame: &[u8]) {}
    /// The current data message is whole.
    fn message(&mut self, message: Message);
}

/// Longest frame header: 2 bytes, 8 of extended length, 4 of mask.
const MAX_HEADER: usize = 14;

/// The message being read.
#[derive(Debug, Clone, Default)]
struct Current {
    opcode: u8,
    mask: Option<[u8; 4]>,
    frames: u32,
    compressed: bool,
    scanner: Scanner,
    kept: Option<Vec<u8>>,
    limit: usize,
    overflowed: bool,
    len: u64,
}

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
    /// The current frame is a control frame: its bytes so far.
    control: Option<Vec<u8>>,
    fin: bool,
    message: Option<Current>,
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
            control: None,
            fin: false,
            message: None,
        }
    }

    pub fn side(&self) -> Side {
        self.side
    }

    /// Whether the reader holds part of a frame or of a message: bytes
    /// read that have not yet made a whole one.
    pub fn in_progress(&self) -> bool {
        self.header_len > 0 || self.in_frame || self.message.is_some()
    }

    /// Reads `piece`, the next bytes of this direction's stream.
    pub fn feed(&mut self, piece: &[u8], sink: &mut impl Sink) {
        let mut at = 0;
        while at < piece.len() {
            if !self.in_frame {
                let start = at;
                at = self.read_header(piece, at, sink);
                if at > start {
                    sink.raw(start..at, self.control.is_some());
                }
                if let Some(frame) = &mut self.control {
                    frame.extend_from_slice(&piece[start..at]);
                }
                if !self.in_frame {
                    return;
                }
                if self.remaining == 0 {
                    self.end_frame(sink);
                }
                continue;
            }
            let take = usize::try_from(self.remaining)
                .unwrap_or(usize::MAX)
                .min(piece.len() - at);
            let range = at..at + take;
            sink.raw(range.clone(), self.control.is_some());
            self.payload(&piece[range]);
            self.remaining -= take as u64;
            at += take;
            if self.remaining == 0 {
                self.end_frame(sink);
            }
        }
    }

    /// Reads header bytes from `piece[at..]`; returns where it stopped.
    /// Once the header is whole, the frame starts.
    fn read_header(&mut self, piece: &[u8], mut at: usize, sink: &mut impl Sink) -> usize {
        while self.header_len < self.header_needed() {
            let Some(&b) = piece.get(at) else {
                return at;
            };
            if self.header_len == 0 {
                self.first_byte(b, sink);
            }
            self.header[self.header_len] = b;
            self.header_len += 1;
            at += 1;
        }
        let h = self.header;
        let (fin, rsv1) = (h[0] & 0x80 != 0, h[0] & 0x40 != 0);
        let masked = h[1] & 0x80 != 0;
        let (length, mask_at) = match h[1] & 0x7f {
            126 => (u64::from(u16::from_be_bytes([h[2], h[3]])), 4),
            127 => {
                let mut n = [0; 8];
                n.copy_from_slice(&h[2..10]);
                (u64::from_be_bytes(n), 10)
            }
            n => (u64::from(n), 2),
        };
        self.mask = masked.then(|| [h[mask_at], h[mask_at + 1], h[mask_at + 2], h[mask_at + 3]]);
        self.mask_at = 0;
        self.remaining = length;
        self.fin = fin;
        self.header_len = 0;
        self.in_frame = true;
        if let (Some(message), false) = (&mut self.message, is_control(h[0])) {
            if message.frames == 0 {
                message.mask = self.mask;
                message.compressed |= rsv1;
            }
            message.frames += 1;
        }
        at
    }

    /// A frame's first byte: a control frame's bytes are kept from here,
    /// and a data frame that starts a message (a continuation with none
    /// before it is read as one, unreadable) makes the sink decide whether
    /// to keep it before any of its bytes are reported.
    fn first_byte(&mut self, b: u8, sink: &mut impl Sink) {
        if is_control(b) {
            self.control = Some(Vec::with_capacity(MAX_HEADER + 125));
            return;
        }
        let opcode = b & 0x0f;
        if opcode != OPCODE_CONTINUATION || self.message.is_none() {
            let limit = sink.begin();
            self.message = Some(Current {
                opcode: if opcode == OPCODE_CONTINUATION {
                    OPCODE_BINARY
                } else {
                    opcode
                },
                compressed: opcode == OPCODE_CONTINUATION,
                kept: limit.map(|_| Vec::new()),
                limit: limit.unwrap_or(0),
                ..Current::default()
            });
        }
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

    fn payload(&mut self, bytes: &[u8]) {
        if let Some(frame) = &mut self.control {
            if frame.len() < MAX_HEADER + 125 {
                frame.extend_from_slice(bytes);
            }
            return;
        }
        let Some(message) = &mut self.message else {
            return;
        };
        let unmasked: std::borrow::Cow<'_, [u8]> = match self.mask {
            Some(mask) => {
                let mut owned = bytes.to_vec();
                for b in &mut owned {
                    *b ^= mask[self.mask_at];
                    self.mask_at = (self.mask_at + 1) % 4;
                }
                owned.into()
            }
            None => bytes.into(),
        };
        message.len += bytes.len() as u64;
        if !message.compressed {
            message.scanner.push(&unmasked);
        }
        if let Some(kept) = &mut message.kept {
            if kept.len() + unmasked.len() > message.limit {
                message.kept = None;
                message.overflowed = true;
            } else {
                kept.extend_from_slice(&unmasked);
            }
        }
    }

    fn end_frame(&mut self, sink: &mut impl Sink) {
        self.in_frame = false;
        if let Some(frame) = self.control.take() {
            sink.control(&frame);
            return;
        }
        if !self.fin {
            return;
        }
        let Some(current) = self.message.take() else {
            return;
        };
        sink.message(Message {
            opcode: current.opcode,
            mask: current.mask,
            frames: current.frames,
            compressed: current.compressed,
            summary: if current.compressed {
                Summary::default()
            } else {
                current.scanner.finish()
            },
            payload: current.kept,
            overflowed: current.overflowed,
            len: current.len,
        });
    }
}

fn is_control(first_header_byte: u8) -> bool {
    first_header_byte & 0x0f >= 8
}

/// `payload` as one final frame of `opcode`, masked with `mask` if given
/// (a client's frames must be; a server's must not).
pub fn encode(opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + MAX_HEADER);
    out.push(0x80 | (opcode & 0x0f));
    let masked = if mask.is_some() { 0x80 } else { 0 };
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

/// A close frame with `code` and `reason` (at most 123 bytes of it).
pub fn close_frame(code: u16, reason: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut payload = code.to_be_bytes().to_vec();
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    encode(OPCODE_CLOSE, &payload, mask)
}

/// Counts what a stream's messages hold, keeping nothing: stake QoS's
/// view of a client's socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Count {
    pub messages: u32,
    /// Calls the node will run: a batch's entries, one for any other
    /// message; a response (see `jsonrpc`) none.
    pub calls: u32,
}

impl Sink for Count {
    fn message(&mut self, message: Message) {
        self.messages += 1;
        self.calls = self.calls.saturating_add(calls(&message));
    }
}

/// Calls the node runs for `message`.
pub fn calls(message: &Message) -> u32 {
    use crate::jsonrpc::{Kind, Shape};
    let summary = &message.summary;
    match summary.shape {
        _ if !summary.valid => 1,
        Shape::Array => {
            let calls = summary
                .entries
                .iter()
                .filter(|e| e.kind() != Kind::Response)
                .count();
            u32::try_from(calls).unwrap_or(u32::MAX).max(1)
        }
        Shape::Object if summary.entries.first().map(|e| e.kind()) == Some(Kind::Response) => 0,
        _ => 1,
    }
}

impl Message {
    /// A server message that is not an answer: a subscription's
    /// notification (`{"method":"eth_subscription","params":…}`), or a
    /// call the node makes, which has a method and neither `result` nor
    /// `error`.
    pub fn is_push(&self) -> bool {
        use crate::jsonrpc::{Kind, Name, Shape};
        let summary = &self.summary;
        summary.valid
            && summary.shape == Shape::Object
            && summary.entries.first().is_some_and(|e| {
                e.kind() == Kind::Call && !e.has(Name::Result) && !e.has(Name::Error)
            })
    }
}
