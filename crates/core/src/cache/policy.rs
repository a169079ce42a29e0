//! The `cache` section of the admission gate's policy (documented in
//! `policies/admission-gate.md`). Present means enabled.

use crate::validate::{ensure, Fields, PolicyError, Warning, Warnings};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct CacheDoc {
    max_bytes: Option<u64>,
    max_entries: Option<u64>,
    max_answer_bytes: Option<u64>,
    latest: Option<bool>,
}

/// A worker's cache may hold at most this much (a Wasm VM's memory is at
/// most 4 GiB).
pub const MAX_BYTES_LIMIT: u64 = 1 << 30;
pub const MAX_ENTRIES_LIMIT: u64 = 10_000_000;
/// An answer is read whole before it goes on to the client: larger ones
/// would near Envoy's default buffer limit (1 MiB) per connection.
pub const MAX_ANSWER_BYTES_LIMIT: u64 = 512 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachePolicy {
    /// Bytes each worker's cache holds at most (answers and their
    /// bookkeeping, `ENTRY_OVERHEAD` each).
    pub max_bytes: u64,
    /// Answers each worker's cache holds at most.
    pub max_entries: u64,
    /// Larger answers are not kept.
    pub max_answer_bytes: u64,
    /// Reads at `latest` are answered at the head the gate has just seen
    /// (`cache::head`).
    pub latest: bool,
}

impl CachePolicy {
    pub(crate) fn compile(doc: CacheDoc, f: &mut Fields) -> Result<Self, PolicyError> {
        let max_bytes = f.range(
            "cache.maxBytes",
            doc.max_bytes,
            64 * 1024 * 1024,
            1024,
            MAX_BYTES_LIMIT,
        )?;
        let max_entries = f.range(
            "cache.maxEntries",
            doc.max_entries,
            100_000,
            1,
            MAX_ENTRIES_LIMIT,
        )?;
        let max_answer_bytes = f.range(
            "cache.maxAnswerBytes",
            doc.max_answer_bytes,
            128 * 1024,
            0,
            MAX_ANSWER_BYTES_LIMIT,
        )?;
        ensure(
            max_answer_bytes <= max_bytes,
            "cache.maxAnswerBytes",
            || format!("must be at most cache.maxBytes ({max_bytes}); got {max_answer_bytes}"),
        )?;
        Ok(Self {
            max_bytes,
            max_entries,
            max_answer_bytes,
            latest: f.or("cache.latest", doc.latest, false),
        })
    }

    /// Values that are valid but probably a mistake.
    pub fn warnings(&self) -> Vec<Warning> {
        let mut w = Warnings::default();
        w.when(self.max_bytes > 256 * 1024 * 1024, "cache.maxBytes", || {
            format!(
                "{} bytes per worker: every Envoy worker keeps its own cache, so Envoy's memory grows by this times --concurrency",
                self.max_bytes
            )
        });
        w.0
    }
}
