//! The node: read slots shared by RPC and sync, the sync loop, and metrics.

use crate::chain::Chain;
use crate::costs::{work, CostChange, CostTable, Flavour};
use crate::pubsub::{self, Subscriptions};
use crate::rpc::{self, Body, Call};
use crate::slots::ReadSlots;
use crate::solana;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The node's answer to one HTTP body or WebSocket message.
#[derive(Debug)]
pub struct Answer {
    /// `None`: no response body (only notifications were sent).
    pub body: Option<Value>,
    /// The time the node spent working on it, holding read slots (a
    /// batch's calls one after another); waiting for a slot is not in it.
    pub service: Duration,
}

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub read_slots: u32,
    pub costs: CostTable,
    /// Costs that change during the run, from the first request on.
    pub cost_changes: Vec<CostChange>,
    pub block_interval: Duration,
    pub block_exec: Duration,
    pub sync_slots: u32,
    /// The tip counts as lost when the lag exceeds this many block intervals.
    pub tip_lost_after_blocks: f64,
    /// Every HTTP answer is gzipped, whatever the request accepts.
    pub gzip: bool,
    /// Ethereum's JSON-RPC or Solana's.
    pub flavour: Flavour,
    /// What `eth_chainId` and `net_version` answer.
    pub chain_id: u64,
}

#[derive(Debug)]
pub struct Node {
    config: NodeConfig,
    slots: ReadSlots,
    chain: Mutex<Chain>,
    served: Mutex<BTreeMap<String, u64>>,
    errors: Mutex<BTreeMap<i64, u64>>,
    requests: Requests,
    inflight: AtomicU64,
    inflight_max: AtomicU64,
    /// What the HTTP answers' `x-node-service-us` headers said, summed.
    service_us_said: AtomicU64,
    service_us_websocket: AtomicU64,
    websockets: AtomicU64,
    started: Instant,
    /// When the first request came (what `cost_changes` count from).
    first_request: std::sync::OnceLock<Instant>,
    /// Each newly executed block's number (PubSub's notifications).
    heads: tokio::sync::broadcast::Sender<u64>,
    /// Solana: the transactions sent, and the slot each landed in.
    landed: Mutex<solana::Landed>,
}

/// The `GET /metrics` document.
#[derive(Debug, Serialize)]
pub struct Metrics {
    pub tip_lag_ms: f64,
    pub tip_lag_max_ms: f64,
    pub tip_lost: bool,
    pub head: u64,
    pub blocks_pending: usize,
    pub queue_depth: u64,
    pub queue_max: u64,
    pub inflight: u64,
    pub inflight_max: u64,
    pub websockets: u64,
    pub read_slots: u32,
    pub read_slots_in_use: u32,
    pub served: BTreeMap<String, u64>,
    /// The node's time on its HTTP answers as their `x-node-service-us`
    /// headers said it, summed, in µs: what a gateway reading the header
    /// was told in all.
    pub service_us_said: u64,
    /// The node's time on the calls it answered on WebSockets (which carry
    /// no header to say it), summed, in µs; slot waits are not in it.
    pub service_us_websocket: u64,
    pub errors: BTreeMap<i64, u64>,
    /// HTTP request bodies received that parsed as JSON-RPC.
    pub requests: u64,
    /// How many of them were distinct (method and params, whatever the
    /// id); `requests / unique_requests` is the retry amplification.
    pub unique_requests: u64,
    pub rss_bytes: u64,
    pub uptime_ms: u64,
}

/// Bodies received, and the distinct ones by fingerprint. Fingerprints
/// stop being added at `MAX_FINGERPRINTS` (memory stays bounded; the unique
/// count is then a lower bound).
#[derive(Debug, Default)]
struct Requests {
    total: AtomicU64,
    seen: Mutex<HashSet<u64>>,
}

const MAX_FINGERPRINTS: usize = 4_000_000;

