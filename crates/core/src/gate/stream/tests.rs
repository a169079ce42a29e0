use super::*;
use crate::gate::counts::Ticked;
use crate::gate::policy::GatePolicy;
use crate::gate::InflightGate;
use crate::request::testing::{Bytes, Public};
use crate::shared::{MemoryStore, StoreError};

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
};

/// `Head::read` over `headers`, and the names it read.
fn read_head(end_of_stream: bool, dedup: bool, headers: &[(&str, &str)]) -> (Head, Vec<String>) {
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
    assert_eq!(reads, ["upgrade", "content-length"]);
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
    let headers = first.response_headers(&mut w, &store, &mut Now::fixed(0), false, |_| None);
    assert_eq!(headers, (false, None));
    let mut nothing = Bytes(Vec::new());
    assert!(
        first
            .response_body(&mut w, &store, &mut Now::fixed(0), 0, true, &mut nothing)
            .released
    );
    // The client is still reading, but the node is done.
    assert_eq!(
        GateStream::default().headers(&mut w, &store, &mut Now::fixed(0), &mut Public, GET),
        OnHeaders::Continue
    );
    first.done(&mut w, &store, &mut Now::fixed(0));
    assert_eq!(w.counts.admitted[RequestClass::Default.index()], 2);
}

/// Two requests whose bodies come in pieces through a gate with `policy`:
/// how many it counted and how many lines it logged.
fn streamed_bodies(policy: &str) -> (u64, usize) {
    let store = MemoryStore::default();
    let mut w = worker(policy, 1);
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
        // Admitted already, it goes on; deciding on the body, it waits.
        let step = stream.request_body(&mut w, &store, &mut Now::fixed(0), 6, false, &mut piece);
        assert!(matches!(step, OnBody::Continue | OnBody::Hold), "{step:?}");
        stream.done(&mut w, &store, &mut Now::fixed(0));
    }
    (w.counts.bodies_streamed, w.take_log().len())
}

#[test]
fn a_streamed_body_is_counted_and_reported_once_when_it_holds_a_slot() {
    assert_eq!(streamed_bodies(r#"{"maxInflight": 8}"#), (2, 1));
    // Waiting for the whole body, or internal, it holds no node slot: a
    // warning would be a false alarm (init's internal listener has no
    // buffer filter, and needs none).
    let whole = r#"{"maxInflight": 8, "decideOnBody": true}"#;
    assert_eq!(streamed_bodies(whole), (2, 0));
    let internal =
        r#"{"maxInflight": 8, "classes": {"internal": [{"sourceCidr": "192.0.2.0/24"}]}}"#;
    assert_eq!(streamed_bodies(internal), (2, 0));
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
    second.done(&mut w, &store, &mut Now::fixed(0));
    first.done(&mut w, &store, &mut Now::fixed(0));
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
    trailed.done(&mut w, &store, &mut Now::fixed(0));
    assert_eq!(inflight(&mut w, &store), 0);
}

/// Shared data that refuses every call.
struct Refusing;

impl SharedStore for Refusing {
    fn load(&self, _: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        Err(StoreError::Host("refused".into()))
    }

    fn store(&self, _: &str, _: &[u8], _: Option<u32>) -> Result<crate::shared::Write, StoreError> {
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
