//! One request's way through the admission gate, as plain state: the filter
//! glue reports what Envoy did (headers, body, response, end) and gets back
//! what to do. The glue makes the host calls; every decision is here.
//!
//! **When a slot is held.** A request takes its slot when its headers reach
//! the gate and gives it back when the node's response has ended (not when
//! the client has finished reading it: a slow reader does not hold the
//! node). The shipped Envoy configs put `envoy.filters.http.buffer` before
//! the gate on RPC routes, so a request's headers reach the gate only once
//! its whole body has arrived: a client that uploads slowly, or sends
//! headers and never a body, holds nothing here, and Envoy's
//! `request_timeout` ends it. Without that filter a body reaches the gate in
//! pieces; the gate counts such requests (`bodies_streamed`) and says once
//! in Envoy's log how to fix the config.
//!
//! **Upgraded streams** (WebSocket, CONNECT) are never held for a body and
//! never deduplicated. A WebSocket takes a connection place
//! (`maxWebsocketConnections`) for its life, and each of its JSON-RPC
//! messages that expects an answer takes an in-flight slot like an HTTP
//! request, given back when the answer passes: HTTP and WebSocket traffic
//! together never put more than `maxInflight` requests at the node. A
//! connection has at most `maxInflightPerWebsocket` messages at the node.
//! A message that finds no slot is not refused (a WebSocket has no status
//! to refuse it with): the client's stream is held at the gateway until a
//! slot frees, which is back-pressure on the client's socket. Envoy hands
//! data over in pieces that may hold several messages, and a piece goes
//! through whole or not at all, so its messages take their slots together
//! (see `Websocket::settle`); the per-connection cap is checked before a
//! piece starts, so a socket can pass it by the messages of one piece. A
//! piece with more messages than the gate has slots closes the socket.
//! Internal WebSockets are never held.

use crate::clock::Now;
use crate::dedup::answer::Answer;
use crate::dedup::engage::Engagement;
use crate::dedup::{client_name, finality, Dedup, Outcome, Pending, Verdict};
use crate::gate::class::{classify, RequestClass};
use crate::gate::coalesce::{no_answer, Act, Callout, Led, Reply, Target, Waiting};
use crate::gate::shards::Totals;
use crate::gate::websocket::{self, Flow, Websocket};
use crate::gate::{slot_of, Admission, Decision, Heartbeat, InflightGate, Taken, Ticket};
use crate::rejection::{Rejection, INVALID_REQUEST};
use crate::request::{Body, RequestFacts};
use crate::shared::{SharedStore, StoreCounts, StoreError};
use std::collections::HashMap;

/// What the glue knows about a request when its headers arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub end_of_stream: bool,
    pub upgrade: Upgrade,
    pub content_length: Option<u64>,
    /// With dedup, where a leader's callout goes.
    pub target: Option<Target>,
}

impl Head {
    /// Reads what the gate needs from the request headers, and no more:
    /// each read is a host call every request pays for. `upgrade` (absent
    /// on a plain request, which is cheap) always; `:method` only for an
    /// upgrade, or, with dedup on, for a body of unknown length (a CONNECT
    /// tunnel must not be held as a body); `content-length` only with
    /// dedup, which skips a body too large to check before holding it, and
    /// with it `:path` and `:authority`, where a leader's callout goes.
    pub fn read(
        end_of_stream: bool,
        dedup: bool,
        mut header: impl FnMut(&str) -> Option<String>,
    ) -> Head {
        let upgrade = header("upgrade");
        let content_length = if dedup && upgrade.is_none() && !end_of_stream {
            header("content-length").and_then(|v| v.trim().parse().ok())
        } else {
            None
        };
        let method = if upgrade.is_some() || (dedup && !end_of_stream && content_length.is_none()) {
            header(":method")
        } else {
            None
        };
        let tunnel = method.as_deref() == Some("CONNECT");
        let target = (dedup && upgrade.is_none() && !end_of_stream && !tunnel).then(|| Target {
            path: header(":path").unwrap_or_else(|| "/".into()),
            authority: header(":authority").unwrap_or_default(),
        });
        let upgrade = match (upgrade, method.as_deref()) {
            (_, Some("CONNECT")) => Upgrade::Tunnel,
            (Some(_), m) if m != Some("GET") => Upgrade::NotGet,
            (Some(u), _) if u.eq_ignore_ascii_case("websocket") => Upgrade::Websocket,
            (Some(_), _) => Upgrade::Tunnel,
            (None, _) => Upgrade::None,
        };
        Head {
            end_of_stream,
            upgrade,
            content_length,
            target,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    None,
    /// `upgrade: websocket`.
    Websocket,
    /// CONNECT, or an upgrade to anything else: a tunnel the gate cannot read.
    Tunnel,
    /// An upgrade asked by a method other than GET (RFC 6455 4.1): Envoy
    /// would treat it as a tunnel whose body never ends. Refused with 400.
    NotGet,
}

/// What to do with request headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnHeaders {
    Continue,
    /// Continue without `sec-websocket-extensions`, so that no compression
    /// is negotiated and the gate can read the messages.
    ContinueWebsocket,
    Refuse(Rejection),
}

/// What to do with a piece of request body (or WebSocket data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnBody {
    Continue,
    /// Hold it (and what follows) at the gateway.
    Hold,
    /// Replace the data held with these bytes, then continue.
    ContinueWith(Vec<u8>),
    Refuse(Rejection),
    /// Hold it, and send its callout: it leads its key (`coalesce`).
    Lead(Callout),
    /// Answer it with another request's answer.
    Answer(Reply),
}

