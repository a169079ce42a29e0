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
//! (`maxWebsocketConnections`) for its life, and every message the node
//! runs takes an in-flight slot like an HTTP request, given back when its
//! answer passes (`gate::websocket` has how). Internal WebSockets are never
//! held.
//!
//! **Coalescing.** With dedup engaged, a whole body is checked against the
//! table (`held`): the request may lead its key, wait for an identical
//! request's answer, or take a kept answer. What holds it from then on is
//! coalescing's (`coalesce`), scheduled by the registry.

use super::held::{Checked, Place};
use super::node_time::{Full, Metered};
use super::reply::{Callout, Reply, Target};
use super::websocket::{Flow, Websocket};
use super::worker::GateWorker;
use super::{slot_of, Ticket};
use crate::cache::{Lookup, Miss};
use crate::clock::Now;
use crate::dedup::answer::Answer;
use crate::dedup::client_name;
use crate::gate::class::{classify, RequestClass};
use crate::rejection::{Rejection, Rule, INVALID_REQUEST};
use crate::request::{Body, RequestFacts};
use crate::shared::SharedStore;

/// What the glue knows about a request when its headers arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub end_of_stream: bool,
    pub upgrade: Upgrade,
    pub content_length: Option<u64>,
}

impl Head {
    /// Reads what the gate needs from the request headers, and no more:
    /// each read is a host call every request pays for. `upgrade` (absent
    /// on a plain request, which is cheap) always; `:method` only for an
    /// upgrade, or, with dedup on, for a body of unknown length (a CONNECT
    /// tunnel must not be held as a body); `content-length` only with
    /// dedup, which skips a body too large to check before holding it.
    /// (Where the request goes, `Target`, is read by the stream, only if
    /// the cache or coalescing looks at it.)
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
    /// Hold it for the head (a read at `latest`, `cache::head`).
    AtHead,
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
    /// Its slot and class, and what it waits for if coalescing holds it.
    place: Place,
    /// The headers did not end the request: a body follows.
    body_follows: bool,
    body_pieces: u32,
    /// Dedup reads the body: the sender's name for `client` scope, read
    /// with the headers (Envoy serves no headers in the body phase).
    dedup_client: Option<String>,
    target: Option<Target>,
    /// With `nodeTime`: its price, when it got its slot, and whether it
    /// waits for one.
    metered: Option<Metered>,
    /// The cache looks its whole body up (it is admitted then).
    cache: bool,
    /// A cache miss whose answer comes through the route: read whole, with
    /// its content type, and kept if it cannot change.
    capture: Option<(Miss, String)>,
    /// Its body, for dedup's check once it has the slot it waits for.
    checks_later: Option<Vec<u8>>,
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
    /// It waited `nodeTime.waitMs` for a slot in vain: refused.
    Refuse(Rejection),
    /// It has its slot, and dedup's check of its body found this.
    Checked(Checked),
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
    /// Hold the body until it is whole (the cache reads it).
    pub hold: bool,
    /// On a WebSocket whose node answered or pushed: its calls answered so
    /// far, their time at the node, and its notifications, to tell the
    /// filters before the gate (`cost::SOCKET_ANSWERED_PROPERTY`).
    pub socket_answered: Option<crate::cost::SocketAnswered>,
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
                Rule::InvalidRequest,
                Rejection::BAD_REQUEST,
                0,
                INVALID_REQUEST,
                "a WebSocket upgrade must be a GET request",
            ));
        }
        let policy = w.gate.policy();
        let class = classify(&policy.internal, &policy.priority, facts);
        if head.upgrade != Upgrade::None {
            let ticket = match w.admit(store, now, class, true, false) {
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
                    facts.qos_identity(),
                )));
                return OnHeaders::ContinueWebsocket;
            }
            self.state = State::Tunnel(ticket);
            return OnHeaders::Continue;
        }
        // With `decideOnBody`, a public request with a body is admitted
        // when its body is whole, so that a refusal can answer each of its
        // calls (internal requests are never refused: nothing to wait for);
        // with the cache (unless it stands by), so that a request the cache
        // answers never waits for a slot nor is refused one.
        let checked = !head.end_of_stream && class != RequestClass::Internal;
        // The cache and coalescing front one cluster (`dedup.upstream`):
        // a request the route sends elsewhere passes them by.
        let cluster = (checked && w.dedup.is_some())
            .then(|| facts.route_cluster())
            .flatten();
        let routed = checked && w.fronts(cluster.as_deref());
        let cache = routed
            && w.dedup
                .as_ref()
                .is_some_and(|d| head.content_length.is_none_or(|n| d.fits(n)))
            && w.cache_looks_up();
        let waits = (w.gate.policy().decide_on_body || cache) && checked;
        let ticket = if waits {
            None
        } else {
            match w.admit(store, now, class, false, false) {
                Ok(ticket) => Some(ticket),
                Err(refusal) => return OnHeaders::Refuse(refusal),
            }
        };
        if routed && w.dedup.is_some() && !w.dedup_engaged() {
            w.counts.dedup.standing_by += 1;
        }
        let dedup_client = match &w.dedup {
            Some(dedup) if routed && w.dedup_engaged() => {
                if head.content_length.is_some_and(|n| !dedup.fits(n)) {
                    w.counts.dedup.too_large += 1;
                    None
                } else {
                    Some(client_name(dedup.policy(), facts))
                }
            }
            _ => None,
        };
        let target = (cache || dedup_client.is_some()).then(|| Target::read(cluster, facts));
        if let Some(target) = &target {
            w.saw_target(target);
        }
        self.state = State::Http(HttpRequest {
            place: Place::new(ticket, class),
            body_follows: !head.end_of_stream,
            body_pieces: 0,
            dedup_client,
            target,
            metered: None,
            cache,
            capture: None,
            checks_later: None,
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
                ws.read(body, size, &mut w.counts.websocket, &mut w.subscriptions);
                match settle(ws, w, store, now) {
                    Flow::Through => OnBody::Continue,
                    Flow::Replace(bytes) => OnBody::ContinueWith(bytes),
                    Flow::ConnectionFull | Flow::GateFull => OnBody::Hold,
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
            let place = &mut request.place;
            if place.ticket.is_none() {
                place.ticket = Some(w.admit(store, now, place.class, false, false)?);
            }
            if request.dedup_client.take().is_some() {
                w.counts.dedup.skipped += 1;
            }
        }
        Ok(())
    }

    /// Retries the slots a held WebSocket's messages, or a request held
    /// for a slot, wait for, unless `full` says there is none. On
    /// `Through` the glue resumes the stream.
    pub fn settle(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        full: &mut Full,
    ) -> Settled {
        match &mut self.state {
            State::Websocket(_) if full.all => Settled::GateFull,
            State::Websocket(ws) => {
                let settled = Settled::of(settle(ws, w, store, now));
                if settled == Settled::GateFull {
                    full.found(false);
                }
                settled
            }
            State::Http(request) => request.settle(w, store, now, full),
            _ => Settled::Through(None),
        }
    }

    /// Until when a request waiting for a slot (`nodeTime.waitMs`) waits.
    pub fn waits_until(&self) -> Option<u64> {
        match &self.state {
            State::Http(request) => request.metered.as_ref()?.waiting.as_ref().map(|w| w.0),
            _ => None,
        }
    }

    /// Whether the stream holds data waiting for a slot.
    pub fn waiting(&self) -> bool {
        match &self.state {
            State::Websocket(ws) => ws.waiting(),
            State::Http(request) => request.metered.as_ref().is_some_and(Metered::waits),
            _ => false,
        }
    }

    /// Response headers (`header` reads one, only if needed);
    /// `end_of_stream` ends the response. Returns whether slots were given
    /// back, and with `nodeTime` the node's time on the request, in µs.
    pub fn response_headers(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        end_of_stream: bool,
        header: impl FnMut(&str) -> Option<String>,
    ) -> (bool, Option<u64>) {
        let mut header = header;
        let node_us = match &mut self.state {
            State::Http(request) => {
                let node_us = request.answered(w, now, &mut header);
                request.capture_answer(w, &mut header);
                node_us
            }
            _ => None,
        };
        (end_of_stream && self.response_ended(w, store), node_us)
    }

    /// A piece of response body: slots given back (the glue then lets
    /// waiting WebSockets retry), and on a WebSocket what the client gets
    /// instead, if the gate changed it.
    pub fn response_body(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnResponse {
        match &mut self.state {
            State::Websocket(ws) => {
                let piece = body.read(0, size);
                let before = ws.answered();
                let (released, replace) =
                    ws.answer(&piece, now.us(), &mut w.linger, &mut w.counts.websocket);
                for _ in 0..released {
                    w.gate.give(ws.kind());
                }
                return OnResponse {
                    released: released > 0,
                    replace,
                    hold: false,
                    socket_answered: (ws.answered() != before).then(|| ws.answered()),
                };
            }
            State::Http(request) if request.capture.is_some() => {
                let limit = w.cache.as_ref().map_or(0, |c| c.policy().max_answer_bytes);
                if !end_of_stream && size as u64 <= limit {
                    return OnResponse {
                        hold: true,
                        ..OnResponse::default()
                    };
                }
                if let Some((miss, content_type)) = request.capture.take() {
                    if end_of_stream {
                        let answer = Answer {
                            key: miss.key,
                            status: 200,
                            content_type,
                            content_encoding: None,
                            ids: miss.ids.clone(),
                            body: body.read(0, size),
                        };
                        w.cache_keep(store, now.ms(), miss, &answer);
                    } else {
                        w.counts.cache.not_kept += 1;
                    }
                }
            }
            _ => {}
        }
        OnResponse {
            released: end_of_stream && self.response_ended(w, store),
            ..OnResponse::default()
        }
    }

    /// Response trailers end the response.
    pub fn response_trailers(&mut self, w: &mut GateWorker, store: &impl SharedStore) -> bool {
        self.response_ended(w, store)
    }

    /// The node's response has ended: an HTTP request's slot goes back.
    fn response_ended(&mut self, w: &mut GateWorker, store: &impl SharedStore) -> bool {
        if !matches!(self.state, State::Http(_)) {
            return false;
        }
        if let State::Http(request) = std::mem::take(&mut self.state) {
            request.end(w, store);
        }
        true
    }

    /// The stream is over (done, reset, or deleted): everything it holds
    /// goes back (a cut socket's units at the node, when the node is
    /// expected to be done with them: `websocket::linger`). Safe to call
    /// more than once.
    pub fn done(&mut self, w: &mut GateWorker, store: &impl SharedStore, now: &mut Now) {
        match std::mem::take(&mut self.state) {
            State::Idle => {}
            State::Http(request) => request.end(w, store),
            State::Websocket(ws) => {
                let held = w.linger.held();
                for _ in 0..ws.cut(&mut w.linger, now.ms()) {
                    w.gate.give(ws.kind());
                }
                w.counts.websocket.lingered += (w.linger.held() - held) as u64;
                let (identity, subscribed) = ws.subscriptions();
                w.subscriptions.release(identity, subscribed);
                w.release(ws.connection);
            }
            State::Tunnel(ticket) => w.release(ticket),
        }
    }
}

impl HttpRequest {
    /// It is over: its slot, its wait, its place in coalescing go back.
    fn end(self, w: &mut GateWorker, store: &impl SharedStore) {
        if let Some(metered) = &self.metered {
            if metered.waits() {
                w.stop_waiting();
            }
            if let Some(priced) = metered.priced {
                w.meter.ended(priced);
            }
        }
        self.place.leave(w, store)
    }

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
            // Only a public request admitted before its body holds a node
            // slot while the body comes (an internal one holds none; with
            // `decideOnBody` it is admitted once the body is whole).
            if self.place.ticket.is_some() && self.place.class != RequestClass::Internal {
                w.note_once("request bodies reach the gate in pieces, so a slow upload holds its slot; put envoy.filters.http.buffer before the gate (see policies/admission-gate.md)");
            }
        }
        let mut read = None;
        if self.place.ticket.is_none() {
            if !end_of_stream {
                return OnBody::Hold;
            }
            let fits = w.dedup.as_ref().is_some_and(|d| d.fits(size as u64));
            if self.cache && fits {
                let bytes = body.read(0, size);
                let route = self.target.as_ref().map(Target::route).unwrap_or_default();
                match w.cache_lookup(store, now.ms(), &bytes, &route) {
                    Some(Lookup::Hit(answer, ids)) => {
                        let reply = Reply::answer(&answer, &ids).from_cache();
                        return OnBody::Answer(reply.no_node_time(w.gate.policy()));
                    }
                    Some(Lookup::Miss(miss)) => self.place.cache = Some(miss),
                    Some(Lookup::AtHead(at, ids)) => {
                        let target = self.target.take();
                        self.place.hold_for_head(at, ids, bytes, target);
                        return OnBody::AtHead;
                    }
                    _ => {}
                }
                read = Some(bytes);
            }
            let heavy = match &w.gate.policy().node_time {
                Some(node_time) => {
                    // Priced only if it may take a slot from the pool or
                    // the gate is busy (`node_time::Busy`).
                    let spare = w.gate.has_spare(super::slot_of(self.place.class));
                    let priced = (w.busy.engaged() || !spare).then(|| {
                        let bytes = read.take().unwrap_or_else(|| body.read(0, size));
                        let priced = w.meter.price(&bytes, node_time.cheap_below_us);
                        read = Some(bytes);
                        priced
                    });
                    self.metered = Some(Metered::new(priced));
                    priced.is_some_and(|p| !p.cheap)
                }
                None => false,
            };
            match w.try_admit(store, now, self.place.class, false, heavy) {
                Ok(ticket) => self.slot_taken(w, now, ticket),
                Err(refusal) => {
                    let bytes = read.unwrap_or_else(|| body.read(0, size));
                    return self.refused(w, now, refusal, bytes);
                }
            }
        }
        let (Some(dedup), Some(_)) = (w.dedup.as_ref(), &self.dedup_client) else {
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
        let request = read.unwrap_or_else(|| body.read(0, size));
        match self.check(w, store, now, request) {
            Checked::Continue => OnBody::Continue,
            Checked::Hold => OnBody::Hold,
            Checked::Lead(callout) => OnBody::Lead(callout),
            Checked::Answer(reply) => OnBody::Answer(reply),
            Checked::Refuse(refusal) => OnBody::Refuse(refusal),
        }
    }
}

