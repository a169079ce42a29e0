//! A public WebSocket at the gate: every message the node will run takes
//! an in-flight slot, and every message the client sent that expects an
//! answer gets one, with the client's own ids.
//!
//! **Units.** What the gate sends the node on a socket goes in *units*: a
//! message, or a batch the gate made of several. Each unit takes one slot
//! of the socket's class (HTTP and WebSocket traffic share `maxInflight`)
//! and gives it back when the node's answer to it passes, so the node never
//! has more units at once than the gate has slots; a socket has at most
//! `maxInflightPerWebsocket` units at the node. A batch counts as one unit,
//! as an HTTP batch is one request: nodes (geth, Erigon, rpc-node) run a
//! batch's calls one after another.
//!
//! **What gets an answer.** A notification (no `id`) is run by the node
//! and never answered, so its slot could never come back: the gate gives it
//! an id of its own and drops the node's answer (`rewrite`). So does a call
//! whose id key one node reads and another does not (`"ID"`, `"\u0069d"`).
//! A client's response (`result`, no `method`) is not sent at all.
//!
//! **Holding and packing.** Envoy hands the client's bytes over in pieces
//! (whatever one read holds), and a piece goes on whole or not at all, so
//! the gate reads whole messages (a message split over pieces or frames is
//! kept until it is whole, and sent as one frame) and decides for everything
//! read so far at once. When the socket's allowance and the gate have a
//! slot for every message, each goes as itself. When they have fewer, the
//! messages go in as many units as there are slots, calls packed into
//! batches of at most `MERGE_MAX` (batches the client made take a unit of
//! their own; subscriptions go as they came, but those read together share
//! a unit, `MERGE_MAX` to a unit); the batch's answer is split back
//! into one answer per call, each with its caller's id. With no slot at
//! all, the data is held at the gateway (back-pressure on the client's
//! socket) until an answer or another request frees one; held sockets
//! retry oldest first. So a client that sends a hundred calls at once gets
//! a hundred answers, and the node never more than the gate's limit.
//!
//! **Stake QoS's word.** While stake QoS, before the gate, says a socket's
//! calls wait for their identity's share (`request::SOCKET_HOLD_PROPERTY`),
//! its data waits at the gateway as if the socket had its allowance at the
//! node; held sockets try again as slots free and at each tick, where the
//! glue reads QoS's word again. The gate tells QoS what it sent and what
//! was answered (`answered`), so that QoS counts the calls at the node.
//!
//! **Closing.** A client's close goes to the node only once the node has
//! answered every unit the socket has there (messages not sent yet are
//! dropped): a node runs a socket's calls to the end after it closes, so
//! their slots stay taken until their answers pass.
//!
//! **Limits.** A message longer than `maxWebsocketMessageBytes` (either
//! way, while the gate reads it whole), or more held data than that, or a
//! piece that needs more units than the socket may ever have (more client
//! batches at once than `maxInflightPerWebsocket`, say),
//! closes the socket with a close frame (1009 or 1008) and its reason.
//!
//! **Answers.** While no unit with gateway ids is at the node, the node's
//! messages pass untouched, and each answer gives back one slot. While one
//! is, each message is read whole and its gateway ids are turned back into
//! the client's ids (or the answer dropped, for a notification). An answer
//! that names none of the socket's calls gives back the oldest unit sent
//! as it came, or, failing that, the oldest other unit, whose calls are
//! then answered with the node's error.

mod book;
pub mod linger;
pub mod rewrite;
pub mod subscriptions;

use super::shards::SlotKind;
use super::{InflightGate, Taken, Ticket};
use crate::clock::Now;
use crate::cost::SocketAnswered;
use crate::request::Body;
use crate::shared::SharedStore;
use crate::websocket::{self as ws, FrameReader, Message, Side, Sink};
use book::{Book, ServerSink, Unit};
use linger::Linger;
use rewrite::{BatchEntry, Outgoing, Prepared};
use subscriptions::Subscriptions;

/// Calls the gate puts in one batch at most: below every node's batch
/// limit (Erigon's default is 100, geth's 1000).
pub const MERGE_MAX: usize = 100;

