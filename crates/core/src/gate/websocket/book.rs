//! The units a public WebSocket has at the node and the ids they carry,
//! and the node's side: its answers read, their gateway ids put back, and
//! the slots they give back counted (`mod.rs` has the rules).

use super::linger::Linger;
use super::rewrite::{self, Call, Restore};
use super::subscriptions;
use crate::cost::SocketAnswered;
use crate::jsonrpc::{Name, Shape};
use crate::websocket::{self as ws, Message, Sink};
use std::collections::VecDeque;
use std::ops::Range;

/// One unit at the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Unit {
    /// Answers still due before it gives its slot back: one, but for the
    /// subscriptions of one piece, which go together (`subscription` in
    /// mod.rs).
    pub(super) due: u32,
    /// Its gateway ids: each one's number, what it stands for, and which
    /// of the unit's messages it belongs to (none: sent as it came).
    pub(super) ids: Vec<(u64, Restore, usize)>,
    /// The client's messages in it: whether each was a batch.
    pub(super) members: Vec<bool>,
    /// When it was sent (µs), and the calls in it.
    pub(super) sent_us: u64,
    pub(super) calls: u32,
}

/// The units at the node and the ids they carry.
#[derive(Debug, Clone, Default)]
pub(super) struct Book {
    pub(super) nonce: u64,
    pub(super) next_seq: u64,
    pub(super) units: VecDeque<Unit>,
}

impl Book {
    /// `call` with a new gateway id, noted in `unit` for its `member`.
    pub(super) fn mint(&mut self, call: &Call, member: usize, unit: &mut Unit) -> Vec<u8> {
        let seq = self.next_seq;
        self.next_seq += 1;
        unit.ids.push((seq, call.restore.clone(), member));
        rewrite::with_id(&call.bare, &rewrite::gateway_id(self.nonce, seq))
    }

    /// Takes the unit that carries `seq` off the node.
    pub(super) fn take(&mut self, seq: u64) -> Option<Unit> {
        let at = self
            .units
            .iter()
            .position(|u| u.ids.iter().any(|(s, ..)| *s == seq))?;
        self.units.remove(at)
    }

    /// An answer that names no call of this socket: it answers the oldest
    /// unit sent as it came, else the oldest, taken off the node if that
    /// was its last answer due (`None` while more are).
    pub(super) fn take_unnamed(&mut self) -> Option<Unit> {
        let at = self
            .units
            .iter()
            .position(|u| u.ids.is_empty())
            .unwrap_or(0);
        self.answered(at)
    }

    /// One answer to the unit at `at`: the unit, if it was its last.
    pub(super) fn answered(&mut self, at: usize) -> Option<Unit> {
        let unit = self.units.get_mut(at)?;
        if unit.due > 1 {
            unit.due -= 1;
            return None;
        }
        self.units.remove(at)
    }

    pub(super) fn tracking(&self) -> bool {
        self.units.iter().any(|u| !u.ids.is_empty())
    }
}

/// Reads the node's bytes: passes them, or rewrites its answers.
pub(super) struct ServerSink<'a> {
    pub(super) book: &'a mut Book,
    pub(super) keeping: &'a mut bool,
    pub(super) limit: usize,
    pub(super) piece: &'a [u8],
    /// What the client gets instead of the piece.
    pub(super) out: Vec<u8>,
    pub(super) changed: bool,
    pub(super) released: u32,
    pub(super) messages: u64,
    pub(super) overflow: bool,
    /// Now (µs), and where the time each answered unit took goes: the
    /// cut-socket estimate, and the socket's calls and time answered.
    pub(super) now_us: u64,
    pub(super) linger: &'a mut Linger,
    pub(super) answered: &'a mut SocketAnswered,
}

impl ServerSink<'_> {
    /// `unit` was answered: its slot goes back.
    fn released(&mut self, unit: &Unit) {
        self.released += 1;
        let took_us = self.now_us.saturating_sub(unit.sent_us);
        self.linger.answered(took_us / 1000, unit.calls);
        self.answered.calls += u64::from(unit.calls);
        self.answered.node_us += took_us;
    }
}

