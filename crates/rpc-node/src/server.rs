//! HTTP surface: `POST /` takes JSON-RPC, `GET /metrics` returns the node's
//! state as JSON, `POST /metrics/reset` starts a new measurement window, and
//! `GET /health` answers once the node is serving.

use crate::node::Node;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use std::sync::Arc;

/// Bodies above this are refused by the HTTP layer with 413.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/", post(rpc))
        .route("/metrics", get(metrics))
        .route("/metrics/reset", post(reset))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(node)
}

async fn rpc(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match node.handle(&body).await {
        Some(response) => Json(response).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    }
}

async fn metrics(State(node): State<Arc<Node>>) -> Response {
    Json(node.metrics()).into_response()
}

async fn reset(State(node): State<Arc<Node>>) -> StatusCode {
    node.reset();
    StatusCode::NO_CONTENT
}
