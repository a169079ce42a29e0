//! The one shape every stakegate rejection has, whichever filter sends it:
//! a status, a jittered `retry-after`, any headers of its own, and a
//! JSON-RPC 2.0 error body with code -32005 (or -32600 for a request that
//! is wrong rather than early). A rejection made before the body was read
//! has `id: null`; once the body is known (`Rejection::answering`) it
//! answers the request's own `id`, and a batch gets an array with one error
//! per call, each with its call's `id`.
//!
//! Every rejection says why: the `Rule` that refused it and what that rule
//! knew (`Fact`s: the identity's configured name, its share and rate, the
//! requests in flight against the limit), in the error's `data` and in
//! `x-stakegate-*` headers (policies/refusals.md).

use crate::jsonrpc::Request;

/// A request stakegate answers itself instead of passing on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u32,
    /// Seconds for `retry-after`; 0 for a request that is wrong rather than
    /// early (no `retry-after` is sent).
    pub retry_after_s: u32,
    /// Headers beyond `content-type` and `retry-after` (QoS's
    /// `RateLimit-Policy` and `RateLimit`).
    pub headers: Vec<(&'static str, String)>,
    /// The JSON-RPC error's code and message.
    pub code: i32,
    pub message: &'static str,
    /// The limit that refused it.
    pub rule: Rule,
    /// The error's `data` object, rendered: the rule, `retryAfter` and the
    /// facts.
    pub data: String,
    pub body: String,
}

/// The header that names the refusing rule.
pub const RULE_HEADER: &str = "x-stakegate-rule";

/// Which limit refused a request: `data.rule` and `x-stakegate-rule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// QoS: the identity is over its stake share.
    StakeShare,
    /// QoS: the identity has its concurrency allowance in flight.
    Concurrency,
    /// QoS: the identity has `websocketsPerIdentity` WebSockets open.
    Websockets,
    /// The gate: the node has its in-flight limit.
    GateInflight,
    /// The gate: `maxWebsocketConnections` connections are open.
    GateWebsockets,
    /// The gate's coalescing: too many identical requests are waiting.
    DedupWaiters,
    /// The gate: a socket or an identity has its subscriptions open.
    Subscriptions,
    /// The gate: its worker, or the caller's identity on it, has as many
    /// requests held at the gateway as it may (`gate::holds`).
    Held,
    /// The request can never be served as sent.
    InvalidRequest,
}

impl Rule {
    pub const ALL: [Rule; 9] = [
        Rule::StakeShare,
        Rule::Concurrency,
        Rule::Websockets,
        Rule::GateInflight,
        Rule::GateWebsockets,
        Rule::DedupWaiters,
        Rule::Subscriptions,
        Rule::Held,
        Rule::InvalidRequest,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rule::StakeShare => "stake-share",
            Rule::Concurrency => "concurrency",
            Rule::Websockets => "websockets",
            Rule::GateInflight => "gate-inflight",
            Rule::GateWebsockets => "gate-websockets",
            Rule::DedupWaiters => "dedup-waiters",
            Rule::Subscriptions => "subscriptions",
            Rule::Held => "held",
            Rule::InvalidRequest => "invalid-request",
        }
    }

    pub fn from_name(name: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|rule| rule.name() == name)
    }
}

/// What the refusing rule knew, in `data` and a header each.
#[derive(Debug, Clone, PartialEq)]
pub enum Fact {
    /// The identity's name in the stake table, or `unstaked`; never a key.
    Identity(String),
    /// Its share, in calls per second at this call's cost.
    Share(f64),
    /// Its rate as the last refill round saw it, in calls per second.
    Rate(f64),
    /// Requests (or WebSockets) in flight that the limit counts.
    Inflight(u32),
    /// The limit.
    Limit(u32),
}

impl Fact {
    fn names(&self) -> (&'static str, &'static str) {
        match self {
            Fact::Identity(_) => ("identity", "x-stakegate-identity"),
            Fact::Share(_) => ("share", "x-stakegate-share"),
            Fact::Rate(_) => ("rate", "x-stakegate-rate"),
            Fact::Inflight(_) => ("inFlight", "x-stakegate-inflight"),
            Fact::Limit(_) => ("limit", "x-stakegate-limit"),
        }
    }

