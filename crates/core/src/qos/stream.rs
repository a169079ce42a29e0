//! One request's way through stake QoS, as the filter's stream sees it:
//! headers (admit or throttle; an admitted upgrade leaves the requests in
//! flight), body (a batch's other calls, or the calls sent on a WebSocket,
//! are charged), response headers (the upstream's status, in reactive mode)
//! and done (the request ends locally). Each step returns what the glue
//! must do or record, so the glue only makes host calls.

use super::identity::{anonymous, identify};
use super::policy::Mode;
use super::{Admission, Connection, StakeQos, Throttled, Ticket, Verdict};
use crate::jsonrpc;
use crate::request::{Body, RequestFacts};
use crate::shared::{SharedStore, StoreError};
use crate::websocket::{FrameReader, Side};

/// What the request headers decided, and what the glue records of it.
#[derive(Debug)]
pub struct OnHeaders {
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

/// One stream's state in stake QoS.
#[derive(Debug, Default)]
pub struct QosStream {
    /// An admitted request in flight.
    ticket: Option<Ticket>,
    /// The body was looked at for a batch.
    charged: bool,
    upstream_status: Option<u32>,
    /// An admitted upgrade: not in flight; a WebSocket's calls are read
    /// from its client frames.
    upgraded: Option<(Connection, Option<FrameReader>)>,
}

impl QosStream {
    /// Request headers: the identity, then the admission. An admitted
    /// request whose headers do not end it may be an upgrade (one header
    /// read): a WebSocket leaves the identity's requests in flight at once.
    pub fn headers(
        &mut self,
        qos: &mut StakeQos,
        store: &impl SharedStore,
        now_ms: u64,
        facts: &mut impl RequestFacts,
        end_of_stream: bool,
    ) -> OnHeaders {
        let identity = identify(qos.policy(), facts).unwrap_or_else(|| anonymous(qos.policy()));
        let Admission {
            verdict,
            leased,
            cas_retries,
            evicted,
            store_error,
        } = qos.admit(store, now_ms, &identity);
        let throttled = match verdict {
            Verdict::Admit(ticket) => {
                let upgrade = (!end_of_stream).then(|| facts.header("upgrade")).flatten();
                match upgrade {
                    Some(upgrade) => {
                        let reader = upgrade
                            .eq_ignore_ascii_case("websocket")
                            .then(|| FrameReader::new(Side::Client));
                        self.upgraded = Some((qos.upgraded(ticket), reader));
                    }
                    None => self.ticket = Some(ticket),
                }
                None
            }
            Verdict::Throttle(throttled) => Some(throttled),
        };
        OnHeaders {
            throttled,
            tier: identity.tier,
            leased,
            cas_retries,
            evicted,
            store_error,
        }
    }

    /// A piece of request body, `size` bytes. A batch is charged the calls
    /// it holds beyond the first (behind the buffer filter of the shipped
    /// configs the body is whole here; a body streamed in pieces is charged
    /// what its first piece holds). On a WebSocket, the calls the piece
    /// completes are charged; returns how many.
    pub fn body(&mut self, qos: &mut StakeQos, size: usize, body: &mut impl Body) -> u32 {
        if let Some((connection, reader)) = &mut self.upgraded {
            let Some(reader) = reader else {
                return 0;
            };
            let messages = reader.feed(&body.read(0, size));
            let calls = messages.requests + messages.notifications;
            if calls > 0 {
                qos.charge_calls(connection, calls);
            }
            return calls;
        }
        let Some(ticket) = &self.ticket else {
            return 0;
        };
        if std::mem::replace(&mut self.charged, true) || size == 0 {
            return 0;
        }
        let head = body.read(0, size.min(64));
        if head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
            qos.charge(ticket, jsonrpc::calls(&body.read(0, size)));
        }
        0
    }

    /// Response headers: in reactive mode the upstream's status (503 and
    /// 429 are back-pressure), read only then.
    pub fn response_headers(&mut self, qos: &StakeQos, status: impl FnOnce() -> Option<u32>) {
        if qos.policy().mode == Mode::Reactive {
            self.upstream_status = status();
        }
    }

    /// The stream is over: the request ends locally (its place in flight
    /// and its latency). Safe to call more than once.
    pub fn done(&mut self, qos: &mut StakeQos, now_ms: u64) {
        if let Some(ticket) = self.ticket.take() {
            qos.finish(now_ms, ticket, self.upstream_status);
        }
    }
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
        let decided = socket.headers(&mut qos, &store, 0, &mut Client(upgrade), false);
        assert!(decided.throttled.is_none());
        assert!(socket.ticket.is_none() && socket.upgraded.is_some());
        let two = [
            frame(r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"}"#),
            frame(r#"{"jsonrpc":"2.0","id":2,"method":"eth_chainId"}"#),
        ]
        .concat();
        let size = two.len();
        assert_eq!(socket.body(&mut qos, size, &mut Bytes(two)), 2);

        // A plain POST is in flight until done, and a batch is charged.
        let mut post = QosStream::default();
        post.headers(&mut qos, &store, 0, &mut Client(&[]), false);
        assert!(post.ticket.is_some() && post.upgraded.is_none());
        let batch = br#"[{"id":1,"method":"a"},{"id":2,"method":"b"}]"#.to_vec();
        assert_eq!(post.body(&mut qos, batch.len(), &mut Bytes(batch)), 0);
        post.done(&mut qos, 5);
        post.done(&mut qos, 6);
        assert!(post.ticket.is_none());
    }
}
