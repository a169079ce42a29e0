//! One request's way through stake QoS, as the filter's stream sees it:
//! headers (admit or throttle; an admitted upgrade leaves the requests in
//! flight), body (a batch's other calls, or the calls sent on a WebSocket,
//! are charged), response headers (the upstream's status, in reactive mode)
//! and done (the request ends locally). Each step returns what the glue
//! must do or record, so the glue only makes host calls.
//!
//! With `decideOnBody`, a request with a body is admitted when the body is
//! whole (or its trailers arrive), so that a 429 answers each call by its
//! `id`; the identity is still read with the headers.
//!
//! Far below the threshold a request is only counted (`light`): no
//! identity, no body read, no clock read; its body's size gives its calls'
//! bound.

use super::identity::{anonymous, identify, staked_by_key, Identity};
use super::ledger::Named;
use super::light::BodyBound;
use super::page::MILLI;
use super::policy::Mode;
use super::socket::{Charged, Socket};
use super::{Admission, Connection, StakeQos, Throttled, Ticket, Verdict};
use crate::clock::Now;
use crate::cost::SocketAnswered;
use crate::cost::Unit;
use crate::jsonrpc;
use crate::rejection::Rule;
use crate::request::{Body, RequestFacts};
use crate::shared::{SharedStore, StoreError};

/// What an admission decided, and what the glue records of it.
#[derive(Debug)]
pub struct Decided {
    /// Answer with this 429 instead of continuing.
    pub throttled: Option<Throttled>,
    /// The identity's tier (for the per-tier counters).
    pub tier: usize,
    /// A shared-bucket lease was taken.
    pub leased: bool,
    pub cas_retries: u32,
    /// An identity was evicted from the shared table to make room.
    pub evicted: bool,
    /// Shared data failed; the request was admitted without a token.
    pub store_error: Option<StoreError>,
}

/// What a piece of request body asks of the glue.
#[derive(Debug, Default)]
pub struct OnBody {
    /// The admission, when this piece completed a body it waited for.
    pub decided: Option<Decided>,
    /// Hold the body until it is whole (the admission waits for it).
    pub hold: bool,
    /// Calls read on a WebSocket.
    pub websocket_calls: u32,
    /// On a WebSocket, what charging its calls did (whether the gate is
    /// to hold its data: `socket`).
    pub socket: Option<Charged>,
}

/// An admitted upgrade.
#[derive(Debug)]
enum Upgraded {
    /// A WebSocket: its calls are the identity's (`socket`). Boxed: the
    /// plain request is the hot path.
    Websocket(Box<Socket>),
    /// Another protocol: unread.
    Tunnel(Connection),
}

/// One stream's state in stake QoS.
#[derive(Debug, Default)]
pub struct QosStream {
    /// An admitted request in flight.
    ticket: Option<Ticket>,
    /// A request whose admission waits for its whole body.
    waiting: Option<Identity>,
    /// The body was looked at for a batch.
    charged: bool,
    upstream_status: Option<u32>,
    /// An admitted upgrade: not in flight; a WebSocket's calls are read
    /// from its client frames.
    upgraded: Option<Upgraded>,
    /// Counted without an identity (`light`).
    counted: bool,
    /// Counted, with the staked identity its API key names: the usage
    /// ledger counts its calls and refusals under that name.
    counted_as: Option<Named>,
    /// The rule that refused it further on, as its answer said.
    refused_by: Option<Rule>,
    /// The bound of its calls counted so far.
    bound: BodyBound,
    /// Its caller is in the stake table (the gate's `staked` matcher).
    staked: bool,
}