/// What a socket counts, handed to the gate's metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Upgrades refused (no connection place).
    pub rejected: u64,
    /// JSON-RPC messages read, both ways.
    pub messages: u64,
    /// Times a socket's data waited for a slot.
    pub waits: u64,
    /// Sockets closed by the gate (a limit above).
    pub closed: u64,
    /// Batches the gate made of calls that outnumbered the slots.
    pub merged: u64,
    /// Messages given gateway ids (notifications, unsure ids).
    pub rewritten: u64,
    /// Client responses not sent to the node.
    pub skipped: u64,
    /// Subscribe calls refused past `maxSubscriptionsPerWebsocket` or
    /// `maxSubscriptionsPerIdentity`.
    pub subscriptions_refused: u64,
    /// The change in subscriptions open on this worker since the last
    /// flush (a gauge's change).
    pub subscriptions: i64,
    /// Units of cut sockets whose slots were held for the node's work.
    pub lingered: u64,
}

/// What to do with the client's held data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flow {
    /// Let it go as it is.
    Through,
    /// Replace it with these bytes, then let them go.
    Replace(Vec<u8>),
    /// Keep holding it: the socket has as many units at the node as it may.
    ConnectionFull,
    /// Keep holding it: the gate has no slot.
    GateFull,
}

/// Something the client sent that is not at the node yet.
#[derive(Debug, Clone)]
enum Item {
    /// A control frame, as it came.
    Control(Vec<u8>),
    Message {
        out: Outgoing,
        opcode: u8,
        mask: Option<[u8; 4]>,
        /// It came as one frame and goes as it came.
        verbatim: bool,
    },
}

#[derive(Debug)]
pub struct Websocket {
    pub(super) connection: Ticket,
    kind: SlotKind,
    /// `maxWebsocketMessageBytes`.
    limit: usize,
    client: FrameReader,
    server: FrameReader,
    book: Book,
    pending: Vec<Item>,
    pending_bytes: usize,
    /// Every pending item sits in Envoy's held data as it came.
    verbatim: bool,
    /// Bytes of Envoy's held data already read.
    fed: usize,
    waited: bool,
    /// A close went to the node: nothing more of the client's is sent.
    closing: bool,
    /// A close went to the client: nothing more of the node's is sent.
    cut: bool,
    /// The node's message being read is kept whole.
    keeping: bool,
    /// A message over the limit came from the client.
    client_overflow: bool,
    /// Calls the node has answered on it so far, and the time their units
    /// took at the node (sent to answered): what stake QoS charges the
    /// socket's identity in node time.
    answered: SocketAnswered,
    /// Its identity, as stake QoS named it, and the subscriptions it has
    /// open (`subscriptions`).
    identity: Option<u64>,
    subscribed: u32,
    /// Stake QoS asks that its data wait: its identity is in debt
    /// (`request::SOCKET_HOLD_PROPERTY`).
    held_by_qos: bool,
}

impl Websocket {
    /// A socket admitted with `connection`, its messages taking `kind`
    /// slots; `nonce` makes its gateway ids its own; `identity` is its
    /// caller's, as stake QoS named it.
    pub fn new(
        connection: Ticket,
        kind: SlotKind,
        limit: usize,
        nonce: u64,
        identity: Option<u64>,
    ) -> Self {
        Self {
            connection,
            kind,
            limit,
            client: FrameReader::new(Side::Client),
            server: FrameReader::new(Side::Server),
            book: Book {
                nonce,
                ..Book::default()
            },
            pending: Vec::new(),
            pending_bytes: 0,
            verbatim: true,
            fed: 0,
            waited: false,
            closing: false,
            cut: false,
            keeping: false,
            client_overflow: false,
            answered: SocketAnswered::default(),
            identity,
            subscribed: 0,
            held_by_qos: false,
        }
    }

    /// The kind of slot its messages take.
    pub fn kind(&self) -> SlotKind {
        self.kind
    }

    /// Stake QoS asks that its data wait (`hold`), or lets it go.
    pub fn hold_for_qos(&mut self, hold: bool) {
        self.held_by_qos = hold;
    }

    /// Its identity, and the subscriptions it has open.
    pub fn subscriptions(&self) -> (Option<u64>, u32) {
        (self.identity, self.subscribed)
    }

