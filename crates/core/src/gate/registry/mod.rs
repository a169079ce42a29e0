//! One VM's streams, by context id, and the scheduling between them.
//!
//! Envoy calls a filter per stream, but what the gate does in one stream's
//! callback often settles another's: an answer that frees a slot lets a
//! held WebSocket go on, a leader's answer answers every request waiting on
//! its key. The registry keeps every stream's state (`GateStream`), the
//! streams held for a slot and for an answer (oldest first), and the
//! leaders' callouts still to be sent, and each of its methods returns what
//! the glue must do for the stream it was called for; what it must do for
//! the others it queues as `Do`s, which the glue takes (`take`) and carries
//! out with host calls, in order.
//!
//! **Turns.** Envoy does what a VM asks for another stream (a local reply,
//! a resume) after the VM call returns, one after another, and each local
//! reply runs that stream's response through the VMs at once, where the
//! next one waiting is done, nested: the host's stack grows with the number
//! asked for in one go, and V8 stops the VMs past a few hundred. So a turn
//! (from one root-context callback to the next) carries out at most
//! `TURN_ACTIONS` answers and resumes; the rest stay queued, and a `Poke`
//! brings the root context back, in a turn of its own, to do the next.
//!
//! Callouts are sent from the root context (so that a stream's end cannot
//! cancel them): a stream that comes to lead in its own callback asks the
//! glue to `Poke` this VM's own queue, and the root context then sends what
//! `next_callout` gives it and reports each with `sent`.

use super::at_head::{Heads, Hold, HEAD_POLL};
use super::coalesce::{Acts, Coalescer, Held, Response};
use super::counts::{Snapshot, Ticked};
use super::held::Checked;
use super::node_time::{Full, Turn, Waiters, SLOT_WAKE, WAIT_TICK_MS};
use super::policy::GatePolicy;
use super::reply::{Act, Callout, Reply};
use super::stream::{GateStream, Head, OnBody, OnHeaders, OnResponse, Settled};
use super::worker::GateWorker;
use super::InflightGate;
use crate::cache::head::Head as ChainHead;
use crate::clock::Now;
use crate::dedup::key::KEY_LEN;
use crate::rejection::Rejection;
use crate::request::{Body, RequestFacts};
use crate::shared::SharedStore;
use std::collections::{HashMap, VecDeque};

/// Answers and resumes of other streams carried out in one turn at most
/// (module docs): far below the depth at which V8 stops a VM (some 500
/// local replies nested in one, through the whole chain).
pub const TURN_ACTIONS: u32 = 64;

/// What the glue does for a stream other than the one it was called for
/// (or from a root-context callback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Do {
    /// Answer stream `.0`'s request with this reply.
    Answer(u32, Reply),
    /// Resume stream `.0`'s request, its held data replaced by these bytes
    /// if given.
    Resume(u32, Option<Vec<u8>>),
    /// Put this message on the wake queue of each of these gate VMs.
    Wake(Vec<u32>, Vec<u8>),
    /// Put a wake-up on this VM's own queue (unless one is on it), so that
    /// its root context sends the callouts waiting (the heartbeat does, if
    /// it cannot).
    Poke,
}

/// What the glue does with the request body of the stream it was called
/// for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Then {
    Continue,
    /// Continue, with the data held replaced by these bytes.
    ContinueWith(Vec<u8>),
    /// Hold it at the gateway (`Do::Resume` or `Do::Answer` comes later).
    Pause,
    /// Answer it with this reply.
    Answer(Reply),
    Refuse(Rejection),
}