    /// The value as JSON, and as a header value (printable ASCII).
    fn values(&self) -> (String, String) {
        let number = |x: f64| {
            let x = if x.is_finite() { x.max(0.0) } else { 0.0 };
            let text = format!("{}", (x * 100.0).round() / 100.0);
            (text.clone(), text)
        };
        match self {
            Fact::Identity(name) => {
                let mut json = String::from("\"");
                push_json_escaped(&mut json, name);
                json.push('"');
                let header = name
                    .chars()
                    .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
                    .collect();
                (json, header)
            }
            Fact::Share(x) | Fact::Rate(x) => number(*x),
            Fact::Inflight(n) | Fact::Limit(n) => (n.to_string(), n.to_string()),
        }
    }
}

impl Rejection {
    /// The gate: the node is at its in-flight limit.
    pub const OVERLOADED: u32 = 503;
    /// QoS and dedup: this client is over its share, or repeating itself.
    pub const TOO_MANY_REQUESTS: u32 = 429;
    /// A request that can never be served as sent.
    pub const BAD_REQUEST: u32 = 400;

    /// A rejection by `rule` that knows no facts, its body answering
    /// `id: null`.
    pub fn new(
        rule: Rule,
        status: u32,
        retry_after_s: u32,
        code: i32,
        message: &'static str,
    ) -> Self {
        Self::explained(rule, status, retry_after_s, code, message, &[])
    }

