//! HTTP surface: `POST /` takes JSON-RPC, `GET /` upgrades to a WebSocket
//! carrying JSON-RPC messages, `GET /metrics` returns the node's
//! state as JSON, `POST /metrics/reset` starts a new measurement window, and
//! `GET /health` answers once the node is serving.
//!
//! HTTP/1.1 and HTTP/2 (h2c prior knowledge) are both served.

use crate::costs::Flavour;
use crate::node::Node;
use crate::pubsub::Subscriptions;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// HTTP/2 streams per connection: high, because a node's queue is its read
/// slots and a transport cap would hide it.
const MAX_H2_STREAMS: u32 = 1 << 20;

/// Bodies above this are refused by the HTTP layer with 413.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/", post(rpc).get(websocket))
        .route("/metrics", get(metrics))
        .route("/metrics/reset", post(reset))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(node)
}

/// The header each HTTP answer gives the node's work on it in, in
/// microseconds (`Answer::service`), so that a load generator can sum the
/// node time each client used (`/metrics` sums them: `service_us_said`).
/// Real nodes send nothing like it; the gateway reads it only where its
/// policy says so (the admission gate's `nodeTime.serviceTimeHeader`).
pub const SERVICE_HEADER: &str = "x-node-service-us";

async fn rpc(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    let answer = node.handle(&body).await;
    let mut response = match answer.body {
        Some(response) if node.config().gzip => gzipped(&response),
        Some(response) => Json(response).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    };
    let service_us = answer.service.as_micros() as u64;
    node.said_service(service_us);
    response
        .headers_mut()
        .insert(SERVICE_HEADER, HeaderValue::from(service_us));
    response
}

/// `response` as gzipped JSON, with `content-encoding: gzip`.
fn gzipped(response: &serde_json::Value) -> Response {
    use flate2::{write::GzEncoder, Compression};
    use std::io::Write;
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    let body = encoder
        .write_all(response.to_string().as_bytes())
        .and_then(|()| encoder.finish());
    match body {
        Ok(body) => (
            [
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn websocket(State(node): State<Arc<Node>>, upgrade: WebSocketUpgrade) -> Response {
    upgrade
        .on_failed_upgrade(|e| eprintln!("rpc-node: websocket upgrade failed: {e}"))
        .on_upgrade(move |socket| serve_websocket(node, socket))
}

/// Each text or binary message is a JSON-RPC body. Like geth and Erigon,
/// the node works on a connection's messages concurrently (each takes its
/// own read slot) and answers each as it completes, so one socket can put
/// many requests in flight. A close is answered with the same close, as
/// geth does, and the answers not yet written are dropped.
async fn serve_websocket(node: Arc<Node>, socket: WebSocket) {
    use futures_util::{SinkExt, StreamExt};
    let _open = node.websocket_opened();
    let (mut sink, mut stream) = socket.split();
    let (answers, mut outbox) = tokio::sync::mpsc::unbounded_channel::<Message>();
    let writer = tokio::spawn(async move {
        while let Some(message) = outbox.recv().await {
            match message {
                // The client's close: the reply the socket queued on
                // reading it goes out as the socket closes.
                Message::Close(_) => {
                    let _ = sink.close().await;
                    break;
                }
                message => {
                    if sink.send(message).await.is_err() {
                        break;
                    }
                }
            }
        }
    });
    // Solana PubSub: this socket's subscriptions, told of each new slot.
    let subs = Arc::new(Mutex::new(Subscriptions::default()));
    let notifier = (node.config().flavour == Flavour::Solana).then(|| {
        let (subs, answers, mut heads) = (subs.clone(), answers.clone(), node.watch_heads());
        tokio::spawn(async move {
            loop {
                let head = match heads.recv().await {
                    Ok(head) => head,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                };
                let notes = subs.lock().map(|mut s| s.notify(head)).unwrap_or_default();
                for note in notes {
                    if answers
                        .send(Message::Text(note.to_string().into()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        })
    });
    while let Some(Ok(message)) = stream.next().await {
        let body = match message {
            Message::Text(text) => Bytes::from(text.as_str().to_owned()),
            Message::Binary(bytes) => bytes,
            Message::Close(frame) => {
                let _ = answers.send(Message::Close(frame));
                break;
            }
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        let (node, answers, subs) = (node.clone(), answers.clone(), subs.clone());
        tokio::spawn(async move {
            let answer = node.handle_on(&body, Some(&subs)).await;
            node.served_websocket(answer.service);
            if let Some(response) = answer.body {
                let _ = answers.send(Message::Text(response.to_string().into()));
            }
        });
    }
    if let Some(notifier) = notifier {
        notifier.abort();
    }
    drop(answers);
    let _ = writer.await;
}

async fn metrics(State(node): State<Arc<Node>>) -> Response {
    Json(node.metrics()).into_response()
}

async fn reset(State(node): State<Arc<Node>>) -> StatusCode {
    node.reset();
    StatusCode::NO_CONTENT
}

/// Serves `router` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, router: Router) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, usually: back off instead of spinning.
                eprintln!("rpc-node: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder.http2().max_concurrent_streams(MAX_H2_STREAMS);
            let _ = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .await;
        });
    }
}