/// One VM's gate and streams, over its shared data (`store`) and clock
/// (microseconds, read only when a decision needs it).
#[derive(Debug)]
pub struct Registry<S: SharedStore> {
    pub worker: GateWorker,
    store: S,
    clock: fn() -> u64,
    coalescer: Coalescer,
    streams: HashMap<u32, GateStream>,
    /// Streams whose WebSocket data waits for a slot, oldest first.
    waiting: Vec<u32>,
    /// Streams held for an answer, oldest first.
    coalesced: Vec<u32>,
    /// Leaders' callouts to send from the root context.
    to_dispatch: VecDeque<(u32, Callout)>,
    /// Reads at `latest` held for the head, and its poll.
    heads: Heads,
    todo: Vec<Do>,
    /// Answers and resumes this turn may still carry out (`TURN_ACTIONS`).
    turn_left: u32,
    /// When the heartbeat's work last ran.
    last_heartbeat_ms: u64,
    /// When dedup's engagement tick last ran.
    last_engage_ms: u64,
    /// The turn of this VM's first waiting request it last said in shared
    /// data (`node_time::Waiters`).
    announced: Option<Turn>,
    /// The waiters record as last read, and when (ms).
    waiters_seen: Option<(u64, Waiters)>,
    /// The requests held for an answer, and the subscriptions open, as
    /// the last snapshot gave them.
    waiting_reported: i64,
    subscriptions_reported: i64,
}

impl<S: SharedStore> Registry<S> {
    /// The registry of the VM of root context `root` under `policy`; it
    /// takes its shard now.
    pub fn new(policy: GatePolicy, root: u32, store: S, clock_us: fn() -> u64) -> Self {
        let now_ms = clock_us() / 1000;
        let gate = InflightGate::new(policy, now_ms ^ (u64::from(root) << 32));
        let mut worker = GateWorker::new(gate);
        worker.join(&store, now_ms);
        Self {
            worker,
            store,
            clock: clock_us,
            coalescer: Coalescer::default(),
            streams: HashMap::new(),
            waiting: Vec::new(),
            coalesced: Vec::new(),
            to_dispatch: VecDeque::new(),
            heads: Heads::default(),
            todo: Vec::new(),
            turn_left: TURN_ACTIONS,
            last_heartbeat_ms: now_ms,
            last_engage_ms: 0,
            announced: None,
            waiters_seen: None,
            waiting_reported: 0,
            subscriptions_reported: 0,
        }
    }

    /// What to do for the other streams now, in order, and the lines for
    /// Envoy's log; both are taken. Past this turn's answers and resumes
    /// (`TURN_ACTIONS`), the rest stay for the next turn, and a `Poke`
    /// asks for one. So does what is for `current`, the stream the glue was
    /// called for (a queued one, from an earlier turn): Envoy carries a
    /// resume out before the callback returns, so one asked in a stream's
    /// own request callback is undone by its pause.
    pub fn take(&mut self, current: u32) -> (Vec<Do>, Vec<String>) {
        let mut now = Vec::with_capacity(self.todo.len());
        let mut later = Vec::new();
        for todo in std::mem::take(&mut self.todo) {
            if let Do::Answer(id, _) | Do::Resume(id, _) = todo {
                self.worker.release_hold(id);
            }
            match todo {
                Do::Answer(id, _) | Do::Resume(id, _) if id == current => later.push(todo),
                Do::Answer(..) | Do::Resume(..) if self.turn_left == 0 => later.push(todo),
                Do::Answer(..) | Do::Resume(..) => {
                    self.turn_left -= 1;
                    now.push(todo);
                }
                Do::Wake(..) | Do::Poke => now.push(todo),
            }
        }
        if !later.is_empty() {
            now.push(Do::Poke);
        }
        self.todo = later;
        (now, self.worker.take_log())
    }

    /// A root-context callback begins a turn: Envoy calls it from its
    /// event loop, never from inside a VM call.
    pub fn new_turn(&mut self) {
        self.turn_left = TURN_ACTIONS;
    }

    fn now_ms(&self) -> u64 {
        (self.clock)() / 1000
    }