impl QosStream {
    /// Request headers: the identity, then the admission (`None` while it
    /// waits for the body). An admitted request whose headers do not end it
    /// may be an upgrade (one header read): a WebSocket leaves the
    /// identity's requests in flight at once.
    pub fn headers(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
        facts: &mut impl RequestFacts,
        end_of_stream: bool,
    ) -> Option<Decided> {
        let upgrade = (!end_of_stream).then(|| facts.header("upgrade")).flatten();
        if upgrade.is_none() && qos.counting() {
            self.counted = true;
            let by_key = staked_by_key(qos.policy(), facts);
            self.staked = by_key.is_some();
            self.counted_as = by_key.and_then(|i| Some((i.key, i.name?)));
            qos.count(self.bound.at_least_one(), true, self.counted_as.as_ref());
            return None;
        }
        qos.bound(self.bound.at_least_one());
        let identity = identify(qos.policy(), facts).unwrap_or_else(|| anonymous(qos.policy()));
        self.staked = identity.staked;
        if upgrade.is_none() && !end_of_stream && qos.policy().decide_on_body {
            self.waiting = Some(identity);
            return None;
        }
        let (mut decided, ticket) = admit(qos, store, now.us(), &identity);
        if let Some(ticket) = ticket {
            match upgrade {
                Some(upgrade) => match qos.upgraded(ticket) {
                    Ok(connection) => {
                        self.upgraded = Some(match upgrade.eq_ignore_ascii_case("websocket") {
                            true => {
                                Upgraded::Websocket(Box::new(Socket::new(connection, identity)))
                            }
                            false => Upgraded::Tunnel(connection),
                        });
                    }
                    Err(throttled) => decided.throttled = Some(throttled),
                },
                None => self.ticket = Some(ticket),
            }
        }
        Some(decided)
    }

    /// A piece of request body, `size` bytes. A request waiting for its
    /// admission is held until its body is whole, then admitted; a 429
    /// answers its calls. A batch is charged the calls it holds beyond the
    /// first (behind the buffer filter of the shipped configs the body is
    /// whole here; a body streamed in pieces is charged what its first
    /// piece holds). On a WebSocket, the calls the piece completes are
    /// charged.
    pub fn body(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
        size: usize,
        end_of_stream: bool,
        body: &mut impl Body,
    ) -> OnBody {
        match &mut self.upgraded {
            Some(Upgraded::Websocket(socket)) => {
                let (calls, charged) = socket.read(qos, store, now.us(), body, size);
                return OnBody {
                    websocket_calls: calls,
                    socket: Some(charged),
                    ..OnBody::default()
                };
            }
            Some(Upgraded::Tunnel(_)) => return OnBody::default(),
            None => {}
        }
        let more = self.bound.grow(size);
        if self.counted {
            qos.count(more, false, None);
            // A staked key's calls, for its ledger row: a batch's are read
            // once (behind the shipped configs' buffer the body is whole).
            if let Some(named) = &self.counted_as {
                if !std::mem::replace(&mut self.charged, true) && size > 0 {
                    qos.count_calls_of(named, batch_calls(body, size));
                }
            }
            return OnBody::default();
        }
        qos.bound(more);
        let mut decided = None;
        if self.waiting.is_some() && !end_of_stream {
            return OnBody {
                hold: true,
                ..OnBody::default()
            };
        }
        if let Some(identity) = self.waiting.take() {
            let mut admitted = self.admit(qos, store, now.us(), &identity);
            admitted.throttled = admitted.throttled.map(|t| Throttled {
                rejection: t.rejection.answering(&body.read(0, size)),
                ..t
            });
            decided = Some(admitted);
        }
        if let Some(ticket) = &mut self.ticket {
            if !std::mem::replace(&mut self.charged, true) && size > 0 {
                charge(qos, ticket, size, body);
            }
        }
        OnBody {
            decided,
            ..OnBody::default()
        }
    }