/// What makes two bodies the same request: each call's method and params,
/// not its id.
fn fingerprint(body: &Body) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let calls = match body {
        Body::Single(call) => std::slice::from_ref(call),
        Body::Batch(calls) => calls.as_slice(),
    };
    for call in calls {
        match call {
            Call::Request { method, params, .. } => (method, params.to_string()).hash(&mut hasher),
            Call::Invalid { reason, .. } => reason.hash(&mut hasher),
        }
    }
    hasher.finish()
}

/// Counts one open WebSocket for as long as it lives.
pub struct OpenWebsocket<'a>(&'a Node);

impl Drop for OpenWebsocket<'_> {
    fn drop(&mut self) {
        self.0.websockets.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts one HTTP request in flight for as long as it lives.
struct InFlight<'a>(&'a Node);

impl<'a> InFlight<'a> {
    fn enter(node: &'a Node) -> Self {
        let now = node.inflight.fetch_add(1, Ordering::Relaxed) + 1;
        node.inflight_max.fetch_max(now, Ordering::Relaxed);
        Self(node)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the counters
    // inconsistent, so a poisoned lock is still usable.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Node {
    pub fn new(config: NodeConfig) -> Arc<Self> {
        let lost_after = config.block_interval.mul_f64(config.tip_lost_after_blocks);
        Arc::new(Self {
            slots: ReadSlots::new(config.read_slots),
            chain: Mutex::new(Chain::new(lost_after)),
            served: Mutex::new(BTreeMap::new()),
            errors: Mutex::new(BTreeMap::new()),
            requests: Requests::default(),
            inflight: AtomicU64::new(0),
            inflight_max: AtomicU64::new(0),
            service_us_said: AtomicU64::new(0),
            service_us_websocket: AtomicU64::new(0),
            websockets: AtomicU64::new(0),
            started: Instant::now(),
            first_request: std::sync::OnceLock::new(),
            heads: tokio::sync::broadcast::channel(64).0,
            landed: Mutex::default(),
            config,
        })
    }

    /// Each block's number as it is executed, from now on.
    pub fn watch_heads(&self) -> tokio::sync::broadcast::Receiver<u64> {
        self.heads.subscribe()
    }

    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    pub fn websocket_opened(&self) -> OpenWebsocket<'_> {
        self.websockets.fetch_add(1, Ordering::Relaxed);
        OpenWebsocket(self)
    }

    /// Answers one HTTP body. `body` is `None` when there is no response
    /// body (only notifications were sent); `service` is the time the node
    /// held read slots for it (a batch's calls run one after another).
    pub async fn handle(&self, body: &[u8]) -> Answer {
        self.handle_on(body, None).await
    }

    /// `handle`, on a WebSocket with its PubSub subscriptions (Solana).
    pub async fn handle_on(&self, body: &[u8], subs: Option<&Mutex<Subscriptions>>) -> Answer {
        let _inflight = InFlight::enter(self);
        let parsed = rpc::parse(body);
        if let Ok(body) = &parsed {
            self.requests.total.fetch_add(1, Ordering::Relaxed);
            let mut seen = lock(&self.requests.seen);
            if seen.len() < MAX_FINGERPRINTS {
                seen.insert(fingerprint(body));
            }
        }
        match parsed {
            Err(error) => {
                self.count_error(&error);
                Answer {
                    body: Some(error),
                    service: Duration::ZERO,
                }
            }
            Ok(Body::Single(call)) => {
                let (body, service) = self.call(call, subs).await;
                Answer { body, service }
            }
            // Batch entries run one after another, each holding a slot only
            // for its own work, like a node that does not parallelise batches.
            Ok(Body::Batch(calls)) => {
                let mut responses = Vec::with_capacity(calls.len());
                let mut service = Duration::ZERO;
                for call in calls {
                    let (response, spent) = self.call(call, subs).await;
                    responses.extend(response);
                    service += spent;
                }
                Answer {
                    body: (!responses.is_empty()).then_some(Value::Array(responses)),
                    service,
                }
            }
        }
    }