    /// How often the root context ticks: every `engage::TICK_MS` with
    /// dedup (whether it engages), every `node_time::WAIT_TICK_MS` if
    /// requests may wait for a slot, else every `heartbeatMs`.
    pub fn tick_ms(&self) -> u64 {
        let policy = self.worker.gate.policy();
        let mut tick_ms = policy.heartbeat_ms;
        if policy.dedup.is_some() {
            tick_ms = tick_ms.min(crate::dedup::engage::TICK_MS);
        }
        if policy.node_time.as_ref().is_some_and(|n| n.wait_ms > 0) {
            tick_ms = tick_ms.min(WAIT_TICK_MS);
        }
        tick_ms
    }

    /// Requests held for an answer on this VM.
    pub fn coalesced(&self) -> usize {
        self.coalesced.len()
    }

    /// What to hand Envoy now: the counts since the last snapshot (taken),
    /// the change in requests held here, and what the heartbeat found.
    pub fn snapshot(&mut self, ticked: Option<Ticked>) -> Snapshot {
        let waiting = (self.coalesced.len() + self.heads.held()) as i64;
        let change = waiting - std::mem::replace(&mut self.waiting_reported, waiting);
        let subscriptions = self.worker.subscriptions.held() as i64;
        self.worker.counts.websocket.subscriptions =
            subscriptions - std::mem::replace(&mut self.subscriptions_reported, subscriptions);
        Snapshot {
            counts: std::mem::take(&mut self.worker.counts),
            ticked,
            waiting: Some(change),
            engaged: None,
        }
    }

    /// Stream `id`'s request headers.
    pub fn headers(&mut self, id: u32, facts: &mut impl RequestFacts, head: Head) -> OnHeaders {
        let now = &mut Now::lazy_us(self.clock);
        let stream = self.streams.entry(id).or_default();
        stream.headers(&mut self.worker, &self.store, now, facts, head)
    }

    /// A piece of stream `id`'s request body (or WebSocket data): `size`
    /// bytes so far. A request to be held is counted against the holding
    /// bounds or refused (`gate::holds`; `facts` give its identity).
    pub fn request_body(
        &mut self,
        id: u32,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
        facts: &mut impl RequestFacts,
    ) -> Then {
        let now = &mut Now::lazy_us(self.clock);
        let Some(stream) = self.streams.get_mut(&id) else {
            return Then::Continue;
        };
        let w = &mut self.worker;
        let on = stream.request_body(w, &self.store, now, size, end_of_stream, body);
        let (coalesced, waits) = (stream.coalesced(), stream.waiting());
        let holds = match on {
            OnBody::Hold => coalesced || (waits && stream.socket().is_none()),
            OnBody::AtHead => !self.heads.standing_by(),
            _ => false,
        };
        if holds {
            let identity = || facts.qos_identity();
            if let Err(refusal) = stream.hold(w, &self.store, id, identity, || body.read(0, size)) {
                return Then::Refuse(refusal);
            }
        }
        match on {
            OnBody::Continue => Then::Continue,
            OnBody::ContinueWith(bytes) => Then::ContinueWith(bytes),
            OnBody::Hold if coalesced => {
                self.coalesced.push(id);
                Then::Pause
            }
            OnBody::Hold => {
                if waits && !self.waiting.contains(&id) {
                    self.waiting.push(id);
                    if self.slots_wait() {
                        self.announce();
                    }
                }
                Then::Pause
            }
            OnBody::Lead(callout) => {
                self.coalesced.push(id);
                self.to_dispatch.push_back((id, callout));
                self.todo.push(Do::Poke);
                Then::Pause
            }
            OnBody::Answer(reply) => {
                stream.answered_here();
                Then::Answer(reply)
            }
            OnBody::Refuse(refusal) => Then::Refuse(refusal),
            OnBody::AtHead => match self.heads.hold(id) {
                Hold::Poll => {
                    self.todo.push(Do::Poke);
                    Then::Pause
                }
                Hold::Wait => Then::Pause,
                Hold::Pass => {
                    w.counts.cache.head_passed += 1;
                    let passed = stream.place().map(|p| p.pass_head(w, &self.store, now));
                    match passed {
                        Some(Checked::Refuse(refusal)) => Then::Refuse(refusal),
                        _ => Then::Continue,
                    }
                }
            },
        }
    }