    /// Request trailers end the request: an admission waiting for the body
    /// is made now (a 429 answers `id: null`).
    pub fn trailers(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Option<Decided> {
        let identity = self.waiting.take()?;
        Some(self.admit(qos, store, now.us(), &identity))
    }

    fn admit(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now_us: u64,
        identity: &Identity,
    ) -> Decided {
        let (decided, ticket) = admit(qos, store, now_us, identity);
        self.ticket = ticket;
        decided
    }

    /// Response headers: in reactive mode the upstream's status (503 and
    /// 429 are back-pressure); in the node-time unit, the status and the
    /// time the request took until them (`told_us`: as the admission gate
    /// told it, `cost::NODE_US_PROPERTY`). The status is read only then. In
    /// node time a request counted without an identity reads nothing. With
    /// the usage ledger on, an identified request's answer (or a counted
    /// one's its staked key named) is asked which
    /// rule refused it further on (`rule`, the gate's `x-stakegate-rule`):
    /// if the status was read, only for a 429 or a 503. A shadow does not
    /// ask: its ledger is what it would refuse itself.
    pub fn response_headers(
        &mut self,
        qos: &StakeQos,
        now: &mut Now,
        status: impl FnOnce() -> Option<u32>,
        told_us: impl FnOnce() -> Option<u64>,
        rule: impl FnOnce() -> Option<String>,
    ) {
        let unit = qos.policy().costs.unit;
        if self.counted && unit == Unit::NodeTime && self.counted_as.is_none() {
            return;
        }
        let node_time = unit == Unit::NodeTime && self.ticket.is_some();
        let status_read = qos.policy().mode == Mode::Reactive || node_time;
        if status_read {
            self.upstream_status = status();
        }
        if (self.ticket.is_some() || self.counted_as.is_some())
            && qos.policy().usage_on()
            && !qos.policy().shadow
            && (!status_read || matches!(self.upstream_status, Some(429 | 503)))
        {
            self.refused_by = rule().as_deref().and_then(Rule::from_name);
        }
        if let (Some(ticket), true) = (&mut self.ticket, node_time) {
            let took_us = told_us().unwrap_or_else(|| now.us().saturating_sub(ticket.started_us));
            qos.answered(ticket, took_us, self.upstream_status);
        }
    }

    /// The stream is over: the request ends locally (its place in flight
    /// and its latency, and a refusal further on in the usage ledger), or
    /// an upgraded connection gives back its WebSocket place. Safe to call
    /// more than once.
    pub fn done(&mut self, qos: &mut StakeQos, now: &mut Now) {
        if let (Some(named), Some(rule)) = (self.counted_as.take(), self.refused_by) {
            qos.counted_refused_further(&named, rule);
        }
        if let Some(ticket) = self.ticket.take() {
            if let Some(rule) = self.refused_by.take() {
                qos.refused_further(ticket.key, rule);
            }
            qos.finish(now.ms(), ticket, self.upstream_status);
        }
        match self.upgraded.take() {
            Some(Upgraded::Websocket(socket)) => socket.close(qos),
            Some(Upgraded::Tunnel(connection)) => qos.closed(connection),
            None => {}
        }
    }

    /// At a tick, a WebSocket whose data the gate holds for its identity's
    /// share: its calls go on if they may now (`None`: it is no WebSocket,
    /// or not held).
    pub fn socket_tick(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now: &mut Now,
    ) -> Option<Charged> {
        match &mut self.upgraded {
            Some(Upgraded::Websocket(socket)) if socket.holding() => {
                Some(socket.tick(qos, store, now.us()))
            }
            _ => None,
        }
    }

    /// Whether its caller is in the stake table, as its headers said: the
    /// glue tells the gate (`request::STAKED_PROPERTY`).
    pub fn staked(&self) -> bool {
        self.staked
    }

    /// Its identity's key, when its headers named one (QoS identifies
    /// callers unless it only counts): the glue tells the gate, which
    /// bounds an identity's subscriptions and held requests by it
    /// (`request::IDENTITY_PROPERTY`).
    pub fn identity_key(&self) -> Option<u64> {
        match &self.upgraded {
            Some(Upgraded::Websocket(socket)) => Some(socket.identity_key()),
            Some(Upgraded::Tunnel(_)) => None,
            None => self
                .ticket
                .as_ref()
                .map(|t| t.key)
                .or_else(|| self.waiting.as_ref().map(|i| i.key)),
        }
    }

    /// Whether it is a WebSocket (its answers are read: `socket_answered`).
    pub fn is_socket(&self) -> bool {
        matches!(self.upgraded, Some(Upgraded::Websocket(_)))
    }

    /// The admission gate says what the node has answered on this
    /// WebSocket so far (`socket`).
    pub fn socket_answered(&mut self, qos: &mut StakeQos, now: &mut Now, total: SocketAnswered) {
        if let Some(Upgraded::Websocket(socket)) = &mut self.upgraded {
            socket.answered(qos, now.us(), total);
        }
    }
}

/// Charges an admitted request what its body holds: in calls, a batch's
/// other calls; in another unit, its calls' costs.
fn charge(qos: &mut StakeQos, ticket: &mut Ticket, size: usize, body: &mut impl Body) {
    if qos.policy().costs.unit == Unit::Calls {
        let calls = batch_calls(body, size);
        if calls > 1 {
            qos.charge(ticket, calls);
        }
        return;
    }
    let cost = qos
        .policy()
        .costs
        .of_body(&body.read(0, size), qos.learned());
    qos.charge_cost(
        ticket,
        (cost.units * MILLI as f64) as i64,
        cost.calls,
        cost.method,
    );
}

/// The calls a body of `size` bytes holds: a batch's (read whole only if
/// its first bytes open an array), else 1.
fn batch_calls(body: &mut impl Body, size: usize) -> u32 {
    let head = body.read(0, size.min(64));
    match head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        true => jsonrpc::calls(&body.read(0, size)),
        false => 1,
    }
}

