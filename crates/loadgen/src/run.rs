//! The open-loop sender.
//!
//! Each client has a fixed schedule: request `i` is due at `start + i/rate`
//! (with phases, at the rate of the phase it falls in: `spec::Schedule`).
//! The sender sleeps until a request is due and launches it as its own task,
//! whatever earlier requests are doing, so slow responses cannot slow the
//! offered load (and hide overload). The run ends when the duration or the
//! request count is reached, whichever comes first; requests still in flight
//! then get up to `timeout` to finish.

use crate::report::{ClientHeader, ClientReport, Outcome, Recorder, Report};
use crate::spec::{ClientSpec, RunSpec, Schedule};
use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Runs every client at once and returns their reports.
pub async fn run(spec: &RunSpec) -> anyhow::Result<Report> {
    spec.validate()?;
    let uri = |text: &str| -> anyhow::Result<Uri> {
        text.parse()
            .with_context(|| format!("target {text:?} is not a URL"))
    };
    // A common start a little ahead, so every client's schedule begins
    // together once all tasks are spawned.
    let start = Instant::now() + Duration::from_millis(20);
    let mut senders = JoinSet::new();
    for (index, client) in spec.clients.iter().enumerate() {
        let api_key = match &client.api_key {
            None => None,
            Some(key) => Some((
                HeaderName::try_from(client.key_header.as_str()).with_context(|| {
                    format!(
                        "client {}: bad header name {:?}",
                        client.id, client.key_header
                    )
                })?,
                HeaderValue::try_from(key.as_str()).with_context(|| {
                    format!(
                        "client {}: the API key is not a valid header value",
                        client.id
                    )
                })?,
            )),
        };
        let sender = Sender {
            client: client.clone(),
            api_key,
            http: (0..if spec.http2 { spec.connections } else { 1 })
                .map(|_| http_client(spec.http2, client))
                .collect(),
            targets: if client.targets.is_empty() {
                vec![uri(&spec.target)?]
            } else {
                client
                    .targets
                    .iter()
                    .map(|t| uri(t))
                    .collect::<anyhow::Result<_>>()?
            },
            start,
            duration: spec.duration,
            max_requests: spec.max_requests,
            timeout: client
                .timeout_ms
                .map_or(spec.timeout, Duration::from_millis),
            seed: index as u64,
        };
        senders.spawn(async move { (index, sender.run().await) });
    }
    let mut clients: Vec<(usize, (ClientReport, Recorder))> = senders.join_all().await;
    clients.sort_by_key(|(index, _)| *index);
    let mut overall = Recorder::default();
    for (_, (_, recorder)) in &clients {
        overall.merge(recorder);
    }
    Ok(Report {
        target: spec.target.clone(),
        duration_s: round3(Instant::now().duration_since(start).as_secs_f64()),
        http2: spec.http2,
        status: overall.status(),
        latency_ms: overall.latencies(),
        clients: clients.into_iter().map(|(_, (report, _))| report).collect(),
    })
}

fn http_client(http2: bool, client: &ClientSpec) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_local_address(client.source);
    Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .pool_max_idle_per_host(client.concurrency)
        .build(connector)
}

struct Sender {
    client: ClientSpec,
    api_key: Option<(HeaderName, HeaderValue)>,
    /// One client per HTTP/2 connection; requests take them in turn.
    http: Vec<HttpClient>,
    /// Request `i` goes to `targets[i % len]`.
    targets: Vec<Uri>,
    start: Instant,
    duration: Duration,
    max_requests: u64,
    timeout: Duration,
    seed: u64,
}