    /// One call's answer and the time it held a read slot.
    async fn call(
        &self,
        call: Call,
        subs: Option<&Mutex<Subscriptions>>,
    ) -> (Option<Value>, Duration) {
        let response = match call {
            Call::Invalid { id, reason } => rpc::error(
                id,
                rpc::INVALID_REQUEST,
                &format!("invalid request: {reason}"),
            ),
            Call::Request { id, method, params } => {
                let Some(cost) = self.cost(&method) else {
                    let error = rpc::error(
                        id.unwrap_or(Value::Null),
                        rpc::METHOD_NOT_FOUND,
                        &format!("the method {method} does not exist/is not available"),
                    );
                    self.count_error(&error);
                    return (Some(error), Duration::ZERO);
                };
                let service = {
                    let _slot = self.slots.acquire_for_rpc().await;
                    let started = Instant::now();
                    work(cost).await;
                    started.elapsed()
                };
                *lock(&self.served).entry(method.clone()).or_default() += 1;
                let head = lock(&self.chain).head();
                let Some(id) = id else {
                    return (None, service);
                };
                let answer = match self.config.flavour {
                    Flavour::Ethereum => Ok(rpc::canned_result(
                        &method,
                        &params,
                        head,
                        self.config.chain_id,
                    )),
                    Flavour::Solana if pubsub::is_pubsub(&method) => match subs {
                        Some(subs) => lock(subs).call(&method, &params, head),
                        None => Err((
                            rpc::METHOD_NOT_FOUND,
                            format!("{method} is PubSub's: subscribe over the WebSocket"),
                        )),
                    },
                    Flavour::Solana => {
                        solana::answer_keeping(&method, &params, head, &mut lock(&self.landed))
                    }
                };
                let answer = match answer {
                    Ok(result) => rpc::result(id, result),
                    Err((code, message)) => {
                        let error = rpc::error(id, code, &message);
                        self.count_error(&error);
                        error
                    }
                };
                return (Some(answer), service);
            }
        };
        self.count_error(&response);
        (Some(response), Duration::ZERO)
    }

    /// What `method` costs now: its cost, or the latest change of it due
    /// since the first request.
    fn cost(&self, method: &str) -> Option<Duration> {
        let since = self.first_request.get_or_init(Instant::now).elapsed();
        let changed = self
            .config
            .cost_changes
            .iter()
            .filter(|c| c.method == method && c.at <= since)
            .max_by_key(|c| c.at)
            .map(|c| c.cost);
        changed.or_else(|| self.config.costs.cost(method))
    }

    fn count_error(&self, response: &Value) {
        if let Some(code) = response["error"]["code"].as_i64() {
            *lock(&self.errors).entry(code).or_default() += 1;
        }
    }