    /// Calls sent and answered so far, and their units' time at the node.
    pub fn answered(&self) -> SocketAnswered {
        self.answered
    }

    /// Units at the node (slots held).
    pub fn at_node(&self) -> u32 {
        self.book.units.len() as u32
    }

    /// Whether data is held waiting for slots, or a close for the node's
    /// answers.
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The client's data held at the gateway grew to `size` bytes (Envoy's
    /// buffer: only the bytes past what was read are new).
    pub fn read(
        &mut self,
        body: &mut impl Body,
        size: usize,
        counts: &mut Counts,
        subs: &mut Subscriptions,
    ) {
        if size < self.fed {
            self.fed = 0;
        }
        if size == self.fed {
            return;
        }
        let new = body.read(self.fed, size - self.fed);
        self.fed = size;
        let mut sink = ClientSink {
            limit: self.limit,
            items: Vec::new(),
            overflow: false,
            skipped: 0,
        };
        self.client.feed(&new, &mut sink);
        // A skipped message's bytes are in the held data: it cannot go as
        // it is.
        self.verbatim &= sink.skipped == 0;
        counts.skipped += sink.skipped;
        counts.messages += sink.skipped;
        for item in sink.items {
            self.push(item, counts, subs);
        }
        self.client_overflow |= sink.overflow;
    }

    fn push(&mut self, item: Item, counts: &mut Counts, subs: &mut Subscriptions) {
        match item {
            Item::Control(frame) => {
                self.pending_bytes += frame.len();
                self.pending.push(Item::Control(frame));
            }
            Item::Message {
                mut out,
                opcode,
                mask,
                mut verbatim,
            } => {
                counts.messages += 1;
                let kind = subscriptions::of(&out);
                let refused = kind
                    .and_then(|kind| subs.sent(kind, &mut self.subscribed, self.identity, &out));
                if let Some(refusal) = refused {
                    counts.subscriptions_refused += 1;
                    (out, verbatim) = (refusal, false);
                }
                self.pending_bytes += size(&out);
                self.verbatim &= verbatim;
                self.pending.push(Item::Message {
                    out,
                    opcode,
                    mask,
                    verbatim,
                });
            }
        }
    }

    /// Decides for everything read and not sent: send it (taking its
    /// units' slots), or keep holding it.
    pub fn settle(
        &mut self,
        gate: &mut InflightGate,
        store: &impl SharedStore,
        now: &mut Now,
        counts: &mut Counts,
    ) -> (Flow, Option<Taken>) {
        if self.closing {
            self.pending.clear();
            return (Flow::Replace(Vec::new()), None);
        }
        if self.client_overflow || self.pending_bytes > self.limit {
            return (
                self.close(
                    1009,
                    "message larger than the gateway's maxWebsocketMessageBytes",
                    counts,
                ),
                None,
            );
        }
        let messages: Vec<&Outgoing> = self
            .pending
            .iter()
            .filter_map(|i| match i {
                Item::Message { out, .. } => Some(out),
                Item::Control(_) => None,
            })
            .collect();
        let closes = self.pending.iter().any(|i| matches!(i, Item::Control(f) if f.first().is_some_and(|b| b & 0x0f == ws::OPCODE_CLOSE)));
        if closes && !self.book.units.is_empty() {
            // A client that closes takes back what it has not sent yet,
            // and its close waits for the node's answers to what it did
            // send: a node runs a socket's calls to the end after it
            // closes, and their slots are held until then.
            self.drop_messages();
            self.note_wait(counts);
            return (Flow::ConnectionFull, None);
        }
        if messages.is_empty() || closes {
            // Controls go at once.
            self.drop_messages();
            return (self.flush_controls(), None);
        }
        if self.held_by_qos {
            self.note_wait(counts);
            return (Flow::ConnectionFull, None);
        }
        // Units of their own: the client's batches and the odd message,
        // and the piece's subscriptions, `MERGE_MAX` to a unit.
        let subscriptions = messages.iter().filter(|m| subscription(m)).count();
        let alone = messages.iter().filter(|m| !mergeable(m)).count() - subscriptions
            + subscriptions.div_ceil(MERGE_MAX);
        let together = messages.iter().filter(|m| mergeable(m)).count();
        let least = alone + together.div_ceil(MERGE_MAX);
        let limits = gate.policy().limits;
        let per_socket = limits.per_websocket as usize;
        let ever = limits
            .most(self.kind)
            .map_or(per_socket, |most| per_socket.min(most as usize));
        if least > ever {
            return (
                self.close(
                    1008,
                    "more subscriptions and batches at once than the gateway allows a socket",
                    counts,
                ),
                None,
            );
        }
        let allowance = per_socket.saturating_sub(self.book.units.len());
        if least > allowance {
            self.note_wait(counts);
            return (Flow::ConnectionFull, None);
        }
        let most = (alone + together).min(allowance);
        // A socket's messages are not priced: as heavy, they never take
        // the slots kept for cheap calls (`nodeTime.cheapSlots`).
        let taken = gate.take_slots(store, now, self.kind, least as u32, most as u32, true);
        if !taken.ok {
            self.note_wait(counts);
            return (Flow::GateFull, Some(taken));
        }
        let units = taken.count as usize;
        let flow = self.send(units - alone, now.us(), counts);
        (flow, Some(taken))
    }