impl Sink for ServerSink<'_> {
    fn begin(&mut self) -> Option<usize> {
        *self.keeping = self.book.tracking();
        self.keeping.then_some(self.limit)
    }

    fn raw(&mut self, range: Range<usize>, control: bool) {
        if control || !*self.keeping {
            self.out.extend_from_slice(&self.piece[range]);
        } else {
            self.changed = true;
        }
    }

    fn message(&mut self, message: Message) {
        self.messages += 1;
        let kept = std::mem::take(self.keeping);
        if message.overflowed {
            self.overflow = true;
            return;
        }
        if message.is_push() {
            self.answered.pushes += 1;
            if let (true, Some(payload)) = (kept, &message.payload) {
                self.out.extend(ws::encode(message.opcode, payload, None));
            }
            return;
        }
        let Some(payload) = message.payload.as_deref().filter(|_| kept) else {
            // Passed as it came: an answer to a unit sent as it came.
            if let Some(at) = self.book.units.iter().position(|u| u.ids.is_empty()) {
                if let Some(unit) = self.book.answered(at) {
                    self.released(&unit);
                }
            }
            return;
        };
        for answer in self.answers(payload, &message) {
            self.out.extend(ws::encode(message.opcode, &answer, None));
        }
    }
}

impl ServerSink<'_> {
    /// What the client gets for one of the node's answers (kept whole).
    fn answers(&mut self, payload: &[u8], message: &Message) -> Vec<Vec<u8>> {
        let summary = &message.summary;
        let found = rewrite::gateway_ids(self.book.nonce, payload, summary);
        let unit = match found.first() {
            Some(&(_, _, seq)) => self.book.take(seq),
            None => self.book.take_unnamed(),
        };
        let Some(unit) = unit else {
            // Names a call of no unit at the node: passed as it came.
            return vec![payload.to_vec()];
        };
        self.released(&unit);
        if unit.ids.is_empty() {
            return vec![payload.to_vec()];
        }
        regroup(payload, summary, &found, &unit)
    }
}

/// The answers the client gets from the node's answer (`payload`) to a
/// unit with gateway ids: each of the unit's messages gets its calls'
/// answers, with its own ids (a batch as an array, in the node's order);
/// a notification's is dropped; a call the answer does not name gets the
/// node's error (or an internal error). Entries that name no call of the
/// unit go to its only message, or each on its own.
fn regroup(
    payload: &[u8],
    summary: &crate::jsonrpc::Summary,
    found: &[(usize, Range<usize>, u64)],
    unit: &Unit,
) -> Vec<Vec<u8>> {
    let node_error = summary
        .entries
        .first()
        .and_then(|e| e.last(Name::Error))
        .map(|m| &payload[m.value.clone()]);
    let mut groups: Vec<Vec<Vec<u8>>> = vec![Vec::new(); unit.members.len()];
    let mut loose = Vec::new();
    let mut answered = Vec::new();
    for (i, entry) in summary.entries.iter().enumerate() {
        let text = &payload[entry.span.clone()];
        let named = found
            .iter()
            .find(|(at, ..)| *at == i)
            .and_then(|(_, range, seq)| {
                let (_, restore, member) = unit.ids.iter().find(|(s, ..)| s == seq)?;
                Some((range, *seq, restore, *member))
            });
        match named {
            Some((range, seq, restore, member)) => {
                answered.push(seq);
                match restore {
                    Restore::Id(id) => {
                        let local = range.start - entry.span.start..range.end - entry.span.start;
                        groups[member].push(rewrite::replace(text, local, id));
                    }
                    Restore::Refuse(id, limit) => {
                        groups[member].push(subscriptions::refused_answer(id, *limit));
                    }
                    Restore::Drop => {}
                }
            }
            None if summary.shape == Shape::Array && unit.members.len() == 1 => {
                groups[0].push(text.to_vec());
            }
            None if summary.shape == Shape::Array => loose.push(text.to_vec()),
            // An object that names no call stands for all of the unit's.
            None => {}
        }
    }
    for (seq, restore, member) in &unit.ids {
        match (answered.contains(seq), restore) {
            (false, Restore::Id(id)) => {
                groups[*member].push(rewrite::error_answer(id, node_error));
            }
            (false, Restore::Refuse(id, limit)) => {
                groups[*member].push(subscriptions::refused_answer(id, *limit));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (texts, &batch) in groups.into_iter().zip(&unit.members) {
        if !batch {
            out.extend(texts);
        } else if !texts.is_empty() {
            out.push([b"[".as_slice(), &texts.join(&b","[..]), b"]"].concat());
        }
    }
    out.extend(loose);
    out
}