impl GateStream {
    /// The gate answers it itself (`Metered::answered_here`).
    pub fn answered_here(&mut self) {
        if let State::Http(HttpRequest {
            metered: Some(m), ..
        }) = &mut self.state
        {
            m.answered_here();
        }
    }

    /// Its place, if it is an HTTP request (coalescing's side of it).
    pub fn place(&mut self) -> Option<&mut Place> {
        match &mut self.state {
            State::Http(request) => Some(&mut request.place),
            _ => None,
        }
    }
}

/// A held socket's data tries for slots again.
fn settle(ws: &mut Websocket, w: &mut GateWorker, store: &impl SharedStore, now: &mut Now) -> Flow {
    let (flow, taken) = ws.settle(&mut w.gate, store, now, &mut w.counts.websocket);
    if let Some(taken) = taken {
        w.taken(&taken);
    }
    flow
}

impl HttpRequest {
    /// It has its slot (with `nodeTime`, `Metered::slot_taken`).
    fn slot_taken(&mut self, w: &mut GateWorker, now: &mut Now, ticket: super::Ticket) {
        self.place.ticket = Some(ticket);
        if let Some(metered) = &mut self.metered {
            metered.slot_taken(now);
            w.counts.node_time.admitted(metered.priced);
        }
    }

    /// Dedup's check of its whole body, once it has its slot.
    fn check(
        &mut self,
        w: &mut GateWorker,
        store: &impl SharedStore,
        now: &mut Now,
        request: Vec<u8>,
    ) -> Checked {
        let client = self.dedup_client.take().unwrap_or_default();
        self.place
            .check(w, store, now, &client, request, self.target.take())
    }