    /// Whether stream `id` is a WebSocket (stake QoS may ask that its data
    /// wait: `hold_socket`).
    pub fn is_socket(&self, id: u32) -> bool {
        self.streams.get(&id).and_then(GateStream::socket).is_some()
    }

    /// Stake QoS asks that WebSocket `id`'s data wait (`hold`), or lets it
    /// go; it tries again at the next retry.
    pub fn hold_socket(&mut self, id: u32, hold: bool) {
        if let Some(ws) = self.streams.get_mut(&id).and_then(GateStream::socket_mut) {
            ws.hold_for_qos(hold);
        }
    }

    /// What WebSocket `id` has sent the node and had answered so far, for
    /// stake QoS (`cost::SOCKET_ANSWERED_PROPERTY`).
    pub fn socket_answered(&self, id: u32) -> Option<crate::cost::SocketAnswered> {
        Some(self.streams.get(&id)?.socket()?.answered())
    }

    /// The WebSockets waiting, whose QoS word the glue reads again before
    /// a tick's retry.
    pub fn waiting_sockets(&self) -> Vec<u32> {
        let streams = &self.streams;
        self.waiting
            .iter()
            .copied()
            .filter(|id| streams.get(id).and_then(GateStream::socket).is_some())
            .collect()
    }

    /// Stream `id`'s request trailers: a refusal, if its admission waited
    /// for them and the gate is full.
    pub fn request_trailers(&mut self, id: u32) -> Result<(), Rejection> {
        let now = &mut Now::lazy_us(self.clock);
        match self.streams.get_mut(&id) {
            Some(stream) => stream.request_trailers(&mut self.worker, &self.store, now),
            None => Ok(()),
        }
    }

    /// Stream `id`'s response headers (`header` reads one, only if
    /// needed): with `nodeTime`, the node's time on it to tell the filters
    /// before the gate (`node_time::NODE_US_PROPERTY`).
    pub fn response_headers(
        &mut self,
        id: u32,
        end_of_stream: bool,
        header: impl FnMut(&str) -> Option<String>,
    ) -> Option<u64> {
        let now = &mut Now::lazy_us(self.clock);
        let (w, store) = (&mut self.worker, &self.store);
        let stream = self.streams.get_mut(&id)?;
        let (released, node_us) = stream.response_headers(w, store, now, end_of_stream, header);
        if released {
            self.retry(false);
        }
        node_us
    }