/// Retry-storm protection's counts (all zero while it is off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DedupCounts {
    /// Requests that led their key: sent to the node by callout.
    pub led: u64,
    /// Requests held for an identical request's answer.
    pub coalesced: u64,
    /// Held requests answered with another request's answer.
    pub shared: u64,
    /// Answers nobody stayed for, kept for a retry.
    pub kept: u64,
    /// Requests answered with a kept answer.
    pub taken: u64,
    /// Held requests that came to lead after their leader failed or
    /// vanished.
    pub handed_over: u64,
    /// Wake messages saying a leader failed, to a VM holding its waiters.
    pub woken_by_failure: u64,
    /// Held requests answered 504 at `maxWaitMs`.
    pub wait_timeouts: u64,
    /// Held requests whose client went first.
    pub left: u64,
    /// Refused with 429: too many held for one answer.
    pub refused: u64,
    /// Answers only their own client could be given (encoded, or ids that
    /// name no single call): the others went to the node.
    pub unshared: u64,
    /// Callouts the host refused or that got no answer.
    pub callouts_failed: u64,
    /// Passed unchecked: not JSON-RPC, a method not deduplicated, trailers.
    pub skipped: u64,
    /// Passed unchecked: body over `maxBodyBytes`.
    pub too_large: u64,
    /// Passed unrecorded: the key's page was full.
    pub table_full: u64,
    pub purged: u64,
    /// Passed unchecked: coalescing stood by, the node being quick
    /// (`dedup::engage`).
    pub standing_by: u64,
}

/// What a gate VM reports as metrics, counted as things happen and handed
/// to Envoy by the glue once per heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// By `RequestClass::index`.
    pub admitted: [u64; 3],
    pub rejected: [u64; 3],
    /// Change of internal requests in flight (they hold no shared slot).
    pub internal_inflight: i64,
    /// Public WebSockets (`gate::websocket`).
    pub websocket: websocket::Counts,
    /// Requests whose body reached the gate in pieces (no buffer filter in
    /// front of it).
    pub bodies_streamed: u64,
    pub store: StoreCounts,
    pub expired_slots: u64,
    pub dedup: DedupCounts,
}

/// What a heartbeat found, for the gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ticked {
    /// The shared slot counts (`None`: the store failed).
    pub totals: Option<Totals>,
    /// The dedup table's size.
    pub dedup_entries: Option<u64>,
    /// The node's finalized block, as dedup knows it (fresh).
    pub finalized: Option<u64>,
}

/// One VM's gate: what its streams share.
#[derive(Debug)]
pub struct GateWorker {
    pub gate: InflightGate,
    /// Retry-storm protection, when the policy has it.
    pub dedup: Option<Dedup>,
    /// Whether it is engaged (with `dedup`).
    engagement: Option<Engagement>,
    /// Leaders' callouts at the node, by token.
    pub(super) callouts: HashMap<u32, Led>,
    pub counts: Counts,
    /// Lines for Envoy's log, taken by the glue after each call.
    log: Vec<String>,
    told_about_streamed_bodies: bool,
    /// The finality poll's callout at the node (`dedup::finality`).
    finality_poll: Option<u32>,
    /// An answer tied to a block found the finalized number out of date.
    wants_finality: bool,
    /// Where requests go (their `:path` and `:authority`), for the poll.
    target: Option<Target>,
}

impl GateWorker {
    pub fn new(gate: InflightGate) -> Self {
        let policy = gate.policy();
        let dedup = policy
            .dedup
            .clone()
            .map(|d| Dedup::new(d, policy.heartbeat_ms));
        let engagement = policy
            .dedup
            .as_ref()
            .map(|d| Engagement::new(d.engage_after_ms, d.standby_after_ms));
        Self {
            gate,
            dedup,
            engagement,
            callouts: HashMap::new(),
            counts: Counts::default(),
            log: Vec::new(),
            told_about_streamed_bodies: false,
            finality_poll: None,
            wants_finality: false,
            target: None,
        }
    }

    /// The node's finalized block, for an answer tied to a block; one out
    /// of date is asked for again at the next tick (`finality_poll`).
    pub(super) fn finalized(&mut self, store: &impl SharedStore, now_ms: u64) -> Option<u64> {
        match finality::finalized(store, now_ms) {
            Ok(known) => {
                self.wants_finality |= known.due;
                known.number
            }
            Err(e) => {
                self.note_store_error("finality read", &e);
                None
            }
        }
    }