    /// The node's answer to a cache miss starts, through the route: it is
    /// read whole if it may be kept (a 200, not encoded, not longer than
    /// `maxAnswerBytes`).
    fn capture_answer(
        &mut self,
        w: &mut GateWorker,
        header: &mut impl FnMut(&str) -> Option<String>,
    ) {
        let (Some(miss), Some(cache)) = (self.place.cache.take(), &w.cache) else {
            return;
        };
        let limit = cache.policy().max_answer_bytes;
        let keepable = header(":status").as_deref() == Some("200")
            && header("content-encoding").is_none_or(|e| e.eq_ignore_ascii_case("identity"))
            && header("content-length")
                .and_then(|n| n.trim().parse::<u64>().ok())
                .is_none_or(|n| n <= limit);
        if !keepable {
            w.counts.cache.not_kept += 1;
            return;
        }
        let content_type = header("content-type").unwrap_or_else(|| "application/json".into());
        self.capture = Some((miss, content_type));
    }

    /// The node's answer starts: with `nodeTime`, its time on the request
    /// (as the node says in `serviceTimeHeader`, else, for a priced
    /// request, since it got its slot), learned from if the answer is a
    /// success.
    fn answered(
        &mut self,
        w: &mut GateWorker,
        now: &mut Now,
        mut header: impl FnMut(&str) -> Option<String>,
    ) -> Option<u64> {
        let metered = self.metered.as_mut()?;
        let node_time = w.gate.policy().node_time.as_ref()?;
        let told = node_time
            .service_time_header
            .as_deref()
            .and_then(|name| header(name)?.trim().parse().ok());
        let since_us = metered.since_us.take();
        if let (Some(told), Some(since_us)) = (told, since_us) {
            w.meter.occupied(now.us().saturating_sub(since_us), told);
            let scale = w.meter.slot_scale();
            w.gate.scale_slots(scale);
            w.counts.node_time.slot_scale_milli = Some((scale * 1000.0) as u64);
        }
        let us = told.or_else(|| Some(now.us().saturating_sub(since_us?)))?;
        // Only a priced request's answer teaches its method's cost.
        if let Some(priced) = metered.priced {
            let ok = header(":status").and_then(|s| s.parse::<u32>().ok());
            if ok.is_some_and(|s| (200..300).contains(&s)) {
                w.meter.learn(priced, us, now.ms());
            }
        }
        Some(us)
    }
}

mod hold;
mod socket;
#[cfg(test)]
mod tests;
mod wait;