impl Sender {
    async fn run(self) -> (ClientReport, Recorder) {
        let schedule = Schedule::of(&self.client);
        let period = Duration::from_secs_f64(1.0 / self.client.rate.max(1e-9));
        let picker = MethodPicker::new(&self.client.mix);
        let mut rng = SmallRng::seed_from_u64(self.seed);
        let recorder = Arc::new(Mutex::new(Recorder::default()));
        let inflight = Arc::new(AtomicUsize::new(0));
        let mut requests = JoinSet::new();
        let (mut sent, mut skipped) = (0u64, 0u64);
        let mut lag_max = Duration::ZERO;
        let mut last_dispatch = self.start;

        let dues = schedule
            .dues(self.duration.as_secs_f64())
            .take(self.max_requests as usize);
        for (i, due_s) in dues.enumerate() {
            let i = i as u64;
            let due = self.start + Duration::from_secs_f64(due_s);
            tokio::time::sleep_until(due).await;
            let now = Instant::now();
            lag_max = lag_max.max(now.duration_since(due));
            last_dispatch = now;
            while requests.try_join_next().is_some() {}
            if inflight.load(Ordering::Relaxed) >= self.client.concurrency {
                skipped += 1;
                continue;
            }
            sent += 1;
            inflight.fetch_add(1, Ordering::Relaxed);
            let method = picker.pick(&mut rng);
            let params = if self.client.unique_params {
                unique_params(method, self.seed, i)
            } else if self.client.history {
                history_params(method, self.seed, i)
            } else {
                params_for(method).to_string()
            };
            let (http, recorder, inflight) = (
                self.http[i as usize % self.http.len()].clone(),
                recorder.clone(),
                inflight.clone(),
            );
            let (timeout, second) = (
                self.timeout,
                due.duration_since(self.start).as_secs() as usize,
            );
            let retries = self.client.retries;
            let attempts: Vec<Request<Full<Bytes>>> = (0..=retries)
                .map(|attempt| self.request(i, attempt, method, &params))
                .collect();
            requests.spawn(async move {
                for request in attempts {
                    let sent_at = Instant::now();
                    let (outcome, rpc_error, node) = send(&http, request, timeout).await;
                    let answered = Instant::now();
                    if let Ok(mut recorder) = recorder.lock() {
                        let (latency, service) = (answered - due, answered - sent_at);
                        recorder.record(second, outcome, latency, service, node, rpc_error);
                    }
                    if !matches!(outcome, Outcome::Timeout | Outcome::Status(429 | 503)) {
                        break;
                    }
                }
                inflight.fetch_sub(1, Ordering::Relaxed);
            });
        }
        let scheduled = sent + skipped;
        let window = if schedule.is_steady() {
            last_dispatch.duration_since(self.start) + period
        } else {
            self.duration
        };
        while requests.join_next().await.is_some() {}

        let header = ClientHeader {
            id: self.client.id.clone(),
            requested_rps: self.client.rate,
            offered_rps: round3(scheduled as f64 / window.as_secs_f64()),
            scheduled,
            sent,
            skipped_at_cap: skipped,
            dispatch_lag_max_ms: round3(lag_max.as_secs_f64() * 1000.0),
        };
        let recorder = match Arc::try_unwrap(recorder) {
            Ok(mutex) => mutex
                .into_inner()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
            // Every request task has been joined, so no other owner is left.
            Err(shared) => std::mem::take(&mut *shared.lock().unwrap_or_else(|p| p.into_inner())),
        };
        (recorder.finish(header), recorder)
    }

    /// Attempt `attempt` of request `i` (a retry takes a new id).
    fn request(&self, i: u64, attempt: u32, method: &str, params: &str) -> Request<Full<Bytes>> {
        let id = i * 1000 + u64::from(attempt);
        let body =
            format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#);
        let mut request = Request::new(Full::new(Bytes::from(body)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.targets[i as usize % self.targets.len()].clone();
        let headers = request.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some((name, value)) = &self.api_key {
            headers.insert(name.clone(), value.clone());
        }
        request
    }
}

/// The header rpc-node gives its work on an answer in, in µs.
const NODE_SERVICE_HEADER: &str = "x-node-service-us";

/// Sends one request: how it ended, whether its body carries a JSON-RPC
/// error, and the node's time on it when the node says.
async fn send(
    http: &HttpClient,
    request: Request<Full<Bytes>>,
    timeout: Duration,
) -> (Outcome, bool, Option<Duration>) {
    let exchange = async {
        let response = http.request(request).await?;
        let status = response.status().as_u16();
        let node = response
            .headers()
            .get(NODE_SERVICE_HEADER)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(Duration::from_micros);
        let body = response.into_body().collect().await?.to_bytes();
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, body, node))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => (Outcome::Timeout, false, None),
        Ok(Err(_)) => (Outcome::TransportError, false, None),
        Ok(Ok((status, body, node))) => (
            Outcome::Status(status),
            status == 200 && carries_rpc_error(&body),
            node,
        ),
    }
}