    /// At an engagement tick, when an answer tied to a block asked for it
    /// and no VM asked in the last `finality::POLL_MS`: the callout that
    /// asks the node for its finalized block.
    pub fn finality_poll(&mut self, store: &impl SharedStore, now_ms: u64) -> Option<Callout> {
        let upstream = self.dedup.as_ref()?.policy().upstream.clone();
        if !std::mem::take(&mut self.wants_finality) || self.finality_poll.is_some() {
            return None;
        }
        match finality::claim(store, now_ms) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                self.note_store_error("finality poll", &e);
                return None;
            }
        }
        let target = self.target.clone().unwrap_or_default();
        Some(Callout {
            cluster: upstream.cluster,
            headers: callout_headers(&target),
            body: finality::REQUEST.to_vec(),
            timeout_ms: upstream.timeout_ms.min(finality::STALE_MS),
        })
    }

    /// The finality poll went out as `token` (`None`: the host refused).
    pub fn finality_sent(&mut self, token: Option<u32>) {
        self.finality_poll = token;
    }

    /// Callout `token` ended with `body` (`None`: no answer). Returns
    /// whether it was the finality poll.
    pub fn finality_answered(
        &mut self,
        store: &impl SharedStore,
        now_ms: u64,
        token: u32,
        body: Option<&[u8]>,
    ) -> bool {
        if self.finality_poll != Some(token) {
            return false;
        }
        self.finality_poll = None;
        if let Err(e) = finality::answered(store, now_ms, body) {
            self.note_store_error("finality answer", &e);
        }
        true
    }

    /// Whether requests are checked for duplicates now (dedup is on and
    /// engaged).
    pub fn dedup_engaged(&self) -> bool {
        self.engagement.as_ref().is_some_and(Engagement::engaged)
    }

    /// Every `engage::TICK_MS`: whether dedup engages or stands by.
    pub fn engage(&mut self, store: &impl SharedStore, now_ms: u64) {
        if let Some(engagement) = &mut self.engagement {
            if let Err(e) = engagement.tick(store, now_ms) {
                self.note_store_error("dedup engagement", &e);
            }
        }
    }

    /// What to write to Envoy's log (warnings), once each.
    pub fn take_log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.log)
    }

    /// A line for Envoy's log.
    pub(super) fn note(&mut self, line: &str) {
        self.log.push(line.to_string());
    }

    pub(super) fn note_store_error(&mut self, what: &str, e: &StoreError) {
        let line = self.counts.store.failed(what, e);
        self.log.push(line);
    }

    fn taken(&mut self, taken: &Taken) {
        self.counts.store.retried(taken.cas_retries);
        if let Some(e) = &taken.store_error {
            self.note_store_error("admission failed closed", e);
        }
    }

    pub(super) fn admit(
        &mut self,
        store: &impl SharedStore,
        now: &mut Now,
        class: RequestClass,
        upgrade: bool,
    ) -> Result<Ticket, Rejection> {
        let Admission {
            decision,
            cas_retries,
            store_error,
            ..
        } = self.gate.admit(store, now, class, upgrade);
        self.counts.store.retried(cas_retries);
        if let Some(e) = store_error {
            self.note_store_error("admission failed closed", &e);
        }
        match decision {
            Decision::Admit(mut ticket) => {
                if !upgrade && class != RequestClass::Internal {
                    ticket.at_node = self.engagement.as_mut().map(Engagement::started);
                }
                self.counts.admitted[class.index()] += 1;
                if ticket.slot.is_none() {
                    self.counts.internal_inflight += 1;
                }
                Ok(ticket)
            }
            Decision::Reject(rejection) => {
                self.counts.rejected[class.index()] += 1;
                self.counts.websocket.rejected += u64::from(upgrade);
                Err(rejection)
            }
        }
    }

    pub(super) fn release(&mut self, mut ticket: Ticket) {
        if let (Some(at), Some(engagement)) = (ticket.at_node.take(), &mut self.engagement) {
            engagement.ended(at);
        }
        if ticket.slot.is_none() {
            self.counts.internal_inflight -= 1;
        }
        self.gate.release(ticket);
    }

    /// The heartbeat (every `heartbeatMs`): sweeps the dedup table, gives
    /// spare slots back, expires vanished workers' shards. Returns the slot
    /// totals for the gauges, and the dedup table's size.
    pub fn tick(&mut self, store: &impl SharedStore, now_ms: u64) -> Ticked {
        let mut entries = None;
        if let (Some(dedup), Some(vm)) = (self.dedup.as_ref(), self.gate.vm()) {
            match dedup.sweep(store, vm, now_ms) {
                Ok(sweep) => {
                    self.counts.dedup.purged += sweep.purged;
                    self.counts.store.retried(sweep.cas_retries);
                    entries = Some(sweep.entries);
                }
                Err(e) => self.note_store_error("dedup sweep", &e),
            }
        }
        let totals = match self.gate.heartbeat(store, now_ms) {
            Ok(Heartbeat {
                totals,
                expired_slots,
                cas_retries,
            }) => {
                self.counts.store.retried(cas_retries);
                self.counts.expired_slots += expired_slots;
                if expired_slots > 0 {
                    self.log.push(format!(
                        "reclaimed {expired_slots} slots held by a worker that stopped heartbeating"
                    ));
                }
                Some(totals)
            }
            Err(e) => {
                self.note_store_error("heartbeat", &e);
                None
            }
        };
        let finalized = match self.dedup {
            Some(_) => finality::finalized(store, now_ms)
                .ok()
                .and_then(|k| k.number),
            None => None,
        };
        Ticked {
            totals,
            dedup_entries: entries,
            finalized,
        }
    }

    /// Takes this worker's shard before traffic arrives; if the store is
    /// unavailable, the first request joins instead.
    pub fn join(&mut self, store: &impl SharedStore, now_ms: u64) {
        if let Err(e) = self.gate.join(store, now_ms) {
            self.note_store_error("joining the shared slot table", &e);
        }
    }

    /// The plugin is being deleted: spare slots go back at once.
    pub fn leave(&mut self, store: &impl SharedStore, now_ms: u64) {
        match self.gate.leave(store, now_ms) {
            Ok(0) => {}
            Ok(held) => self.log.push(format!(
                "leaving with {held} slots still held; they expire with the stale-slot TTL"
            )),
            Err(e) => self.note_store_error("leaving the slot table", &e),
        }
    }
}

/// One stream at the gate.
#[derive(Debug, Default)]
pub struct GateStream {
    state: State,
}

// The HTTP request is the hot path: kept inline (no allocation per
// request); the rarer WebSocket is boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Default)]
enum State {
    /// Before the headers, after a refusal, or after the end.
    #[default]
    Idle,
    Http(HttpRequest),
    Websocket(Box<Websocket>),
    /// CONNECT, another upgrade, or an internal WebSocket: its connection
    /// place (or nothing, for internal traffic) until it ends.
    Tunnel(Ticket),
}