    /// A rejection by `rule`, with what it knew: `x-stakegate-rule` and a
    /// header per fact, and the error's `data`
    /// (`{"rule":..,"retryAfter":..,<facts>}`).
    pub fn explained(
        rule: Rule,
        status: u32,
        retry_after_s: u32,
        code: i32,
        message: &'static str,
        facts: &[Fact],
    ) -> Self {
        let mut headers = Vec::with_capacity(1 + facts.len());
        headers.push((RULE_HEADER, rule.name().to_string()));
        let mut data = format!(r#"{{"rule":"{}","retryAfter":{retry_after_s}"#, rule.name());
        for fact in facts {
            let ((json_name, header), (json, text)) = (fact.names(), fact.values());
            data.push_str(&format!(r#","{json_name}":{json}"#));
            headers.push((header, text));
        }
        data.push('}');
        Self {
            status,
            retry_after_s,
            headers,
            code,
            message,
            rule,
            body: error_body(None, code, message, &data),
            data,
        }
    }

    /// The same rejection, its body answering `request` (the request body
    /// it refuses): the request's `id`, or for a batch an array with one
    /// error per call that has an `id`, in order (notifications get none).
    /// A body that is not JSON-RPC, or a batch of notifications only, keeps
    /// `id: null`.
    pub fn answering(mut self, request: &[u8]) -> Self {
        let Some(read) = Request::read(request) else {
            return self;
        };
        // An id is quoted back only if any JSON reader can read it (`1e999`
        // is JSON's grammar, but many parsers refuse it); else `null`.
        let ids: Vec<Option<&str>> = read
            .calls
            .iter()
            .filter_map(|call| read.id(call))
            .map(|raw| {
                serde_json::from_slice::<serde_json::Value>(raw)
                    .ok()
                    .and_then(|_| std::str::from_utf8(raw).ok())
            })
            .collect();
        self.body = match (read.batch, ids.as_slice()) {
            (_, []) => return self,
            (false, [id]) => error_body(*id, self.code, self.message, &self.data),
            _ => {
                let errors: Vec<String> = ids
                    .iter()
                    .map(|id| error_body(*id, self.code, self.message, &self.data))
                    .collect();
                format!("[{}]", errors.join(","))
            }
        };
        self
    }
}

/// `rejection`'s JSON-RPC error body answering the call with `id` (raw
/// JSON; `None`: `null`).
pub fn error_body_of(rejection: &Rejection, id: Option<&str>) -> String {
    error_body(id, rejection.code, rejection.message, &rejection.data)
}

/// JSON-RPC error code for "limit exceeded", shared by both gates
/// (docs/background.md part 5, follow-ups).
pub const LIMIT_EXCEEDED: i32 = -32005;

/// JSON-RPC error code for a request that is not a valid request.
pub const INVALID_REQUEST: i32 = -32600;

/// Renders `{"jsonrpc":"2.0","id":<id>,"error":{"code":<code>,"message":<message>}}`.
///
/// `id` is the request's id as raw JSON (`7`, `"abc"`), or `None` when it is
/// not known (the decision came before the body).
pub fn json_rpc_error_body(id: Option<&str>, code: i32, message: &str) -> String {
    error_body(id, code, message, "")
}

/// `json_rpc_error_body` with the error's `data` (raw JSON; empty: none).
fn error_body(id: Option<&str>, code: i32, message: &str, data: &str) -> String {
    let mut body = String::with_capacity(64 + message.len() + data.len());
    body.push_str(r#"{"jsonrpc":"2.0","id":"#);
    body.push_str(id.unwrap_or("null"));
    body.push_str(r#","error":{"code":"#);
    body.push_str(&code.to_string());
    body.push_str(r#","message":""#);
    push_json_escaped(&mut body, message);
    body.push('"');
    if !data.is_empty() {
        body.push_str(r#","data":"#);
        body.push_str(data);
    }
    body.push_str("}}");
    body
}

fn push_json_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

/// Seconds a rejected client should wait: the time `inflight` requests need
/// to drain at `drain_per_second`, `base = ceil(inflight / rate)`, at least
/// 1 s, plus a random extra of up to `max(base, 2)` seconds, so clients
/// rejected together come back spread over a window instead of in lockstep
/// (docs/background.md part 5, follow-ups). With a fast node (base 1 s) that
/// is 1, 2 or 3 s; at most `max_s`. `jitter` is uniform in [0, 1).
pub fn retry_after_s(inflight: u32, drain_per_second: f64, jitter: f64, max_s: u32) -> u32 {
    let base = if drain_per_second > 0.0 {
        (f64::from(inflight) / drain_per_second).ceil().max(1.0)
    } else {
        1.0
    };
    let extra = (jitter.clamp(0.0, 1.0) * base.max(2.0)).round();
    ((base + extra).min(f64::from(max_s)) as u32).max(1)
}

/// A small xorshift generator for jitter: proxy-wasm has no random hostcall
/// and the jitter needs no cryptographic quality.
#[derive(Debug, Clone)]
pub struct Jitter(u64);

impl Jitter {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// Uniform in [0, 1).
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_the_drain_time_stretched_by_jitter() {
        assert_eq!(
            retry_after_s(8, 400.0, 0.0, 30),
            1,
            "drains in 20 ms: at least 1 s"
        );
        assert_eq!(
            retry_after_s(8, 400.0, 0.999, 30),
            3,
            "plus up to 2 s of jitter"
        );
        assert_eq!(retry_after_s(8, 0.0, 0.0, 30), 1, "no rate yet");
        assert_eq!(retry_after_s(100, 20.0, 0.0, 30), 5);
        assert_eq!(retry_after_s(100, 20.0, 0.5, 30), 8);
        assert_eq!(retry_after_s(100, 20.0, 0.999, 30), 10);
        assert_eq!(retry_after_s(10_000, 1.0, 0.5, 30), 30, "capped");
    }

    #[test]
    fn jitter_spreads_retries() {
        let mut jitter = Jitter::new(42);
        let values: Vec<u32> = (0..1000)
            .map(|_| retry_after_s(100, 20.0, jitter.next_unit(), 30))
            .collect();
        for s in 5..=10 {
            assert!(values.contains(&s), "{s} s never chosen");
        }
        assert!(values.iter().all(|s| (5..=10).contains(s)));
        let fast: Vec<u32> = (0..1000)
            .map(|_| retry_after_s(8, 400.0, jitter.next_unit(), 30))
            .collect();
        for s in 1..=3 {
            assert!(fast.contains(&s), "{s} s never chosen for a fast node");
        }
    }

    #[test]
    fn a_rejection_answers_each_call_of_what_it_refuses() {
        let refused = || Rejection::new(Rule::GateInflight, 503, 1, LIMIT_EXCEEDED, "full");
        let error = |id: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32005,"message":"full","data":{{"rule":"gate-inflight","retryAfter":1}}}}}}"#
            )
        };
        assert_eq!(refused().body, error("null"));
        let one = refused().answering(br#"{"jsonrpc":"2.0","id":"a-1","method":"eth_call"}"#);
        assert_eq!(one.body, error(r#""a-1""#));
        let batch = refused().answering(
            br#"[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","method":"note"},
                {"jsonrpc":"2.0","id":"x","method":"b"}]"#,
        );
        assert_eq!(batch.body, format!("[{},{}]", error("1"), error(r#""x""#)));
        let parsed: Vec<serde_json::Value> = serde_json::from_str(&batch.body).unwrap();
        assert_eq!(parsed.len(), 2);
        // A one-call batch is still a batch: an array.
        let single = refused().answering(br#"[{"jsonrpc":"2.0","id":9,"method":"a"}]"#);
        assert_eq!(single.body, format!("[{}]", error("9")));
        // An id a JSON reader refuses (out of range) is answered `null`.
        let huge = refused().answering(br#"{"method":"m","id":-0.5e+333333}"#);
        assert_eq!(huge.body, error("null"));
        for unanswerable in [
            &b"not json"[..],
            br#"{"jsonrpc":"2.0","method":"note"}"#,
            br#"[{"jsonrpc":"2.0","method":"note"}]"#,
            b"[]",
        ] {
            assert_eq!(refused().answering(unanswerable).body, error("null"));
        }
    }

    proptest::proptest! {
        /// A refusal quotes each call's id back as the client wrote it.
        #[test]
        fn a_refusal_quotes_every_id_as_written(
            id in crate::jsonrpc::testing::id_spelling(),
        ) {
            let request = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"eth_call"}}"#);
            let refused = Rejection::new(Rule::GateInflight, 503, 1, LIMIT_EXCEEDED, "full")
                .answering(request.as_bytes());
            let summary = crate::jsonrpc::Summary::of(refused.body.as_bytes());
            let quoted = summary.entries[0].last(crate::jsonrpc::Name::Id).unwrap().value.clone();
            proptest::prop_assert_eq!(&refused.body[quoted], id.as_str());
        }
    }

    #[test]
    fn a_rejection_says_its_rule_and_facts_in_data_and_headers() {
        let refused = Rejection::explained(
            Rule::StakeShare,
            429,
            3,
            LIMIT_EXCEEDED,
            "over",
            &[
                Fact::Identity("desk \"b\"\u{e9}".into()),
                Fact::Share(12.345),
                Fact::Rate(f64::NAN),
                Fact::Limit(8),
            ],
        )
        .answering(br#"{"jsonrpc":"2.0","id":4,"method":"eth_call"}"#);
        let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
        assert_eq!(body["id"], 4);
        assert_eq!(
            body["error"]["data"],
            serde_json::json!({"rule": "stake-share", "retryAfter": 3,
                "identity": "desk \"b\"\u{e9}", "share": 12.35, "rate": 0, "limit": 8})
        );
        let header = |name: &str| {
            refused
                .headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(header("x-stakegate-rule"), Some("stake-share"));
        // A header value is printable ASCII whatever the name holds.
        assert_eq!(header("x-stakegate-identity"), Some("desk \"b\"?"));
        assert_eq!(header("x-stakegate-share"), Some("12.35"));
        assert_eq!(header("x-stakegate-limit"), Some("8"));
        let names: std::collections::HashSet<_> = Rule::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Rule::ALL.len());
        for rule in Rule::ALL {
            assert_eq!(Rule::from_name(rule.name()), Some(rule));
        }
        assert_eq!(Rule::from_name("stake"), None);
    }

    #[test]
    fn unknown_id_renders_null() {
        assert_eq!(
            json_rpc_error_body(None, LIMIT_EXCEEDED, "over the limit"),
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32005,"message":"over the limit"}}"#
        );
    }

    #[test]
    fn known_id_and_awkward_message_are_kept_valid_json() {
        assert_eq!(
            json_rpc_error_body(Some(r#""a-1""#), LIMIT_EXCEEDED, "say \"no\"\n\u{1}"),
            r#"{"jsonrpc":"2.0","id":"a-1","error":{"code":-32005,"message":"say \"no\"\n\u0001"}}"#
        );
    }
}