fn carries_rpc_error(body: &[u8]) -> bool {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Array(entries)) => entries.iter().any(|e| e.get("error").is_some()),
        Ok(value) => value.get("error").is_some(),
        Err(_) => false,
    }
}

/// Plausible parameters for the methods the mock node and real nodes know.
pub fn params_for(method: &str) -> &'static str {
    match method {
        "eth_call" => {
            r#"[{"to":"0x00000000219ab540356cbb839cbe05303d7705fa","data":"0x70a08231000000000000000000000000d8da6bf26964af9d7eed9e03e53415d37aa96045"},"latest"]"#
        }
        "eth_getBlockByNumber" => r#"["latest",false]"#,
        "eth_getBalance" | "eth_getTransactionCount" => {
            r#"["0x00000000219ab540356cbb839cbe05303d7705fa","latest"]"#
        }
        "eth_getProof" => r#"["0x00000000219ab540356cbb839cbe05303d7705fa",[],"latest"]"#,
        "eth_getLogs" => r#"[{"fromBlock":"latest","toBlock":"latest"}]"#,
        "getProgramAccounts" => {
            r#"["TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA",{"encoding":"base64"}]"#
        }
        "getBalance" | "getAccountInfo" | "getSignaturesForAddress" => {
            r#"["Vote111111111111111111111111111111111111111",{"commitment":"confirmed"}]"#
        }
        "getBlock" => r#"[1,{"transactionDetails":"none","rewards":false}]"#,
        _ => "[]",
    }
}

/// Solana's methods are camelCase, Ethereum's `namespace_method`.
fn is_solana(method: &str) -> bool {
    !method.contains('_')
}