#[derive(Debug)]
struct HttpRequest {
    /// `None` while the admission waits for the whole body.
    ticket: Option<Ticket>,
    class: RequestClass,
    /// The headers did not end the request: a body follows.
    body_follows: bool,
    body_pieces: u32,
    /// Dedup reads the body: the sender's name for `client` scope, read
    /// with the headers (Envoy serves no headers in the body phase).
    dedup_client: Option<String>,
    target: Option<Target>,
    /// Held for an answer (`coalesce`).
    waiting: Option<Waiting>,
}

/// What `GateStream::settle` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Nothing waits: let the held data go, replaced by these bytes if
    /// given.
    Through(Option<Vec<u8>>),
    /// Still waiting for its own messages' answers.
    ConnectionFull,
    /// Still waiting: the gate has no slot.
    GateFull,
}

impl Settled {
    fn of(flow: Flow) -> Self {
        match flow {
            Flow::Through => Settled::Through(None),
            Flow::Replace(bytes) => Settled::Through(Some(bytes)),
            Flow::ConnectionFull => Settled::ConnectionFull,
            Flow::GateFull => Settled::GateFull,
        }
    }
}

/// What a piece of the response asks of the glue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OnResponse {
    /// Slots were given back: held streams may retry.
    pub released: bool,
    /// Send the client these bytes instead of the piece.
    pub replace: Option<Vec<u8>>,
}

impl GateStream {
    /// The request headers: classify, then admit or refuse.
    pub fn headers(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        facts: &mut impl RequestFacts,
        head: Head,
    ) -> OnHeaders {
        if head.upgrade == Upgrade::NotGet {
            return OnHeaders::Refuse(Rejection::new(
                Rejection::BAD_REQUEST,
                0,
                INVALID_REQUEST,
                "a WebSocket upgrade must be a GET request",
            ));
        }
        let policy = w.gate.policy();
        let class = classify(&policy.internal, &policy.priority, facts);
        if head.upgrade != Upgrade::None {
            let ticket = match w.admit(store, now, class, true) {
                Ok(ticket) => ticket,
                Err(refusal) => return OnHeaders::Refuse(refusal),
            };
            if head.upgrade == Upgrade::Websocket && class != RequestClass::Internal {
                let limit = w.gate.policy().max_websocket_message_bytes;
                let nonce = w.gate.nonce();
                self.state = State::Websocket(Box::new(Websocket::new(
                    ticket,
                    slot_of(class),
                    limit,
                    nonce,
                )));
                return OnHeaders::ContinueWebsocket;
            }
            self.state = State::Tunnel(ticket);
            return OnHeaders::Continue;
        }
        // With `decideOnBody`, a public request with a body is admitted
        // when its body is whole, so that a refusal can answer each of its
        // calls (internal requests are never refused: nothing to wait for).
        let waits = policy.decide_on_body && !head.end_of_stream && class != RequestClass::Internal;
        let ticket = if waits {
            None
        } else {
            match w.admit(store, now, class, false) {
                Ok(ticket) => Some(ticket),
                Err(refusal) => return OnHeaders::Refuse(refusal),
            }
        };
        let checked = !head.end_of_stream && class != RequestClass::Internal;
        if checked && w.dedup.is_some() && !w.dedup_engaged() {
            w.counts.dedup.standing_by += 1;
        }
        if let (None, Some(target)) = (&w.target, &head.target) {
            w.target = Some(target.clone());
        }
        let dedup_client = match &w.dedup {
            Some(dedup) if checked && w.dedup_engaged() => {
                if head.content_length.is_some_and(|n| !dedup.fits(n)) {
                    w.counts.dedup.too_large += 1;
                    None
                } else {
                    Some(client_name(dedup.policy(), facts))
                }
            }
            _ => None,
        };
        self.state = State::Http(HttpRequest {
            ticket,
            class,
            body_follows: !head.end_of_stream,
            body_pieces: 0,
            dedup_client,
            target: head.target,
            waiting: None,
        });
        OnHeaders::Continue
    }