    fn note_wait(&mut self, counts: &mut Counts) {
        if !self.waited {
            self.waited = true;
            counts.waits += 1;
        }
    }

    /// Sends every pending item, the mergeable calls in `groups` units.
    fn send(&mut self, groups: usize, now_us: u64, counts: &mut Counts) -> Flow {
        let pending = std::mem::take(&mut self.pending);
        let units_before = self.book.units.len();
        let together = pending
            .iter()
            .filter(|i| matches!(i, Item::Message { out, .. } if mergeable(out)))
            .count();
        let sizes = group_sizes(together, groups);
        let all_alone = sizes.iter().all(|&n| n == 1);
        let verbatim = self.verbatim && all_alone && !self.client.in_progress();
        let mut out = Vec::new();
        let mut group: Vec<(Outgoing, u8, Option<[u8; 4]>)> = Vec::new();
        let mut sizes = sizes.into_iter();
        let mut want = sizes.next().unwrap_or(0);
        let mut subscriptions = 0;
        for item in pending {
            match item {
                Item::Control(frame) => out.extend_from_slice(&frame),
                Item::Message {
                    out: message,
                    opcode,
                    mask,
                    ..
                } => {
                    if subscription(&message) {
                        if let Outgoing::Calls { original, .. } = &message {
                            out.extend(ws::encode(opcode, original, mask));
                        }
                        subscriptions += 1;
                        if subscriptions == MERGE_MAX as u32 {
                            self.subscriptions_sent(std::mem::take(&mut subscriptions), now_us);
                        }
                        continue;
                    }
                    if !mergeable(&message) {
                        let bytes = self.unit(vec![(message, opcode, mask)], now_us, counts);
                        out.extend(bytes);
                        continue;
                    }
                    group.push((message, opcode, mask));
                    if group.len() == want {
                        let bytes = self.unit(std::mem::take(&mut group), now_us, counts);
                        out.extend(bytes);
                        want = sizes.next().unwrap_or(0);
                    }
                }
            }
        }
        self.subscriptions_sent(subscriptions, now_us);
        let calls: u64 = (self.book.units.iter().skip(units_before))
            .map(|u| u64::from(u.calls))
            .sum();
        self.answered.sent += calls;
        self.sent();
        self.waited = false;
        if verbatim {
            Flow::Through
        } else {
            Flow::Replace(out)
        }
    }

    /// `n` subscriptions went as they came at `now_us`, as one unit.
    fn subscriptions_sent(&mut self, n: u32, now_us: u64) {
        if n > 0 {
            self.book.units.push_back(Unit {
                due: n,
                sent_us: now_us,
                calls: n,
                ..Unit::default()
            });
        }
    }