/// Params of request `i` of client `client` that no other request has: a
/// nonce in eth_call's data, or a first param for other methods (Solana's:
/// a made-up address, and a config object).
pub fn unique_params(method: &str, client: u64, i: u64) -> String {
    match method {
        "getMultipleAccounts" | "getSignatureStatuses" => {
            format!(r#"[["{client:x}{i:016x}"],{{"commitment":"confirmed"}}]"#)
        }
        m if is_solana(m) => format!(r#"["{client:x}{i:016x}",{{"commitment":"confirmed"}}]"#),
        "eth_call" => format!(
            r#"[{{"to":"0x00000000219ab540356cbb839cbe05303d7705fa","data":"0x70a08231{client:032x}{i:032x}"}},"latest"]"#
        ),
        _ => format!(r#"["0x{client:x}{i:016x}","latest"]"#),
    }
}

/// The blocks history reads choose from: 0 to `HISTORY_BLOCKS - 1`.
pub const HISTORY_BLOCKS: u64 = 500;
/// How far back from the newest of them a read goes, on average.
const HISTORY_MEAN_BACK: f64 = 30.0;

/// Params of request `i` of client `client` replaying reads of history: a
/// block of the first `HISTORY_BLOCKS`, the newest most often (an
/// exponential number of blocks back, `HISTORY_MEAN_BACK` on average, from a
/// hash of the client and `i`), for methods read at a block; `params_for`'s
/// for the others. A node whose head is past `HISTORY_BLOCKS` plus its
/// finality depth has them all final.
pub fn history_params(method: &str, client: u64, i: u64) -> String {
    let mixed =
        (client.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let u = ((mixed >> 11) as f64) / ((1u64 << 53) as f64);
    let back = (-(1.0 - u).ln() * HISTORY_MEAN_BACK) as u64;
    let block = HISTORY_BLOCKS - 1 - back.min(HISTORY_BLOCKS - 1);
    let contract = "0x00000000219ab540356cbb839cbe05303d7705fa";
    match method {
        "eth_getBlockByNumber" => format!(r#"["{block:#x}",false]"#),
        "eth_getBalance" | "eth_getTransactionCount" | "eth_getCode" => {
            format!(r#"["{contract}","{block:#x}"]"#)
        }
        "eth_call" => format!(
            r#"[{{"to":"{contract}","data":"0x70a08231000000000000000000000000d8da6bf26964af9d7eed9e03e53415d37aa96045"}},"{block:#x}"]"#
        ),
        "eth_getProof" => format!(r#"["{contract}",[],"{block:#x}"]"#),
        "eth_getLogs" => format!(
            r#"[{{"fromBlock":"{:#x}","toBlock":"{block:#x}"}}]"#,
            block.saturating_sub(9)
        ),
        _ => params_for(method).to_string(),
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Weighted choice of a method.
struct MethodPicker {
    cumulative: Vec<(f64, String)>,
    total: f64,
}

impl MethodPicker {
    fn new(mix: &BTreeMap<String, f64>) -> Self {
        let mut total = 0.0;
        let cumulative = mix
            .iter()
            .map(|(method, weight)| {
                total += weight;
                (total, method.clone())
            })
            .collect();
        Self { cumulative, total }
    }

    fn pick(&self, rng: &mut SmallRng) -> &str {
        let x = rng.random::<f64>() * self.total;
        self.cumulative
            .iter()
            .find(|(upto, _)| x < *upto)
            .or(self.cumulative.last())
            .map_or("eth_blockNumber", |(_, method)| method.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_are_picked_by_weight() {
        let picker = MethodPicker::new(&BTreeMap::from([("a".into(), 3.0), ("b".into(), 1.0)]));
        let mut rng = SmallRng::seed_from_u64(7);
        let a = (0..40_000).filter(|_| picker.pick(&mut rng) == "a").count();
        assert!((29_000..31_000).contains(&a), "a picked {a} times of 40000");
    }

    #[test]
    fn rpc_errors_are_found_in_single_and_batch_bodies() {
        assert!(carries_rpc_error(
            br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32601}}"#
        ));
        assert!(carries_rpc_error(br#"[{"result":1},{"error":{}}]"#));
        assert!(!carries_rpc_error(
            br#"{"jsonrpc":"2.0","id":1,"result":"0x1"}"#
        ));
        assert!(!carries_rpc_error(b"not json"));
    }

    #[test]
    fn history_reads_favour_recent_blocks_of_the_first_500() {
        let blocks: Vec<u64> = (0..10_000)
            .map(|i| {
                let params: serde_json::Value =
                    serde_json::from_str(&history_params("eth_getBlockByNumber", 3, i)).unwrap();
                u64::from_str_radix(params[0].as_str().unwrap().trim_start_matches("0x"), 16)
                    .unwrap()
            })
            .collect();
        assert!(blocks.iter().all(|&b| b < HISTORY_BLOCKS));
        let distinct: std::collections::BTreeSet<u64> = blocks.iter().copied().collect();
        let recent = blocks.iter().filter(|&&b| b >= HISTORY_BLOCKS - 30).count();
        // An exponential with mean 30: 1 - 1/e of them in the newest 30.
        assert!(
            (5_800..=6_800).contains(&recent),
            "{recent} in the newest 30"
        );
        assert!(distinct.len() < 400, "{} distinct blocks", distinct.len());
        // Another client reads others in another order.
        assert_ne!(
            history_params("eth_call", 3, 1),
            history_params("eth_call", 4, 1)
        );
        assert_eq!(
            history_params("eth_blockNumber", 3, 1),
            params_for("eth_blockNumber")
        );
    }
}
