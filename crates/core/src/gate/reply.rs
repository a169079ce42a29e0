//! What the gate sends on its own rather than through the route: a reply to
//! a request it answers itself, and a callout to the node (a coalescing
//! leader's request, or the finality poll). The glue makes them with host
//! calls as they are.

use super::policy::GatePolicy;
use crate::dedup::answer::{Answer, Id};
use crate::rejection::{json_rpc_error_body, Rejection};
use crate::request::RequestFacts;

/// Where a request goes: the cluster Envoy's route chose for it (empty if
/// the host cannot say), and the client's `:path` and `:authority`, where
/// a callout for it goes too. Together they say which node, and which
/// chain, answers it: answers are shared only within one (`route`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target {
    pub cluster: String,
    pub path: String,
    pub authority: String,
}

impl Target {
    /// The request's target: `cluster` as the route chose it, the path
    /// and authority from its headers.
    pub fn read(cluster: Option<String>, facts: &mut impl RequestFacts) -> Self {
        Self {
            cluster: cluster.unwrap_or_default(),
            path: facts.header(":path").unwrap_or_else(|| "/".into()),
            authority: facts.header(":authority").unwrap_or_default(),
        }
    }

    /// What names its route in a key: two requests share an answer only
    /// if this is the same for both.
    pub fn route(&self) -> String {
        format!("{}\n{}\n{}", self.cluster, self.authority, self.path)
    }
}

/// An HTTP callout to make from the root context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub cluster: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

impl Callout {
    /// A JSON-RPC POST of `body` to `cluster`, where `target` says (the
    /// client's `:path` and `:authority`: a node may check its host name),
    /// asking for no encoding, so that every waiter can read the answer and
    /// have its ids put back.
    pub fn post(cluster: &str, target: &Target, body: Vec<u8>, timeout_ms: u64) -> Self {
        let authority = match target.authority.as_str() {
            "" => "localhost".to_string(),
            authority => authority.to_string(),
        };
        let path = match target.path.as_str() {
            "" => "/".to_string(),
            path => path.to_string(),
        };
        Self {
            cluster: cluster.to_string(),
            headers: vec![
                (":method", "POST".into()),
                (":path", path),
                (":authority", authority),
                ("content-type", "application/json".into()),
                ("accept-encoding", "identity".into()),
            ],
            body,
            timeout_ms,
        }
    }
}

/// An answer the gate gives a request itself: status, headers (the content
/// type; the encoding of an encoded answer its own client is given; a
/// refusal's `retry-after` and its own) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// The node's time on it, in µs, for the filters before the gate
    /// (`node_time::NODE_US_PROPERTY`); `None` says nothing.
    pub node_us: Option<u64>,
    /// A leader's answer: the node's own word on its time, in µs, which
    /// the glue passes on in `nodeTime.serviceTimeHeader`, as the client
    /// would have had it through the route. Another request's has none.
    pub said_us: Option<u64>,
}

impl Reply {
    /// A JSON body of the gate's own (a refusal, an error): the node did
    /// no work for it, so stake QoS charges it no node time (a refusal
    /// after a wait for a slot would be charged the wait).
    pub fn json(status: u32, body: Vec<u8>) -> Self {
        Self {
            status,
            headers: vec![("content-type", "application/json".into())],
            body,
            node_us: Some(0),
            said_us: None,
        }
    }

    /// With `nodeTime`, says the node did no work for this answer (another
    /// request's, or a kept one), so stake QoS charges it no node time.
    pub fn no_node_time(mut self, policy: &GatePolicy) -> Self {
        if policy.node_time.is_some() {
            self.node_us = Some(0);
        }
        self
    }

    /// Says the answer came from the cache (`cache::HEADER`).
    pub fn from_cache(mut self) -> Self {
        self.headers.push((crate::cache::HEADER, "hit".into()));
        self
    }

    /// A refusal, as a held request's answer: the same headers as any.
    pub fn refusal(refusal: Rejection) -> Self {
        let mut reply = Self::json(refusal.status, refusal.body.into_bytes());
        if refusal.retry_after_s > 0 {
            reply
                .headers
                .push(("retry-after", refusal.retry_after_s.to_string()));
        }
        reply.headers.extend(refusal.headers);
        reply
    }

    /// The node's `answer`, for the request with these `ids`.
    pub fn answer(answer: &Answer, ids: &[Id]) -> Self {
        let mut headers = vec![("content-type", answer.content_type.clone())];
        if let Some(encoding) = &answer.content_encoding {
            headers.push(("content-encoding", encoding.clone()));
        }
        Self {
            status: answer.status,
            headers,
            body: answer.body_for(ids),
            node_us: None,
            said_us: None,
        }
    }

    /// The answer to a request that got none: 502, a JSON-RPC error with
    /// its own id(s).
    pub fn none(ids: &[Id], message: &str) -> Self {
        let errors: Vec<String> = ids
            .iter()
            .flatten()
            .map(|id| json_rpc_error_body(std::str::from_utf8(id).ok(), -32603, message))
            .collect();
        let body = match errors.as_slice() {
            [one] if ids.len() == 1 => one.clone(),
            [] => json_rpc_error_body(None, -32603, message),
            _ => format!("[{}]", errors.join(",")),
        };
        Self::json(502, body.into_bytes())
    }
}

/// What to do with a request the gate holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    Answer(Reply),
    /// Send this callout (from the root context) for it: it leads its key.
    Dispatch(Callout),
    /// Let it go on through the route, uncoalesced.
    Resume,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_that_got_no_answer_gets_a_json_rpc_error_with_its_ids() {
        let one = Reply::none(&[Some(b"7".to_vec())], "x");
        assert_eq!(one.status, 502);
        let body: serde_json::Value = serde_json::from_slice(&one.body).unwrap();
        assert_eq!(
            (body["id"].clone(), body["error"]["code"].clone()),
            (7.into(), (-32603).into())
        );
        let batch = Reply::none(&[Some(b"1".to_vec()), None, Some(b"\"b\"".to_vec())], "x");
        let body: serde_json::Value = serde_json::from_slice(&batch.body).unwrap();
        assert_eq!(body.as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_callout_goes_where_the_client_sent_its_request_in_no_encoding() {
        let target = Target {
            path: "/rpc".into(),
            authority: "node.example".into(),
            ..Target::default()
        };
        let callout = Callout::post("node", &target, b"{}".to_vec(), 100);
        assert!(callout.headers.contains(&(":path", "/rpc".into())));
        assert!(callout
            .headers
            .contains(&(":authority", "node.example".into())));
        assert!(callout
            .headers
            .contains(&("accept-encoding", "identity".into())));
        let callout = Callout::post("node", &Target::default(), Vec::new(), 100);
        assert!(callout.headers.contains(&(":path", "/".into())));
        assert!(callout
            .headers
            .contains(&(":authority", "localhost".into())));
    }
}