    /// One unit: one message as itself, or several as a batch. Returns its
    /// frame.
    fn unit(
        &mut self,
        messages: Vec<(Outgoing, u8, Option<[u8; 4]>)>,
        now_us: u64,
        counts: &mut Counts,
    ) -> Vec<u8> {
        let Some(&(_, opcode, mask)) = messages.first() else {
            return Vec::new();
        };
        let mut unit = Unit {
            due: 1,
            sent_us: now_us,
            calls: messages.iter().map(|(out, ..)| calls(out)).sum(),
            ..Unit::default()
        };
        if messages.len() > 1 {
            counts.merged += 1;
        }
        let payload = match messages.as_slice() {
            [(Outgoing::Plain(payload), ..)] => payload.clone(),
            [(
                Outgoing::Calls {
                    original,
                    alone: true,
                    ..
                },
                ..,
            )] => original.clone(),
            [(
                Outgoing::Calls {
                    batch: false,
                    calls,
                    ..
                },
                ..,
            )] if calls.len() == 1 => {
                counts.rewritten += 1;
                unit.members.push(false);
                self.book.mint(&calls[0], 0, &mut unit)
            }
            [(Outgoing::Batch(entries), ..)] => {
                counts.rewritten += 1;
                unit.members.push(true);
                let entries: Vec<Vec<u8>> = entries
                    .iter()
                    .map(|e| match e {
                        BatchEntry::Plain(text) => text.clone(),
                        BatchEntry::Call(call) => self.book.mint(call, 0, &mut unit),
                    })
                    .collect();
                [b"[".as_slice(), &entries.join(&b","[..]), b"]"].concat()
            }
            _ => {
                // Calls, as one batch: each message a member of the unit.
                let mut calls = Vec::new();
                for (out, ..) in &messages {
                    if let Outgoing::Calls {
                        batch, calls: own, ..
                    } = out
                    {
                        let member = unit.members.len();
                        unit.members.push(*batch);
                        for call in own {
                            calls.push(self.book.mint(call, member, &mut unit));
                        }
                    }
                }
                [b"[".as_slice(), &calls.join(&b","[..]), b"]"].concat()
            }
        };
        self.book.units.push_back(unit);
        ws::encode(opcode, &payload, mask)
    }

    /// Forgets the messages pending (a client that closes takes them
    /// back): what Envoy holds is no longer what goes.
    fn drop_messages(&mut self) {
        let before = self.pending.len();
        self.pending.retain(|i| matches!(i, Item::Control(_)));
        self.verbatim &= self.pending.len() == before;
    }

    /// The control frames pending, and no message.
    fn flush_controls(&mut self) -> Flow {
        let verbatim = self.verbatim && !self.client.in_progress();
        let mut out = Vec::new();
        for item in std::mem::take(&mut self.pending) {
            if let Item::Control(frame) = item {
                out.extend_from_slice(&frame);
            }
        }
        self.sent();
        if verbatim {
            Flow::Through
        } else {
            Flow::Replace(out)
        }
    }

    /// The held data went on: what comes next is new. Bytes of a frame not
    /// yet whole were left out, so the next data is not what will be sent.
    fn sent(&mut self) {
        self.pending_bytes = 0;
        self.verbatim = !self.client.in_progress();
        self.fed = 0;
    }

    /// Sends the node a close (`code`, `reason`) instead of what was held;
    /// the node's close goes back to the client.
    fn close(&mut self, code: u16, reason: &str, counts: &mut Counts) -> Flow {
        counts.closed += 1;
        self.closing = true;
        self.pending.clear();
        self.pending_bytes = 0;
        Flow::Replace(ws::close_frame(
            code,
            reason,
            Some([0x5a, 0x17, 0xc3, 0x9e]),
        ))
    }

    /// The socket is over: its units still at the node, each its slot's
    /// to hold (`linger`) or give back now. Returns how many go back now.
    pub fn cut(&self, linger: &mut Linger, now_ms: u64) -> u32 {
        let units = self.book.units.iter();
        units
            .filter(|u| !linger.hold(self.kind, now_ms, u.sent_us / 1000, u.calls))
            .count() as u32
    }