/// Admits `identity`'s request: what was decided, and the ticket if it
/// was admitted.
fn admit(
    qos: &mut StakeQos,
    store: &impl SharedStore,
    now_us: u64,
    identity: &Identity,
) -> (Decided, Option<Ticket>) {
    let Admission {
        verdict,
        leased,
        cas_retries,
        evicted,
        store_error,
    } = qos.admit_at(store, now_us, identity);
    let (throttled, ticket) = match verdict {
        Verdict::Admit(ticket) => (None, Some(ticket)),
        Verdict::Throttle(throttled) => (Some(throttled), None),
    };
    let decided = Decided {
        throttled,
        tier: identity.tier,
        leased,
        cas_retries,
        evicted,
        store_error,
    };
    (decided, ticket)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qos::policy::QosPolicy;
    use crate::request::MetadataScope;
    use crate::shared::MemoryStore;
    use std::net::IpAddr;

    /// A client at one address whose request has `headers`.
    struct Client(&'static [(&'static str, &'static str)]);

    impl RequestFacts for Client {
        fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
            None
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            "192.0.2.7".parse().ok()
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            None
        }
        fn header(&mut self, name: &str) -> Option<String> {
            let found = self.0.iter().find(|(n, _)| *n == name);
            found.map(|(_, v)| v.to_string())
        }
    }

    struct Bytes(Vec<u8>);

    impl Body for Bytes {
        fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
            self.0.get(start..start + len).unwrap_or_default().to_vec()
        }
    }

    /// A masked client text frame holding `text`.
    fn frame(text: &str) -> Vec<u8> {
        let mut out = vec![0x81, 0x80 | text.len() as u8, 0, 0, 0, 0];
        out.extend_from_slice(text.as_bytes());
        out
    }

    #[test]
    fn a_websocket_is_not_in_flight_and_its_calls_are_counted() {
        let store = MemoryStore::default();
        let mut qos = StakeQos::new(QosPolicy::parse(br#"{"capacityRps": 100}"#).unwrap(), 1);
        let mut socket = QosStream::default();
        let upgrade = &[("upgrade", "websocket")];
        let decided = socket.headers(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            &mut Client(upgrade),
            false,
        );
        assert!(decided.is_some_and(|d| d.throttled.is_none()));
        assert!(socket.ticket.is_none() && socket.upgraded.is_some());
        let two = [
            frame(r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#),
            frame(r#"{"jsonrpc":"2.0","id":2,"method":"eth_chainId"}"#),
        ]
        .concat();
        let size = two.len();
        let step = socket.body(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            size,
            false,
            &mut Bytes(two),
        );
        assert_eq!(step.websocket_calls, 2);

        // A plain POST is in flight until done, and a batch is charged.
        let mut post = QosStream::default();
        post.headers(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            &mut Client(&[]),
            false,
        );
        assert!(post.ticket.is_some() && post.upgraded.is_none());
        let batch = br#"[{"id":1,"method":"a"},{"id":2,"method":"b"}]"#.to_vec();
        let step = post.body(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            batch.len(),
            true,
            &mut Bytes(batch),
        );
        assert_eq!(step.websocket_calls, 0);
        assert!(step.decided.is_none() && !step.hold);
        post.done(&mut qos, &mut Now::fixed(5));
        post.done(&mut qos, &mut Now::fixed(6));
        assert!(post.ticket.is_none());
    }

    #[test]
    fn deciding_on_the_body_answers_each_call_of_a_throttled_batch() {
        let store = MemoryStore::default();
        let policy = br#"{"capacityRps": 100, "decideOnBody": true}"#;
        let mut qos = StakeQos::new(QosPolicy::parse(policy).unwrap(), 1);
        qos.state.throttling = true;
        let batch =
            br#"[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","id":2,"method":"b"}]"#;
        let mut answers = Vec::new();
        for _ in 0..20 {
            let mut post = QosStream::default();
            assert!(post
                .headers(
                    &mut qos,
                    &store,
                    &mut Now::fixed(0),
                    &mut Client(&[]),
                    false
                )
                .is_none());
            let held = post.body(
                &mut qos,
                &store,
                &mut Now::fixed(0),
                10,
                false,
                &mut Bytes(batch.to_vec()),
            );
            assert!(held.hold && held.decided.is_none(), "held until whole");
            let end = post.body(
                &mut qos,
                &store,
                &mut Now::fixed(0),
                batch.len(),
                true,
                &mut Bytes(batch.to_vec()),
            );
            assert!(!end.hold);
            answers.push(end.decided.expect("decided at the end").throttled);
            post.done(&mut qos, &mut Now::fixed(1));
        }
        let refused = answers
            .iter()
            .flatten()
            .next()
            .expect("some were throttled");
        let body: Vec<serde_json::Value> = serde_json::from_str(&refused.rejection.body).unwrap();
        let ids: Vec<_> = body.iter().map(|e| e["id"].as_i64()).collect();
        assert_eq!(ids, [Some(1), Some(2)]);

        // Trailers end a request that waited.
        let mut trailed = QosStream::default();
        trailed.headers(
            &mut qos,
            &store,
            &mut Now::fixed(0),
            &mut Client(&[]),
            false,
        );
        assert!(trailed
            .trailers(&mut qos, &store, &mut Now::fixed(0))
            .is_some());
        assert!(
            trailed
                .trailers(&mut qos, &store, &mut Now::fixed(0))
                .is_none(),
            "once"
        );
    }

    /// QoS with one staked API key, `k`, named `name`, counting or not.
    fn keyed_qos(name: &str, counting: bool) -> StakeQos {
        let policy = format!(
            r#"{{"capacityRps": 1000, "stakes": [{{"apiKeySha256": "{}", "name": "{name}", "stake": 100}}]}}"#,
            crate::request::sha256_hex(b"k")
        );
        let mut qos = StakeQos::new(QosPolicy::parse(policy.as_bytes()).unwrap(), 1);
        qos.counting = counting;
        qos
    }

    /// Whether a request with `key` (an `x-api-key`) is staked as QoS
    /// tells the gate, while it identifies requests and while it only
    /// counts them; and the headers it read.
    #[test]
    fn a_staked_caller_is_told_to_the_gate_even_while_requests_are_only_counted() {
        let store = MemoryStore::default();
        for counting in [false, true] {
            let mut qos = keyed_qos("s", counting);
            for (headers, staked) in [
                (&[("x-api-key", "k")][..], true),
                (&[("x-api-key", "other")][..], false),
                (&[][..], false),
            ] {
                let mut stream = QosStream::default();
                stream.headers(
                    &mut qos,
                    &store,
                    &mut Now::fixed(0),
                    &mut Client(headers),
                    true,
                );
                assert_eq!(stream.staked(), staked, "{headers:?}, counting {counting}");
            }
        }
    }

    /// While QoS only counts, a request whose API key is in the stake table
    /// is counted in the usage ledger under that identity's name: its
    /// batch's calls (its body is read for them, a key's requests only),
    /// and the gate's refusal further on. No address or clock is read, and
    /// no identity is made for decisions.
    #[test]
    fn while_qos_counts_a_staked_keys_requests_are_in_the_ledger_by_its_name() {
        let store = MemoryStore::default();
        let mut qos = keyed_qos("desk", true);
        let mut now = Now::lazy_us(|| panic!("no clock read"));
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"eth_chainId"},{"jsonrpc":"2.0","id":2,"method":"eth_chainId"},{"jsonrpc":"2.0","id":3,"method":"eth_chainId"}]"#;
        for (headers, refused) in [
            (&[("x-api-key", "k")][..], Some("gate-inflight")),
            (&[("x-api-key", "k")][..], None),
            (&[("x-api-key", "other")][..], None),
        ] {
            let mut stream = QosStream::default();
            let mut client = Client(headers);
            assert!(stream
                .headers(&mut qos, &store, &mut now, &mut client, false)
                .is_none());
            let mut body = Bytes(batch.to_vec());
            stream.body(&mut qos, &store, &mut now, batch.len(), true, &mut body);
            stream.response_headers(
                &qos,
                &mut now,
                || panic!("no status read"),
                || panic!("the gate's node time is not read"),
                || refused.map(str::to_string),
            );
            stream.done(&mut qos, &mut now);
        }
        assert!(!now.was_read());
        assert_eq!(qos.local_identities(), 0, "nothing to decide by");
        let by_label = qos.usage(&store, 1000).unwrap().unwrap();
        let desk = &by_label["desk"];
        assert_eq!((desk.requests, desk.calls), (2, 6), "{by_label:?}");
        assert_eq!(desk.share_rps, f64::INFINITY, "not limited");
        let gate = Rule::ALL.iter().position(|r| *r == Rule::GateInflight);
        assert_eq!(desk.refused[gate.unwrap()], 1);
        assert_eq!(by_label["unidentified"].requests, 1);
    }

    /// Facts that count what is asked of them.
    #[derive(Default)]
    struct Watched {
        headers: Vec<String>,
        addresses: u32,
    }

    impl RequestFacts for Watched {
        fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
            None
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            self.addresses += 1;
            "192.0.2.7".parse().ok()
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            None
        }
        fn header(&mut self, name: &str) -> Option<String> {
            self.headers.push(name.to_string());
            None
        }
    }

    /// A body that must not be read.
    struct Unread;

    impl Body for Unread {
        fn read(&mut self, _: usize, _: usize) -> Vec<u8> {
            panic!("a counted request's body is not read")
        }
    }

    /// A request of 95 bytes in two pieces counted under `policy`, to its
    /// end, asked nothing but whether it upgrades (not even the gate's
    /// node time).
    fn counted(policy: &[u8]) -> StakeQos {
        let store = MemoryStore::default();
        let mut qos = StakeQos::new(QosPolicy::parse(policy).unwrap(), 1);
        qos.counting = true;
        let mut facts = Watched::default();
        let mut now = Now::lazy_us(|| panic!("no clock read"));
        let mut post = QosStream::default();
        assert!(post
            .headers(&mut qos, &store, &mut now, &mut facts, false)
            .is_none());
        assert!(post
            .body(&mut qos, &store, &mut now, 40, false, &mut Unread)
            .decided
            .is_none());
        post.body(&mut qos, &store, &mut now, 95, true, &mut Unread);
        post.response_headers(
            &qos,
            &mut now,
            || panic!("no status read"),
            || panic!("the gate's node time is not read"),
            || panic!("no rule read"),
        );
        post.done(&mut qos, &mut now);
        assert!(!now.was_read());
        assert_eq!(facts.addresses, 0);
        assert_eq!(facts.headers, ["upgrade"], "only whether it upgrades");
        qos
    }

    #[test]
    fn a_counted_request_is_neither_identified_nor_timed_nor_read() {
        let mut qos = counted(br#"{"capacityRps": 1000}"#);
        // 95 bytes: at most 4 calls, the first counted at the headers.
        assert_eq!(
            (qos.counted, qos.bound, qos.take_counted_requests()),
            (4, 0, 1)
        );
        assert_eq!(qos.local_identities(), 0);
        // The usage ledger has it, as unidentified.
        let by_label = qos.usage(&MemoryStore::default(), 1000).unwrap().unwrap();
        assert_eq!(by_label["unidentified"].requests, 1);

        // An upgrade is identified all the same (its allowance is per
        // identity), and so is everything once QoS identifies.
        let mut socket = QosStream::default();
        let decided = socket.headers(
            &mut qos,
            &MemoryStore::default(),
            &mut Now::fixed(0),
            &mut Client(&[("upgrade", "websocket")]),
            false,
        );
        assert!(decided.is_some() && qos.local_identities() == 1);
    }

    #[test]
    fn in_node_time_a_counted_request_is_bounded_by_its_calls_at_the_dearest_cost() {
        let policy = br#"{"capacityNodeMs": 4000, "costs": {"eth_getLogs": 20}}"#;
        let mut qos = counted(policy);
        // At most 4 calls, each at most 20 ms (the table's dearest, above
        // the 10 ms default), in µs.
        assert_eq!(
            (qos.counted, qos.bound, qos.take_counted_requests()),
            (80_000, 0, 1)
        );
    }
}