    /// Starts the sync loop: blocks arrive every `block_interval`, and each
    /// is executed with `sync_slots` read slots held for `block_exec`.
    pub fn start_sync(self: &Arc<Self>) {
        let arrived = Arc::new(tokio::sync::Notify::new());

        let node = self.clone();
        let wake = arrived.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(node.config.block_interval);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            loop {
                every.tick().await;
                lock(&node.chain).block_arrived(Instant::now());
                wake.notify_one();
            }
        });

        let node = self.clone();
        tokio::spawn(async move {
            loop {
                if !lock(&node.chain).has_pending() {
                    arrived.notified().await;
                    continue;
                }
                {
                    let _slots = node.slots.acquire_for_sync(node.config.sync_slots).await;
                    tokio::time::sleep(node.config.block_exec).await;
                }
                let head = {
                    let mut chain = lock(&node.chain);
                    chain.block_executed(Instant::now());
                    chain.head()
                };
                // No socket listening is no error.
                let _ = node.heads.send(head);
            }
        });

        // The lag grows while the executor waits for slots, with no chain
        // event to record it, so sample it too.
        let node = self.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(10));
            loop {
                every.tick().await;
                lock(&node.chain).observe(Instant::now());
            }
        });
    }

    /// An HTTP answer said the node's time on it was `us`.
    pub fn said_service(&self, us: u64) {
        self.service_us_said.fetch_add(us, Ordering::Relaxed);
    }

    /// The node spent `service` on a message that came on a WebSocket.
    pub fn served_websocket(&self, service: Duration) {
        let us = u64::try_from(service.as_micros()).unwrap_or(u64::MAX);
        self.service_us_websocket.fetch_add(us, Ordering::Relaxed);
    }

    pub fn metrics(&self) -> Metrics {
        let now = Instant::now();
        let mut chain = lock(&self.chain);
        let lag = chain.observe(now);
        Metrics {
            tip_lag_ms: millis(lag),
            tip_lag_max_ms: millis(chain.lag_max()),
            tip_lost: chain.tip_lost(),
            head: chain.head(),
            blocks_pending: chain.pending(),
            queue_depth: self.slots.queue_depth(),
            queue_max: self.slots.queue_max(),
            inflight: self.inflight.load(Ordering::Relaxed),
            inflight_max: self.inflight_max.load(Ordering::Relaxed),
            websockets: self.websockets.load(Ordering::Relaxed),
            read_slots: self.slots.total(),
            read_slots_in_use: self.slots.in_use(),
            served: lock(&self.served).clone(),
            service_us_said: self.service_us_said.load(Ordering::Relaxed),
            service_us_websocket: self.service_us_websocket.load(Ordering::Relaxed),
            errors: lock(&self.errors).clone(),
            requests: self.requests.total.load(Ordering::Relaxed),
            unique_requests: lock(&self.requests.seen).len() as u64,
            rss_bytes: rss_bytes(),
            uptime_ms: now.duration_since(self.started).as_millis() as u64,
        }
    }

    /// Starts a new measurement window: maxima and counts restart from the
    /// current state.
    pub fn reset(&self) {
        lock(&self.chain).reset_maxima(Instant::now());
        self.slots.reset_maxima();
        self.inflight_max
            .store(self.inflight.load(Ordering::Relaxed), Ordering::Relaxed);
        lock(&self.served).clear();
        self.service_us_said.store(0, Ordering::Relaxed);
        self.service_us_websocket.store(0, Ordering::Relaxed);
        lock(&self.errors).clear();
        self.requests.total.store(0, Ordering::Relaxed);
        lock(&self.requests.seen).clear();
    }
}

fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(read_slots: u32) -> Arc<Node> {
        node_of(Flavour::Ethereum, read_slots)
    }

    fn node_of(flavour: Flavour, read_slots: u32) -> Arc<Node> {
        Node::new(NodeConfig {
            read_slots,
            costs: CostTable::of(flavour),
            cost_changes: vec![
                CostChange {
                    at: Duration::ZERO,
                    method: "eth_getProof".into(),
                    cost: Duration::from_micros(300),
                },
                CostChange {
                    at: Duration::from_secs(3600),
                    method: "eth_getLogs".into(),
                    cost: Duration::from_secs(1),
                },
            ],
            block_interval: Duration::from_secs(1),
            block_exec: Duration::from_millis(50),
            sync_slots: 1,
            tip_lost_after_blocks: 3.0,
            gzip: false,
            flavour,
            chain_id: 1,
        })
    }

    #[tokio::test]
    async fn a_solana_node_answers_solana_and_keeps_pubsub_to_websockets() {
        let node = node_of(Flavour::Solana, 4);
        let body = |method: &str, params: &str| {
            format!(r#"{{"jsonrpc":"2.0","id":1,"method":"{method}","params":{params}}}"#)
        };
        let answer = |text: String| {
            let node = node.clone();
            async move { node.handle(text.as_bytes()).await.body.unwrap() }
        };
        let slot = answer(body("getSlot", r#"[{"commitment":"processed"}]"#)).await;
        assert_eq!(slot["result"], 0);
        let eth = answer(body("eth_blockNumber", "[]")).await;
        assert_eq!(eth["error"]["code"], rpc::METHOD_NOT_FOUND);
        let http_subscribe = answer(body("slotSubscribe", "[]")).await;
        assert_eq!(http_subscribe["error"]["code"], rpc::METHOD_NOT_FOUND);
        let subs = Mutex::new(Subscriptions::default());
        let text = body("slotSubscribe", "[]");
        let subscribed = node
            .handle_on(text.as_bytes(), Some(&subs))
            .await
            .body
            .unwrap();
        assert_eq!(subscribed["result"], 0);
    }

    #[tokio::test]
    async fn a_batch_answers_requests_and_errors_in_order() {
        let node = node(4);
        let body = br#"[{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber"},
                        {"jsonrpc":"2.0","id":2,"method":"eth_nope"},
                        {"jsonrpc":"2.0","method":"eth_chainId"},
                        {"jsonrpc":"2.0","id":3}]"#;
        let answer = node.handle(body).await;
        let block_number = node.config().costs.cost("eth_blockNumber").unwrap();
        let chain_id = node.config().costs.cost("eth_chainId").unwrap();
        assert!(
            answer.service >= block_number + chain_id,
            "the work of both calls that ran: {:?}",
            answer.service
        );
        assert_eq!(
            answer.body.unwrap(),
            json!([
                {"jsonrpc":"2.0","id":1,"result":"0x0"},
                {"jsonrpc":"2.0","id":2,"error":{"code":-32601,"message":"the method eth_nope does not exist/is not available"}},
                {"jsonrpc":"2.0","id":3,"error":{"code":-32600,"message":"invalid request: method must be a string"}},
            ])
        );
        let metrics = node.metrics();
        assert_eq!(metrics.served["eth_blockNumber"], 1);
        assert_eq!(metrics.served["eth_chainId"], 1, "notifications are served");
        assert_eq!(metrics.errors[&-32601], 1);
        assert_eq!(metrics.errors[&-32600], 1);
        assert_eq!(metrics.inflight, 0);
        assert_eq!(metrics.inflight_max, 1);
    }

    #[tokio::test]
    async fn a_cost_change_applies_from_its_time_after_the_first_request() {
        let node = node(1);
        assert_eq!(
            node.cost("eth_getProof"),
            Some(Duration::from_micros(300)),
            "changed at once"
        );
        let default = CostTable::default();
        assert_eq!(
            node.cost("eth_getLogs"),
            default.cost("eth_getLogs"),
            "not yet"
        );
        assert_eq!(
            node.cost("eth_blockNumber"),
            default.cost("eth_blockNumber")
        );
    }

    #[tokio::test]
    async fn only_notifications_get_no_body() {
        let node = node(1);
        assert_eq!(
            node.handle(br#"{"jsonrpc":"2.0","method":"eth_chainId"}"#)
                .await
                .body,
            None
        );
    }

    #[tokio::test]
    async fn garbage_gets_a_parse_error() {
        let node = node(1);
        let answer = node.handle(b"\xff\x00not json").await;
        assert_eq!(answer.service, Duration::ZERO, "no work");
        let response = answer.body.unwrap();
        assert_eq!(response["error"]["code"], -32700);
        assert_eq!(node.metrics().errors[&-32700], 1);
    }

    #[tokio::test]
    async fn retries_count_as_requests_but_not_as_unique_ones() {
        let node = node(4);
        for body in [
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_call","params":[{"data":"0x1"}]}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"eth_call","params":[{"data":"0x1"}]}"#,
            r#"{"jsonrpc":"2.0","id":3,"method":"eth_call","params":[{"data":"0x2"}]}"#,
            r#"{"jsonrpc":"2.0","id":4,"method":"eth_getBalance","params":[{"data":"0x2"}]}"#,
            "not json",
        ] {
            node.handle(body.as_bytes()).await;
        }
        let metrics = node.metrics();
        assert_eq!((metrics.requests, metrics.unique_requests), (4, 3));
        node.reset();
        assert_eq!(node.metrics().unique_requests, 0);
    }
}