    /// A piece of stream `id`'s response body: what the client gets instead
    /// of it, if the gate changed it, and whether to hold it until it is
    /// whole.
    pub fn response_body(
        &mut self,
        id: u32,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnResponse {
        let now = &mut Now::lazy_us(self.clock);
        let Some(stream) = self.streams.get_mut(&id) else {
            return OnResponse::default();
        };
        let w = &mut self.worker;
        let answered = stream.response_body(w, &self.store, now, size, end_of_stream, body);
        if answered.released {
            self.retry(false);
        }
        answered
    }

    /// Stream `id`'s response trailers.
    pub fn response_trailers(&mut self, id: u32) {
        let (w, store) = (&mut self.worker, &self.store);
        let released = self
            .streams
            .get_mut(&id)
            .is_some_and(|s| s.response_trailers(w, store));
        if released {
            self.retry(false);
        }
    }

    /// Stream `id` is over (done, reset, or its context dropped): what it
    /// holds goes back, and the streams waiting for a slot retry. Safe to
    /// call more than once.
    pub fn done(&mut self, id: u32) {
        self.worker.release_hold(id);
        if let Some(mut stream) = self.streams.remove(&id) {
            let now = &mut Now::lazy_us(self.clock);
            stream.done(&mut self.worker, &self.store, now);
            self.retry(false);
        }
    }

    /// Lets the streams waiting for a slot retry, oldest first: those that
    /// get their slots resume (or are closed, if they never can), requests
    /// that waited `nodeTime.waitMs` in vain are refused. Called from the
    /// root context (a tick, a wake), never in a stream's callback: a
    /// refusal is a local reply, which runs the refused stream's response
    /// through this VM's filters at once, and Envoy must not call into a
    /// VM from inside its own call.
    pub fn retry_waiting(&mut self) {
        self.retry(true);
    }

    /// `retry_waiting`; a slot freed in a stream's callback lets waiting
    /// streams go on (a resume runs only the filters after the gate), but
    /// refuses none (`expire` false: the next tick does).
    ///
    /// With nothing waiting here and requests allowed to wait, this VM's
    /// spare slots go back to the shared pool at once, for the other
    /// workers' waiters.
    fn retry(&mut self, expire: bool) {
        let now = &mut Now::lazy_us(self.clock);
        self.worker.give_lingering(now);
        let mut full = Full::expiring(expire);
        if self.slots_wait() && self.defer_to_first(now, expire) {
            // Another VM's first waiter goes before ours: its turn for slots.
            full.found(true);
        }
        // Priority requests (staked callers among them) first, each class
        // oldest first: an unstaked crowd waiting never goes before them.
        let streams = &self.streams;
        self.waiting
            .sort_by_key(|id| !streams.get(id).is_some_and(GateStream::priority));
        let mut i = 0;
        while i < self.waiting.len() {
            let id = self.waiting[i];
            let Some(stream) = self.streams.get_mut(&id) else {
                self.waiting.remove(i);
                continue;
            };
            match stream.settle(&mut self.worker, &self.store, now, &mut full) {
                Settled::ConnectionFull | Settled::GateFull => i += 1,
                Settled::Through(bytes) => {
                    self.todo.push(Do::Resume(id, bytes));
                    self.waiting.remove(i);
                }
                Settled::Refuse(refusal) => {
                    self.todo.push(Do::Answer(id, Reply::refusal(refusal)));
                    self.waiting.remove(i);
                }
                Settled::Checked(checked) => {
                    self.waiting.remove(i);
                    self.went_on(id, checked);
                }
            }
        }
        if self.slots_wait() {
            self.announce();
        }
    }

    /// Whether the glue retries the waiting streams at every tick: when
    /// some wait here, and whenever requests may wait for a slot, so that
    /// an idle VM hands its spare slots to VMs whose requests wait.
    pub fn retries_on_tick(&self) -> bool {
        !self.waiting.is_empty() || self.slots_wait() || self.worker.linger.held() > 0
    }

    /// The next callout to send from the root context: the head poll (as
    /// stream `HEAD_POLL`), if reads wait for one, then the leaders',
    /// skipping those whose stream ended first (it left its key to its
    /// waiters).
    pub fn next_callout(&mut self) -> Option<(u32, Callout)> {
        let upstream = self.worker.dedup.as_ref().map(|d| &d.policy().upstream);
        let poll = upstream
            .filter(|_| self.heads.held() > 0)
            .and_then(|u| self.heads.next(u, &self.worker.callout_target()));
        if let Some(poll) = poll {
            self.worker.counts.cache.head_polls += 1;
            return Some((HEAD_POLL, poll));
        }
        while let Some((id, callout)) = self.to_dispatch.pop_front() {
            let leads = self
                .streams
                .get_mut(&id)
                .and_then(GateStream::place)
                .is_some_and(|p| p.awaits_callout());
            if leads {
                return Some((id, callout));
            }
        }
        None
    }

    /// Stream `id`'s callout went out as `token`, or the host refused it
    /// (`Err`, its status as the host said it).
    pub fn sent(&mut self, id: u32, sent: Result<u32, String>) {
        if id == HEAD_POLL {
            // Refused: the reads it would have answered go on.
            let refused = self.heads.sent(sent.ok());
            if !refused.is_empty() {
                self.settle_heads(refused, None, false);
            }
            return;
        }
        match sent {
            Ok(token) => {
                let now_us = (self.clock)();
                if let Some(place) = self.streams.get_mut(&id).and_then(GateStream::place) {
                    self.coalescer.sent(&self.worker, token, place, now_us);
                }
            }
            Err(status) => self.coalesce(|c, w, store, now, held| {
                c.lead_refused(w, store, now, id, &status, held)
            }),
        }
    }

    /// The header in which the node says its time on an answer
    /// (`nodeTime.serviceTimeHeader`), read from callouts' answers too.
    pub fn service_time_header(&self) -> Option<&str> {
        let node_time = self.worker.gate.policy().node_time.as_ref()?;
        node_time.service_time_header.as_deref()
    }

    /// A callout ended (`None`: with no answer: reset, timeout, no
    /// upstream): the finality poll's, or a leader's, whose answer goes to
    /// every request waiting for it.
    pub fn callout_ended(&mut self, token: u32, response: Option<Response>) {
        if self.heads.is_poll(token) {
            let answer = response.map(|r| r.answer([0; KEY_LEN], Vec::new()));
            let (settled, head) = self.heads.ended(answer);
            return self.settle_heads(settled, head.as_ref(), true);
        }
        let body = response.as_ref().map(|r| r.body.as_slice());
        let now_ms = self.now_ms();
        if self
            .worker
            .finality_answered(&self.store, now_ms, token, body)
        {
            return;
        }
        self.coalesce(|c, w, store, now, held| {
            c.callout_ended(w, store, now, token, response, held)
        });
    }

    /// A message came on this VM's wake queue (an empty one is a wake-up
    /// to send callouts, which the root context does anyway).
    pub fn woken(&mut self, message: &[u8]) {
        if message == SLOT_WAKE {
            return self.retry_waiting();
        }
        if message.is_empty() {
            return;
        }
        self.coalesce(|c, w, store, now, held| c.woken(w, store, now, message, held));
    }

    /// A tick every `engage::TICK_MS`: with dedup, whether coalescing is
    /// engaged now, and the finality poll to send, if one is due.
    pub fn engage(&mut self, now_ms: u64) -> Option<(bool, Option<Callout>)> {
        self.worker.dedup.as_ref()?;
        // Ticks come faster when requests may wait for a slot.
        let tick_ms = crate::dedup::engage::TICK_MS;
        if now_ms.saturating_sub(self.last_engage_ms) + self.tick_ms() / 2 < tick_ms {
            return None;
        }
        self.last_engage_ms = now_ms;
        self.worker.engage(&self.store, now_ms);
        let poll = self.worker.finality_poll(&self.store, now_ms);
        Some((self.worker.dedup_engaged(), poll))
    }

    /// Whether the heartbeat's work is due at this tick (`tick_ms`): it
    /// runs once per `heartbeatMs`, give or take half a tick.
    pub fn heartbeat_due(&mut self, now_ms: u64) -> bool {
        let heartbeat_ms = self.worker.gate.policy().heartbeat_ms;
        if now_ms.saturating_sub(self.last_heartbeat_ms) + self.tick_ms() / 2 < heartbeat_ms {
            return false;
        }
        self.last_heartbeat_ms = now_ms;
        true
    }

    /// The heartbeat: the worker's (shard, spares, dedup sweep) and
    /// coalescing's (deadlines, lost wakes, stuck callouts). Returns what
    /// it found for the gauges.
    pub fn heartbeat(&mut self) -> Ticked {
        let ticked = self.worker.tick(&self.store, self.now_ms());
        self.coalesce(|c, w, store, now, held| c.heartbeat(w, store, now, held));
        ticked
    }

    /// The head poll these reads waited for ended (`head`: what it found;
    /// `polled`: it reached the node): each is answered, held for its
    /// pinned key's answer, or goes on; the calls they made at the node are
    /// counted (`Heads::judge`).
    fn settle_heads(&mut self, settled: Vec<u32>, head: Option<&ChainHead>, polled: bool) {
        let now = &mut Now::lazy_us(self.clock);
        let (reads, mut calls) = (settled.len() as u64, u64::from(polled));
        if head.is_none() {
            self.worker.counts.cache.head_failed += 1;
        }
        for id in settled {
            let Some(stream) = self.streams.get_mut(&id) else {
                continue;
            };
            let Some(place) = stream.place() else {
                continue;
            };
            let checked = place.at_head(&mut self.worker, &self.store, now, head);
            calls += u64::from(matches!(checked, Checked::Continue | Checked::Lead(_)));
            self.went_on(id, checked);
        }
        self.heads.judge(reads, calls);
    }

    /// Held stream `id` goes on as dedup's check found (`checked`): through
    /// the route, held for an answer, leading its key, answered, refused.
    fn went_on(&mut self, id: u32, checked: Checked) {
        match checked {
            Checked::Continue => self.todo.push(Do::Resume(id, None)),
            Checked::Hold => self.coalesced.push(id),
            Checked::Lead(callout) => {
                self.coalesced.push(id);
                self.to_dispatch.push_back((id, callout));
                self.todo.push(Do::Poke);
            }
            Checked::Answer(reply) => {
                if let Some(stream) = self.streams.get_mut(&id) {
                    stream.answered_here();
                }
                self.todo.push(Do::Answer(id, reply));
            }
            Checked::Refuse(refusal) => self.todo.push(Do::Answer(id, Reply::refusal(refusal))),
        }
    }

    /// Runs a coalescing step over the streams held for an answer, oldest
    /// first, and queues what it decided.
    fn coalesce(
        &mut self,
        step: impl FnOnce(&mut Coalescer, &mut GateWorker, &S, &mut Now, &mut [Held<'_>]) -> Acts,
    ) {
        let now = &mut Now::lazy_us(self.clock);
        let coalesced = &self.coalesced;
        let mut by_id: HashMap<u32, &mut GateStream> = self
            .streams
            .iter_mut()
            .filter(|(id, _)| coalesced.contains(id))
            .map(|(id, s)| (*id, s))
            .collect();
        let mut held: Vec<Held<'_>> = coalesced
            .iter()
            .filter_map(|id| Some((*id, by_id.remove(id)?.place()?)))
            .collect();
        let acts = step(
            &mut self.coalescer,
            &mut self.worker,
            &self.store,
            now,
            &mut held,
        );
        drop(held);
        if let Some(message) = acts.wake {
            self.wake_peers(now.ms(), message);
        }
        for (id, act) in acts.acts {
            match act {
                Act::Answer(reply) => {
                    if let Some(stream) = self.streams.get_mut(&id) {
                        stream.answered_here();
                    }
                    self.todo.push(Do::Answer(id, reply));
                }
                Act::Resume => self.todo.push(Do::Resume(id, None)),
                Act::Dispatch(callout) => self.to_dispatch.push_back((id, callout)),
            }
        }
        let streams = &self.streams;
        self.coalesced
            .retain(|id| streams.get(id).is_some_and(GateStream::coalesced));
    }

    /// Queues `message` for every other live gate VM.
    fn wake_peers(&mut self, now_ms: u64, message: Vec<u8>) {
        let (Some(dedup), Some(me)) = (self.worker.dedup.as_ref(), self.worker.gate.vm()) else {
            return;
        };
        let peers = dedup.peers(&self.store, me, now_ms);
        self.todo.push(Do::Wake(peers, message));
    }

    /// This VM's wake queue's name, once dedup is on and its VM number
    /// known.
    pub fn wake_queue(&self) -> Option<String> {
        if self.worker.dedup.is_none() && !self.slots_wait() {
            return None;
        }
        self.worker.gate.vm().map(crate::dedup::wake_queue)
    }

    /// The plugin is being deleted: spare slots go back at once.
    pub fn leave(&mut self) {
        self.worker.leave(&self.store, self.now_ms());
    }
}

#[cfg(test)]
mod tests;
mod waiters;