    /// A piece of request body: `size` bytes buffered so far.
    pub fn request_body(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnBody {
        match &mut self.state {
            State::Http(request) => request.body(w, store, now, size, end_of_stream, body),
            State::Websocket(ws) => {
                ws.read(body, size, &mut w.counts.websocket);
                match settle(ws, w, store, now) {
                    Settled::Through(None) => OnBody::Continue,
                    Settled::Through(Some(bytes)) => OnBody::ContinueWith(bytes),
                    Settled::ConnectionFull | Settled::GateFull => OnBody::Hold,
                }
            }
            State::Idle | State::Tunnel(_) => OnBody::Continue,
        }
    }

    /// Request trailers end the request: an admission that waited for the
    /// body is made now (a refusal answers `id: null`), and a body held
    /// for dedup goes on unchecked.
    pub fn request_trailers(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Result<(), Rejection> {
        if let State::Http(request) = &mut self.state {
            if request.ticket.is_none() {
                request.ticket = Some(w.admit(store, now, request.class, false)?);
            }
            if request.dedup_client.take().is_some() {
                w.counts.dedup.skipped += 1;
            }
        }
        Ok(())
    }

    /// Retries the slots a held WebSocket's messages wait for. On
    /// `Through` the glue resumes the stream.
    pub fn settle(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Settled {
        match &mut self.state {
            State::Websocket(ws) => settle(ws, w, store, now),
            _ => Settled::Through(None),
        }
    }

    /// Whether the stream holds data waiting for a slot.
    pub fn waiting(&self) -> bool {
        matches!(&self.state, State::Websocket(ws) if ws.waiting())
    }

    /// Response headers; `end_of_stream` ends the response.
    pub fn response_headers(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        end_of_stream: bool,
    ) -> bool {
        end_of_stream && self.response_ended(w, store)
    }

    /// A piece of response body: slots given back (the glue then lets
    /// waiting WebSockets retry), and on a WebSocket what the client gets
    /// instead, if the gate changed it.
    pub fn response_body(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnResponse {
        if let State::Websocket(ws) = &mut self.state {
            let (released, replace) = ws.answer(&body.read(0, size), &mut w.counts.websocket);
            for _ in 0..released {
                w.gate.give(ws.kind());
            }
            return OnResponse {
                released: released > 0,
                replace,
            };
        }
        OnResponse {
            released: end_of_stream && self.response_ended(w, store),
            replace: None,
        }
    }

    /// Response trailers end the response.
    pub fn response_trailers(&mut self, w: &mut GateWorker, store: &impl SharedStore) -> bool {
        self.response_ended(w, store)
    }

    /// The node's response has ended: an HTTP request's slot goes back.
    fn response_ended(&mut self, w: &mut GateWorker, store: &impl SharedStore) -> bool {
        if let State::Http(_) = &self.state {
            self.done(w, store);
            return true;
        }
        false
    }

    /// The stream is over (done, reset, or deleted): everything it holds
    /// goes back. Safe to call more than once.
    pub fn done(&mut self, w: &mut GateWorker, store: &impl SharedStore) {
        match std::mem::take(&mut self.state) {
            State::Idle => {}
            State::Http(request) => {
                if let (Some(waiting), Some(dedup)) = (request.waiting, w.dedup.clone()) {
                    // Its client went while it was held: no longer counted.
                    w.counts.dedup.left += 1;
                    let left = match waiting.pending {
                        // It led, and its callout was not sent yet: the key
                        // is left to its waiters (they check again on the
                        // heartbeat).
                        Some(pending) => {
                            let at = pending.start_ms();
                            dedup
                                .complete(store, &pending, Outcome::Failed, 1, 0, at)
                                .map(|(_, retries)| retries)
                        }
                        None => dedup.left(store, &waiting.key),
                    };
                    match left {
                        Ok(retries) => w.counts.store.retried(retries),
                        Err(e) => w.note_store_error("dedup: a held request left", &e),
                    }
                }
                if let Some(ticket) = request.ticket {
                    w.release(ticket);
                }
            }
            State::Websocket(ws) => {
                for _ in 0..ws.at_node() {
                    w.gate.give(ws.kind());
                }
                w.release(ws.connection);
            }
            State::Tunnel(ticket) => w.release(ticket),
        }
    }
}

impl HttpRequest {
    fn body(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnBody {
        self.body_pieces = self.body_pieces.saturating_add(1);
        if self.body_pieces == 1 && self.body_follows && !end_of_stream {
            w.counts.bodies_streamed += 1;
            if !w.told_about_streamed_bodies {
                w.told_about_streamed_bodies = true;
                w.log.push(
                    "request bodies reach the gate in pieces, so a slow upload holds its slot; put envoy.filters.http.buffer before the gate (see policies/admission-gate.md)".into(),
                );
            }
        }
        if self.ticket.is_none() {
            if !end_of_stream {
                return OnBody::Hold;
            }
            match w.admit(store, now, self.class, false) {
                Ok(ticket) => self.ticket = Some(ticket),
                Err(refusal) => {
                    self.dedup_client = None;
                    return OnBody::Refuse(refusal.answering(&body.read(0, size)));
                }
            }
        }
        let Some(client) = &self.dedup_client else {
            return OnBody::Continue;
        };
        let Some(dedup) = w.dedup.as_ref() else {
            return OnBody::Continue;
        };
        if !dedup.fits(size as u64) {
            // Too large to check: it goes on as it is, with what was held.
            self.dedup_client = None;
            w.counts.dedup.too_large += 1;
            return OnBody::Continue;
        }
        if !end_of_stream {
            return OnBody::Hold;
        }
        let client = client.clone();
        self.dedup_client = None;
        let request = body.read(0, size);
        let dedup = dedup.clone();
        let keyed = match (dedup.key(&request, &client), w.gate.vm()) {
            (Ok(keyed), Some(vm)) => (keyed, vm),
            _ => {
                w.counts.dedup.skipped += 1;
                return OnBody::Continue;
            }
        };
        let ((keyed, vm), now_ms) = (keyed, now.ms());
        let checked = match dedup.check(store, &keyed.key, vm, now_ms, false) {
            Ok(checked) => checked,
            Err(e) => {
                w.note_store_error("dedup check passed a request", &e);
                return OnBody::Continue;
            }
        };
        w.counts.store.retried(checked.cas_retries);
        w.counts.dedup.purged += checked.purged;
        let waiting = Waiting {
            key: keyed.key,
            ids: keyed.ids,
            body: request,
            target: self.target.take().unwrap_or_default(),
            deadline_ms: now_ms.saturating_add(dedup.policy().max_wait_ms),
            leads: false,
            pending: None,
            reuse: keyed.reuse,
            checked_ms: now_ms,
        };
        match checked.verdict {
            Verdict::Lead(pending) => {
                w.counts.dedup.led += 1;
                let callout = callout(&dedup, &waiting);
                self.waiting = Some(Waiting {
                    leads: true,
                    pending: Some(pending),
                    ..waiting
                });
                OnBody::Lead(callout)
            }
            Verdict::Wait => {
                // It puts no load on the node while it waits.
                w.counts.dedup.coalesced += 1;
                if let Some(ticket) = self.ticket.take() {
                    w.release(ticket);
                }
                self.waiting = Some(waiting);
                OnBody::Hold
            }
            Verdict::Take(slot) => match dedup.take(store, slot, &waiting.key) {
                Ok(Some(answer)) => {
                    w.counts.dedup.taken += 1;
                    OnBody::Answer(reply(&answer, &waiting.ids))
                }
                _ => OnBody::Continue,
            },
            Verdict::TableFull => {
                w.counts.dedup.table_full += 1;
                OnBody::Continue
            }
            Verdict::Refuse(rejection) => {
                w.counts.dedup.refused += 1;
                OnBody::Refuse(rejection.answering(&waiting.body))
            }
        }
    }
}

/// The leader's request, as a callout to the policy's upstream.
fn callout(dedup: &Dedup, waiting: &Waiting) -> Callout {
    let upstream = &dedup.policy().upstream;
    Callout {
        cluster: upstream.cluster.clone(),
        headers: callout_headers(&waiting.target),
        body: waiting.body.clone(),
        timeout_ms: upstream.timeout_ms,
    }
}

/// A callout's headers: a JSON-RPC POST to where `target` says (the
/// client's `:path` and `:authority`: a node may check its host name), in
/// no encoding, so that every waiter can read the answer and have its ids
/// put back.
fn callout_headers(target: &Target) -> Vec<(&'static str, String)> {
    let authority = match target.authority.as_str() {
        "" => "localhost".to_string(),
        authority => authority.to_string(),
    };
    let path = match target.path.as_str() {
        "" => "/".to_string(),
        path => path.to_string(),
    };
    vec![
        (":method", "POST".into()),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/json".into()),
        ("accept-encoding", "identity".into()),
    ]
}

/// `answer`, for the request with these ids.
fn reply(answer: &Answer, ids: &[crate::dedup::answer::Id]) -> Reply {
    Reply::answer(answer, answer.body_for(ids))
}

/// A held request's side of coalescing (`coalesce` drives these).
impl GateStream {
    fn http(&mut self) -> Option<&mut HttpRequest> {
        match &mut self.state {
            State::Http(request) => Some(request),
            _ => None,
        }
    }

    /// It leads, and its callout is still to be sent.
    pub fn awaits_callout(&self) -> bool {
        self.held_for().is_some_and(|w| w.pending.is_some())
    }

    /// What it waits for, if it is held for an answer.
    pub fn held_for(&self) -> Option<&Waiting> {
        match &self.state {
            State::Http(request) => request.waiting.as_ref(),
            _ => None,
        }
    }

    /// Its callout was sent with `token`: the callout holds the key's
    /// lead and the gate slot from now on.
    pub fn led(&mut self, w: &mut GateWorker, token: u32, now_ms: u64) {
        let Some(request) = self.http() else { return };
        let Some(waiting) = request.waiting.as_mut() else {
            return;
        };
        let Some(pending) = waiting.pending.take() else {
            return;
        };
        let timeout_ms = w
            .dedup
            .as_ref()
            .map_or(0, |d| d.policy().upstream.timeout_ms);
        w.callouts.insert(
            token,
            Led {
                pending,
                ids: waiting.ids.clone(),
                ticket: request.ticket.take(),
                started_ms: now_ms,
                timeout_ms,
                reuse: waiting.reuse,
            },
        );
    }

    /// Its callout could not be sent: it stops leading and holding (it
    /// goes on through the route with its slot).
    pub(super) fn stop_leading(&mut self) -> Option<Pending> {
        let request = self.http()?;
        let pending = request.waiting.as_mut()?.pending.take();
        request.waiting = None;
        pending
    }

    /// It comes to lead `pending`: it takes a gate slot, and its callout
    /// is to be sent. A full gate refuses it (and `pending` goes back).
    pub(super) fn lead(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        pending: Pending,
    ) -> Result<Callout, (Reply, Pending)> {
        let Some(dedup) = w.dedup.clone() else {
            return Err((no_answer(&[], "dedup is off"), pending));
        };
        let Some(request) = self.http() else {
            return Err((no_answer(&[], "the request is gone"), pending));
        };
        if request.ticket.is_none() {
            match w.admit(store, now, request.class, false) {
                Ok(ticket) => request.ticket = Some(ticket),
                Err(refusal) => {
                    let waiting = request.waiting.take();
                    let body = waiting.map(|w| w.body).unwrap_or_default();
                    return Err((Reply::refusal(refusal.answering(&body)), pending));
                }
            }
        }
        let Some(waiting) = request.waiting.as_mut() else {
            return Err((no_answer(&[], "the request is gone"), pending));
        };
        waiting.leads = true;
        waiting.pending = Some(pending);
        Ok(callout(&dedup, waiting))
    }

    /// It gets `answer`, with its own ids.
    pub(super) fn answer(&mut self, w: &mut GateWorker, answer: &Answer) -> Reply {
        let Some(waiting) = self.http().and_then(|r| r.waiting.take()) else {
            return no_answer(&[], "the request is gone");
        };
        if !waiting.leads {
            w.counts.dedup.shared += 1;
        }
        reply(answer, &waiting.ids)
    }

    /// Its own callout failed: the node's 5xx as it came if it is JSON,
    /// else a JSON-RPC error with the status (Envoy's own 503 or 504 for a
    /// callout it could not complete), or 502 with no answer at all.
    pub(super) fn failed(&mut self, answer: Option<&Answer>) -> Reply {
        let Some(waiting) = self.http().and_then(|r| r.waiting.take()) else {
            return no_answer(&[], "the request is gone");
        };
        match answer {
            Some(answer) if answer.content_type.contains("json") => reply(answer, &waiting.ids),
            Some(answer) => Reply {
                status: answer.status,
                ..no_answer(&waiting.ids, "the node did not answer in time")
            },
            None => no_answer(&waiting.ids, "the node did not answer"),
        }
    }

    /// Past its deadline, a held request gets 504 and is no longer counted.
    pub(super) fn expire(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now_ms: u64,
    ) -> Option<Reply> {
        let request = self.http()?;
        if request.waiting.as_ref()?.deadline_ms > now_ms {
            return None;
        }
        let waiting = request.waiting.take()?;
        w.counts.dedup.wait_timeouts += 1;
        if let Some(dedup) = w.dedup.clone() {
            if let Err(e) = dedup.left(store, &waiting.key) {
                w.note_store_error("dedup: a held request timed out", &e);
            }
        }
        Some(Reply {
            status: 504,
            ..no_answer(
                &waiting.ids,
                "timed out waiting for the node's answer to an identical request",
            )
        })
    }

    /// The table was checked for `key` at `now_ms`.
    pub(super) fn checked(&mut self, key: &crate::dedup::key::Key, now_ms: u64) {
        if let Some(waiting) = self.http().and_then(|r| r.waiting.as_mut()) {
            if waiting.key == *key {
                waiting.checked_ms = now_ms;
            }
        }
    }

    /// It goes through the route as it is, with a gate slot (or the gate's
    /// refusal).
    pub(super) fn pass(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Act {
        let Some(request) = self.http() else {
            return Act::Resume;
        };
        let body = request.waiting.take().map(|w| w.body).unwrap_or_default();
        if request.ticket.is_none() {
            match w.admit(store, now, request.class, false) {
                Ok(ticket) => request.ticket = Some(ticket),
                Err(refusal) => return Act::Answer(Reply::refusal(refusal.answering(&body))),
            }
        }
        Act::Resume
    }
}

/// A held socket's data tries for slots again.
fn settle(
    ws: &mut Websocket,
    w: &mut GateWorker,
    store: &impl SharedStore,
    now: &mut Now,
) -> Settled {
    let (flow, taken) = ws.settle(&mut w.gate, store, now, &mut w.counts.websocket);
    if let Some(taken) = taken {
        w.taken(&taken);
    }
    Settled::of(flow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::policy::GatePolicy;
    use crate::request::MetadataScope;
    use crate::shared::MemoryStore;
    use std::net::IpAddr;

    struct Public;

    impl RequestFacts for Public {
        fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
            None
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            "192.0.2.1".parse().ok()
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            None
        }
        fn header(&mut self, _: &str) -> Option<String> {
            None
        }
    }

    struct Bytes(Vec<u8>);

    impl Body for Bytes {
        fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
            self.0.get(start..start + len).unwrap_or_default().to_vec()
        }
    }

    fn worker(policy: &str, seed: u64) -> GateWorker {
        GateWorker::new(InflightGate::new(
            GatePolicy::parse(policy.as_bytes()).unwrap(),
            seed,
        ))
    }

    const GET: Head = Head {
        end_of_stream: true,
        upgrade: Upgrade::None,
        content_length: None,
        target: None,
    };

    /// `Head::read` over `headers`, and the names it read.
    fn read_head(
        end_of_stream: bool,
        dedup: bool,
        headers: &[(&str, &str)],
    ) -> (Head, Vec<String>) {
        let mut reads = Vec::new();
        let head = Head::read(end_of_stream, dedup, |name| {
            reads.push(name.to_string());
            headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        });
        (head, reads)
    }

    #[test]
    fn a_plain_request_costs_one_header_read() {
        let post = [(":method", "POST"), ("content-length", "64")];
        let (head, reads) = read_head(false, false, &post);
        assert_eq!((head.upgrade, head.content_length), (Upgrade::None, None));
        assert_eq!(reads, ["upgrade"]);
        let (head, reads) = read_head(false, true, &post);
        assert_eq!(
            (head.upgrade, head.content_length),
            (Upgrade::None, Some(64))
        );
        // With dedup, also where a leader's callout goes.
        assert_eq!(reads, ["upgrade", "content-length", ":path", ":authority"]);
        // With dedup, a body of unknown length may be a CONNECT tunnel.
        let (head, reads) = read_head(false, true, &[(":method", "CONNECT")]);
        assert_eq!(head.upgrade, Upgrade::Tunnel);
        assert_eq!(reads, ["upgrade", "content-length", ":method"]);
        let (head, _) = read_head(false, true, &[(":method", "POST")]);
        assert_eq!(head.upgrade, Upgrade::None);
    }

    #[test]
    fn upgrades_are_told_apart_by_method_and_protocol() {
        let head = |method: &str, upgrade: &str| {
            read_head(false, false, &[(":method", method), ("upgrade", upgrade)])
                .0
                .upgrade
        };
        assert_eq!(head("GET", "websocket"), Upgrade::Websocket);
        assert_eq!(head("GET", "WebSocket"), Upgrade::Websocket);
        assert_eq!(head("GET", "h2c"), Upgrade::Tunnel);
        assert_eq!(head("POST", "websocket"), Upgrade::NotGet);
        assert_eq!(head("CONNECT", "websocket"), Upgrade::Tunnel);
    }

    fn inflight(w: &mut GateWorker, store: &MemoryStore) -> u32 {
        w.tick(store, 0).totals.unwrap().inflight()
    }

    #[test]
    fn an_http_slot_goes_back_when_the_response_ends() {
        let store = MemoryStore::default();
        let mut w = worker(r#"{"maxInflight": 1}"#, 1);
        let mut first = GateStream::default();
        assert_eq!(
            first.headers(&mut w, &store, &mut Now::fixed(0), &mut Public, GET),
            OnHeaders::Continue
        );
        assert!(!first.response_headers(&mut w, &store, false));
        let mut nothing = Bytes(Vec::new());
        assert!(
            first
                .response_body(&mut w, &store, 0, true, &mut nothing)
                .released
        );
        // The client is still reading, but the node is done.
        assert_eq!(
            GateStream::default().headers(&mut w, &store, &mut Now::fixed(0), &mut Public, GET),
            OnHeaders::Continue
        );
        first.done(&mut w, &store);
        assert_eq!(w.counts.admitted[RequestClass::Default.index()], 2);
    }

    #[test]
    fn a_streamed_body_is_counted_and_reported_once() {
        let store = MemoryStore::default();
        let mut w = worker(r#"{"maxInflight": 8}"#, 1);
        let post = Head {
            end_of_stream: false,
            ..GET
        };
        for _ in 0..2 {
            let mut stream = GateStream::default();
            stream.headers(
                &mut w,
                &store,
                &mut Now::fixed(0),
                &mut Public,
                post.clone(),
            );
            let mut piece = Bytes(b"{\"id\":".to_vec());
            assert_eq!(
                stream.request_body(&mut w, &store, &mut Now::fixed(0), 6, false, &mut piece),
                OnBody::Continue
            );
            stream.done(&mut w, &store);
        }
        assert_eq!(w.counts.bodies_streamed, 2);
        assert_eq!(w.take_log().len(), 1);
    }

    #[test]
    fn deciding_on_the_body_answers_each_call_of_a_refused_batch() {
        let store = MemoryStore::default();
        let mut w = worker(r#"{"maxInflight": 1, "decideOnBody": true}"#, 1);
        let post = Head {
            end_of_stream: false,
            ..GET
        };
        let mut first = GateStream::default();
        assert_eq!(
            first.headers(
                &mut w,
                &store,
                &mut Now::fixed(0),
                &mut Public,
                post.clone()
            ),
            OnHeaders::Continue
        );
        assert_eq!(inflight(&mut w, &store), 0, "nothing taken before the body");
        let mut piece = Bytes(br#"[{"id":1,"method":"a"},"#.to_vec());
        assert_eq!(
            first.request_body(&mut w, &store, &mut Now::fixed(0), 22, false, &mut piece),
            OnBody::Hold,
            "a piece is held until the body is whole"
        );
        let batch = br#"[{"id":1,"method":"a"},{"id":"b","method":"a"}]"#;
        let mut whole = Bytes(batch.to_vec());
        let end = batch.len();
        assert_eq!(
            first.request_body(&mut w, &store, &mut Now::fixed(0), end, true, &mut whole),
            OnBody::Continue
        );
        assert_eq!(inflight(&mut w, &store), 1);

        let mut second = GateStream::default();
        second.headers(
            &mut w,
            &store,
            &mut Now::fixed(0),
            &mut Public,
            post.clone(),
        );
        let OnBody::Refuse(refusal) =
            second.request_body(&mut w, &store, &mut Now::fixed(0), end, true, &mut whole)
        else {
            panic!("admitted over the limit");
        };
        let answers: Vec<serde_json::Value> = serde_json::from_str(&refusal.body).unwrap();
        let ids: Vec<_> = answers.iter().map(|a| a["id"].clone()).collect();
        assert_eq!(ids, [serde_json::json!(1), serde_json::json!("b")]);
        assert!(answers.iter().all(|a| a["error"]["code"] == -32005));
        second.done(&mut w, &store);
        first.done(&mut w, &store);
        assert_eq!(inflight(&mut w, &store), 0);

        // A request that ends with trailers is admitted there.
        let mut trailed = GateStream::default();
        trailed.headers(
            &mut w,
            &store,
            &mut Now::fixed(0),
            &mut Public,
            post.clone(),
        );
        assert_eq!(
            trailed.request_trailers(&mut w, &store, &mut Now::fixed(0)),
            Ok(())
        );
        assert_eq!(inflight(&mut w, &store), 1);
        let mut late = GateStream::default();
        late.headers(
            &mut w,
            &store,
            &mut Now::fixed(0),
            &mut Public,
            post.clone(),
        );
        assert!(late
            .request_trailers(&mut w, &store, &mut Now::fixed(0))
            .is_err());
        trailed.done(&mut w, &store);
        assert_eq!(inflight(&mut w, &store), 0);
    }

    /// Shared data that refuses every call.
    struct Refusing;

    impl SharedStore for Refusing {
        fn load(&self, _: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            Err(StoreError::Host("refused".into()))
        }

        fn store(
            &self,
            _: &str,
            _: &[u8],
            _: Option<u32>,
        ) -> Result<crate::shared::Write, StoreError> {
            Err(StoreError::Host("refused".into()))
        }
    }

    #[test]
    fn a_failing_store_fails_closed_and_is_counted_and_logged_each_time() {
        let mut w = worker(r#"{"maxInflight": 8}"#, 1);
        w.join(&Refusing, 0);
        let mut stream = GateStream::default();
        let refused = stream.headers(&mut w, &Refusing, &mut Now::fixed(0), &mut Public, GET);
        assert!(matches!(refused, OnHeaders::Refuse(r) if r.status == Rejection::OVERLOADED));
        assert_eq!(w.tick(&Refusing, 1000), Ticked::default());
        assert_eq!(w.counts.store.store_errors, 3);
        let log = w.take_log();
        assert_eq!(log.len(), 3, "{log:?}");
        for (line, what) in log
            .iter()
            .zip(["joining", "admission failed closed", "heartbeat"])
        {
            assert!(
                line.starts_with(what) && line.ends_with("refused"),
                "{line}"
            );
        }
    }
}