    /// A piece of the node's data, at `now_us` (the time its answers took
    /// goes to `linger`, and to `answered`). Returns the slots its answers
    /// gave back, and what to send the client instead of the piece, if
    /// anything changed.
    pub fn answer(
        &mut self,
        piece: &[u8],
        now_us: u64,
        linger: &mut Linger,
        counts: &mut Counts,
    ) -> (u32, Option<Vec<u8>>) {
        if self.cut {
            return (0, Some(Vec::new()));
        }
        let mut sink = ServerSink {
            book: &mut self.book,
            keeping: &mut self.keeping,
            limit: self.limit,
            piece,
            out: Vec::new(),
            changed: false,
            released: 0,
            messages: 0,
            overflow: false,
            now_us,
            linger,
            answered: &mut self.answered,
        };
        self.server.feed(piece, &mut sink);
        let ServerSink {
            out,
            changed,
            released,
            messages,
            overflow,
            ..
        } = sink;
        counts.messages += messages;
        if overflow {
            counts.closed += 1;
            self.cut = true;
            let mut out = out;
            out.extend(ws::close_frame(
                1009,
                "answer too large for the gateway to read",
                None,
            ));
            return (released, Some(out));
        }
        (released, changed.then_some(out))
    }
}

/// Calls an outgoing message holds (what is not a call counts as one).
fn calls(out: &Outgoing) -> u32 {
    let n = match out {
        Outgoing::Plain(_) => 1,
        Outgoing::Calls { calls, .. } => calls.len(),
        Outgoing::Batch(entries) => entries.len(),
    };
    n.max(1) as u32
}

/// Bytes an outgoing message holds.
fn size(out: &Outgoing) -> usize {
    match out {
        Outgoing::Plain(p) => p.len(),
        Outgoing::Calls {
            original, calls, ..
        } => original.len() + calls.iter().map(|c| c.bare.len()).sum::<usize>(),
        Outgoing::Batch(entries) => entries
            .iter()
            .map(|e| match e {
                BatchEntry::Plain(t) => t.len(),
                BatchEntry::Call(call) => call.bare.len(),
            })
            .sum(),
    }
}

/// A subscription (or unsubscription) that goes as it came: the piece's
/// subscriptions go as one unit per `MERGE_MAX`, as calls packed in a batch
/// do, so that a client may open more at once than its socket may have
/// units (a wallet starting up, `Promise.all` of fifty `accountSubscribe`).
/// A node registers them in microseconds each.
fn subscription(out: &Outgoing) -> bool {
    matches!(
        out,
        Outgoing::Calls {
            mergeable: false,
            alone: true,
            batch: false,
            ..
        }
    )
}

fn mergeable(out: &Outgoing) -> bool {
    matches!(
        out,
        Outgoing::Calls {
            mergeable: true,
            ..
        }
    )
}

/// `n` calls over `groups` batches, as even as they go, in order.
fn group_sizes(n: usize, groups: usize) -> Vec<usize> {
    if n == 0 || groups == 0 {
        return Vec::new();
    }
    let groups = groups.min(n);
    (0..groups)
        .map(|g| n / groups + usize::from(g < n % groups))
        .collect()
}

/// Reads the client's bytes into pending items.
struct ClientSink {
    limit: usize,
    items: Vec<Item>,
    overflow: bool,
    /// Responses not sent.
    skipped: u64,
}

impl Sink for ClientSink {
    fn begin(&mut self) -> Option<usize> {
        Some(self.limit)
    }

    fn control(&mut self, frame: &[u8]) {
        self.items.push(Item::Control(frame.to_vec()));
    }

    fn message(&mut self, message: Message) {
        if message.overflowed {
            self.overflow = true;
            return;
        }
        let Some(payload) = message.payload else {
            return;
        };
        let single = message.frames == 1;
        let prepared = if message.compressed {
            Prepared::Send(Outgoing::Plain(payload))
        } else {
            rewrite::prepare(payload, &message.summary)
        };
        let Prepared::Send(out) = prepared else {
            // A response: not sent, and not waited for.
            self.skipped += 1;
            return;
        };
        let verbatim = single
            && match &out {
                Outgoing::Plain(_) => true,
                Outgoing::Calls { alone, .. } => *alone,
                Outgoing::Batch(_) => false,
            };
        self.items.push(Item::Message {
            out,
            opcode: message.opcode,
            mask: message.mask,
            verbatim,
        });
    }
}

#[cfg(test)]
mod tests;
